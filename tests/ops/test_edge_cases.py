"""Edge cases every backend of the gated delta rule must agree on.

g = -inf and |g| ~ 1e37 (hard resets), NaN locality, autodiff through Pallas, head dims outside the kernel's list,
B = 0 / T = 0, chunk_size types, mixed q / v dtypes. CPU backends: "xla", "pallas_interpret" and the per-token
form, against the float64 loop (tests/numpy_reference.py). Tolerances (relative RMS): fp32 2e-4, bf16 1e-2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops import (chunk_gated_delta_rule, chunk_gated_delta_rule_slots, fused_recurrent_gated_delta_rule_slots,
                         recurrent_gated_delta_rule)
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

FP32_TOL, BF16_TOL = 2e-4, 1e-2
CHUNKED = ("xla", "pallas_interpret")


def _inputs(seed, b, t, hk, hv, dk, dv):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.3, (b, t, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, t, hv)).astype(np.float32)
    h0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    return [q, k, v, g, beta], h0


def _call(fn, xs, **kw):
    xs = [jnp.asarray(x) for x in xs]
    if fn == "recurrent":
        return recurrent_gated_delta_rule(*xs, **kw)
    return chunk_gated_delta_rule(*xs, backend=fn, **kw)


@pytest.mark.parametrize("fn", ("recurrent",))   # the chunked backends: tests/pallas_kernels/gated_delta_rule/base.py
def test_hard_resets_match_per_token_form(fn):
    """g = -inf at tokens 3 and 70, g = -1e37 at 100 and -5e37 over a whole chunk of row 1: exp(g) = 0, no NaN."""
    xs, h0 = _inputs(1, 2, 130, 1, 2, 16, 8)
    g = xs[3]
    g[0, 3], g[0, 70, 1], g[0, 100] = -np.inf, -np.inf, -1e37
    g[1, 64:128] = -5e37
    o, final = _call(fn, xs, initial_state=jnp.asarray(h0), output_final_state=True)
    o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=h0)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(final)).all()
    assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(final, f_ref) < FP32_TOL


@pytest.mark.parametrize("fn", CHUNKED + ("recurrent",))
def test_nan_locality(fn):
    """NaN in k at token 70 of row 0 (chunk 1 = tokens 64..127): tokens 0..63 exact, 70.. NaN, final state NaN;
    tokens 64..69 are NaN in the chunked forms (documented), finite in the per-token form. NaN in q at token 20 of
    row 1 poisons o[1, 20] only. Row 1 is otherwise untouched."""
    xs, h0 = _inputs(2, 2, 130, 1, 2, 16, 8)
    o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=h0)
    xs[1][0, 70] = np.nan
    xs[0][1, 20] = np.nan
    o, final = _call(fn, xs, initial_state=jnp.asarray(h0), output_final_state=True)
    o, final = np.asarray(o), np.asarray(final)
    assert rel_rms(o[0, :64], o_ref[0, :64]) < FP32_TOL
    assert np.isnan(o[0, 70:]).all() and np.isnan(final[0]).all()
    if fn == "recurrent":
        assert rel_rms(o[0, 64:70], o_ref[0, 64:70]) < FP32_TOL
    keep = np.arange(130) != 20
    assert np.isnan(o[1, 20]).all() and np.isfinite(o[1, keep]).all()
    assert rel_rms(o[1, keep], o_ref[1, keep]) < FP32_TOL and rel_rms(final[1], f_ref[1]) < FP32_TOL


def test_grad_through_a_kernel_is_the_xla_forms_and_forward_mode_raises():
    """Reverse mode through the Pallas kernel (kernel forward, the XLA form's VJP) equals XLA autodiff; forward
    mode through a kernel raises (a custom VJP has no JVP), the decode kernel's autodiff names backend='xla'."""
    xs, h0 = _inputs(3, 1, 20, 1, 1, 16, 16)
    xs = [jnp.asarray(x) for x in xs]

    def loss(v, backend):
        o, _ = chunk_gated_delta_rule(xs[0], xs[1], v, xs[3], xs[4], backend=backend)
        return jnp.sum(o ** 2)
    g_kernel = jax.grad(loss)(xs[2], "pallas_interpret")
    g_xla = jax.grad(loss)(xs[2], "xla")
    assert rel_rms(g_kernel, g_xla) < 1e-5
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda v: loss(v, "pallas_interpret"), (xs[2],), (xs[2],))
    pool = jnp.zeros((2, 1, 16, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match="backend='xla'"):
        jax.grad(lambda p: jnp.sum(fused_recurrent_gated_delta_rule_slots(
            *[x[:, :1] for x in xs], ssm_state=p, slot_ids=jnp.asarray([1]), has_initial_state=jnp.asarray([True]),
            backend="pallas_interpret")[1]))(pool)


def test_head_dims_outside_the_kernel_list_are_padded():
    """K = 100 (FLA's test matrix) and V = 24: zero-padded to 128 / 32 inside the op, the pool copied back."""
    dk, dv, t = 100, 24, 20
    xs, h0 = _inputs(4, 1, t, 1, 2, dk, dv)
    o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=h0)
    pool = np.full((3, 2, dk, dv), np.nan, np.float32)
    pool[2] = h0[0]
    for backend in CHUNKED:
        o, new_pool = chunk_gated_delta_rule_slots(*map(jnp.asarray, xs), ssm_state=jnp.asarray(pool),
                                                   slot_ids=np.array([2]), has_initial_state=np.array([True]),
                                                   backend=backend)
        assert o.shape == (1, t, 2, dv) and new_pool.shape == pool.shape
        assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(np.asarray(new_pool)[2], f_ref[0]) < FP32_TOL, backend
        assert np.isnan(np.asarray(new_pool)[:2]).all()


