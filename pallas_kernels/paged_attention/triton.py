"""Pallas (Triton lowering) kernels of paged causal attention: prefill over stacked streams, and decode.

Shape legend: T stacked query tokens, N streams, S slots, H query heads, Hkv kv heads (G = H / Hkv), Dh head dim,
P pages, Ps tokens per page, W pages per slot in the page table, NB query blocks (reference.num_query_blocks),
M query rows per tile (block_m), Bk keys per step (block_k), NS decode splits, R = N H decode rows.

Prefill (``paged_attention_prefill``), grid (Hkv, NB) (kv head fastest), blocks sorted by the keys they read
(longest first, so the longest programs launch first):
  one program = one query block of Bq = M // G tokens of one stream x the G query heads of one kv head, packed
  in ONE [M, Dh] tile (row i = token i // G, head hk * G + i % G) so that the G heads share every K/V tile.
  Keys are visited Bk at a time (Bk / Ps pages through page_table[slot]) from 0 to klen = min(slot_len,
  last query position + 1): the trip count comes from the device-side block map (no host read). Key blocks
  wholly at or before the block's first query skip the causal mask (first loop); the rest take it (second).
  Online softmax in fp32, base 2 (running max m, sum l, accumulator [M, Dh]); keys past the block's causal bound, past
  the slot's length or on a page id outside [0, P) are masked on load (never read) and in the scores.
Gated prefill (``paged_attention_prefill_gated``, Qwen3-Next's attention): the same program, reading the queries
  and gates from q_proj's raw output qg [T, C] (head h's [query | gate] at columns h 2 Dh ..) and writing o
  [T, H * Dh] (o_proj's input) = o * sigmoid(gate), the gate read in the epilogue. The q RMSNorm + partial RoPE
  run where PrefillConfig.q_prologue says: "xla" (default: one XLA fusion before the kernel, which then loads a
  plain q tile), "kernel" (on the loaded tile: measured 2x slower on the H200, ``python -m benchmarks
  attention``) or "reload" (on the tile, stored to the program's own output rows and loaded back after a CTA
  barrier).
Decode (``paged_attention_decode``), grid (N, Hkv / kv_per_prog, NS) (flash decoding):
  the G heads of one kv head (or, pack_kv_heads, all H heads of the stream) in one tile (rows padded to 16, the
  smallest dot); each stream's context cut into NS splits of ceil(len / NS) keys (the length read on the device:
  one program for any lengths); each program writes its partial (m, l, unnormalised o) and a combine (one XLA
  fusion or a small kernel) merges them; with NS == 1 the kernel writes o itself.
Gated decode (``paged_attention_decode_gated``): the same, reading q (and the gate) from qg [N, C] and writing
  o * sigmoid(gate) where o becomes final; the q RMSNorm + RoPE in XLA or on the query tile (DecodeConfig.q_prologue).
K/V page write (``kv_write``), grid (T,): one program per token, its k heads RMS-normed and rotated and its v heads
  stored to both pools (aliased in and out) at page * Ps + offset.
Prefill and decode q are addressed as [T, C] / [N, C] (token row, per-head column offset: C = H Dh, or the gated
qg), o as [T, H * Dh] / [N * H, Dh] rows, K/V pages as [P * Ps, Hkv, Dh] rows (free reshapes), so every load is
one gather of whole rows with a mask. Interpret mode (CPU) runs the same kernel bodies.

This module imports only jax.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.reference import build_query_blocks, gated_query

_NEG = -1e30
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """block_m: query rows per tile (Bq tokens x G heads, a power of two >= 16); block_k: keys per step (a
    multiple of the page size or a divisor of it); num_warps / num_stages: Triton launch parameters.
    q_prologue (gated prefill only): where the q RMSNorm + RoPE run: "kernel" (on the query tile, which then
    feeds the QK^T dot from registers), "reload" (on the tile, stored to the program's own output rows and loaded
    back, so that the dot reads it like a loaded tile), "xla" (one XLA pass before the kernel; the kernel still
    applies the gate)."""
    block_m: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2
    q_prologue: str = "xla"

    def __post_init__(self):
        if self.q_prologue not in ("kernel", "reload", "xla"):
            raise ValueError(f"PrefillConfig.q_prologue must be 'kernel', 'reload' or 'xla', got "
                             f"{self.q_prologue!r}")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Decode launch; the defaults are the H200 sweep's pick (``python -m benchmarks attention``), ``decode_config``
    adapts block_k to the dtype.

    block_k: keys per step (a power of two >= 16). num_splits: context splits per (stream, kv head block); None:
    the power of two for about ``waves`` programs per SM (``_num_splits``); 1: no combine, the kernel writes o.
    num_warps / num_stages: Triton launch parameters. dynamic_split: each stream's split length is ceil(len / NS)
    (its length read on the device) instead of W Ps / NS (static: a stream shorter than the page table's width
    leaves splits idle). combine: how the splits merge: "pallas" (one small kernel), "xla" (one product +
    reduction fusion) or "einsum" (an fp32 einsum). pack_kv_heads (off: measured no faster on the H200): one
    program per stream reads every kv head: whole [Ps, Hkv Dh] page rows, all H query heads in one tile; taken
    where Hkv <= 4 and H <= 32.
    q_prologue (the gated decode, ``paged_attention_decode_gated``, only): where the q RMSNorm + RoPE run: "xla"
    (one XLA fusion before the kernel) or "kernel" (on the [16, Dh] query tile in the kernel's prologue)."""
    block_k: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    pack_kv_heads: bool = False
    dynamic_split: bool = True
    combine: str = "pallas"
    waves: int = 2
    q_prologue: str = "xla"

    def __post_init__(self):
        if self.q_prologue not in ("kernel", "xla"):
            raise ValueError(f"DecodeConfig.q_prologue must be 'kernel' or 'xla', got {self.q_prologue!r}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"DecodeConfig.block_k must be a power of two >= 16, got {self.block_k}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"DecodeConfig.num_splits must be None or >= 1, got {self.num_splits}")
        if self.combine not in ("xla", "pallas", "einsum"):
            raise ValueError(f"DecodeConfig.combine must be 'xla', 'pallas' or 'einsum', got {self.combine!r}")
        if self.waves < 1:
            raise ValueError(f"DecodeConfig.waves must be >= 1, got {self.waves}")


