"""Public entry of the MoE routed experts: checks once, picks the backend.

Shape legend: T tokens, D hidden, I per-expert intermediate size, E experts, k experts per token.

    x [T, D]; top_w [T, k] (routing weights); top_i [T, k] int32 expert ids in [0, E)
    w_gate_up [E, D, 2I] (gate columns first, then up); w_down [E, I, D]
    -> sum_j top_w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = top_i[t, j]: [T, D] in x's dtype

Backends: "xla" (reference.routed_experts_xla, runs anywhere), "pallas" (triton.py on a CUDA GPU),
"pallas_interpret" (the same kernels in Pallas interpret mode, any platform); "auto" resolves :data:`TABLE`
(``resolve_backend``; ``python -m pallas_kernels.registry`` prints it). Both Pallas backends and the XLA
path share ``reference.moe_align``'s on-device layout: work and memory scale with T * k, never with T * E. The
launch config (row block and tiles; the XLA path uses its row block) is picked from the static shapes by
``triton.select_config`` unless given: 16-row blocks at decode sizes, 128-row blocks at prefill sizes.
Expert ids outside [0, E) are not checked (values are traced); the router never produces them.
Autodiff (reverse mode) on every backend: the kernels by ``pallas_kernels.autodiff.reference_vjp`` (the kernels
run the forward, ``reference.routed_experts_xla`` / ``route_xla``'s VJP the backward: gradients of x, the routing
weights (and through ``route`` the logits) and both expert weight pools).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.autodiff import reference_vjp
from pallas_kernels.dispatch import DocCase, Implementation, OpTable
from pallas_kernels.moe import reference as _ref
from pallas_kernels.moe import routing_triton as _routing
from pallas_kernels.moe import triton as _triton
from pallas_kernels.moe.triton import MoeConfig, select_config

BACKENDS = ("xla", "pallas", "pallas_interpret")
GPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def supports(*, platform: str, dtype, num_experts: int, hidden: int, inter: int) -> Optional[str]:
    """None when the Pallas (Triton) backend runs this case on `platform`, else the reason it does not."""
    if platform not in ("gpu", "cuda"):
        return f"pallas MoE runs on a CUDA GPU (Triton lowering); platform is {platform!r}"
    if jnp.dtype(dtype) not in GPU_DTYPES:
        return f"pallas MoE takes bfloat16, float16 or float32; got {jnp.dtype(dtype).name}"
    if num_experts < 1:
        return f"num_experts must be >= 1; got {num_experts}"
    for name, dim in (("hidden", hidden), ("inter", inter)):
        if dim % 16:
            return f"pallas MoE on the GPU needs {name} % 16 == 0 (Triton dot blocks); got {name}={dim}"
    return None


CALL_KINDS = ("experts", "routing")


@dataclasses.dataclass(frozen=True)
class MoeCase:
    """What the dispatch table sees of one call: call kind ("experts": the grouped matmuls, "routing": softmax +
    top-k of the router's logits), platform (the first device's), the activations' dtype, E experts, D hidden, I
    per-expert intermediate size, k experts per token (routing)."""

    call: str
    platform: str
    dtype: Any
    num_experts: int
    hidden: int
    inter: int
    top_k: int = 1

    def __post_init__(self):
        if self.call not in CALL_KINDS:
            raise ValueError(f"call must be one of {CALL_KINDS}, got {self.call!r}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @property
    def dims(self) -> dict:
        return dict(dtype=self.dtype, num_experts=self.num_experts, hidden=self.hidden, inter=self.inter)


def _experts_supports(case: MoeCase) -> Optional[str]:
    return supports(platform=case.platform, **case.dims)


def _interpret_supports(case: MoeCase) -> Optional[str]:
    if case.dtype not in GPU_DTYPES:
        return f"pallas MoE (interpret) takes bfloat16, float16 or float32; got {case.dtype.name}"
    return None


def _routing_supports(interpret: bool):
    def check(case: MoeCase) -> Optional[str]:
        if not interpret and case.platform not in ("gpu", "cuda"):
            return f"the routing kernel runs on a CUDA GPU (Triton lowering); platform is {case.platform!r}"
        return _interpret_supports(case) or _routing.supports(num_experts=case.num_experts, top_k=case.top_k)
    return check


def _always(case: MoeCase) -> Optional[str]:
    return None


def _doc_cases() -> tuple:
    return tuple(DocCase(label, call, MoeCase(call, platform, jnp.bfloat16, 512, 2048, 512, 10))
                 for label, platform in (("CPU", "cpu"), ("GPU", "gpu")) for call in CALL_KINDS)


#: The MoE's implementations, in the order "auto" tries them. The router runs on the experts' resolved backend
#: (``route(backend=...)``): its Pallas rows take the sizes the routing kernel takes, else the XLA router (the
#: same function, exact up to fp32 rounding).
TABLE = OpTable(
    op="moe",
    call_kinds=CALL_KINDS,
    implementations=(
        Implementation("triton", ("pallas",), "grouped-GEMM Pallas Triton kernels over the expert-sorted rows "
                       "(triton.py)", _experts_supports, calls=("experts",),
                       limits="CUDA GPU; bf16 / fp16 / fp32; D, I multiples of 16"),
        Implementation("triton.routing", ("pallas",), "softmax + top-k as one Pallas Triton kernel "
                       "(routing_triton.py)", _routing_supports(False), calls=("routing",),
                       limits="CUDA GPU; E a power of two in [2, 1024]"),
        Implementation("xla", ("xla",), "reference.py: batched matmuls over groups of row blocks; softmax + "
                       "lax.top_k", _always, limits="any platform"),
        Implementation("triton.interpret", ("pallas_interpret",), "the grouped-GEMM kernels in Pallas interpret "
                       "mode", _interpret_supports, calls=("experts",), auto=False, interpret=True,
                       limits="any platform; bf16 / fp16 / fp32"),
        Implementation("triton.routing.interpret", ("pallas_interpret",), "the routing kernel in Pallas interpret "
                       "mode", _routing_supports(True), calls=("routing",), auto=False, interpret=True,
                       limits="any platform; E a power of two in [2, 1024]"),
        Implementation("xla.routing", ("pallas", "pallas_interpret"), "a Pallas backend's router where the "
                       "routing kernel does not take the sizes: reference.route_xla", _always, calls=("routing",),
                       auto=False, limits="any"),
    ),
    doc_cases=_doc_cases(),
)

#: implementation -> the backend name the kernels' bodies take
KERNEL = {"triton": "pallas", "triton.routing": "pallas", "xla": "xla", "triton.interpret": "pallas_interpret",
          "triton.routing.interpret": "pallas_interpret", "xla.routing": "xla"}


def _platform() -> str:
    try:
        return jax.devices()[0].platform
    except RuntimeError:  # pragma: no cover
        return "cpu"


def resolve_backend(backend: str, *, dtype, num_experts: int, hidden: int, inter: int, call: str = "experts",
                    top_k: int = 1) -> str:
    """The kernel name ("pallas", "pallas_interpret" or "xla") :data:`TABLE` runs for the user's ``backend`` at
    this case ("auto": "pallas" on a GPU where the kernels take the dims and dtype, else "xla")."""
    case = MoeCase(call, _platform(), dtype, num_experts, hidden, inter, top_k)
    return KERNEL[TABLE.resolve(backend, case).name]


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def check_inputs(x, top_w, top_i, w_gate_up, w_down, *, backend: str, config: MoeConfig) -> None:
    """Raises ValueError naming the argument when the inputs do not fit the contract of `moe_experts`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D]; got shape {x.shape}")
    t, d = x.shape
    if top_i.ndim != 2 or top_i.shape[0] != t or top_w.shape != top_i.shape:
        raise ValueError(f"top_w and top_i must both be [T={t}, k]; got top_w {top_w.shape}, top_i {top_i.shape}")
    if not jnp.issubdtype(top_i.dtype, jnp.integer):
        raise ValueError(f"top_i must be an integer array of expert ids; got {top_i.dtype}")
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] != d or w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up must be [E, D={d}, 2I]; got {w_gate_up.shape}")
    e, _, two_i = w_gate_up.shape
    if w_down.shape != (e, two_i // 2, d):
        raise ValueError(f"w_down must be [E={e}, I={two_i // 2}, D={d}]; got {w_down.shape}")
    if top_i.shape[1] > e:
        raise ValueError(f"top_k (top_i.shape[1]={top_i.shape[1]}) must be <= E={e}")
    if jnp.dtype(w_gate_up.dtype) != jnp.dtype(x.dtype) or jnp.dtype(w_down.dtype) != jnp.dtype(x.dtype):
        raise ValueError(f"w_gate_up and w_down must have x's dtype {x.dtype}; got {w_gate_up.dtype}, "
                         f"{w_down.dtype}")
    if config.block_m < 16 or config.block_m & (config.block_m - 1):
        raise ValueError(f"config.block_m must be a power of two >= 16; got {config.block_m}")
    if config.split_partial and config.block_m < 32:
        raise ValueError(f"config.split_partial needs block_m >= 32 (half tiles of >= 16 rows); got {config.block_m}")
    if backend == "pallas":
        reason = supports(platform="gpu" if _has_gpu() else jax.devices()[0].platform, dtype=x.dtype,
                          num_experts=e, hidden=d, inter=two_i // 2)
        if reason is not None:
            raise ValueError(f"backend 'pallas': {reason}; use backend='xla' (or 'pallas_interpret')")
    elif backend == "pallas_interpret" and jnp.dtype(x.dtype) not in GPU_DTYPES:
        raise ValueError(f"backend 'pallas_interpret' takes bfloat16, float16 or float32 x; got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("backend", "config", "num_experts"))
def _moe_experts(x, top_w, top_i, w_gate_up, w_down, expert_offset, *, backend, config, num_experts):
    reference_fn = functools.partial(_experts_xla, block_m=config.block_m, num_experts=num_experts)
    if backend == "xla":
        return reference_fn(x, top_w, top_i, w_gate_up, w_down, expert_offset)
    kernel = functools.partial(_experts_kernel, backend=backend, config=config, num_experts=num_experts)
    return reference_vjp(kernel, reference_fn)(x, top_w, top_i, w_gate_up, w_down, expert_offset)


def _experts_xla(x, top_w, top_i, w_gate_up, w_down, expert_offset, *, block_m, num_experts):
    return _ref.routed_experts_xla(x, top_w, top_i, w_gate_up, w_down, block_m=block_m, num_experts=num_experts,
                                   expert_offset=expert_offset)


def _experts_kernel(x, top_w, top_i, w_gate_up, w_down, expert_offset, *, backend, config, num_experts):
    """The Pallas kernels of :func:`moe_experts` (forward only: the VJP is the XLA form's)."""
    interpret = backend == "pallas_interpret"
    lay = _ref.moe_align(top_w, top_i, num_experts, config.block_m)
    lay = lay._replace(block_expert=_ref.pool_block_experts(lay.block_expert, num_experts, expert_offset,
                                                            w_gate_up.shape[0]))
    h = _triton.gate_up_silu(x, w_gate_up, lay.block_expert, lay.row_token, config=config, interpret=interpret)
    if config.fused_combine:
        out = _triton.down_combined(h, w_down, lay.block_expert, lay.row_token, lay.row_weight,
                                    num_tokens=x.shape[0], config=config, interpret=interpret)
        return out.astype(x.dtype)
    y = _triton.down_weighted(h, w_down, lay.block_expert, lay.row_token, lay.row_weight,
                              num_tokens=x.shape[0], config=config, interpret=interpret)
    return _ref.combine(y, lay.row_pos, x.dtype)


def moe_experts(x, top_w, top_i, w_gate_up, w_down, *, backend: str = "pallas",
                config: Optional[MoeConfig] = None, num_experts: Optional[int] = None,
                expert_offset=None) -> jax.Array:
    """Routed experts of a sparse MoE (see module doc for shapes); [T, D] in x's dtype.

    config: launch parameters of the Pallas kernels (block_m is also the XLA path's row block); None picks one
    from the static shapes with ``triton.select_config(T, k, E)`` (16-row blocks at decode sizes, 128 at
    prefill sizes).

    Peak activation memory: Mp (I + D) itemsize for h and y plus T k D * 4 bytes for the fp32 combine, with
    Mp = (ceil(T k / BM) + min(E, T k)) BM <= T k + E BM: O(T k (I + D)), never O(T E I). With
    ``config.fused_combine``: Mp I itemsize for h plus T D * 4 bytes for the fp32 output (no y).

    Expert pool (the model's scan over layers): w_gate_up [R E, D, 2I] / w_down [R E, I, D] may stack the experts
    of R layers (a free reshape of the stacked [R, E, ...] weights); num_experts = E (the router's width: top_i
    in [0, E)) and expert_offset (a traced int32 scalar, r E) says where this layer's experts start. The kernels
    index the pool in place: slicing the layer's [E, ...] weights out inside a ``lax.scan`` is a dynamic slice
    XLA materialises before the custom call (3.2 GB per layer at 80B dims: ~1.3 ms of copy per MoE layer).
    """
    e_pool = w_gate_up.shape[0] if w_gate_up.ndim == 3 else 1
    num_experts = e_pool if num_experts is None else int(num_experts)
    if num_experts < 1 or e_pool % num_experts:
        raise ValueError(f"num_experts={num_experts} must divide the expert pool size w_gate_up.shape[0]="
                         f"{e_pool} (one layer's E, or R layers' R E)")
    if expert_offset is None and num_experts != e_pool:
        raise ValueError(f"expert_offset is needed when w_gate_up holds a pool of {e_pool} experts and "
                         f"num_experts={num_experts}")
    if config is None:
        config = select_config(x.shape[0], top_i.shape[1] if top_i.ndim == 2 else 1, num_experts)
    check_inputs(x, top_w, top_i, w_gate_up, w_down, backend=backend, config=config)
    if x.shape[0] == 0:
        return jnp.zeros(x.shape, x.dtype)
    offset = jnp.zeros((), jnp.int32) if expert_offset is None else jnp.asarray(expert_offset, jnp.int32)
    return _moe_experts(x, top_w, top_i.astype(jnp.int32), w_gate_up, w_down, offset, backend=backend,
                        config=config, num_experts=num_experts)


def route(logits, *, top_k: int, norm_topk_prob: bool, backend: str = "xla"):
    """The MoE router after its matmul: logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32 in [0, E)): fp32
    softmax over all experts, top-k (ties: lowest id first), renormalised when norm_topk_prob.

    backend: "xla" (``reference.route_xla``: softmax + ``lax.top_k``), "pallas" (``routing_triton.route``: one
    kernel on a CUDA GPU), "pallas_interpret" (the same kernel in interpret mode), "auto"; resolved by
    :data:`TABLE`'s "routing" rows: a Pallas backend runs "xla" where the kernel does not take the case (E not a
    power of two in [2, 1024], no GPU): the routing is the same function either way, so the fallback is exact up
    to fp32 rounding. Bad shapes: ValueError naming the
    argument."""
    TABLE.check_backend(backend)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, E]; got shape {logits.shape}")
    if not 1 <= int(top_k) <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, E={logits.shape[1]}]; got {top_k}")
    case = MoeCase("routing", _platform(), logits.dtype, logits.shape[1], 0, 0, int(top_k))
    kernel = KERNEL[TABLE.resolve(backend, case).name]
    if kernel == "xla":
        return _ref.route_xla(logits, top_k=top_k, norm_topk_prob=norm_topk_prob)
    kernel_fn = functools.partial(_routing.route, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                  interpret=kernel == "pallas_interpret")
    return reference_vjp(kernel_fn, functools.partial(_ref.route_xla, top_k=top_k,
                                                      norm_topk_prob=norm_topk_prob))(logits)
