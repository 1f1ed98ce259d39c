"""Pallas (Triton lowering) grouped-GEMM kernels of the MoE routed experts.

Two pallas_calls over the padded sorted rows of ``reference.moe_align`` (vLLM fused_moe / MegaBlocks design):

1. ``gate_up_silu``  programs (NB, I / BN) (launched column blocks fastest, see ``_grid``): row block b reads
   its expert e = block_expert[b] (E: past the live rows, the program does nothing), gathers its BM token rows
   of x (padding rows load zeros), and accumulates the gate and up column blocks [BM, BN] of x @ w_gate_up[e] in
   fp32 over D in steps of BK; the epilogue writes h = silu(gate) * up in x's dtype.
       h [Mp, I]
2. ``down_weighted`` programs (NB, D / BN): y = (h[rows] @ w_down[e]) * row_weight[rows] (fp32 accumulation over I
   in steps of BK, the routing weight fused in the epilogue); padding rows load h as zeros (whatever the buffer
   holds: NaN there never leaks) and carry weight 0.
       y [Mp, D]
The combine ``out[t] = sum_j y[row_pos[t, j]]`` (fp32) is a gather + sum in XLA (reference.combine); with
``MoeConfig.fused_combine`` kernel 2 is ``down_combined`` instead: its epilogue atomically adds the weighted rows
into an fp32 [T, D] output (no y buffer; off by default: no faster at decode sizes, not deterministic).
With ``MoeConfig.split_partial`` a row block with at most BM / 2 live rows (an expert's partial last block) runs
both kernels on a BM / 2-row tile instead (on in PREFILL_CONFIG). ``select_config`` picks the launch config from
the static shapes: the row block shrinks to 16 when there are few rows per expert (decode sizes).

Shape legend: T tokens, D hidden, I per-expert intermediate, E experts, NB row blocks, BM rows per block,
Mp = NB * BM padded rows, BN / BK column / reduction blocks.

This module imports only jax.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Launch parameters. block_m: rows per block (also the padding unit of each expert's rows); gate_up_n /
    gate_up_k: column / reduction blocks of kernel 1 (each program holds two [BM, BN] fp32 accumulators);
    down_n / down_k: the same for kernel 2; warps / stages per kernel (stages = Triton software pipelining of
    the reduction loop, cut to fit shared memory by ``fit_stages``); columns_fastest: launch order (``_grid``);
    split_partial: blocks with at most BM / 2 live rows run a BM / 2-row tile (``_live_row_tiles``);
    fused_combine: the down kernel's epilogue atomically adds routing-weighted rows into an fp32 [T, D] output
    instead of writing y [Mp, D] for an XLA combine (``down_combined``; summation order not deterministic;
    Pallas backends only: the XLA path always combines by gather + sum).
    A block larger than its dim is cut to the largest power of two dividing the dim. The defaults are the
    fastest of the H200 sweep at Qwen3-Next-80B dims, 19027 tokens (config "c6"; ``python -m benchmarks moe``);
    ``select_config`` picks smaller row blocks when there are few rows per expert (decode)."""
    block_m: int = 128
    gate_up_n: int = 128
    gate_up_k: int = 64
    gate_up_warps: int = 8
    gate_up_stages: int = 4
    down_n: int = 256
    down_k: int = 64
    down_warps: int = 8
    down_stages: int = 3
    columns_fastest: bool = True
    split_partial: bool = False      # BM / 2-row tiles for blocks at most half live (on in PREFILL_CONFIG)
    fused_combine: bool = False      # down kernel adds its weighted rows into an fp32 [T, D] output (atomics)


# Launch configs by mean rows per expert r = T k / E, from H200 sweeps at decode sizes (``python -m benchmarks moe``;
# Qwen3-Next-80B dims, r = T / 51.2). Measured routed-expert times, ms:
#   r 1.25 (T 64): 16-row 0.60, c6 0.74 | r 5 (T 256): 16-row 0.87, c6 1.04 | r 20 (T 1024): 32-row 1.00,
#   64-row 1.10, c6 1.19 | r 40 (T 2048): 64-row 1.00, c6s 1.04, 32-row 1.27 | r 80 (T 4096): c6s 1.20, 64-row
#   1.41 | r 160 (T 8192): c6s 1.69, c6 1.98. The bounds between measured points (8, 32, 48) are interpolated.
# Few rows per expert (decode): 16-row blocks, so that an expert's rows mostly fit one block and every weight tile
# is streamed once; narrower column blocks and 4 warps give more programs in flight (weight streaming).
DECODE_CONFIG = MoeConfig(block_m=16, gate_up_n=64, gate_up_k=64, gate_up_warps=4, gate_up_stages=4,
                          down_n=128, down_k=64, down_warps=4, down_stages=4)
D32_CONFIG = dataclasses.replace(DECODE_CONFIG, block_m=32)
MID_CONFIG = MoeConfig(block_m=64, gate_up_n=128, gate_up_k=64, gate_up_warps=4, gate_up_stages=4,
                       down_n=128, down_k=64, down_warps=4, down_stages=4)
