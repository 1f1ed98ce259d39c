"""Public entry of the gated delta rule op: checks every argument once, picks a backend, calls it.
``jax_gdn.ops`` re-exports these functions.

Shape legend: B batch rows, T tokens, N sequences (streams), S slots, Hk key heads, Hv value heads
(Hv % Hk == 0; value head h reads key head h // (Hv // Hk)), K / V key / value head dims, C chunk size.

    q, k  [B, T, Hk, K]      v     [B, T, Hv, V]      g (log-decay), beta  [B, T, Hv]
    initial_state [N, Hv, K, V] fp32       cu_seqlens [N + 1] int32 (then B == 1; else N = B)
    o     [B, T, Hv, V] in v's dtype       final_state [N, Hv, K, V] fp32

Per token and value head: ``S = exp(g_t) S; S = S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T (scale q_t)``,
scale defaulting to K ** -0.5. ``use_qk_l2norm`` normalises q and k in fp32 (``x * rsqrt(sum x^2 + 1e-6)``)
before the scale.

The op's folder: ``api.py`` (this file), ``reference.py`` (XLA chunked form + per-token recurrence, the "xla"
backend), ``gated_delta_rule/triton/chunk.py`` (the prefill kernels), ``decode.py`` (the decode kernel), ``recurrent_varlen.py``
(the per-token prefill kernel for short sequences), ``chunk_map.py`` (the one chunk map from cu_seqlens, slot
helpers), ``validation.py`` (argument checks), ``NOTES.md``.

Backends: "xla" (``reference.py``), "pallas" (the GPU kernels of ``gated_delta_rule/triton/chunk.py`` / ``decode.py``),
"pallas_interpret" (the same kernels in Pallas interpret mode, any platform), "mosaic_gpu" (prefill on a Hopper
GPU: ``mosaic_gpu.py``'s stage 1a and warp-specialised fused state pass, launch choices in
``mosaic_gpu.DEFAULT_CONFIG``; packed ``cu_seqlens`` and the slot pool through ``gated_delta_rule/mosaic_gpu/varlen.py`` while
``mosaic_gpu.VARLEN`` is set; what it does not take, fp32 inputs, other head dims, a non-Hopper GPU, decode, runs
"pallas" with a warning that names the reason; it needs a GPU), "auto" (= "pallas" when
``jax.default_backend() == "gpu"`` and the kernel takes the inputs, "mosaic_gpu" instead where ``mosaic_gpu.AUTO``
is set and it takes them (packed / slot calls only while ``mosaic_gpu.AUTO_VARLEN`` is also set: on since session 8,
serve256 1.92 ms against Triton's 2.41 on the H200), else "xla").
Mixes of short sequences (B T <= MAX_MEAN_LEN N = 8 N, shapes only) run "pallas" / "pallas_interpret" (and "auto"
on a GPU, before any Mosaic choice) through ``recurrent_varlen.py``, one per-token kernel launch, instead of the
chunked kernels (tiny64 on the H200: 0.110 ms against 0.355; ``recurrent_varlen.MAX_MEAN_LEN = 0`` turns it off).

Every backend gives the same results up to rounding, also at the edges:
  * g = -inf (a hard reset) or a huge negative g: exp(g) = 0 as in the per-token form (the chunked forms floor g
    at -128, where exp already underflows to 0 in fp32, so cumulative gates stay finite);
  * head dims: Pallas runs K, V in {16, 32, 64, 128} and zero-pads other dims up to 128 inside the op (the result
    is that of the real dims); K or V over 128 is refused by "pallas" / "pallas_interpret" (ValueError naming the
    limit) and makes "auto" pick "xla";
  * mixed dtypes (e.g. fp32 q, k with bf16 v): Pallas runs in the promoted dtype; o takes v's dtype everywhere;
  * B = 0 or T = 0: o is empty / all sequences keep their initial state;
  * autodiff: only "xla" is differentiable; jax.grad / jax.jvp through a Pallas backend raises
    NotImplementedError naming backend='xla';
  * NaN / inf in token t's k, v, g or beta poisons (as in the per-token form) every later token of its sequence and
    its final state; the chunked forms also poison the earlier tokens of t's own chunk (up to C - 1 tokens: the
    chunk's matmuls multiply the NaN by the zero coefficients of earlier rows, and 0 * NaN = NaN; a batch routed to
    ``recurrent_varlen`` is per-token and does not). Earlier chunks, other rows and other sequences are untouched;
    a NaN in q_t poisons o_t only, in every form.

Padding contract (every backend): zero-length streams (repeated ``cu_seqlens`` entries) are allowed; tokens at
index >= cu_seqlens[N] (cu_seqlens[N] <= T) are padding: they touch no state and their output rows are zero; a
slot id outside [0, S) (S for a padding stream, -1, any bad traced value) names no slot: that stream starts from
zeros and its final state is dropped; it never touches another slot.

Checks (``validation.py``, also ``jax_gdn.ops.validation``): shapes, ranks and dtypes always raise ``ValueError``
naming the argument and the expected shape. Value checks (``cu_seqlens`` starts at 0, is non-decreasing, ends at
or before T; the ``slot_ids`` inside [0, S) are distinct) run only on concrete values; under ``jax.jit`` they are skipped (use
``validation.checkify_cu_seqlens`` / ``checkify_slot_ids`` with ``jax.experimental.checkify`` to have them there).
"""
from __future__ import annotations

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta_rule import validation
from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mosaic_gpu
from pallas_kernels.gated_delta_rule.mosaic_gpu import varlen as mosaic_gpu_varlen
from pallas_kernels.gated_delta_rule.triton import chunk as pallas_triton
from pallas_kernels.gated_delta_rule.triton import decode, recurrent_varlen
from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map
from pallas_kernels.gated_delta_rule.triton.chunk import (GPU_DTYPES, GPU_HEAD_DIMS, MAX_HEAD_DIM,  # noqa: F401
                                                           check_supported, kernel_head_dim, supported)
