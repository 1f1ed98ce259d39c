"""The configs and random models of the whole-model sections (benchmarks.model, benchmarks.sharding).

The real dims come from the library's ``qwen3_next_80b`` preset (``jax_gdn.config.PRESETS``); ``tiny_config`` is the
quick CPU stand-in with the same layer pattern and MoE structure.
"""
from __future__ import annotations

#: layers of the model section's rows (2 x (3 GDN + 1 attention))
LAYERS = 8


def qwen3_next_80b_config(num_layers: int = LAYERS):
    """The ``qwen3_next_80b`` preset with ``num_layers`` layers of its 3 GDN + 1 attention pattern."""
    from jax_gdn.config import preset
    return preset("qwen3_next_80b", num_hidden_layers=num_layers)


def tiny_config(num_layers: int = LAYERS):
    """The quick (CPU) stand-in: the same layer pattern and MoE structure at tiny dims."""
    import dataclasses
    return dataclasses.replace(
        qwen3_next_80b_config(num_layers), vocab_size=97, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16)


def random_device_model(config, dtype=None, backend="auto", seed: int = 0):
    """A HybridModel with random weights made on the default device (``init_params`` in one jitted program: no
    host copy, no per-leaf dispatch)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax_gdn.model import HybridModel, init_params
    dtype = dtype or jnp.bfloat16
    params = jax.jit(functools.partial(init_params, config, dtype=dtype))(jax.random.PRNGKey(seed))
    return HybridModel(config, params, dtype=dtype, backend=backend)


def check_config(quick: bool = False):
    """The GPU check's config: 2 layers, one GDN and one attention, at 80B dims (tiny dims when ``quick``)."""
    import dataclasses
    cfg = (tiny_config if quick else qwen3_next_80b_config)(2)
    return dataclasses.replace(cfg, layer_types=("linear_attention", "full_attention"))
