"""Feed-forward blocks: dense SwiGLU MLP and the Qwen3-Next / Qwen3.5 sparse MoE.

Shape legend: T tokens, D hidden size, I intermediate size (per expert for the MoE), E experts, k experts per
token, Is shared-expert intermediate size.

Parameters (dicts; weights stored [in, out] so that ``y = x @ W``):
  MLP:  gate_proj [D, I]  up_proj [D, I]  down_proj [I, D]
  MoE:  router [D, E]  experts_gate_up [E, D, 2I] (gate columns first, then up)  experts_down [E, I, D]
        shared_expert: an MLP dict (Is)  shared_expert_gate [D, 1]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_mlp(params: dict, x: jax.Array) -> jax.Array:
    """``down(silu(x @ gate) * (x @ up))``; x [T, D] -> [T, D] in x's dtype."""
    h = jax.nn.silu(x @ params["gate_proj"]) * (x @ params["up_proj"])
    return (h @ params["down_proj"]).astype(x.dtype)


def moe_route(router_w: jax.Array, x: jax.Array, top_k: int, norm_topk_prob: bool, backend: str = "xla"):
    """fp32 softmax over all experts, top-k, optional renormalisation (HF ``Qwen3NextTopKRouter``).

    x [T, D], router_w [D, E]. Returns (weights [T, k] in x's dtype, expert ids [T, k] int32). backend: the MoE
    backend ("xla" | "pallas" | "pallas_interpret"): the Pallas ones run softmax + top-k as one kernel
    (``pallas_kernels.moe.api.route``; XLA's top-k over [T, E] is slow on the GPU).
    """
    from pallas_kernels.moe import api as moe_api
    logits = x @ router_w                                                  # [T, E] (activation dtype, as HF)
    top_w, top_i = moe_api.route(logits, top_k=top_k, norm_topk_prob=norm_topk_prob, backend=backend)
    return top_w.astype(x.dtype), top_i


MOE_BACKENDS = ("xla", "pallas", "pallas_interpret", "auto")


def routing_backend(moe_backend: str) -> str:
    """The router's backend for a resolved MoE backend: the same name (``pallas_kernels.moe.api.route`` resolves
    the MoE table's "routing" rows: the routing kernel where it takes the sizes, else the XLA router)."""
    return moe_backend if moe_backend in ("pallas", "pallas_interpret") else "xla"


def resolve_moe_backend(backend: str, x: jax.Array, w_gate_up: jax.Array) -> str:
    """"auto" -> the MoE table's pick for the experts at these dims and dtype (``pallas_kernels.moe.api.TABLE``:
    "pallas" on a GPU where the kernels take them, else "xla"); other names are checked and returned (the op
    checks what they can run)."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"backend must be one of {MOE_BACKENDS}; got {backend!r}")
    if backend != "auto":
        return backend
    from pallas_kernels.moe import api as moe_api
    e, d, two_i = w_gate_up.shape
    return moe_api.resolve_backend("auto", dtype=x.dtype, num_experts=e, hidden=d, inter=two_i // 2)


def grouped_experts(x: jax.Array, top_w: jax.Array, top_i: jax.Array, w_gate_up: jax.Array,
                    w_down: jax.Array, *, backend: str = "xla", moe_config=None, num_experts: int = None,
                    expert_offset=None) -> jax.Array:
    """Sum over each token's k experts of ``weight * down(silu(gate) * up)`` with grouped matmuls.

    x [T, D]; top_w, top_i [T, k]; w_gate_up [E, D, 2I]; w_down [E, I, D] -> [T, D] in x's dtype. The T*k
    (token, expert) rows are sorted by expert on the device and each expert's run is padded to the row block
    (``pallas_kernels.moe``): backend "xla" runs batched matmuls over groups of row blocks, "pallas" /
    "pallas_interpret" the two grouped-GEMM kernels (SiLU * up fused into gate_up, routing weights into down).
    Work and memory scale with T * k, never with T * E. Activations are cast to the experts' dtype (the kernels
    take one dtype) and the result back to x's. moe_config: a ``pallas_kernels.moe.triton.MoeConfig`` (static);
    None lets the kernels pick one from the static shapes (16-row blocks at decode sizes, 128 at prefill sizes).
    num_experts / expert_offset: the weights are an expert pool of several layers ([R E, ...]) and this layer's
    E experts start at expert_offset (``pallas_kernels.moe.api.moe_experts``).
    """
    from pallas_kernels.moe import api as moe_api
    backend = resolve_moe_backend(backend, x, w_gate_up)
    out = moe_api.moe_experts(x.astype(w_gate_up.dtype), top_w, top_i, w_gate_up, w_down, backend=backend,
                               config=moe_config, num_experts=num_experts, expert_offset=expert_offset)
    return out.astype(x.dtype)


def sparse_moe(params: dict, x: jax.Array, *, top_k: int, norm_topk_prob: bool, backend: str = "xla",
               moe_config=None, expert_offset=None) -> jax.Array:
    """Routed experts plus the shared expert gated by ``sigmoid(x @ shared_expert_gate)``; x [T, D] -> [T, D].

    backend: "xla" | "pallas" (CUDA GPU) | "pallas_interpret" | "auto" (pallas where it runs, else xla) picks the
    routed experts' grouped matmuls (``grouped_experts``; moe_config: its launch config, None = picked from the
    shapes); the router runs on the same Pallas backend (``routing_backend``), the shared expert in XLA.
    """
    backend = resolve_moe_backend(backend, x, params["experts_gate_up"])     # checked before any work
    top_w, top_i = moe_route(params["router"], x, top_k, norm_topk_prob, backend=routing_backend(backend))
    routed = grouped_experts(x, top_w, top_i, params["experts_gate_up"], params["experts_down"], backend=backend,
                             moe_config=moe_config, num_experts=params["router"].shape[-1],
                             expert_offset=expert_offset)
    if "shared_expert" in params:
        shared = swiglu_mlp(params["shared_expert"], x)
        gate = jax.nn.sigmoid((x @ params["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype)
        routed = routed + gate * shared
    return routed.astype(x.dtype)
