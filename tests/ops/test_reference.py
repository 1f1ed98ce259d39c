"""jax_gdn.ops (xla backend) against the float64 per-token loop and HF transformers' torch recurrence.

Small dims (K, V in 8..32), seeded random inputs, odd lengths, grouped value heads and dk != dv.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jax_gdn.ops import chunk_gated_delta_rule, chunk_gated_delta_rule_slots, recurrent_gated_delta_rule
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

FP32_TOL = 2e-4
BF16_TOL = 1e-2


def make_inputs(seed, b, t, hk, hv, dk, dv, n_state=None, dtype=np.float32, unit_k=True):
    """Seeded inputs in the ranges of a real layer: g in [-0.5, -0.01], beta in (0.1, 0.9), unit-norm k."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    if unit_k:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (b, t, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, t, hv)).astype(np.float32)
    init = None
    if n_state is not None:
        init = (0.5 * rng.standard_normal((n_state, hv, dk, dv))).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(q), cast(k), cast(v), jnp.asarray(g), cast(beta)), init


def f64(xs):
    return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in xs]


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_dense_matches_f64_loop(fn, t):
    b, hk, hv, dk, dv = 2, 2, 4, 16, 24
    xs, init = make_inputs(t, b, t, hk, hv, dk, dv, n_state=b)
    o, final = fn(*xs, initial_state=jnp.asarray(init), output_final_state=True, backend="xla") \
        if fn is chunk_gated_delta_rule else fn(*xs, initial_state=jnp.asarray(init), output_final_state=True)
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=init)
    assert o.shape == (b, t, hv, dv) and o.dtype == jnp.float32
    assert final.shape == (b, hv, dk, dv) and final.dtype == jnp.float32
    assert rel_rms(o, o_ref) < FP32_TOL
    assert rel_rms(final, f_ref) < FP32_TOL
