"""Public entry points of the Pallas gated delta rule forward (called by jax_gdn.ops after validation).

Shape legend: B batch, T tokens, N sequences (streams), S state slots, Hk key heads, Hv value heads (Hv = r Hk;
value head h reads key head h // r), K key dim, V value dim, C chunk size, NC = B*T // C + N chunk slots.

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; g (fp32 log-decay), beta [B, T, Hv]
    initial_state [N, Hv, K, V] fp32 | ssm_state pool [S, Hv, K, V] fp32
    cu_seqlens [N + 1] int32 (then B == 1) or None (dense: N = B)
    -> o [B, T, Hv, V] in v's dtype, final state fp32

Per token: S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T (scale q_t).

Everything is traced: the chunk map comes from cu_seqlens on the device (static bound NC), so one compiled program
serves every packing with the same T and N, with no device-to-host sync.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta_rule import decode as _decode
from pallas_kernels.gated_delta_rule import triton as _triton

GPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
GPU_HEAD_DIMS = (16, 32, 64, 128)   # the dims the kernels are compiled for; others up to 128 are zero-padded
MAX_HEAD_DIM = GPU_HEAD_DIMS[-1]    # 256 not yet compiled/tested on the H200


def kernel_head_dim(d: int) -> int:
    """The head dim the kernels run for a head dim ``d`` <= MAX_HEAD_DIM: the smallest of GPU_HEAD_DIMS >= d.
    q, k (K) and v (V) and the state are zero-padded to it inside the entry points; zero rows of k and zero
    columns of v leave the rule on the real dims unchanged (q . k and S^T k do not see them, the padded state
    rows / columns stay zero), and the output is sliced back."""
    return next(x for x in GPU_HEAD_DIMS if x >= d)


def compute_dtype(q, v):
    """The one dtype the kernels take: q, k and v promoted together (bf16 v with fp32 q runs in fp32)."""
    return jnp.promote_types(q.dtype, v.dtype)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def supported(q, k, v, *, interpret: bool) -> tuple[bool, str]:
    """(ok, reason): whether the Pallas kernel runs these inputs (see :func:`check_supported`)."""
    try:
        check_supported(q, k, v, interpret=interpret)
    except ValueError as err:
        return False, str(err)
    return True, ""


def check_supported(q, k, v, *, interpret: bool) -> None:
    """Raises ValueError naming the limit when the Pallas kernel cannot run these inputs.

    q, k, v floating ({bfloat16, float16, float32}; promoted to one dtype by the entry points); K and V at most
    MAX_HEAD_DIM = 128 (dims that are not one of GPU_HEAD_DIMS are zero-padded to the next one); Hv a multiple of
    Hk. backend "pallas" (interpret False) needs a GPU; interpret mode runs the same kernels anywhere.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have one shape [B, T, Hk, K]; got q {q.shape}, k {k.shape}")
    if v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"v must be [B, T, Hv, V] with Hv a multiple of Hk={q.shape[2]}; got v {v.shape}")
    if any(jnp.dtype(x.dtype) not in GPU_DTYPES for x in (q, k, v)):
        raise ValueError(
            "pallas gated delta rule: q, k, v must be floating, each one of {bfloat16, float16, float32}; "
            f"got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    kd, vd = q.shape[3], v.shape[3]
    if kd > MAX_HEAD_DIM or vd > MAX_HEAD_DIM:
        raise ValueError(
            f"pallas gated delta rule: head dims K (got {kd}) and V (got {vd}) must each be at most {MAX_HEAD_DIM} "
            f"(the kernels run {GPU_HEAD_DIMS}, smaller dims are zero-padded); use backend='xla' for larger heads")
    if not interpret and not _has_gpu():
        raise ValueError(
            "backend 'pallas' needs a CUDA GPU (Pallas Triton lowering) and none is visible; "
            "use backend='xla', or 'pallas_interpret' to run the same kernel in interpret mode on CPU")


def _no_autodiff(fn):
    """fn with a JVP rule that raises: the Pallas kernels have no backward pass yet, and without this jax.grad
    fails deep inside pallas_call with an empty AssertionError."""
    wrapped = jax.custom_jvp(fn)

    @wrapped.defjvp
    def _jvp(primals, tangents):
        raise NotImplementedError(
            "the Pallas gated delta rule kernels (backend='pallas' / 'pallas_interpret') have no backward pass: "
            "use backend='xla' to differentiate (jax.grad / jax.jvp)")
    return wrapped


# ----------------------------------------------------------------------------------------------------------------
# Chunk maps (plain jnp, traceable)
# ----------------------------------------------------------------------------------------------------------------
def _dense_map(batch: int, seq_len: int, chunk: int):
    """Static chunk map for B equal sequences laid end to end (numpy constants)."""
    per = max(1, math.ceil(seq_len / chunk)) if seq_len > 0 else 0
    j = np.arange(per)
    start = (np.arange(batch)[:, None] * seq_len + j[None, :] * chunk).reshape(-1)
    length = np.broadcast_to(np.minimum(chunk, seq_len - j * chunk), (batch, per)).reshape(-1)
    first = np.arange(batch) * per
    num = np.full((batch,), per)
    if start.size == 0:                        # T == 0: one padding chunk keeps the grid non-empty
        start, length = np.zeros(1), np.zeros(1)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    return i32(start), i32(length), i32(first), i32(num)


def chunk_map_from_cu_seqlens(cu_seqlens, total_len: int, chunk: int):
    """(chunk_start [NC], chunk_len [NC], seq_first_chunk [N], seq_num_chunks [N]) with NC = T // C + N."""
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    nc = total_len // chunk + n
    lens = cu[1:] - cu[:-1]
    num = (lens + chunk - 1) // chunk
    end = jnp.cumsum(num)
    first = end - num
    c = jnp.arange(nc, dtype=jnp.int32)
    valid = c < end[-1]
    seq = jnp.minimum(jnp.searchsorted(end, c, side="right").astype(jnp.int32), n - 1)
    start = cu[seq] + (c - first[seq]) * chunk
    length = jnp.where(valid, jnp.clip(cu[seq + 1] - start, 0, chunk), 0)
    start = jnp.where(valid, start, 0)
    return start, length, first.astype(jnp.int32), num.astype(jnp.int32)


def _maps(batch, seq_len, cu_seqlens, chunk_map, chunk):
    if cu_seqlens is None:
        return _dense_map(batch, seq_len, chunk)
    if chunk_map is not None:
        return (chunk_map.chunk_start.astype(jnp.int32), chunk_map.chunk_len.astype(jnp.int32),
                chunk_map.seq_first_chunk.astype(jnp.int32), chunk_map.seq_num_chunks.astype(jnp.int32))
    return chunk_map_from_cu_seqlens(cu_seqlens, seq_len, chunk)


def _block_v(vdim: int, programs_per_vblock: int) -> int:
    """V block of the state pass: 64 when that still gives >= 256 programs (e.g. 16 streams x 32 heads), else 32
    (B1-T8192-Hk16-Hv32: 128 programs of BV 32 beat 64 of BV 64, 0.200 vs 0.250 ms); at least 16 (Triton dots)."""
    if vdim <= 32:
        return vdim
    bv = 64 if programs_per_vblock * (vdim // 64) >= 256 else 32
    return min(bv, vdim)


def launch_config(vdim: int, programs_per_vblock: int, dtype=jnp.bfloat16) -> _triton.LaunchConfig:
    """The launch parameters for one call: LaunchConfig defaults, block_v from ``_block_v``, and a 2-stage state
    pass for fp32 inputs (3 stages of fp32 tiles need 257 KB of shared memory, over the H200's 227 KB). For
    tuning runs the environment variable JAX_GDN_PALLAS_LAUNCH overrides fields, e.g. "state_stages=2,block_v=64"."""
    cfg = _triton.LaunchConfig(block_v=_block_v(vdim, programs_per_vblock))
    if jnp.dtype(dtype).itemsize > 2:
        cfg = dataclasses.replace(cfg, state_stages=2)
    env = os.environ.get("JAX_GDN_PALLAS_LAUNCH")
    if env:
        cfg = dataclasses.replace(cfg, **{k: int(v) for k, v in (item.split("=") for item in env.split(","))})
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------------
def _pad_last(x, size):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _run(q, k, v, g, beta, *, scale, pool, slot_ids, has_initial_state, cu_seqlens, chunk_map, chunk_size,
         interpret):
    b, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    if chunk_size % _triton.SUB != 0:
        raise ValueError(f"chunk_size must be a multiple of {_triton.SUB} for the Pallas kernels; got {chunk_size}")
    if scale is None:
        scale = kdim ** -0.5
    n = slot_ids.shape[0]
    out_dtype = v.dtype
    if b == 0:           # no rows, no sequences: nothing to run, the pool is unchanged
        return jnp.zeros(v.shape, out_dtype), pool
    dtype = compute_dtype(q, v)
    kp, vp = kernel_head_dim(kdim), kernel_head_dim(vdim)
    q, k = _pad_last(q.astype(dtype), kp), _pad_last(k.astype(dtype), kp)
    v = _pad_last(v.astype(dtype), vp)
    padded_pool = (kp, vp) != (kdim, vdim)
    if padded_pool:
        pool = jnp.pad(pool, [(0, 0), (0, 0), (0, kp - kdim), (0, vp - vdim)])
    start, length, first, num = _maps(b, t, cu_seqlens, chunk_map, chunk_size)
    tt = b * t
    qf = q.reshape(tt, hk, kp)
    kf = k.reshape(tt, hk, kp)
    vf = v.reshape(tt, hv, vp)
    gf = g.reshape(tt, hv).astype(jnp.float32)
    bf = beta.reshape(tt, hv)
    if interpret:
        # Interpret mode clamps out-of-range dynamic slices (which would shift the rows under the mask); pad C
        # rows so that every chunk's [start, start + C) slice is in range. On the GPU masked loads need no pad.
        pad = lambda x: jnp.pad(x, [(0, chunk_size)] + [(0, 0)] * (x.ndim - 1))
        qf, kf, vf, gf, bf = (pad(x) for x in (qf, kf, vf, gf, bf))
    config = launch_config(vp, n * hv, dtype)
    varlen = cu_seqlens is not None
    cu_last = cu_seqlens[-1:].astype(jnp.int32) if varlen else jnp.full((1,), tt, jnp.int32)

    def kernels(qf, kf, vf, gf, bf, pool, slot_ids, has, start, length, first, num, cu_last):
        o, new_pool = _triton.gated_delta_rule_fwd_packed(
            qf, kf, vf, gf, bf, scale=float(scale), pool=pool, slot_ids=slot_ids, has_initial_state=has,
            chunk_start=start, chunk_len=length, seq_first_chunk=first, seq_num_chunks=num, chunk=chunk_size,
            interpret=interpret, config=config)
        if varlen and tt > 0:
            # tokens past cu_seqlens[N] are padding: no chunk holds them, so no program stored their rows
            o = _triton.zero_tail(o, cu_last, total=tt, chunk=chunk_size, interpret=interpret)
        return o, new_pool

    o, new_pool = _no_autodiff(kernels)(
        qf, kf, vf, gf, bf, pool, slot_ids.astype(jnp.int32), has_initial_state.astype(jnp.int32), start, length,
        first, num, cu_last)
    o = o[:tt].reshape(b, t, hv, vp)[..., :vdim].astype(out_dtype)
    if padded_pool:
        new_pool = new_pool[:, :, :kdim, :vdim]
    return o, new_pool


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, chunk_map,
                               output_final_state, chunk_size=64, interpret=False):
    """Chunked gated delta rule forward (Pallas). Returns (o [B, T, Hv, V], final_state [N, Hv, K, V] or None).

    initial_state [N, Hv, K, V] fp32 or None (zeros); N = B for dense input, len(cu_seqlens) - 1 otherwise.
    """
    b, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        pool = jnp.zeros((n, hv, kdim, vdim), jnp.float32)
        has = jnp.zeros((n,), jnp.int32)
    else:
        pool = initial_state.astype(jnp.float32)
        has = jnp.ones((n,), jnp.int32)
    o, final = _run(q, k, v, g, beta, scale=scale, pool=pool, slot_ids=jnp.arange(n, dtype=jnp.int32),
                    has_initial_state=has, cu_seqlens=cu_seqlens, chunk_map=chunk_map, chunk_size=chunk_size,
                    interpret=interpret)
    return o, (final if output_final_state else None)


def chunk_gated_delta_rule_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state,
                                     cu_seqlens, chunk_map, chunk_size=64, interpret=False):
    """Chunked gated delta rule forward over a state-slot pool. Returns (o [B, T, Hv, V], new_ssm_state [S, ...]).

    Sequence n reads ssm_state[slot_ids[n]] (zeros where has_initial_state[n] is False, whatever the slot holds)
    and writes its final state back to that slot; other slots keep their values. ssm_state is aliased to the
    output (input_output_aliases), so a donated pool updates in place. slot_ids must be distinct.
    """
    return _run(q, k, v, g, beta, scale=scale, pool=ssm_state, slot_ids=slot_ids,
                has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, chunk_map=chunk_map,
                chunk_size=chunk_size, interpret=interpret)


