# Copyright 2026 KarLex AI, Inc.
# Copyright 2026 the jax-gdn authors
# SPDX-License-Identifier: Apache-2.0
# The helpers marked "(jla)" are adapted from jax-linear-attention 0.1.0 (Apache-2.0), jla/ops/mosaic_gpu/_common.py,
# itself adapted from flash-linear-attention (MIT) and FlashQLA (MIT). See NOTICE in gated_delta_rule/.
"""What the Mosaic GPU kernels of this folder share: the Pallas Mosaic GPU module (imported on first use, so that
every module here imports on any platform), the device's SM count, shared-memory buffers and the ring depth that
fits them, and the WGMMA-layout helpers of the chunk kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SMEM_BUDGET = 220 * 1024        # bytes of shared memory a CTA may take on sm_90 (228 KB less the reserve)
F32 = jnp.float32
C = 64                          # chunk size of the chunk kernels (stage 1a's T is [C, C])
BV = 64                         # value columns per CTA (WG0's S^T [BV, K] fp32 is 64 registers a thread at K = 128)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def plgpu():
    """The Pallas Mosaic GPU module (``jax.experimental.pallas.mosaic_gpu``), imported on first use."""
    import jax.experimental.pallas.mosaic_gpu as module
    return module


_plgpu = plgpu


def num_sms() -> int:
    """The default device's SM count (its ``core_count``); 132 (an H200's) where the device reports none or there
    is no device (the CPU tests size their grids as on the H200)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0) or 0) or 132
    except RuntimeError:
        return 132


# ---------------------------------------------------------------------------------------------------------------
# helpers (jla: _common.py)
# ---------------------------------------------------------------------------------------------------------------
def smem(shape, dtype):
    """(jla) SMEM buffer tiled and swizzled for TMA and WGMMA (minor dim = last dim)."""
    plgpu = _plgpu()
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def iota(shape, dim):
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def bcast_rows(vec, shape):
    """(jla) ``vec[i]`` along row i (vec in the WGMMA row layout)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def bcast_cols(vec, shape):
    """(jla) ``vec[j]`` along column j (vec in the WGMMA column layout)."""
    return lax.broadcast_in_dim(vec, shape, [1])


def matmul(a, b, shape, init=None):
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


SMEM_LIMIT = 232448             # bytes of SMEM a CTA may take on the H200 (Mosaic GPU refuses more at lowering)
SMEM_ALIGN = 1024               # Pallas Mosaic GPU rounds every scratch buffer up to this
BARRIER_BYTES = 8


def smem_bytes(scratch: dict) -> int:
    """The shared memory a kernel with these scratch entries takes, counted as Pallas Mosaic GPU counts it at
    lowering: every buffer (a RefUnion: its largest group) rounded up to SMEM_ALIGN bytes, BARRIER_BYTES a barrier
    (e.g. 250000 bytes for the one wide-pass layout that did not fit, exactly as the H200 reported it)."""
    plgpu = _plgpu()
    total = 0
    for spec in scratch.values():
        if isinstance(spec, plgpu.Barrier):     # num_barriers: an int or a shape, by jax version
            total += BARRIER_BYTES * int(np.prod(spec.num_barriers))
            continue
        n = spec.shape[0] if isinstance(spec, plgpu.RefUnion) else int(np.prod(spec.shape)) * jnp.dtype(
            spec.dtype).itemsize
        total += -(-n // SMEM_ALIGN) * SMEM_ALIGN
    return total


def ring_stages(per_stage: int, fixed: int) -> int:
    """Deepest input ring (2 to 4 stages) that fits SMEM_BUDGET."""
    for stages in (4, 3, 2):
        if stages * per_stage + fixed <= SMEM_BUDGET:
            return stages
    raise ValueError(f"mosaic_gpu fused state pass needs {2 * per_stage + fixed} bytes of shared memory")
