"""One device run (session 7, issue 14): the Mosaic GPU decode kernel (pallas_kernels/gated_delta_rule/decode_mosaic.py)
beside the Pallas Triton decode kernel, the XLA copy of the pool and FLA's fused_recurrent.

    python benchmarks/gpu/gdn_decode_mosaic.py [--quick] [--budget SECONDS]   (results under $OUT, default /tmp/out)

Steps, each skipped when the deadline (``--budget``, default 60 s from start) would not fit it; a watchdog prints the
table and exits at budget + 10 s whatever is running (a hung kernel cannot cost the rows already measured):
  tests      the GPU-marked tests of tests/pallas_kernels/test_gdn_decode_mosaic.py in a child process (timeout
             ``--test-timeout``): the compiled kernel against the fp32 XLA step and float64 for four configs
             (permuted ids with -1 and S, a fresh stream over a NaN slot, untouched slots bitwise, in place), and
             the layer's fused decode step through ``decode.BACKEND = "mosaic"``. If the child times out with no
             finished test and no kernel call returned (a hang), the Mosaic rows below are skipped.
  numerics   N 64, Qwen3-Next heads (Hk 16, Hv 32, K = V = 128), bf16 q/k/v/beta, fp32 g, pool of S = N + 8 slots
             (ids permuted with -1 and S, a fresh stream over a NaN slot, NaN untouched slots), fused L2 norm: the
             Mosaic kernel (default config) and the Triton kernel against the XLA step in fp32 (matmul precision
             highest): relative RMS of o and of the written slots, untouched slots bitwise, o finite, in place.
  kernel     N 256 and N 64 (Hk 16, Hv 32, K = V = 128, bf16 q/k/v): the XLA copy of the pool (pool * 1.0001, the
             practical floor), the Triton kernel (default DecodeConfig), FLA's fused_recurrent (torch), then the
             Mosaic kernel: the default MosaicDecodeConfig and the variants (value block, ring depth, CTAs per SM)
             and ``copy_only`` (its ring and TMA path alone). Every column timed the same way (jax_gdn.bench_decode:
             groups of 10 back-to-back calls, each feeding its new state to the next, the pool donated in jax, FLA's
             final state as the next initial state; median over 15 groups of the wall time per call, one sync a
             group); FLA's do_bench median beside. GB/s of state bytes (2 N Hv K V 4) and % of 4.8 TB/s.
Writes $OUT/gdn_decode_mosaic.json and $OUT/gdn_decode_mosaic.log; prints a table last.
--quick: the same steps on CPU at tiny sizes (Mosaic GPU and Triton interpret modes, no FLA): a check of this
script, not a measurement.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
import traceback

import script_kit as kit

T0 = time.time()
log = kit.Log()
sys.path.insert(0, kit.REPO)
HBM_GBPS = 4800.0
TEST_FILE = "tests/pallas_kernels/test_gdn_decode_mosaic.py"


def run_tests(res, quick: bool, timeout: float):
    """The GPU tests in a child process (a CUDA error or a hang cannot cost the timings)."""
    args = ["-v", "-s", "-m", "gpu", "-p", "no:randomly", "-p", "no:cacheprovider", TEST_FILE]
    log(f"== GPU tests (timeout {timeout:.0f} s): -m pytest {' '.join(args)}")
    child = kit.run_tests(args, quick=quick, timeout=timeout)     # unbuffered: a killed child keeps its verdicts
    rc, verdicts = child.rc, child.verdicts
    figures = [ln.strip() for ln in child.lines if "FIGURE" in ln]
    fails = child.failures(30)
    for ln in verdicts:
        log("  " + ln.split("::", 1)[1][:200])
    for ln in figures + fails:
        log("  " + ln[:300])
    finished = sum(("PASSED" in v or "FAILED" in v) for v in verdicts)
    ran = sum("FIGURE decode_mosaic" in f for f in figures)      # a kernel call came back: not a hang
    log(f"  tests rc={rc} in {child.seconds:.0f} s, {finished} finished, {ran} kernel calls returned")
    res["tests"] = {"rc": rc, "seconds": round(child.seconds, 1), "verdicts": verdicts, "figures": figures,
                    "failures": fails, "finished": finished, "kernel_calls": ran}
    # a hang is a child that timed out with nothing back; run 2 skipped every Mosaic row on "0 finished" although
    # the kernel had returned (its verdict was still buffered when the child was killed)
    return finished > 0 or ran > 0 or rc != "timeout" or quick


def main():
    ap = kit.arg_parser(__doc__, budget=60.0, test_timeout=16.0,
                        quick_help="CPU smoke run at tiny sizes (interpret modes)")
    args, out, left = kit.parse(ap, T0, cpu_quick=True)
    quick = args.quick
    res = {"quick": quick, "budget_s": args.budget, "numerics": [], "kernel": [], "skipped": [], "errors": []}

    def save():
        kit.save(out, "gdn_decode_mosaic", res, log.lines)

    def table():
        log("\n==== gdn_decode_mosaic (ms; rel = relative RMS against the fp32 XLA step) ====")
        t = res.get("tests")
        if t:
            log(f"GPU tests: rc {t['rc']}, {t['finished']} finished in {t['seconds']} s")
            for v in t["verdicts"]:
                log("  " + v.split("::", 1)[1][:160])
        for r in res["numerics"]:
            log(f"numerics {r['impl']:28s} o {r['o_rel']:.1e} state {r['state_rel']:.1e} untouched "
                f"{r['untouched_same']} finite {r['finite']} in place {r.get('in_place')}")
        log("kernel (one token per stream, fp32 state; wall per call of threaded groups; GB/s of state bytes, "
            f"% of {HBM_GBPS / 1000:.1f} TB/s):")
        for r in res["kernel"]:
            for name, ms in r["ms"].items():
                gbps = r["gbps"].get(name)
                extra = f" {gbps:6d} GB/s {100 * gbps / HBM_GBPS:5.1f}%" if gbps else ""
                log(f"  {r['case']:24s} {name:34s} {ms:8.4f}{extra}")
        if res["skipped"]:
            log("skipped:", res["skipped"])
        if res["errors"]:
            log(f"errors: {len(res['errors'])}")
            for e in res["errors"]:
                log("  " + e[:300])
        log(f"total {time.time() - T0:.0f} s")
        save()

    def watchdog():
        log(f"WATCHDOG: {time.time() - T0:.0f} s, past the budget (a hung kernel?): table so far, exit")
        res["errors"].append("watchdog: budget exceeded")
        table()
        os._exit(3)

    timer = threading.Timer(args.budget + 10, watchdog)
    timer.daemon = True
    timer.start()

    guarded = functools.partial(kit.guarded, left=left, log=log, res=res, save=save)

    mosaic_ok = True
    if not args.no_tests:
        mosaic_ok = guarded("tests", 10, lambda: run_tests(res, quick, min(args.test_timeout, max(left() - 25, 5))))
        mosaic_ok = mosaic_ok is not False
        if not mosaic_ok:
            log("no GPU test finished in the child (a hang?): the Mosaic rows are skipped")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import bench_decode
    from jax_gdn.cases import Case
    from pallas_kernels.gated_delta_rule import decode, decode_mosaic as dm
    from pallas_kernels.gated_delta_rule.api import fused_recurrent_gated_delta_rule_slots

    dev = jax.devices()[0]
    res.update(device=str(getattr(dev, "device_kind", dev.platform)), jax=jax.__version__)
    log(f"device {res['device']} jax {jax.__version__} hopper {dm.is_hopper()}")
    bf = jnp.bfloat16
    MC = dm.MosaicDecodeConfig
    timing = dict(warmup=1, groups=2, per_group=2) if quick else dict(warmup=3, groups=15, per_group=10)
    if quick:
        k256 = Case("quick-N3-Hk1-Hv2", 3, 1, 1, 2, 128, 128)
        k64 = Case("quick-N5-Hk1-Hv2", 5, 1, 1, 2, 128, 128)
        variants = [MC(copy_only=True)]
    else:
        k256 = Case("decode-N256-Hk16-Hv32", 256, 1, 16, 32, 128, 128)
        k64 = Case("decode-N64-Hk16-Hv32", 64, 1, 16, 32, 128, 128)
        variants = [MC(block_v=128, stages=3), MC(stages=6), MC(stages=3, ctas_per_sm=2), MC(copy_only=True),
                    MC(entry="pallas_call"), MC(block_v=128, stages=3, copy_only=True)]

    rel, cfg_name = kit.relative_rms, kit.config_name

    def mosaic_fn(xs, ids, has, cfg):
        return jax.jit(lambda p: dm.fused_recurrent_gated_delta_rule_slots_fwd(
            *xs, scale=None, ssm_state=p, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
            interpret=quick, config=cfg), donate_argnums=0)

    def triton_fn(xs, ids, has):
        return jax.jit(lambda p: decode.fused_recurrent_gated_delta_rule_slots_fwd(
            *xs, scale=None, ssm_state=p, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
            interpret=quick, config=decode.DecodeConfig()), donate_argnums=0)

    # ---- numerics ----
    def numerics(case):
        n = case.B
        s = n + 8
        rng = np.random.default_rng(5)
        q, k, v, g, beta, pool0, _ = bench_decode.make_inputs_np(case)
        ids = rng.permutation(s)[:n].astype(np.int32)
        ids[1], ids[3] = -1, s
        has = np.ones(n, bool)
        has[2] = False
        pool = np.full((s, case.Hv, case.K, case.V), np.nan, np.float32)
        live = ids[(ids >= 0) & (ids < s)]
        pool[live] = pool0[: len(live)]
        pool[ids[2]] = np.nan                                 # fresh stream over a stale slot
        untouched = np.setdiff1d(np.arange(s), ids)
        rnd = lambda x: jnp.asarray(jnp.asarray(x, bf).astype(jnp.float32))
        xs32 = (rnd(q), rnd(k), rnd(v), jnp.asarray(g), rnd(beta))
        with jax.default_matmul_precision("highest"):
            o_ref, p_ref = jax.jit(lambda p: fused_recurrent_gated_delta_rule_slots(
                *xs32, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
                use_qk_l2norm=True, backend="xla"))(jnp.asarray(pool))
        o_ref, p_ref = np.asarray(o_ref, np.float32), np.asarray(p_ref)
        xs = kit.bf16_inputs(xs32)
        runs = [("triton", lambda: triton_fn(xs, jnp.asarray(ids), jnp.asarray(has))),
                ("mosaic default", lambda: mosaic_fn(xs, jnp.asarray(ids), jnp.asarray(has), MC())),
                ("mosaic warpgroup", lambda: mosaic_fn(xs, jnp.asarray(ids), jnp.asarray(has),
                                                       MC(semantics="warpgroup")))]
        # the layer's form: g, beta made inside from raw a, b (b = logit(beta), softplus(a) = -g, A_log = dt_bias = 0)
        r = case.Hv // case.Hk
        b_raw = np.log(np.asarray(xs32[4]) / (1 - np.asarray(xs32[4])))
        a_raw = np.log(np.expm1(-np.asarray(g, np.float64))).astype(np.float32)
        ba = jnp.asarray(np.concatenate([b_raw.reshape(n, 1, case.Hk, r), a_raw.reshape(n, 1, case.Hk, r)], -1))
        gates = decode.RawGates(jnp.zeros((case.Hv,)), jnp.zeros((case.Hv,)), a_offset=r, b_offset=0)
        runs.append(("mosaic raw gates", lambda: jax.jit(lambda p: dm.fused_recurrent_gated_delta_rule_slots_fwd(
            *xs[:3], ba, ba, scale=None, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
            use_qk_l2norm=True, interpret=quick, raw_gates=gates), donate_argnums=0)))
        if not quick:                                         # the second way in (interpret mode cannot run it)
            runs.append(("mosaic pallas_call", lambda: mosaic_fn(xs, jnp.asarray(ids), jnp.asarray(has),
                                                                 MC(entry="pallas_call"))))
        for label, make in runs:
            if label.startswith("mosaic") and not mosaic_ok:
                res["skipped"].append(f"numerics {label}")
                continue
            try:
                pd = jnp.asarray(pool)
                ptr = pd.unsafe_buffer_pointer() if not quick else None
                o, p = make()(pd)
                in_place = (p.unsafe_buffer_pointer() == ptr) if not quick else None
                o, p = np.asarray(o, np.float32), np.asarray(p)
                row = {"case": case.name, "impl": label, "o_rel": rel(o, o_ref), "state_rel": rel(p[live], p_ref[live]),
                       "untouched_same": bool(np.array_equal(p[untouched], pool[untouched], equal_nan=True)),
                       "finite": bool(np.isfinite(o).all()), "in_place": in_place}
                log("numerics", row)
                res["numerics"].append(row)
            except Exception as e:
                res["errors"].append(f"numerics {label}: {type(e).__name__}: {str(e)[:800]}")
                log(f"FAIL numerics {label}: {type(e).__name__}: {str(e)[:800]}")
                traceback.print_exc()

    # ---- timing ----
    def kernel_row(case):
        """The row of one case and its timers (each column timed and stored on call, skipped near the deadline)."""
        host = bench_decode.make_inputs_np(case)
        q, k, v, g, beta, pool, ids = host
        xs = kit.bf16_inputs((q, k, v, g, beta))
        ids_d, has = jnp.asarray(ids), jnp.ones(ids.shape, bool)
        nbytes = bench_decode.state_bytes(case)
        row = {"case": case.name, "N": case.B, "Hk": case.Hk, "Hv": case.Hv, "K": case.K, "V": case.V,
               "state_bytes": nbytes, "ms": {}, "gbps": {}, "pct_hbm": {}}
        res["kernel"].append(row)

        def put(name, ms):
            row["ms"][name] = round(ms, 4)
            row["gbps"][name] = round(nbytes / ms / 1e6)
            row["pct_hbm"][name] = round(100 * nbytes / ms / 1e6 / HBM_GBPS, 1)
            log(f"kernel {case.name} {name}: {ms:.4f} ms ({nbytes / ms / 1e6:.0f} GB/s, "
                f"{row['pct_hbm'][name]}% of HBM)")
            save()

        def attempt(name, fn, need=4):
            if left() < need:
                res["skipped"].append(f"{case.name} {name}")
                log(f"skip {case.name} {name} ({left():.0f} s left)")
                return
            try:
                put(name, fn())
            except Exception as e:
                res["errors"].append(f"{case.name} {name}: {type(e).__name__}: {str(e)[:800]}")
                log(f"FAIL {case.name} {name}: {type(e).__name__}: {str(e)[:800]}")

        def mosaic(cfg):
            if not mosaic_ok:
                res["skipped"].append(f"{case.name} mosaic {cfg_name(cfg)} (child tests hung)")
                return
            attempt(f"mosaic {cfg_name(cfg)}", lambda: bench_decode._time_threaded(
                (lambda f: lambda p: f(p)[1])(mosaic_fn(xs, ids_d, has, cfg)), jnp.asarray(pool), **timing))

        def fla():
            if quick:
                return
            if left() < (35 if not fla_warm else 8):
                res["skipped"].append(f"{case.name} fla")
                return
            try:
                wall, bench = bench_decode.time_fla(case, host), bench_decode.time_fla(case, host, do_bench=True)
                put("fla", wall)
                row["ms"]["fla do_bench"] = round(bench, 4)
                fla_warm.append(1)
            except Exception as e:
                res["errors"].append(f"fla {case.name}: {type(e).__name__}: {str(e)[:400]}")
                log(f"FAIL fla {case.name}: {type(e).__name__}: {str(e)[:300]}")

        return dict(
            copy=lambda label="copy": attempt(label, lambda: bench_decode.time_copy(case, host, **timing)),
            triton=lambda: attempt("triton", lambda: bench_decode._time_threaded(
                (lambda f: lambda p: f(p)[1])(triton_fn(xs, ids_d, has)), jnp.asarray(pool), **timing)),
            mosaic=mosaic, fla=fla)

    big = 0 if quick else 1
    guarded("numerics", 8 * big, lambda: numerics(k64 if not quick else Case("quick-N5", 5, 1, 1, 2, 128, 128)))
    rows = {}
    fla_warm = []

    def base(key, case):                                      # the comparison the issue asks for, first
        rows[key] = r = kernel_row(case)
        r["copy"]()
        r["triton"]()
        r["mosaic"](MC())
        r["mosaic"](MC(semantics="warpgroup"))
    guarded("kernel N256", 10 * big, lambda: base("256", k256))
    guarded("kernel N64", 8 * big, lambda: base("64", k64))
    # the launch variants under the semantics that compiled and ran faster at N256 (lane if neither)
    timed = {sem: ms for sem, ms in (("lane", res["kernel"][0]["ms"].get("mosaic default") if res["kernel"] else None),
                                      ("warpgroup", res["kernel"][0]["ms"].get("mosaic semantics=warpgroup")
                                       if res["kernel"] else None)) if ms}
    sem = min(timed, key=timed.get) if timed else "lane"
    res["variant_semantics"] = sem
    log(f"variants under {sem} semantics (N256 default: {timed})")
    variants = [dataclasses.replace(c, semantics=sem) for c in variants]
    if "256" in rows:                                         # the launch choices, then the rest, FLA last
        guarded("variants N256", 6 * big, lambda: [rows["256"]["mosaic"](c) for c in variants[:3]])
        guarded("more N256", 6 * big, lambda: [rows["256"]["mosaic"](c) for c in variants[3:]])
    if "64" in rows:
        guarded("variants N64", 6 * big, lambda: [rows["64"]["mosaic"](c) for c in variants[:3]])
    for key in ("256", "64"):
        if key in rows:
            guarded(f"copy again N{key}", 3 * big, lambda key=key: rows[key]["copy"]("copy (again)"))
    for key in ("256", "64"):                                 # FLA's first call autotunes ~30 s (run 1)
        if key in rows:
            guarded(f"fla N{key}", 0, rows[key]["fla"])
    timer.cancel()
    table()


if __name__ == "__main__":
    main()
