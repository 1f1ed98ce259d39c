"""Causal depthwise conv1d with conv-state slots: one request, and many requests packed over ``cu_seqlens``.

Shape legend: T stacked tokens, C channels (conv_dim = [q | k | v]), Kc kernel size, S slots, N streams.

Semantics (the same as HF's ``causal_conv1d_fn`` / ``causal_conv1d_update`` and Dao's causal-conv1d):

    y[t, c] = act( sum_{j < Kc} w[c, j] * xs[t + j, c] ),   xs = concat(prev[c, :], x[:, c])   (Kc - 1 + T rows)

where ``prev`` is the stream's conv state (the last Kc - 1 pre-conv inputs it saw; zeros for a fresh stream, whatever
stale or NaN contents its slot holds) and the new conv state is the last Kc - 1 rows of ``xs`` (so a stream shorter
than Kc - 1 tokens keeps the tail of its old state). No bias (Qwen3-Next / Qwen3.5 have none). Arithmetic in fp32;
``y`` in ``x.dtype``; the state keeps the pool's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.chunk_map import gather_slots, scatter_slots, token_streams

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


def causal_conv1d_varlen(x: jax.Array, w: jax.Array, conv_state_pool: jax.Array, cu_seqlens: jax.Array,
                         slot_ids: jax.Array, has_initial_state: jax.Array, *,
                         activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv1d of N streams packed along T, each continuing from its slot's conv state.

    x: [T, C]; w: [C, Kc]; conv_state_pool: [S, C, Kc - 1]; cu_seqlens: [N + 1] int32 (stream n owns tokens
    cu_seqlens[n]:cu_seqlens[n+1]; cu_seqlens[N] <= T, tokens past it are padding and give y = 0);
    slot_ids: [N] int32 (distinct inside [0, S); an id outside [0, S) names no slot: that stream starts from zeros
    and its new state is dropped, e.g. S for a zero-length padding stream); has_initial_state: [N] bool.
    Returns (y [T, C] in x.dtype, new pool [S, C, Kc - 1]): the slots of the N streams are rewritten, others kept.
    One gather per tap; no host sync, traceable with T and N static.
    """
    _check_x_w("causal_conv1d_varlen", x, w)
    c, kc = w.shape
    t = x.shape[0]
    if conv_state_pool.ndim != 3 or conv_state_pool.shape[1:] != (c, kc - 1):
        raise ValueError(f"causal_conv1d_varlen: conv_state_pool must be [S, C, Kc-1] with C={c}, Kc-1={kc - 1}, "
                         f"got {tuple(conv_state_pool.shape)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"causal_conv1d_varlen: cu_seqlens must be [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    n = cu_seqlens.shape[0] - 1
    if slot_ids.shape != (n,):
        raise ValueError(f"causal_conv1d_varlen: slot_ids must be [N]=({n},), got {tuple(slot_ids.shape)}")
    if jnp.shape(has_initial_state) != (n,):
        raise ValueError(f"causal_conv1d_varlen: has_initial_state must be [N]=({n},), "
                         f"got {tuple(jnp.shape(has_initial_state))}")
    if kc == 1:  # no taps into the past, a 0-wide state: y = act(w[:, 0] * x), padding tokens still give 0
        valid = jnp.arange(t, dtype=jnp.int32) < cu_seqlens[n].astype(jnp.int32)
        y = _activation(activation)(x.astype(jnp.float32) * w[:, 0].astype(jnp.float32))
        return jnp.where(valid[:, None], y, 0.0).astype(x.dtype), conv_state_pool

    cu = cu_seqlens.astype(jnp.int32)
    has_init = jnp.asarray(has_initial_state, bool)
    # ---- previous inputs of each stream: its slot's conv state, zeros when fresh (NaN-safe select) ----
    prev = gather_slots(conv_state_pool, slot_ids, has_init).astype(jnp.float32)                  # [N, C, Kc-1]
    x32 = x.astype(jnp.float32)

    # ---- each token: its stream and position inside it ----
    tok = jnp.arange(t, dtype=jnp.int32)
    tok_seq, rel = token_streams(cu, t)                                                            # [T], [T]
    valid = tok < cu[n]

    # ---- taps: lag L = Kc - 1 - j reads x[t - L] inside the stream, else the state's column Kc-1-L+rel ----
    w32 = w.astype(jnp.float32)
    y = w32[:, kc - 1] * x32
    for j in range(kc - 1):
        lag = kc - 1 - j
        inside = rel >= lag
        from_x = x32[jnp.maximum(tok - lag, 0)]                                                    # [T, C]
        col = jnp.clip(kc - 1 - lag + rel, 0, kc - 2)
        from_state = prev[tok_seq, :, col]                                                         # [T, C]
        y = y + w32[:, j] * jnp.where(inside[:, None], from_x, from_state)
    y = jnp.where(valid[:, None], _activation(activation)(y), 0.0).astype(x.dtype)

    # ---- new state: the last Kc - 1 rows of concat(prev, x_stream) ----
    lens = cu[1:] - cu[:-1]                                                                        # [N]
    p = jnp.arange(kc - 1, dtype=jnp.int32)
    v = lens[:, None] - (kc - 1) + p[None, :]                                                      # [N, Kc-1]
    from_x = x32[jnp.clip(cu[:-1, None] + v, 0, t - 1)]                                            # [N, Kc-1, C]
    from_x = jnp.swapaxes(from_x, 1, 2)                                                            # [N, C, Kc-1]
    state_col = jnp.clip(p[None, :] + lens[:, None], 0, kc - 2)                                    # [N, Kc-1]
    from_state = jnp.take_along_axis(prev, jnp.broadcast_to(state_col[:, None, :], prev.shape), axis=2)
    new_states = jnp.where((v >= 0)[:, None, :], from_x, from_state)
    pool = scatter_slots(conv_state_pool, slot_ids, new_states)          # ids outside [0, S): write dropped
    return y, pool
