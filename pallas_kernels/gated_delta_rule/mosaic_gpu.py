# Copyright 2026 KarLex AI, Inc.
# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
# The kernel body of fused_state_pass and the helpers marked "(jla)" are adapted from jax-linear-attention 0.1.0
# (Apache-2.0), jla/ops/mosaic_gpu/scalar_gate_fused.py (fused_fwd_wy) and jla/ops/mosaic_gpu/_common.py, which
# were themselves adapted from flash-linear-attention (MIT) and FlashQLA (MIT). See NOTICE in this folder.
"""Mosaic GPU (Hopper, sm_90) stage of the chunked gated delta rule forward: the warp-specialised fused state
pass (JLA_STUDY.md, port plan step 1). **Off by default**: ``ENABLED`` is False and api.py does not call it; the
probe (benchmarks/gpu/jla_probe.py) and the GPU-marked tests (tests/pallas_kernels/test_gdn_mosaic_gpu.py) do.

What it replaces: stage 1b (``wu_aqk``: w, u, Aqk written to HBM) and stage 2 (``state_pass``) of
pallas_triton.py, with one kernel that builds the WY factors inside the chunk loop from stage 1a's T (FlashQLA's
fused forward as jla ports it). Stage 1a (``kkt_solve``, Pallas Triton) is unchanged: its gated
T = (I + A)^-1 (A_ij = beta_i k_i.k_j e^(G_i - G_j), j < i) and chunk-local cumulative gates G are the inputs.
With the gated T (jla uses the gate-free T0 and multiplies by e^(G_i - G_j) here) the WY identity reads

    v_new = u - w S = T diag(beta) (v - diag(e^G) k S) = Ag (v - Gamma k S),    Ag_ij = T_ij beta_j

One CTA per (sequence, value head, 64 value columns), three warpgroups (128 threads each):
  WG0 (state)  S^T [BV, K] fp32 in registers (WGMMA layout); per chunk: publish S^T (input dtype) to SMEM,
               X^T = S^T k^T (wgmma), W^T = v^T - X^T Gamma, v_new^T = W^T Ag^T (wgmma), publish v_new^T,
               S^T <- e^(G_last) S^T + (e^(G_last - G) v_new)^T k (wgmma). The only serial chain.
  WG1 (output) Ag = T * beta_j in place of T in SMEM (before WG0 needs it), P = (q k^T) * e^(G_i - G_j) (i >= j),
               then o = scale (e^G (q S) + P v_new) from the published tiles, staged and stored by TMA.
  WG2 (memory) streams q, k (key head h // (Hv / Hk)), v, T and the gate / beta vectors by TMA into a
               2-4 stage ring (as deep as 220 KB of SMEM allows: 2 at K = V = 128 bf16).

Scope of this first stage (dense input only): q, k, v bf16 / fp16 of one dtype, K and V in {64, 128}, Hv a
multiple of Hk, any T (padded with zero tokens to a multiple of C = 64: zero k, v, beta and g leave the state and
the real rows unchanged), initial state [B, Hv, K, V] fp32 or None, the final state returned. Not yet: cu_seqlens
packing, the slots pool (slot ids, has_initial_state, drop-on-bad-id), fp32 inputs; JLA_STUDY.md says what each
needs. Mosaic GPU kernels do not run in interpret mode on this repo's CPU jax (0.10.2; the code targets 0.11's
Pallas Mosaic GPU API), so the tests are GPU-marked.

Shape legend: B batch, T tokens (Tp padded to a multiple of C), Hk / Hv key / value heads, K / V head dims,
C = 64 chunk, NC = B * Tp / C chunks (chunk c = b * Tp / C + j covers tokens [j C, (j + 1) C) of row b), BV = 64.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

ENABLED = False        # api.py does not route here yet (a backend switch that is off)
C = 64                 # chunk size (stage 1a's T is [C, C])
BV = 64                # value columns per CTA (WG0's S^T [BV, K] fp32 is 64 registers a thread at K = 128)
SMEM_BUDGET = 220 * 1024
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128)
F32 = jnp.float32


def _plgpu():
    """The Pallas Mosaic GPU module, imported on first use (keeps this module importable everywhere)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return plgpu


