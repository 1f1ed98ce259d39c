"""pallas_kernels/autodiff.py: the VJPs of ops whose forward is a kernel (``reference_vjp``, ``kernel_vjp``).

Their residuals are the inputs alone, so under ``jax.checkpoint`` the forward kernels run once, not twice (the
backward recomputes what it needs from the inputs): checked on the jaxpr of value_and_grad, counting the kernel
launches (``pallas_call``) that survive dead-code elimination, with the GDN op's Triton kernels in interpret mode.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as pe

from jax_gdn.ops import chunk_gated_delta_rule
from pallas_kernels.autodiff import kernel_vjp, reference_vjp


def _live_kernel_calls(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    dced, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return str(dced).count("pallas_call")


def test_checkpoint_runs_the_forward_kernels_once():
    rng = np.random.default_rng(0)
    b, t, h, d = 1, 64, 1, 16
    q = jnp.asarray(0.2 * rng.standard_normal((b, t, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    g, beta = jnp.full((b, t, h), -0.1), jnp.full((b, t, h), 0.5)

    def loss(q, v):
        o, ht = chunk_gated_delta_rule(q, q, v, g, beta, output_final_state=True, backend="pallas_interpret")
        return jnp.sum(o) + jnp.sum(ht)
    plain = _live_kernel_calls(jax.value_and_grad(loss, argnums=(0, 1)), q, v)
    remat = _live_kernel_calls(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1)), q, v)
    assert plain >= 1, "the forward's kernels are in the program"
    assert remat == plain, f"jax.checkpoint ran the forward kernels again: {remat} launches against {plain}"


@pytest.mark.parametrize("wrap", ["reference", "kernel"])
def test_vjps_match_the_reference_and_take_the_inputs_only(wrap):
    """Both wrappers run the kernel forward; reference_vjp differentiates the reference, kernel_vjp calls the given
    backward with the inputs themselves (the residuals) and the cotangent."""
    kernel = lambda x, w: jnp.tanh(x) * w                                   # noqa: E731  (stand-in "kernel")
    reference = lambda x, w: jnp.tanh(x) * w                                # noqa: E731
    seen = {}

    def backward(args, ct):
        seen["args"] = args
        _, vjp = jax.vjp(reference, *args)
        return vjp(ct)
    op = reference_vjp(kernel, reference) if wrap == "reference" else kernel_vjp(kernel, backward)
    x, w = jnp.linspace(-1, 1, 5), jnp.arange(5.0)
    got = jax.grad(lambda x, w: jnp.sum(op(x, w) ** 2), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(reference(x, w) ** 2), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    if wrap == "kernel":
        np.testing.assert_array_equal(seen["args"][0], x)
