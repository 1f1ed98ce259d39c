"""jax-gdn: hybrid Gated DeltaNet + attention language models (Qwen3-Next, Qwen3.5) in JAX.

    import jax_gdn
    model = jax_gdn.load_pretrained(path, dtype=jnp.bfloat16)          # a HF checkpoint directory
    model = jax_gdn.HybridModel.random(jax_gdn.preset("tiny"), 0)      # or random weights for a preset
    cache = model.init_cache(max_seqs=8, max_tokens=4096, page_size=16)
    logits, cache = model.prefill(cache, input_ids, cu_seqlens, slot_ids)
    logits, cache = model.decode(cache, input_ids, slot_ids)
    cache = model.release(cache, slot_ids)
    model.check(cache)      # steps never sync; this raises OutOfKvPagesError if one ran out of KV pages

``preset(name, **overrides)`` builds a :class:`HybridConfig` from ``PRESETS`` ("tiny", "qwen3_next_80b",
"qwen3_5_35b_a3b"). The ops (``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``,
``chunk_gated_delta_rule_slots``, FLA's signatures) come from :mod:`jax_gdn.ops`. Every name is imported on first
use.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "load_pretrained": "jax_gdn.checkpoint",
    "HybridModel": "jax_gdn.model",
    "OutOfKvPagesError": "jax_gdn.model",
    "HybridConfig": "jax_gdn.config",
    "preset": "jax_gdn.config",
    "PRESETS": "jax_gdn.config",
    "GdnDims": "jax_gdn.config",
    "AttnDims": "jax_gdn.config",
    "chunk_gated_delta_rule": "jax_gdn.ops",
    "recurrent_gated_delta_rule": "jax_gdn.ops",
    "chunk_gated_delta_rule_slots": "jax_gdn.ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jax_gdn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
