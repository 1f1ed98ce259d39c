# Copyright 2026 KarLex AI, Inc.
# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
# The kernel body of fused_state_pass and the helpers marked "(jla)" are adapted from jax-linear-attention 0.1.0
# (Apache-2.0), jla/ops/mosaic_gpu/scalar_gate_fused.py (fused_fwd_wy) and jla/ops/mosaic_gpu/_common.py, which
# were themselves adapted from flash-linear-attention (MIT) and FlashQLA (MIT). See NOTICE in this folder.
"""Mosaic GPU (Hopper, sm_90) backend of the chunked gated delta rule forward, dense prefill: the op's backend
"mosaic_gpu" (the dispatch table in api.py routes here; "auto" picks it for the calls it takes on a Hopper GPU). At B1-T8192-Hk16-Hv32 on the H200 it
runs in 0.316 ms against Pallas Triton's 0.443 (``python -m benchmarks gdn``).

Two kernels and a little XLA glue:
  * stage 1a, :func:`kkt_fwd` (jla's kkt_fwd): the gate-free T0 = (I + A0)^-1,
    A0_ij = beta_i k_i.k_j (j < i), 16 x 16 diagonal blocks by forward substitution, merged on the tensor cores;
    T0 [B, Hv, Tp, C] in the input dtype. (``stage1a="triton"``: Pallas Triton ``kkt_solve``'s gated T instead.)
  * :func:`fused_state_pass` (jla's fused_fwd_wy): stages 1b + 2 of gated_delta_rule/triton/chunk.py in one
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
    The wide form (``MosaicConfig.wide``; "auto" picks it where the narrow form runs more than one wave of CTAs:
    the batched rows and the packed mixes): one CTA per (row, value head) over all V = 128 columns, four warpgroups
    as FlashInfer's SM90 kernel splits them: two state warpgroups (one per 64 value columns) that also form their
    half of the output, o^T = e^G scale (S^T q^T) + v_new^T P^T, one warpgroup forming Ag and P once for both,
    and the memory warpgroup. Half the CTAs, and no S^T / v_new hand-off through SMEM.
  * the sequence split (jla's piece maps, :func:`split_pieces` decides; ``MosaicConfig.pieces`` and
    ``MosaicConfig.split``, a :class:`SplitConfig`): where B Hv V / 64 CTAs leave the SMs idle, each row is cut
    into P pieces run side by side; their start states come from one state-map pass over pieces 0 .. P - 2 (a
    piece's map is affine, S_end = M S_start + E: ``split.state_map_pass``, a state-only kernel carrying [M | E]
    with u read in place; the first piece walked from the initial state itself) and a scan over the pieces
    (``split.piece_scan``: one Pallas Triton launch with tf32 products; at 2 pieces an XLA stack, no product).

Scope (dense rows here; packed sequences and the slot pool in ``mosaic_gpu/varlen.py``, which lays them out for
the same kernels: the fused pass's ``walk`` table): q, k, v bf16 / fp16 of one dtype, K and V in {64, 128}, Hv a
multiple of Hk, any T (padded with zero tokens to a multiple of C * P: zero k, v, beta and g leave the state and
the real rows unchanged), g floored at G_FLOOR as the other backends do, initial state [B, Hv, K, V] fp32 or None,
the final state returned. Not here (api.py runs Pallas Triton with a warning naming the reason,
:func:`fallback_reason`): fp32 inputs, other head dims, chunk sizes other than 64, a GPU other than sm_90. Mosaic GPU kernels do not
run in interpret mode on this repo's CPU jax (0.10.2; the code targets 0.11's Pallas Mosaic GPU API): each kernel
has a jnp twin (:func:`kkt_fwd_reference`, :func:`fused_state_pass_reference`) that the CPU tests check against
float64; the kernels' tests are GPU-marked.

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

from pallas_kernels.gated_delta_rule.mosaic_gpu import split as mosaic_split
from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk_reference import (chunk_layout, chunk_step,  # noqa: F401
                                                                       fused_state_pass_reference)
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import (BV, C, LN2, LOG2E, SMEM_BUDGET, bcast_cols,  # noqa: F401
                                                              bcast_rows, iota, matmul, num_sms, ring_stages, smem)
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import plgpu as _plgpu
from pallas_kernels.gated_delta_rule.mosaic_gpu.split import (DEFAULT_SPLIT, FIRSTS, PRECISIONS, SCANS,  # noqa: F401
                                                             SplitConfig, split_cost, split_pieces)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# setmaxnreg of the wide fused pass's warpgroups (memory, Ag / P, each state half): 128 threads x (24 + 104 + 2 x
# 192) = the SM's 64 K registers (FlashInfer's SM90 split of the same roles)
WIDE_REGISTERS = (24, 104, 192)
SUPPORTED_HEAD_DIMS = (64, 128)
F32 = jnp.float32


# ---------------------------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------------------------
def fused_pass_scratch(key_dim: int, dtype, out_dtype, *, write_o: bool, has_state: bool, state_kv: bool,
                       in_place: bool, wide: bool, solve: bool):
    """(ring stages, TMA copies a chunk, the SMEM scratch) of :func:`fused_state_pass` in one form (its
    arguments of the same names; ``has_state``: an initial state read or the final one written): the buffers and
    barriers its warpgroups share, sized for :func:`common.smem_bytes` to check against the SM."""
    plgpu = _plgpu()
    isz = jnp.dtype(dtype).itemsize
    n_vec = 5 if solve else 4    # g_state, g_rows, g_cols, b_cols (+ b_rows: the solve's A0 rows)
    osz = jnp.dtype(out_dtype).itemsize
    state_bytes = BV * key_dim * 4 if has_state else 0
    solve_bytes = 2 * C * (C + SOLVE_PAD) * 4          # the diagonal solve's two fp32 buffers
    if wide:                     # q, k, v (both halves), T0 -> Ag, P; o staged per half; no published tiles
        per_stage = 2 * C * key_dim * isz + 2 * C * BV * isz + 2 * C * C * isz + n_vec * C * 4
        fixed = 2 * 2 * C * BV * osz
        if solve:                # the solve buffers alias the state tile; the merges' operand
            state_bytes = max(state_bytes, solve_bytes)
            fixed += C * C * isz
    else:
        per_stage = 2 * C * key_dim * isz + C * BV * isz + C * C * isz + n_vec * C * 4
        fixed = 2 * BV * key_dim * isz + 2 * C * BV * isz + 2 * C * BV * osz
    fixed += state_bytes + 4096 + n_vec * 1024
    stages = ring_stages(per_stage, fixed)
    # TMA copies a chunk: q (not in the map pass), k, v (wide: two halves), T0 (not with solve), the vectors
    n_copies = int(write_o) + 1 + (2 if wide else 1) + (0 if solve else 1) + n_vec
    vecs = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        q_s=smem((stages, C, key_dim), dtype),
        k_s=smem((stages, C, key_dim), dtype),
        v_s=smem((stages, 2, C, BV) if wide else (stages, C, BV), dtype),
        t_s=smem((stages, C, C), dtype),        # T, then Ag = T * beta_j (written by WG1)
        g_state=vecs,                            # WG0: column view + last gate
        g_rows=vecs,                             # WG1: row view
        g_cols=vecs,                             # WG1: column view
        b_cols=vecs,                             # WG1: beta per column of Ag
        o_out=smem((2, 2, C, BV) if wide else (2, C, BV), out_dtype),
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=3 if wide else 2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages),
        state_bar=plgpu.Barrier(num_barriers=2) if wide else plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=4 if wide else 3),
    )
    if wide:                     # P for both state halves; the halves take turns with the one state tile
        scratch.update(p_s=smem((stages, C, C), dtype), p_ready=plgpu.Barrier(num_barriers=stages),
                       handoff=plgpu.Barrier(num_barriers=3))
    if solve:
        scratch.update(b_rows=vecs, b_s=smem((C, C), dtype), solved=plgpu.Barrier())
    if not wide:                 # the narrow form publishes S^T and v_new to the output warpgroup
        scratch.update(s_pub=smem((2, BV, key_dim), dtype), vn_pub=smem((2, C, BV), dtype),
                       s_ready=plgpu.Barrier(num_barriers=2), s_free=plgpu.Barrier(num_barriers=2))
    if in_place:
        scratch.update(k_clean=plgpu.Barrier(num_barriers=stages))
    state_spec = plgpu.SMEM((key_dim, BV) if state_kv else (BV, key_dim), F32)
    if solve:                    # the state tile (start and end of the walk) and the solve's buffers (inside it)
        pad_spec = plgpu.SMEM((C, C + SOLVE_PAD), F32)
        scratch.update(state_union=plgpu.RefUnion(state_spec, (pad_spec, pad_spec)))
    elif has_state:
        scratch.update(state_smem=state_spec)

    return stages, n_copies, scratch


def fused_state_pass(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool, interpret=None,
                     head_major: bool = False, pieces: int = 1, run_pieces: int | None = None,
                     write_o: bool = True, exp2: bool = False, walk=None, num_states: int | None = None,
                     state_kv: bool = False, lane_rows=None, in_place: bool = False, wide: bool = False,
                     solve: bool = False):
    """Stages 1b + 2 as one warp-specialised Mosaic GPU kernel. Returns (o [B, Tp, Hv, V] in q's dtype or None
    (``write_o`` False), final S^T [B * R, Hv, V, K] fp32 or None); with ``in_place`` (o, edges, final state).

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
    ``walk`` (varlen, ``mosaic_gpu/varlen.py``): int32 [R, 3] table, row r = (first chunk c0, chunk count n_r,
    sequence s_r); then B = 1, P = 1, the grid is (R, Hv, V / BV) and CTA row r walks chunks c0 .. c0 + n_r - 1
    of the one row (a dynamic trip count, 0 allowed: the final state is then the initial one), starting from
    h0t[s_r] and storing its final state to [s_r]; h0t and the final state are [num_states, Hv, V, K] (S^T),
    chunk c is tokens [c C, c C + C) of q, k, v, o and chunk c of t / gcum / beta_c in either layout. Chunks no
    row walks are neither read nor written (their rows of o are left unset).
    ``lane_rows`` (persistent walk): with a walk table [L, R_max, 6] (each row + m0, the chunks its lane walked
    before it) and lane_rows [L] int32, CTA row p (grid (L, Hv, V / BV)) walks rows 0 .. lane_rows[p] - 1 of its
    lane back to back: the input ring and the barrier phases run on across rows (slot and phase from m0 + n), each
    row loads its own initial state and stores its final one, so a sequence's pipeline fill and state load overlap
    the previous sequence's tail instead of costing a CTA launch each.
    ``state_kv``: the initial and final states in the op's own layout [.., Hv, K, V] (not S^T): WG0 loads its
    [K, 64] tile by TMA and reads it transposed (``Layout.WGMMA_TRANSPOSED`` from the transposed SMEM view, then a
    register layout cast), and stores the final state the same way back; saves two XLA transposes of all states
    (2 x 2 x 2 MB per sequence at Hv 32, K = V = 128).
    ``in_place`` (varlen, packed tokens read where they lie): q, k [1, T, Hk, K] and v [1, T, Hv, V] are the
    packed row itself (T a multiple of 8: Mosaic tiles the GMEM rows of a TMA in 8s) and ``walk`` is [R, 6], row
    r = (c0, n_r, s_r, start, length, row0 / 8) with row0 = start rounded down to a multiple of 8 (stored in 8s so
    that every copy offset is a product by 8, which Mosaic's layout inference can see divides its tile). Chunk n
    of the row
    is packed rows [row0 + n C, row0 + n C + C) (rows past T read as zeros); its rows outside [start, start +
    length) belong to other sequences or to padding and are masked by selects, never by multiplies (so a NaN
    there reaches nothing): WG1 zeroes them in k's SMEM tile after it has published Ag (chunks with such rows
    only; WG0's state update waits for it on the ``k_clean`` barrier), WG0 zeroes those columns of W (its
    S^T k^T reads k beside that write), and the caller gives them g = 0 and beta = 0
    in t / gcum / beta_c, which stay in the chunk-slot layout (chunk c0 + n). o [1, T, Hv, V] is stored in place:
    a chunk wholly inside its sequence by one copy, the others in groups of 8 rows, those wholly inside the
    sequence to o and a partial group to ``edges`` [2 num_states, 8, Hv, V]
    (entry 2 s_r the group of the sequence's first token, 2 s_r + 1 the group of its last when that is another);
    the caller merges the edges and zeroes the padding rows (:func:`varlen.merge_edges`). A walk [R, 8] (the
    packed split, ``varlen.split_plan``) adds (sequence n_r, chunks of it before this row) to each row: a piece of
    a split sequence starts from its own state row s_r and names its sequence's edge entries (2 n_r, 2 n_r + 1).
    ``wide`` (V = 2 BV, ``head_major``, ``write_o``, no lanes): one CTA per (row, value head) covers all V = 128
    columns with four warpgroups (FlashInfer's SM90 layout): two state warpgroups (WG0 columns 0..63, WG3
    64..127) each hold their S^T half and compute their half of the output themselves, o^T = e^G scale (S^T q^T) +
    v_new^T P^T (every left operand from registers); WG1 forms Ag and P = scale q k^T e^(G_i - G_j) once for both
    halves (P to SMEM); WG2 streams the tiles. Half the CTAs of the narrow form, and Ag, P and the q / k / T0
    loads are not repeated per 64 value columns; no S^T or v_new tile is published.
    ``solve`` (with ``wide``; ``t`` None): WG1 also forms T0 itself from the k tile in SMEM (:func:`blocked_inverse`,
    stage 1a's solve), so no kkt_fwd launch and no T0 in HBM; its solve buffers share SMEM with the state tile
    (WG1 starts solving once both state halves are loaded, and they store the final state once WG1 has finished).
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
    if in_place and (not varlen or lanes or walk.ndim != 2 or walk.shape[-1] not in (6, 8) or not write_o
                     or padded % 8):
        raise ValueError("fused_state_pass: in_place needs a walk table [R, 6] or [R, 8], no lanes, write_o and a "
                         "packed row "
                         f"of a multiple of 8 tokens (got T = {padded})")
    if wide and (v.shape[3] != 2 * BV or not head_major or not write_o or lanes):
        raise ValueError(f"fused_state_pass: wide needs V = {2 * BV} (got {v.shape[3]}), head_major, write_o and "
                         "no lanes")
    if solve != (t is None) or (solve and not wide):
        raise ValueError("fused_state_pass: solve (wide only) forms T0 in the kernel and takes t = None; without "
                         "solve t is required")
    if lanes and (walk is None or walk.ndim != 3 or walk.shape[-1] != 6):
        raise ValueError("fused_state_pass: lane_rows needs a lane walk table [L, R_max, 6]")
    if varlen and (batch != 1 or pieces != 1 or num_states is None):
        raise ValueError(f"fused_state_pass: a walk table needs B = 1 (got {batch}), pieces = 1 (got {pieces}) "
                         f"and num_states (got {num_states})")
    if in_place:             # q / k / v are the packed row; the chunk slots are gcum's (either layout)
        padded = gcum.shape[2] if head_major else gcum.shape[0] * C
    if padded % (C * pieces) or not 1 <= run_pieces <= pieces:
        raise ValueError(f"fused_state_pass: Tp={padded} must be a multiple of C * pieces = {C * pieces} and "
                         f"1 <= run_pieces={run_pieces} <= pieces={pieces}")
    ncb_row = padded // C        # chunks per row
    ncb = ncb_row // pieces      # chunks per piece (the loop's trip count)
    piece_len = ncb * C
    nv = 1 if wide else value_dim // BV
    dtype = k.dtype
    out_dtype = q.dtype
    _exp = jnp.exp2 if exp2 else jnp.exp
    has_h0 = h0t is not None
    stages, n_copies, scratch = fused_pass_scratch(key_dim, dtype, out_dtype, write_o=write_o,
                                                   has_state=has_h0 or out_final, state_kv=state_kv,
                                                   in_place=in_place, wide=wide, solve=solve)

    n_rows = k.shape[1]          # rows of q / k / v / o (the packed row when in_place)
    out_type = [jax.ShapeDtypeStruct((batch, n_rows if in_place else padded, heads, value_dim), out_dtype)] \
        if write_o else []
    if in_place:
        out_type.append(jax.ShapeDtypeStruct((2 * num_states, 8, heads, value_dim), out_dtype))
    if out_final:
        out_type.append(jax.ShapeDtypeStruct(
            ((num_states if varlen else batch * run_pieces), heads)
            + ((key_dim, value_dim) if state_kv else (value_dim, key_dim)), F32))
    if not out_type:
        raise ValueError("fused_state_pass: nothing to compute (write_o and out_final both False)")

    def body(*refs, q_s, k_s, v_s, t_s, g_state, g_rows, g_cols, b_cols, o_out, in_bar, in_free, ag_ready,
             state_bar, done, s_pub=None, vn_pub=None, s_ready=None, s_free=None, state_smem=None, k_clean=None,
             p_s=None, p_ready=None, handoff=None, b_rows=None, b_s=None, solved=None, state_union=None):
        refs = list(refs)
        q_ref, k_ref, v_ref = (refs.pop(0) for _ in range(3))
        t_ref = None if solve else refs.pop(0)
        g_ref, b_ref = refs.pop(0), refs.pop(0)
        na_s = x_s = None
        if solve:
            state_smem, (na_s, x_s) = state_union
        h0_ref = refs.pop(0) if has_h0 else None
        walk_ref = refs.pop(0) if varlen else None
        nrows_ref = refs.pop(0) if lanes else None
        o_ref = refs.pop(0) if write_o else None
        edge_ref = refs.pop(0) if in_place else None
        ht_ref = refs.pop(0) if out_final else None
        r, hh, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        if varlen:
            b, piece = 0, 0
        else:
            b, piece = lax.div(r, run_pieces), lax.rem(r, run_pieces)

        def row_at(j):
            """The j-th row this CTA walks: (c0, count, state row, first row of t / gcum / beta_c (and of o unless
            in_place), first row of q / k / v (the same unless in_place: row0), (start, end) of the sequence's
            tokens when in_place, chunks this CTA walked before it, (sequence, chunks of it before this row) for
            the edge entries when in_place)."""
            if not varlen:               # dense: piece p of row b
                tok0 = piece * piece_len
                return None, ncb, r, tok0, tok0, None, 0
            ent = (lambda i: walk_ref[r, j, i]) if lanes else (lambda i: walk_ref[r, i])
            c0 = ent(0)
            tok0 = c0 * C
            if in_place:                 # [R, 8]: a piece of a split sequence names its sequence and offset
                edge = (ent(6), ent(7)) if walk.shape[-1] == 8 else (ent(2), 0)
                return c0, ent(1), ent(2), tok0, ent(5) * 8, (ent(3), ent(3) + ent(4)), 0, edge
            return c0, ent(1), ent(2), tok0, tok0, None, ent(5) if lanes else 0

        def tile_rows(n, row):
            """in_place: (first packed row of chunk n, [lo, hi) its rows in the sequence, whether some are not)."""
            tile0 = row[4] + n * C
            lo = jnp.maximum(row[5][0] - tile0, 0)
            hi = jnp.minimum(row[5][1] - tile0, C)
            return tile0, lo, hi, (lo > 0) | (hi < C)

        hk = lax.div(hh, group)
        v0 = iv * BV
        wg = lax.axis_index("wg")

        def store_o(n, row, o_buf, col0, tile=None):
            """Stores the staged [C, BV] output tile ``o_buf`` of chunk n (value columns col0 ..) by TMA: one copy
            (dense rows, or an in-place chunk wholly inside its sequence), else groups of 8 rows, those inside the
            sequence to o and a partial one to the edges. One commit group a chunk. ``tile``: ``tile_rows(n, row)``
            (in place)."""
            if not in_place:
                plgpu.copy_smem_to_gmem(o_buf, o_ref.at[b, pl.ds(row[3] + n * C, C), hh, pl.ds(col0, BV)])
                return
            tile0, _, _, edge = tile
            start, end = row[5]
            plgpu.copy_smem_to_gmem(o_buf, o_ref.at[0, pl.ds(tile0, C), hh, pl.ds(col0, BV)],
                                    predicate=jnp.logical_not(edge), commit_group=False)

            @pl.when(edge)
            def _():
                for j in range(C // 8):
                    grow = tile0 + 8 * j
                    inside = (grow >= start) & (grow + 8 <= end)
                    part = jnp.logical_not(inside) & (grow < end) & (grow + 8 > start)
                    entry = 2 * row[7][0] + (jnp.minimum(n + row[7][1], 1) if j == 0 else 1)
                    src = o_buf.at[pl.ds(8 * j, 8)]
                    plgpu.copy_smem_to_gmem(src, o_ref.at[0, pl.ds(grow, 8), hh, pl.ds(col0, BV)],
                                            predicate=inside, commit_group=False)
                    plgpu.copy_smem_to_gmem(src, edge_ref.at[entry, :, hh, pl.ds(col0, BV)], predicate=part,
                                            commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(WIDE_REGISTERS[0] if wide else 40, action="decrease")

            def issue_qkv(srcs, rows, slot):
                qr, kr, vr = srcs
                bar = in_bar.at[slot]
                if write_o:
                    plgpu.copy_gmem_to_smem(qr.at[b, rows, hk], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(kr.at[b, rows, hk], k_s.at[slot], bar)
                if wide:
                    for half_v in range(2):
                        plgpu.copy_gmem_to_smem(vr.at[b, rows, hh, pl.ds(half_v * BV, BV)], v_s.at[slot, half_v],
                                                bar)
                else:
                    plgpu.copy_gmem_to_smem(vr.at[b, rows, hh, pl.ds(v0, BV)], v_s.at[slot], bar)

            def issue(n, slot, row):     # n: chunk index within the row
                c0, tok0 = row[0], row[3]
                rows = pl.ds(tok0 + n * C, C)
                bar = in_bar.at[slot]
                issue_qkv((q_ref, k_ref, v_ref), pl.ds(row[4] + n * C, C) if in_place else rows, slot)
                if head_major:           # kkt_fwd's layout: [B, Hv, Tp, C] and [B, Hv, Tp]
                    t_src = None if solve else t_ref.at[b, hh, rows]
                    g_src, b_src = g_ref.at[b, hh, rows], b_ref.at[b, hh, rows]
                else:                    # Triton stage 1a's chunk layout: chunk c = b * NC_row + j
                    c = c0 + n if varlen else b * ncb_row + piece * ncb + n
                    t_src, g_src, b_src = t_ref.at[c, hh], g_ref.at[c, hh], b_ref.at[c, hh]
                if not solve:
                    plgpu.copy_gmem_to_smem(t_src, t_s.at[slot], bar)
                for g_buf in (g_state, g_rows, g_cols):
                    plgpu.copy_gmem_to_smem(g_src, g_buf.at[slot], bar)
                for b_buf in (b_cols, b_rows) if solve else (b_cols,):
                    plgpu.copy_gmem_to_smem(b_src, b_buf.at[slot], bar)

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

        @pl.when(((wg == 0) | (wg == 3)) if wide else (wg == 0))
        def _state():
            plgpu.set_max_registers(WIDE_REGISTERS[2] if wide else 232, action="increase")
            # wide: WG0 holds value columns 0..63, WG3 64..127; they take turns with the one state tile in SMEM:
            # WG0 loads, then WG3 (handoff 0); WG0 stores once WG3 has loaded (handoff 2; with solve, once WG1 has
            # solved its last chunk: the solve buffers alias the tile), then WG3 (handoff 1)
            hv = (wg == 3).astype(jnp.int32) if wide else 0
            sv0 = hv * BV if wide else v0
            sbar = state_bar.at[hv] if wide else state_bar

            def when_half(h, fn):
                pl.when(hv == h)(fn)

            def turn(k_, fn):
                if not wide:
                    fn()
                    return
                if k_ == 1:              # the store: after WG3's load (and WG1's last solve)
                    def first():
                        if has_h0:
                            plgpu.barrier_wait(handoff.at[2])
                        if solve:
                            plgpu.barrier_wait(solved)
                    when_half(0, first)
                when_half(1, lambda: plgpu.barrier_wait(handoff.at[k_]))
                fn()
                when_half(0, lambda: plgpu.barrier_arrive(handoff.at[k_]))
                if k_ == 0:
                    when_half(1, lambda: plgpu.barrier_arrive(handoff.at[2]))

            def load_state(srow):
                out = []

                def load():
                    if has_h0 and state_kv:  # S [K, BV] tile, read as S^T through the transposed view
                        plgpu.copy_gmem_to_smem(h0_ref.at[srow, hh, pl.ds(0, key_dim), pl.ds(sv0, BV)], state_smem,
                                                sbar)
                        plgpu.barrier_wait(sbar)
                        # (state_smem.T: plgpu.transpose_ref needs a ref with .memory_space, a scratch ref has none)
                        s_kv = plgpu.load(state_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)
                        out.append(plgpu.layout_cast(s_kv, WGMMA))
                    elif has_h0:
                        plgpu.copy_gmem_to_smem(h0_ref.at[srow, hh, pl.ds(sv0, BV)], state_smem, sbar)
                        plgpu.barrier_wait(sbar)
                        out.append(plgpu.load(state_smem, layout=WGMMA))
                if not has_h0:
                    return plgpu.layout_cast(jnp.zeros((BV, key_dim), F32), WGMMA)
                turn(0, load)
                return out[0]

            def store_state(srow, s_t):
                def store():
                    if state_kv:
                        state_smem.T[...] = plgpu.layout_cast(s_t, plgpu.Layout.WGMMA_TRANSPOSED)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(state_smem,
                                                ht_ref.at[srow, hh, pl.ds(0, key_dim), pl.ds(sv0, BV)])
                    else:
                        state_smem[...] = s_t
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(state_smem, ht_ref.at[srow, hh, pl.ds(sv0, BV)])
                    plgpu.wait_smem_to_gmem(0)
                turn(1, store)

            def step_wide(n, s_t, row):
                """One chunk of one value half: the state chain and this half's output."""
                slot = lax.rem(n, stages)
                half = lax.rem(n, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                tile = tile_rows(n, row) if in_place else None
                if in_place:
                    _, lo, hi, edge = tile
                s_lo = s_t.astype(dtype)
                g_last = g_state[slot, C - 1]
                g_col = plgpu.load(g_state.at[slot], layout=COLS)
                key_decay = _exp(g_col)                     # Gamma: also the output's e^G (tokens are columns)
                k_decay = _exp(g_last - g_col)
                s_decay = _exp(g_last)
                x_t = matmul(s_lo, k_s.at[slot].T, (BV, C))                  # S^T k^T
                v_t = plgpu.load(v_s.at[slot, hv].T, layout=WGMMA).astype(F32)
                w_t = v_t - x_t * bcast_cols(key_decay, (BV, C))
                if in_place:             # v's rows outside the sequence: a select, so a NaN there reaches nothing
                    cols = iota((BV, C), 1)
                    w_t = jnp.where((cols >= lo) & (cols < hi), w_t, 0.0)
                w_t = w_t.astype(dtype)
                o_t = matmul(s_lo, q_s.at[slot].T, (BV, C))                  # (q S)^T from the incoming state
                plgpu.barrier_wait(ag_ready.at[slot])
                vn_t = matmul(w_t, t_s.at[slot].T, (BV, C))
                vd_t = (vn_t * bcast_cols(k_decay, (BV, C))).astype(dtype)
                vn_lo = vn_t.astype(dtype)
                if in_place:

                    @pl.when(edge)
                    def _():             # WG1 has zeroed k's rows outside the sequence
                        plgpu.barrier_wait(k_clean.at[slot])
                s_new = matmul(vd_t, k_s.at[slot], (BV, key_dim), init=s_t * s_decay)
                plgpu.barrier_wait(p_ready.at[slot])
                # o^T = e^G scale (S^T q^T) + v_new^T P^T (P carries the scale)
                o_t = matmul(vn_lo, p_s.at[slot].T, (BV, C), init=o_t * bcast_cols(key_decay * scale, (BV, C)))
                plgpu.barrier_arrive(in_free.at[slot])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # o_out[hv, half] of chunk n - 2 was sent
                o_out.at[hv, half].T[...] = o_t.astype(out_dtype)
                plgpu.commit_smem()
                store_o(n, row, o_out.at[hv, half], sv0, tile)
                return s_new

            def step(n, s_t, row):
                m0 = row[6]
                m = n if isinstance(m0, int) and m0 == 0 else m0 + n     # chunks this CTA walked before
                slot = lax.rem(m, stages)
                half = lax.rem(m, 2)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(m >= 2)
                def _():                 # WG1 has finished reading the tiles published two chunks ago
                    plgpu.barrier_wait(s_free.at[half])

                if in_place:
                    _, lo, hi, edge = tile_rows(n, row)
                s_lo = s_t.astype(dtype)
                s_pub.at[half][...] = s_lo
                g_last = g_state[slot, C - 1]
                g_col = plgpu.load(g_state.at[slot], layout=COLS)
                key_decay = _exp(g_col)                     # Gamma: the correction term reads the incoming state
                k_decay = _exp(g_last - g_col)
                s_decay = _exp(g_last)
                # W^T = v^T - (S^T k^T) Gamma, then v_new^T = W^T Ag^T
                x_t = matmul(s_lo, k_s.at[slot].T, (BV, C))
                v_t = plgpu.load(v_s.at[slot].T, layout=WGMMA).astype(F32)
                w_t = v_t - x_t * bcast_cols(key_decay, (BV, C))
                if in_place:             # v's rows outside the sequence: a select, so a NaN there reaches nothing
                    cols = iota((BV, C), 1)
                    w_t = jnp.where((cols >= lo) & (cols < hi), w_t, 0.0)
                w_t = w_t.astype(dtype)
                plgpu.barrier_wait(ag_ready.at[slot])
                vn_t = matmul(w_t, t_s.at[slot].T, (BV, C))
                vn_pub.at[half].T[...] = vn_t.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(s_ready.at[half])
                vd_t = (vn_t * bcast_cols(k_decay, (BV, C))).astype(dtype)
                if in_place:             # v_new is zero on the rows outside the sequence; 0 x NaN is not

                    @pl.when(edge)
                    def _():             # WG1 has zeroed k's rows outside the sequence
                        plgpu.barrier_wait(k_clean.at[slot])
                s_new = matmul(vd_t, k_s.at[slot], (BV, key_dim), init=s_t * s_decay)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            if lanes:
                @pl.loop(0, nrows_ref[r])
                def _rows(j):
                    row = row_at(j)
                    s_t = lax.fori_loop(0, row[1], functools.partial(step, row=row), load_state(row[2]))
                    if out_final:
                        store_state(row[2], s_t)
            elif wide:
                row = row_at(0)
                s_t = lax.fori_loop(0, row[1], functools.partial(step_wide, row=row), load_state(row[2]))
                if out_final:
                    store_state(row[2], s_t)
                plgpu.wait_smem_to_gmem(0)
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
            if wide:                     # forms Ag and P only: the state warpgroups take the registers
                plgpu.set_max_registers(WIDE_REGISTERS[1], action="decrease")
            else:
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
                keep = iota(sq, 0) >= iota(sq, 1)
                # the exponent is masked before exp, so acausal entries never overflow (jla decay_matrix)
                decay = _exp(jnp.where(keep, bcast_rows(g_row, sq) - bcast_cols(g_col, sq), -jnp.inf))
                # Ag = T * beta_j replaces T in the input buffer (Triton's T already carries e^(G_i - G_j);
                # kkt_fwd's gate-free T0 gets it here: T = T0 * e^(G_i - G_j), a diagonal similarity)
                b_col = plgpu.load(b_cols.at[slot], layout=COLS)
                tile = tile_rows(n, row) if in_place else None
                if in_place:
                    _, lo, hi, edge = tile
                if solve:                # stage 1a here: T0 from this chunk's k tile (rows outside the sequence zero)
                    mine = chunk_mask(lo, hi) if in_place else None
                    kk = matmul(k_s.at[slot], k_s.at[slot].T, sq)
                    t_in = blocked_inverse(kk, plgpu.load(b_rows.at[slot], layout=ROWS), b_col, na_s.at[:, :C],
                                           x_s.at[:, :C], b_s, dtype, mine=mine)
                else:
                    t_in = plgpu.load(t_s.at[slot], layout=WGMMA).astype(F32)
                if head_major:
                    t_in = t_in * decay
                ag = t_in * bcast_cols(b_col, sq)
                t_s.at[slot][...] = ag.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ag_ready.at[slot])
                if in_place:

                    @pl.when(edge)
                    def _():
                        # k's rows outside the sequence zeroed, after Ag (WG0 needs them only for its state
                        # update, behind k_clean; its S^T k^T beside this write reads them too, but only into
                        # W's columns that it masks) and before P reads k
                        kt = plgpu.load(k_s.at[slot], layout=WGMMA)
                        rr = iota((C, key_dim), 0)
                        k_s.at[slot][...] = jnp.where((rr >= lo) & (rr < hi), kt, jnp.zeros_like(kt))
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(k_clean.at[slot])
                if wide:                 # P = scale q k^T e^(G_i - G_j) (i >= j) for both value halves
                    p = matmul(q_s.at[slot], k_s.at[slot].T, sq)
                    p_s.at[slot][...] = (p * (decay * scale)).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready.at[slot])
                    plgpu.barrier_arrive(in_free.at[slot])
                    return carry
                if not write_o:          # the map pass: only Ag, then release the tiles
                    plgpu.barrier_wait(s_ready.at[half])
                    plgpu.barrier_arrive(s_free.at[half])
                    plgpu.barrier_arrive(in_free.at[slot])
                    return carry
                p = matmul(q_s.at[slot], k_s.at[slot].T, sq)
                p_lo = (p * decay).astype(dtype)
                plgpu.barrier_wait(s_ready.at[half])
                o = matmul(q_s.at[slot], s_pub.at[half].T, (C, BV))
                o = matmul(p_lo, vn_pub.at[half], (C, BV), init=o * bcast_rows(q_decay, (C, BV)))
                plgpu.barrier_arrive(s_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # o_out[half] of chunk m - 2 was sent
                o_out.at[half][...] = (o * scale).astype(out_dtype)
                plgpu.commit_smem()
                store_o(n, row, o_out.at[half], v0, tile)
                return carry

            if lanes:
                @pl.loop(0, nrows_ref[r])
                def _rows(j):
                    row = row_at(j)
                    lax.fori_loop(0, row[1], functools.partial(step, row=row), None)
            else:
                row = row_at(0)
                if solve and has_h0:     # the solve buffers alias the state tile: both halves have loaded it
                    plgpu.barrier_wait(handoff.at[2])
                lax.fori_loop(0, row[1], functools.partial(step, row=row), None)
                if solve:
                    plgpu.barrier_arrive(solved)
            if write_o and not wide:
                plgpu.wait_smem_to_gmem(0)

        # (jla finish_together) every warpgroup waits for the others before it exits: one exiting while another
        # still issued WGMMAs ended some runs in CUDA_ERROR_ILLEGAL_INSTRUCTION (sm_90, jax 0.11.2)
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    args = [q, k, v] + ([] if solve else [t]) + [gcum, beta_c] + ([h0t] if has_h0 else [])
    args += [walk] if varlen else []
    args += [lane_rows] if lanes else []
    rows = walk.shape[0] if varlen else batch * run_pieces
    name = "gdn_mosaic_varlen_in_place" if in_place else "gdn_mosaic_varlen_state_pass" if varlen else (
        "gdn_mosaic_fused_state_pass" if write_o else "gdn_mosaic_state_map")
    outs = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(rows, heads, nv),
        grid_names=("b", "h", "v"), compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
        kernel_name=name + ("_solve" if solve else "_wide" if wide else ""), num_threads=4 if wide else 3,
        thread_name="wg",
    )(*args)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    o = outs.pop(0) if write_o else None
    if in_place:
        edges = outs.pop(0)
        return o, edges, (outs.pop(0) if out_final else None)
    return o, (outs.pop(0) if out_final else None)


# ---------------------------------------------------------------------------------------------------------------
# stage 1a in Mosaic GPU: the gate-free inverse T0 (jla: gated_delta_rule_kernels.kkt_fwd)
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


def chunk_mask(lo, hi):
    """bool [C, C]: entries whose row and column both lie in [lo, hi) (a chunk's own tokens)."""
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    return (ri >= lo) & (ri < hi) & (ci >= lo) & (ci < hi)


def _merge_product(a, bmat, b_smem, dtype):
    b_smem[...] = bmat.astype(dtype)
    _plgpu().commit_smem()
    return matmul(a.astype(dtype), b_smem, (C, C))


def blocked_inverse(kk, beta_row, beta_col, na_ref, x_ref, b_ref, dtype, mine=None):
    """(jla kkt_fwd's solve) The gate-free T0 = (I + A0)^-1, A0_ij = beta_i k_i.k_j (j < i), in fp32 WGMMA
    registers [C, C] (zeros above the diagonal), from kk = k k^T (fp32 [C, C], symmetric: it also serves A0^T) and
    beta as a row and a column vector: the 16 x 16 diagonal blocks by forward substitution (``na_ref``, ``x_ref``:
    fp32 [C, C] SMEM views), merged 16 -> 32 -> 64 by X <- X - X (L X) on the tensor cores (``b_ref``: [C, C]
    SMEM in ``dtype``, the merges' right operand). ``mine`` (bool [C, C] or None): entries outside it (rows and
    columns of tokens outside the chunk's sequence) are zero in A0, by a select."""
    sq = (C, C)
    ri, ci = iota(sq, 0), iota(sq, 1)
    lower = ri > ci
    diag_upper = (ci > ri) & (lax.div(ri, BLOCK) == lax.div(ci, BLOCK))
    if mine is not None:
        lower = lower & mine
        diag_upper = diag_upper & mine
    a0 = jnp.where(lower, kk * bcast_rows(beta_row, sq), 0.0)
    neg_a_t = jnp.where(diag_upper, kk * bcast_cols(-beta_col, sq), 0.0)
    x = _diag_block_inverse_fn()(neg_a_t, na_ref, x_ref)
    for size in (2 * BLOCK, 4 * BLOCK):                        # merge 16 -> 32 -> 64
        half = size // 2
        off = ((lax.div(ri, size) == lax.div(ci, size)) & (lax.rem(ri, size) >= half)
               & (lax.rem(ci, size) < half))
        link = _merge_product(jnp.where(off, a0, 0.0), x, b_ref, dtype)     # L X
        x = x - _merge_product(x, link, b_ref, dtype)
    return x


def kkt_chunks_per_cta(batch: int, heads: int, chunks: int) -> int:
    """(jla) Chunks per CTA of :func:`kkt_fwd`: the most (8, 4, 2) that still leave >= 1.5 CTAs per SM."""
    for cpc in (8, 4, 2):
        if chunks % cpc == 0 and batch * heads * (chunks // cpc) * 2 >= 3 * num_sms():
            return cpc
    return 1


def kkt_fwd(k, beta_hm, *, heads: int, chunks_per_cta: int | None = None, interpret=None, num_chunks=None,
            chunk_rows=None):
    """Gate-free T0 = (I + A0)^-1, A0_ij = beta_i k_i.k_j (j < i), one Mosaic GPU kernel. Returns
    T0 [B, Hv, Tp, C] in k's dtype (row i of chunk c at [b, h, c C + i], zeros above the diagonal).

    k [B, Tp, Hk, K] (16-bit, Tp a multiple of C; value head h reads key head h // (Hv / Hk)); beta_hm
    [B, Hv, Tp] fp32. The gated inverse is T0 * e^(G_i - G_j) (a diagonal similarity of A), applied by
    :func:`fused_state_pass` (``head_major``). Blocked: 16 x 16 diagonal blocks by forward substitution in fp32,
    merged 16 -> 32 -> 64 by X <- X - X (L X) on the tensor cores (16-bit operands); each CTA walks
    ``chunks_per_cta`` chunks with the next chunk's keys prefetched and T0's stores left in flight.
    ``num_chunks`` (int32 [1] or None; the varlen path's used chunk slots): a CTA whose chunks all lie at or past
    num_chunks[0] exits at once, leaving its rows of T0 unset (nothing may read them).
    ``chunk_rows`` (int32 [NC, 3] or None; the varlen path's packed tokens read in place): k is then the packed row
    [1, T, Hk, K] (T a multiple of 8) and chunk c's keys are rows 8 chunk_rows[c, 0] + [0, C) of it (the first row
    stored in 8s: an offset Mosaic's layout inference can see divides its tile), of which only
    rows [chunk_rows[c, 1], chunk_rows[c, 2]) are the chunk's (the others give A0 zero rows and columns by a
    select: a NaN there reaches nothing); Tp is then beta_hm's.
    """
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    WGMMA = plgpu.Layout.WGMMA
    ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)
    batch, padded, kv_heads, key_dim = k.shape
    in_place = chunk_rows is not None
    if in_place:
        if batch != 1 or padded % 8 or chunk_rows.shape != (beta_hm.shape[2] // C, 3):
            raise ValueError(f"kkt_fwd: chunk_rows needs one packed row of a multiple of 8 tokens and a table "
                             f"[NC, 3]; got k {k.shape}, chunk_rows {chunk_rows.shape}")
        padded = beta_hm.shape[2]
    group = heads // kv_heads
    nc = padded // C
    if chunks_per_cta is None:
        chunks_per_cta = kkt_chunks_per_cta(batch, heads, nc)
    cpc = next(n for n in (chunks_per_cta, 4, 2, 1) if nc % n == 0)
    dtype = k.dtype
    vec2 = plgpu.SMEM((2, C), F32)
    scratch = dict(
        k_smem=smem((2, C, key_dim), dtype),
        br_smem=vec2,
        bc_smem=vec2,
        t_smem=smem((2, C, C), dtype),
        b_smem=smem((C, C), dtype),
        na_smem=plgpu.SMEM((C, C + SOLVE_PAD), F32),
        x_smem=plgpu.SMEM((C, C + SOLVE_PAD), F32),
        bar=plgpu.Barrier(num_arrivals=3, num_barriers=2),
    )

    def body(k_ref, beta_ref, t_ref, k_smem, br_smem, bc_smem, t_smem, b_smem, na_smem, x_smem, bar,
             rows_ref=None):
        b, nb, hh = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
        hk = lax.div(hh, group)

        def issue(n, slot):
            rows = pl.ds((nb * cpc + n) * C, C)
            k_rows = pl.ds(rows_ref[nb * cpc + n, 0] * 8, C) if in_place else rows
            plgpu.copy_gmem_to_smem(k_ref.at[b, k_rows, hk], k_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(beta_ref.at[b, hh, rows], br_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(beta_ref.at[b, hh, rows], bc_smem.at[slot], bar.at[slot])

        issue(0, 0)
        sq = (C, C)

        @pl.loop(0, cpc)
        def _chunk(n):
            slot = lax.rem(n, 2)
            plgpu.barrier_wait(bar.at[slot])

            @pl.when(n + 1 < cpc)
            def _prefetch():
                plgpu.commit_smem()
                issue(n + 1, 1 - slot)

            s = matmul(k_smem.at[slot], k_smem.at[slot].T, sq)
            mine = None
            if in_place:         # rows and columns of other sequences' (or padding) tokens: zero, by a select
                c = nb * cpc + n
                mine = chunk_mask(rows_ref[c, 1], rows_ref[c, 2])
            x = blocked_inverse(s, plgpu.load(br_smem.at[slot], layout=ROWS),
                                plgpu.load(bc_smem.at[slot], layout=COLS), na_smem.at[:, :C], x_smem.at[:, :C],
                                b_smem, dtype, mine=mine)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)            # t_smem[slot] of chunk n - 2 was sent
            t_smem.at[slot][...] = x.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_smem.at[slot], t_ref.at[b, hh, pl.ds((nb * cpc + n) * C, C)])

        plgpu.wait_smem_to_gmem(0)

    def body_kw(k_ref, beta_ref, *refs, **scr):
        refs = list(refs)
        rows_ref = refs.pop(0) if in_place else None
        if num_chunks is None:
            return body(k_ref, beta_ref, *refs, rows_ref=rows_ref, **scr)
        n_ref, t_ref = refs

        @pl.when(lax.axis_index("n") * cpc < n_ref[0])
        def _():
            body(k_ref, beta_ref, t_ref, rows_ref=rows_ref, **scr)

    return plgpu.kernel(
        body_kw, out_type=jax.ShapeDtypeStruct((batch, heads, padded, C), dtype), scratch_types=scratch,
        grid=(batch, nc // cpc, heads), grid_names=("b", "n", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret, kernel_name="gdn_mosaic_kkt",
    )(k, beta_hm, *(() if chunk_rows is None else (chunk_rows.astype(jnp.int32),)),
      *(() if num_chunks is None else (num_chunks,)))


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


def _pad_time(x, pad):
    return x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def prepare_chunk_layout(q, k, v, g, beta, initial_state, *, interpret: bool, pieces: int = 1):
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
    if interpret:        # interpret mode clamps dynamic slices: pad C rows as triton.chunk's entry points do
        kf, gf, bf = (jnp.pad(x, [(0, C)] + [(0, 0)] * (x.ndim - 1)) for x in (kf, gf, bf))
    tmat, gcum = kt.kkt_solve(kf, gf, bf, chunk_start=start, chunk_len=length, chunk=C, num_v_heads=hv,
                              interpret=interpret, config=config)
    nc = b * tp // C
    beta_c = jnp.swapaxes(beta.astype(F32).reshape(nc, C, hv), 1, 2)                 # [NC, Hv, C]
    h0t = None if initial_state is None else jnp.swapaxes(initial_state.astype(F32), -1, -2)
    return q, k, v, tmat, gcum, beta_c, h0t


def prepare_head_major(q, k, v, g, beta, initial_state, *, kernel: bool, pieces: int = 1, exp2: bool = False,
                       solve: bool = False):
    """Stage 1a in Mosaic GPU (``kernel``) or its jnp twin: pads T to a multiple of C * pieces (zero tokens), the
    chunk-local cumulative log-decay G [B, Hv, Tp] (g floored at G_FLOOR first, as Triton's 1a does), beta
    [B, Hv, Tp] fp32 and the gate-free T0 [B, Hv, Tp, C] (None with ``solve``: the wide fused pass forms it).
    Returns the fused pass's ``head_major`` operands."""
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
    t0 = None if solve else kkt_fwd(k, beta_hm, heads=hv) if kernel else kkt_fwd_reference(k, beta_hm, heads=hv)
    h0t = None if initial_state is None else jnp.swapaxes(initial_state.astype(F32), -1, -2)
    return q, k, v, t0, gcum, beta_hm, h0t


STAGE1A = ("triton", "mosaic")


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "impl", "stage1a", "pieces", "exp2",
                                             "state_kv", "split", "wide", "solve"))
def chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=None, *, scale=None, output_final_state=True,
                               impl: str = "mosaic", stage1a: str = "triton", pieces: int = 1, exp2: bool = False,
                               state_kv: bool = False, split: SplitConfig = DEFAULT_SPLIT, wide=False,
                               solve: bool = False):
    """Dense chunked gated delta rule forward: stage 1a, then :func:`fused_state_pass` (``impl="mosaic"``, a
    Hopper GPU) or its jnp twin :func:`fused_state_pass_reference` (``impl="reference"``, anywhere: the CPU check
    of the algebra).

    ``stage1a``: "triton" (Pallas Triton ``kkt_solve``, the gated T in chunk layout; interpret mode under
    ``impl="reference"``) or "mosaic" (:func:`kkt_fwd`, the gate-free T0 in head-major layout, or its jnp twin
    :func:`kkt_fwd_reference` under ``impl="reference"``). ``pieces`` P > 1: the sequence split (each row cut
    into P pieces run side by side, their start states from one state-map pass and a scan,
    ``split.start_states`` with ``split``); 0: :func:`split_pieces` picks. ``exp2`` (with ``stage1a="mosaic"``):
    log2 gates and exp2 in the pass. ``state_kv`` (``impl="mosaic"``, unsplit rows): the fused pass reads the
    initial state and writes the final one in the op's [B, Hv, K, V] layout itself (``fused_state_pass(
    state_kv=True)``), instead of two XLA transposes to and from its S^T (4 x 4 B Hv K V bytes of HBM traffic and
    two launches); the jnp twin and the split ignore it. ``wide`` (``impl="mosaic"``, ``stage1a="mosaic"``, V =
    128, unsplit rows; ignored elsewhere): True / False / "auto" (:func:`use_wide`): the fused pass as one CTA per
    (row, value head) over all 128 value columns (``fused_state_pass(wide=True)``); ``solve`` with it: T0 formed
    inside that pass instead of by :func:`kkt_fwd`.

    q, k [B, T, Hk, K]; v [B, T, Hv, V] (mosaic: one of bf16 / fp16, K, V in {64, 128}); g [B, T, Hv] fp32
    log-decay; beta [B, T, Hv]; initial_state [B, Hv, K, V] fp32 or None. Returns (o [B, T, Hv, V] in v's dtype,
    final_state [B, Hv, K, V] fp32 or None), as the op ``chunk_gated_delta_rule`` (no cu_seqlens).
    """
    if impl not in ("mosaic", "reference"):
        raise ValueError(f"impl must be 'mosaic' or 'reference'; got {impl!r}")
    if stage1a not in STAGE1A:
        raise ValueError(f"stage1a must be one of {STAGE1A}; got {stage1a!r}")
    if not isinstance(split, SplitConfig):
        raise ValueError(f"split must be a SplitConfig; got {split!r}")
    if not isinstance(pieces, int) or isinstance(pieces, bool) or not 0 <= pieces <= split.max_pieces:
        raise ValueError(f"pieces must be an int in [0, {split.max_pieces}] (0: automatic); got {pieces!r}")
    check_supported(q, k, v, g, beta, initial_state, kernel=impl == "mosaic")
    b, t, _, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    scale = kdim ** -0.5 if scale is None else float(scale)
    kernel = impl == "mosaic"
    head_major = stage1a == "mosaic"
    if pieces == 0:
        pieces = split_pieces(b, hv, kdim, vdim, t + (-t) % C, has_h0=initial_state is not None, config=split)
    wide = wide_pass(wide, b, hv, vdim) and kernel and head_major and pieces == 1
    exp2 = bool(exp2) and head_major
    kv = bool(state_kv) and kernel and pieces == 1
    solve = bool(solve) and wide
    if head_major:
        ops_ = prepare_head_major(q, k, v, g, beta, initial_state, kernel=kernel, pieces=pieces, exp2=exp2,
                                  solve=solve)
    else:
        ops_ = prepare_chunk_layout(q, k, v, g, beta, initial_state, interpret=not kernel, pieces=pieces)
    run = fused_state_pass if kernel else fused_state_pass_reference
    wide_kw = dict(wide=True, solve=solve) if wide else {}
    if pieces > 1:
        h0_pieces = mosaic_split.start_states(ops_, pieces, kernel=kernel, head_major=head_major, exp2=exp2,
                                              config=split)
        o, ht = run(*ops_[:6], h0_pieces, scale=scale, out_final=output_final_state, head_major=head_major,
                    pieces=pieces, exp2=exp2, **wide_kw)
        if ht is not None:      # the final state is the last piece's
            ht = ht.reshape((b, pieces) + ht.shape[1:])[:, -1]
    elif kv:            # the states in [B, Hv, K, V] straight into and out of the kernel (no XLA transposes)
        h0 = None if initial_state is None else initial_state.astype(F32)
        o, ht = run(*ops_[:6], h0, scale=scale, out_final=output_final_state, head_major=head_major, exp2=exp2,
                    state_kv=True, **wide_kw)
    else:
        o, ht = run(*ops_, scale=scale, out_final=output_final_state, head_major=head_major, exp2=exp2, **wide_kw)
    o = o[:, :t].astype(v.dtype)
    return o, (None if ht is None else ht if kv else jnp.swapaxes(ht, -1, -2))


# ---------------------------------------------------------------------------------------------------------------
# the op's backend "mosaic_gpu" (api.py routes here)
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch choices of the "mosaic_gpu" backend, fixed when the call is built. The defaults are the H200's
    (``python -m benchmarks gdn``; one process, 3 interleaved rounds, bf16, ms; each won every round it was timed
    in).

    stage1a: "mosaic" (:func:`kkt_fwd`, the gate-free T0) or "triton" (Pallas Triton ``kkt_solve``, the gated T).
    pieces: the sequence split, 0 = :func:`split_pieces` decides per shape (P = 2 on the 64-CTA rows, P = 4 at
      B1-T8192-Hk2-Hv8: 0.1436 against 0.1571 at P = 8), 1 = never split, P = always P pieces.
    exp2: log2 gates and exp2 in the fused pass (jla's form; stage1a "mosaic" only), else natural log and exp:
      B16-T1024 0.359 -> 0.354, B4-T4096 0.337 -> 0.334, numerics unchanged.
    state_kv: the fused pass reads / writes the states in the op's [B, Hv, K, V] layout (no XLA transposes around
      it; unsplit rows only, the split keeps its transposed start states): B16-T1024 0.359 against 0.392,
      B4-T4096 0.337 against 0.346.
    split: the sequence split's policy and start-state pass (:class:`SplitConfig`).
    wide: True / False / "auto" (:func:`use_wide`): unsplit rows' fused pass as one CTA per (row, value head)
      over V = 128 with two state warpgroups (``fused_state_pass(wide=True)``; stage1a "mosaic", V = 128 only,
      else ignored). "auto" by default (H200, one process, narrow -> auto: B4-T4096 0.3345 -> 0.2950, B16-T1024
      0.3569 -> 0.3109; the rows of one wave or less unchanged, B1-T8192 0.2462 -> 0.2481).
    solve: with wide, T0 formed inside the fused pass (no kkt_fwd launch).
    """
    stage1a: str = "mosaic"
    pieces: int = 0
    exp2: bool = True
    state_kv: bool = True
    split: SplitConfig = DEFAULT_SPLIT
    wide: object = "auto"
    solve: bool = False

    def __post_init__(self):
        if self.stage1a not in STAGE1A:
            raise ValueError(f"MosaicConfig.stage1a must be one of {STAGE1A}; got {self.stage1a!r}")
        if not isinstance(self.split, SplitConfig):
            raise ValueError(f"MosaicConfig.split must be a SplitConfig; got {self.split!r}")
        if not isinstance(self.pieces, int) or not 0 <= self.pieces <= self.split.max_pieces:
            raise ValueError(f"MosaicConfig.pieces must be an int in [0, {self.split.max_pieces}]; "
                             f"got {self.pieces!r}")
        if self.wide not in (True, False, "auto"):
            raise ValueError(f"MosaicConfig.wide must be True, False or 'auto'; got {self.wide!r}")
        for name in ("exp2", "state_kv", "solve"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MosaicConfig.{name} must be a bool; got {getattr(self, name)!r}")

    def options(self) -> dict:
        """The fields as :func:`chunk_gated_delta_rule_fwd`'s keyword arguments (the same names)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


DEFAULT_CONFIG = MosaicConfig()


def wide_pass(wide, rows: int, heads: int, value_dim: int) -> bool:
    """The ``wide`` switch (True / False / "auto": :func:`use_wide`) resolved for an unsplit pass over ``rows``
    rows (sequences); never at V other than 2 BV."""
    return value_dim == 2 * BV and (use_wide(rows, heads, value_dim) if wide == "auto" else bool(wide))


def use_wide(rows: int, heads: int, value_dim: int, sms: int | None = None) -> bool:
    """Whether an unsplit fused pass over ``rows`` rows (sequences) runs wide: V = 2 BV and the narrow pass's
    rows Hv V / BV CTAs more than one wave of the SMs (below that the narrow pass's extra CTAs fill idle SMs)."""
    sms = num_sms() if sms is None else sms
    return value_dim == 2 * BV and rows * heads * (value_dim // BV) > sms


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
                                          output_final_state=output_final_state, impl="mosaic", **cfg.options())
    h0 = () if initial_state is None else (initial_state.astype(F32),)
    return no_autodiff(run)(q, k, v, g, beta, *h0)
