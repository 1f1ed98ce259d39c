"""Pallas (Triton lowering) decode kernel: the per-token gated delta rule over a state-slot pool, in place.

One program per (stream n, value head h, value block): it reads its [K, BV] block of the state from
``pool[slot_ids[n], h]`` (zeros when ``has_initial_state[n]`` is False or the id names no slot), runs the T tokens
of the stream (T = 1 for decode, a few for speculative decoding) with the state in registers, stores the outputs
and writes the block back to the same slot (the pool is aliased: donated, it is updated in place; an id outside
[0, S) drops the write). Per token, with value head h reading key head h // (Hv // Hk):

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t)

optionally with q_t, k_t L2-normalised in fp32 first (``x * rsqrt(sum x^2 + 1e-6)``). With
``DecodeConfig.fused_output`` (the default) it is computed from the loaded S as a = exp(g_t),
delta = beta_t (v_t - a S^T k_t), o_t = scale (a S^T q_t + (q_t . k_t) delta), S = a S + k_t delta^T: the same
numbers up to fp32 rounding, with two independent K reductions. The state bytes (read once, written once) are the
whole cost: 256 streams x 32 heads x 128 x 128 fp32 is 0.54 GB each way.

Where it runs: the op's dispatch table (``api.py``) picks, for "auto", ``gated_delta_rule/mosaic_gpu/decode.py``'s
direct kernel for a one-token call on a Hopper GPU, and this kernel for the rest (T > 1, other GPUs, other head
dims; backend "pallas" always, "pallas_interpret" in interpret mode). Why the Mosaic one is faster (ncu on the
H200): Triton lays the [128, 64] block out with 32 rows a thread, so each thread also holds 32 values of q and
of k; this kernel takes 249 registers a thread, 4 two-warp programs an SM, 0.298 ms at N256, where its copy twin
(138 registers, 6 programs) takes 0.274; Pallas Triton gives no handle on the layout. The
Mosaic kernel's layout holds 16 rows a thread and runs at its own copy's speed (0.278; ``python -m benchmarks decode``).

Shape legend: N streams, T tokens per stream, S slots, Hk / Hv key / value heads, K / V head dims (powers of two
>= 16: the entry point pads), BV value block.

    q, k [N, T, Hk, K]; v [N, T, Hv, V]; g, beta [N, T, Hv]; pool [S, Hv, K, V] fp32;
    slot_ids, has_initial_state [N] int32  ->  o [N, T, Hv, V] in v's dtype, pool (aliased)

With ``RawGates`` (the GDN layer's fused decode step) g and beta are made inside from the raw projections:
g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), a and b given in place of g and beta as [N, T, Hk, Ca].

``fused_recurrent_gated_delta_rule_slots_fwd`` (called by api.py after validation) pads head dims to the kernel's
sizes and guards against autodiff as the prefill entry points do. This module imports only jax (and its folder).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule.triton import chunk as triton_chunk

L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel.

    block_v: the value block of one program (a power of two; min(block_v, V) must divide V).
    num_warps, num_stages: Triton's (one load per program: stages do not pipeline anything).
    v_fastest: grid (V / BV, Hv, N), the value block varying fastest in launch order, so the programs in flight
      together read neighbouring blocks of one slot (one contiguous [Hv, K, V] run of the pool); False: grid
      (N, Hv, V / BV), stream fastest.
    fused_output: o from the state as loaded, o = scale (a S^T q + (q . k) delta), so the two K reductions
      (S^T k, S^T q) are independent and the new state's store does not wait on the second; False: o = S_new^T
      (scale q) after the update (two reductions in a row).

    Defaults from one H200 sweep at N256-Hk16-Hv32 (``python -m benchmarks decode``; the XLA copy of the same
    bytes 0.294 ms): BV 64 / 2 warps / v_fastest / fused 0.314 ms; BV 64 / 4 warps / stream fastest / unfused
    0.331; BV 128 / 8 warps 0.330; BV 32 0.34-0.36; BV 16 0.43-0.44; BV 8 / 1 warp (FLA's shape) 0.546.
    Qwen3.5-397B heads (N64-Hv64): 0.170 against 0.194.
    """
    block_v: int = 64
    num_warps: int = 2
    num_stages: int = 1
    v_fastest: bool = True
    fused_output: bool = True


