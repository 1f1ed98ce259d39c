"""Argument checks for the gated delta rule ops, reusable by the layers.

Shape legend: B batch, T tokens, N sequences (streams), S slots, Hk key heads, Hv value heads (Hv % Hk == 0),
K key head dim, V value head dim.

The ops follow the library's padding contract: they call ``check_cu_seqlens(..., padded=True)`` (cu[N] <= T:
tokens past cu[N] are padding) and ``check_slot_ids(..., allow_no_slot=True)`` (an id outside [0, S) names no
slot). Zero-length streams are always allowed. The defaults stay strict for callers that want exact packing.

Two kinds of checks:
  * static checks (ranks, shapes, dtypes): always run, also under ``jax.jit``, and raise ``ValueError`` naming the
    argument and the expected shape;
  * value checks (``cu_seqlens`` contents, ``slot_ids`` range and uniqueness): run only when the values are concrete
    (eager arrays, NumPy arrays, lists). Under tracing (``jax.jit``, ``vmap``, ``scan``) the values are unknown and
    these checks are skipped silently: a traced call with bad ``cu_seqlens`` gives garbage, not an error. Users who
    want the value checks under ``jit`` call :func:`checkify_cu_seqlens` / :func:`checkify_slot_ids` inside a
    function transformed by ``jax.experimental.checkify.checkify`` (see their docstrings).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = [
    "BACKENDS",
    "is_concrete",
    "concrete_value",
    "check_backend",
    "check_qkvgb",
    "check_cu_seqlens",
    "check_initial_state",
    "check_ssm_state_pool",
    "check_slot_ids",
    "check_has_initial_state",
    "checkify_cu_seqlens",
    "checkify_slot_ids",
]

BACKENDS = ("auto", "xla", "pallas", "pallas_interpret", "mosaic_gpu")

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


try:
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover - in case a later jax drops the public alias
    from jax._src.core import Tracer as _Tracer


def is_concrete(x) -> bool:
    """True when ``x``'s values are known now (not a tracer)."""
    return not isinstance(x, _Tracer)