# ---------------------------------------------------------------------------------------------------------------
# helpers (jla: _common.py)
# ---------------------------------------------------------------------------------------------------------------
def _smem(shape, dtype):
    """(jla) SMEM buffer tiled and swizzled for TMA and WGMMA (minor dim = last dim)."""
    plgpu = _plgpu()
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _iota(shape, dim):
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _bcast_rows(vec, shape):
    """(jla) ``vec[i]`` along row i (vec in the WGMMA row layout)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def _bcast_cols(vec, shape):
    """(jla) ``vec[j]`` along column j (vec in the WGMMA column layout)."""
    return lax.broadcast_in_dim(vec, shape, [1])


def _matmul(a, b, shape, init=None):
    """(jla) ``init + a @ b`` on the tensor cores (a: SMEM ref or 16-bit WGMMA registers; b: SMEM ref), fp32.

    The optimization barrier keeps LLVM from reading the accumulator before ``wgmma.wait_group`` (jla saw
    silently zeroed products without it, sm_90, jax 0.11.2)."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()

    def body(acc):
        plgpu.wgmma(acc, a, b)

    if init is None:
        def scoped(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]
        out = pl.run_scoped(scoped, plgpu.ACC(shape, F32))
    else:
        out = pl.run_state(body)(plgpu.ACC.init(init))
    return lax.optimization_barrier(out)


def _stages(per_stage: int, fixed: int) -> int:
    """Deepest input ring (2 to 4 stages) that fits SMEM_BUDGET."""
    for stages in (4, 3, 2):
        if stages * per_stage + fixed <= SMEM_BUDGET:
            return stages
    raise ValueError(f"mosaic_gpu fused state pass needs {2 * per_stage + fixed} bytes of shared memory")


