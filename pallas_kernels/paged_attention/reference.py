"""XLA reference of paged causal attention (prefill over stacked streams, and decode), and the on-device query
block map the kernels share with it.

Shape legend: T stacked query tokens, N streams, S slots, H query heads, Hkv kv heads (G = H / Hkv query heads
per kv head; query head h reads kv head h // G), Dh head dim, P pages in the pool, Ps tokens per page, W pages per
slot in the page table (any width), Bq query tokens per block, NB = T // Bq + N + 1 query blocks (static bound).

Semantics (both paths, and every kernel):
  stream n owns tokens cu[n] .. cu[n+1]-1 and slot s = slot_ids[n]; slot_lens[s] counts the tokens the slot holds
  AFTER this call's K/V were written, so query j of stream n sits at absolute position
  pos = slot_lens[s] - (cu[n+1] - cu[n]) + j and attends to keys 0 .. pos of its slot, key i living in page
  page_table[s, i // Ps] at offset i % Ps. softmax(q k^T * scale) v, scores and softmax in fp32.
  Padding: tokens >= cu[N], streams whose slot id is outside [0, S) (negative ids too) and keys whose page id is
  outside [0, P) read nothing; such queries get zeros. Keys at positions >= slot_lens[s] (stale page tails, NaN or
  not) are never used.

Gated prefill (``paged_attention_gated_xla``, Qwen3-Next / Qwen3.5 attention): the queries come as q_proj's raw
output qg [T, C] (head h's [query | gate] at columns h 2 Dh ..); each query is RMS-normed over Dh (zero-centred
weight: x / rms(x) * (1 + w), fp32, rounded to qg's dtype), its first R dims rotated by the partial NeoX RoPE
(``apply_partial_rope``, fp32, rounded), then attended as above, and the output multiplied by sigmoid(gate):
o [T, H * Dh] = o_proj's input.

This module imports only jax.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.chunk_map import count_le

_NEG = -1e30


class QueryBlocks(NamedTuple):
    """Stacked query tokens cut into NB blocks of at most Bq tokens, each inside ONE stream (built on device).

    tok0:  [NB] int32  first token of the block (T for a dead block)
    count: [NB] int32  valid query rows (0 for a dead block)
    slot:  [NB] int32  slot of the block's stream, clamped into [0, S) (meaningless when klen == 0)
    pos0:  [NB] int32  absolute position of the block's first query
    klen:  [NB] int32  keys the block reads: min(slot_lens[slot], pos0 + count); 0 for padding / no-slot blocks
    """

    tok0: jax.Array
    count: jax.Array
    slot: jax.Array
    pos0: jax.Array
    klen: jax.Array


def num_query_blocks(num_tokens: int, num_streams: int, block_q: int) -> int:
    """Static bound on the blocks of any packing: sum ceil(L_n / Bq) <= T // Bq + N, plus one padding stream."""
    return max(1, num_tokens // block_q + num_streams + 1)


def build_query_blocks(cu_seqlens: jax.Array, slot_ids: jax.Array, slot_lens: jax.Array, num_tokens: int,
                       block_q: int) -> QueryBlocks:
    """Cuts each stream of ``cu_seqlens [N + 1]`` into ceil(L / Bq) blocks on the device (no host sync).

    The tokens cu[N] .. T-1 (padding) form one more stream with no slot, so that every token of [0, T) lies in
    some block and a kernel writes every output row (zeros for padding). Blocks past the real count are dead
    (count 0)."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    slot_lens = jnp.asarray(slot_lens, jnp.int32)
    s_count = slot_lens.shape[0]
    bq = int(block_q)
    cu = jnp.concatenate([cu, jnp.full((1,), num_tokens, jnp.int32)])              # + padding stream
    ids = jnp.concatenate([slot_ids, jnp.full((1,), -1, jnp.int32)])
    n = ids.shape[0]
    nb = num_query_blocks(num_tokens, n - 1, bq)
    lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    per = (lens + bq - 1) // bq                                                     # [N + 1]
    end = jnp.cumsum(per)
    first = end - per
    b = jnp.arange(nb, dtype=jnp.int32)
    stream = jnp.minimum(count_le(end, nb), n - 1).astype(jnp.int32)   # searchsorted(end, b, "right"), loop-free
    live = b < end[-1]
    j = b - first[stream]
    tok0 = cu[stream] + j * bq
    count = jnp.where(live, jnp.clip(cu[stream + 1] - tok0, 0, bq), 0)
    sid = ids[stream]
    has_slot = live & (sid >= 0) & (sid < s_count)
    slot = jnp.clip(sid, 0, s_count - 1)
    pos0 = slot_lens[slot] - lens[stream] + j * bq
    klen = jnp.where(has_slot, jnp.clip(jnp.minimum(slot_lens[slot], pos0 + count), 0, None), 0)
    return QueryBlocks(tok0=jnp.where(live, tok0, num_tokens).astype(jnp.int32), count=count.astype(jnp.int32),
                       slot=slot.astype(jnp.int32), pos0=jnp.where(has_slot, pos0, 0).astype(jnp.int32),
                       klen=klen.astype(jnp.int32))


def _gather_slot(k_pages, v_pages, pages):
    """K, V of pages [W] (ids already in range) as [W * Ps, Hkv, Dh]."""
    _, ps, hkv, dh = k_pages.shape
    w = pages.shape[0]
    return k_pages[pages].reshape(w * ps, hkv, dh), v_pages[pages].reshape(w * ps, hkv, dh)


def _attend(q, keys, values, mask, scale):
    """q [M, H, Dh], keys/values [L, Hkv, Dh] (masked entries already zero), mask [M, L] -> [M, H, Dh] fp32."""
    m_rows, h, dh = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(m_rows, hkv, h // hkv, dh)
    s = jnp.einsum("mhgd,khd->hgmk", qg, keys, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[None, None], s, _NEG)
    mx = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask[None, None], jnp.exp(s - mx), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("hgmk,khd->mhgd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return o.reshape(m_rows, h, dh)


def _slot_keys(k_pages, v_pages, page_table_row, key_limit):
    """Keys/values of one slot [W * Ps, Hkv, Dh] with every key at position >= key_limit or on a page id outside
    [0, P) zeroed (never read as data), and the key validity [W * Ps]."""
    p, ps = k_pages.shape[0], k_pages.shape[1]
    w = page_table_row.shape[0]
    page_ok = (page_table_row >= 0) & (page_table_row < p)                          # [W]
    keys, values = _gather_slot(k_pages, v_pages, jnp.where(page_ok, page_table_row, 0))
    kpos = jnp.arange(w * ps, dtype=jnp.int32)
    live = jnp.repeat(page_ok, ps) & (kpos < key_limit)
    keys = jnp.where(live[:, None, None], keys, jnp.zeros((), keys.dtype))
    values = jnp.where(live[:, None, None], values, jnp.zeros((), values.dtype))
    return keys, values, live, kpos


def paged_attention_xla(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *, scale: float,
                        block_q: int = 64):
    """Prefill: q [T, H, Dh] stacked queries of N streams -> o [T, H, Dh] in q's dtype (see the module docstring).

    One block of Bq queries at a time (``lax.map`` over NB = T // Bq + N + 1 blocks); each block gathers all W
    pages of its slot: O(T * W * Ps) work, an oracle and the CPU path, not a fast one."""
    t, h, dh = q.shape
    bq = max(1, min(int(block_q), t))
    blocks = build_query_blocks(cu_seqlens, slot_ids, slot_lens, t, bq)
    q_pad = jnp.concatenate([q, jnp.zeros((bq, h, dh), q.dtype)], axis=0)
    rows = jnp.arange(bq, dtype=jnp.int32)

    def one_block(blk):
        tok0, count, slot, pos0, klen = blk
        qi = jax.lax.dynamic_slice_in_dim(q_pad, jnp.minimum(tok0, t), bq, axis=0)   # [Bq, H, Dh]
        keys, values, live, kpos = _slot_keys(k_pages, v_pages, page_table[slot], klen)
        qpos = pos0 + rows
        mask = live[None, :] & (kpos[None, :] <= qpos[:, None]) & (rows < count)[:, None]
        return _attend(qi, keys, values, mask, scale).astype(q.dtype)

    out = jax.lax.map(one_block, tuple(blocks))                                        # [NB, Bq, H, Dh]
    dest = jnp.where(rows[None, :] < blocks.count[:, None], blocks.tok0[:, None] + rows[None, :], t)
    o = jnp.zeros((t + 1, h, dh), q.dtype).at[dest.reshape(-1)].set(out.reshape(-1, h, dh), mode="drop")
    return o[:t]


def rms_norm_zc(x, w, eps: float):
    """Zero-centred RMSNorm over the last axis, ``x / rms(x) * (1 + w)`` in fp32, returned in x's dtype (the
    formula of jax_gdn.ops.norms.rms_norm, which the layers use)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def apply_partial_rope(x, cos, sin):
    """Rotates the first R dims of ``x [T, H, Dh]`` with ``cos, sin [T, R]`` (NeoX rotate-half: the rotary part
    split into halves [x1 | x2] becomes [x1 cos - x2 sin | x2 cos + x1 sin]; dims R.. pass through); computed in
    fp32, returned in x's dtype. (jax_gdn.layers.rope re-exports it.)"""
    r = cos.shape[-1]
    if x.ndim != 3 or cos.shape != (x.shape[0], r) or r > x.shape[-1]:
        raise ValueError(f"apply_partial_rope: x must be [T, H, Dh] and cos/sin [T, R<=Dh]; got x "
                         f"{tuple(x.shape)}, cos {tuple(cos.shape)}")
    x32 = x.astype(jnp.float32)
    x_rot, x_pass = x32[..., :r], x32[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x_rot * c + rotated * s, x_pass], axis=-1)
    return out.astype(x.dtype)


