# Copyright 2026 KarLex AI, Inc.
# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
# The kernel body of fused_state_pass and the helpers marked "(jla)" are adapted from jax-linear-attention 0.1.0
# (Apache-2.0), jla/ops/mosaic_gpu/scalar_gate_fused.py (fused_fwd_wy) and jla/ops/mosaic_gpu/_common.py, which
# were themselves adapted from flash-linear-attention (MIT) and FlashQLA (MIT). See NOTICE in this folder.
"""Mosaic GPU (Hopper, sm_90) backend of the chunked gated delta rule forward, dense prefill: the op's backend
"mosaic_gpu" (api.py's dispatch table routes here, and "auto" picks it for the calls it takes on a Hopper GPU,
from the H200 measurements in NOTES.md). JLA_STUDY.md has the port plan and the measured stages.

Two kernels and a little XLA glue:
  * stage 1a, :func:`kkt_fwd` (port plan step 2, jla's kkt_fwd): the gate-free T0 = (I + A0)^-1,
    A0_ij = beta_i k_i.k_j (j < i), 16 x 16 diagonal blocks by forward substitution, merged on the tensor cores;
    T0 [B, Hv, Tp, C] in the input dtype. (``stage1a="triton"``: Pallas Triton ``kkt_solve``'s gated T instead,
    the session-5 port.)
  * :func:`fused_state_pass` (step 1, jla's fused_fwd_wy): stages 1b + 2 of gated_delta_rule/triton/chunk.py in one
    warp-specialised kernel that builds the WY factors inside the chunk loop. With T = T0 * e^(G_i - G_j) (the
    gates enter A as a diagonal similarity) the WY identity reads

        v_new = u - w S = T diag(beta) (v - diag(e^G) k S) = Ag (v - Gamma k S),    Ag_ij = T_ij beta_j

    One CTA per (sequence piece, value head, 64 value columns), three warpgroups (128 threads each):
      WG0 (state)  S^T [BV, K] fp32 in registers (WGMMA layout); per chunk: publish S^T (input dtype) to SMEM,
                   X^T = S^T k^T (wgmma), W^T = v^T - X^T Gamma, v_new^T = W^T Ag^T (wgmma), publish v_new^T,
                   S^T <- e^(G_last) S^T + (e^(G_last - G) v_new)^T k (wgmma). The only serial chain.
      WG1 (output) Ag = T0 * e^(G_i - G_j) * beta_j in place of T0 in SMEM (before WG0 needs it),
                   P = (q k^T) * e^(G_i - G_j) (i >= j), then o = scale (e^G (q S) + P v_new) from the published
                   tiles, staged and stored by TMA.
      WG2 (memory) streams q, k (key head h // (Hv / Hk)), v, T0 and the gate / beta vectors by TMA into a
                   2-4 stage ring (as deep as 220 KB of SMEM allows: 2 at K = V = 128 bf16).
  * the sequence split (step 3, jla's piece maps, :func:`split_pieces` decides; ``MosaicConfig.pieces``): where
    B Hv V / 64 CTAs leave the SMs idle, each row is cut into P pieces run side by side; their start states come
    from one state-map pass over pieces 0 .. P - 2 (a piece's map is affine, S_end = M S_start + E:
    ``mosaic_gpu_split.state_map_pass``, a state-only kernel carrying [M | E] with u read in place; the first
    piece walked from the initial state itself) and a scan over the pieces (``mosaic_gpu_split.piece_scan``:
    one Pallas Triton launch with tf32 products; at 2 pieces an XLA stack, no product).

Scope (dense rows here; packed sequences and the slot pool in ``gated_delta_rule/mosaic_gpu/varlen.py``, which lays them out for
the same kernels: the fused pass's ``walk`` table): q, k, v bf16 / fp16 of one dtype, K and V in {64, 128}, Hv a
multiple of Hk, any T (padded with zero tokens to a multiple of C * P: zero k, v, beta and g leave the state and
the real rows unchanged), g floored at G_FLOOR as the other backends do, initial state [B, Hv, K, V] fp32 or None,
the final state returned. Not here (api.py runs Pallas Triton with a warning naming the reason,
:func:`fallback_reason`): fp32 inputs, other head dims, chunk sizes other than 64, a GPU other than sm_90;
JLA_STUDY.md step 4 says what each needs. Mosaic GPU kernels do not run in interpret mode on this repo's CPU
jax (0.10.2; the code targets 0.11's Pallas Mosaic GPU API): each kernel has a jnp twin
(:func:`kkt_fwd_reference`, :func:`fused_state_pass_reference`) that the CPU tests check against float64; the
kernels' tests are GPU-marked.

Shape legend: B batch, T tokens (Tp padded), Hk / Hv key / value heads, K / V head dims, C = 64 chunk,
NC = B * Tp / C chunks, BV = 64 value columns per CTA, P pieces per row (R of them run by a pass).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

C = 64                 # chunk size (stage 1a's T is [C, C])
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BV = 64                # value columns per CTA (WG0's S^T [BV, K] fp32 is 64 registers a thread at K = 128)
SMEM_BUDGET = 220 * 1024
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128)
F32 = jnp.float32


def _plgpu():
    """The Pallas Mosaic GPU module, imported on first use (keeps this module importable everywhere)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return plgpu


# ---------------------------------------------------------------------------------------------------------------
# helpers (jla: _common.py)
# ---------------------------------------------------------------------------------------------------------------
def _smem(shape, dtype):
    """(jla) SMEM buffer tiled and swizzled for TMA and WGMMA (minor dim = last dim)."""
    plgpu = _plgpu()
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _iota(shape, dim):
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _bcast_rows(vec, shape):
    """(jla) ``vec[i]`` along row i (vec in the WGMMA row layout)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def _bcast_cols(vec, shape):
    """(jla) ``vec[j]`` along column j (vec in the WGMMA column layout)."""
    return lax.broadcast_in_dim(vec, shape, [1])


def _matmul(a, b, shape, init=None):
    """(jla) ``init + a @ b`` on the tensor cores (a: SMEM ref or 16-bit WGMMA registers; b: SMEM ref), fp32.

    The optimization barrier keeps LLVM from reading the accumulator before ``wgmma.wait_group`` (jla saw
    silently zeroed products without it, sm_90, jax 0.11.2)."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()

    def body(acc):
        plgpu.wgmma(acc, a, b)

    if init is None:
        def scoped(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]
        out = pl.run_scoped(scoped, plgpu.ACC(shape, F32))
    else:
        out = pl.run_state(body)(plgpu.ACC.init(init))
    return lax.optimization_barrier(out)


def _stages(per_stage: int, fixed: int) -> int:
    """Deepest input ring (2 to 4 stages) that fits SMEM_BUDGET."""
    for stages in (4, 3, 2):
        if stages * per_stage + fixed <= SMEM_BUDGET:
            return stages
    raise ValueError(f"mosaic_gpu fused state pass needs {2 * per_stage + fixed} bytes of shared memory")


