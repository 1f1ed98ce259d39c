"""Paged causal attention over stacked streams (prefill) and one query per stream (decode); see api.py."""
from pallas_kernels.paged_attention.api import (paged_attention, paged_attention_decode,
                                                paged_attention_gated, resolve_backend,
                                                supports)

__all__ = ["paged_attention", "paged_attention_decode", "paged_attention_gated", "resolve_backend", "supports"]