# Many rows per expert (prefill): c6 + half tiles for an expert's partial last block ("c6s").
PREFILL_CONFIG = MoeConfig(split_partial=True)
# (largest r, config): the first entry whose bound holds is taken (``select_config``).
CONFIG_LADDER = ((8.0, DECODE_CONFIG), (32.0, D32_CONFIG), (48.0, MID_CONFIG), (float("inf"), PREFILL_CONFIG))


def select_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """Launch config from static shapes (trace time, never from the environment): the first CONFIG_LADDER entry
    whose bound holds the mean rows per expert T k / E."""
    rows = num_tokens * top_k / max(num_experts, 1)
    return next(cfg for bound, cfg in CONFIG_LADDER if rows <= bound)


def _grid(num_row_blocks: int, num_col_blocks: int, columns_fastest: bool):
    """Launch grid and the (row block, column block) program ids. Pallas Triton launches grid axis 0 as CUDA's
    fastest axis: columns fastest puts the column blocks of one row block side by side in time, so that its
    rows (gathered x, h) are read from HBM once and then served by L2, and neighbouring row blocks (mostly of
    one expert) share the expert's weight tiles in L2."""
    if columns_fastest:
        return (num_col_blocks, num_row_blocks), lambda: (pl.program_id(1), pl.program_id(0))
    return (num_row_blocks, num_col_blocks), lambda: (pl.program_id(0), pl.program_id(1))


def fit_block(dim: int, pref: int) -> int:
    """Largest power of two <= pref dividing dim (dim itself when dim < 16 and no power of two >= 16 divides)."""
    b = 1
    while b * 2 <= pref and dim % (b * 2) == 0:
        b *= 2
    return b if b >= 16 else dim


SMEM_BYTES = 220 * 1024   # H200: 227 KiB of shared memory per block, minus Triton's scratch


