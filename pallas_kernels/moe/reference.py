"""MoE routed experts, XLA path: the on-device row layout shared with the Pallas kernels, and grouped matmuls
over row blocks that scale with T * k (never with T * E).

Shape legend: T tokens, D hidden, I per-expert intermediate size, E experts, k experts per token, M = T * k routed
rows (token copies), BM row block, NB = ceil(M / BM) + min(E, M) row blocks (static bound), Mp = NB * BM padded
rows.

Layout (``moe_align``, all on the device, no host sync, one compile per (T, k, E, BM)):
  the M token copies are sorted by expert (stable), each expert's run is padded to a multiple of BM, runs are laid
  end to end; block b of the padded rows belongs to expert ``block_expert[b]`` (E for blocks past the live rows).
  Each expert with c_e rows owns ceil(c_e / BM) blocks and sum_e ceil(c_e / BM) <= ceil(M / BM) + #nonempty
  experts, hence the bound NB.

    row_token  [Mp] int32  token of each padded row; T for padding rows
    row_weight [Mp] fp32   routing weight of each padded row; 0 for padding rows
    block_expert [NB] int32 expert of each row block; E for blocks past the live rows
    row_pos    [T, k] int32 padded row of each (token, j) copy (the combine gathers y[row_pos] and sums over k)

This module imports only jax.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class MoeLayout(NamedTuple):
    row_token: jax.Array      # [Mp] int32
    row_weight: jax.Array     # [Mp] fp32
    block_expert: jax.Array   # [NB] int32
    row_pos: jax.Array        # [T, k] int32


def route_xla(logits: jax.Array, *, top_k: int, norm_topk_prob: bool):
    """The router after its matmul (HF ``Qwen3NextTopKRouter``): fp32 softmax over all E experts, ``lax.top_k``,
    ``w / sum(w)`` when norm_topk_prob. logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32). The reference
    of ``routing_triton.route``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = lax.top_k(probs, top_k)
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_i.astype(jnp.int32)


def num_row_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Static bound NB = ceil(T k / BM) + min(E, T k) on the row blocks of the padded sorted rows."""
    m = num_tokens * top_k
    return -(-m // block_m) + min(num_experts, m)


def sort_by_expert(flat_e: jax.Array, num_experts: int):
    """(order, sorted_e): the copies sorted by expert, ties in copy order (a stable sort).

    When E * M < 2**31 the key ``e * M + copy`` is sorted alone: one int32 operand (XLA:GPU sorts that with a
    radix sort), and order / expert come back from the key; otherwise a stable two-operand argsort."""
    m = flat_e.shape[0]
    if num_experts * m < 2 ** 31:
        key = lax.sort(flat_e * m + jnp.arange(m, dtype=jnp.int32))
        return key % m, key // m
    order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)
    return order, flat_e[order]


def moe_align(top_w: jax.Array, top_i: jax.Array, num_experts: int, block_m: int) -> MoeLayout:
    """Sorts the T*k token copies by expert and pads each expert's run to a multiple of block_m (see module doc).

    top_w [T, k] (any float dtype), top_i [T, k] int32 in [0, E). Returns a MoeLayout.
    """
    t, k = top_i.shape
    m = t * k
    e = num_experts
    nb = num_row_blocks(t, k, e, block_m)
    mp = nb * block_m
    flat_e = top_i.reshape(-1).astype(jnp.int32)                            # [M]
    order, sorted_e = sort_by_expert(flat_e, e)                             # sorted row -> copy index, expert
    counts = jnp.zeros((e,), jnp.int32).at[flat_e].add(1)                   # [E]
    blocks = (counts + block_m - 1) // block_m                              # [E] blocks per expert
    pstart = (jnp.cumsum(blocks) - blocks) * block_m                        # [E] first padded row
    start = jnp.cumsum(counts) - counts                                     # [E] first sorted row
    dest = pstart[sorted_e] + (jnp.arange(m, dtype=jnp.int32) - start[sorted_e])   # [M] padded row
    row_copy = jnp.full((mp,), m, jnp.int32).at[dest].set(order)            # [Mp] copy index, m = padding
    row_token = row_copy // k                                               # padding -> m // k == T
    w_ext = jnp.concatenate([top_w.reshape(-1).astype(jnp.float32), jnp.zeros((1,), jnp.float32)])
    row_weight = w_ext[row_copy]                                            # padding -> 0
    # block b belongs to the number of experts whose blocks end at or before b (E past the live blocks): a
    # compare-and-count over [NB, E] (one fused reduction; jnp.searchsorted's default is a while loop, a chain
    # of small kernels on the GPU)
    ends = jnp.cumsum(blocks)                                               # [E]
    block_expert = jnp.sum(ends[None, :] <= jnp.arange(nb, dtype=jnp.int32)[:, None], axis=1,
                           dtype=jnp.int32)                                 # [NB]
    row_pos = jnp.zeros((m,), jnp.int32).at[order].set(dest).reshape(t, k)
    return MoeLayout(row_token, row_weight, block_expert, row_pos)


def pool_block_experts(block_expert: jax.Array, num_experts: int, expert_offset, pool_size: int) -> jax.Array:
    """Block experts of a layout over ``num_experts`` local ids -> ids in an expert pool of ``pool_size`` experts
    (the stacked experts of every layer of a scan, [R * E, ...], a free reshape): live blocks get
    ``block_expert + expert_offset``, blocks past the live rows (id >= num_experts) get ``pool_size``, which every
    kernel skips. Identity when the pool is one layer's experts and the offset 0."""
    if expert_offset is None and pool_size == num_experts:
        return block_expert
    off = jnp.asarray(0 if expert_offset is None else expert_offset, jnp.int32)
    return jnp.where(block_expert < num_experts, block_expert + off, pool_size).astype(jnp.int32)