# ---------------------------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------------------------
def fused_state_pass(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool, interpret=None,
                     head_major: bool = False, pieces: int = 1, run_pieces: int | None = None,
                     write_o: bool = True, exp2: bool = False, walk=None, num_states: int | None = None,
                     packed_qkv: bool = False, state_kv: bool = False, lane_rows=None, tails=None):
    """Stages 1b + 2 as one warp-specialised Mosaic GPU kernel. Returns (o [B, Tp, Hv, V] in q's dtype or None
    (``write_o`` False), final S^T [B * R, Hv, V, K] fp32 or None).

    q, k [B, Tp, Hk, K]; v [B, Tp, Hv, V] (one 16-bit dtype; Tp a multiple of C * pieces);
    ``head_major`` False (stage 1a = Triton ``kkt_solve``): t [NC, Hv, C, C] the **gated** T (input dtype, zeros
    above the diagonal), gcum [NC, Hv, C] fp32 chunk-local cumulative log-decay (natural log), beta_c [NC, Hv, C]
    fp32 (chunk-major); ``head_major`` True (stage 1a = :func:`kkt_fwd`): t [B, Hv, Tp, C] the **gate-free** T0
    (the kernel multiplies e^(G_i - G_j) in), gcum and beta_c [B, Hv, Tp] fp32.
    ``pieces`` P: each row's Tp tokens are cut into P pieces of L = Tp / P tokens run by separate CTAs (grid
    (B * R, Hv, V / BV), CTA row r = b * R + p runs piece p of row b), ``run_pieces`` R <= P (default P): only the
    first R pieces of each row run (the state-map pass of the sequence split skips the last piece).
    h0t [B * R, Hv, V, K] fp32 (each run piece's initial state, transposed) or None (zeros).
    ``write_o`` False: no output (the map pass), the output warpgroup only forms Ag.
    ``exp2``: gcum holds log2 gates (G log2 e) and every decay is exp2 (as jla), else natural-log gates and exp.
    ``walk`` (varlen, ``gated_delta_rule/mosaic_gpu/varlen.py``): int32 [R, 3] table, row r = (first chunk c0, chunk count n_r,
    sequence s_r); then B = 1, P = 1, the grid is (R, Hv, V / BV) and CTA row r walks chunks c0 .. c0 + n_r - 1
    of the one row (a dynamic trip count, 0 allowed: the final state is then the initial one), starting from
    h0t[s_r] and storing its final state to [s_r]; h0t and the final state are [num_states, Hv, V, K] (S^T),
    chunk c is tokens [c C, c C + C) of q, k, v, o and chunk c of t / gcum / beta_c in either layout. Chunks no
    row walks are neither read nor written (their rows of o are left unset).
    ``packed_qkv`` (with a walk table of 5 columns, + (first token t0, length L), and ``tails``): q, k, v [1, T, ...]
    are the packed row itself; the full chunks n < L // C of row r are read in place (tokens [t0 + n C, +C), all
    the sequence's own), its last, partial chunk from ``tails`` = (q, k, v [1, N C, ...]: sequence s's tail at rows
    [s C, s C + C), zero past its L mod C tokens), so no chunk ever holds another sequence's tokens. o stays in the
    chunk coordinates (rows c C ...), gcum / beta_c / t must be zero-padded per chunk as usual. (Does not build on
    the H200 with jax 0.11.2: an AssertionError while lowering; ``mosaic_gpu_varlen`` keeps it off.)
    ``lane_rows`` (persistent walk): with a walk table [L, R_max, 6] (each row + m0, the chunks its lane walked
    before it) and lane_rows [L] int32, CTA row p (grid (L, Hv, V / BV)) walks rows 0 .. lane_rows[p] - 1 of its
    lane back to back: the input ring and the barrier phases run on across rows (slot and phase from m0 + n), each
    row loads its own initial state and stores its final one, so a sequence's pipeline fill and state load overlap
    the previous sequence's tail instead of costing a CTA launch each.
    ``state_kv``: the initial and final states in the op's own layout [.., Hv, K, V] (not S^T): WG0 loads its
    [K, 64] tile by TMA and reads it transposed (``Layout.WGMMA_TRANSPOSED`` from the transposed SMEM view, then a
    register layout cast), and stores the final state the same way back; saves two XLA transposes of all states
    (2 x 2 x 2 MB per sequence at Hv 32, K = V = 128).
    """
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    WGMMA = plgpu.Layout.WGMMA
    ROWS = WGMMA.reduce(1)       # one value per row of a WGMMA tile
    COLS = WGMMA.reduce(0)       # one value per column
    batch, padded, kv_heads, key_dim = k.shape
    heads, value_dim = v.shape[2], v.shape[3]
    group = heads // kv_heads
    run_pieces = pieces if run_pieces is None else run_pieces
    varlen = walk is not None
    lanes = lane_rows is not None
    if lanes and (walk is None or walk.ndim != 3 or walk.shape[-1] != 6):
        raise ValueError("fused_state_pass: lane_rows needs a lane walk table [L, R_max, 6]")
    if varlen and (batch != 1 or pieces != 1 or num_states is None):
        raise ValueError(f"fused_state_pass: a walk table needs B = 1 (got {batch}), pieces = 1 (got {pieces}) "
                         f"and num_states (got {num_states})")
    if packed_qkv and (not varlen or walk.shape[-1] < 5 or not write_o or tails is None):
        raise ValueError("fused_state_pass: packed_qkv needs a walk table of 5 columns, tails and write_o")
    o_rows = (t.shape[0] * C if not head_major else t.shape[2]) if packed_qkv else padded   # o's chunk rows
    if (padded % (C * pieces) and not packed_qkv) or not 1 <= run_pieces <= pieces:
        raise ValueError(f"fused_state_pass: Tp={padded} must be a multiple of C * pieces = {C * pieces} and "
                         f"1 <= run_pieces={run_pieces} <= pieces={pieces}")
    ncb_row = padded // C        # chunks per row
    ncb = ncb_row // pieces      # chunks per piece (the loop's trip count)
    piece_len = ncb * C
    nv = value_dim // BV
    dtype = k.dtype
    out_dtype = q.dtype
    _exp = jnp.exp2 if exp2 else jnp.exp
    has_h0 = h0t is not None
    isz = jnp.dtype(dtype).itemsize
    n_vec = 4                    # g_state, g_rows, g_cols, b_cols
    per_stage = 2 * C * key_dim * isz + C * BV * isz + C * C * isz + n_vec * C * 4
    fixed = 2 * BV * key_dim * isz + 2 * C * BV * isz + 2 * C * BV * jnp.dtype(out_dtype).itemsize
    fixed += (BV * key_dim * 4 if has_h0 or out_final else 0) + 4096 + n_vec * 1024
    stages = _stages(per_stage, fixed)
    n_copies = (4 if write_o else 3) + n_vec      # the map pass reads no q

    out_type = [jax.ShapeDtypeStruct((batch, o_rows, heads, value_dim), out_dtype)] if write_o else []
    if out_final:
        out_type.append(jax.ShapeDtypeStruct(
            ((num_states if varlen else batch * run_pieces), heads)
            + ((key_dim, value_dim) if state_kv else (value_dim, key_dim)), F32))
    if not out_type:
        raise ValueError("fused_state_pass: nothing to compute (write_o and out_final both False)")
    vecs = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        q_s=_smem((stages, C, key_dim), dtype),
        k_s=_smem((stages, C, key_dim), dtype),
        v_s=_smem((stages, C, BV), dtype),
        t_s=_smem((stages, C, C), dtype),        # T, then Ag = T * beta_j (written by WG1)
        g_state=vecs,                            # WG0: column view + last gate
        g_rows=vecs,                             # WG1: row view
        g_cols=vecs,                             # WG1: column view
        b_cols=vecs,                             # WG1: beta per column of Ag
        s_pub=_smem((2, BV, key_dim), dtype),
        vn_pub=_smem((2, C, BV), dtype),
        o_out=_smem((2, C, BV), out_dtype),
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages),
        s_ready=plgpu.Barrier(num_barriers=2),
        s_free=plgpu.Barrier(num_barriers=2),
        state_bar=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=3),
    )
    if has_h0 or out_final:
        scratch.update(state_smem=plgpu.SMEM((key_dim, BV) if state_kv else (BV, key_dim), F32))

    def body(*refs, q_s, k_s, v_s, t_s, g_state, g_rows, g_cols, b_cols, s_pub, vn_pub, o_out, in_bar, in_free,
             ag_ready, s_ready, s_free, state_bar, done, state_smem=None):
        refs = list(refs)
        q_ref, k_ref, v_ref, t_ref, g_ref, b_ref = (refs.pop(0) for _ in range(6))
        h0_ref = refs.pop(0) if has_h0 else None
        walk_ref = refs.pop(0) if varlen else None
        nrows_ref = refs.pop(0) if lanes else None
        qt_ref, kt_ref, vt_ref = (refs.pop(0) for _ in range(3)) if packed_qkv else (None,) * 3
        o_ref = refs.pop(0) if write_o else None
        ht_ref = refs.pop(0) if out_final else None
        r, hh, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        if varlen:
            b, piece = 0, 0
        else:
            b, piece = lax.div(r, run_pieces), lax.rem(r, run_pieces)

        def row_at(j):
            """The j-th row this CTA walks: (c0, count, state row, first row of t / gcum / beta_c / o, first row of
            q / k / v, sequence length or None, chunks this CTA walked before it)."""
            if not varlen:               # dense: piece p of row b
                tok0 = piece * piece_len
                return None, ncb, r, tok0, tok0, None, 0
            ent = (lambda i: walk_ref[r, j, i]) if lanes else (lambda i: walk_ref[r, i])
            c0 = ent(0)
            tok0 = c0 * C
            return (c0, ent(1), ent(2), tok0, ent(3) if packed_qkv else tok0, ent(4) if packed_qkv else None,
                    ent(5) if lanes else 0)

        hk = lax.div(hh, group)
        v0 = iv * BV
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue_qkv(srcs, rows, slot):
                qr, kr, vr = srcs
                bar = in_bar.at[slot]
                if write_o:
                    plgpu.copy_gmem_to_smem(qr.at[b, rows, hk], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(kr.at[b, rows, hk], k_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(vr.at[b, rows, hh, pl.ds(v0, BV)], v_s.at[slot], bar)

            def issue(n, slot, row):     # n: chunk index within the row
                c0, _, srow_, tok0, in0, seq_len_, _ = row
                rows = pl.ds(tok0 + n * C, C)
                bar = in_bar.at[slot]
                if packed_qkv:           # full chunks in place, the partial last one from the tails
                    full = lax.div(seq_len_, C)

                    @pl.when(n < full)
                    def _():
                        issue_qkv((q_ref, k_ref, v_ref), pl.ds(in0 + n * C, C), slot)

                    @pl.when(n >= full)
                    def _():
                        issue_qkv((qt_ref, kt_ref, vt_ref), pl.ds(srow_ * C, C), slot)
                else:
                    issue_qkv((q_ref, k_ref, v_ref), rows, slot)
                if head_major:           # kkt_fwd's layout: [B, Hv, Tp, C] and [B, Hv, Tp]
                    t_src, g_src, b_src = t_ref.at[b, hh, rows], g_ref.at[b, hh, rows], b_ref.at[b, hh, rows]
                else:                    # Triton stage 1a's chunk layout: chunk c = b * NC_row + j
                    c = c0 + n if varlen else b * ncb_row + piece * ncb + n
                    t_src, g_src, b_src = t_ref.at[c, hh], g_ref.at[c, hh], b_ref.at[c, hh]
                plgpu.copy_gmem_to_smem(t_src, t_s.at[slot], bar)
                for g_buf in (g_state, g_rows, g_cols):
                    plgpu.copy_gmem_to_smem(g_src, g_buf.at[slot], bar)
                plgpu.copy_gmem_to_smem(b_src, b_cols.at[slot], bar)

            if lanes:                    # rows back to back: the ring runs on across them (m counts every chunk)
                @pl.loop(0, nrows_ref[r])
                def _rows(j):
                    row = row_at(j)

                    @pl.loop(0, row[1])
                    def _chunks(n):
                        m = row[6] + n
                        slot = lax.rem(m, stages)

                        @pl.when(m >= stages)
                        def _():
                            plgpu.barrier_wait(in_free.at[slot])
                        issue(n, slot, row)
            elif varlen:                 # (jla scalar_gate_docs) a dynamic trip count, possibly 0
                row = row_at(0)
                count = row[1]
                for n in range(stages):
                    @pl.when(count > n)
                    def _(n=n):
                        issue(n, n, row)

                @pl.loop(stages, jnp.maximum(count, stages))
                def _refill_walk(n):
                    slot = lax.rem(n, stages)
                    plgpu.barrier_wait(in_free.at[slot])
                    issue(n, slot, row)
            else:
                row = row_at(0)
                for n in range(min(stages, ncb)):
                    issue(n, n, row)

                @pl.loop(stages, ncb)
                def _refill(n):
                    slot = lax.rem(n, stages)
                    plgpu.barrier_wait(in_free.at[slot])
                    issue(n, slot, row)

                for n in range(max(ncb - stages, 0), ncb):      # observe the remaining releases
                    plgpu.barrier_wait(in_free.at[n % stages])

        @pl.when(wg == 0)
        def _state():
            plgpu.set_max_registers(232, action="increase")

            def load_state(srow):
                if has_h0 and state_kv:  # S [K, BV] tile, read as S^T through the transposed view
                    plgpu.copy_gmem_to_smem(h0_ref.at[srow, hh, pl.ds(0, key_dim), pl.ds(v0, BV)], state_smem,
                                            state_bar)
                    plgpu.barrier_wait(state_bar)
                    # (state_smem.T: plgpu.transpose_ref needs a ref with .memory_space, a scratch ref has none)
                    s_kv = plgpu.load(state_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)
                    return plgpu.layout_cast(s_kv, WGMMA)
                if has_h0:
                    plgpu.copy_gmem_to_smem(h0_ref.at[srow, hh, pl.ds(v0, BV)], state_smem, state_bar)
                    plgpu.barrier_wait(state_bar)
                    return plgpu.load(state_smem, layout=WGMMA)
                return plgpu.layout_cast(jnp.zeros((BV, key_dim), F32), WGMMA)

            def store_state(srow, s_t):
                if state_kv:
                    state_smem.T[...] = plgpu.layout_cast(s_t, plgpu.Layout.WGMMA_TRANSPOSED)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(state_smem, ht_ref.at[srow, hh, pl.ds(0, key_dim), pl.ds(v0, BV)])
                else:
                    state_smem[...] = s_t
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(state_smem, ht_ref.at[srow, hh, pl.ds(v0, BV)])
                plgpu.wait_smem_to_gmem(0)

            def step(n, s_t, row):
                m0 = row[6]
                m = n if isinstance(m0, int) and m0 == 0 else m0 + n     # chunks this CTA walked before
                slot = lax.rem(m, stages)
                half = lax.rem(m, 2)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(m >= 2)
                def _():                 # WG1 has finished reading the tiles published two chunks ago
                    plgpu.barrier_wait(s_free.at[half])

                s_lo = s_t.astype(dtype)
                s_pub.at[half][...] = s_lo
                g_last = g_state[slot, C - 1]
                g_col = plgpu.load(g_state.at[slot], layout=COLS)
                key_decay = _exp(g_col)                     # Gamma: the correction term reads the incoming state
                k_decay = _exp(g_last - g_col)
                s_decay = _exp(g_last)
                # W^T = v^T - (S^T k^T) Gamma, then v_new^T = W^T Ag^T
                x_t = _matmul(s_lo, k_s.at[slot].T, (BV, C))
                v_t = plgpu.load(v_s.at[slot].T, layout=WGMMA).astype(F32)
                w_t = (v_t - x_t * _bcast_cols(key_decay, (BV, C))).astype(dtype)
                plgpu.barrier_wait(ag_ready.at[slot])
                vn_t = _matmul(w_t, t_s.at[slot].T, (BV, C))
                vn_pub.at[half].T[...] = vn_t.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(s_ready.at[half])
                vd_t = (vn_t * _bcast_cols(k_decay, (BV, C))).astype(dtype)
                s_new = _matmul(vd_t, k_s.at[slot], (BV, key_dim), init=s_t * s_decay)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            if lanes:
                @pl.loop(0, nrows_ref[r])
                def _rows(j):
                    row = row_at(j)
                    s_t = lax.fori_loop(0, row[1], functools.partial(step, row=row), load_state(row[2]))
                    if out_final:
                        store_state(row[2], s_t)
            else:
                row = row_at(0)
                s_t = lax.fori_loop(0, row[1], functools.partial(step, row=row), load_state(row[2]))
                if not varlen:           # (varlen: the done barrier below orders the exit instead)
                    for n in range(max(ncb - 2, 0), ncb):   # observe the last releases of the published tiles
                        plgpu.barrier_wait(s_free.at[n % 2])
                if out_final:
                    store_state(row[2], s_t)

        @pl.when(wg == 1)
        def _output():
            plgpu.set_max_registers(232, action="increase")

            def step(n, carry, row):
                tok0, m0 = row[3], row[6]
                m = n if isinstance(m0, int) and m0 == 0 else m0 + n
                slot = lax.rem(m, stages)
                half = lax.rem(m, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                g_row = plgpu.load(g_rows.at[slot], layout=ROWS)
                g_col = plgpu.load(g_cols.at[slot], layout=COLS)
                q_decay = _exp(g_row)
                sq = (C, C)
                keep = _iota(sq, 0) >= _iota(sq, 1)
                # the exponent is masked before exp, so acausal entries never overflow (jla decay_matrix)
                decay = _exp(jnp.where(keep, _bcast_rows(g_row, sq) - _bcast_cols(g_col, sq), -jnp.inf))
                # Ag = T * beta_j replaces T in the input buffer (Triton's T already carries e^(G_i - G_j);
                # kkt_fwd's gate-free T0 gets it here: T = T0 * e^(G_i - G_j), a diagonal similarity)
                t_in = plgpu.load(t_s.at[slot], layout=WGMMA).astype(F32)
                if head_major:
                    t_in = t_in * decay
                ag = t_in * _bcast_cols(plgpu.load(b_cols.at[slot], layout=COLS), sq)
                t_s.at[slot][...] = ag.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ag_ready.at[slot])
                if not write_o:          # the map pass: only Ag, then release the tiles
                    plgpu.barrier_wait(s_ready.at[half])
                    plgpu.barrier_arrive(s_free.at[half])
                    plgpu.barrier_arrive(in_free.at[slot])
                    return carry
                p = _matmul(q_s.at[slot], k_s.at[slot].T, sq)
                p_lo = (p * decay).astype(dtype)
                plgpu.barrier_wait(s_ready.at[half])
                o = _matmul(q_s.at[slot], s_pub.at[half].T, (C, BV))
                o = _matmul(p_lo, vn_pub.at[half], (C, BV), init=o * _bcast_rows(q_decay, (C, BV)))
                plgpu.barrier_arrive(s_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # o_out[half] of chunk m - 2 was sent
                o_out.at[half][...] = (o * scale).astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_out.at[half], o_ref.at[b, pl.ds(tok0 + n * C, C), hh, pl.ds(v0, BV)])
                return carry

            if lanes:
                @pl.loop(0, nrows_ref[r])
                def _rows(j):
                    row = row_at(j)
                    lax.fori_loop(0, row[1], functools.partial(step, row=row), None)
            else:
                row = row_at(0)
                lax.fori_loop(0, row[1], functools.partial(step, row=row), None)
            if write_o:
                plgpu.wait_smem_to_gmem(0)

        # (jla finish_together) every warpgroup waits for the others before it exits: one exiting while another
        # still issued WGMMAs ended some runs in CUDA_ERROR_ILLEGAL_INSTRUCTION (sm_90, jax 0.11.2)
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    args = [q, k, v, t, gcum, beta_c] + ([h0t] if has_h0 else []) + ([walk] if varlen else [])
    args += [lane_rows] if lanes else []
    args += list(tails) if packed_qkv else []
    rows = walk.shape[0] if varlen else batch * run_pieces
    name = "gdn_mosaic_varlen_state_pass" if varlen else (
        "gdn_mosaic_fused_state_pass" if write_o else "gdn_mosaic_state_map")
    outs = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(rows, heads, nv),
        grid_names=("b", "h", "v"), compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
        kernel_name=name, num_threads=3,
        thread_name="wg",
    )(*args)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    o = outs.pop(0) if write_o else None
    return o, (outs.pop(0) if out_final else None)


# ---------------------------------------------------------------------------------------------------------------
# stage 1a in Mosaic GPU (port plan step 2): the gate-free inverse T0 (jla: gated_delta_rule_kernels.kkt_fwd)
# ---------------------------------------------------------------------------------------------------------------
BLOCK = 16       # diagonal blocks of the blocked inverse
SOLVE_PAD = 8    # (jla) padded rows of the fp32 solve buffers: 256-byte rows gave 8-way bank conflicts


@functools.cache
def _diag_block_inverse_fn():
    """(jla ``_diag_block_inverse``) built on first use: the MLIR imports exist only with a GPU jaxlib."""
    plgpu = _plgpu()
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, memref, vector
    from jaxlib.mlir.dialects import math as mlir_math

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((C, C), F32, layout=plgpu.Layout.WGMMA),
    )
    def diag_block_inverse(ctx, neg_a_t, na_ref, x_ref):
        """Inverses of the 16 x 16 diagonal blocks of I + A (A strictly lower), zeros elsewhere, from
        ``neg_a_t = -A^T`` (fp32 [C, C] registers, only its diagonal blocks read). Each of 64 threads (warps 0-1
        or 2-3, alternating between CTAs so two CTAs on an SM use all four sub-partitions) solves one column of
        its block by forward substitution (16 steps, one FMA on the dependent chain a step)."""
        del ctx
        neg_a_t.store_untiled(na_ref, optimized=False)
        f32 = ir.F32Type.get()
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        vec4 = ir.VectorType.get([4], f32)
        cst = mgpu_utils.c
        zero, one = cst(0.0, f32), cst(1.0, f32)
        mgpu.FragmentedArray.splat(zero, (C, C), layout=mgpu.WGMMA_LAYOUT).store_untiled(x_ref, optimized=False)
        mgpu_utils.warpgroup_barrier()
        tid = arith.remui(mgpu_utils.thread_idx(), cst(128, i32))
        blocks = arith.addi(arith.addi(gpu.block_id(gpu.Dimension.x), gpu.block_id(gpu.Dimension.y)),
                            gpu.block_id(gpu.Dimension.z))
        base = arith.muli(arith.index_cast(i32, arith.remui(blocks, cst(2, index))), cst(C, i32))
        lane = arith.subi(tid, base)
        active = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, lane, cst(0, i32)),
                            arith.cmpi(arith.CmpIPredicate.slt, lane, cst(C, i32)))
        with mgpu_utils.when(active):
            col = arith.index_cast(index, lane)
            local = arith.remui(lane, cst(BLOCK, i32))
            start = arith.index_cast(index, arith.subi(lane, local))
            r = {i: arith.select(arith.cmpi(arith.CmpIPredicate.eq, local, cst(i, i32)), one, zero)
                 for i in range(BLOCK)}
            for j in range(BLOCK):
                x_j = r.pop(j)
                row_j = arith.addi(start, cst(j, index))
                memref.store(x_j, x_ref, [row_j, col])
                for i0 in range((j + 1) // 4 * 4, BLOCK, 4):
                    seg = vector.load(vec4, na_ref, [row_j, arith.addi(start, cst(i0, index))])
                    for ii in range(4):
                        if i0 + ii > j:
                            a = vector.extract(seg, dynamic_position=[],
                                               static_position=ir.DenseI64ArrayAttr.get([ii]))
                            r[i0 + ii] = mlir_math.fma(a, x_j, r[i0 + ii])
        mgpu_utils.warpgroup_barrier()
        return mgpu.FragmentedArray.load_untiled(x_ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)

    return diag_block_inverse


def _num_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0) or 0) or 132
    except RuntimeError:
        return 132


