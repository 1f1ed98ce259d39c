"""Pallas (Triton lowering) kernels for the chunked gated delta rule forward.

Three pallas_calls (four for varlen), in the order the algorithm reads (chunk C = 64, sub-blocks of 16):

1a. ``kkt_solve``   grid (NC, Hv), parallel, 1 warp (row reductions stay inside the warp), 16 x 16 blocks:
     G   = cumsum(g) inside the chunk                                   [C]      fp32
     A   = beta_i (k_i . k_j) exp(G_i - G_j), j < i                     [C, C]   fp32 (16 x 16 blocks)
     T   = (I + A)^-1: diagonal 16 x 16 blocks by forward substitution, off-diagonal blocks merged by
           T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj                      [C, C]   input dtype
1b. ``wu_aqk``      grid (NC, Hv), parallel, 4 warps, whole-chunk tiles:
     w   = T (beta exp(G) k)                                            [C, K]   input dtype
     u   = T (beta v)                                                   [C, V]   input dtype
     Aqk = scale (q_i . k_j) exp(G_i - G_j), j <= i                     [C, C]   input dtype
    Both skip padding chunk slots (chunk_len 0).
2.  ``state_pass``  grid (V / BV, Hv, N), serial over the chunks of one sequence, S [K, BV] fp32 in registers,
    the output fused in, 3-stage software pipeline on the tile loads (2 for fp32); sequences launched longest
    first (``seq_order``); final states to the aliased pool (slots API) or to a fresh [N, ...] (plain API);
    (``gdn_state_pass_persistent``, behind LaunchConfig.state_programs, off, not timed on a GPU: grid (P,), each
    program walking its share of the longest-first items with the next item's start state loaded ahead):
     v_new = u - w S
     o     = scale exp(G) (q S) + Aqk v_new
     S     = exp(G_last) S + k^T (exp(G_last - G) v_new)
3.  ``zero_tail``   varlen only: zeros the output rows of padding tokens (past cu_seqlens[N]).

Chunks never straddle a sequence boundary: chunk c covers tokens [chunk_start[c], chunk_start[c] + chunk_len[c])
of the packed token axis; rows past chunk_len are masked on load (zeros) and on store. A sequence's chunks are
consecutive slots, so the state pass reads its start and length once and addresses the loop affinely. The loop
over a sequence's chunks has a traced trip count (seq_num_chunks[n]), so one compiled program serves any lengths.

Shape legend: T packed tokens (B*T for dense input), N sequences, S slots, Hk/Hv heads (value head h reads key
head h // (Hv // Hk)), K/V head dims, C chunk size, NC = T // C + N chunk slots, BV value block.

Below the kernels: the entry points ``api.py`` calls (``chunk_gated_delta_rule_fwd``, ``..._slots_fwd``: dtype
promotion, head-dim padding, chunk map, launch config, no-autodiff guard) and ``check_supported``.

This module imports only jax (and the chunk map / reference of its own folder).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule.chunk_map import kernel_chunk_map, launch_order
# log-decays below G_FLOOR (-128) are raised to it on load in 1a: exp(g) is 0 in fp32 below -104 either way, and
# the floor keeps the chunk's cumulative gates finite (g = -inf, a hard reset, would give -inf - -inf = NaN)
from pallas_kernels.gated_delta_rule.reference import G_FLOOR, floor_log_decay  # noqa: F401

SUB = 16  # sub-block rows inside a chunk: the smallest dot Triton lowers


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of the three pallas_calls (H200 measurements chose the defaults: ``python -m benchmarks
    gdn``).

    solve_warps / solve_block_k: stage 1a's warps and the k columns it reads per step; wu_warps: stage 1b;
    block_v / state_warps / state_stages: stage 2's value block (None: chosen from the
    program count by _block_v), warps and software-pipelining depth (None: chosen by launch_config);
    state_programs: 0, one state-pass program per (value block, head, sequence) item; P > 0, a persistent state
    pass of P programs over the longest-first item list (``gdn_state_pass_persistent``: program p runs items
    p, 2P - 1 - p, 2P + p, ... (snake order, for balance) and loads the next item's start state before running the
    current one's chunks). Interpret-tested and cross-lowered to Triton IR on CPU, not timed on a GPU: off."""
    solve_warps: int = 1
    solve_block_k: int = 128
    wu_warps: int = 4
    block_v: int | None = None
    state_warps: int = 4
    state_stages: int | None = None
    state_programs: int = 0


