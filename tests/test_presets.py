"""Named model presets (jax_gdn.config.PRESETS / preset): the real models' dims, overrides, refusals."""
import pytest

import jax_gdn
from jax_gdn.config import PRESETS, HybridConfig, preset


def test_every_preset_builds_a_valid_config():
    assert sorted(PRESETS) == ["qwen3_5_35b_a3b", "qwen3_next_80b", "tiny"]
    for name in PRESETS:
        cfg = preset(name)
        assert isinstance(cfg, HybridConfig) and cfg.layer_types[3] == "full_attention", name
    assert jax_gdn.preset is preset


def test_qwen3_next_80b_dims():
    c = preset("qwen3_next_80b")
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (48, 2048, 151936)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.partial_rotary_factor) == (16, 2, 256, 0.25)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size) == (512, 10, 512, 512)
    assert len(c.gdn_layers) == 36 and len(c.attn_layers) == 12 and c.gdn_layout == "qwen3_next"
    assert all(c.layer_is_moe(i) for i in range(48))


def test_qwen3_5_35b_a3b_dims():
    c = preset("qwen3_5_35b_a3b")
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (40, 2048, 248320)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert c.gdn_layout == "qwen3_5" and all(c.layer_is_moe(i) for i in range(40))


def test_presets_match_transformers_configs():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "shared_expert_intermediate_size", "rms_norm_eps")
    for name, hf in (("qwen3_next_80b", transformers.Qwen3NextConfig()), ("qwen3_5_35b_a3b", Qwen3_5MoeTextConfig())):
        ours = preset(name)
        assert {f: getattr(ours, f) for f in fields} == {f: getattr(hf, f) for f in fields}, name
        assert list(ours.layer_types) == list(hf.layer_types), name


def test_overrides_and_depth():
    c = preset("qwen3_next_80b", num_hidden_layers=8)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert preset("tiny", num_hidden_layers=1).mlp_only_layers == ()          # layer 1's dense MLP is past the end
    assert preset("tiny", vocab_size=97).vocab_size == 97
    two = preset("tiny", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    assert two.attn_layers == (1,)


def test_refusals():
    with pytest.raises(ValueError, match=r"unknown preset 'qwen'.*\['qwen3_5_35b_a3b', 'qwen3_next_80b', 'tiny'\]"):
        preset("qwen")
    with pytest.raises(ValueError, match="unknown HybridConfig field"):
        preset("tiny", hidden=3)
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive int"):
        preset("tiny", num_hidden_layers=0)
    with pytest.raises(ValueError, match="num_v_heads .* multiple of"):
        preset("tiny", linear_num_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        preset("tiny", hidden_size=0)
    with pytest.raises(ValueError, match="intermediate_size must be positive"):
        preset("tiny", intermediate_size=0)                                  # layer 1 is a dense MLP
