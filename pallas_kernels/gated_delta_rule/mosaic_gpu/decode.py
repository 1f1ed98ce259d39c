"""Mosaic GPU (Hopper) decode kernel: the per-token gated delta rule over a state-slot pool, in place (issue 14's
"decode kernel at HBM speed"), in two forms (``MosaicDecodeConfig.transfer``).

The same op as :mod:`decode` (the Pallas Triton kernel; same arguments, same contract), for one token per stream
(T = 1). Per work item (stream n, value head h, value block vb) with its [K, BV] fp32 state tile S (from
``pool[slot_ids[n], h, :, vb]``), q, k [K] (key head h // (Hv / Hk)), v [BV] and a = exp(g):

    sk = S^T k,  sq = S^T q                   (fp32, one reduction each over K)
    delta = beta (v - a sk)
    o = scale (a sq + (q . k) delta)          (= S'^T (scale q))
    S' = a S + k delta^T                      (stored in place)

optionally with q, k L2-normalised in fp32 first (``x * rsqrt(sum x^2 + 1e-6)``), the same numbers as decode.py's
``fused_output`` form up to fp32 rounding. An id outside [0, S) reads zeros and its store is dropped; a fresh stream
(has_initial_state False) starts from zeros whatever its slot holds (a select, so a stale NaN never leaks). Other
slots are never touched.

``transfer="direct"`` (:data:`DEFAULT_CONFIG`, what the op's "auto" runs on Hopper): one CTA (one
warpgroup) per item, value block fastest, then head, then stream. The tile goes from global memory straight into
registers in a layout chosen for this op (:func:`rows_layout`: each thread 16 rows x 4 columns at K = 128, BV = 64,
so it keeps 16 rows of q and k where the Triton kernel's layout keeps 32), is updated there and stored back from
them; q, k, v and o move the same way, the scalars are read at the top of the CTA. 152 registers a thread, 3 CTAs an
SM, and on the H200 as fast as its own copy twin (``copy_only``): 0.2777 ms at N256-Hk16-Hv32 (3.87 TB/s of state
bytes, 81% of 4.8) against the Triton kernel's 0.2981 (249 registers, 4 two-warp programs an SM).

``transfer="tma"`` (sessions 7-8; the dataclass's defaults): a persistent grid of P CTAs (one warpgroup each;
P = SMs x ``ctas_per_sm``) walks the items b = p, p + P, ...; each CTA keeps a ring of ``stages`` shared-memory
slots, each holding one item's tile, q, k and v, TMA-loaded. While item i is computed, the loads of items
i + 1 .. i + stages - 2 are in flight; item i's store is issued asynchronously, and slot (i - 1) % stages is refilled
with item i - 1 + stages once the previous store has read it (``wait_smem_to_gmem(1, wait_read_only=True)`` after
item i's store is issued; ``refill="early"``: before item i's wait, so stages - 1 loads are in flight while it
computes). Scalars are read one trip before their item is computed and used only then (``defer_scalars``). The ring
alone (``copy_only``) runs 0.307-0.320 ms at N256: no arithmetic change gets it to the copy's speed (NOTES.md,
"Session 8: Mosaic decode").

Shape legend: N streams, S slots, Hk / Hv key / value heads, K / V head dims, BV value block, P CTAs.

    q, k [N, 1, Hk, K]; v [N, 1, Hv, V]; g, beta [N, 1, Hv] (or the raw a, b [N, 1, Hk, Ca] with
    ``decode.RawGates``); pool [S, Hv, K, V] fp32; slot_ids, has_initial_state [N]
    ->  o [N, 1, Hv, V] in v's dtype, pool (updated in place: a mutable ref aliased in and out of the kernel)

Scope (:func:`fallback_reason` names what it refuses; decode.py then runs the Triton kernel): one token per
stream, K and V in {64, 128} with BV | V, q and k of one dtype, an sm_90 GPU; the TMA ring also needs q / k / v rows
of whole multiples of 128 bytes and its ring to fit in shared memory. Mosaic GPU kernels do not compile on this
repo's CPU jax (0.10.2); they do run in its GPU interpret mode (``interpret=True``: the kernel body itself, TMA
copies, barriers and the ring, with plain loads in place of the register layouts), which the CPU tests use, and
they lower for CUDA on the CPU (the layout and transfer checks of Mosaic GPU run there). :func:`decode_reference` is
the jnp twin of the tile algebra, checked against float64.

Where it runs: the op's dispatch table (``api.py``, rows "mosaic_gpu.decode" / "mosaic_gpu.decode.interpret")
sends the decode calls of "auto" and "mosaic_gpu" (a Hopper GPU) and of "mosaic_gpu_interpret" (interpret mode)
here, the plain op's and the layer's fused decode step alike, where :func:`fallback_reason` is None.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mosaic_gpu

F32 = jnp.float32
L2_EPS = 1e-6            # decode.L2_EPS
HEAD_DIMS = (64, 128)
TMA_UNIT = 128           # bytes: every TMA load here moves a multiple of the warpgroup size
SMEM_BUDGET = 220 * 1024
#: shared memory for the cross-warp step of the K reductions (Mosaic's default 2 KB splits each [K, BV] reduction
#: into more rounds: 37 warpgroup barriers a CTA program at BV 64 against 25 with 8 KB, counted in the lowered module)
REDUCTION_SCRATCH = 8192


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Launch parameters of the Mosaic GPU decode kernel.

    block_v: value columns of one state tile (64 or 128; min(block_v, V) must divide V). A [K, BV] fp32 tile is
      32 KB at K = 128, BV = 64.
    stages: shared memory ring depth (>= 2): up to stages - 2 tile loads in flight while one tile is computed and
      the previous one is stored.
    ctas_per_sm: CTAs of the persistent grid per SM (P = SMs x ctas_per_sm; the ring of each must fit in shared
      memory beside the others).
    programs: P > 0 fixes the grid size instead (tests, sweeps).
    layout: "wgmma" (the tile in registers in the WGMMA layout: each thread 4 rows x BV / 4 columns; the K
      reductions are 4 in-thread rows, 3 lane shuffles and a cross-warp step through shared memory; the tile in
      swizzled shared memory) or "rows" (transfer="direct" only, :func:`rows_layout`: each thread R consecutive
      rows x 4 consecutive columns, min(32, BV / 4) lanes across the columns so that one load instruction of a
      warp reads whole 256-byte row pieces (BV 64), the rest of the lanes and the 4 warps down K; R = 16 at
      K = 128, BV = 64) or "strided_rows" (the same, each thread every lk-th row of its warp's instead, so that
      one load instruction reads neighbouring rows: the Triton kernel's arrangement of the tile).
    entry: "kernel" (``pl.kernel`` over a ``plgpu.Mesh``, the pool a mutable ref closed over: the API Pallas keeps)
      or "pallas_call" (the pool an aliased operand, ``input_output_aliases``; deprecated for Mosaic GPU, kept as
      the second way in should the first fail on the GPU's jax; GPU only: interpret mode cannot read its grid).
    semantics: Mosaic GPU's lowering semantics, "lane" (arrays are per-thread register fragments in the layouts
      named here; the default of jax 0.10, and what the CPU lowering tests check) or "warpgroup" (layouts inferred;
      jax 0.11's default, where this kernel's scalar-predicate select does not lower: the first H200 run).
    copy_only: a measurement aid, not the op: every tile is stored back as loaded (o = 0), so the time is the ring's
      and the TMA path's alone (the kernel's ceiling; compare the XLA copy of the pool). True: the tile still goes
      through registers (shared memory -> registers -> shared memory, as the kernel does); "tma": it does not (TMA
      load, then TMA store of the same shared memory).
    swizzle: the state tile's shared-memory layout, 128-byte swizzled (True: what the WGMMA-layout register load
      needs; each TMA box row is then 128 bytes, [K, 32] fp32 columns) or plain (False: one [K, BV] box, rows of
      4 BV bytes; only with copy_only="tma", a measurement of the TMA box shape).
    defer_scalars: False: an item's scalars (slot id, has_initial_state, g / beta or the raw gates) are loaded a trip
      ahead and used at once (flags, clipping, the gate math: the warpgroup waits on those loads there); True: only
      loaded a trip ahead, used on the next trip (the refill's slot id too), so their latency overlaps an item.
      H200 (NOTES, session 8 run 2): with the layer's raw gates 0.329 / 0.0996 ms (N256 / N64) against 0.370 /
      0.1125 used at once; plain gates 0.321 / 0.098 against 0.317 / 0.104.
    transfer: how a state tile moves between the pool and registers. "tma" (the persistent TMA ring above) or
      "direct" (session 10): no ring and no shared memory for the tile; one CTA (one warpgroup) per item, the tile
      loaded from global memory straight into registers in ``layout`` and stored back from them, q / k / v and o
      likewise; stages, ctas_per_sm, programs, refill, swizzle and defer_scalars do not apply (the scalars are read
      at the top of the CTA, as the Triton kernel does). Why: the Triton kernel holds 249 registers a thread at
      2 warps (4 programs an SM, ncu on the H200) where its copy twin holds 138 (6 programs), since each thread
      keeps 32 rows of q and k beside its 32 x 4 tile elements; a layout with 16 consecutive rows a thread keeps 16.
    refill: when the previous item's slot is refilled, "late" (after this item is computed and its store issued:
      stages - 2 tile loads in flight while an item computes) or "early" (before this item's wait, as soon as the
      previous item's store has read its slot: stages - 1 loads in flight, at the cost of waiting on that read
      first).

    Defaults from the session-8 H200 sweeps (NOTES.md): ring depth 5 / 6, the early refill (+0.03 ms), BV 128 and 2
    CTAs per SM were no faster at N256 and slower at N64; deferred scalars won with the raw gates.
    """
    block_v: int = 64
    stages: int = 4
    ctas_per_sm: int = 1
    programs: int = 0
    layout: str = "wgmma"
    copy_only: bool = False
    entry: str = "kernel"
    semantics: str = "lane"
    refill: str = "late"
    swizzle: bool = True
    defer_scalars: bool = True
    transfer: str = "tma"

    def __post_init__(self):
        if self.block_v not in (64, 128):
            raise ValueError(f"MosaicDecodeConfig.block_v must be 64 or 128, got {self.block_v!r}")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"MosaicDecodeConfig.stages must be an int >= 2, got {self.stages!r}")
        if not isinstance(self.ctas_per_sm, int) or self.ctas_per_sm < 1:
            raise ValueError(f"MosaicDecodeConfig.ctas_per_sm must be an int >= 1, got {self.ctas_per_sm!r}")
        if not isinstance(self.programs, int) or self.programs < 0:
            raise ValueError(f"MosaicDecodeConfig.programs must be an int >= 0, got {self.programs!r}")
        if self.semantics not in SEMANTICS:
            raise ValueError(f"MosaicDecodeConfig.semantics must be one of {SEMANTICS}, got {self.semantics!r}")
        if self.entry not in ENTRIES:
            raise ValueError(f"MosaicDecodeConfig.entry must be one of {ENTRIES}, got {self.entry!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"MosaicDecodeConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"MosaicDecodeConfig.transfer must be one of {TRANSFERS}, got {self.transfer!r}")
        if self.layout != "wgmma" and self.transfer != "direct":
            raise ValueError(f"MosaicDecodeConfig.layout={self.layout!r} needs transfer='direct' (the TMA ring's tile "
                             "is read from swizzled shared memory in the WGMMA layout)")
        if self.transfer == "direct" and self.copy_only == "tma":
            raise ValueError("MosaicDecodeConfig.copy_only='tma' needs transfer='tma'")
        if self.refill not in REFILLS:
            raise ValueError(f"MosaicDecodeConfig.refill must be one of {REFILLS}, got {self.refill!r}")
        if self.copy_only not in (False, True, "tma"):
            raise ValueError(f"MosaicDecodeConfig.copy_only must be False, True or 'tma', got {self.copy_only!r}")
        if not self.swizzle and self.copy_only != "tma":
            raise ValueError("MosaicDecodeConfig.swizzle=False needs copy_only='tma' (the WGMMA-layout register load "
                             "of the tile needs the swizzled layout)")


