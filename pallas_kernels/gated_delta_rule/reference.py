"""Pure-JAX gated delta rule: the per-token recurrence (``lax.scan``) and the XLA chunked form.

Every kernel is held to these. Per value head h (state S [K, V] fp32, key head h // (Hv // Hk)):

    S   = exp(g_t) S
    S   = S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale q_t)

Shape legend: B batch rows, T tokens, N sequences (N = B for dense input, len(cu_seqlens) - 1 for packed input,
then B == 1), Hk key heads, Hv value heads, r = Hv // Hk, K / V key / value head dims, C chunk size,
NC number of chunks.

The functions here take already validated arrays (see ``api.py`` for the public, checked entry points) whose
q / k are already L2-normalised if wanted. They compute in float32 (``Precision.HIGHEST`` dots), return o in v's
dtype and the final state [N, Hv, K, V] in float32. Grouped value heads are handled by viewing the value-head
axis as [Hk, r]: q and k are never repeated.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map, gather_slots, scatter_slots, token_streams

__all__ = ["l2norm", "recurrent_gated_delta_rule_xla", "chunk_gated_delta_rule_xla",
           "chunk_gated_delta_rule_slots_xla", "fused_recurrent_gated_delta_rule_slots_xla", "G_FLOOR",
           "floor_log_decay"]

_HI = lax.Precision.HIGHEST
#: log-decays below this are raised to it in the chunked form: exp(g) is 0 in fp32 for g < -104 either way, and the
#: floor keeps cumulative gates finite (g = -inf, a hard reset, would give -inf - -inf = NaN on the diagonal)
G_FLOOR = -128.0


def floor_log_decay(g: jax.Array) -> jax.Array:
    """g with values below G_FLOOR raised to it (NaN stays NaN: a select, not a max)."""
    return jnp.where(g < G_FLOOR, jnp.asarray(G_FLOOR, g.dtype), g)
_SCAN_UNROLL = 2        # chunks per state-pass loop iteration (H200, T=8192, 32 heads: 6.3 -> 5.7 ms)
_F32 = jnp.float32


def _einsum(spec: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=_F32)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """L2 normalisation over the last axis, ``x * rsqrt(sum(x^2) + eps)`` in fp32, returned in ``x.dtype``
    (FLA's and HF's formula; ``jax_gdn.ops.norms.l2norm`` is this function).

    x: [..., D]. Returns [..., D].
    """
    x32 = x.astype(_F32)
    y = x32 * lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype)


def _zero_padding_tokens(x: jax.Array, cu_seqlens: jax.Array, total_len: int, axis: int) -> jax.Array:
    """Zeros the rows of ``x`` along ``axis`` (the packed token axis) at index >= cu_seqlens[N] (padding)."""
    valid = jnp.arange(total_len, dtype=jnp.int32) < cu_seqlens[-1].astype(jnp.int32)
    return jnp.where(valid.reshape((total_len,) + (1,) * (x.ndim - axis - 1)), x, 0)


def _segments(cu_seqlens: jax.Array, total_len: int):
    """Per token of a packed row: (seq [T], first [T] bool, last [T] bool)."""
    cu = cu_seqlens.astype(jnp.int32)
    seq, rel = token_streams(cu, total_len)
    return seq, rel == 0, rel == cu[seq + 1] - cu[seq] - 1


# ---------------------------------------------------------------------------------------------------------------
# Per-token recurrence
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale", "output_final_state"))
def recurrent_gated_delta_rule_xla(q, k, v, g, beta, *, scale: float, initial_state=None, cu_seqlens=None,
                                   output_final_state: bool = False):
    """Per-token gated delta rule as a ``lax.scan`` over T (the decode path and the simplest reference).

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; initial_state [N, Hv, K, V] fp32 or None;
    cu_seqlens [N + 1] int32 (B == 1) or None. Returns (o [B, T, Hv, V] in v's dtype, final [N, Hv, K, V] fp32
    or None).
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # time-major, value heads viewed as [Hk, r]
    qs = jnp.moveaxis(q.astype(_F32) * scale, 1, 0)                       # [T, B, Hk, K]
    ks = jnp.moveaxis(k.astype(_F32), 1, 0)                               # [T, B, Hk, K]
    vs = jnp.moveaxis(v.astype(_F32).reshape(b, t, hk, r, dv), 1, 0)      # [T, B, Hk, r, V]
    gs = jnp.moveaxis(g.astype(_F32).reshape(b, t, hk, r), 1, 0)          # [T, B, Hk, r]
    bs = jnp.moveaxis(beta.astype(_F32).reshape(b, t, hk, r), 1, 0)       # [T, B, Hk, r]
    if initial_state is None:
        init = jnp.zeros((n, hk, r, dk, dv), _F32)
    else:
        init = initial_state.astype(_F32).reshape(n, hk, r, dk, dv)

    def token(state, qt, kt, vt, gt, bt):
        state = state * jnp.exp(gt)[..., None, None]
        kv = _einsum("bhk,bhrkv->bhrv", kt, state)
        delta = bt[..., None] * (vt - kv)
        state = state + _einsum("bhk,bhrv->bhrkv", kt, delta)
        return state, _einsum("bhk,bhrkv->bhrv", qt, state)

    if cu_seqlens is None:
        def step(state, xs):
            return token(state, *xs)

        state, o = lax.scan(step, init, (qs, ks, vs, gs, bs))
        final = state.reshape(n, hv, dk, dv)
    else:
        seq, first, last = _segments(cu_seqlens, t)

        def step(carry, xs):
            state, final = carry
            qt, kt, vt, gt, bt, s, f, l = xs
            state = jnp.where(f, init[s][None], state)          # a sequence starts from its initial state
            state, ot = token(state, qt, kt, vt, gt, bt)
            final = final.at[s].set(jnp.where(l, state[0], final[s]))
            return (state, final), ot

        state0 = jnp.zeros((1, hk, r, dk, dv), _F32)
        (_, final), o = lax.scan(step, (state0, init), (qs, ks, vs, gs, bs, seq, first, last))
        final = final.reshape(n, hv, dk, dv)                     # an empty sequence keeps its initial state
        o = _zero_padding_tokens(o, cu_seqlens, t, axis=0)
    o = jnp.moveaxis(o, 0, 1).reshape(b, t, hv, dv).astype(v.dtype)
    return o, (final if output_final_state else None)


