"""The one chunk map of the gated delta rule: which chunk of C tokens covers which tokens of which sequence.

Used by every backend (the XLA chunked form in ``reference.py``, the Pallas kernels in ``gated_delta_rule/triton/chunk.py``) and
re-exported by ``jax_gdn.ops.varlen``. Also the packing helpers the ops share: ``token_streams`` (stream of each
packed token) and the slot-pool gather / scatter of the padding contract.

Varlen (``cu_seqlens``) packing is mapped on the device, with a static bound and no host sync.

A sequence of length L is cut into ceil(L / C) chunks that start at its first token, so no chunk ever mixes two
sequences. The total number of chunks is at most ``T // C + N`` (sum of ceil(L_i / C) <= sum floor(L_i / C) + N),
a static bound: one compiled program serves any lengths with the same T and N. Chunk slots past the real count
are padding (``chunk_len == 0``).

Padding contract: tokens at index >= cu_seqlens[N] are padding (they belong to no stream and to no chunk);
zero-length streams have no chunks; a slot id outside [0, S) names no slot (``gather_slots`` reads zeros for it,
``scatter_slots`` drops its write).

Shape legend: T packed tokens, N sequences, S slots, C chunk size, NC = T // C + N chunk slots.
"""
from __future__ import annotations

from typing import NamedTuple

import math

import jax
import jax.numpy as jnp
import numpy as np


class ChunkMap(NamedTuple):
    """Where each chunk lives in the packed token axis.

    chunk_seq:   [NC] int32  sequence of each chunk (clamped to N - 1 for padding chunks)
    chunk_start: [NC] int32  first token of each chunk in [0, T) (clamped for padding chunks)
    chunk_len:   [NC] int32  valid tokens in each chunk, 1..C (0 for padding chunks)
    chunk_first: [NC] bool   first chunk of its sequence
    chunk_last:  [NC] bool   last chunk of its sequence
    seq_first_chunk: [N] int32  index of each sequence's first chunk
    seq_num_chunks:  [N] int32  ceil(L / C); 0 for an empty sequence (its final state is its initial state)
    token_chunk:  [T] int32  chunk holding each token
    token_offset: [T] int32  position of each token inside its chunk
    """

    chunk_seq: jax.Array
    chunk_start: jax.Array
    chunk_len: jax.Array
    chunk_first: jax.Array
    chunk_last: jax.Array
    seq_first_chunk: jax.Array
    seq_num_chunks: jax.Array
    token_chunk: jax.Array
    token_offset: jax.Array


def count_le(ends: jax.Array, size: int) -> jax.Array:
    """[size] int32: for each i in [0, size), how many entries of the non-decreasing int array ``ends`` are <= i
    (``jnp.searchsorted(ends, arange(size), side="right")``), as one scatter-add and one cumsum: no loop, where
    searchsorted's binary search is a while loop of log2(len(ends)) steps (a serial chain of small kernels on
    the GPU)."""
    ends = jnp.asarray(ends).astype(jnp.int32)
    marks = jnp.zeros((size + 1,), jnp.int32).at[jnp.clip(ends, 0, size)].add(1)
    return jnp.cumsum(marks[:size], dtype=jnp.int32)


def token_streams(cu_seqlens: jax.Array, total_len: int) -> tuple[jax.Array, jax.Array]:
    """Per token of a packed row: (stream [T] int32, position inside its stream [T] int32).

    Tokens past cu_seqlens[N] (padding) are given to the last stream; callers mask them with ``t < cu_seqlens[N]``.
    """
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    t = jnp.arange(total_len, dtype=jnp.int32)
    stream = jnp.clip(count_le(cu, total_len) - 1, 0, n - 1)      # searchsorted(cu, t, "right") - 1
    return stream, t - cu[stream]


def slot_mask(slot_ids: jax.Array, num_slots: int) -> jax.Array:
    """[N] bool: which ids name a slot of the pool (0 <= id < S). Any other id (negative, >= S, a bad traced
    value) means "no slot": the stream starts from zeros and its write is dropped (never wrapped, never clamped)."""
    ids = jnp.asarray(slot_ids).astype(jnp.int32)
    return (ids >= 0) & (ids < num_slots)


