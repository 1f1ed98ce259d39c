"""Causal depthwise conv1d with conv-state slots against a float64 NumPy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops.conv1d import causal_conv1d_one, causal_conv1d_varlen
from tests.numpy_reference import rel_rms

C, KC = 12, 4


def conv_ref_f64(x, w, prev, silu=True):
    """x [T, C], w [C, Kc], prev [C, Kc-1] -> (y [T, C], new_state [C, Kc-1]) in float64."""
    x, w, prev = (np.asarray(a, np.float64) for a in (x, w, prev))
    kc = w.shape[1]
    xs = np.concatenate([prev.T, x], axis=0)
    t = x.shape[0]
    y = np.stack([(w * xs[i:i + kc].T).sum(-1) for i in range(t)]) if t else np.zeros((0, x.shape[1]))
    if silu:
        y = y / (1.0 + np.exp(-y))
    return y, xs[xs.shape[0] - (kc - 1):].T


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


one_jit = jax.jit(causal_conv1d_one)
varlen_jit = jax.jit(causal_conv1d_varlen)


@pytest.mark.parametrize("t", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("has_init", [False, True])
def test_one_matches_reference(t, has_init):
    rng = np.random.default_rng(t * 7 + has_init)
    x, w, state = _rand(rng, t, C), _rand(rng, C, KC), _rand(rng, C, KC - 1)
    y, new_state = one_jit(x, w, state, has_init)
    prev = state if has_init else np.zeros_like(state)
    y_ref, s_ref = conv_ref_f64(x, w, prev)
    assert rel_rms(y, y_ref) < 1e-6
    assert rel_rms(new_state, s_ref) < 1e-6


def test_one_fresh_ignores_nan_state():
    rng = np.random.default_rng(1)
    x, w = _rand(rng, 7, C), _rand(rng, C, KC)
    y, s = causal_conv1d_one(x, w, jnp.full((C, KC - 1), jnp.nan), False)
    y_ref, s_ref = conv_ref_f64(x, w, np.zeros((C, KC - 1)))
    assert rel_rms(y, y_ref) < 1e-6 and rel_rms(s, s_ref) < 1e-6


def test_one_two_pieces_equal_one_shot():
    rng = np.random.default_rng(2)
    x, w = _rand(rng, 9, C), _rand(rng, C, KC)
    zero = jnp.zeros((C, KC - 1))
    y_all, s_all = causal_conv1d_one(x, w, zero, False)
    for cut in (1, 2, 5):  # first piece shorter than Kc - 1, equal, longer
        y1, s1 = causal_conv1d_one(x[:cut], w, zero, False)
        y2, s2 = causal_conv1d_one(x[cut:], w, s1, True)
        np.testing.assert_allclose(np.concatenate([y1, y2]), y_all, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s2, s_all, rtol=1e-6)


def test_varlen_matches_each_stream_and_keeps_other_slots():
    rng = np.random.default_rng(3)
    lengths = [1, 0, 2, 3, 7, 5]  # includes an empty stream and streams shorter than Kc - 1
    n, s = len(lengths), 9
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu[-1])
    x, w = _rand(rng, t, C), _rand(rng, C, KC)
    pool = _rand(rng, s, C, KC - 1)
    slot_ids = np.array([7, 2, 0, 5, 3, 8], np.int32)  # permuted
    has_init = np.array([True, True, False, True, False, True])
    unused = [i for i in range(s) if i not in slot_ids]
    pool[unused] = np.nan  # poisoned unused slots must stay as they were
    pool[slot_ids[~has_init]] = np.nan  # stale slots of fresh streams are ignored
    y, new_pool = varlen_jit(x, w, jnp.asarray(pool), jnp.asarray(cu), jnp.asarray(slot_ids), jnp.asarray(has_init))
    y, new_pool = np.asarray(y), np.asarray(new_pool)
    for i in range(n):
        prev = pool[slot_ids[i]] if has_init[i] else np.zeros((C, KC - 1))
        y_ref, s_ref = conv_ref_f64(x[cu[i]:cu[i + 1]], w, prev)
        if lengths[i]:
            assert rel_rms(y[cu[i]:cu[i + 1]], y_ref) < 1e-6, i
        assert rel_rms(new_pool[slot_ids[i]], s_ref) < 1e-6, i
    assert np.isnan(new_pool[unused]).all()


def test_varlen_padding_tokens_give_zero():
    rng = np.random.default_rng(4)
    x, w = _rand(rng, 10, C), _rand(rng, C, KC)
    cu = jnp.asarray([0, 3, 7], jnp.int32)
    y, _ = causal_conv1d_varlen(x, w, jnp.zeros((2, C, KC - 1)), cu, jnp.asarray([0, 1]), jnp.asarray([False, False]))
    assert np.all(np.asarray(y[7:]) == 0) and np.all(np.isfinite(np.asarray(y)))


def test_varlen_no_activation_and_bf16():
    rng = np.random.default_rng(5)
    x, w = _rand(rng, 6, C), _rand(rng, C, KC)
    pool = _rand(rng, 2, C, KC - 1)
    cu = jnp.asarray([0, 2, 6], jnp.int32)
    y, p = causal_conv1d_varlen(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                                jnp.asarray(pool, jnp.bfloat16), cu, jnp.asarray([1, 0]),
                                jnp.asarray([True, True]), activation=None)
    assert y.dtype == jnp.bfloat16 and p.dtype == jnp.bfloat16
    y_ref, _ = conv_ref_f64(x[2:], w, pool[0], silu=False)
    assert rel_rms(np.asarray(y[2:], np.float32), y_ref) < 1e-2


def test_bad_shapes_raise():
    x, w = jnp.ones((4, C)), jnp.ones((C, KC))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_one(x, w, jnp.ones((C, KC)), True)
    with pytest.raises(ValueError, match="w must be"):
        causal_conv1d_one(x, jnp.ones((C + 1, KC)), jnp.ones((C, KC - 1)), True)
    with pytest.raises(ValueError, match="slot_ids"):
        causal_conv1d_varlen(x, w, jnp.ones((2, C, KC - 1)), jnp.asarray([0, 4]), jnp.asarray([0, 1]),
                             jnp.asarray([True]))


# ---- kernel size 1: the conv state has width Kc - 1 = 0, y = act(w[:, 0] * x) per channel ----
def _k1_ref(x, w, silu=True):
    y = np.asarray(x, np.float64) * np.asarray(w, np.float64)[:, 0]
    return y / (1.0 + np.exp(-y)) if silu else y


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("has_init", [False, True])
def test_one_kernel_size_1(t, has_init):
    rng = np.random.default_rng(20 + t)
    x, w = _rand(rng, t, C), _rand(rng, C, 1)
    y, new_state = one_jit(x, w, jnp.zeros((C, 0)), has_init)
    assert y.shape == (t, C) and new_state.shape == (C, 0)
    assert rel_rms(y, _k1_ref(x, w)) < 1e-6
    y_ref, s_ref = conv_ref_f64(x, w, np.zeros((C, 0)))  # the general reference agrees at Kc = 1
    assert rel_rms(y, y_ref) < 1e-6 and s_ref.shape == (C, 0)
    y_lin, _ = causal_conv1d_one(x, w, jnp.zeros((C, 0)), has_init, activation=None)
    assert rel_rms(y_lin, _k1_ref(x, w, silu=False)) < 1e-6


def test_varlen_kernel_size_1_packed_and_padding():
    rng = np.random.default_rng(21)
    lengths = [1, 3, 5]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu[-1]) + 2  # two padding tokens past cu[N]
    x, w = _rand(rng, t, C), _rand(rng, C, 1)
    pool = jnp.zeros((4, C, 0))
    y, new_pool = varlen_jit(x, w, pool, jnp.asarray(cu), jnp.asarray([3, 0, 2], jnp.int32),
                             jnp.asarray([True, False, True]))
    assert y.shape == (t, C) and new_pool.shape == (4, C, 0)
    y = np.asarray(y)
    for i in range(len(lengths)):
        assert rel_rms(y[cu[i]:cu[i + 1]], _k1_ref(x[cu[i]:cu[i + 1]], w)) < 1e-6, i
    assert np.all(y[cu[-1]:] == 0)
    # the single-stream conv gives the same rows
    for i in range(len(lengths)):
        y_i, _ = one_jit(x[cu[i]:cu[i + 1]], w, jnp.zeros((C, 0)), True)
        np.testing.assert_allclose(y_i, y[cu[i]:cu[i + 1]], rtol=1e-6, atol=1e-7)
    y_lin, _ = causal_conv1d_varlen(x, w, pool, jnp.asarray(cu), jnp.asarray([3, 0, 2], jnp.int32),
                                    jnp.asarray([True, False, True]), activation=None)
    assert rel_rms(np.asarray(y_lin)[:cu[-1]], _k1_ref(x[:cu[-1]], w, silu=False)) < 1e-6


def test_kernel_size_1_bad_state_raises():
    x, w = jnp.ones((4, C)), jnp.ones((C, 1))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_one(x, w, jnp.ones((C, 1)), True)
    with pytest.raises(ValueError, match="conv_state_pool"):
        causal_conv1d_varlen(x, w, jnp.ones((2, C, 1)), jnp.asarray([0, 4]), jnp.asarray([0]), jnp.asarray([True]))
