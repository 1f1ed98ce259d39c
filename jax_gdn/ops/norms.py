"""Normalisations of the Gated DeltaNet layer, computed in fp32 and cast back to the input dtype.

Shape legend: ``...`` any leading axes, D the normalised (last) axis.

- ``rms_norm``: zero-centred RMSNorm, ``x / rms(x) * (1 + w)`` (Qwen3-Next / Qwen3.5 input and q/k norms; the
  weight is stored as an offset from one, zeros at init).
- ``gated_rms_norm``: ``w * x / rms(x) * silu(z)`` with a plain weight (ones at init): the GDN output norm.
- ``l2norm``: ``x * rsqrt(sum(x^2) + eps)`` over the last axis (q and k of the delta rule).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.reference import l2norm  # noqa: F401  (one definition, beside the rule)


def _rms_normalise(x32: jax.Array, eps: float) -> jax.Array:
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(variance + eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Zero-centred RMSNorm: ``norm(x) * (1 + w)`` in fp32, returned in ``x.dtype``.

    x: [..., D]; w: [D] (offset from one). Returns [..., D].
    """
    if w.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: w must have shape [D]=({x.shape[-1]},), got {tuple(w.shape)}")
    y = _rms_normalise(x.astype(jnp.float32), eps) * (1.0 + w.astype(jnp.float32))
    return y.astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Gated RMSNorm: ``w * norm(x) * silu(z)`` in fp32 (plain weight), returned in ``x.dtype``.

    x, z: [..., D] (same shape); w: [D]. Returns [..., D].
    """
    if z.shape != x.shape:
        raise ValueError(f"gated_rms_norm: z must have the shape of x {tuple(x.shape)}, got {tuple(z.shape)}")
    if w.shape != (x.shape[-1],):
        raise ValueError(f"gated_rms_norm: w must have shape [D]=({x.shape[-1]},), got {tuple(w.shape)}")
    y = _rms_normalise(x.astype(jnp.float32), eps) * w.astype(jnp.float32)
    y = y * jax.nn.silu(z.astype(jnp.float32))
    return y.astype(x.dtype)
