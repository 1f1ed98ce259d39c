"""Pallas (Triton lowering) kernels for the chunked gated delta rule forward.

Two pallas_calls:

1. ``intra_chunk``  grid (NC, Hv), fully parallel. Per chunk of C tokens (C = 64, split into C/16 sub-blocks of
   16 rows so that every dot is at least 16 x 16 and no register tensor is ever sliced):
     G   = cumsum(g) inside the chunk                                   [C]      fp32
     A   = beta_i (k_i . k_j) exp(G_i - G_j), j < i                     [C, C]   fp32 (16 x 16 blocks)
     T   = (I + A)^-1: diagonal 16 x 16 blocks by forward substitution, off-diagonal blocks merged by
           T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj
     w   = T (beta exp(G) k)                                            [C, K]   input dtype
     u   = T (beta v)                                                   [C, V]   input dtype
     Aqk = scale (q_i . k_j) exp(G_i - G_j), j <= i                     [C, C]   input dtype
2. ``state_pass``   grid (N, Hv, V / BV), serial over the chunks of one sequence, S [K, BV] fp32 in registers,
   the output fused in:
     v_new = u - w S
     o     = scale exp(G) (q S) + Aqk v_new
     S     = exp(G_last) S + k^T (exp(G_last - G) v_new)

Chunks never straddle a sequence boundary: chunk c covers tokens [chunk_start[c], chunk_start[c] + chunk_len[c])
of the packed token axis; rows past chunk_len are masked on load (zeros) and on store. The loop over a sequence's
chunks has a traced trip count (seq_num_chunks[n]), so one compiled program serves any lengths.

Shape legend: T packed tokens (B*T for dense input), N sequences, S slots, Hk/Hv heads (value head h reads key
head h // (Hv // Hk)), K/V head dims, C chunk size, NC = T // C + N chunk slots, BV value block.

This module imports only jax.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SUB = 16  # sub-block rows inside a chunk: the smallest dot Triton lowers


def _compiler_params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(a, b, *, ta=False, tb=False, precision=None):
    """a @ b (a^T / b^T when asked) with fp32 accumulation."""
    dn = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return lax.dot_general(a, b, dn, precision=precision, preferred_element_type=jnp.float32)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _inv_unit_lower16(a):
    """(I + a)^-1 for a strictly lower triangular [16, 16] fp32 block, by forward substitution on registers.

    Row i of N = (I + a)^-1 - I: N_i = -a_i + sum_m (-a_im) N_m (rows m < i are already final, the rest zero).
    """
    rows = _iota((SUB, SUB), 0)
    n = jnp.zeros((SUB, SUB), jnp.float32)
    for i in range(1, SUB):
        sel = rows == i
        ai = -jnp.sum(jnp.where(sel, a, 0.0), axis=0)                 # [16]  -a[i, :]
        new = ai + jnp.sum(ai[:, None] * n, axis=0)                    # [16]
        n = jnp.where(sel, new[None, :], n)
    return n + (rows == _iota((SUB, SUB), 1)).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: intra-chunk (parallel over chunks and value heads)
# ----------------------------------------------------------------------------------------------------------------
def _intra_chunk_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                        w_ref, u_ref, aqk_ref, gcum_ref, *, chunk, group, scale, dtype, precision):
    c = pl.program_id(0)
    h = pl.program_id(1)
    hk = h // group
    start = start_ref[c]
    length = len_ref[c]
    nb = chunk // SUB
    kdim = k_ref.shape[-1]
    vdim = v_ref.shape[-1]

    # ---- loads, 16 rows at a time; rows past the chunk's length read as zeros ----
    qb, kb, vb, bb, gb = [], [], [], [], []
    off = jnp.float32(0.0)
    tri16 = _iota((SUB, SUB), 1) <= _iota((SUB, SUB), 0)              # j <= i
    for b in range(nb):
        rows = b * SUB + lax.broadcasted_iota(jnp.int32, (SUB,), 0)
        valid = rows < length
        sl = pl.ds(start + b * SUB, SUB)
        mk = jnp.broadcast_to(valid[:, None], (SUB, kdim))
        mv = jnp.broadcast_to(valid[:, None], (SUB, vdim))
        qb.append(plgpu.load(q_ref.at[sl, hk, :], mask=mk, other=0).astype(dtype))
        kb.append(plgpu.load(k_ref.at[sl, hk, :], mask=mk, other=0).astype(dtype))
        vb.append(plgpu.load(v_ref.at[sl, h, :], mask=mv, other=0).astype(dtype))
        bb.append(plgpu.load(beta_ref.at[sl, h], mask=valid, other=0).astype(jnp.float32))
        g = plgpu.load(g_ref.at[sl, h], mask=valid, other=0).astype(jnp.float32)
        gc = off + jnp.sum(jnp.where(tri16, g[None, :], 0.0), axis=1)    # [16] cumulative gate
        off = off + jnp.sum(g)
        gb.append(gc)
        gcum_ref[c, h, pl.ds(b * SUB, SUB)] = gc

    # ---- A = beta k k^T * decay (strictly lower), and Aqk = scale q k^T * decay (lower, diagonal included) ----
    strict16 = _iota((SUB, SUB), 1) < _iota((SUB, SUB), 0)
    a_blk = {}
    for i in range(nb):
        for j in range(i + 1):
            diff = gb[i][:, None] - gb[j][None, :]
            if i == j:
                dec_a = jnp.exp(jnp.where(strict16, diff, -jnp.inf))
                dec_q = jnp.exp(jnp.where(tri16, diff, -jnp.inf))
            else:
                dec_a = dec_q = jnp.exp(diff)
            a_blk[i, j] = bb[i][:, None] * _dot(kb[i], kb[j], tb=True, precision=precision) * dec_a
            aq = scale * _dot(qb[i], kb[j], tb=True, precision=precision) * dec_q
            aqk_ref[c, h, pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = aq.astype(aqk_ref.dtype)
        for j in range(i + 1, nb):
            aqk_ref[c, h, pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)

    # ---- T = (I + A)^-1, block forward substitution ----
    hi = lax.Precision.HIGHEST
    t_blk = {}
    for i in range(nb):
        t_blk[i, i] = _inv_unit_lower16(a_blk[i, i])
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            acc = _dot(a_blk[i, j], t_blk[j, j], precision=hi)
            for m in range(j + 1, i):
                acc = acc + _dot(a_blk[i, m], t_blk[m, j], precision=hi)
            t_blk[i, j] = -_dot(t_blk[i, i], acc, precision=hi)

    # ---- w = T (beta exp(G) k), u = T (beta v) ----
    kbeta = [(kb[b].astype(jnp.float32) * (bb[b] * jnp.exp(gb[b]))[:, None]).astype(dtype) for b in range(nb)]
    vbeta = [(vb[b].astype(jnp.float32) * bb[b][:, None]).astype(dtype) for b in range(nb)]
    for i in range(nb):
        w = jnp.zeros((SUB, kdim), jnp.float32)
        u = jnp.zeros((SUB, vdim), jnp.float32)
        for j in range(i + 1):
            t = t_blk[i, j].astype(dtype)
            w = w + _dot(t, kbeta[j], precision=precision)
            u = u + _dot(t, vbeta[j], precision=precision)
        w_ref[c, h, pl.ds(i * SUB, SUB), :] = w.astype(w_ref.dtype)
        u_ref[c, h, pl.ds(i * SUB, SUB), :] = u.astype(u_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: serial state pass over each sequence's chunks, output fused
# ----------------------------------------------------------------------------------------------------------------
def _state_pass_kernel(start_ref, len_ref, first_ref, nchunks_ref, slot_ref, has_ref,
                       q_ref, k_ref, w_ref, u_ref, aqk_ref, gcum_ref, pool_in_ref,
                       o_ref, pool_out_ref, *, chunk, group, block_v, scale, dtype, precision):
    n = pl.program_id(0)
    h = pl.program_id(1)
    vblk = pl.program_id(2)
    hk = h // group
    kdim = k_ref.shape[-1]
    vs = pl.ds(vblk * block_v, block_v)
    slot = slot_ref[n]
    first = first_ref[n]
    count = nchunks_ref[n]

    s0 = pool_in_ref[slot, h, :, vs].astype(jnp.float32)                        # [K, BV]
    s0 = jnp.where(has_ref[n] != 0, s0, 0.0)                                    # never multiply a stale slot

    rows = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def body(j, s):
        c = first + j
        start = start_ref[c]
        valid = rows < len_ref[c]
        sl = pl.ds(start, chunk)
        mk = jnp.broadcast_to(valid[:, None], (chunk, kdim))
        qc = plgpu.load(q_ref.at[sl, hk, :], mask=mk, other=0).astype(dtype)   # [C, K]
        kc = plgpu.load(k_ref.at[sl, hk, :], mask=mk, other=0).astype(dtype)   # [C, K]
        w = w_ref[c, h, :, :]                                                  # [C, K]
        u = u_ref[c, h, :, vs].astype(jnp.float32)                             # [C, BV]
        aqk = aqk_ref[c, h, :, :]                                              # [C, C]
        gc = gcum_ref[c, h, :]                                                 # [C]
        glast = gcum_ref[c, h, chunk - 1]                                      # padded rows repeat G_last
        sb = s.astype(dtype)
        v_new = u - _dot(w, sb, precision=precision)                           # [C, BV]
        o = (scale * jnp.exp(gc))[:, None] * _dot(qc, sb, precision=precision)
        o = o + _dot(aqk, v_new.astype(dtype), precision=precision)
        mv = jnp.broadcast_to(valid[:, None], (chunk, block_v))
        plgpu.store(o_ref.at[sl, h, vs], o.astype(o_ref.dtype), mask=mv)
        vd = (v_new * jnp.exp(glast - gc)[:, None]).astype(dtype)
        return jnp.exp(glast) * s + _dot(kc, vd, ta=True, precision=precision)

    s = lax.fori_loop(0, count, body, s0)
    pool_out_ref[slot, h, :, vs] = s.astype(pool_out_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------
def gated_delta_rule_fwd_packed(q, k, v, g, beta, *, scale, pool, slot_ids, has_initial_state,
                                chunk_start, chunk_len, seq_first_chunk, seq_num_chunks, chunk,
                                block_v, interpret, num_warps=(4, 4), num_stages=(1, 2)):
    """Runs both stages on packed tokens.

    q, k [T', Hk, K]; v [T', Hv, V]; g, beta [T', Hv] (T' >= T: interpret mode pads C rows so that no masked
    slice runs past the end); pool [S, Hv, K, V] fp32 (aliased to the returned pool); slot_ids,
    has_initial_state [N] int32; chunk_start, chunk_len [NC]; seq_first_chunk, seq_num_chunks [N].
    Returns o [T', Hv, V] in v's dtype and the updated pool.
    """
    w, u, aqk, gcum = intra_chunk(q, k, v, g, beta, scale=scale, chunk_start=chunk_start, chunk_len=chunk_len,
                                  chunk=chunk, interpret=interpret, num_warps=num_warps[0],
                                  num_stages=num_stages[0])
    return state_pass(q, k, w, u, aqk, gcum, scale=scale, pool=pool, slot_ids=slot_ids,
                      has_initial_state=has_initial_state, chunk_start=chunk_start, chunk_len=chunk_len,
                      seq_first_chunk=seq_first_chunk, seq_num_chunks=seq_num_chunks, chunk=chunk,
                      block_v=block_v, interpret=interpret, num_warps=num_warps[1], num_stages=num_stages[1])


def intra_chunk(q, k, v, g, beta, *, scale, chunk_start, chunk_len, chunk, interpret, num_warps=4,
                num_stages=1):
    """Stage 1: returns w [NC, Hv, C, K], u [NC, Hv, C, V], Aqk [NC, Hv, C, C] (v's dtype), G [NC, Hv, C] fp32."""
    tp, hk, kdim = q.shape
    hv, vdim = v.shape[1], v.shape[2]
    group = hv // hk
    nc = chunk_start.shape[0]
    dtype = v.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    inter_dtype = dtype

    intra = pl.pallas_call(
        functools.partial(_intra_chunk_kernel, chunk=chunk, group=group, scale=scale, dtype=dtype,
                          precision=precision),
        grid=(nc, hv),
        out_shape=(
            jax.ShapeDtypeStruct((nc, hv, chunk, kdim), inter_dtype),      # w
            jax.ShapeDtypeStruct((nc, hv, chunk, vdim), inter_dtype),      # u
            jax.ShapeDtypeStruct((nc, hv, chunk, chunk), inter_dtype),     # Aqk
            jax.ShapeDtypeStruct((nc, hv, chunk), jnp.float32),            # G (cumulative gate)
        ),
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_intra_chunk",
    )
    return intra(chunk_start, chunk_len, q, k, v, g, beta)


def state_pass(q, k, w, u, aqk, gcum, *, scale, pool, slot_ids, has_initial_state, chunk_start, chunk_len,
               seq_first_chunk, seq_num_chunks, chunk, block_v, interpret, num_warps=4, num_stages=2):
    """Stage 2: returns (o [T', Hv, V], updated pool [S, Hv, K, V]); the pool is aliased in place."""
    tp, hk, kdim = q.shape
    hv, vdim = u.shape[1], u.shape[3]
    group = hv // hk
    n = slot_ids.shape[0]
    dtype = w.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    state = pl.pallas_call(
        functools.partial(_state_pass_kernel, chunk=chunk, group=group, block_v=block_v, scale=scale, dtype=dtype,
                          precision=precision),
        grid=(n, hv, vdim // block_v),
        out_shape=(
            jax.ShapeDtypeStruct((tp, hv, vdim), dtype),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ),
        input_output_aliases={12: 1},
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_state_pass",
    )
    return state(chunk_start, chunk_len, seq_first_chunk, seq_num_chunks, slot_ids, has_initial_state,
                 q, k, w, u, aqk, gcum, pool)
