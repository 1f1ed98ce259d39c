"""The fused causal conv1d + SiLU + q/k L2 norm of the Gated DeltaNet layer (varlen, conv-state slots): checks,
backend pick, and the state update shared by the backends.

Shape legend: T stacked tokens, Cs source columns, C = (2 Hk + Hv) D conv channels ([q | k | v]), D head dim
(K == V), Kc kernel size, S slots, N streams.

Backends: "xla" (reference.conv1d_l2_varlen, any platform), "pallas" (triton.conv1d_l2_pallas on a GPU; the
decode step decode.conv1d_l2_decode_pallas), "pallas_interpret" (the same kernels in interpret mode, any platform;
the CPU tests), "auto" (the first row of :data:`TABLE` that takes the call: "pallas" on a GPU where the kernel
takes the dims, else "xla"). Semantics, the padding contract and the source layout (``block_cols``) are
reference.py's. Autodiff: the prefill op is differentiable (reverse mode) on every backend, the kernels by
``pallas_kernels.autodiff.reference_vjp`` (the kernel runs the forward, the XLA form's VJP the backward); the
decode step is not.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.autodiff import reference_vjp
from pallas_kernels.conv1d import reference
from pallas_kernels.dispatch import DocCase, Implementation, OpTable
from pallas_kernels.gated_delta_rule.chunk_map import gather_slots, scatter_slots

__all__ = ["causal_conv1d_l2_varlen", "causal_conv1d_l2_decode", "supports", "resolve_backend", "ConvCase",
           "TABLE", "BACKENDS"]

_DTYPES = ("bfloat16", "float16", "float32")
CALL_KINDS = ("prefill", "decode")


def supports(*, platform: str, dtype, head_k_dim: int, head_v_dim: int, interpret: bool = False) -> Optional[str]:
    """None when the Pallas kernel can run this case, else the reason (a sentence naming the limit)."""
    if jnp.dtype(dtype).name not in _DTYPES:
        return f"pallas conv1d: dtype must be one of {_DTYPES}, got {jnp.dtype(dtype).name}"
    if head_k_dim != head_v_dim:
        return f"pallas conv1d: needs head_k_dim == head_v_dim (one head per channel block), got {head_k_dim}, " \
               f"{head_v_dim}"
    if head_k_dim > 256:
        return f"pallas conv1d: head dim up to 256, got {head_k_dim}"
    if not interpret and platform != "gpu":
        return f"pallas conv1d needs a GPU (platform is {platform!r}); 'pallas_interpret' runs on CPU"
    if not interpret and head_k_dim % 16:
        return f"pallas conv1d on a GPU: head dim must be a multiple of 16 (aligned loads), got {head_k_dim}"
    return None


@dataclasses.dataclass(frozen=True)
class ConvCase:
    """What the dispatch table sees of one call: call kind ("prefill": packed streams, "decode": one token per
    stream), platform (``jax.default_backend()``), x's dtype, head dims K and V."""

    call: str
    platform: str
    dtype: Any
    head_k_dim: int
    head_v_dim: int

    def __post_init__(self):
        if self.call not in CALL_KINDS:
            raise ValueError(f"call must be one of {CALL_KINDS}, got {self.call!r}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))


def _kernel_supports(interpret: bool, decode: bool):
    def check(case: ConvCase) -> Optional[str]:
        why = supports(platform=case.platform, dtype=case.dtype, head_k_dim=case.head_k_dim,
                       head_v_dim=case.head_v_dim, interpret=interpret)
        d = case.head_k_dim
        if why is None and decode and d & (d - 1):
            why = f"pallas conv1d decode: head dim must be a power of two, got {d}"
        return why
    return check


def _always(case: ConvCase) -> Optional[str]:
    return None


#: The fused conv + L2 norm's implementations, in the order "auto" tries them.
TABLE = OpTable(
    op="conv1d",
    call_kinds=CALL_KINDS,
    implementations=(
        Implementation("triton", ("pallas",), "conv + SiLU + q/k L2 norm in one Pallas Triton kernel (triton.py)",
                       _kernel_supports(False, False), calls=("prefill",),
                       limits="CUDA GPU; bf16 / fp16 / fp32; K == V, a multiple of 16 up to 256"),
        Implementation("triton.decode", ("pallas",), "one token per stream, conv states advanced in place "
                       "(decode.py)", _kernel_supports(False, True), calls=("decode",),
                       limits="CUDA GPU; K == V, a power of two up to 256"),
        Implementation("xla", ("xla",), "reference.conv1d_l2_varlen (decode: cu_seqlens = arange(N + 1))", _always,
                       limits="any platform"),
        Implementation("triton.interpret", ("pallas_interpret",), "the prefill kernel in Pallas interpret mode",
                       _kernel_supports(True, False), calls=("prefill",), auto=False, interpret=True,
                       limits="any platform; K == V up to 256"),
        Implementation("triton.decode.interpret", ("pallas_interpret",), "the decode kernel in Pallas interpret "
                       "mode", _kernel_supports(True, True), calls=("decode",), auto=False, interpret=True,
                       limits="any platform; K == V, a power of two up to 256"),
    ),
    doc_cases=tuple(DocCase(label, call, ConvCase(call, platform, jnp.bfloat16, 128, 128))
                    for label, platform in (("CPU", "cpu"), ("GPU", "gpu")) for call in CALL_KINDS),
)
BACKENDS = TABLE.backends
#: implementation -> the backend name the kernels' bodies take
KERNEL = {"triton": "pallas", "triton.decode": "pallas", "xla": "xla", "triton.interpret": "pallas_interpret",
          "triton.decode.interpret": "pallas_interpret"}


def resolve_backend(backend: str, *, call: str, dtype, head_k_dim: int, head_v_dim: int) -> str:
    """The kernel name ("pallas", "pallas_interpret" or "xla") :data:`TABLE` runs for ``backend`` at this case
    on this platform; an explicit name that cannot run raises ValueError naming it and the reason."""
    case = ConvCase(call, jax.default_backend(), dtype, head_k_dim, head_v_dim)
    return KERNEL[TABLE.resolve(backend, case).name]


def causal_conv1d_l2_varlen(x: jax.Array, w: jax.Array, conv_state_pool: jax.Array, cu_seqlens: jax.Array,
                            slot_ids: jax.Array, has_initial_state: jax.Array, *, num_k_heads: int,
                            num_v_heads: int, head_dim: int, block_cols=None, eps: float = 1e-6,
                            backend: str = "xla", config=None):
    """Causal conv1d + SiLU of N packed streams from their slots' conv states, then the L2 norm of every q and k
    head.

    x: [T, Cs] (channel c = b D + i read from source column ``block_cols[b] + i``; None: Cs == C, identity;
    ``reference.qkvz_block_cols`` for Qwen3-Next's fused in_proj_qkvz output); w: [C, Kc]; conv_state_pool
    [S, C, Kc - 1]; cu_seqlens [N + 1] int32 (cu[N] <= T: later tokens are padding, their rows zeros, no state
    touched); slot_ids [N] int32 (ids outside [0, S): zeros read, write dropped); has_initial_state [N] bool.
    Returns (q [T, Hk, D], k [T, Hk, D], v [T, Hv, D] in x.dtype; the pool with the N streams' states advanced).
    """
    TABLE.check_backend(backend)
    if x.ndim != 2:
        raise ValueError(f"causal_conv1d_l2_varlen: x must be [T, Cs], got shape {tuple(x.shape)}")
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    c = (2 * hk + hv) * d
    if w.ndim != 2 or w.shape[0] != c or w.shape[1] < 1:
        raise ValueError(f"causal_conv1d_l2_varlen: w must be [C, Kc] with C = (2 Hk + Hv) D = {c}, "
                         f"got shape {tuple(w.shape)}")
    if block_cols is None:
        if x.shape[1] != c:
            raise ValueError(f"causal_conv1d_l2_varlen: x must be [T, C] = [T, {c}] when block_cols is None, "
                             f"got shape {tuple(x.shape)}")
    else:
        cols = np.asarray(block_cols)
        if cols.shape != (2 * hk + hv,) or cols.min() < 0 or cols.max() + d > x.shape[1]:
            raise ValueError(f"causal_conv1d_l2_varlen: block_cols must hold 2 Hk + Hv = {2 * hk + hv} source "
                             f"columns in [0, {x.shape[1] - d}], got {block_cols!r}")
    kc = w.shape[1]
    reference.check_pool_meta("causal_conv1d_l2_varlen", conv_state_pool, c, kc, cu_seqlens, slot_ids,
                              has_initial_state)
    backend = resolve_backend(backend, call="prefill", dtype=x.dtype, head_k_dim=d, head_v_dim=d)
    if backend == "xla":
        return reference.conv1d_l2_varlen(x, w, conv_state_pool, cu_seqlens, slot_ids, has_initial_state,
                                          num_k_heads=hk, num_v_heads=hv, head_dim=d, block_cols=block_cols,
                                          eps=eps)
    cols = np.arange(2 * hk + hv, dtype=np.int32) * d if block_cols is None else np.asarray(block_cols, np.int32)
    if backend == "pallas" and (cols % 16).any():
        raise ValueError(f"pallas conv1d: block_cols must be multiples of 16 on a GPU, got {block_cols!r}")
    statics = dict(num_k_heads=hk, num_v_heads=hv, head_dim=d, block_cols=block_cols, eps=eps)
    kernel = functools.partial(_varlen_kernel, cols=cols, interpret=backend == "pallas_interpret", config=config,
                               **statics)
    reference_fn = functools.partial(reference.conv1d_l2_varlen, **statics)
    return reference_vjp(kernel, reference_fn)(x, w, conv_state_pool, cu_seqlens, slot_ids, has_initial_state)


def _varlen_kernel(x, w, conv_state_pool, cu_seqlens, slot_ids, has_initial_state, *, cols, num_k_heads,
                   num_v_heads, head_dim, block_cols, eps, interpret, config):
    """The Pallas kernel of :func:`causal_conv1d_l2_varlen` (arguments checked; forward only: its VJP is the XLA
    form's, ``pallas_kernels.autodiff.reference_vjp``)."""
    from pallas_kernels.conv1d.triton import conv1d_l2_pallas

    hk, hv, d = num_k_heads, num_v_heads, head_dim
    n = slot_ids.shape[0]
    c = (2 * hk + hv) * d
    kc = w.shape[1]
    cu = cu_seqlens.astype(jnp.int32)
    q, k, v = conv1d_l2_pallas(x, w, cu[n], jnp.asarray(cols), num_k_heads=hk, num_v_heads=hv, head_dim=d, eps=eps,
                               interpret=interpret, config=config)
    if kc == 1:
        return q, k, v, conv_state_pool
    prev = gather_slots(conv_state_pool, slot_ids, jnp.asarray(has_initial_state, bool)).astype(jnp.float32)
    src = None if block_cols is None else reference.channel_source_index(block_cols, d, c)
    q, k, v = reference.fix_boundaries(q, k, v, x, w, prev, cu, src, eps=eps)
    pool = scatter_slots(conv_state_pool, slot_ids, reference.new_conv_states(x, prev, cu, src))
    return q, k, v, pool


def causal_conv1d_l2_decode(x: jax.Array, w: jax.Array, conv_state_pool: jax.Array, slot_ids: jax.Array,
                            has_initial_state: jax.Array, *, num_k_heads: int, num_v_heads: int, head_dim: int,
                            block_cols=None, eps: float = 1e-6, backend: str = "xla", config=None):
    """The decode step of ``causal_conv1d_l2_varlen``: ONE token per stream (row n of x is stream n's token), the
    conv state of each stream's slot read and advanced by one token.

    x: [N, Cs] (``block_cols`` as in ``causal_conv1d_l2_varlen``); w: [C, Kc], Kc >= 2; conv_state_pool
    [S, C, Kc - 1]; slot_ids [N] int32 (ids outside [0, S): zeros read, write dropped: a padding stream has slot id
    S); has_initial_state [N] bool. Returns (q [N, Hk, D], k [N, Hk, D] L2-normalised, v [N, Hv, D] in x.dtype;
    the pool with the N streams' states advanced). "xla" is ``reference.conv1d_l2_varlen`` with
    ``cu_seqlens = arange(N + 1)``; "pallas" / "pallas_interpret" run ``decode.conv1d_l2_decode_pallas`` over the
    pool in place (donate it under jit; D must be a power of two).
    """
    TABLE.check_backend(backend)
    if x.ndim != 2:
        raise ValueError(f"causal_conv1d_l2_decode: x must be [N, Cs], got shape {tuple(x.shape)}")
    n = x.shape[0]
    if jnp.ndim(slot_ids) != 1 or jnp.shape(slot_ids)[0] != n:
        raise ValueError(f"causal_conv1d_l2_decode: slot_ids must be [N] = [{n}] (one token per stream), "
                         f"got shape {tuple(jnp.shape(slot_ids))}")
    if w.ndim != 2 or w.shape[1] < 2:
        raise ValueError(f"causal_conv1d_l2_decode: w must be [C, Kc] with Kc >= 2, got shape {tuple(w.shape)}")
    cu = jnp.arange(n + 1, dtype=jnp.int32)
    if n > 0 and backend != "xla":
        backend = resolve_backend(backend, call="decode", dtype=x.dtype, head_k_dim=head_dim, head_v_dim=head_dim)
    if backend == "xla" or n == 0:
        return causal_conv1d_l2_varlen(x, w, conv_state_pool, cu, slot_ids, has_initial_state, num_k_heads=num_k_heads,
                                       num_v_heads=num_v_heads, head_dim=head_dim, block_cols=block_cols, eps=eps,
                                       backend="xla")
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    c = (2 * hk + hv) * d
    if w.shape[0] != c:
        raise ValueError(f"causal_conv1d_l2_decode: w must be [C, Kc] with C = (2 Hk + Hv) D = {c}, "
                         f"got shape {tuple(w.shape)}")
    reference.check_pool_meta("causal_conv1d_l2_decode", conv_state_pool, c, w.shape[1], cu, slot_ids,
                               has_initial_state)
    cols = np.arange(2 * hk + hv, dtype=np.int32) * d if block_cols is None else np.asarray(block_cols, np.int32)
    if cols.shape != (2 * hk + hv,) or cols.min() < 0 or cols.max() + d > x.shape[1]:
        raise ValueError(f"causal_conv1d_l2_decode: block_cols must hold 2 Hk + Hv = {2 * hk + hv} source columns "
                         f"in [0, {x.shape[1] - d}], got {block_cols!r}")
    if backend == "pallas" and (cols % 16).any():
        raise ValueError(f"pallas conv1d: block_cols must be multiples of 16 on a GPU, got {block_cols!r}")
    from pallas_kernels.conv1d.decode import conv1d_l2_decode_pallas
    return conv1d_l2_decode_pallas(x, w, conv_state_pool, jnp.asarray(slot_ids, jnp.int32),
                                   jnp.asarray(has_initial_state), jnp.asarray(cols), num_k_heads=hk,
                                   num_v_heads=hv, head_dim=d, eps=eps, interpret=backend == "pallas_interpret",
                                   config=config)
