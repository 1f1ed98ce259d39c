# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
# The per-CTA walk table and its dynamic trip count follow jax-linear-attention 0.1.0 (Apache-2.0),
# jla/ops/mosaic_gpu/scalar_gate_docs.py (walk_tables, map_fwd_wy). See NOTICE in this folder.
"""Mosaic GPU (Hopper) backend of the chunked gated delta rule for packed sequences (``cu_seqlens``): the
"mosaic_gpu" backend's varlen and slot-pool calls (the dispatch table's "mosaic_gpu.varlen" row, which "auto" picks
on a Hopper GPU where it takes the call). The kernels are ``chunk.py``'s: this file lays the packed row out
for them and back.

  1. **Repack** (``VarlenConfig.copies``: XLA gathers, or one Pallas Triton launch of ``triton/varlen_copy.py``
     copying each chunk's rows as [C, BD] tiles): every sequence starts at a chunk boundary of one padded row of
     Tp = NC C tokens, NC = T // C + N rounded up to a multiple of 8 (``chunk_map.max_chunks``; 8: kkt_fwd's
     chunks per CTA; chunk c of the repacked row is chunk c of ``build_chunk_map``).
     The tail of each sequence's last chunk holds zero q, k, v, g and beta: a zero token neither decays nor
     updates the state. The unused chunk slots at the end are zeros too ("xla") or left unset ("triton"): no
     walk reads them. Padding tokens (index >= cu_seqlens[N]) and
     other sequences' tokens are never gathered into a chunk, so a NaN there reaches nothing (a select, never a
     multiply).
  2. **Stage 1a** on the repacked row: ``stage1a="mosaic"`` (:func:`chunk.kkt_fwd`, gate-free T0, head-major;
     the chunk-local cumulative gate in XLA) or ``"triton"`` (Pallas Triton ``kkt_solve`` straight from the packed
     row through the chunk map: gated T in chunk layout, no repack of k for it).
  3. **The fused state pass** (:func:`chunk.fused_state_pass` with a walk table): grid (N, Hv, V / 64), CTA
     row r reads (first chunk, chunk count, sequence) from an int32 [N, 3] table (sequences by decreasing chunk
     count, so the long serial walks start first) and walks only its own chunks (a dynamic trip count; 0 for an
     empty sequence, whose final state is then its initial state), from h0[n], final state to [n].
  4. **Unpack**: o gathered back to the packed token order (XLA gather, or the Triton chunk copy); rows at index
     >= cu_seqlens[N] are zero.

**The packed split** (``VarlenConfig.split``, in place, the narrow pass, at most ``SPLIT_MAX_SEQS`` sequences):
:func:`split_plan` cuts each sequence long enough to leave SMs idle into pieces on the device,
``split.state_map_pass_walk`` maps every piece but the last over the packed row, :func:`split_start_states` scans
the maps into each piece's start state, and the fused pass walks the pieces side by side from an [R, 8] table.

The slot-pool form (:func:`op_fwd_slots`) gathers the start states of the pool (``chunk_map.gather_slots``: zeros
for has_initial_state False and for ids outside [0, S)) and scatters the final states back
(``chunk_map.scatter_slots``: writes of ids outside [0, S) dropped), around the same call.

**Packed tokens read in place** (``VarlenConfig.reads="in_place"``, packed rows of a multiple of 8 tokens): no
repack of q, k, v and no unpack of o. Each sequence's chunks lie on a grid of rows aligned to 8 (Mosaic's TMA
tiles GMEM rows in 8s, so a copy may start at a multiple of 8 only), starting at its first token rounded down
(``chunk_map.build_aligned_chunks``): a chunk's leading rows may belong to the sequence before and its trailing
rows to the one after or to padding. Those rows are masked inside the kernels by selects (k zeroed in SMEM, W's
columns, A0's rows and columns; g = 0 and beta = 0 in the chunk-slot vectors, which XLA gathers: [T, Hv] fp32,
a small part of the bytes), so a NaN in another sequence reaches nothing. o is stored in place in groups of 8
rows; the groups a sequence shares with its neighbours go to a small edge buffer [2 N, 8, Hv, V] that one Pallas
Triton launch merges into o in place, zeroing the padding rows in the same launch (:func:`merge_edges`).

``impl="reference"``: the same repack, table and unpack around the jnp twin of the walk
(:func:`fused_state_pass_walk_reference`, the kernel's per-row dynamic loop as ``lax.fori_loop``s) and the twins of
stage 1a: the CPU tests check it against the float64 oracle (the Mosaic GPU kernels do not run on CPU).

Shape legend: T packed tokens, N sequences, S slots, Hk / Hv key / value heads, K / V head dims, C = 64 chunk,
NC = T // C + N chunk slots (rounded up to 8 on the repacked row), Tp = NC C repacked tokens, R = N rows of the walk
table.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.dispatch import DEVICE_BRANCH_MIN_TOKENS
from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mg
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import num_sms
from pallas_kernels.gated_delta_rule.chunk_map import (build_chunk_map, gather_slots, launch_order, max_chunks,
                                                       scatter_slots)

C = mg.C
F32 = jnp.float32
STAGE1A = ("mosaic", "triton")
ORDERS = ("longest_first", "index")
STATES = ("kv", "vk")
COPIES = ("xla", "triton")
READS = ("repacked", "in_place")
ALIGN = 8                # rows of a TMA copy's GMEM tile: in-place chunks start at multiples of it
# the packed split (VarlenConfig.split, split_plan): calls of at most SPLIT_MAX_SEQS sequences (above that the pieces'
# start states would be a copy of every initial state, and such mixes fill the SMs without a split), pieces of at
# least SPLIT_MIN_CHUNKS chunks (2048 tokens; VarlenConfig.split's default, the bench's split variant; not tuned), at
# most SPLIT_MAX_PIECES pieces a sequence
SPLIT_MAX_SEQS = 16
SPLIT_MIN_CHUNKS = 32
SPLIT_MAX_PIECES = 8
# wide "per_call" (wide_pays): a wide CTA's chunk step over a narrow one's where the longest sequence sets the time,
# from long16k-short63 (H200, 8c8daaf: wide 0.8963 against narrow 0.7714 ms; the launches both pay included, so the
# steps' own ratio is larger and the choice leans wide, the static "auto" form's way)
WIDE_STEP = 1.16
WIDES = (True, False, "auto", "per_call")


@dataclasses.dataclass(frozen=True)
class VarlenConfig:
    """Launch choices of the varlen "mosaic_gpu" path, fixed when the call is built.

    stage1a: "mosaic" (kkt_fwd on the repacked row) or "triton" (Pallas Triton kkt_solve on the packed row).
    order: the walk table's row order, "longest_first" (decreasing chunk count) or "index" (sequence order).
    states: "kv" (the kernel reads the initial states and writes the final ones in the op's [N, Hv, K, V] layout,
    ``fused_state_pass(state_kv=True)``) or "vk" (XLA transposes them to and from the kernel's S^T, the dense
    path's way: two extra passes over 2 x N Hv K V x 4 bytes).
    lanes: 0 (one CTA row per sequence, grid (N, Hv, V / 64)) or the persistent walk (:func:`lane_table`): L > 0
    lanes of sequences, each CTA walking its lane's sequences back to back; -1: L = SMs // (Hv V / 64) (one wave)
    when that leaves at least 4 sequences a lane, else 0. Right against float64 on the GPU (vk states, 3 lanes);
    serve256 1.891 ms against 1.918 without (bitwise the same result); varlen16 (2 lanes for 16 sequences) is
    untimed, so it stays off by default.
    copies: how the rows move between the packed and the chunk-aligned row: "triton" (``triton/varlen_copy.py``:
    q, k, v, g and beta repacked by one Pallas Triton launch of [C, BD] tiles at each chunk's row offset, o
    unpacked by another: serve256's repack 0.381 ms against 0.524) or "xla" (one gather + select fusion per array, :func:`gather_rows`); bitwise the same rows,
    but "triton" leaves the unused chunk slots of the repacked row unset instead of zeroed: nothing reads them.
    kkt_used: stage1a "mosaic" computes T0 only for the chunk slots in use (``kkt_fwd(num_chunks=...)``: the CTAs
    past them exit at once; serve256 uses 732 of its 864 slots: 0.306 ms against 0.353); False: every slot.
    reads: "repacked" (q, k, v copied to chunk-aligned rows and o back) or "in_place" (the packed row read and o
    written where they lie, module docstring; needs stage1a "mosaic", lanes 0 and T a multiple of 8: other calls
    run "repacked").
    wide: True / False / "auto" (``chunk.use_wide`` on N sequences): the fused pass as one CTA per (sequence, value
    head) over V = 128 with two state warpgroups (``chunk.fused_state_pass(wide=True)``; stage1a "mosaic", V = 128,
    lanes 0; ignored elsewhere; "auto" as ``chunk.MosaicConfig.wide``'s default: varlen16 0.6693 -> 0.6027 ms,
    serve256 1.9300 -> 1.6768, tiny64 0.2407 -> 0.1968; a mix whose longest sequence sets the time loses,
    long16k-short63 0.7694 -> 0.9083). "per_call" (the default): where "auto" would run wide, the choice is made
    on the device for each call from cu_seqlens (:func:`wide_pays`: the longest sequence against the total), both
    passes in the program under a ``lax.cond`` (H200, aef319c, same process, against "auto": long16k-short63
    0.893 -> 0.774 ms, varlen16 0.599 / 0.600, serve256 1.677 / 1.682, packed1 1.110 / 1.105; the cost is both
    passes compiled into each packed program). solve: with wide, T0 formed inside the fused pass (no kkt_fwd
    launch).
    split: the packed split (:func:`split_plan`; reads "in_place", the narrow pass, at most ``SPLIT_MAX_SEQS``
    sequences): 0 off, else the shortest piece in chunks (default ``SPLIT_MIN_CHUNKS`` = 32; the dense split's
    ``min_piece_chunks`` is 8). A sequence long enough to leave SMs idle is cut into pieces that the fused pass
    walks side by side, their start states from a map pass over the packed row (``split.state_map_pass_walk``) and
    a scan; the plan is made on the device from cu_seqlens. It engages only where the pass runs narrow: calls of
    at most SMs / (Hv V / 64) sequences (2 at 80B dims, the model's long stream among them), and with wide
    "per_call" a call of at most ``SPLIT_MAX_SEQS`` sequences whose choice goes narrow. On by default
    since measured (H200, 8c8daaf, same process): packed1-T32768 1.2553 -> 1.1092 ms; long16k-short63 (64
    sequences: never split) 0.7714 / 0.7777.

    single_dense: a call of one sequence that covers the whole row (cu_seqlens = [0, T], checked on the device)
    runs the dense op (``chunk.DEFAULT_CONFIG``: its split, exp2 and state layout) under a ``lax.cond``, the
    packed path otherwise (a sequence followed by padding): both compiled into the program. The model's long
    stream is such a call.
    cond_min_tokens: the device-side choices above (single_dense, wide "per_call") are made only in calls of at
    least this many tokens (static T); a shorter call runs the packed path with wide "auto" and holds no
    ``lax.cond``, which XLA's GPU runtime runs as a host wait (``pallas_kernels.dispatch.DEVICE_BRANCH_MIN_TOKENS``,
    the default, says what was measured). 0: always.

    The defaults are the H200's (``python -m benchmarks gdn``): serve256 1.933 ms (copies "triton" + kkt_used;
    2.142 with the XLA gathers and every kkt slot, same process) against Pallas Triton's 2.435 and FLA's 2.843 (0.68x); varlen16 0.672 against Triton's 0.808.
    """
    stage1a: str = "mosaic"
    order: str = "longest_first"
    states: str = "kv"
    lanes: int = 0
    copies: str = "triton"
    kkt_used: bool = True
    reads: str = "in_place"
    wide: object = "per_call"
    solve: bool = False
    split: int = SPLIT_MIN_CHUNKS
    single_dense: bool = True
    cond_min_tokens: int = DEVICE_BRANCH_MIN_TOKENS

    def __post_init__(self):
        if self.stage1a not in STAGE1A:
            raise ValueError(f"VarlenConfig.stage1a must be one of {STAGE1A}; got {self.stage1a!r}")
        if self.order not in ORDERS:
            raise ValueError(f"VarlenConfig.order must be one of {ORDERS}; got {self.order!r}")
        if self.states not in STATES:
            raise ValueError(f"VarlenConfig.states must be one of {STATES}; got {self.states!r}")
        if self.copies not in COPIES:
            raise ValueError(f"VarlenConfig.copies must be one of {COPIES}; got {self.copies!r}")
        if self.reads not in READS:
            raise ValueError(f"VarlenConfig.reads must be one of {READS}; got {self.reads!r}")
        if self.wide not in WIDES or isinstance(self.wide, int) and not isinstance(self.wide, bool):
            raise ValueError(f"VarlenConfig.wide must be one of {WIDES}; got {self.wide!r}")
        for name in ("kkt_used", "solve", "single_dense"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"VarlenConfig.{name} must be a bool; got {getattr(self, name)!r}")
        if not isinstance(self.split, int) or isinstance(self.split, bool) or self.split < 0:
            raise ValueError(f"VarlenConfig.split must be an int >= 0 (0: off, else the shortest piece in chunks, "
                             f"SPLIT_MIN_CHUNKS = {SPLIT_MIN_CHUNKS} measured); got {self.split!r}")
        if not isinstance(self.cond_min_tokens, int) or isinstance(self.cond_min_tokens, bool) \
                or self.cond_min_tokens < 0:
            raise ValueError(f"VarlenConfig.cond_min_tokens must be an int >= 0 (0: the device-side choices in "
                             f"every call); got {self.cond_min_tokens!r}")
        if not isinstance(self.lanes, int) or isinstance(self.lanes, bool) or self.lanes < -1:
            raise ValueError(f"VarlenConfig.lanes must be an int >= -1 (0: one CTA per sequence, -1: automatic); "
                             f"got {self.lanes!r}")


DEFAULT_CONFIG = VarlenConfig()


def layout(cu_seqlens, total_len: int, *, order: str = "longest_first"):
    """The repack / unpack maps and the walk table of ``cu_seqlens [N + 1]`` for a row of ``total_len`` tokens
    (on the device, static shapes: Tp = NC C, NC = T // C + N rounded up to 8). Returns (chunk map, src [Tp],
    keep [Tp], back [T], valid [T], walk [N, 5]) int32 / bool: repacked token p is packed token src[p] where
    keep[p] (else a zero token); packed token t is repacked token back[t] where valid[t] (t < cu_seqlens[N]);
    walk row r = (first chunk, chunk count, sequence n, its first packed token cu_seqlens[n], its length)."""
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    n = cu.shape[0] - 1
    nc = -(-max_chunks(total_len, n, C) // 8) * 8
    cm = build_chunk_map(cu, total_len, C)
    p = jnp.arange(nc * C, dtype=jnp.int32)
    c, i = p // C, p % C
    chunk_start, chunk_len = chunk_rows(cm, nc)      # the slots past the chunk map's hold no token
    keep = i < chunk_len[c]
    src = jnp.where(keep, chunk_start[c] + i, 0)
    t = jnp.arange(total_len, dtype=jnp.int32)
    valid = t < cu[-1]
    back = jnp.where(valid, jnp.clip(cm.token_chunk * C + cm.token_offset, 0, nc * C - 1), 0)
    rows = launch_order(cm.seq_num_chunks) if order == "longest_first" else jnp.arange(n, dtype=jnp.int32)
    walk = jnp.stack([cm.seq_first_chunk[rows], cm.seq_num_chunks[rows], rows, cu[rows], cu[rows + 1] - cu[rows]],
                     axis=-1).astype(jnp.int32)
    return cm, src, keep, back, valid, walk


def num_lanes(lanes: int, n: int, heads: int, value_dim: int, sms: int | None = None) -> int:
    """The persistent walk's lane count for ``VarlenConfig.lanes`` (0: off)."""
    if lanes >= 0:
        return min(lanes, n)
    auto = rows_per_wave(heads, value_dim, sms)
    return auto if n >= 4 * auto else 0


def row_ctas(heads: int, value_dim: int) -> int:
    """CTAs of one row (sequence) of the narrow fused pass: Hv V / 64."""
    return heads * max(value_dim // mg.BV, 1)


def rows_per_wave(heads: int, value_dim: int, sms: int | None = None) -> int:
    """CTA rows of the narrow fused pass (:func:`row_ctas` a row) that one wave of the SMs holds, at least 1."""
    sms = num_sms() if sms is None else sms
    return max(sms // row_ctas(heads, value_dim), 1)


def wide_pays(cu, heads: int, value_dim: int, sms: int | None = None):
    """Whether the wide fused pass should run this call (wide "per_call"; traceable: cu [N + 1] traced), a bool
    scalar: with c_n = ceil(len_n / C) chunks a sequence, the narrow pass takes about max(max c_n, sum c_n Hv V /
    64 / SMs) chunk steps (its longest sequence's chain, or its CTAs' share of the SMs) and the wide one
    ``WIDE_STEP`` max(max c_n, sum c_n Hv / SMs) (half the CTAs, each step ``WIDE_STEP`` narrow ones): wide where
    that is less, so a mix whose longest sequence sets the time runs narrow."""
    sms = num_sms() if sms is None else sms
    lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    chunks = ((lens + C - 1) // C).astype(jnp.float32)
    longest, total = jnp.max(chunks), jnp.sum(chunks)
    narrow = jnp.maximum(longest, total * row_ctas(heads, value_dim) / sms)
    wide = WIDE_STEP * jnp.maximum(longest, total * heads / sms)
    return wide < narrow


def lane_table(walk, lanes: int):
    """The persistent walk's tables from the walk table [N, 5] (rows longest first): (table [L, R, 6] int32,
    lane_rows [L] int32), R = ceil(N / L). Rows are dealt in snake order (lane 0, 1, .., L-1, then L-1, .., 0, ...),
    so every lane gets one of each L consecutive rows of the longest-first order; entry [p, j] = walk row + m0,
    the chunks lane p walks before its row j (the kernel's ring position). Lane p's rows are j < lane_rows[p]."""
    n = walk.shape[0]
    rmax = -(-n // lanes)
    i = jnp.arange(rmax * lanes, dtype=jnp.int32)
    rnd, pos = i // lanes, i % lanes
    lane = jnp.where(rnd % 2 == 0, pos, lanes - 1 - pos)
    valid = i < n
    rows = jnp.where(valid[:, None], walk[jnp.clip(i, 0, n - 1)], 0)
    table = jnp.zeros((lanes, rmax, walk.shape[1]), jnp.int32).at[lane, rnd].set(rows)
    counts = table[..., 1]
    m0 = jnp.cumsum(counts, axis=1) - counts
    lane_rows = jnp.zeros((lanes,), jnp.int32).at[lane].add(valid.astype(jnp.int32))
    return jnp.concatenate([table, m0[..., None]], axis=-1).astype(jnp.int32), lane_rows


def used_chunks(cm):
    """int32 [1]: the chunk slots in use (sum of the sequences' chunk counts; they come first)."""
    return jnp.sum(cm.seq_num_chunks, dtype=jnp.int32).reshape(1)


def chunk_rows(cm, ncp: int):
    """(chunk_start, chunk_len) [NCp] int32 of the chunk map padded with zero-length slots to the repacked row's
    NCp chunks (the Triton copies' map)."""
    pad = ncp - cm.chunk_start.shape[0]
    return tuple(jnp.pad(x.astype(jnp.int32), (0, pad)) for x in (cm.chunk_start, cm.chunk_len))


def repack_all(xs, src, keep, *, copies: str = "xla", chunks=None, interpret: bool = False):
    """Arrays [1, T, ...] of the packed row -> [1, Tp, ...] on the repacked row: ``copies="xla"`` by
    :func:`repack` (src / keep), ``"triton"`` by one ``varlen_copy_triton.repack_rows`` launch over ``chunks`` =
    :func:`chunk_rows` (the same rows, bitwise, in the chunks in use; the unused
    slots left unset)."""
    if copies == "xla":
        return repack(xs, src, keep)
    from pallas_kernels.gated_delta_rule.triton import varlen_copy as vc
    t = xs[0].shape[1]
    outs = vc.repack_rows(tuple(x[0].reshape(t, -1) for x in xs), *chunks, chunk=C, interpret=interpret)
    return tuple(y.reshape((1, y.shape[0]) + x.shape[2:]) for x, y in zip(xs, outs))


def unpack(o_r, back, valid, *, copies: str = "xla", chunks=None, end=None, total_len: int = 0,
           interpret: bool = False):
    """o_r [1, Tp, Hv, V] on the repacked row -> [1, T, Hv, V] on the packed row, zero at index >= cu_seqlens[N]
    (``copies="xla"``: one gather + select by back / valid; ``"triton"``: ``varlen_copy_triton.unpack_rows`` over
    ``chunks`` with ``end`` = cu_seqlens[N:])."""
    if copies == "xla":
        return gather_rows(o_r[0], back, valid)[None]
    from pallas_kernels.gated_delta_rule.triton import varlen_copy as vc
    tp = o_r.shape[1]
    y = vc.unpack_rows(o_r[0].reshape(tp, -1), *chunks, end, total_len=total_len, chunk=C, interpret=interpret)
    return y.reshape((1, total_len) + o_r.shape[2:])


def gather_rows(x, idx, keep):
    """x [T, ...] -> [len(idx), ...]: x[idx] where keep, zeros elsewhere (a select: NaN-safe)."""
    out = jnp.take(x, idx, axis=0, mode="clip")
    return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), out, jnp.zeros((), x.dtype))


def repack(xs, src, keep):
    """Arrays [1, T, ...] of the packed row -> the same on the repacked row [1, Tp, ...]."""
    return tuple(gather_rows(x[0], src, keep)[None] for x in xs)


class EdgeGroups(NamedTuple):
    """Where the in-place kernel's edge buffer [2 N, 8, Hv, V] lands: entry e's rows [lo[e], hi[e]) go to packed
    rows row[e] + i (entry 2 n: the group of 8 holding sequence n's first token, 2 n + 1: the one holding its last
    when that is another; an entry whose group lies wholly inside its sequence, stored in place by the kernel, or
    that is not used, has lo = hi = 0). All int32 [2 N]."""
    row: jax.Array
    lo: jax.Array
    hi: jax.Array

    def rows(self, total_len: int):
        """[2 N 8] int32: the packed row of each edge-buffer row, ``total_len`` where it lands nowhere."""
        i = jnp.arange(ALIGN, dtype=jnp.int32)
        ok = (i >= self.lo[:, None]) & (i < self.hi[:, None])
        return jnp.where(ok, self.row[:, None] + i, total_len).reshape(-1)


def in_place_layout(cu_seqlens, total_len: int, *, order: str = "longest_first"):
    """The in-place reads' maps of ``cu_seqlens [N + 1]`` for a packed row of ``total_len`` tokens: (aligned chunks
    (``chunk_map.AlignedChunks``, NC slots rounded up to 8), walk [N, 6] int32 with row r = (first chunk, chunk
    count, sequence n, cu_seqlens[n], its length, its first chunk's packed row / 8), :class:`EdgeGroups`)."""
    from pallas_kernels.gated_delta_rule.chunk_map import build_aligned_chunks, max_aligned_chunks
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    n = cu.shape[0] - 1
    nc = -(-max_aligned_chunks(total_len, n, C, ALIGN) // 8) * 8
    ac = build_aligned_chunks(cu, total_len, C, align=ALIGN, num_slots=nc)
    start, end = cu[:-1], cu[1:]
    rows = launch_order(ac.seq_num_chunks) if order == "longest_first" else jnp.arange(n, dtype=jnp.int32)
    walk = jnp.stack([ac.seq_first_chunk[rows], ac.seq_num_chunks[rows], rows, start[rows], end[rows] - start[rows],
                      ac.row0[rows] // ALIGN], axis=-1).astype(jnp.int32)
    last = jnp.maximum(end - 1, 0) // ALIGN * ALIGN                 # the group of each sequence's last token
    group = jnp.stack([ac.row0, last], axis=1)                      # [N, 2]: entries 2 n, 2 n + 1
    inside = (group >= start[:, None]) & (group + ALIGN <= end[:, None])
    used = ~inside & jnp.stack([end > start, (last != ac.row0) & (end > start)], axis=1)
    lo = jnp.where(used, jnp.clip(start[:, None] - group, 0, ALIGN), 0)
    hi = jnp.where(used, jnp.clip(end[:, None] - group, 0, ALIGN), 0)
    edges = EdgeGroups(group.reshape(-1).astype(jnp.int32), lo.reshape(-1).astype(jnp.int32),
                       hi.reshape(-1).astype(jnp.int32))
    return ac, walk, edges


class SplitPlan(NamedTuple):
    """The packed split of one call (:func:`split_plan`), made on the device. R = N + E piece rows, E mapped rows.

    walk [R, 8] int32: the fused pass's rows, longest first: (first chunk slot, chunk count, state row i, the
      sequence's first token, its length, the piece's first packed row / 8, the sequence n, chunks of n before the
      piece); state row i is the piece's index in sequence order (pieces of sequence 0, then 1, ...; rows past the
      pieces walk nothing).
    piece_seq, piece_index [R] int32: the sequence and the piece of it of each state row (piece_index 0: the start
      is the sequence's initial state; -1: an unused row).
    maps [E, 6] int32: ``split.state_map_pass_walk``'s rows, every piece but its sequence's last, in sequence order:
      (first chunk slot, count, first packed row / 8, the sequence's first token, 1 for a first piece, n).
    map_row [R] int32: the mapped row whose end state starts state row i (for piece_index >= 1).
    last_row [N] int32: the state row of each sequence's last piece (its final state).
    """
    walk: jax.Array
    piece_seq: jax.Array
    piece_index: jax.Array
    maps: jax.Array
    map_row: jax.Array
    last_row: jax.Array


def split_rows(num_seqs: int, total_chunks: int, heads: int, value_dim: int, min_chunks: int,
               sms: int | None = None) -> int:
    """E, the static bound on the extra piece rows of :func:`split_plan`: at most ``slots`` = SMs // (Hv V / 64)
    (the CTA rows of one wave; the pieces are at least total / slots chunks long), ``total_chunks`` //
    ``min_chunks`` and N (SPLIT_MAX_PIECES - 1); 0 (no split) for ``min_chunks`` 0 and above SPLIT_MAX_SEQS
    sequences."""
    if num_seqs > SPLIT_MAX_SEQS or min_chunks <= 0:
        return 0
    return min(rows_per_wave(heads, value_dim, sms), total_chunks // min_chunks, num_seqs * (SPLIT_MAX_PIECES - 1))


def split_plan(ac, cu, extra: int, *, heads: int, value_dim: int, min_chunks: int, sms: int | None = None
               ) -> SplitPlan:
    """The packed split of a call (traceable: cu traced, the bounds static): with ``slots`` CTA rows a wave (as in
    :func:`split_rows`), the piece length is L = max(``min_chunks``, ceil(total chunks / slots)) and sequence
    n of c_n chunks is cut into pieces of ceil(c_n / min(ceil(c_n / L), SPLIT_MAX_PIECES)) chunks, its last piece
    the rest (not empty, so a mapped piece never reaches its sequence's last chunk, whose trailing rows may belong
    to the next), p_n - 1 <= ``extra`` in all (sum(ceil(c_n / L) - 1) <= total / L <= slots; the cumulative clip
    below only guards the bound). ``ac``: the call's ``chunk_map.AlignedChunks``; cu [N + 1]."""
    from pallas_kernels.gated_delta_rule.chunk_map import count_le
    n = cu.shape[0] - 1
    rows = n + extra
    slots = rows_per_wave(heads, value_dim, sms)
    c = ac.seq_num_chunks.astype(jnp.int32)                                          # [N]
    total = jnp.sum(c)
    length = jnp.maximum(min_chunks, (total + slots - 1) // slots)
    pieces = jnp.clip((c + length - 1) // length, 1, SPLIT_MAX_PIECES)
    more = pieces - 1
    before = jnp.cumsum(more) - more
    pieces = jnp.clip(extra - before, 0, more) + 1                                   # never past E rows
    per = jnp.maximum((c + pieces - 1) // pieces, 1)                                 # chunks a piece
    pieces = jnp.where(c > 0, (c + per - 1) // per, 1)   # every piece but the last full, the last not empty
    more = pieces - 1
    ends = jnp.cumsum(pieces)
    i = jnp.arange(rows, dtype=jnp.int32)
    seq = jnp.minimum(count_le(ends, rows), n - 1)
    p = i - (ends - pieces)[seq]
    used = i < ends[-1]
    count = jnp.where(used, jnp.clip(c[seq] - p * per[seq], 0, per[seq]), 0)
    skip = p * per[seq]                                                              # chunks of n before it
    start, end = cu[:-1], cu[1:]
    c0 = jnp.where(used, ac.seq_first_chunk[seq] + skip, 0)
    row0 = ac.row0[seq] + skip * C
    table = jnp.stack([c0, count, i, jnp.where(used, start[seq], 0), jnp.where(used, end[seq] - start[seq], 0),
                       jnp.where(used, row0 // ALIGN, 0), seq, jnp.where(used, skip, 0)], axis=-1)
    walk = table[launch_order(count)].astype(jnp.int32)
    # the mapped pieces: all but each sequence's last, in sequence order
    m_ends = jnp.cumsum(more)
    j = jnp.arange(extra, dtype=jnp.int32)
    m_seq = jnp.minimum(count_le(m_ends, extra), n - 1)
    m_p = j - (m_ends - more)[m_seq]
    m_used = j < m_ends[-1]
    m_skip = m_p * per[m_seq]
    maps = jnp.stack([jnp.where(m_used, ac.seq_first_chunk[m_seq] + m_skip, 0),
                      jnp.where(m_used, per[m_seq], 0),
                      jnp.where(m_used, (ac.row0[m_seq] + m_skip * C) // ALIGN, 0),
                      jnp.where(m_used, start[m_seq], 0),
                      (m_p == 0).astype(jnp.int32), m_seq], axis=-1).astype(jnp.int32)
    map_row = jnp.clip((m_ends - more)[seq] + p - 1, 0, max(extra - 1, 0))
    return SplitPlan(walk, seq.astype(jnp.int32), jnp.where(used, p, -1).astype(jnp.int32), maps,
                     map_row.astype(jnp.int32), (ends - 1).astype(jnp.int32))


def split_start_states(plan: SplitPlan, maps_t, h0):
    """Each state row's start state [R, Hv, K, V] fp32 from the mapped pieces' maps ``maps_t`` [E, Hv, K + V, K]
    (``split.state_map_pass_walk``) and the initial states ``h0`` [N, Hv, K, V] (None: zeros): a first piece starts
    from its sequence's h0; the scan over the mapped rows in sequence order gives the others, S_1 = E_0 (mapped
    from h0: M_0 = 0) and S_{p+1} = S_p M_p^T + E_p^T (transposed), products in fp32 (E small)."""
    kdim = maps_t.shape[-1]
    mt, et = maps_t[:, :, :kdim], maps_t[:, :, kdim:]
    first = plan.maps[:, 4] == 1

    def step(s, x):
        m, e, f = x
        nxt = jnp.einsum("hvk,hkj->hvj", s, m, precision=lax.Precision.HIGHEST, preferred_element_type=F32) + e
        nxt = jnp.where(f, e, nxt)
        return nxt, nxt

    _, nexts = lax.scan(step, jnp.zeros_like(et[0]), (mt, et, first))               # [E, Hv, V, K]
    later = jnp.swapaxes(jnp.take(nexts, plan.map_row, axis=0), -1, -2)              # [R, Hv, K, V]
    own = (jnp.zeros_like(later) if h0 is None else jnp.take(h0.astype(F32), plan.piece_seq, axis=0))
    return jnp.where((plan.piece_index >= 1)[:, None, None, None], later,
                     jnp.where((plan.piece_index == 0)[:, None, None, None], own, 0.0))


def merge_edges(o, edges, groups: "EdgeGroups", cu_last, *, kernel: bool = True, interpret: bool = False):
    """The in-place kernel's o [1, T, Hv, V] completed: the edge buffer's rows [2 N, 8, Hv, V] put on their packed
    rows (``groups``), the padding rows (index >= cu_last[0]) zeroed. ``kernel``: one Pallas Triton launch over o in
    place (``triton/varlen_copy.merge_edge_rows``; ``interpret`` for the CPU); else an XLA scatter and select."""
    _, t, hv, vdim = o.shape
    if kernel:
        from pallas_kernels.gated_delta_rule.triton import varlen_copy as vc
        y = vc.merge_edge_rows(o[0].reshape(t, hv * vdim), edges.reshape(-1, hv * vdim), groups.row, groups.lo,
                               groups.hi, cu_last, interpret=interpret)
        return y.reshape(o.shape)
    o = o[0].at[groups.rows(t)].set(edges.reshape((-1,) + edges.shape[2:]), mode="drop", unique_indices=True)
    return jnp.where((jnp.arange(t) < cu_last[0])[:, None, None], o, jnp.zeros((), o.dtype))[None]


def in_place_stores_reference(o_r, ac, walk, total_len: int):
    """What the in-place kernel leaves in o and the edge buffer, from the twin's o on the chunk-slot row o_r
    [1, Tp, Hv, V]: (o [1, T, Hv, V] with the rows of groups of 8 wholly inside a sequence set and NaN elsewhere
    (unset), edges [2 N, 8, Hv, V] with each partial group's 8 rows as the kernel stores them)."""
    n = walk.shape[0]
    tp = o_r.shape[1]
    o_flat = o_r[0]
    seq = walk[:, 2]
    first, count, row0 = (jnp.zeros((n,), jnp.int32).at[seq].set(walk[:, i]) for i in (0, 1, 5))
    row0 = row0 * ALIGN
    start, end = (jnp.zeros((n,), jnp.int32).at[seq].set(x) for x in (walk[:, 3], walk[:, 3] + walk[:, 4]))
    t = jnp.arange(total_len, dtype=jnp.int32)
    s_of = jnp.clip(jnp.searchsorted(end, t, side="right"), 0, n - 1)
    g = t // ALIGN * ALIGN
    inside = (g >= start[s_of]) & (g + ALIGN <= end[s_of]) & (t < end[-1])
    slot = jnp.clip(first[s_of] * C + t - row0[s_of], 0, tp - 1)
    o = jnp.where(inside[:, None, None], jnp.take(o_flat, slot, axis=0), jnp.nan).astype(o_r.dtype)
    last = jnp.maximum(end - 1, 0) // ALIGN * ALIGN
    grp = jnp.stack([row0, last], axis=1)[:, :, None] + jnp.arange(ALIGN)             # [N, 2, 8] packed rows
    eslot = jnp.clip(first[:, None, None] * C + grp - row0[:, None, None], 0, tp - 1)
    edges = jnp.take(o_flat, eslot.reshape(-1), axis=0).reshape((2 * n, ALIGN) + o_flat.shape[1:])
    return o[None], edges


def stage1a_operands(k_r, g_r, b_r, *, kernel: bool, stage1a: str, vdim: int, packed=None, chunk_map=None,
                     num_chunks=None, chunk_rows=None, solve: bool = False):
    """(t, gcum, beta_c, head_major): the fused pass's stage-1a operands for the repacked row (g_r, b_r [1, Tp, Hv]
    fp32; k_r [1, Tp, Hk, K], read only by stage1a "mosaic"). ``stage1a="triton"`` runs kkt_solve on the packed
    row ``packed`` = (k [T, Hk, K], g, beta [T, Hv]) through ``chunk_map`` (interpret mode without ``kernel``).
    ``num_chunks`` (int32 [1], stage1a "mosaic"): T0 only for chunks below it (the kernel leaves the rest unset;
    the twin makes them NaN, so a read of them shows). ``chunk_rows`` (in-place reads, int32 [NC, 3]): k_r is the
    packed row itself and kkt_fwd reads each chunk's keys where they lie (``kkt_fwd(chunk_rows=...)``); the twin
    is then given k_r already gathered to the chunk-slot row. ``solve`` (stage1a "mosaic", ``kernel``): no T0 (None),
    the wide fused pass forms it (``chunk.fused_state_pass(solve=True)``)."""
    from pallas_kernels.gated_delta_rule.reference import floor_log_decay
    _, tp, hv = g_r.shape
    nc = tp // C
    if stage1a == "mosaic":
        g = floor_log_decay(g_r[0])                                                   # [Tp, Hv]
        gcum = jnp.cumsum(g.T.reshape(hv, nc, C), axis=-1).reshape(1, hv, tp)
        beta_hm = b_r[0].T[None]                                                      # [1, Hv, Tp]
        if kernel and solve:     # the wide fused pass forms T0 itself
            t0 = None
        elif kernel:
            t0 = mg.kkt_fwd(k_r, beta_hm, heads=hv, num_chunks=num_chunks, chunk_rows=chunk_rows)
        else:
            t0 = mg.kkt_fwd_reference(k_r, beta_hm, heads=hv)
            if num_chunks is not None:
                unset = (jnp.arange(tp) // C >= num_chunks[0])[None, None, :, None]
                t0 = jnp.where(unset, jnp.asarray(jnp.nan, t0.dtype), t0)
        return t0, gcum, beta_hm, True
    from pallas_kernels.gated_delta_rule.triton import chunk as kt
    kf, gf, bf = packed
    if not kernel:       # interpret mode clamps dynamic slices: pad C rows as triton.chunk's entry points do
        kf, gf, bf = (jnp.pad(x, [(0, C)] + [(0, 0)] * (x.ndim - 1)) for x in (kf, gf, bf))
    config = kt.launch_config(vdim, hv, kf.dtype)
    tmat, gcum = kt.kkt_solve(kf, gf.astype(F32), bf, chunk_start=chunk_map.chunk_start.astype(jnp.int32),
                              chunk_len=chunk_map.chunk_len.astype(jnp.int32), chunk=C, num_v_heads=hv,
                              interpret=not kernel, config=config)
    beta_c = jnp.swapaxes(b_r[0].reshape(nc, C, hv), 1, 2)[:tmat.shape[0]]             # [NC, Hv, C]
    return tmat, gcum, beta_c, False


def fused_state_pass_walk_reference(q, k, v, t, gcum, beta_c, h0t, walk, *, num_states: int, scale: float,
                                    out_final: bool, head_major: bool, exp2: bool = False, state_kv: bool = False,
                                    lane_rows=None, in_place: bool = False):
    """What :func:`chunk.fused_state_pass` computes with a walk table, in jnp (fp32, precision highest):
    row r of ``walk`` = (c0, count, s, ...) walks chunks c0 .. c0 + count - 1 from h0t[s] (zeros when None) by
    a dynamic-trip-count ``lax.fori_loop``, writes those chunks' rows of o and its final state to [s]. Chunks no
    row walks are NaN in the returned o (the kernel leaves
    them unset: nothing may read them). Returns (o [1, Tp, Hv, V] in q's dtype, final S^T [num_states, Hv, V, K]
    fp32 or None; ``state_kv``:
    h0t is then S [num_states, Hv, K, V] and so is the final state; ``lane_rows``: ``walk`` is a lane table
    [L, R, 6] and lane p walks its rows j < lane_rows[p] in order, as the persistent kernel does; ``in_place``:
    q, k, v are the packed row and ``walk`` the in-place table [N, 6]: chunk n of a row reads packed rows row0 +
    n C + [0, C) (zeros past T), its rows outside the sequence zeroed by a select, as the kernel masks them; o
    stays on the chunk-slot row)."""
    kdim = k.shape[3]
    hv, vdim = v.shape[2], v.shape[3]
    t, gcum, beta_c = mg.chunk_layout(t, gcum, beta_c, head_major=head_major, exp2=exp2)
    nc = t.shape[0]                                                                   # chunk slots
    tp = nc * C

    def heads(x):       # [1, L, H, D] -> [L, Hv, D] fp32 (value heads)
        return jnp.repeat(x[0], hv // x.shape[2], axis=1).astype(F32)
    qa, ka, va = heads(q), heads(k), heads(v)
    if in_place:         # rows past T read as zeros (the kernel's TMA does the same)
        qa, ka, va = (jnp.pad(x, [(0, C), (0, 0), (0, 0)]) for x in (qa, ka, va))
    ts = (t.astype(F32).reshape(nc, hv, C, C), gcum.astype(F32).reshape(nc, hv, C),
          beta_c.astype(F32).reshape(nc, hv, C))
    h0 = (jnp.zeros((num_states, hv, kdim, vdim), F32) if h0t is None
          else h0t.astype(F32) if state_kv else jnp.swapaxes(h0t.astype(F32), -1, -2))  # [S, Hv, K, V]

    def row(ent, carry):
        o, ht = carry
        c0, count, srow = ent[0], ent[1], ent[2]

        def chunk(n, carry2):
            s, o = carry2
            c = c0 + n
            first = c * C
            if in_place:
                at = ent[5] * ALIGN + n * C
                i = at + jnp.arange(C)
                mine = ((i >= ent[3]) & (i < ent[3] + ent[4]))[None, None, :, None]
            else:
                at, mine = first, None

            def tile(x, at):        # [C, Hv, D] rows at.. -> [1, Hv, C, D]
                y = jnp.swapaxes(lax.dynamic_slice_in_dim(x, at, C, 0), 0, 1)[None]
                return y if mine is None else jnp.where(mine, y, 0.0)
            qc, kc, vc = (tile(x, at) for x in (qa, ka, va))
            xs = (qc, kc, vc) + tuple(lax.dynamic_index_in_dim(x, c, 0, keepdims=True) for x in ts)
            s, oc = mg.chunk_step(s, xs, scale)
            return s, lax.dynamic_update_index_in_dim(o, oc[0], c, 0)

        s, o = lax.fori_loop(0, count, chunk, (lax.dynamic_index_in_dim(h0, srow, 0, keepdims=True), o))
        return o, lax.dynamic_update_index_in_dim(ht, s[0], srow, 0)

    o0 = jnp.full((nc, hv, C, vdim), jnp.nan, F32)
    if lane_rows is None:
        o, ht = lax.fori_loop(0, walk.shape[0], lambda r, cr: row(walk[r], cr), (o0, jnp.zeros_like(h0)))
    else:
        def lane(p, cr):
            return lax.fori_loop(0, lane_rows[p], lambda j, cr2: row(walk[p, j], cr2), cr)
        o, ht = lax.fori_loop(0, walk.shape[0], lane, (o0, jnp.zeros_like(h0)))
    o = jnp.swapaxes(o, 1, 2).reshape(1, tp, hv, vdim).astype(q.dtype)
    return o, ((ht if state_kv else jnp.swapaxes(ht, -1, -2)) if out_final else None)


def state_map_pass_walk_reference(k, v, t, gcum, beta_c, walk, *, h0t=None, exp2: bool = False):
    """What ``split.state_map_pass_walk`` computes, in jnp (fp32, precision highest), same arguments and result: the
    packed fused pass's twin (:func:`fused_state_pass_walk_reference`, in place) over the augmented values
    [0 | v] from [0 ; h0t[sequence]] (first pieces) or [I | 0] (later pieces)."""
    kdim = k.shape[3]
    hv, vdim = v.shape[2], v.shape[3]
    e = walk.shape[0]
    v_aug = jnp.concatenate([jnp.zeros(v.shape[:3] + (kdim,), v.dtype), v], axis=-1)        # [1, T, Hv, K + V]
    eye_t = jnp.concatenate([jnp.eye(kdim, dtype=F32), jnp.zeros((vdim, kdim), F32)], axis=0)  # [I | 0]^T
    h0_rows = (jnp.zeros((e, hv, vdim, kdim), F32) if h0t is None
               else jnp.take(h0t.astype(F32), walk[:, 5], axis=0))
    from_h0 = jnp.concatenate([jnp.zeros((e, hv, kdim, kdim), F32), h0_rows], axis=2)
    starts = jnp.where((walk[:, 4] == 1)[:, None, None, None], from_h0, eye_t)
    # the twin's in-place table: (c0, count, state row, first token, length, first packed row / 8); the length
    # only bounds the rows kept, and no mapped piece reaches its sequence's end
    twin = jnp.stack([walk[:, 0], walk[:, 1], jnp.arange(e, dtype=jnp.int32), walk[:, 3],
                      jnp.full((e,), k.shape[1], jnp.int32), walk[:, 2]], axis=-1)
    _, maps_t = fused_state_pass_walk_reference(k, k, v_aug, t, gcum, beta_c, starts, twin, num_states=e,
                                                scale=1.0, out_final=True, head_major=True, exp2=exp2,
                                                in_place=True)
    return maps_t


def reads_in_place(reads: str, stage1a: str, lanes: int, total_len: int) -> bool:
    """Whether a call with these choices reads the packed row in place (``VarlenConfig.reads``): only with
    stage1a "mosaic", no lanes and a multiple of 8 tokens; otherwise it is repacked."""
    return reads == "in_place" and stage1a == "mosaic" and lanes == 0 and total_len % ALIGN == 0


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "impl", "stage1a", "order",
                                             "states", "lanes", "copies", "kkt_used", "reads", "wide",
                                             "solve", "split", "single_dense", "cond_min_tokens"))
def chunk_gated_delta_rule_varlen_fwd(q, k, v, g, beta, cu_seqlens, initial_state=None, *, scale=None,
                                      output_final_state=True, impl: str = "mosaic", stage1a: str = "mosaic",
                                      order: str = "longest_first", states: str = "kv",
                                      lanes: int = 0, copies: str = "xla", kkt_used: bool = False,
                                      reads: str = "repacked", wide=False, solve: bool = False,
                                      split: int = 0, single_dense: bool = False, cond_min_tokens: int = 0):
    """Packed-sequence forward: repack, stage 1a, the walked fused pass, unpack (module docstring); with
    ``reads="in_place"`` (where :func:`reads_in_place`) the packed row is read and written where it lies.

    q, k [1, T, Hk, K]; v [1, T, Hv, V] (mosaic: one of bf16 / fp16, K, V in {64, 128}); g [1, T, Hv] fp32
    log-decay; beta [1, T, Hv]; cu_seqlens [N + 1] int32 (cu_seqlens[N] <= T; zero-length sequences allowed);
    initial_state [N, Hv, K, V] fp32 or None. Returns (o [1, T, Hv, V] in v's dtype, zero at index >=
    cu_seqlens[N]; final_state [N, Hv, K, V] fp32 or None). ``impl="reference"``: the jnp twins (any platform).
    ``stage1a``, ``order``, ``states``, ``lanes``, ``copies``, ``kkt_used``, ``reads``, ``wide``, ``solve``,
    ``split``, ``single_dense``, ``cond_min_tokens``: as :class:`VarlenConfig` (the Triton copies run in interpret
    mode with ``impl="reference"``; here ``cond_min_tokens`` defaults to 0: the choices as asked, in any call).
    """
    if impl not in ("mosaic", "reference"):
        raise ValueError(f"impl must be 'mosaic' or 'reference'; got {impl!r}")
    VarlenConfig(stage1a=stage1a, order=order, states=states, lanes=lanes, copies=copies, kkt_used=kkt_used,
                 reads=reads, wide=wide, solve=solve, split=split, single_dense=single_dense,
                 cond_min_tokens=cond_min_tokens)
    if q.shape[0] != 1:
        raise ValueError(f"mosaic_gpu varlen: q must be one packed row [1, T, Hk, K]; got q {q.shape}")
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"mosaic_gpu varlen: cu_seqlens must be [N + 1] with N >= 1; got {cu.shape}")
    n = cu.shape[0] - 1
    kernel = impl == "mosaic"
    mg.check_supported(q, k, v, g, beta, None, kernel=kernel)
    _, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    if initial_state is not None and initial_state.shape != (n, hv, kdim, vdim):
        raise ValueError(f"mosaic_gpu varlen: initial_state must be [N, Hv, K, V] = {(n, hv, kdim, vdim)}; "
                         f"got {initial_state.shape}")
    scale = kdim ** -0.5 if scale is None else float(scale)
    opts = dict(scale=scale, output_final_state=output_final_state, impl=impl, stage1a=stage1a, order=order,
                states=states, lanes=lanes, copies=copies, kkt_used=kkt_used, reads=reads, wide=wide, solve=solve,
                split=split)

    def again(**changed):    # this call with some choices resolved (single_dense off: its cond is taken)
        return chunk_gated_delta_rule_varlen_fwd(q, k, v, g, beta, cu, initial_state, **{**opts, **changed})
    if t < cond_min_tokens:          # a short call: the choices from shapes, no lax.cond (a host wait on a GPU)
        single_dense, wide = False, "auto" if wide == "per_call" else wide
    if single_dense and n == 1:      # one sequence over the whole row: the dense op, else the packed path
        def dense():
            return mg.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state, scale=scale,
                                                 output_final_state=output_final_state, impl=impl,
                                                 **mg.DEFAULT_CONFIG.options())
        return lax.cond((cu[0] == 0) & (cu[1] == t), dense, again)
    wide_ok = stage1a == "mosaic" and lanes == 0           # what the wide pass needs besides its shapes
    if wide == "per_call":   # where "auto" runs wide, both passes under a cond on the call's lengths
        if wide_ok and mg.wide_pass("auto", n, hv, vdim):
            return lax.cond(wide_pays(cu, hv, vdim), lambda: again(wide=True), lambda: again(wide=False))
        wide = False
    wide = wide_ok and mg.wide_pass(wide, n, hv, vdim)
    solve = bool(solve) and wide and kernel
    if reads_in_place(reads, stage1a, lanes, t):
        return _varlen_in_place(q, k, v, g, beta, cu, initial_state, scale=scale, out_final=output_final_state,
                                kernel=kernel, order=order, state_kv=states == "kv", kkt_used=kkt_used, wide=wide,
                                solve=solve, split=split)
    cm, src, keep, back, valid, walk = layout(cu, t, order=order)
    cp = dict(copies=copies, chunks=chunk_rows(cm, src.shape[0] // C), interpret=not kernel)
    *qkv, g_r, b_r = repack_all((q, k, v, g.astype(F32), beta.astype(F32)), src, keep, **cp)
    qkv = tuple(qkv)
    k_r = qkv[1]
    state_kv = states == "kv"
    h0t = (None if initial_state is None else initial_state.astype(F32) if state_kv
           else jnp.swapaxes(initial_state.astype(F32), -1, -2))
    tmat, gcum, beta_c, head_major = stage1a_operands(k_r, g_r, b_r, kernel=kernel, stage1a=stage1a, vdim=vdim,
                                                      packed=(k[0], g[0], beta[0]), chunk_map=cm,
                                                      num_chunks=used_chunks(cm) if kkt_used else None,
                                                      solve=solve)
    ops_ = qkv + (tmat, gcum, beta_c, h0t)
    n_lanes = num_lanes(lanes, n, hv, vdim)
    rows = None
    if n_lanes:
        walk, rows = lane_table(walk, n_lanes)
    if kernel:
        o_r, ht = mg.fused_state_pass(*ops_, scale=scale, out_final=output_final_state, head_major=head_major,
                                      walk=walk, num_states=n, state_kv=state_kv, lane_rows=rows, wide=wide,
                                      solve=solve)
    else:
        o_r, ht = fused_state_pass_walk_reference(*ops_, walk, num_states=n, scale=scale,
                                                  out_final=output_final_state, head_major=head_major,
                                                  state_kv=state_kv, lane_rows=rows)
    o = unpack(o_r, back, valid, end=cu[-1:], total_len=t, **cp).astype(v.dtype)
    return o, (None if ht is None else ht if state_kv else jnp.swapaxes(ht, -1, -2))


def _varlen_in_place(q, k, v, g, beta, cu, initial_state, *, scale: float, out_final: bool, kernel: bool,
                     order: str, state_kv: bool, kkt_used: bool, wide: bool = False, solve: bool = False,
                     split: int = 0):
    """The in-place form of :func:`chunk_gated_delta_rule_varlen_fwd` (checked there): g and beta gathered to the
    chunk-slot row (zero outside each chunk's own rows), kkt_fwd and the fused pass reading q, k, v in the packed
    row, o stored there with its edges merged; with ``split`` (narrow pass, :func:`split_rows` > 0) the long
    sequences cut into pieces (:func:`split_plan`) whose start states the map pass and the scan give."""
    from pallas_kernels.gated_delta_rule.reference import floor_log_decay
    t = q.shape[1]
    n = cu.shape[0] - 1
    hv = v.shape[2]
    ac, walk, groups = in_place_layout(cu, t, order=order)
    nc = ac.tile0.shape[0]
    tp = nc * C
    g_r, b_r = (gather_rows(x[0].astype(F32), ac.src, ac.keep) for x in (g, beta))    # [Tp, Hv]
    gcum = jnp.cumsum(floor_log_decay(g_r).T.reshape(hv, nc, C), axis=-1).reshape(1, hv, tp)
    beta_hm = b_r.T[None]                                                             # [1, Hv, Tp]
    num_chunks = jnp.sum(ac.seq_num_chunks, dtype=jnp.int32).reshape(1) if kkt_used else None
    if kernel and solve:     # the wide fused pass forms T0 itself
        t0 = None
    elif kernel:
        rows = jnp.stack([ac.tile0 // ALIGN, ac.lo, ac.hi], axis=-1).astype(jnp.int32)
        t0 = mg.kkt_fwd(k, beta_hm, heads=hv, num_chunks=num_chunks, chunk_rows=rows)
    else:
        t0 = mg.kkt_fwd_reference(gather_rows(k[0], ac.src, ac.keep)[None], beta_hm, heads=hv)
    extra = 0 if wide else split_rows(n, nc, hv, v.shape[3], split)    # (solve, where T0 is None, is wide only)
    states = None if initial_state is None else initial_state.astype(F32)
    rows, num_states = walk, n
    if extra:                # the packed split: pieces walked side by side from mapped start states
        from pallas_kernels.gated_delta_rule.mosaic_gpu import split as sp
        plan = split_plan(ac, cu, extra, heads=hv, value_dim=v.shape[3], min_chunks=split)
        h0_vk = None if states is None else jnp.swapaxes(states, -1, -2)
        map_fn = sp.state_map_pass_walk if kernel else state_map_pass_walk_reference
        maps_t = map_fn(k, v, t0, gcum, beta_hm, plan.maps, h0t=h0_vk)
        states = split_start_states(plan, maps_t, states)                             # [R, Hv, K, V]
        rows, num_states = plan.walk, plan.walk.shape[0]
    h0t = None if states is None else states if state_kv else jnp.swapaxes(states, -1, -2)
    ops_ = (q, k, v, t0, gcum, beta_hm, h0t)
    if kernel:
        o, edges, ht = mg.fused_state_pass(*ops_, scale=scale, out_final=out_final, head_major=True, walk=rows,
                                           num_states=num_states, state_kv=state_kv, in_place=True, wide=wide,
                                           solve=solve)
        edges = edges[:2 * n]
    else:
        o_r, ht = fused_state_pass_walk_reference(*ops_, rows[:, :6], num_states=num_states, scale=scale,
                                                  out_final=out_final, head_major=True, state_kv=state_kv,
                                                  in_place=True)
        o, edges = in_place_stores_reference(o_r, ac, walk, t)
    if extra and ht is not None:
        ht = jnp.take(ht, plan.last_row, axis=0)
    o = merge_edges(o, edges, groups, cu[-1:], kernel=True, interpret=not kernel).astype(v.dtype)
    return o, (None if ht is None else ht if state_kv else jnp.swapaxes(ht, -1, -2))


# ---------------------------------------------------------------------------------------------------------------
# the op's backend "mosaic_gpu" for cu_seqlens and the slot pool (api.py routes here)
# ---------------------------------------------------------------------------------------------------------------
def op_fwd(q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool, cu_seqlens,
           config: VarlenConfig = None):
    """``chunk_gated_delta_rule(..., cu_seqlens=...)`` on "mosaic_gpu" (api.py has checked the arguments and
    ``chunk.fallback_reason``). Returns (o [1, T, Hv, V] in v's dtype, final_state [N, Hv, K, V] fp32 or
    None). jax.grad / jax.jvp raise NotImplementedError naming backend='xla'."""
    from pallas_kernels.gated_delta_rule.triton.chunk import no_autodiff
    cfg = config or DEFAULT_CONFIG

    def run(q, k, v, g, beta, cu, *h0):
        return chunk_gated_delta_rule_varlen_fwd(
            q, k, v, g.astype(F32), beta, cu, h0[0] if h0 else None, scale=float(scale),
            output_final_state=output_final_state, impl="mosaic", stage1a=cfg.stage1a, order=cfg.order,
            states=cfg.states, lanes=cfg.lanes, copies=cfg.copies, kkt_used=cfg.kkt_used, reads=cfg.reads,
            wide=cfg.wide, solve=cfg.solve, split=cfg.split, single_dense=cfg.single_dense,
            cond_min_tokens=cfg.cond_min_tokens)
    h0 = () if initial_state is None else (initial_state.astype(F32),)
    return no_autodiff(run)(q, k, v, g, beta, jnp.asarray(cu_seqlens, jnp.int32), *h0)


def op_fwd_slots(q, k, v, g, beta, *, scale: float, ssm_state, slot_ids, has_initial_state, cu_seqlens=None,
                 config: VarlenConfig = None, impl: str = "mosaic"):
    """``chunk_gated_delta_rule_slots`` on "mosaic_gpu": the start states gathered from the pool (zeros where
    has_initial_state is False or the id is outside [0, S)), the packed (``cu_seqlens``) or dense call, the final
    states scattered back (an id outside [0, S) drops its write). Returns (o [B, T, Hv, V], new pool [S, Hv, K, V]
    fp32). The dense call (no ``cu_seqlens``) is the dense op's own (:func:`chunk.op_fwd` with its
    ``DEFAULT_CONFIG``: exp2, state_kv, the split policy); ``config`` applies to packed calls. ``impl="reference"``:
    the jnp twins (CPU tests)."""
    from pallas_kernels.gated_delta_rule.triton.chunk import no_autodiff
    cfg = config or DEFAULT_CONFIG
    h0 = gather_slots(ssm_state.astype(F32), slot_ids, has_initial_state)               # [N, Hv, K, V]
    if cu_seqlens is None and impl == "mosaic":
        o, ht = mg.op_fwd(q, k, v, g, beta, scale=float(scale), initial_state=h0, output_final_state=True)
        return o, scatter_slots(ssm_state, slot_ids, ht)

    def run(q, k, v, g, beta, h0, *cu):
        if cu:
            return chunk_gated_delta_rule_varlen_fwd(q, k, v, g.astype(F32), beta, cu[0], h0, scale=float(scale),
                                                     output_final_state=True, impl=impl, stage1a=cfg.stage1a,
                                                     order=cfg.order, states=cfg.states,
                                                     lanes=cfg.lanes, copies=cfg.copies, kkt_used=cfg.kkt_used,
                                                     reads=cfg.reads, wide=cfg.wide, solve=cfg.solve,
                                                     split=cfg.split, single_dense=cfg.single_dense,
                                                     cond_min_tokens=cfg.cond_min_tokens)
        return mg.chunk_gated_delta_rule_fwd(q, k, v, g.astype(F32), beta, h0, scale=float(scale),
                                             output_final_state=True, impl=impl, stage1a=cfg.stage1a)
    cu = () if cu_seqlens is None else (jnp.asarray(cu_seqlens, jnp.int32),)
    o, ht = no_autodiff(run)(q, k, v, g, beta, h0, *cu)
    return o, scatter_slots(ssm_state, slot_ids, ht)
