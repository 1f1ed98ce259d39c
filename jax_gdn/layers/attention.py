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
replaces; the XLA version below scans query blocks over the whole pool with an owner / position mask.
"""
from __future__ import annotations

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


def paged_attention(q: jax.Array, token_slot: jax.Array, token_pos: jax.Array, kv: KvPages,
                    page_owner: jax.Array, page_index: jax.Array, slot_lens: jax.Array, *, scale: float,
                    backend: str = "xla", block_q: int = 128) -> jax.Array:
    """Causal attention of stacked queries over their own slot's pages.

    q: [T, H, Dh]; token_slot, token_pos: [T] int32 (slot and absolute position of each query; a query with
    slot -1 attends nowhere and returns zeros); kv pages [P, Ps, Hkv, Dh]; page_owner, page_index: [P] int32;
    slot_lens: [S] int32 tokens each slot holds once this call's K/V are written.
    Query t sees key (p, j) iff page_owner[p] == token_slot[t] and page_index[p] * Ps + j <= token_pos[t].
    Keys and values of free pages and of page tails past their slot's length are zeroed first, so stale contents
    (even NaN) never reach the output. Returns o [T, H, Dh] in q's dtype (scores and softmax in fp32).
    """
    if backend not in ("auto", "xla", "pallas", "pallas_interpret"):
        raise ValueError(f"paged_attention: unknown backend {backend!r}")
    # No Pallas paged-attention kernel yet: every backend runs the XLA form below.
    token_slot, token_pos = jnp.asarray(token_slot, jnp.int32), jnp.asarray(token_pos, jnp.int32)
    page_owner, page_index = jnp.asarray(page_owner, jnp.int32), jnp.asarray(page_index, jnp.int32)
    slot_lens = jnp.asarray(slot_lens, jnp.int32)
    t, h, dh = q.shape
    p, ps, hkv, _ = kv.k_pages.shape
    g = h // hkv
    keys = kv.k_pages.reshape(p * ps, hkv, dh)                            # [L, Hkv, Dh], L = P * Ps
    values = kv.v_pages.reshape(p * ps, hkv, dh)
    key_slot = jnp.repeat(page_owner, ps)                                 # [L]
    key_pos = (page_index[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :]).reshape(-1)
    key_live = (key_slot >= 0) & (key_pos < slot_lens[jnp.maximum(key_slot, 0)])          # [L]
    keys = jnp.where(key_live[:, None, None], keys, 0).astype(keys.dtype)
    values = jnp.where(key_live[:, None, None], values, 0).astype(values.dtype)
    key_slot = jnp.where(key_live, key_slot, -2)                                          # never matches

    bq = max(1, min(block_q, t))
    nb = -(-t // bq)
    pad = nb * bq - t
    qb = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(nb, bq, hkv, g, dh)
    slot_b = jnp.pad(token_slot, (0, pad), constant_values=-1).reshape(nb, bq)
    pos_b = jnp.pad(token_pos, (0, pad)).reshape(nb, bq)

    def one_block(args):
        qi, si, pi = args                                                 # [Bq, Hkv, G, Dh], [Bq], [Bq]
        scores = jnp.einsum("qhgd,khd->hgqk", qi, keys, preferred_element_type=jnp.float32) * scale
        mask = (key_slot[None, :] == si[:, None]) & (key_pos[None, :] <= pi[:, None]) & (si[:, None] >= 0)
        scores = jnp.where(mask[None, None], scores, _NEG_INF)
        m = jnp.max(scores, axis=-1, keepdims=True)
        e = jnp.where(mask[None, None], jnp.exp(scores - m), 0.0)
        denom = jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
        probs = (e / denom).astype(values.dtype)
        return jnp.einsum("hgqk,khd->qhgd", probs, values, preferred_element_type=jnp.float32).astype(q.dtype)

    out = jax.lax.map(one_block, (qb, slot_b, pos_b))                     # [nb, Bq, Hkv, G, Dh]
    return out.reshape(nb * bq, h, dh)[:t]


# ================================================================================================================
# The layer
# ================================================================================================================
def attention_layer(params: dict, dims: AttnDims, hidden: jax.Array, kv: KvPages, *, token_slot: jax.Array,
                    token_pos: jax.Array, token_page: jax.Array, token_offset: jax.Array,
                    page_owner: jax.Array, page_index: jax.Array, slot_lens: jax.Array, backend: str = "xla"):
    """One gated attention layer over stacked tokens (prefill of several streams, or one decode step).

    hidden [T, D]; token_slot / token_pos [T] (slot, absolute position); token_page / token_offset [T] (where
    each token's K/V go; page >= P drops it); page_owner / page_index [P] and slot_lens [S] describe the pool
    *after* this call's allocation and writes. Returns (out [T, D] in hidden's dtype, updated KvPages).
    """
    t = hidden.shape[0]
    q, k, v, gate = attention_qkv(params, dims, hidden, token_pos)
    kv = write_kv_pages(kv, k, v, token_page, token_offset)
    o = paged_attention(q, token_slot, token_pos, kv, page_owner, page_index, slot_lens,
                        scale=dims.head_dim ** -0.5, backend=backend)     # [T, H, Dh]
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    out = o.reshape(t, dims.num_heads * dims.head_dim) @ params["o_proj"]
    return out.astype(hidden.dtype), kv
