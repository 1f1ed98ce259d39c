"""One decoder block contract for every layer of a hybrid model: ``(params, x, layer_state, batch) -> (x,
layer_state)``.

Shape legend: T stacked tokens of the call (padded to a bucket), N streams (padded), S slots, D hidden size,
P KV pages, Ps tokens per page, W pages per slot (the page table's width).

A block owns both pre-norms, both residual adds and the FFN / MoE, for both mixers, at prefill and decode alike::

    x = x + reduce(mixer(rmsnorm(x, input_norm)))      mixer: Gated DeltaNet or gated attention
    x = x + reduce(ffn(rmsnorm(x, post_norm)))         ffn: SwiGLU MLP or sparse MoE

(``reduce``: ``Batch.reduce``, the psum of row-parallel partial sums under a mesh, the identity on one device.)
A mixer maps normed hidden states to its output projection's result and advances its own state, nothing else:
GDN: ``jax_gdn.layers.gdn.gdn_mixer`` (prefill: phase 1 -> phase 2 -> gated norm + out_proj) and
``gdn_mixer_decode`` (one recurrent step); attention: ``jax_gdn.layers.attention.attention_layer``.

Block parameters (one dict layout for both mixers; every Linear weight [in, out], GDN's included):
    input_norm [D], post_norm [D]      zero-centred RMSNorm weights (1 + w)
    mixer                              jax_gdn.layers.gdn mixer params (``mixer_param_shapes``: no
                                       ``input_layernorm``), or jax_gdn.layers.attention params (attention)
    ffn                                jax_gdn.layers.ffn MLP or MoE params

``Batch`` is the already-checked description of one call, built once per step by the model (jax_gdn.model) from
host-checked inputs: the blocks trust it (no value checks, no device-to-host copies). The model keeps every
layer's state in one flat pool per kind and hands each block a view of the batch addressing its own part (GDN:
slot ids offset by layer * S, padding / refused streams out of range; attention: page ids offset by layer * P),
so a block reads and writes the pools in place. ``RuntimeOptions`` (jax_gdn.options) picks between
implementations of the same math (static).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from flax import struct

from jax_gdn.config import HybridConfig
from jax_gdn.layers.attention import attention_layer
from jax_gdn.layers import gdn
from jax_gdn.layers.ffn import sparse_moe, swiglu_mlp
from jax_gdn.layers.moe_ep import sparse_moe_expert_parallel
from jax_gdn.ops.norms import rms_norm
from jax_gdn.options import DEFAULT_OPTIONS, RuntimeOptions
from jax_gdn.state import BatchMeta, GdnSlots, KvPages

__all__ = ["Batch", "BlockKind", "Backends", "block", "gdn_block", "attention_block", "ffn"]


@struct.dataclass
class Batch:
    """One call's checked description (T tokens padded to a bucket, N streams padded to a bucket).

    meta:         BatchMeta: cu_seqlens [N + 1] (padding streams have zero length, cu[N] <= T), slot_ids [N]
                  (padding streams: S), has_initial_state [N], positions [N] (tokens each slot held before)
    token_pos:    [T] int32  absolute position of each token in its stream (0 for padding tokens)
    token_page:   [T] int32  page receiving each token's K/V (P for padding tokens or a refused call: dropped)
    token_offset: [T] int32  row inside that page
    page_table:   [S, W] int32 each slot's pages after this call's allocation
    slot_lens:    [S] int32  tokens each slot holds after this call
    decode:       static: one token per stream (recurrent GDN step)
    axis_name:    static: the mesh axis the heads / expert columns are split over when the step runs per device
                  inside ``shard_map`` (jax_gdn.sharding); the row-parallel projections' partial sums are then
                  ``psum``-ed before each residual add. None: one device, no reduction.
    expert_axis:  static: the mesh axis the routed experts are split over whole (expert parallel,
                  jax_gdn.layers.moe_ep); None: every device holds every expert (whole, or its columns).
    expert_offset: [] int32 or None: the block's routed expert weights are an expert pool stacking the experts
                  of several layers ([R E, ...], the model's scan over layers) and this layer's start here;
                  None: the weights are this layer's own [E, ...].
    """

    meta: BatchMeta
    token_pos: jax.Array
    token_page: jax.Array
    token_offset: jax.Array
    page_table: jax.Array
    slot_lens: jax.Array
    decode: bool = struct.field(pytree_node=False, default=False)
    axis_name: Optional[str] = struct.field(pytree_node=False, default=None)
    expert_axis: Optional[str] = struct.field(pytree_node=False, default=None)
    expert_offset: Optional[jax.Array] = None

    def reduce(self, y: jax.Array) -> jax.Array:
        """Sum of a row-parallel projection's partial results over the mesh axis (identity on one device)."""
        return y if self.axis_name is None else jax.lax.psum(y, self.axis_name)


@dataclasses.dataclass(frozen=True)
class BlockKind:
    """What a layer is: its mixer ("gdn" | "attention") and whether its FFN is the sparse MoE."""

    mixer: str
    moe: bool


@dataclasses.dataclass(frozen=True)
class Backends:
    """The backend name each op's layer calls pass (the user's, checked once by the model against the op's dispatch
    table; "auto" is resolved per call by the op's table: ``HybridModel.kernels`` shows the picks)."""

    gated_delta_rule: str = "xla"
    paged_attention: str = "xla"
    moe: str = "xla"


def ffn(params: dict, x: jax.Array, *, config: HybridConfig, moe: bool, backend: str = "xla",
        expert_axis: Optional[str] = None, expert_offset=None) -> jax.Array:
    """The block's FFN on already-normed x [T, D] -> [T, D] (no residual). expert_axis: the routed experts are
    split whole over that mesh axis (this device's partial sum; jax_gdn.layers.moe_ep). expert_offset: the
    routed expert weights are an expert pool of several layers and this layer's start there (Batch)."""
    if moe and expert_axis is not None:
        return sparse_moe_expert_parallel(params, x, top_k=config.num_experts_per_tok,
                                          norm_topk_prob=config.norm_topk_prob, axis_name=expert_axis,
                                          num_experts=config.num_experts, backend=backend,
                                          expert_offset=expert_offset)
    if moe:
        return sparse_moe(params, x, top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                          backend=backend, expert_offset=expert_offset)
    return swiglu_mlp(params, x)


def _ffn_residual(params: dict, x: jax.Array, batch: Batch, *, config: HybridConfig, moe: bool,
                  backend: str) -> jax.Array:
    """``x + reduce(ffn(rmsnorm(x, post_norm)))``: the block's second half."""
    h = rms_norm(x, params["post_norm"], config.rms_norm_eps)
    return x + batch.reduce(ffn(params["ffn"], h, config=config, moe=moe, backend=backend,
                                expert_axis=batch.expert_axis, expert_offset=batch.expert_offset))


def gdn_block(params: dict, x: jax.Array, state: GdnSlots, batch: Batch, *, config: HybridConfig, moe: bool,
              backends: Backends, options: RuntimeOptions = DEFAULT_OPTIONS) -> tuple[jax.Array, GdnSlots]:
    """GDN block: x [T, D] -> (x [T, D], GdnSlots [S, ...] with the call's streams advanced)."""
    dims = config.gdn_dims
    meta = batch.meta
    h = rms_norm(x, params["input_norm"], config.rms_norm_eps)
    if batch.decode:
        y, state = gdn.gdn_mixer_decode(params["mixer"], dims, h, state, meta.slot_ids, meta.has_initial_state,
                                        backend=backends.gated_delta_rule, step=options.gdn_decode_step)
    else:
        y, state = gdn.gdn_mixer(params["mixer"], dims, h, state, meta, backend=backends.gated_delta_rule,
                                 conv=options.phase1_conv)
    x = x + batch.reduce(y)
    return _ffn_residual(params, x, batch, config=config, moe=moe, backend=backends.moe), state


def attention_block(params: dict, x: jax.Array, state: KvPages, batch: Batch, *, config: HybridConfig, moe: bool,
                    backends: Backends, options: RuntimeOptions = DEFAULT_OPTIONS) -> tuple[jax.Array, KvPages]:
    """Gated attention block: x [T, D] -> (x [T, D], KvPages with the call's K/V written)."""
    h = rms_norm(x, params["input_norm"], config.rms_norm_eps)
    y, state = attention_layer(params["mixer"], config.attn_dims, h, state, token_pos=batch.token_pos,
                               token_page=batch.token_page, token_offset=batch.token_offset,
                               page_table=batch.page_table, slot_lens=batch.slot_lens,
                               cu_seqlens=batch.meta.cu_seqlens, slot_ids=batch.meta.slot_ids, decode=batch.decode,
                               backend=backends.paged_attention, options=options)
    x = x + batch.reduce(y)
    return _ffn_residual(params, x, batch, config=config, moe=moe, backend=backends.moe), state


def block(kind: BlockKind, params: dict, x: jax.Array, state, batch: Batch, *, config: HybridConfig,
          backends: Backends, options: RuntimeOptions = DEFAULT_OPTIONS):
    """Dispatches on ``kind.mixer``: ``(params, x, layer_state, batch) -> (x, layer_state)``."""
    fn = gdn_block if kind.mixer == "gdn" else attention_block
    return fn(params, x, state, batch, config=config, moe=kind.moe, backends=backends, options=options)
