"""The model runtime: one compiled program per shape bucket whatever the lengths (200 random serving steps compile
nothing once the buckets are warm), bucket padding changes no result and touches no other slot, the layer plan
(scan over the repeating period), init_params, and the backend registry resolved once at construction."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn import HybridConfig, HybridModel
from jax_gdn.checkpoint import params_from_state_dict, random_state_dict
from jax_gdn.model import init_params, layer_plan
from jax_gdn.options import RuntimeOptions

# 2 layers, dense FFN, tiny dims: cheap to compile (CI runs every program below on 2 shared cores)
CFG = HybridConfig(model_type="qwen3_next", vocab_size=37, hidden_size=16, num_hidden_layers=2,
                   layer_types=("linear_attention", "full_attention"), intermediate_size=16,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5,
                   linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


@pytest.fixture(scope="module")
def params():
    return params_from_state_dict(CFG, random_state_dict(CFG, seed=3), jnp.float32)


def test_serving_loop_compiles_once_per_bucket(params):
    """Warm every bucket (prefill T in {16, 32} x N in {1, 2}, decode N in {1, 2}, release N in {1, 2}: 8
    programs), then 200 random prefill / decode / release steps with random lengths and slots: zero new programs,
    and the cache stays consistent (slot lengths as tracked on the host, status 0)."""
    model = HybridModel(CFG, params, dtype=jnp.float32, backend="xla")
    s = 2
    cache = model.init_cache(max_seqs=s, max_tokens=512, page_size=8, max_seq_len=256)
    for t in (16, 32):
        for n in (1, 2):
            _, cache = model.prefill(cache, np.zeros(t, np.int32), np.linspace(0, t, n + 1).astype(np.int32),
                                     np.arange(n, dtype=np.int32))
    for n in (1, 2):
        _, cache = model.decode(cache, np.zeros(n, np.int32), np.arange(n, dtype=np.int32))
        cache = model.release(cache, np.arange(n, dtype=np.int32))
    warm = model.compiled_programs()
    assert warm == 8

    rng = np.random.default_rng(0)
    lens = np.zeros(s, np.int64)
    for _ in range(200):
        active = np.flatnonzero(lens > 0)
        op = rng.integers(3)
        if op == 0 or not len(active):                       # prefill 1-2 streams (new or continuing)
            n = int(rng.integers(1, s + 1))
            slots = rng.permutation(s)[:n]
            if np.any(lens[slots] > 200):
                cache = model.release(cache, slots)
                lens[slots] = 0
            seg = rng.integers(1, 32 // n + 1, n)
            ids = rng.integers(0, CFG.vocab_size, int(seg.sum())).astype(np.int32)
            logits, cache = model.prefill(cache, ids, np.cumsum([0, *seg]).astype(np.int32), slots)
            assert logits.shape == (n, CFG.vocab_size)
            lens[slots] += seg
        elif op == 1:                                        # decode the active slots
            slots = rng.permutation(active)
            slots = slots[lens[slots] < 256]
            if len(slots):
                logits, cache = model.decode(cache, rng.integers(0, CFG.vocab_size, len(slots)), slots)
                lens[slots] += 1
        else:                                                # release one active slot
            slot = rng.choice(active, 1)
            cache = model.release(cache, slot)
            lens[slot] = 0
    assert model.compiled_programs() == warm                 # nothing compiled once warm
    np.testing.assert_array_equal(np.asarray(cache.slot_lens), lens)
    model.check(cache)
    assert np.all(np.isfinite(np.asarray(logits)))


def test_cache_is_donated_and_updated_in_place(params):
    """prefill / decode / release donate the cache: the buffers passed in are consumed (no copy of the pools per
    step; XLA aliases them to the returned cache)."""
    model = HybridModel(CFG, params, dtype=jnp.float32, backend="xla")
    cache = model.init_cache(max_seqs=2, max_tokens=64, page_size=8)
    old = cache
    _, cache = model.prefill(cache, np.arange(5, dtype=np.int32), np.array([0, 5], np.int32), [1])
    assert old.gdn.ssm_state.is_deleted() and old.kv.k_pages.is_deleted()
    old = cache
    _, cache = model.decode(cache, np.array([2], np.int32), [1])
    assert old.gdn.conv_state.is_deleted() and old.slot_lens.is_deleted()
    old = cache
    cache = model.release(cache, [1])
    assert old.page_refs.is_deleted() and int(cache.slot_lens[1]) == 0


def test_bucket_padding_changes_nothing_and_touches_no_other_slot(params):
    """The same 3 streams (1, 5, 19 tokens, permuted slots) through a model that pads nothing (exact token
    buckets, max_seqs = N = 3) and one that pads to T = 32, N = 4 with slot 3 poisoned with NaN: equal logits
    (prefill every token, then a decode step), equal states, slot 3 left exactly as it was."""
    lens, slots = [1, 5, 19], np.array([2, 0, 1], np.int32)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, CFG.vocab_size, sum(lens)).astype(np.int32)
    cu = np.cumsum([0] + lens).astype(np.int32)
    nxt = rng.integers(0, CFG.vocab_size, 3).astype(np.int32)

    exact = HybridModel(CFG, params, dtype=jnp.float32, backend="xla", token_buckets=(25,))
    cache = exact.init_cache(max_seqs=3, max_tokens=128, page_size=8)
    ref_p, cache = exact.prefill(cache, ids, cu, slots, return_all_logits=True)
    ref_d, ref_cache = exact.decode(cache, nxt, slots)

    padded = HybridModel(CFG, params, dtype=jnp.float32, backend="xla")
    cache = padded.init_cache(max_seqs=4, max_tokens=128, page_size=8)
    nan = jnp.float32(jnp.nan)
    cache = cache.replace(gdn=jax.tree.map(lambda a: a.at[:, 3].set(nan), cache.gdn))
    got_p, cache = padded.prefill(cache, ids, cu, slots, return_all_logits=True)
    got_d, cache = padded.decode(cache, nxt, slots)

    assert got_p.shape == (sum(lens), CFG.vocab_size) and got_d.shape == (3, CFG.vocab_size)
    np.testing.assert_allclose(np.asarray(got_p), np.asarray(ref_p), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_d), np.asarray(ref_d), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(cache.gdn), jax.tree.leaves(ref_cache.gdn)):
        np.testing.assert_allclose(np.asarray(a)[:, :3], np.asarray(b), rtol=1e-5, atol=1e-5)
        assert np.all(np.isnan(np.asarray(a)[:, 3]))        # the padding stream (slot id S = 4) touched nothing
    np.testing.assert_array_equal(np.asarray(cache.slot_lens), [6, 20, 2, 0])
    assert padded.compiled_programs() == 2 and exact.compiled_programs() == 2


def test_per_layer_state_path_equals_flat_pools(params):
    """Pools too large for the kernels to address as one flat array (RuntimeOptions.flat_pool_limit) run per layer
    (slice / update): the same logits and states as the flat-pool path (kernels in interpret mode; prefill with
    padding, then decode)."""
    ids, cu, slots = np.arange(11, dtype=np.int32) % 37, np.array([0, 4, 11], np.int32), np.array([1, 0], np.int32)
    outs = []
    for limit in (RuntimeOptions().flat_pool_limit, 0):
        m = HybridModel(CFG, params, dtype=jnp.float32, backend="pallas_interpret",
                        options=RuntimeOptions(flat_pool_limit=limit))
        cache = m.init_cache(max_seqs=3, max_tokens=64, page_size=8)
        a, cache = m.prefill(cache, ids, cu, slots, return_all_logits=True)
        b, cache = m.decode(cache, ids[:2], slots)
        outs.append([np.asarray(x) for x in (a, b, cache.gdn.ssm_state, cache.kv.k_pages)])
    for x, y in zip(*outs):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_layer_plan_and_stacked_init_params():
    """Qwen3-Next's pattern (3 GDN + 1 attention) at 10 layers: a scan of 2 x 4 and a tail of 2; init_params
    makes that layout directly (leaves [R, ...]) with neutral norms; the model runs it."""
    types = ("linear_attention",) * 3 + ("full_attention",)
    cfg = dataclasses.replace(CFG, num_hidden_layers=10, layer_types=(types * 3)[:10])
    plan = layer_plan(cfg)
    assert (plan.period, plan.repeats, plan.tail) == (4, 2, (8, 9))
    p = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    assert len(p["period"]) == 4 and len(p["tail"]) == 2
    out_proj = p["period"][0]["mixer"]["out_proj"]
    assert out_proj.shape[0] == 2 and out_proj.dtype == jnp.bfloat16
    assert p["period"][3]["mixer"]["q_proj"].shape == (2, 16, 2 * 2 * 8)
    assert float(jnp.max(jnp.abs(p["period"][0]["input_norm"]))) == 0.0 and p["final_norm"].dtype == jnp.float32
    w = np.asarray(p["period"][0]["ffn"]["gate_proj"], np.float32)
    assert 0.015 < w.std() < 0.025
    model = HybridModel.random(cfg, 0, dtype=jnp.float32, backend="xla")
    cache = model.init_cache(max_seqs=2, max_tokens=64, page_size=8)
    assert cache.gdn.ssm_state.shape[0] == 8 and cache.kv.k_pages.shape[0] == 2
    logits, cache = model.prefill(cache, np.arange(7, dtype=np.int32), np.array([0, 3, 7], np.int32), [1, 0])
    assert np.all(np.isfinite(np.asarray(logits))) and "scan of 2 x 4 + 2" in repr(model)


def test_scan_unroll_same_logits_and_bad_values_named():
    """scan_unroll (the layer scan's unroll per program) changes no result: a 9-layer model (scan of 2 x 4 + a
    tail) with the scan unrolled (prefill by 2, decode fully) gives the rolled model's logits and states (fp32, xla,
    within 1e-4 relative); the default is rolled prefill, decode by 2; a bad value is refused naming scan_unroll."""
    types = ("linear_attention",) * 3 + ("full_attention",)
    cfg = dataclasses.replace(CFG, num_hidden_layers=9, layer_types=(types * 3)[:9])
    p = init_params(cfg, jax.random.PRNGKey(1), jnp.float32, std=0.2)
    ids, cu, slots = np.arange(11, dtype=np.int32) % 37, np.array([0, 4, 11], np.int32), np.array([1, 0], np.int32)
    outs = []
    for unroll in (1, {"prefill": 2, "decode": True}):
        m = HybridModel(cfg, p, dtype=jnp.float32, backend="xla", scan_unroll=unroll)
        cache = m.init_cache(max_seqs=3, max_tokens=64, page_size=8)
        a, cache = m.prefill(cache, ids, cu, slots)
        b, cache = m.decode(cache, ids[:2], slots)
        outs.append([np.asarray(x) for x in (a, b, cache.gdn.ssm_state, cache.kv.k_pages)])
    for x, y in zip(*outs):          # fp32; unrolled, XLA fuses differently: rounding-level differences only
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    assert HybridModel(cfg, p, dtype=jnp.float32, backend="xla").scan_unroll == {"prefill": 1, "decode": 2}
    for bad in (0, "2", {"decode": 1}):
        with pytest.raises(ValueError, match="scan_unroll"):
            HybridModel(cfg, p, dtype=jnp.float32, backend="xla", scan_unroll=bad)


def test_backend_resolved_once_with_reasons():
    """auto -> xla on CPU for every op; pallas_interpret names the GDN kernel; an explicit backend that cannot run
    the dims or platform is refused at construction with the registry's reason."""
    m = HybridModel.random(CFG, 0, dtype=jnp.float32, backend="auto")
    assert m.backends.gated_delta_rule == "auto"                     # the name the layers pass to the ops
    if jax.default_backend() != "gpu":
        assert {impl for calls in m.kernels.values() for impl in calls.values()} == {"xla"}
        assert "gdn=auto [slots: xla" in repr(m)
    m = HybridModel.random(CFG, 0, dtype=jnp.float32, backend="pallas_interpret")
    assert m.backends.gated_delta_rule == "pallas_interpret" and "gdn=pallas_interpret" in repr(m)
    assert m.backends.paged_attention == "pallas_interpret"          # every kernel in interpret mode (CPU CI)
    assert HybridModel.random(dataclasses.replace(CFG, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
                              0, dtype=jnp.float32, backend="pallas_interpret").backends.moe == "pallas_interpret"
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="backend 'pallas' cannot run gated_delta_rule here.*needs a GPU"):
            HybridModel.random(CFG, 0, dtype=jnp.float32, backend="pallas")
    with pytest.raises(ValueError, match="backend must be one of"):
        HybridModel.random(CFG, 0, dtype=jnp.float32, backend="triton")
    with pytest.raises(ValueError, match="unknown op"):
        HybridModel.random(CFG, 0, dtype=jnp.float32, backend={"attention": "xla"})


