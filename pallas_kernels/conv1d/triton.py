"""Pallas (Triton lowering) kernel: causal depthwise conv1d + SiLU + per-head L2 norm of q and k, varlen over
``cu_seqlens`` with conv-state slots, in one pass over the projection's output.

Shape legend: T stacked tokens, Cs source columns, C = (2 Hk + Hv) D conv channels ([q | k | v]), D head dim
(K == V), Kc kernel size, N streams, BT tokens per program.

Grid (cdiv(T, BT), 2 Hk + Hv): one program = BT tokens x one head block of D channels (so the L2 norm of a q or k
head is a row reduction inside the tile). It loads the block's Kc shifted [BT, D] tiles straight from the source
columns ``block_cols[b]`` (Qwen3-Next's fused per-key-head ``in_proj_qkvz`` output, or an identity layout),
accumulates in fp32, applies SiLU, normalises q / k heads and writes q, k or v. The stacked tokens are convolved
as one stream (no per-token stream lookup, no state gather): the caller rewrites the first Kc - 1 rows of every
stream from its start state and computes the new conv states (reference.fix_boundaries / new_conv_states, tiny
XLA ops). Padding tokens (t >= cu_seqlens[N]) are written as zeros. Semantics: reference.conv1d_l2_varlen.

This module imports only jax.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Conv1dConfig:
    """block_t: tokens per program (a power of two); num_warps / num_stages: Triton launch parameters. Default: the
    best of the H200 sweep of the kernel's first form at 80B dims (64 x 8 warps 0.51 ms, 32 x 4 0.56, 64 x 4 0.72,
    128 x 8 0.75, 128 x 4 1.10; ``python -m benchmarks layers``)."""
    block_t: int = 64
    num_warps: int = 8
    num_stages: int = 1


def _kernel(tv_ref, cols_ref, src_ref, w_ref, q_ref, k_ref, v_ref, *, t: int, hk: int, d: int, dp: int, kc: int,
            block_t: int, eps: float):
    """tv_ref [1] int32 = cu_seqlens[N] (rows past it are padding: zeros); cols_ref [NB] int32 source column of each
    head block; src_ref [T, Cs]; w_ref [Kc, C] fp32; q_ref, k_ref [T, Hk D]; v_ref [T, Hv D].
    The stacked tokens are convolved as ONE stream (tap x[t - lag], zeros before row 0): the caller rewrites the
    first Kc - 1 rows of every stream from its start state (reference.fix_boundaries)."""
    pid_t, b = pl.program_id(0), pl.program_id(1)
    rows = pid_t * block_t + jnp.arange(block_t, dtype=jnp.int32)                   # [BT]
    live = rows < tv_ref[0]
    ci = jnp.arange(dp, dtype=jnp.int32)                                            # [Dp]
    c_ok = ci < d if dp != d else None              # no column mask when D is a power of two: vectorised access
    src_c = pl.multiple_of(cols_ref[b], 16) + ci                                    # [Dp] source columns
    chan = b * d + ci                                                               # [Dp] conv channels

    def mask2(row_mask):
        return row_mask[:, None] if c_ok is None else row_mask[:, None] & c_ok[None, :]

    acc = jnp.zeros((block_t, dp), _F32)
    for j in range(kc):
        lag = kc - 1 - j
        r = rows - lag
        xr = plgpu.load(src_ref.at[r[:, None], src_c[None, :]], mask=mask2((r >= 0) & live), other=0)
        wj = plgpu.load(w_ref.at[j, chan]) if c_ok is None else plgpu.load(w_ref.at[j, chan], mask=c_ok, other=0)
        acc += wj[None, :] * xr.astype(_F32)
    y = acc * jax.nn.sigmoid(acc)                                                   # SiLU (0 on padding rows)
    y_qk = y * jax.lax.rsqrt(jnp.sum(y * y, axis=1, keepdims=True) + eps)
    out_mask = mask2(rows < t)

    @pl.when(b < hk)
    def _():
        plgpu.store(q_ref.at[rows[:, None], (b * d + ci)[None, :]], y_qk.astype(q_ref.dtype), mask=out_mask)

    @pl.when((b >= hk) & (b < 2 * hk))
    def _():
        plgpu.store(k_ref.at[rows[:, None], ((b - hk) * d + ci)[None, :]], y_qk.astype(k_ref.dtype), mask=out_mask)

    @pl.when(b >= 2 * hk)
    def _():
        plgpu.store(v_ref.at[rows[:, None], ((b - 2 * hk) * d + ci)[None, :]], y.astype(v_ref.dtype), mask=out_mask)


def conv1d_l2_pallas(src: jax.Array, w: jax.Array, total_valid: jax.Array, block_cols: jax.Array, *,
                     num_k_heads: int, num_v_heads: int, head_dim: int, eps: float = 1e-6, interpret: bool = False,
                     config: Conv1dConfig | None = None):
    """src [T, Cs]; w [C, Kc]; total_valid [] int32 (cu_seqlens[N]); block_cols [2 Hk + Hv] int32 (multiples of 16
    on a GPU: the loads are vectorised on that promise). Returns q, k [T, Hk, D] (L2-normalised), v [T, Hv, D] in
    src's dtype, the stacked tokens convolved as one stream (see ``_kernel``)."""
    config = config or Conv1dConfig()
    t = src.shape[0]
    c, kc = w.shape
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    nb = 2 * hk + hv
    dp = max(16, 1 << (d - 1).bit_length())
    wt = jnp.asarray(w, _F32).T                                                      # [Kc, C]
    kernel = functools.partial(_kernel, t=t, hk=hk, d=d, dp=dp, kc=kc, block_t=config.block_t, eps=eps)
    q, k, v = pl.pallas_call(
        kernel, grid=(pl.cdiv(t, config.block_t), nb),
        out_shape=(jax.ShapeDtypeStruct((t, hk * d), src.dtype), jax.ShapeDtypeStruct((t, hk * d), src.dtype),
                   jax.ShapeDtypeStruct((t, hv * d), src.dtype)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="conv1d_silu_l2")(jnp.reshape(total_valid.astype(jnp.int32), (1,)), block_cols,
                                                    src, wt)
    return q.reshape(t, hk, d), k.reshape(t, hk, d), v.reshape(t, hv, d)
