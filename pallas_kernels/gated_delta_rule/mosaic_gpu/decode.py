"""Mosaic GPU (Hopper) decode kernel: the per-token gated delta rule over a state-slot pool, in place.

The same op as ``gated_delta_rule/triton/decode.py`` (the Pallas Triton kernel; same arguments, same contract), for
one token per stream (T = 1). Per work item (stream n, value head h, value block vb) with its [K, BV] fp32 state
tile S (from ``pool[slot_ids[n], h, :, vb]``), q, k [K] (key head h // (Hv / Hk)), v [BV] and a = exp(g):

    sk = S^T k,  sq = S^T q                   (fp32, one reduction each over K)
    delta = beta (v - a sk)
    o = scale (a sq + (q . k) delta)          (= S'^T (scale q))
    S' = a S + k delta^T                      (stored in place)

optionally with q, k L2-normalised in fp32 first (``x * rsqrt(sum x^2 + 1e-6)``), the same numbers as the Triton
kernel's ``fused_output`` form up to fp32 rounding. An id outside [0, S) reads zeros and its store is dropped; a
fresh stream (has_initial_state False) starts from zeros whatever its slot holds (a select, so a stale NaN never
leaks). Other slots are never touched.

One CTA (one warpgroup) per item, value block fastest, then head, then stream. The tile goes from global memory
straight into registers in a layout chosen for this op (:func:`rows_layout`: each thread 16 rows x 4 columns at
K = 128, BV = 64, every 2nd row of its warp's, so that one load instruction reads neighbouring rows; it keeps 16
rows of q and k where the Triton kernel's layout keeps 32), is updated there and stored back from them; q, k, v and
o move the same way, the scalars are read at the top of the CTA. 152 registers a thread, 3 CTAs an SM, and on the
H200 as fast as its own copy twin (``copy_only``): 0.2777 ms at N256-Hk16-Hv32 (3.87 TB/s of state bytes, 81% of
4.8) against the Triton kernel's 0.2981 (249 registers, 4 two-warp programs an SM); N64 0.0758 against 0.0813; the
layer's fused decode step 0.122 against 0.132 ms (``python -m benchmarks decode``).

Shape legend: N streams, S slots, Hk / Hv key / value heads, K / V head dims, BV value block.

    q, k [N, 1, Hk, K]; v [N, 1, Hv, V]; g, beta [N, 1, Hv] (or the raw a, b [N, 1, Hk, Ca] with
    ``triton.decode.RawGates``); pool [S, Hv, K, V] fp32; slot_ids, has_initial_state [N]
    ->  o [N, 1, Hv, V] in v's dtype, pool (updated in place: a mutable ref aliased in and out of the kernel)

Scope (:func:`fallback_reason` names what it refuses; the Triton entry point then runs its own kernel): one token
per stream, K and V in {64, 128} with BV | V, q and k of one dtype, an sm_90 GPU. Mosaic GPU kernels do not compile
on the CPU jax (0.10.2); they run in its GPU interpret mode (``interpret=True``: the kernel body itself, with plain
loads in place of the register layouts), which the CPU tests use, and they lower for CUDA on the CPU (the layout
and transfer checks of Mosaic GPU run there). :func:`decode_reference` is the jnp twin of the tile algebra, checked
against float64.

Where it runs: the op's dispatch table (``api.py``, rows "mosaic_gpu.decode" / "mosaic_gpu.decode.interpret")
sends the decode calls of "auto" and "mosaic_gpu" (a Hopper GPU) and of "mosaic_gpu_interpret" (interpret mode)
here, the plain op's and the layer's fused decode step alike, where :func:`fallback_reason` is None.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mosaic_chunk
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import plgpu as _plgpu

F32 = jnp.float32
L2_EPS = 1e-6            # triton.decode.L2_EPS
HEAD_DIMS = (64, 128)
#: shared memory for the cross-warp step of the K reductions (Mosaic's default 2 KB splits each [K, BV] reduction
#: into more rounds: 37 warpgroup barriers a CTA program at BV 64 against 25 with 8 KB, counted in the lowered module)
REDUCTION_SCRATCH = 8192


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Launch parameters of the Mosaic GPU decode kernel.

    block_v: value columns of one state tile (64 or 128; min(block_v, V) must divide V). A [K, BV] fp32 tile is
      32 KB at K = 128, BV = 64.
    copy_only: a measurement aid, not the op: every tile is stored back as loaded (o = 0), through the same
      registers, so the time is the transfer's alone (the kernel's ceiling; compare the XLA copy of the pool).
    """
    block_v: int = 64
    copy_only: bool = False

    def __post_init__(self):
        if self.block_v not in (64, 128):
            raise ValueError(f"MosaicDecodeConfig.block_v must be 64 or 128, got {self.block_v!r}")
        if not isinstance(self.copy_only, bool):
            raise ValueError(f"MosaicDecodeConfig.copy_only must be a bool, got {self.copy_only!r}")


