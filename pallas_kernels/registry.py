"""Which implementation runs each accelerated op, decided once from what each one supports.

Ops and their implementations, fastest first (the order ``"auto"`` tries them in):

    "gated_delta_rule": "pallas" (Triton on a GPU), "xla"; and "pallas_interpret" (the same kernel in interpret
                        mode, any platform; never picked by "auto"), "mosaic_gpu" (prefill on a Hopper GPU: dense
                        rows, and packed / slot calls while gated_delta_rule/mosaic_gpu.py's VARLEN is set; other
                        calls run Triton; never picked here by "auto": the op's own "auto" picks it per call where
                        mosaic_gpu.AUTO, and for packed / slot calls AUTO_VARLEN, is set)
    "paged_attention":  "cudnn" (prefill through cuDNN's packed fused attention, decode on the Pallas kernel;
                        picked by "auto" only while pallas_kernels/paged_attention/cudnn.py's AUTO is set),
                        "pallas" (pallas_kernels/paged_attention/api.py when present), "xla"; "pallas_interpret",
                        "cudnn_xla" (cudnn's packing with an XLA stand-in for the cuDNN call; never "auto")
    "moe":              "pallas" (pallas_kernels/moe/api.py when present), "xla" (lax.ragged_dot); "pallas_interpret"

Every implementation has ``supports(**case) -> Optional[str]``: ``None`` when it can run the case, else the
reason it cannot (a sentence naming the limit). The case keywords per op:

    gated_delta_rule: platform, dtype, head_k_dim, head_v_dim, num_k_heads, num_v_heads
    paged_attention:  platform, dtype, head_dim, num_heads, num_kv_heads
    moe:              platform, dtype, num_experts, hidden, inter

``resolve(op, backend, **case)``: "auto" -> the first implementation (in the order above) that supports the case;
an explicit name -> that name when it supports the case, else ValueError with its reason. A kernel module that is
missing (ImportError) is "not available", never an import error of this module. This module imports nothing from
jax_gdn (dependencies point pallas_kernels <- jax_gdn).
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional

import jax.numpy as jnp

__all__ = ["OPS", "implementations", "supports", "resolve", "resolve_all"]

_GDN_DTYPES = ("bfloat16", "float16", "float32")


def _always(**case) -> Optional[str]:
    return None


def _import(module: str):
    try:
        return importlib.import_module(module), None
    except ImportError as err:
        return None, f"{module} is not available ({err})"


# ---- gated delta rule ------------------------------------------------------------------------------------------
def _gdn_pallas(*, platform, dtype, head_k_dim, head_v_dim, num_k_heads, num_v_heads, interpret=False):
    api, why = _import("pallas_kernels.gated_delta_rule.api")
    if api is None:
        return why
    if jnp.dtype(dtype).name not in _GDN_DTYPES:
        return f"pallas gated delta rule: dtype must be one of {_GDN_DTYPES}, got {jnp.dtype(dtype).name}"
    if not interpret and platform != "gpu":
        return f"pallas gated delta rule needs a GPU (platform is {platform!r}); 'pallas_interpret' runs on CPU"
    # the kernel's own check on abstract inputs of these dims (T = 1, B = 1)
    import jax
    q = jax.ShapeDtypeStruct((1, 1, num_k_heads, head_k_dim), dtype)
    v = jax.ShapeDtypeStruct((1, 1, num_v_heads, head_v_dim), dtype)
    try:
        if interpret:
            api.check_supported(q, q, v, interpret=True)
        else:  # the GPU presence test of check_supported is platform, checked above
            if head_k_dim not in api.GPU_HEAD_DIMS or head_v_dim not in api.GPU_HEAD_DIMS:
                return (f"pallas gated delta rule on the GPU: head dims K (got {head_k_dim}) and V (got "
                        f"{head_v_dim}) must each be one of {api.GPU_HEAD_DIMS}")
            api.check_supported(q, q, v, interpret=True)
    except ValueError as err:
        return str(err)
    return None


def _gdn_pallas_interpret(**case):
    return _gdn_pallas(**case, interpret=True)


def _gdn_mosaic(*, platform, dtype, head_k_dim, head_v_dim, num_k_heads, num_v_heads):
    mod, why = _import("pallas_kernels.gated_delta_rule.mosaic_gpu.chunk")
    if mod is None:
        return why
    if platform != "gpu" or not mod.is_hopper():
        return "mosaic_gpu gated delta rule needs an sm_90 (Hopper) GPU"
    if jnp.dtype(dtype) not in mod.SUPPORTED_DTYPES:
        return f"mosaic_gpu gated delta rule takes bfloat16 or float16; got {jnp.dtype(dtype).name}"
    if head_k_dim not in mod.SUPPORTED_HEAD_DIMS or head_v_dim not in mod.SUPPORTED_HEAD_DIMS:
        return (f"mosaic_gpu gated delta rule: head dims K (got {head_k_dim}) and V (got {head_v_dim}) must each be "
                f"one of {mod.SUPPORTED_HEAD_DIMS}")
    if num_v_heads % num_k_heads:
        return f"mosaic_gpu gated delta rule: num_v_heads {num_v_heads} must be a multiple of {num_k_heads}"
    return None


# ---- kernels other helpers provide (optional modules with their own supports) -----------------------------------
def _external(module: str, interpret: bool = False) -> Callable[..., Optional[str]]:
    def supports(**case) -> Optional[str]:
        if interpret:   # the module's own platform name for Pallas interpret mode
            case = dict(case, platform="interpret")
        api, why = _import(module)
        if api is None:
            return why
        fn = getattr(api, "supports", None)
        if fn is None:
            return f"{module} has no supports()"
        try:
            return fn(**case)
        except TypeError as err:  # a case keyword the module does not know: not available for this case
            return f"{module}.supports: {err}"
    return supports


def _moe_interpret(*, dtype, **case) -> Optional[str]:
    """pallas_kernels.moe in interpret mode: any dims, its kernels' dtypes (the module's supports() is the GPU's)."""
    api, why = _import("pallas_kernels.moe.api")
    if api is None:
        return why
    if jnp.dtype(dtype) not in api.GPU_DTYPES:
        return f"pallas MoE (interpret) takes bfloat16, float16 or float32; got {jnp.dtype(dtype).name}"
    return None


