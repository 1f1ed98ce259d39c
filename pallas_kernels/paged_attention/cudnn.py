"""Paged attention prefill through cuDNN's fused flash attention (packed "THD" layout), jax's
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with per-segment offsets.

Shape legend: T stacked query tokens, N streams, S slots, H query heads, Hkv kv heads (G = H / Hkv), Dh head dim,
P pages, Ps tokens per page, W pages per slot, M = max(N, 2) segments of a cuDNN call, K packed key rows
(static: ``CudnnConfig.kv_capacity`` or min(N W Ps, P Ps) + 2 N (A - 1), rounded up to A), A the key-region
alignment (1, or G where jax scales kv offsets by the query heads: ``kv_offset_unit``; jax 0.11.2 on the H200
already scales them right, A = 1).

    paged_attention_prefill_cudnn(q [T, H, Dh], k_pages, v_pages [P, Ps, Hkv, Dh], page_table [S, W],
                                  slot_lens [S], cu_seqlens [N + 1], slot_ids [N], *, scale, config, impl)
        -> o [T, H, Dh] in q's dtype

Semantics are those of reference.py (slot_lens count the keys AFTER this call's writes; query j of stream n sits
at slot_lens[slot] - len_n + j and attends to its slot's keys 0 .. that position). What cuDNN can do here (jax
0.10-0.11, XLA's cuDNN graph): the packed layout takes per-segment q / kv offsets and lengths, returns the softmax
statistics (natural-log LSE, [M, H, T]: segment, head, row inside the segment: ``STATS_ROWS``, both measured on
the H200), and its causal mask is TOP-LEFT
aligned (XLA sets ``set_causal_mask``; no bottom-right option reaches jax). So a continued stream (context c > 0)
cannot be one causal call; it is two:

  * the "new" call, causal: queries = the stream's new tokens, keys = the same tokens' keys (equal lengths, where
    top-left == bottom-right);
  * the "context" call, no causal mask: queries = the new tokens, keys = the c context keys;

merged per row by their LSEs (fp32): o = (o1 e^(l1 - m) + o2 e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m)). Streams
with no context drop out of the context call (segment length -1: jax packs the live segments to the left) and take
o1. ``CudnnConfig(context=False)`` runs the new call only (no merge): for calls the caller knows are all fresh; a stream
that does have context then gets ZERO rows (never a wrong attention).

Both calls read one packed K/V buffer [K, Hkv, Dh] gathered from the pages on the device: per stream a region
[context (padded to A) | new tokens (padded to A)], region starts from a cumsum of the slot lengths: no host read,
one compiled program per (T, N, pool shapes). Tokens past cu[N], streams whose slot id is outside [0, S) or whose
slot holds fewer keys than their tokens, and streams whose region would pass K get zero rows and read nothing;
the buffer rows they would use are zeros (finite: cuDNN may load a tile past a segment's end). A key on a page id
outside [0, P) (only under jit: the checked path rejects such tables) is a ZERO vector here (score 0, value 0),
where the reference masks it out: it reads nothing of another slot either way.

``prefill_direct`` (what the layer runs, ``paged_attention_gated(..., k_new=, v_new=)``): the same two calls, but
the causal call reads the new tokens' K/V as the projection produced them (token order: its key offsets are the
query offsets cu[:-1]; no gather of them back from the pages), only the context keys are gathered (a
context-only buffer), the output gate is applied in the merge's pass, and a batch where no live stream has
context can run the causal call alone, without statistics (``CudnnConfig.fresh`` / ``FRESH``: "cond", a
``lax.cond`` on the device-side "any context"; "merge": always both calls; "auto", the default: "cond" in long
calls only, since on a GPU the cond is a host wait).

impl: "cudnn" (the fused kernel; a GPU with cuDNN >= 9 and compute capability >= 9.0) or "xla" (``segments_xla``:
the same segment semantics in plain XLA, dense over [T, K]; the CPU stand-in that tests the gather / offsets /
merge logic, backend "cudnn_xla").

This module imports only jax (and numpy) and the chunk map's helpers.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dispatch import DEVICE_BRANCH_MIN_TOKENS
from pallas_kernels.gated_delta_rule.chunk_map import count_le, token_streams

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: where the statistics of a packed call keep a query's LSE: "segment" (stats[m, h, j], j the row inside segment m:
#: cuDNN's [B, H, S_q, 1] stats with one batch row per segment, as XLA declares them) or "packed" (stats[m, h, t],
#: t the query's index in the packed rows); "segment" is what cuDNN writes on the H200 (the GPU tests check it).
STATS_ROWS = "segment"
#: factor from the stats cuDNN returns to a natural-log LSE (1: natural log, as cuDNN documents; ln 2 if a build
#: returned log2; the GPU probe measures it)
STATS_TO_LN = 1.0
#: ``CudnnConfig.fresh`` when None (read when ``prefill_direct`` is traced): "cond", "merge" or "auto" (see
#: CudnnConfig).
FRESH = "auto"
#: ``CudnnConfig.q_prologue`` when None: "xla" or "pallas" (see CudnnConfig). "pallas" from the H200
#: (``python -m benchmarks attention``): the XLA form took three passes (0.35 ms), the kernel 0.185 ms; the layer at
#: varlen16 3.151 -> 2.937 ms fresh, 4.471 -> 4.345 ms with 2k context; 3.9e-3 vs the XLA layer.
Q_PROLOGUE = "pallas"


class CudnnConfig(NamedTuple):
    """Static options of the cuDNN prefill. context: run the context call and the merge (False: every stream is
    known fresh; a stream with context gets zero rows). kv_capacity: rows K of the packed K/V buffer (None: the
    bound min(N W Ps, P Ps) + 2 N (A - 1), which holds when the streams' slots own disjoint pages).
    fresh (``prefill_direct`` only): how a call with no context in any stream skips the context call and the
    merge: "cond" (``lax.cond`` on "any live stream has context": one branch runs the causal call alone, without
    statistics) or "merge" (always both calls and the merge: the context call then has no live segment) or "auto"
    ("cond" in calls of at least ``pallas_kernels.dispatch.DEVICE_BRANCH_MIN_TOKENS`` tokens, "merge" below: on a
    GPU the cond is a host wait, which costs a short call more than the context call it skips); None: ``FRESH``.
    q_prologue (the gated entry only): the q RMSNorm + RoPE as XLA fusions ("xla") or one Pallas
    kernel ("pallas": q_prologue.py; interpret mode off a GPU); None: ``Q_PROLOGUE``."""
    context: bool = True
    kv_capacity: Optional[int] = None
    fresh: Optional[str] = None
    q_prologue: Optional[str] = None


# ----------------------------------------------------------------------------------------------------------------
# What jax's cuDNN entry takes
# ----------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def kv_offset_unit(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Key tokens per kv-offset unit jax passes to cuDNN. jax's ``_fix_seqlen_offsets`` turns token offsets into
    element offsets; before jax PR 39521 it scaled the kv offsets by the QUERY heads (H Dh), G times the keys' own
    stride Hkv Dh. Probed on tiny arrays (shapes only): returns 1 (correct scaling) or G (then the key regions are
    aligned to G tokens and their offsets passed in units of G). Raises ValueError on anything else."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    class _Shape:
        def __init__(self, shape):
            self.shape = shape
    q = _Shape((1, 8, num_heads, head_dim))
    k = _Shape((1, 8, num_kv_heads, head_dim))
    lens = np.asarray([[1, 1]], np.int32)
    offs = np.asarray([[0, 1, 2]], np.int32)
    import inspect
    extra = {}
    if "layout" in inspect.signature(fa._fix_seqlen_offsets).parameters:     # a later jax may take the layout
        extra["layout"] = fa.AttentionLayout.BTNH.value
    with jax.ensure_compile_time_eval():
        _, _, qo, ko = fa._fix_seqlen_offsets(jnp.asarray(lens), jnp.asarray(lens), jnp.asarray(offs),
                                              jnp.asarray(offs), q, k, **extra)
        q_unit, k_unit = int(np.asarray(qo)[0, 1]), int(np.asarray(ko)[0, 1])
    if q_unit != num_heads * head_dim:
        raise ValueError(f"jax scales packed q offsets by {q_unit}, expected H Dh = {num_heads * head_dim}")
    if k_unit == num_kv_heads * head_dim:
        return 1
    if k_unit == num_heads * head_dim and num_heads % num_kv_heads == 0:
        return num_heads // num_kv_heads
    raise ValueError(f"jax scales packed kv offsets by {k_unit}: neither Hkv Dh nor H Dh")


def supports(*, platform: str, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
             hopper: Optional[bool] = None) -> Optional[str]:
    """Why cuDNN's packed fused attention cannot run these inputs (a sentence), or None when it can.
    platform "xla" / "interpret": the XLA stand-in (any platform, the dtypes of the reference). hopper: None asks
    the installed cuDNN and the device; True / False take the GPU as a Hopper one with cuDNN >= 9 or as an older
    one (the docs' table)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if platform in ("xla", "interpret"):
        return None
    if jnp.dtype(dtype) not in DTYPES:
        return f"cuDNN fused attention takes bfloat16 or float16, got {jnp.dtype(dtype).name}"
    if platform not in ("gpu", "cuda"):
        return f"platform {platform!r}: cuDNN fused attention needs a CUDA GPU"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim={head_dim}: cuDNN takes multiples of 8 up to 256 (Hopper)"
    if hopper is not None:
        return None if hopper else "cuDNN's packed (THD) layout needs compute capability >= 9.0 (Hopper)"
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
        if fa.check_cudnn_version() < 90000:
            return "cuDNN >= 9.0 is needed for the packed layout"
        if not fa.check_compute_capability("9.0"):
            return "cuDNN's packed (THD) layout needs compute capability >= 9.0 (Hopper)"
        kv_offset_unit(num_heads, num_kv_heads, head_dim)
    except Exception as err:  # noqa: BLE001 - any failure to probe means "cannot run here"
        return f"cuDNN fused attention unavailable: {type(err).__name__}: {err}"
    return None


# ----------------------------------------------------------------------------------------------------------------
# The packing: per-stream metadata, the K/V gather, per-token indices
# ----------------------------------------------------------------------------------------------------------------
class Packing(NamedTuple):
    """Device-side layout of one call (all int32 / bool, static shapes).

    live     [N]  the stream attends (valid slot, length > 0, slot holds >= length keys, region fits in K)
    ctx      [N]  context keys (0 where not live, or where config.context is False)
    length   [N]  new tokens (0 where not live)
    kv_start [N]  first buffer row of the stream's region ([ctx padded to A | new padded to A])
    ctx_pad  [N]  ctx rounded up to A
    rows     [K]  flat pool row (page * Ps + offset) each buffer row gathers; P * Ps (-> zeros) for unused rows
    """
    live: jax.Array
    ctx: jax.Array
    length: jax.Array
    kv_start: jax.Array
    ctx_pad: jax.Array
    rows: jax.Array


def default_capacity(num_tokens: int, num_streams: int, num_pages: int, page_size: int, width: int,
                     align: int, context: bool) -> int:
    """K: static rows of the packed K/V buffer."""
    pad = 2 * num_streams * (align - 1)
    rows = num_tokens if not context else min(num_streams * width * page_size, num_pages * page_size)
    return -(-max(1, rows + pad) // align) * align


def build_packing(page_table, slot_lens, cu_seqlens, slot_ids, *, num_pages: int, page_size: int,
                  capacity: int, align: int, context: bool, new_rows: bool = True) -> Packing:
    """The per-stream regions of the packed K/V buffer and the pool row each buffer row reads (see Packing).
    new_rows False: the regions hold the context only ([ctx padded to A]; ``prefill_direct`` takes the new
    tokens' K/V from the projection)."""
    s_count, width = page_table.shape
    cu = cu_seqlens.astype(jnp.int32)
    ids = slot_ids.astype(jnp.int32)
    n = ids.shape[0]
    length = jnp.maximum(cu[1:] - cu[:-1], 0)
    has_slot = (ids >= 0) & (ids < s_count)
    slot = jnp.clip(ids, 0, s_count - 1)
    total = jnp.where(has_slot, slot_lens.astype(jnp.int32)[slot], 0)
    live = has_slot & (length > 0) & (total >= length) & (total <= width * page_size)
    if not context:
        live = live & (total == length)                  # fresh streams only; the others get zero rows
    ctx = jnp.where(live, total - length, 0)
    length = jnp.where(live, length, 0)
    a = int(align)
    ctx_pad = (ctx + a - 1) // a * a
    region = ctx_pad + ((length + a - 1) // a * a if new_rows else 0)
    kv_end = jnp.cumsum(region)
    kv_start = kv_end - region
    live = live & ((kv_end <= capacity) | (region == 0))      # an empty region (context-only buffer) always fits
    ctx, length = jnp.where(live, ctx, 0), jnp.where(live, length, 0)
    # buffer row -> (stream, key position in its slot)
    r = jnp.arange(capacity, dtype=jnp.int32)
    st = jnp.minimum(count_le(kv_end, capacity), n - 1)          # searchsorted(kv_end, r, "right")
    local = r - kv_start[st]
    in_ctx = local < ctx_pad[st]
    pos = jnp.where(in_ctx, local, ctx[st] + local - ctx_pad[st])
    valid = (r < kv_end[-1]) & live[st] & jnp.where(in_ctx, local < ctx[st],
                                                    new_rows & (local - ctx_pad[st] < length[st]))
    col = jnp.clip(pos // page_size, 0, width - 1)
    page = page_table.astype(jnp.int32)[slot[st], col]
    valid = valid & (page >= 0) & (page < num_pages)
    rows = jnp.where(valid, page * page_size + pos % page_size, num_pages * page_size)
    return Packing(live=live, ctx=ctx.astype(jnp.int32), length=length.astype(jnp.int32),
                   kv_start=kv_start.astype(jnp.int32), ctx_pad=ctx_pad.astype(jnp.int32), rows=rows)


def gather_kv(k_pages, v_pages, rows):
    """[K, Hkv, Dh] K and V of the buffer rows (zeros where rows == P * Ps)."""
    p, ps, hkv, dh = k_pages.shape
    flat_k = k_pages.reshape(p * ps, hkv, dh)
    flat_v = v_pages.reshape(p * ps, hkv, dh)
    return (jnp.take(flat_k, rows, axis=0, mode="fill", fill_value=0),
            jnp.take(flat_v, rows, axis=0, mode="fill", fill_value=0))


class Segments(NamedTuple):
    """One cuDNN call's segments in token units: [M] lengths (-1: no segment) and [M + 1] offsets (-1: none; the
    entry after the last live one is the end). Dropped entries are packed out by jax (live ones shifted left), so
    live segment n is segment ``rank[n]`` of the call's statistics."""
    q_len: jax.Array
    kv_len: jax.Array
    q_off: jax.Array
    kv_off: jax.Array
    rank: jax.Array


def _segments(keep, q_start, q_len, kv_off, kv_len, *, m: int, q_end: int, kv_end: int) -> Segments:
    n = keep.shape[0]
    pad = m - n

    def lens(x):
        return jnp.concatenate([jnp.where(keep, x, -1), jnp.full((pad,), -1, jnp.int32)]).astype(jnp.int32)[None]

    def offs(x, end):
        return jnp.concatenate([jnp.where(keep, x, -1), jnp.full((pad,), -1, jnp.int32),
                                jnp.full((1,), end, jnp.int32)]).astype(jnp.int32)[None]
    rank = jnp.cumsum(keep.astype(jnp.int32)) - 1
    return Segments(q_len=lens(q_len), kv_len=lens(kv_len), q_off=offs(q_start, q_end), kv_off=offs(kv_off, kv_end),
                    rank=rank.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------------------------
# The fused attention of a set of segments: cuDNN, or the XLA stand-in
# ----------------------------------------------------------------------------------------------------------------
def segments_xla(q, k, v, seg: Segments, *, causal: bool, scale: float, stats: bool = True):
    """XLA stand-in of ``segments_cudnn`` with the same semantics: q [T, H, Dh], k, v [K, Hkv, Dh]; segment m
    (live entries packed to the left) maps query rows q_off .. q_off + q_len to keys kv_off .. kv_off + kv_len,
    top-left causal when ``causal``. Returns (o [T, H, Dh] in q's dtype, NaN on rows of no segment, as cuDNN
    leaves them unwritten; lse [M, H, T] fp32, natural log, NaN past each segment's rows)."""
    t, h, dh = q.shape
    kc, hkv, _ = k.shape
    m = seg.q_len.shape[1]
    keep = seg.q_len[0] >= 0
    idx = jnp.nonzero(keep, size=m, fill_value=m)[0]                      # live segments first (jax's shift)

    def pick(x, fill):
        return jnp.take(x[0], idx, mode="fill", fill_value=fill)
    q_len, kv_len, q_off, kv_off = pick(seg.q_len, 0), pick(seg.kv_len, 0), pick(seg.q_off, t), pick(seg.kv_off, kc)
    rows = jnp.arange(t, dtype=jnp.int32)
    cols = jnp.arange(kc, dtype=jnp.int32)
    in_seg = (rows[None] >= q_off[:, None]) & (rows[None] < (q_off + q_len)[:, None])       # [M, T]
    seg_of = jnp.argmax(in_seg, axis=0)
    covered = jnp.any(in_seg, axis=0)
    qi = rows - q_off[seg_of]
    kj = cols[None] - kv_off[seg_of][:, None]                                                 # [T, K]
    mask = covered[:, None] & (kj >= 0) & (kj < kv_len[seg_of][:, None])
    if causal:
        mask = mask & (kj <= qi[:, None])
    qg = q.reshape(t, hkv, h // hkv, dh)
    s = jnp.einsum("tkgd,skd->tkgs", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.where(mask[:, None, None], jnp.exp(s - mx_safe), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("tkgs,skd->tkgd", (e / jnp.where(den > 0, den, 1.0)).astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    lse = (mx_safe + jnp.log(den)).reshape(t, h)                                              # -inf: no key
    o = jnp.where(covered[:, None, None], o.reshape(t, h, dh), jnp.nan).astype(q.dtype)
    if not stats:
        return o, None
    # stats [M, H, T]: row j of segment m is token q_off[m] + j ("segment"), or row t is token t ("packed")
    if STATS_ROWS == "segment":
        tok = q_off[:, None] + rows[None]                                                     # [M, T]
        ok = rows[None] < q_len[:, None]
    else:
        tok = jnp.broadcast_to(rows[None], (m, t))
        ok = (rows[None] >= q_off[:, None]) & (rows[None] < (q_off + q_len)[:, None])
    stats = jnp.take(lse, jnp.clip(tok, 0, t - 1), axis=0)                                    # [M, T, H]
    stats = jnp.where(ok[..., None], stats, jnp.nan)
    return o, jnp.transpose(stats, (0, 2, 1)).astype(jnp.float32)


def segments_cudnn(q, k, v, seg: Segments, *, causal: bool, scale: float, unit: int, stats: bool = True):
    """cuDNN fused flash attention over packed segments (see ``segments_xla``). unit: ``kv_offset_unit``.
    stats False: no statistics (returned as None; cuDNN then neither writes nor clears them)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    kv_off = jnp.where(seg.kv_off >= 0, seg.kv_off // unit, -1) if unit > 1 else seg.kv_off
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    res = fa.dot_product_attention(q[None], k[None], v[None], q_seqlen=seg.q_len, kv_seqlen=seg.kv_len,
                                   q_offsets=seg.q_off, kv_offsets=kv_off, scale=float(scale),
                                   mask_type=mask, qkv_layout="BTNH", return_residual=stats)
    if not stats:
        return (res[0] if isinstance(res, (tuple, list)) else res)[0], None
    o, st = res
    return o[0], st


# ----------------------------------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------------------------------
def _row_lse(stats, rank, stream, j):
    """stats [M, H, T] -> [T, H] for token rows (segment rank[stream], row j inside it, or the token's own index:
    ``STATS_ROWS``)."""
    m, _, t = stats.shape
    seg = jnp.clip(rank[stream], 0, m - 1)
    row = jnp.clip(j, 0, t - 1) if STATS_ROWS == "segment" else jnp.arange(t, dtype=jnp.int32)
    lse = stats[seg, :, row]
    return lse if STATS_TO_LN == 1.0 else lse * STATS_TO_LN


def paged_attention_prefill_cudnn(q, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *,
                                  scale: float, config: Optional[CudnnConfig] = None, impl: str = "cudnn",
                                  align: Optional[int] = None):
    """Prefill of stacked streams through cuDNN's packed fused attention (module docstring). Under jit; returns
    o [T, H, Dh] in q's dtype, zero rows for padding tokens and streams that read nothing. align: the key-region
    alignment A (None: ``kv_offset_unit`` for "cudnn", 1 for "xla"; tests set it to run the aligned layout on
    the stand-in)."""
    config = config or CudnnConfig()
    t, h, dh = q.shape
    p, ps, hkv, _ = k_pages.shape
    s_count, width = page_table.shape
    n = slot_ids.shape[0]
    if impl not in ("cudnn", "xla"):
        raise ValueError(f"impl must be 'cudnn' or 'xla', got {impl!r}")
    if n == 0 or t == 0:
        return jnp.zeros(q.shape, q.dtype)
    unit = kv_offset_unit(h, hkv, dh) if impl == "cudnn" else 1
    if align is None:
        align = unit
    elif align % unit:
        raise ValueError(f"align={align} must be a multiple of jax's kv offset unit {unit}")
    cap = config.kv_capacity or default_capacity(t, n, p, ps, width, align, config.context)
    pk = build_packing(page_table, slot_lens, cu_seqlens, slot_ids, num_pages=p, page_size=ps, capacity=cap,
                       align=align, context=config.context)
    k, v = gather_kv(k_pages, v_pages, pk.rows)
    cu = cu_seqlens.astype(jnp.int32)
    m = max(n, 2)                       # jax takes the packed path only with more than one segment per batch row
    attend = (functools.partial(segments_cudnn, unit=unit) if impl == "cudnn" else segments_xla)
    seg_new = _segments(pk.live, cu[:-1], pk.length, pk.kv_start + pk.ctx_pad, pk.length, m=m, q_end=t, kv_end=cap)
    o1, st1 = attend(q, k, v, seg_new, causal=True, scale=scale)
    stream, j = token_streams(cu, t)
    row_live = (jnp.arange(t) < cu[-1]) & pk.live[stream]
    if not config.context:
        return jnp.where(row_live[:, None, None], o1, jnp.zeros((), q.dtype))
    has_ctx = pk.live & (pk.ctx > 0)
    seg_ctx = _segments(has_ctx, cu[:-1], pk.length, pk.kv_start, pk.ctx, m=m, q_end=t, kv_end=cap)
    o2, st2 = attend(q, k, v, seg_ctx, causal=False, scale=scale)
    return _merge(o1, st1, seg_new, o2, st2, seg_ctx, stream, j, row_live, has_ctx).astype(q.dtype)


def _merge(o1, st1, seg_new: Segments, o2, st2, seg_ctx: Segments, stream, j, row_live, has_ctx):
    """The two calls' outputs merged per row by their LSEs: fp32 [T, H, Dh], zero rows where not row_live."""
    l1 = _row_lse(st1, seg_new.rank, stream, j)                                   # [T, H]
    l2 = _row_lse(st2, seg_ctx.rank, stream, j)
    use2 = (row_live & has_ctx[stream])[:, None]
    l1 = jnp.where(row_live[:, None], l1, 0.0)
    l2 = jnp.where(use2, l2, -jnp.inf)
    mx = jnp.maximum(l1, l2)
    w1 = jnp.exp(l1 - mx)
    w2 = jnp.where(use2, jnp.exp(l2 - mx), 0.0)
    inv = 1.0 / (w1 + w2)
    o1f = jnp.where(row_live[:, None, None], o1.astype(jnp.float32), 0.0)
    o2f = jnp.where(use2[..., None], o2.astype(jnp.float32), 0.0)
    o = (o1f * (w1 * inv)[..., None] + o2f * (w2 * inv)[..., None])
    return jnp.where(row_live[:, None, None], o, 0.0)


FRESH_MODES = ("cond", "merge", "auto")


def prefill_direct(q, k_new, v_new, k_pages, v_pages, page_table, slot_lens, cu_seqlens, slot_ids, *,
                   scale: float, gate=None, config: Optional[CudnnConfig] = None, impl: str = "cudnn"):
    """Prefill of stacked streams with the new tokens' K/V taken as they come from the projection (no gather of
    them back from the pages). Under jit.

    q [T, H, Dh]; k_new, v_new [T, Hkv, Dh]: the keys / values this call wrote to the pages, in token order
    (token t's are row t; the K/V buffer of the causal call IS them, with the query offsets cu[:-1] as key
    offsets); k_pages, v_pages [P, Ps, Hkv, Dh] and the rest as ``paged_attention_prefill_cudnn``: only the
    CONTEXT keys (positions < slot_lens[slot] - len_n) are gathered from the pages, into a context-only buffer.
    gate [T, H, Dh], or q_proj's raw output qg [T, C] (C >= H 2 Dh: head h's gate at columns h 2 Dh + Dh ..,
    sliced inside the branch that uses it, so that XLA fuses the slice into the last pass instead of
    materializing it as an operand of the cond), or None: the output is ``o * sigmoid(gate)`` (Qwen3-Next's
    output gate, in the same pass as the merge: o rounded to q's dtype, times sigmoid(gate) rounded to it).
    config.fresh: "cond" runs, when no live stream has context, the causal call alone (no statistics, no context
    gather, no merge) through ``lax.cond``; "merge" always runs both calls; "auto" (the default) "cond" from
    ``DEVICE_BRANCH_MIN_TOKENS`` tokens, else "merge". config.context False: the causal call only (a stream with
    context gets zero rows). Rows of padding tokens and of streams that read nothing are zero (k_new / v_new
    rows outside live streams are zeroed before the call: cuDNN may load a tile past a segment's end).
    Returns o [T, H, Dh] in q's dtype. Needs jax's per-kv-head packed offsets (``kv_offset_unit`` 1: jax >=
    0.11 on the H200) for impl "cudnn"."""
    config = config or CudnnConfig()
    if config.fresh is None:
        config = config._replace(fresh=FRESH)
    t, h, dh = q.shape
    p, ps, hkv, _ = k_pages.shape
    s_count, width = page_table.shape
    n = slot_ids.shape[0]
    if impl not in ("cudnn", "xla"):
        raise ValueError(f"impl must be 'cudnn' or 'xla', got {impl!r}")
    if config.fresh not in FRESH_MODES:
        raise ValueError(f"CudnnConfig.fresh must be one of {FRESH_MODES}, got {config.fresh!r}")
    if config.fresh == "auto":
        config = config._replace(fresh="cond" if q.shape[0] >= DEVICE_BRANCH_MIN_TOKENS else "merge")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if tuple(x.shape) != (t, hkv, dh):
            raise ValueError(f"{name} must be [T, Hkv, Dh] = {[t, hkv, dh]}, got {list(x.shape)}")
    if gate is not None and tuple(gate.shape) != (t, h, dh) and not (gate.ndim == 2 and gate.shape[0] == t
                                                                     and gate.shape[1] >= 2 * h * dh):
        raise ValueError(f"gate must be [T, H, Dh] = {[t, h, dh]} or q_proj's output [T, C >= {2 * h * dh}], got "
                         f"{list(gate.shape)}")
    if n == 0 or t == 0:
        return jnp.zeros(q.shape, q.dtype)
    unit = kv_offset_unit(h, hkv, dh) if impl == "cudnn" else 1
    if unit != 1:
        raise ValueError(f"prefill_direct needs jax's per-kv-head packed offsets (kv_offset_unit 1), this jax "
                         f"scales them by {unit}: use paged_attention_prefill_cudnn (the gather path)")
    cap = config.kv_capacity or default_capacity(0, n, p, ps, width, 1, True)
    pk = build_packing(page_table, slot_lens, cu_seqlens, slot_ids, num_pages=p, page_size=ps, capacity=cap,
                       align=1, context=config.context, new_rows=False)
    cu = cu_seqlens.astype(jnp.int32)
    stream, j = token_streams(cu, t)
    row_live = (jnp.arange(t) < cu[-1]) & pk.live[stream]
    zero = jnp.zeros((), q.dtype)
    kn = jnp.where(row_live[:, None, None], k_new.astype(k_pages.dtype), 0).astype(k_pages.dtype)
    vn = jnp.where(row_live[:, None, None], v_new.astype(v_pages.dtype), 0).astype(v_pages.dtype)
    m = max(n, 2)                       # jax takes the packed path only with more than one segment per batch row
    attend = (functools.partial(segments_cudnn, unit=unit) if impl == "cudnn" else segments_xla)
    seg_new = _segments(pk.live, cu[:-1], pk.length, cu[:-1], pk.length, m=m, q_end=t, kv_end=t)
    has_ctx = pk.live & (pk.ctx > 0)

    def finish(o, g):                   # o [T, H, Dh] (zero rows where not live) -> q's dtype, gated
        o = o.astype(q.dtype)
        if g is not None:
            if g.ndim == 2:                 # q_proj's raw output: head h's gate at columns h 2 Dh + Dh ..
                g = g[:, :2 * h * dh].reshape(t, h, 2 * dh)[..., dh:]
            o = o * jax.nn.sigmoid(g.astype(jnp.float32)).astype(q.dtype)
        return o

    def fresh(q, kn, vn, k_pages, v_pages, g):
        o1, _ = attend(q, kn, vn, seg_new, causal=True, scale=scale, stats=False)
        return finish(jnp.where(row_live[:, None, None], o1, zero), g)

    def with_context(q, kn, vn, k_pages, v_pages, g):
        o1, st1 = attend(q, kn, vn, seg_new, causal=True, scale=scale)
        # the buffer rows [K] built here, not outside: a value the branch closes over is computed before the cond
        rows = build_packing(page_table, slot_lens, cu_seqlens, slot_ids, num_pages=p, page_size=ps,
                             capacity=cap, align=1, context=config.context, new_rows=False).rows
        kc, vc = gather_kv(k_pages, v_pages, rows)
        seg_ctx = _segments(has_ctx, cu[:-1], pk.length, pk.kv_start, pk.ctx, m=m, q_end=t, kv_end=cap)
        o2, st2 = attend(q, kc, vc, seg_ctx, causal=False, scale=scale)
        return finish(_merge(o1, st1, seg_new, o2, st2, seg_ctx, stream, j, row_live, has_ctx), g)

    args = (q, kn, vn, k_pages, v_pages, gate)
    if not config.context:
        return fresh(*args)
    if config.fresh == "merge":
        return with_context(*args)
    return jax.lax.cond(jnp.any(has_ctx), with_context, fresh, *args)
