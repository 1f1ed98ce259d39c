"""One device run (session 6, issues 14 and 9): the GDN decode kernel at HBM speed and the layer's fused decode step.

    python benchmarks/gpu/gdn_decode_s6.py [--quick] [--budget SECONDS]     (results under $OUT, default /tmp/out)

Steps (numerics kernel, numerics layer, layer step, kernel N256, kernel N64), each skipped when the deadline (``--budget``, default 100 s from start) would not fit it:
  numerics kernel   N 64, Qwen3-Next heads (Hk 16, Hv 32, K = V = 128), bf16 q/k/v/beta, fp32 g and pool of S = N + 8
                    slots (ids permuted, two fresh streams over NaN-stale slots, untouched NaN slots), fused L2 norm:
                    the decode kernel (default DecodeConfig and each load hint) against the XLA step in fp32
                    (matmul precision highest): relative RMS of o and of the written slots, untouched slots NaN.
                    Then the raw-gates form (g, beta made inside from a, b, A_log, dt_bias) against the same.
  numerics layer    one GDN layer at Qwen3-Next-80B dims (bf16 params and activations), N 64 streams with 2
                    padding streams (slot id S), a fresh stream over a NaN-stale slot, NaN untouched slots: the
                    unfused step (today's: XLA phase 1 + decode kernel) and the fused step (in_proj, conv1d decode
                    kernel, decode kernel with gates inside, phase 3) against the unfused step with the XLA
                    backend in fp32 (highest): relative RMS of the output, the ssm and conv states written; then
                    the fused step in fp32 (highest) against the same (the 1e-5 check).
  kernel N256/N64   one token for N streams: the decode kernel (default, then load hints and BV 128 / 8 warps),
                    the XLA copy of the pool (pool * 1.0001: the practical floor), FLA's fused_recurrent (torch):
                    all timed the same way, groups of 10 back-to-back calls each feeding its new state to the next
                    (the pool donated in jax; FLA's final state as the next initial state), median over 15 groups
                    of the wall time per call closed by one sync; FLA also by triton do_bench (median) beside.
                    Beside them a Pallas Triton copy of the pool with the decode kernel's grid, slot lookup and
                    [K, BV] blocks but no arithmetic ("pallas copy"): if it is as slow as the kernel, the gap to
                    the XLA copy is the launch shape / load-store path, not the arithmetic.
  layer step        gdn_layer_decode for 64 streams at 80B dims (bf16), unfused and fused: bench_model's in-program
                    time (R steps in one compiled loop, (2 programs - 1 program) / R) and its pipelined time, the
                    floor (bench_model.decode_floors "gdn_decode"), and a kernel table of each under jax.profiler
                    (benchmarks/gpu/trace_events.py).
Writes $OUT/gdn_decode_s6.json and $OUT/gdn_decode_s6.log; prints a table last.
--quick: the same steps on CPU at tiny sizes in interpret mode (a check of this script, not a measurement).
--steps: only the steps whose labels start with one of the given prefixes; --two-pass-only: the kernel sweeps run
the default and the two-pass variants (DecodeConfig.row_block) only, no FLA (the second run's form).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

T0 = time.time()
LOG = []
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))          # the repo
sys.path.insert(0, HERE)                                             # trace_events


def log(*a):
    line = " ".join(str(x) for x in a)
    LOG.append(line)
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=100.0)
    ap.add_argument("--steps", default="", help="comma-separated step labels (prefixes) to run only those, e.g. "
                    "'numerics kernel,kernel N256'; default all")
    ap.add_argument("--two-pass-only", action="store_true", help="kernel sweeps: only the default and the "
                    "two-pass variants (DecodeConfig.row_block), with the XLA / Pallas copies beside")
    args = ap.parse_args()
    only = [x.strip() for x in args.steps.split(",") if x.strip()]
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    quick = args.quick
    if quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    left = lambda: args.budget - (time.time() - T0)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import bench_decode, bench_model
    from jax_gdn.cases import Case
    from jax_gdn.layers import gdn
    from jax_gdn.state import GdnSlots
    from pallas_kernels.gated_delta_rule import decode
    from pallas_kernels.gated_delta_rule.api import fused_recurrent_gated_delta_rule_slots

    dev = jax.devices()[0]
    res = {"device": str(getattr(dev, "device_kind", dev.platform)), "jax": jax.__version__, "quick": quick,
           "numerics": [], "kernel": [], "layer": {}, "skipped": [], "errors": []}
    log(f"device {res['device']} jax {jax.__version__}")
    interpret = quick
    bf = jnp.bfloat16
    DC = decode.DecodeConfig
    timing = dict(warmup=1, groups=2, per_group=2) if quick else dict(warmup=3, groups=15, per_group=10)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))

    def save():
        with open(os.path.join(out, "gdn_decode_s6.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(out, "gdn_decode_s6.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")

    def guarded(label, need, fn):
        if only and not any(label.startswith(x) for x in only):
            return None
        if left() < need:
            res["skipped"].append(label)
            log(f"skip {label} ({left():.0f} s left, needs ~{need})")
            return None
        t = time.time()
        try:
            return fn()
        except Exception as e:                                # report and go on
            res["errors"].append(f"{label}: {type(e).__name__}: {str(e)[:600]}")
            log(f"FAIL {label}: {type(e).__name__}: {str(e)[:600]}")
            traceback.print_exc()
            return None
        finally:
            log(f"  ({label}: {time.time() - t:.1f} s)")
            save()

    def cfg_name(c):
        if c is None:
            return "default"
        return ",".join(f"{f.name}={getattr(c, f.name)}" for f in dataclasses.fields(c)
                        if getattr(c, f.name) != f.default) or "default"

    # ---- cases ----
    if quick:
        k256, k64 = Case("quick-N6-Hk1-Hv2", 6, 1, 1, 2, 16, 16), Case("quick-N4-Hk1-Hv2", 4, 1, 1, 2, 16, 16)
        config = bench_model.tiny_config(4)
        n_layer = 6
        hint_cfgs = [DC(load_hint="evict_first", block_v=16)]
        copy_shapes = [(16, 2, False), (16, 2, True)]
        n64_cfgs = [DC(block_v=16, num_warps=1)]
        two_pass = [DC(block_v=16, row_block=8)]
    else:
        k256 = Case("decode-N256-Hk16-Hv32", 256, 1, 16, 32, 128, 128)
        k64 = Case("decode-N64-Hk16-Hv32", 64, 1, 16, 32, 128, 128)
        config = bench_model.qwen3_next_80b_config(4)
        n_layer = 64
        hint_cfgs = [DC(load_hint="masked"), DC(load_hint="evict_first"), DC(num_warps=4, load_hint="evict_first"),
                     DC(block_v=128, num_warps=8, load_hint="evict_first")]
        copy_shapes = [(64, 2, False), (64, 2, True), (128, 4, False)]
        # N 64: 4096 programs of the default shape are ~5.2 waves of ~790 resident: other block sizes change that
        n64_cfgs = [DC(load_hint="evict_first"), DC(block_v=32, num_warps=1), DC(block_v=32, num_warps=2),
                    DC(block_v=128, num_warps=8)]
        # two-pass (row_block): S^T k / S^T q over [R, BV] chunks, then each chunk re-read, updated and stored
        # (num_stages 3: Triton software-pipelines the chunk loads of the two loops)
        two_pass = [DC(row_block=16), DC(row_block=32), DC(row_block=16, num_stages=3),
                    DC(row_block=32, num_warps=4, num_stages=3), DC(block_v=128, num_warps=4, row_block=16),
                    DC(block_v=32, num_warps=1, row_block=32)]
    hint_cfgs = (hint_cfgs if not args.two_pass_only else []) + two_pass
    n64_cfgs = (n64_cfgs if not args.two_pass_only else []) + two_pass[:3]
    if args.two_pass_only:
        copy_shapes = copy_shapes[:1]
    dims = config.gdn_dims

    # ---- numerics: the kernel against the XLA step ----
    def kernel_numerics(case):
        n = case.B
        s = n + 8
        rng = np.random.default_rng(5)
        q, k, v, g, beta, pool0, _ = bench_decode.make_inputs_np(case)
        ids = rng.permutation(s)[:n].astype(np.int32)
        has = np.ones(n, bool)
        has[[1, n - 1]] = False
        pool = np.full((s, case.Hv, case.K, case.V), np.nan, np.float32)
        pool[ids[has]] = pool0[has]
        rnd = lambda x: jnp.asarray(jnp.asarray(x, bf).astype(jnp.float32))
        xs32 = (rnd(q), rnd(k), rnd(v), jnp.asarray(g), rnd(beta))
        with jax.default_matmul_precision("highest"):
            o_ref, p_ref = jax.jit(lambda p: fused_recurrent_gated_delta_rule_slots(
                *xs32, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
                use_qk_l2norm=True, backend="xla"))(jnp.asarray(pool))
        o_ref, p_ref = np.asarray(o_ref, np.float32), np.asarray(p_ref)
        untouched = np.setdiff1d(np.arange(s), ids)
        xs = tuple(x.astype(bf) if i != 3 else x for i, x in enumerate(xs32))

        def check(label, fn):
            o, p = fn(jnp.asarray(pool))
            o, p = np.asarray(o, np.float32), np.asarray(p)
            row = {"case": case.name, "impl": label, "o_rel": rel(o, o_ref), "state_rel": rel(p[ids], p_ref[ids]),
                   "untouched_nan": bool(np.isnan(p[untouched]).all()), "finite": bool(np.isfinite(o).all())}
            log("numerics", row)
            res["numerics"].append(row)

        for cfg in [None] + hint_cfgs:
            if left() < 6:
                res["skipped"].append(f"numerics {cfg_name(cfg)}")
                continue
            use = cfg or decode.decode_config(n, case.Hv, case.K, case.V)
            check(f"kernel {cfg_name(cfg)}", jax.jit(lambda p, use=use: decode.fused_recurrent_gated_delta_rule_slots_fwd(
                *xs, scale=None, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
                use_qk_l2norm=True, interpret=interpret, config=use)))
        # raw gates: a, b chosen so that the gates equal g, beta: b = logit(beta), A_log = 0, dt_bias = 0,
        # softplus(a) = -g -> a = log(expm1(-g)); laid out [N, 1, Hk, 2r] as Qwen3-Next's [b | a] per key head
        r = case.Hv // case.Hk
        b_raw = np.log(np.asarray(xs32[4]) / (1 - np.asarray(xs32[4])))
        a_raw = np.log(np.expm1(-np.asarray(g, np.float64))).astype(np.float32)
        ba = np.concatenate([b_raw.reshape(n, 1, case.Hk, r), a_raw.reshape(n, 1, case.Hk, r)], axis=-1)
        gates = decode.RawGates(jnp.zeros((case.Hv,)), jnp.zeros((case.Hv,)), a_offset=r, b_offset=0)
        ba = jnp.asarray(ba)
        check("kernel raw gates", jax.jit(lambda p: decode.fused_recurrent_gated_delta_rule_slots_fwd(
            *xs[:3], ba, ba, scale=None, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
            use_qk_l2norm=True, interpret=interpret, raw_gates=gates)))

    # ---- the layer: unfused / fused steps ----
    layer_state = {}

    def layer_setup():
        n = n_layer
        s = n + 8
        key = jax.random.PRNGKey(0)
        params = gdn.init_params(dims, key, bf, randomize_norms=True)
        rng = np.random.default_rng(7)
        ids = rng.permutation(s)[:n].astype(np.int32)
        ids[[3, n - 2]] = s                                  # padding streams
        has = np.ones(n, bool)
        has[5] = False                                       # a fresh stream over a stale (NaN) slot
        live = ids[(ids < s)]
        conv = np.full((s, dims.conv_dim, dims.conv_kernel_size - 1), np.nan, np.float32)
        ssm = np.full((s, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim), np.nan, np.float32)
        conv[live] = rng.standard_normal((len(live),) + conv.shape[1:])
        ssm[live] = 0.3 * rng.standard_normal((len(live),) + ssm.shape[1:])
        conv[ids[5]] = np.nan
        ssm[ids[5]] = np.nan
        slots = GdnSlots(conv_state=jnp.asarray(conv, bf), ssm_state=jnp.asarray(ssm))
        hidden = jnp.asarray(rng.standard_normal((n, dims.hidden_size)), bf)
        layer_state.update(params=params, ids=jnp.asarray(ids), has=jnp.asarray(has), slots=slots, hidden=hidden,
                           written=np.asarray(ids[ids < s]), untouched=np.setdiff1d(np.arange(s), ids),
                           real=np.nonzero(ids < s)[0])

    gb = "pallas_interpret" if quick else "auto"

    def step_fn(step, backend=gb):
        return jax.jit(lambda p, x, sl, ids, has: gdn.gdn_layer_decode(p, dims, x, sl, ids, has, backend=backend,
                                                                          step=step))

    def layer_numerics():
        layer_setup()
        st = layer_state
        p32 = jax.tree.map(lambda x: x.astype(jnp.float32), st["params"])
        s32 = GdnSlots(conv_state=st["slots"].conv_state.astype(jnp.float32), ssm_state=st["slots"].ssm_state)
        with jax.default_matmul_precision("highest"):
            ref_o, ref_s = step_fn("unfused", "xla")(p32, st["hidden"].astype(jnp.float32), s32, st["ids"], st["has"])
        ref_o = np.asarray(ref_o)
        w, u, real = st["written"], st["untouched"], st["real"]
        f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
        runs = [("unfused", "bf16", st["params"], st["hidden"], st["slots"]),
                ("fused", "bf16", st["params"], st["hidden"], st["slots"]),
                ("fused", "fp32", p32, st["hidden"].astype(jnp.float32), s32)]
        for step, dname, p_, x_, sl_ in runs:
            if left() < 8:
                res["skipped"].append(f"numerics layer {step} {dname}")
                continue
            with jax.default_matmul_precision("highest" if dname == "fp32" else "default"):
                o, sl = step_fn(step)(p_, x_, sl_, st["ids"], st["has"])
            row = {"case": f"layer N{n_layer} {dims.num_k_heads}/{dims.num_v_heads}x{dims.head_k_dim}",
                   "impl": f"layer {step} ({dname})", "o_rel": rel(f32(o)[real], ref_o[real]),
                   "state_rel": rel(f32(sl.ssm_state)[w], f32(ref_s.ssm_state)[w]),
                   "conv_rel": rel(f32(sl.conv_state)[w], f32(ref_s.conv_state)[w]),
                   "untouched_nan": bool(np.isnan(f32(sl.ssm_state)[u]).all() and np.isnan(f32(sl.conv_state)[u]).all()),
                   "finite": bool(np.isfinite(f32(o)).all())}
            log("numerics", row)
            res["numerics"].append(row)

    # ---- kernel timing ----
    def fla_ms(case, host):                                   # threaded groups (as the jax rows), do_bench beside
        return bench_decode.time_fla(case, host), bench_decode.time_fla(case, host, do_bench=True)

    def pallas_copy(pool, ids, block_v, num_warps, direct=False):
        """A Pallas Triton kernel with the decode kernel's grid (value block fastest), slot lookup, [K, BV] block load
        and in-place store, and no arithmetic but a scale: what the launch shape alone reaches. ``direct``: slot =
        stream index (no dependent load of the slot id before the state's)."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import triton as pltr
        _, hv, _, vdim = pool.shape
        bv = min(block_v, vdim)

        def kern(ids_ref, p_in, p_out):
            vb, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
            slot, vs = (i if direct else ids_ref[i]), pl.ds(vb * bv, bv)
            p_out[slot, h, :, vs] = p_in[slot, h, :, vs] * 1.0001
        return pl.pallas_call(kern, grid=(vdim // bv, hv, ids.shape[0]),
                              out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={1: 0},
                              compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
                              interpret=interpret, name="pool_copy")(ids, pool)

    def kernel_rows(case, cfgs, with_fla=True, copies=None):
        with_fla = with_fla and not args.two_pass_only
        host = bench_decode.make_inputs_np(case)
        q, k, v, g, beta, pool, ids = host
        xs = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf))
        ids_d, has = jnp.asarray(ids), jnp.ones(ids.shape, bool)
        nbytes = bench_decode.state_bytes(case)
        row = {"case": case.name, "N": case.B, "Hk": case.Hk, "Hv": case.Hv, "K": case.K, "V": case.V,
               "state_bytes": nbytes, "ms": {}, "gbps": {}}
        res["kernel"].append(row)

        def put(name, ms):
            row["ms"][name] = round(ms, 4)
            row["gbps"][name] = round(nbytes / ms / 1e6)
            log(f"kernel {case.name} {name}: {ms:.4f} ms ({nbytes / ms / 1e6:.0f} GB/s)")
            save()

        put("copy", bench_decode.time_copy(case, host, **timing))
        for cfg in [None] + list(cfgs):
            if left() < 5:
                res["skipped"].append(f"kernel {case.name} {cfg_name(cfg)}")
                continue
            use = cfg or decode.decode_config(case.B, case.Hv, case.K, case.V)
            fn = jax.jit(lambda p, use=use: decode.fused_recurrent_gated_delta_rule_slots_fwd(
                *xs, scale=None, ssm_state=p, slot_ids=ids_d, has_initial_state=has, use_qk_l2norm=True,
                interpret=interpret, config=use)[1], donate_argnums=0)
            try:
                put(f"pallas {cfg_name(cfg)}", bench_decode._time_threaded(fn, jnp.asarray(pool), **timing))
            except Exception as e:
                res["errors"].append(f"kernel {case.name} {cfg_name(cfg)}: {type(e).__name__}: {str(e)[:400]}")
                log(f"FAIL kernel {case.name} {cfg_name(cfg)}: {type(e).__name__}: {str(e)[:400]}")
        for bv, warps, direct in (copy_shapes if copies is None else copies):   # the kernel's shape, no arithmetic
            if left() < 5:
                continue
            try:
                fn = jax.jit(lambda p, bv=bv, warps=warps, direct=direct: pallas_copy(p, ids_d, bv, warps, direct),
                             donate_argnums=0)
                put(f"pallas copy bv{bv}-w{warps}" + (" direct" if direct else ""),
                    bench_decode._time_threaded(fn, jnp.asarray(pool), **timing))
            except Exception as e:
                res["errors"].append(f"pallas copy {case.name}: {type(e).__name__}: {str(e)[:400]}")
                log(f"FAIL pallas copy {case.name}: {type(e).__name__}: {str(e)[:300]}")
        put("copy (again)", bench_decode.time_copy(case, host, **timing))
        if with_fla and not quick and left() > 10:
            try:
                wall, bench = fla_ms(case, host)
                put("fla", wall)
                row["ms"]["fla do_bench"] = round(bench, 4)
            except Exception as e:
                res["errors"].append(f"fla {case.name}: {type(e).__name__}: {str(e)[:400]}")
                log(f"FAIL fla {case.name}: {type(e).__name__}: {str(e)[:300]}")

    # ---- layer step timing: bench_model's in-program method + kernel tables ----
    def layer_timing():
        if not layer_state:
            layer_setup()
        st = layer_state
        n = n_layer
        floor = bench_model.decode_floors(config, n, 1189)["gdn_decode"]["ms"]
        res["layer"]["floor_ms"] = round(floor, 4)
        ids, has = jnp.arange(n, dtype=jnp.int32), jnp.ones((n,), bool)
        slots0 = GdnSlots.zeros(dims, n, bf)
        for step in ("unfused", "fused"):
            if left() < 12:
                res["skipped"].append(f"layer timing {step}")
                continue
            fn = (lambda step: lambda p, x, sl: gdn.gdn_layer_decode(p, dims, x, sl, ids, has, backend=gb,
                                                                     step=step))(step)
            r = {}
            bench_model._time_into(r, step, fn, (st["params"], st["hidden"]), slots0,
                                   reps=3 if quick else 7, calls=4 if quick else 20, feed=(1,),
                                   iters=2 if quick else 20)
            entry = {"ms_in_program": r["ms_in_program"].get(step), "ms_pipelined": r["ms_pipelined"].get(step),
                     "ms_blocking": r["ms_blocking"].get(step), "in_program": r.get("in_program", {}).get(step),
                     "errors": r.get("errors")}
            ip = entry["ms_in_program"]
            if ip:
                entry["floor_ratio"] = round(ip / floor, 3)
            res["layer"][step] = entry
            log(f"layer step {step}: in-program {ip} ms, pipelined {entry['ms_pipelined']} ms, floor {floor:.4f}")
            save()
            if left() < 10:
                res["skipped"].append(f"kernel table {step}")
                continue
            from profile_s6 import kernel_table
            jf = jax.jit(fn, donate_argnums=(2,))
            box = {"s": jax.tree.map(jnp.copy, slots0)}

            def call(jf=jf, box=box):
                y, box["s"] = jf(st["params"], st["hidden"], box["s"])
                return y
            try:
                res["layer"][step]["kernels"] = kernel_table(call, 10, f"gdn_decode_{step}", top=25)
            except Exception as e:
                log(f"kernel table {step} failed: {type(e).__name__}: {str(e)[:300]}")

    big = 0 if quick else 1
    guarded("numerics kernel", 20 * big, lambda: kernel_numerics(k64))
    guarded("numerics layer", 15 * big, layer_numerics)
    guarded("layer step", 20 * big, layer_timing)
    guarded("kernel N256", 20 * big, lambda: kernel_rows(k256, hint_cfgs))
    guarded("kernel N64", 10 * big, lambda: kernel_rows(k64, n64_cfgs, copies=copy_shapes[:1],
                                                          with_fla=not args.two_pass_only))

    # ---- table ----
    log("\n==== gdn_decode_s6 (ms; rel = relative RMS against the fp32 XLA step) ====")
    log("numerics:")
    for r in res["numerics"]:
        extra = f" conv {r['conv_rel']:.1e}" if "conv_rel" in r else ""
        log(f"  {r['case']:30s} {r['impl']:44s} o {r['o_rel']:.1e} state {r['state_rel']:.1e}{extra} "
            f"untouched NaN {r['untouched_nan']} finite {r['finite']}")
    log("kernel (one token per stream, fp32 state; wall per call of threaded groups, GB/s of state bytes):")
    for r in res["kernel"]:
        for name, ms in r["ms"].items():
            gb_s = r["gbps"].get(name)
            log(f"  {r['case']:24s} {name:44s} {ms:.4f}" + (f" ({gb_s} GB/s)" if gb_s else ""))
    lay = res["layer"]
    if lay:
        log(f"layer decode step (N {n_layer}, one GDN layer, bf16; floor {lay.get('floor_ms')} ms):")
        for step in ("unfused", "fused"):
            e = lay.get(step)
            if e:
                ker = e.get("kernels") or {}
                log(f"  {step:8s} in-program {e['ms_in_program']} ms (x{e.get('floor_ratio')} of floor), pipelined "
                    f"{e['ms_pipelined']} ms, kernels {ker.get('kernels_sum_ms')} ms in "
                    f"{ker.get('launches_per_call')} launches")
                for kname, ms, c in (ker.get("kernels") or [])[:12]:
                    log(f"      {ms:8.4f} ms x{c:<3d} {kname}")
    if res["skipped"]:
        log("skipped:", res["skipped"])
    if res["errors"]:
        log("errors:", len(res["errors"]))
    log(f"total {time.time() - T0:.0f} s")
    save()


if __name__ == "__main__":
    main()
