"""The Mosaic varlen path's row copies as Pallas Triton kernels (``mosaic_gpu.varlen.VarlenConfig.copies``): the
repack of the packed row to chunk-aligned rows and the unpack of the output back, each one launch at HBM speed
where the XLA gathers they replace (``mosaic_gpu.varlen.gather_rows``) run one gather fusion per array.

Both walk the chunk map (``chunk_map.build_chunk_map``): chunk c covers packed tokens
[chunk_start[c], chunk_start[c] + chunk_len[c]) and repacked rows [c C, c C + chunk_len[c]); chunk slots past the
real count have length 0. A chunk's rows are contiguous on both sides, so every copy is a [C, BD] tile at a
dynamic row offset with a row mask (no per-element index):

  * :func:`repack_rows`: grid (NCp, column blocks of all arrays): program (c, j) loads rows
    [chunk_start[c], + C) of its array's column block j, masked to the chunk's length (masked rows read nothing:
    padding tokens, NaN or not, and the next sequence's tokens never reach the tile) and stores the tile, zeros
    past the length, to rows [c C, c C + C): bitwise what the XLA gather with a select gives on every chunk in
    use. The unused chunk slots (length 0, after the used ones) are left unset: the walked fused pass never reads
    them and what stage 1a makes of them is never read either (serve256: 132 of 864 slots, ~140 MB of writes).
  * :func:`unpack_rows`: grid (NCp + ceil(T / C), column blocks): program c < NCp stores rows [c C, c C + len) of
    its chunk to packed rows [chunk_start[c], + len) (each packed token t < cu_seqlens[N] belongs to exactly one
    chunk); program NCp + b stores zeros to the rows of block b at index >= cu_seqlens[N] (padding). Every packed
    row is written once.

The in-place path (``VarlenConfig.reads="in_place"``) needs neither copy, only :func:`merge_edge_rows`: grid
(G edge groups + ceil(T / 64) blocks, column blocks); program e < G stores rows [lo, hi) of edge group e's 8 rows
to packed rows row[e] + i, program G + b zeros the rows of block b at index >= cu_seqlens[N], o aliased.

Interpret mode (CPU tests) clamps dynamic slices at the array's end, so there the packed side is padded by C rows
(as ``triton/chunk.py`` does); on the GPU the masks keep every access inside the arrays.

Shape legend: T packed tokens, D columns of one array (H x head dim, or H for g / beta), C = 64 chunk,
NCp chunk slots of the repacked row (>= T // C + N), BD columns per program (a power of two).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TILE_BYTES = 512        # bytes of one row of a program's tile: [C, 256] bf16 / [C, 128] fp32, 4 warps
NUM_WARPS = 4


def column_block(d: int, itemsize: int, tile_bytes: int = TILE_BYTES) -> int:
    """BD: the largest power of two dividing ``d`` and at most ``tile_bytes`` / itemsize columns."""
    return min(tile_bytes // itemsize, d & -d)


def _blocks(xs, tile_bytes):
    """[(first program column, end, BD)] per array: the arrays' column blocks laid side by side on grid axis 1."""
    out, lo = [], 0
    for x in xs:
        bd = column_block(x.shape[1], jnp.dtype(x.dtype).itemsize, tile_bytes)
        out.append((lo, lo + x.shape[1] // bd, bd))
        lo += x.shape[1] // bd
    return out


def _check(xs, name):
    for i, x in enumerate(xs):
        if x.ndim != 2 or x.shape[0] != xs[0].shape[0] or x.shape[1] < 1:
            raise ValueError(f"{name}: every array must be [T, D] with the same T and D >= 1; "
                             f"got array {i} of shape {x.shape}")


def _repack_kernel(start_ref, len_ref, *refs, blocks, chunk):
    c, j = pl.program_id(0), pl.program_id(1)      # (read outside pl.when: interpret mode needs it)
    start, length = start_ref[c], len_ref[c]
    rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    m = len(blocks)
    for a, (lo, hi, bd) in enumerate(blocks):
        @pl.when((j >= lo) & (j < hi))
        def _(a=a, lo=lo, bd=bd):
            cols = pl.ds((j - lo) * bd, bd)
            ok = jnp.broadcast_to(rows < length, (chunk, bd))
            tile = plgpu.load(refs[a].at[pl.ds(start, chunk), cols], mask=ok, other=0)

            @pl.when(length > 0)         # unused chunk slots: nothing stored (nothing may read them)
            def _():
                refs[m + a][pl.ds(c * chunk, chunk), cols] = tile


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "tile_bytes", "num_warps"))
def repack_rows(xs, chunk_start, chunk_len, *, chunk: int = 64, interpret: bool = False,
                tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS):
    """Arrays xs[i] [T, D_i] of the packed row -> [NCp C, D_i] on the chunk-aligned row, one launch.

    chunk_start, chunk_len [NCp] int32 (the chunk map, padded with zero-length slots to NCp): repacked row
    c C + i is packed row chunk_start[c] + i where i < chunk_len[c], else zeros (bitwise the XLA gather + select
    of ``mosaic_gpu.varlen.gather_rows``), except in chunk slots of length 0, which are left unset.
    ``tile_bytes`` / ``num_warps``: a program's tile row in bytes and its warps (the defaults are the module's)."""
    xs = tuple(xs)
    _check(xs, "repack_rows")
    ncp = chunk_start.shape[0]
    if interpret:
        xs = tuple(jnp.pad(x, ((0, chunk), (0, 0))) for x in xs)
    blocks = _blocks(xs, tile_bytes)
    call = pl.pallas_call(
        functools.partial(_repack_kernel, blocks=blocks, chunk=chunk),
        grid=(ncp, blocks[-1][1]),
        out_shape=tuple(jax.ShapeDtypeStruct((ncp * chunk, x.shape[1]), x.dtype) for x in xs),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="gdn_varlen_repack")
    return tuple(call(chunk_start.astype(jnp.int32), chunk_len.astype(jnp.int32), *xs))


