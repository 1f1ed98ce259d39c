"""Pallas (Triton lowering) kernel: causal depthwise conv1d + SiLU + per-head L2 norm of q and k, varlen over
``cu_seqlens`` with conv-state slots, in one pass over the projection's output.

Shape legend: T stacked tokens, Cs source columns, C = (2 Hk + Hv) D conv channels ([q | k | v]), D head dim
(K == V), Kc kernel size, N streams, BT tokens per program.

Grid (cdiv(T, BT), 2 Hk + Hv): one program = BT tokens x one head block of D channels (so the L2 norm of a q or k
head is a row reduction inside the tile). It loads the block's Kc shifted [BT, D] tiles straight from the source
columns ``block_cols[b]`` (Qwen3-Next's fused per-key-head ``in_proj_qkvz`` output, or an identity layout), takes
the taps that reach before a stream's first token from its start state (a masked gather of the tiny
[N (Kc - 1), C] start-state rows), accumulates in fp32, applies SiLU, normalises q / k heads and writes q, k or v.
Padding tokens (t >= cu_seqlens[N], given rel = -1 by the caller) are written as zeros. The new conv states are
the caller's (a [N, Kc - 1] row gather in XLA: reference.new_conv_states). Semantics: reference.conv1d_l2_varlen.

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
    """block_t: tokens per program (a power of two); num_warps / num_stages: Triton launch parameters."""
    block_t: int = 64
    num_warps: int = 4
    num_stages: int = 1


def _kernel(cols_ref, seq_ref, rel_ref, src_ref, w_ref, prev_ref, q_ref, k_ref, v_ref, *, t: int, hk: int,
            d: int, dp: int, kc: int, block_t: int, eps: float):
    """cols_ref [NB] int32 source column of each head block; seq_ref / rel_ref [T] int32 (stream, position in it;
    rel = -1 for padding tokens); src_ref [T, Cs]; w_ref [Kc, C] fp32; prev_ref [N (Kc-1), C] fp32 start states;
    q_ref, k_ref [T, Hk D]; v_ref [T, Hv D]."""
    pid_t, b = pl.program_id(0), pl.program_id(1)
    rows = pid_t * block_t + jnp.arange(block_t, dtype=jnp.int32)                   # [BT]
    row_ok = rows < t
    rel = plgpu.load(rel_ref.at[rows], mask=row_ok, other=-1)
    seq = plgpu.load(seq_ref.at[rows], mask=row_ok, other=0)
    live = rel >= 0
    ci = jnp.arange(dp, dtype=jnp.int32)                                            # [Dp]
    c_ok = ci < d
    src_c = cols_ref[b] + ci                                                        # [Dp] source columns
    chan = b * d + ci                                                               # [Dp] conv channels
    m2 = live[:, None] & c_ok[None, :]
    x0 = plgpu.load(src_ref.at[rows[:, None], src_c[None, :]], mask=m2, other=0).astype(_F32)
    acc = plgpu.load(w_ref.at[kc - 1, chan], mask=c_ok, other=0)[None, :] * x0      # [BT, Dp]
    for j in range(kc - 1):
        lag = kc - 1 - j
        inside = rel >= lag
        xr = plgpu.load(src_ref.at[(rows - lag)[:, None], src_c[None, :]], mask=inside[:, None] & c_ok[None, :],
                        other=0).astype(_F32)
        from_state = live & (rel < lag)
        prow = seq * (kc - 1) + jnp.clip(kc - 1 - lag + rel, 0, kc - 2)
        st = plgpu.load(prev_ref.at[prow[:, None], chan[None, :]], mask=from_state[:, None] & c_ok[None, :],
                        other=0)
        wj = plgpu.load(w_ref.at[j, chan], mask=c_ok, other=0)
        acc += wj[None, :] * (xr + st)                                              # masks are exclusive
    y = acc * jax.nn.sigmoid(acc)                                                   # SiLU
    inv = jax.lax.rsqrt(jnp.sum(y * y, axis=1, keepdims=True) + eps)                # [BT, 1]
    y_qk = jnp.where(live[:, None], y * inv, 0.0)
    y_v = jnp.where(live[:, None], y, 0.0)
    out_mask = row_ok[:, None] & c_ok[None, :]

    @pl.when(b < hk)
    def _():
        plgpu.store(q_ref.at[rows[:, None], (b * d + ci)[None, :]], y_qk.astype(q_ref.dtype), mask=out_mask)

    @pl.when((b >= hk) & (b < 2 * hk))
    def _():
        plgpu.store(k_ref.at[rows[:, None], ((b - hk) * d + ci)[None, :]], y_qk.astype(k_ref.dtype), mask=out_mask)

    @pl.when(b >= 2 * hk)
    def _():
        plgpu.store(v_ref.at[rows[:, None], ((b - 2 * hk) * d + ci)[None, :]], y_v.astype(v_ref.dtype),
                    mask=out_mask)


def conv1d_l2_pallas(src: jax.Array, w: jax.Array, prev: jax.Array, seq: jax.Array, rel: jax.Array,
                     block_cols: jax.Array, *, num_k_heads: int, num_v_heads: int, head_dim: int, eps: float = 1e-6,
                     interpret: bool = False, config: Conv1dConfig | None = None):
    """src [T, Cs]; w [C, Kc]; prev [N, C, Kc - 1] fp32 start states (zeros for fresh streams); seq, rel [T] int32
    (rel = -1 for padding tokens); block_cols [2 Hk + Hv] int32. Returns q, k [T, Hk, D] (L2-normalised), v [T, Hv,
    D] in src's dtype."""
    config = config or Conv1dConfig()
    t = src.shape[0]
    c, kc = w.shape
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    n = prev.shape[0]
    nb = 2 * hk + hv
    dp = max(16, 1 << (d - 1).bit_length())
    wt = jnp.asarray(w, _F32).T                                                      # [Kc, C]
    prev_rows = (jnp.swapaxes(prev.astype(_F32), 1, 2).reshape(n * (kc - 1), c) if kc > 1
                 else jnp.zeros((1, c), _F32))
    kernel = functools.partial(_kernel, t=t, hk=hk, d=d, dp=dp, kc=kc, block_t=config.block_t, eps=eps)
    q, k, v = pl.pallas_call(
        kernel, grid=(pl.cdiv(t, config.block_t), nb),
        out_shape=(jax.ShapeDtypeStruct((t, hk * d), src.dtype), jax.ShapeDtypeStruct((t, hk * d), src.dtype),
                   jax.ShapeDtypeStruct((t, hv * d), src.dtype)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="conv1d_silu_l2")(block_cols, seq, rel, src, wt, prev_rows)
    return q.reshape(t, hk, d), k.reshape(t, hk, d), v.reshape(t, hv, d)