LAYOUTS = ("wgmma", "rows", "strided_rows")
TRANSFERS = ("tma", "direct")
ENTRIES = ("kernel", "pallas_call")
SEMANTICS = ("lane", "warpgroup")
REFILLS = ("late", "early")
#: What the op's "auto" runs on Hopper: the direct transfer with the strided-rows layout
#: (session 10, H200, N256-Hk16-Hv32: 0.2777 ms against the Triton kernel's 0.2981 in one run (call 3); the
#: TMA ring's defaults took 0.2991 in call 2 beside Triton's 0.2993; N64 0.0758 against 0.0813; the layer's fused
#: decode step 0.122 against 0.132 (call 5); NOTES.md "Session 10"). The dataclass's own defaults stay the TMA
#: ring's, which the ring's tests name.
DEFAULT_CONFIG = MosaicDecodeConfig(transfer="direct", layout="strided_rows")


_plgpu = mosaic_gpu._plgpu          # the Pallas Mosaic GPU module, imported on first use
_num_sms = mosaic_gpu._num_sms      # this GPU's SM count (132 on an H200, and off a GPU)
is_hopper = mosaic_gpu.is_hopper    # whether the default device is an sm_90 GPU


def smem_bytes(kdim: int, block_v: int, stages: int, qk_itemsize: int, v_itemsize: int) -> int:
    """Shared memory of one CTA's ring: per stage the fp32 tile, q, k, v and the staged o."""
    return stages * (kdim * block_v * 4 + 2 * kdim * qk_itemsize + 2 * block_v * v_itemsize) + REDUCTION_SCRATCH + 1024