def decode_config(n: int, hv: int, kdim: int, vdim: int) -> DecodeConfig:
    """The launch parameters for N streams x Hv heads x K x V (kernel dims), chosen at trace time: one config
    measured best or within noise at every size swept (N 1 / 64 / 256, Hv 32 / 64, K = V = 128); for V < 64 the
    value block is V (``fused_recurrent_slots`` clamps it)."""
    del n, hv, kdim, vdim
    return DecodeConfig()


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))          # jax.nn.softplus's form


def _read_gates(g_ref, beta_ref, gate_refs, *, n, t, h, group):
    """(g_t, beta_t) fp32 scalars of stream n, token t, value head h: read, or (``gate_refs`` = (A_log, dt_bias)
    refs [Hv]) made from the raw projections, g_ref = a and beta_ref = b [N, T, Hk, Ca] with value head h at
    column ``h % group`` of key head h // group (see ``fused_recurrent_slots``'s ``raw_gates``)."""
    if gate_refs is None:
        return g_ref[n, t, h].astype(jnp.float32), beta_ref[n, t, h].astype(jnp.float32)
    alog_ref, dtb_ref, a_off, b_off = gate_refs
    hk, j = h // group, h % group
    a = g_ref[n, t, hk, a_off + j].astype(jnp.float32)
    b = beta_ref[n, t, hk, b_off + j].astype(jnp.float32)
    g = -jnp.exp(alog_ref[h].astype(jnp.float32)) * _softplus(a + dtb_ref[h].astype(jnp.float32))
    return g, jax.nn.sigmoid(b)


def _run_tokens(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, *, n, h, hk, vs, scale, use_qk_l2norm, num_tokens,
                fused_output, gate_refs=None, group=1):
    """The T tokens of stream n on value head h's [K, BV] state block ``s`` (columns ``vs``); stores o and returns
    the new block."""

    def token(t, s):
        q = q_ref[n, t, hk, :].astype(jnp.float32)                              # [K]
        k = k_ref[n, t, hk, :].astype(jnp.float32)                              # [K]
        if use_qk_l2norm:
            q = q * lax.rsqrt(jnp.sum(q * q) + L2_EPS)
            k = k * lax.rsqrt(jnp.sum(k * k) + L2_EPS)
        v = v_ref[n, t, h, vs].astype(jnp.float32)                              # [BV]
        g, beta = _read_gates(g_ref, beta_ref, gate_refs, n=n, t=t, h=h, group=group)
        a = jnp.exp(g)
        if fused_output:
            sk = jnp.sum(k[:, None] * s, axis=0)                                # [BV]  S^T k
            sq = jnp.sum(q[:, None] * s, axis=0)                                # [BV]  S^T q
            delta = beta * (v - a * sk)
            o = scale * (a * sq + jnp.sum(q * k) * delta)
            s = a * s + k[:, None] * delta[None, :]
        else:
            s = a * s
            delta = beta * (v - jnp.sum(k[:, None] * s, axis=0))                # [BV]
            s = s + k[:, None] * delta[None, :]
            o = jnp.sum((scale * q)[:, None] * s, axis=0)
        o_ref[n, t, h, vs] = o.astype(o_ref.dtype)
        return s

    if num_tokens == 1:
        return token(0, s)
    return lax.fori_loop(0, num_tokens, token, s)


