# Copyright 2026 KarLex AI, Inc.
# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
# The kernels state_fwd_wy, state_bwd_wy and chunk_grads and the helper _products are adapted from
# jax-linear-attention 0.1.0 (Apache-2.0), jla/ops/mosaic_gpu/gated_delta_rule_bwd.py, itself adapted from FlashQLA
# (MIT: flash_qla/ops/gated_delta_rule/chunk/hopper/prepare_h.py, fused_bwd.py). See NOTICE in gated_delta_rule/.
"""Mosaic GPU (Hopper) backward of the chunked gated delta rule: the VJP of ``chunk.op_fwd`` (dense rows) and of
``varlen.op_fwd`` (packed sequences, behind a switch).

With stage 1a's gate-free inverse T0 = (I + A0)^-1 (:func:`chunk.kkt_fwd`), per chunk of C = 64 tokens, the decay
D_ij = e^(G_i - G_j) (i >= j), Gamma = e^G, gamma = e^(G_last), Gamma_r = e^(G_last - G), the forward is

    Ag = T0 * D * beta_j,   W = v - Gamma (k S),   v_new = Ag W,
    o = scale (Gamma q S + P v_new),   S' = gamma S + (Gamma_r k)^T v_new,      P = (q k^T) * D

and the backward reads as the algorithm, three warp-specialised kernels:
  1. :func:`state_fwd_wy` recomputes the state entering every chunk (the forward's serial pass, storing S^T).
  2. :func:`state_bwd_wy` walks the chunks in reverse carrying dS^T: dv_new = scale P^T do + Gamma_r (k dS'),
     dv = Ag^T dv_new (the value gradient, stored), dS <- gamma dS + scale (Gamma q)^T do - (Gamma k)^T dv ...;
     it stores the gradient of the state leaving every chunk and returns dh0.
  3. :func:`chunk_grads`, one CTA per (chunk, value head): dq, dk, dbeta and dG (the gradient of the chunk-local
     cumulative gate) from the stored states, recomputing W, v_new and dv_new, through the inverse
     (dA0 = -T0^T dT0 T0^T on the strictly lower part).
Then XLA: dG's reverse cumsum within each chunk gives dg (zero where the forward floored g), dq and dk are summed
over each key head's group of value heads, the L2 norm's VJP (in api.py) and the padding cut off.

Residuals: the op's inputs only (q, k, v, g, beta, h0: what the forward reads anyway); stage 1a (T0, G) is recomputed
in the backward, which also holds the chunk states h and their gradients dh (B Hv (T / 64) V K x 2 bytes each in
bf16: 128 MiB each at B1-T8192-Hv32, K = V = 128) while it runs.

Scope: as the forward's "mosaic_gpu" dense path (bf16 / fp16 q, k, v of one dtype, K and V in {64, 128}, Hv a
multiple of Hk, any T (zero tokens pad it to a multiple of 64), h0 and the final state's cotangent optional).
Packed sequences (:func:`chunk_gated_delta_rule_varlen_bwd`, ``DispatchConfig.mosaic_backward_varlen``, on
by default): the packed row repacked so that each sequence starts at a chunk boundary (``varlen.layout``),
the two state passes walking each sequence's chunks from its own initial state and final-state cotangent (a walk
table, as the forward's), the per-chunk kernel over the repacked row, the gradients gathered back.
:func:`chunk_gated_delta_rule_bwd` with ``impl="reference"`` replaces the three kernels by their jnp twin
(:func:`kernels_reference`, :func:`walk_kernels_reference`: jax.vjp of the jnp chunk form over the kernels'
operands), so that the CPU tests check everything around the kernels against float64; the kernels' tests are
GPU-marked. jla's in-chunk packed-document masks are left out: packed sequences start at chunk boundaries here.

Shape legend: B batch, T tokens (Tp padded), Hk / Hv key / value heads, K / V head dims, C = 64 chunk,
NC = Tp / C chunks per row, BV = 64 value columns per CTA of the serial passes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk import kkt_fwd_reference, prepare_head_major
from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk_reference import fused_state_pass_reference
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import (BV, C, F32, LN2, bcast_cols, bcast_rows, iota,
                                                              matmul, ring_stages, smem)
from pallas_kernels.gated_delta_rule.mosaic_gpu.common import plgpu as _plgpu
from pallas_kernels.gated_delta_rule.mosaic_gpu.split import form_ag, issue_chunk
from pallas_kernels.gated_delta_rule.reference import G_FLOOR

Array = jax.Array
# chunk_grads: registers per thread of WG0 (forward side), WG1 (dv_new, dW and the inverse) and WG2 (dk),
# multiples of 8 summing to at most 3 * 168 (the launch share of 384 threads; setmaxnreg moves registers
# only within the CTA).
CHUNK_GRADS_REGISTERS = (160, 232, 112)
CHUNK_GRADS_LAUNCH_REGISTERS = 168


def _layouts():
    plgpu = _plgpu()
    wgmma = plgpu.Layout.WGMMA
    return wgmma, wgmma.reduce(1), wgmma.reduce(0)     # WGMMA, ROWS (one value per row), COLS (per column)


def decay_matrix(g_row, g_col, shape, *, strict: bool):
    """(jla) ``exp2(G_i - G_j)`` on the causal part (``j < i`` or ``j <= i``), zero elsewhere; the exponent is
    masked before exp2, so acausal entries never overflow."""
    rows, cols = iota(shape, 0), iota(shape, 1)
    keep = rows > cols if strict else rows >= cols
    return jnp.exp2(jnp.where(keep, bcast_rows(g_row, shape) - bcast_cols(g_col, shape), -jnp.inf))


def finish_together(done) -> None:
    """(jla) Every warpgroup arrives at ``done`` and waits for the others (one exiting while another still issued
    WGMMAs ended some runs in CUDA_ERROR_ILLEGAL_INSTRUCTION, sm_90, jax 0.11.2)."""
    plgpu = _plgpu()
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)


def _walk_row(walk_ref, r, ncs: int):
    """(row of the inputs, first chunk, chunk count, state row) CTA row r of a serial pass walks: row r of the walk
    table (its chunks c0 .. c0 + count - 1 of the one packed row, its state row s), or dense row r's NC chunks."""
    if walk_ref is None:
        return r, 0, ncs, r
    return 0, walk_ref[r, 0], walk_ref[r, 1], walk_ref[r, 2]


