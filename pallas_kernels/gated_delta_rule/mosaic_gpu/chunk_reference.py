# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
"""The jnp twins of the chunk kernels' fused state pass (fp32, matmul precision highest): the same per-chunk
formulas as ``chunk.fused_state_pass`` as a ``lax.scan``, runnable anywhere. The CPU tests check them against the
float64 per-token oracle, so the algebra the kernels implement is tested without a GPU; ``split.py``'s state-map
twin runs the same pass over augmented values."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta_rule.mosaic_gpu.common import C, F32, LN2


def fused_state_pass_reference(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool,
                               head_major: bool = False, pieces: int = 1, run_pieces: int | None = None,
                               write_o: bool = True, exp2: bool = False):
    """What :func:`fused_state_pass` computes, in jnp (fp32, matmul precision highest), same arguments and
    results: the kernel's per-chunk formulas (W = v - Gamma k S, v_new = (T * beta_j) W, o, S update) as a
    lax.scan over each piece's chunks (``head_major``: T = T0 * e^(G_i - G_j) first, as the kernel's WG1 does).
    Runs anywhere; the CPU tests check it (behind stage 1a in interpret mode, or :func:`kkt_fwd_reference`)
    against the float64 per-token oracle, so the algebra the kernel implements is tested without a GPU."""
    b, tp, hk, kdim = k.shape
    hv = v.shape[2]
    run_pieces = pieces if run_pieces is None else run_pieces
    t, gcum, beta_c = chunk_layout(t, gcum, beta_c, head_major=head_major, exp2=exp2)
    if pieces > 1:      # piece p of row b becomes row b * R + p (p < R)
        lp = tp // pieces

        def rows(x):    # [B, Tp, ...] -> [B * R, L, ...]
            x = x.reshape((b, pieces, lp) + x.shape[2:])[:, :run_pieces]
            return x.reshape((b * run_pieces, lp) + x.shape[3:])

        def chunk_rows(x):  # [NC, ...] -> [B * R * NC_piece, ...]
            x = x.reshape((b, pieces, lp // C) + x.shape[1:])[:, :run_pieces]
            return x.reshape((b * run_pieces * (lp // C),) + x.shape[3:])
        o, ht = _reference_rows(rows(q), rows(k), rows(v), chunk_rows(t), chunk_rows(gcum), chunk_rows(beta_c),
                                h0t, scale=scale, out_final=out_final)
        o = o.reshape(b, run_pieces * lp, hv, v.shape[3]) if run_pieces == pieces else None
    else:
        o, ht = _reference_rows(q, k, v, t, gcum, beta_c, h0t, scale=scale, out_final=out_final)
    return (o if write_o else None), ht


def chunk_layout(t, gcum, beta_c, *, head_major: bool, exp2: bool):
    """The twins' common input: (gated T [NC, Hv, C, C], natural-log G [NC, Hv, C], beta [NC, Hv, C]) fp32 from
    either layout of the fused pass's operands (``head_major``: T0 [B, Hv, Tp, C], G and beta [B, Hv, Tp], T
    gated here as the kernel's WG1 does; ``exp2``: G in log2 units)."""
    if exp2:            # log2 gates back to natural log (the twin works in natural log)
        gcum = gcum * LN2
    if not head_major:
        return t, gcum, beta_c
    b, hv, tp = gcum.shape
    nc = b * tp // C
    g4 = gcum.astype(F32).reshape(b, hv, tp // C, C)
    keep = jnp.tril(jnp.ones((C, C), bool))
    decay = jnp.exp(jnp.where(keep, g4[..., :, None] - g4[..., None, :], -jnp.inf))
    t = t.astype(F32).reshape(b, hv, tp // C, C, C) * decay
    t = jnp.transpose(t, (0, 2, 1, 3, 4)).reshape(nc, hv, C, C)
    gcum = jnp.transpose(g4, (0, 2, 1, 3)).reshape(nc, hv, C)
    beta_c = jnp.transpose(beta_c.astype(F32).reshape(b, hv, tp // C, C), (0, 2, 1, 3)).reshape(nc, hv, C)
    return t, gcum, beta_c


def chunk_step(s, xs, scale: float):
    """One chunk of the fused pass in jnp (fp32, precision highest): s [B, Hv, K, V] the incoming state, xs =
    (q, k [B, Hv, C, K], v [B, Hv, C, V], gated T [B, Hv, C, C], G, beta [B, Hv, C]) fp32. Returns (the outgoing
    state, o [B, Hv, C, V] fp32): W = v - e^G k S, v_new = (T * beta_j) W, o = scale (e^G q S + P v_new),
    S' = e^(G_last) S + k^T (e^(G_last - G) v_new)."""
    hp = lax.Precision.HIGHEST
    keep = jnp.tril(jnp.ones((C, C), bool))
    qq, kk, vv, tt, gg, bb = xs
    ag = tt * bb[..., None, :]                                                   # T_ij beta_j
    x = jnp.einsum("bhck,bhkv->bhcv", kk, s, precision=hp)
    w = vv - jnp.exp(gg)[..., None] * x
    vn = jnp.einsum("bhij,bhjv->bhiv", ag, w, precision=hp)
    decay = jnp.exp(jnp.where(keep, gg[..., :, None] - gg[..., None, :], -jnp.inf))
    p = jnp.einsum("bhik,bhjk->bhij", qq, kk, precision=hp) * decay
    o = scale * (jnp.exp(gg)[..., None] * jnp.einsum("bhck,bhkv->bhcv", qq, s, precision=hp)
                 + jnp.einsum("bhij,bhjv->bhiv", p, vn, precision=hp))
    glast = gg[..., -1]
    vd = jnp.exp(glast[..., None] - gg)[..., None] * vn
    s = jnp.exp(glast)[..., None, None] * s + jnp.einsum("bhck,bhcv->bhkv", kk, vd, precision=hp)
    return s, o


def _reference_rows(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool):
    b, tp, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    ncb = tp // C

    def chunks(x):      # [B, Tp, H, D] -> [ncb, B, Hv, C, D] fp32
        x = jnp.repeat(x, hv // x.shape[2], axis=2).astype(F32)
        return jnp.transpose(x.reshape(b, ncb, C, hv, x.shape[3]), (1, 0, 3, 2, 4))
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    tc = jnp.swapaxes(t.astype(F32).reshape(b, ncb, hv, C, C), 0, 1)                  # [ncb, B, Hv, C, C]
    gc = jnp.swapaxes(gcum.astype(F32).reshape(b, ncb, hv, C), 0, 1)                  # [ncb, B, Hv, C]
    bc = jnp.swapaxes(beta_c.astype(F32).reshape(b, ncb, hv, C), 0, 1)
    s0 = (jnp.zeros((b, hv, kdim, vdim), F32) if h0t is None else jnp.swapaxes(h0t.astype(F32), -1, -2))
    s, o = lax.scan(functools.partial(chunk_step, scale=scale), s0, (qc, kc, vc, tc, gc, bc))  # o [ncb, B, Hv, C, V]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(b, tp, hv, vdim).astype(q.dtype)
    return o, (jnp.swapaxes(s, -1, -2) if out_final else None)