def _compiler_params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(a, b, *, ta=False, tb=False, precision=None):
    """a @ b (a^T / b^T when asked) with fp32 accumulation."""
    dn = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return lax.dot_general(a, b, dn, precision=precision, preferred_element_type=jnp.float32)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _unit_lower_inverse_blocks(a_blk: dict, nb: int, precision) -> dict:
    """T = (I + A)^-1 of a strictly lower-triangular A held as 16 x 16 blocks a_blk[i, j] (j <= i): the diagonal
    blocks by forward substitution, then T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj. Returns {(i, j): block}, j <= i."""
    t_blk = {}
    for i in range(nb):
        t_blk[i, i] = _inv_unit_lower16(a_blk[i, i])
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            acc = _dot(a_blk[i, j], t_blk[j, j], precision=precision)
            for m in range(j + 1, i):
                acc = acc + _dot(a_blk[i, m], t_blk[m, j], precision=precision)
            t_blk[i, j] = -_dot(t_blk[i, i], acc, precision=precision)
    return t_blk


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
def _kkt_solve_kernel(start_ref, len_ref, k_ref, g_ref, beta_ref, t_ref, gcum_ref, *, chunk, group, dtype,
                      precision, merge_precision, block_k):
    """Stage 1a, grid (NC, Hv): G, A = beta k k^T decay and T = (I + A)^-1, all in 16 x 16 blocks (run with
    1-2 warps so that the row reductions of the forward substitution stay inside a warp). k is read block_k
    columns at a time. Writes T in the input dtype (zeros above the diagonal) and G fp32."""
    c = pl.program_id(0)
    h = pl.program_id(1)          # (program ids read outside pl.when: interpret mode cannot read them inside)
    length = len_ref[c]

    @pl.when(length > 0)          # padding chunk slots (length 0) are never read: compute and store nothing
    def _():
        _kkt_solve_body(c, h, start_ref[c], length, k_ref, g_ref, beta_ref, t_ref, gcum_ref,
                        chunk=chunk, group=group, dtype=dtype, precision=precision,
                        merge_precision=merge_precision, block_k=block_k)


def _gate_blocks(c, h, start, length, g_ref, beta_ref, gcum_ref, *, nb, tri16):
    """A chunk's gates in 16-row blocks, rows past ``length`` masked to 0: (valid [nb] of [16] bool, beta [nb] of
    [16] fp32, G [nb] of [16] fp32 cumulative log-decay over the chunk); G is also written to gcum_ref[c, h]."""
    valid, bb, gb = [], [], []
    off = jnp.float32(0.0)
    for b in range(nb):
        ok = b * SUB + lax.broadcasted_iota(jnp.int32, (SUB,), 0) < length
        sl = pl.ds(start + b * SUB, SUB)
        bb.append(plgpu.load(beta_ref.at[sl, h], mask=ok, other=0).astype(jnp.float32))
        g = floor_log_decay(plgpu.load(g_ref.at[sl, h], mask=ok, other=0).astype(jnp.float32))
        gc = off + jnp.sum(jnp.where(tri16, g[None, :], 0.0), axis=1)    # [16] cumulative gate
        off = off + jnp.sum(g)
        gb.append(gc)
        valid.append(ok)
        gcum_ref[c, h, pl.ds(b * SUB, SUB)] = gc
    return valid, bb, gb


def _kkt_solve_body(c, h, start, length, k_ref, g_ref, beta_ref, t_ref, gcum_ref, *, chunk, group, dtype,
                    precision, merge_precision, block_k):
    hk = h // group
    nb = chunk // SUB
    kdim = k_ref.shape[-1]

    tri16 = _iota((SUB, SUB), 1) <= _iota((SUB, SUB), 0)              # j <= i
    strict16 = _iota((SUB, SUB), 1) < _iota((SUB, SUB), 0)
    valid, bb, gb = _gate_blocks(c, h, start, length, g_ref, beta_ref, gcum_ref, nb=nb, tri16=tri16)

    # ---- k k^T in 16 x 16 blocks (lower block triangle), block_k columns of k at a time ----
    kk = {(i, j): jnp.zeros((SUB, SUB), jnp.float32) for i in range(nb) for j in range(i + 1)}
    for kc in range(0, kdim, block_k):
        bk = min(block_k, kdim - kc)
        kb = [plgpu.load(k_ref.at[pl.ds(start + b * SUB, SUB), hk, pl.ds(kc, bk)],
                         mask=jnp.broadcast_to(valid[b][:, None], (SUB, bk)), other=0).astype(dtype)
              for b in range(nb)]
        for i in range(nb):
            for j in range(i + 1):
                kk[i, j] = kk[i, j] + _dot(kb[i], kb[j], tb=True, precision=precision)
    a_blk = {}
    for i in range(nb):
        for j in range(i + 1):
            diff = gb[i][:, None] - gb[j][None, :]
            dec = jnp.exp(jnp.where(strict16, diff, -jnp.inf)) if i == j else jnp.exp(diff)
            a_blk[i, j] = bb[i][:, None] * kk[i, j] * dec

    # ---- T = (I + A)^-1: diagonal blocks by forward substitution, then T_ij = -T_ii sum_m A_im T_mj ----
    mp = merge_precision
    t_blk = _unit_lower_inverse_blocks(a_blk, nb, mp)
    for i in range(nb):
        for j in range(nb):
            blk = t_blk[i, j] if j <= i else jnp.zeros((SUB, SUB), jnp.float32)
            t_ref[c, h, pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = blk.astype(t_ref.dtype)


def _wu_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, beta_ref, t_ref, gcum_ref, w_ref, u_ref, aqk_ref, *,
               chunk, group, scale, dtype, precision):
    """Stage 1b, grid (NC, Hv), whole-chunk tiles: w = T (beta e^G k), u = T (beta v),
    Aqk = scale (q k^T) e^(G_i - G_j) (lower, diagonal included). Padding chunk slots (length 0) store nothing."""
    c = pl.program_id(0)
    h = pl.program_id(1)
    length = len_ref[c]

    @pl.when(length > 0)
    def _():
        _wu_body(c, h, start_ref[c], length, q_ref, k_ref, v_ref, beta_ref, t_ref, gcum_ref, w_ref,
                 u_ref, aqk_ref, chunk=chunk, group=group, scale=scale, dtype=dtype, precision=precision)


