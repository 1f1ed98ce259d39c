"""Gated attention pieces: paged causal attention against a float64 NumPy reference (continued streams, GQA, odd
lengths, NaN-poisoned stale pages), partial NeoX RoPE and the whole layer against HF's Qwen3NextAttention."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.config import AttnDims
from jax_gdn.layers.attention import (attention_layer, attention_plan, build_query_blocks, paged_attention,
                                      write_kv_pages)
from jax_gdn.layers.rope import apply_partial_rope, rope_cos_sin
from jax_gdn.state import KvPages
from tests.numpy_reference import rel_rms

PS, P, S = 8, 48, 4


def _ref_attention(q, k, v, start, scale):
    """q [Tn, H, Dh] at positions start.., k/v [start + Tn, Hkv, Dh]; causal; float64."""
    tn, h, _ = q.shape
    g = h // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk) * scale
    mask = np.arange(k.shape[0])[None, :] <= (start + np.arange(tn))[:, None]
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_continued_streams_match_f64(dtype, tol, group):
    rng = np.random.default_rng(group)
    hkv, dh = 2, 16
    h = hkv * group
    slots, old, new = [2, 0, 3], [0, 13, 64], [1, 63, 65]
    total = [o + n for o, n in zip(old, new)]
    k_all = [rng.standard_normal((t, hkv, dh)) for t in total]
    v_all = [rng.standard_normal((t, hkv, dh)) for t in total]
    q_new = [rng.standard_normal((n, h, dh)) for n in new]

    # pool: pages handed out in a shuffled order; everything not written is NaN
    k_pages = np.full((P, PS, hkv, dh), np.nan, np.float32)
    v_pages = np.full((P, PS, hkv, dh), np.nan, np.float32)
    free = list(rng.permutation(P))
    table = {}
    for s, t in zip(slots, total):
        for i in range(-(-t // PS)):
            pg = free.pop()
            table[(s, i)] = pg
    for s, o, kk, vv in zip(slots, old, k_all, v_all):     # the earlier tokens are already in the pages
        for pos in range(o):
            k_pages[table[(s, pos // PS)], pos % PS] = kk[pos]
            v_pages[table[(s, pos // PS)], pos % PS] = vv[pos]
    slot_lens = np.zeros(S, np.int32)
    slot_lens[slots] = total
    page_table = np.zeros((S, P), np.int32)
    for (s, i), pg in table.items():
        page_table[s, i] = pg
    page_table[1, :] = rng.integers(0, P, P)      # an idle slot's stale row must not matter

    tok_slot = np.concatenate([[s] * n for s, n in zip(slots, new)]).astype(np.int32)
    tok_pos = np.concatenate([np.arange(o, o + n) for o, n in zip(old, new)]).astype(np.int32)
    tok_page = np.array([table[(s, p // PS)] for s, p in zip(tok_slot, tok_pos)], np.int32)
    q = jnp.asarray(np.concatenate(q_new), dtype)
    k = jnp.asarray(np.concatenate([kk[o:] for kk, o in zip(k_all, old)]), dtype)
    v = jnp.asarray(np.concatenate([vv[o:] for vv, o in zip(v_all, old)]), dtype)

    kv = KvPages(jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype))
    cu = np.cumsum([0] + new).astype(np.int32)
    window, block_q = attention_plan(max(total), max(new), P, PS, h, max_block_q=32)
    assert (window, block_q) == (32, 32)        # ceil(129 / 8) = 17 pages -> 32; longest new segment 65 -> 32
    blocks = build_query_blocks(cu, np.array(slots, np.int32), sum(new), block_q)
    assert blocks.tokens.shape == (sum(new) // 32 + 3, 32)
    fn = jax.jit(lambda kv, q, k, v: paged_attention(
        q, tok_pos, write_kv_pages(kv, k, v, tok_page, tok_pos % PS), page_table, slot_lens, blocks,
        window_pages=window, scale=dh ** -0.5))
    out = np.asarray(fn(kv, q, k, v).astype(jnp.float32))
    assert out.shape == (sum(new), h, dh) and np.all(np.isfinite(out))
    start = 0
    for s, o, n, kk, vv, qq in zip(slots, old, new, k_all, v_all, q_new):
        ref = _ref_attention(np.asarray(q[start:start + n], np.float64), np.asarray(jnp.asarray(kk, dtype),
                             np.float64), np.asarray(jnp.asarray(vv, dtype), np.float64), o, dh ** -0.5)
        assert rel_rms(out[start:start + n], ref) <= tol, f"slot {s}"
        start += n


def test_partial_rope_matches_hf():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb
    rng = np.random.default_rng(0)
    t, h, dh, r, theta = 11, 3, 16, 4, 10000.0
    x = rng.standard_normal((t, h, dh)).astype(np.float32)
    pos = np.array([0, 1, 2, 7, 63, 64, 65, 129, 500, 4095, 30000], np.int32)
    inv = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    freqs = torch.tensor(pos, dtype=torch.float)[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)
    xt = torch.tensor(x).transpose(0, 1)[None]                                  # [1, H, T, Dh]
    ref, _ = apply_rotary_pos_emb(xt, xt, emb.cos()[None], emb.sin()[None])
    cos, sin = rope_cos_sin(jnp.asarray(pos), r, theta)
    ours = apply_partial_rope(jnp.asarray(x), cos, sin)
    np.testing.assert_allclose(np.asarray(ours), ref[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ours)[..., r:], x[..., r:])


def test_attention_layer_matches_hf_module():
    """One fresh stream of 9 tokens through attention_layer vs HF Qwen3NextAttention (random norms, gate)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding
    cfg = Qwen3NextConfig(hidden_size=24, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                           "partial_rotary_factor": 0.5})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    mod = Qwen3NextAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(1, 9, 24)
    pos = torch.arange(9)[None]
    cos, sin = Qwen3NextRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = mod(x, (cos, sin), mask)[0][0].numpy()
    dims = AttnDims(hidden_size=24, num_heads=6, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.5,
                    rope_theta=1000.0)
    params = {n: jnp.asarray(getattr(mod, n).weight.detach().numpy().T) for n in ("q_proj", "k_proj", "v_proj",
                                                                               "o_proj")}
    params["q_norm"] = jnp.asarray(mod.q_norm.weight.detach().numpy())
    params["k_norm"] = jnp.asarray(mod.k_norm.weight.detach().numpy())
    kv = KvPages.zeros(4, 4, 2, 8)
    t = np.arange(9, dtype=np.int32)
    blocks = build_query_blocks(np.array([0, 9], np.int32), np.array([0], np.int32), 9, 4)
    out, kv = attention_layer(params, dims, jnp.asarray(x[0].numpy()), kv, token_pos=t, token_page=t // 4,
                              token_offset=t % 4, page_table=np.array([[0, 1, 2, 3]], np.int32),
                              slot_lens=np.array([9], np.int32), blocks=blocks, window_pages=4)
    assert rel_rms(np.asarray(out), ref) <= 2e-4
    assert np.all(np.asarray(kv.k_pages)[3] == 0)          # nothing written past the stream's pages