def gather_slots(pool: jax.Array, slot_ids: jax.Array, has_initial_state: jax.Array) -> jax.Array:
    """Start states [N, ...] from pool [S, ...]: pool[slot_ids[n]], zeros where has_initial_state[n] is False or
    the id names no slot (a NaN-safe select, never a multiply)."""
    pool, slot_ids = jnp.asarray(pool), jnp.asarray(slot_ids)
    ok = slot_mask(slot_ids, pool.shape[0])
    safe = jnp.clip(slot_ids.astype(jnp.int32), 0, pool.shape[0] - 1)
    ok = ok & jnp.asarray(has_initial_state).astype(bool)
    return jnp.where(ok.reshape((-1,) + (1,) * (pool.ndim - 1)), pool[safe], jnp.zeros((), pool.dtype))


def scatter_slots(pool: jax.Array, slot_ids: jax.Array, values: jax.Array) -> jax.Array:
    """pool with pool[slot_ids[n]] = values[n] for the ids that name a slot; writes of other ids are dropped."""
    pool = jnp.asarray(pool)
    s = pool.shape[0]
    ids = jnp.where(slot_mask(slot_ids, s), jnp.asarray(slot_ids).astype(jnp.int32), s)   # S: dropped
    return pool.at[ids].set(jnp.asarray(values).astype(pool.dtype), mode="drop")


def max_chunks(total_len: int, num_seqs: int, chunk_size: int) -> int:
    """Static bound on the number of chunks of any packing of ``num_seqs`` sequences into ``total_len`` tokens."""
    return total_len // chunk_size + num_seqs


def build_chunk_map(cu_seqlens: jax.Array, total_len: int, chunk_size: int = 64) -> ChunkMap:
    """Builds the chunk map on the device from ``cu_seqlens [N + 1]`` (traceable; T and N are static)."""
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    nc = max_chunks(total_len, n, chunk_size)
    lens = cu[1:] - cu[:-1]                                     # [N]
    seq_num_chunks = (lens + chunk_size - 1) // chunk_size      # [N]
    chunk_end = jnp.cumsum(seq_num_chunks)                      # [N] exclusive end chunk of each sequence
    seq_first_chunk = chunk_end - seq_num_chunks                # [N]

    c = jnp.arange(nc, dtype=jnp.int32)
    valid = c < chunk_end[-1]
    seq = jnp.minimum(count_le(chunk_end, nc), n - 1)          # searchsorted(chunk_end, c, "right")
    j = c - seq_first_chunk[seq]                                # chunk index inside its sequence
    start = cu[seq] + j * chunk_size
    length = jnp.where(valid, jnp.clip(cu[seq + 1] - start, 0, chunk_size), 0)
    start = jnp.where(valid, start, 0)
    first = valid & (j == 0)
    last = valid & (j == seq_num_chunks[seq] - 1)

    tok_seq, rel = token_streams(cu, total_len)
    token_chunk = seq_first_chunk[tok_seq] + rel // chunk_size
    token_offset = rel % chunk_size
    return ChunkMap(seq, start, length, first, last, seq_first_chunk, seq_num_chunks,
                    token_chunk, token_offset)


class AlignedChunks(NamedTuple):
    """Chunks on a grid aligned to ``align`` rows (for kernels that read the packed tokens where they lie, by
    copies whose row offsets must be multiples of ``align``): sequence n's chunks start at row0[n] = cu[n] rounded
    down to a multiple of ``align``, so chunk j of it is packed rows [row0 + j C, row0 + j C + C), of which only
    [lo, hi) are its own (the leading rows belong to earlier sequences, the trailing ones to later sequences or to
    padding, or lie past T).

    row0, seq_first_chunk, seq_num_chunks: [N] int32 (0 chunks for an empty sequence);
    tile0, lo, hi: [NC] int32 per chunk slot (0, 0, 0 for unused slots);
    src, keep: [NC C] the packed row of each chunk-slot row and whether it is the chunk's own token.
    """
    row0: jax.Array
    seq_first_chunk: jax.Array
    seq_num_chunks: jax.Array
    tile0: jax.Array
    lo: jax.Array
    hi: jax.Array
    src: jax.Array
    keep: jax.Array