def gated_query(qg, q_norm, cos, sin, *, num_heads: int, head_dim: int, eps: float):
    """qg [T, C] (head h's [query | gate] at columns h 2 Dh ..) -> (q [T, H, Dh] normed and rotated, gate
    [T, H, Dh]), both in qg's dtype."""
    t = qg.shape[0]
    x = qg[:, :num_heads * 2 * head_dim].reshape(t, num_heads, 2 * head_dim)
    q, gate = x[..., :head_dim], x[..., head_dim:]
    q = rms_norm_zc(q, q_norm, eps)
    if cos.shape[-1]:
        q = apply_partial_rope(q, cos, sin)
    return q, gate


def paged_attention_gated_xla(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, q_norm, cos, sin,
                              *, num_heads: int, eps: float, scale: float):
    """Gated prefill (module docstring): qg [T, C] -> o [T, H * Dh] in qg's dtype, = sigmoid(gate) *
    attention(RoPE(RMSNorm(query))); zeros for padding tokens."""
    dh = k_pages.shape[-1]
    q, gate = gated_query(qg, q_norm, cos, sin, num_heads=num_heads, head_dim=dh, eps=eps)
    o = paged_attention_xla(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, scale=scale)
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    return o.reshape(qg.shape[0], num_heads * dh)


def paged_attention_decode_xla(q, k_pages, v_pages, page_table, slot_lens, slot_ids, *, scale: float):
    """Decode: q [N, H, Dh], one query per stream at position slot_lens[slot] - 1 -> o [N, H, Dh] in q's dtype.
    Streams whose slot id is outside [0, S) get zeros. Each stream gathers all W pages of its slot (vmapped)."""
    s_count = slot_lens.shape[0]
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    has_slot = (slot_ids >= 0) & (slot_ids < s_count)
    slot = jnp.clip(slot_ids, 0, s_count - 1)
    ctx = jnp.where(has_slot, slot_lens[slot], 0)

    def one(qn, sl, c):
        keys, values, live, _ = _slot_keys(k_pages, v_pages, page_table[sl], c)
        return _attend(qn[None], keys, values, live[None, :], scale)[0]

    return jax.vmap(one)(q, slot, ctx).astype(q.dtype)
