"""Causal depthwise conv1d with conv-state slots: one request, and many requests packed over ``cu_seqlens``.

Shape legend: T stacked tokens, C channels (conv_dim = [q | k | v]), Kc kernel size, S slots, N streams.

Semantics (the same as HF's ``causal_conv1d_fn`` / ``causal_conv1d_update`` and Dao's causal-conv1d):

    y[t, c] = act( sum_{j < Kc} w[c, j] * xs[t + j, c] ),   xs = concat(prev[c, :], x[:, c])   (Kc - 1 + T rows)

where ``prev`` is the stream's conv state (the last Kc - 1 pre-conv inputs it saw; zeros for a fresh stream, whatever
stale or NaN contents its slot holds) and the new conv state is the last Kc - 1 rows of ``xs`` (so a stream shorter
than Kc - 1 tokens keeps the tail of its old state). No bias (Qwen3-Next / Qwen3.5 have none). Arithmetic in fp32;
``y`` in ``x.dtype``; the state keeps the pool's dtype.

``causal_conv1d_one`` is defined here; ``causal_conv1d_varlen`` (many streams over ``cu_seqlens``) and
``causal_conv1d_l2_varlen`` (the same conv + SiLU + the L2 norm of each q / k head in one pass, backends "xla",
"pallas", "pallas_interpret") live beside their kernel in ``pallas_kernels/conv1d`` and are re-exported.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.conv1d.api import causal_conv1d_l2_varlen  # noqa: F401  (conv + SiLU + q/k L2 norm, fused)
from pallas_kernels.conv1d.reference import causal_conv1d_varlen  # noqa: F401  (one definition, beside the kernel)

_ACTIVATIONS = {"silu": jax.nn.silu, None: lambda x: x}


def _activation(name):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {name!r}")
    return _ACTIVATIONS[name]


def _check_x_w(fn: str, x, w):
    if x.ndim != 2:
        raise ValueError(f"{fn}: x must be [T, C], got shape {tuple(x.shape)}")
    if w.ndim != 2 or w.shape[0] != x.shape[1] or w.shape[1] < 1:
        raise ValueError(f"{fn}: w must be [C, Kc] with C={x.shape[1]}, got shape {tuple(w.shape)}")


def causal_conv1d_one(x: jax.Array, w: jax.Array, conv_state: jax.Array, has_initial_state=True, *,
                      activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv1d of ONE stream, continuing from its conv state.

    x: [T, C] pre-conv inputs; w: [C, Kc]; conv_state: [C, Kc - 1]; has_initial_state: bool scalar (Python or
    traced; False = start from zeros). Returns (y [T, C] in x.dtype, new_conv_state [C, Kc - 1] in conv_state.dtype).
    """
    _check_x_w("causal_conv1d_one", x, w)
    c, kc = w.shape
    if conv_state.shape != (c, kc - 1):
        raise ValueError(f"causal_conv1d_one: conv_state must be [C, Kc-1]=({c}, {kc - 1}), "
                         f"got {tuple(conv_state.shape)}")
    t = x.shape[0]
    prev = jnp.where(jnp.asarray(has_initial_state, bool), conv_state.astype(jnp.float32), 0.0)  # [C, Kc-1]
    xs = jnp.concatenate([prev.T, x.astype(jnp.float32)], axis=0)                             # [Kc-1+T, C]
    w32 = w.astype(jnp.float32)
    y = sum(w32[:, j] * xs[j:j + t] for j in range(kc))                                       # [T, C]
    y = _activation(activation)(y).astype(x.dtype)
    new_state = xs[t:].T.astype(conv_state.dtype) if kc > 1 else conv_state                 # [C, Kc-1]
    return y, new_state
