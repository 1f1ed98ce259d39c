"""Norms against float64 NumPy formulas and HF's torch modules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops.norms import gated_rms_norm, l2norm, rms_norm
from tests.numpy_reference import l2norm_f64, rel_rms


def _x(seed, *shape, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def test_rms_norm_zero_centred():
    x, w = _x(0, 5, 7, 16), _x(1, 16, scale=0.2)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + w)
    assert rel_rms(jax.jit(rms_norm)(x, w, 1e-6), ref) < 1e-6
    # zero weight = plain normalisation (the (1 + w) convention, zeros at init)
    assert rel_rms(rms_norm(x, np.zeros(16, np.float32)), ref / (1 + w)) < 1e-6


def test_gated_rms_norm():
    x, z, w = _x(2, 9, 8), _x(3, 9, 8), _x(4, 8, scale=0.5) + 1
    x64, z64 = x.astype(np.float64), z.astype(np.float64)
    ref = w * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * z64 / (1 + np.exp(-z64))
    assert rel_rms(jax.jit(gated_rms_norm, static_argnums=3)(x, z, w, 1e-5), ref) < 1e-6


def test_l2norm_and_dtype():
    x = _x(5, 4, 3, 32)
    assert rel_rms(l2norm(x), l2norm_f64(x)) < 1e-6
    y = l2norm(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    assert rel_rms(np.asarray(y, np.float32), l2norm_f64(x)) < 1e-2
    assert rel_rms(rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.zeros(32)).astype(jnp.float32),
                   rms_norm(x, jnp.zeros(32))) < 1e-2


def test_matches_hf_modules():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

    x, z, w = _x(6, 3, 5, 16), _x(7, 3, 5, 16), _x(8, 16, scale=0.3)
    norm = Qwen3NextRMSNorm(16, eps=1e-6)
    gated = Qwen3NextRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        gated.weight.copy_(torch.from_numpy(w + 1))
        ref = norm(torch.from_numpy(x)).numpy()
        ref_g = gated(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    assert rel_rms(rms_norm(x, w), ref) < 1e-6
    assert rel_rms(gated_rms_norm(x, z, w + 1), ref_g) < 1e-6


def test_bad_weight_shape_raises():
    with pytest.raises(ValueError, match=r"w must have shape \[D\]"):
        rms_norm(jnp.ones((2, 8)), jnp.ones(7))
    with pytest.raises(ValueError, match="z must have the shape"):
        gated_rms_norm(jnp.ones((2, 8)), jnp.ones((2, 7)), jnp.ones(8))
