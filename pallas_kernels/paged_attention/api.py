"""Public entry of paged causal attention: checks once, picks a backend, runs the reference or a kernel.

Shape legend: T stacked query tokens, N streams, S slots, H query heads, Hkv kv heads (G = H / Hkv; query head h
reads kv head h // G), Dh head dim, P pages in the pool, Ps tokens per page, W pages per slot in the page table.

    paged_attention(q [T, H, Dh], k_pages, v_pages [P, Ps, Hkv, Dh], page_table [S, W] int32, slot_lens [S] int32,
                    cu_seqlens [N + 1] int32, slot_ids [N] int32, *, scale, backend="xla") -> o [T, H, Dh]
    paged_attention_decode(q [N, H, Dh], k_pages, v_pages, page_table, slot_lens, slot_ids, *, scale,
                           backend="xla") -> o [N, H, Dh]
    paged_attention_gated(qg [T, C], k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *,
                          q_norm [Dh], cos [T, R], sin [T, R], num_heads, scale, eps, backend="xla")
        -> o [T, H * Dh]   (Qwen3-Next's gated attention prefill: q RMSNorm + partial RoPE on the raw q_proj
                            output, attention, * sigmoid(gate) in the kernel's epilogue on the Pallas backends)
    paged_attention_decode_gated(qg [N, C], k_pages, v_pages, page_table, slot_lens, slot_ids, *, q_norm,
                                 cos [N, R], sin [N, R], num_heads, scale, eps, backend="xla") -> o [N, H * Dh]
                           (the same for one decode step: the gate where the decode kernels finish o)
    paged_kv_write(k_pages, v_pages, yk [T, Ck], yv [T, Cv], token_page [T], token_offset [T], *, k_norm, cos,
                   sin, k_col, v_col, eps, backend="xla") -> (k_pages, v_pages)
                           (k RMSNorm + RoPE and both page writes; one kernel on the Pallas backends)

slot_lens are the tokens each slot holds AFTER this call's K/V were written: query j of stream n (token
cu[n] + j) sits at position slot_lens[slot] - (cu[n+1] - cu[n]) + j and attends causally to its slot's keys
0 .. that position through page_table[slot]; a decode query sits at slot_lens[slot] - 1. Padding tokens
(>= cu[N]), streams whose slot id is outside [0, S), and page ids outside [0, P) read nothing (zeros out).
Output in q's dtype; scores and softmax in fp32. Nothing here reads a value back to the host under jit: loop
trip counts come from the device-side slot lengths, so one compiled program serves any lengths with the same
(T, N) and the same pool and page-table shapes.

Backends: "xla" (reference.py: gathers every page of the slot, the CPU default and the oracle), "pallas" (the
Pallas Triton kernels of triton.py, GPU), "pallas_interpret" (the same kernels in interpret mode, CPU),
"cudnn" (prefill through cuDNN's packed fused attention, cudnn.py: bf16 / fp16 on a Hopper GPU; decode on
this backend runs the Pallas decode kernel, or xla where that cannot run), "cudnn_xla" (cudnn.py's packing and
merge with an XLA stand-in for the cuDNN call: any platform, for tests), "auto" (the first of :data:`TABLE`'s
order that supports the call: cudnn, then pallas on a GPU, else xla). :data:`TABLE` says what each one takes
(``python -m pallas_kernels.registry`` prints it); :func:`resolve_backend` / :func:`decode_backend` resolve it
once per call.

Autodiff: the prefill entries (``paged_attention``, ``paged_attention_gated``) are differentiable (reverse mode) on
every backend: "xla" by its own autodiff, the kernels by ``pallas_kernels.autodiff.reference_vjp`` (the kernel
runs the forward, the XLA form's VJP the backward: gradients of the queries, the pages and the norm weight; the
pages' cotangent flows back through the page write to the new keys and values). One exception: the gated entry
on the cuDNN backends with ``k_new`` / ``v_new`` differentiates, where no live stream has context, the fresh
causal call itself (cuDNN's fused attention backward; its cotangents reach k_new / v_new, the pages get zeros),
and only calls with context take the XLA form's VJP (``_gated_fresh_backward``). Decode and
``paged_kv_write``'s kernel are inference only.

Checks: shapes and dtypes always (ValueError naming the argument). When cu_seqlens, slot_ids, slot_lens and the
page table are concrete (not traced), also their values: cu_seqlens non-decreasing from 0 to at most T, every
stream with a slot no longer than its slot's length, every slot's length within its W pages, and every page id a
live key may read inside [0, P). Under jit nothing is checked by value, and the kernels mask instead (a page id
outside [0, P) is never dereferenced).

This module imports only jax, numpy, pallas_kernels.dispatch and pallas_kernels.autodiff.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.autodiff import kernel_vjp, reference_vjp
from pallas_kernels.dispatch import DocCase, Implementation, OpTable
from pallas_kernels.paged_attention import reference

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
GPU_HEAD_DIMS = (64, 128, 256)
CALL_KINDS = ("prefill", "decode")
_MAX_ELEMENTS = 2 ** 31 - 1     # the kernels address q, o and the pools with int32 element offsets


def supports(*, platform: str, dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> Optional[str]:
    """Why the Pallas Triton kernels cannot run these inputs (a sentence), or None when they can.
    platform: "gpu" / "cuda" (compiled kernel) or "interpret" (interpret mode, any platform)."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not one of bfloat16, float16, float32"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if platform == "interpret":
        return None
    if platform not in ("gpu", "cuda"):
        return f"platform {platform!r}: the kernels are Pallas Triton (CUDA GPU) or interpret mode"
    if head_dim not in GPU_HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {GPU_HEAD_DIMS}"
    if num_heads // num_kv_heads > 16:
        return f"{num_heads // num_kv_heads} query heads per kv head (at most 16 are packed in one tile)"
    return None


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """What the dispatch table sees of one call: call kind ("prefill" | "decode"), platform
    (``jax.default_backend()``), q's dtype, head dim, query / kv heads, sizes ((array name, element count)
    pairs: the kernels' int32 addressing) and hopper (None: ask the installed cuDNN and the device; True / False:
    take the GPU as a Hopper one with cuDNN >= 9 or an older one, the docs' table)."""

    call: str
    platform: str
    dtype: Any
    head_dim: int
    num_heads: int
    num_kv_heads: int
    sizes: tuple = ()
    hopper: Optional[bool] = None

    def __post_init__(self):
        if self.call not in CALL_KINDS:
            raise ValueError(f"call must be one of {CALL_KINDS}, got {self.call!r}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "sizes", tuple(sorted(dict(self.sizes).items())))

    @property
    def dims(self) -> dict:
        return dict(dtype=self.dtype, head_dim=self.head_dim, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads)


def _platform() -> str:
    try:
        return jax.default_backend()
    except RuntimeError:  # pragma: no cover
        return "cpu"


def _size_limit(case: PagedCase) -> Optional[str]:
    for name, n in case.sizes:
        if n > _MAX_ELEMENTS:
            return f"{name} holds {n} elements, more than the 2**31 - 1 the kernels address with int32 offsets"
    return None


def _triton_supports(interpret: bool):
    def check(case: PagedCase) -> Optional[str]:
        return supports(platform="interpret" if interpret else case.platform, **case.dims) or _size_limit(case)
    return check


def _cudnn_supports(stand_in: bool):
    def check(case: PagedCase) -> Optional[str]:
        from pallas_kernels.paged_attention import cudnn as _cudnn
        return _cudnn.supports(platform="xla" if stand_in else case.platform, **case.dims,
                               hopper=case.hopper)
    return check


def _always(case: PagedCase) -> Optional[str]:
    return None


def _doc_cases() -> tuple:
    cells = []
    for label, platform, dtype, hopper in (("CPU", "cpu", jnp.bfloat16, False),
                                           ("GPU (not Hopper), bf16", "gpu", jnp.bfloat16, False),
                                           ("Hopper GPU, bf16", "gpu", jnp.bfloat16, True),
                                           ("Hopper GPU, fp32", "gpu", jnp.float32, True)):
        for call in CALL_KINDS:
            cells.append(DocCase(label, call, PagedCase(call, platform, dtype, 256, 16, 2, hopper=hopper)))
    return tuple(cells)


#: The implementations of paged attention, in the order "auto" tries them. The op's functions run the one
#: :func:`resolve_backend` / :func:`decode_backend` name (``KERNEL[impl.name]``).
TABLE = OpTable(
    op="paged_attention",
    call_kinds=CALL_KINDS,
    implementations=(
        # cuDNN first for the prefill (bf16 / fp16 on Hopper; fp32 stays on Triton), from the H200 run of NOTES.md
        # "cuDNN prefill backend": numerics within 3.7e-3 of float64 / the XLA reference; core 0.96 vs 1.37 ms
        # (varlen16), 2.10 vs 3.57 ms (+2k context), 14.6 vs 28.9 ms (one 32k stream), layer 3.58 vs 4.20 ms.
        Implementation("cudnn", ("cudnn",), "cuDNN's packed (THD) fused attention for the new tokens, merged with "
                       "a context call (cudnn.py)", _cudnn_supports(False), calls=("prefill",),
                       limits="Hopper GPU, cuDNN >= 9; bf16 / fp16; Dh a multiple of 8 up to 256"),
        Implementation("triton", ("pallas",), "the Pallas Triton prefill / decode kernels (triton.py)",
                       _triton_supports(False), limits="CUDA GPU; bf16 / fp16 / fp32; Dh in {64, 128, 256}; "
                       "H / Hkv <= 16; arrays under 2**31 elements"),
        Implementation("cudnn.decode", ("cudnn",), "backend \"cudnn\" at decode: the Pallas Triton decode kernel "
                       "(cuDNN has no paged decode)", _triton_supports(False), calls=("decode",), auto=False,
                       limits="as triton"),
        Implementation("xla", ("xla",), "reference.py: gathers every page of the slot", _always,
                       limits="any platform, dtype and head dim"),
        Implementation("cudnn.decode.xla", ("cudnn", "cudnn_xla"), "the cuDNN backends at decode where the Triton "
                       "kernel cannot run: reference.py", _always, calls=("decode",), auto=False,
                       limits="any platform"),
        Implementation("triton.interpret", ("pallas_interpret",), "the Triton kernels in Pallas interpret mode",
                       _triton_supports(True), auto=False, interpret=True,
                       limits="any platform; arrays under 2**31 elements"),
        Implementation("cudnn_xla", ("cudnn_xla",), "cudnn.py's packing and merge with an XLA stand-in "
                       "for the cuDNN call (tests)", _cudnn_supports(True), calls=("prefill",), auto=False,
                       limits="any platform"),
    ),
    doc_cases=_doc_cases(),
)

#: implementation -> the name the op's jitted bodies take ("xla", "pallas", "pallas_interpret", "cudnn",
#: "cudnn_xla")
KERNEL = {"cudnn": "cudnn", "triton": "pallas", "cudnn.decode": "pallas", "xla": "xla", "cudnn.decode.xla": "xla",
          "triton.interpret": "pallas_interpret", "cudnn_xla": "cudnn_xla"}
BACKENDS = TABLE.backends


def _case(call: str, dtype, head_dim, num_heads, num_kv_heads, sizes) -> PagedCase:
    return PagedCase(call, _platform(), dtype, head_dim, num_heads, num_kv_heads, tuple((sizes or {}).items()))


def resolve_backend(backend: str, *, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                    sizes: Optional[dict] = None) -> str:
    """The prefill kernel name for the user's ``backend`` (:data:`TABLE` at the "prefill" case of these dims):
    "auto" -> "cudnn", "pallas" or "xla" (the first that supports it); an explicit name that cannot run ->
    ValueError naming it and the reason. sizes: {array name: element count} of the call (the int32 addressing
    limit)."""
    TABLE.check_backend(backend)
    case = _case("prefill", dtype, head_dim, num_heads, num_kv_heads, sizes)
    if backend != "auto":
        why = TABLE.why_not(backend, case)
        if why is not None:
            raise ValueError(f"paged attention backend {backend!r} cannot run here: {why}; use backend='pallas' "
                             f"or 'xla' (or 'pallas_interpret' / 'cudnn_xla' for the interpret / stand-in forms)")
    return KERNEL[TABLE.resolve(backend, case).name]


def decode_backend(backend: str, *, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                   sizes: Optional[dict] = None) -> str:
    """The decode kernel name for ``backend`` (a name :func:`resolve_backend` returned, or "auto"): :data:`TABLE`
    at the "decode" case; the cuDNN backends are prefill only and their decode runs the Pallas decode kernel
    ("cudnn" on a GPU where it can), else the XLA path (always for "cudnn_xla")."""
    return KERNEL[TABLE.resolve(backend, _case("decode", dtype, head_dim, num_heads, num_kv_heads, sizes)).name]


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------
def _concrete(x) -> Optional[np.ndarray]:
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # pragma: no cover - abstract values
        return None


def _check_int(x, name: str, shape: tuple, doc: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an int32 array of shape {doc}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int32 array of shape {doc}, got dtype {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {doc} = {list(shape)}, got {list(x.shape)}")


def _check_gated_query(qg, k_pages, v_pages, page_table, slot_lens, num_heads: int, *, rows: str):
    """Checks of the gated entry points' q_proj output qg [rows, C] (per head [query | gate], C >= H 2 Dh) against
    the pool; returns (rows, Dh). rows: the name of qg's first axis in the messages ("T" prefill, "N" decode)."""
    if not hasattr(qg, "ndim") or qg.ndim != 2:
        raise ValueError(f"qg must be [{rows}, C] (q_proj's output), got shape {list(getattr(qg, 'shape', ()))}")
    if not hasattr(k_pages, "ndim") or k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [P, Ps, Hkv, Dh], got shape {list(getattr(k_pages, 'shape', ()))}")
    r, c = qg.shape
    dh = k_pages.shape[3]
    if num_heads < 1 or c < num_heads * 2 * dh:
        raise ValueError(f"qg has {c} columns, fewer than num_heads * 2 * Dh = {num_heads} * 2 * {dh} (per head "
                         f"[query | gate])")
    _check_pool(jax.ShapeDtypeStruct((r, num_heads, dh), qg.dtype), k_pages, v_pages, page_table, slot_lens,
                f"[{rows}, H, Dh]")
    return r, dh


def _check_pool(q, k_pages, v_pages, page_table, slot_lens, what: str):
    if q.ndim != 3:
        raise ValueError(f"q must be {what}, got shape {list(q.shape)}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must share one shape [P, Ps, Hkv, Dh], got {list(k_pages.shape)} "
                         f"and {list(v_pages.shape)}")
    h, dh = q.shape[1], q.shape[2]
    hkv = k_pages.shape[2]
    if k_pages.shape[3] != dh:
        raise ValueError(f"q head dim {dh} != k_pages head dim {k_pages.shape[3]}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"q heads H={h} must be a multiple of the kv heads Hkv={hkv} of k_pages")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if jnp.dtype(k_pages.dtype) != jnp.dtype(v_pages.dtype):
        raise ValueError(f"k_pages and v_pages must share one dtype, got {k_pages.dtype} and {v_pages.dtype}")
    if not hasattr(page_table, "ndim") or page_table.ndim != 2:
        raise ValueError(f"page_table must be int32 [S, W], got shape {list(getattr(page_table, 'shape', ()))}")
    s = page_table.shape[0]
    _check_int(page_table, "page_table", tuple(page_table.shape), "[S, W]")
    if page_table.shape[1] < 1:
        raise ValueError("page_table must have at least one page per slot (W >= 1)")
    _check_int(slot_lens, "slot_lens", (s,), "[S]")


def _check_values(cu, slot_ids, slot_lens, page_table, num_pages: int, page_size: int, num_tokens: int):
    """Value checks on concrete arrays (skipped under jit). cu None: decode (one query per stream)."""
    sl, pt, ids = _concrete(slot_lens), _concrete(page_table), _concrete(slot_ids)
    cuv = None if cu is None else _concrete(cu)
    if sl is None or pt is None or ids is None or (cu is not None and cuv is None):
        return
    s, w = pt.shape
    if sl.size and sl.min() < 0:
        raise ValueError(f"slot_lens must be >= 0, got {sl.tolist()}")
    if cuv is not None:
        if cuv[0] != 0 or np.any(np.diff(cuv) < 0) or cuv[-1] > num_tokens:
            raise ValueError(f"cu_seqlens must rise from 0 to at most T={num_tokens}, got {cuv.tolist()}")
        lens = np.diff(cuv)
    else:
        lens = np.ones(ids.shape, np.int64)
    for n, (sid, ln) in enumerate(zip(ids.tolist(), lens.tolist())):
        if not 0 <= sid < s or ln == 0:
            continue                                     # padding stream: reads nothing
        if sl[sid] < ln:
            raise ValueError(f"stream {n} has {ln} tokens but slot_lens[{sid}] = {sl[sid]} (slot_lens count the "
                             f"tokens AFTER this call's K/V were written)")
    for sid in np.unique(ids):
        if not 0 <= sid < s:
            continue
        need = -(-int(sl[sid]) // page_size)
        if need > w:
            raise ValueError(f"slot {sid} holds slot_lens={int(sl[sid])} tokens, more than its W={w} pages of "
                             f"{page_size} in page_table")
        bad = pt[sid, :need][(pt[sid, :need] < 0) | (pt[sid, :need] >= num_pages)]
        if bad.size:
            raise ValueError(f"page_table[{sid}] holds page ids outside [0, P={num_pages}) within the slot's "
                             f"{int(sl[sid])} tokens: {bad[:8].tolist()}")


def check_call(page_table, slot_lens, cu_seqlens, slot_ids, *, num_pages: int, page_size: int, num_tokens: int,
               decode: bool = False) -> None:
    """The metadata checks of ``paged_attention`` / ``paged_attention_decode`` alone (shapes and dtypes always,
    values when concrete), for a caller that wants them before it writes anything (the attention layer).
    decode: one query per stream, cu_seqlens unused (may be None)."""
    if not hasattr(page_table, "ndim") or page_table.ndim != 2:
        raise ValueError(f"page_table must be int32 [S, W], got shape {list(getattr(page_table, 'shape', ()))}")
    _check_int(page_table, "page_table", tuple(page_table.shape), "[S, W]")
    _check_int(slot_lens, "slot_lens", (page_table.shape[0],), "[S]")
    if not hasattr(slot_ids, "shape") or len(slot_ids.shape) != 1:
        raise ValueError(f"slot_ids must be int32 [N], got shape {list(getattr(slot_ids, 'shape', ()))}")
    n = slot_ids.shape[0]
    _check_int(slot_ids, "slot_ids", (n,), "[N]")
    if decode:
        if n != num_tokens:
            raise ValueError(f"decode takes one token per stream: {num_tokens} tokens but slot_ids has N={n}")
        _check_values(None, slot_ids, slot_lens, page_table, num_pages, page_size, num_tokens)
    else:
        _check_int(cu_seqlens, "cu_seqlens", (n + 1,), "[N + 1]")
        _check_values(cu_seqlens, slot_ids, slot_lens, page_table, num_pages, page_size, num_tokens)


# ----------------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------------
def paged_attention(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *, scale: float,
                    backend: str = "xla", config=None):
    """Prefill of stacked streams against paged K/V (see the module docstring). Returns o [T, H, Dh] (q's dtype).
    config: a triton.PrefillConfig for the Pallas backends, a cudnn.CudnnConfig for "cudnn" / "cudnn_xla" (None:
    the default)."""
    _check_pool(q, k_pages, v_pages, page_table, slot_lens, "[T, H, Dh]")
    if not hasattr(slot_ids, "shape") or len(slot_ids.shape) != 1:
        raise ValueError(f"slot_ids must be int32 [N], got shape {list(getattr(slot_ids, 'shape', ()))}")
    n = slot_ids.shape[0]
    _check_int(slot_ids, "slot_ids", (n,), "[N]")
    _check_int(cu_seqlens, "cu_seqlens", (n + 1,), "[N + 1]")
    _check_values(cu_seqlens, slot_ids, slot_lens, page_table, k_pages.shape[0], k_pages.shape[1], q.shape[0])
    backend = resolve_backend(backend, dtype=q.dtype, head_dim=q.shape[2], num_heads=q.shape[1],
                              num_kv_heads=k_pages.shape[2], sizes={"q": q.size, "k_pages": k_pages.size})
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    return _prefill_jit(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, scale=float(scale),
                        backend=backend, config=config)


@functools.partial(jax.jit, static_argnames=("scale", "backend", "config"))
def _prefill_jit(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *, scale, backend, config):
    args = [jnp.asarray(x, jnp.int32) for x in (page_table, slot_lens, cu_seqlens, slot_ids)]
    reference_fn = functools.partial(reference.paged_attention_xla, scale=scale)
    if backend == "xla":
        return reference_fn(q, k_pages, v_pages, *args)
    kernel = functools.partial(_prefill_kernel, scale=scale, backend=backend, config=config)
    return reference_vjp(kernel, reference_fn)(q, k_pages, v_pages, *args)


def _prefill_kernel(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *, scale, backend, config):
    """The kernels of :func:`paged_attention` (forward only: the VJP is the XLA form's)."""
    args = (page_table, slot_lens, cu_seqlens, slot_ids)
    if backend in ("cudnn", "cudnn_xla"):
        from pallas_kernels.paged_attention import cudnn as _cudnn
        return _cudnn.paged_attention_prefill_cudnn(q, k_pages, v_pages, *args, scale=scale, config=config,
                                                    impl="cudnn" if backend == "cudnn" else "xla")
    from pallas_kernels.paged_attention import triton as _triton
    return _triton.paged_attention_prefill(q, k_pages, v_pages, *args, scale=scale,
                                           interpret=backend == "pallas_interpret", config=config)


def paged_attention_gated(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *, q_norm, cos, sin,
                          num_heads: int, scale: float, eps: float = 1e-6, backend: str = "xla", config=None,
                          k_new=None, v_new=None):
    """Gated attention prefill from q_proj's raw output (reference.py's module docstring).

    qg [T, C] (C >= H 2 Dh; head h's [query | gate] at columns h 2 Dh ..; further columns, e.g. the k and v of a
    fused projection, are not read); q_norm [Dh] (zero-centred RMSNorm weight); cos, sin [T, R] (R even, <= Dh;
    R = 0: no RoPE) at each token's position; the rest as ``paged_attention``. Returns o [T, H * Dh] in qg's
    dtype: sigmoid(gate) * attention(RoPE(RMSNorm(query))). On "pallas" / "pallas_interpret" the gate runs on
    the kernel's output tile (no slice of qg, no pass over o outside the kernel) and the norm + RoPE where
    config.q_prologue says (triton.PrefillConfig: one XLA fusion before the kernel by default). On "cudnn" /
    "cudnn_xla" the norm + RoPE run where cudnn.CudnnConfig.q_prologue says (None: ``cudnn.Q_PROLOGUE``; "xla"
    fusions or the Pallas kernel of q_prologue.py).
    k_new, v_new [T, Hkv, Dh] (optional, both or neither): the K/V this call wrote to the pages, in token order.
    The cuDNN backends then attend the new tokens to them directly (``cudnn.prefill_direct``: no gather of them
    back from the pages, the gate in the merge's pass, no context call on a batch without context: CudnnConfig
    .fresh); the other backends read the pages and ignore them. Their rows must equal what the pages hold."""
    t, dh = _check_gated_query(qg, k_pages, v_pages, page_table, slot_lens, num_heads, rows="T")
    _check_gate_inputs(q_norm, cos, sin, t, dh)
    if not hasattr(slot_ids, "shape") or len(slot_ids.shape) != 1:
        raise ValueError(f"slot_ids must be int32 [N], got shape {list(getattr(slot_ids, 'shape', ()))}")
    n = slot_ids.shape[0]
    _check_int(slot_ids, "slot_ids", (n,), "[N]")
    _check_int(cu_seqlens, "cu_seqlens", (n + 1,), "[N + 1]")
    _check_values(cu_seqlens, slot_ids, slot_lens, page_table, k_pages.shape[0], k_pages.shape[1], t)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together (both [T, Hkv, Dh]) or not at all")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x is not None and (not hasattr(x, "shape") or tuple(x.shape) != (t,) + tuple(k_pages.shape[2:])):
            raise ValueError(f"{name} must be [T, Hkv, Dh] = {[t] + list(k_pages.shape[2:])}, got "
                             f"{list(getattr(x, 'shape', ()))}")
    backend = resolve_backend(backend, dtype=qg.dtype, head_dim=dh, num_heads=num_heads,
                              num_kv_heads=k_pages.shape[2], sizes={"qg": qg.size, "k_pages": k_pages.size})
    if t == 0:
        return jnp.zeros((0, num_heads * dh), qg.dtype)
    if backend not in ("cudnn", "cudnn_xla"):
        k_new = v_new = None
    else:                                      # module defaults resolved here: static arguments of the jit
        from pallas_kernels.paged_attention import cudnn as _cudnn
        config = config or _cudnn.CudnnConfig()
        if config.fresh is None:
            config = config._replace(fresh=_cudnn.FRESH)
        if config.q_prologue is None:
            config = config._replace(q_prologue=_cudnn.Q_PROLOGUE)
        if config.q_prologue not in ("xla", "pallas"):
            raise ValueError(f"CudnnConfig.q_prologue must be 'xla' or 'pallas', got {config.q_prologue!r}")
    return _gated_jit(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, q_norm, cos, sin, k_new,
                      v_new, num_heads=int(num_heads), eps=float(eps), scale=float(scale), backend=backend,
                      config=config)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "scale", "backend", "config"))
def _gated_jit(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, q_norm, cos, sin, k_new, v_new, *,
               num_heads, eps, scale, backend, config):
    args = [jnp.asarray(x, jnp.int32) for x in (page_table, slot_lens, cu_seqlens, slot_ids)]
    cos, sin = jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32)
    statics = dict(num_heads=num_heads, eps=eps, scale=scale)
    if backend == "xla":
        return reference.paged_attention_gated_xla(qg, k_pages, v_pages, *args, q_norm, cos, sin, **statics)

    def reference_fn(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, q_norm, cos, sin, k_new,
                     v_new):               # reads the pages; k_new / v_new (the same rows) get zero cotangents
        return reference.paged_attention_gated_xla(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens,
                                                   slot_ids, q_norm, cos, sin, **statics)
    kernel = functools.partial(_gated_kernel, backend=backend, config=config, **statics)
    operands = (qg, k_pages, v_pages, *args, q_norm, cos, sin, k_new, v_new)
    if backend in ("cudnn", "cudnn_xla") and k_new is not None and _direct(backend, num_heads, k_pages):
        backward = functools.partial(_gated_fresh_backward, reference_fn=reference_fn, backend=backend,
                                     config=config, **statics)
        return kernel_vjp(kernel, backward)(*operands)
    return reference_vjp(kernel, reference_fn)(*operands)


def _direct(backend, num_heads, k_pages) -> bool:
    """Whether the cuDNN backends take ``cudnn.prefill_direct`` (the new tokens' K/V as projected)."""
    from pallas_kernels.paged_attention import cudnn as _cudnn
    return backend == "cudnn_xla" or _cudnn.kv_offset_unit(num_heads, k_pages.shape[2], k_pages.shape[3]) == 1


def _gated_fresh_backward(args, cotangent, *, reference_fn, backend, config, num_heads, eps, scale):
    """The VJP of the cuDNN direct prefill: where no live stream has context (a training step's packed documents,
    every prefill of fresh requests) the VJP of the fresh causal call itself (the XLA q norm + RoPE, cuDNN's own
    fused attention backward on "cudnn", autodiff of its XLA stand-in on "cudnn_xla", the gate), whose
    cotangents reach k_new and v_new (the pages get zeros: they hold the same rows, read by nobody else here);
    else the XLA form's VJP as for the other kernels (the cotangents reach the pages). One ``lax.cond`` on the
    device, which on a GPU is a host wait where XLA does not capture it into a CUDA graph (not measured here: the
    XLA form's blockwise loop it skips is 73 query blocks an attention layer of a 4096-token training step at 80B
    dims)."""
    from pallas_kernels.paged_attention import cudnn as _cudnn
    qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, q_norm, cos, sin, k_new, v_new = args
    p, ps = k_pages.shape[:2]
    dh = k_pages.shape[-1]
    t, n, width = qg.shape[0], slot_ids.shape[0], page_table.shape[1]
    cap = config.kv_capacity or _cudnn.default_capacity(0, n, p, ps, width, 1, True)
    pk = _cudnn.build_packing(page_table, slot_lens, cu_seqlens, slot_ids, num_pages=p, page_size=ps, capacity=cap,
                              align=1, context=config.context, new_rows=False)
    has_context = jnp.any(pk.live & (pk.ctx > 0))
    fresh_config = config._replace(context=False)
    ints = (page_table, slot_lens, cu_seqlens, slot_ids)

    def with_context(qg, k_pages, v_pages, q_norm, cos, sin, k_new, v_new):
        return reference_fn(qg, k_pages, v_pages, *ints, q_norm, cos, sin, k_new, v_new)

    def fresh(qg, k_pages, v_pages, q_norm, cos, sin, k_new, v_new):
        q, _ = reference.gated_query(qg, q_norm, cos, sin, num_heads=num_heads, head_dim=dh, eps=eps)
        o = _cudnn.prefill_direct(q, k_new, v_new, k_pages, v_pages, *ints, scale=scale, gate=qg,
                                  config=fresh_config, impl="cudnn" if backend == "cudnn" else "xla")
        return o.reshape(t, num_heads * dh)

    floats = (qg, k_pages, v_pages, q_norm, cos, sin, k_new, v_new)

    def vjp_of(fn):
        return lambda: jax.vjp(fn, *floats)[1](cotangent)
    d_qg, d_kp, d_vp, d_qn, d_cos, d_sin, d_kn, d_vn = jax.lax.cond(has_context, vjp_of(with_context),
                                                                     vjp_of(fresh))
    zero_ints = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in ints)
    return (d_qg, d_kp, d_vp, *zero_ints, d_qn, d_cos, d_sin, d_kn, d_vn)


def _gated_kernel(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, q_norm, cos, sin, k_new, v_new,
                  *, num_heads, eps, scale, backend, config):
    """The kernels of :func:`paged_attention_gated` (forward only: the VJP is the XLA form's)."""
    args = (page_table, slot_lens, cu_seqlens, slot_ids)
    if backend in ("cudnn", "cudnn_xla"):      # XLA q norm + RoPE, the cuDNN core, the gate fused by XLA
        from pallas_kernels.paged_attention import cudnn as _cudnn
        dh = k_pages.shape[-1]
        impl = "cudnn" if backend == "cudnn" else "xla"
        if config.q_prologue == "pallas" and not dh & (dh - 1):
            from pallas_kernels.paged_attention.q_prologue import gated_query_pallas
            q = gated_query_pallas(qg, q_norm, cos, sin, num_heads=num_heads, head_dim=dh, eps=eps,
                                   interpret=_platform() != "gpu")
            gate = qg[:, :num_heads * 2 * dh].reshape(qg.shape[0], num_heads, 2 * dh)[..., dh:]
        else:
            q, gate = reference.gated_query(qg, q_norm, cos, sin, num_heads=num_heads, head_dim=dh, eps=eps)
        if k_new is not None and _direct(backend, num_heads, k_pages):
            o = _cudnn.prefill_direct(q, k_new, v_new, k_pages, v_pages, *args, scale=scale, gate=qg,
                                      config=config, impl=impl)        # the gate sliced from qg in the last pass
            return o.reshape(qg.shape[0], num_heads * dh)
        o = _cudnn.paged_attention_prefill_cudnn(q, k_pages, v_pages, *args, scale=scale, config=config, impl=impl)
        o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
        return o.reshape(qg.shape[0], num_heads * dh)
    from pallas_kernels.paged_attention import triton as _triton
    return _triton.paged_attention_prefill_gated(qg, k_pages, v_pages, *args, q_norm, cos, sin,
                                                 num_heads=num_heads, eps=eps, scale=scale,
                                                 interpret=backend == "pallas_interpret", config=config)


def paged_attention_decode(q, k_pages, v_pages, page_table, slot_lens, slot_ids, *, scale: float,
                           backend: str = "xla", config=None):
    """One query per stream (q [N, H, Dh]) at position slot_lens[slot] - 1 against the slot's whole paged
    context (see the module docstring). Returns o [N, H, Dh] (q's dtype). config: a triton.DecodeConfig."""
    _check_pool(q, k_pages, v_pages, page_table, slot_lens, "[N, H, Dh]")
    _check_int(slot_ids, "slot_ids", (q.shape[0],), "[N]")
    _check_values(None, slot_ids, slot_lens, page_table, k_pages.shape[0], k_pages.shape[1], q.shape[0])
    dims = dict(dtype=q.dtype, head_dim=q.shape[2], num_heads=q.shape[1], num_kv_heads=k_pages.shape[2],
                sizes={"q": q.size, "k_pages": k_pages.size})
    backend = decode_backend(resolve_backend(backend, **dims), **dims)
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    return _decode_jit(q, k_pages, v_pages, page_table, slot_lens, slot_ids, scale=float(scale), backend=backend,
                       config=config)


@functools.partial(jax.jit, static_argnames=("scale", "backend", "config"))
def _decode_jit(q, k_pages, v_pages, page_table, slot_lens, slot_ids, *, scale, backend, config):
    args = [jnp.asarray(x, jnp.int32) for x in (page_table, slot_lens, slot_ids)]
    if backend == "xla":
        return reference.paged_attention_decode_xla(q, k_pages, v_pages, *args, scale=scale)
    from pallas_kernels.paged_attention import triton as _triton
    return _triton.paged_attention_decode(q, k_pages, v_pages, *args, scale=scale,
                                          interpret=backend == "pallas_interpret", config=config)


def paged_attention_decode_gated(qg, k_pages, v_pages, page_table, slot_lens, slot_ids, *, q_norm, cos, sin,
                                 num_heads: int, scale: float, eps: float = 1e-6, backend: str = "xla",
                                 config=None):
    """The gated attention's decode step from q_proj's raw output: qg [N, C] (C >= H 2 Dh; head h's [query |
    gate] at columns h 2 Dh ..; further columns, e.g. a fused projection's k and v, are not read), one query per
    stream at position slot_lens[slot] - 1; q_norm [Dh]; cos, sin [N, R] (R even, <= Dh; R = 0: no RoPE); the
    rest as ``paged_attention_decode``. Returns o [N, H * Dh] in qg's dtype: sigmoid(gate) *
    attention(RoPE(RMSNorm(query))), zeros for streams with no slot. On "pallas" / "pallas_interpret" the gate runs
    where the kernels finish o (no pass over o outside them) and the norm + RoPE where config.q_prologue says
    (triton.DecodeConfig); "xla" composes reference.gated_query, the XLA decode and the gate."""
    n, dh = _check_gated_query(qg, k_pages, v_pages, page_table, slot_lens, num_heads, rows="N")
    _check_int(slot_ids, "slot_ids", (n,), "[N]")
    _check_gate_inputs(q_norm, cos, sin, n, dh)
    _check_values(None, slot_ids, slot_lens, page_table, k_pages.shape[0], k_pages.shape[1], n)
    dims = dict(dtype=qg.dtype, head_dim=dh, num_heads=num_heads, num_kv_heads=k_pages.shape[2],
                sizes={"qg": qg.size, "k_pages": k_pages.size})
    backend = decode_backend(resolve_backend(backend, **dims), **dims)
    if n == 0:
        return jnp.zeros((0, num_heads * dh), qg.dtype)
    return _decode_gated_jit(qg, k_pages, v_pages, page_table, slot_lens, slot_ids, q_norm, cos, sin,
                             num_heads=int(num_heads), eps=float(eps), scale=float(scale), backend=backend,
                             config=config)


def _check_gate_inputs(q_norm, cos, sin, t: int, dh: int, norm_name: str = "q_norm"):
    if not hasattr(q_norm, "shape") or tuple(q_norm.shape) != (dh,):
        raise ValueError(f"{norm_name} must have shape [Dh] = [{dh}], got {list(getattr(q_norm, 'shape', ()))}")
    for name, x in (("cos", cos), ("sin", sin)):
        if not hasattr(x, "shape") or x.ndim != 2 or x.shape[0] != t or x.shape != cos.shape:
            raise ValueError(f"{name} must be [T, R] = [{t}, R] like cos, got {list(getattr(x, 'shape', ()))}")
    r = cos.shape[1]
    if r % 2 or r > dh:
        raise ValueError(f"cos/sin: the rotary dims R={r} must be even and at most Dh={dh}")


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "scale", "backend", "config"))
def _decode_gated_jit(qg, k_pages, v_pages, page_table, slot_lens, slot_ids, q_norm, cos, sin, *, num_heads, eps,
                      scale, backend, config):
    args = [jnp.asarray(x, jnp.int32) for x in (page_table, slot_lens, slot_ids)]
    cos, sin = jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32)
    dh = k_pages.shape[-1]
    if backend == "xla":
        q, gate = reference.gated_query(qg, q_norm, cos, sin, num_heads=num_heads, head_dim=dh, eps=eps)
        o = reference.paged_attention_decode_xla(q, k_pages, v_pages, *args, scale=scale)
        o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
        return o.reshape(qg.shape[0], num_heads * dh)
    from pallas_kernels.paged_attention import triton as _triton
    return _triton.paged_attention_decode_gated(qg, k_pages, v_pages, *args, q_norm, cos, sin, num_heads=num_heads,
                                                eps=eps, scale=scale, interpret=backend == "pallas_interpret",
                                                config=config)


