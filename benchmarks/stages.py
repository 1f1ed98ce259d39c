"""Per-stage GPU timing of the Pallas kernels and a small sweep of launch parameters (device tool only).

`python benchmarks/stages.py` prints, per case: stage 1 (intra-chunk) alone for a few num_warps, and stage 2
(state pass + output) alone for block_v / num_warps / num_stages variants, medians in ms.
"""
from __future__ import annotations

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from jax_gdn.bench import make_inputs_np, time_jax  # noqa: E402
from jax_gdn.cases import BENCH_CASES  # noqa: E402
from pallas_kernels.gated_delta_rule import api, triton as kt  # noqa: E402


INTERPRET = False


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
        start, length, first, num = api._maps(case.B, case.T, None if cu is None else jnp.asarray(cu, jnp.int32),
                                              None, 64)
        n = case.num_seqs
        pool = jnp.asarray(h0)
        slots = jnp.arange(n, dtype=jnp.int32)
        has = jnp.ones((n,), jnp.int32)
        scale = case.K ** -0.5
        print(f"== {case.name}", flush=True)
        inter = None
        for nw in (2, 4, 8):
            f1 = jax.jit(lambda *a, nw=nw: kt.intra_chunk(*a, scale=scale, chunk_start=start, chunk_len=length,
                                                          chunk=64, interpret=INTERPRET, num_warps=nw, num_stages=1))
            try:
                ms = time_jax(f1, (qf, kf, vf, gf, bfb))
                print(f"  intra   warps={nw}: {ms:.4f} ms", flush=True)
                inter = f1(qf, kf, vf, gf, bfb)
            except Exception as e:
                print(f"  intra   warps={nw}: FAIL {type(e).__name__} {str(e)[:300]}", flush=True)
        if inter is None:
            continue
        w, u, aqk, gcum = inter
        for bv, nw, ns in [(32, 4, 2), (32, 4, 1), (32, 4, 3), (64, 4, 2), (64, 8, 2), (32, 2, 2), (16, 4, 2)]:
            f2 = jax.jit(lambda q_, k_, w_, u_, a_, g_, p_, bv=bv, nw=nw, ns=ns: kt.state_pass(
                q_, k_, w_, u_, a_, g_, pool=p_, scale=scale, slot_ids=slots, has_initial_state=has, chunk_start=start, chunk_len=length,
                seq_first_chunk=first, seq_num_chunks=num, chunk=64, block_v=bv, interpret=INTERPRET,
                num_warps=nw, num_stages=ns))
            try:
                ms = time_jax(f2, (qf, kf, w, u, aqk, gcum, pool))
                print(f"  state   bv={bv} warps={nw} stages={ns}: {ms:.4f} ms", flush=True)
            except Exception as e:
                print(f"  state   bv={bv} warps={nw} stages={ns}: FAIL {type(e).__name__} {str(e)[:300]}",
                      flush=True)


if __name__ == "__main__":
    main()