def kkt_chunks_per_cta(batch: int, heads: int, chunks: int) -> int:
    """(jla) Chunks per CTA of :func:`kkt_fwd`: the most (8, 4, 2) that still leave >= 1.5 CTAs per SM."""
    for cpc in (8, 4, 2):
        if chunks % cpc == 0 and batch * heads * (chunks // cpc) * 2 >= 3 * _num_sms():
            return cpc
    return 1


def kkt_fwd(k, beta_hm, *, heads: int, chunks_per_cta: int | None = None, interpret=None, num_chunks=None):
    """Gate-free T0 = (I + A0)^-1, A0_ij = beta_i k_i.k_j (j < i), one Mosaic GPU kernel. Returns
    T0 [B, Hv, Tp, C] in k's dtype (row i of chunk c at [b, h, c C + i], zeros above the diagonal).

    k [B, Tp, Hk, K] (16-bit, Tp a multiple of C; value head h reads key head h // (Hv / Hk)); beta_hm
    [B, Hv, Tp] fp32. The gated inverse is T0 * e^(G_i - G_j) (a diagonal similarity of A), applied by
    :func:`fused_state_pass` (``head_major``). Blocked: 16 x 16 diagonal blocks by forward substitution in fp32,
    merged 16 -> 32 -> 64 by X <- X - X (L X) on the tensor cores (16-bit operands); each CTA walks
    ``chunks_per_cta`` chunks with the next chunk's keys prefetched and T0's stores left in flight.
    ``num_chunks`` (int32 [1] or None; the varlen path's used chunk slots): a CTA whose chunks all lie at or past
    num_chunks[0] exits at once, leaving its rows of T0 unset (nothing may read them).
    """
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    WGMMA = plgpu.Layout.WGMMA
    ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)
    batch, padded, kv_heads, key_dim = k.shape
    group = heads // kv_heads
    nc = padded // C
    if chunks_per_cta is None:
        chunks_per_cta = kkt_chunks_per_cta(batch, heads, nc)
    cpc = next(n for n in (chunks_per_cta, 4, 2, 1) if nc % n == 0)
    dtype = k.dtype
    diag_inverse = _diag_block_inverse_fn()
    vec2 = plgpu.SMEM((2, C), F32)
    scratch = dict(
        k_smem=_smem((2, C, key_dim), dtype),
        br_smem=vec2,
        bc_smem=vec2,
        t_smem=_smem((2, C, C), dtype),
        b_smem=_smem((C, C), dtype),
        na_smem=plgpu.SMEM((C, C + SOLVE_PAD), F32),
        x_smem=plgpu.SMEM((C, C + SOLVE_PAD), F32),
        bar=plgpu.Barrier(num_arrivals=3, num_barriers=2),
    )

    def merge_product(a, bmat, b_smem):
        b_smem[...] = bmat.astype(dtype)
        plgpu.commit_smem()
        return _matmul(a.astype(dtype), b_smem, (C, C))

    def body(k_ref, beta_ref, t_ref, k_smem, br_smem, bc_smem, t_smem, b_smem, na_smem, x_smem, bar):
        b, nb, hh = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
        hk = lax.div(hh, group)

        def issue(n, slot):
            rows = pl.ds((nb * cpc + n) * C, C)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], k_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(beta_ref.at[b, hh, rows], br_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(beta_ref.at[b, hh, rows], bc_smem.at[slot], bar.at[slot])

        issue(0, 0)
        sq = (C, C)
        ri, ci = _iota(sq, 0), _iota(sq, 1)

        @pl.loop(0, cpc)
        def _chunk(n):
            slot = lax.rem(n, 2)
            plgpu.barrier_wait(bar.at[slot])

            @pl.when(n + 1 < cpc)
            def _prefetch():
                plgpu.commit_smem()
                issue(n + 1, 1 - slot)

            s = _matmul(k_smem.at[slot], k_smem.at[slot].T, sq)        # symmetric: also serves A0^T
            lower = ri > ci
            diag_upper = (ci > ri) & (lax.div(ri, BLOCK) == lax.div(ci, BLOCK))
            a0 = jnp.where(lower, s * _bcast_rows(plgpu.load(br_smem.at[slot], layout=ROWS), sq), 0.0)
            neg_a_t = jnp.where(diag_upper, s * _bcast_cols(-plgpu.load(bc_smem.at[slot], layout=COLS), sq), 0.0)
            x = diag_inverse(neg_a_t, na_smem.at[:, :C], x_smem.at[:, :C])
            for size in (2 * BLOCK, 4 * BLOCK):                        # merge 16 -> 32 -> 64
                half = size // 2
                off = ((lax.div(ri, size) == lax.div(ci, size)) & (lax.rem(ri, size) >= half)
                       & (lax.rem(ci, size) < half))
                link = merge_product(jnp.where(off, a0, 0.0), x, b_smem)     # L X
                x = x - merge_product(x, link, b_smem)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)            # t_smem[slot] of chunk n - 2 was sent
            t_smem.at[slot][...] = x.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_smem.at[slot], t_ref.at[b, hh, pl.ds((nb * cpc + n) * C, C)])

        plgpu.wait_smem_to_gmem(0)

    def body_kw(k_ref, beta_ref, *refs, **scr):
        if num_chunks is None:
            return body(k_ref, beta_ref, *refs, **scr)
        n_ref, t_ref = refs

        @pl.when(lax.axis_index("n") * cpc < n_ref[0])
        def _():
            body(k_ref, beta_ref, t_ref, **scr)

    return plgpu.kernel(
        body_kw, out_type=jax.ShapeDtypeStruct((batch, heads, padded, C), dtype), scratch_types=scratch,
        grid=(batch, nc // cpc, heads), grid_names=("b", "n", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret, kernel_name="gdn_mosaic_kkt",
    )(k, beta_hm, *(() if num_chunks is None else (num_chunks,)))


def kkt_fwd_reference(k, beta_hm, *, heads: int):
    """What :func:`kkt_fwd` computes, in jnp (fp32, exact triangular solve): T0 [B, Hv, Tp, C] in k's dtype."""
    b, tp, hk, kdim = k.shape
    nc = tp // C
    kk = jnp.repeat(k, heads // hk, axis=2).astype(F32).reshape(b, nc, C, heads, kdim)
    kk = jnp.transpose(kk, (0, 3, 1, 2, 4))                                             # [B, Hv, nc, C, K]
    bt = beta_hm.astype(F32).reshape(b, heads, nc, C)
    a0 = jnp.einsum("bhnik,bhnjk->bhnij", kk, kk, precision=lax.Precision.HIGHEST) * bt[..., :, None]
    a0 = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), a0, 0.0)
    eye = jnp.broadcast_to(jnp.eye(C, dtype=F32), a0.shape)
    t0 = jax.scipy.linalg.solve_triangular(eye + a0, eye, lower=True, unit_diagonal=True)
    return t0.reshape(b, heads, tp, C).astype(k.dtype)


