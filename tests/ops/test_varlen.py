"""jax_gdn.ops.varlen.build_chunk_map against a plain Python construction of the same map."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops.varlen import build_chunk_map, dense_cu_seqlens, max_chunks


def python_chunk_map(lengths, chunk_size):
    """Chunks of each sequence in order: (seq, start, len, first, last); per token: (chunk, offset)."""
    chunks, token_chunk, token_offset, seq_first, seq_num = [], [], [], [], []
    start = 0
    for n, length in enumerate(lengths):
        m = -(-length // chunk_size)
        seq_first.append(len(chunks))
        seq_num.append(m)
        for j in range(m):
            c_len = min(chunk_size, length - j * chunk_size)
            for i in range(c_len):
                token_chunk.append(len(chunks))
                token_offset.append(i)
            chunks.append((n, start + j * chunk_size, c_len, j == 0, j == m - 1))
        start += length
    return chunks, token_chunk, token_offset, seq_first, seq_num


CASES = [
    ([63, 0, 65, 1, 71], 64),
    ([0, 0, 130], 64),
    ([130, 0, 0], 64),
    ([1] * 7, 4),
    ([8, 8, 8], 4),
    ([5, 0, 3, 9, 0], 4),
]


@pytest.mark.parametrize("lengths,chunk_size", CASES)
def test_build_chunk_map_matches_python(lengths, chunk_size):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t, n = int(cu[-1]), len(lengths)
    build = jax.jit(build_chunk_map, static_argnums=(1, 2))
    cmap = jax.tree.map(np.asarray, build(jnp.asarray(cu), t, chunk_size))
    chunks, token_chunk, token_offset, seq_first, seq_num = python_chunk_map(lengths, chunk_size)
    nc = max_chunks(t, n, chunk_size)
    assert len(chunks) <= nc and cmap.chunk_seq.shape == (nc,)
    real = len(chunks)
    np.testing.assert_array_equal(cmap.chunk_seq[:real], [c[0] for c in chunks])
    np.testing.assert_array_equal(cmap.chunk_start[:real], [c[1] for c in chunks])
    np.testing.assert_array_equal(cmap.chunk_len[:real], [c[2] for c in chunks])
    np.testing.assert_array_equal(cmap.chunk_first[:real], [c[3] for c in chunks])
    np.testing.assert_array_equal(cmap.chunk_last[:real], [c[4] for c in chunks])
    # padding chunk slots: empty, never first or last, indices in range
    assert (cmap.chunk_len[real:] == 0).all()
    assert not cmap.chunk_first[real:].any() and not cmap.chunk_last[real:].any()
    assert ((cmap.chunk_seq >= 0) & (cmap.chunk_seq < n)).all()
    assert ((cmap.chunk_start >= 0) & (cmap.chunk_start < max(t, 1))).all()
    np.testing.assert_array_equal(cmap.seq_num_chunks, seq_num)
    nonempty = np.asarray(lengths) > 0
    np.testing.assert_array_equal(cmap.seq_first_chunk[nonempty], np.asarray(seq_first)[nonempty])
    np.testing.assert_array_equal(cmap.token_chunk, token_chunk)
    np.testing.assert_array_equal(cmap.token_offset, token_offset)


def test_build_chunk_map_is_traceable_without_retrace():
    traces = []

    @jax.jit
    def f(cu):
        traces.append(1)
        return build_chunk_map(cu, 20, 4)

    for lengths in ([5, 0, 15], [20, 0, 0], [1, 1, 18]):
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        cmap = f(jnp.asarray(cu))
        _, token_chunk, token_offset, _, _ = python_chunk_map(lengths, 4)
        np.testing.assert_array_equal(cmap.token_chunk, token_chunk)
        np.testing.assert_array_equal(cmap.token_offset, token_offset)
    assert len(traces) == 1


def test_dense_cu_seqlens():
    np.testing.assert_array_equal(dense_cu_seqlens(3, 5), [0, 5, 10, 15])
    assert dense_cu_seqlens(3, 5).dtype == jnp.int32


def test_count_le_equals_searchsorted_and_launch_order():
    """count_le (the loop-free lookup of build_chunk_map / token_streams) is searchsorted(side="right") on
    non-decreasing ends with repeats, zeros and ends past the range; launch_order puts the longest first, ties in
    index order."""
    from pallas_kernels.gated_delta_rule.chunk_map import count_le, launch_order
    rng = np.random.default_rng(5)
    for size in (1, 7, 64, 130):
        ends = np.sort(rng.integers(0, size + 5, rng.integers(1, 12))).astype(np.int32)
        got = np.asarray(jax.jit(count_le, static_argnums=1)(jnp.asarray(ends), size))
        np.testing.assert_array_equal(got, np.searchsorted(ends, np.arange(size), side="right"))
    np.testing.assert_array_equal(launch_order(jnp.array([1, 3, 0, 3, 2])), [1, 3, 4, 0, 2])