def _cudnn(xla_stand_in: bool = False) -> Callable[..., Optional[str]]:
    def supports(**case) -> Optional[str]:
        mod, why = _import("pallas_kernels.paged_attention.cudnn")
        if mod is None:
            return why
        if xla_stand_in:
            case = dict(case, platform="xla")
        return mod.supports(**case)
    return supports


#: op -> {implementation name: supports}, fastest first
OPS = {
    "gated_delta_rule": {"pallas": _gdn_pallas, "xla": _always, "pallas_interpret": _gdn_pallas_interpret,
                         "mosaic_gpu": _gdn_mosaic},
    "paged_attention": {"cudnn": _cudnn(), "pallas": _external("pallas_kernels.paged_attention.api"), "xla": _always,
                        "pallas_interpret": _external("pallas_kernels.paged_attention.api", interpret=True),
                        "cudnn_xla": _cudnn(xla_stand_in=True)},
    "moe": {"pallas": _external("pallas_kernels.moe.api"), "xla": _always,
            "pallas_interpret": _moe_interpret},
}

#: implementations "auto" never picks (debug forms)
_NOT_AUTO = {"pallas_interpret", "cudnn_xla"}


def _auto_allowed(op: str, name: str) -> bool:
    """Whether "auto" may pick ``name``: never the debug forms; the cuDNN attention prefill only while its
    module's AUTO switch (set from the GPU measurement) is on."""
    if name in _NOT_AUTO or (op == "gated_delta_rule" and name == "mosaic_gpu"):
        return False
    if op == "paged_attention" and name == "cudnn":
        mod, _ = _import("pallas_kernels.paged_attention.cudnn")
        return bool(mod is not None and mod.AUTO)
    return True


def implementations(op: str) -> tuple:
    if op not in OPS:
        raise ValueError(f"registry: unknown op {op!r}; known: {sorted(OPS)}")
    return tuple(OPS[op])


def supports(op: str, name: str, **case) -> Optional[str]:
    """None when implementation ``name`` of ``op`` runs ``case``, else why not."""
    impls = OPS.get(op)
    if impls is None:
        raise ValueError(f"registry: unknown op {op!r}; known: {sorted(OPS)}")
    if name not in impls:
        return f"{op} has no implementation {name!r}; known: {sorted(impls)}"
    return impls[name](**case)


def resolve(op: str, backend: str, **case) -> str:
    """The implementation of ``op`` to run for ``case``: "auto" -> the fastest that supports it; an explicit name
    -> itself, or ValueError naming why it cannot run the case."""
    impls = implementations(op)
    if backend == "auto":
        for name in impls:
            if _auto_allowed(op, name) and supports(op, name, **case) is None:
                return name
        raise ValueError(f"registry: no implementation of {op} supports {case}")  # pragma: no cover (xla always)
    why = supports(op, backend, **case)
    if why is not None:
        raise ValueError(f"backend {backend!r} cannot run {op} here: {why}")
    return backend


def resolve_all(backends: dict, cases: dict) -> dict:
    """{op: implementation} for every op of ``cases`` ({op: case dict}); ``backends`` {op: name} ("auto" where
    missing)."""
    return {op: resolve(op, backends.get(op, "auto"), **case) for op, case in cases.items()}