# ---------------------------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------------------------
def fused_state_pass(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool, interpret=None):
    """Stages 1b + 2 as one warp-specialised Mosaic GPU kernel. Returns (o [B, Tp, Hv, V] in q's dtype,
    final S^T [B, Hv, V, K] fp32 or None).

    q, k [B, Tp, Hk, K]; v [B, Tp, Hv, V] (one 16-bit dtype; Tp a multiple of C);
    t [NC, Hv, C, C] stage 1a's gated T (input dtype, zeros above the diagonal); gcum [NC, Hv, C] fp32 stage 1a's
    chunk-local cumulative log-decay (natural log); beta_c [NC, Hv, C] fp32 (beta in chunk-major layout);
    h0t [B, Hv, V, K] fp32 (the initial state transposed) or None (zeros).
    """
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    WGMMA = plgpu.Layout.WGMMA
    ROWS = WGMMA.reduce(1)       # one value per row of a WGMMA tile
    COLS = WGMMA.reduce(0)       # one value per column
    batch, padded, kv_heads, key_dim = k.shape
    heads, value_dim = v.shape[2], v.shape[3]
    group = heads // kv_heads
    ncb = padded // C            # chunks per row
    nv = value_dim // BV
    dtype = k.dtype
    out_dtype = q.dtype
    has_h0 = h0t is not None
    isz = jnp.dtype(dtype).itemsize
    n_vec = 4                    # g_state, g_rows, g_cols, b_cols
    per_stage = 2 * C * key_dim * isz + C * BV * isz + C * C * isz + n_vec * C * 4
    fixed = 2 * BV * key_dim * isz + 2 * C * BV * isz + 2 * C * BV * jnp.dtype(out_dtype).itemsize
    fixed += (BV * key_dim * 4 if has_h0 or out_final else 0) + 4096 + n_vec * 1024
    stages = _stages(per_stage, fixed)
    n_copies = 4 + n_vec

    out_type = [jax.ShapeDtypeStruct((batch, padded, heads, value_dim), out_dtype)]
    if out_final:
        out_type.append(jax.ShapeDtypeStruct((batch, heads, value_dim, key_dim), F32))
    vecs = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        q_s=_smem((stages, C, key_dim), dtype),
        k_s=_smem((stages, C, key_dim), dtype),
        v_s=_smem((stages, C, BV), dtype),
        t_s=_smem((stages, C, C), dtype),        # T, then Ag = T * beta_j (written by WG1)
        g_state=vecs,                            # WG0: column view + last gate
        g_rows=vecs,                             # WG1: row view
        g_cols=vecs,                             # WG1: column view
        b_cols=vecs,                             # WG1: beta per column of Ag
        s_pub=_smem((2, BV, key_dim), dtype),
        vn_pub=_smem((2, C, BV), dtype),
        o_out=_smem((2, C, BV), out_dtype),
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages),
        s_ready=plgpu.Barrier(num_barriers=2),
        s_free=plgpu.Barrier(num_barriers=2),
        state_bar=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=3),
    )
    if has_h0 or out_final:
        scratch.update(state_smem=plgpu.SMEM((BV, key_dim), F32))

    def body(*refs, q_s, k_s, v_s, t_s, g_state, g_rows, g_cols, b_cols, s_pub, vn_pub, o_out, in_bar, in_free,
             ag_ready, s_ready, s_free, state_bar, done, state_smem=None):
        refs = list(refs)
        q_ref, k_ref, v_ref, t_ref, g_ref, b_ref = (refs.pop(0) for _ in range(6))
        h0_ref = refs.pop(0) if has_h0 else None
        o_ref = refs.pop(0)
        ht_ref = refs.pop(0) if out_final else None
        b, hh, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        hk = lax.div(hh, group)
        v0 = iv * BV
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(n, slot):          # n: chunk index within row b
                rows = pl.ds(n * C, C)
                c = b * ncb + n          # global chunk index (stage 1a's layout)
                bar = in_bar.at[slot]
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hk], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], k_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hh, pl.ds(v0, BV)], v_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(t_ref.at[c, hh], t_s.at[slot], bar)
                for g_buf in (g_state, g_rows, g_cols):
                    plgpu.copy_gmem_to_smem(g_ref.at[c, hh], g_buf.at[slot], bar)
                plgpu.copy_gmem_to_smem(b_ref.at[c, hh], b_cols.at[slot], bar)

            for n in range(min(stages, ncb)):
                issue(n, n)

            @pl.loop(stages, ncb)
            def _refill(n):
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(in_free.at[slot])
                issue(n, slot)

            for n in range(max(ncb - stages, 0), ncb):      # observe the remaining releases
                plgpu.barrier_wait(in_free.at[n % stages])

        @pl.when(wg == 0)
        def _state():
            plgpu.set_max_registers(232, action="increase")
            if has_h0:
                plgpu.copy_gmem_to_smem(h0_ref.at[b, hh, pl.ds(v0, BV)], state_smem, state_bar)
                plgpu.barrier_wait(state_bar)
                s0 = plgpu.load(state_smem, layout=WGMMA)
            else:
                s0 = plgpu.layout_cast(jnp.zeros((BV, key_dim), F32), WGMMA)

            def step(n, s_t):
                slot = lax.rem(n, stages)
                half = lax.rem(n, 2)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(n >= 2)
                def _():                 # WG1 has finished reading the tiles published two chunks ago
                    plgpu.barrier_wait(s_free.at[half])

                s_lo = s_t.astype(dtype)
                s_pub.at[half][...] = s_lo
                g_last = g_state[slot, C - 1]
                g_col = plgpu.load(g_state.at[slot], layout=COLS)
                key_decay = jnp.exp(g_col)                  # Gamma: the correction term reads the incoming state
                k_decay = jnp.exp(g_last - g_col)
                s_decay = jnp.exp(g_last)
                # W^T = v^T - (S^T k^T) Gamma, then v_new^T = W^T Ag^T
                x_t = _matmul(s_lo, k_s.at[slot].T, (BV, C))
                v_t = plgpu.load(v_s.at[slot].T, layout=WGMMA).astype(F32)
                w_t = (v_t - x_t * _bcast_cols(key_decay, (BV, C))).astype(dtype)
                plgpu.barrier_wait(ag_ready.at[slot])
                vn_t = _matmul(w_t, t_s.at[slot].T, (BV, C))
                vn_pub.at[half].T[...] = vn_t.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(s_ready.at[half])
                vd_t = (vn_t * _bcast_cols(k_decay, (BV, C))).astype(dtype)
                s_new = _matmul(vd_t, k_s.at[slot], (BV, key_dim), init=s_t * s_decay)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            s_t = lax.fori_loop(0, ncb, step, s0)
            for n in range(max(ncb - 2, 0), ncb):           # observe the last releases of the published tiles
                plgpu.barrier_wait(s_free.at[n % 2])
            if out_final:
                state_smem[...] = s_t
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(state_smem, ht_ref.at[b, hh, pl.ds(v0, BV)])
                plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _output():
            plgpu.set_max_registers(232, action="increase")

            def step(n, carry):
                slot = lax.rem(n, stages)
                half = lax.rem(n, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                g_row = plgpu.load(g_rows.at[slot], layout=ROWS)
                g_col = plgpu.load(g_cols.at[slot], layout=COLS)
                q_decay = jnp.exp(g_row)
                sq = (C, C)
                keep = _iota(sq, 0) >= _iota(sq, 1)
                # the exponent is masked before exp, so acausal entries never overflow (jla decay_matrix)
                decay = jnp.exp(jnp.where(keep, _bcast_rows(g_row, sq) - _bcast_cols(g_col, sq), -jnp.inf))
                # Ag = T * beta_j replaces T in the input buffer (T already carries e^(G_i - G_j))
                t_in = plgpu.load(t_s.at[slot], layout=WGMMA).astype(F32)
                ag = t_in * _bcast_cols(plgpu.load(b_cols.at[slot], layout=COLS), sq)
                t_s.at[slot][...] = ag.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ag_ready.at[slot])
                p = _matmul(q_s.at[slot], k_s.at[slot].T, sq)
                p_lo = (p * decay).astype(dtype)
                plgpu.barrier_wait(s_ready.at[half])
                o = _matmul(q_s.at[slot], s_pub.at[half].T, (C, BV))
                o = _matmul(p_lo, vn_pub.at[half], (C, BV), init=o * _bcast_rows(q_decay, (C, BV)))
                plgpu.barrier_arrive(s_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # o_out[half] of chunk n - 2 was sent
                o_out.at[half][...] = (o * scale).astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_out.at[half], o_ref.at[b, pl.ds(n * C, C), hh, pl.ds(v0, BV)])
                return carry

            lax.fori_loop(0, ncb, step, None)
            plgpu.wait_smem_to_gmem(0)

        # (jla finish_together) every warpgroup waits for the others before it exits: one exiting while another
        # still issued WGMMAs ended some runs in CUDA_ERROR_ILLEGAL_INSTRUCTION (sm_90, jax 0.11.2)
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    args = [q, k, v, t, gcum, beta_c] + ([h0t] if has_h0 else [])
    outs = list(plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(batch, heads, nv), grid_names=("b", "h", "v"),
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
        kernel_name="gdn_mosaic_fused_state_pass", num_threads=3, thread_name="wg",
    )(*args))
    return outs[0], (outs[1] if out_final else None)