def test_registry_supports_and_missing_modules():
    from pallas_kernels import registry
    case = dict(platform="gpu", dtype=jnp.bfloat16, head_k_dim=96, head_v_dim=128, num_k_heads=2, num_v_heads=4)
    assert "head dims K (got 256)" in registry.supports("gated_delta_rule", "pallas", **dict(case, head_k_dim=256))
    assert registry.resolve("gated_delta_rule", "auto", **dict(case, head_k_dim=256)) == "xla"
    assert registry.resolve("gated_delta_rule", "auto", **case) == "triton.chunk"   # K = 96 zero-padded to 128
    assert registry.supports("gated_delta_rule", "pallas", **dict(case, head_k_dim=128)) is None
    assert registry.supports("gated_delta_rule", "pallas_interpret", **dict(case, platform="cpu")) is None
    assert registry.resolve("moe", "auto", platform="cpu", dtype=jnp.float32, num_experts=4, hidden=8,
                            inter=4) == "xla"
    assert "no implementation 'cuda'" in registry.supports("moe", "cuda")
    with pytest.raises(ValueError, match="unknown op"):
        registry.resolve("conv", "auto")


def test_runtime_options_validated_held_and_passed_down(params):
    """RuntimeOptions refuses bad values naming the field; the model holds its options (scan_unroll applied) and
    its blocks run them: other implementations of the same math give the default's logits (fp32, xla), and
    hold_fused_qkv=False keeps the three projection weights."""
    for bad, field in ((dict(phase1_conv="fast"), "phase1_conv"), (dict(gdn_decode_step=1), "gdn_decode_step"),
                       (dict(hold_fused_qkv=1), "hold_fused_qkv"), (dict(qkv_concat_min_tokens=-1),
                                                                     "qkv_concat_min_tokens"),
                       (dict(flat_pool_limit=1.5), "flat_pool_limit"), (dict(scan_unroll_decode=0),
                                                                         "scan_unroll_decode")):
        with pytest.raises(ValueError, match=f"RuntimeOptions.{field}"):
            RuntimeOptions(**bad)
    with pytest.raises(ValueError, match="options must be"):
        HybridModel(CFG, params, dtype=jnp.float32, backend="xla", options={"phase1_conv": "fused"})
    m = HybridModel(CFG, params, dtype=jnp.float32, backend="xla", scan_unroll=3,
                    options=RuntimeOptions(scan_unroll_prefill=2))
    assert m.options == RuntimeOptions(scan_unroll_prefill=3, scan_unroll_decode=3)
    assert m.scan_unroll == {"prefill": 3, "decode": 3}
    ids, cu, slots = np.arange(11, dtype=np.int32) % 37, np.array([0, 4, 11], np.int32), np.array([1, 0], np.int32)
    outs = []
    for opts in (None, RuntimeOptions(hold_fused_qkv=False, qkv_concat_min_tokens=0, kv_write_unique=False,
                                      phase1_conv="fused")):
        m = HybridModel(CFG, params, dtype=jnp.float32, backend="xla", options=opts)
        assert ("qkv_proj" in m.params["period"][1]["mixer"]) == (opts is None)
        cache = m.init_cache(max_seqs=3, max_tokens=64, page_size=8)
        a, cache = m.prefill(cache, ids, cu, slots, return_all_logits=True)
        b, cache = m.decode(cache, ids[:2], slots)
        outs.append([np.asarray(x) for x in (a, b, cache.gdn.ssm_state, cache.kv.k_pages)])
    for x, y in zip(*outs):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
