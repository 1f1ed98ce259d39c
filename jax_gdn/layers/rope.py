"""Partial NeoX rotary position embedding (Qwen3-Next / Qwen3.5 text; M-RoPE reduces to this for text tokens).

Shape legend: T tokens, H heads, Dh head dim, R = rotary dims (the first ``Dh * partial_rotary_factor`` dims).

NeoX ("rotate half") layout: the rotary part is split into halves ``[x1 | x2]`` and rotated as
``[x1 cos - x2 sin | x2 cos + x1 sin]``; the remaining ``Dh - R`` dims pass through unchanged.
Frequencies, cos and sin are fp32 (``inv_freq = 1 / theta^(2i/R)``, as HF computes them).
``apply_partial_rope(x [T, H, Dh], cos, sin [T, R])`` lives in pallas_kernels.paged_attention.reference (the gated
prefill kernel applies the same rotation to its query tile) and is re-exported here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# one definition, beside the gated prefill kernel whose prologue applies the same rotation
from pallas_kernels.paged_attention.reference import apply_partial_rope  # noqa: F401


def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """[R / 2] fp32 inverse frequencies, computed exactly as HF does (fp32 arange / R, fp32 power)."""
    if rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be even, got {rotary_dim}")
    exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float):
    """cos, sin [T, R] fp32 for integer ``positions [T]`` (frequencies repeated for both halves)."""
    inv_freq = np.asarray(rope_inv_freq(rotary_dim, theta))
    inv_full = jnp.asarray(np.concatenate([inv_freq, inv_freq]))             # [R]: a constant, no concatenate
    emb = positions.astype(jnp.float32)[:, None] * inv_full[None, :]         # [T, R] (the same products)
    return jnp.cos(emb), jnp.sin(emb)