from pallas_kernels.gated_delta_rule.reference import (chunk_gated_delta_rule_slots_xla, chunk_gated_delta_rule_xla,
                                                       fused_recurrent_gated_delta_rule_slots_xla, l2norm,
                                                       recurrent_gated_delta_rule_xla)

__all__ = [
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule_slots",
    "fused_recurrent_gated_delta_rule_slots",
    "resolve_backend",
    "check_supported",
    "supported",
    "GPU_HEAD_DIMS",
]


def resolve_backend(backend: str) -> str:
    """Maps "auto" to "pallas" on a GPU and "xla" elsewhere; rejects unknown names and "pallas" / "mosaic_gpu"
    without a GPU."""
    validation.check_backend(backend)
    platform = jax.default_backend()
    if backend == "auto":
        return "pallas" if platform == "gpu" else "xla"
    if backend in ("pallas", "mosaic_gpu") and platform != "gpu":
        raise ValueError(f"backend={backend!r} needs a GPU (jax.default_backend() is {platform!r}); "
                         "use backend='xla', 'auto' or 'pallas_interpret'")
    return backend


def _mosaic_or_triton(requested: str, backend: str, q, k, v, *, cu_seqlens=None, chunk_size: int = 64,
                      slots: bool = False, what: str = "chunk_gated_delta_rule") -> str:
    """The prefill backend after _resolve_for (``requested``: the caller's name, ``backend``: resolved).
    "mosaic_gpu" stays where ``mosaic_gpu.fallback_reason`` is None, else it runs "pallas" (Triton) with a warning
    naming the reason; "auto" resolved to "pallas" picks "mosaic_gpu" where ``mosaic_gpu.AUTO`` is set and it takes
    the inputs (silently: "auto" promises the best backend that runs)."""
    if backend not in ("mosaic_gpu", "pallas") or (backend == "pallas" and requested != "auto"):
        return backend
    why = mosaic_gpu.fallback_reason(q, k, v, cu_seqlens=cu_seqlens, chunk_size=chunk_size, slots=slots)
    if backend == "pallas":                                          # requested "auto"
        ok = why is None and mosaic_gpu.auto_picks(cu_seqlens=cu_seqlens, slots=slots)
        return "mosaic_gpu" if ok else "pallas"
    if why is not None:
        warnings.warn(f"{what}(backend='mosaic_gpu') runs Pallas Triton: {why}", stacklevel=3)
        return "pallas"
    return "mosaic_gpu"