def paged_kv_write(k_pages, v_pages, yk, yv, token_page, token_offset, *, k_norm, cos, sin, k_col: int = 0,
                   v_col: int = 0, eps: float = 1e-6, backend: str = "xla"):
    """Writes a call's new keys and values into the pools: token t's key heads (yk[t, k_col + j Dh ..], j < Hkv)
    RMS-normed with the zero-centred weight k_norm [Dh] and rotated (partial NeoX RoPE, cos / sin [T, R] fp32,
    R = 0: none), its value heads (yv[t, v_col + j Dh ..]) as they are, to pages[token_page[t],
    token_offset[t]]; a page id outside [0, P) or an offset outside [0, Ps) (padding) writes nothing. yk [T, Ck],
    yv [T, Cv]: the k and v projections' outputs, or a fused q/k/v projection's output passed twice with its
    k and v column offsets. Returns the new (k_pages, v_pages) [P, Ps, Hkv, Dh]. "pallas" / "pallas_interpret"
    (and the cuDNN backends on a GPU): one kernel writes both pools in place (the pools aliased: donate them for
    no copy); "xla": slices, norm, RoPE and two scatters (the layer's unfused path)."""
    if not hasattr(k_pages, "ndim") or k_pages.ndim != 4 or k_pages.shape != getattr(v_pages, "shape", None):
        raise ValueError(f"k_pages and v_pages must share one shape [P, Ps, Hkv, Dh], got "
                         f"{list(getattr(k_pages, 'shape', ()))} and {list(getattr(v_pages, 'shape', ()))}")
    p, ps, hkv, dh = k_pages.shape
    for name, y in (("yk", yk), ("yv", yv)):
        if not hasattr(y, "ndim") or y.ndim != 2:
            raise ValueError(f"{name} must be [T, C], got shape {list(getattr(y, 'shape', ()))}")
    t = yk.shape[0]
    if yv.shape[0] != t:
        raise ValueError(f"yk and yv must have the same T rows, got {yk.shape[0]} and {yv.shape[0]}")
    for name, col, y in (("k_col", k_col, yk), ("v_col", v_col, yv)):
        if not 0 <= int(col) <= y.shape[1] - hkv * dh:
            raise ValueError(f"{name}={col}: the Hkv Dh = {hkv * dh} columns from it must lie inside the "
                             f"{y.shape[1]} columns of {'yk' if name == 'k_col' else 'yv'}")
    for name, x in (("token_page", token_page), ("token_offset", token_offset)):
        _check_int(x, name, (t,), "[T]")
    _check_gate_inputs(k_norm, cos, sin, t, dh, "k_norm")
    dims = dict(dtype=k_pages.dtype, head_dim=dh, num_heads=hkv, num_kv_heads=hkv)
    backend = decode_backend(resolve_backend(backend, **dims, sizes={"k_pages": k_pages.size}), **dims)
    return _kv_write_impl(k_pages, v_pages, yk, yv, jnp.asarray(token_page, jnp.int32),
                          jnp.asarray(token_offset, jnp.int32), k_norm, jnp.asarray(cos, jnp.float32),
                          jnp.asarray(sin, jnp.float32), k_col=int(k_col), v_col=int(v_col), eps=float(eps),
                          backend=backend)


def _kv_write_impl(k_pages, v_pages, yk, yv, token_page, token_offset, k_norm, cos, sin, *, k_col, v_col, eps,
                   backend):
    p, ps, hkv, dh = k_pages.shape
    t = yk.shape[0]
    if backend == "xla" or t == 0:
        k = yk[:, k_col:k_col + hkv * dh].reshape(t, hkv, dh)
        v = yv[:, v_col:v_col + hkv * dh].reshape(t, hkv, dh)
        k = reference.rms_norm_zc(k, k_norm, eps)
        if cos.shape[-1]:
            k = reference.apply_partial_rope(k, cos, sin)
        bad = (token_page < 0) | (token_page >= p) | (token_offset < 0) | (token_offset >= ps)
        page = jnp.where(bad, p, token_page)
        return (k_pages.at[page, token_offset].set(k.astype(k_pages.dtype), mode="drop"),
                v_pages.at[page, token_offset].set(v.astype(v_pages.dtype), mode="drop"))
    from pallas_kernels.paged_attention import triton as _triton
    return _triton.kv_write(k_pages, v_pages, yk, yv, token_page, token_offset, k_norm, cos, sin, k_col=k_col,
                            v_col=v_col, eps=eps, interpret=backend == "pallas_interpret")