#: What the op's "auto" runs on Hopper (the dispatch table's "mosaic_gpu.decode" row).
DEFAULT_CONFIG = MosaicDecodeConfig()


def fallback_reason(q, k, v, *, interpret: bool = False) -> Optional[str]:
    """Why the Mosaic GPU decode kernel cannot run this call (the Triton entry point then runs its own kernel), or
    None. Shapes and dtypes only (works on tracers). ``interpret``: GPU interpret mode (no Hopper needed)."""
    if not interpret and not mosaic_chunk.is_hopper():
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
    return None


_LOAD_IDX_OPTIONAL = None


def _load(ref, layout, optimized: bool = True):
    """plgpu.load with a register layout (jax 0.10 takes the index positionally, 0.11 deprecates it).
    ``optimized=False``: a plain per-thread transfer (what a load from global memory needs); the signature is
    inspected once."""
    global _LOAD_IDX_OPTIONAL
    plgpu = _plgpu()
    if _LOAD_IDX_OPTIONAL is None:
        param = inspect.signature(plgpu.load).parameters.get("idx")
        _LOAD_IDX_OPTIONAL = param is None or param.default is not inspect.Parameter.empty
    if _LOAD_IDX_OPTIONAL:
        return plgpu.load(ref, layout=layout, optimized=optimized)
    return plgpu.load(ref, (), layout=layout, optimized=optimized)