def fallback_reason(q, k, v, *, config: MosaicDecodeConfig = None, interpret: bool = False) -> Optional[str]:
    """Why the Mosaic GPU decode kernel cannot run this call (decode.py then runs the Triton kernel), or None.
    Shapes and dtypes only (works on tracers). ``interpret``: GPU interpret mode (no Hopper needed)."""
    cfg = config or DEFAULT_CONFIG
    if not interpret and not mosaic_gpu.is_hopper():
        return "the Mosaic GPU decode kernel needs an sm_90 (Hopper) GPU"
    n, t, _, kdim = q.shape
    vdim = v.shape[3]
    if t != 1:
        return f"the Mosaic GPU decode kernel runs one token per stream; got T = {t}"
    if n == 0:
        return "no streams (N = 0)"
    if kdim not in HEAD_DIMS or vdim not in HEAD_DIMS:
        return f"the Mosaic GPU decode kernel takes K, V in {HEAD_DIMS}; got K={kdim}, V={vdim}"
    if q.dtype != k.dtype:
        return f"q and k must share a dtype; got {q.dtype}, {k.dtype}"
    if cfg.transfer == "direct":                    # no TMA, no ring: plain vector loads and stores
        return None
    bv = min(cfg.block_v, vdim)
    if (kdim * jnp.dtype(q.dtype).itemsize) % TMA_UNIT or (bv * jnp.dtype(v.dtype).itemsize) % TMA_UNIT:
        return (f"q / k rows ({kdim} x {jnp.dtype(q.dtype).name}) and v blocks ({bv} x {jnp.dtype(v.dtype).name}) "
                f"must be multiples of {TMA_UNIT} bytes")
    need = smem_bytes(kdim, bv, cfg.stages, jnp.dtype(q.dtype).itemsize, jnp.dtype(v.dtype).itemsize)
    if need * cfg.ctas_per_sm > SMEM_BUDGET:
        return f"the ring needs {need} bytes x {cfg.ctas_per_sm} CTAs per SM, over {SMEM_BUDGET}"
    return None


_LOAD_IDX_OPTIONAL = None


def _load(ref, layout, optimized: bool = True):
    """plgpu.load with a register layout (jax 0.10 takes the index positionally, 0.11 deprecates it).
    ``optimized=False``: a plain per-thread transfer (what a load from global memory needs)."""
    global _LOAD_IDX_OPTIONAL
    plgpu = _plgpu()
    if _LOAD_IDX_OPTIONAL is None:
        param = inspect.signature(plgpu.load).parameters.get("idx")
        _LOAD_IDX_OPTIONAL = param is None or param.default is not inspect.Parameter.empty
    if _LOAD_IDX_OPTIONAL:
        return plgpu.load(ref, layout=layout, optimized=optimized)
    return plgpu.load(ref, (), layout=layout, optimized=optimized)