def _prefetch(issue, count, stages: int, ncs: int, varlen: bool, in_free) -> None:
    """The memory warpgroup's loop of the serial passes: ``issue(step, slot)`` for steps 0 .. count - 1 into a
    ring of ``stages`` slots, each refill after the slot's release. Dense rows: count = ncs chunks (static);
    a walk table: a dynamic count, possibly 0 (the prologue guarded, as the forward's walk in chunk.py)."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    if varlen:
        for n in range(stages):
            @pl.when(count > n)
            def _(n=n):
                issue(n, n)
        end = jnp.maximum(count, stages)
    else:
        for n in range(min(stages, ncs)):
            issue(n, n)
        end = ncs

    @pl.loop(stages, end)
    def _refill(n):
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(in_free.at[slot])
        issue(n, slot)


def build_kernel(body, *, name: str, out_type, scratch, grid, grid_names, **threads):
    plgpu = _plgpu()
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
                        compiler_params=plgpu.CompilerParams(approx_math=True), kernel_name=name, **threads)


def _products(*specs) -> tuple:
    """Independent float32 products ``a @ b`` issued as one WGMMA group, with one wait for all.

    ``specs`` are ``(a, b, shape)`` as for :func:`matmul` (``a`` an SMEM ref or 16-bit
    WGMMA registers). Each product runs the instructions :func:`matmul` runs, so the
    results are the same bits; the tensor cores start the next product while the
    previous one finishes instead of draining between them.
    """

    import jax.experimental.pallas as pl
    plgpu = _plgpu()

    def scoped(*accs):
        for acc, (a, b, _) in zip(accs, specs):
            plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)

    return lax.optimization_barrier(pl.run_scoped(scoped, *(plgpu.ACC(shape, F32) for _, _, shape in specs)))


def state_fwd_wy(
    k: Array,
    v: Array,
    t0: Array,
    g2: Array,
    beta: Array,
    h0: Array | None,
    *,
    walk: Array | None = None,
) -> Array:
    """Forward state pass from the gate-free inverse (FlashQLA's ``prepare_h``), warp-specialized.

    WG1 builds ``Ag`` in place of ``T0``; WG0 carries ``S^T`` (``[BV, K]``
    float32) and per chunk forms ``W^T = v^T - (S^T k^T) Gamma``,
    ``v_new^T = W^T Ag^T`` and ``S^T <- gamma S^T + (Gamma_r v_new)^T k``; WG2
    streams the inputs.

    Args:
      k: ``[B, Tp, Hk, K]``; v: ``[B, Tp, H, V]`` (user layout); t0: ``[B, H, Tp, C]``;
      g2, beta: ``[B, H, Tp]`` float32 (g2: chunk-local cumulative log2-decay); h0: ``[B, H, V, K]`` float32
        transposed initial states or ``None``.
      walk: ``None`` (every row walks its NC chunks from ``h0[b]``) or, for packed sequences laid out at chunk
        boundaries of one row (B = 1), an int32 ``[R, 3]`` table: CTA row r walks chunks ``c0 .. c0 + n - 1``
        (row r = (c0, n, s); n may be 0) from ``h0[s]`` (``h0 [num_states, H, V, K]``); chunks no row walks
        are left unset.

    Returns:
      ``h [B, H, NC, V, K]``: the transposed state entering each chunk, in the input dtype.
    """
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    WGMMA, ROWS, COLS = _layouts()
    batch, padded, kv_heads, key_dim = k.shape
    heads = g2.shape[1]
    value_dim = v.shape[-1]
    group = heads // kv_heads
    ncs = padded // C
    bv = BV                      # value columns per CTA
    nv = value_dim // bv
    dtype = k.dtype
    has_h0 = h0 is not None
    varlen = walk is not None
    if varlen and batch != 1:
        raise ValueError(f"state_fwd_wy: a walk table needs one packed row (B = 1); got B = {batch}")
    isz = jnp.dtype(dtype).itemsize
    n_vec = 4  # g_state, g_rows, g_cols, b_cols
    per_stage = C * key_dim * isz + C * bv * isz + C * C * isz + n_vec * C * 4
    fixed = 2 * bv * key_dim * isz + (bv * key_dim * 4 if has_h0 else 0)
    fixed += 4096 + n_vec * 1024
    stages = ring_stages(per_stage, fixed)
    n_copies = 3 + n_vec
    out_type = jax.ShapeDtypeStruct((batch, heads, padded // C, value_dim, key_dim), dtype)
    vecs = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        k_s=smem((stages, C, key_dim), dtype),
        v_s=smem((stages, C, bv), dtype),
        t_s=smem((stages, C, C), dtype),  # T0, then Ag (written by WG1)
        g_state=vecs,
        g_rows=vecs,
        g_cols=vecs,
        b_cols=vecs,
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages),
        state_bar=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=3),
    )
    scratch.update(h_out=smem((2, bv, key_dim), dtype))
    if has_h0:
        scratch.update(state_smem=plgpu.SMEM((bv, key_dim), F32))

    def body(*refs, k_s, v_s, t_s, g_state, g_rows, g_cols, b_cols, in_bar, in_free, ag_ready, state_bar, done,
             h_out=None, state_smem=None):
        refs = list(refs)
        k_ref, v_ref, t_ref, g_ref, b_ref = (refs.pop(0) for _ in range(5))
        h0_ref = refs.pop(0) if has_h0 else None
        walk_ref = refs.pop(0) if varlen else None
        h_ref = refs.pop(0)
        r, hh, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        b, c0, count, srow = _walk_row(walk_ref, r, ncs)
        hk = lax.div(hh, group)
        v0 = iv * bv
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(n, slot):
                issue_chunk(n, slot, ((v0, v_s),), refs=(k_ref, v_ref, t_ref, g_ref, b_ref), k_s=k_s, t_s=t_s,
                            vecs=(g_state, g_rows, g_cols, b_cols), in_bar=in_bar, head_major=True, b=b, hh=hh,
                            hk=hk, tok0=c0 * C, piece=0, ncb_row=ncs, ncb=ncs)

            _prefetch(issue, count, stages, ncs, varlen, in_free)

        @pl.when(wg == 1)
        def _ag():
            plgpu.set_max_registers(232, action="increase")

            @pl.loop(0, count)
            def _chunk(n):
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(in_bar.at[slot])
                form_ag(slot, head_major=True, exp=jnp.exp2, dtype=dtype, t_s=t_s, g_rows=g_rows, g_cols=g_cols,
                        b_cols=b_cols, ag_ready=ag_ready)
                plgpu.barrier_arrive(in_free.at[slot])

        @pl.when(wg == 0)
        def _state():
            plgpu.set_max_registers(232, action="increase")
            shape = (bv, key_dim)
            if has_h0:
                plgpu.copy_gmem_to_smem(h0_ref.at[srow, hh, pl.ds(v0, bv)], state_smem, state_bar)
                plgpu.barrier_wait(state_bar)
                s0 = plgpu.load(state_smem, layout=WGMMA)
            else:
                s0 = plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA)

            def step(n, s_t):
                slot = lax.rem(n, stages)
                half = lax.rem(n, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                s_lo = s_t.astype(dtype)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # h_out[half] of chunk n - 2 was sent
                h_out.at[half][...] = s_lo
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(h_out.at[half], h_ref.at[b, hh, c0 + n, pl.ds(v0, bv)])
                g_last = g_state[slot, C - 1]
                g_col = plgpu.load(g_state.at[slot], layout=COLS)
                key_decay = jnp.exp2(g_col)
                k_decay = jnp.exp2(g_last - g_col)
                s_decay = jnp.exp2(g_last)
                u_t = matmul(s_lo, k_s.at[slot].T, (bv, C))
                v_t = plgpu.load(v_s.at[slot].T, layout=WGMMA).astype(F32)
                w_t = (v_t - u_t * bcast_cols(key_decay, (bv, C))).astype(dtype)
                plgpu.barrier_wait(ag_ready.at[slot])
                vn_t = matmul(w_t, t_s.at[slot].T, (bv, C))
                vd_t = (vn_t * bcast_cols(k_decay, (bv, C))).astype(dtype)
                s_new = matmul(vd_t, k_s.at[slot], (bv, key_dim), init=s_t * s_decay)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            lax.fori_loop(0, count, step, s0)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [k, v, t0, g2, beta] + ([h0] if has_h0 else [])
    args += [walk.astype(jnp.int32)] if varlen else []
    return build_kernel(
        body, name="gdn_mosaic_state_fwd", out_type=out_type, scratch=scratch,
        grid=(walk.shape[0] if varlen else batch, heads, nv),
        grid_names=("b", "h", "v"), num_threads=3, thread_name="wg",
    )(*args)


def state_bwd_wy(
    q: Array,
    k: Array,
    do: Array,
    t0: Array,
    g2: Array,
    beta: Array,
    dht: Array | None,
    *,
    scale: float,
    want_dh0: bool,
    walk: Array | None = None,
    num_states: int | None = None,
) -> tuple[Array, Array, Array | None]:
    """Reverse state pass of the delta rule from the gate-free inverse, warp-specialized.

    * WG1 builds ``Ag`` in place of ``T0`` and the intra-chunk value gradient
      ``dvl = scale P^T do`` (64 value columns);
    * WG0 carries ``dS^T`` (``[BV, K]`` float32) through the chunks in reverse:
      ``dv_new^T = dvl^T + (dS^T k^T) Gamma_r``, ``dW^T = dv_new^T Ag`` (the
      value gradient) and
      ``dS^T <- gamma dS^T + scale (do^T Gamma) q - (dW^T Gamma) k``;
    * WG2 streams ``q, k, do, T0`` and the gate vectors.

    Args:
      q, k: ``[B, Tp, Hk, K]``; do: ``[B, Tp, H, V]``; t0: ``[B, H, Tp, C]``;
      g2, beta: ``[B, H, Tp]``; dht: ``[B, H, V, K]`` float32 transposed
        gradient of the final state, or ``None`` (zero).
      walk, num_states: as :func:`state_fwd_wy` (the row walks its chunks backwards from ``dht[s]``; ``dht``
        and ``dh0`` are then ``[num_states, H, V, K]``, a state row no walk row names gets no ``dh0``).

    Returns:
      ``dh [B, H, NC, V, K]`` (transposed gradient of the state leaving each
      chunk), ``dv [B, Tp, H, V]`` (both in the input dtype) and the transposed
      ``dh0 [B, H, V, K]`` float32 (with ``want_dh0``, else ``None``).
    """
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    WGMMA, ROWS, COLS = _layouts()
    batch, padded, kv_heads, key_dim = q.shape
    heads = g2.shape[1]
    value_dim = do.shape[-1]
    group = heads // kv_heads
    ncs = padded // C
    bv = BV                      # value columns per CTA
    nv = value_dim // bv
    dtype = q.dtype
    has_dht = dht is not None
    varlen = walk is not None
    if varlen and (batch != 1 or num_states is None):
        raise ValueError(f"state_bwd_wy: a walk table needs one packed row (B = 1; got {batch}) and num_states")
    num_states = num_states if varlen else batch
    isz = jnp.dtype(dtype).itemsize
    n_vec = 4  # g_state, g_rows, g_cols, b_cols
    per_stage = 2 * C * key_dim * isz + 2 * C * bv * isz + C * C * isz + n_vec * C * 4
    fixed = 2 * bv * key_dim * isz + 2 * C * bv * isz
    fixed += (bv * key_dim * 4 if has_dht or want_dh0 else 0) + 4096 + n_vec * 1024
    stages = ring_stages(per_stage, fixed)
    n_copies = 4 + n_vec
    out_type = [jax.ShapeDtypeStruct((batch, heads, padded // C, value_dim, key_dim), dtype),
                jax.ShapeDtypeStruct((batch, padded, heads, value_dim), dtype)]
    if want_dh0:
        out_type.append(jax.ShapeDtypeStruct((num_states, heads, value_dim, key_dim), F32))
    vecs = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        q_s=smem((stages, C, key_dim), dtype),
        k_s=smem((stages, C, key_dim), dtype),
        do_s=smem((stages, C, bv), dtype),
        t_s=smem((stages, C, C), dtype),  # T0, then Ag (written by WG1)
        dvl_s=smem((stages, C, bv), dtype),  # written by WG1
        g_state=vecs,
        g_rows=vecs,
        g_cols=vecs,
        b_cols=vecs,
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        dvl_ready=plgpu.Barrier(num_barriers=stages),
        state_bar=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=3),
    )
    scratch.update(dh_out=smem((2, bv, key_dim), dtype), dv_out=smem((2, C, bv), dtype))
    if has_dht or want_dh0:
        scratch.update(state_smem=plgpu.SMEM((bv, key_dim), F32))

    def body(*refs, q_s, k_s, do_s, t_s, dvl_s, g_state, g_rows, g_cols, b_cols, in_bar, in_free, dvl_ready,
             state_bar, done, dh_out=None, dv_out=None, state_smem=None):
        refs = list(refs)
        q_ref, k_ref, do_ref, t_ref, g_ref, b_ref = (refs.pop(0) for _ in range(6))
        dht_ref = refs.pop(0) if has_dht else None
        walk_ref = refs.pop(0) if varlen else None
        dh_ref, dv_ref = refs.pop(0), refs.pop(0)
        dh0_ref = refs.pop(0) if want_dh0 else None
        r, hh, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        b, c0, count, srow = _walk_row(walk_ref, r, ncs)
        hk = lax.div(hh, group)
        v0 = iv * bv
        wg = lax.axis_index("wg")
        sq = (C, C)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(i, slot):  # i: step of the reverse walk
                rows = pl.ds((c0 + count - 1 - i) * C, C)
                bar = in_bar.at[slot]
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hk], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], k_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, hh, pl.ds(v0, bv)], do_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(t_ref.at[b, hh, rows], t_s.at[slot], bar)
                for g_buf in (g_state, g_rows, g_cols):
                    plgpu.copy_gmem_to_smem(g_ref.at[b, hh, rows], g_buf.at[slot], bar)
                plgpu.copy_gmem_to_smem(b_ref.at[b, hh, rows], b_cols.at[slot], bar)

            _prefetch(issue, count, stages, ncs, varlen, in_free)

        @pl.when(wg == 1)
        def _intra():
            plgpu.set_max_registers(232, action="increase")

            @pl.loop(0, count)
            def _chunk(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(in_bar.at[slot])
                g_row = plgpu.load(g_rows.at[slot], layout=ROWS)
                g_col = plgpu.load(g_cols.at[slot], layout=COLS)
                t0v = plgpu.load(t_s.at[slot], layout=WGMMA).astype(F32)
                ag = t0v * decay_matrix(g_row, g_col, sq, strict=False)
                t_s.at[slot][...] = (ag * bcast_cols(plgpu.load(b_cols.at[slot], layout=COLS), sq)).astype(dtype)
                # P^T[j, i] = (k_j . q_i) exp(G_i - G_j) on i >= j: rows are keys, columns queries.
                keep = iota(sq, 0) <= iota(sq, 1)
                expo = jnp.where(keep, bcast_cols(g_col, sq) - bcast_rows(g_row, sq), -jnp.inf)
                pt = matmul(k_s.at[slot], q_s.at[slot].T, sq)
                pt = (pt * jnp.exp2(expo) * scale).astype(dtype)
                dvl_s.at[slot][...] = matmul(pt, do_s.at[slot], (C, bv)).astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(dvl_ready.at[slot])
                plgpu.barrier_arrive(in_free.at[slot])

        @pl.when(wg == 0)
        def _state():
            plgpu.set_max_registers(232, action="increase")
            if has_dht:
                plgpu.copy_gmem_to_smem(dht_ref.at[srow, hh, pl.ds(v0, bv)], state_smem, state_bar)
                plgpu.barrier_wait(state_bar)
                ds0 = plgpu.load(state_smem, layout=WGMMA)
            else:
                ds0 = plgpu.layout_cast(jnp.zeros((bv, key_dim), F32), WGMMA)
            st = (bv, C)

            def step(i, ds_t):
                n = c0 + count - 1 - i  # global chunk index
                slot = lax.rem(i, stages)
                half = lax.rem(i, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                ds_lo = ds_t.astype(dtype)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # dh_out/dv_out[half] of step i - 2 were sent
                dh_out.at[half][...] = ds_lo
                g_last = g_state[slot, C - 1]
                g_col = plgpu.load(g_state.at[slot], layout=COLS)  # tokens are the columns of the [BV, C] tiles
                k_decay = jnp.exp2(g_last - g_col)
                gam = jnp.exp2(g_col)
                s_decay = jnp.exp2(g_last)
                kd = matmul(ds_lo, k_s.at[slot].T, st)  # dS^T k^T
                plgpu.barrier_wait(dvl_ready.at[slot])
                dvl_t = plgpu.load(dvl_s.at[slot].T, layout=WGMMA).astype(F32)
                dvn_lo = (kd * bcast_cols(k_decay, st) + dvl_t).astype(dtype)
                dw_t = matmul(dvn_lo, t_s.at[slot], st)  # dW^T = dv_new^T Ag
                dv_out.at[half].T[...] = dw_t.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dh_out.at[half], dh_ref.at[b, hh, n, pl.ds(v0, bv)], commit_group=False)
                plgpu.copy_smem_to_gmem(dv_out.at[half], dv_ref.at[b, pl.ds(n * C, C), hh, pl.ds(v0, bv)],
                                        commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                do_t = plgpu.load(do_s.at[slot].T, layout=WGMMA).astype(F32)
                do_t = (do_t * bcast_cols(gam * scale, st)).astype(dtype)
                dwn = (dw_t * bcast_cols(-gam, st)).astype(dtype)

                def update(acc):
                    plgpu.wgmma(acc, do_t, q_s.at[slot])
                    plgpu.wgmma(acc, dwn, k_s.at[slot])

                ds_new = lax.optimization_barrier(pl.run_state(update)(plgpu.ACC.init(ds_t * s_decay)))
                plgpu.barrier_arrive(in_free.at[slot])
                return ds_new

            ds_t = lax.fori_loop(0, count, step, ds0)
            if want_dh0:
                state_smem[...] = ds_t
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(state_smem, dh0_ref.at[srow, hh, pl.ds(v0, bv)])
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [q, k, do, t0, g2, beta] + ([dht] if has_dht else [])
    args += [walk.astype(jnp.int32)] if varlen else []
    outs = list(build_kernel(
        body, name="gdn_mosaic_state_bwd", out_type=out_type, scratch=scratch,
        grid=(walk.shape[0] if varlen else batch, heads, nv),
        grid_names=("b", "h", "v"), num_threads=3, thread_name="wg",
    )(*args))
    dh, dv = outs.pop(0), outs.pop(0)
    return dh, dv, (outs.pop(0) if want_dh0 else None)


def chunk_grads(
    q: Array,
    k: Array,
    v: Array,
    do: Array,
    t0: Array,
    g2: Array,
    beta: Array,
    h: Array,
    dh: Array,
    *,
    scale: float,
) -> tuple[Array, Array, Array, Array]:
    """Per-chunk ``dq``, ``dk``, ``dbeta`` and gate gradient of the delta rule; one chunk per CTA.

    WG0 recomputes ``U = Gamma (k S)``, ``W = v - U``, ``Ag`` and
    ``v_new = Ag W``, then ``dP = scale (do v_new^T) * D`` and
    ``dq = scale Gamma (do S^T) + dP k``. WG1 recomputes
    ``dv_new = scale P^T do + Gamma_r (k dS')`` and ``dW = Ag^T dv_new`` and goes
    through ``Ag`` and the inverse (``dA0 = -T0^T dT0 T0^T`` on the strictly
    lower part) before its ``dbeta`` and gate-gradient sums, so ``dA0`` reaches
    WG2 early. WG2 accumulates
    ``dk = Gamma_r (v_new dS'^T) - Gamma (dW S^T) + dP^T q + (dA0 beta_i) k + (dA0 beta_i)^T k``
    from the products the other two publish in SMEM, and the state-decay term
    ``gamma <S, dS'>`` of the gate gradient. Independent products whose results
    are live together anyway are issued as one WGMMA group (:func:`_products`).
    The results are bit for bit those of the two-warpgroup kernel this replaced
    (WG1 then also carried ``dk``: 8 of the chunk's 13 M multiply-adds). The
    kernel is compute-bound: on an H100 it takes 76% of its time without its
    loads and stores (``benchmarks/gdn.md``).

    Args:
      q, k: ``[B, Tp, Hk, K]``; v, do: ``[B, Tp, H, V]``; t0: ``[B, H, Tp, C]``;
      g2, beta: ``[B, H, Tp]`` float32; h: ``[B, H, NC, V, K]`` transposed states
      entering each chunk (:func:`state_fwd_wy`); dh: ``[B, H, NC, V, K]``
      transposed gradients of the states leaving each chunk (:func:`state_bwd_wy`).

    Returns:
      ``dq, dk [B, Tp, H, K]`` per value head in the input dtype, and float32
      ``dbeta [B, H, Tp]`` and ``dG [B, H, Tp]`` (gradient of the chunk-local
      cumulative log-decay, natural units, before the reverse chunk cumsum).
    """
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    WGMMA, ROWS, COLS = _layouts()
    batch, padded, kv_heads, key_dim = q.shape
    heads = g2.shape[1]
    value_dim = v.shape[-1]
    group = heads // kv_heads
    nc = padded // C
    dtype = q.dtype
    vec = plgpu.SMEM((C,), F32)
    out_type = [
        jax.ShapeDtypeStruct((batch, padded, heads, key_dim), dtype),
        jax.ShapeDtypeStruct((batch, padded, heads, key_dim), dtype),
        jax.ShapeDtypeStruct((batch, heads, padded), F32),
        jax.ShapeDtypeStruct((batch, heads, padded), F32),
    ]
    scratch = dict(
        q_s=smem((C, key_dim), dtype),
        k_s=smem((C, key_dim), dtype),
        v_s=smem((C, value_dim), dtype),  # v, then U = Gamma (k S)
        do_dq=plgpu.RefUnion([smem((C, value_dim), dtype)], [smem((C, key_dim), dtype)]),  # do, then dq
        h_s=smem((value_dim, key_dim), dtype),
        dh_s=smem((value_dim, key_dim), dtype),
        t_s=smem((C, C), dtype),  # T0, then dA0 * beta_i
        w_dk=plgpu.RefUnion([smem((C, value_dim), dtype)], [smem((C, key_dim), dtype)]),  # W, then dk
        ag_s=smem((C, C), dtype),
        vn_s=smem((C, value_dim), dtype),
        dvn_s=smem((C, value_dim), dtype),  # dv_new, then -Gamma dW
        dp_s=smem((C, C), dtype),
        m_s=smem((C, C), dtype),
        g_r=vec,
        g_c=vec,
        b_r=vec,
        b_c=vec,
        sum_s=vec,
        rks_s=vec,
        tot_s=vec,
        dg_out=vec,
        db_out=vec,
        in_a=plgpu.Barrier(num_arrivals=8),  # k, S, v, T0 and the vectors
        in_b=plgpu.Barrier(num_arrivals=3),  # q, do, dS'
        ag_ready=plgpu.Barrier(),
        vn_ready=plgpu.Barrier(),
        dp_ready=plgpu.Barrier(),
        do_free=plgpu.Barrier(),
        dga_ready=plgpu.Barrier(),
        dw_ready=plgpu.Barrier(),
        das_ready=plgpu.Barrier(),
        rks_ready=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=3),
    )

    def body(*refs, q_s, k_s, v_s, do_dq, h_s, dh_s, t_s, w_dk, ag_s, vn_s, dvn_s, dp_s, m_s, g_r, g_c, b_r, b_c,
             sum_s, rks_s, tot_s, dg_out, db_out, in_a, in_b, ag_ready, vn_ready, dp_ready, do_free, dga_ready,
             dw_ready, das_ready, rks_ready, done):
        (do_s,), (dq_out,) = do_dq
        (w_s,), (dk_out,) = w_dk
        refs = list(refs)
        q_ref, k_ref, v_ref, do_ref, t_ref, g_ref, b_ref, h_ref, dh_ref = (refs.pop(0) for _ in range(9))
        dq_ref, dk_ref, db_ref, dg_ref = refs
        b, n, hh = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
        hk = lax.div(hh, group)
        rows = pl.ds(n * C, C)
        wg = lax.axis_index("wg")
        sq, sv, sk = (C, C), (C, value_dim), (C, key_dim)
        # The [C, V] float32 tiles are processed in 64-column blocks to bound register use.
        vblocks = [pl.ds(i * 64, 64) for i in range(value_dim // 64)]
        sh = (C, 64)

        def gates():
            g_row = plgpu.load(g_r, layout=ROWS)
            g_col = plgpu.load(g_c, layout=COLS)
            gam = jnp.exp2(g_row)  # Gamma: the queries and the W correction read the incoming state
            return g_row, g_col, gam

        def decay_t(g_row, g_col):
            """``D^T``: ``exp(G_i - G_j)`` at row ``j``, column ``i`` for ``i >= j``."""
            keep = iota(sq, 0) <= iota(sq, 1)
            return jnp.exp2(jnp.where(keep, bcast_cols(g_col, sq) - bcast_rows(g_row, sq), -jnp.inf))

        # Gate gradients of the decay matrices are row sums minus column sums. No column
        # sum (a cross-warp reduction) is taken: both warpgroups would use Pallas' one
        # reduction scratch at once. Columns are summed as rows of transposed products.

        def set_registers(n):  # CHUNK_GRADS_REGISTERS: setmaxnreg from the launch share
            if n != CHUNK_GRADS_LAUNCH_REGISTERS:
                plgpu.set_max_registers(n, action="increase" if n > CHUNK_GRADS_LAUNCH_REGISTERS else "decrease")

        @pl.when(wg == 0)
        def _forward_side():
            set_registers(CHUNK_GRADS_REGISTERS[0])
            loads = [(k_ref.at[b, rows, hk], k_s), (h_ref.at[b, hh, n], h_s), (v_ref.at[b, rows, hh], v_s),
                     (t_ref.at[b, hh, rows], t_s), (g_ref.at[b, hh, rows], g_r), (g_ref.at[b, hh, rows], g_c),
                     (b_ref.at[b, hh, rows], b_r), (b_ref.at[b, hh, rows], b_c)]
            for src, dst in loads:
                plgpu.copy_gmem_to_smem(src, dst, in_a)
            for src, dst in ((q_ref.at[b, rows, hk], q_s), (do_ref.at[b, rows, hh], do_s), (dh_ref.at[b, hh, n], dh_s)):
                plgpu.copy_gmem_to_smem(src, dst, in_b)
            plgpu.barrier_wait(in_a)
            g_row, g_col, gam = gates()
            # U = Gamma (k S) and W = v - U, then Ag and v_new = Ag W.
            for blk in vblocks:
                u = matmul(k_s, h_s.at[blk].T, sh) * bcast_rows(gam, sh)
                w_s.at[:, blk][...] = (plgpu.load(v_s.at[:, blk], layout=WGMMA).astype(F32) - u).astype(dtype)
                v_s.at[:, blk][...] = u.astype(dtype)
            decay = decay_matrix(g_row, g_col, sq, strict=False)
            ag_lo = (plgpu.load(t_s, layout=WGMMA).astype(F32) * decay
                     * bcast_cols(plgpu.load(b_c, layout=COLS), sq)).astype(dtype)
            ag_s[...] = ag_lo
            plgpu.commit_smem()
            plgpu.barrier_arrive(ag_ready)
            for blk in vblocks:
                vn_s.at[:, blk][...] = matmul(ag_lo, w_s.at[:, blk], sh).astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(vn_ready)
            plgpu.barrier_wait(in_b)
            # dP = scale (do v_new^T) * D; E = dP * (q k^T) gives the gate gradient of D.
            dp, qk = _products((do_s, vn_s.T, sq), (q_s, k_s.T, sq))
            dp = dp * decay * scale
            dp_lo = dp.astype(dtype)
            dp_s[...] = dp_lo
            plgpu.commit_smem()
            plgpu.barrier_arrive(dp_ready)
            dg = (dp * qk).sum(axis=1)
            vd, kq = _products((vn_s, do_s.T, sq), (k_s, q_s.T, sq))
            et = vd * decay_t(g_row, g_col) * kq
            dg = dg - et.sum(axis=1) * scale  # E^T = (scale (v_new do^T) * D^T) * (k q^T)
            # dq = scale Gamma (do S^T) + dP k
            dq = matmul(do_s, h_s, sk) * bcast_rows(gam * scale, sk)
            dg = dg + (plgpu.load(q_s, layout=WGMMA).astype(F32) * dq).sum(axis=1)
            dq = matmul(dp_lo, k_s, sk, init=dq)
            plgpu.barrier_wait(do_free)  # WG1 has read do
            dq_out[...] = dq.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_out, dq_ref.at[b, rows, hh])
            dg_out[...] = dg
            plgpu.commit_smem()
            plgpu.barrier_arrive(dga_ready)
            plgpu.wait_smem_to_gmem(0)

        def key_decay():
            """``Gamma_r`` (the keys write the outgoing state) and ``gamma`` (the state's own decay)."""
            g_last = g_r[C - 1]
            k_decay = jnp.exp2(g_last - plgpu.load(g_r, layout=ROWS))
            s_decay = jnp.exp2(g_last)
            return k_decay, s_decay

        @pl.when(wg == 1)
        def _backward_side():
            set_registers(CHUNK_GRADS_REGISTERS[1])
            plgpu.barrier_wait(in_a)
            plgpu.barrier_wait(in_b)
            g_row, g_col, gam = gates()
            b_col = plgpu.load(b_c, layout=COLS)
            k_decay, _ = key_decay()
            # dv_new = scale P^T do + Gamma_r (k dS')
            pt = (matmul(k_s, q_s.T, sq) * decay_t(g_row, g_col) * scale).astype(dtype)
            for blk in vblocks:
                dvl, kds = _products((pt, do_s.at[:, blk], sh), (k_s, dh_s.at[blk].T, sh))
                dvn_s.at[:, blk][...] = (kds * bcast_rows(k_decay, sh) + dvl).astype(dtype)
            plgpu.barrier_arrive(do_free)
            plgpu.commit_smem()
            plgpu.barrier_wait(ag_ready)  # U, W and Ag
            # dAg = dv_new W^T (only Ag's support is used) and its transpose
            dag, dagt = _products((dvn_s, w_s.T, sq), (w_s, dvn_s.T, sq))
            dg = None
            # dW = Ag^T dv_new (the value gradient); dvn_s then holds -Gamma dW
            for blk in vblocks:
                dw = matmul(ag_s.T, dvn_s.at[:, blk], sh)
                part = -(dw * plgpu.load(v_s.at[:, blk], layout=WGMMA).astype(F32)).sum(axis=1)  # W = v - U
                dg = part if dg is None else dg + part
                dvn_s.at[:, blk][...] = (dw * bcast_rows(-gam, sh)).astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(dw_ready)  # WG2: dk += -Gamma (dW S^T)
            decay = decay_matrix(g_row, g_col, sq, strict=False)
            # Through the inverse first, so WG2 gets dA0 early: dA0 = -T0^T dT0 T0^T on the strictly lower
            # part (T0 has a unit diagonal); dA0 beta_i then replaces M in m_s.
            strict = iota(sq, 0) > iota(sq, 1)
            ndt = jnp.where(strict, dag * decay * bcast_cols(-b_col, sq), 0.0)
            m_s[...] = matmul(ndt.astype(dtype), t_s.T, sq).astype(dtype)
            plgpu.commit_smem()
            da, kk = _products((t_s.T, m_s, sq), (k_s, k_s.T, sq))
            da = jnp.where(strict, da, 0.0)
            db_inv = (da * kk).sum(axis=1)
            m_s[...] = (da * bcast_rows(plgpu.load(b_r, layout=ROWS), sq)).astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(das_ready)  # WG2: dk += (dA0 beta_i) k + (dA0 beta_i)^T k
            # Ag = T0 * D * beta_j: to beta, the gates and T0. F = dAg * Ag by rows, F^T by rows.
            t0d = plgpu.load(t_s, layout=WGMMA).astype(F32) * decay
            dg = dg + (dag * t0d * bcast_cols(b_col, sq)).sum(axis=1)
            x = dagt * plgpu.load(t_s.T, layout=WGMMA).astype(F32) * decay_t(g_row, g_col)
            db = x.sum(axis=1) + db_inv  # dbeta_j through Ag, then through the inverse
            dg = dg - (x * bcast_rows(plgpu.load(b_r, layout=ROWS), sq)).sum(axis=1)
            plgpu.barrier_wait(dga_ready)
            plgpu.barrier_wait(rks_ready)
            dg = dg - plgpu.load(rks_s, layout=ROWS) + plgpu.load(tot_s, layout=ROWS)
            dg_out[...] = plgpu.load(dg_out, layout=ROWS) + dg
            db_out[...] = db
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dg_out, dg_ref.at[b, hh, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(db_out, db_ref.at[b, hh, rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _key_side():
            set_registers(CHUNK_GRADS_REGISTERS[2])
            plgpu.barrier_wait(in_a)
            plgpu.barrier_wait(in_b)
            k_decay, s_decay = key_decay()
            # The last token gets sum(rks) + gamma <S, dS'> (state decay, in 64-row blocks of the
            # transposed states); <S, dS'> needs only the loads, so it runs while WG0 forms v_new.
            sd = None
            for r in range(value_dim // 64):
                blk = pl.ds(r * 64, 64)
                part = (plgpu.load(h_s.at[blk], layout=WGMMA).astype(F32)
                        * plgpu.load(dh_s.at[blk], layout=WGMMA).astype(F32)).sum(axis=1)
                sd = part if sd is None else sd + part
            # dk, starting from its state part Gamma_r (v_new dS'^T), whose key products feed the gate gradient.
            plgpu.barrier_wait(vn_ready)
            vnr = [(plgpu.load(vn_s.at[:, blk], layout=WGMMA).astype(F32) * bcast_rows(k_decay, sh)).astype(dtype)
                   for blk in vblocks]

            def state_part(acc):
                for blk, a in zip(vblocks, vnr):
                    plgpu.wgmma(acc, a, dh_s.at[blk])

            dks = lax.optimization_barrier(pl.run_state(state_part)(plgpu.ACC.init(jnp.zeros(sk, F32))))
            rks = (plgpu.load(k_s, layout=WGMMA).astype(F32) * dks).sum(axis=1)

            def update(acc):
                plgpu.barrier_wait(dw_ready)
                plgpu.wgmma(acc, dvn_s, h_s)  # -Gamma (dW S^T)
                plgpu.barrier_wait(dp_ready)
                plgpu.wgmma(acc, dp_s.T, q_s)  # dP^T q
                plgpu.barrier_wait(das_ready)
                plgpu.wgmma(acc, m_s, k_s)
                plgpu.wgmma(acc, m_s.T, k_s)

            dk = lax.optimization_barrier(pl.run_state(update)(plgpu.ACC.init(dks)))
            dk_out[...] = dk.astype(dtype)  # W was last read by WG1's dAg product (before dw_ready)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dk_out, dk_ref.at[b, rows, hh])
            # The total is summed in the column layout (within warps).
            sum_s[...] = rks + sd * s_decay
            plgpu.commit_smem()
            total = plgpu.load(sum_s, layout=COLS).sum()
            last = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=ROWS) == C - 1
            rks_s[...] = rks
            tot_s[...] = jnp.where(last, total, 0.0)
            plgpu.commit_smem()
            plgpu.barrier_arrive(rks_ready)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [q, k, v, do, t0, g2, beta, h, dh]
    dq, dk, db, dg = build_kernel(
        body, name="gdn_mosaic_chunk_grads", out_type=out_type, scratch=scratch, grid=(batch, nc, heads),
        grid_names=("b", "n", "h"), num_threads=3, thread_name="wg",
    )(*args)
    return dq, dk, db, dg


# ---------------------------------------------------------------------------------------------------------------
# the jnp twin of the three kernels, and the backward they compose
# ---------------------------------------------------------------------------------------------------------------
def _twin_grads(forward, q, k, v, do, g2, beta, h0t, dht, *, num_states: int):
    """jax.vjp of ``forward(q, k, v, G, beta, h0t) -> (o, final S^T)`` (a jnp twin of the kernels' forward, G in
    natural units, q and k per value head, states transposed) at the kernels' operands, with the cotangents do and
    dht (None: zero). Returns as :func:`kernels_reference`."""
    _, _, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    q_rep, k_rep = (jnp.repeat(x, hv // hk, axis=2).astype(F32) for x in (q, k))
    zeros = jnp.zeros((num_states, hv, vdim, kdim), F32)
    h0 = zeros if h0t is None else h0t.astype(F32)
    _, vjp = jax.vjp(forward, q_rep, k_rep, v.astype(F32), g2.astype(F32) * LN2, beta.astype(F32), h0)
    dq, dk, dv, dgc, dbeta, dh0 = vjp((do.astype(F32), zeros if dht is None else dht.astype(F32)))
    return dq, dk, dv, dbeta, dgc, (None if h0t is None else dh0)


def kernels_reference(q, k, v, do, g2, beta, h0t, dht, *, scale: float):
    """What the three kernels give together, in jnp (fp32, matmul precision highest): jax.vjp of the jnp chunk form
    (:func:`kkt_fwd_reference`'s T0, then ``fused_state_pass_reference``) over the kernels' own operands. Returns
    (dq, dk [B, Tp, Hv, K] per value head, dv [B, Tp, Hv, V], dbeta [B, Hv, Tp], dG [B, Hv, Tp] (natural units,
    before the reverse chunk cumsum), dh0 [B, Hv, V, K] transposed or None); arguments as :func:`state_bwd_wy`
    and :func:`chunk_grads` take them (g2 in log2 units)."""
    hv = v.shape[2]

    def forward(q, k, v, gcum, beta, h0t):
        t0 = kkt_fwd_reference(k, beta, heads=hv)
        return fused_state_pass_reference(q, k, v, t0, gcum, beta, h0t, scale=scale, out_final=True,
                                          head_major=True)
    return _twin_grads(forward, q, k, v, do, g2, beta, h0t, dht, num_states=k.shape[0])


IMPLS = ("mosaic", "reference")


def _kernel_grads(qp, kp, vp, dop, t0, g2, beta_hm, h0t, dht_t, *, scale: float, kernel: bool, walk=None,
                  num_states: int):
    """The three kernels (or, ``kernel`` False, their twin) on stage 1a's operands, dG's reverse chunk cumsum
    applied: (dq, dk per value head, dv, dbeta, dg on the kernels' rows, dh0 transposed or None). ``walk``: the
    packed row's walk table (:func:`state_fwd_wy`)."""
    b, tp = qp.shape[:2]
    hv = vp.shape[2]
    if kernel:
        row_walk = {} if walk is None else dict(walk=walk)
        h = state_fwd_wy(kp, vp, t0, g2, beta_hm, h0t, **row_walk)
        dh, dv, dh0t = state_bwd_wy(qp, kp, dop, t0, g2, beta_hm, dht_t, scale=scale, want_dh0=h0t is not None,
                                    **(dict(row_walk, num_states=num_states) if walk is not None else {}))
        dq, dk, dbeta, dgc = chunk_grads(qp, kp, vp, dop, t0, g2, beta_hm, h, dh, scale=scale)
    elif walk is None:
        dq, dk, dv, dbeta, dgc, dh0t = kernels_reference(qp, kp, vp, dop, g2, beta_hm, h0t, dht_t, scale=scale)
    else:
        dq, dk, dv, dbeta, dgc, dh0t = walk_kernels_reference(qp, kp, vp, dop, g2, beta_hm, h0t, dht_t, walk,
                                                              scale=scale, num_states=num_states)
    dg = lax.cumsum(dgc.reshape(b, hv, tp // C, C), axis=3, reverse=True).reshape(b, hv, tp)
    return dq, dk, dv, dbeta, dg, dh0t


def _user_grads(grads, rows, q, k, v, g, beta):
    """The gradients in the op's layouts and dtypes: ``rows`` maps [B, Tp, ...] on the kernels' rows to the user's
    [B, T, ...] (the padding cut off, or the packed row gathered back); dg zero where the forward floored g (a
    select: no gradient below G_FLOOR); dq, dk summed over each key head's group of value heads."""
    dq, dk, dv, dbeta, dg, dh0t = grads
    b, t, hk, kdim = q.shape
    hv = v.shape[2]
    dg = jnp.where(g < G_FLOOR, 0.0, rows(jnp.swapaxes(dg, 1, 2))).astype(g.dtype)
    dbeta = rows(jnp.swapaxes(dbeta, 1, 2)).astype(beta.dtype)

    def key_grad(x, dtype):        # [B, Tp, Hv, K] per value head -> [B, T, Hk, K] summed over each group
        return rows(x.astype(F32)).reshape(b, t, hk, hv // hk, kdim).sum(axis=3).astype(dtype)
    dh0 = None if dh0t is None else jnp.swapaxes(dh0t, -1, -2).astype(F32)
    return key_grad(dq, q.dtype), key_grad(dk, k.dtype), rows(dv).astype(v.dtype), dg, dbeta, dh0


@functools.partial(jax.jit, static_argnames=("scale", "impl"))
def chunk_gated_delta_rule_bwd(q, k, v, g, beta, initial_state, do, dht, *, scale: float, impl: str = "mosaic"):
    """Gradients of ``sum(o * do) + sum(final_state * dht)`` through the dense chunked gated delta rule
    (``chunk.chunk_gated_delta_rule_fwd``'s inputs and results, q and k as the kernels read them, i.e. after any
    L2 norm). Returns (dq, dk [B, T, Hk, K] in q's / k's dtype, dv [B, T, Hv, V] in v's, dg [B, T, Hv] in g's,
    dbeta [B, T, Hv] in beta's, dh0 [B, Hv, K, V] fp32 or None).

    q, k [B, T, Hk, K]; v, do [B, T, Hv, V]; g (log-decay), beta [B, T, Hv]; initial_state [B, Hv, K, V] fp32 or
    None; dht [B, Hv, K, V] or None (no final state asked, or its cotangent zero). ``impl``: "mosaic" (the three
    kernels, a Hopper GPU) or "reference" (:func:`kernels_reference` in their place, anywhere).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    t = q.shape[1]
    qp, kp, vp, t0, g2, beta_hm, h0t = prepare_head_major(q, k, v, g, beta, initial_state, kernel=impl == "mosaic",
                                                          exp2=True)
    dop = jnp.pad(do.astype(qp.dtype), [(0, 0), (0, qp.shape[1] - t), (0, 0), (0, 0)])
    dht_t = None if dht is None else jnp.swapaxes(dht.astype(F32), -1, -2)
    grads = _kernel_grads(qp, kp, vp, dop, t0, g2, beta_hm, h0t, dht_t, scale=scale, kernel=impl == "mosaic",
                          num_states=q.shape[0])
    return _user_grads(grads, lambda x: x[:, :t], q, k, v, g, beta)


# ---------------------------------------------------------------------------------------------------------------
# packed sequences: the repacked row (each sequence from a chunk boundary) and the walk table of varlen.py
# ---------------------------------------------------------------------------------------------------------------
def walk_kernels_reference(q, k, v, do, g2, beta, h0t, dht, walk, *, scale: float, num_states: int):
    """What the three kernels give with a walk table (:func:`state_fwd_wy` / :func:`state_bwd_wy` ``walk``), in
    jnp: jax.vjp of a ``lax.scan`` over the repacked row's chunks in which a chunk that starts a walk row takes
    that row's initial state and the row's final state is the state leaving its last chunk (its initial state when
    it has none). Arguments as the kernels take them on the repacked row (B = 1; h0t, dht [num_states, Hv, V, K]
    transposed or None); returns as :func:`kernels_reference` (dh0 over all num_states rows)."""
    from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk_reference import chunk_layout, chunk_step
    _, tp, _, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    nc = tp // C
    c0, count, srow = walk[:, 0], walk[:, 1], walk[:, 2]
    cidx = jnp.arange(nc, dtype=jnp.int32)
    starts = (cidx[None, :] == c0[:, None]) & (count[:, None] > 0)                 # [R, NC]
    first = jnp.any(starts, axis=0)
    first_state = jnp.sum(jnp.where(starts, srow[:, None], 0), axis=0)            # state row of a starting chunk
    last = jnp.clip(c0 + count - 1, 0, nc - 1)

    def forward(q, k, v, gcum, beta, h0t):
        h0 = jnp.swapaxes(h0t, -1, -2)                                              # [S, Hv, K, V]
        t0 = kkt_fwd_reference(k, beta, heads=hv)
        t, gc, bc = chunk_layout(t0, gcum, beta, head_major=True, exp2=False)      # [NC, Hv, C, C], [NC, Hv, C]

        def chunks(x):                                                              # [1, Tp, Hv, D] -> [NC, Hv, C, D]
            return jnp.swapaxes(x[0].reshape(nc, C, hv, x.shape[3]), 1, 2)

        def step(s, xs):
            qq, kk, vv, tt, gg, bb, f, sr = xs
            s = jnp.where(f, h0[sr], s)
            s, o = chunk_step(s[None], (qq[None], kk[None], vv[None], tt[None], gg[None], bb[None]), scale)
            return s[0], (o[0], s[0])
        _, (o, s_out) = lax.scan(step, jnp.zeros((hv, kdim, vdim), F32),
                                 (chunks(q), chunks(k), chunks(v), t, gc, bc, first, first_state))
        ht = jnp.where((count > 0)[:, None, None, None], s_out[last], h0[srow])
        final = h0.at[srow].set(ht)
        return jnp.swapaxes(o, 1, 2).reshape(1, tp, hv, vdim), jnp.swapaxes(final, -1, -2)
    return _twin_grads(forward, q, k, v, do, g2, beta, h0t, dht, num_states=num_states)


@functools.partial(jax.jit, static_argnames=("scale", "impl"))
def chunk_gated_delta_rule_varlen_bwd(q, k, v, g, beta, cu_seqlens, initial_state, do, dht, *, scale: float,
                                      impl: str = "mosaic"):
    """:func:`chunk_gated_delta_rule_bwd` for packed sequences: q, k [1, T, Hk, K]; v, do [1, T, Hv, V]; g, beta
    [1, T, Hv]; cu_seqlens [N + 1] int32; initial_state and dht [N, Hv, K, V] fp32 or None. The packed row is
    repacked so that every sequence starts at a chunk boundary (``varlen.layout``, as the forward's repacked
    reads), the two state passes walk each sequence's chunks from its own initial state / final-state cotangent
    (one CTA row per sequence), the per-chunk gradients run over the repacked row, and the gradients are gathered
    back to the packed tokens: exactly zero at tokens >= cu_seqlens[N] (a select). Returns as
    :func:`chunk_gated_delta_rule_bwd` (dh0 [N, Hv, K, V])."""
    from pallas_kernels.gated_delta_rule.mosaic_gpu import varlen as mv
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    _, src, keep, back, valid, walk = mv.layout(cu, q.shape[1])
    packed = (q, k, v, g.astype(F32), beta.astype(F32), do.astype(q.dtype))
    q_r, k_r, v_r, g_r, b_r, do_r = mv.repack(packed, src, keep)
    qp, kp, vp, t0, g2, beta_hm, h0t = prepare_head_major(q_r, k_r, v_r, g_r, b_r, initial_state,
                                                          kernel=impl == "mosaic", exp2=True)
    dht_t = None if dht is None else jnp.swapaxes(dht.astype(F32), -1, -2)
    grads = _kernel_grads(qp, kp, vp, do_r, t0, g2, beta_hm, h0t, dht_t, scale=scale, kernel=impl == "mosaic",
                          walk=walk[:, :3], num_states=cu.shape[0] - 1)
    # [1, Tp, ...] on the repacked row -> [1, T, ...], zero past cu_seqlens[N]
    return _user_grads(grads, lambda x: mv.gather_rows(x[0], back, valid)[None], q, k, v, g, beta)
