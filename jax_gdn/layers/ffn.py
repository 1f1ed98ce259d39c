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


def moe_route(router_w: jax.Array, x: jax.Array, top_k: int, norm_topk_prob: bool):
    """fp32 softmax over all experts, top-k, optional renormalisation (HF ``Qwen3NextTopKRouter``).

    x [T, D], router_w [D, E]. Returns (weights [T, k] in x's dtype, expert ids [T, k] int32).
    """
    logits = x @ router_w                                                  # [T, E] (activation dtype, as HF)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w.astype(x.dtype), top_i.astype(jnp.int32)


def grouped_experts(x: jax.Array, top_w: jax.Array, top_i: jax.Array, w_gate_up: jax.Array,
                    w_down: jax.Array) -> jax.Array:
    """Sum over each token's k experts of ``weight * down(silu(gate) * up)`` with grouped matmuls.

    x [T, D]; top_w, top_i [T, k]; w_gate_up [E, D, 2I]; w_down [E, I, D]. The T*k (token, expert) rows are
    sorted by expert and fed to ``jax.lax.ragged_dot`` (one grouped matmul per projection, no loop over experts).
    """
    t, d = x.shape
    k = top_i.shape[1]
    e, _, two_i = w_gate_up.shape
    inter = two_i // 2
    flat_expert = top_i.reshape(-1)                                        # [T*k]
    order = jnp.argsort(flat_expert, stable=True)                          # rows grouped by expert
    token_of_row = order // k                                              # [T*k]
    group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)    # [E]
    xs = x[token_of_row]                                                   # [T*k, D]
    gu = jax.lax.ragged_dot(xs, w_gate_up, group_sizes)                    # [T*k, 2I]
    h = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    y = jax.lax.ragged_dot(h.astype(x.dtype), w_down, group_sizes)         # [T*k, D]
    y = y * top_w.reshape(-1)[order][:, None]
    out = jax.ops.segment_sum(y.astype(jnp.float32), token_of_row, num_segments=t)
    return out.astype(x.dtype)


def sparse_moe(params: dict, x: jax.Array, *, top_k: int, norm_topk_prob: bool) -> jax.Array:
    """Routed experts plus the shared expert gated by ``sigmoid(x @ shared_expert_gate)``; x [T, D] -> [T, D]."""
    top_w, top_i = moe_route(params["router"], x, top_k, norm_topk_prob)
    routed = grouped_experts(x, top_w, top_i, params["experts_gate_up"], params["experts_down"])
    if "shared_expert" in params:
        shared = swiglu_mlp(params["shared_expert"], x)
        gate = jax.nn.sigmoid((x @ params["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype)
        routed = routed + gate * shared
    return routed.astype(x.dtype)