def rows_layout(kdim: int, block_v: int):
    """The register layout of a [K, BV] fp32 tile over one warpgroup, as a Pallas Mosaic GPU layout:
    lv = min(32, BV / 4) lanes across the columns (4 consecutive columns each, one 16-byte vector), lk = 32 / lv
    lanes and the 4 warps down K (each warp K / 4 rows), each thread R = K / (4 lk) rows, every lk-th row of its
    warp's, so that the lk lane groups of one load instruction read neighbouring rows (the Triton kernel's own
    arrangement of this tile). Its K-reduced form (q, k [K]) holds R values a thread; its BV-reduced form (v, o,
    S^T k [BV]) 4."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    lv = min(32, block_v // 4)
    lk = 32 // lv
    rows = kdim // (4 * lk)
    if rows < 1 or kdim % (4 * lk):
        raise ValueError(f"rows_layout: K = {kdim} does not split over 4 warps x {lk} lanes")
    # tiled [.., 4 warps, .., R rows, .., lk lanes, lv lanes, .., 4]
    tiled = fa.TiledLayout(fa.Tiling(((kdim, block_v), (kdim // 4, block_v), (lk, block_v), (1, 4))),
                           warp_dims=(-8,), lane_dims=(-4, -3), vector_dim=-1, _check_canonical=False)
    tiled = tiled.canonicalize()
    return _plgpu().Layout.TILED(tiled.tiling, warp_dims=tiled.warp_dims, lane_dims=tiled.lane_dims,
                                 vector_dim=tiled.vector_dim)


def _softplus(x):
    """max(x, 0) + log1p(exp(-|x|)) with log1p(y) = log(u) y / (u - 1), u = 1 + y (exact where u rounds to 1; the
    Mosaic GPU lowering has no log1p)."""
    y = jnp.exp(-jnp.abs(x))
    u = 1.0 + y
    log1p = jnp.where(u == 1.0, y, jnp.log(u) * (y / jnp.where(u == 1.0, 1.0, u - 1.0)))
    return jnp.maximum(x, 0.0) + log1p


def _gates(g_ref, beta_ref, gate_refs, *, n, h, group):
    """(g, beta) fp32 scalars of stream n, value head h: read, or with raw gates (``gate_refs`` = (A_log, dt_bias,
    a column, b column)) made from a, b as ``triton.decode.RawGates`` says."""
    if gate_refs is None:
        return g_ref[n, 0, h].astype(F32), beta_ref[n, 0, h].astype(F32)
    alog_ref, dtb_ref, a_off, b_off = gate_refs
    hk, j = h // group, lax.rem(h, group)
    loaded = g_ref[n, 0, hk, a_off + j], beta_ref[n, 0, hk, b_off + j], alog_ref[h], dtb_ref[h]
    a, b, alog, dtb = (x.astype(F32) for x in loaded)
    g = -jnp.exp(alog) * _softplus(a + dtb)
    return g, 1.0 / (1.0 + jnp.exp(-b))


def _dims(q, v, pool, cfg, raw_gates, interpret):
    """What the kernel reads off the call: (n, kdim, hv, vdim, num_slots, group, bv, nvb, total, gate_offsets,
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


def _compiler_params():
    """The kernel's Mosaic GPU compiler parameters: the K reductions' cross-warp scratch, and lane semantics (arrays
    are per-thread register fragments in the layouts named here; jax 0.11's default, warpgroup semantics, does not
    lower this kernel's scalar-predicate select)."""
    plgpu = _plgpu()
    return plgpu.CompilerParams(reduction_scratch_bytes=REDUCTION_SCRATCH,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


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
    where it is called (inside the store's ``pl.when``).
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
    :func:`fallback_reason`): one CTA (one warpgroup) per item b = (stream, value head, value block; value block
    fastest), its [K, BV] tile loaded from the pool straight into registers (:func:`rows_layout`), updated there and
    stored back; no shared memory but the K reductions' cross-warp scratch. raw_gates: None or
    ``triton.decode.RawGates`` (g, beta are then the raw a, b [N, 1, Hk, Ca]). Returns (o [N, 1, Hv, V] in v's
    dtype, the updated pool [S, Hv, K, V] fp32)."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    cfg = config or DEFAULT_CONFIG
    n, kdim, hv, vdim, num_slots, group, bv, nvb, total, gate_offsets, interp = _dims(q, v, pool, cfg, raw_gates,
                                                                                    interpret)
    scale = float(scale)
    tile = rows_layout(kdim, bv)
    ROWS, COLS = tile.reduce(1), tile.reduce(0)
    params = _compiler_params()

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
    from pallas_kernels.gated_delta_rule.triton import chunk as triton_chunk
    cfg = config or DEFAULT_CONFIG
    reason = fallback_reason(q, k, v, interpret=interpret)
    if reason is not None:
        raise ValueError(f"decode_mosaic: {reason}")
    if scale is None:
        scale = q.shape[3] ** -0.5
    # differentiating raises at this identity (NotImplementedError naming backend='xla'); the kernel itself sits
    # outside the custom_jvp, whose body cannot hold the pool's mutable ref
    q, k, v, g, beta, ssm_state = triton_chunk.no_autodiff(lambda *a: a)(q, k, v, g, beta, ssm_state)
    return fused_recurrent_slots_mosaic(q, k, v, g, beta, pool=ssm_state, slot_ids=slot_ids,
                                        has_initial_state=has_initial_state, scale=scale,
                                        use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates, config=cfg,
                                        interpret=interpret)
