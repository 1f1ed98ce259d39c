"""One device run (session 8, issue 14): the GDN decode step against the XLA copy of its state bytes; the Mosaic GPU
kernel's launch sweep (pallas_kernels/gated_delta_rule/decode_mosaic.py) beside the Triton kernel (decode.py).

    python benchmarks/gpu/gdn_decode_s8.py [--quick] [--budget SECONDS] [--no-tests] [--run 2]   (under $OUT)

--run 1 (default) is the launch sweep below; --run 2 the second device run's set (``sweep``): the default against
``defer_scalars``, with the layer's raw gates at kernel level too, the ring without registers (copy_only "tma") with
swizzled and plain TMA boxes, the layer step for each, and only the layer / defer / model GPU tests (outputs
gdn_decode_s8_r2.*).

Steps, in this order, each skipped when the deadline (``--budget``, default 120 s from the start) would not fit it;
a watchdog prints the table and exits at budget + 15 s whatever is running:
  build      N 256 and N 64 (Hk 16, Hv 32, K = V = 128; bf16 q, k, v, beta, fp32 g and pool of S = N slots, ids
             shuffled: ``jax_gdn.bench_decode.make_inputs_np``): one jitted step per implementation, ``(pool, ids,
             has) -> (o, pool)`` with the pool donated, compiled by its first call: Triton (the default DecodeConfig),
             Mosaic at each ``sweep`` config (the default, ring depth 5 / 6, the early refill, BV 128, 2 CTAs per
             SM, and ``copy_only``: the ring and TMA path alone, the kernel's ceiling; at N 64 only the default
             ring's ceiling; the kernels of both N are built before the copy_only configs). A config that fails to
             compile or run is reported and left out.
  rounds     3 rounds; each times the XLA copy of the pool (``bench_decode.time_copy``) and every step with the
             bench's timer (``bench_decode._time_threaded``: groups of 10 back-to-back calls threading the donated
             pool, one sync a group, the median over 15 groups of the wall time per call), the order rotated by a
             third each round, so every implementation is measured 3 times in different positions. Round 1 runs
             first for both N, then numerics, then rounds 2 and 3.
  numerics   each compiled step, the same executable as timed, on a poisoned call: ids 1 and 3 set to -1 and S
             (their slots untouched, NaN), stream 2 fresh over a NaN slot; against the XLA step in fp32 on the
             bf16-rounded inputs (matmul precision highest): relative RMS of o (bf16) and of the written slots,
             untouched slots bitwise, o finite, the pool updated in place (same buffer). copy_only configs: the
             written slots bitwise as loaded, o zero.
  layer      ``gdn_layer_decode`` (the fused step: conv kernel, then the decode kernel with raw gates) at
             Qwen3-Next-80B GDN dims, N 64 over S 72 slots (a padding stream id S, a fresh stream, NaN untouched
             slots), bf16: ``decode.BACKEND = "mosaic"`` against "triton" (o, ssm and conv states), the Mosaic kernel
             seen running; then both steps timed (slots donated, threaded).
  tests      last, in a child process (-v, unbuffered, timeout what is left): the GPU tests of
             tests/pallas_kernels/test_gdn_decode_mosaic.py but the pallas_call entry's (it fails to lower on the
             GPU's jax, session 7).
Writes $OUT/gdn_decode_s8.json, $OUT/gdn_decode_s8.log and $OUT/gdn_decode_s8_tests.log; prints a table last.
--quick: the same steps on the CPU at tiny sizes (Mosaic GPU and Triton interpret modes): a check of this script,
not a measurement.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import threading
import time
import traceback

import script_kit as kit

T0 = time.time()
log = kit.Log()
sys.path.insert(0, kit.REPO)
NAME = "gdn_decode_s8"
HBM_GBPS = 4800.0
TEST_FILE = "tests/pallas_kernels/test_gdn_decode_mosaic.py"
ROUNDS = 3
#: seconds each step keeps back for what comes after it: the layer step (RESERVE_LAYER), then at least KEEP[step]
#: for the GPU tests (the timing comes first: rounds 2 and 3 leave the tests 20 s, round 1 and the builds less)
RESERVE_LAYER = 14.0
KEEP = dict(build=20.0, round1=8.0, numerics=8.0, rounds=20.0, layer=6.0)


def sweep(MC, run: int):
    """(label, kind, config, raw gates) of each step timed, Triton first, then Mosaic (the default first); labels
    starting "copy_only" are the ring's ceilings (built last). Run 1: the launch sweep; run 2 (after run 1 put the
    ring alone at 0.31 ms and the layer step through Mosaic 0.023 ms behind Triton's): the scalars deferred, the raw
    gates at kernel level, the ring without registers and with plain (unswizzled) TMA boxes."""
    if run == 1:
        return [("triton", "triton", None, False)] + [(lb, "mosaic", c, False) for lb, c in [
            ("mosaic", MC()),
            ("mosaic s5", MC(stages=5)),
            ("mosaic s6", MC(stages=6)),
            ("mosaic s4 early", MC(refill="early")),
            ("mosaic s6 early", MC(stages=6, refill="early")),
            ("mosaic bv128 s3", MC(block_v=128, stages=3)),
            ("mosaic s3 cta2", MC(stages=3, ctas_per_sm=2)),
            ("copy_only s4", MC(copy_only=True)),
            ("copy_only s6", MC(stages=6, copy_only=True)),
            ("copy_only bv128 s3", MC(block_v=128, stages=3, copy_only=True)),
            ("copy_only s3 cta2", MC(stages=3, ctas_per_sm=2, copy_only=True))]]
    return [("triton", "triton", None, False),
            ("mosaic", "mosaic", MC(), False),
            ("mosaic defer", "mosaic", MC(defer_scalars=True), False),
            ("triton raw", "triton", None, True),
            ("mosaic raw", "mosaic", MC(), True),
            ("mosaic defer raw", "mosaic", MC(defer_scalars=True), True),
            ("copy_only s4", "mosaic", MC(copy_only=True), False),
            ("copy_only tma", "mosaic", MC(copy_only="tma"), False),
            ("copy_only tma plain", "mosaic", MC(copy_only="tma", swizzle=False), False),
            ("copy_only tma plain s6", "mosaic", MC(stages=6, copy_only="tma", swizzle=False), False),
            ("copy_only tma plain bv128 s3", "mosaic", MC(block_v=128, stages=3, copy_only="tma", swizzle=False),
             False)]


#: the ring's ceilings also timed at the second N (the others at the first only)
SECOND_N_CEILINGS = ("copy_only s4", "copy_only tma plain")


def layer_variants(MC, run: int):
    """(label, decode.BACKEND, decode_mosaic.DEFAULT_CONFIG) of the layer steps compared (Triton's first)."""
    out = [("triton", "triton", None), ("mosaic", "mosaic", MC())]
    return out + ([("mosaic defer", "mosaic", MC(defer_scalars=True))] if run == 2 else [])


def verdicts(lines):
    """{test id: verdict} from pytest -v -s output, where a test's prints may push its verdict to a later line."""
    out, current = {}, None
    for ln in lines:
        if "::" in ln:
            current = ln.split()[0]
        words = ln.split()
        for w in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            if current and w in words:
                out[current] = w
    return out


def main():
    ap = kit.arg_parser(__doc__, budget=120.0, test_timeout=60.0,
                        quick_help="CPU smoke run at tiny sizes (interpret modes)")
    ap.add_argument("--run", type=int, default=1, choices=(1, 2), help="which sweep (see sweep())")
    args, out, left = kit.parse(ap, T0, cpu_quick=True)
    name = NAME if args.run == 1 else f"{NAME}_r{args.run}"
    quick = args.quick
    res = {"quick": quick, "budget_s": args.budget, "configs": {}, "kernel": {}, "numerics": [], "layer": {},
           "compile_s": {}, "skipped": [], "errors": []}

    def save():
        kit.save(out, name, res, log.lines)

    def table():
        log(f"\n==== {name} (ms per call, median of 15 groups of 10 threaded calls; rounds in time order) ====")
        for case, rows in res["kernel"].items():
            copy = rows.get("copy", {}).get("median")
            log(f"{case}  (state bytes {res['state_bytes'][case] / 1e9:.3f} GB; x copy = time / the copy's median)")
            log(f"  {'impl':22s} {'r1':>8s} {'r2':>8s} {'r3':>8s} {'median':>8s} {'GB/s':>6s} {'%HBM':>5s} "
                f"{'x copy':>6s} {'<tri':>4s}  numerics")
            for label, r in rows.items():
                ms = "".join(f"{t:8.4f} " if t is not None else "       - " for t in
                             (r["rounds"] + [None] * ROUNDS)[:ROUNDS])
                med = r.get("median")
                num = next((x for x in res["numerics"] if x["case"] == case and x["impl"] == label), None)
                ntxt = "" if num is None else (
                    f"o {num['o_rel']:.1e} state {num['state_rel']:.1e} untouched {num['untouched_same']} "
                    f"in place {num['in_place']} ok {num['ok']}")
                if med is None:
                    log(f"  {label:22s} {ms}{'-':>8s}  {ntxt}")
                    continue
                gbps = res["state_bytes"][case] / med / 1e6
                xc = f"{med / copy:6.3f}" if copy else "     -"
                tri = rows.get("triton raw" if label.endswith(" raw") else "triton", {}).get("rounds", [])
                wins = (f"{sum(m < t for m, t in zip(r['rounds'], tri))}/{min(len(tri), len(r['rounds']))}"
                        if label.startswith("mosaic") else "")
                r["faster_than_triton_rounds"] = wins
                log(f"  {label:22s} {ms}{med:8.4f} {gbps:6.0f} {100 * gbps / HBM_GBPS:5.1f} {xc} {wins:>4s}  {ntxt}")
            best = min(((r["median"], label) for label, r in rows.items()
                        if label.startswith("mosaic") and r.get("median")), default=None)
            if best:
                log(f"  fastest mosaic config: {best[1]} {best[0]:.4f}")
        lay = res["layer"]
        if lay:
            log(f"layer (gdn_layer_decode, fused step, raw gates inside; N {lay.get('N')} over S {lay.get('S')}): "
                "ms of 2 rounds; numerics against the Triton step")
            for label, v in lay.get("variants", {}).items():
                num = "" if "o_rel" not in v else (
                    f"o {v['o_rel']:.1e} ssm {v['ssm_rel']:.1e} conv equal {v['conv_equal']} untouched "
                    f"{v['untouched_same']} mosaic ran {v['mosaic_calls']} ok {v['ok']}")
                log(f"  {label:22s} {str(v.get('ms')):24s} {num}")
        t = res.get("tests")
        if t:
            found = t.get("by_test", {})
            log(f"GPU tests rc={t['rc']} in {t['seconds']} s: {sum(v == 'PASSED' for v in found.values())} passed, "
                f"{sum(v in ('FAILED', 'ERROR') for v in found.values())} failed of {len(found)} with a verdict")
            for tid, v in found.items():
                log(f"  {tid.split('::', 1)[-1][:150]} {v}")
            for f in t["failures"][:10]:
                log("  " + f[:200])
        if res["skipped"]:
            log("skipped:", res["skipped"])
        if res["errors"]:
            log(f"errors: {len(res['errors'])}")
            for e in res["errors"]:
                log("  " + e[:300])
        log(f"total {time.time() - T0:.0f} s (budget {args.budget:.0f} s)")
        save()

    def watchdog():
        log(f"WATCHDOG: {time.time() - T0:.0f} s, past the budget (a hung kernel?): table so far, exit")
        res["errors"].append("watchdog: budget exceeded")
        table()
        os._exit(3)

    timer = threading.Timer(args.budget + 15, watchdog)
    timer.daemon = True
    timer.start()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import bench_decode
    from jax_gdn.cases import Case
    from pallas_kernels.gated_delta_rule import decode, decode_mosaic as dm
    from pallas_kernels.gated_delta_rule.api import fused_recurrent_gated_delta_rule_slots

    dev = jax.devices()[0]
    res.update(device=str(getattr(dev, "device_kind", dev.platform)), jax=jax.__version__, hopper=dm.is_hopper())
    log(f"device {res['device']} jax {jax.__version__} hopper {res['hopper']} ({left.elapsed():.0f} s)")
    MC = dm.MosaicDecodeConfig
    configs = sweep(MC, args.run)
    if quick:
        keep = ("triton", "mosaic", "mosaic s4 early", "copy_only s4", "mosaic defer raw", "triton raw",
                "copy_only tma plain")
        configs = [c for c in configs if c[0] in keep]
        cases = [Case("quick-N4-Hk1-Hv2", 4, 1, 1, 2, 128, 128), Case("quick-N6-Hk1-Hv2", 6, 1, 1, 2, 128, 128)]
        timing = dict(warmup=1, groups=2, per_group=2)
    else:
        cases = [Case("decode-N256-Hk16-Hv32", 256, 1, 16, 32, 128, 128),
                 Case("decode-N64-Hk16-Hv32", 64, 1, 16, 32, 128, 128)]
        timing = dict(warmup=3, groups=15, per_group=10)
    res["run"] = args.run
    res["configs"] = {label: dict(kind=kind, raw_gates=raw, **(dataclasses.asdict(cfg) if cfg else {}))
                      for label, kind, cfg, raw in configs}
    res["state_bytes"] = {c.name: bench_decode.state_bytes(c) for c in cases}
    res["timing"] = timing
    guarded = lambda label, need, fn: kit.guarded(label, need, fn, left=left, log=log, res=res, save=save)

    def raw_gate_inputs(xs, case):
        """The layer's form of the gates: raw a, b in Qwen3-Next's [b (r) | a (r)] per key head with A_log = dt_bias
        = 0, b = logit(beta), softplus(a) = -g (the same g and beta up to fp32 rounding)."""
        n, r = case.B, case.Hv // case.Hk
        beta = np.asarray(xs[4].astype(jnp.float32), np.float64)
        b_raw = np.log(beta / (1 - beta)).astype(np.float32)
        a_raw = np.log(np.expm1(-np.asarray(xs[3], np.float64))).astype(np.float32)
        ba = jnp.asarray(np.concatenate([b_raw.reshape(n, 1, case.Hk, r), a_raw.reshape(n, 1, case.Hk, r)], -1))
        return ba, decode.RawGates(jnp.zeros((case.Hv,)), jnp.zeros((case.Hv,)), a_offset=r, b_offset=0)

    def step_fn(xs, kind, cfg=None, raw=None):
        """jit((pool, ids, has) -> (o, pool)), the pool donated: one executable for timing and numerics. raw: None
        or (ba, RawGates): the gates made inside from the raw projections."""
        args, gates = (xs, None) if raw is None else (tuple(xs[:3]) + (raw[0], raw[0]), raw[1])

        def run(pool, ids, has):
            if kind == "triton":
                return decode.fused_recurrent_gated_delta_rule_slots_fwd(
                    *args, scale=None, ssm_state=pool, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
                    interpret=quick, config=decode.DecodeConfig(), raw_gates=gates)
            return dm.fused_recurrent_gated_delta_rule_slots_fwd(
                *args, scale=None, ssm_state=pool, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
                interpret=quick, config=cfg, raw_gates=gates)
        return jax.jit(run, donate_argnums=0)

    # ---- build: inputs and one compiled step per implementation ----
    state = {}

    def build(case, ceilings: bool):
        """The case's inputs and steps: the kernels (``ceilings`` False), then the copy_only configs (True: built
        after every case's kernels, so a ring that never ran on a GPU before cannot cost the others' builds)."""
        if case.name not in state:
            t = time.time()
            host = bench_decode.make_inputs_np(case)
            xs = kit.bf16_inputs(host[:5])
            ids_d, has_d = jnp.asarray(host[6]), jnp.ones(host[6].shape, bool)
            state[case.name] = dict(case=case, host=host, xs=xs, ids=ids_d, has=has_d, fns={},
                                    pool=jnp.asarray(host[5]), raw=raw_gate_inputs(xs, case))
            res["kernel"][case.name] = {"copy": {"rounds": []}}
            log(f"{case.name}: inputs {time.time() - t:.1f} s")
        st = state[case.name]
        todo = [x for x in configs if x[0].startswith("copy_only") == ceilings]
        if case is not cases[0]:                                # most ring ceilings at the first (largest) N only
            todo = [x for x in todo if not x[0].startswith("copy_only") or x[0] in SECOND_N_CEILINGS]
        for label, kind, cfg, raw in todo:
            if left() < RESERVE_LAYER + KEEP["build"]:
                res["skipped"].append(f"{case.name} build {label}")
                continue
            t = time.time()
            try:
                fn = step_fn(st["xs"], kind, cfg, st["raw"] if raw else None)
                jax.block_until_ready(fn(jnp.array(st["pool"], copy=True), st["ids"], st["has"]))
                st["fns"][label] = fn
                res["kernel"][case.name][label] = {"rounds": []}
                res["compile_s"][f"{case.name} {label}"] = round(time.time() - t, 2)
                log(f"  built {case.name} {label} ({time.time() - t:.1f} s, {left():.0f} s left)")
            except Exception as e:                          # report and go on without it
                res["errors"].append(f"build {case.name} {label}: {type(e).__name__}: {str(e)[:800]}")
                log(f"  FAIL build {case.name} {label}: {type(e).__name__}: {str(e)[:600]}")
                traceback.print_exc()
        save()

    # ---- one timing round: every implementation once, the order rotated ----
    def one_round(r, case_name, need):
        st = state[case_name]
        case, host = st["case"], st["host"]
        labels = ["copy"] + list(st["fns"])
        shift = (r * len(labels)) // ROUNDS
        for label in labels[shift:] + labels[:shift]:
            if left() < need:
                res["skipped"].append(f"{case_name} round {r + 1} {label}")
                continue
            row = res["kernel"][case_name][label]
            try:
                if label == "copy":
                    ms = bench_decode.time_copy(case, host, **timing)
                else:
                    fn, ids, has = st["fns"][label], st["ids"], st["has"]
                    ms = bench_decode._time_threaded(lambda p: fn(p, ids, has)[1], jnp.array(st["pool"], copy=True),
                                                     **timing)
                row["rounds"].append(round(ms, 4))
                row["median"] = round(statistics.median(row["rounds"]), 4)
                log(f"  round {r + 1} {case_name} {label:22s} {ms:8.4f} ms ({left():.0f} s left)")
            except Exception as e:
                res["errors"].append(f"round {r + 1} {case_name} {label}: {type(e).__name__}: {str(e)[:400]}")
                log(f"  FAIL round {r + 1} {case_name} {label}: {type(e).__name__}: {str(e)[:400]}")
        save()

    # ---- numerics: the timed executables on a poisoned call ----
    def rel_dev(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.sqrt(jnp.sum((a - b) ** 2) / jnp.maximum(jnp.sum(b * b), 1e-30)))

    def numerics(case_name):
        st = state[case_name]
        case = st["case"]
        q, k, v, g, beta, pool0, perm = st["host"]
        n = s = case.B
        ids = perm.copy()
        ids[1], ids[3] = -1, s
        has = np.ones(n, bool)
        has[2] = False
        pool = pool0.copy()
        untouched = np.setdiff1d(np.arange(s), ids)            # the slots ids 1 and 3 named before
        pool[untouched] = np.nan
        pool[ids[2]] = np.nan                                    # a fresh stream over a stale slot
        written = ids[(ids >= 0) & (ids < s)]
        xs32 = tuple(x.astype(jnp.float32) for x in st["xs"])   # the bf16-rounded inputs in fp32
        ids_d, has_d = jnp.asarray(ids), jnp.asarray(has)
        keep = jnp.asarray(pool)                                 # never donated
        w_d, u_d = jnp.asarray(written), jnp.asarray(untouched)
        with jax.default_matmul_precision("highest"):
            o_ref, p_ref = jax.jit(lambda p, i, h: fused_recurrent_gated_delta_rule_slots(
                *xs32, ssm_state=p, slot_ids=i, has_initial_state=h, use_qk_l2norm=True, backend="xla"))(
                    jnp.asarray(pool), ids_d, has_d)
        p_ref_w = p_ref[w_d]
        del p_ref
        for label, fn in st["fns"].items():
            if left() < RESERVE_LAYER + KEEP["numerics"]:
                res["skipped"].append(f"numerics {case_name} {label}")
                continue
            try:
                pd = jnp.array(keep, copy=True)
                ptr = pd.unsafe_buffer_pointer()
                o, p = fn(pd, ids_d, has_d)
                in_place = bool(p.unsafe_buffer_pointer() == ptr)
                untouched_same = bool(jnp.array_equal(p[u_d], keep[u_d], equal_nan=True))
                finite = bool(jnp.isfinite(o.astype(jnp.float32)).all())
                if label.startswith("copy_only"):
                    o_rel = float(jnp.max(jnp.abs(o.astype(jnp.float32))))    # o is zero
                    state_rel = 0.0 if bool(jnp.array_equal(p[w_d], keep[w_d], equal_nan=True)) else 1.0
                    ok = o_rel == 0 and state_rel == 0 and untouched_same and in_place
                else:
                    o_rel, state_rel = rel_dev(o, o_ref), rel_dev(p[w_d], p_ref_w)
                    ok = o_rel < 1e-2 and state_rel < 1e-5 and untouched_same and finite and in_place
                row = {"case": case_name, "impl": label, "o_rel": o_rel, "state_rel": state_rel,
                       "untouched_same": untouched_same, "finite": finite, "in_place": in_place, "ok": bool(ok)}
                log(f"  numerics {case_name} {label:22s} o {o_rel:.2e} state {state_rel:.2e} untouched "
                    f"{untouched_same} finite {finite} in place {in_place} -> {'ok' if ok else 'FAILED'}")
                res["numerics"].append(row)
                del o, p
            except Exception as e:
                res["errors"].append(f"numerics {case_name} {label}: {type(e).__name__}: {str(e)[:600]}")
                log(f"  FAIL numerics {case_name} {label}: {type(e).__name__}: {str(e)[:600]}")
                traceback.print_exc()
        save()

    # ---- the layer's decode step through decode.BACKEND ----
    def layer():
        from jax_gdn.config import GdnDims
        from jax_gdn.layers import gdn
        from jax_gdn.state import GdnSlots
        if quick:
            dims, n, s, dt, kb = GdnDims(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=128,
                                         head_v_dim=128), 3, 5, jnp.float32, "pallas_interpret"
        else:
            from jax_gdn.bench_model import qwen3_next_80b_config
            dims, n, s, dt, kb = qwen3_next_80b_config(4).gdn_dims, 64, 72, jnp.bfloat16, "pallas"
        lay = res["layer"]
        lay.update(dims=str(dims), N=n, S=s)
        params = gdn.init_params(dims, jax.random.PRNGKey(0), dt, randomize_norms=True)
        rng = np.random.default_rng(3)
        ids = rng.permutation(s)[:n].astype(np.int32)
        ids[1] = s                                              # a padding stream: reads zeros, writes nothing
        has = np.ones(n, bool)
        has[2] = False
        untouched = np.setdiff1d(np.arange(s), ids)
        ssm = (0.3 * rng.standard_normal((s, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim))).astype(np.float32)
        ssm[untouched] = np.nan
        slots = GdnSlots(conv_state=jnp.asarray(rng.standard_normal((s, dims.conv_dim, dims.conv_kernel_size - 1)),
                                                dt), ssm_state=jnp.asarray(ssm))
        hidden = jnp.asarray(rng.standard_normal((n, dims.hidden_size)), dt)
        ids_d, has_d = jnp.asarray(ids), jnp.asarray(has)
        calls = []
        real = dm.fused_recurrent_slots_mosaic
        dm.fused_recurrent_slots_mosaic = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        saved = decode.BACKEND, dm.DEFAULT_CONFIG
        variants = layer_variants(MC, args.run)
        lay["variants"] = {}

        def make():                                             # traced on its first call (BACKEND then)
            return jax.jit(lambda p, x, sl, i, h: gdn.gdn_layer_decode(p, dims, x, sl, i, h, backend=kb,
                                                                       step="fused"), donate_argnums=2)

        def fresh():
            return GdnSlots(conv_state=jnp.array(slots.conv_state), ssm_state=jnp.array(slots.ssm_state))
        fns = {}

        def use(backend, cfg):
            decode.BACKEND = backend
            dm.DEFAULT_CONFIG = cfg or saved[1]
        try:
            w = jnp.asarray(ids[(ids >= 0) & (ids < s)])
            u = jnp.asarray(untouched)
            ref_o = ref_s = None
            for label, backend, cfg in variants:                 # one step each, against the first (Triton's)
                use(backend, cfg)
                del calls[:]
                fns[label] = make()                              # one executable per variant, timed below too
                o, sl = fns[label](params, hidden, fresh(), ids_d, has_d)
                if ref_o is None:
                    ref_o, ref_s = o, sl
                    continue
                v = lay["variants"][label] = {"config": str(cfg)}
                v["mosaic_calls"] = len(calls)
                v["o_rel"] = rel_dev(o, ref_o)
                v["ssm_rel"] = rel_dev(sl.ssm_state[w], ref_s.ssm_state[w])
                v["conv_equal"] = bool(jnp.array_equal(sl.conv_state, ref_s.conv_state))
                v["untouched_same"] = bool(jnp.array_equal(sl.ssm_state[u], slots.ssm_state[u], equal_nan=True))
                v["finite"] = bool(jnp.isfinite(o.astype(jnp.float32)).all())
                v["ok"] = bool(len(calls) > 0 and v["o_rel"] < 2e-2 and v["ssm_rel"] < 1e-4 and v["conv_equal"]
                               and v["untouched_same"] and v["finite"])
                log(f"  layer {label} vs triton: o {v['o_rel']:.2e} ssm {v['ssm_rel']:.2e} conv equal "
                    f"{v['conv_equal']} untouched {v['untouched_same']} finite {v['finite']} mosaic ran "
                    f"{len(calls)} -> {'ok' if v['ok'] else 'FAILED'}")
            save()
            for rnd in range(2):                                 # the layer steps, slots donated and threaded
                for label, backend, cfg in variants:
                    if left() < KEEP["layer"] + 3:
                        res["skipped"].append(f"layer timing {label} round {rnd + 1}")
                        continue
                    use(backend, cfg)
                    fn = fns[label]
                    ms = bench_decode._time_threaded(lambda sl: fn(params, hidden, sl, ids_d, has_d)[1], fresh(),
                                                     **timing)
                    lay["variants"].setdefault(label, {}).setdefault("ms", []).append(round(ms, 4))
                    log(f"  layer step {label} round {rnd + 1}: {ms:.4f} ms")
        finally:
            decode.BACKEND, dm.DEFAULT_CONFIG = saved
            dm.fused_recurrent_slots_mosaic = real

    # ---- the run ----
    for ceilings in (False, True):
        for case in cases:
            guarded(f"build {case.name}{' ceilings' if ceilings else ''}", RESERVE_LAYER + KEEP["build"] + 5,
                    lambda case=case, c=ceilings: build(case, c))
    need = RESERVE_LAYER + KEEP["round1"]
    for case in cases:
        if case.name in state:
            guarded(f"round 1 {case.name}", need + 1, lambda c=case.name: one_round(0, c, need))
    for case in cases:
        if case.name in state:
            guarded(f"numerics {case.name}", RESERVE_LAYER + KEEP["numerics"] + 1, lambda c=case.name: numerics(c))
    need = RESERVE_LAYER + KEEP["rounds"]
    for r in range(1, ROUNDS):
        for case in cases:
            if case.name in state:
                guarded(f"round {r + 1} {case.name}", need + 1, lambda r=r, c=case.name: one_round(r, c, need))
    guarded("layer", KEEP["layer"] + 8, layer)
    state.clear()                                               # the pools go before the child takes the GPU
    if not args.no_tests:
        def tests():
            pytest_args = ["-v", "-s", "-m", "gpu", "-p", "no:randomly", "-p", "no:cacheprovider", TEST_FILE,
                           "--deselect", TEST_FILE + "::test_gpu_kernel_variants_match_xla_step[pallas-call]"]
            if args.run == 2:                                   # run 1 passed the others
                pytest_args += ["-k", "layer or defer or model"]
            t = max(min(args.test_timeout, left() - 3), 5)
            log(f"== GPU tests (timeout {t:.0f} s): -m pytest {' '.join(pytest_args)}")
            child = kit.run_tests(pytest_args, quick=quick, timeout=t,
                                  log_path=os.path.join(out, f"{name}_tests.log"))
            child.record(res, log)
            res["tests"]["by_test"] = found = verdicts(child.lines)    # -s can push a verdict to a later line
            log(f"  verdicts: {sum(v == 'PASSED' for v in found.values())} passed, "
                f"{sum(v in ('FAILED', 'ERROR') for v in found.values())} failed of {len(found)}")
            for ln in child.lines:
                if "FIGURE" in ln:
                    log("  " + ln.strip()[:300])
        guarded("tests", 6, tests)
    timer.cancel()
    table()


if __name__ == "__main__":
    main()
