"""Pallas gated delta rule kernel vs the float64 per-token loop (tests/numpy_reference.py).

CPU: the same kernels in interpret mode at tiny dims (dk != dv). GPU (`pytest -m gpu`): K = V = 128, bf16 and fp32.
Shapes, inputs, oracle and tolerances come from the shared harness (tests/gdn_harness.py: benchmarks.cases shapes,
relative RMS vs float64: fp32 2e-4, bf16 / fp16 1e-2; kernel dots run in IEEE fp32 for fp32 inputs, half
operands with fp32 accumulation for half inputs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cases
from pallas_kernels.gated_delta_rule import api
from pallas_kernels.gated_delta_rule.triton import chunk as pallas_triton
from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map
from tests.gdn_harness import cu_of, make_inputs, oracle, rel_rms, tol
from tests.numpy_reference import gated_delta_rule_f64, l2norm_f64


def run_fwd(case, dtype, seed, *, interpret, lens=None, with_h0=True, fwd=None):
    """The kernel entry point (pallas_triton.chunk_gated_delta_rule_fwd) on a case against the float64 loop:
    returns the relative RMS of o and of the final state."""
    q, k, v, g, beta, h0, cu = make_inputs(case, seed, dtype, with_h0=with_h0, lens=lens)
    ref_o, ref_s = oracle(q, k, v, g, beta, h0, cu)
    fwd = fwd or jax.jit(lambda *a: _fwd(*a, interpret=interpret))
    o, s = fwd(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g),
               jnp.asarray(beta), None if h0 is None else jnp.asarray(h0),
               None if cu is None else jnp.asarray(cu))
    assert o.dtype == dtype and s.dtype == jnp.float32
    return rel_rms(np.asarray(o, np.float64), ref_o), rel_rms(np.asarray(s), ref_s)


def _fwd(q, k, v, g, beta, h0, cu, *, interpret, config=None):
    cmap = None if cu is None else build_chunk_map(cu, q.shape[1], 64)
    return pallas_triton.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=h0, cu_seqlens=cu,
                                                    chunk_map=cmap, output_final_state=True, interpret=interpret,
                                                    config=config)


# ----------------------------------------------------------------------------------------------------------------
# CPU, interpret mode
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", cases.CPU_GVA, ids=lambda c: c.name)
def test_interpret_grouped_heads_no_initial_state(case):
    eo, es = run_fwd(case, jnp.float32, seed=7, interpret=True, with_h0=False)
    assert eo < tol(jnp.float32) and es < tol(jnp.float32), (eo, es)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_interpret_half_precision(dtype):
    eo, es = run_fwd(cases.CPU_DENSE[-1], dtype, seed=3, interpret=True)
    assert eo < tol(dtype) and es < tol(dtype), (eo, es)


def test_interpret_varlen_initial_states_and_no_recompile():
    case = cases.CPU_VARLEN
    traces = []

    def counted(*a):
        traces.append(1)
        return _fwd(*a, interpret=True)
    fwd = jax.jit(counted)
    for seed, lens in ((11, case.lens), (12, cases.CPU_VARLEN_OTHER_LENS)):
        eo, es = run_fwd(case, jnp.float32, seed=seed, interpret=True, lens=lens, fwd=fwd)
        assert eo < tol(jnp.float32) and es < tol(jnp.float32), (lens, eo, es)
    assert len(traces) == 1, "a second packing with the same T and N must reuse the compiled program"


def test_interpret_no_final_state_unless_asked():
    """output_final_state=False: the state pass writes no final state (None back), o is the same as with it."""
    case = cases.CPU_DENSE[3]                              # T = 65: a full chunk and a one-token one
    q, k, v, g, beta, h0, _ = make_inputs(case, 9)
    xs = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    run = lambda want: pallas_triton.chunk_gated_delta_rule_fwd(
        *xs, scale=None, initial_state=jnp.asarray(h0), cu_seqlens=None, chunk_map=None, output_final_state=want,
        interpret=True)
    o_without, none = run(False)
    o_with, final = run(True)
    assert none is None and final.shape == h0.shape
    np.testing.assert_array_equal(np.asarray(o_without), np.asarray(o_with))
    assert rel_rms(np.asarray(o_with), oracle(q, k, v, g, beta, h0)[0]) < tol(jnp.float32)


def test_interpret_near_collinear_keys():
    """Near-identical keys with beta ~ 1 and almost no decay make I + A ill-conditioned in the power series
    sense: an inverse by repeated squaring, (I + x)(I + x^2)..., lost two digits here (fp32 state 2e-4, seen
    while trying it); forward substitution must stay at fp32 rounding."""
    rng = np.random.default_rng(41)
    b, t, hk, hv, dk, dv = 1, 128, 1, 1, 16, 8
    k = l2norm_f64(l2norm_f64(rng.standard_normal((dk,)))[None, None, None, :]
                   + 0.01 * rng.standard_normal((b, t, hk, dk))).astype(np.float32)
    q = l2norm_f64(rng.standard_normal((b, t, hk, dk))).astype(np.float32)
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = np.full((b, t, hv), -1e-3, np.float32)
    beta = np.full((b, t, hv), 0.99, np.float32)
    o, s = pallas_triton.chunk_gated_delta_rule_fwd(*map(jnp.asarray, (q, k, v, g, beta)), scale=None,
                                                    initial_state=None, cu_seqlens=None, chunk_map=None,
                                                    output_final_state=True, interpret=True)
    ref_o, ref_s = gated_delta_rule_f64(q, k, v, g, beta)
    assert rel_rms(np.asarray(o), ref_o) < 2e-5 and rel_rms(np.asarray(s), ref_s) < 2e-5


def test_check_supported_errors():
    x = jnp.zeros((1, 4, 1, 24), jnp.float32)
    big = jnp.zeros((1, 4, 1, 256), jnp.float32)
    with pytest.raises(ValueError, match=r"head dims K \(got 256\) and V \(got 24\) must each be at most 128"):
        api.check_supported(big, big, x, interpret=True)
    with pytest.raises(ValueError, match="floating"):
        api.check_supported(x, x, x.astype(jnp.int32), interpret=True)
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ValueError, match="GPU"):
            api.check_supported(x, x, x, interpret=False)
    api.check_supported(x, x, x.astype(jnp.bfloat16), interpret=True)   # K = 24 padded to 32; dtypes promoted
    assert [api.kernel_head_dim(d) for d in (1, 16, 17, 100, 128)] == [16, 16, 32, 128, 128]


# ----------------------------------------------------------------------------------------------------------------
# GPU (device tool): K = V = 128
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", cases.GPU_TEST_CASES, ids=lambda c: c.name)
def test_gpu_matches_f64(case, dtype):
    eo, es = run_fwd(case, dtype, seed=5, interpret=False, lens=case.lens)
    print(f"FIGURE {case.name} {jnp.dtype(dtype).name} o_rel_rms={eo:.3e} state_rel_rms={es:.3e}")
    assert eo < tol(dtype) and es < tol(dtype), (eo, es)


@pytest.mark.gpu
def test_gpu_slots_poisoned_and_no_recompile():
    case = cases.GPU_TEST_CASES[-1]
    lens = case.lens
    n = len(lens)
    num_slots = n + 3
    q, k, v, g, beta, _, _ = make_inputs(case, 31, jnp.bfloat16)
    slot_ids = np.random.default_rng(1).permutation(num_slots)[:n].astype(np.int32)
    has = np.arange(n) % 2 == 0
    init = np.random.default_rng(2).standard_normal((n, case.Hv, case.K, case.V)).astype(np.float32)
    pool = np.full((num_slots, case.Hv, case.K, case.V), np.nan, np.float32)
    pool[slot_ids[has]] = init[has]
    traces = []

    @jax.jit
    def fwd(q, k, v, g, beta, pool, slot_ids, has, cu):
        traces.append(1)
        cmap = build_chunk_map(cu, q.shape[1], 64)
        return pallas_triton.chunk_gated_delta_rule_slots_fwd(q, k, v, g, beta, scale=None, ssm_state=pool,
                                                    slot_ids=slot_ids, has_initial_state=has, cu_seqlens=cu,
                                                    chunk_map=cmap)
    for lens_i in (lens, tuple(reversed(lens))):
        cu = cu_of(lens_i)
        h0 = np.where(has[:, None, None, None], init, 0.0)
        ref_o, ref_s = gated_delta_rule_f64(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
        o, new_pool = fwd(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
                          *map(jnp.asarray, (g, beta, pool, slot_ids, has, cu)))
        new_pool = np.asarray(new_pool)
        eo, es = rel_rms(np.asarray(o, np.float64), ref_o), rel_rms(new_pool[slot_ids], ref_s)
        print(f"FIGURE slots {lens_i} o_rel_rms={eo:.3e} state_rel_rms={es:.3e}")
        assert eo < 1e-2 and es < 1e-2
        untouched = np.setdiff1d(np.arange(num_slots), slot_ids)
        assert np.isnan(new_pool[untouched]).all() and np.isfinite(new_pool[slot_ids]).all()
    assert len(traces) == 1