def rows_layout(kdim: int, block_v: int, strided: bool = False):
    """The "rows" register layout of a [K, BV] fp32 tile over one warpgroup (``MosaicDecodeConfig.layout``), as a
    Pallas Mosaic GPU layout: lv = min(32, BV / 4) lanes across the columns (4 consecutive columns each, one
    16-byte vector), lk = 32 / lv lanes and the 4 warps down K (each warp K / 4 rows), each thread R = K / (4 lk)
    rows: consecutive ones, or with ``strided`` ("strided_rows") every lk-th row of its warp's, so that the lk lane
    groups of one load instruction read neighbouring rows (the Triton kernel's own arrangement of this tile). Its
    K-reduced form (q, k [K]) holds R values a thread; its BV-reduced form (v, o, S^T k [BV]) 4."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    lv = min(32, block_v // 4)
    lk = 32 // lv
    rows = kdim // (4 * lk)
    if rows < 1 or kdim % (4 * lk):
        raise ValueError(f"rows_layout: K = {kdim} does not split over 4 warps x {lk} lanes")
    if strided:     # tiled [.., 4 warps, .., R rows, .., lk lanes, lv lanes, .., 4]
        tiled = fa.TiledLayout(fa.Tiling(((kdim, block_v), (kdim // 4, block_v), (lk, block_v), (1, 4))),
                               warp_dims=(-8,), lane_dims=(-4, -3), vector_dim=-1, _check_canonical=False)
    else:           # tiled [.., 4 warps, .., lk lanes, .., lv lanes, R rows, .., 4]
        tiled = fa.TiledLayout(fa.Tiling(((kdim, block_v), (kdim // 4, block_v), (rows, block_v), (rows, 4))),
                               warp_dims=(-8,), lane_dims=(-6, -3), vector_dim=-1, _check_canonical=False)
    tiled = tiled.canonicalize()
    return _plgpu().Layout.TILED(tiled.tiling, warp_dims=tiled.warp_dims, lane_dims=tiled.lane_dims,
                                 vector_dim=tiled.vector_dim)


def _tile_smem(shape, swizzled: bool):
    """fp32 [stages, K, BV] ring of state tiles: tiled and swizzled (bank-conflict-free WGMMA-layout loads)."""
    plgpu = _plgpu()
    if not swizzled:
        return plgpu.SMEM(shape, F32)
    swizzle = plgpu.find_swizzle(shape[-1] * 32)
    return plgpu.SMEM(shape, F32, transforms=(plgpu.TilingTransform((8, swizzle // 4)),
                                              plgpu.SwizzleTransform(swizzle)))


def _softplus(x):
    """max(x, 0) + log1p(exp(-|x|)) with log1p(y) = log(u) y / (u - 1), u = 1 + y (exact where u rounds to 1; the
    Mosaic GPU lowering has no log1p)."""
    y = jnp.exp(-jnp.abs(x))
    u = 1.0 + y
    log1p = jnp.where(u == 1.0, y, jnp.log(u) * (y / jnp.where(u == 1.0, 1.0, u - 1.0)))
    return jnp.maximum(x, 0.0) + log1p


def _gate_loads(g_ref, beta_ref, gate_refs, *, n, h, group):
    """The global loads behind stream n, value head h's gates, as loaded: (g, beta) or, with raw gates,
    (a, b, A_log, dt_bias)."""
    if gate_refs is None:
        return g_ref[n, 0, h], beta_ref[n, 0, h]
    alog_ref, dtb_ref, a_off, b_off = gate_refs
    hk, j = h // group, lax.rem(h, group)
    return g_ref[n, 0, hk, a_off + j], beta_ref[n, 0, hk, b_off + j], alog_ref[h], dtb_ref[h]


def _gate_math(loaded):
    """(g, beta) fp32 from :func:`_gate_loads`' values (see decode._read_gates)."""
    if len(loaded) == 2:
        return loaded[0].astype(F32), loaded[1].astype(F32)
    a, b, alog, dtb = (x.astype(F32) for x in loaded)
    g = -jnp.exp(alog) * _softplus(a + dtb)
    return g, 1.0 / (1.0 + jnp.exp(-b))


def _gates(g_ref, beta_ref, gate_refs, *, n, h, group):
    """(g, beta) fp32 scalars of stream n, value head h."""
    return _gate_math(_gate_loads(g_ref, beta_ref, gate_refs, n=n, h=h, group=group))


def _dims(q, v, pool, cfg, raw_gates, interpret):
    """What both transfers read off the call: (n, kdim, hv, vdim, num_slots, group, bv, nvb, total, gate_offsets,
    interp) with bv the value block (checked to divide V), total the N Hv V / BV items, gate_offsets the raw gates'
    (a, b) columns or None, interp the interpret-mode parameters or False."""
    n, _, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    bv = min(cfg.block_v, vdim)
    if vdim % bv:
        raise ValueError(f"MosaicDecodeConfig.block_v ({cfg.block_v}) must divide V = {vdim}")
    gate_offsets = None if raw_gates is None else (int(raw_gates.a_offset), int(raw_gates.b_offset))
    interp = False                                  # GPU; interpret mode: InterpretGPUParams
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interp = InterpretGPUParams()
    return (n, kdim, hv, vdim, pool.shape[0], hv // hk, bv, vdim // bv, n * hv * (vdim // bv), gate_offsets,
            interp)


def _operands(slot_ids, has_initial_state, q, k, v, g, beta, raw_gates):
    """The kernels' operands, in their refs' order: ids, flags (int32), q, k, v, g, beta[, A_log, dt_bias]."""
    operands = [slot_ids.astype(jnp.int32), has_initial_state.astype(jnp.int32), q, k, v, g, beta]
    if raw_gates is not None:
        operands += [raw_gates.a_log, raw_gates.dt_bias]
    return operands


