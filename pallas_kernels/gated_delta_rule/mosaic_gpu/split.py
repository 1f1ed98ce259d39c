# Copyright 2026 KarLex AI, Inc.
# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
# state_map_pass is adapted from jax-linear-attention 0.1.0 (Apache-2.0), jla/ops/mosaic_gpu/scalar_gate_docs.py
# (map_fwd_wy: a state-only map kernel reading u in place, the first piece's M skipped without an initial state),
# and piece_scan's "serial" and "triton" forms from jla/ops/mosaic_gpu/scalar_gate_scan.py (piece_scan_xla,
# piece_scan). Those files state that they are adapted from FlashQLA (MIT) and flash-linear-attention (MIT). See
# NOTICE in this folder.
"""The sequence split's start states for the Mosaic GPU backend (``chunk.py``).

The split cuts each row of Tp tokens into P pieces that the fused state pass runs side by side. Piece p's map of
its start state is affine, S_end = M_p S_start + E_p; the start states are S_0 (the initial state) and
S_{p+1} = M_p S_p + E_p. Both the kernels and this file keep states transposed ([V, K], the fused pass's h0t),
where a piece maps s -> s M_p^T + E_p^T. What runs is :class:`chunk.SplitConfig` (passed in, defaults measured).

  * :func:`state_map_pass` (one Mosaic GPU kernel, jla's ``map_fwd_wy``): [M_p^T ; E_p^T] [K + V, K] for pieces
    0 .. P - 2 (the last piece's map is never read). Grid (B (P - 1), Hv, (K + V) / 64): CTA block iv < K / 64 is
    an identity block (start rows iv 64 .. of [I | 0]^T, values zero: it carries rows of M^T), the others carry
    E^T from a zero start, reading their 64 value columns of v **in place** (no materialised [0 | v], no
    [I | 0] start states in HBM). No output warpgroup and no q: WG0 the chain (W = v - Gamma k S,
    v_new = Ag W, S <- e^G_last S + (e^(G_last - G) v_new)^T k), WG1 forms Ag = T0 e^(G_i - G_j) beta_j in SMEM,
    WG2 streams k, v, T0 and the gate vectors by TMA into a 4-stage ring. Without an initial state the first
    piece's identity blocks walk no chunk and store zeros (nothing reads M_0 then); with one and
    ``SplitConfig.first = "h0"`` likewise, and the first piece's value blocks start from h0's rows, so they carry
    piece 1's true start (no M_0 needed). ``SplitConfig.paired``: two blocks per CTA (jla's
    ``_map_fwd_wy_paired``, :func:`_state_map_pass_paired`), half the CTAs at ~1.86x the step, where that saves a
    wave.
  * :func:`state_map_pass_walk`: the same chain over the pieces of a packed row read in place (the packed split,
    ``varlen.split_plan``): rows from a table, a first piece mapped from its sequence's h0, its first chunk's
    leading rows of the neighbour masked by selects.
  * :func:`piece_scan`: "serial" (jla's unrolled XLA scan: P - 2 dependent [V, K] x [K, K] products, the first
    taken as E_0^T without an initial state or with ``first = "h0"``), "log" (XLA, Hillis-Steele prefix
    compositions, ceil(log2(P - 1)) batched steps of [K + V, K] x [K, K] then one apply) or "triton"
    (:func:`piece_scan_triton`, one Pallas Triton launch, jla's kernel), products in ``SplitConfig.precision``.
  * :func:`start_states`: the map pass, then the scan: [B P, Hv, V, K] fp32 for ``chunk.fused_state_pass``.

Jnp twins of the map kernels: :func:`state_map_pass_reference`; the packed one's is
``varlen.state_map_pass_walk_reference`` (beside the packed fused pass's twin it runs on).

Shape legend: B batch rows, Tp padded tokens (a multiple of C P), P pieces, R = P - 1 mapped pieces, Hk / Hv key /
value heads, K / V head dims, C = 64 chunk, BV = 64 columns per CTA.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk_reference import fused_state_pass_reference
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import (BV, C, bcast_cols, bcast_rows, iota, matmul, num_sms,
                                                              ring_stages, smem)
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import plgpu as _plgpu

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
MAPS = ("map", "paired")
PRECISIONS = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "default": lax.Precision.DEFAULT}


# ---- the sequence split (jla's piece maps, FlashQLA's intra-card context parallelism) -------------------------
SCANS = ("serial", "log", "triton")
FIRSTS = ("map", "h0")


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """The sequence split: when to split a row (:func:`split_pieces`, a time model) and how the pieces' start
    states are made (``split.start_states``). The defaults are the H200's (``python -m benchmarks gdn``; one
    process, 3 interleaved rounds, bf16, ms).

    max_pieces, min_piece_chunks: :func:`split_pieces` tries the powers of two P <= max_pieces whose pieces hold at
      least min_piece_chunks chunks.
    max_split_ctas: rows whose unsplit pass runs more CTAs (B Hv V / 64) are never split (jla's rule is 32): P = 2
      beat the unsplit pass in every round on both 64-CTA rows (B1-T8192-Hk16-Hv32 0.2585 against 0.2830,
      B1-T32768 0.928 against 1.078); at 128+ CTAs the fused pass alone fills a wave.
    map_step, fixed, per_piece: :func:`split_cost`'s time model in chunk steps of the fused pass (1.86 us on the
      H200): one map-pass step as a fraction of a fused step, the fixed and the per-piece cost of the launches and
      the scan. per_piece fits B1-T8192-Hk2-Hv8, where P = 4 (0.1436) beat P = 8 (0.1571) in every round.
    scan: the scan over the pieces, "serial" (jla's unrolled XLA form), "log" (XLA, log-depth compositions),
      "triton" (one Pallas Triton kernel, jla's) or "auto": serial up to serial_max_pieces pieces, Triton above.
      B1-T8192-Hk2-Hv8, P = 4, tf32 products: Triton 0.1222 against serial 0.1262; at P = 2 (first piece from h0,
      or no h0) no scan has a product and serial (a stack) ties Triton (0.2477).
    precision: the scan's products, "highest" (IEEE fp32), "high" (bf16 x 3) or "default" (tf32): tf32 0.1222
      against fp32 0.1309 at B1-T8192-Hk2-Hv8 P = 4, o and state unchanged against fp32 XLA (3.39e-3, 2.38e-3).
    first: the first piece of a row with an initial state, "h0" (walked from h0 itself: its identity blocks walk
      nothing, one scan product less) or "map" (mapped from [I | 0] like the others, jla's form): "h0" 0.1321
      against 0.1429 (Triton scan), 0.1307 against 0.1369 (serial), B1-T8192-Hk2-Hv8 P = 4.
    paired: the map pass runs two 64-row blocks per CTA (jla's ``_map_fwd_wy_paired``): "auto" where
      ceil(CTAs / 2 / SMs) paired_step < ceil(CTAs / SMs), True / False always / never; paired_step is a paired
      CTA's step over a single one's (H200, B1-T8192-Hk2-Hv8 P = 8, 224 blocks: 0.0617 ms paired, one wave,
      against 0.0665 single, two waves).
    """
    max_pieces: int = 8
    min_piece_chunks: int = 8
    max_split_ctas: int = 64
    map_step: float = 0.6
    fixed: float = 1.0
    per_piece: float = 5.8
    scan: str = "auto"
    serial_max_pieces: int = 2
    precision: str = "default"
    first: str = "h0"
    paired: object = "auto"
    paired_step: float = 1.86

    def __post_init__(self):
        for name in ("max_pieces", "min_piece_chunks", "max_split_ctas", "serial_max_pieces"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SplitConfig.{name} must be an int >= 1; got {value!r}")
        for name in ("map_step", "fixed", "per_piece", "paired_step"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SplitConfig.{name} must be a number >= 0; got {value!r}")
        if self.scan not in SCANS + ("auto",):
            raise ValueError(f"SplitConfig.scan must be one of {SCANS + ('auto',)}; got {self.scan!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"SplitConfig.precision must be one of {tuple(PRECISIONS)}; got {self.precision!r}")
        if self.first not in FIRSTS:
            raise ValueError(f"SplitConfig.first must be one of {FIRSTS}; got {self.first!r}")
        if self.paired not in ("auto", True, False) or isinstance(self.paired, int) and not isinstance(
                self.paired, bool):
            raise ValueError(f"SplitConfig.paired must be 'auto', True or False; got {self.paired!r}")


DEFAULT_SPLIT = SplitConfig()


def split_cost(batch: int, heads: int, key_dim: int, value_dim: int, nchunks: int, pieces: int,
               sms: int | None = None, *, has_h0: bool = True, config: SplitConfig = DEFAULT_SPLIT) -> float:
    """The split's time model in fused-pass chunk steps (one CTA per SM at K = 128): the fused pass runs
    ceil(B Hv V/BV P / SMs) waves of nchunks / P steps; with P > 1 the map pass adds ceil(CTAs / SMs) waves of as
    many steps at ``config.map_step`` each, CTAs = B Hv (K + V)/BV (P - 1) (less the first piece's B Hv K/BV
    identity blocks without an initial state or with ``config.first = "h0"``), plus ``config.fixed +
    config.per_piece (P - 1)`` for the launch and the scan."""
    sms = num_sms() if sms is None else sms
    steps = -(-nchunks // pieces)
    cost = -(-batch * heads * max(value_dim // BV, 1) * pieces // sms) * steps
    if pieces > 1:
        ctas = batch * heads * ((key_dim + value_dim) // BV) * (pieces - 1)
        if not has_h0 or config.first == "h0":
            ctas -= batch * heads * (key_dim // BV)
        cost += -(-ctas // sms) * steps * config.map_step + config.fixed + config.per_piece * (pieces - 1)
    return cost


def split_pieces(batch: int, heads: int, key_dim: int, value_dim: int, padded: int, *, sms: int | None = None,
                 has_h0: bool = True, config: SplitConfig = DEFAULT_SPLIT) -> int:
    """Pieces per row of the sequence split: the power of two P <= ``config.max_pieces`` (pieces of at least
    ``config.min_piece_chunks`` chunks) with the least :func:`split_cost`; 1 (no split) for rows of more than
    ``config.max_split_ctas`` CTAs (the bench's B4-T4096 and B16-T1024 rows) and on ties."""
    if batch * heads * max(value_dim // BV, 1) > config.max_split_ctas:
        return 1
    nchunks = padded // C
    best, best_cost = 1, split_cost(batch, heads, key_dim, value_dim, nchunks, 1, sms, has_h0=has_h0, config=config)
    p = 2
    while p <= config.max_pieces and nchunks // p >= config.min_piece_chunks:
        cost = split_cost(batch, heads, key_dim, value_dim, nchunks, p, sms, has_h0=has_h0, config=config)
        if cost < best_cost:
            best, best_cost = p, cost
        p *= 2
    return best


def use_pairs(ctas: int, key_dim: int, value_dim: int, *, config: SplitConfig = DEFAULT_SPLIT,
              sms: int | None = None) -> bool:
    """Whether the map pass runs its ``ctas`` single-block CTAs as pairs (needs K / 64 and V / 64 even):
    ``config.paired`` True / False, or "auto": where ceil(CTAs / 2 / SMs) ``config.paired_step`` < ceil(CTAs / SMs)
    (a wave saved)."""
    paired = config.paired
    if (key_dim // BV) % 2 or (value_dim // BV) % 2 or paired is False:
        return False
    if paired is True:
        return True
    sms = num_sms() if sms is None else sms
    return -(-(ctas // 2) // sms) * config.paired_step < -(-ctas // sms)


def _check(pieces: int, padded: int, key_dim: int, value_dim: int, kernel: bool = True):
    if pieces < 2 or padded % (C * pieces):
        raise ValueError(f"state_map_pass: pieces must be >= 2 (got {pieces}) and Tp={padded} a multiple of "
                         f"C * pieces = {C * pieces}")
    if kernel and (key_dim % BV or value_dim % BV):
        raise ValueError(f"state_map_pass: K (got {key_dim}) and V (got {value_dim}) must be multiples of {BV}")


def issue_chunk(n, slot, values, *, refs, k_s, t_s, vecs, in_bar, head_major: bool, b, hh, hk, tok0, piece,
                 ncb_row: int, ncb: int, kv_row0=None):
    """The memory warpgroup's TMA copies of chunk ``n`` of a piece (tokens tok0 + n C ..) into ring slot ``slot`` of
    both map kernels and of the backward's state pass (``backward.state_fwd_wy``), all on ``in_bar[slot]``: k
    (key head hk), the value block(s) ``values`` ((first column, SMEM ring) per block carried), T0 or T, the
    cumulative gates into the three gate buffers, beta (``head_major`` False: chunk b ncb_row + piece ncb + n of
    the [NC, ...] layout). ``kv_row0`` (packed tokens read in place): k and v from packed rows kv_row0 + n C ..,
    the chunk-slot operands from tok0 + n C .."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    k_ref, v_ref, t_ref, g_ref, b_ref = refs
    g_state, g_rows, g_cols, b_cols = vecs
    rows = pl.ds(tok0 + n * C, C)
    kv_rows = rows if kv_row0 is None else pl.ds(kv_row0 + n * C, C)
    bar = in_bar.at[slot]
    plgpu.copy_gmem_to_smem(k_ref.at[b, kv_rows, hk], k_s.at[slot], bar)
    for v0, v_s in values:
        plgpu.copy_gmem_to_smem(v_ref.at[b, kv_rows, hh, pl.ds(v0, BV)], v_s.at[slot], bar)
    if head_major:
        t_src, g_src, b_src = t_ref.at[b, hh, rows], g_ref.at[b, hh, rows], b_ref.at[b, hh, rows]
    else:
        c = b * ncb_row + piece * ncb + n
        t_src, g_src, b_src = t_ref.at[c, hh], g_ref.at[c, hh], b_ref.at[c, hh]
    plgpu.copy_gmem_to_smem(t_src, t_s.at[slot], bar)
    for g_buf in (g_state, g_rows, g_cols):
        plgpu.copy_gmem_to_smem(g_src, g_buf.at[slot], bar)
    plgpu.copy_gmem_to_smem(b_src, b_cols.at[slot], bar)


def form_ag(slot, *, head_major: bool, exp, dtype, t_s, g_rows, g_cols, b_cols, ag_ready):
    """Ag = T0 e^(G_i - G_j) beta_j (``head_major``: the exponent masked before exp; else T beta_j from Triton's
    gated T) written over T0 in ring slot ``slot``, then ``ag_ready[slot]`` arrives (both map kernels and
    ``backward.state_fwd_wy``)."""
    plgpu = _plgpu()
    WGMMA = plgpu.Layout.WGMMA
    ROWS = WGMMA.reduce(1)
    COLS = WGMMA.reduce(0)
    sq = (C, C)
    t_in = plgpu.load(t_s.at[slot], layout=WGMMA).astype(F32)
    if head_major:
        g_row = plgpu.load(g_rows.at[slot], layout=ROWS)
        g_col = plgpu.load(g_cols.at[slot], layout=COLS)
        keep = iota(sq, 0) >= iota(sq, 1)
        t_in = t_in * exp(jnp.where(keep, bcast_rows(g_row, sq) - bcast_cols(g_col, sq), -jnp.inf))
    ag = t_in * bcast_cols(plgpu.load(b_cols.at[slot], layout=COLS), sq)
    t_s.at[slot][...] = ag.astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(ag_ready.at[slot])


def _map_chain(blk, n_id, count, *, need_first: bool, stages: int, dtype, key_dim: int, exp, k_s, v_s, t_s, g_state,
               in_bar, ag_ready, in_free, s_start=None, lead=None):
    """The state warpgroup's chain of both map kernels (single and paired): value block ``blk`` of the augmented
    values [0 | v] (blocks below ``n_id`` are the identity rows of [I | 0]^T, which read no v) walks ``count`` chunks
    from its start rows, per chunk W^T = v^T - (S^T k^T) Gamma, v_new^T = W^T Ag^T (Ag formed by the Ag warpgroup,
    ``ag_ready``), S^T <- e^(G_last) S^T + (e^(G_last - G) v_new)^T k; frees the input slot (``in_free``) after
    each chunk. ``need_first`` False: a block that walks nothing holds zeros, not its identity rows. ``s_start``
    (the map from the initial state, :func:`state_map_pass` with ``h0t``): (flag, rows [BV, K] fp32 in the WGMMA
    layout): where the flag holds, the chain starts from those rows instead. ``lead`` (packed tokens read in place):
    a function of the chunk index giving its leading rows that belong to another sequence (0 .. 7); W's columns
    for them are zeroed by a select (their v may be NaN; the Ag warpgroup zeroes their k rows). Returns S^T
    [BV, K] fp32 (the piece's rows of [M | E]^T)."""
    plgpu = _plgpu()
    WGMMA = plgpu.Layout.WGMMA
    COLS = WGMMA.reduce(0)
    shape = (BV, key_dim)
    eye = iota(shape, 1) == iota(shape, 0) + blk * BV    # rows blk BV .. of [I | 0]^T (none for E)
    s0 = jnp.where(eye, 1.0, 0.0).astype(F32)
    if not need_first:
        s0 = s0 * jnp.where(count > 0, 1.0, 0.0).astype(F32)
    v_keep = jnp.where(blk >= n_id, 1.0, 0.0).astype(F32)
    if s_start is not None:
        use, rows = s_start              # a vector mask (as form_ag's): rows may be garbage where not use
        s0 = jnp.where(iota(shape, 0) < jnp.where(use, BV, 0), rows, s0)

    def step(n, s_t):
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(in_bar.at[slot])
        s_lo = s_t.astype(dtype)
        g_last = g_state[slot, C - 1]
        g_col = plgpu.load(g_state.at[slot], layout=COLS)
        key_decay = exp(g_col)
        k_decay = exp(g_last - g_col)
        s_decay = exp(g_last)
        x_t = matmul(s_lo, k_s.at[slot].T, (BV, C))
        v_t = plgpu.load(v_s.at[slot].T, layout=WGMMA).astype(F32) * v_keep
        w_t = v_t - x_t * bcast_cols(key_decay, (BV, C))
        if lead is not None:             # another sequence's rows: a select, so a NaN there reaches nothing
            w_t = jnp.where(iota((BV, C), 1) >= lead(n), w_t, 0.0)
        w_t = w_t.astype(dtype)
        plgpu.barrier_wait(ag_ready.at[slot])
        vn_t = matmul(w_t, t_s.at[slot].T, (BV, C))
        vd_t = (vn_t * bcast_cols(k_decay, (BV, C))).astype(dtype)
        s_new = matmul(vd_t, k_s.at[slot], (BV, key_dim), init=s_t * s_decay)
        plgpu.barrier_arrive(in_free.at[slot])
        return s_new

    return lax.fori_loop(0, count, step, s0)


def state_map_pass(k, v, t, gcum, beta_c, *, pieces: int, need_first: bool = True, head_major: bool = True,
                   exp2: bool = False, config: SplitConfig = DEFAULT_SPLIT, h0t=None, interpret=None):
    """The maps [M_p^T ; E_p^T] of pieces p = 0 .. P - 2, fp32 [B (P - 1), Hv, K + V, K] (row b (P - 1) + p: piece
    p of row b; rows :K hold M^T, rows K: hold E^T), one Mosaic GPU kernel.

    k [B, Tp, Hk, K]; v [B, Tp, Hv, V] (one 16-bit dtype, Tp a multiple of C P; value head h reads key head
    h // (Hv / Hk)); ``head_major`` True (stage 1a = ``kkt_fwd``): t [B, Hv, Tp, C] the gate-free T0, gcum and
    beta_c [B, Hv, Tp] fp32; False (Triton stage 1a): t [NC, Hv, C, C] the gated T, gcum and beta_c [NC, Hv, C].
    gcum is the chunk-local cumulative log-decay (log2 units with ``exp2``). ``need_first`` False (no initial
    state): the first piece's M is not computed (its rows :K are zeros). ``config.paired`` (see
    :func:`use_pairs`): two row blocks per CTA (:func:`_state_map_pass_paired`, the same arithmetic per block).
    ``h0t`` [B, Hv, V, K] fp32 (the initial state transposed; ``SplitConfig.first = "h0"``): the first piece starts
    from it, not from [I | 0]: its value blocks carry the true end state S_1^T of piece 0 (rows K: of piece 0,
    i.e. the start of piece 1), its identity blocks walk nothing and store zeros (M_0 = 0, so every scan gives the
    same starts; ``piece_scan(first_end=True)`` skips the product); ``need_first`` is then ignored, and the single
    kernel runs (no paired form).
    """
    batch, padded, _, key_dim = k.shape
    value_dim = v.shape[3]
    _check(pieces, padded, key_dim, value_dim)
    if h0t is not None:
        if h0t.shape != (batch, v.shape[2], value_dim, key_dim):
            raise ValueError(f"state_map_pass: h0t must be [B, Hv, V, K] = {(batch, v.shape[2], value_dim, key_dim)}; "
                             f"got {h0t.shape}")
        need_first = False               # the first piece's identity blocks walk nothing (M_0 = 0)
    elif use_pairs(batch * (pieces - 1) * v.shape[2] * (key_dim // BV + value_dim // BV), key_dim, value_dim,
                   config=config):
        return _state_map_pass_paired(k, v, t, gcum, beta_c, pieces=pieces, need_first=need_first,
                                      head_major=head_major, exp2=exp2, interpret=interpret)
    return _map_kernel(k, v, t, gcum, beta_c, h0t=h0t, exp2=exp2, interpret=interpret, pieces=pieces,
                       need_first=need_first, head_major=head_major)


def state_map_pass_walk(k, v, t, gcum, beta_c, walk, *, h0t=None, exp2: bool = False, interpret=None):
    """The maps [M_j^T ; E_j^T] of the pieces of a packed row that the packed split maps (``walk``), fp32
    [E, Hv, K + V, K], one Mosaic GPU kernel: :func:`state_map_pass`'s chain over pieces given by a table, the
    packed tokens read in place.

    k [1, T, Hk, K], v [1, T, Hv, V] the packed row (T a multiple of 8); t [1, Hv, Tp, C] the gate-free T0 of the
    chunk slots (``chunk.kkt_fwd`` in place), gcum and beta_c [1, Hv, Tp] fp32 (zero on rows outside each chunk's
    sequence); walk [E, 6] int32, row j = (first chunk slot, chunk count, first packed row / 8, the sequence's first
    token, 1 if the piece is its sequence's first, the sequence). A first piece maps from its sequence's initial
    state (``h0t`` [N, Hv, V, K] fp32, zeros when None): its identity blocks walk nothing and store zeros (M = 0),
    its value blocks carry the piece's true end state; a later piece maps from [I | 0]. Only a first chunk may hold
    rows of another sequence (its leading rows, < 8): mapped pieces are never their sequence's last, so no chunk
    they walk runs past its end. Those rows' k are zeroed in SMEM by the Ag warpgroup and W's columns for them by a
    select in the chain, so a NaN there reaches nothing. A row of count 0 stores zeros.
    """
    key_dim, value_dim = k.shape[3], v.shape[3]
    if key_dim % BV or value_dim % BV:
        raise ValueError(f"state_map_pass_walk: K (got {key_dim}) and V (got {value_dim}) must be multiples of {BV}")
    if walk.ndim != 2 or walk.shape[1] != 6:
        raise ValueError(f"state_map_pass_walk: walk must be [E, 6]; got {walk.shape}")
    return _map_kernel(k, v, t, gcum, beta_c, h0t=h0t, exp2=exp2, interpret=interpret, walk=walk)


def _map_kernel(k, v, t, gcum, beta_c, *, h0t, exp2: bool, interpret, pieces: int = 0, need_first: bool = False,
                head_major: bool = True, walk=None):
    """The single map kernel of :func:`state_map_pass` (dense rows: CTA row r is piece r % (P - 1) of row
    r // (P - 1)) and :func:`state_map_pass_walk` (``walk``: CTA row r is table row r, the packed tokens read in
    place, head-major, a first chunk's leading rows masked), checked there: WG2 streams the chunks into the ring,
    WG1 forms Ag, WG0 walks the chain (:func:`_map_chain`) and stores its rows of [M ; E]^T."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    batch, padded, kv_heads, key_dim = k.shape
    heads, value_dim = v.shape[2], v.shape[3]
    packed = walk is not None
    group = heads // kv_heads
    if packed:
        n_rows = walk.shape[0]
        head_major = True
    else:
        run = pieces - 1
        ncb_row = padded // C
        ncb = ncb_row // pieces          # chunks per piece
        piece_len = ncb * C
        n_rows = batch * run
    n_id = key_dim // BV             # identity blocks (rows of M^T)
    nb = n_id + value_dim // BV
    from_h0 = h0t is not None
    dtype = k.dtype
    _exp = jnp.exp2 if exp2 else jnp.exp
    isz = jnp.dtype(dtype).itemsize
    n_vec = 4                        # g_state, g_rows, g_cols, b_cols
    per_stage = C * key_dim * isz + C * BV * isz + C * C * isz + n_vec * C * 4
    stages = ring_stages(per_stage, BV * key_dim * 4 + 4096 + n_vec * 1024)
    n_copies = 3 + n_vec
    vecs = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        k_s=smem((stages, C, key_dim), dtype),
        v_s=smem((stages, C, BV), dtype),
        t_s=smem((stages, C, C), dtype),     # T0 (or T), then Ag (written by WG1)
        g_state=vecs, g_rows=vecs, g_cols=vecs, b_cols=vecs,
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages),
        done=plgpu.Barrier(num_arrivals=3),
        state_smem=plgpu.SMEM((BV, key_dim), F32),
    )
    if from_h0:
        scratch["h0_bar"] = plgpu.Barrier(num_barriers=1)

    def body(k_ref, v_ref, t_ref, g_ref, b_ref, *refs, k_s, v_s, t_s, g_state, g_rows, g_cols, b_cols, in_bar,
             in_free, ag_ready, done, state_smem, h0_bar=None):
        refs = list(refs)
        walk_ref = refs.pop(0) if packed else None
        h0_ref, ht_ref = refs if from_h0 else (None, refs[0])
        r, hh, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        if packed:                       # the table row: (c0, count, first row / 8, first token, first piece, n)
            c0, n_chunks, row0, start = walk_ref[r, 0], walk_ref[r, 1], walk_ref[r, 2] * 8, walk_ref[r, 3]
            first, h0_row = walk_ref[r, 4] == 1, walk_ref[r, 5]
        else:
            b, piece = lax.div(r, run), lax.rem(r, run)
            tok0 = piece * piece_len
            first, h0_row = None, b      # (piece == 0, formed where it is used)
        hk = lax.div(hh, group)
        v0 = jnp.maximum(iv - n_id, 0) * BV  # the identity blocks read (and zero) the first value block
        if packed:
            count = jnp.where((iv < n_id) & first, 0, n_chunks).astype(jnp.int32)
        elif need_first:                 # every block walks the whole piece (a static trip count)
            count = ncb
        else:                            # no initial state: the first piece's M is never read, its blocks walk 0
            count = jnp.where((iv < n_id) & (piece == 0), 0, ncb).astype(jnp.int32)

        def lead(n):                     # packed: leading rows of chunk n that belong to the sequence before
            return jnp.clip(start - (row0 + n * C), 0, C)

        wg = lax.axis_index("wg")
        if packed:
            ring = dict(refs=(k_ref, v_ref, t_ref, g_ref, b_ref), k_s=k_s, t_s=t_s,
                        vecs=(g_state, g_rows, g_cols, b_cols), in_bar=in_bar, head_major=True, b=0, hh=hh, hk=hk,
                        tok0=c0 * C, piece=0, ncb_row=0, ncb=0, kv_row0=row0)
        else:
            ring = dict(refs=(k_ref, v_ref, t_ref, g_ref, b_ref), k_s=k_s, t_s=t_s,
                        vecs=(g_state, g_rows, g_cols, b_cols), in_bar=in_bar, head_major=head_major, b=b, hh=hh,
                        hk=hk, tok0=tok0, piece=piece, ncb_row=ncb_row, ncb=ncb)
        ag_bufs = dict(head_major=head_major, exp=_exp, dtype=dtype, t_s=t_s, g_rows=g_rows, g_cols=g_cols,
                       b_cols=b_cols, ag_ready=ag_ready)
        static = not packed and need_first

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(n, slot):
                issue_chunk(n, slot, ((v0, v_s),), **ring)

            if static:
                for n in range(min(stages, ncb)):
                    issue(n, n)
            else:
                for n in range(stages):      # (jla map_fwd_wy) a dynamic trip count, possibly 0
                    @pl.when(count > n)
                    def _(n=n):
                        issue(n, n)

            @pl.loop(stages, max(ncb, stages) if static else jnp.maximum(count, stages))
            def _refill(n):
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(in_free.at[slot])
                issue(n, slot)

        @pl.when(wg == 1)
        def _ag():
            plgpu.set_max_registers(232, action="increase")

            @pl.loop(0, count)
            def _chunk(n):
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(in_bar.at[slot])
                if packed:

                    @pl.when(lead(n) > 0)
                    def _():             # k's rows of the sequence before: zero, before Ag says the tile is ready
                        kt = plgpu.load(k_s.at[slot], layout=plgpu.Layout.WGMMA)
                        k_s.at[slot][...] = jnp.where(iota((C, key_dim), 0) >= lead(n), kt, jnp.zeros_like(kt))
                        plgpu.commit_smem()

                form_ag(slot, **ag_bufs)
                plgpu.barrier_arrive(in_free.at[slot])

        @pl.when(wg == 0)
        def _state():
            plgpu.set_max_registers(232, action="increase")
            s_start = None
            if from_h0:                      # a first piece's value blocks start from its row's initial state
                use = (first if packed else piece == 0) & (iv >= n_id)

                @pl.when(use)
                def _():
                    plgpu.copy_gmem_to_smem(h0_ref.at[h0_row, hh, pl.ds(v0, BV)], state_smem, h0_bar.at[0])
                    plgpu.barrier_wait(h0_bar.at[0])

                # (optimized=False: one [BV, K] fp32 load a CTA; jax 0.10 finds no conflict-free plan for it)
                s_start = (use, plgpu.load(state_smem, layout=plgpu.Layout.WGMMA, optimized=False))
            s_t = _map_chain(iv, n_id, count, need_first=need_first, stages=stages, dtype=dtype, key_dim=key_dim,
                             exp=_exp, k_s=k_s, v_s=v_s, t_s=t_s, g_state=g_state, in_bar=in_bar,
                             ag_ready=ag_ready, in_free=in_free, s_start=s_start, lead=lead if packed else None)
            state_smem[...] = s_t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(state_smem, ht_ref.at[r, hh, pl.ds(iv * BV, BV)])
            plgpu.wait_smem_to_gmem(0)

        # (jla finish_together) no warpgroup exits while another may still issue WGMMAs
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    extra = ((walk.astype(jnp.int32),) if packed else ()) + ((h0t.astype(F32),) if from_h0 else ())
    out = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n_rows, heads, nb * BV, key_dim), F32), scratch_types=scratch,
        grid=(n_rows, heads, nb), grid_names=("b", "h", "v"),
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
        kernel_name="gdn_mosaic_split_map_packed" if packed else "gdn_mosaic_split_map", num_threads=3,
        thread_name="wg",
    )(k, v, t, gcum, beta_c, *extra)
    return out[0] if isinstance(out, (list, tuple)) else out


def _state_map_pass_paired(k, v, t, gcum, beta_c, *, pieces: int, need_first: bool, head_major: bool, exp2: bool,
                           interpret=None):
    """:func:`state_map_pass` with two row blocks per CTA (jla's ``_map_fwd_wy_paired``, Ag formed in the memory
    warpgroup): grid (B (P - 1), Hv, (K + V) / 128); CTA ip carries blocks 2 ip (WG0) and 2 ip + 1 (WG1), both
    identity blocks or both value blocks, so they walk the same chunks; WG2 streams k, both blocks' values, T0 and
    the gate vectors into a 3-stage ring and forms Ag one chunk ahead. Per block the arithmetic is the single
    kernel's, so are the results."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    batch, padded, kv_heads, key_dim = k.shape
    heads, value_dim = v.shape[2], v.shape[3]
    group = heads // kv_heads
    run = pieces - 1
    ncb_row = padded // C
    ncb = ncb_row // pieces
    piece_len = ncb * C
    n_id = key_dim // BV
    nb = n_id + value_dim // BV
    dtype = k.dtype
    _exp = jnp.exp2 if exp2 else jnp.exp
    isz = jnp.dtype(dtype).itemsize
    n_vec = 4
    per_stage = C * key_dim * isz + 2 * C * BV * isz + C * C * isz + n_vec * C * 4
    stages = ring_stages(per_stage, 2 * BV * key_dim * 4 + 4096 + n_vec * 1024)
    n_copies = 4 + n_vec
    vecs = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        k_s=smem((stages, C, key_dim), dtype),
        va_s=smem((stages, C, BV), dtype),
        vb_s=smem((stages, C, BV), dtype),
        t_s=smem((stages, C, C), dtype),     # T0 (or T), then Ag (written by WG2)
        g_state=vecs, g_rows=vecs, g_cols=vecs, b_cols=vecs,
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages),
        done=plgpu.Barrier(num_arrivals=3),
        state_smem=plgpu.SMEM((2, BV, key_dim), F32),
    )

    def body(k_ref, v_ref, t_ref, g_ref, b_ref, ht_ref, *, k_s, va_s, vb_s, t_s, g_state, g_rows, g_cols, b_cols,
             in_bar, in_free, ag_ready, done, state_smem):
        r, hh, ip = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        b, piece = lax.div(r, run), lax.rem(r, run)
        tok0 = piece * piece_len
        hk = lax.div(hh, group)
        blocks = (2 * ip, 2 * ip + 1)
        v0s = tuple(jnp.maximum(x - n_id, 0) * BV for x in blocks)   # identity blocks read the first value block
        if need_first:
            count = ncb
        else:
            count = jnp.where((blocks[0] < n_id) & (piece == 0), 0, ncb).astype(jnp.int32)
        wg = lax.axis_index("wg")
        ring = dict(refs=(k_ref, v_ref, t_ref, g_ref, b_ref), k_s=k_s, t_s=t_s, vecs=(g_state, g_rows, g_cols, b_cols),
                    in_bar=in_bar, head_major=head_major, b=b, hh=hh, hk=hk, tok0=tok0,
                    piece=piece, ncb_row=ncb_row, ncb=ncb)
        ag_bufs = dict(head_major=head_major, exp=_exp, dtype=dtype, t_s=t_s, g_rows=g_rows, g_cols=g_cols,
                       b_cols=b_cols, ag_ready=ag_ready)

        def form_ag_ahead(slot):         # Ag in place of T0, formed one chunk ahead by the memory warpgroup
            form_ag(slot, **ag_bufs)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(96, action="decrease")

            def issue(n, slot):
                issue_chunk(n, slot, ((v0s[0], va_s), (v0s[1], vb_s)), **ring)

            for n in range(stages):          # (jla _map_fwd_wy_paired)
                @pl.when(count > n)
                def _(n=n):
                    issue(n, n)

            @pl.when(count > 0)
            def _():
                plgpu.barrier_wait(in_bar.at[0])
                form_ag_ahead(0)

            @pl.loop(0, count)
            def _walk(n):
                @pl.when(n + 1 < count)
                def _():                     # the next chunk's Ag before blocking on this chunk's release
                    nxt = lax.rem(n + 1, stages)
                    plgpu.barrier_wait(in_bar.at[nxt])
                    form_ag_ahead(nxt)

                @pl.when(n + stages < count)
                def _():
                    slot = lax.rem(n, stages)
                    plgpu.barrier_wait(in_free.at[slot])
                    issue(n + stages, slot)

        def carry(which, v_s):
            blk = blocks[which]
            s_t = _map_chain(blk, n_id, count, need_first=need_first, stages=stages, dtype=dtype, key_dim=key_dim,
                             exp=_exp, k_s=k_s, v_s=v_s, t_s=t_s, g_state=g_state, in_bar=in_bar,
                             ag_ready=ag_ready, in_free=in_free)
            state_smem.at[which][...] = s_t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(state_smem.at[which], ht_ref.at[r, hh, pl.ds(blk * BV, BV)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _second():
            plgpu.set_max_registers(200, action="increase")
            carry(1, vb_s)

        @pl.when(wg == 0)
        def _first():
            plgpu.set_max_registers(200, action="increase")
            carry(0, va_s)

        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    out = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((batch * run, heads, nb * BV, key_dim), F32), scratch_types=scratch,
        grid=(batch * run, heads, nb // 2), grid_names=("b", "h", "v"),
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
        kernel_name="gdn_mosaic_split_map2", num_threads=3, thread_name="wg",
    )(k, v, t, gcum, beta_c)
    return out[0] if isinstance(out, (list, tuple)) else out


def _augmented_map(k, v, t, gcum, beta_c, *, pieces, need_first, head_major, exp2, h0t=None):
    """The maps of :func:`state_map_pass` by the fused pass's jnp twin over [0 | v] from [I | 0]."""
    b, tp, _, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    _check(pieces, tp, kdim, vdim, kernel=False)
    r = pieces - 1
    v_aug = jnp.concatenate([jnp.zeros(v.shape[:3] + (kdim,), v.dtype), v], axis=-1)        # [B, Tp, Hv, K + V]
    eye_t = jnp.concatenate([jnp.eye(kdim, dtype=F32), jnp.zeros((vdim, kdim), F32)], axis=0)  # [I | 0]^T
    h_aug = jnp.broadcast_to(eye_t, (b, r, hv, kdim + vdim, kdim))
    if h0t is not None:       # the first piece from the initial state: M_0 = 0, E_0 = piece 0's end state
        first = jnp.concatenate([jnp.zeros((b, hv, kdim, kdim), F32), h0t.astype(F32)], axis=2)
        h_aug = h_aug.at[:, 0].set(first)
    elif not need_first:
        h_aug = h_aug.at[:, 0].set(0.0)
    h_aug = h_aug.reshape(b * r, hv, kdim + vdim, kdim)
    _, maps_t = fused_state_pass_reference(k, k, v_aug, t, gcum, beta_c, h_aug, scale=1.0, out_final=True,
                                              head_major=head_major, exp2=exp2, pieces=pieces, run_pieces=r,
                                              write_o=False)
    return maps_t


def state_map_pass_reference(k, v, t, gcum, beta_c, *, pieces: int, need_first: bool = True,
                             head_major: bool = True, exp2: bool = False, h0t=None):
    """What :func:`state_map_pass` computes, in jnp (fp32, precision highest), same arguments and result: the
    fused pass's twin (``chunk.fused_state_pass_reference``, no output) over the augmented values [0 | v]
    from the augmented start [I | 0] of each mapped piece (zeros for the first piece's identity rows without
    ``need_first``; with ``h0t`` the first piece starts from [0 ; h0t] instead)."""
    return _augmented_map(k, v, t, gcum, beta_c, pieces=pieces, need_first=need_first, head_major=head_major,
                          exp2=exp2, h0t=h0t)


def piece_scan(maps_t, h0t, *, key_dim: int, method: str = "serial", precision: str = "default",
               interpret: bool = False, first_end: bool = False):
    """Every piece's start state, transposed, fp32 [B, P, Hv, V, K], from the maps of pieces 0 .. P - 2.

    maps_t [B, R, Hv, K + V, K] ([M_p^T ; E_p^T], R = P - 1); h0t [B, Hv, V, K] the initial state transposed, or
    None (zeros: then M_0 is not read and may hold anything finite). Start of piece p + 1 = S_p M_p^T + E_p^T.
    ``method`` (not "auto": :func:`start_states` resolves it) "serial": R - 1 dependent products (jla's unrolled
    scan); "log": the prefix compositions in ceil(log2 R) batched steps (composing piece a then b: [A_a ; B_a] A_b
    + [0 ; B_b]), then one apply.
    "triton": :func:`piece_scan_triton` (``interpret``: Pallas interpret mode, the CPU tests). ``precision``: a key
    of PRECISIONS (``SplitConfig.precision``). ``first_end`` (maps from :func:`state_map_pass` with ``h0t``): rows K:
    of piece 0 already hold piece 1's start (M_0 = 0): "serial" and "triton" take it without the product, "log"
    composes the zero M_0 (the same starts)."""
    if method not in SCANS:
        raise ValueError(f"piece_scan: method must be one of {SCANS}; got {method!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"piece_scan: precision must be one of {tuple(PRECISIONS)}; got {precision!r}")
    hp = PRECISIONS[precision]
    b, r, hv, rows, kdim = maps_t.shape
    vdim = rows - kdim
    if kdim != key_dim:
        raise ValueError(f"piece_scan: maps_t must be [B, R, Hv, K + V, K] with K = {key_dim}; got {maps_t.shape}")
    s0 = jnp.zeros((b, hv, vdim, kdim), F32) if h0t is None else h0t.astype(F32)
    if method == "triton":
        return piece_scan_triton(maps_t, h0t, precision=hp, interpret=interpret, first_end=first_end)
    mt, et = maps_t[:, :, :, :kdim], maps_t[:, :, :, kdim:]
    if method == "serial":
        s, out = s0, [s0]
        for i in range(r):
            if i == 0 and (h0t is None or first_end):
                s = et[:, 0]
            else:
                s = jnp.einsum("bhvk,bhkj->bhvj", s, mt[:, i], precision=hp, preferred_element_type=F32) + et[:, i]
            out.append(s)
        return jnp.stack(out, axis=1)
    m, d = maps_t, 1
    while d < r:          # entry p: the composition of pieces max(0, p - 2d + 1) .. p
        later, earlier = m[:, d:], m[:, :-d]
        comp = jnp.einsum("bphrk,bphkj->bphrj", earlier, later[:, :, :, :kdim], precision=hp,
                          preferred_element_type=F32)
        comp = comp.at[:, :, :, kdim:].add(later[:, :, :, kdim:])
        m = jnp.concatenate([m[:, :d], comp], axis=1)
        d *= 2
    later = m[:, :, :, kdim:]
    if h0t is not None:
        later = later + jnp.einsum("bhvk,bphkj->bphvj", s0, m[:, :, :, :kdim], precision=hp,
                                   preferred_element_type=F32)
    return jnp.concatenate([s0[:, None], later], axis=1)


SCAN_ROWS = 16       # value rows per program of piece_scan_triton
SCAN_WARPS = 8


def piece_scan_triton(maps_t, h0t, *, precision=HIGHEST, interpret: bool = False, first_end: bool = False):
    """:func:`piece_scan` as one Pallas Triton kernel (jla's ``scalar_gate_scan.piece_scan``, forward, no zero-map
    flags): grid (B Hv, V / 16); a program keeps its 16 rows of the running S^T in registers as K / 64 column
    tiles and walks the pieces, S_{p+1}^T rows = S_p^T rows M_p^T + E_p^T rows, each product a sum of [16, 64] x
    [64, 64] tile products, the next step's tiles loaded before this step's products. Same result as the XLA
    forms (``precision`` of the tile products). maps_t [B, R, Hv, K + V, K], h0t [B, Hv, V, K] or None ->
    [B, R + 1, Hv, V, K] fp32. ``first_end``: piece 0's rows K: are piece 1's start (M_0 not read)."""
    import jax.experimental.pallas as pl
    b, r, hv, rows_kv, kdim = maps_t.shape
    vdim = rows_kv - kdim
    cols = 64 if kdim % 64 == 0 else kdim
    rows = SCAN_ROWS if vdim % SCAN_ROWS == 0 else vdim
    nb = kdim // cols
    has_init = h0t is not None

    def kernel(maps_ref, *refs):
        init_ref = refs[0] if has_init else None
        out_ref = refs[-1]
        bh, rb = pl.program_id(0), pl.program_id(1)
        bi, h = bh // hv, bh % hv
        vrows = pl.ds(rb * rows, rows)
        erows = pl.ds(kdim + rb * rows, rows)

        def cs(j):
            return pl.ds(j * cols, cols)

        def store(i, s):
            for j in range(nb):
                out_ref[bi, i, h, vrows, cs(j)] = s[j]

        def loads(i, first):
            local = [maps_ref[bi, i, h, erows, cs(j)] for j in range(nb)]
            tiles = None if first else [[maps_ref[bi, i, h, cs(c), cs(j)] for c in range(nb)] for j in range(nb)]
            return local, tiles

        if has_init:
            s = [init_ref[bi, h, vrows, cs(j)] for j in range(nb)]
        else:
            s = [jnp.zeros((rows, cols), F32) for _ in range(nb)]
        store(0, s)
        pending = loads(0, not has_init or first_end) if r else None
        for i in range(r):
            local, tiles = pending
            if i + 1 < r:
                pending = loads(i + 1, False)
            if tiles is None:            # from a zero state: the local term itself (M_0 not read)
                s = local
            else:
                s = [local[j] + sum(jnp.dot(s[c], tiles[j][c], precision=precision, preferred_element_type=F32)
                                    for c in range(nb)) for j in range(nb)]
            store(i + 1, s)

    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        params = pltriton.CompilerParams(num_warps=SCAN_WARPS, num_stages=1)
    args = [maps_t.astype(F32)] + ([h0t.astype(F32)] if has_init else [])
    return pl.pallas_call(
        kernel, grid=(b * hv, vdim // rows), out_shape=jax.ShapeDtypeStruct((b, r + 1, hv, vdim, kdim), F32),
        compiler_params=params, interpret=interpret, name="gdn_split_piece_scan",
    )(*args)


def start_states(ops_, pieces: int, *, kernel: bool, head_major: bool, exp2: bool = False, map_impl: str = "map",
                 config: SplitConfig = DEFAULT_SPLIT):
    """Each piece's initial state, transposed, fp32 [B P, Hv, V, K], from the fused pass's operands ``ops_`` =
    (q, k, v, t, gcum, beta_c, h0t) (``chunk.prepare_head_major`` / ``prepare_chunk_layout`` with the same P).
    ``kernel`` False: the jnp twin of the map pass (anywhere). ``map_impl``: "map" the map kernel (paired where
    ``config.paired`` says), "paired" always paired. ``config``: the scan (``scan``; "auto": "serial" up to
    ``serial_max_pieces`` pieces, else "triton") and its ``precision``; ``first`` "h0" runs the first piece from the
    initial state (:func:`state_map_pass` with ``h0t``: no identity blocks walk piece 0, and the scan skips one
    product), "map" maps it from [I | 0] like the others; without an initial state both are the same (M_0 is
    skipped)."""
    scan = config.scan
    if scan == "auto":
        scan = "serial" if pieces <= config.serial_max_pieces else "triton"
    if map_impl not in MAPS:
        raise ValueError(f"start_states: map_impl must be one of {MAPS}; got {map_impl!r}")
    _, k, v, t, gcum, beta_c, h0t = ops_
    b, _, hv, vdim = v.shape
    kdim = k.shape[3]
    kw = dict(pieces=pieces, need_first=h0t is not None, head_major=head_major, exp2=exp2)
    first_end = config.first == "h0" and h0t is not None
    if first_end:
        kw["h0t"] = h0t
    if not kernel:
        maps_t = state_map_pass_reference(k, v, t, gcum, beta_c, **kw)
    else:
        map_config = dataclasses.replace(config, paired=True) if map_impl == "paired" else config
        maps_t = state_map_pass(k, v, t, gcum, beta_c, config=map_config, **kw)
    maps_t = maps_t.reshape(b, pieces - 1, hv, kdim + vdim, kdim)
    starts = piece_scan(maps_t, h0t, key_dim=kdim, method=scan, precision=config.precision, interpret=not kernel,
                        first_end=first_end)
    return starts.reshape(b * pieces, hv, vdim, kdim)
