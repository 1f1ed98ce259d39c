"""Gated softmax attention of Qwen3-Next / Qwen3.5 over a paged KV cache.

Shape legend: T stacked tokens of all streams, N streams, D hidden size, H query heads, Hkv kv heads
(G = H / Hkv queries per kv head), Dh head dim, R rotary dims, P pages in the pool, Ps tokens per page.

Per layer (HF ``Qwen3NextAttention``):
  q_proj(x) -> per head ``[query | gate]`` (2 * Dh); q_norm / k_norm zero-centred fp32 RMSNorm over Dh;
  partial NeoX RoPE on the first R dims; softmax(q k^T * Dh^-0.5) v with GQA; ``o * sigmoid(gate)``; o_proj.

Parameters (one layer, a dict; linear weights stored [in, out] so that ``y = x @ W``):
  q_proj [D, H * 2 * Dh]  k_proj [D, Hkv * Dh]  v_proj [D, Hkv * Dh]  o_proj [H * Dh, D]
  q_norm [Dh]  k_norm [Dh]

The cache side: new K/V are written to pool pages first (``write_kv_pages``), then every query attends to the
keys of its own slot with position <= its own (``paged_attention``): the earlier tokens of a continued stream
come from the pages, the new ones were just written. ``paged_attention`` is the one function a Pallas kernel
replaces; the XLA version below cuts the queries into blocks inside one stream (``build_query_blocks``) and
lets each block gather a static window of its slot's pages (``attention_plan`` picks the window and block
sizes as powers of two), so the work follows the streams' context lengths, not the pool size.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_gdn.config import AttnDims
from jax_gdn.layers.rope import apply_partial_rope, rope_cos_sin
from jax_gdn.ops.norms import rms_norm
from jax_gdn.state import KvPages

_NEG_INF = -1e30


def attention_param_shapes(dims: AttnDims) -> dict:
    """Shapes of one layer's parameters (the layout of this module, [in, out])."""
    d, h, hkv, dh = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim
    return {"q_proj": (d, h * 2 * dh), "k_proj": (d, hkv * dh), "v_proj": (d, hkv * dh),
            "o_proj": (h * dh, d), "q_norm": (dh,), "k_norm": (dh,)}


# ================================================================================================================
# Stage 1: projections, q/k norms, RoPE
# ================================================================================================================
def attention_qkv(params: dict, dims: AttnDims, hidden: jax.Array, positions: jax.Array):
    """Projects ``hidden [T, D]`` at integer ``positions [T]``.

    Returns q [T, H, Dh] (normed, rotated), k [T, Hkv, Dh] (normed, rotated), v [T, Hkv, Dh], gate [T, H, Dh],
    all in hidden's dtype.
    """
    t = hidden.shape[0]
    h, hkv, dh = dims.num_heads, dims.num_kv_heads, dims.head_dim
    qg = (hidden @ params["q_proj"]).reshape(t, h, 2 * dh)           # per head [query | gate]
    q, gate = qg[..., :dh], qg[..., dh:]
    k = (hidden @ params["k_proj"]).reshape(t, hkv, dh)
    v = (hidden @ params["v_proj"]).reshape(t, hkv, dh)
    q = rms_norm(q, params["q_norm"], dims.rms_norm_eps)
    k = rms_norm(k, params["k_norm"], dims.rms_norm_eps)
    if dims.rotary_dim:
        cos, sin = rope_cos_sin(positions, dims.rotary_dim, dims.rope_theta)
        q = apply_partial_rope(q, cos, sin)
        k = apply_partial_rope(k, cos, sin)
    return q, k, v, gate


# ================================================================================================================
# Stage 2: the paged cache
# ================================================================================================================
def write_kv_pages(kv: KvPages, k: jax.Array, v: jax.Array, token_page: jax.Array,
                   token_offset: jax.Array) -> KvPages:
    """Writes k, v [T, Hkv, Dh] to ``pages[token_page[t], token_offset[t]]``; a token whose page is out of range
    (>= P, e.g. padding) is dropped."""
    k_pages = kv.k_pages.at[token_page, token_offset].set(k.astype(kv.k_pages.dtype), mode="drop")
    v_pages = kv.v_pages.at[token_page, token_offset].set(v.astype(kv.v_pages.dtype), mode="drop")
    return KvPages(k_pages=k_pages, v_pages=v_pages)