def _split_refs(refs, gate_offsets):
    """(A_log, dt_bias) refs + offsets (or None), pool_in, o, pool_out from the refs after beta's."""
    if gate_offsets is None:
        return (None,) + tuple(refs)
    alog_ref, dtb_ref, pool_in_ref, o_ref, pool_out_ref = refs
    return (alog_ref, dtb_ref) + tuple(gate_offsets), pool_in_ref, o_ref, pool_out_ref


def _program_slot(slot_ref, pool_in_ref, *, v_fastest: bool, block_v: int):
    """The decode kernels' program coordinates: (stream n, value head h, value columns vs, in_pool, read_slot). The
    grid is (N, Hv, V / BV), or (V / BV, Hv, N) when v_fastest; an id outside [0, S) names no slot (in_pool False:
    zeros in, no write), read_slot its clipped id for the loads."""
    if v_fastest:
        vb, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:
        n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_slots = pool_in_ref.shape[0]
    slot = slot_ref[n]
    in_pool = (slot >= 0) & (slot < num_slots)
    return n, h, pl.ds(vb * block_v, block_v), in_pool, jnp.clip(slot, 0, num_slots - 1)


def _decode_kernel(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, group, block_v, v_fastest,
                   gate_offsets, **token_args):
    """One program per (stream, value head, value block). refs: [A_log, dt_bias (raw gates only),] pool_in, o,
    pool_out."""
    gate_refs, pool_in_ref, o_ref, pool_out_ref = _split_refs(refs, gate_offsets)
    n, h, vs, in_pool, read_slot = _program_slot(slot_ref, pool_in_ref, v_fastest=v_fastest, block_v=block_v)
    read = (has_ref[n] != 0) & in_pool
    s = pool_in_ref[read_slot, h, :, vs].astype(jnp.float32)                # [K, BV]
    s = jnp.where(read, s, 0.0)                                             # select: a stale NaN never leaks
    s = _run_tokens(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, n=n, h=h, hk=h // group, vs=vs,
                    gate_refs=gate_refs, group=group, **token_args)

    @pl.when(in_pool)
    def _():
        pool_out_ref[read_slot, h, :, vs] = s.astype(pool_out_ref.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["a_log", "dt_bias"],
                   meta_fields=["a_offset", "b_offset"])
@dataclasses.dataclass(frozen=True)
class RawGates:
    """The gates made inside the decode kernel from the raw projections (the layer's decode step, one launch less):
    g = -exp(A_log[h]) softplus(a + dt_bias[h]), beta = sigmoid(b) in fp32, with ``g`` and ``beta`` given as a and
    b, each [N, T, Hk, Ca] (value head h of key head h // r at column ``a_offset + h % r`` / ``b_offset + h % r``,
    r = Hv / Hk): Qwen3-Next's in_proj_ba output [N, T, Hk, 2 r] ([b (r) | a (r)] per key head) passed twice with
    a_offset r, b_offset 0; Qwen3.5's separate a, b [N, T, Hv] reshaped to [N, T, Hk, r], offsets 0.

    a_log, dt_bias: [Hv] (any float dtype; read as fp32). A pytree (the arrays are its leaves): it passes through
    jax.jit as an argument."""
    a_log: jax.Array
    dt_bias: jax.Array
    a_offset: int = 0
    b_offset: int = 0