# ---------------------------------------------------------------------------------------------------------------
# Chunked form
# ---------------------------------------------------------------------------------------------------------------
def forward_substitution(a: jax.Array, rhs: jax.Array) -> jax.Array:
    """x with (I + A) x = rhs for strictly lower triangular A, row by row (x_i = rhs_i - A_i. x), in fp32
    Precision.HIGHEST dots: no LAPACK call.

    a [..., C, C] (zero on and above the diagonal); rhs [..., C, D]. Returns x [..., C, D]."""
    def row(i, x):
        a_i = lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)            # [..., C]: zero from column i
        r_i = lax.dynamic_index_in_dim(rhs, i, axis=-2, keepdims=False)          # [..., D]
        x_i = r_i - _einsum("...c,...cd->...d", a_i, x)                          # rows >= i of x are still zero
        return lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)
    return lax.fori_loop(0, a.shape[-1], row, jnp.zeros_like(rhs))


def unit_lower_solve(a: jax.Array, rhs: jax.Array) -> jax.Array:
    """x with (I + A) x = rhs for strictly lower triangular A [..., C, C], rhs [..., C, D].

    On CPU: :func:`forward_substitution`. XLA's CPU triangular solve calls LAPACK's trsm, which deadlocks when
    several device programs of one process run it at once (a mesh of forced host devices, the model sharded over
    it). Elsewhere (GPU): ``lax.linalg.triangular_solve`` (cuBLAS), as measured by ``python -m benchmarks gdn``."""
    return lax.platform_dependent(
        a, rhs, cpu=forward_substitution,
        default=lambda a, rhs: lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True))