def test_head_dims_over_the_kernel_limit_are_refused_publicly():
    xs, _ = _inputs(5, 1, 4, 1, 1, 256, 16)
    with pytest.raises(ValueError, match=r"head dims K \(got 256\).*at most 128.*backend='xla'"):
        _call("pallas_interpret", xs)
    o, _ = _call("auto", xs)                                 # CPU: auto is xla
    assert o.shape == (1, 4, 1, 16)


@pytest.mark.parametrize("backend", CHUNKED)
def test_empty_batch_and_empty_rows(backend):
    for b, t in ((0, 10), (2, 0)):
        xs, h0 = _inputs(6, b, t, 1, 2, 16, 8)
        o, final = _call(backend, xs, initial_state=jnp.asarray(h0), output_final_state=True)
        assert o.shape == (b, t, 2, 8) and final.shape == (b, 2, 16, 8)
        np.testing.assert_array_equal(np.asarray(final), h0)
    xs, _ = _inputs(6, 0, 10, 1, 2, 16, 8)
    pool = jnp.asarray(np.random.default_rng(7).standard_normal((3, 2, 16, 8)).astype(np.float32))
    o, new_pool = chunk_gated_delta_rule_slots(*map(jnp.asarray, xs), ssm_state=pool,
                                               slot_ids=np.zeros((0,), np.int32),
                                               has_initial_state=np.ones((0,), bool), backend=backend)
    assert o.shape == (0, 10, 2, 8)
    np.testing.assert_array_equal(np.asarray(new_pool), np.asarray(pool))


@pytest.mark.parametrize("backend", CHUNKED)
def test_chunk_size_types(backend):
    xs, _ = _inputs(8, 1, 20, 1, 1, 16, 16)
    o_ref, _ = gated_delta_rule_f64(*xs)
    o, _ = _call(backend, xs, chunk_size=np.int64(64))
    assert rel_rms(o, o_ref) < FP32_TOL
    for bad in (True, 0, 64.0, "64"):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            _call(backend, xs, chunk_size=bad)


def test_mixed_dtypes_agree_across_backends():
    """fp32 q, k with bf16 v (and bf16 beta): every backend runs it and o comes back in bf16."""
    xs, h0 = _inputs(9, 1, 20, 1, 2, 16, 16)
    xs[2] = np.asarray(jnp.asarray(xs[2], jnp.bfloat16).astype(jnp.float32))
    o_ref, _ = gated_delta_rule_f64(*xs, initial_state=h0[:1])
    args = [jnp.asarray(xs[0]), jnp.asarray(xs[1]), jnp.asarray(xs[2], jnp.bfloat16), jnp.asarray(xs[3]),
            jnp.asarray(xs[4])]
    outs = {}
    for backend in CHUNKED:
        o, _ = chunk_gated_delta_rule(*args, initial_state=jnp.asarray(h0[:1]), backend=backend)
        assert o.dtype == jnp.bfloat16
        outs[backend] = np.asarray(o, np.float64)
        assert rel_rms(outs[backend], o_ref) < BF16_TOL, backend
    assert rel_rms(outs["pallas_interpret"], outs["xla"]) < BF16_TOL
