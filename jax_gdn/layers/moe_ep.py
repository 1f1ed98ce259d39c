"""The sparse MoE with its experts split over a mesh axis (expert parallel), run per device inside ``shard_map``.

Shape legend: T tokens, D hidden size, E experts in all, n devices on the axis, El = E / n experts held by this
device (experts [i El, (i + 1) El) on device i), I per-expert intermediate size, k experts per token, Is
shared-expert intermediate size (its columns split over the axis, as in tensor parallel), M = T k token copies.

No token exchange: the tokens are replicated on every device after the mixer's reduction, so each device routes
ALL tokens with the whole (replicated) router, keeps the copies that chose one of its El experts and runs the
grouped matmuls on them at the experts' full width (gate_up N = 2I, down K = I); the copies of other devices'
experts are dropped from its layout (they take no row block). Its output is the partial sum over its experts;
the block's one reduction per FFN (``Batch.reduce``, a psum that also joins the shared expert's column-split
partial sums) adds the devices' parts. Exact in fp32 up to the order of that sum.

Parameters (this device's slices): router [D, E] (replicated), experts_gate_up [El, D, 2I], experts_down [El, I,
D], shared_expert {gate_proj [D, Is / n], up_proj [D, Is / n], down_proj [Is / n, D]}, shared_expert_gate [D, 1].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_gdn.layers.ffn import moe_route, resolve_moe_backend, routing_backend, swiglu_mlp

__all__ = ["local_routed_experts", "sparse_moe_expert_parallel"]


def local_routed_experts(x: jax.Array, top_w: jax.Array, local_i: jax.Array, mine: jax.Array,
                         w_gate_up: jax.Array, w_down: jax.Array, *, backend: str, num_experts: int,
                         num_local: int = None, expert_offset=None) -> jax.Array:
    """sum over the copies with ``mine`` of ``weight * down_e(silu(gate_e) * up_e)`` with e = local_i (this
    device's expert ids, [0, El) where mine); copies without ``mine`` contribute nothing.

    x [T, D]; top_w, local_i, mine [T, k]; w_gate_up [El, D, 2I]; w_down [El, I, D]; num_experts: E (all devices),
    which picks the launch config from the rows per expert as one device would see them. -> [T, D] in x's dtype.

    "pallas" / "pallas_interpret": the copies of other devices' experts go to a trash expert El sorted last by
    ``moe_align`` (El + 1 experts); the kernels skip its blocks (expert >= El, nothing computed or written) and
    the combine masks their rows out (gathering row 0 for them: the unwritten rows are never read). "xla": those
    copies run on expert 0 with weight 0 (the XLA path is the CPU check, not a fast path: its work is not cut by
    n).

    Expert pool (the model's scan over layers): w_gate_up / w_down may stack R layers' local experts ([R El,
    ...]); num_local = El and expert_offset (traced, r El) say where this layer's start (pallas_kernels.moe.api).
    """
    from pallas_kernels.moe import reference as moe_ref
    from pallas_kernels.moe import triton as moe_triton

    t, k = local_i.shape
    pool = w_gate_up.shape[0]
    el = pool if num_local is None else num_local
    x = x.astype(w_gate_up.dtype)
    weights = jnp.where(mine, top_w, jnp.zeros((), top_w.dtype))
    config = moe_triton.select_config(t, k, num_experts)
    if backend == "xla":
        return moe_ref.routed_experts_xla(x, weights, jnp.where(mine, local_i, 0), w_gate_up, w_down,
                                          block_m=config.block_m, num_experts=el, expert_offset=expert_offset)
    lay = moe_ref.moe_align(weights, jnp.where(mine, local_i, el).astype(jnp.int32), el + 1, config.block_m)
    lay = lay._replace(block_expert=moe_ref.pool_block_experts(lay.block_expert, el, expert_offset, pool))
    interpret = backend == "pallas_interpret"
    h = moe_triton.gate_up_silu(x, w_gate_up, lay.block_expert, lay.row_token, config=config, interpret=interpret)
    y = moe_triton.down_weighted(h, w_down, lay.block_expert, lay.row_token, lay.row_weight, num_tokens=t,
                                 config=config, interpret=interpret)
    # other devices' copies read row 0 (then masked): one row served from L2, not T k / n rows from memory
    rows = y[jnp.where(mine, lay.row_pos, 0)].astype(jnp.float32)                     # [T, k, D]
    return jnp.sum(jnp.where(mine[..., None], rows, 0.0), axis=1).astype(x.dtype)


def sparse_moe_expert_parallel(params: dict, x: jax.Array, *, top_k: int, norm_topk_prob: bool, axis_name: str,
                               num_experts: int, backend: str = "xla", expert_offset=None) -> jax.Array:
    """This device's part of the sparse MoE (see the module docstring); x [T, D] (replicated) -> [T, D] partial
    sum in x's dtype, to be summed over ``axis_name`` by the caller (with the rest of the block's reduction).

    num_experts: E of the whole model (the router's width); this device holds ``params["experts_gate_up"]
    .shape[0]`` = E / n of them, experts [i E / n, (i + 1) E / n) on the device of axis index i; or, with
    expert_offset, a pool of R layers' local experts [R E / n, ...] with this layer's at expert_offset."""
    w_gate_up = params["experts_gate_up"]
    el = num_experts // jax.lax.axis_size(axis_name)
    if expert_offset is None and w_gate_up.shape[0] != el or w_gate_up.shape[0] % max(el, 1):
        raise ValueError(f"expert parallel: experts_gate_up [{w_gate_up.shape[0]}, ...] is not E / n = {el} "
                         f"experts (or a pool of R x {el} with expert_offset)")
    if params["router"].shape[-1] != num_experts or el * jax.lax.axis_size(axis_name) != num_experts:
        raise ValueError(f"expert parallel: router [D, {params['router'].shape[-1]}] and experts_gate_up "
                         f"[{el}, ...] on {jax.lax.axis_size(axis_name)} devices do not make num_experts="
                         f"{num_experts}")
    backend = resolve_moe_backend(backend, x, w_gate_up)
    top_w, top_i = moe_route(params["router"], x, top_k, norm_topk_prob,           # every token, global ids
                             backend=routing_backend(backend))
    local_i = top_i - jax.lax.axis_index(axis_name).astype(jnp.int32) * el
    mine = (local_i >= 0) & (local_i < el)
    routed = local_routed_experts(x, top_w, local_i, mine, w_gate_up, params["experts_down"], backend=backend,
                                  num_experts=num_experts, num_local=el, expert_offset=expert_offset)
    if "shared_expert" in params:
        shared = swiglu_mlp(params["shared_expert"], x)                               # column-split: partial
        gate = jax.nn.sigmoid((x @ params["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype)
        routed = routed.astype(x.dtype) + gate * shared
    return routed.astype(x.dtype)