def combine(y: jax.Array, row_pos: jax.Array, out_dtype) -> jax.Array:
    """out[t] = sum_j y[row_pos[t, j]] (fp32 sum); y [Mp, D] already carries the routing weights."""
    return jnp.sum(y[row_pos].astype(jnp.float32), axis=1).astype(out_dtype)


def _group_size(num_blocks: int, d: int, inter: int, itemsize: int, budget_bytes: int = 1 << 28) -> int:
    """Row blocks per scan step: the gathered weights of one step stay under budget_bytes (256 MiB)."""
    per_block = d * 3 * inter * itemsize
    return max(1, min(num_blocks, budget_bytes // per_block))


def routed_experts_xla(x: jax.Array, top_w: jax.Array, top_i: jax.Array, w_gate_up: jax.Array,
                       w_down: jax.Array, *, block_m: int = 64, num_experts: int = None,
                       expert_offset=None) -> jax.Array:
    """Sum over each token's k experts of ``weight * down(silu(gate) * up)``, XLA only.

    x [T, D]; top_w, top_i [T, k]; w_gate_up [E, D, 2I] (gate columns first); w_down [E, I, D] -> [T, D] in x's
    dtype. Rows are laid out by ``moe_align``; a ``lax.scan`` walks groups of G row blocks, gathers the G experts'
    weights ([G, D, 2I], at most 256 MiB) and runs batched [BM, D] x [D, 2I] and [BM, I] x [I, D] matmuls with
    fp32 accumulation. Work and memory scale with Mp = NB * BM rows, never with T * E. fp32 inputs use
    Precision.HIGHEST. Expert pool: w_gate_up / w_down may hold the experts of several layers ([R * E, ...]);
    top_i are then ids in [0, num_experts) of the layer whose experts start at ``expert_offset`` (traced).
    """
    t, d = x.shape
    e, _, two_i = w_gate_up.shape
    inter = two_i // 2
    num_experts = e if num_experts is None else num_experts
    lay = moe_align(top_w, top_i, num_experts, block_m)
    lay = lay._replace(block_expert=pool_block_experts(lay.block_expert, num_experts, expert_offset, e))
    nb = lay.block_expert.shape[0]
    g = _group_size(nb, d, inter, jnp.dtype(w_gate_up.dtype).itemsize)
    steps = math.ceil(nb / g)
    pad_b = steps * g - nb
    block_expert = jnp.concatenate([lay.block_expert, jnp.full((pad_b,), e, jnp.int32)])
    row_token = jnp.concatenate([lay.row_token, jnp.full((pad_b * block_m,), t, jnp.int32)])
    row_weight = jnp.concatenate([lay.row_weight, jnp.zeros((pad_b * block_m,), jnp.float32)])
    prec = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    x_ext = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])               # row T: the padding row (zeros)

    def step(_, blk):
        be, tok, wt = blk                                                   # [G], [G*BM], [G*BM]
        live = be < e
        ec = jnp.where(live, be, 0)
        xs = x_ext[tok].reshape(g, block_m, d)                              # [G, BM, D]
        wgu = w_gate_up[ec]                                                 # [G, D, 2I]
        gu = jnp.einsum("gmd,gdn->gmn", xs, wgu, precision=prec, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gu[..., :inter]) * gu[..., inter:]).astype(x.dtype)
        y = jnp.einsum("gmi,gid->gmd", h, w_down[ec], precision=prec, preferred_element_type=jnp.float32)
        y = jnp.where(live[:, None, None], y * wt.reshape(g, block_m, 1), 0.0)
        return None, y.astype(x.dtype).reshape(g * block_m, d)

    _, ys = lax.scan(step, None, (block_expert.reshape(steps, g), row_token.reshape(steps, g * block_m),
                                  row_weight.reshape(steps, g * block_m)))
    return combine(ys.reshape(-1, d), lay.row_pos, x.dtype)