class QueryBlocks(NamedTuple):
    """Stacked query tokens cut into blocks of Bq tokens, each block inside ONE stream (static NB blocks).

    tokens: [NB, Bq] int32  token index in [0, T), or T for a padding position
    slot:   [NB] int32      slot of the block's stream, -1 for a padding block
    """

    tokens: jax.Array
    slot: jax.Array


def build_query_blocks(cu_seqlens: jax.Array, slot_ids: jax.Array, total_len: int, block_q: int) -> QueryBlocks:
    """Cuts each stream of ``cu_seqlens [N + 1]`` into ceil(L / Bq) blocks (on device, no host sync).
    NB = min(T // Bq + N, T) is a static bound on the number of blocks."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    n = slot_ids.shape[0]
    bq = int(block_q)
    nb = max(1, min(total_len // bq + n, total_len))
    lens = cu[1:] - cu[:-1]
    blocks_per = (lens + bq - 1) // bq                                    # [N]
    end = jnp.cumsum(blocks_per)
    first = end - blocks_per
    b = jnp.arange(nb, dtype=jnp.int32)
    stream = jnp.minimum(jnp.searchsorted(end, b, side="right"), n - 1).astype(jnp.int32)
    live_block = b < end[-1]
    tok0 = cu[stream] + (b - first[stream]) * bq                          # [NB]
    toks = tok0[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]       # [NB, Bq]
    live = live_block[:, None] & (toks < cu[stream + 1][:, None])
    return QueryBlocks(tokens=jnp.where(live, toks, total_len).astype(jnp.int32),
                       slot=jnp.where(live_block, slot_ids[stream], -1).astype(jnp.int32))


def paged_attention(q: jax.Array, token_pos: jax.Array, kv: KvPages, page_table: jax.Array,
                    slot_lens: jax.Array, blocks: QueryBlocks, *, window_pages: int, scale: float,
                    backend: str = "xla") -> jax.Array:
    """Causal attention of stacked queries over their own slot's pages (prefill of several streams or decode).

    q: [T, H, Dh]; token_pos: [T] int32 absolute position of each query; kv pages [P, Ps, Hkv, Dh];
    page_table: [S, P] int32; slot_lens: [S] int32 tokens each slot holds once this call's K/V are written;
    blocks: the query blocks (each inside one stream). window_pages W (static): every stream of the call holds at
    most W * Ps tokens (the caller guarantees it; more would be silently cut).
    Each block gathers the first W pages of its slot and attends to keys with position <= the query's and
    < slot_lens[slot]; keys past the slot's length (stale page tails, NaN or not) are zeroed before use.
    Work per call: NB * Bq * W * Ps, independent of the pool size. Returns o [T, H, Dh] in q's dtype (scores
    and softmax in fp32).
    """
    if backend not in ("auto", "xla", "pallas", "pallas_interpret"):
        raise ValueError(f"paged_attention: unknown backend {backend!r}")
    # No Pallas paged-attention kernel yet: every backend runs the XLA form below.
    token_pos = jnp.asarray(token_pos, jnp.int32)
    page_table = jnp.asarray(page_table, jnp.int32)
    slot_lens = jnp.asarray(slot_lens, jnp.int32)
    t, h, dh = q.shape
    _, ps, hkv, _ = kv.k_pages.shape
    g = h // hkv
    w = int(window_pages)
    if not 1 <= w <= page_table.shape[1]:
        raise ValueError(f"paged_attention: window_pages must be in [1, P={page_table.shape[1]}], got {w}")
    nb, bq = blocks.tokens.shape
    lk = w * ps
    q_pad = jnp.concatenate([q, jnp.zeros((1, h, dh), q.dtype)], axis=0)          # row T: padding
    pos_pad = jnp.concatenate([token_pos, jnp.zeros((1,), jnp.int32)])
    key_pos = jnp.arange(lk, dtype=jnp.int32)

    def one_block(args):
        toks, slot = args                                                         # [Bq], scalar
        s = jnp.maximum(slot, 0)
        qi = q_pad[toks].reshape(bq, hkv, g, dh)
        pi = pos_pad[toks]                                                        # [Bq]
        pages = page_table[s, :w]                                                 # [W]
        live = (key_pos < slot_lens[s]) & (slot >= 0)                             # [Lk]
        keys = jnp.where(live[:, None, None], kv.k_pages[pages].reshape(lk, hkv, dh), 0).astype(kv.k_pages.dtype)
        values = jnp.where(live[:, None, None], kv.v_pages[pages].reshape(lk, hkv, dh), 0).astype(
            kv.v_pages.dtype)
        scores = jnp.einsum("qhgd,khd->hgqk", qi, keys, preferred_element_type=jnp.float32) * scale
        mask = live[None, :] & (key_pos[None, :] <= pi[:, None])                  # [Bq, Lk]
        scores = jnp.where(mask[None, None], scores, _NEG_INF)
        m = jnp.max(scores, axis=-1, keepdims=True)
        e = jnp.where(mask[None, None], jnp.exp(scores - m), 0.0)
        denom = jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
        probs = (e / denom).astype(values.dtype)
        o = jnp.einsum("hgqk,khd->qhgd", probs, values, preferred_element_type=jnp.float32)
        return o.astype(q.dtype).reshape(bq, h, dh)

    out = jax.lax.map(one_block, (blocks.tokens, blocks.slot))                   # [NB, Bq, H, Dh]
    o = jnp.zeros((t + 1, h, dh), q.dtype).at[blocks.tokens.reshape(-1)].set(out.reshape(nb * bq, h, dh))
    return o[:t]


def attention_plan(max_stream_len: int, max_new_len: int, num_pages: int, page_size: int, num_heads: int,
                   *, max_block_q: int = 128, max_scores: int = 1 << 25) -> tuple:
    """Static (window_pages, block_q) for a call whose longest stream will hold ``max_stream_len`` tokens and
    whose longest new segment is ``max_new_len``: powers of two (few recompiles), the window capped at the pool,
    the query block at ``max_block_q`` and so that one block's scores [H, Bq, W * Ps] stay under max_scores."""
    def pow2(x):
        return 1 << max(0, int(x) - 1).bit_length()
    w = min(num_pages, pow2(-(-max(1, max_stream_len) // page_size)))
    bq = min(max_block_q, pow2(max(1, max_new_len)))
    while bq > 1 and num_heads * bq * w * page_size > max_scores:
        bq //= 2
    return w, bq


# ================================================================================================================
# The layer
# ================================================================================================================
def attention_layer(params: dict, dims: AttnDims, hidden: jax.Array, kv: KvPages, *, token_pos: jax.Array,
                    token_page: jax.Array, token_offset: jax.Array, page_table: jax.Array, slot_lens: jax.Array,
                    blocks: QueryBlocks, window_pages: int, backend: str = "xla"):
    """One gated attention layer over stacked tokens (prefill of several streams, or one decode step).

    hidden [T, D]; token_pos [T] (absolute position); token_page / token_offset [T] (where each token's K/V go;
    page >= P drops it); page_table [S, P] and slot_lens [S] describe the pool *after* this call's allocation and
    writes; blocks / window_pages: see ``paged_attention``. Returns (out [T, D] in hidden's dtype, new KvPages).
    """
    t = hidden.shape[0]
    q, k, v, gate = attention_qkv(params, dims, hidden, token_pos)
    kv = write_kv_pages(kv, k, v, token_page, token_offset)
    o = paged_attention(q, token_pos, kv, page_table, slot_lens, blocks, window_pages=window_pages,
                        scale=dims.head_dim ** -0.5, backend=backend)     # [T, H, Dh]
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    out = o.reshape(t, dims.num_heads * dims.head_dim) @ params["o_proj"]
    return out.astype(hidden.dtype), kv
