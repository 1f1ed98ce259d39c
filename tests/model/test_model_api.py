"""HybridModel API: argument checks before any state is touched, running out of KV pages, release and reuse of
slots (stale GDN state and pages ignored), config.json parsing and checkpoint errors that name the tensor."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn import HybridConfig, OutOfKvPagesError, load_pretrained
from jax_gdn.checkpoint import params_from_state_dict, random_model, random_state_dict

CFG = HybridConfig(model_type="qwen3_next", vocab_size=61, hidden_size=32, num_hidden_layers=2,
                   layer_types=("linear_attention", "full_attention"), intermediate_size=24,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=8,
                   mlp_only_layers=(0,))


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0, dtype=jnp.float32, backend="xla")


def _snapshot(cache):
    return [np.asarray(x).copy() for x in (cache.slot_lens, cache.page_refs, cache.page_table, cache.gdn.ssm_state,
                                           cache.gdn.conv_state, cache.kv.k_pages)]


BAD = [
    (dict(input_ids=np.zeros((2, 3), np.int32)), "input_ids must have shape"),
    (dict(input_ids=np.zeros(6, np.float32)), "input_ids must be an int32 array"),
    (dict(input_ids=np.full(6, 61, np.int32)), r"input_ids must be token ids in \[0, vocab_size=61\)"),
    (dict(input_ids=np.full(6, -1, np.int32)), "input_ids must be token ids"),
    (dict(cu_seqlens=np.array([0, 2, 6], np.float32)), "cu_seqlens must be an int32 array"),
    (dict(cu_seqlens=np.array([[0, 2, 6]], np.int32)), r"cu_seqlens must have shape \[N \+ 1\]"),
    (dict(cu_seqlens=np.array([0, 2, 5], np.int32)), "end at T=6"),
    (dict(cu_seqlens=np.array([1, 2, 6], np.int32)), "start at 0"),
    (dict(cu_seqlens=np.array([0, 4, 2, 6], np.int32), slot_ids=np.array([0, 1, 2], np.int32)), "grow by"),
    (dict(slot_ids=np.array([0], np.int32)), r"slot_ids must have shape \[N\] = \[2\]"),
    (dict(slot_ids=np.array([0.0, 1.0])), "slot_ids must be an integer array"),
    (dict(slot_ids=np.array([0, 4], np.int32)), r"slot_ids must lie in \[0, 4\)"),
    (dict(slot_ids=np.array([-1, 0], np.int32)), r"slot_ids must lie in \[0, 4\)"),
    (dict(slot_ids=np.array([1, 1], np.int32)), "slot_ids must not repeat a slot"),
    (dict(cu_seqlens=np.array([0, 1, 2, 3, 4, 6], np.int32), slot_ids=np.arange(5, dtype=np.int32)),
     "5 streams in one call but the cache has max_seqs=4"),
]


@pytest.mark.parametrize("bad,match", BAD, ids=[m for _, m in BAD])
def test_prefill_rejects_bad_input_before_touching_state(model, bad, match):
    cache = model.init_cache(max_seqs=4, max_tokens=64, page_size=8)
    before = _snapshot(cache)
    args = dict(input_ids=np.arange(6, dtype=np.int32), cu_seqlens=np.array([0, 2, 6], np.int32),
                slot_ids=np.array([2, 0], np.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        model.prefill(cache, args["input_ids"], args["cu_seqlens"], args["slot_ids"])
    for a, b in zip(before, _snapshot(cache)):   # the cache was neither donated nor changed
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("ids,slots,match", [
    (np.array([[1, 2]], np.int32), np.array([0], np.int32), r"input_ids must have shape \[N\]"),
    (np.array([1, 99], np.int32), np.array([0, 1], np.int32), "token ids"),
    (np.array([1, 2], np.int32), np.array([0, 0], np.int32), "slot_ids must not repeat"),
    (np.array([1, 2], np.int32), np.array([0], np.int32), "slot_ids must have shape"),
])
def test_decode_and_release_reject_bad_input(model, ids, slots, match):
    cache = model.init_cache(max_seqs=4, max_tokens=64, page_size=8)
    with pytest.raises(ValueError, match=match):
        model.decode(cache, ids, slots)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, 4\)"):
        model.release(cache, np.array([7], np.int32))
    with pytest.raises(ValueError, match="cache must be the Cache"):
        model.prefill({"not": "a cache"}, np.arange(3, dtype=np.int32), np.array([0, 3], np.int32),
                      np.array([0], np.int32))
    for name in ("max_seqs", "max_tokens", "page_size"):
        with pytest.raises(ValueError, match=name):
            model.init_cache(**{name: 0})


@pytest.mark.parametrize("bad", [[0, 4], [1, 1], [[0, 1]], [0.0, 1.0]], ids=["range", "repeat", "rank", "dtype"])
def test_slot_id_errors_match_the_layers(model, bad):
    """The model checks slot_ids through validation.check_slot_ids: the same message as the GDN layer's decode."""
    from jax_gdn.layers import gdn
    from jax_gdn.state import GdnSlots

    cache = model.init_cache(max_seqs=4, max_tokens=64, page_size=8)
    dims = CFG.gdn_dims
    with pytest.raises(ValueError, match="slot_ids") as layer_err:
        gdn.gdn_layer_decode(gdn.init_params(dims, jax.random.PRNGKey(0)), dims, jnp.zeros((2, dims.hidden_size)),
                             GdnSlots.zeros(dims, 4), np.asarray(bad))
    with pytest.raises(ValueError, match="slot_ids") as model_err:
        model.decode(cache, np.array([1, 2], np.int32), bad)   # a list, converted like an array
    assert str(model_err.value) == str(layer_err.value)
    assert model.release(cache, []) is cache   # an empty release is a no-op


