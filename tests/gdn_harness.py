"""The one test harness of the gated delta rule op, shared by tests/ops and tests/pallas_kernels.

* named shapes from ``benchmarks.cases`` (``Case``: B, T, Hk, Hv, K, V, lens);
* ``make_inputs``: seeded inputs in a real layer's ranges (unit-norm q and k, g = log(uniform(0.5, 0.999)),
  beta in (0.05, 0.99)), rounded to the dtype the kernel will see so that the oracle takes the same values;
* ``oracle``: the float64 per-token loop (tests/numpy_reference.py);
* ``backends_for``: every backend that runs a case here (xla always; pallas_interpret when the kernel takes its
  dims; pallas on a GPU);
* ``run``: the public op on one backend; ``TOL``: relative RMS tolerance against the oracle per input dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cases import Case
from tests.numpy_reference import gated_delta_rule_f64, l2norm_f64, rel_rms  # noqa: F401

#: relative RMS against the float64 loop: fp32 inputs (IEEE fp32 dots) 2e-4; bf16 / fp16 inputs (half-precision
#: dot operands, fp32 accumulation and state) 1e-2
TOL = {jnp.dtype(jnp.float32): 2e-4, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 1e-2}


def tol(dtype) -> float:
    return TOL[jnp.dtype(dtype)]


def cu_of(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def rounded(x, dtype) -> np.ndarray:
    """The fp32 values an array takes after a round trip through ``dtype`` (what the kernel actually sees)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def make_inputs(case: Case, seed: int, dtype=jnp.float32, *, with_h0: bool = True, lens=None):
    """Host inputs of a case: (q, k, v, g, beta, h0 or None, cu or None), fp32 NumPy, q / k / v rounded to dtype.
    ``lens`` overrides the case's packing (same T)."""
    rng = np.random.default_rng(seed)
    b, t = case.B, case.T
    q = l2norm_f64(rng.standard_normal((b, t, case.Hk, case.K))).astype(np.float32)
    k = l2norm_f64(rng.standard_normal((b, t, case.Hk, case.K))).astype(np.float32)
    v = rng.standard_normal((b, t, case.Hv, case.V)).astype(np.float32)
    g = np.log(rng.uniform(0.5, 0.999, (b, t, case.Hv))).astype(np.float32)
    beta = rng.uniform(0.05, 0.99, (b, t, case.Hv)).astype(np.float32)
    q, k, v = (rounded(x, dtype) for x in (q, k, v))
    lens = case.lens if lens is None else lens
    n = b if lens is None else len(lens)
    h0 = (np.random.default_rng(seed + 1).standard_normal((n, case.Hv, case.K, case.V)).astype(np.float32)
          if with_h0 else None)
    return q, k, v, g, beta, h0, (None if lens is None else cu_of(lens))


def oracle(q, k, v, g, beta, h0=None, cu=None, **kw):
    """(o [B, T, Hv, V], final [N, Hv, K, V]) in float64."""
    return gated_delta_rule_f64(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **kw)


def has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def backends_for(case: Case) -> tuple:
    """The backends that run ``case`` on this machine."""
    from pallas_kernels.gated_delta_rule.api import MAX_HEAD_DIM
    out = ["xla"]
    if max(case.K, case.V) <= MAX_HEAD_DIM:
        out.append("pallas" if has_gpu() else "pallas_interpret")
    return tuple(out)


def run(backend: str, q, k, v, g, beta, h0=None, cu=None, dtype=jnp.float32, **kw):
    """``jax_gdn.ops.chunk_gated_delta_rule`` on one backend, q / k / v in ``dtype``, final state returned."""
    from jax_gdn.ops import chunk_gated_delta_rule
    return chunk_gated_delta_rule(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                  jnp.asarray(g), jnp.asarray(beta), initial_state=None if h0 is None else
                                  jnp.asarray(h0), cu_seqlens=None if cu is None else jnp.asarray(cu),
                                  output_final_state=True, backend=backend, **kw)