def _unpack_kernel(start_ref, len_ref, end_ref, x_ref, y_ref, *, nchunks, chunk, bd, total):
    c, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bd, bd)
    rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)

    @pl.when(c < nchunks)
    def _chunk():
        cc = jnp.minimum(c, nchunks - 1)
        start, length = start_ref[cc], len_ref[cc]
        tile = x_ref[pl.ds(cc * chunk, chunk), cols]
        plgpu.store(y_ref.at[pl.ds(start, chunk), cols], tile,
                    mask=jnp.broadcast_to(rows < length, (chunk, bd)))

    @pl.when(c >= nchunks)
    def _padding():
        r0 = (c - nchunks) * chunk
        r = r0 + rows
        ok = jnp.broadcast_to((r >= end_ref[0]) & (r < total), (chunk, bd))
        plgpu.store(y_ref.at[pl.ds(r0, chunk), cols], jnp.zeros((chunk, bd), y_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("total_len", "chunk", "interpret", "tile_bytes", "num_warps"))
def unpack_rows(x, chunk_start, chunk_len, end, *, total_len: int, chunk: int = 64, interpret: bool = False,
                tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS):
    """x [NCp C, D] on the chunk-aligned row -> [T, D] (T = ``total_len``) on the packed row, one launch: packed
    row chunk_start[c] + i is x[c C + i] for i < chunk_len[c]; rows at index >= ``end`` (cu_seqlens[N], int32
    [1]) are zeros. chunk_start, chunk_len [NCp] int32, ``tile_bytes``, ``num_warps`` as :func:`repack_rows`."""
    _check((x,), "unpack_rows")
    ncp = chunk_start.shape[0]
    if x.shape[0] != ncp * chunk:
        raise ValueError(f"unpack_rows: x must have NCp C = {ncp * chunk} rows; got {x.shape}")
    d = x.shape[1]
    bd = column_block(d, jnp.dtype(x.dtype).itemsize, tile_bytes)
    rows_out = total_len + (chunk if interpret else 0)
    call = pl.pallas_call(
        functools.partial(_unpack_kernel, nchunks=ncp, chunk=chunk, bd=bd, total=total_len),
        grid=(ncp + -(-total_len // chunk), d // bd),
        out_shape=jax.ShapeDtypeStruct((rows_out, d), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="gdn_varlen_unpack")
    y = call(chunk_start.astype(jnp.int32), chunk_len.astype(jnp.int32),
             jnp.asarray(end, jnp.int32).reshape(1), x)
    return y[:total_len] if interpret else y


def _merge_kernel(grp_ref, lo_ref, hi_ref, end_ref, e_ref, o_in_ref, o_ref, *, groups, block, bd, total):
    p, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bd, bd)
    gg = jnp.minimum(p, groups - 1)
    r0, lo, hi = grp_ref[gg], lo_ref[gg], hi_ref[gg]
    rows8 = lax.broadcasted_iota(jnp.int32, (8, 1), 0)

    @pl.when((p < groups) & (hi > lo))
    def _edge():
        tile = e_ref[pl.ds(gg * 8, 8), cols]
        plgpu.store(o_ref.at[pl.ds(r0, 8), cols], tile, mask=jnp.broadcast_to((rows8 >= lo) & (rows8 < hi), (8, bd)))

    b = jnp.maximum(p - groups, 0)
    b0 = jnp.minimum(b * block, total - block)        # the last block ends at T (it may overlap the one before)
    rows = b0 + lax.broadcasted_iota(jnp.int32, (block, 1), 0)

    @pl.when((p >= groups) & (b0 + block > end_ref[0]))
    def _padding():
        plgpu.store(o_ref.at[pl.ds(b0, block), cols], jnp.zeros((block, bd), o_ref.dtype),
                    mask=jnp.broadcast_to(rows >= end_ref[0], (block, bd)))


@functools.partial(jax.jit, static_argnames=("interpret", "tile_bytes", "num_warps"))
def merge_edge_rows(o, edges, group_row, group_lo, group_hi, end, *, interpret: bool = False,
                    tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS):
    """The in-place Mosaic pass's o completed, in place (o aliased), one launch: o [T, D] (T a multiple of 8),
    edges [G 8, D]: rows [group_lo[e], group_hi[e]) of edge group e go to packed rows group_row[e] + i (G groups,
    int32 [G] each; an empty range stores nothing); rows at index >= ``end`` (cu_seqlens[N], int32 [1]) are
    zeroed. Grid (G + ceil(T / 64) blocks of padding rows, column blocks)."""
    _check((o,), "merge_edge_rows")
    t, d = o.shape
    if t % 8 or edges.shape != (group_row.shape[0] * 8, d):
        raise ValueError(f"merge_edge_rows: o must be [T, D] with T a multiple of 8 and edges [G 8, D]; got o "
                         f"{o.shape}, edges {edges.shape}, G = {group_row.shape[0]}")
    bd = column_block(d, jnp.dtype(o.dtype).itemsize, tile_bytes)
    block = 64 if t >= 64 else 8
    groups = group_row.shape[0]
    call = pl.pallas_call(
        functools.partial(_merge_kernel, groups=groups, block=block, bd=bd, total=t),
        grid=(groups + -(-t // block), d // bd),
        out_shape=jax.ShapeDtypeStruct(o.shape, o.dtype),
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="gdn_varlen_merge_edges")
    i32 = jnp.int32
    return call(group_row.astype(i32), group_lo.astype(i32), group_hi.astype(i32),
                jnp.asarray(end, i32).reshape(1), edges, o)
