"""One device run for the GDN prefill kernel on serving mixes (issue 14): where the time goes, and the variants.

    python benchmarks/gpu/gdn_prefill.py OUT_DIR [deadline_s]

Per case (jax_gdn.cases.BENCH_CASES by name; bf16 q/k/v/beta, fp32 g and initial states, final states out, the
inputs of jax_gdn.bench), in priority order, each timed as jax_gdn.bench.time_jax (median of groups of
back-to-back calls):
  op        the public op (backend="pallas", what `python -m jax_gdn.bench` times) and, beside it, the same call
            through pallas_triton.chunk_gated_delta_rule_fwd with LaunchConfig variants (fused_intra, state pass
            stages / block_v / warps); "v4" the kernel before this session's changes when the folder
            benchmarks/gpu/_gdn_v4 (untracked, written by the caller from git) travelled with the tree:
              B=7b59aec; mkdir -p benchmarks/gpu/_gdn_v4; touch benchmarks/gpu/_gdn_v4/__init__.py
              for f in pallas_triton chunk_map reference; do git show $B:pallas_kernels/gated_delta_rule/$f.py |
                sed 's/pallas_kernels\.gated_delta_rule\./_gdn_v4./g' > benchmarks/gpu/_gdn_v4/$f.py; done
  stages    chunk map (loop-free vs v4's searchsorted), 1a kkt_solve, 1b wu_aqk, the fused 1a+1b, the state pass
  fla       FLA's chunk_gated_delta_rule on the same inputs (triton.testing.do_bench median), varlen cases, right
            after the public op (run 1 left it last and its deadline cut it)
  fresh     the op with initial_state None (new prompts: no state read), v5 and v4
Numerics on the GPU: each variant's o and final state against the default's (relative RMS), and the default's
against v4's. Everything lands in OUT_DIR/gdn_prefill.json; a short table is printed last.
GDN_PREFILL_SMOKE=1: the same steps in interpret mode on a tiny varlen case (a CPU check of this script, no FLA).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

T0 = time.time()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))      # _gdn_v4, if it travelled


def left(deadline):
    return deadline - (time.time() - T0)


def rel(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def main():
    out = sys.argv[1]
    deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 150.0
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench import _jax_impl, _time_fla, make_inputs_np, time_jax
    from jax_gdn.cases import CASES
    from pallas_kernels.gated_delta_rule import pallas_triton as kt
    from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map, kernel_chunk_map, launch_order
    try:
        import _gdn_v4.pallas_triton as v4
        import _gdn_v4.chunk_map as v4map
    except ImportError as e:
        print("no v4 baseline:", e)
        v4 = v4map = None
    smoke = os.environ.get("GDN_PREFILL_SMOKE") == "1"
    tj = lambda fn, args: time_jax(fn, args, warmup=2, groups=7, per_group=10)
    if smoke:
        tj = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "cases": {}}
    LC = kt.LaunchConfig

    # (case, op variants, state-pass variants). Run 1 (benchmarks/logs/gdn_prefill_h200_run1.log) measured the
    # fused intra and the serve256 stage / block sweep: what is left is what it did not reach.
    plan = [
        ("serve256-T38567-Hk16-Hv32", [], []),
        ("tiny64-T171-Hk16-Hv32", [],
         [dict(state_stages=s, block_v=bv) for bv, s in ((64, 1), (32, 3), (32, 1), (128, 3))]),
        ("varlen16-T19027-Hk16-Hv32", [], [dict(state_stages=1, block_v=64)]),
        ("B1-T8192-Hk16-Hv32", [], [dict(state_stages=1, block_v=32)]),
    ]
    if smoke:
        plan = [("cpu-varlen5-Hk1-Hv2-K16-V8", [LC(fused_intra=True)], [dict(state_stages=1, block_v=8)])]
    for name, op_variants, state_variants in plan:
        if left(deadline) < 20:
            break
        case = CASES[name]
        r = result["cases"][name] = {"op": {}, "stages": {}, "numerics": {}}
        host = make_inputs_np(case, 0)
        print(f"== {name}", flush=True)

        def timed(key, fn, args, store):
            try:
                ms = tj(fn, args)
                store[key] = round(ms, 4)
                print(f"  {key}: {ms:.4f} ms", flush=True)
                return fn(*args)
            except Exception as e:                 # report and go on
                store[key] = None
                print(f"  {key}: FAIL {type(e).__name__} {str(e)[:300]}", flush=True)
                return None

        fn, args = _jax_impl(case, host, "pallas_interpret" if smoke else "pallas")
        ref = timed("public", fn, args, r["op"])
        q, k, v, g, beta, h0 = args
        if not smoke and case.lens is not None and left(deadline) > 40:
            try:                                   # FLA beside ours right away (its first call autotunes)
                r["op"]["fla"] = round(_time_fla(case, host), 4)
                print(f"  fla: {r['op']['fla']:.4f} ms", flush=True)
            except Exception as e:
                print(f"  fla: FAIL {type(e).__name__} {str(e)[:300]}", flush=True)

        cu = case.cu_seqlens()
        cu = None if cu is None else jnp.asarray(cu, jnp.int32)

        def direct(mod, cmod, config, fresh=False):
            @jax.jit
            def f(q, k, v, g, beta, h0):
                cmap = None if cu is None else cmod.build_chunk_map(cu, q.shape[1], 64)
                return mod.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None,
                                                      initial_state=None if fresh else h0,
                                                      cu_seqlens=cu, chunk_map=cmap, output_final_state=True,
                                                      config=config, interpret=smoke)
            return f
        if v4 is not None:
            o4 = timed("v4", direct(v4, v4map, None), args, r["op"])
            if o4 is not None and ref is not None:
                r["numerics"]["public_vs_v4"] = [rel(ref[0], o4[0]), rel(ref[1], o4[1])]
        cmod = sys.modules["pallas_kernels.gated_delta_rule.chunk_map"]
        # fresh sequences (initial_state None: the state load masked off), as a serving prefill of new prompts
        timed("fresh", direct(kt, cmod, None, fresh=True), args, r["op"])
        if v4 is not None:
            timed("fresh_v4", direct(v4, v4map, None, fresh=True), args, r["op"])
        for cfg in op_variants:
            if left(deadline) < 15:
                break
            key = ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                           if getattr(cfg, f.name) != f.default)
            o = timed(key, direct(kt, cmod, cfg), args, r["op"])
            if o is not None and ref is not None:
                r["numerics"][key] = [rel(o[0], ref[0]), rel(o[1], ref[1])]

        # ---- stages ----
        st = r["stages"]
        tt = case.B * case.T
        if cu is not None:
            timed("chunk_map", jax.jit(lambda c: kernel_chunk_map(1, case.T, c, 64) + (launch_order(
                build_chunk_map(c, case.T, 64).seq_num_chunks),)), (cu,), st)
            if v4map is not None:
                timed("chunk_map_v4", jax.jit(lambda c: v4map.kernel_chunk_map(1, case.T, c, 64)), (cu,), st)
        start, length, first, num = kernel_chunk_map(case.B, case.T, cu, 64)
        order = jnp.arange(case.num_seqs, dtype=jnp.int32) if cu is None else launch_order(num)
        qf, kf = q.reshape(tt, case.Hk, case.K), k.reshape(tt, case.Hk, case.K)
        vf, gf, bf = v.reshape(tt, case.Hv, case.V), g.reshape(tt, case.Hv), beta.reshape(tt, case.Hv)
        n = case.num_seqs
        base = kt.launch_config(case.V, n * case.Hv, jnp.bfloat16)
        st["default_config"] = str(base)
        if smoke:                        # interpret mode reads C rows past each chunk start: pad as _run does
            pad = lambda x: jnp.pad(x, [(0, 64)] + [(0, 0)] * (x.ndim - 1))
            qf, kf, vf, gf, bf = (pad(x) for x in (qf, kf, vf, gf, bf))
        mp = dict(chunk_start=start, chunk_len=length, chunk=64, interpret=smoke)
        t_g = timed("1a_kkt_solve", jax.jit(lambda k_, g_, b_: kt.kkt_solve(
            k_, g_, b_, num_v_heads=case.Hv, config=base, **mp)), (kf, gf, bf), st)
        if t_g is None:
            continue
        inter = timed("1b_wu_aqk", jax.jit(lambda *a: kt.wu_aqk(*a, scale=case.K ** -0.5, config=base, **mp)),
                      (qf, kf, vf, bf) + tuple(t_g), st)
        for warps in (1, 2) if any(c.fused_intra for c in op_variants) else ():
            timed(f"1ab_fused_w{warps}", jax.jit(lambda *a, w=warps: kt.intra_fused(
                *a, scale=case.K ** -0.5, config=dataclasses.replace(base, solve_warps=w), **mp)),
                (qf, kf, vf, gf, bf), st)
        if inter is None:
            continue
        w, u, aqk = inter
        slots = jnp.arange(n, dtype=jnp.int32)
        has = jnp.ones((n,), jnp.int32)
        for var in [{}] + state_variants:
            if left(deadline) < 10:
                break
            cfg = dataclasses.replace(base, **var)
            key = "2_state" + "".join(f",{a}={b}" for a, b in var.items())
            timed(key, jax.jit(lambda q_, k_, w_, u_, a_, g_, p_, cfg=cfg: kt.state_pass(
                q_, k_, w_, u_, a_, g_, pool=p_, scale=case.K ** -0.5, slot_ids=slots, has_initial_state=has,
                seq_first_chunk=first, seq_num_chunks=num, config=cfg, seq_order=order, final="seq", **mp)),
                (qf, kf, w, u, aqk, t_g[1], h0), st)
        if cu is not None:
            o_dummy = jnp.zeros((tt + (64 if smoke else 0), case.Hv, case.V), jnp.bfloat16)
            timed("zero_tail", jax.jit(lambda o_, c_: kt.zero_tail(o_, c_, total=tt, chunk=64, interpret=smoke)),
                  (o_dummy, cu[-1:]), st)
        with open(os.path.join(out, "gdn_prefill.json"), "w") as f:
            json.dump(result, f, indent=1)

    # ---- FLA beside ours, same inputs (its first call autotunes) ----
    for name in ("serve256-T38567-Hk16-Hv32", "tiny64-T171-Hk16-Hv32", "varlen16-T19027-Hk16-Hv32"):
        if smoke or left(deadline) < 25 or name not in result["cases"] or "fla" in result["cases"][name]["op"]:
            continue
        try:
            os.environ.setdefault("FLA_FLASH_QLA", "0")
            ms = _time_fla(CASES[name], make_inputs_np(CASES[name], 0))
            result["cases"][name]["op"]["fla"] = round(ms, 4)
            print(f"  {name} fla: {ms:.4f} ms", flush=True)
        except Exception as e:
            print(f"  {name} fla: FAIL {type(e).__name__} {str(e)[:300]}", flush=True)
            if os.environ.get("GDN_TRACEBACK"):
                traceback.print_exc()
    with open(os.path.join(out, "gdn_prefill.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n==== summary (ms) ====")
    for name, r in result["cases"].items():
        print(name)
        print("  op     ", {k: v for k, v in r["op"].items()})
        print("  stages ", {k: v for k, v in r["stages"].items() if k != "default_config"})
        print("  config ", r["stages"].get("default_config"))
        print("  numerics", {k: [f"{x:.1e}" for x in v] for k, v in r["numerics"].items()})
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
