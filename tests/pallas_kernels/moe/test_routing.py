"""The MoE router kernel (pallas_kernels.moe.routing_triton) against its XLA reference (reference.route_xla:
fp32 softmax, lax.top_k, renormalisation) and a float64 numpy oracle.

Logits are a random permutation of well-separated levels (0.05 apart, plus noise under 1e-3) so that the top-k
ORDER is unique and ids must match exactly; weights within 1e-6 (fp32: softmax over <= 512 terms, two roundings).
Interpret mode on CPU; the compiled kernel at 80B dims on a GPU (marked gpu).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import api, reference, routing_triton


def _logits(rng, t, e, dtype=np.float32):
    levels = np.stack([rng.permutation(e) for _ in range(t)]).astype(np.float64) * 0.05
    return (levels + rng.uniform(0, 1e-3, (t, e))).astype(dtype)


def _oracle(logits, k, norm):
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, 1)
    if norm:
        w = w / w.sum(1, keepdims=True)
    return w, ids


@pytest.mark.parametrize("t,e,k,norm", [(1, 8, 2, True), (63, 8, 1, False), (64, 64, 4, True),
                                        (65, 512, 10, True), (130, 256, 8, False)])
def test_interpret_matches_oracle_and_xla(t, e, k, norm):
    rng = np.random.default_rng(t * 7 + e)
    x = jnp.asarray(_logits(rng, t, e))
    w, i = api.route(x, top_k=k, norm_topk_prob=norm, backend="pallas_interpret")
    wx, ix = api.route(x, top_k=k, norm_topk_prob=norm, backend="xla")
    wo, io = _oracle(np.asarray(x), k, norm)
    assert w.shape == (t, k) and i.shape == (t, k) and w.dtype == jnp.float32 and i.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(i), io)
    np.testing.assert_array_equal(np.asarray(ix), io)
    np.testing.assert_allclose(np.asarray(w), wo, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(wx), wo, rtol=1e-6, atol=1e-7)


def test_bf16_logits_ties_and_a_nan_row():
    """bf16 logits (upcast in the kernel); a row of equal logits takes the lowest ids first (as lax.top_k); a NaN
    row gets ids inside [0, E) and spoils only itself."""
    rng = np.random.default_rng(3)
    t, e, k = 16, 64, 4
    x = _logits(rng, t, e)
    x[5] = 0.25                                    # all equal: ids 0..k-1, weights 1/k after renormalisation
    x[9, 17] = np.nan
    xb = jnp.asarray(x, jnp.bfloat16)
    w, i = api.route(xb, top_k=k, norm_topk_prob=True, backend="pallas_interpret")
    w, i = np.asarray(w), np.asarray(i)
    np.testing.assert_array_equal(i[5], np.arange(k))
    np.testing.assert_allclose(w[5], np.full(k, 1 / k), rtol=1e-6)
    assert ((i >= 0) & (i < e)).all()
    assert np.isnan(w[9]).all()
    good = [r for r in range(t) if r not in (5, 9)]
    wo, io = _oracle(np.asarray(xb.astype(jnp.float32))[good], k, True)
    np.testing.assert_array_equal(i[good], io)
    np.testing.assert_allclose(w[good], wo, rtol=1e-6, atol=1e-7)


def test_falls_back_and_refuses_bad_arguments():
    x = jnp.asarray(_logits(np.random.default_rng(0), 5, 6))        # E = 6: not a power of two -> XLA path
    w, i = api.route(x, top_k=2, norm_topk_prob=True, backend="pallas_interpret")
    wx, ix = api.route(x, top_k=2, norm_topk_prob=True, backend="xla")
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ix))
    with pytest.raises(ValueError, match="top_k"):
        api.route(x, top_k=7, norm_topk_prob=True, backend="xla")
    with pytest.raises(ValueError, match="logits"):
        api.route(x[0], top_k=2, norm_topk_prob=True, backend="xla")
    with pytest.raises(ValueError, match="backend"):
        api.route(x, top_k=2, norm_topk_prob=True, backend="cuda")
    assert routing_triton.supports(num_experts=6, top_k=2) is not None
    assert routing_triton.rows_per_program(19456, 512) == 16 and routing_triton.rows_per_program(65, 512) == 1


def test_sparse_moe_routes_with_the_kernel_on_pallas_backends(monkeypatch):
    """sparse_moe on "pallas_interpret" routes through the kernel (the MoE table's routing row) and gives the XLA
    MoE."""
    from jax_gdn.layers import ffn
    calls = []
    real = routing_triton.route

    def spy(*a, **kw):
        calls.append(kw.get("interpret"))
        return real(*a, **kw)
    monkeypatch.setattr(routing_triton, "route", spy)
    rng = np.random.default_rng(1)
    d, e, inter, t, k = 32, 8, 16, 65, 2
    p = {"router": jnp.asarray(rng.standard_normal((d, e)), jnp.float32),
         "experts_gate_up": jnp.asarray(rng.standard_normal((e, d, 2 * inter)) / 6, jnp.float32),
         "experts_down": jnp.asarray(rng.standard_normal((e, inter, d)) / 4, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    got = ffn.sparse_moe(p, x, top_k=k, norm_topk_prob=True, backend="pallas_interpret")
    want = ffn.sparse_moe(p, x, top_k=k, norm_topk_prob=True, backend="xla")
    assert calls == [True]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_80b_router_on_gpu():
    """Compiled kernel, Qwen3-Next-80B router (E 512, top 10) over the varlen16 bucket (19456 tokens), bf16
    logits: ids equal the XLA reference's, weights within 1e-6."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(_logits(rng, 19456, 512), jnp.bfloat16)
    w, i = jax.jit(lambda x: api.route(x, top_k=10, norm_topk_prob=True, backend="pallas"))(x)
    wx, ix = jax.jit(lambda x: reference.route_xla(x, top_k=10, norm_topk_prob=True))(x)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ix))
    np.testing.assert_allclose(np.asarray(w), np.asarray(wx), rtol=1e-6, atol=1e-7)
