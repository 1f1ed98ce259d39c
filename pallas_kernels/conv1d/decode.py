"""Pallas (Triton lowering) kernel: the decode step of the causal depthwise conv1d + SiLU + per-head L2 norm of q
and k, ONE token per stream, each stream's conv state read from and written back to its slot of the pool in place.

Shape legend: N streams (one token each), Cs source columns, C = (2 Hk + Hv) D conv channels ([q | k | v]), D head
dim (K == V, a power of two), Kc kernel size, S slots.

Grid (N, 2 Hk + Hv): one program = one stream x one head block of D channels. It reads the stream's conv state
``pool[slot_ids[n], block channels, :]`` (Kc - 1 [D] taps; zeros where has_initial_state is False or the id is
outside [0, S), by masked loads: a stale NaN is never read), the token's [D] inputs from the source
columns ``block_cols[b]`` (Qwen3-Next's fused ``in_proj_qkvz`` output read in place, or the identity layout),
computes ``y = silu(sum_j w[c, j] xs[j])`` in fp32 (xs = the state's Kc - 1 taps then the token), L2-normalises q
and k heads (``y * rsqrt(sum y^2 + eps)``, over the fp32 y), writes q, k or v, and writes the shifted state
(taps 1.. then the token) back to the slot (the pool is aliased: donated, it is updated in place; an id outside
[0, S) drops the write). Each (stream, channel) is owned by one program, so the in-place update has no race
(distinct slot ids among the streams that name a slot, as every slot op assumes).

Semantics: ``reference.conv1d_l2_varlen`` with ``cu_seqlens = arange(N + 1)`` (one token per stream); the
conv_l2 decode entry point is ``api.causal_conv1d_l2_decode``. This module imports only jax.
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
class ConvDecodeConfig:
    """num_warps / num_stages: Triton launch parameters of the one-stream programs. Default chosen without a GPU
    measurement (the kernel moves ~3 MB at N 64, 80B dims: a few us at any launch shape)."""
    num_warps: int = 1
    num_stages: int = 1


def _kernel(slot_ref, has_ref, cols_ref, x_ref, w_ref, pool_in_ref, q_ref, k_ref, v_ref, pool_out_ref, *, hk: int,
            d: int, kc: int, eps: float):
    """slot_ref, has_ref [N] int32; cols_ref [2 Hk + Hv] int32 source column of each head block; x_ref [N, Cs];
    w_ref [Kc, C] fp32; pool_in_ref / pool_out_ref [S, C, Kc - 1] (aliased); q_ref, k_ref [N, Hk D];
    v_ref [N, Hv D]. One program = stream n x head block b (D channels)."""
    n, b = pl.program_id(0), pl.program_id(1)
    num_slots = pool_in_ref.shape[0]
    slot = slot_ref[n]
    in_pool = (slot >= 0) & (slot < num_slots)          # an id outside [0, S) names no slot: zeros in, no write
    read = jnp.broadcast_to(in_pool & (has_ref[n] != 0), (d,))
    slot_c = jnp.clip(slot, 0, num_slots - 1)
    chans = pl.ds(pl.multiple_of(b * d, d), d)                                      # [D] conv channels
    x = x_ref[n, pl.ds(pl.multiple_of(cols_ref[b], 16), d)]                         # [D] the token (source cols)
    taps = [plgpu.load(pool_in_ref.at[slot_c, chans, jnp.int32(j)], mask=read, other=0)       # masked: a stale NaN is
            for j in range(kc - 1)]                                                 # never read; Kc - 1 x [D]
    acc = w_ref[kc - 1, chans] * x.astype(_F32)
    for j in range(kc - 1):
        acc += w_ref[j, chans] * taps[j].astype(_F32)
    y = acc * jax.nn.sigmoid(acc)                                                   # SiLU, fp32

    @pl.when(b < 2 * hk)
    def _():
        y_qk = y * jax.lax.rsqrt(jnp.sum(y * y) + eps)

        @pl.when(b < hk)
        def _():
            q_ref[n, chans] = y_qk.astype(q_ref.dtype)

        @pl.when(b >= hk)
        def _():
            k_ref[n, pl.ds(pl.multiple_of((b - hk) * d, d), d)] = y_qk.astype(k_ref.dtype)

    @pl.when(b >= 2 * hk)
    def _():
        v_ref[n, pl.ds(pl.multiple_of((b - 2 * hk) * d, d), d)] = y.astype(v_ref.dtype)

    @pl.when(in_pool)
    def _():
        new_taps = taps[1:] + [x]                                                   # the state shifted by one
        for j in range(kc - 1):
            pool_out_ref[slot_c, chans, jnp.int32(j)] = new_taps[j].astype(pool_out_ref.dtype)


def conv1d_l2_decode_pallas(x: jax.Array, w: jax.Array, conv_state_pool: jax.Array, slot_ids: jax.Array,
                            has_initial_state: jax.Array, block_cols: jax.Array, *, num_k_heads: int,
                            num_v_heads: int, head_dim: int, eps: float = 1e-6, interpret: bool = False,
                            config: ConvDecodeConfig | None = None):
    """x [N, Cs] (one token per stream); w [C, Kc]; conv_state_pool [S, C, Kc - 1] (aliased: donate it);
    slot_ids [N] int32; has_initial_state [N] (bool or int); block_cols [2 Hk + Hv] int32 (multiples of 16 on a GPU).
    Returns (q, k [N, Hk, D] L2-normalised, v [N, Hv, D] in x's dtype; the pool with the N streams' states
    advanced). Kc >= 2 and D a power of two (the caller checks)."""
    config = config or ConvDecodeConfig()
    n = x.shape[0]
    c, kc = w.shape
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    nb = 2 * hk + hv
    wt = jnp.asarray(w, _F32).T                                                     # [Kc, C]
    kernel = functools.partial(_kernel, hk=hk, d=d, kc=kc, eps=eps)
    operands = dict(slot_ids=slot_ids.astype(jnp.int32), has_initial_state=has_initial_state.astype(jnp.int32),
                    block_cols=block_cols.astype(jnp.int32), x=x, w=wt, pool=conv_state_pool)
    q, k, v, pool = pl.pallas_call(
        kernel, grid=(n, nb),
        out_shape=(jax.ShapeDtypeStruct((n, hk * d), x.dtype), jax.ShapeDtypeStruct((n, hk * d), x.dtype),
                   jax.ShapeDtypeStruct((n, hv * d), x.dtype),
                   jax.ShapeDtypeStruct(conv_state_pool.shape, conv_state_pool.dtype)),
        input_output_aliases={list(operands).index("pool"): 3},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="conv1d_decode")(*operands.values())
    return q.reshape(n, hk, d), k.reshape(n, hk, d), v.reshape(n, hv, d), pool