# Module-wide overrides (benchmarks): None picks by dtype and head dim below.
DEFAULT_PREFILL: PrefillConfig | None = None
DEFAULT_DECODE: DecodeConfig | None = None


def prefill_config(dtype, head_dim: int) -> PrefillConfig:
    """Launch parameters by input size (H200 sweep, ``python -m benchmarks attention``): 2-byte inputs [128 rows,
    64 keys, 8 warps]; fp32 tiles are halved so that q, 2 stages of K and V fit the 227 KB of shared memory at Dh 256."""
    if DEFAULT_PREFILL is not None:
        return DEFAULT_PREFILL
    if jnp.dtype(dtype).itemsize == 4:
        return PrefillConfig(block_m=32 if head_dim > 128 else 64, block_k=32, num_warps=4, num_stages=2)
    return PrefillConfig(block_m=128, block_k=64, num_warps=8, num_stages=2)


def decode_config(dtype, head_dim: int) -> DecodeConfig:
    """Decode launch (H200 sweeps, ``python -m benchmarks attention``): Bk 64, 4 warps, 2
    stages, dynamic split, NS the power of two for ~2 programs per SM (``_num_splits``: 2 at 128 (stream, kv
    head) pairs, one split and no combine from ~264), the Pallas combine; fp32 at Dh 256 halves Bk (2 stages of
    K and V in shared memory). 16-bit inputs take the gated decode's q norm + RoPE in the kernel (q_prologue
    "kernel": 3 XLA launches fewer per decode layer; an interleaved A/B at 80B dims, 64 x 1189, in-program:
    0.0816 / 0.0811 / 0.0879 ms against 0.0831 / 0.0897 / 0.0889 with the XLA prologue, kernels 82-83 us against
    86-88)."""
    if DEFAULT_DECODE is not None:
        return DEFAULT_DECODE
    if jnp.dtype(dtype).itemsize == 4 and head_dim > 128:
        return DecodeConfig(block_k=32)
    if jnp.dtype(dtype).itemsize == 4:
        return DecodeConfig(block_k=64)
    return DecodeConfig(block_k=64, q_prologue="kernel")


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, *, tb=False, precision=None):
    dn = (((1,), (1,) if tb else (0,)), ((), ()))
    return lax.dot_general(a, b, dn, precision=precision, preferred_element_type=jnp.float32)


def _kv_rows(pt_ref, slot, start, limit, *, block_k, page_size, num_pages, width):
    """Keys start .. start + Bk - 1 of a slot through its page table row: (key positions [Bk], rows [Bk] of the
    [P * Ps, Hkv, Dh] pool view (0 where invalid), valid [Bk]: before ``limit`` and on a page id in [0, P))."""
    kpos = start + _iota((block_k,), 0)
    pidx = kpos // page_size
    live = (kpos < limit) & (pidx < width)
    page = plgpu.load(pt_ref.at[slot, jnp.where(live, pidx, 0)], mask=live, other=-1)
    valid = live & (page >= 0) & (page < num_pages)
    row = jnp.where(valid, page * page_size + kpos % page_size, 0)
    return kpos, row, valid


def _kv_tile(pt_ref, k_ref, v_ref, slot, start, limit, *, block_k, page_size, num_pages, width, hk, dh):
    """Keys start .. start + Bk - 1 of a slot (through its page table row), masked past ``limit`` and on page ids
    outside [0, P): returns (k [Bk, Dh], v [Bk, Dh], key positions [Bk], valid [Bk])."""
    kpos, row, valid = _kv_rows(pt_ref, slot, start, limit, block_k=block_k, page_size=page_size,
                                num_pages=num_pages, width=width)
    cols = _iota((1, dh), 1)
    m2 = valid[:, None]
    k = plgpu.load(k_ref.at[row[:, None], hk, cols], mask=m2, other=0)
    v = plgpu.load(v_ref.at[row[:, None], hk, cols], mask=m2, other=0)
    return k, v, kpos, valid


def _online_step(carry, q, k, v, scale_log2, precision, *, mask=None, key_ok=None):
    """One key tile of the online softmax in base 2 (scores scaled by scale * log2(e), then exp2).

    mask [M, Bk]: scores outside it are set to -1e30 and their p to 0 (the causal diagonal). key_ok [Bk] (the
    cheaper form for tiles with no causal cut): -1e30 is added to the scores of keys outside it in the same FMA
    as the scale; their k and v rows were loaded as zeros, so a p of 1 while a row has seen no valid key yet
    only adds zeros to acc, and the first valid key resets l (alpha = exp2(-1e30 - m) = 0)."""
    m_i, l_i, acc = carry
    s = _dot(q, k, tb=True, precision=precision)                                   # [M, Bk] fp32
    if mask is not None:
        s = jnp.where(mask, s * scale_log2, _NEG)
    else:
        s = s * scale_log2 + jnp.where(key_ok, 0.0, _NEG)[None, :]
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    l_new = l_i * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, precision=precision)
    return m_new, l_new, acc


