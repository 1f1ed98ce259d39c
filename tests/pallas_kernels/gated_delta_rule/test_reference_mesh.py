"""The default GDN backends on a CPU mesh (two forced host devices): they finish and match one device.

XLA's CPU triangular solve calls LAPACK's trsm, which deadlocks when several device programs of one process run it
at once; the XLA chunked form (what "auto" runs on CPU) therefore solves its chunks by forward substitution there
(``reference.unit_lower_solve``). Each check runs in a subprocess (the device count is fixed when jax starts) under
a timeout, so a deadlock fails the test instead of hanging the suite.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.xla_env import subprocess_xla_flags

from pallas_kernels.gated_delta_rule.reference import chunk_gated_delta_rule_xla, forward_substitution

TIMEOUT_S = 300

OP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from pallas_kernels.gated_delta_rule.api import chunk_gated_delta_rule
    assert len(jax.devices()) == 2, jax.devices()
    rng = np.random.default_rng(0)
    b, t, hk, hv, d = 2, 130, 2, 4, 32
    k = rng.standard_normal((b, t, hk, d)).astype(np.float32)
    xs = [rng.standard_normal((b, t, hk, d)).astype(np.float32), k / np.linalg.norm(k, axis=-1, keepdims=True),
          rng.standard_normal((b, t, hv, d)).astype(np.float32),
          -rng.uniform(0.01, 0.5, (b, t, hv)).astype(np.float32), rng.uniform(0.1, 0.9, (b, t, hv)).astype(np.float32)]
    h0 = (0.5 * rng.standard_normal((b, hv, d, d))).astype(np.float32)
    op = lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                             output_final_state=True)
    one = jax.jit(op)(*xs, h0)
    mesh = jax.make_mesh((2,), ("model",))
    heads = P(None, None, "model")                      # key heads with their value heads, per device
    specs = (heads,) * 5 + (P(None, "model"),)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(xs + [h0], specs)]
    sharded = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=specs, out_specs=(heads, P(None, "model"))))(*args)
    for a, r in zip(sharded, one):
        err = float(np.max(np.abs(np.asarray(a) - np.asarray(r))) / np.max(np.abs(np.asarray(r))))
        print("ERR", err)
        assert err < 1e-5, err
    # gradients through the sharded op (the default backend and the kernels' wrapper in interpret mode)
    do = rng.standard_normal(one[0].shape).astype(np.float32)
    dht = rng.standard_normal(one[1].shape).astype(np.float32)
    for backend in ("auto", "pallas_interpret"):
        def fn(q, k, v, g, beta, h0):
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          backend=backend)
        sm = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(heads, P(None, "model")), check_vma=False)
        def loss(f):
            return lambda *a: jnp.sum(f(*a)[0] * do) + jnp.sum(f(*a)[1] * dht)
        want = jax.jit(jax.grad(loss(fn), argnums=tuple(range(6))))(*xs, h0)
        got = jax.jit(jax.grad(loss(sm), argnums=tuple(range(6))))(*args)
        for name, a, r in zip(("q", "k", "v", "g", "beta", "h0"), got, want):
            err = float(np.max(np.abs(np.asarray(a) - np.asarray(r))) / np.max(np.abs(np.asarray(r))))
            print("GRAD", backend, name, err)
            assert err < 1e-5, (backend, name, err)
    print("OK")
""")

MODEL_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_gdn.model import HybridModel, init_params
    from jax_gdn.config import preset
    assert len(jax.devices()) == 2, jax.devices()
    config = preset("tiny")
    ids = np.random.default_rng(1).integers(0, config.vocab_size, 70).astype(np.int32)
    cu, slots = np.array([0, 30, 70], np.int32), np.array([0, 1], np.int32)
    mesh = jax.make_mesh((2,), ("model",))

    def prefill(model):
        return np.asarray(model.prefill(model.init_cache(max_seqs=2, max_tokens=256), ids, cu, slots)[0])
    params = init_params(config, jax.random.PRNGKey(0), jnp.float32)
    out = [prefill(HybridModel(config, params, dtype=jnp.float32, mesh=m)) for m in (None, mesh)]
    err = float(np.max(np.abs(out[1] - out[0])) / np.max(np.abs(out[0])))
    print("ERR", err)
    assert err < 1e-4, err
    print("OK")
""")


def _run_on_two_cpu_devices(script: str) -> str:
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags("--xla_force_host_platform_device_count=2"),
               JAX_PLATFORMS="cpu")
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2-device CPU run did not finish in {TIMEOUT_S} s (a deadlock)")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_forward_substitution_matches_numpy_solve():
    """x with (I + A) x = rhs for strictly lower A, batched, against float64 numpy."""
    rng = np.random.default_rng(0)
    a = np.tril(rng.uniform(-0.5, 0.5, (3, 2, 64, 64)), -1).astype(np.float32)
    rhs = rng.standard_normal((3, 2, 64, 40)).astype(np.float32)
    x = np.asarray(forward_substitution(a, rhs), np.float64)
    ref = np.linalg.solve(np.eye(64) + a.astype(np.float64), rhs.astype(np.float64))
    assert np.max(np.abs(x - ref)) / np.max(np.abs(ref)) < 1e-5


def test_cpu_chunked_form_calls_no_lapack():
    """The XLA chunked form lowered for CPU holds no LAPACK custom call (the trsm that deadlocks on a mesh)."""
    import jax
    import jax.numpy as jnp
    x = jnp.zeros((1, 128, 1, 16))
    v, g = jnp.zeros((1, 128, 2, 16)), jnp.zeros((1, 128, 2))
    text = jax.jit(lambda q, v, g: chunk_gated_delta_rule_xla(q, q, v, g, g, scale=0.25)).lower(x, v, g).as_text()
    assert "lapack" not in text.lower() and "trsm" not in text.lower()


def test_default_op_under_shard_map_on_two_cpu_devices():
    """chunk_gated_delta_rule with the default backend ("auto": the XLA chunked form on CPU) under shard_map over
    the heads of two forced host devices finishes and matches one device; so do its gradients (q, k, v, g, beta,
    h0), with the default backend and with the Triton kernels in interpret mode (their reference VJP)."""
    _run_on_two_cpu_devices(OP_SCRIPT)


def test_tiny_model_prefill_on_a_two_device_cpu_mesh():
    """The tiny model's prefill with the default backends on a mesh of two forced host devices finishes and gives
    one device's logits (the same weights placed on the mesh)."""
    _run_on_two_cpu_devices(MODEL_SCRIPT)