def fit_stages(stages: int, per_stage_bytes: int) -> int:
    """Pipeline depth that fits shared memory: Triton buffers (stages - 1) copies of one step's tiles."""
    return max(1, min(stages, 1 + SMEM_BYTES // per_stage_bytes))


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, precision):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _live_row_tiles(tok_ref, b, *, block_m, num_tokens, split_partial, compute):
    """Runs compute(m) for the first m rows of row block b: m = BM, or BM / 2 when split_partial and at most half
    the block's rows are live (an expert's partial last block: live rows come first, padding after), which
    halves the FLOPs spent on padding. Rows past m are left unwritten (the down kernel and the combine never read
    them: they are padding rows)."""
    if not split_partial:
        compute(block_m)
        return
    half = block_m // 2
    nlive = jnp.sum((tok_ref[pl.ds(b * block_m, block_m)] < num_tokens).astype(jnp.int32))

    @pl.when(nlive <= half)
    def _():
        compute(half)

    @pl.when(nlive > half)
    def _():
        compute(block_m)


def _gate_up_kernel(be_ref, tok_ref, x_ref, w_ref, h_ref, *, num_experts, num_tokens, block_m, bn, bk,
                    precision, pids, split_partial):
    b, n = pids()
    e = be_ref[b]
    inter = h_ref.shape[1]
    d = x_ref.shape[1]

    def compute(m):
        rows = pl.ds(b * block_m, m)
        tok = tok_ref[rows]                                                   # [m]
        valid = tok < num_tokens
        tok = jnp.where(valid, tok, 0)
        vmask = jnp.broadcast_to(valid[:, None], (m, bk))

        def body(i, acc):
            acc_g, acc_u = acc
            ks = pl.ds(i * bk, bk)
            cols = i * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            xb = plgpu.load(x_ref.at[tok[:, None], cols], mask=vmask, other=0)   # [m, BK] gathered rows
            wg = w_ref[e, ks, pl.ds(n * bn, bn)]                              # [BK, BN]
            wu = w_ref[e, ks, pl.ds(inter + n * bn, bn)]                      # [BK, BN]
            return acc_g + _dot(xb, wg, precision), acc_u + _dot(xb, wu, precision)

        zero = jnp.zeros((m, bn), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, d // bk, body, (zero, zero))
        hval = acc_g / (1.0 + jnp.exp(-acc_g)) * acc_u
        h_ref[rows, pl.ds(n * bn, bn)] = hval.astype(h_ref.dtype)

    @pl.when(e < num_experts)
    def _():
        _live_row_tiles(tok_ref, b, block_m=block_m, num_tokens=num_tokens, split_partial=split_partial,
                        compute=compute)


def _down_kernel(be_ref, tok_ref, wt_ref, h_ref, w_ref, *out_refs, num_experts, num_tokens, block_m, bn, bk,
                 precision, pids, split_partial, fused_combine, interpret):
    """out_refs: (y_ref [Mp, D],) or, fused_combine, (aliased input, out_ref fp32 [T + 1, D])."""
    b, n = pids()
    e = be_ref[b]
    inter = h_ref.shape[1]
    out_ref = out_refs[-1]

    def compute(m):
        rows = pl.ds(b * block_m, m)
        tok = tok_ref[rows]                                                   # [m]
        valid = tok < num_tokens
        vmask = jnp.broadcast_to(valid[:, None], (m, bk))

        def body(i, acc):
            ks = pl.ds(i * bk, bk)
            hb = plgpu.load(h_ref.at[rows, ks], mask=vmask, other=0)         # [m, BK]
            wd = w_ref[e, ks, pl.ds(n * bn, bn)]                              # [BK, BN]
            return acc + _dot(hb, wd, precision)

        acc = lax.fori_loop(0, inter // bk, body, jnp.zeros((m, bn), jnp.float32))
        wt = jnp.where(valid, wt_ref[rows], 0.0)                              # [m] fp32
        if fused_combine:                                                     # out[tok] += weighted rows
            # padding rows go to the spare row T (masked off on the GPU; interpret mode's atomic has no mask
            # and adds their zeros there); a block holds each token at most once, so its rows never collide
            cols = n * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
            mask = None if interpret else jnp.broadcast_to(valid[:, None], (m, bn))
            plgpu.atomic_add(out_ref, (jnp.where(valid, tok, num_tokens)[:, None], cols), acc * wt[:, None],
                             mask=mask)
        else:
            out_ref[rows, pl.ds(n * bn, bn)] = (acc * wt[:, None]).astype(out_ref.dtype)

    @pl.when(e < num_experts)
    def _():
        _live_row_tiles(tok_ref, b, block_m=block_m, num_tokens=num_tokens, split_partial=split_partial,
                        compute=compute)


def gate_up_silu(x, w_gate_up, block_expert, row_token, *, config: MoeConfig, interpret: bool):
    """Kernel 1: h [Mp, I] in x's dtype (rows of dead blocks are left unwritten)."""
    t, d = x.shape
    e, _, two_i = w_gate_up.shape
    inter = two_i // 2
    nb = block_expert.shape[0]
    bm = config.block_m
    bn, bk = fit_block(inter, config.gate_up_n), fit_block(d, config.gate_up_k)
    grid, pids = _grid(nb, inter // bn, config.columns_fastest)
    call = pl.pallas_call(
        functools.partial(_gate_up_kernel, num_experts=e, num_tokens=t, block_m=bm, bn=bn, bk=bk,
                          precision=_precision(x.dtype), pids=pids, split_partial=config.split_partial),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((nb * bm, inter), x.dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.gate_up_warps,
            num_stages=fit_stages(config.gate_up_stages, (bm * bk + 2 * bk * bn) * x.dtype.itemsize)),
        interpret=interpret, name="moe_gate_up_silu")
    return call(block_expert, row_token, x, w_gate_up)


def _down_call(h, w_down, block_expert, *, num_tokens, config, interpret, out_shape, fused, name, **kw):
    e, inter, d = w_down.shape
    nb = block_expert.shape[0]
    bm = config.block_m
    bn, bk = fit_block(d, config.down_n), fit_block(inter, config.down_k)
    grid, pids = _grid(nb, d // bn, config.columns_fastest)
    return pl.pallas_call(
        functools.partial(_down_kernel, num_experts=e, num_tokens=num_tokens, block_m=bm, bn=bn, bk=bk,
                          precision=_precision(h.dtype), pids=pids, split_partial=config.split_partial,
                          fused_combine=fused, interpret=interpret),
        grid=grid, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.down_warps,
            num_stages=fit_stages(config.down_stages, (bm * bk + bk * bn) * h.dtype.itemsize)),
        interpret=interpret, name=name, **kw)


def down_weighted(h, w_down, block_expert, row_token, row_weight, *, num_tokens: int, config: MoeConfig,
                  interpret: bool):
    """Kernel 2: y [Mp, D] = (h @ w_down[e]) * row_weight in h's dtype (rows of dead blocks unwritten)."""
    nb, d = block_expert.shape[0], w_down.shape[2]
    call = _down_call(h, w_down, block_expert, num_tokens=num_tokens, config=config, interpret=interpret,
                      out_shape=jax.ShapeDtypeStruct((nb * config.block_m, d), h.dtype), fused=False,
                      name="moe_down_weighted")
    return call(block_expert, row_token, row_weight, h, w_down)


def down_combined(h, w_down, block_expert, row_token, row_weight, *, num_tokens: int, config: MoeConfig,
                  interpret: bool):
    """Kernel 2 with the combine fused: out [T, D] fp32 = sum over each token's rows of (h @ w_down[e]) *
    row_weight, added atomically by the epilogue (no y [Mp, D] buffer; fp32 adds in no fixed order)."""
    d = w_down.shape[2]
    out = jnp.zeros((num_tokens + 1, d), jnp.float32)                       # + a spare row for padding rows
    call = _down_call(h, w_down, block_expert, num_tokens=num_tokens, config=config, interpret=interpret,
                      out_shape=jax.ShapeDtypeStruct((num_tokens + 1, d), jnp.float32), fused=True,
                      name="moe_down_combined", input_output_aliases={5: 0})
    return call(block_expert, row_token, row_weight, h, w_down, out)[:num_tokens]
