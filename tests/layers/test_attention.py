"""Gated attention layer: partial NeoX RoPE and the whole layer against HF's Qwen3NextAttention; the layer's
split calls (prefill in two chunks, then decode steps) against one prefill of every token, per backend (the
cuDNN backend through its XLA stand-in "cudnn_xla" on CPU), with padding tokens and a padding stream (slot id S). The paged-attention op itself is tested against a float64 oracle
in tests/pallas_kernels/paged_attention/test_triton.py."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.config import AttnDims
from jax_gdn.layers.attention import attention_layer, fuse_qkv, write_kv_pages
from jax_gdn.layers.rope import apply_partial_rope, rope_cos_sin
from jax_gdn.options import RuntimeOptions
from jax_gdn.state import KvPages
from tests.numpy_reference import rel_rms

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
    out, kv = attention_layer(params, dims, jnp.asarray(x[0].numpy()), kv, token_pos=t, token_page=t // 4,
                              token_offset=t % 4, page_table=np.array([[0, 1, 2, 3]], np.int32),
                              slot_lens=np.array([9], np.int32), cu_seqlens=np.array([0, 9], np.int32),
                              slot_ids=np.array([0], np.int32))
    assert rel_rms(np.asarray(out), ref) <= 2e-4
    assert np.all(np.asarray(kv.k_pages)[3] == 0)          # nothing written past the stream's pages


def _layer_setup(seed=0, d=32, h=4, hkv=2, dh=16, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    dims = AttnDims(hidden_size=d, num_heads=h, num_kv_heads=hkv, head_dim=dh, partial_rotary_factor=0.5,
                    rope_theta=1000.0)
    shapes = {"q_proj": (d, h * 2 * dh), "k_proj": (d, hkv * dh), "v_proj": (d, hkv * dh), "o_proj": (h * dh, d)}
    params = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dtype) for n, s in shapes.items()}
    params["q_norm"] = jnp.asarray(0.1 * rng.standard_normal(dh), jnp.float32)
    params["k_norm"] = jnp.asarray(0.1 * rng.standard_normal(dh), jnp.float32)
    return rng, dims, params


def _call(params, dims, kv, x, slot_ids, old_lens, new_lens, page_table, ps, *, decode=False, backend="xla",
          pad_tokens=0, num_slots=4, options=None):
    """One layer call for streams (slot, old, new); the page table is fixed (slot s owns pages s*W ..)."""
    tok_slot = np.concatenate([[s] * n for s, n in zip(slot_ids, new_lens)] + [[num_slots] * pad_tokens])
    tok_pos = np.concatenate([np.arange(o, o + n) for o, n in zip(old_lens, new_lens)] + [[0] * pad_tokens])
    tok_slot, tok_pos = tok_slot.astype(np.int32), tok_pos.astype(np.int32)
    real = tok_slot < num_slots
    tok_page = np.where(real, page_table[np.minimum(tok_slot, num_slots - 1), tok_pos // ps], kv.num_pages)
    slot_lens = np.zeros(num_slots, np.int32)
    for sid, o, n in zip(slot_ids, old_lens, new_lens):
        if sid < num_slots:
            slot_lens[sid] = o + n
    cu = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    return attention_layer(params, dims, x, kv, token_pos=jnp.asarray(tok_pos), token_page=jnp.asarray(
        tok_page.astype(np.int32)), token_offset=jnp.asarray(tok_pos % ps), page_table=jnp.asarray(page_table),
        slot_lens=jnp.asarray(slot_lens), cu_seqlens=jnp.asarray(cu), slot_ids=jnp.asarray(slot_ids, jnp.int32),
        decode=decode, backend=backend, options=options)


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret", "cudnn_xla"])
def test_layer_chunked_prefill_and_decode_match_one_prefill(backend):
    """Streams of 70 and 9 tokens: prefill 40 + 5, then 27 + 2 (with 3 padding tokens), then 3 decode steps,
    equals one prefill of all 70 + 9 at once (stale NaN pages everywhere else)."""
    rng, dims, params = _layer_setup()
    ps, w, s = 8, 10, 4
    slots = [2, 0]
    page_table = np.arange(s * w, dtype=np.int32).reshape(s, w)[::-1].copy()     # slot s owns pages (S-1-s)*W..
    nan_kv = KvPages(jnp.full((s * w, ps, 2, 16), jnp.nan), jnp.full((s * w, ps, 2, 16), jnp.nan))
    xs = [jnp.asarray(rng.standard_normal((n, 32)), jnp.float32) for n in (70, 9)]
    ref, _ = _call(params, dims, nan_kv, jnp.concatenate(xs), slots, [0, 0], [70, 9], page_table, ps)
    ref = np.asarray(ref)
    kv = nan_kv
    o1, kv = _call(params, dims, kv, jnp.concatenate([xs[0][:40], xs[1][:5]]), slots, [0, 0], [40, 5],
                   page_table, ps, backend=backend)
    x2 = jnp.concatenate([xs[0][40:67], xs[1][5:7], jnp.full((3, 32), 5.0)])
    o2, kv = _call(params, dims, kv, x2, slots, [40, 5], [27, 2], page_table, ps, backend=backend, pad_tokens=3)
    o2 = np.asarray(o2)
    assert np.all(np.isfinite(o2))
    np.testing.assert_allclose(np.asarray(o1)[:40], ref[:40], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o1)[40:], ref[70:75], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(o2[:27], ref[40:67], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(o2[27:29], ref[75:77], rtol=1e-4, atol=1e-5)
    for step in range(3):
        old = [67 + step, 7 + step] if step < 2 else [69, 9]
        if step == 2:   # the short stream is done: a padding stream (slot id S) takes its place
            x = jnp.stack([xs[0][69], jnp.full((32,), 3.0)])
            o, kv = _call(params, dims, kv, x, [2, s], [69, 0], [1, 1], page_table, ps, decode=True,
                          backend=backend)
            np.testing.assert_allclose(np.asarray(o)[0], ref[69], rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(np.asarray(o)[1], 0.0)
            continue
        x = jnp.stack([xs[0][old[0]], xs[1][old[1]]])
        o, kv = _call(params, dims, kv, x, slots, old, [1, 1], page_table, ps, decode=True, backend=backend)
        np.testing.assert_allclose(np.asarray(o), ref[[old[0], 70 + old[1]]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_fused_layer_matches_unfused(dtype, tol):
    """The prefill with q norm, RoPE and gate inside the kernel (pallas_interpret, fused by default there), with
    three projections or one fused qkv_proj, against the unfused XLA layer: same outputs, same pages written.
    Streams of 1, 63, 64, 65 and 130 new tokens, two of them continuing, plus padding tokens."""
    rng, dims, params = _layer_setup(3, dtype=dtype)
    params = {k: v.astype(dtype) for k, v in params.items()}
    ps, w, s = 8, 24, 6
    page_table = rng.permutation(s * w).astype(np.int32).reshape(s, w)
    kv0 = KvPages(jnp.full((s * w, ps, 2, 16), jnp.nan, dtype), jnp.full((s * w, ps, 2, 16), jnp.nan, dtype))
    slots, old, new = [3, 0, 5, 1, 2], [0, 7, 0, 40, 0], [1, 63, 64, 65, 130]
    # the context of the continued streams, written by an earlier (unfused) call
    ctx_x = jnp.asarray(rng.standard_normal((47, 32)), dtype)
    _, kv0 = _call(params, dims, kv0, ctx_x, [0, 1], [0, 0], [7, 40], page_table, ps, num_slots=s)
    x = jnp.asarray(rng.standard_normal((sum(new) + 5, 32)), dtype)
    ref, kv_ref = _call(params, dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s)
    ref = np.asarray(ref.astype(jnp.float32))
    for p in (params, fuse_qkv(params)):
        out, kv = _call(p, dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s,
                        backend="pallas_interpret")
        out = np.asarray(out.astype(jnp.float32))
        assert np.all(np.isfinite(out))
        assert rel_rms(out[:sum(new)], ref[:sum(new)]) <= tol, sorted(p)
        live = np.isfinite(np.asarray(kv_ref.k_pages.astype(jnp.float32)))
        np.testing.assert_array_equal(np.isfinite(np.asarray(kv.k_pages.astype(jnp.float32))), live)
        np.testing.assert_allclose(np.asarray(kv.k_pages.astype(jnp.float32))[live],
                                   np.asarray(kv_ref.k_pages.astype(jnp.float32))[live], rtol=tol, atol=tol)
    # the XLA backend with the fused weight, and the three weights concatenated per call (long calls): the same
    out, _ = _call(fuse_qkv(params), dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s)
    assert rel_rms(np.asarray(out.astype(jnp.float32))[:sum(new)], ref[:sum(new)]) <= tol
    out, _ = _call(params, dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s,
                   backend="pallas_interpret", options=RuntimeOptions(qkv_concat_min_tokens=16))
    assert rel_rms(np.asarray(out.astype(jnp.float32))[:sum(new)], ref[:sum(new)]) <= tol


@pytest.mark.parametrize("batch", ["fresh", "mixed"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_cudnn_layer_direct_path_matches_xla(batch, dtype, tol):
    """The cuDNN backends' prefill (the "cudnn_xla" stand-in takes the same branches as "cudnn": the new K/V
    straight from the projection, ``lax.cond`` on "any stream has context", the gate in the merge's pass), with
    the fused qkv_proj the model holds and with the three weights, against the XLA layer: same outputs, same
    pages. A fresh batch (1, 63, 64, 65, 130 tokens) and one where two streams continue; padding tokens and a
    padding stream (slot id S) in both. Also the unfused cuDNN path (``fused=False``: the K/V gathered back from
    the pages, context call and merge always) and the Pallas q norm + RoPE kernel (``cudnn.Q_PROLOGUE``)."""
    rng, dims, params = _layer_setup(4, dtype=dtype)
    params = {k: v.astype(dtype) for k, v in params.items()}
    ps, w, s = 8, 24, 6
    page_table = rng.permutation(s * w).astype(np.int32).reshape(s, w)
    kv0 = KvPages(jnp.full((s * w, ps, 2, 16), jnp.nan, dtype), jnp.full((s * w, ps, 2, 16), jnp.nan, dtype))
    slots, new = [3, 0, 5, 1, 2, s], [1, 63, 64, 65, 130, 0]
    old = [0] * 6 if batch == "fresh" else [0, 7, 0, 40, 0, 0]
    if batch == "mixed":
        ctx_x = jnp.asarray(rng.standard_normal((47, 32)), dtype)
        _, kv0 = _call(params, dims, kv0, ctx_x, [0, 1], [0, 0], [7, 40], page_table, ps, num_slots=s)
    x = jnp.asarray(rng.standard_normal((sum(new) + 5, 32)), dtype)
    ref, kv_ref = _call(params, dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s)
    ref = np.asarray(ref.astype(jnp.float32))
    live = np.isfinite(np.asarray(kv_ref.k_pages.astype(jnp.float32)))
    for p in (params, fuse_qkv(params)):
        out, kv = _call(p, dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s,
                        backend="cudnn_xla")
        out = np.asarray(out.astype(jnp.float32))
        assert np.all(np.isfinite(out)) and rel_rms(out, ref) <= tol, sorted(p)
        np.testing.assert_array_equal(np.isfinite(np.asarray(kv.k_pages.astype(jnp.float32))), live)
        for got, want in ((kv.k_pages, kv_ref.k_pages), (kv.v_pages, kv_ref.v_pages)):
            np.testing.assert_allclose(np.asarray(got.astype(jnp.float32))[live],
                                       np.asarray(want.astype(jnp.float32))[live], rtol=tol, atol=tol)
    from pallas_kernels.paged_attention import cudnn
    out, _ = _call(params, dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s,
                   backend="cudnn_xla", options=RuntimeOptions(cudnn_direct=False))      # the unfused path
    assert rel_rms(np.asarray(out.astype(jnp.float32)), ref) <= tol, "cudnn_direct"
    mp = pytest.MonkeyPatch()
    mp.setattr(cudnn, "Q_PROLOGUE", "pallas")     # the q norm + RoPE kernel (interpret mode here)
    try:
        out, _ = _call(params, dims, kv0, x, slots, old, new, page_table, ps, pad_tokens=5, num_slots=s,
                       backend="cudnn_xla")
    finally:
        mp.undo()
    assert rel_rms(np.asarray(out.astype(jnp.float32)), ref) <= tol, "Q_PROLOGUE"


def test_fuse_qkv_tree_fuses_every_attention_mixer_once():
    """The model's parameter tree (stacked layers [R, D, C]): each attention mixer gets one qkv_proj with the
    columns q | k | v; the other leaves are the same arrays; fusing twice changes nothing."""
    from jax_gdn.layers.attention import fuse_qkv_tree
    _, _, a = _layer_setup(5)
    stacked = {k: jnp.stack([v, 2 * v]) for k, v in a.items()}
    gdn = {"in_proj_qkvz": jnp.ones((2, 3, 4))}
    tree = {"embed": jnp.zeros(3), "period": ({"mixer": gdn}, {"mixer": stacked, "input_norm": jnp.ones(2)}),
            "tail": ()}
    out = fuse_qkv_tree(tree)
    assert out["embed"] is tree["embed"] and out["period"][0]["mixer"]["in_proj_qkvz"] is gdn["in_proj_qkvz"]
    m = out["period"][1]["mixer"]
    assert sorted(m) == ["k_norm", "o_proj", "q_norm", "qkv_proj"]
    np.testing.assert_array_equal(np.asarray(m["qkv_proj"]), np.concatenate(
        [np.asarray(stacked[n]) for n in ("q_proj", "k_proj", "v_proj")], axis=-1))
    assert fuse_qkv_tree(out)["period"][1]["mixer"]["qkv_proj"] is m["qkv_proj"]


def test_layer_rejects_bad_metadata_before_writing():
    """A page id out of range inside a slot's tokens, or a stream longer than its slot, raises ValueError naming
    the argument (checked path: concrete values)."""
    _, dims, params = _layer_setup(1)
    kv = KvPages.zeros(8, 4, 2, 16)
    x = jnp.zeros((6, 32))
    t = np.arange(6, dtype=np.int32)
    kw = dict(token_pos=t, token_page=t // 4, token_offset=t % 4, cu_seqlens=np.array([0, 6], np.int32),
              slot_ids=np.array([0], np.int32))
    with pytest.raises(ValueError, match=r"page_table\[0\]"):
        attention_layer(params, dims, x, kv, page_table=np.array([[0, 9]], np.int32),
                        slot_lens=np.array([6], np.int32), **kw)
    with pytest.raises(ValueError, match="stream 0 has 6 tokens but slot_lens"):
        attention_layer(params, dims, x, kv, page_table=np.array([[0, 1]], np.int32),
                        slot_lens=np.array([5], np.int32), **kw)
    with pytest.raises(ValueError, match="one token per stream"):
        attention_layer(params, dims, x, kv, page_table=np.array([[0, 1]], np.int32),
                        slot_lens=np.array([6], np.int32), decode=True, **kw)


@pytest.mark.parametrize("unique", [True, False])
def test_write_kv_pages_drops_out_of_range_and_negative_pages(unique):
    """Both scatters (``unique``, ``RuntimeOptions.kv_write_unique``: flat rows with unique indices, or (page,
    offset)); the row form also drops offsets outside [0, Ps) instead of writing another page's row."""
    kv = KvPages(jnp.full((3, 2, 1, 4), 7.0), jnp.full((3, 2, 1, 4), -7.0))
    k = jnp.arange(1, 7, dtype=jnp.float32)[:, None, None] * jnp.ones((6, 1, 4))
    pages, offs = [0, 3, -1, 2, 1, 0], [1, 0, 1, 0, 0, 0]
    if unique:
        pages, offs = pages + [1, 2], offs + [2, -1]
        k = jnp.concatenate([k, jnp.full((2, 1, 4), 9.0)])
    out = write_kv_pages(kv, k, -k, jnp.asarray(pages), jnp.asarray(offs), unique=unique)
    kp = np.asarray(out.k_pages)[:, :, 0, 0]
    np.testing.assert_array_equal(kp, [[6, 1], [5, 7], [4, 7]])      # page 3 (== P) and page -1 dropped
    np.testing.assert_array_equal(np.asarray(out.v_pages)[:, :, 0, 0], -kp)


