"""The Mosaic GPU fused state pass (pallas_kernels/gated_delta_rule/mosaic_gpu.py, off by default).

CPU: the algebra the kernel implements (W = v - Gamma k S, v_new = (T * beta_j) W, the output and the state update
from stage 1a's gated T), as its jnp twin ``fused_state_pass_reference`` behind stage 1a in interpret mode, against
the float64 per-token oracle at fp32 (tolerance 2e-4 relative RMS: fp32 dots everywhere), odd lengths, grouped
heads; the argument checks. GPU (`pytest -m gpu`, Hopper): the kernel itself against the float64 oracle at bf16 /
fp16 (1e-2 relative RMS, the harness's half-precision bound), and beside our Pallas Triton op.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.cases import Case
from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
from tests.gdn_harness import make_inputs, oracle, rel_rms, tol


def _run(case, dtype=jnp.float32, impl="reference", seed=0, with_h0=True, poison_row=None):
    q, k, v, g, beta, h0, _ = make_inputs(case, seed, dtype, with_h0=with_h0)
    if poison_row is not None:
        h0 = h0.copy()
        h0[poison_row] = np.nan                      # a stale NaN state in one row must stay in that row
    o, s = mg.chunk_gated_delta_rule_fwd(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                         jnp.asarray(g), jnp.asarray(beta, dtype),
                                         None if h0 is None else jnp.asarray(h0), impl=impl)
    return (q, k, v, g, beta, h0), np.asarray(o.astype(jnp.float32)), np.asarray(s)


def test_module_is_off_by_default():
    assert mg.ENABLED is False


@pytest.mark.parametrize("t", [1, 63, 65, 130])
def test_reference_algebra_matches_f64(t):
    """Odd lengths (padded inside to a multiple of 64 with zero tokens), Hv = 2 Hk, K != V."""
    case = Case(f"cpu-B2-T{t}-Hk1-Hv2-K16-V8", 2, t, 1, 2, 16, 8)
    (q, k, v, g, beta, h0), o, s = _run(case)
    ro, rs = oracle(q, k, v, g, beta, h0)
    assert o.shape == ro.shape and s.shape == rs.shape
    assert rel_rms(o, ro) < 2e-4, rel_rms(o, ro)
    assert rel_rms(s, rs) < 2e-4, rel_rms(s, rs)


def test_reference_grouped_heads_no_initial_state():
    case = Case("cpu-B1-T64-Hk2-Hv6-K8-V16", 1, 64, 2, 6, 8, 16)
    (q, k, v, g, beta, _), o, s = _run(case, with_h0=False)
    ro, rs = oracle(q, k, v, g, beta, None)
    assert rel_rms(o, ro) < 2e-4 and rel_rms(s, rs) < 2e-4, (rel_rms(o, ro), rel_rms(s, rs))


def test_reference_nan_state_stays_in_its_row():
    case = Case("cpu-B2-T65-Hk1-Hv2-K16-V8", 2, 65, 1, 2, 16, 8)       # same shapes as above: no new compile
    (q, k, v, g, beta, h0), o, s = _run(case, poison_row=1)
    assert np.isnan(o[1]).any()                                         # the poisoned row is poisoned...
    ro, rs = oracle(q[:1], k[:1], v[:1], g[:1], beta[:1], h0[:1])
    assert np.isfinite(o[0]).all() and rel_rms(o[:1], ro) < 2e-4       # ...and row 0 is exact
    assert rel_rms(s[:1], rs) < 2e-4


def test_check_supported_names_the_argument():
    f32, bf = jnp.float32, jnp.bfloat16
    q = jnp.zeros((1, 64, 1, 64), bf)
    v = jnp.zeros((1, 64, 2, 64), bf)
    g = jnp.zeros((1, 64, 2), f32)
    mg.check_supported(q, q, v, g, g)                                   # fine
    with pytest.raises(ValueError, match="dtype"):
        mg.check_supported(q.astype(f32), q.astype(f32), v.astype(f32), g, g)
    with pytest.raises(ValueError, match="head dims"):
        mg.check_supported(jnp.zeros((1, 64, 1, 100), bf), jnp.zeros((1, 64, 1, 100), bf), v, g, g)
    with pytest.raises(ValueError, match="beta must"):
        mg.check_supported(q, q, v, g, g[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        mg.check_supported(q, q, v, g, g, jnp.zeros((1, 2, 64, 32), f32))
    with pytest.raises(ValueError, match="multiple of Hk"):
        mg.check_supported(jnp.zeros((1, 64, 2, 64), bf), jnp.zeros((1, 64, 2, 64), bf),
                           jnp.zeros((1, 64, 3, 64), bf), g, g)
    with pytest.raises(ValueError, match="impl"):
        mg.chunk_gated_delta_rule_fwd(q, q, v, g, g, impl="triton")


# ---- GPU (Hopper): the kernel itself ----
def _hopper():
    d = jax.devices()[0]
    return d.platform == "gpu" and getattr(d, "compute_capability", None) == "9.0"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
def test_gpu_kernel_matches_f64(t, dtype):
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    case = Case(f"B2-T{t}-Hk2-Hv4-K64-V64", 2, t, 2, 4, 64, 64)
    (q, k, v, g, beta, h0), o, s = _run(case, dtype, impl="mosaic")
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, dtype).astype(jnp.float32)), h0)
    assert rel_rms(o, ro) < tol(dtype), rel_rms(o, ro)
    assert rel_rms(s, rs) < tol(dtype), rel_rms(s, rs)


@pytest.mark.gpu
def test_gpu_kernel_k128_grouped_and_nan_row():
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    case = Case("B2-T130-Hk1-Hv3-K128-V128", 2, 130, 1, 3, 128, 128)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic", poison_row=1)
    beta = np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32))
    ro, rs = oracle(q[:1], k[:1], v[:1], g[:1], beta[:1], h0[:1])
    assert np.isfinite(o[0]).all()
    assert rel_rms(o[:1], ro) < 1e-2 and rel_rms(s[:1], rs) < 1e-2, (rel_rms(o[:1], ro), rel_rms(s[:1], rs))


@pytest.mark.gpu
def test_gpu_kernel_beside_pallas_triton():
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    from jax_gdn import ops
    case = Case("B1-T1024-Hk2-Hv4-K128-V128", 1, 1024, 2, 4, 128, 128)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic")
    bf = jnp.bfloat16
    po, ps = ops.chunk_gated_delta_rule(jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
                                        jnp.asarray(beta, bf), initial_state=jnp.asarray(h0),
                                        output_final_state=True, backend="pallas")
    assert rel_rms(o, np.asarray(po.astype(jnp.float32))) < 1e-2
    assert rel_rms(s, np.asarray(ps)) < 1e-2