# ----------------------------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatedQ:
    """The gated prefill's prologue / epilogue (static). gate_stride: columns per head in qg (2 Dh: [query |
    gate]; the gate at column h * gate_stride + Dh); rotary_dim: R, the rotated leading dims of each head (0: no
    RoPE); eps: the q RMSNorm's epsilon; prologue: PrefillConfig.q_prologue."""
    gate_stride: int
    rotary_dim: int
    eps: float
    prologue: str


def _prefill_kernel(*refs, group, block_q, block_m, block_k, page_size, num_pages, width, num_heads, scale,
                    precision, head_stride, gated: GatedQ | None, interpret: bool):
    tok0_ref, count_ref, slot_ref, pos0_ref, klen_ref, pt_ref, q_ref, k_ref, v_ref = refs[:9]
    o_ref = refs[-1]
    hk = pl.program_id(0)
    b = pl.program_id(1)
    tok0 = tok0_ref[b]
    count = count_ref[b]
    slot = slot_ref[b]
    pos0 = pos0_ref[b]
    klen = klen_ref[b]
    dh = k_ref.shape[-1]
    scale_log2 = scale * _LOG2E

    i = _iota((block_m,), 0)
    tok = i // group
    row_ok = (i < block_q * group) & (tok < count)
    trow = tok0 + tok                                             # query token of each row
    head = hk * group + i % group
    qcol = head * head_stride                                     # first column of the row's query in q_ref
    cols = _iota((1, dh), 1)
    q = plgpu.load(q_ref.at[trow[:, None], qcol[:, None] + cols], mask=row_ok[:, None], other=0)   # [M, Dh]
    ocol = head * dh
    if gated is not None and gated.prologue != "xla":
        q = _gated_prologue(refs[9:-1], q_ref, q, trow, qcol, row_ok, gated, dh)
        if gated.prologue == "reload":      # through the program's own output rows (overwritten at the end)
            plgpu.store(o_ref.at[trow[:, None], ocol[:, None] + cols], q, mask=row_ok[:, None])
            if not interpret:           # (interpret mode runs the program's rows in order: nothing to wait for)
                plgpu.debug_barrier()
            q = plgpu.load(o_ref.at[trow[:, None], ocol[:, None] + cols], mask=row_ok[:, None], other=0)
    qpos = pos0 + tok                                                                 # [M]

    def below(j, carry):            # key block entirely at or before the block's first query: no causal mask
        k, v, _, valid = _kv_tile(pt_ref, k_ref, v_ref, slot, j * block_k, klen, block_k=block_k,
                                  page_size=page_size, num_pages=num_pages, width=width, hk=hk, dh=dh)
        return _online_step(carry, q, k, v, scale_log2, precision, key_ok=valid)

    def diagonal(j, carry):
        k, v, kpos, valid = _kv_tile(pt_ref, k_ref, v_ref, slot, j * block_k, klen, block_k=block_k,
                                     page_size=page_size, num_pages=num_pages, width=width, hk=hk, dh=dh)
        mask = valid[None, :] & (kpos[None, :] <= qpos[:, None])
        return _online_step(carry, q, k, v, scale_log2, precision, mask=mask)

    carry = (jnp.full((block_m,), _NEG, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, dh), jnp.float32))
    steps = (klen + block_k - 1) // block_k
    full = jnp.clip(jnp.minimum(pos0 + 1, klen) // block_k, 0, steps)
    carry = lax.fori_loop(0, full, below, carry)
    _, l_i, acc = lax.fori_loop(full, steps, diagonal, carry)
    o = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    if gated is not None:           # o * sigmoid(gate): the gate sits Dh columns after the row's query in qg
        g_ref = refs[9] if gated.prologue == "xla" else q_ref
        gcol = head * gated.gate_stride + dh
        g = plgpu.load(g_ref.at[trow[:, None], gcol[:, None] + cols], mask=row_ok[:, None], other=0)
        o = o / (1.0 + jnp.exp2(g.astype(jnp.float32) * -_LOG2E))
        o = jnp.where((l_i > 0)[:, None], o, 0.0)
    plgpu.store(o_ref.at[trow[:, None], ocol[:, None] + cols], o.astype(o_ref.dtype), mask=row_ok[:, None])


def _gated_prologue(extra_refs, q_ref, q, trow, qcol, row_ok, gated: GatedQ, dh):
    """q [M, Dh] (raw rows of q_proj's output) -> RoPE(RMSNorm(q)) in q's dtype, rounded where the XLA path
    rounds (after the norm, after the rotation). extra_refs: (q_norm [Dh], and cos, sin [T, R] when R > 0)."""
    qn_ref = extra_refs[0]
    cols1 = _iota((dh,), 0)
    x = q.astype(jnp.float32)
    rs = lax.rsqrt(jnp.sum(x * x, axis=1) / dh + gated.eps)                          # [M]
    w1 = 1.0 + plgpu.load(qn_ref.at[cols1]).astype(jnp.float32)                       # zero-centred weight
    xn = (x * rs[:, None] * w1[None, :]).astype(q.dtype)
    r = gated.rotary_dim
    if not r:
        return xn
    cos_ref, sin_ref = extra_refs[1], extra_refs[2]
    half = r // 2
    pc1 = jnp.where(cols1 < half, cols1 + half, jnp.where(cols1 < r, cols1 - half, cols1))   # rotate-half partner
    xp = plgpu.load(q_ref.at[trow[:, None], qcol[:, None] + pc1[None, :]], mask=row_ok[:, None], other=0)
    wp = 1.0 + plgpu.load(qn_ref.at[pc1]).astype(jnp.float32)
    xpn = (xp.astype(jnp.float32) * rs[:, None] * wp[None, :]).astype(q.dtype)
    rot = cols1 < r
    cidx = jnp.where(rot, cols1, 0)[None, :]
    trow_c = jnp.where(row_ok, trow, 0)[:, None]
    m2 = row_ok[:, None] & rot[None, :]
    c = plgpu.load(cos_ref.at[trow_c, cidx], mask=m2, other=1.0)
    s = plgpu.load(sin_ref.at[trow_c, cidx], mask=m2, other=0.0)
    sign = jnp.where(cols1 < half, -1.0, 1.0)[None, :]
    out = xn.astype(jnp.float32) * c + sign * xpn.astype(jnp.float32) * s
    return out.astype(q.dtype)


def _prefill_call(q2d, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, extra, *, num_heads,
                  head_stride, gated, scale, interpret, config, out_dtype):
    t = q2d.shape[0]
    p, ps, hkv, dh = k_pages.shape
    h = num_heads
    group = h // hkv
    block_m = max(16, _pow2(config.block_m), _pow2(group))
    block_q = block_m // group
    block_k = config.block_k
    blocks = build_query_blocks(cu_seqlens, slot_ids, slot_lens, t, block_q)
    # longest work first (the blocks reading the most keys launch first: a short tail of programs at the end)
    order = jnp.argsort(-blocks.klen, stable=True)
    blocks = type(blocks)(*(x[order] for x in blocks))
    nb = blocks.tok0.shape[0]
    kernel = functools.partial(
        _prefill_kernel, group=group, block_q=block_q, block_m=block_m, block_k=block_k, page_size=ps,
        num_pages=p, width=page_table.shape[1], num_heads=h, scale=float(scale),
        precision=_precision(k_pages.dtype), head_stride=head_stride, gated=gated, interpret=bool(interpret))
    call = pl.pallas_call(
        kernel, grid=(hkv, nb), out_shape=jax.ShapeDtypeStruct((t, h * dh), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="paged_attention_prefill" + ("_gated" if gated else ""))
    return call(blocks.tok0, blocks.count, blocks.slot, blocks.pos0, blocks.klen, page_table, q2d,
                k_pages.reshape(p * ps, hkv, dh), v_pages.reshape(p * ps, hkv, dh), *extra)


def paged_attention_prefill(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *, scale,
                            interpret=False, config: PrefillConfig | None = None):
    """q [T, H, Dh]; k/v_pages [P, Ps, Hkv, Dh]; page_table [S, W], slot_lens [S], cu_seqlens [N + 1], slot_ids
    [N] int32 -> o [T, H, Dh] in q's dtype (semantics: reference.py). Every output row is written (zeros for
    padding tokens and streams with no slot)."""
    config = config or prefill_config(q.dtype, q.shape[-1])
    t, h, dh = q.shape
    o = _prefill_call(q.reshape(t, h * dh), k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, (),
                      num_heads=h, head_stride=dh, gated=None, scale=scale, interpret=interpret, config=config,
                      out_dtype=q.dtype)
    return o.reshape(t, h, dh)


def paged_attention_prefill_gated(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, q_norm, cos,
                                  sin, *, num_heads, eps, scale, interpret=False,
                                  config: PrefillConfig | None = None):
    """The gated attention's prefill in one kernel (semantics: reference.paged_attention_gated_xla).

    qg [T, C] (C >= H 2 Dh; head h's [query | gate] at columns h 2 Dh .. h 2 Dh + 2 Dh - 1: q_proj's output, or
    the first columns of a fused q/k/v projection); q_norm [Dh]; cos, sin [T, R] fp32 (R = 0: no RoPE);
    k/v_pages, page_table, slot_lens, cu_seqlens, slot_ids as ``paged_attention_prefill``.
    Prologue (config.q_prologue, "kernel" / "reload"): the [M, Dh] query tile is RMS-normed (zero-centred weight)
    and rotated (partial NeoX RoPE); "xla": the same by reference.gated_query before the kernel. Epilogue:
    o * sigmoid(gate). Returns o [T, H * Dh] in qg's dtype (o_proj's input)."""
    t = qg.shape[0]
    dh = k_pages.shape[-1]
    config = config or prefill_config(qg.dtype, dh)
    r = cos.shape[1]
    gated = GatedQ(gate_stride=2 * dh, rotary_dim=int(r), eps=float(eps), prologue=config.q_prologue)
    if config.q_prologue == "xla":
        q, _ = gated_query(qg, q_norm, cos, sin, num_heads=num_heads, head_dim=dh, eps=eps)
        return _prefill_call(q.reshape(t, num_heads * dh), k_pages, v_pages, page_table, slot_lens, cu_seqlens,
                             slot_ids, (qg,), num_heads=num_heads, head_stride=dh, scale=scale,
                             interpret=interpret, config=config, gated=gated, out_dtype=qg.dtype)
    extra = (q_norm,) + ((cos.astype(jnp.float32), sin.astype(jnp.float32)) if r else ())
    return _prefill_call(qg, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, extra,
                         num_heads=num_heads, head_stride=2 * dh, scale=scale, interpret=interpret, config=config,
                         gated=gated, out_dtype=qg.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Decode (flash decoding: splits over the context, then a combine)
# ----------------------------------------------------------------------------------------------------------------
def _decode_kernel(*refs, group, kv_per_prog, block_m, block_k, num_splits, split_len, page_size, num_pages, width,
                   num_heads, num_slots, scale, precision, direct, gated: GatedQ | None, n_extra):
    """One program: stream n, kv heads hb * kv_per_prog .., split sp. Rows of the [M, Dh] query tile: the G heads
    of each of its kv heads (row i: local kv head i // G); with several kv heads per program every key tile is
    loaded once per kv head (together: the page's whole [Ps, Hkv Dh] rows when kv_per_prog == Hkv) and each row
    keeps the scores of its own kv head.
    refs: slot_ids, slot_lens, page_table, q [N, C] (head h's query at column h * head_stride), k, v pool views,
    n_extra gated inputs (prologue "xla": qg; "kernel": q_norm, cos, sin), outputs.
    gated: the gate (at column h 2 Dh + Dh of qg) multiplies o where o is final (NS == 1: here; else in the
    combine); prologue "kernel": q is qg and its tile is RMS-normed and rotated here."""
    slot_ids_ref, slot_lens_ref, pt_ref, q_ref, k_ref, v_ref = refs[:6]
    extra_refs = refs[6:6 + n_extra]
    out_refs = refs[6 + n_extra:]
    n = pl.program_id(0)
    hb = pl.program_id(1)
    sp = pl.program_id(2)
    sid = slot_ids_ref[n]
    has_slot = (sid >= 0) & (sid < num_slots)
    slot = jnp.where(has_slot, sid, 0)
    ctx = jnp.where(has_slot, slot_lens_ref[slot], 0)
    if split_len is None:       # the stream's own length cut in num_splits parts, rounded up to block_k keys
        per = (ctx + num_splits - 1) // num_splits
        per = (per + block_k - 1) // block_k * block_k
    else:                       # static: W * Ps keys cut in num_splits parts
        per = split_len
    start = sp * per
    stop = jnp.minimum(ctx, start + per)
    dh = k_ref.shape[-1]
    scale_log2 = scale * _LOG2E

    i = _iota((block_m,), 0)
    row_ok = i < group * kv_per_prog
    kvl = i // group                                              # the row's kv head, local to the program
    row = n * num_heads + hb * kv_per_prog * group + i            # distinct rows (masked ones too: no clash)
    cols = _iota((1, dh), 1)
    head = row - n * num_heads                                    # the row's query head
    trow = jnp.full((block_m,), n, jnp.int32)
    head_stride = 2 * dh if gated is not None and gated.prologue == "kernel" else dh
    qcol = head * head_stride
    q = plgpu.load(q_ref.at[trow[:, None], qcol[:, None] + cols], mask=row_ok[:, None], other=0)   # [M, Dh]
    if gated is not None and gated.prologue == "kernel":
        q = _gated_prologue(extra_refs, q_ref, q, trow, qcol, row_ok, gated, dh)
    g_ref = None if gated is None else (extra_refs[0] if gated.prologue == "xla" else q_ref)

    def gate(o, ok):            # o [M, Dh] fp32 -> o * sigmoid(gate) (zeros where not ok: no stream, no key)
        if gated is None:
            return o
        g = plgpu.load(g_ref.at[trow[:, None], head[:, None] * 2 * dh + dh + cols], mask=row_ok[:, None], other=0)
        return jnp.where(ok[:, None], o / (1.0 + jnp.exp2(g.astype(jnp.float32) * -_LOG2E)), 0.0)
    heads = [hb * kv_per_prog + c for c in range(kv_per_prog)]

    def rows_of(j):             # pool rows of step j's keys, -1 where invalid
        _, rows, valid = _kv_rows(pt_ref, slot, start + j * block_k, stop, block_k=block_k, page_size=page_size,
                                  num_pages=num_pages, width=width)
        return jnp.where(valid, rows, -1)

    def body(j, carry):
        m_i, l_i, acc = carry
        rows = rows_of(j)
        valid = rows >= 0
        m2 = valid[:, None]
        rows = jnp.maximum(rows, 0)
        ks = [plgpu.load(k_ref.at[rows[:, None], hk, cols], mask=m2, other=0) for hk in heads]
        vs = [plgpu.load(v_ref.at[rows[:, None], hk, cols], mask=m2, other=0) for hk in heads]
        s = None
        for c, k in enumerate(ks):
            sc = _dot(q, k, tb=True, precision=precision)                              # [M, Bk] fp32
            s = sc if s is None else jnp.where((kvl == c)[:, None], sc, s)
        s = s * scale_log2 + jnp.where(valid, 0.0, _NEG)[None, :]
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None]
        for c, v in enumerate(vs):
            pc = p if kv_per_prog == 1 else jnp.where((kvl == c)[:, None], p, 0.0)
            acc = acc + _dot(pc.astype(v.dtype), v, precision=precision)
        return m_new, l_new, acc

    carry = (jnp.full((block_m,), _NEG, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, dh), jnp.float32))
    steps = jnp.maximum(stop - start + block_k - 1, 0) // block_k
    m_i, l_i, acc = lax.fori_loop(0, steps, body, carry)
    if direct:                  # one split: the normalised output in q's dtype, no combine
        o_ref, = out_refs
        o = gate(acc / jnp.where(l_i > 0, l_i, 1.0)[:, None], l_i > 0)
        plgpu.store(o_ref.at[row[:, None], cols], o.astype(o_ref.dtype), mask=row_ok[:, None])
        return
    o_ref, m_ref, l_ref = out_refs
    plgpu.store(o_ref.at[row[:, None], sp, cols], acc, mask=row_ok[:, None])
    plgpu.store(m_ref.at[row, sp], m_i, mask=row_ok)
    plgpu.store(l_ref.at[row, sp], l_i, mask=row_ok)


def _merge_splits(m_ref, l_ref, o_part_ref, r, ok, num_splits, dh):
    """(o [len(r), Dh] fp32, its denominator [len(r)]) of rows r from their NS split partials (m in log2 units,
    l, unnormalised o); a row with no key has denominator 0 and o 0. The split loops are unrolled up to 16 splits (the measured form), a fori_loop beyond."""
    cols = _iota((1, dh), 1)

    def loop(body, carry):
        if num_splits <= 16:
            for s in range(num_splits):
                carry = body(s, carry)
            return carry
        return lax.fori_loop(0, num_splits, body, carry)

    def m_of(s):
        return plgpu.load(m_ref.at[r, s], mask=ok, other=_NEG)

    rows = r.shape[0]
    m_all = loop(lambda s, m: jnp.maximum(m, m_of(s)), jnp.full((rows,), _NEG, jnp.float32))

    def merge(s, carry):
        den, acc = carry
        w = jnp.exp2(m_of(s) - m_all)
        den = den + w * plgpu.load(l_ref.at[r, s], mask=ok, other=0.0)
        acc = acc + w[:, None] * plgpu.load(o_part_ref.at[r[:, None], s, cols], mask=ok[:, None], other=0.0)
        return den, acc
    den, acc = loop(merge, (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, dh), jnp.float32)))
    return acc / jnp.where(den > 0, den, 1.0)[:, None], den