def test_model_on_the_cudnn_backend_stand_in_matches_xla():
    """The whole model with paged attention on "cudnn_xla" (the cuDNN backend's packing, offsets and LSE merge with
    an XLA stand-in for the cuDNN call): chunked prefill of two streams (the second chunk continues them, with
    the model's bucket padding: padding tokens, a padding stream of slot id S, the layers' flat KV pool), then
    a decode step (the Pallas / XLA decode on this backend): the same logits as the XLA backend."""
    from jax_gdn import HybridConfig, HybridModel
    from jax_gdn.checkpoint import params_from_state_dict, random_state_dict
    cfg = HybridConfig(model_type="qwen3_next", vocab_size=37, hidden_size=16, num_hidden_layers=2,
                       layer_types=("linear_attention", "full_attention"), intermediate_size=16,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8)
    params = params_from_state_dict(cfg, random_state_dict(cfg, seed=5), jnp.float32)
    outs = {}
    for backend in ("xla", "cudnn_xla"):
        model = HybridModel(cfg, params, dtype=jnp.float32, backend={"paged_attention": backend})
        assert model.backends.paged_attention == backend
        cache = model.init_cache(max_seqs=3, max_tokens=256, page_size=8, max_seq_len=128)
        got = []
        ids = np.random.default_rng(1).integers(0, 37, 60).astype(np.int32)
        logits, cache = model.prefill(cache, ids[:25], np.array([0, 20, 25], np.int32), np.array([2, 0], np.int32))
        got.append(np.asarray(logits))
        logits, cache = model.prefill(cache, ids[25:45], np.array([0, 13, 20], np.int32),
                                      np.array([2, 0], np.int32))
        got.append(np.asarray(logits))
        logits, cache = model.decode(cache, ids[45:47], np.array([2, 0], np.int32))
        got.append(np.asarray(logits))
        model.check(cache)
        outs[backend] = got
    for a, b in zip(outs["xla"], outs["cudnn_xla"]):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-5)
