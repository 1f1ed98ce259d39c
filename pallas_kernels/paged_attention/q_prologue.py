"""Gated attention's query prologue as one Pallas (Triton lowering) kernel: q_proj's raw output -> the RMS-normed,
rotated queries, one read of the query columns and one write (the XLA form, ``reference.gated_query``, is a
reduction fusion plus an elementwise one that reads the columns again).

Shape legend: T tokens, H query heads, Dh head dim, C >= H 2 Dh columns of q_proj's output (head h's
[query | gate] at columns h 2 Dh ..; more columns, e.g. a fused projection's k and v, are not read), R rotary
dims (even, <= Dh; 0: no RoPE), Bt tokens per program.

    gated_query_pallas(qg [T, C], q_norm [Dh], cos [T, R], sin [T, R], *, num_heads, head_dim, eps,
                       interpret=False) -> q [T, H, Dh] in qg's dtype

Semantics are ``reference.gated_query``'s query half: x / rms(x) * (1 + w) in fp32 rounded to qg's dtype, then
the partial NeoX RoPE in fp32 rounded again (the rotate-half partner of column j < R is column j +- R/2, normed
with its own weight). Used by the cuDNN backends' gated prefill when ``CudnnConfig.q_prologue`` /
``cudnn.Q_PROLOGUE`` is "pallas"; runs in interpret mode on CPU (tests).

This module imports only jax.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

#: Tokens per program, warps per program, and how the rotate-half partner is read: "gather" (one [Bt, Dh] load
#: with each column's partner index, as the Pallas prefill kernel's prologue does) or "halves" (the two rotary
#: halves loaded and stored as contiguous [Bt, R/2] tiles, the pass-through columns stored from the full tile
#: under a column mask: every access contiguous). H200: "gather", 32, 4: 0.185 ms at varlen16 80B dims
#: (``python -m benchmarks attention``).
BLOCK_T = 32
NUM_WARPS = 4
LAYOUT = "gather"


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _kernel(*refs, block_t, num_tokens, dh, eps, rotary_dim):
    if rotary_dim:
        qg_ref, w_ref, cos_ref, sin_ref, o_ref = refs
    else:
        qg_ref, w_ref, o_ref = refs
    i, h = pl.program_id(0), pl.program_id(1)
    trow = i * block_t + _iota((block_t, 1), 0)                                        # [Bt, 1]
    row_ok = trow < num_tokens
    trow_c = jnp.where(row_ok, trow, 0)
    cols = _iota((1, dh), 1)                                                           # [1, Dh]
    col0 = h * 2 * dh
    x = plgpu.load(qg_ref.at[trow_c, col0 + cols], mask=row_ok, other=0)            # [Bt, Dh]
    x32 = x.astype(jnp.float32)
    rs = lax.rsqrt(jnp.sum(x32 * x32, axis=1, keepdims=True) / dh + eps)             # [Bt, 1]
    cols1 = _iota((dh,), 0)
    w = 1.0 + plgpu.load(w_ref.at[cols1]).astype(jnp.float32)[None, :]
    out = (x32 * rs * w).astype(x.dtype)
    if rotary_dim:
        half = rotary_dim // 2
        pc1 = jnp.where(cols1 < half, cols1 + half, jnp.where(cols1 < rotary_dim, cols1 - half, cols1))
        xp = plgpu.load(qg_ref.at[trow_c, col0 + pc1[None, :]], mask=row_ok, other=0)
        wp = 1.0 + plgpu.load(w_ref.at[pc1]).astype(jnp.float32)[None, :]
        xpn = (xp.astype(jnp.float32) * rs * wp).astype(x.dtype)
        rot = (cols1 < rotary_dim)[None, :]
        cidx = jnp.where(rot, cols, 0)
        c = plgpu.load(cos_ref.at[trow_c, cidx], mask=row_ok & rot, other=1.0)
        s = plgpu.load(sin_ref.at[trow_c, cidx], mask=row_ok & rot, other=0.0)
        sign = jnp.where(cols1 < half, -1.0, 1.0)[None, :]
        out = (out.astype(jnp.float32) * c + sign * xpn.astype(jnp.float32) * s).astype(x.dtype)
    plgpu.store(o_ref.at[trow, h * dh + cols], out.astype(o_ref.dtype), mask=row_ok)


def _kernel_halves(*refs, block_t, num_tokens, dh, eps, rotary_dim):
    qg_ref, w_ref, cos_ref, sin_ref, o_ref = refs
    i, h = pl.program_id(0), pl.program_id(1)
    trow = i * block_t + _iota((block_t, 1), 0)
    row_ok = trow < num_tokens
    trow_c = jnp.where(row_ok, trow, 0)
    half = rotary_dim // 2
    cols = _iota((1, dh), 1)
    hc = _iota((1, half), 1)
    col0 = h * 2 * dh
    x = plgpu.load(qg_ref.at[trow_c, col0 + cols], mask=row_ok, other=0)            # [Bt, Dh]
    x32 = x.astype(jnp.float32)
    rs = lax.rsqrt(jnp.sum(x32 * x32, axis=1, keepdims=True) / dh + eps)             # [Bt, 1]
    w = 1.0 + plgpu.load(w_ref.at[_iota((dh,), 0)]).astype(jnp.float32)[None, :]
    xn = (x32 * rs * w).astype(x.dtype)
    plgpu.store(o_ref.at[trow, h * dh + cols], xn.astype(o_ref.dtype), mask=row_ok & (cols >= rotary_dim))

    def part(c0):                       # normed columns c0 .. c0 + R/2, and cos / sin there
        xp = plgpu.load(qg_ref.at[trow_c, col0 + c0 + hc], mask=row_ok, other=0)
        wp = 1.0 + plgpu.load(w_ref.at[c0 + _iota((half,), 0)]).astype(jnp.float32)[None, :]
        xpn = (xp.astype(jnp.float32) * rs * wp).astype(x.dtype).astype(jnp.float32)
        cs = plgpu.load(cos_ref.at[trow_c, c0 + hc], mask=row_ok, other=1.0)
        sn = plgpu.load(sin_ref.at[trow_c, c0 + hc], mask=row_ok, other=0.0)
        return xpn, cs, sn
    x1, c1, s1 = part(0)
    x2, c2, s2 = part(half)
    plgpu.store(o_ref.at[trow, h * dh + hc], (x1 * c1 - x2 * s1).astype(o_ref.dtype), mask=row_ok)
    plgpu.store(o_ref.at[trow, h * dh + half + hc], (x2 * c2 + x1 * s2).astype(o_ref.dtype), mask=row_ok)


def gated_query_pallas(qg, q_norm, cos, sin, *, num_heads: int, head_dim: int, eps: float, interpret: bool = False,
                       block_t: int = None, num_warps: int = None, layout: str = None):
    """q [T, H, Dh] = RoPE(RMSNorm(query)) from q_proj's raw output (module docstring). block_t, num_warps,
    layout: None takes ``BLOCK_T``, ``NUM_WARPS``, ``LAYOUT`` ("halves" needs R / 2 a power of two; else
    "gather")."""
    block_t = int(block_t or BLOCK_T)
    num_warps = int(num_warps or NUM_WARPS)
    layout = layout or LAYOUT
    if layout not in ("gather", "halves"):
        raise ValueError(f"layout must be 'gather' or 'halves', got {layout!r}")
    t, c = qg.shape
    dh, h = int(head_dim), int(num_heads)
    r = cos.shape[1]
    if c < 2 * h * dh:
        raise ValueError(f"qg has {c} columns, fewer than num_heads * 2 * head_dim = {2 * h * dh}")
    if tuple(q_norm.shape) != (dh,):
        raise ValueError(f"q_norm must be [Dh] = [{dh}], got {list(q_norm.shape)}")
    if r % 2 or r > dh or cos.shape != (t, r) or sin.shape != (t, r):
        raise ValueError(f"cos, sin must be [T, R] with R even and <= Dh; got {list(cos.shape)}, {list(sin.shape)}")
    if dh & (dh - 1):
        raise ValueError(f"head_dim={dh} must be a power of two (one Triton tile per head)")
    if t == 0:
        return jnp.zeros((0, h, dh), qg.dtype)
    extra = (cos.astype(jnp.float32), sin.astype(jnp.float32)) if r else ()
    halves = layout == "halves" and r and not (r // 2) & (r // 2 - 1)
    kernel = functools.partial(_kernel_halves if halves else _kernel, block_t=block_t, num_tokens=t, dh=dh,
                               eps=float(eps), rotary_dim=int(r))
    out = pl.pallas_call(
        kernel, grid=(pl.cdiv(t, block_t), h), out_shape=jax.ShapeDtypeStruct((t, h * dh), qg.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="gated_q_prologue")(qg, q_norm, *extra)
    return out.reshape(t, h, dh)
