"""One device run (issue 14, GDN kernel v5): the persistent state pass on serving mixes and the decode kernel's
persistent grid, each checked against an fp32 reference and timed against the default in the same process.

    python benchmarks/gpu/gdn_v5.py [--quick] [--budget SECONDS] [--steps LABELS]   (results under $OUT, default /tmp/out)

``--steps 'prefill serve256,numerics serve256 bf16'`` runs only the steps whose labels start with one of those.

Steps, each skipped when the deadline (``--budget``, default 100 s from start) would not fit it; run in the order
prefill serve256, numerics serve256, decode N256, tiny64 (numerics, prefill), B1-T8192, decode N64, serve256 with
no initial state ("fresh"), the state pass alone, fp32 numerics, FLA:
  numerics  the slots API (initial states read from a pool of N + 8 slots under permuted ids; every 5th sequence
            has_initial_state False over a NaN stale slot) on serve256 / tiny64 lengths, bf16 inputs, default
            LaunchConfig and each persistent variant, against the XLA backend in fp32 (the bf16-rounded inputs,
            matmul precision highest): relative RMS of o and of the written slots, untouched slots still NaN,
            variant vs default. Then fp32 inputs for the persistent variant (tiny64, serve256 if time is left).
  prefill   ms of pallas_triton.chunk_gated_delta_rule_fwd (what the public op runs: plain API, initial states in,
            final states out) with the default LaunchConfig and the persistent variants, jax_gdn.bench.time_jax
            (median of 7 groups of 10 back-to-back calls) on serve256-T38567, tiny64-T171, B1-T8192-Hk16-Hv32.
  decode    one token for N = 256 and 64 streams x Hk16 / Hv32 x 128 x 128 fp32 state (bf16 q/k/v/beta, fused L2
            norm): the default DecodeConfig and persistent grids (programs = P), each checked against the XLA step
            (fp32, highest) and timed as jax_gdn.bench_decode does (donated pool threaded through the calls); the
            XLA copy of the pool as the floor.
  state     serve256's state pass alone (kt.state_pass on intermediates from the intra stages): grid and
            persistent, each also with no start-state load (has 0) and the grid with no final store: what an item's
            fixed cost is made of.
  fla       FLA's chunk_gated_delta_rule on serve256 and tiny64 (same inputs, triton do_bench median), last.
Writes $OUT/gdn_v5.json and $OUT/gdn_v5.log; prints a table last.
--quick: the same steps in interpret mode on CPU at tiny sizes (a check of this script; no FLA).
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repo


def log(*a):
    line = " ".join(str(x) for x in a)
    LOG.append(line)
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=100.0)
    ap.add_argument("--steps", default="", help="comma-separated step labels (prefixes, e.g. 'prefill serve256,"
                    "numerics serve256 bf16') to run only those; default all")
    args = ap.parse_args()
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    quick = args.quick
    if quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    deadline = args.budget
    left = lambda: deadline - (time.time() - T0)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import bench_decode
    from jax_gdn.bench import _time_fla, make_inputs_np, time_jax
    from jax_gdn.cases import CASES, Case
    from pallas_kernels.gated_delta_rule import decode, pallas_triton as kt
    from pallas_kernels.gated_delta_rule.api import chunk_gated_delta_rule_slots, fused_recurrent_gated_delta_rule_slots
    from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map

    dev = jax.devices()[0]
    sms = int(getattr(dev, "core_count", 0) or 132)
    res = {"device": str(getattr(dev, "device_kind", dev.platform)), "jax": jax.__version__, "sms": sms,
           "numerics": [], "prefill": [], "decode": [], "fla": {}, "skipped": []}
    log(f"device {res['device']} sms {sms} jax {jax.__version__}")
    LC = kt.LaunchConfig
    interpret = quick
    bf = jnp.bfloat16

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))

    def tj(fn, a):
        if quick:
            return time_jax(fn, a, warmup=1, groups=1, per_group=1)
        return time_jax(fn, a, warmup=2, groups=7, per_group=10)

    def cfg_name(c):
        if c is None:
            return "default"
        return ",".join(f"{f.name}={getattr(c, f.name)}" for f in dataclasses.fields(c)
                        if getattr(c, f.name) != f.default) or "default"

    def save():
        with open(os.path.join(out, "gdn_v5.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(out, "gdn_v5.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")

    only = [x.strip() for x in args.steps.split(",") if x.strip()]

    def guarded(label, need, fn):
        if only and not any(label.startswith(x) for x in only):
            return None
        if left() < need:
            res["skipped"].append(label)
            log(f"skip {label} ({left():.0f} s left, needs ~{need})")
            return None
        try:
            return fn()
        except Exception as e:                                # report and go on
            log(f"FAIL {label}: {type(e).__name__}: {str(e)[:400]}")
            if os.environ.get("GDN_TRACEBACK"):
                traceback.print_exc()
            return None
        finally:
            save()

    # ---- cases and variants ----
    if quick:
        serve = Case("quick-varlen", 1, 140, 1, 2, 16, 16, (1, 63, 0, 64, 5, 7))
        tiny = Case("quick-tiny", 1, 10, 1, 2, 16, 16, (3, 4, 1, 2))
        dense = Case("quick-B1-T130", 1, 130, 1, 2, 16, 16)
        dec_cases = [Case("quick-decode-N4", 4, 1, 1, 2, 16, 16)]
        persist = [LC(state_programs=3), LC(state_programs=5, state_stages=1)]
        dec_cfgs = [decode.DecodeConfig(block_v=16, num_warps=4, programs=3)]
    else:
        serve = CASES["serve256-T38567-Hk16-Hv32"]
        tiny = CASES["tiny64-T171-Hk16-Hv32"]
        dense = CASES["B1-T8192-Hk16-Hv32"]
        dec_cases = [CASES["decode-N256-Hk16-Hv32"], CASES["decode-N64-Hk16-Hv32"]]
        # one program per SM at 3 stages (~192 KB of shared memory each); 1 stage fits 2 per SM
        persist = [LC(state_programs=sms), LC(state_programs=2 * sms, state_stages=1),
                   LC(state_programs=sms, state_stages=1)]
        # decode: P resident programs (BV 64 / 4 warps holds two [128, 64] fp32 blocks: ~3 programs per SM;
        # BV 32 / 2 warps ~5)
        dec_cfgs = [decode.DecodeConfig(block_v=64, num_warps=4, programs=2 * sms),
                    decode.DecodeConfig(block_v=64, num_warps=4, programs=3 * sms),
                    decode.DecodeConfig(block_v=32, num_warps=2, programs=5 * sms)]

    # ---- numerics: slots API against the XLA backend in fp32 ----
    def slot_inputs(case, seed=0):
        q, k, v, g, beta, h0 = make_inputs_np(case, seed)
        n = case.num_seqs
        num_slots = n + 8
        rng = np.random.default_rng(seed + 1)
        ids = rng.permutation(num_slots)[:n].astype(np.int32)
        has = np.arange(n) % 5 != 4
        pool = np.full((num_slots, case.Hv, case.K, case.V), np.nan, np.float32)
        pool[ids[has]] = h0[has]
        rnd = lambda x: np.asarray(jnp.asarray(x, bf).astype(jnp.float32))
        return (rnd(q), rnd(k), rnd(v), g, rnd(beta)), pool, ids, has

    def slots_fn(case, config, dtype):
        cu = jnp.asarray(case.cu_seqlens(), jnp.int32)

        @jax.jit
        def f(q, k, v, g, beta, pool, ids, has):
            cmap = build_chunk_map(cu, q.shape[1], 64)
            return kt.chunk_gated_delta_rule_slots_fwd(
                q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype), scale=None,
                ssm_state=pool, slot_ids=ids, has_initial_state=has, cu_seqlens=cu, chunk_map=cmap,
                interpret=interpret, config=config)
        return f

    def numerics(case, configs, dtype, with_default=True):
        xs, pool, ids, has = slot_inputs(case)
        dxs = [jnp.asarray(x) for x in xs]
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda *a: chunk_gated_delta_rule_slots(
                *a[:5], ssm_state=a[5], slot_ids=a[6], has_initial_state=a[7],
                cu_seqlens=jnp.asarray(case.cu_seqlens(), jnp.int32), backend="xla"))(
                *dxs, jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(has))
        ref_o, ref_p = np.asarray(ref[0], np.float32), np.asarray(ref[1])
        written = ids
        untouched = np.setdiff1d(np.arange(pool.shape[0]), ids)
        outs = {}
        for cfg in ([None] if with_default else []) + list(configs):
            name = cfg_name(cfg)
            if left() < (8 if quick else 12):
                res["skipped"].append(f"numerics {case.name} {name}")
                continue
            try:
                o, p = slots_fn(case, cfg, dtype)(*dxs, jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(has))
                o, p = np.asarray(o, np.float32), np.asarray(p)
                row = {"case": case.name, "dtype": jnp.dtype(dtype).name, "config": name,
                       "o_rel": rel(o, ref_o), "state_rel": rel(p[written], ref_p[written]),
                       "untouched_nan": bool(np.isnan(p[untouched]).all()), "finite": bool(np.isfinite(o).all())}
                if "default" in outs:
                    row["o_vs_default"] = rel(o, outs["default"][0])
                    row["state_vs_default"] = rel(p[written], outs["default"][1][written])
                outs[name] = (o, p)
            except Exception as e:
                row = {"case": case.name, "dtype": jnp.dtype(dtype).name, "config": name,
                       "error": f"{type(e).__name__}: {str(e)[:400]}"}
            log("numerics", row)
            res["numerics"].append(row)
            save()

    # ---- prefill timing: plain API (what the public op runs), initial states in, final states out ----
    def prefill(case, configs, fresh=False):
        q, k, v, g, beta, h0 = make_inputs_np(case, 0)
        a = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf),
             jnp.asarray(h0))
        cu = case.cu_seqlens()
        cu = None if cu is None else jnp.asarray(cu, jnp.int32)
        base = None
        for cfg in [None] + list(configs):
            name = cfg_name(cfg)
            if left() < (5 if quick else 10):
                res["skipped"].append(f"prefill {case.name} {name}")
                continue

            @jax.jit
            def f(q, k, v, g, beta, h0, cfg=cfg):
                cmap = None if cu is None else build_chunk_map(cu, q.shape[1], 64)
                return kt.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None,
                                                     initial_state=None if fresh else h0,
                                                     cu_seqlens=cu, chunk_map=cmap, output_final_state=True,
                                                     interpret=interpret, config=cfg)
            row = {"case": case.name + (" fresh" if fresh else ""), "config": name}
            try:
                ms = tj(f, a)
                row["ms"] = round(ms, 4)
                if base is None and cfg is None:
                    base = (ms, [np.asarray(x, np.float32) for x in f(*a)])
                elif base is not None:
                    row["vs_default"] = round(ms / base[0], 3)
                    o, s = f(*a)
                    row["o_vs_default"] = rel(np.asarray(o, np.float32), base[1][0])
                    row["state_vs_default"] = rel(s, base[1][1])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log("prefill", row)
            res["prefill"].append(row)
            save()

    # ---- decode: default vs persistent grids, numerics against the XLA step ----
    def decode_rows(case, configs, floor=True):
        host = bench_decode.make_inputs_np(case)
        q, k, v, g, beta, pool, ids = host
        xs = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf))
        ids_d = jnp.asarray(ids)
        has = jnp.ones(ids.shape, bool)
        with jax.default_matmul_precision("highest"):
            o_ref, p_ref = jax.jit(lambda p: fused_recurrent_gated_delta_rule_slots(
                *[x.astype(jnp.float32) for x in xs], ssm_state=p, slot_ids=ids_d, use_qk_l2norm=True,
                backend="xla"))(jnp.asarray(pool))
        o_ref, p_ref = np.asarray(o_ref, np.float32), np.asarray(p_ref)
        timing = dict(warmup=1, groups=1, per_group=1) if quick else {}
        copy_ms = bench_decode.time_copy(case, host, **timing) if floor else None
        for cfg in [None] + list(configs):
            name = "default" if cfg is None else (f"bv{cfg.block_v}-w{cfg.num_warps}-p{cfg.programs}")
            if left() < (4 if quick else 6):
                res["skipped"].append(f"decode {case.name} {name}")
                continue
            use = cfg or decode.decode_config(case.B, case.Hv, case.K, case.V)
            fn = jax.jit(lambda p, use=use: decode.fused_recurrent_gated_delta_rule_slots_fwd(
                *xs, scale=None, ssm_state=p, slot_ids=ids_d, has_initial_state=has, use_qk_l2norm=True,
                interpret=interpret, config=use), donate_argnums=0)
            row = {"case": case.name, "config": name, "N": case.B, "Hv": case.Hv, "copy_ms": copy_ms}
            try:
                o, p1 = fn(jnp.asarray(pool))
                row["o_rel"], row["pool_rel"] = rel(np.asarray(o, np.float32), o_ref), rel(p1, p_ref)
                row["ms"] = round(bench_decode._time_threaded(lambda st: fn(st)[1], p1, **timing), 4)
                row["gbps"] = round(bench_decode.state_bytes(case) / row["ms"] / 1e6, 0)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log("decode", row)
            res["decode"].append(row)
            save()

    # ---- where the state pass's per-item time goes: the state pass alone on precomputed intermediates ----
    def state_attribution(case, pcfg):
        from pallas_kernels.gated_delta_rule.chunk_map import kernel_chunk_map, launch_order
        q, k, v, g, beta, h0 = make_inputs_np(case, 0)
        tt, n = case.B * case.T, case.num_seqs
        cu = jnp.asarray(case.cu_seqlens(), jnp.int32)
        pad = (lambda x: jnp.pad(x, [(0, 64)] + [(0, 0)] * (x.ndim - 1))) if interpret else (lambda x: x)
        qf, kf = (pad(jnp.asarray(x, bf).reshape(tt, case.Hk, case.K)) for x in (q, k))
        vf = pad(jnp.asarray(v, bf).reshape(tt, case.Hv, case.V))
        gf, bfb = pad(jnp.asarray(g).reshape(tt, case.Hv)), pad(jnp.asarray(beta, bf).reshape(tt, case.Hv))
        start, length, first, num = kernel_chunk_map(1, case.T, cu, 64)
        order = launch_order(num)
        base = kt.launch_config(case.V, n * case.Hv, bf)
        mp = dict(chunk_start=start, chunk_len=length, chunk=64, interpret=interpret)
        w, u, aqk, gcum = jax.jit(lambda *x: kt.intra_chunk(*x, scale=case.K ** -0.5, config=base, **mp))(
            qf, kf, vf, gf, bfb)
        h0d = jnp.asarray(h0)
        rows = [("grid", base, 1, "seq"), ("grid has0", base, 0, "seq"), ("grid final none", base, 1, "none"),
                ("persistent", dataclasses.replace(base, state_programs=pcfg.state_programs), 1, "seq"),
                ("persistent has0", dataclasses.replace(base, state_programs=pcfg.state_programs), 0, "seq")]
        res.setdefault("state_pass", [])
        for label, cfg, has, final in rows:
            if left() < (4 if quick else 8):
                res["skipped"].append(f"state_pass {case.name} {label}")
                continue
            hasv = jnp.full((n,), has, jnp.int32)
            fn = jax.jit(lambda *x, cfg=cfg, hasv=hasv, final=final: kt.state_pass(
                *x[:6], pool=x[6], scale=case.K ** -0.5, slot_ids=jnp.arange(n, dtype=jnp.int32), has_initial_state=hasv,
                seq_first_chunk=first, seq_num_chunks=num, config=cfg, seq_order=order, final=final, **mp))
            row = {"case": case.name, "state_pass": label, "config": str(cfg)}
            try:
                row["ms"] = round(tj(fn, (qf, kf, w, u, aqk, gcum, h0d)), 4)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log("state_pass", row)
            res["state_pass"].append(row)
            save()

    big = 0 if quick else 1
    # timing of the main row first (its variant-vs-default check comes with it), then its fp32-reference check
    guarded("prefill serve256", 15 * big, lambda: prefill(serve, persist))
    guarded("numerics serve256 bf16", 20 * big, lambda: numerics(serve, persist[:1], bf))
    guarded("decode N256", 8 * big, lambda: decode_rows(dec_cases[0], dec_cfgs))
    guarded("numerics tiny64 bf16", 10 * big, lambda: numerics(tiny, persist[:1], bf))
    guarded("prefill tiny64", 10 * big, lambda: prefill(tiny, persist[:1]))
    guarded("prefill B1-T8192", 12 * big, lambda: prefill(dense, persist[:1]))
    if len(dec_cases) > 1:
        guarded("decode N64", 8 * big, lambda: decode_rows(dec_cases[1], dec_cfgs[:2]))
    # new prompts (initial_state None: every start-state load masked off; NOTES' "fresh" prediction)
    guarded("prefill serve256 fresh", 12 * big, lambda: prefill(serve, persist[:1], fresh=True))
    guarded("state pass serve256", 15 * big, lambda: state_attribution(serve, persist[0]))
    guarded("numerics tiny64 fp32", 10 * big, lambda: numerics(tiny, persist[:1], jnp.float32, with_default=False))
    guarded("numerics serve256 fp32", 15 * big,
            lambda: numerics(serve, persist[:1], jnp.float32, with_default=False))
    if not quick:
        for case in (serve, tiny):
            def fla(case=case):
                os.environ.setdefault("FLA_FLASH_QLA", "0")
                res["fla"][case.name] = round(_time_fla(case, make_inputs_np(case, 0)), 4)
                log("fla", case.name, res["fla"][case.name])
            guarded(f"fla {case.name}", 40, fla)      # its first call autotunes

    # ---- table ----
    log("\n==== gdn_v5 (ms; rel = relative RMS) ====")
    log("prefill (plain API, bf16, initial states in, final states out):")
    for r in res["prefill"]:
        extra = f"  x{r['vs_default']:.3f} of default, o/state vs default {r['o_vs_default']:.1e}/" \
                f"{r['state_vs_default']:.1e}" if "vs_default" in r else ""
        log(f"  {r['case']:28s} {r['config']:40s} {r.get('ms', r.get('error'))}{extra}")
    for name, ms in res["fla"].items():
        log(f"  {name:28s} {'FLA chunk_gated_delta_rule':40s} {ms}")
    if res.get("state_pass"):
        log("state pass alone (serve256 intermediates; has0: no start-state load; final none: no final store):")
        for r in res["state_pass"]:
            log(f"  {r['case']:28s} {r['state_pass']:40s} {r.get('ms', r.get('error'))}")
    log("numerics (slots API vs XLA fp32 highest):")
    for r in res["numerics"]:
        if "error" in r:
            log(f"  {r['case']:28s} {r['dtype']:8s} {r['config']:40s} {r['error']}")
            continue
        vd = f" vs default o {r['o_vs_default']:.1e} state {r['state_vs_default']:.1e}" if "o_vs_default" in r else ""
        log(f"  {r['case']:28s} {r['dtype']:8s} {r['config']:40s} o {r['o_rel']:.1e} state {r['state_rel']:.1e} "
            f"untouched NaN {r['untouched_nan']} finite {r['finite']}{vd}")
    log("decode (one token, fp32 state; copy = XLA copy of the pool):")
    for r in res["decode"]:
        if "ms" in r:
            log(f"  {r['case']:28s} {r['config']:16s} {r['ms']:.4f} ms ({r['gbps']:.0f} GB/s) copy "
                f"{r['copy_ms']:.4f}  o {r['o_rel']:.1e} pool {r['pool_rel']:.1e}")
        else:
            log(f"  {r['case']:28s} {r['config']:16s} {r.get('error')}")
    if res["skipped"]:
        log("skipped:", res["skipped"])
    log(f"total {time.time() - T0:.0f} s")
    save()


if __name__ == "__main__":
    main()
