"""The package's public ops (FLA-style signatures): thin re-exports.

The gated delta rule lives in one folder, ``pallas_kernels/gated_delta_rule/`` (``api.py`` checks, holds the op's
dispatch table and resolves it once per call, ``DispatchConfig`` being its measured rules; ``reference.py`` is the
XLA form, ``triton/`` and ``mosaic_gpu/`` the GPU kernels, ``chunk_map.py`` the chunk map, ``validation.py`` the
checks); its docstrings hold the shapes, backends, padding contract and edge cases.
``jax_gdn.ops.{reference, varlen, validation}`` re-export those modules for existing imports. ``conv1d`` and
``norms`` are the other ops of the layer.
"""
from __future__ import annotations

from pallas_kernels.gated_delta_rule.api import (DEFAULT_DISPATCH, DispatchConfig, chunk_gated_delta_rule,
                                                 chunk_gated_delta_rule_slots, fused_recurrent_gated_delta_rule_slots,
                                                 recurrent_gated_delta_rule, resolve_backend)
from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map, dense_cu_seqlens
from pallas_kernels.gated_delta_rule.validation import checkify_cu_seqlens, checkify_slot_ids

__all__ = [
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule_slots",
    "fused_recurrent_gated_delta_rule_slots",
    "resolve_backend",
    "DispatchConfig",
    "DEFAULT_DISPATCH",
    "checkify_cu_seqlens",
    "checkify_slot_ids",
    "build_chunk_map",
    "dense_cu_seqlens",
]