# ---------------------------------------------------------------------------------------------------------------
# entry point (dense): Triton stage 1a + the Mosaic GPU fused pass
# ---------------------------------------------------------------------------------------------------------------
def check_supported(q, k, v, g, beta, initial_state=None, *, kernel: bool = True) -> None:
    """Raises ValueError naming the argument when this first Mosaic GPU stage cannot run the call (``kernel``
    False: the limits of the jnp reference path, which also takes float32 and any head dims)."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"mosaic_gpu gdn: q and k must be [B, T, Hk, K] of one shape; got q {q.shape}, k {k.shape}")
    if v.ndim != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"mosaic_gpu gdn: v must be [B, T, Hv, V] with Hv a multiple of Hk={q.shape[2]}; "
                         f"got v {v.shape}")
    dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if kernel and (len(dts) != 1 or next(iter(dts)) not in SUPPORTED_DTYPES):
        raise ValueError(f"mosaic_gpu gdn: q, k, v must share one dtype in (bfloat16, float16); "
                         f"got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if kernel and (q.shape[3] not in SUPPORTED_HEAD_DIMS or v.shape[3] not in SUPPORTED_HEAD_DIMS):
        raise ValueError(f"mosaic_gpu gdn: head dims K (got {q.shape[3]}) and V (got {v.shape[3]}) must be in "
                         f"{SUPPORTED_HEAD_DIMS}")
    b, t, hv = v.shape[:3]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"mosaic_gpu gdn: {name} must be [B, T, Hv] = {(b, t, hv)}; got {x.shape}")
    if initial_state is not None and initial_state.shape != (b, hv, q.shape[3], v.shape[3]):
        raise ValueError(f"mosaic_gpu gdn: initial_state must be [B, Hv, K, V] = {(b, hv, q.shape[3], v.shape[3])}; "
                         f"got {initial_state.shape}")
    if t == 0:
        raise ValueError("mosaic_gpu gdn: q has T = 0 tokens (nothing to run)")


def fused_state_pass_reference(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool,
                               head_major: bool = False, pieces: int = 1, run_pieces: int | None = None,
                               write_o: bool = True, exp2: bool = False):
    """What :func:`fused_state_pass` computes, in jnp (fp32, matmul precision highest), same arguments and
    results: the kernel's per-chunk formulas (W = v - Gamma k S, v_new = (T * beta_j) W, o, S update) as a
    lax.scan over each piece's chunks (``head_major``: T = T0 * e^(G_i - G_j) first, as the kernel's WG1 does).
    Runs anywhere; the CPU tests check it (behind stage 1a in interpret mode, or :func:`kkt_fwd_reference`)
    against the float64 per-token oracle, so the algebra the kernel implements is tested without a GPU."""
    b, tp, hk, kdim = k.shape
    hv = v.shape[2]
    run_pieces = pieces if run_pieces is None else run_pieces
    t, gcum, beta_c = _chunk_layout(t, gcum, beta_c, head_major=head_major, exp2=exp2)
    if pieces > 1:      # piece p of row b becomes row b * R + p (p < R)
        lp = tp // pieces

        def rows(x):    # [B, Tp, ...] -> [B * R, L, ...]
            x = x.reshape((b, pieces, lp) + x.shape[2:])[:, :run_pieces]
            return x.reshape((b * run_pieces, lp) + x.shape[3:])

        def chunk_rows(x):  # [NC, ...] -> [B * R * NC_piece, ...]
            x = x.reshape((b, pieces, lp // C) + x.shape[1:])[:, :run_pieces]
            return x.reshape((b * run_pieces * (lp // C),) + x.shape[3:])
        o, ht = _reference_rows(rows(q), rows(k), rows(v), chunk_rows(t), chunk_rows(gcum), chunk_rows(beta_c),
                                h0t, scale=scale, out_final=out_final)
        o = o.reshape(b, run_pieces * lp, hv, v.shape[3]) if run_pieces == pieces else None
    else:
        o, ht = _reference_rows(q, k, v, t, gcum, beta_c, h0t, scale=scale, out_final=out_final)
    return (o if write_o else None), ht


def _chunk_layout(t, gcum, beta_c, *, head_major: bool, exp2: bool):
    """The twins' common input: (gated T [NC, Hv, C, C], natural-log G [NC, Hv, C], beta [NC, Hv, C]) fp32 from
    either layout of the fused pass's operands (``head_major``: T0 [B, Hv, Tp, C], G and beta [B, Hv, Tp], T
    gated here as the kernel's WG1 does; ``exp2``: G in log2 units)."""
    if exp2:            # log2 gates back to natural log (the twin works in natural log)
        gcum = gcum * LN2
    if not head_major:
        return t, gcum, beta_c
    b, hv, tp = gcum.shape
    nc = b * tp // C
    g4 = gcum.astype(F32).reshape(b, hv, tp // C, C)
    keep = jnp.tril(jnp.ones((C, C), bool))
    decay = jnp.exp(jnp.where(keep, g4[..., :, None] - g4[..., None, :], -jnp.inf))
    t = t.astype(F32).reshape(b, hv, tp // C, C, C) * decay
    t = jnp.transpose(t, (0, 2, 1, 3, 4)).reshape(nc, hv, C, C)
    gcum = jnp.transpose(g4, (0, 2, 1, 3)).reshape(nc, hv, C)
    beta_c = jnp.transpose(beta_c.astype(F32).reshape(b, hv, tp // C, C), (0, 2, 1, 3)).reshape(nc, hv, C)
    return t, gcum, beta_c


def _chunk_step(s, xs, scale: float):
    """One chunk of the fused pass in jnp (fp32, precision highest): s [B, Hv, K, V] the incoming state, xs =
    (q, k [B, Hv, C, K], v [B, Hv, C, V], gated T [B, Hv, C, C], G, beta [B, Hv, C]) fp32. Returns (the outgoing
    state, o [B, Hv, C, V] fp32): W = v - e^G k S, v_new = (T * beta_j) W, o = scale (e^G q S + P v_new),
    S' = e^(G_last) S + k^T (e^(G_last - G) v_new)."""
    hp = lax.Precision.HIGHEST
    keep = jnp.tril(jnp.ones((C, C), bool))
    qq, kk, vv, tt, gg, bb = xs
    ag = tt * bb[..., None, :]                                                   # T_ij beta_j
    x = jnp.einsum("bhck,bhkv->bhcv", kk, s, precision=hp)
    w = vv - jnp.exp(gg)[..., None] * x
    vn = jnp.einsum("bhij,bhjv->bhiv", ag, w, precision=hp)
    decay = jnp.exp(jnp.where(keep, gg[..., :, None] - gg[..., None, :], -jnp.inf))
    p = jnp.einsum("bhik,bhjk->bhij", qq, kk, precision=hp) * decay
    o = scale * (jnp.exp(gg)[..., None] * jnp.einsum("bhck,bhkv->bhcv", qq, s, precision=hp)
                 + jnp.einsum("bhij,bhjv->bhiv", p, vn, precision=hp))
    glast = gg[..., -1]
    vd = jnp.exp(glast[..., None] - gg)[..., None] * vn
    s = jnp.exp(glast)[..., None, None] * s + jnp.einsum("bhck,bhcv->bhkv", kk, vd, precision=hp)
    return s, o


def _reference_rows(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool):
    b, tp, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    ncb = tp // C

    def chunks(x):      # [B, Tp, H, D] -> [ncb, B, Hv, C, D] fp32
        x = jnp.repeat(x, hv // x.shape[2], axis=2).astype(F32)
        return jnp.transpose(x.reshape(b, ncb, C, hv, x.shape[3]), (1, 0, 3, 2, 4))
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    tc = jnp.swapaxes(t.astype(F32).reshape(b, ncb, hv, C, C), 0, 1)                  # [ncb, B, Hv, C, C]
    gc = jnp.swapaxes(gcum.astype(F32).reshape(b, ncb, hv, C), 0, 1)                  # [ncb, B, Hv, C]
    bc = jnp.swapaxes(beta_c.astype(F32).reshape(b, ncb, hv, C), 0, 1)
    s0 = (jnp.zeros((b, hv, kdim, vdim), F32) if h0t is None else jnp.swapaxes(h0t.astype(F32), -1, -2))
    s, o = lax.scan(functools.partial(_chunk_step, scale=scale), s0, (qc, kc, vc, tc, gc, bc))  # o [ncb, B, Hv, C, V]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(b, tp, hv, vdim).astype(q.dtype)
    return o, (jnp.swapaxes(s, -1, -2) if out_final else None)


def _pad_time(x, pad):
    return x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _prepare(q, k, v, g, beta, initial_state, *, interpret: bool, pieces: int = 1):
    """Pads T to a multiple of C (zero tokens) and runs stage 1a (Pallas Triton): the fused pass's operands."""
    from pallas_kernels.gated_delta_rule.triton import chunk as kt
    from pallas_kernels.gated_delta_rule.chunk_map import kernel_chunk_map
    b, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    pad = (-t) % (C * pieces)
    tp = t + pad
    q, k, v = _pad_time(q, pad), _pad_time(k, pad), _pad_time(v, pad)
    g, beta = _pad_time(g.astype(F32), pad), _pad_time(beta, pad)       # zero tokens: no decay, no update
    start, length, _, _ = kernel_chunk_map(b, tp, None, C)
    config = kt.launch_config(vdim, b * hv, q.dtype)
    kf, gf, bf = k.reshape(b * tp, hk, kdim), g.reshape(b * tp, hv), beta.reshape(b * tp, hv)
    if interpret:        # interpret mode clamps dynamic slices: pad C rows as pallas_triton._run does
        kf, gf, bf = (jnp.pad(x, [(0, C)] + [(0, 0)] * (x.ndim - 1)) for x in (kf, gf, bf))
    tmat, gcum = kt.kkt_solve(kf, gf, bf, chunk_start=start, chunk_len=length, chunk=C, num_v_heads=hv,
                              interpret=interpret, config=config)
    nc = b * tp // C
    beta_c = jnp.swapaxes(beta.astype(F32).reshape(nc, C, hv), 1, 2)                 # [NC, Hv, C]
    h0t = None if initial_state is None else jnp.swapaxes(initial_state.astype(F32), -1, -2)
    return q, k, v, tmat, gcum, beta_c, h0t


def _prepare_head_major(q, k, v, g, beta, initial_state, *, kernel: bool, pieces: int = 1, exp2: bool = False):
    """Stage 1a in Mosaic GPU (``kernel``) or its jnp twin: pads T to a multiple of C * pieces (zero tokens), the
    chunk-local cumulative log-decay G [B, Hv, Tp] (g floored at G_FLOOR first, as Triton's 1a does), beta
    [B, Hv, Tp] fp32 and the gate-free T0 [B, Hv, Tp, C]. Returns the fused pass's ``head_major`` operands."""
    from pallas_kernels.gated_delta_rule.reference import floor_log_decay
    b, t, hk, kdim = q.shape
    hv = v.shape[2]
    pad = (-t) % (C * pieces)
    tp = t + pad
    q, k, v = _pad_time(q, pad), _pad_time(k, pad), _pad_time(v, pad)
    g = floor_log_decay(_pad_time(g.astype(F32), pad))
    gcum = jnp.cumsum(jnp.swapaxes(g, 1, 2).reshape(b, hv, tp // C, C), axis=-1).reshape(b, hv, tp)
    if exp2:
        gcum = gcum * LOG2E
    beta_hm = jnp.swapaxes(_pad_time(beta.astype(F32), pad), 1, 2)                     # [B, Hv, Tp]
    t0 = kkt_fwd(k, beta_hm, heads=hv) if kernel else kkt_fwd_reference(k, beta_hm, heads=hv)
    h0t = None if initial_state is None else jnp.swapaxes(initial_state.astype(F32), -1, -2)
    return q, k, v, t0, gcum, beta_hm, h0t


# ---- the sequence split (port plan step 3; jla's piece maps, FlashQLA's intra-card context parallelism) -------
MAX_PIECES = 8
MIN_PIECE_CHUNKS = 8


#: the split's time model (:func:`split_cost`), in chunk steps of the fused pass (1.86 us on the H200): one map-pass
#: step (mosaic_gpu_split.state_map_pass: no output warpgroup, no q) as a fraction of a fused step, and the fixed
#: and per-piece costs of the launches and the scan. SPLIT_PER_PIECE refit in session 8 (NOTES.md "Session 8: dense
#: Mosaic", H200, both P with the Triton scan, 3 interleaved rounds): B1-T8192-Hk2-Hv8 P = 4 0.1436 against P = 8
#: 0.1571 (P = 4 wins every round; the model: 7.2 steps = 0.013 ms between them); it also has P = 2 beat P = 1 on
#: the 64-CTA rows (B1-T8192-Hk16-Hv32 0.2585 against 0.2830, B1-T32768 0.928 against 1.078: the model 18.8 and 96
#: steps, measured 13 and 81). (Session 7's 2.4 came from P = 8 with the Triton scan against P = 4 with XLA's.)
SPLIT_MAP_STEP = 0.6
SPLIT_FIXED = 1.0
SPLIT_PER_PIECE = 5.8
#: split only rows whose unsplit pass runs at most this many CTAs (B Hv V / 64; jla's rule is 32): session 8 measured
#: P = 2 faster than unsplit in every round on both 64-CTA bench rows (above; 0.93x and 0.87x jla). Rows of more
#: CTAs are not split (at 128+ the fused pass alone fills a wave; unmeasured, and the model agrees).
MAX_SPLIT_CTAS = 64


def _first_from_h0() -> bool:
    from pallas_kernels.gated_delta_rule.mosaic_gpu import split as mosaic_gpu_split
    return mosaic_gpu_split.FIRST == "h0"


def split_cost(batch: int, heads: int, key_dim: int, value_dim: int, nchunks: int, pieces: int,
               sms: int | None = None, *, has_h0: bool = True) -> float:
    """The split's time model in fused-pass chunk steps (one CTA per SM at K = 128): the fused pass runs
    ceil(B Hv V/BV P / SMs) waves of nchunks / P steps; with P > 1 the map pass adds ceil(CTAs / SMs) waves of as
    many steps at SPLIT_MAP_STEP each, CTAs = B Hv (K + V)/BV (P - 1) (less the first piece's B Hv K/BV identity
    blocks without an initial state or with ``mosaic_gpu_split.FIRST = "h0"``), plus SPLIT_FIXED + SPLIT_PER_PIECE
    (P - 1) for the launch and the scan."""
    sms = _num_sms() if sms is None else sms
    steps = -(-nchunks // pieces)
    cost = -(-batch * heads * max(value_dim // BV, 1) * pieces // sms) * steps
    if pieces > 1:
        ctas = batch * heads * ((key_dim + value_dim) // BV) * (pieces - 1)
        if not has_h0 or _first_from_h0():
            ctas -= batch * heads * (key_dim // BV)
        cost += -(-ctas // sms) * steps * SPLIT_MAP_STEP + SPLIT_FIXED + SPLIT_PER_PIECE * (pieces - 1)
    return cost


def split_pieces(batch: int, heads: int, key_dim: int, value_dim: int, padded: int, *, sms: int | None = None,
                 has_h0: bool = True) -> int:
    """Pieces per row of the sequence split: the power of two P <= MAX_PIECES (pieces of at least MIN_PIECE_CHUNKS
    chunks) with the least :func:`split_cost`; 1 (no split) for rows of more than MAX_SPLIT_CTAS CTAs (the bench's
    B4-T4096 and B16-T1024 rows) and on ties."""
    if batch * heads * max(value_dim // BV, 1) > MAX_SPLIT_CTAS:
        return 1
    nchunks = padded // C
    best, best_cost = 1, split_cost(batch, heads, key_dim, value_dim, nchunks, 1, sms, has_h0=has_h0)
    p = 2
    while p <= MAX_PIECES and nchunks // p >= MIN_PIECE_CHUNKS:
        cost = split_cost(batch, heads, key_dim, value_dim, nchunks, p, sms, has_h0=has_h0)
        if cost < best_cost:
            best, best_cost = p, cost
        p *= 2
    return best


def _split_start_states(ops_, pieces: int, *, kernel: bool, head_major: bool, exp2: bool = False,
                        chain: bool = False, scan: str | None = None, first: str | None = None,
                        precision: str | None = None):
    """Each piece's true initial state S^T [B * P, Hv, V, K]: the maps [M | E] of pieces 0 .. P - 2 (S_end =
    M S_start + E) from one state-map pass, then a scan over the pieces (``mosaic_gpu_split.start_states``: its
    MAP, PAIRED, SCAN and SCAN_PRECISION say which map pass and which scan). ``chain`` (P = 2 only): piece 1's start
    from one state-only pass over piece 0 from the initial state (map "chain": no M, no scan). ``scan`` /
    ``first`` / ``precision``: start_states' (None: its SCAN / FIRST / SCAN_PRECISION)."""
    from pallas_kernels.gated_delta_rule.mosaic_gpu import split as mosaic_gpu_split
    return mosaic_gpu_split.start_states(ops_, pieces, kernel=kernel, head_major=head_major, exp2=exp2,
                                         map_impl="chain" if chain and pieces == 2 else None, scan=scan,
                                         first=first, precision=precision)


STAGE1A = ("triton", "mosaic")


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "impl", "stage1a", "pieces", "exp2",
                                             "state_kv", "split_chain", "split_scan", "split_first",
                                             "split_precision"))
def chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=None, *, scale=None, output_final_state=True,
                               impl: str = "mosaic", stage1a: str = "triton", pieces: int = 1, exp2: bool = False,
                               state_kv: bool = False, split_chain: bool = False, split_scan: str | None = None,
                               split_first: str | None = None, split_precision: str | None = None):
    """Dense chunked gated delta rule forward: stage 1a, then :func:`fused_state_pass` (``impl="mosaic"``, a
    Hopper GPU) or its jnp twin :func:`fused_state_pass_reference` (``impl="reference"``, anywhere: the CPU check
    of the algebra).

    ``stage1a``: "triton" (Pallas Triton ``kkt_solve``, the gated T in chunk layout; interpret mode under
    ``impl="reference"``) or "mosaic" (:func:`kkt_fwd`, the gate-free T0 in head-major layout, or its jnp twin
    :func:`kkt_fwd_reference` under ``impl="reference"``). ``pieces`` P > 1: the sequence split (each row cut
    into P pieces run side by side, their start states from one state-map pass, :func:`_split_start_states`);
    0: :func:`split_pieces` picks. ``exp2`` (with ``stage1a="mosaic"``): log2 gates and exp2 in the pass.
    ``state_kv`` (``impl="mosaic"``, unsplit rows): the fused pass reads the initial state and writes the final one
    in the op's [B, Hv, K, V] layout itself (``fused_state_pass(state_kv=True)``), instead of two XLA transposes to
    and from its S^T (4 x 4 B Hv K V bytes of HBM traffic and two launches); the jnp twin and the split ignore it.
    ``split_chain`` (P = 2): piece 1's start state from one state-only pass over piece 0 from the initial state
    (``mosaic_gpu_split.start_states(map_impl="chain")``) instead of the map pass and the scan.
    ``split_scan`` / ``split_first`` / ``split_precision`` (P > 1): the start states' scan, first-piece form and
    the scan's products' precision (None: ``mosaic_gpu_split.SCAN`` / ``FIRST`` / ``SCAN_PRECISION``; see
    ``mosaic_gpu_split.start_states``).

    q, k [B, T, Hk, K]; v [B, T, Hv, V] (mosaic: one of bf16 / fp16, K, V in {64, 128}); g [B, T, Hv] fp32
    log-decay; beta [B, T, Hv]; initial_state [B, Hv, K, V] fp32 or None. Returns (o [B, T, Hv, V] in v's dtype,
    final_state [B, Hv, K, V] fp32 or None), as ``jax_gdn.ops.chunk_gated_delta_rule`` (no cu_seqlens).
    """
    if impl not in ("mosaic", "reference"):
        raise ValueError(f"impl must be 'mosaic' or 'reference'; got {impl!r}")
    if stage1a not in STAGE1A:
        raise ValueError(f"stage1a must be one of {STAGE1A}; got {stage1a!r}")
    if not isinstance(pieces, int) or isinstance(pieces, bool) or not 0 <= pieces <= MAX_PIECES:
        raise ValueError(f"pieces must be an int in [0, {MAX_PIECES}] (0: automatic); got {pieces!r}")
    check_supported(q, k, v, g, beta, initial_state, kernel=impl == "mosaic")
    b, t, _, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    scale = kdim ** -0.5 if scale is None else float(scale)
    if pieces == 0:
        pieces = split_pieces(b, hv, kdim, vdim, t + (-t) % C, has_h0=initial_state is not None)
    kernel = impl == "mosaic"
    head_major = stage1a == "mosaic"
    exp2 = bool(exp2) and head_major
    kv = bool(state_kv) and kernel and pieces == 1
    if head_major:
        ops_ = _prepare_head_major(q, k, v, g, beta, initial_state, kernel=kernel, pieces=pieces, exp2=exp2)
    else:
        ops_ = _prepare(q, k, v, g, beta, initial_state, interpret=not kernel, pieces=pieces)
    run = fused_state_pass if kernel else fused_state_pass_reference
    if pieces > 1:
        h0_pieces = _split_start_states(ops_, pieces, kernel=kernel, head_major=head_major, exp2=exp2,
                                        chain=split_chain, scan=split_scan, first=split_first,
                                        precision=split_precision)
        o, ht = run(*ops_[:6], h0_pieces, scale=scale, out_final=output_final_state, head_major=head_major,
                    pieces=pieces, exp2=exp2)
        if ht is not None:      # the final state is the last piece's
            ht = ht.reshape((b, pieces) + ht.shape[1:])[:, -1]
    elif kv:            # the states in [B, Hv, K, V] straight into and out of the kernel (no XLA transposes)
        h0 = None if initial_state is None else initial_state.astype(F32)
        o, ht = run(*ops_[:6], h0, scale=scale, out_final=output_final_state, head_major=head_major, exp2=exp2,
                    state_kv=True)
    else:
        o, ht = run(*ops_, scale=scale, out_final=output_final_state, head_major=head_major, exp2=exp2)
    o = o[:, :t].astype(v.dtype)
    return o, (None if ht is None else ht if kv else jnp.swapaxes(ht, -1, -2))


# ---------------------------------------------------------------------------------------------------------------
# the op's backend "mosaic_gpu" (api.py routes here)
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch choices of the "mosaic_gpu" backend, fixed when the call is built (never read from the environment).

    stage1a: "mosaic" (:func:`kkt_fwd`, the gate-free T0) or "triton" (Pallas Triton ``kkt_solve``, the gated T).
    pieces: the sequence split, 0 = :func:`split_pieces` decides per shape, 1 = never split, P = always P pieces.
    exp2: log2 gates and exp2 in the fused pass (jla's form; stage1a "mosaic" only), else natural log and exp.
    state_kv: the fused pass reads / writes the states in the op's [B, Hv, K, V] layout (no XLA transposes around
    it; unsplit rows only, the split keeps its transposed start states).
    split_chain: at P = 2, piece 1's start state from one state-only pass over piece 0 from the initial state (no
    state map M, no scan: ``mosaic_gpu_split.start_states(map_impl="chain")``); other P ignore it.
    split_scan: the split's piece scan, "serial" / "log" / "triton" / "auto" (None: ``mosaic_gpu_split.SCAN``).
    split_first: the split's first piece with an initial state, "map" (from [I | 0]) or "h0" (walked from h0
    itself; None: ``mosaic_gpu_split.FIRST``).
    split_precision: the scan's products, "highest" (IEEE fp32), "high" (bf16 x 3) or "default" (tf32) (None:
    ``mosaic_gpu_split.SCAN_PRECISION``).
    """
    stage1a: str = "mosaic"
    pieces: int = 0
    exp2: bool = True
    state_kv: bool = True
    split_chain: bool = False
    split_scan: Optional[str] = None
    split_first: Optional[str] = None
    split_precision: Optional[str] = None

    def __post_init__(self):
        if self.stage1a not in STAGE1A:
            raise ValueError(f"MosaicConfig.stage1a must be one of {STAGE1A}; got {self.stage1a!r}")
        if not isinstance(self.pieces, int) or not 0 <= self.pieces <= MAX_PIECES:
            raise ValueError(f"MosaicConfig.pieces must be an int in [0, {MAX_PIECES}]; got {self.pieces!r}")
        for name in ("exp2", "state_kv", "split_chain"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MosaicConfig.{name} must be a bool; got {getattr(self, name)!r}")
        from pallas_kernels.gated_delta_rule.mosaic_gpu import split as ms
        if self.split_scan is not None and self.split_scan not in ms.SCAN_CHOICES:
            raise ValueError(f"MosaicConfig.split_scan must be None or one of {ms.SCAN_CHOICES}; "
                             f"got {self.split_scan!r}")
        if self.split_first is not None and self.split_first not in ms.FIRSTS:
            raise ValueError(f"MosaicConfig.split_first must be None or one of {ms.FIRSTS}; "
                             f"got {self.split_first!r}")
        if self.split_precision is not None and self.split_precision not in ms.PRECISIONS:
            raise ValueError(f"MosaicConfig.split_precision must be None or one of {tuple(ms.PRECISIONS)}; "
                             f"got {self.split_precision!r}")


#: The launch choices of "mosaic_gpu" / "auto", from the H200 (NOTES.md "Session 8: dense Mosaic", one process, 3
#: interleaved rounds, bf16, ms; each change won every round it was timed in):
#:   pieces=0: the sequence split where :func:`split_pieces` says (rows of <= MAX_SPLIT_CTAS CTAs): P = 2 on the
#:     64-CTA rows (B1-T8192-Hk16-Hv32 0.2585 against 0.2830 unsplit, jla 0.2790; B1-T32768 0.928 against 1.078, jla
#:     1.061), P = 4 at B1-T8192-Hk2-Hv8 (0.1436 against 0.1571 at P = 8, jla 0.1383); on since session 7, whose
#:     weak-decay GPU tests of the split pass at P = 2, 4, 8;
#:   state_kv=True: the unsplit rows' states read and written by the fused pass in [B, Hv, K, V] (two XLA
#:     transposes and their launches gone): B16-T1024 0.359 against 0.392, B4-T4096 0.337 against 0.346;
#:   exp2=True: log2 gates and exp2 (jla's form): B16 kv 0.359 -> 0.354, B4 kv 0.337 -> 0.334, Hk2-Hv8 P = 4
#:     0.1436 -> 0.1422; numerics unchanged (o 3.39e-3, state 2.4e-3 relative RMS against fp32 XLA);
#:   split_chain=False: P = 2 through one state-only fused pass over piece 0 lost to the map kernel + scan every
#:     round (0.270 against 0.2585; 1.003 against 0.928);
#:   split_scan / split_first / split_precision None: mosaic_gpu_split's SCAN ("auto": XLA's serial stack at P = 2,
#:     Triton above), FIRST ("h0": the first piece walked from the initial state) and SCAN_PRECISION ("default":
#:     tf32 products). Session 9 (3 interleaved rounds each): B1-T8192-Hk2-Hv8 (P = 4) first "h0" + Triton tf32
#:     0.1222 (run 2; jla 0.1365), first "h0" + serial fp32 0.1296, session 8's (map + Triton fp32) 0.1425;
#:     B1-T8192-Hk16-Hv32 (P = 2) first "h0" 0.2477 against session 8's 0.2555 (jla 0.2766); B1-T32768 0.9107 against
#:     0.9106 (a tie; jla 1.046).
DEFAULT_CONFIG = MosaicConfig()


def is_hopper() -> bool:
    """Whether the default device is an sm_90 (Hopper) GPU, where the Mosaic GPU kernels are compiled."""
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and getattr(d, "compute_capability", None) == "9.0"


def fallback_reason(q, k, v, *, chunk_size: int = C, hopper: Optional[bool] = None) -> Optional[str]:
    """Why the Mosaic GPU kernels cannot run this call (dense rows, packed sequences and the slot pool alike), or
    None when they can. Shapes and dtypes only (works on ShapeDtypeStructs and tracers). ``hopper``: whether the
    device is an sm_90 GPU (None: :func:`is_hopper`)."""
    if not (is_hopper() if hopper is None else hopper):
        return "the Mosaic GPU kernels need an sm_90 (Hopper) GPU"
    if chunk_size != C:
        return f"the Mosaic GPU kernels use chunk_size {C}; got {chunk_size}"
    dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dts) != 1 or next(iter(dts)) not in SUPPORTED_DTYPES:
        return (f"the Mosaic GPU kernels take q, k, v of one 16-bit dtype (bfloat16 / float16; wgmma has no IEEE "
                f"fp32); got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS or v.shape[3] not in SUPPORTED_HEAD_DIMS:
        return f"the Mosaic GPU kernels take head dims in {SUPPORTED_HEAD_DIMS}; got K={q.shape[3]}, V={v.shape[3]}"
    if q.shape[0] == 0 or q.shape[1] == 0:
        return "empty input (B = 0 or T = 0)"
    return None


def op_fwd(q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool,
           config: MosaicConfig = None):
    """The "mosaic_gpu" backend of ``chunk_gated_delta_rule`` (dense rows; api.py has checked the arguments and
    :func:`fallback_reason`). Returns (o [B, T, Hv, V] in v's dtype, final_state [B, Hv, K, V] fp32 or None).
    jax.grad / jax.jvp raise NotImplementedError naming backend='xla' (no backward pass)."""
    from pallas_kernels.gated_delta_rule.triton.chunk import no_autodiff
    cfg = config or DEFAULT_CONFIG

    def run(q, k, v, g, beta, *h0):
        return chunk_gated_delta_rule_fwd(q, k, v, g.astype(F32), beta, h0[0] if h0 else None, scale=float(scale),
                                          output_final_state=output_final_state, impl="mosaic",
                                          stage1a=cfg.stage1a, pieces=cfg.pieces, exp2=cfg.exp2,
                                          state_kv=cfg.state_kv, split_chain=cfg.split_chain,
                                          split_scan=cfg.split_scan, split_first=cfg.split_first,
                                          split_precision=cfg.split_precision)
    h0 = () if initial_state is None else (initial_state.astype(F32),)
    return no_autodiff(run)(q, k, v, g, beta, *h0)


# ---------------------------------------------------------------------------------------------------------------
# the GPU probe's hook (benchmarks/gpu/jla_probe.py)
# ---------------------------------------------------------------------------------------------------------------
def probe_rows(case, args, timer, *, interpret=False, log=print, reference=None) -> dict:
    """For jla_probe: time this port beside the others on ``args`` = (q, k, v, g, beta, h0) (bench inputs), and
    check it against the fp32 XLA backend (``reference()``: its (o, final state), computed here when None).
    Returns {"ms": {"fwd", "fused"}, "numerics": {"o", "state", "o_finite"}}."""
    out = {"ms": {}, "numerics": {}}
    from jax_gdn import ops
    q = args[0]
    impl = "reference" if interpret else "mosaic"    # interpret (CPU): the jnp twin, to check the plumbing
    if interpret:
        log("  mgpu: the kernel needs a Hopper GPU; timing its jnp twin (impl='reference') instead")

    def timed(key, fn, fargs):
        try:
            res = jax.block_until_ready(fn(*fargs))
            out["ms"][key] = round(timer(fn, fargs), 4)
            log(f"  mgpu.{key:9s} {out['ms'][key]:8.4f} ms")
            return res
        except Exception as e:  # noqa: BLE001 - report and go on
            out["ms"][key] = None
            out.setdefault("errors", []).append(f"{key}: {type(e).__name__}: {str(e)[:600]}")
            log(f"  mgpu.{key:9s} FAIL {type(e).__name__}: {str(e)[:600]}")
            return None

    res = timed("fwd", lambda *a: chunk_gated_delta_rule_fwd(*a, impl=impl), args)
    if res is not None:
        if reference is not None:
            ref = reference()
        else:
            f32 = [x.astype(F32) for x in args]
            with jax.default_matmul_precision("highest"):
                ref = jax.block_until_ready(jax.jit(lambda *a: ops.chunk_gated_delta_rule(
                    *a[:5], initial_state=a[5], output_final_state=True, backend="xla"))(*f32))

        def rel(a, r):
            a, r = a.astype(F32), r.astype(F32)
            return float(jnp.sqrt(jnp.mean((a - r) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(r ** 2)), 1e-30))
        out["numerics"] = {"o": rel(res[0], ref[0]), "state": rel(res[1], ref[1]),
                           "o_finite": bool(jnp.all(jnp.isfinite(res[0].astype(F32))))}
        log(f"  mgpu numerics: o {out['numerics']['o']:.2e} state {out['numerics']['state']:.2e} "
            f"(rel RMS vs fp32 XLA; bf16 bound 1e-2)")
    # the fused kernel alone, on stage 1a's outputs
    if interpret:
        return out
    try:
        operands = jax.block_until_ready(jax.jit(functools.partial(_prepare, interpret=False))(*args))
        timed("fused", jax.jit(lambda *a: fused_state_pass(*a, scale=q.shape[3] ** -0.5, out_final=True)),
              operands)
    except Exception as e:  # noqa: BLE001
        log(f"  mgpu.fused setup FAIL {type(e).__name__}: {str(e)[:400]}")
    return out
