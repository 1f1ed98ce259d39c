"""The checks every backend of the MoE routed experts and router passes (``pallas_kernels.moe.api``:
``moe_experts`` and ``route``), against float64 NumPy loops.

A backend's test file subclasses :class:`MoeBackendTest` and sets ``backend`` (and where they differ ``dtypes``,
``hidden``, ``inter``).

Shape legend: T tokens, D hidden, I per-expert intermediate size, E experts, k experts per token, R layers in a
stacked expert pool.

Cases: T = 1, 7, 130 tokens with k = 2 and 4 of E = 8 and 16 experts, under the default launch config and a
small one (several row and column blocks); experts with no rows, every token on one expert; T = 0; a pool of
R = 3 layers' experts read through ``num_experts`` / ``expert_offset`` under jit; the router (softmax, top-k,
renormalised or not) with a unique top-k order, and a row of equal logits (lowest ids first).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import api
from pallas_kernels.moe.triton import MoeConfig
from tests.numpy_reference import rel_rms

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
#: relative RMS over the whole output against float64 on the same rounded inputs: fp32 1e-5; bf16 2e-2 (h and y
#: rounded to bf16 inside, as HF does)
TOL = {F32: 1e-5, BF16: 2e-2}
#: the router: ids exact, weights within rtol 1e-6 (fp32 softmax over <= E terms, two roundings)
ROUTE_RTOL = 1e-6
#: a launch config with several row and column blocks at the CPU dims
SMALL = MoeConfig(block_m=16, gate_up_n=32, gate_up_k=32, down_n=32, down_k=32)


def routed_f64(x, tw, ti, wgu, wd) -> np.ndarray:
    """sum_j tw[t, j] down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ti[t, j]: float64 loop over (token, expert)."""
    x, tw, wgu, wd = (np.asarray(a, np.float64) for a in (x, tw, wgu, wd))
    inter = wd.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            gu = x[t] @ wgu[e]
            out[t] += tw[t, j] * ((gu[:inter] / (1.0 + np.exp(-gu[:inter])) * gu[inter:]) @ wd[e])
    return out


def route_f64(logits, k, norm):
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, 1)
    return (w / w.sum(1, keepdims=True) if norm else w), ids


class MoeBackendTest:
    """Checks of one MoE backend. Subclass it as ``Test<Backend>`` and set ``backend``."""

    #: the api's backend name ("xla", "pallas_interpret", "pallas")
    backend: str = ""
    dtypes: tuple = (F32, BF16)
    hidden: int = 64
    inter: int = 32
    #: the small launch config of the multi-block case (None: the default pick)
    small_config: Optional[MoeConfig] = SMALL

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=[jnp.dtype(d).name for d in self.dtypes])

    def inputs(self, rng, t, e, k, dtype, ti=None):
        """Device inputs (x, tw, ti, wgu, wd) and their float64 values."""
        d, inter = self.hidden, self.inter
        x = rng.standard_normal((t, d))
        wgu = rng.standard_normal((e, d, 2 * inter)) * d ** -0.5
        wd = rng.standard_normal((e, inter, d)) * inter ** -0.5
        if ti is None:
            ti = (np.stack([rng.permutation(e)[:k] for _ in range(t)]) if t else np.zeros((0, k))).astype(np.int32)
        tw = rng.uniform(0.05, 1.0, ti.shape)
        dev = [jnp.asarray(a, dtype) for a in (x, tw, wgu, wd)]
        f64 = [np.asarray(a.astype(jnp.float32), np.float64) for a in dev]
        x_d, tw_d, wgu_d, wd_d = dev
        return (x_d, tw_d, jnp.asarray(ti), wgu_d, wd_d), (f64[0], f64[1], ti, f64[2], f64[3])

    def experts(self, args, config=None, **kw):
        return api.moe_experts(*args, backend=self.backend, config=config, **kw)

    def test_routed_experts(self, dtype):
        """T = 1, 7, 130 tokens, k of E experts each, under the default config and the small multi-block one; the
        dtypes after the first: T = 7 and 130 with k = 4 of 16 experts, the small config."""
        full = jnp.dtype(dtype) == jnp.dtype(self.dtypes[0])
        cases = ((1, 8, 2), (7, 16, 4), (130, 8, 2)) if full else ((7, 16, 4), (130, 16, 4))
        for t, e, k in cases:
            args, ref = self.inputs(np.random.default_rng(t * 100 + e + k), t, e, k, dtype)
            want = routed_f64(*ref)
            for config in (None, self.small_config) if full else (self.small_config,):
                out = self.experts(args, config)
                assert out.shape == (t, self.hidden) and out.dtype == dtype
                err = rel_rms(np.asarray(out.astype(jnp.float32)), want)
                assert err <= TOL[dtype], f"T={t} E={e} k={k} config={config}: rel RMS {err:.3e}"

    def test_empty_experts_and_one_hot_expert(self):
        """Only 2 of 16 experts used (the others get no rows), then every token of 130 on one expert (k = 1:
        several full row blocks of one expert and a partial one); T = 0 gives an empty output."""
        rng = np.random.default_rng(5)
        ti = np.stack([np.full(65, 3), np.full(65, 11)], axis=1).astype(np.int32)
        for ti_case in (ti, np.full((130, 1), 2, np.int32)):
            args, ref = self.inputs(rng, ti_case.shape[0], 16, ti_case.shape[1], F32, ti=ti_case)
            out = self.experts(args, self.small_config)
            assert rel_rms(np.asarray(out), routed_f64(*ref)) <= TOL[F32]
        args, _ = self.inputs(rng, 0, 8, 2, F32)
        out = self.experts(args)
        assert out.shape == (0, self.hidden) and out.dtype == jnp.float32

    def test_expert_pool_of_stacked_layers(self):
        """w [R E, ...] with num_experts = E and a traced expert_offset r E equals layer r's own experts."""
        rng = np.random.default_rng(7)
        r, e, k, t = 3, 6, 2, 37
        args, ref = self.inputs(rng, t, r * e, k, F32, ti=np.stack([rng.permutation(e)[:k] for _ in range(t)]))
        x, tw, ti, wgu, wd = args
        fn = jax.jit(lambda off: api.moe_experts(x, tw, ti, wgu, wd, backend=self.backend,
                                                 config=self.small_config, num_experts=e, expert_offset=off))
        for layer in range(r):
            got = fn(jnp.int32(layer * e))
            want = routed_f64(ref[0], ref[1], ref[2], ref[3][layer * e:(layer + 1) * e],
                              ref[4][layer * e:(layer + 1) * e])
            assert rel_rms(np.asarray(got), want) <= TOL[F32], f"layer {layer}"

    def test_route(self):
        """Unique top-k orders (well-separated logit levels) at E = 8 / 64 / 256, renormalised or not; a row of
        equal logits takes ids 0..k-1 with weights 1 / k."""
        for t, e, k, norm in ((1, 8, 2, True), (63, 64, 4, False), (130, 256, 8, True)):
            rng = np.random.default_rng(t + e)
            levels = np.stack([rng.permutation(e) for _ in range(t)]).astype(np.float64) * 0.05
            logits = (levels + rng.uniform(0, 1e-3, (t, e))).astype(np.float32)
            logits[0] = 0.25
            w, i = api.route(jnp.asarray(logits), top_k=k, norm_topk_prob=norm, backend=self.backend)
            assert w.shape == (t, k) and w.dtype == jnp.float32 and i.dtype == jnp.int32
            w_ref, i_ref = route_f64(logits, k, norm)
            np.testing.assert_array_equal(np.asarray(i), i_ref, err_msg=f"T={t} E={e} k={k}")
            np.testing.assert_allclose(np.asarray(w), w_ref, rtol=ROUTE_RTOL, atol=1e-7)

    def test_gradients(self):
        """jax.grad through the routed experts and the router (fp32) equals the XLA forms' gradients of x, the
        routing logits and both weight pools (the kernels' VJP is the XLA form's, at the same inputs)."""
        if F32 not in self.dtypes:
            pytest.skip("the backend takes no fp32")
        rng = np.random.default_rng(5)
        t, e, k = 33, 8, 2
        (x, _, _, wgu, wd), _ = self.inputs(rng, t, e, k, F32)
        logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
        cot = jnp.asarray(rng.standard_normal((t, self.hidden)), jnp.float32)

        def loss(x, logits, wgu, wd, backend):
            tw, ti = api.route(logits, top_k=k, norm_topk_prob=True, backend=backend)
            return jnp.sum(api.moe_experts(x, tw, ti, wgu, wd, backend=backend) * cot)
        got = jax.grad(loss, argnums=(0, 1, 2, 3))(x, logits, wgu, wd, self.backend)
        want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, logits, wgu, wd, "xla")
        for name, a, b in zip(("x", "logits", "w_gate_up", "w_down"), got, want):
            a = np.asarray(a)
            assert np.isfinite(a).all() and np.abs(a).max() > 0, name
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
