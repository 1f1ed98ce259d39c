"""Public entry of the gated delta rule op: checks every argument once, resolves its dispatch table, calls it.
``jax_gdn.ops`` re-exports these functions.

Shape legend: B batch rows, T tokens, N sequences (streams), S slots, Hk key heads, Hv value heads
(Hv % Hk == 0; value head h reads key head h // (Hv // Hk)), K / V key / value head dims, C chunk size.

    q, k  [B, T, Hk, K]      v     [B, T, Hv, V]      g (log-decay), beta  [B, T, Hv]
    initial_state [N, Hv, K, V] fp32       cu_seqlens [N + 1] int32 (then B == 1; else N = B)
    o     [B, T, Hv, V] in v's dtype       final_state [N, Hv, K, V] fp32

Per token and value head: ``S = exp(g_t) S; S = S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T (scale q_t)``,
scale defaulting to K ** -0.5. ``use_qk_l2norm`` normalises q and k in fp32 (``x * rsqrt(sum x^2 + 1e-6)``)
before the scale.

The op's folder: ``api.py`` (this file: checks, the dispatch table, the calls), ``reference.py`` (XLA chunked form
+ per-token recurrence, the "xla" backend), ``triton/`` (``chunk.py`` the prefill kernels, ``decode.py`` the
decode kernel, ``recurrent_varlen.py`` the per-token prefill kernel for short sequences), ``mosaic_gpu/`` (the
Hopper kernels), ``chunk_map.py`` (the one chunk map from cu_seqlens, slot helpers), ``validation.py`` (argument
checks), ``NOTES.md``.

Dispatch: one table, :data:`TABLE` (``pallas_kernels.dispatch.OpTable``), resolved once per call from the call's
:class:`GdnCase` (call kind, q / k / v shapes and dtypes, chunk size, platform). Call kinds: "dense" (rows
[B, T]), "varlen" (``cu_seqlens``), "slots" (the slot pool), "short_mix" (a prefill of any of those three with
B T <= ``DispatchConfig.short_mix_max_mean_len`` N, shapes only) and "decode" (the fused recurrent slot op).
Implementations, in the order "auto" tries them (``python -m pallas_kernels.registry`` prints the table):

    triton.recurrent_varlen  "pallas"      short mixes: one per-token Pallas Triton launch (recurrent_varlen.py)
    mosaic_gpu.chunk         "mosaic_gpu"  dense prefill on a Hopper GPU (mosaic_gpu/chunk.py; bf16 / fp16, K, V
                                           in {64, 128}, chunk_size 64)
    mosaic_gpu.varlen        "mosaic_gpu"  packed and slot prefill on a Hopper GPU (mosaic_gpu/varlen.py, the same
                                           kernels and limits)
    mosaic_gpu.decode        "mosaic_gpu"  one-token decode on a Hopper GPU (mosaic_gpu/decode.py; K, V in {64, 128})
    triton.chunk             "pallas"      the chunked Pallas Triton prefill kernels (triton/chunk.py; GPU)
    triton.decode            "pallas"      the Pallas Triton decode kernel (triton/decode.py; GPU)
    xla                      "xla"         reference.py: the chunked form, the ``lax.scan`` decode (any platform)
    *.interpret              "pallas_interpret" (the Triton kernels) / "mosaic_gpu_interpret" (the Mosaic decode
                                           kernel, Triton for the rest): interpret mode, any platform; never "auto"

The Pallas Triton kernels take bf16 / fp16 / fp32 and K, V up to 128 (other dims zero-padded to 16 / 32 / 64 /
128); over 128 only "xla" runs. An explicit "mosaic_gpu" whose kernels refuse the call (fp32, other head dims, a
non-Hopper GPU, another chunk size) runs "pallas" with a warning naming the reason; other explicit names that
cannot run raise ValueError naming ``backend`` and the reason. Figures behind the order: NOTES.md.

Every backend gives the same results up to rounding, also at the edges:
  * g = -inf (a hard reset) or a huge negative g: exp(g) = 0 as in the per-token form (the chunked forms floor g
    at -128, where exp already underflows to 0 in fp32, so cumulative gates stay finite);
  * head dims: Pallas Triton runs K, V in {16, 32, 64, 128} and zero-pads other dims up to 128 inside the op (the
    result is that of the real dims); K or V over 128 is refused by "pallas" / "pallas_interpret" (ValueError
    naming the limit) and makes "auto" pick "xla";
  * mixed dtypes (e.g. fp32 q, k with bf16 v): Pallas runs in the promoted dtype; o takes v's dtype everywhere;
  * B = 0 or T = 0: o is empty / all sequences keep their initial state;
  * autodiff: ``chunk_gated_delta_rule`` and ``chunk_gated_delta_rule_slots`` are differentiable (reverse mode,
    ``jax.grad`` / ``jax.vjp``) on every backend: "xla" by autodiff of its own form; dense rows (and the slot pool
    without cu_seqlens) on "mosaic_gpu" by the Mosaic GPU backward kernels (``mosaic_gpu/backward.py``,
    ``pallas_kernels.autodiff.kernel_vjp``; ``DispatchConfig.mosaic_backward`` False turns them off), packed calls
    (cu_seqlens) by the same kernels walking each sequence (``DispatchConfig.mosaic_backward_varlen``); every other kernel path (Triton, the per-token
    kernel) by ``pallas_kernels.autodiff.reference_vjp`` (the kernel runs the forward; the backward
    recomputes the XLA chunked form from the saved inputs and differentiates it). Gradients of q, k (through the
    L2 norm), v, g, beta, initial_state / the pool, for o and the final state; forward mode (``jax.jvp``)
    through a kernel, and any autodiff of the decode op ``fused_recurrent_gated_delta_rule_slots`` on a kernel,
    raise;
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

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.autodiff import kernel_vjp, reference_vjp
from pallas_kernels.dispatch import DocCase, Implementation, OpTable
from pallas_kernels.gated_delta_rule import validation
from pallas_kernels.gated_delta_rule.mosaic_gpu import backward as mosaic_gpu_backward
from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mosaic_gpu
from pallas_kernels.gated_delta_rule.mosaic_gpu import decode as mosaic_gpu_decode
from pallas_kernels.gated_delta_rule.mosaic_gpu import varlen as mosaic_gpu_varlen
from pallas_kernels.gated_delta_rule.triton import chunk as pallas_triton
from pallas_kernels.gated_delta_rule.triton import decode, recurrent_varlen
from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map, gather_slots, scatter_slots
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
    "decode_slots_raw_gates",
    "resolve_backend",
    "resolve",
    "GdnCase",
    "DispatchConfig",
    "DEFAULT_DISPATCH",
    "TABLE",
    "CALL_KINDS",
    "check_supported",
    "supported",
    "GPU_HEAD_DIMS",
]

CALL_KINDS = ("dense", "varlen", "slots", "short_mix", "decode")


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """The measured rules of the dispatch, as data.

    short_mix_max_mean_len: a prefill call (dense rows, packed or slots) of N sequences over B T tokens with
    1 <= B T <= short_mix_max_mean_len * N (static shapes; the lengths themselves are traced) is a "short_mix":
    "auto" and "pallas" run it with the per-token kernel (``triton/recurrent_varlen.py``, one launch) instead of
    the chunked kernels; 0: never. 8 from the H200 (NOTES.md, the per-token kernel's section; plain op, bf16):
    tiny64 (mean 2.7 tokens) 0.110 ms against the chunked path's 0.355; uniform mixes win up to a mean of ~20
    tokens; 8, not 16, because the worst mix (one long sequence among one-token ones, its tokens serial) at
    T = 8 N ran 0.686 ms against the chunked path's ~0.37 at N 64, a loss that doubles at 16 N.

    mosaic_backward: jax.grad through a dense "mosaic_gpu" call (rows, or the slot pool without cu_seqlens) runs
    the Mosaic backward kernels (``mosaic_gpu/backward.py``); False: the XLA chunked form's VJP recomputed from the
    inputs, as the other kernel paths (Triton, the per-token kernel) do.
    mosaic_backward_varlen: the same for packed calls (cu_seqlens, and the slot pool with them): the backward's
    walk over the repacked row (H200, varlen16-T19027-Hk16-Hv32, bf16: forward + backward 2.17 ms against the XLA
    VJP's 48.5; NOTES.md); False: the XLA VJP."""

    short_mix_max_mean_len: int = 8
    mosaic_backward: bool = True
    mosaic_backward_varlen: bool = True

    def __post_init__(self):
        n = self.short_mix_max_mean_len
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"short_mix_max_mean_len must be an int >= 0, got {n!r}")
        for name in ("mosaic_backward", "mosaic_backward_varlen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def is_short_mix(self, total_tokens: int, num_seqs: int) -> bool:
        return num_seqs >= 1 and 1 <= total_tokens <= self.short_mix_max_mean_len * num_seqs


DEFAULT_DISPATCH = DispatchConfig()


@dataclasses.dataclass(frozen=True)
class GdnCase:
    """What the dispatch table sees of one call (static: shapes, dtypes, names).

    call: one of CALL_KINDS; form: the entry's layout ("dense", "varlen", "slots", "decode"; a "short_mix" call
    keeps its form); q, k [B, T, Hk, K], v [B, T, Hv, V] (jax.ShapeDtypeStruct); chunk_size: C of a prefill;
    platform: ``jax.default_backend()``; hopper: the device is an sm_90 GPU."""

    call: str
    form: str
    q: jax.ShapeDtypeStruct
    k: jax.ShapeDtypeStruct
    v: jax.ShapeDtypeStruct
    platform: str
    hopper: bool
    chunk_size: int = 64

    def __post_init__(self):
        if self.call not in CALL_KINDS:
            raise ValueError(f"call must be one of {CALL_KINDS}, got {self.call!r}")
        if self.form not in ("dense", "varlen", "slots", "decode"):
            raise ValueError(f"form must be 'dense', 'varlen', 'slots' or 'decode', got {self.form!r}")

    @classmethod
    def of(cls, form: str, q, k, v, *, num_seqs: Optional[int] = None, chunk_size: int = 64,
           dispatch: DispatchConfig = DEFAULT_DISPATCH, platform: Optional[str] = None,
           hopper: Optional[bool] = None) -> "GdnCase":
        """The case of a call with these inputs (``num_seqs``: N of a prefill; platform / hopper: probed from the
        devices when None)."""
        call = form
        if form != "decode" and dispatch.is_short_mix(q.shape[0] * q.shape[1], q.shape[0] if num_seqs is None
                                                      else num_seqs):
            call = "short_mix"
        spec = [jax.ShapeDtypeStruct(tuple(x.shape), jnp.dtype(x.dtype)) for x in (q, k, v)]
        return cls(call=call, form=form, q=spec[0], k=spec[1], v=spec[2],
                   platform=jax.default_backend() if platform is None else platform,
                   hopper=mosaic_gpu.is_hopper() if hopper is None else hopper, chunk_size=int(chunk_size))

    @classmethod
    def example(cls, call: str, *, platform: str = "gpu", hopper: bool = False, dtype=jnp.bfloat16,
                head_k_dim: int = 128, head_v_dim: int = 128, num_k_heads: int = 16,
                num_v_heads: int = 32) -> "GdnCase":
        """A case at given dims (no arrays): the docs' table and the model's repr. Prefill calls are 2 sequences
        of 512 tokens (a "short_mix" 64 sequences of 4), decode 64 streams of one token."""
        b, t = {"decode": (64, 1), "short_mix": (1, 256)}.get(call, (2, 512))
        form = {"short_mix": "varlen"}.get(call, call)
        q = jax.ShapeDtypeStruct((b, t, num_k_heads, head_k_dim), jnp.dtype(dtype))
        v = jax.ShapeDtypeStruct((b, t, num_v_heads, head_v_dim), jnp.dtype(dtype))
        return cls(call=call, form=form, q=q, k=q, v=v, platform=platform, hopper=hopper)


def _triton_supports(interpret: bool):
    def supports(case: GdnCase) -> Optional[str]:
        if not interpret and case.platform != "gpu":
            return (f"backend 'pallas' needs a GPU (jax.default_backend() is {case.platform!r}); use backend='xla', "
                    "'auto' or 'pallas_interpret'")
        try:                                        # dims and dtypes; the platform is checked above
            check_supported(case.q, case.k, case.v, interpret=True)
        except ValueError as err:
            return str(err)
        return None
    return supports


def _mosaic_prefill_supports(forms: tuple):
    def supports(case: GdnCase) -> Optional[str]:
        if case.form not in forms:
            return f"this Mosaic GPU entry runs {' / '.join(forms)} calls, not {case.form}"
        return mosaic_gpu.fallback_reason(case.q, case.k, case.v, chunk_size=case.chunk_size, hopper=case.hopper)
    return supports


def _mosaic_decode_supports(interpret: bool):
    def supports(case: GdnCase) -> Optional[str]:
        if not interpret and not case.hopper:
            return "the Mosaic GPU decode kernel needs an sm_90 (Hopper) GPU"
        return mosaic_gpu_decode.fallback_reason(case.q, case.k, case.v, interpret=True)   # the platform is above
    return supports


def _always(case: GdnCase) -> Optional[str]:
    return None


_PREFILL = ("dense", "varlen", "slots")
_TRITON_LIMITS = "CUDA GPU; bf16 / fp16 / fp32; K, V <= 128 (zero-padded to 16 / 32 / 64 / 128)"
_MOSAIC_LIMITS = "Hopper (sm_90); q, k, v one of bf16 / fp16; K, V in {64, 128}; chunk_size 64"


def _gdn_doc_cases() -> tuple:
    cells = []
    for label, platform, hopper in (("CPU", "cpu", False), ("GPU (not Hopper)", "gpu", False),
                                    ("Hopper GPU", "gpu", True)):
        for call in CALL_KINDS:
            cells.append(DocCase(label, call, GdnCase.example(call, platform=platform, hopper=hopper)))
    cells += [DocCase("Hopper GPU, fp32", call, GdnCase.example(call, platform="gpu", hopper=True,
                                                                dtype=jnp.float32)) for call in CALL_KINDS]
    cells += [DocCase("GPU, K = V = 256", call, GdnCase.example(call, platform="gpu", hopper=True, head_k_dim=256,
                                                                head_v_dim=256)) for call in CALL_KINDS]
    return tuple(cells)


#: The gated delta rule's implementations, in the order "auto" tries them (see the module docstring).
TABLE = OpTable(
    op="gated_delta_rule",
    call_kinds=CALL_KINDS,
    implementations=(
        Implementation("triton.recurrent_varlen", ("pallas",), "one per-token Pallas Triton launch over every "
                       "sequence (triton/recurrent_varlen.py)", _triton_supports(False), calls=("short_mix",),
                       limits=_TRITON_LIMITS),
        Implementation("mosaic_gpu.chunk", ("mosaic_gpu",), "Triton stage 1a + the warp-specialised Mosaic GPU "
                       "state pass (mosaic_gpu/chunk.py)", _mosaic_prefill_supports(("dense",)),
                       calls=("dense", "short_mix"), limits=_MOSAIC_LIMITS),
        Implementation("mosaic_gpu.varlen", ("mosaic_gpu",), "the same kernels over chunk-aligned packed sequences "
                       "(mosaic_gpu/varlen.py)", _mosaic_prefill_supports(("varlen", "slots")),
                       calls=("varlen", "slots", "short_mix"), limits=_MOSAIC_LIMITS),
        Implementation("mosaic_gpu.decode", ("mosaic_gpu",), "the Mosaic GPU decode kernel, direct transfer "
                       "(mosaic_gpu/decode.py)", _mosaic_decode_supports(False), calls=("decode",),
                       limits="Hopper (sm_90); T = 1; K, V in {64, 128}"),
        Implementation("triton.chunk", ("pallas",), "the chunked Pallas Triton prefill kernels (triton/chunk.py)",
                       _triton_supports(False), calls=_PREFILL, limits=_TRITON_LIMITS),
        Implementation("triton.decode", ("pallas",), "the Pallas Triton decode kernel over the pool in place "
                       "(triton/decode.py)", _triton_supports(False), calls=("decode",), limits=_TRITON_LIMITS),
        Implementation("xla", ("xla",), "reference.py: the chunked form (prefill), the lax.scan step (decode)",
                       _always, limits="any platform, dtype and head dims; the backward of every prefill kernel"),
        Implementation("triton.recurrent_varlen.interpret", ("pallas_interpret", "mosaic_gpu_interpret"),
                       "the per-token kernel in Pallas interpret mode", _triton_supports(True),
                       calls=("short_mix",), auto=False, interpret=True, limits="any platform; K, V <= 128"),
        Implementation("triton.chunk.interpret", ("pallas_interpret", "mosaic_gpu_interpret"),
                       "the chunked Triton kernels in Pallas interpret mode", _triton_supports(True), calls=_PREFILL,
                       auto=False, interpret=True, limits="any platform; K, V <= 128"),
        Implementation("mosaic_gpu.decode.interpret", ("mosaic_gpu_interpret",), "the Mosaic GPU decode kernel in "
                       "interpret mode", _mosaic_decode_supports(True), calls=("decode",), auto=False,
                       interpret=True, limits="any platform; T = 1; K, V in {64, 128}"),
        Implementation("triton.decode.interpret", ("pallas_interpret", "mosaic_gpu_interpret"),
                       "the Triton decode kernel in Pallas interpret mode", _triton_supports(True),
                       calls=("decode",), auto=False, interpret=True, limits="any platform; K, V <= 128"),
    ),
    fallbacks=(("mosaic_gpu", "pallas"),),
    doc_cases=_gdn_doc_cases(),
)


def resolve(backend: str, case: GdnCase, *, warn: bool = True) -> Implementation:
    """The implementation of :data:`TABLE` that runs ``case`` for the user's ``backend``."""
    return TABLE.resolve(backend, case, warn=warn)


def resolve_backend(backend: str) -> str:
    """Checks the backend name and the platform without a call's shapes: "auto" -> "pallas" on a GPU, else "xla";
    an explicit name is returned, "pallas" / "mosaic_gpu" without a GPU raise ValueError. The kernel a call runs
    is the table's pick for its case (:func:`resolve`)."""
    TABLE.check_backend(backend)
    platform = jax.default_backend()
    if backend == "auto":
        return "pallas" if platform == "gpu" else "xla"
    if backend in ("pallas", "mosaic_gpu") and platform != "gpu":
        raise ValueError(f"backend={backend!r} needs a GPU (jax.default_backend() is {platform!r}); "
                         "use backend='xla', 'auto' or 'pallas_interpret'")
    return backend


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


def _check_pallas_chunk_size(chunk_size: int) -> None:
    if chunk_size % 16:
        raise ValueError(f"chunk_size must be a multiple of 16 for the Pallas backends, got {chunk_size}; "
                         "use backend='xla' for other chunk sizes")


def _pallas_inputs(q, k, g, cu_seqlens, chunk_size, use_qk_l2norm):
    """The inputs as the chunked Triton kernels take them (the table has run ``check_supported``): q, k
    L2-normalised (if asked) in their own dtype, g in fp32, and the on-device chunk map for varlen (None for
    dense rows)."""
    _check_pallas_chunk_size(chunk_size)
    q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=True)
    chunk_map = None if cu_seqlens is None else build_chunk_map(cu_seqlens, q.shape[1], chunk_size)
    return q, k, g.astype(jnp.float32), chunk_map


def _run_short_mix(impl: Implementation, chunk_size) -> bool:
    """Whether ``impl`` is the per-token kernel (the table has run ``check_supported``; both Pallas paths refuse
    the same chunk sizes)."""
    if not impl.name.startswith("triton.recurrent_varlen"):
        return False
    _check_pallas_chunk_size(chunk_size)
    return True


def _prepare_qk(q, k, use_qk_l2norm: bool, keep_dtype: bool):
    if not use_qk_l2norm:
        return q, k
    qn, kn = l2norm(q.astype(jnp.float32), eps=1e-6), l2norm(k.astype(jnp.float32), eps=1e-6)
    if keep_dtype:
        qn, kn = qn.astype(q.dtype), kn.astype(k.dtype)
    return qn, kn


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
                           output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm: bool = False,
                           chunk_size: int = 64, backend: str = "auto",
                           dispatch: DispatchConfig = DEFAULT_DISPATCH):
    """Chunked gated delta rule (prefill). Returns ``(o [B, T, Hv, V], final_state [N, Hv, K, V] fp32 or None)``.

    Shape legend: B rows, T tokens, N sequences, Hk / Hv key / value heads, K / V head dims, C = chunk_size.
      q, k [B, T, Hk, K]; v [B, T, Hv, V] (o takes v's dtype); g (log-decay, fp32 or bf16), beta [B, T, Hv];
      initial_state [N, Hv, K, V] fp32 or None (zeros); cu_seqlens [N + 1] int32 or None (then N = B).
    ``cu_seqlens`` packs N sequences into one row (B == 1); each starts from ``initial_state[n]``; an empty
    sequence's final state is its initial state; tokens past cu_seqlens[N] are padding (output rows zero).
    ``scale`` is a Python float (default K ** -0.5); ``chunk_size`` a positive int (a multiple of 16 on Pallas).
    Both backends cut the row into at most T // C + N chunks on the device (no host sync, one compile per (T, N)).
    See the module docstring for g = -inf, NaN inputs, head dims, mixed dtypes and autodiff. ``backend``: a name
    of :data:`TABLE` ("auto" resolves from the call's case); ``dispatch``: the table's measured rules.
    """
    TABLE.check_backend(backend)
    b, t, hk, hv, dk, dv, n, cu_seqlens = _check_common(q, k, v, g, beta, cu_seqlens)
    validation.check_initial_state(initial_state, n, hv, dk, dv)
    chunk_size, scale = _check_chunk_size_and_scale(chunk_size, scale, dk)
    case = GdnCase.of("dense" if cu_seqlens is None else "varlen", q, k, v, num_seqs=n, chunk_size=chunk_size,
                      dispatch=dispatch)
    impl = TABLE.resolve(backend, case)
    reference = functools.partial(_dense_xla, scale=scale, output_final_state=output_final_state,
                                  use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    if impl.name == "xla":
        return reference(q, k, v, g, beta, initial_state, cu_seqlens)
    kernel = functools.partial(_dense_kernel, impl, scale=scale, output_final_state=output_final_state,
                               use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    if _mosaic_backward(impl, dispatch, cu_seqlens):                   # the Mosaic backward kernels
        backward = functools.partial(mosaic_backward_pass, scale=scale, use_qk_l2norm=use_qk_l2norm)
        return kernel_vjp(kernel, backward)(q, k, v, g, beta, initial_state, cu_seqlens)
    return reference_vjp(kernel, reference)(q, k, v, g, beta, initial_state, cu_seqlens)


def _mosaic_backward(impl: Implementation, dispatch: DispatchConfig, cu_seqlens) -> bool:
    """Whether a call the table sent to ``impl`` differentiates through the Mosaic backward kernels."""
    if impl.name not in ("mosaic_gpu.chunk", "mosaic_gpu.varlen"):
        return False
    return dispatch.mosaic_backward if cu_seqlens is None else dispatch.mosaic_backward_varlen


def mosaic_backward_pass(args, cotangent, *, scale: float, use_qk_l2norm: bool, impl: str = "mosaic"):
    """The VJP of the "mosaic_gpu" forward (``mosaic_gpu/backward.py``; dense rows, or packed rows with
    ``cu_seqlens``): cotangents of (q, k, v, g, beta, initial_state, cu_seqlens) from those of (o, final_state).
    The L2 norm (when ``use_qk_l2norm``) is differentiated in XLA around the kernels, as the forward runs it in XLA
    before them. ``impl="reference"`` runs the kernels' jnp twin (the CPU tests)."""
    q, k, v, g, beta, initial_state, cu_seqlens = args
    do, dht = cotangent
    (qn, kn), l2_vjp = jax.vjp(lambda q, k: _prepare_qk(q, k, use_qk_l2norm, keep_dtype=True), q, k)
    if cu_seqlens is None:
        grads = mosaic_gpu_backward.chunk_gated_delta_rule_bwd(qn, kn, v, g, beta, initial_state, do, dht,
                                                               scale=float(scale), impl=impl)
    else:
        grads = mosaic_gpu_backward.chunk_gated_delta_rule_varlen_bwd(qn, kn, v, g, beta, cu_seqlens, initial_state,
                                                                      do, dht, scale=float(scale), impl=impl)
    dqn, dkn, dv, dg, dbeta, dh0 = grads
    dq, dk = l2_vjp((dqn, dkn))
    return dq, dk, dv, dg, dbeta, dh0, None


def mosaic_slots_backward_pass(args, cotangent, *, scale: float, use_qk_l2norm: bool, impl: str = "mosaic"):
    """The VJP of the "mosaic_gpu" slot-pool forward (``varlen.op_fwd_slots``: the pool's gather, the op, the
    scatter): the gather's and the scatter's VJPs in XLA around :func:`mosaic_backward_pass`. Cotangents of
    (q, k, v, g, beta, ssm_state, slot_ids, has_initial_state, cu_seqlens) from those of (o, new_ssm_state)."""
    q, k, v, g, beta, ssm_state, slot_ids, has_initial_state, cu_seqlens = args
    do, dpool_new = cotangent
    h0, gather_vjp = jax.vjp(lambda pool: gather_slots(pool.astype(jnp.float32), slot_ids, has_initial_state),
                             ssm_state)
    # scatter_slots' VJP does not depend on the scattered values: zeros stand in for the final states
    _, scatter_vjp = jax.vjp(lambda pool, ht: scatter_slots(pool, slot_ids, ht), ssm_state, jnp.zeros_like(h0))
    dpool_kept, dht = scatter_vjp(dpool_new)
    dq, dk, dv, dg, dbeta, dh0, _ = mosaic_backward_pass((q, k, v, g, beta, h0, cu_seqlens), (do, dht), scale=scale,
                                                         use_qk_l2norm=use_qk_l2norm, impl=impl)
    (dpool_read,) = gather_vjp(dh0)
    return dq, dk, dv, dg, dbeta, dpool_kept + dpool_read, None, None, None


def _dense_xla(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, output_final_state, use_qk_l2norm,
               chunk_size):
    """The "xla" backend of :func:`chunk_gated_delta_rule` (arguments checked), also the kernels' backward."""
    q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=False)
    return chunk_gated_delta_rule_xla(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                                      chunk_size=chunk_size)


def _dense_kernel(impl, q, k, v, g, beta, initial_state, cu_seqlens, *, scale, output_final_state, use_qk_l2norm,
                  chunk_size):
    """The kernel ``impl`` of :func:`chunk_gated_delta_rule` (arguments checked; forward only)."""
    if _run_short_mix(impl, chunk_size):
        return recurrent_varlen.recurrent_varlen_fwd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, interpret=impl.interpret)
    if impl.name in ("mosaic_gpu.chunk", "mosaic_gpu.varlen"):
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=True)
        if cu_seqlens is not None:
            return mosaic_gpu_varlen.op_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return mosaic_gpu.op_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state)
    q, k, g, chunk_map = _pallas_inputs(q, k, g, cu_seqlens, chunk_size, use_qk_l2norm)
    return pallas_triton.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        chunk_map=chunk_map, output_final_state=output_final_state, chunk_size=chunk_size,
        interpret=impl.interpret)


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
                                 backend: str = "auto", dispatch: DispatchConfig = DEFAULT_DISPATCH):
    """Chunked gated delta rule over a slot pool. Returns ``(o [B, T, Hv, V], new_ssm_state [S, Hv, K, V] fp32)``.

    Shape legend: B rows, T tokens, N sequences, S slots, Hk / Hv key / value heads, K / V head dims.
      q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; cu_seqlens [N + 1] int32 or None (then N = B);
      ssm_state [S, Hv, K, V] fp32; slot_ids [N] int32 (distinct inside [0, S)); has_initial_state [N] bool.
    Sequence n starts from ``ssm_state[slot_ids[n]]`` (zeros where ``has_initial_state[n]`` is False, whatever the
    slot holds) and its final state is written back to that slot; every other slot is returned unchanged. An id
    outside [0, S) (S for a padding stream, -1, a bad traced value) reads zeros and its write is dropped. Tokens
    past cu_seqlens[N] are padding (output rows zero, no state touched). Without cu_seqlens, N = B. Under
    ``jax.jit`` donate ``ssm_state`` to update it in place. ``backend`` / ``dispatch``: as
    :func:`chunk_gated_delta_rule`.
    """
    TABLE.check_backend(backend)
    b, t, hk, hv, dk, dv, n, cu_seqlens = _check_common(q, k, v, g, beta, cu_seqlens)
    num_slots = validation.check_ssm_state_pool(ssm_state, hv, dk, dv)
    validation.check_slot_ids(slot_ids, num_slots, n, allow_no_slot=True)
    validation.check_has_initial_state(has_initial_state, n)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    has_initial_state = jnp.asarray(has_initial_state)
    chunk_size, scale = _check_chunk_size_and_scale(chunk_size, scale, dk)
    impl = TABLE.resolve(backend, GdnCase.of("slots", q, k, v, num_seqs=n, chunk_size=chunk_size,
                                             dispatch=dispatch))
    reference = functools.partial(_slots_xla, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    if impl.name == "xla":
        return reference(q, k, v, g, beta, ssm_state, slot_ids, has_initial_state, cu_seqlens)
    kernel = functools.partial(_slots_kernel, impl, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               chunk_size=chunk_size)
    if _mosaic_backward(impl, dispatch, cu_seqlens):
        backward = functools.partial(mosaic_slots_backward_pass, scale=scale, use_qk_l2norm=use_qk_l2norm)
        return kernel_vjp(kernel, backward)(q, k, v, g, beta, ssm_state, slot_ids, has_initial_state, cu_seqlens)
    return reference_vjp(kernel, reference)(q, k, v, g, beta, ssm_state, slot_ids, has_initial_state, cu_seqlens)


def _slots_xla(q, k, v, g, beta, ssm_state, slot_ids, has_initial_state, cu_seqlens, *, scale, use_qk_l2norm,
               chunk_size):
    """The "xla" backend of :func:`chunk_gated_delta_rule_slots` (arguments checked), also the kernels' backward."""
    q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=False)
    return chunk_gated_delta_rule_slots_xla(
        q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
        has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _slots_kernel(impl, q, k, v, g, beta, ssm_state, slot_ids, has_initial_state, cu_seqlens, *, scale,
                  use_qk_l2norm, chunk_size):
    """The kernel ``impl`` of :func:`chunk_gated_delta_rule_slots` (arguments checked; forward only)."""
    if _run_short_mix(impl, chunk_size):
        return recurrent_varlen.recurrent_varlen_slots_fwd(
            q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
            has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
            interpret=impl.interpret)
    if impl.name in ("mosaic_gpu.chunk", "mosaic_gpu.varlen"):
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=True)
        return mosaic_gpu_varlen.op_fwd_slots(q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
                                              has_initial_state=has_initial_state, cu_seqlens=cu_seqlens)
    q, k, g, chunk_map = _pallas_inputs(q, k, g, cu_seqlens, chunk_size, use_qk_l2norm)
    return pallas_triton.chunk_gated_delta_rule_slots_fwd(
        q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
        has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, chunk_map=chunk_map, chunk_size=chunk_size,
        interpret=impl.interpret)


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
    with the state read from and written to a pool). The Pallas kernels (the "decode" rows of :data:`TABLE`:
    Mosaic GPU on Hopper where it takes the call under "auto" / "mosaic_gpu", Triton for "pallas") run over the
    pool in place: under ``jax.jit`` donate ``ssm_state``; "xla" gathers the N states, runs the ``lax.scan`` form
    and scatters them back. ``use_qk_l2norm`` normalises q, k in fp32 (fused in the kernel).
    """
    TABLE.check_backend(backend)
    b, t, hk, hv, dk, dv, n, _ = _check_common(q, k, v, g, beta, None)
    num_slots = validation.check_ssm_state_pool(ssm_state, hv, dk, dv)
    validation.check_slot_ids(slot_ids, num_slots, n, allow_no_slot=True)
    if has_initial_state is None:
        has_initial_state = jnp.ones((n,), bool)
    validation.check_has_initial_state(has_initial_state, n)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    has_initial_state = jnp.asarray(has_initial_state)
    scale = float(dk ** -0.5 if scale is None else scale)
    impl = TABLE.resolve(backend, GdnCase.of("decode", q, k, v))
    if impl.name == "xla":
        q, k = _prepare_qk(q, k, use_qk_l2norm, keep_dtype=False)
        return fused_recurrent_gated_delta_rule_slots_xla(q, k, v, g, beta, scale=scale, ssm_state=ssm_state,
                                                          slot_ids=slot_ids, has_initial_state=has_initial_state)
    return _run_decode_kernel(impl, q, k, v, g, beta, scale=scale, ssm_state=ssm_state, slot_ids=slot_ids,
                              has_initial_state=has_initial_state, use_qk_l2norm=use_qk_l2norm)


def _run_decode_kernel(impl: Implementation, q, k, v, g, beta, *, raw_gates=None, **kw):
    if impl.name.startswith("mosaic_gpu.decode"):
        return mosaic_gpu_decode.fused_recurrent_gated_delta_rule_slots_fwd(q, k, v, g, beta, interpret=impl.interpret,
                                                                            raw_gates=raw_gates, **kw)
    return decode.fused_recurrent_gated_delta_rule_slots_fwd(q, k, v, g, beta, interpret=impl.interpret,
                                                             raw_gates=raw_gates, **kw)


def decode_slots_raw_gates(q, k, v, a, b, *, raw_gates: decode.RawGates, scale: float, ssm_state, slot_ids,
                           has_initial_state, backend: str = "auto"):
    """The decode kernel of :func:`fused_recurrent_gated_delta_rule_slots` with g and beta made inside from the
    raw projections (the GDN layer's fused decode step; ``decode.RawGates``): q, k [N, 1, Hk, K] (already
    L2-normalised), v [N, 1, Hv, V], a, b [N, 1, Hk, Ca]. ``backend`` resolves the "decode" case of :data:`TABLE`
    and must name a Pallas kernel there ("auto" on a GPU, "pallas", "mosaic_gpu", "pallas_interpret",
    "mosaic_gpu_interpret"; ValueError otherwise). Returns (o [N, 1, Hv, V], new ssm_state)."""
    impl = TABLE.resolve(backend, GdnCase.of("decode", q, k, v))
    if impl.name == "xla":
        raise ValueError(f"backend={backend!r} runs the XLA step here, which takes g and beta: the raw-gate decode "
                         "needs a Pallas decode kernel")
    return _run_decode_kernel(impl, q, k, v, a, b, raw_gates=raw_gates, scale=scale, ssm_state=ssm_state,
                              slot_ids=slot_ids, has_initial_state=has_initial_state)
