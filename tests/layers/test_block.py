"""The block contract (jax_gdn.layers.block): ``(params, x, layer_state, batch) -> (x, layer_state)`` owns both
pre-norms and both residual adds, for the GDN and the attention mixer alike: checked against the layers composed by
hand (the GDN layer's own prefill / decode with an FFN hook; attention_layer + rms_norm + swiglu), and zeroed
output projections make a block the identity on x."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn import HybridConfig
from jax_gdn.layers import block as blk
from jax_gdn.layers import gdn
from jax_gdn.layers.attention import attention_layer
from jax_gdn.layers.ffn import swiglu_mlp
from jax_gdn.model import init_params
from jax_gdn.ops.norms import rms_norm
from jax_gdn.state import BatchMeta, GdnSlots, KvPages

CFG = HybridConfig(model_type="qwen3_5_text", vocab_size=11, hidden_size=16, num_hidden_layers=2,
                   layer_types=("linear_attention", "full_attention"), intermediate_size=24,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
BACK = blk.Backends()


def _blocks(std=0.3):
    p = init_params(CFG, jax.random.PRNGKey(0), jnp.float32, std=std)
    one = jax.tree.map(lambda a: a[0], p["period"])           # R = 1: drop the stack axis
    key = jax.random.PRNGKey(5)
    norms = lambda b: {**b, "input_norm": 0.2 * jax.random.normal(key, b["input_norm"].shape),   # noqa: E731
                       "post_norm": -0.1 * jax.random.normal(key, b["post_norm"].shape)}
    return norms(one[0]), norms(one[1])


def _batch(lens, slots, decode=False, pages=4, ps=4):
    meta = BatchMeta.from_lengths(lens, slot_ids=slots)
    t = sum(lens)
    cu = np.cumsum([0] + list(lens))
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    stream = np.repeat(np.arange(len(lens)), lens)
    s = max(slots) + 1
    table = np.arange(s * pages, dtype=np.int32).reshape(s, pages)
    slot_lens = np.zeros(s, np.int32)
    slot_lens[list(slots)] = lens
    page = table[np.asarray(slots)[stream], pos // ps]
    assert cu[-1] == t
    return blk.Batch(meta=meta, token_pos=jnp.asarray(pos), token_page=jnp.asarray(page),
                     token_offset=jnp.asarray(pos % ps), page_table=jnp.asarray(table),
                     slot_lens=jnp.asarray(slot_lens), decode=decode)


def _x(t, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (t, CFG.hidden_size), jnp.float32)


def test_gdn_block_is_the_gdn_layer_with_norms_and_residuals():
    g, _ = _blocks()
    batch = _batch([3, 9], [1, 0])
    x = _x(12)
    state = GdnSlots.zeros(CFG.gdn_dims, 2)
    got, st = blk.block(blk.BlockKind("gdn", False), g, x, state, batch, config=CFG, backends=BACK)
    mixer = dict(g["mixer"], input_layernorm=g["input_norm"])

    def hook(h):
        return h + swiglu_mlp(g["ffn"], rms_norm(h, g["post_norm"], CFG.rms_norm_eps))
    ref, st_ref = gdn.gdn_layer_prefill(mixer, CFG.gdn_dims, x, state, batch.meta, backend="xla", ffn=hook)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.ssm_state), np.asarray(st_ref.ssm_state), rtol=1e-5, atol=1e-6)
    # decode: the GDN layer's recurrent step, same hook
    dec = dataclasses.replace(batch, meta=BatchMeta.from_lengths([1, 1], slot_ids=[1, 0], positions=[3, 9]),
                              decode=True)
    got_d, _ = blk.block(blk.BlockKind("gdn", False), g, x[:2], st, dec, config=CFG, backends=BACK)
    ref_d, _ = gdn.gdn_layer_decode(mixer, CFG.gdn_dims, x[:2], st, jnp.array([1, 0]), ffn=hook)
    np.testing.assert_allclose(np.asarray(got_d), np.asarray(ref_d), rtol=1e-5, atol=1e-5)


def test_attention_block_is_attention_with_norms_and_residuals():
    _, a = _blocks()
    batch = _batch([5, 2], [0, 1])
    x = _x(7, seed=2)
    kv = KvPages.zeros(8, 4, CFG.num_key_value_heads, CFG.head_dim)
    got, kv_got = blk.block(blk.BlockKind("attention", False), a, x, kv, batch, config=CFG, backends=BACK)
    h, kv_ref = attention_layer(a["mixer"], CFG.attn_dims, rms_norm(x, a["input_norm"], CFG.rms_norm_eps), kv,
                                token_pos=batch.token_pos, token_page=batch.token_page,
                                token_offset=batch.token_offset, page_table=batch.page_table,
                                slot_lens=batch.slot_lens, cu_seqlens=batch.meta.cu_seqlens,
                                slot_ids=batch.meta.slot_ids)
    h = x + h
    ref = h + swiglu_mlp(a["ffn"], rms_norm(h, a["post_norm"], CFG.rms_norm_eps))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(kv_got.k_pages), np.asarray(kv_ref.k_pages))


@pytest.mark.parametrize("mixer", ["gdn", "attention"])
def test_zero_output_projections_make_the_block_the_identity(mixer):
    """With the mixer's output projection and the FFN's down projection zeroed, x passes through unchanged: the
    residuals are the block's (one add each), not the mixer's."""
    g, a = _blocks()
    p = g if mixer == "gdn" else a
    out_name = "out_proj" if mixer == "gdn" else "o_proj"
    p = {**p, "mixer": {**p["mixer"], out_name: jnp.zeros_like(p["mixer"][out_name])},
         "ffn": {**p["ffn"], "down_proj": jnp.zeros_like(p["ffn"]["down_proj"])}}
    batch = _batch([4], [0])
    x = _x(4, seed=3)
    state = GdnSlots.zeros(CFG.gdn_dims, 1) if mixer == "gdn" else KvPages.zeros(4, 4, 2, 8)
    got, _ = blk.block(blk.BlockKind(mixer, False), p, x, state, batch, config=CFG, backends=BACK)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


def test_gdn_mixer_is_the_one_composition_of_the_layer():
    """gdn_layer_prefill / gdn_layer_decode are ``hidden + mixer(rmsnorm(hidden))`` with the same gdn_mixer /
    gdn_mixer_decode the block runs (bitwise, eager), and phase3 is ``residual + gdn_output``; the mixer takes the
    block's mixer params (no input_layernorm) or the layer's (input_layernorm ignored)."""
    g, _ = _blocks()
    dims = CFG.gdn_dims
    meta = BatchMeta.from_lengths([3, 9], slot_ids=[1, 0])
    x = _x(12)
    state = GdnSlots.zeros(dims, 2)
    layer = dict(g["mixer"], input_layernorm=g["input_norm"])
    h = rms_norm(x, g["input_norm"], CFG.rms_norm_eps)
    y, st = gdn.gdn_mixer(g["mixer"], dims, h, state, meta, backend="xla")
    y2, _ = gdn.gdn_mixer(layer, dims, h, state, meta, backend="xla")
    out, st_l = gdn.gdn_layer_prefill(layer, dims, x, state, meta, backend="xla")
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x + y))
    np.testing.assert_array_equal(np.asarray(st_l.ssm_state), np.asarray(st.ssm_state))

    p1 = gdn.phase1_proj_batched(layer, dims, x)
    q, k, v, s1 = gdn.phase1_conv_l2(layer, dims, p1, state, meta, conv="two_step")
    o, _, ok = gdn.gdn_full_varlen(q, k, v, p1.g, p1.beta, s1, meta, backend="xla")
    assert ok
    np.testing.assert_array_equal(np.asarray(gdn.phase3(layer, dims, o, p1.z, x)),
                                  np.asarray(x + gdn.gdn_output(layer, dims, o, p1.z, x.dtype)))

    xd = x[:2]
    yd, _ = gdn.gdn_mixer_decode(g["mixer"], dims, rms_norm(xd, g["input_norm"], CFG.rms_norm_eps), st,
                                 jnp.array([1, 0]), backend="xla")
    outd, _ = gdn.gdn_layer_decode(layer, dims, xd, st, jnp.array([1, 0]), backend="xla")
    np.testing.assert_array_equal(np.asarray(outd), np.asarray(xd + yd))
    with pytest.raises(ValueError, match="missing"):
        gdn.gdn_mixer({k: v for k, v in g["mixer"].items() if k != "out_proj"}, dims, h, state, meta)