def _compiler_params(cfg):
    """Both transfers' Mosaic GPU compiler parameters: the K reductions' cross-warp scratch, the lowering semantics."""
    plgpu = _plgpu()
    semantics = dict(lane=plgpu.LoweringSemantics.Lane, warpgroup=plgpu.LoweringSemantics.Warpgroup)[cfg.semantics]
    return plgpu.CompilerParams(reduction_scratch_bytes=REDUCTION_SCRATCH, lowering_semantics=semantics)


def _take_gate_refs(refs, gate_offsets):
    """(gate_refs, the other refs) of a kernel body's refs after beta's: with raw gates (``gate_offsets`` not None)
    the first two are A_log and dt_bias, and gate_refs is (A_log, dt_bias, a column, b column) for :func:`_gates`."""
    refs = list(refs)
    if gate_offsets is None:
        return None, refs
    return (refs.pop(0), refs.pop(0)) + gate_offsets, refs


def _tile_update(s, qv, kv, vv, g, beta, *, scale: float, use_qk_l2norm: bool, bcast):
    """(o [BV], new_state) of one tile by the module docstring's formulas, in fp32: s the tile as read (zeros for
    a fresh stream), qv, kv [K] and vv [BV] as loaded, g, beta fp32 scalars. ``new_state()`` traces S' [K, BV]
    where it is called (the direct transfer calls it inside its store's ``pl.when``, the ring right away).
    ``bcast(x, dims)`` broadcasts a [K] (dims [0]) or [BV] (dims [1]) vector to the tile's shape (and register
    layout, where the lowering asks)."""
    qv, kv, vv = qv.astype(F32), kv.astype(F32), vv.astype(F32)
    if use_qk_l2norm:
        qv = qv * lax.rsqrt(jnp.sum(qv * qv) + L2_EPS)
        kv = kv * lax.rsqrt(jnp.sum(kv * kv) + L2_EPS)
    a = jnp.exp(g)
    kb, qb = bcast(kv, [0]), bcast(qv, [0])
    sk = jnp.sum(s * kb, axis=0)                    # [BV]  S^T k
    sq = jnp.sum(s * qb, axis=0)                    # [BV]  S^T q
    delta = beta * (vv - a * sk)
    o = scale * (a * sq + jnp.sum(qv * kv) * delta)
    return o, lambda: a * s + kb * bcast(delta, [1])