# ---------------------------------------------------------------------------------------------------------------
# entry point (dense): Triton stage 1a + the Mosaic GPU fused pass
# ---------------------------------------------------------------------------------------------------------------
def check_supported(q, k, v, g, beta, initial_state=None, *, kernel: bool = True) -> None:
    """Raises ValueError naming the argument when this first Mosaic GPU stage cannot run the call (``kernel``
    False: the limits of the jnp reference path, which also takes float32 and any head dims)."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"mosaic_gpu gdn: q and k must be [B, T, Hk, K] of one shape; got q {q.shape}, k {k.shape}")
    if v.ndim != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"mosaic_gpu gdn: v must be [B, T, Hv, V] with Hv a multiple of Hk={q.shape[2]}; "
                         f"got v {v.shape}")
    dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if kernel and (len(dts) != 1 or next(iter(dts)) not in SUPPORTED_DTYPES):
        raise ValueError(f"mosaic_gpu gdn: q, k, v must share one dtype in (bfloat16, float16); "
                         f"got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if kernel and (q.shape[3] not in SUPPORTED_HEAD_DIMS or v.shape[3] not in SUPPORTED_HEAD_DIMS):
        raise ValueError(f"mosaic_gpu gdn: head dims K (got {q.shape[3]}) and V (got {v.shape[3]}) must be in "
                         f"{SUPPORTED_HEAD_DIMS}")
    b, t, hv = v.shape[:3]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"mosaic_gpu gdn: {name} must be [B, T, Hv] = {(b, t, hv)}; got {x.shape}")
    if initial_state is not None and initial_state.shape != (b, hv, q.shape[3], v.shape[3]):
        raise ValueError(f"mosaic_gpu gdn: initial_state must be [B, Hv, K, V] = {(b, hv, q.shape[3], v.shape[3])}; "
                         f"got {initial_state.shape}")
    if t == 0:
        raise ValueError("mosaic_gpu gdn: q has T = 0 tokens (nothing to run)")


def fused_state_pass_reference(q, k, v, t, gcum, beta_c, h0t, *, scale: float, out_final: bool):
    """What :func:`fused_state_pass` computes, in jnp (fp32, matmul precision highest), same arguments and
    results: the kernel's per-chunk formulas (W = v - Gamma k S, v_new = (T * beta_j) W, o, S update) as a
    lax.scan over each row's chunks. Runs anywhere; the CPU tests check it (behind stage 1a in interpret mode)
    against the float64 per-token oracle, so the algebra the kernel implements is tested without a GPU."""
    b, tp, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    ncb = tp // C
    hp = lax.Precision.HIGHEST

    def chunks(x):      # [B, Tp, H, D] -> [ncb, B, Hv, C, D] fp32
        x = jnp.repeat(x, hv // x.shape[2], axis=2).astype(F32)
        return jnp.transpose(x.reshape(b, ncb, C, hv, x.shape[3]), (1, 0, 3, 2, 4))
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    tc = jnp.swapaxes(t.astype(F32).reshape(b, ncb, hv, C, C), 0, 1)                  # [ncb, B, Hv, C, C]
    gc = jnp.swapaxes(gcum.astype(F32).reshape(b, ncb, hv, C), 0, 1)                  # [ncb, B, Hv, C]
    bc = jnp.swapaxes(beta_c.astype(F32).reshape(b, ncb, hv, C), 0, 1)
    s0 = (jnp.zeros((b, hv, kdim, vdim), F32) if h0t is None else jnp.swapaxes(h0t.astype(F32), -1, -2))
    keep = jnp.tril(jnp.ones((C, C), bool))

    def step(s, xs):
        qq, kk, vv, tt, gg, bb = xs
        ag = tt * bb[..., None, :]                                                   # T_ij beta_j
        x = jnp.einsum("bhck,bhkv->bhcv", kk, s, precision=hp)
        w = vv - jnp.exp(gg)[..., None] * x
        vn = jnp.einsum("bhij,bhjv->bhiv", ag, w, precision=hp)
        decay = jnp.exp(jnp.where(keep, gg[..., :, None] - gg[..., None, :], -jnp.inf))
        p = jnp.einsum("bhik,bhjk->bhij", qq, kk, precision=hp) * decay
        o = scale * (jnp.exp(gg)[..., None] * jnp.einsum("bhck,bhkv->bhcv", qq, s, precision=hp)
                     + jnp.einsum("bhij,bhjv->bhiv", p, vn, precision=hp))
        glast = gg[..., -1]
        vd = jnp.exp(glast[..., None] - gg)[..., None] * vn
        s = jnp.exp(glast)[..., None, None] * s + jnp.einsum("bhck,bhcv->bhkv", kk, vd, precision=hp)
        return s, o

    s, o = lax.scan(step, s0, (qc, kc, vc, tc, gc, bc))                               # o [ncb, B, Hv, C, V]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(b, tp, hv, vdim).astype(q.dtype)
    return o, (jnp.swapaxes(s, -1, -2) if out_final else None)


def _prepare(q, k, v, g, beta, initial_state, *, interpret: bool):
    """Pads T to a multiple of C (zero tokens) and runs stage 1a (Pallas Triton): the fused pass's operands."""
    from pallas_kernels.gated_delta_rule import pallas_triton as kt
    from pallas_kernels.gated_delta_rule.chunk_map import kernel_chunk_map
    b, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    pad = (-t) % C
    tp = t + pad
    padt = (lambda x: x) if pad == 0 else (lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)))
    q, k, v = padt(q), padt(k), padt(v)
    g, beta = padt(g.astype(F32)), padt(beta)                        # zero tokens: no decay, no update
    start, length, _, _ = kernel_chunk_map(b, tp, None, C)
    config = kt.launch_config(vdim, b * hv, q.dtype)
    kf, gf, bf = k.reshape(b * tp, hk, kdim), g.reshape(b * tp, hv), beta.reshape(b * tp, hv)
    if interpret:        # interpret mode clamps dynamic slices: pad C rows as pallas_triton._run does
        kf, gf, bf = (jnp.pad(x, [(0, C)] + [(0, 0)] * (x.ndim - 1)) for x in (kf, gf, bf))
    tmat, gcum = kt.kkt_solve(kf, gf, bf, chunk_start=start, chunk_len=length, chunk=C, num_v_heads=hv,
                              interpret=interpret, config=config)
    nc = b * tp // C
    beta_c = jnp.swapaxes(beta.astype(F32).reshape(nc, C, hv), 1, 2)                 # [NC, Hv, C]
    h0t = None if initial_state is None else jnp.swapaxes(initial_state.astype(F32), -1, -2)
    return q, k, v, tmat, gcum, beta_c, h0t


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "impl"))
def chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=None, *, scale=None, output_final_state=True,
                               impl: str = "mosaic"):
    """Dense chunked gated delta rule forward: Pallas Triton stage 1a, then :func:`fused_state_pass`
    (``impl="mosaic"``, a Hopper GPU) or its jnp twin :func:`fused_state_pass_reference` behind stage 1a in
    interpret mode (``impl="reference"``, anywhere: the CPU check of the algebra).

    q, k [B, T, Hk, K]; v [B, T, Hv, V] (mosaic: one of bf16 / fp16, K, V in {64, 128}); g [B, T, Hv] fp32
    log-decay; beta [B, T, Hv]; initial_state [B, Hv, K, V] fp32 or None. Returns (o [B, T, Hv, V] in v's dtype,
    final_state [B, Hv, K, V] fp32 or None), as ``jax_gdn.ops.chunk_gated_delta_rule`` (no cu_seqlens).
    """
    if impl not in ("mosaic", "reference"):
        raise ValueError(f"impl must be 'mosaic' or 'reference'; got {impl!r}")
    check_supported(q, k, v, g, beta, initial_state, kernel=impl == "mosaic")
    t, kdim = q.shape[1], q.shape[3]
    scale = kdim ** -0.5 if scale is None else float(scale)
    ops_ = _prepare(q, k, v, g, beta, initial_state, interpret=impl == "reference")
    run = fused_state_pass if impl == "mosaic" else fused_state_pass_reference
    o, ht = run(*ops_, scale=scale, out_final=output_final_state)
    o = o[:, :t].astype(v.dtype)
    return o, (None if ht is None else jnp.swapaxes(ht, -1, -2))