def _chunk_core(q, k, v, g, beta, init, *, scale, varlen):
    """Chunked gated delta rule over chunks laid out [B, NC, C, ...] (padded positions all zero).

    q, k [B, NC, C, Hk, K]; v [B, NC, C, Hk, r, V]; g, beta [B, NC, C, Hk, r] (fp32).
    init: [B, Hk, r, K, V] (dense) or [N, Hk, r, K, V] (varlen, B == 1).
    varlen: None, or (chunk_first [NC], chunk_last [NC], chunk_seq [NC]) for a packed row.
    Returns (o [B, NC, C, Hk, r, V] fp32, final state as init).
    """
    c = q.shape[2]
    # heads before the chunk axis
    q = jnp.moveaxis(q, 2, 3) * scale                            # [B, NC, Hk, C, K]
    k = jnp.moveaxis(k, 2, 3)                                    # [B, NC, Hk, C, K]
    v = jnp.moveaxis(v, 2, 4)                                    # [B, NC, Hk, r, C, V]
    g = jnp.moveaxis(g, 2, 4)                                    # [B, NC, Hk, r, C]
    beta = jnp.moveaxis(beta, 2, 4)                              # [B, NC, Hk, r, C]

    # ---- stage 1: local cumulative gates ---------------------------------------------------------------------
    gcum = jnp.cumsum(g, axis=-1)                                # [B, NC, Hk, r, C]  G_i
    g_last = gcum[..., -1]                                       # [B, NC, Hk, r]     G_C
    i_idx = jnp.arange(c)[:, None]
    j_idx = jnp.arange(c)[None, :]
    incl = i_idx >= j_idx                                        # [C, C] causal, with the diagonal
    strict = i_idx > j_idx                                       # [C, C] strictly lower
    diff = gcum[..., :, None] - gcum[..., None, :]               # [B, NC, Hk, r, C, C]  G_i - G_j
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)   # mask before exp: no overflow

    # ---- stage 2: WY representation (parallel over chunks) ---------------------------------------------------
    kk = _einsum("bnhck,bnhdk->bnhcd", k, k)                     # [B, NC, Hk, C, C]
    qk = _einsum("bnhck,bnhdk->bnhcd", q, k)                     # [B, NC, Hk, C, C]
    a = jnp.where(strict, beta[..., :, None] * kk[:, :, :, None] * decay, 0.0)   # [B, NC, Hk, r, C, C]
    dk = k.shape[-1]
    rhs = jnp.concatenate([
        (beta * jnp.exp(gcum))[..., None] * k[:, :, :, None],   # beta exp(G) k   [B, NC, Hk, r, C, K]
        beta[..., None] * v,                                     # beta v          [B, NC, Hk, r, C, V]
    ], axis=-1)
    # T = (I + A)^-1 applied by forward substitution: (I + A) [w | u] = rhs
    wu = unit_lower_solve(a, rhs)
    w, u = wu[..., :dk], wu[..., dk:]                            # [.., C, K], [.., C, V]
    q_gated = q[:, :, :, None] * jnp.exp(gcum)[..., None]        # q exp(G)          [B, NC, Hk, r, C, K]
    k_to_end = k[:, :, :, None] * jnp.exp(g_last[..., None] - gcum)[..., None]   # k exp(G_C - G)
    attn = jnp.where(incl, qk[:, :, :, None] * decay, 0.0)       # [B, NC, Hk, r, C, C] causal intra-chunk
    chunk_decay = jnp.exp(g_last)[..., None, None]               # [B, NC, Hk, r, 1, 1]

    # ---- stage 3: state pass (serial over chunks; two dots per chunk, the rest stays parallel) --------------
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (w, u, k_to_end, chunk_decay))

    def advance(state, w_c, u_c, kd_c, cd_c):
        v_new = u_c - _einsum("bhrck,bhrkv->bhrcv", w_c, state)           # [B, Hk, r, C, V]
        new_state = cd_c * state + _einsum("bhrck,bhrcv->bhrkv", kd_c, v_new)
        return new_state, (state, v_new)                                  # the chunk's start state, its v_new

    if varlen is None:
        def step(state, x):
            return advance(state, *x)

        final, (h, v_new) = lax.scan(step, init, xs, unroll=_SCAN_UNROLL)
    else:
        first, last, seq = varlen

        def step(carry, x):
            state, final = carry
            *xc, f, l, s = x
            state = jnp.where(f, init[s][None], state)           # a sequence's first chunk: its initial state
            state, ys = advance(state, *xc)
            final = final.at[s].set(jnp.where(l, state[0], final[s]))   # its last chunk: record the final state
            return (state, final), ys

        state0 = jnp.zeros((1,) + init.shape[1:], _F32)
        (_, final), (h, v_new) = lax.scan(step, (state0, init), xs + (first, last, seq), unroll=_SCAN_UNROLL)
    h = jnp.moveaxis(h, 0, 1)                                    # [B, NC, Hk, r, K, V] chunk start states
    v_new = jnp.moveaxis(v_new, 0, 1)                            # [B, NC, Hk, r, C, V]

    # ---- stage 4: output (parallel over chunks) --------------------------------------------------------------
    o = (_einsum("bnhrck,bnhrkv->bnhrcv", q_gated, h)             # inter-chunk: (q exp(G)) S
         + _einsum("bnhrcd,bnhrdv->bnhrcv", attn, v_new))        # intra-chunk: causal (q k^T decay) v_new
    return jnp.moveaxis(o, 4, 2), final                          # [B, NC, C, Hk, r, V]


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "chunk_size"))
def chunk_gated_delta_rule_xla(q, k, v, g, beta, *, scale: float, initial_state=None, cu_seqlens=None,
                               output_final_state: bool = False, chunk_size: int = 64):
    """Chunked gated delta rule in XLA (WY form, ``lax.scan`` over chunks only for the state pass).

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; initial_state [N, Hv, K, V] fp32 or None;
    cu_seqlens [N + 1] int32 (B == 1) or None. Returns (o [B, T, Hv, V] in v's dtype, final [N, Hv, K, V] fp32
    or None). Packed sequences are cut into chunks with ``build_chunk_map`` (NC = T // C + N, no host sync).
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    c = chunk_size
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    qf, kf = q.astype(_F32), k.astype(_F32)
    vf = v.astype(_F32).reshape(b, t, hk, r, dv)
    # a floor on the log-decay keeps the cumulative gates finite (exp(g) is 0 in fp32 below -104 anyway)
    gf = floor_log_decay(g.astype(_F32)).reshape(b, t, hk, r)
    bf = beta.astype(_F32).reshape(b, t, hk, r)
    if initial_state is None:
        init = jnp.zeros((n, hk, r, dk, dv), _F32)
    else:
        init = initial_state.astype(_F32).reshape(n, hk, r, dk, dv)

    if cu_seqlens is None:
        # dense rows: pad T up to whole chunks (padding has g = beta = k = 0, so it leaves the state alone)
        nc = -(-t // c)
        pad = nc * c - t

        def to_chunks(x):
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            return x.reshape((b, nc, c) + x.shape[2:])

        o, final = _chunk_core(*(to_chunks(x) for x in (qf, kf, vf, gf, bf)), init, scale=scale, varlen=None)
        o = o.reshape(b, nc * c, hv, dv)[:, :t]
    elif t == 0:
        # nothing to gather: every sequence is empty and keeps its initial state
        o, final = jnp.zeros((1, 0, hv, dv), _F32), init
    else:
        # packed row: gather tokens into [NC, C] chunks that never straddle two sequences
        cmap = build_chunk_map(cu_seqlens, t, c)
        pos = jnp.arange(c, dtype=jnp.int32)
        idx = jnp.minimum(cmap.chunk_start[:, None] + pos[None, :], t - 1)        # [NC, C]
        valid = pos[None, :] < cmap.chunk_len[:, None]                           # [NC, C]

        def to_chunks(x):
            x = x[0][idx]                                                        # [NC, C, ...]
            mask = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
            return jnp.where(mask, x, 0.0)[None]                                 # [1, NC, C, ...]

        o, final = _chunk_core(*(to_chunks(x) for x in (qf, kf, vf, gf, bf)), init, scale=scale,
                               varlen=(cmap.chunk_first, cmap.chunk_last, cmap.chunk_seq))
        o = o[0][cmap.token_chunk, cmap.token_offset].reshape(1, t, hv, dv)      # back to token order
        o = _zero_padding_tokens(o, cu_seqlens, t, axis=1)                       # tokens past cu[N]: zeros
    o = o.astype(v.dtype)
    return o, (final.reshape(n, hv, dk, dv) if output_final_state else None)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def chunk_gated_delta_rule_slots_xla(q, k, v, g, beta, *, scale: float, ssm_state, slot_ids, has_initial_state,
                                     cu_seqlens=None, chunk_size: int = 64):
    """Chunked gated delta rule over a slot pool ssm_state [S, Hv, K, V] fp32.

    Sequence n starts from ``ssm_state[slot_ids[n]]`` (zeros where ``has_initial_state[n]`` is False) and its final
    state is written back there; other slots are unchanged. An id outside [0, S) reads zeros and its write is
    dropped. slot_ids, has_initial_state [N]; N = B without cu_seqlens. Returns (o [B, T, Hv, V] in v's dtype,
    new ssm_state [S, Hv, K, V]).
    """
    init = gather_slots(ssm_state, slot_ids, has_initial_state)                          # [N, Hv, K, V]
    o, final = chunk_gated_delta_rule_xla(q, k, v, g, beta, scale=scale, initial_state=init, cu_seqlens=cu_seqlens,
                                          output_final_state=True, chunk_size=chunk_size)
    return o, scatter_slots(ssm_state, slot_ids, final)


@functools.partial(jax.jit, static_argnames=("scale",))
def fused_recurrent_gated_delta_rule_slots_xla(q, k, v, g, beta, *, scale: float, ssm_state, slot_ids,
                                               has_initial_state):
    """Per-token gated delta rule of N streams over a slot pool (the decode kernel's reference).

    q, k [N, T, Hk, K]; v [N, T, Hv, V]; g, beta [N, T, Hv]; ssm_state [S, Hv, K, V] fp32; slot_ids,
    has_initial_state [N]. Gathers the N start states (zeros where has_initial_state is False or the id is outside
    [0, S)), runs the ``lax.scan`` form, scatters the final states back (writes of ids outside [0, S) dropped).
    Returns (o [N, T, Hv, V] in v's dtype, new ssm_state).
    """
    init = gather_slots(ssm_state, slot_ids, has_initial_state)
    o, final = recurrent_gated_delta_rule_xla(q, k, v, g, beta, scale=scale, initial_state=init,
                                              output_final_state=True)
    return o, scatter_slots(ssm_state, slot_ids, final)
