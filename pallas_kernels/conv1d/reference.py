"""XLA reference of the causal depthwise conv1d with conv-state slots (varlen), and of the fused conv + SiLU +
per-head L2 norm that feeds the gated delta rule.

Shape legend: T stacked tokens, C conv channels ([q | k | v] = 2 Hk K + Hv V), Cs source columns (C, or the fused
Qwen3-Next ``in_proj_qkvz`` output 2 Hk K + 2 Hv V), Kc kernel size, S slots, N streams, Hk / Hv key / value heads,
K / V head dims (the fused op needs K == V: one head per channel block).

Semantics (HF's ``causal_conv1d_fn`` / ``causal_conv1d_update``, Dao's causal-conv1d)::

    y[t, c] = act( sum_{j < Kc} w[c, j] * xs[t + j, c] ),   xs = concat(prev[c, :], x_stream[:, c])

``prev`` is the stream's conv state (the last Kc - 1 pre-conv inputs it saw; zeros for a fresh stream or a slot id
outside [0, S), whatever stale or NaN contents the slot holds); the new conv state is the last Kc - 1 rows of
``xs`` (a stream shorter than Kc - 1 keeps the tail of its old state). Tokens at index >= cu_seqlens[N] are
padding: y = 0 there and they touch no state. A slot id outside [0, S) reads zeros and its write is dropped.

Source layout (``block_cols``): the conv's channel c = b * K + i (b the head block: q heads, then k heads, then v
heads) is read from source column ``block_cols[b] + i``. ``None`` is the identity (x is [T, C] in [q | k | v]
order); ``qkvz_block_cols`` gives Qwen3-Next's fused per-key-head layout ``[q | k | v * r | z * r]`` so the
conv reads the projection's output where it lies (no [T, C] copy to reorder it; the z columns are not read).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta_rule.chunk_map import gather_slots, scatter_slots, token_streams

_F32 = jnp.float32
_ACTIVATIONS = {"silu": jax.nn.silu, None: lambda x: x}

__all__ = ["causal_conv1d_varlen", "conv1d_l2_varlen", "qkvz_block_cols", "channel_source_index", "select_channels",
           "boundary_rows", "fix_boundaries", "new_conv_states"]


def _activation(name):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {name!r}")
    return _ACTIVATIONS[name]


def qkvz_block_cols(num_k_heads: int, num_v_heads: int, head_dim: int) -> tuple:
    """Source column of each head block (q heads, k heads, v heads) in Qwen3-Next's fused ``in_proj_qkvz``
    output, grouped per key head as ``[q (K) | k (K) | v (r V) | z (r V)]`` with K == V == head_dim."""
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    r, g = hv // hk, 2 * d + 2 * (hv // hk) * d            # group width per key head
    q = [h * g for h in range(hk)]
    k = [h * g + d for h in range(hk)]
    v = [(j // r) * g + 2 * d + (j % r) * d for j in range(hv)]
    return tuple(q + k + v)


def channel_source_index(block_cols, head_dim: int, num_channels: int) -> np.ndarray:
    """[C] int32: the source column of each conv channel (identity when block_cols is None)."""
    if block_cols is None:
        return np.arange(num_channels, dtype=np.int32)
    cols = np.asarray(block_cols, np.int64)[:, None] + np.arange(head_dim)[None, :]
    return cols.reshape(-1).astype(np.int32)


def select_channels(x: jax.Array, block_cols, head_dim: int, num_channels: int) -> jax.Array:
    """x [T, Cs] -> [T, C] in channel order: a concatenation of static column slices (runs of adjacent blocks
    merged), which XLA fuses into its consumer (no gather, no separate copy when the consumer is a fusion).

    Its VJP is one concatenation too (``_select_runs``): the cotangent's runs put back in source order with zero
    columns between them. Left to autodiff, each slice transposes to a pad of the whole [T, Cs] and the pads are
    summed: 48 of them at 80B dims, which XLA fused into one 12.5 ms pass per GDN layer of a training step on the
    H200 (the forward conv's backward recomputed inside every term)."""
    if block_cols is None:
        return x
    runs = []                                                            # [start, width] of contiguous sources
    for col in block_cols:
        if runs and runs[-1][0] + runs[-1][1] == col:
            runs[-1][1] += head_dim
        else:
            runs.append([col, head_dim])
    return _select_runs(x, tuple((int(s), int(wd)) for s, wd in runs), int(x.shape[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _select_runs(x, runs, width):
    """x [T, Cs = width] -> the concatenation of the column runs ``runs`` ((start, width), in channel order)."""
    parts = [x[:, s:s + wd] for s, wd in runs]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _select_runs_fwd(x, runs, width):
    return _select_runs(x, runs, width), None


def _select_runs_bwd(runs, width, _, g):
    t = g.shape[0]
    offsets = np.concatenate([[0], np.cumsum([wd for _, wd in runs])]).astype(int)   # each run's columns in g
    pieces, at = [], 0
    for i in sorted(range(len(runs)), key=lambda i: runs[i][0]):                    # source order
        s, wd = runs[i]
        if s > at:
            pieces.append(jnp.zeros((t, s - at), g.dtype))                         # columns the conv does not read
        pieces.append(g[:, offsets[i]:offsets[i] + wd])
        at = s + wd
    if at < width:
        pieces.append(jnp.zeros((t, width - at), g.dtype))
    return (pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1),)


_select_runs.defvjp(_select_runs_fwd, _select_runs_bwd)


def new_conv_states(x: jax.Array, prev: jax.Array, cu: jax.Array, src_index=None) -> jax.Array:
    """The new conv state of each stream, [N, C, Kc - 1] fp32: the last Kc - 1 rows of concat(prev, x_stream).
    x [T, Cs]; prev [N, C, Kc - 1] fp32 (the start states); cu [N + 1] int32; src_index [C] (None: identity)."""
    n, c, km1 = prev.shape
    t = x.shape[0]
    lens = cu[1:] - cu[:-1]                                                                        # [N]
    p = jnp.arange(km1, dtype=jnp.int32)
    v = lens[:, None] - km1 + p[None, :]                                                           # [N, Kc-1]
    rows = x[jnp.clip(cu[:-1, None] + v, 0, t - 1)]                                                # [N, Kc-1, Cs]
    if src_index is not None:
        rows = rows[:, :, jnp.asarray(src_index)]                                                  # [N, Kc-1, C]
    from_x = jnp.swapaxes(rows.astype(_F32), 1, 2)                                                 # [N, C, Kc-1]
    state_col = jnp.clip(p[None, :] + lens[:, None], 0, km1 - 1)                                   # [N, Kc-1]
    from_state = jnp.take_along_axis(prev, jnp.broadcast_to(state_col[:, None, :], prev.shape), axis=2)
    return jnp.where((v >= 0)[:, None, :], from_x, from_state)


def _conv_taps(x32, w32, prev, cu, n):
    """y [T, C] fp32 pre-activation and valid [T] of the varlen conv (x32 [T, C] already in channel order)."""
    t = x32.shape[0]
    kc = w32.shape[1]
    tok = jnp.arange(t, dtype=jnp.int32)
    tok_seq, rel = token_streams(cu, t)                                                            # [T], [T]
    valid = tok < cu[n]
    # lag L = Kc - 1 - j reads x[t - L] inside the stream, else the state's column Kc - 1 - L + rel (a row gather
    # per tap: measured 0.49 ms at 80B dims on the H200 against 0.57 ms for static shifts;
    # ``python -m benchmarks layers``)
    y = w32[:, kc - 1] * x32
    for j in range(kc - 1):
        lag = kc - 1 - j
        inside = rel >= lag
        from_x = x32[jnp.maximum(tok - lag, 0)]                                                    # [T, C]
        col = jnp.clip(kc - 1 - lag + rel, 0, kc - 2)
        from_state = prev[tok_seq, :, col]                                                         # [T, C]
        y = y + w32[:, j] * jnp.where(inside[:, None], from_x, from_state)
    return y, valid


def causal_conv1d_varlen(x: jax.Array, w: jax.Array, conv_state_pool: jax.Array, cu_seqlens: jax.Array,
                         slot_ids: jax.Array, has_initial_state: jax.Array, *,
                         activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv1d of N streams packed along T, each continuing from its slot's conv state.

    x: [T, C]; w: [C, Kc]; conv_state_pool: [S, C, Kc - 1]; cu_seqlens: [N + 1] int32 (stream n owns tokens
    cu_seqlens[n]:cu_seqlens[n+1]; cu_seqlens[N] <= T, tokens past it are padding and give y = 0);
    slot_ids: [N] int32 (distinct inside [0, S); an id outside [0, S) names no slot: that stream starts from zeros
    and its new state is dropped, e.g. S for a zero-length padding stream); has_initial_state: [N] bool.
    Returns (y [T, C] in x.dtype, new pool [S, C, Kc - 1]): the slots of the N streams are rewritten, others kept.
    One gather per tap; no host sync, traceable with T and N static. Arithmetic in fp32.
    """
    _check_x_w("causal_conv1d_varlen", x, w)
    c, kc = w.shape
    t = x.shape[0]
    n = check_pool_meta("causal_conv1d_varlen", conv_state_pool, c, kc, cu_seqlens, slot_ids, has_initial_state)
    if kc == 1:  # no taps into the past, a 0-wide state: y = act(w[:, 0] * x), padding tokens still give 0
        valid = jnp.arange(t, dtype=jnp.int32) < cu_seqlens[n].astype(jnp.int32)
        y = _activation(activation)(x.astype(_F32) * w[:, 0].astype(_F32))
        return jnp.where(valid[:, None], y, 0.0).astype(x.dtype), conv_state_pool

    cu = cu_seqlens.astype(jnp.int32)
    has_init = jnp.asarray(has_initial_state, bool)
    prev = gather_slots(conv_state_pool, slot_ids, has_init).astype(_F32)                         # [N, C, Kc-1]
    y, valid = _conv_taps(x.astype(_F32), w.astype(_F32), prev, cu, n)
    y = jnp.where(valid[:, None], _activation(activation)(y), 0.0).astype(x.dtype)
    pool = scatter_slots(conv_state_pool, slot_ids, new_conv_states(x, prev, cu))  # ids outside [0, S): dropped
    return y, pool


def _finish(y, hk: int, hv: int, d: int, eps: float, dtype):
    """Pre-activation y [R, C] fp32 -> SiLU, split, L2 norm of each q / k head -> (q [R, Hk, D], k, v [R, Hv, D])."""
    r = y.shape[0]
    y = jax.nn.silu(y)
    kd = hk * d

    def l2(a):
        return a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + eps)
    return (l2(y[:, :kd].reshape(r, hk, d)).astype(dtype), l2(y[:, kd:2 * kd].reshape(r, hk, d)).astype(dtype),
            y[:, 2 * kd:].reshape(r, hv, d).astype(dtype))


def boundary_rows(x: jax.Array, w: jax.Array, prev: jax.Array, cu: jax.Array, src_index=None):
    """The first Kc - 1 tokens of every stream, whose taps reach into its start state.

    x [T, Cs]; w [C, Kc]; prev [N, C, Kc - 1] fp32 start states; cu [N + 1] int32; src_index [C] (None: identity).
    Returns (rows [N (Kc - 1)] int32, T where the stream is shorter: a dropped write; y [N (Kc - 1), C] fp32, the
    pre-activation conv of those tokens). Tiny: N (Kc - 1) rows.
    """
    n, c, km1 = prev.shape
    t = x.shape[0]
    lens = cu[1:] - cu[:-1]
    i = jnp.arange(km1, dtype=jnp.int32)
    rows = cu[:-1, None] + i[None, :]                                                              # [N, Kc-1]
    xr = x[jnp.clip(rows, 0, t - 1)]                                                               # [N, Kc-1, Cs]
    if src_index is not None:
        xr = xr[:, :, jnp.asarray(src_index)]
    xs = jnp.concatenate([jnp.swapaxes(prev, 1, 2), xr.astype(_F32)], axis=1)                     # [N, 2(Kc-1), C]
    w32 = w.astype(_F32)
    y = sum(w32[:, j] * xs[:, j:j + km1] for j in range(km1 + 1))                                  # [N, Kc-1, C]
    rows = jnp.where(i[None, :] < lens[:, None], rows, t)
    return rows.reshape(-1), y.reshape(n * km1, c)


def fix_boundaries(q, k, v, x, w, prev, cu, src_index, *, eps: float):
    """q, k, v with the rows of ``boundary_rows`` replaced (a scatter of N (Kc - 1) rows, set not add, so whatever
    the stream-blind pass wrote there, NaN included, is gone)."""
    hk, d = q.shape[1], q.shape[2]
    rows, yb = boundary_rows(x, w, prev, cu, src_index)
    qb, kb, vb = _finish(yb, hk, v.shape[1], d, eps, q.dtype)
    return (q.at[rows].set(qb, mode="drop"), k.at[rows].set(kb, mode="drop"), v.at[rows].set(vb, mode="drop"))


def conv1d_l2_varlen(x: jax.Array, w: jax.Array, conv_state_pool: jax.Array, cu_seqlens: jax.Array,
                     slot_ids: jax.Array, has_initial_state: jax.Array, *, num_k_heads: int, num_v_heads: int,
                     head_dim: int, block_cols=None, eps: float = 1e-6):
    """Causal conv1d + SiLU + L2 norm of each q and k head, varlen with conv-state slots (the ``"xla"`` backend of
    the fused op; ``causal_conv1d_varlen`` + a split + ``l2norm`` is the two-step form it is tested against).

    x: [T, Cs] (channel c read from column ``channel_source_index(block_cols)[c]``); w: [C, Kc] with
    C = (2 Hk + Hv) head_dim; conv_state_pool [S, C, Kc - 1]; cu_seqlens [N + 1]; slot_ids, has_initial_state [N].
    Returns (q [T, Hk, K], k [T, Hk, K] L2-normalised, v [T, Hv, V], all in x.dtype; new pool). The L2 norm is
    taken of the fp32 conv output (``y * rsqrt(sum(y^2) + eps)``); padding tokens give zeros.

    Two passes, neither gathering per token: the conv of the stacked tokens as if they were one stream (static
    shifts of x, fused by XLA with SiLU and the L2 norm into one read of x and one write of q, k, v), then the
    first Kc - 1 tokens of each stream recomputed from its start state and scattered over (``fix_boundaries``).
    """
    c, kc = w.shape
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    if c != (2 * hk + hv) * d:
        raise ValueError(f"conv1d_l2_varlen: w must be [C, Kc] with C = (2 Hk + Hv) head_dim = {(2 * hk + hv) * d}, "
                         f"got shape {tuple(w.shape)}")
    n = check_pool_meta("conv1d_l2_varlen", conv_state_pool, c, kc, cu_seqlens, slot_ids, has_initial_state)
    src = None if block_cols is None else channel_source_index(block_cols, d, c)
    xc = select_channels(x, block_cols, d, c).astype(_F32)                                         # [T, C]
    cu = cu_seqlens.astype(jnp.int32)
    t = x.shape[0]
    w32 = w.astype(_F32)
    y = w32[:, kc - 1] * xc
    for j in range(kc - 1):
        y = y + w32[:, j] * jnp.pad(xc, ((kc - 1 - j, 0), (0, 0)))[:t]                             # x[t - lag]
    valid = jnp.arange(t, dtype=jnp.int32) < cu[n]
    q, k, v = _finish(jnp.where(valid[:, None], y, 0.0), hk, hv, d, eps, x.dtype)   # padding: silu(0) = 0
    if kc == 1:
        return q, k, v, conv_state_pool
    prev = gather_slots(conv_state_pool, slot_ids, jnp.asarray(has_initial_state, bool)).astype(_F32)
    q, k, v = fix_boundaries(q, k, v, x, w, prev, cu, src, eps=eps)
    pool = scatter_slots(conv_state_pool, slot_ids, new_conv_states(x, prev, cu, src))
    return q, k, v, pool


def _check_x_w(fn: str, x, w):
    if x.ndim != 2:
        raise ValueError(f"{fn}: x must be [T, C], got shape {tuple(x.shape)}")
    if w.ndim != 2 or w.shape[0] != x.shape[1] or w.shape[1] < 1:
        raise ValueError(f"{fn}: w must be [C, Kc] with C={x.shape[1]}, got shape {tuple(w.shape)}")


def check_pool_meta(fn, pool, c, kc, cu_seqlens, slot_ids, has_initial_state) -> int:
    if pool.ndim != 3 or pool.shape[1:] != (c, kc - 1):
        raise ValueError(f"{fn}: conv_state_pool must be [S, C, Kc-1] with C={c}, Kc-1={kc - 1}, "
                         f"got {tuple(pool.shape)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{fn}: cu_seqlens must be [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    n = cu_seqlens.shape[0] - 1
    if jnp.shape(slot_ids) != (n,):
        raise ValueError(f"{fn}: slot_ids must be [N]=({n},), got {tuple(jnp.shape(slot_ids))}")
    if jnp.shape(has_initial_state) != (n,):
        raise ValueError(f"{fn}: has_initial_state must be [N]=({n},), got {tuple(jnp.shape(has_initial_state))}")
    return n