# ---------------------------------------------------------------------------------------------------------------
# the GPU probe's hook (benchmarks/gpu/jla_probe.py)
# ---------------------------------------------------------------------------------------------------------------
def probe_rows(case, args, timer, *, interpret=False, log=print, reference=None) -> dict:
    """For jla_probe: time this port beside the others on ``args`` = (q, k, v, g, beta, h0) (bench inputs), and
    check it against the fp32 XLA backend (``reference()``: its (o, final state), computed here when None).
    Returns {"ms": {"fwd", "fused"}, "numerics": {"o", "state", "o_finite"}}."""
    out = {"ms": {}, "numerics": {}}
    from jax_gdn import ops
    q = args[0]
    impl = "reference" if interpret else "mosaic"    # interpret (CPU): the jnp twin, to check the plumbing
    if interpret:
        log("  mgpu: the kernel needs a Hopper GPU; timing its jnp twin (impl='reference') instead")

    def timed(key, fn, fargs):
        try:
            res = jax.block_until_ready(fn(*fargs))
            out["ms"][key] = round(timer(fn, fargs), 4)
            log(f"  mgpu.{key:9s} {out['ms'][key]:8.4f} ms")
            return res
        except Exception as e:  # noqa: BLE001 - report and go on
            out["ms"][key] = None
            out.setdefault("errors", []).append(f"{key}: {type(e).__name__}: {str(e)[:600]}")
            log(f"  mgpu.{key:9s} FAIL {type(e).__name__}: {str(e)[:600]}")
            return None

    res = timed("fwd", lambda *a: chunk_gated_delta_rule_fwd(*a, impl=impl), args)
    if res is not None:
        if reference is not None:
            ref = reference()
        else:
            f32 = [x.astype(F32) for x in args]
            with jax.default_matmul_precision("highest"):
                ref = jax.block_until_ready(jax.jit(lambda *a: ops.chunk_gated_delta_rule(
                    *a[:5], initial_state=a[5], output_final_state=True, backend="xla"))(*f32))

        def rel(a, r):
            a, r = a.astype(F32), r.astype(F32)
            return float(jnp.sqrt(jnp.mean((a - r) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(r ** 2)), 1e-30))
        out["numerics"] = {"o": rel(res[0], ref[0]), "state": rel(res[1], ref[1]),
                           "o_finite": bool(jnp.all(jnp.isfinite(res[0].astype(F32))))}
        log(f"  mgpu numerics: o {out['numerics']['o']:.2e} state {out['numerics']['state']:.2e} "
            f"(rel RMS vs fp32 XLA; bf16 bound 1e-2)")
    # the fused kernel alone, on stage 1a's outputs
    if interpret:
        return out
    try:
        operands = jax.block_until_ready(jax.jit(functools.partial(_prepare, interpret=False))(*args))
        timed("fused", jax.jit(lambda *a: fused_state_pass(*a, scale=q.shape[3] ** -0.5, out_final=True)),
              operands)
    except Exception as e:  # noqa: BLE001
        log(f"  mgpu.fused setup FAIL {type(e).__name__}: {str(e)[:400]}")
    return out