def _wu_body(c, h, start, length, q_ref, k_ref, v_ref, beta_ref, t_ref, gcum_ref, w_ref, u_ref, aqk_ref, *,
             chunk, group, scale, dtype, precision):
    hk = h // group
    kdim = k_ref.shape[-1]
    vdim = v_ref.shape[-1]
    sl = pl.ds(start, chunk)
    valid = lax.broadcasted_iota(jnp.int32, (chunk,), 0) < length
    mk = jnp.broadcast_to(valid[:, None], (chunk, kdim))
    q = plgpu.load(q_ref.at[sl, hk, :], mask=mk, other=0).astype(dtype)                       # [C, K]
    k = plgpu.load(k_ref.at[sl, hk, :], mask=mk, other=0).astype(dtype)                       # [C, K]
    v = plgpu.load(v_ref.at[sl, h, :], mask=jnp.broadcast_to(valid[:, None], (chunk, vdim)),
                   other=0).astype(dtype)                                                     # [C, V]
    beta = plgpu.load(beta_ref.at[sl, h], mask=valid, other=0).astype(jnp.float32)            # [C]
    t = t_ref[c, h, :, :]                                                                     # [C, C]
    gc = gcum_ref[c, h, :]                                                                    # [C]

    kbeta = (k.astype(jnp.float32) * (beta * jnp.exp(gc))[:, None]).astype(dtype)
    vbeta = (v.astype(jnp.float32) * beta[:, None]).astype(dtype)
    w_ref[c, h, :, :] = _dot(t, kbeta, precision=precision).astype(w_ref.dtype)
    u_ref[c, h, :, :] = _dot(t, vbeta, precision=precision).astype(u_ref.dtype)

    lower = _iota((chunk, chunk), 1) <= _iota((chunk, chunk), 0)
    decay = jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], -jnp.inf))
    aqk_ref[c, h, :, :] = (scale * _dot(q, k, tb=True, precision=precision) * decay).astype(aqk_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: serial state pass over each sequence's chunks, output fused
# ----------------------------------------------------------------------------------------------------------------
def _run_sequence(h, vs, first, count, s, start_ref, len_ref, q_ref, k_ref, w_ref, u_ref, aqk_ref, gcum_ref,
                  o_ref, *, chunk, group, scale, dtype, precision):
    """The ``count`` chunks of one sequence (chunk slots first, first + 1, ...) on value head h's columns ``vs``
    from the [K, BV] fp32 state ``s``: stores o's rows, returns the final state. count 0 returns ``s``."""
    hk = h // group
    kdim = k_ref.shape[-1]
    block_v = s.shape[-1]
    rows = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    # A sequence's chunks are consecutive slots covering consecutive tokens: read its start and length once, so
    # that every address in the loop is affine in j (no scalar load on the path of the pipelined tile loads).
    last_slot = start_ref.shape[0] - 1
    seq_start = start_ref[jnp.minimum(first, last_slot)]
    seq_len = (count - 1) * chunk + len_ref[jnp.clip(first + count - 1, 0, last_slot)]

    def body(j, s):
        c = first + j
        valid = rows < seq_len - j * chunk
        sl = pl.ds(seq_start + j * chunk, chunk)
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

    return lax.fori_loop(0, count, body, s)


def _state_pass_kernel(start_ref, len_ref, first_ref, nchunks_ref, order_ref, slot_ref, has_ref,
                       q_ref, k_ref, w_ref, u_ref, aqk_ref, gcum_ref, pool_in_ref,
                       o_ref, pool_out_ref, *, chunk, group, block_v, scale, dtype, precision, final):
    """Grid (V / BV, Hv, N): the V blocks of one (sequence, head) are neighbours in launch order (they read the same
    q, k, w, Aqk tiles), and the sequence axis goes slowest through ``order`` (longest first), so that the long
    serial loops start first and short ones fill in behind them instead of one long loop running alone at the end.
    ``final``: where the final state goes: "slot" pool_out[slot] (the pool, aliased; ids outside [0, S) drop it),
    "seq" pool_out[n] (a fresh [N, Hv, K, V] array: the plain API, whose initial states are not donated, so that
    aliasing them would cost XLA a copy of the whole pool), "none" nowhere (output_final_state=False)."""
    vblk = pl.program_id(0)
    h = pl.program_id(1)
    n = order_ref[pl.program_id(2)]
    kdim = k_ref.shape[-1]
    vs = pl.ds(vblk * block_v, block_v)
    s0, in_pool, read_slot = load_start_state(pool_in_ref, slot_ref, has_ref, n, h, vs, kdim=kdim, block_v=block_v)
    s = _run_sequence(h, vs, first_ref[n], nchunks_ref[n], s0, start_ref, len_ref, q_ref, k_ref, w_ref, u_ref,
                      aqk_ref, gcum_ref, o_ref, chunk=chunk, group=group, scale=scale, dtype=dtype,
                      precision=precision)

    store_final_state(final, s, pool_out_ref, n, h, vs, in_pool=in_pool, read_slot=read_slot)


def load_start_state(pool_in_ref, slot_ref, has_ref, n, h, vs, *, kdim: int, block_v: int):
    """A sequence's start state from the slot pool, for the Pallas Triton kernels that walk one (sequence, head,
    V block) (the chunked state pass and recurrent_varlen.py): (S [K, BV] fp32, in_pool, read_slot).
    An id outside [0, S) names no slot (in_pool False: read zeros, drop the write; never wrap, never clamp onto a
    slot); read_slot is the clipped id for addressing. A fresh sequence (has_ref[n] 0) or an id naming no
    slot loads nothing: the load is masked off (no memory traffic) and reads zeros, a select, so a NaN stale slot
    never enters (never a multiply)."""
    num_slots = pool_in_ref.shape[0]
    slot = slot_ref[n]
    in_pool = (slot >= 0) & (slot < num_slots)
    read_slot = jnp.clip(slot, 0, num_slots - 1)
    read = jnp.broadcast_to((has_ref[n] != 0) & in_pool, (kdim, block_v))
    s0 = plgpu.load(pool_in_ref.at[read_slot, h, :, vs], mask=read, other=0.0).astype(jnp.float32)
    return s0, in_pool, read_slot


def store_final_state(final: str, s, pool_out_ref, n, h, vs, *, in_pool, read_slot):
    """Where a sequence's final state S [K, BV] goes (``final``): "slot" pool_out[slot] (the pool, aliased; an id
    outside [0, S) drops it), "seq" pool_out[n] (a fresh [N, Hv, K, V] array), "none" nowhere."""
    if final == "slot":
        @pl.when(in_pool)
        def _():
            pool_out_ref[read_slot, h, :, vs] = s.astype(pool_out_ref.dtype)
    elif final == "seq":
        pool_out_ref[n, h, :, vs] = s.astype(pool_out_ref.dtype)


def persistent_item(p, r, num_programs):
    """The item (index into the longest-first item list) that program p of ``num_programs`` runs in its round r:
    snake order, r P + p in even rounds and r P + P - 1 - p in odd ones, so that over the rounds every program gets
    a mix of long and short items (round robin would give program 0 the longest item of every round)."""
    return r * num_programs + jnp.where(lax.rem(r, 2) == 0, p, num_programs - 1 - p)   # r >= 0: rem, not %


def _state_pass_persistent_kernel(start_ref, len_ref, first_ref, nchunks_ref, order_ref, slot_ref, has_ref,
                                  q_ref, k_ref, w_ref, u_ref, aqk_ref, gcum_ref, pool_in_ref,
                                  o_ref, pool_out_ref, *, chunk, group, block_v, scale, dtype, precision, final,
                                  num_programs, rounds):
    """Grid (P,): the items b = (sequence order[b // (Hv NVB)], head (b // NVB) % Hv, value block b % NVB) of the
    longest-first list, program p running ``persistent_item(p, r, P)`` for r = 0 .. rounds - 1. Before running an
    item's chunks it issues the masked load of its next item's start state, so that load (the whole cost of a
    one-chunk item's first step, with one program per SM) is in flight while the current item computes. Items
    past the end (the last round) are masked: no chunk, no load, no store. ``final`` as in _state_pass_kernel."""
    num_slots, hv, kdim, vdim = pool_in_ref.shape
    nvb = vdim // block_v
    total = order_ref.shape[0] * hv * nvb
    pid = pl.program_id(0)                      # read outside the loops (interpret mode needs it there)

    def locate(r):
        b = persistent_item(pid, r, num_programs)
        valid = b < total
        b = jnp.minimum(b, total - 1)
        n = order_ref[b // (nvb * hv)]
        h = (b // nvb) % hv
        vs = pl.ds((b % nvb) * block_v, block_v)
        slot = slot_ref[n]
        in_pool = valid & (slot >= 0) & (slot < num_slots)   # an id outside [0, S): zeros in, no write
        return valid, n, h, vs, in_pool, jnp.clip(slot, 0, num_slots - 1)

    def load(r):
        _, n, h, vs, in_pool, read_slot = locate(r)
        read = in_pool & (has_ref[n] != 0)      # else masked: zeros, no bytes read, a stale NaN never enters
        return plgpu.load(pool_in_ref.at[read_slot, h, :, vs], mask=jnp.broadcast_to(read, (kdim, block_v)),
                          other=0).astype(jnp.float32)

    def item(r, s):
        s_next = load(r + 1)                    # issued before this item's chunks and stores
        valid, n, h, vs, in_pool, read_slot = locate(r)
        count = jnp.where(valid, nchunks_ref[n], 0)
        s = _run_sequence(h, vs, first_ref[n], count, s, start_ref, len_ref, q_ref, k_ref, w_ref, u_ref,
                          aqk_ref, gcum_ref, o_ref, chunk=chunk, group=group, scale=scale, dtype=dtype,
                          precision=precision)
        if final == "slot":
            plgpu.store(pool_out_ref.at[read_slot, h, :, vs], s.astype(pool_out_ref.dtype),
                        mask=jnp.broadcast_to(in_pool, (kdim, block_v)))
        elif final == "seq":
            plgpu.store(pool_out_ref.at[n, h, :, vs], s.astype(pool_out_ref.dtype),
                        mask=jnp.broadcast_to(valid, (kdim, block_v)))
        return s_next

    lax.fori_loop(0, rounds, item, load(0))


def _zero_tail_kernel(cu_last_ref, o_in_ref, o_ref, *, chunk, total):
    """Zeros rows [cu_last, total) of o (padding tokens, which no state-pass program stores); programs whose block
    of rows holds no padding store nothing."""
    i = pl.program_id(0)
    h = pl.program_id(1)
    cu_last = cu_last_ref[0]
    vdim = o_ref.shape[-1]
    rows = i * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    @pl.when((i + 1) * chunk > cu_last)
    def _():
        pad = jnp.broadcast_to(((rows >= cu_last) & (rows < total))[:, None], (chunk, vdim))
        plgpu.store(o_ref.at[pl.ds(i * chunk, chunk), h, :], jnp.zeros((chunk, vdim), o_ref.dtype), mask=pad)


def zero_tail(o, cu_last, *, total, chunk, interpret):
    """o [T', Hv, V] with rows cu_last <= row < total (cu_last int32 [1]; total <= T' static) set to zero, in place
    (o is aliased). Blocks of ``chunk`` rows start below ``total``, so with T' >= total + chunk - 1 (the interpret
    padding) no block runs past the end."""
    hv = o.shape[1]
    operands = dict(cu_last=cu_last, o=o)
    call = pl.pallas_call(
        functools.partial(_zero_tail_kernel, chunk=chunk, total=total),
        grid=(pl.cdiv(total, chunk), hv),
        out_shape=jax.ShapeDtypeStruct(o.shape, o.dtype),
        input_output_aliases={list(operands).index("o"): 0},
        compiler_params=_compiler_params(4, 1), interpret=interpret, name="gdn_zero_tail")
    return call(*operands.values())


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------
def _precisions(dtype):
    """(dot precision, T-merge precision): bf16/fp16 operands with fp32 accumulation and tf32 merge dots for
    bf16/fp16 inputs (T is rounded to the input dtype next anyway); IEEE fp32 everywhere for fp32 inputs."""
    if dtype == jnp.float32:
        return lax.Precision.HIGHEST, lax.Precision.HIGHEST
    return None, (lax.Precision.DEFAULT, lax.Precision.DEFAULT)


def gated_delta_rule_fwd_packed(q, k, v, g, beta, *, scale, pool, slot_ids, has_initial_state,
                                chunk_start, chunk_len, seq_first_chunk, seq_num_chunks, chunk,
                                interpret, config: LaunchConfig, seq_order=None, final="slot"):
    """Runs the three stages on packed tokens.

    q, k [T', Hk, K]; v [T', Hv, V]; g, beta [T', Hv] (T' >= T: interpret mode pads C rows so that no masked
    slice runs past the end); pool [S, Hv, K, V] fp32; slot_ids, has_initial_state [N] int32; chunk_start,
    chunk_len [NC]; seq_first_chunk, seq_num_chunks, seq_order [N] (launch order, see ``state_pass``).
    config.block_v must be set. Returns o [T', Hv, V] in v's dtype and the final states as ``state_pass``'s
    ``final`` says: the updated pool [S, Hv, K, V] (aliased, "slot"), a fresh [N, Hv, K, V] ("seq"), or a
    placeholder ("none").
    """
    w, u, aqk, gcum = intra_chunk(q, k, v, g, beta, scale=scale, chunk_start=chunk_start, chunk_len=chunk_len,
                                  chunk=chunk, interpret=interpret, config=config)
    return state_pass(q, k, w, u, aqk, gcum, scale=scale, pool=pool, slot_ids=slot_ids,
                      has_initial_state=has_initial_state, chunk_start=chunk_start, chunk_len=chunk_len,
                      seq_first_chunk=seq_first_chunk, seq_num_chunks=seq_num_chunks, chunk=chunk,
                      interpret=interpret, config=config, seq_order=seq_order, final=final)


def kkt_solve(k, g, beta, *, chunk_start, chunk_len, chunk, num_v_heads, interpret, config: LaunchConfig):
    """Stage 1a: returns T = (I + A)^-1 [NC, Hv, C, C] (k's dtype, zeros above the diagonal), G [NC, Hv, C] fp32."""
    hk, kdim = k.shape[1], k.shape[2]
    nc = chunk_start.shape[0]
    dtype = k.dtype
    precision, merge_precision = _precisions(dtype)
    call = pl.pallas_call(
        functools.partial(_kkt_solve_kernel, chunk=chunk, group=num_v_heads // hk, dtype=dtype,
                          precision=precision, merge_precision=merge_precision,
                          block_k=min(config.solve_block_k, kdim)),
        grid=(nc, num_v_heads),
        out_shape=(jax.ShapeDtypeStruct((nc, num_v_heads, chunk, chunk), dtype),      # T
                   jax.ShapeDtypeStruct((nc, num_v_heads, chunk), jnp.float32)),       # G
        compiler_params=_compiler_params(config.solve_warps, 1), interpret=interpret, name="gdn_kkt_solve")
    return call(chunk_start, chunk_len, k, g, beta)


def wu_aqk(q, k, v, beta, t, gcum, *, scale, chunk_start, chunk_len, chunk, interpret, config: LaunchConfig):
    """Stage 1b: returns w [NC, Hv, C, K], u [NC, Hv, C, V], Aqk [NC, Hv, C, C], all in v's dtype."""
    hk, kdim = q.shape[1], q.shape[2]
    hv, vdim = v.shape[1], v.shape[2]
    nc = chunk_start.shape[0]
    dtype = v.dtype
    precision, _ = _precisions(dtype)
    call = pl.pallas_call(
        functools.partial(_wu_kernel, chunk=chunk, group=hv // hk, scale=scale, dtype=dtype, precision=precision),
        grid=(nc, hv),
        out_shape=(jax.ShapeDtypeStruct((nc, hv, chunk, kdim), dtype),       # w
                   jax.ShapeDtypeStruct((nc, hv, chunk, vdim), dtype),       # u
                   jax.ShapeDtypeStruct((nc, hv, chunk, chunk), dtype)),     # Aqk
        compiler_params=_compiler_params(config.wu_warps, 1), interpret=interpret, name="gdn_wu_aqk")
    return call(chunk_start, chunk_len, q, k, v, beta, t, gcum)


def intra_chunk(q, k, v, g, beta, *, scale, chunk_start, chunk_len, chunk, interpret, config: LaunchConfig):
    """Stages 1a + 1b: returns w, u, Aqk (v's dtype) and G [NC, Hv, C] fp32."""
    t, gcum = kkt_solve(k, g, beta, chunk_start=chunk_start, chunk_len=chunk_len, chunk=chunk,
                        num_v_heads=v.shape[1], interpret=interpret, config=config)
    w, u, aqk = wu_aqk(q, k, v, beta, t, gcum, scale=scale, chunk_start=chunk_start, chunk_len=chunk_len,
                       chunk=chunk, interpret=interpret, config=config)
    return w, u, aqk, gcum


def state_pass(q, k, w, u, aqk, gcum, *, scale, pool, slot_ids, has_initial_state, chunk_start, chunk_len,
               seq_first_chunk, seq_num_chunks, chunk, interpret, config: LaunchConfig, seq_order=None,
               final: str = "slot"):
    """Stage 2: returns (o [T', Hv, V], final states). Sequence n reads pool[slot_ids[n]] (zeros where
    has_initial_state[n] is 0 or the id is outside [0, S)). ``final``: "slot" the pool [S, Hv, K, V] updated in
    place (input_output_aliases); "seq" a fresh [N, Hv, K, V] array of the N final states; "none" no final
    state (a [1, 1, 1, 1] placeholder). ``seq_order`` [N] int32: the order in which sequences are launched (a
    permutation; default 0..N-1; ``chunk_map.launch_order`` gives longest first). ``config.state_programs`` P > 0:
    one persistent program per P items instead of one program per (value block, head, sequence) item (at most
    N Hv V / BV programs), same results."""
    tp, hk, kdim = q.shape
    hv, vdim = u.shape[1], u.shape[3]
    n = slot_ids.shape[0]
    dtype = w.dtype
    precision, _ = _precisions(dtype)
    block_v = config.block_v
    if block_v is None or vdim % block_v:
        raise ValueError(f"config.block_v must divide V={vdim}; got {block_v}")
    if seq_order is None:
        seq_order = jnp.arange(n, dtype=jnp.int32)
    operands = dict(chunk_start=chunk_start, chunk_len=chunk_len, seq_first_chunk=seq_first_chunk,
                    seq_num_chunks=seq_num_chunks, seq_order=seq_order, slot_ids=slot_ids,
                    has_initial_state=has_initial_state, q=q, k=k, w=w, u=u, aqk=aqk, gcum=gcum,
                    pool=pool)                                                   # the kernel's ref order
    if final not in ("slot", "seq", "none"):
        raise ValueError(f"final must be 'slot', 'seq' or 'none'; got {final!r}")
    final_shape = {"slot": pool.shape, "seq": (n,) + pool.shape[1:], "none": (1, 1, 1, 1)}[final]
    common = dict(chunk=chunk, group=hv // hk, block_v=block_v, scale=scale, dtype=dtype, precision=precision,
                  final=final)
    items = n * hv * (vdim // block_v)
    if config.state_programs < 0:
        raise ValueError(f"config.state_programs must be >= 0; got {config.state_programs}")
    if config.state_programs and items:
        programs = min(config.state_programs, items)
        kernel = functools.partial(_state_pass_persistent_kernel, num_programs=programs,
                                   rounds=-(-items // programs), **common)
        grid, name = (programs,), "gdn_state_pass_persistent"
    else:
        kernel = functools.partial(_state_pass_kernel, **common)
        grid, name = (vdim // block_v, hv, n), "gdn_state_pass"
    call = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=(
            jax.ShapeDtypeStruct((tp, hv, vdim), dtype),
            jax.ShapeDtypeStruct(final_shape, pool.dtype),
        ),
        input_output_aliases={list(operands).index("pool"): 1} if final == "slot" else {},   # pool in place
        compiler_params=_compiler_params(config.state_warps, config.state_stages),
        interpret=interpret,
        name=name,
    )
    return call(*operands.values())


# ----------------------------------------------------------------------------------------------------------------
# What the kernels take, launch parameters, entry points (called by api.py after validation)
# ----------------------------------------------------------------------------------------------------------------
GPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
GPU_HEAD_DIMS = (16, 32, 64, 128)   # the dims the kernels are compiled for; others up to 128 are zero-padded
MAX_HEAD_DIM = GPU_HEAD_DIMS[-1]    # 256 not yet compiled/tested on the H200


def kernel_head_dim(d: int) -> int:
    """The head dim the kernels run for a head dim ``d`` <= MAX_HEAD_DIM: the smallest of GPU_HEAD_DIMS >= d.
    q, k (K) and v (V) and the state are zero-padded to it inside the entry points; zero rows of k and zero
    columns of v leave the rule on the real dims unchanged (q . k and S^T k do not see them, the padded state
    rows / columns stay zero), and the output is sliced back."""
    return next(x for x in GPU_HEAD_DIMS if x >= d)


def compute_dtype(q, v):
    """The one dtype the kernels take: q, k and v promoted together (bf16 v with fp32 q runs in fp32)."""
    return jnp.promote_types(q.dtype, v.dtype)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def supported(q, k, v, *, interpret: bool) -> tuple[bool, str]:
    """(ok, reason): whether the Pallas kernel runs these inputs (see :func:`check_supported`)."""
    try:
        check_supported(q, k, v, interpret=interpret)
    except ValueError as err:
        return False, str(err)
    return True, ""


def check_supported(q, k, v, *, interpret: bool) -> None:
    """Raises ValueError naming the limit when the Pallas kernel cannot run these inputs.

    q, k, v floating ({bfloat16, float16, float32}; promoted to one dtype by the entry points); K and V at most
    MAX_HEAD_DIM = 128 (dims that are not one of GPU_HEAD_DIMS are zero-padded to the next one); Hv a multiple of
    Hk. backend "pallas" (interpret False) needs a GPU; interpret mode runs the same kernels anywhere.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have one shape [B, T, Hk, K]; got q {q.shape}, k {k.shape}")
    if v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"v must be [B, T, Hv, V] with Hv a multiple of Hk={q.shape[2]}; got v {v.shape}")
    if any(jnp.dtype(x.dtype) not in GPU_DTYPES for x in (q, k, v)):
        raise ValueError(
            "pallas gated delta rule: q, k, v must be floating, each one of {bfloat16, float16, float32}; "
            f"got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    kd, vd = q.shape[3], v.shape[3]
    if kd > MAX_HEAD_DIM or vd > MAX_HEAD_DIM:
        raise ValueError(
            f"pallas gated delta rule: head dims K (got {kd}) and V (got {vd}) must each be at most {MAX_HEAD_DIM} "
            f"(the kernels run {GPU_HEAD_DIMS}, smaller dims are zero-padded); use backend='xla' for larger heads")
    if not interpret and not _has_gpu():
        raise ValueError(
            "backend 'pallas' needs a CUDA GPU (Pallas Triton lowering) and none is visible; "
            "use backend='xla', or 'pallas_interpret' to run the same kernel in interpret mode on CPU")


def no_autodiff(fn):
    """fn with a JVP rule that raises: the Pallas kernels have no backward pass yet, and without this jax.grad
    fails deep inside pallas_call with an empty AssertionError."""
    wrapped = jax.custom_jvp(fn)

    @wrapped.defjvp
    def _jvp(primals, tangents):
        raise NotImplementedError(
            "the Pallas gated delta rule kernels (backend='pallas' / 'pallas_interpret') have no backward pass: "
            "use backend='xla' to differentiate (jax.grad / jax.jvp)")
    return wrapped


def _block_v(vdim: int, programs_per_vblock: int) -> int:
    """V block of the state pass: 64 when that still gives >= 256 programs (e.g. 16 streams x 32 heads), else 32
    (B1-T8192-Hk16-Hv32: 128 programs of BV 32 beat 64 of BV 64, 0.200 vs 0.250 ms); at least 16 (Triton dots)."""
    if vdim <= 32:
        return vdim
    bv = 64 if programs_per_vblock * (vdim // 64) >= 256 else 32
    return min(bv, vdim)


def launch_config(vdim: int, programs_per_vblock: int, dtype=jnp.bfloat16, base: LaunchConfig = None) -> LaunchConfig:
    """The launch parameters of one call, fixed when the call is built (never read from the environment while
    tracing): ``base`` (default LaunchConfig()) with block_v from ``_block_v`` where base leaves it None, and
    state_stages, where base leaves it None, 3 for bf16 / fp16 inputs and 2 for fp32 (3 stages of fp32 tiles need
    257 KB of shared memory, over the H200's 227 KB). 1 or 2 stages did not win on short sequences either
    (serve256 state pass, BV 64: 1.19 / 1.36 / 1.19 ms for 1 / 2 / 3 stages). Sweeps pass their own ``base``."""
    cfg = base or LaunchConfig()
    if cfg.block_v is None:
        cfg = dataclasses.replace(cfg, block_v=_block_v(vdim, programs_per_vblock))
    if cfg.state_stages is None:
        cfg = dataclasses.replace(cfg, state_stages=2 if jnp.dtype(dtype).itemsize > 2 else 3)
    return cfg


def pad_last(x, size):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _run(q, k, v, g, beta, *, scale, pool, slot_ids, has_initial_state, cu_seqlens, chunk_map, chunk_size,
         interpret, config, final="slot"):
    """The entry points' common path; ``final`` as in ``state_pass`` (the returned state is None for "none")."""
    b, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    if chunk_size % SUB != 0:
        raise ValueError(f"chunk_size must be a multiple of {SUB} for the Pallas kernels; got {chunk_size}")
    if scale is None:
        scale = kdim ** -0.5
    n = slot_ids.shape[0]
    out_dtype = v.dtype
    if b == 0:           # no rows, no sequences: nothing to run, the pool is unchanged
        return jnp.zeros(v.shape, out_dtype), (None if final == "none" else pool[:n] if final == "seq" else pool)
    dtype = compute_dtype(q, v)
    kp, vp = kernel_head_dim(kdim), kernel_head_dim(vdim)
    q, k = pad_last(q.astype(dtype), kp), pad_last(k.astype(dtype), kp)
    v = pad_last(v.astype(dtype), vp)
    padded_pool = (kp, vp) != (kdim, vdim)
    if padded_pool:
        pool = jnp.pad(pool, [(0, 0), (0, 0), (0, kp - kdim), (0, vp - vdim)])
    start, length, first, num = kernel_chunk_map(b, t, cu_seqlens, chunk_size, chunk_map)
    # varlen: longest sequences first (dense rows are all equal: the identity)
    order = jnp.arange(n, dtype=jnp.int32) if cu_seqlens is None else launch_order(num)
    tt = b * t
    qf = q.reshape(tt, hk, kp)
    kf = k.reshape(tt, hk, kp)
    vf = v.reshape(tt, hv, vp)
    gf = g.reshape(tt, hv).astype(jnp.float32)
    bf = beta.reshape(tt, hv)
    if interpret:
        # Interpret mode clamps out-of-range dynamic slices (which would shift the rows under the mask); pad C
        # rows so that every chunk's [start, start + C) slice is in range. On the GPU masked loads need no pad.
        pad = lambda x: jnp.pad(x, [(0, chunk_size)] + [(0, 0)] * (x.ndim - 1))
        qf, kf, vf, gf, bf = (pad(x) for x in (qf, kf, vf, gf, bf))
    config = launch_config(vp, n * hv, dtype, base=config)
    varlen = cu_seqlens is not None
    cu_last = cu_seqlens[-1:].astype(jnp.int32) if varlen else jnp.full((1,), tt, jnp.int32)

    def kernels(qf, kf, vf, gf, bf, pool, slot_ids, has, start, length, first, num, order, cu_last):
        o, new_pool = gated_delta_rule_fwd_packed(
            qf, kf, vf, gf, bf, scale=float(scale), pool=pool, slot_ids=slot_ids, has_initial_state=has,
            chunk_start=start, chunk_len=length, seq_first_chunk=first, seq_num_chunks=num, chunk=chunk_size,
            interpret=interpret, config=config, seq_order=order, final=final)
        if varlen and tt > 0:
            # tokens past cu_seqlens[N] are padding: no chunk holds them, so no program stored their rows
            o = zero_tail(o, cu_last, total=tt, chunk=chunk_size, interpret=interpret)
        return o, new_pool

    o, new_pool = no_autodiff(kernels)(
        qf, kf, vf, gf, bf, pool, slot_ids.astype(jnp.int32), has_initial_state.astype(jnp.int32), start, length,
        first, num, order, cu_last)
    o = o[:tt].reshape(b, t, hv, vp)[..., :vdim].astype(out_dtype)
    if final == "none":
        return o, None
    if padded_pool:
        new_pool = new_pool[:, :, :kdim, :vdim]
    return o, new_pool


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, chunk_map,
                               output_final_state, chunk_size=64, interpret=False, config: LaunchConfig = None):
    """Chunked gated delta rule forward (Pallas). Returns (o [B, T, Hv, V], final_state [N, Hv, K, V] or None).

    initial_state [N, Hv, K, V] fp32 or None (zeros); N = B for dense input, len(cu_seqlens) - 1 otherwise.
    """
    b, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        # no start state to read: a one-slot placeholder (ids 1.. name no slot, has = 0 reads zeros anyway)
        pool = jnp.zeros((min(n, 1), hv, kdim, vdim), jnp.float32)
        has = jnp.zeros((n,), jnp.int32)
    else:
        pool = initial_state.astype(jnp.float32)
        has = jnp.ones((n,), jnp.int32)
    # the final states go to a fresh array (aliasing a non-donated initial_state would cost a copy of all of it)
    return _run(q, k, v, g, beta, scale=scale, pool=pool, slot_ids=jnp.arange(n, dtype=jnp.int32),
                has_initial_state=has, cu_seqlens=cu_seqlens, chunk_map=chunk_map, chunk_size=chunk_size,
                interpret=interpret, config=config, final="seq" if output_final_state else "none")


def chunk_gated_delta_rule_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state,
                                     cu_seqlens, chunk_map, chunk_size=64, interpret=False,
                                     config: LaunchConfig = None):
    """Chunked gated delta rule forward over a state-slot pool. Returns (o [B, T, Hv, V], new_ssm_state [S, ...]).

    Sequence n reads ssm_state[slot_ids[n]] (zeros where has_initial_state[n] is False, whatever the slot holds)
    and writes its final state back to that slot; other slots keep their values. ssm_state is aliased to the
    output (input_output_aliases), so a donated pool updates in place. slot_ids must be distinct.
    """
    return _run(q, k, v, g, beta, scale=scale, pool=ssm_state, slot_ids=slot_ids,
                has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, chunk_map=chunk_map,
                chunk_size=chunk_size, interpret=interpret, config=config)