def _check_common(q, k, v, g, beta, cu_seqlens):
    b, t, hk, hv, dk, dv, _ = validation.check_qkvgb(q, k, v, g, beta)
    if cu_seqlens is None:
        n = b
    else:
        n = validation.check_cu_seqlens(cu_seqlens, t, "cu_seqlens", batch=b, padded=True)
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    return b, t, hk, hv, dk, dv, n, cu_seqlens


def _check_chunk_size_and_scale(chunk_size, scale, dk) -> tuple[int, float]:
    """(chunk_size as a Python int, scale as a Python float). chunk_size: a positive int or NumPy integer (not a
    bool); scale: None (K ** -0.5) or a number."""
    if (not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, (bool, np.bool_))
            or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size), float(dk ** -0.5 if scale is None else scale)


def _resolve_for(backend: str, q, k, v, *, mosaic: bool = False) -> str:
    """resolve_backend, and "auto" on a GPU falls back to "xla" where the Pallas kernel does not take the inputs
    (head dims over 128). ``mosaic`` False (the callers without a Mosaic GPU path: decode): "mosaic_gpu" runs
    "pallas", with a warning."""
    resolved = resolve_backend(backend)
    if backend == "auto" and resolved == "pallas" and not supported(q, k, v, interpret=False)[0]:
        return "xla"
    if resolved == "mosaic_gpu" and not mosaic:
        warnings.warn("backend='mosaic_gpu' runs Pallas Triton here: the Mosaic GPU kernels cover dense prefill "
                      "only", stacklevel=3)
        return "pallas"
    return resolved


def _short_sequences(backend: str, q, k, v, n: int, chunk_size: int) -> bool:
    """Whether a prefill call runs ``recurrent_varlen`` (the per-token Pallas kernel for mixes of short sequences)
    instead of the chunked kernels: backend "pallas" / "pallas_interpret" (or "auto" resolved to "pallas"; not an
    explicit "mosaic_gpu") and ``recurrent_varlen.use_recurrent(B T, N)`` (static shapes only: T <= MAX_MEAN_LEN N).
    Runs the Pallas checks first, so that both Pallas paths refuse the same inputs."""
    if backend not in ("pallas", "pallas_interpret"):
        return False
    if not recurrent_varlen.use_recurrent(q.shape[0] * q.shape[1], n):
        return False
    check_supported(q, k, v, interpret=backend == "pallas_interpret")
    if chunk_size % 16:
        raise ValueError(f"chunk_size must be a multiple of 16 for the Pallas backends, got {chunk_size}; "
                         "use backend='xla' for other chunk sizes")
    return True


def _pallas_inputs(backend, q, k, v, g, cu_seqlens, chunk_size, use_qk_l2norm):
    """The interpret flag and the inputs as the kernels take them: q, k L2-normalised (if asked) in their own
    dtype, g in fp32, and the on-device chunk map for varlen (None for dense rows)."""
    interpret = backend == "pallas_interpret"
    check_supported(q, k, v, interpret=interpret)
    if chunk_size % 16:
        raise ValueError(f"chunk_size must be a multiple of 16 for the Pallas backends, got {chunk_size}; "
                         "use backend='xla' for other chunk sizes")
    q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=True)
    chunk_map = None if cu_seqlens is None else build_chunk_map(cu_seqlens, q.shape[1], chunk_size)
    return interpret, q, k, g.astype(jnp.float32), chunk_map


