"""The library's padding contract on every CPU backend of the gated delta rule ops ("xla", "pallas_interpret",
the per-token form) and on the varlen conv1d.

(a) tokens at index >= cu_seqlens[N] are padding: no state is touched by them, their own output rows are zero;
(b) padding streams have zero length (repeated cu_seqlens entries) and slot id S;
(c) a slot id outside [0, S) (S, S + 3, -1, also traced under jit) reads a zero state and its write is dropped;
    it never touches another slot (no wrap of -1 onto S - 1, no clamp of S onto S - 1).
Padding tokens and untouched slots are NaN-poisoned before the call. Tolerance: fp32 relative RMS 2e-4 against the
float64 loop (tests/numpy_reference.py) on the real tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops import chunk_gated_delta_rule, chunk_gated_delta_rule_slots, recurrent_gated_delta_rule
from jax_gdn.ops.conv1d import causal_conv1d_varlen
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

TOL = 2e-4
HK, HV, K, V = 1, 2, 16, 8
T = 80
CU = np.array([0, 5, 5, 40, 40, 40], np.int32)        # lengths 5, 0, 35, then two zero-length padding streams
REAL = int(CU[-1])                                     # tokens 40..79 are padding
BACKENDS = ("xla", "pallas_interpret")


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, T, HK, K)).astype(np.float32)
    k = rng.standard_normal((1, T, HK, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, T, HV, V)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (1, T, HV)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (1, T, HV)).astype(np.float32)
    xs = [q, k, v, g, beta]
    for x in xs:
        x[:, REAL:] = np.nan                               # poison the padding tokens
    return xs


def _ref(xs, init):
    return gated_delta_rule_f64(*(x[:, :REAL] for x in xs), initial_state=init, cu_seqlens=CU)


@pytest.mark.parametrize("fn", ("recurrent",))   # the chunked backends: tests/pallas_kernels/gated_delta_rule/base.py
def test_padding_tokens_and_zero_length_streams(fn):
    xs = _inputs(1)
    n = len(CU) - 1
    init = np.random.default_rng(2).standard_normal((n, HV, K, V)).astype(np.float32)
    if fn == "recurrent":
        call = lambda *a, **kw: recurrent_gated_delta_rule(*a, **kw)
    else:
        call = lambda *a, **kw: chunk_gated_delta_rule(*a, backend=fn, **kw)
    o, final = jax.jit(lambda xs, h0, cu: call(*xs, initial_state=h0, cu_seqlens=cu, output_final_state=True))(
        [jnp.asarray(x) for x in xs], jnp.asarray(init), jnp.asarray(CU))
    o_ref, f_ref = _ref(xs, init)
    o = np.asarray(o)
    assert rel_rms(o[:, :REAL], o_ref[:, :REAL]) < TOL
    np.testing.assert_array_equal(o[:, REAL:], 0.0)          # padding rows: zeros (finite), not NaN
    assert rel_rms(final, f_ref) < TOL                         # zero-length streams keep their initial state
    np.testing.assert_array_equal(np.asarray(final)[3:], init[3:])


@pytest.mark.parametrize("backend", ("xla",))   # pallas_interpret: tests/pallas_kernels/gated_delta_rule/base.py
def test_slots_out_of_range_ids_drop_their_writes_under_jit(backend):
    """Traced ids S (padding stream), -1 and S + 3: zero start state, write dropped, no other slot touched."""
    xs = _inputs(3)
    s = 4
    rng = np.random.default_rng(4)
    pool = rng.standard_normal((s, HV, K, V)).astype(np.float32)
    pool[1] = np.nan                                          # a slot nobody names: must stay NaN bit for bit
    # stream 0 -> no slot (-1), stream 1 (empty) -> slot 2, stream 2 -> slot 3 (S - 1: the target of a wrapped -1
    # or a clamped S), streams 3, 4 (empty padding) -> S and S + 3
    ids = np.array([-1, 2, 3, s, s + 3], np.int32)
    has = np.array([True, True, True, True, True])
    fn = jax.jit(lambda xs, pool, ids, has, cu: chunk_gated_delta_rule_slots(
        *xs, ssm_state=pool, slot_ids=ids, has_initial_state=has, cu_seqlens=cu, backend=backend))
    o, new_pool = fn([jnp.asarray(x) for x in xs], jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(has),
                     jnp.asarray(CU))
    init = np.zeros((len(ids), HV, K, V), np.float32)
    init[1], init[2] = pool[2], pool[3]                       # only in-range ids read their slot
    o_ref, f_ref = _ref(xs, init)
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    assert rel_rms(o[:, :REAL], o_ref[:, :REAL]) < TOL
    np.testing.assert_array_equal(o[:, REAL:], 0.0)
    assert rel_rms(new_pool[2], f_ref[1]) < TOL and rel_rms(new_pool[3], f_ref[2]) < TOL
    np.testing.assert_array_equal(new_pool[0], pool[0])       # untouched
    assert np.isnan(new_pool[1]).all()                        # untouched NaN slot
    if backend != "xla":
        return
    # the same ids concrete (eager): allowed by the public check, same result
    o2, pool2 = chunk_gated_delta_rule_slots(*map(jnp.asarray, xs), ssm_state=jnp.asarray(pool),
                                             slot_ids=ids, has_initial_state=has, cu_seqlens=CU, backend=backend)
    np.testing.assert_allclose(np.asarray(o2), o, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(pool2)[[0, 1]], new_pool[[0, 1]])


def test_slot_ids_check_allows_no_slot_but_not_repeats():
    xs = [jnp.asarray(x) for x in _inputs(5)]
    pool = jnp.zeros((3, HV, K, V), jnp.float32)
    has = jnp.ones((5,), bool)
    call = lambda ids: chunk_gated_delta_rule_slots(*xs, ssm_state=pool, slot_ids=jnp.asarray(ids, jnp.int32),
                                                    has_initial_state=has, cu_seqlens=CU, backend="xla")
    call([0, 3, 1, 3, 3])                                    # S repeated (padding streams): fine
    with pytest.raises(ValueError, match="slot_ids must not repeat"):
        call([0, 3, 1, 1, 3])
    with pytest.raises(ValueError, match=r"cu_seqlens must end at or before the token count T = 80"):
        chunk_gated_delta_rule(*xs, cu_seqlens=jnp.asarray([0, 81], jnp.int32), backend="xla")


def test_conv1d_varlen_padding_and_no_slot_ids():
    rng = np.random.default_rng(6)
    c, kc, s = 6, 4, 3
    x = rng.standard_normal((T, c)).astype(np.float32)
    x[REAL:] = np.nan
    w = rng.standard_normal((c, kc)).astype(np.float32)
    pool = rng.standard_normal((s, c, kc - 1)).astype(np.float32)
    ids = np.array([-1, 1, s - 1, s, s + 2], np.int32)
    has = np.ones((5,), bool)
    y, new_pool = jax.jit(causal_conv1d_varlen)(x, w, pool, CU, ids, has)
    y, new_pool = np.asarray(y), np.asarray(new_pool)
    np.testing.assert_array_equal(y[REAL:], 0.0)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(new_pool[0], pool[0])      # -1 did not wrap onto slot S - 1 or touch slot 0
    # stream 0 (id -1) starts from zeros: same rows as a fresh call with a valid slot
    y_fresh, _ = causal_conv1d_varlen(x, w, pool, CU, np.array([0, 1, 2, s, s], np.int32),
                                      np.array([False, True, True, False, False]))
    np.testing.assert_allclose(y[:5], np.asarray(y_fresh)[:5], rtol=1e-6, atol=1e-6)
    # stream 2 (35 tokens, slot S - 1) wrote its last Kc - 1 inputs
    np.testing.assert_array_equal(new_pool[s - 1], x[REAL - (kc - 1):REAL].T)
    # stream 1 (empty, slot 1, has state) keeps its state
    np.testing.assert_array_equal(new_pool[1], pool[1])
