"""The configs and random models of the whole-model sections (benchmarks.model, benchmarks.serving,
benchmarks.sharding).

The real dims come from the library's presets (``jax_gdn.config.PRESETS``): ``qwen3_next_80b`` at 8 layers (the
"model" section) and ``qwen3_5_35b_a3b`` at its full 40 layers (``MODEL_DIMS``); ``tiny_config`` is the quick CPU
stand-in of either, with the same layer pattern, layout and MoE structure.
"""
from __future__ import annotations

#: layers of the model section's rows (2 x (3 GDN + 1 attention))
LAYERS = 8
#: the whole-model sections' dims: preset name -> the depth their rows run at (Qwen3-Next-80B at 8 of its 48
#: layers; Qwen3.5-35B-A3B at all 40 of its layers, which fit one H200 in bf16)
MODEL_DIMS = {"qwen3_next_80b": LAYERS, "qwen3_5_35b_a3b": 40}


def model_config(dims: str = "qwen3_next_80b", num_layers: int = None):
    """The preset ``dims`` (a key of ``MODEL_DIMS``) at ``num_layers`` (default: its ``MODEL_DIMS`` depth) of its
    3 GDN + 1 attention pattern; ValueError naming ``dims`` for any other name."""
    from jax_gdn.config import preset
    if dims not in MODEL_DIMS:
        raise ValueError(f"dims must be one of {sorted(MODEL_DIMS)}, got {dims!r}")
    return preset(dims, num_hidden_layers=MODEL_DIMS[dims] if num_layers is None else num_layers)


def qwen3_next_80b_config(num_layers: int = LAYERS):
    """The ``qwen3_next_80b`` preset with ``num_layers`` layers of its 3 GDN + 1 attention pattern."""
    from jax_gdn.config import preset
    return preset("qwen3_next_80b", num_hidden_layers=num_layers)


def tiny_config(num_layers: int = LAYERS, dims: str = "qwen3_next_80b"):
    """The quick (CPU) stand-in of ``dims``: the same layer pattern, layout and MoE structure at tiny dims."""
    import dataclasses
    return dataclasses.replace(
        model_config(dims, num_layers), vocab_size=97, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16)


#: parameter bytes above which ``random_device_model`` makes each leaf in its own program: one program making every
#: leaf plans temporaries for the random bits beside the weights (XLA on the CPU plans 4x the weights' bytes for
#: Qwen3.5-35B-A3B's 65 GiB), which a model of half the GPU's memory cannot afford
LEAFWISE_BYTES = 32 << 30


def random_device_model(config, dtype=None, backend="auto", seed: int = 0, leafwise: bool = None):
    """A HybridModel with random weights made on the default device (no host copy): ``init_params`` in one jitted
    program, or with ``leafwise`` (default: when the weights exceed ``LEAFWISE_BYTES``) each leaf by its own
    program (``jax_gdn.model._random_leaf``, the same distribution per leaf name as ``init_params``; another
    random stream), so that the temporaries of one leaf only are ever live."""
    import functools
    import math

    import jax
    import jax.numpy as jnp
    from jax_gdn.model import HybridModel, _random_leaf, init_params
    dtype = dtype or jnp.bfloat16
    init = functools.partial(init_params, config, dtype=dtype)
    key = jax.random.PRNGKey(seed)
    shapes = jax.eval_shape(init, key)
    if leafwise is None:
        leafwise = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)) > LEAFWISE_BYTES
    if not leafwise:
        return HybridModel(config, jax.jit(init)(key), dtype=dtype, backend=backend)
    make = jax.jit(_random_leaf, static_argnums=(1, 2, 3, 4, 5))
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = []
    for i, (path, x) in enumerate(paths):
        name = path[-1].key                               # the leaf's name in its dict: what _random_leaf reads
        leaves.append(make(jax.random.fold_in(key, i), name, tuple(x.shape), dtype, 0.02,
                           config.linear_conv_kernel_dim))
    return HybridModel(config, jax.tree_util.tree_unflatten(treedef, leaves), dtype=dtype, backend=backend)


def check_config(quick: bool = False, dims: str = "qwen3_next_80b"):
    """The GPU check's config: 2 layers, one GDN and one attention, at ``dims`` (tiny dims when ``quick``)."""
    import dataclasses
    cfg = tiny_config(2, dims) if quick else model_config(dims, 2)
    return dataclasses.replace(cfg, layer_types=("linear_attention", "full_attention"))