def _prepare_qk(q, k, use_qk_l2norm: bool, keep_dtype: bool):
    if not use_qk_l2norm:
        return q, k
    qn, kn = l2norm(q.astype(jnp.float32), eps=1e-6), l2norm(k.astype(jnp.float32), eps=1e-6)
    if keep_dtype:
        qn, kn = qn.astype(q.dtype), kn.astype(k.dtype)
    return qn, kn


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
                           output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm: bool = False,
                           chunk_size: int = 64, backend: str = "auto"):
    """Chunked gated delta rule (prefill). Returns ``(o [B, T, Hv, V], final_state [N, Hv, K, V] fp32 or None)``.

    Shape legend: B rows, T tokens, N sequences, Hk / Hv key / value heads, K / V head dims, C = chunk_size.
      q, k [B, T, Hk, K]; v [B, T, Hv, V] (o takes v's dtype); g (log-decay, fp32 or bf16), beta [B, T, Hv];
      initial_state [N, Hv, K, V] fp32 or None (zeros); cu_seqlens [N + 1] int32 or None (then N = B).
    ``cu_seqlens`` packs N sequences into one row (B == 1); each starts from ``initial_state[n]``; an empty
    sequence's final state is its initial state; tokens past cu_seqlens[N] are padding (output rows zero).
    ``scale`` is a Python float (default K ** -0.5); ``chunk_size`` a positive int (a multiple of 16 on Pallas).
    Both backends cut the row into at most T // C + N chunks on the device (no host sync, one compile per (T, N)).
    See the module docstring for g = -inf, NaN inputs, head dims, mixed dtypes and autodiff.
    """
    resolve_backend(backend)
    b, t, hk, hv, dk, dv, n, cu_seqlens = _check_common(q, k, v, g, beta, cu_seqlens)
    requested, backend = backend, _resolve_for(backend, q, k, v, mosaic=True)
    validation.check_initial_state(initial_state, n, hv, dk, dv)
    chunk_size, scale = _check_chunk_size_and_scale(chunk_size, scale, dk)
    if _short_sequences(backend, q, k, v, n, chunk_size):
        return recurrent_varlen.recurrent_varlen_fwd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            interpret=backend == "pallas_interpret")
    backend = _mosaic_or_triton(requested, backend, q, k, v, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if backend == "mosaic_gpu":
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=True)
        if cu_seqlens is not None:
            return mosaic_gpu_varlen.op_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return mosaic_gpu.op_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state)
    if backend == "xla":
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=False)
        return chunk_gated_delta_rule_xla(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                                          chunk_size=chunk_size)
    interpret, q, k, g, chunk_map = _pallas_inputs(backend, q, k, v, g, cu_seqlens, chunk_size, use_qk_l2norm)
    return pallas_triton.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        chunk_map=chunk_map, output_final_state=output_final_state, chunk_size=chunk_size, interpret=interpret)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
                               output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm: bool = False):
    """Per-token gated delta rule (``lax.scan`` over T): decode and reference, always XLA.

    Shape legend: B rows, T tokens, N sequences, Hk / Hv key / value heads, K / V head dims.
      q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; initial_state [N, Hv, K, V] fp32 or None;
      cu_seqlens [N + 1] int32 or None (then N = B). Returns ``(o [B, T, Hv, V] in v's dtype,
      final_state [N, Hv, K, V] fp32 or None)``, the same as :func:`chunk_gated_delta_rule` up to rounding.
    """
    b, t, hk, hv, dk, dv, n, cu_seqlens = _check_common(q, k, v, g, beta, cu_seqlens)
    validation.check_initial_state(initial_state, n, hv, dk, dv)
    scale = float(dk ** -0.5 if scale is None else scale)
    q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=False)
    return recurrent_gated_delta_rule_xla(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          cu_seqlens=cu_seqlens, output_final_state=output_final_state)