def max_aligned_chunks(total_len: int, num_seqs: int, chunk_size: int, align: int) -> int:
    """Static bound on the chunk count of :func:`build_aligned_chunks`: a sequence of L tokens starting up to
    align - 1 rows past its grid point takes ceil((L + align - 1) / C) <= (L + align - 1 + C - 1) / C chunks."""
    return -(-(total_len + num_seqs * (align + chunk_size - 2)) // chunk_size)


def build_aligned_chunks(cu_seqlens: jax.Array, total_len: int, chunk_size: int = 64, *, align: int = 8,
                         num_slots: int | None = None) -> AlignedChunks:
    """The :class:`AlignedChunks` of ``cu_seqlens [N + 1]`` on the device (traceable; T, N and the slot count
    static; ``num_slots`` >= :func:`max_aligned_chunks`, default that bound)."""
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    nc = max_aligned_chunks(total_len, n, chunk_size, align) if num_slots is None else num_slots
    start, end = cu[:-1], cu[1:]
    row0 = start // align * align
    count = jnp.where(end > start, (end - row0 + chunk_size - 1) // chunk_size, 0)
    chunk_end = jnp.cumsum(count)
    first = chunk_end - count
    c = jnp.arange(nc, dtype=jnp.int32)
    used = c < chunk_end[-1]
    seq = jnp.minimum(count_le(chunk_end, nc), n - 1)
    tile0 = row0[seq] + (c - first[seq]) * chunk_size
    lo = jnp.where(used, jnp.clip(start[seq] - tile0, 0, chunk_size), 0)
    hi = jnp.where(used, jnp.clip(end[seq] - tile0, 0, chunk_size), 0)
    tile0 = jnp.where(used, tile0, 0)
    i = jnp.arange(chunk_size, dtype=jnp.int32)
    keep = (i[None, :] >= lo[:, None]) & (i[None, :] < hi[:, None])
    src = jnp.where(keep, tile0[:, None] + i[None, :], 0)
    return AlignedChunks(row0, first.astype(jnp.int32), count.astype(jnp.int32), tile0, lo, hi,
                         src.reshape(-1), keep.reshape(-1))


def dense_cu_seqlens(batch: int, seq_len: int) -> jax.Array:
    """cu_seqlens of ``batch`` equal-length sequences laid end to end: [0, T, 2T, ..., B*T]."""
    return jnp.arange(batch + 1, dtype=jnp.int32) * seq_len


def dense_chunk_map(batch: int, seq_len: int, chunk_size: int = 64):
    """Static chunk map (NumPy constants) of ``batch`` sequences of ``seq_len`` tokens laid end to end:
    (chunk_start [NC], chunk_len [NC], seq_first_chunk [B], seq_num_chunks [B]) int32 with NC = B ceil(T / C)
    (one padding chunk of length 0 when that is 0, so that a grid over chunks is never empty)."""
    per = math.ceil(seq_len / chunk_size) if seq_len > 0 else 0
    j = np.arange(per)
    start = (np.arange(batch)[:, None] * seq_len + j[None, :] * chunk_size).reshape(-1)
    length = np.broadcast_to(np.minimum(chunk_size, seq_len - j * chunk_size), (batch, per)).reshape(-1)
    first = np.arange(batch) * per
    num = np.full((batch,), per)
    if start.size == 0:
        start, length = np.zeros(1), np.zeros(1)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    return i32(start), i32(length), i32(first), i32(num)


def launch_order(seq_num_chunks: jax.Array) -> jax.Array:
    """[N] int32: the sequences by decreasing chunk count (ties in index order), the order in which the state pass
    launches them: the longest serial loops start first and the short ones fill in behind them."""
    return jnp.argsort(-jnp.asarray(seq_num_chunks).astype(jnp.int32), stable=True).astype(jnp.int32)


def kernel_chunk_map(batch: int, seq_len: int, cu_seqlens, chunk_size: int = 64, chunk_map: ChunkMap = None):
    """The four arrays the Pallas kernels read, (chunk_start [NC], chunk_len [NC], seq_first_chunk [N],
    seq_num_chunks [N]) int32: ``dense_chunk_map`` without cu_seqlens, else from ``chunk_map`` (built here with
    ``build_chunk_map`` when None)."""
    if cu_seqlens is None:
        return dense_chunk_map(batch, seq_len, chunk_size)
    if chunk_map is None:
        chunk_map = build_chunk_map(cu_seqlens, seq_len, chunk_size)
    return tuple(x.astype(jnp.int32) for x in (chunk_map.chunk_start, chunk_map.chunk_len,
                                               chunk_map.seq_first_chunk, chunk_map.seq_num_chunks))
