"""Per-stage GPU timing of the Pallas kernels over launch-parameter variants (device tool only).

    PYTHONPATH=$PWD python benchmarks/stages.py [case,...]     (the package installed, or the repo on the path)

Per case: stage 1a (kkt_solve) and 1b (wu_aqk) alone, then stage 2 (state pass + output) alone, for each variant
in STAGE_SOLVE / STAGE_WU / STAGE_STATE (environment), medians in ms. Variants are LaunchConfig field lists:
    STAGE_SOLVE="solve_warps=1:solve_block_k=128;solve_warps=2"   STAGE_WU="wu_warps=4;wu_warps=8"
    STAGE_STATE="block_v=32:state_stages=3;block_v=64:state_stages=3"
STAGE_INTERPRET=1 runs the same in interpret mode (a CPU smoke test of this script, not a measurement).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from jax_gdn.bench import make_inputs_np, time_jax
from jax_gdn.cases import BENCH_CASES
from pallas_kernels.gated_delta_rule import pallas_triton as kt
from pallas_kernels.gated_delta_rule.chunk_map import kernel_chunk_map

INTERPRET = os.environ.get("STAGE_INTERPRET") == "1"


def _variants(name, default):
    spec = os.environ.get(name, default)
    return [{k: int(v) for k, v in (kv.split("=") for kv in item.split(":") if kv)} for item in spec.split(";")]


def _timed(label, fn, args):
    try:
        ms = time_jax(fn, args)
        print(f"  {label}: {ms:.4f} ms", flush=True)
        return fn(*args)
    except Exception as e:  # report and go on with the next variant
        print(f"  {label}: FAIL {type(e).__name__} {str(e)[:300]}", flush=True)
        return None


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else [c.name for c in BENCH_CASES]
    for case in [c for c in BENCH_CASES if c.name in names]:
        q, k, v, g, beta, h0 = make_inputs_np(case)
        bf = jnp.bfloat16
        tt = case.B * case.T
        qf = jnp.asarray(q, bf).reshape(tt, case.Hk, case.K)
        kf = jnp.asarray(k, bf).reshape(tt, case.Hk, case.K)
        vf = jnp.asarray(v, bf).reshape(tt, case.Hv, case.V)
        gf = jnp.asarray(g).reshape(tt, case.Hv)
        bfb = jnp.asarray(beta, bf).reshape(tt, case.Hv)
        cu = case.cu_seqlens()
        start, length, first, num = kernel_chunk_map(case.B, case.T,
                                                     None if cu is None else jnp.asarray(cu, jnp.int32), 64)
        n = case.num_seqs
        pool = jnp.asarray(h0)
        slots = jnp.arange(n, dtype=jnp.int32)
        has = jnp.ones((n,), jnp.int32)
        scale = case.K ** -0.5
        base = kt.launch_config(case.V, n * case.Hv)
        mp = dict(chunk_start=start, chunk_len=length, chunk=64, interpret=INTERPRET)
        print(f"== {case.name}  (default {base})", flush=True)
        t = gcum = None
        for var in _variants("STAGE_SOLVE", "solve_warps=1"):
            cfg = dataclasses.replace(base, **var)
            f = jax.jit(lambda k_, g_, b_, cfg=cfg: kt.kkt_solve(k_, g_, b_, num_v_heads=case.Hv, config=cfg, **mp))
            t, gcum = _timed(f"solve {var}", f, (kf, gf, bfb)) or (t, gcum)
        if t is None:
            continue
        inter = None
        for var in _variants("STAGE_WU", "wu_warps=4"):
            cfg = dataclasses.replace(base, **var)
            f = jax.jit(lambda *a, cfg=cfg: kt.wu_aqk(*a, scale=scale, config=cfg, **mp))
            inter = _timed(f"wu    {var}", f, (qf, kf, vf, bfb, t, gcum)) or inter
        if inter is None:
            continue
        w, u, aqk = inter
        for var in _variants("STAGE_STATE", "state_stages=3"):
            cfg = dataclasses.replace(base, **var)
            f = jax.jit(lambda q_, k_, w_, u_, a_, g_, p_, cfg=cfg: kt.state_pass(
                q_, k_, w_, u_, a_, g_, pool=p_, scale=scale, slot_ids=slots, has_initial_state=has,
                seq_first_chunk=first, seq_num_chunks=num, config=cfg, **mp))
            _timed(f"state {var}", f, (qf, kf, w, u, aqk, gcum, pool))


if __name__ == "__main__":
    main()