def _combine_kernel(m_ref, l_ref, o_part_ref, *refs, num_splits, rows, num_rows, num_heads):
    """Rows r0 .. r0 + rows - 1 of the split partials -> o (the merge of ``_combine_xla`` in one launch); with a
    gate input (refs = (qg [N, C], o)), o * sigmoid(gate) (row r: stream r // H, head r % H)."""
    o_ref = refs[-1]
    r = pl.program_id(0) * rows + _iota((rows,), 0)
    ok = r < num_rows
    dh = o_ref.shape[-1]
    o, den = _merge_splits(m_ref, l_ref, o_part_ref, r, ok, num_splits, dh)
    if len(refs) == 2:
        g = plgpu.load(refs[0].at[(r // num_heads)[:, None], (r % num_heads)[:, None] * 2 * dh + dh
                                  + _iota((1, dh), 1)], mask=ok[:, None], other=0)
        o = jnp.where((den > 0)[:, None], o / (1.0 + jnp.exp2(g.astype(jnp.float32) * -_LOG2E)), 0.0)
    plgpu.store(o_ref.at[r[:, None], _iota((1, dh), 1)], o.astype(o_ref.dtype), mask=ok[:, None])


def _combine_xla(o_part, m_part, l_part, dtype, einsum: bool):
    """o_part [R, NS, Dh] fp32 (unnormalised), m_part, l_part [R, NS] (m in log2 units) -> o [R, Dh] in dtype.
    einsum: the weighted sum as an fp32 einsum instead of a product + reduction."""
    m_all = jnp.max(m_part, axis=1, keepdims=True)                                   # [R, 1]
    wgt = jnp.exp2(m_part - m_all)                                                   # [R, NS]
    denom = jnp.sum(wgt * l_part, axis=1)
    if einsum:
        o = jnp.einsum("rs,rsd->rd", wgt, o_part, precision=lax.Precision.HIGHEST)
    else:
        o = jnp.sum(wgt[:, :, None] * o_part, axis=1)
    return (o / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(dtype)


def _sm_count() -> int:
    try:
        dev = jax.devices()[0]
        return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132
    except Exception:  # pragma: no cover
        return 132


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _num_splits(programs: int, max_keys: int, block_k: int, waves: int, sms: int = 132) -> int:
    """Splits per (stream, kv head block) for ``programs`` of them: the largest power of two <= waves * sms /
    programs (at least 1), never more than W Ps / (4 block_k) (no split of a full-width slot under 4 steps).
    Powers of two because the H200 measured so: at 64 x 4096 the kernel took 131 / 136 us with 2 / 4 splits and
    151-152 us with 3 / 5 (not understood)."""
    want = _pow2_floor(waves * sms // max(1, programs))
    return max(1, min(want, _pow2_floor(max_keys // (4 * block_k))))


def paged_attention_decode(q, k_pages, v_pages, page_table, slot_lens, slot_ids, *, scale, interpret=False,
                           config: DecodeConfig | None = None):
    """q [N, H, Dh] (one query per stream at position slot_lens[slot] - 1); k/v_pages [P, Ps, Hkv, Dh];
    page_table [S, W]; slot_lens [S]; slot_ids [N] -> o [N, H, Dh] in q's dtype (zeros for streams with no slot).

    Grid (N, Hkv / kv_per_prog, NS); NS = config.num_splits or ``_num_splits``. With NS == 1 the kernel writes o
    itself; else partials o_part [N H, NS, Dh] fp32, m, l [N H, NS] and a combine (config.combine: a second kernel
    or XLA)."""
    config = config or decode_config(q.dtype, q.shape[-1])
    n, h, dh = q.shape
    o = _decode_call(q.reshape(n, h * dh), k_pages, v_pages, page_table, slot_lens, slot_ids, (), num_heads=h,
                     gated=None, scale=scale, interpret=interpret, config=config, out_dtype=q.dtype)
    return o.reshape(n, h, dh)


def paged_attention_decode_gated(qg, k_pages, v_pages, page_table, slot_lens, slot_ids, q_norm, cos, sin, *,
                                 num_heads, eps, scale, interpret=False, config: DecodeConfig | None = None):
    """The gated attention's decode step (semantics: reference.paged_attention_decode_gated_xla).

    qg [N, C] (C >= H 2 Dh; head h's [query | gate] at columns h 2 Dh ..: q_proj's output, or the first columns
    of a fused q/k/v projection); q_norm [Dh]; cos, sin [N, R] fp32 at each stream's position (R = 0: no RoPE);
    the rest as ``paged_attention_decode``. The q RMSNorm + RoPE run where config.q_prologue says ("xla": one
    XLA fusion before the kernel; "kernel": on the kernel's query tile); o * sigmoid(gate) runs where o is final
    (the kernel with one split, else the combine). Returns o [N, H * Dh] in qg's dtype
    (o_proj's input; zeros for streams with no slot)."""
    n = qg.shape[0]
    dh = k_pages.shape[-1]
    config = config or decode_config(qg.dtype, dh)
    r = cos.shape[1]
    gated = GatedQ(gate_stride=2 * dh, rotary_dim=int(r), eps=float(eps), prologue=config.q_prologue)
    if config.q_prologue == "xla":
        q, _ = gated_query(qg, q_norm, cos, sin, num_heads=num_heads, head_dim=dh, eps=eps)
        return _decode_call(q.reshape(n, num_heads * dh), k_pages, v_pages, page_table, slot_lens, slot_ids, (qg,),
                            num_heads=num_heads, gated=gated, scale=scale, interpret=interpret, config=config,
                            out_dtype=qg.dtype).reshape(n, num_heads * dh)
    extra = (q_norm,) + ((cos.astype(jnp.float32), sin.astype(jnp.float32)) if r else ())
    return _decode_call(qg, k_pages, v_pages, page_table, slot_lens, slot_ids, extra, num_heads=num_heads,
                        gated=gated, scale=scale, interpret=interpret, config=config,
                        out_dtype=qg.dtype).reshape(n, num_heads * dh)


def _decode_call(q2d, k_pages, v_pages, page_table, slot_lens, slot_ids, extra, *, num_heads, gated, scale,
                 interpret, config, out_dtype):
    """q2d [N, C] (head h's query at column h Dh, or h 2 Dh with the "kernel" prologue) -> o [N H, Dh]."""
    n = q2d.shape[0]
    h = num_heads
    p, ps, hkv, dh = k_pages.shape
    s, w = page_table.shape
    group = h // hkv
    kvp = hkv if config.pack_kv_heads and hkv <= 4 and h <= 32 else 1      # packing: at most 4 K/V tiles a step
    block_m = max(16, _pow2(group * kvp))
    block_k = config.block_k
    max_keys = w * ps
    ns = config.num_splits or _num_splits(n * (hkv // kvp), max_keys, block_k, config.waves, _sm_count())
    split_len = None if config.dynamic_split else block_k * math.ceil(math.ceil(max_keys / ns) / block_k)
    direct = ns == 1
    kernel = functools.partial(
        _decode_kernel, group=group, kv_per_prog=kvp, block_m=block_m, block_k=block_k, num_splits=ns,
        split_len=split_len, page_size=ps, num_pages=p, width=w, num_heads=h, num_slots=s, scale=float(scale),
        precision=_precision(k_pages.dtype), direct=direct, gated=gated, n_extra=len(extra))
    args = [slot_ids, slot_lens, page_table, q2d, k_pages.reshape(p * ps, hkv, dh),
            v_pages.reshape(p * ps, hkv, dh), *extra]
    if direct:
        out_shape = jax.ShapeDtypeStruct((n * h, dh), out_dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((n * h, ns, dh), jnp.float32),
                     jax.ShapeDtypeStruct((n * h, ns), jnp.float32),
                     jax.ShapeDtypeStruct((n * h, ns), jnp.float32))
    call = pl.pallas_call(
        kernel, grid=(n, hkv // kvp, ns), out_shape=out_shape, input_output_aliases={},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="paged_attention_decode" + ("_gated" if gated else ""))
    out = call(*args)
    if direct:
        return out
    o_part, m_part, l_part = out
    gate_in = () if gated is None else ((extra[0] if gated.prologue == "xla" else q2d),)
    if config.combine == "pallas":
        rows = 8
        return pl.pallas_call(
            functools.partial(_combine_kernel, num_splits=ns, rows=rows, num_rows=n * h, num_heads=h),
            grid=(pl.cdiv(n * h, rows),), out_shape=jax.ShapeDtypeStruct((n * h, dh), out_dtype),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
            name="paged_attention_decode_combine")(m_part, l_part, o_part, *gate_in)
    o = _combine_xla(o_part, m_part, l_part, jnp.float32 if gate_in else out_dtype,
                     einsum=config.combine == "einsum")
    if gate_in:                 # the gate in the same XLA fusion as the merge
        g = gate_in[0][:, :h * 2 * dh].reshape(n * h, 2 * dh)[:, dh:].astype(jnp.float32)
        o = jnp.where(jnp.sum(l_part, axis=1, keepdims=True) > 0, o * jax.nn.sigmoid(g), 0.0).astype(out_dtype)
    return o


# ----------------------------------------------------------------------------------------------------------------
# The decode step's K/V page write (k RMSNorm + RoPE + both pools in one launch)
# ----------------------------------------------------------------------------------------------------------------
def _kv_write_kernel(page_ref, off_ref, yk_ref, yv_ref, *refs, hkv, hkv_pad, k_col, v_col, page_size, num_pages, eps,
                     rotary_dim):
    """One program = token t: its k (RMS-normed, zero-centred weight, then rotated on the first R dims, rounded
    where the XLA path rounds) and v rows [Hkv, Dh], read from the projection outputs yk / yv at columns
    k_col / v_col, stored to pool row page * Ps + offset of both pools (aliased in and out); a page id outside
    [0, P) stores nothing."""
    if rotary_dim:
        kn_ref, cos_ref, sin_ref = refs[:3]
    else:
        kn_ref, cos_ref, sin_ref = refs[0], None, None
    k_out, v_out = refs[-2], refs[-1]
    dh = k_out.shape[-1]
    t = pl.program_id(0)
    page = page_ref[t]
    off = off_ref[t]
    valid = (page >= 0) & (page < num_pages) & (off >= 0) & (off < page_size)
    hk = _iota((hkv_pad, 1), 0)
    cols = _iota((1, dh), 1)
    ok = hk < hkv
    trow = jnp.full((hkv_pad, 1), t, jnp.int32)
    x = plgpu.load(yk_ref.at[trow, k_col + hk * dh + cols], mask=ok, other=0)                      # [Hkv', Dh]
    x32 = x.astype(jnp.float32)
    rs = lax.rsqrt(jnp.sum(x32 * x32, axis=1) / dh + eps)[:, None]
    cols1 = _iota((dh,), 0)
    w1 = 1.0 + plgpu.load(kn_ref.at[cols1]).astype(jnp.float32)[None, :]
    kn = (x32 * rs * w1).astype(x.dtype)
    if rotary_dim:
        half = rotary_dim // 2
        pc1 = jnp.where(cols1 < half, cols1 + half, jnp.where(cols1 < rotary_dim, cols1 - half, cols1))
        xp = plgpu.load(yk_ref.at[trow, k_col + hk * dh + pc1[None, :]], mask=ok, other=0)
        wp = 1.0 + plgpu.load(kn_ref.at[pc1]).astype(jnp.float32)[None, :]
        kpn = (xp.astype(jnp.float32) * rs * wp).astype(x.dtype)
        rot = cols1 < rotary_dim
        cidx = jnp.where(rot, cols1, 0)[None, :]
        c = plgpu.load(cos_ref.at[jnp.full((1, 1), t, jnp.int32), cidx], mask=rot[None, :], other=1.0)
        s = plgpu.load(sin_ref.at[jnp.full((1, 1), t, jnp.int32), cidx], mask=rot[None, :], other=0.0)
        sign = jnp.where(cols1 < half, -1.0, 1.0)[None, :]
        kn = (kn.astype(jnp.float32) * c + sign * kpn.astype(jnp.float32) * s).astype(x.dtype)
    v = plgpu.load(yv_ref.at[trow, v_col + hk * dh + cols], mask=ok, other=0)
    row = jnp.full((hkv_pad, 1), jnp.where(valid, page * page_size + off, 0), jnp.int32)
    m = ok & valid
    plgpu.store(k_out.at[row, hk, cols], kn.astype(k_out.dtype), mask=m)
    plgpu.store(v_out.at[row, hk, cols], v.astype(v_out.dtype), mask=m)


def kv_write(k_pages, v_pages, yk, yv, token_page, token_offset, k_norm, cos, sin, *, k_col, v_col, eps,
             interpret=False):
    """Writes one call's new K/V into the pools in one launch (semantics: api.paged_kv_write with backend "xla").

    k/v_pages [P, Ps, Hkv, Dh]; yk [T, Ck], yv [T, Cv] (token t's raw k head j at yk's columns k_col + j Dh ..,
    its v head j at yv's columns v_col + j Dh ..: the k / v projections' outputs, or one fused output twice); token_page, token_offset [T] int32; k_norm [Dh]; cos, sin
    [T, R] fp32 (R = 0: no RoPE). Returns the new (k_pages, v_pages) (the inputs aliased: in place when donated)."""
    p, ps, hkv, dh = k_pages.shape
    t = yk.shape[0]
    r = cos.shape[1]
    extra = (k_norm,) + ((cos.astype(jnp.float32), sin.astype(jnp.float32)) if r else ())
    kernel = functools.partial(_kv_write_kernel, hkv=hkv, hkv_pad=max(2, _pow2(hkv)), k_col=int(k_col),
                               v_col=int(v_col), page_size=ps, num_pages=p, eps=float(eps), rotary_dim=int(r))
    n_in = 4 + len(extra)
    kp, vp = pl.pallas_call(
        kernel, grid=(t,),
        out_shape=(jax.ShapeDtypeStruct((p * ps, hkv, dh), k_pages.dtype),
                   jax.ShapeDtypeStruct((p * ps, hkv, dh), v_pages.dtype)),
        input_output_aliases={n_in: 0, n_in + 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="paged_kv_write")(token_page, token_offset, yk, yv, *extra, k_pages.reshape(p * ps, hkv, dh),
                               v_pages.reshape(p * ps, hkv, dh))
    return kp.reshape(p, ps, hkv, dh), vp.reshape(p, ps, hkv, dh)