def test_out_of_pages_release_and_fresh_restart(model):
    """4 pages of 8 tokens: a second 20-token stream does not fit -> the step writes nothing, returns zero logits
    and sets cache.status; the status is sticky (a later decode is refused too) until model.check raises
    OutOfKvPagesError carrying the cleared cache. After releasing the first slot its pages are reused and its
    stale GDN state / KV ignored: same logits as a fresh cache."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 61, 20).astype(np.int32), rng.integers(0, 61, 20).astype(np.int32)
    cu = np.array([0, 20], np.int32)

    fresh = model.init_cache(max_seqs=2, max_tokens=32, page_size=8)
    ref_b, _ = model.prefill(fresh, b, cu, np.array([1], np.int32), return_all_logits=True)

    cache = model.init_cache(max_seqs=2, max_tokens=32, page_size=8)
    _, cache = model.prefill(cache, a, cu, np.array([0], np.int32))
    model.check(cache)                                   # no error yet
    assert int(np.sum(np.asarray(cache.page_refs) == 1)) == 3 and int(np.sum(np.asarray(cache.page_refs))) == 3
    before = _snapshot(cache)
    logits, cache = model.prefill(cache, b, cu, np.array([1], np.int32))     # no host read: returns at once
    assert int(cache.status) == 1 and np.all(np.asarray(logits) == 0)
    logits, cache = model.decode(cache, a[:1], np.array([0], np.int32))      # refused too (sticky)
    assert np.all(np.asarray(logits) == 0)
    for x, y in zip(before, _snapshot(cache)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(OutOfKvPagesError, match="out of KV pages") as err:
        model.check(cache)
    cache = err.value.cache
    assert int(cache.status) == 0
    for x, y in zip(before, _snapshot(cache)):
        np.testing.assert_array_equal(x, y)

    cache = model.release(cache, np.array([0], np.int32))
    assert np.all(np.asarray(cache.page_refs) == 0) and np.all(np.asarray(cache.slot_lens) == 0)
    # slot 1 now fits; then slot 0 (stale state and pages of stream a) restarts fresh with stream b
    got_b, cache = model.prefill(cache, b, cu, np.array([1], np.int32), return_all_logits=True)
    np.testing.assert_allclose(np.asarray(got_b), np.asarray(ref_b), rtol=1e-5, atol=1e-5)
    cache = model.release(cache, np.array([1], np.int32))
    _, cache = model.prefill(cache, a, cu, np.array([0], np.int32))
    cache = model.release(cache, np.array([0], np.int32))
    got_b0, cache = model.prefill(cache, b, cu, np.array([1], np.int32), return_all_logits=True)
    np.testing.assert_allclose(np.asarray(got_b0), np.asarray(ref_b), rtol=1e-5, atol=1e-5)
    model.check(cache)


def test_strict_model_raises_at_the_step_and_max_seq_len(model):
    """strict=True syncs after each step and raises at the refused step; a slot passing max_seq_len (W pages per
    slot) is refused with status 2 whatever the pool holds."""
    from jax_gdn import HybridModel
    strict = HybridModel(CFG, model.params, dtype=jnp.float32, backend="xla", strict=True)
    cache = strict.init_cache(max_seqs=2, max_tokens=32, page_size=8)
    _, cache = strict.prefill(cache, np.arange(20, dtype=np.int32), np.array([0, 20], np.int32), [0])
    with pytest.raises(OutOfKvPagesError, match="out of KV pages") as err:
        strict.prefill(cache, np.arange(20, dtype=np.int32), np.array([0, 20], np.int32), [1])
    np.testing.assert_array_equal(np.asarray(err.value.cache.slot_lens), [20, 0])

    cache = model.init_cache(max_seqs=2, max_tokens=64, page_size=8, max_seq_len=16)
    assert cache.page_table.shape == (2, 2)
    _, cache = model.prefill(cache, np.arange(16, dtype=np.int32), np.array([0, 16], np.int32), [0])
    _, cache = model.decode(cache, np.array([3], np.int32), [0])              # token 17 > max_seq_len
    assert int(cache.status) == 2
    with pytest.raises(OutOfKvPagesError, match="max_seq_len"):
        model.check(cache)


def test_cache_checked_leaf_by_leaf(model):
    """A cache of another head dim or dtype is refused with the leaf's name before anything runs."""
    cache = model.init_cache(max_seqs=2, max_tokens=32, page_size=8)
    bad = cache.replace(kv=cache.kv.replace(k_pages=jnp.zeros(cache.kv.k_pages.shape[:-1] + (16,))))
    with pytest.raises(ValueError, match=r"cache\.kv\.k_pages has shape .*needs"):
        model.prefill(bad, np.arange(3, dtype=np.int32), np.array([0, 3], np.int32), [0])
    bf16 = cache.replace(gdn=cache.gdn.replace(conv_state=cache.gdn.conv_state.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"cache\.gdn\.conv_state .*bfloat16.*float32"):
        model.decode(bf16, np.array([1], np.int32), [0])


def test_config_from_hf_variants():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                head_dim=4, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
                linear_value_head_dim=4, intermediate_size=8, full_attention_interval=2,
                rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0],
                                 "rope_type": "default"})
    c = HybridConfig.from_hf({"model_type": "qwen3_5", "text_config": base, "tie_word_embeddings": True})
    assert c.layer_types == ("linear_attention", "full_attention") * 2 and c.tie_word_embeddings
    assert c.rope_theta == 1e6 and c.attn_dims.rotary_dim == 2 and c.gdn_dims.layout == "qwen3_5"
    assert not any(c.layer_is_moe(i) for i in range(4))
    n = HybridConfig.from_hf({**base, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                              "norm_topk_prob": False})
    assert [n.layer_is_moe(i) for i in range(4)] == [False, True, False, False] and not n.norm_topk_prob
    with pytest.raises(ValueError, match="unknown model_type 'llama'"):
        HybridConfig.from_hf({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match="missing field 'linear_num_key_heads'"):
        HybridConfig.from_hf({k: v for k, v in base.items() if k != "linear_num_key_heads"}
                             | {"model_type": "qwen3_5_text"})
    with pytest.raises(ValueError, match="text_config"):
        HybridConfig.from_hf({"model_type": "qwen3_5_moe"})


def test_checkpoint_errors_name_the_tensor(tmp_path):
    sd = random_state_dict(CFG, seed=1)
    bad = dict(sd)
    del bad["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        params_from_state_dict(CFG, bad)
    bad = dict(sd, **{"model.layers.0.linear_attn.bogus": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensor.*linear_attn\.bogus"):
        params_from_state_dict(CFG, bad)
    bad = dict(sd, **{"model.layers.1.mlp.experts.2.up_proj.weight": np.ones((16, 33), np.float32)})
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight' has shape \(16, 33\).*\(16, 32\)"):
        params_from_state_dict(CFG, bad)
    # mtp.* is skipped, not "unexpected"
    params_from_state_dict(CFG, dict(sd, **{"mtp.layers.0.foo": np.ones(2, np.float32)}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match="unknown model_type 'mamba'"):
        load_pretrained(str(tmp_path))


def test_gdn_only_model_needs_no_kv_pages():
    """Without attention layers the KV pool is never consulted: 40 tokens fit a 16-token pool."""
    import dataclasses
    cfg = dataclasses.replace(CFG, layer_types=("linear_attention",) * 2)
    m = random_model(cfg, seed=2, dtype=jnp.float32, backend="xla")
    cache = m.init_cache(max_seqs=2, max_tokens=16, page_size=8)
    assert cache.kv.k_pages.shape[0] == 0 and cache.gdn.ssm_state.shape[0] == 2
    logits, cache = m.prefill(cache, np.arange(40, dtype=np.int32) % 61, np.array([0, 40], np.int32),
                              np.array([1], np.int32))
    assert logits.shape == (1, 61) and np.all(np.isfinite(np.asarray(logits)))
    np.testing.assert_array_equal(np.asarray(cache.slot_lens), [0, 40])


def test_strict_refusal_leaves_the_callers_cache_live(model):
    """strict=True decides each step on the host before the donating call: a refused prefill or decode raises
    without running, so the cache passed in (never donated) is still live and unchanged even when the caller
    drops ``err.cache``; the caller carries on with it."""
    from jax_gdn import HybridModel
    strict = HybridModel(CFG, model.params, dtype=jnp.float32, backend="xla", strict=True)
    cache = strict.init_cache(max_seqs=2, max_tokens=32, page_size=8, max_seq_len=24)
    _, cache = strict.prefill(cache, np.arange(20, dtype=np.int32), np.array([0, 20], np.int32), [0])
    before = _snapshot(cache)
    with pytest.raises(OutOfKvPagesError, match="out of KV pages.*before it ran"):
        strict.prefill(cache, np.arange(20, dtype=np.int32), np.array([0, 20], np.int32), [1])
    for x, y in zip(before, _snapshot(cache)):                                          # live, unchanged
        np.testing.assert_array_equal(x, y)
    for _ in range(4):
        _, cache = strict.decode(cache, np.array([3], np.int32), [0])                  # tokens 21 .. 24
    before = _snapshot(cache)
    with pytest.raises(OutOfKvPagesError, match="max_seq_len"):
        strict.decode(cache, np.array([3], np.int32), [0])                              # token 25 > 24
    for x, y in zip(before, _snapshot(cache)):                                          # live, unchanged
        np.testing.assert_array_equal(x, y)
    assert int(cache.status) == 0
    cache = strict.release(cache, [0])
    logits, cache = strict.prefill(cache, np.arange(20, dtype=np.int32), np.array([0, 20], np.int32), [1])
    assert np.all(np.isfinite(np.asarray(logits))) and np.any(np.asarray(logits) != 0)
    np.testing.assert_array_equal(np.asarray(cache.slot_lens), [0, 20])


def test_max_seq_len_is_exact_not_whole_pages(model):
    """max_seq_len=20 with 16-token pages: a slot holds 20 tokens, never 21 (the pages would hold 32). The
    refused step writes nothing to any stream and returns zero logits (status 2, sticky until check), through the
    model's methods and through the pure step under a jit of one's own."""
    cache = model.init_cache(max_seqs=2, max_tokens=128, page_size=16, max_seq_len=20)
    assert cache.seq_len_limit == 20
    _, cache = model.prefill(cache, np.arange(25, dtype=np.int32), np.array([0, 20, 25], np.int32), [0, 1])
    assert int(cache.status) == 0
    before = _snapshot(cache)
    logits, cache = model.decode(cache, np.array([1, 2], np.int32), [1, 0])             # slot 0: token 21
    assert int(cache.status) == 2 and np.all(np.asarray(logits) == 0)
    for x, y in zip(before, _snapshot(cache)):                                          # slot 1 untouched too
        np.testing.assert_array_equal(x, y)
    with pytest.raises(OutOfKvPagesError, match=r"max_seq_len \(20 tokens per slot\)") as err:
        model.check(cache)
    cache = err.value.cache
    _, cache = model.decode(cache, np.array([1], np.int32), [1])                        # slot 1: token 6 fits
    assert int(cache.status) == 0
    np.testing.assert_array_equal(np.asarray(cache.slot_lens), [20, 6])

    # the pure step under jax.jit: inputs padded by hand (T 32, N 2), a fresh cache
    step = jax.jit(model.step_fn(), donate_argnums=(1,))
    ids = jnp.asarray(np.arange(32, dtype=np.int32) % 61)
    for lens, want in (((21, 5), 2), ((20, 5), 0)):
        fresh = model.init_cache(max_seqs=2, max_tokens=128, page_size=16, max_seq_len=20)
        cu = jnp.asarray(np.cumsum([0, *lens]).astype(np.int32))
        logits, out = step(model.params, fresh, ids, cu, jnp.asarray([0, 1], jnp.int32))
        assert int(out.status) == want
        if want:
            assert np.all(np.asarray(logits) == 0)
            np.testing.assert_array_equal(np.asarray(out.slot_lens), [0, 0])
            assert np.all(np.asarray(out.page_refs) == 0)
        else:
            np.testing.assert_array_equal(np.asarray(out.slot_lens), [20, 5])


def test_traced_methods_raise_naming_the_method_and_the_pure_step(model):
    """jax.jit(model.prefill) (or decode, release, check) raises a TypeError naming the method and what to use
    instead, not JAX's generic conversion error; model.step_fn() under jax.jit gives the method's logits."""
    cache = model.init_cache(max_seqs=2, max_tokens=64, page_size=8)
    ids, cu, sl = np.arange(6, dtype=np.int32), np.array([0, 2, 6], np.int32), np.array([1, 0], np.int32)
    with pytest.raises(TypeError, match=r"HybridModel\.prefill .*traced.*model\.step_fn\(\)"):
        jax.jit(model.prefill)(cache, ids, cu, sl)
    with pytest.raises(TypeError, match=r"HybridModel\.decode .*step_fn"):
        jax.jit(model.decode)(cache, ids[:2], sl)
    with pytest.raises(TypeError, match=r"HybridModel\.release .*release_slots"):
        jax.jit(model.release)(cache, sl)
    with pytest.raises(TypeError, match=r"HybridModel\.check"):
        jax.jit(model.check)(cache)
    want, _ = model.prefill(cache, ids, cu, sl, return_all_logits=True)
    ids_p = jnp.asarray(np.concatenate([ids, np.zeros(10, np.int32)]))                 # T bucket 16
    got, _ = jax.jit(model.step_fn(return_all_logits=True))(model.params, model.init_cache(
        max_seqs=2, max_tokens=64, page_size=8), ids_p, jnp.asarray(cu), jnp.asarray(sl))
    np.testing.assert_allclose(np.asarray(got)[:6], np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="return_all_logits"):
        model.step_fn(decode=True, return_all_logits=True)