def chunk_gated_delta_rule_slots(q, k, v, g, beta, *, ssm_state, slot_ids, has_initial_state, cu_seqlens=None,
                                 scale: Optional[float] = None, use_qk_l2norm: bool = False, chunk_size: int = 64,
                                 backend: str = "auto"):
    """Chunked gated delta rule over a slot pool. Returns ``(o [B, T, Hv, V], new_ssm_state [S, Hv, K, V] fp32)``.

    Shape legend: B rows, T tokens, N sequences, S slots, Hk / Hv key / value heads, K / V head dims.
      q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; cu_seqlens [N + 1] int32 or None (then N = B);
      ssm_state [S, Hv, K, V] fp32; slot_ids [N] int32 (distinct inside [0, S)); has_initial_state [N] bool.
    Sequence n starts from ``ssm_state[slot_ids[n]]`` (zeros where ``has_initial_state[n]`` is False, whatever the
    slot holds) and its final state is written back to that slot; every other slot is returned unchanged. An id
    outside [0, S) (S for a padding stream, -1, a bad traced value) reads zeros and its write is dropped. Tokens
    past cu_seqlens[N] are padding (output rows zero, no state touched). Without cu_seqlens, N = B. Under
    ``jax.jit`` donate ``ssm_state`` to update it in place.
    """
    resolve_backend(backend)
    b, t, hk, hv, dk, dv, n, cu_seqlens = _check_common(q, k, v, g, beta, cu_seqlens)
    requested, backend = backend, _resolve_for(backend, q, k, v, mosaic=True)
    num_slots = validation.check_ssm_state_pool(ssm_state, hv, dk, dv)
    validation.check_slot_ids(slot_ids, num_slots, n, allow_no_slot=True)
    validation.check_has_initial_state(has_initial_state, n)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    has_initial_state = jnp.asarray(has_initial_state)
    chunk_size, scale = _check_chunk_size_and_scale(chunk_size, scale, dk)
    if _short_sequences(backend, q, k, v, n, chunk_size):
        return recurrent_varlen.recurrent_varlen_slots_fwd(
            q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
            has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
            interpret=backend == "pallas_interpret")
    backend = _mosaic_or_triton(requested, backend, q, k, v, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                slots=True, what="chunk_gated_delta_rule_slots")
    if backend == "mosaic_gpu":
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=True)
        return mosaic_gpu_varlen.op_fwd_slots(q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
                                              has_initial_state=has_initial_state, cu_seqlens=cu_seqlens)
    if backend == "xla":
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=False)
        return chunk_gated_delta_rule_slots_xla(
            q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
            has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    interpret, q, k, g, chunk_map = _pallas_inputs(backend, q, k, v, g, cu_seqlens, chunk_size, use_qk_l2norm)
    return pallas_triton.chunk_gated_delta_rule_slots_fwd(
        q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
        has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, chunk_map=chunk_map, chunk_size=chunk_size,
        interpret=interpret)


def fused_recurrent_gated_delta_rule_slots(q, k, v, g, beta, *, ssm_state, slot_ids, has_initial_state=None,
                                           scale: Optional[float] = None, use_qk_l2norm: bool = False,
                                           backend: str = "auto"):
    """Per-token gated delta rule of N streams over a slot pool (decode). Returns
    ``(o [N, T, Hv, V] in v's dtype, new_ssm_state [S, Hv, K, V] fp32)``.

    Shape legend: N streams (one row each), T tokens per stream (1 for decode), S slots, Hk / Hv key / value heads,
    K / V head dims.
      q, k [N, T, Hk, K]; v [N, T, Hv, V]; g, beta [N, T, Hv]; ssm_state [S, Hv, K, V] fp32;
      slot_ids [N] int32 (distinct inside [0, S)); has_initial_state [N] bool or None (all True).
    Stream n starts from ``ssm_state[slot_ids[n]]`` (zeros where ``has_initial_state[n]`` is False or the id is
    outside [0, S)), runs its T tokens and writes its state back (an id outside [0, S) drops the write); other slots
    are unchanged. The same rule as :func:`recurrent_gated_delta_rule` (FLA's ``fused_recurrent_gated_delta_rule``
    with the state read from and written to a pool). "pallas" runs the decode kernel
    (``pallas_kernels.gated_delta_rule.decode``) over the pool in place: under ``jax.jit`` donate ``ssm_state``;
    "xla" gathers the N states, runs the ``lax.scan`` form and scatters them back. "auto": "pallas" on a GPU
    where the kernel takes the inputs, else "xla". ``use_qk_l2norm`` normalises q, k in fp32 (fused in the kernel).
    """
    resolve_backend(backend)
    b, t, hk, hv, dk, dv, n, _ = _check_common(q, k, v, g, beta, None)
    backend = _resolve_for(backend, q, k, v)
    num_slots = validation.check_ssm_state_pool(ssm_state, hv, dk, dv)
    validation.check_slot_ids(slot_ids, num_slots, n, allow_no_slot=True)
    if has_initial_state is None:
        has_initial_state = jnp.ones((n,), bool)
    validation.check_has_initial_state(has_initial_state, n)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    has_initial_state = jnp.asarray(has_initial_state)
    scale = float(dk ** -0.5 if scale is None else scale)
    if backend == "xla":
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=False)
        return fused_recurrent_gated_delta_rule_slots_xla(q, k, v, g, beta, scale=scale, ssm_state=ssm_state,
                                                          slot_ids=slot_ids, has_initial_state=has_initial_state)
    check_supported(q, k, v, interpret=backend == "pallas_interpret")
    return decode.fused_recurrent_gated_delta_rule_slots_fwd(
        q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids, has_initial_state=has_initial_state,
        use_qk_l2norm=use_qk_l2norm, interpret=backend == "pallas_interpret")