def fused_recurrent_slots(q, k, v, g, beta, *, pool, slot_ids, has_initial_state, scale, use_qk_l2norm,
                          interpret, config: DecodeConfig | None = None, raw_gates: RawGates | None = None):
    """Runs the decode kernel (shapes in the module docstring; K, V powers of two >= 16, V % block_v == 0).
    config: None picks ``decode_config`` for the shapes. raw_gates: None (g, beta [N, T, Hv] as given) or
    ``RawGates`` (g, beta are the raw a, b projections [N, T, Hk, Ca]). Returns (o [N, T, Hv, V] in v's dtype, the
    updated pool [S, Hv, K, V] fp32, aliased to ``pool``)."""
    n, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    config = config or decode_config(n, hv, kdim, vdim)
    block_v = min(config.block_v, vdim)
    if vdim % block_v:
        raise ValueError(f"DecodeConfig.block_v ({config.block_v}) must divide V = {vdim}")
    operands = dict(slot_ids=slot_ids.astype(jnp.int32), has_initial_state=has_initial_state.astype(jnp.int32),
                    q=q, k=k, v=v, g=g, beta=beta)
    gate_offsets = None
    if raw_gates is not None:
        operands.update(a_log=raw_gates.a_log, dt_bias=raw_gates.dt_bias)
        gate_offsets = (int(raw_gates.a_offset), int(raw_gates.b_offset))
    operands["pool"] = pool
    nvb = vdim // block_v
    common = dict(group=hv // hk, block_v=block_v, scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm),
                  num_tokens=t, fused_output=config.fused_output, gate_offsets=gate_offsets)
    kernel = functools.partial(_decode_kernel, v_fastest=config.v_fastest, **common)
    grid = (nvb, hv, n) if config.v_fastest else (n, hv, nvb)
    call = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=(jax.ShapeDtypeStruct((n, t, hv, vdim), v.dtype),
                   jax.ShapeDtypeStruct(pool.shape, jnp.float32)),
        input_output_aliases={list(operands).index("pool"): 1},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_decode",
    )
    return call(*operands.values())


def fused_recurrent_gated_delta_rule_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state,
                                               use_qk_l2norm=False, interpret=False,
                                               config: DecodeConfig = None, raw_gates: RawGates | None = None):
    """Per-token gated delta rule of N streams over a state-slot pool, in place (the decode kernel).

    q, k [N, T, Hk, K]; v [N, T, Hv, V]; g, beta [N, T, Hv] (or, with ``raw_gates``, the raw a, b projections
    [N, T, Hk, Ca]: see ``RawGates``); ssm_state [S, Hv, K, V] fp32 (aliased: donate it); slot_ids [N] int32 (an id
    outside [0, S) reads zeros and drops its write), has_initial_state [N] bool.
    Returns (o [N, T, Hv, V] in v's dtype, new ssm_state). Head dims that are not one of GPU_HEAD_DIMS are
    zero-padded (then the pool is copied, not updated in place).
    """
    n, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    if scale is None:
        scale = kdim ** -0.5
    if n == 0 or t == 0:
        return jnp.zeros(v.shape, v.dtype), ssm_state
    kp, vp = triton_chunk.kernel_head_dim(kdim), triton_chunk.kernel_head_dim(vdim)
    q, k, v = triton_chunk.pad_last(q, kp), triton_chunk.pad_last(k, kp), triton_chunk.pad_last(v, vp)
    pool = ssm_state
    padded = (kp, vp) != (kdim, vdim)
    if padded:
        pool = jnp.pad(pool, [(0, 0), (0, 0), (0, kp - kdim), (0, vp - vdim)])
    cfg = config or decode_config(n, hv, kp, vp)

    gate_arrays = () if raw_gates is None else (raw_gates.a_log, raw_gates.dt_bias)

    def kernel(q, k, v, g, beta, pool, slot_ids, has, *gate_arrays):
        gates = None if raw_gates is None else dataclasses.replace(raw_gates, a_log=gate_arrays[0],
                                                                   dt_bias=gate_arrays[1])
        return fused_recurrent_slots(q, k, v, g, beta, pool=pool, slot_ids=slot_ids, has_initial_state=has,
                                     scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=interpret, config=cfg,
                                     raw_gates=gates)

    o, new_pool = triton_chunk.no_autodiff(kernel)(q, k, v, g, beta, pool, slot_ids.astype(jnp.int32),
                                                   has_initial_state.astype(jnp.int32), *gate_arrays)
    if padded:
        o, new_pool = o[..., :vdim], new_pool[:, :, :kdim, :vdim]
    return o, new_pool