def fused_recurrent_slots_mosaic(q, k, v, g, beta, *, pool, slot_ids, has_initial_state, scale: float,
                                 use_qk_l2norm: bool, raw_gates=None, config: MosaicDecodeConfig = None,
                                 interpret: bool = False):
    """Runs the Mosaic GPU decode kernel (shapes in the module docstring; the caller has checked
    :func:`fallback_reason`). raw_gates: None or ``decode.RawGates`` (g, beta are then the raw a, b
    [N, 1, Hk, Ca]). Returns (o [N, 1, Hv, V] in v's dtype, the updated pool [S, Hv, K, V] fp32)."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    cfg = config or DEFAULT_CONFIG
    if cfg.transfer == "direct":
        return _slots_direct(q, k, v, g, beta, pool=pool, slot_ids=slot_ids, has_initial_state=has_initial_state,
                             scale=scale, use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates, cfg=cfg,
                             interpret=interpret)
    n, kdim, hv, vdim, num_slots, group, bv, nvb, total, gate_offsets, interp = _dims(q, v, pool, cfg, raw_gates,
                                                                                    interpret)
    programs = min(cfg.programs or _num_sms() * cfg.ctas_per_sm, total)
    trips = -(-total // programs)
    stages = cfg.stages
    scale = float(scale)
    WGMMA = plgpu.Layout.WGMMA
    ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)
    params = _compiler_params(cfg)

    def body(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs):
        gate_refs, refs = _take_gate_refs(refs, gate_offsets)
        pool_ref, o_ref, s_buf, q_buf, k_buf, v_buf, o_buf, bar = refs
        pid = pl.program_id(0) if cfg.entry == "pallas_call" else lax.axis_index("p")

        def locate(i):
            """Item i of this CTA: (stream, head, value block, clipped slot, valid, in_pool, read)."""
            b = pid + i * programs
            valid = b < total
            b = jnp.minimum(b, total - 1)                 # past the last item: reload it, store nothing
            nn = b // (hv * nvb)
            h = lax.rem(b // nvb, hv)
            vb = lax.rem(b, nvb)
            slot = slot_ref[nn]
            in_pool = valid & (slot >= 0) & (slot < num_slots)
            read = in_pool & (has_ref[nn] != 0)
            return nn, h, vb, jnp.clip(slot, 0, num_slots - 1), valid, in_pool, read

        def issue(loc, d):
            nn, h, vb, slot = loc[:4]
            vs = pl.ds(vb * bv, bv)
            into = bar.at[d]
            plgpu.copy_gmem_to_smem(pool_ref.at[slot, h, :, vs], s_buf.at[d], into)
            plgpu.copy_gmem_to_smem(q_ref.at[nn, 0, h // group], q_buf.at[d], into)
            plgpu.copy_gmem_to_smem(k_ref.at[nn, 0, h // group], k_buf.at[d], into)
            plgpu.copy_gmem_to_smem(v_ref.at[nn, 0, h, vs], v_buf.at[d], into)

        def fetch(i):
            """Item i's scalars (stream, head, value block, clipped slot, flags, g, beta; flags: 1 valid, 2 in the
            pool, 4 read), loaded from global memory a trip before they are used (the loads' latency overlaps the
            wait and the arithmetic of the item before)."""
            nn, h, vb, slot, valid, in_pool, read = locate(i)
            g, beta = _gates(g_ref, beta_ref, gate_refs, n=nn, h=h, group=group)
            flags = valid.astype(jnp.int32) + 2 * in_pool.astype(jnp.int32) + 4 * read.astype(jnp.int32)
            return nn, h, vb, slot, flags, g, beta

        def coords(i):
            """Item i's (stream, head, value block, valid) from its number alone (no loads)."""
            b = pid + i * programs
            valid = b < total
            b = jnp.minimum(b, total - 1)
            return b // (hv * nvb), lax.rem(b // nvb, hv), lax.rem(b, nvb), valid

        def loads(i):
            """defer_scalars: item i's scalar loads, nothing computed from them yet (the next trip does)."""
            nn, h = coords(i)[:2]
            return (slot_ref[nn], has_ref[nn]) + tuple(_gate_loads(g_ref, beta_ref, gate_refs, n=nn, h=h,
                                                                   group=group))

        def cook(i, loaded):
            """defer_scalars: :func:`fetch`'s tuple of item i from :func:`loads`' values."""
            nn, h, vb, valid = coords(i)
            slot, has = loaded[:2]
            in_pool = valid & (slot >= 0) & (slot < num_slots)
            read = in_pool & (has != 0)
            g, beta = _gate_math(loaded[2:])
            flags = valid.astype(jnp.int32) + 2 * in_pool.astype(jnp.int32) + 4 * read.astype(jnp.int32)
            return nn, h, vb, jnp.clip(slot, 0, num_slots - 1), flags, g, beta

        for i in range(min(stages, trips)):
            issue(locate(i), i)

        def step_deferred(i, carry):
            loaded, refill_slot = carry                   # loaded on the trip before
            upcoming = loads(i + 1), slot_ref[coords(i + stages)[0]]     # this trip's loads, used on the next
            refill = i - 1 + stages
            nn, h, vb = coords(refill)[:3]
            step(i, cook(i, loaded), refill, (nn, h, vb, jnp.clip(refill_slot, 0, num_slots - 1)))
            return upcoming

        def step_now(i, cur):
            upcoming = fetch(i + 1)                       # used by the next trip
            refill = i - 1 + stages                       # the item loaded into the previous item's slot
            step(i, cur, refill, locate(refill))
            return upcoming

        def step(i, cur, refill, refill_loc):
            d = lax.rem(i, stages)
            flags, g, beta = cur[4:]
            if cfg.refill == "early":                     # the previous item's slot, once its store has read it
                @pl.when((i >= 1) & (refill < trips))
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    issue(refill_loc, lax.rem(refill, stages))
            plgpu.barrier_wait(bar.at[d])
            if cfg.copy_only == "tma":                    # the ring alone, no registers: TMA in, TMA out
                o_buf.at[d][...] = jnp.zeros((bv,), o_buf.dtype) if interpret else plgpu.layout_cast(
                    jnp.zeros((bv,), o_buf.dtype), COLS)
                return _store_and_refill(i, d, cur, refill, refill_loc)
            if interpret:                                 # the interpreter keeps no register layouts
                s, qv, kv, vv = s_buf[d], q_buf[d], k_buf[d], v_buf[d]
            else:
                s = _load(s_buf.at[d], WGMMA)             # [K, BV]
                qv, kv = _load(q_buf.at[d], ROWS), _load(k_buf.at[d], ROWS)      # [K]
                vv = _load(v_buf.at[d], COLS)             # [BV]
            if cfg.copy_only:                             # the ring alone: the tile goes back as it came
                if not interpret:
                    s_buf.at[d][...] = s
                o_buf.at[d][...] = jnp.zeros((bv,), o_buf.dtype) if interpret else plgpu.layout_cast(
                    jnp.zeros((bv,), o_buf.dtype), COLS)
                return _store_and_refill(i, d, cur, refill, refill_loc)
            read = lax.broadcast_in_dim((flags & 4) != 0, s.shape, ())     # explicit: warpgroup semantics
            s = lax.select(read, s, jnp.zeros_like(s))   # fresh stream / bad id: zeros (a stale NaN never leaks)
            o, new_state = _tile_update(s, qv, kv, vv, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                        bcast=lambda x, dims: lax.broadcast_in_dim(x, (kdim, bv), dims))
            s_buf.at[d][...] = new_state()
            o_buf.at[d][...] = o.astype(o_buf.dtype)
            return _store_and_refill(i, d, cur, refill, refill_loc)

        def _store_and_refill(i, d, cur, refill, refill_loc):
            nn, h, vb, slot, flags = cur[:5]
            valid, in_pool = (flags & 1) != 0, (flags & 2) != 0
            vs = pl.ds(vb * bv, bv)
            plgpu.commit_smem()

            @pl.when(in_pool)
            def _():
                plgpu.copy_smem_to_gmem(s_buf.at[d], pool_ref.at[slot, h, :, vs], commit_group=False)

            @pl.when(valid)
            def _():
                plgpu.copy_smem_to_gmem(o_buf.at[d], o_ref.at[nn, 0, h, vs], commit_group=False)
            plgpu.commit_smem_to_gmem_group()            # one store group per item

            if cfg.refill == "late":
                @pl.when((i >= 1) & (refill < trips))    # refill the previous item's slot once its store read it
                def _():
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    issue(refill_loc, lax.rem(refill, stages))

        if cfg.defer_scalars:
            lax.fori_loop(0, trips, step_deferred, (loads(0), slot_ref[coords(stages - 1)[0]]))
        else:
            lax.fori_loop(0, trips, step_now, fetch(0))
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _tile_smem((stages, kdim, bv), swizzled=cfg.swizzle and not interpret),
        plgpu.SMEM((stages, kdim), q.dtype),
        plgpu.SMEM((stages, kdim), k.dtype),
        plgpu.SMEM((stages, bv), v.dtype),
        plgpu.SMEM((stages, bv), v.dtype),                # o staged for its TMA store
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
    ]
    operands = _operands(slot_ids, has_initial_state, q, k, v, g, beta, raw_gates)

    out_type = jax.ShapeDtypeStruct((n, 1, hv, vdim), v.dtype)

    def run(pool, *operands):
        if cfg.entry == "pallas_call":                 # the pool an aliased operand (deprecated for Mosaic GPU)
            # registers pallas_call's Mosaic GPU lowering (jax 0.11 does not import it with the module: the first
            # H200 run failed an `assert rule is not None` without it)
            importlib.import_module("jax._src.pallas.mosaic_gpu.pallas_call_registration")
            gmem = plgpu.BlockSpec(memory_space=plgpu.GMEM)

            def kernel(*refs):
                *ins, pool_in, o_ref, _ = refs            # pool_in and the pool output are one buffer
                pl.run_scoped(functools.partial(body, *ins, pool_in, o_ref), *scratch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                o, new_pool = pl.pallas_call(
                    kernel, grid=(programs,), in_specs=[gmem] * (len(operands) + 1), out_specs=[gmem, gmem],
                    out_shape=[out_type, jax.ShapeDtypeStruct(pool.shape, F32)],
                    input_output_aliases={len(operands): 1}, compiler_params=params,
                    interpret=interp, name="gdn_decode_mosaic")(*operands, pool)
            return o, new_pool
        pool_ref = jax.new_ref(pool, memory_space=plgpu.GMEM)   # aliased in and out of the kernel: in place

        def kernel(*refs):
            *ins, o_ref = refs
            pl.run_scoped(functools.partial(body, *ins, pool_ref, o_ref), *scratch)

        o = pl.kernel(kernel, out_type=out_type, mesh=plgpu.Mesh(grid=(programs,), grid_names=("p",)),
                      compiler_params=params, interpret=interp, name="gdn_decode_mosaic")(*operands)
        return o, jax.freeze(pool_ref)

    return jax.jit(run)(pool, *operands)            # a mutable ref with a memory space needs a jit around it


def _slots_direct(q, k, v, g, beta, *, pool, slot_ids, has_initial_state, scale, use_qk_l2norm, raw_gates, cfg,
                  interpret):
    """``MosaicDecodeConfig.transfer = "direct"``: one CTA (one warpgroup) per item b = (stream, value head, value
    block; value block fastest), its [K, BV] tile loaded from the pool straight into registers (``cfg.layout``),
    updated there and stored back; no shared memory but the K reductions' cross-warp scratch. Same arguments,
    contract and result as :func:`fused_recurrent_slots_mosaic`."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    n, kdim, hv, vdim, num_slots, group, bv, nvb, total, gate_offsets, interp = _dims(q, v, pool, cfg, raw_gates,
                                                                                    interpret)
    scale = float(scale)
    tile = plgpu.Layout.WGMMA if cfg.layout == "wgmma" else rows_layout(kdim, bv, cfg.layout == "strided_rows")
    ROWS, COLS = tile.reduce(1), tile.reduce(0)
    params = _compiler_params(cfg)

    def load(ref, layout):
        return ref[...] if interpret else _load(ref, layout, optimized=False)

    def bcast(x, dims):                                 # to the tile's shape and layout (lane semantics asks)
        y = lax.broadcast_in_dim(x, (kdim, bv), dims)
        return y if interpret else plgpu.layout_cast(y, tile)

    def body(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs):
        gate_refs, refs = _take_gate_refs(refs, gate_offsets)
        pool_ref, o_ref = refs
        b = lax.axis_index("p")
        nn, h, vb = b // (hv * nvb), lax.rem(b // nvb, hv), lax.rem(b, nvb)
        slot = slot_ref[nn]
        in_pool = (slot >= 0) & (slot < num_slots)
        read = in_pool & (has_ref[nn] != 0)
        slot = jnp.clip(slot, 0, num_slots - 1)
        vs = pl.ds(vb * bv, bv)
        s = load(pool_ref.at[slot, h, :, vs], tile)                                  # [K, BV] fp32
        s = lax.select(bcast(read, ()), s, jnp.zeros_like(s))                      # fresh / bad id: zeros
        if cfg.copy_only:                       # a measurement aid: the tile back as loaded (fresh: zeros), o = 0
            @pl.when(in_pool)
            def _():
                pool_ref.at[slot, h, :, vs][...] = s
            zero = jnp.zeros((bv,), o_ref.dtype)
            o_ref.at[nn, 0, h, vs][...] = zero if interpret else plgpu.layout_cast(zero, COLS)
            return
        qv = load(q_ref.at[nn, 0, h // group], ROWS).astype(F32)                   # [K]
        kv = load(k_ref.at[nn, 0, h // group], ROWS).astype(F32)
        vv = load(v_ref.at[nn, 0, h, vs], COLS).astype(F32)                        # [BV]
        g, beta = _gates(g_ref, beta_ref, gate_refs, n=nn, h=h, group=group)
        o, new_state = _tile_update(s, qv, kv, vv, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, bcast=bcast)

        @pl.when(in_pool)
        def _():
            pool_ref.at[slot, h, :, vs][...] = new_state()
        o_ref.at[nn, 0, h, vs][...] = o.astype(o_ref.dtype)

    operands = _operands(slot_ids, has_initial_state, q, k, v, g, beta, raw_gates)
    out_type = jax.ShapeDtypeStruct((n, 1, hv, vdim), v.dtype)

    def run(pool, *operands):
        pool_ref = jax.new_ref(pool, memory_space=plgpu.GMEM)   # aliased in and out of the kernel: in place

        def kernel(*refs):
            *ins, o_ref = refs
            body(*ins, pool_ref, o_ref)

        o = pl.kernel(kernel, out_type=out_type, mesh=plgpu.Mesh(grid=(total,), grid_names=("p",)),
                      compiler_params=params, interpret=interp, name="gdn_decode_mosaic_direct")(*operands)
        return o, jax.freeze(pool_ref)

    return jax.jit(run)(pool, *operands)


def decode_reference(q, k, v, g, beta, *, pool, slot_ids, has_initial_state, scale: float, use_qk_l2norm: bool,
                     raw_gates=None, block_v: int = 64):
    """The jnp twin of the kernel's tile algebra (same shapes and contract as
    :func:`fused_recurrent_slots_mosaic`): every (stream, head, value block) tile updated by the fused-output
    formulas of the module docstring in fp32, fresh streams and bad ids from zeros, writes of bad ids dropped,
    other slots unchanged. Runs anywhere; the CPU tests check it against float64."""
    n, _, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    num_slots = pool.shape[0]
    group = hv // hk
    bv = min(block_v, vdim)
    qf = jnp.repeat(q[:, 0].astype(F32), group, axis=1)                  # [N, Hv, K]
    kf = jnp.repeat(k[:, 0].astype(F32), group, axis=1)
    if use_qk_l2norm:
        qf = qf * lax.rsqrt(jnp.sum(qf * qf, -1, keepdims=True) + L2_EPS)
        kf = kf * lax.rsqrt(jnp.sum(kf * kf, -1, keepdims=True) + L2_EPS)
    if raw_gates is None:
        gg, bb = g[:, 0].astype(F32), beta[:, 0].astype(F32)            # [N, Hv]
    else:
        j = jnp.arange(hv) % group
        hkk = jnp.arange(hv) // group
        a = g[:, 0, hkk, raw_gates.a_offset + j].astype(F32)
        b = beta[:, 0, hkk, raw_gates.b_offset + j].astype(F32)
        gg = -jnp.exp(raw_gates.a_log.astype(F32)) * _softplus(a + raw_gates.dt_bias.astype(F32))
        bb = 1.0 / (1.0 + jnp.exp(-b))
    ids = slot_ids.astype(jnp.int32)
    in_pool = (ids >= 0) & (ids < num_slots)
    read = in_pool & has_initial_state.astype(bool)
    s = jnp.where(read[:, None, None, None], pool[jnp.clip(ids, 0, num_slots - 1)], 0.0)      # [N, Hv, K, V]
    a = jnp.exp(gg)[..., None]                                           # [N, Hv, 1]
    outs, news = [], []
    for vb in range(vdim // bv):                                         # the kernel's tiles
        st = s[..., vb * bv:(vb + 1) * bv]
        vv = v[:, 0, :, vb * bv:(vb + 1) * bv].astype(F32)
        sk = jnp.einsum("nhkv,nhk->nhv", st, kf, precision=lax.Precision.HIGHEST)
        sq = jnp.einsum("nhkv,nhk->nhv", st, qf, precision=lax.Precision.HIGHEST)
        delta = bb[..., None] * (vv - a * sk)
        outs.append(scale * (a * sq + jnp.sum(qf * kf, -1, keepdims=True) * delta))
        news.append(a[..., None] * st + kf[..., None] * delta[:, :, None, :])
    o = jnp.concatenate(outs, -1)[:, None].astype(v.dtype)
    new = jnp.concatenate(news, -1)
    # drop the writes of bad ids: scatter to index S (out of bounds) with mode="drop"
    new_pool = pool.at[jnp.where(in_pool, ids, num_slots)].set(new, mode="drop")
    return o, new_pool


def fused_recurrent_gated_delta_rule_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state,
                                               use_qk_l2norm=False, interpret=False,
                                               config: MosaicDecodeConfig = None, raw_gates=None):
    """The op's entry point for this kernel (the same arguments as decode.py's): one token per
    stream over the pool in place. q, k [N, 1, Hk, K]; v [N, 1, Hv, V]; g, beta [N, 1, Hv] (or the raw a, b with
    ``raw_gates``); ssm_state [S, Hv, K, V] fp32 (donate it); slot_ids [N] (outside [0, S): zeros in, no write);
    has_initial_state [N]. ``interpret``: Mosaic GPU interpret mode (CPU). Raises ValueError naming
    :func:`fallback_reason` where the kernel does not take the call. Returns (o [N, 1, Hv, V], new ssm_state)."""
    from pallas_kernels.gated_delta_rule.triton import chunk as _pt
    cfg = config or DEFAULT_CONFIG
    reason = fallback_reason(q, k, v, config=cfg, interpret=interpret)
    if reason is not None:
        raise ValueError(f"decode_mosaic: {reason}")
    if scale is None:
        scale = q.shape[3] ** -0.5
    # differentiating raises at this identity (NotImplementedError naming backend='xla'); the kernel itself sits
    # outside the custom_jvp, whose body cannot hold the pool's mutable ref
    q, k, v, g, beta, ssm_state = _pt.no_autodiff(lambda *a: a)(q, k, v, g, beta, ssm_state)
    return fused_recurrent_slots_mosaic(q, k, v, g, beta, pool=ssm_state, slot_ids=slot_ids,
                                        has_initial_state=has_initial_state, scale=scale,
                                        use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates, config=cfg,
                                        interpret=interpret)