def concrete_value(x) -> Optional[np.ndarray]:
    """``x`` as a NumPy array when its values are concrete; ``None`` under tracing."""
    if not is_concrete(x):
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _is_float(dtype) -> bool:
    return any(jnp.dtype(dtype) == jnp.dtype(d) for d in _FLOAT_DTYPES)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_qkvgb(q, k, v, g, beta) -> tuple[int, int, int, int, int, int, int]:
    """Checks q, k [B,T,Hk,K], v [B,T,Hv,V], g, beta [B,T,Hv]; returns (B, T, Hk, Hv, K, V, Hv // Hk)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(_shape(x)) != 4:
            expected = "[B, T, Hk, K]" if name != "v" else "[B, T, Hv, V]"
            raise ValueError(f"{name} must have rank 4 with shape {expected}, got shape {_shape(x)}")
    b, t, hk, dk = _shape(q)
    if _shape(k) != (b, t, hk, dk):
        raise ValueError(f"k must have the shape of q [B, T, Hk, K] = {(b, t, hk, dk)}, got {_shape(k)}")
    vb, vt, hv, dv = _shape(v)
    if (vb, vt) != (b, t):
        raise ValueError(f"v must have shape [B, T, Hv, V] with B, T = {(b, t)} (from q), got {_shape(v)}")
    if hk < 1 or hv < 1 or dk < 1 or dv < 1:
        raise ValueError(f"head counts and head dims must be positive: q {_shape(q)}, v {_shape(v)}")
    if hv % hk:
        raise ValueError(f"v's heads Hv ({hv}) must be a multiple of q/k's heads Hk ({hk}) "
                         f"(value head h reads key head h // (Hv // Hk))")
    for name, x in (("g", g), ("beta", beta)):
        if _shape(x) != (b, t, hv):
            raise ValueError(f"{name} must have shape [B, T, Hv] = {(b, t, hv)}, got {_shape(x)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not _is_float(_dtype(x)):
            raise ValueError(f"{name} must be a floating dtype (float32, bfloat16 or float16), got {_dtype(x)}")
    if jnp.dtype(_dtype(q)) != jnp.dtype(_dtype(k)):
        raise ValueError(f"q and k must share a dtype, got q {_dtype(q)} and k {_dtype(k)}")
    return b, t, hk, hv, dk, dv, hv // hk


def check_cu_seqlens(cu_seqlens, total_len: int, name: str = "cu_seqlens", *, batch: Optional[int] = None,
                     padded: bool = False) -> int:
    """Checks ``cu_seqlens`` [N + 1] int and, when concrete, 0 = cu[0] <= cu[1] <= ... <= cu[N] = total_len.

    Zero-length streams (repeated entries) are always allowed. ``padded=True`` (the padding contract of the
    library: the gated delta rule ops and conv1d) also allows cu[N] < total_len: tokens at index >= cu[N] are
    padding and belong to no stream. ``batch`` (when given) must be 1: packed sequences live in one row.
    Returns N. Under tracing only the shape and dtype are checked (see the module docstring).
    """
    shape = _shape(cu_seqlens)
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name} must have shape [N + 1] with N >= 1, got shape {shape}")
    if not jnp.issubdtype(_dtype(cu_seqlens), jnp.integer):
        raise ValueError(f"{name} must be an integer array (int32) of shape [N + 1], got dtype {_dtype(cu_seqlens)}")
    if batch is not None and batch != 1:
        raise ValueError(f"with {name} the inputs must be packed into one row: B must be 1, got B = {batch}")
    cu = concrete_value(cu_seqlens)
    if cu is not None:
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
        if np.any(np.diff(cu) < 0):
            raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
        if padded and cu[-1] > total_len:
            raise ValueError(f"{name} must end at or before the token count T = {total_len} (tokens past "
                             f"{name}[N] are padding), got {name}[-1] = {cu[-1]}")
        if not padded and cu[-1] != total_len:
            raise ValueError(f"{name} must end at the token count T = {total_len}, got {name}[-1] = {cu[-1]}")
    return shape[0] - 1


def check_initial_state(initial_state, n: int, hv: int, dk: int, dv: int, name: str = "initial_state") -> None:
    """Checks an initial state [N, Hv, K, V] float32."""
    if initial_state is None:
        return
    if _shape(initial_state) != (n, hv, dk, dv):
        raise ValueError(f"{name} must have shape [N, Hv, K, V] = {(n, hv, dk, dv)} (N = number of sequences: "
                         f"len(cu_seqlens) - 1, or B without cu_seqlens), got {_shape(initial_state)}")
    if jnp.dtype(_dtype(initial_state)) != jnp.float32:
        raise ValueError(f"{name} must be float32, got {_dtype(initial_state)}")


def check_ssm_state_pool(ssm_state, hv: int, dk: int, dv: int, name: str = "ssm_state") -> int:
    """Checks a state pool [S, Hv, K, V] float32; returns S."""
    shape = _shape(ssm_state)
    if len(shape) != 4 or shape[1:] != (hv, dk, dv):
        raise ValueError(f"{name} must have shape [S, Hv, K, V] = [S, {hv}, {dk}, {dv}], got {shape}")
    if jnp.dtype(_dtype(ssm_state)) != jnp.float32:
        raise ValueError(f"{name} must be float32, got {_dtype(ssm_state)}")
    return shape[0]


def check_slot_ids(slot_ids, num_slots: int, num_seqs: Optional[int] = None, name: str = "slot_ids", *,
                   allow_no_slot: bool = False) -> None:
    """Checks ``slot_ids`` [N] int and, when concrete, 0 <= id < num_slots with no id repeated.

    ``allow_no_slot=True`` (the padding contract, used by the ops): an id outside [0, num_slots) (negative or
    >= S, e.g. S for a padding stream) means "no slot": the stream starts from zeros and its final state is
    dropped. Such ids may repeat; ids inside [0, S) must still be distinct.
    """
    shape = _shape(slot_ids)
    if len(shape) != 1 or (num_seqs is not None and shape[0] != num_seqs):
        expected = "[N]" if num_seqs is None else f"[N] = [{num_seqs}]"
        raise ValueError(f"{name} must have shape {expected}, got {shape}")
    if not jnp.issubdtype(_dtype(slot_ids), jnp.integer):
        raise ValueError(f"{name} must be an integer array (int32) of shape [N], got dtype {_dtype(slot_ids)}")
    ids = concrete_value(slot_ids)
    if ids is not None and ids.size:
        inside = (ids >= 0) & (ids < num_slots)
        if not allow_no_slot and not inside.all():
            raise ValueError(f"{name} must lie in [0, {num_slots}) (S = {num_slots} slots), got {ids.tolist()}")
        real = ids[inside]
        if len(np.unique(real)) != real.size:
            raise ValueError(f"{name} must not repeat a slot (two streams cannot share one state), "
                             f"got {ids.tolist()}")


def check_has_initial_state(has_initial_state, num_seqs: int, name: str = "has_initial_state") -> None:
    """Checks ``has_initial_state`` [N] bool."""
    if _shape(has_initial_state) != (num_seqs,):
        raise ValueError(f"{name} must have shape [N] = [{num_seqs}], got {_shape(has_initial_state)}")
    if jnp.dtype(_dtype(has_initial_state)) != jnp.bool_:
        raise ValueError(f"{name} must be a bool array of shape [N], got dtype {_dtype(has_initial_state)}")


# ---------------------------------------------------------------------------------------------------------------
# Value checks under jit, via checkify
# ---------------------------------------------------------------------------------------------------------------
def checkify_cu_seqlens(cu_seqlens, total_len: int, name: str = "cu_seqlens", *, padded: bool = False) -> None:
    """Value checks of ``cu_seqlens`` that also work under ``jit``, through ``jax.experimental.checkify``.

    ``padded`` as in :func:`check_cu_seqlens` (cu[N] <= T instead of == T). Call it inside the function you
    transform::

        def f(q, k, v, g, beta, cu):
            checkify_cu_seqlens(cu, q.shape[1])
            return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
        err, out = jax.jit(checkify.checkify(f))(q, k, v, g, beta, cu)
        err.throw()   # raises checkify.JaxRuntimeError naming the failed check
    """
    cu = jnp.asarray(cu_seqlens)
    checkify.check(cu[0] == 0, f"{name} must start at 0, got {name}[0] = {{x}}", x=cu[0])
    checkify.check(jnp.all(cu[1:] >= cu[:-1]), f"{name} must be non-decreasing")
    if padded:
        checkify.check(cu[-1] <= total_len, f"{name} must end at or before the token count T = {total_len}, "
                       f"got {{x}}", x=cu[-1])
    else:
        checkify.check(cu[-1] == total_len, f"{name} must end at the token count T = {total_len}, got {{x}}",
                       x=cu[-1])


def checkify_slot_ids(slot_ids, num_slots: int, name: str = "slot_ids", *, allow_no_slot: bool = False) -> None:
    """Value checks of ``slot_ids`` (range unless ``allow_no_slot``, no repeat inside [0, S)) under ``jit`` through
    ``checkify`` (see checkify_cu_seqlens)."""
    ids = jnp.asarray(slot_ids)
    inside = (ids >= 0) & (ids < num_slots)
    if not allow_no_slot:
        checkify.check(jnp.all(inside), f"{name} must lie in [0, {num_slots})")
    # out-of-range ids may repeat: give each a distinct value below every real id before the sort
    keyed = jnp.where(inside, ids, -1 - jnp.arange(ids.shape[0], dtype=ids.dtype))
    srt = jnp.sort(keyed)
    checkify.check(jnp.all(srt[1:] != srt[:-1]), f"{name} must not repeat a slot")