def fused_recurrent_gated_delta_rule_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state,
                                               use_qk_l2norm=False, interpret=False, config=None):
    """Per-token gated delta rule of N streams over a state-slot pool, in place (the decode kernel).

    q, k [N, T, Hk, K]; v [N, T, Hv, V]; g, beta [N, T, Hv]; ssm_state [S, Hv, K, V] fp32 (aliased: donate it);
    slot_ids [N] int32 (an id outside [0, S) reads zeros and drops its write), has_initial_state [N] bool.
    Returns (o [N, T, Hv, V] in v's dtype, new ssm_state). Head dims that are not one of GPU_HEAD_DIMS are
    zero-padded (then the pool is copied, not updated in place).
    """
    n, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    if scale is None:
        scale = kdim ** -0.5
    if n == 0 or t == 0:
        return jnp.zeros(v.shape, v.dtype), ssm_state
    kp, vp = kernel_head_dim(kdim), kernel_head_dim(vdim)
    q, k, v = _pad_last(q, kp), _pad_last(k, kp), _pad_last(v, vp)
    pool = ssm_state
    padded = (kp, vp) != (kdim, vdim)
    if padded:
        pool = jnp.pad(pool, [(0, 0), (0, 0), (0, kp - kdim), (0, vp - vdim)])
    cfg = config or _decode.DecodeConfig()

    def kernel(q, k, v, g, beta, pool, slot_ids, has):
        return _decode.fused_recurrent_slots(q, k, v, g, beta, pool=pool, slot_ids=slot_ids, has_initial_state=has,
                                             scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
                                             config=cfg)

    o, new_pool = _no_autodiff(kernel)(q, k, v, g, beta, pool, slot_ids.astype(jnp.int32),
                                       has_initial_state.astype(jnp.int32))
    if padded:
        o, new_pool = o[..., :vdim], new_pool[:, :, :kdim, :vdim]
    return o, new_pool
