"""The Mosaic GPU backward of the dense gated delta rule (pallas_kernels/gated_delta_rule/mosaic_gpu/backward.py).

CPU: everything around the three kernels (stage 1a, padding, the reverse chunk cumsum of the gate gradient, the
floor's mask, the sums over grouped heads, the L2 norm's VJP, the custom VJP's cotangent wiring) with the kernels'
jnp twin (``impl="reference"``), against torch float64 autograd of the per-token recurrence, fp32 limit 1e-4
(relative RMS, FLA's metric). GPU (Hopper): the kernels against the twin on the same inputs (bf16; FLA's bf16
limits: dq, dk, dv, dh0 8e-3, dg, dbeta 2e-2); ``test_mosaic_gpu.py`` runs the op's own gradient checks, which now
go through these kernels for dense rows.

Shape legend: B rows, T tokens, Hk / Hv key / value heads, K / V head dims.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.autodiff import kernel_vjp
from pallas_kernels.gated_delta_rule import api
from pallas_kernels.gated_delta_rule.mosaic_gpu import backward as mosaic_backward
from tests.numpy_reference import rel_rms
from tests.pallas_kernels.gated_delta_rule.base import PAD_TOKENS, GRAD_NAMES, cu_of, grad_case, torch_grads

F32_TOL = 1e-4
BF16_TOL = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3, "g": 2e-2, "beta": 2e-2}

#: (B, T, Hk, Hv, K, V, with h0, scale, gate divisor, share of g = -inf): lengths around the chunk of 64,
#: one token, grouped heads (groups of 2, 3 and 4), no initial state, hard resets, K != V
CPU_CASES = {
    "b2-t75-hk2-hv4-gdiv0.01": (2, 75, 2, 4, 32, 32, True, None, 0.01, 0.0),
    "b1-t130-hk1-hv2-scale0.1-mask0.5-noh0": (1, 130, 1, 2, 16, 32, False, 0.1, 1.0, 0.5),
    "b1-t1-hk1-hv3": (1, 1, 1, 3, 16, 16, True, None, 1.0, 0.0),
    "b1-t63-hk1-hv1": (1, 63, 1, 1, 16, 16, True, None, 1.0, 0.0),
    "b1-t64-hk2-hv4": (1, 64, 2, 4, 16, 16, True, None, 1.0, 0.0),
    "b1-t65-hk1-hv3": (1, 65, 1, 3, 32, 16, True, None, 1.0, 0.0),
}


def _grads(got) -> dict:
    return {name: None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)
            for name, x in zip(GRAD_NAMES, got)}


def _check(got: dict, want: dict, tol, what: str):
    for name, x in got.items():
        if x is None:
            continue
        assert np.isfinite(x).all(), f"{what}: d{name} is not finite"
        limit = tol[name] if isinstance(tol, dict) else tol
        err = rel_rms(x, want[name])
        assert err < limit, f"{what}: d{name} rel RMS {err:.3e} >= {limit}"


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_backward_with_kernel_twin_matches_float64(case):
    b, t, hk, hv, dk, dv, with_h0, scale, gate_div, masked = CPU_CASES[case]
    xs, h0, do, dht = grad_case(11, b, t, hk, hv, dk, dv, jnp.float32, b, gate_div=gate_div, masked=masked)
    if not with_h0:
        h0 = np.zeros_like(h0)
    scale = dk ** -0.5 if scale is None else scale
    args = [jnp.asarray(x) for x in xs]
    with jax.default_matmul_precision("highest"):
        got = mosaic_backward.chunk_gated_delta_rule_bwd(
            *args, jnp.asarray(h0) if with_h0 else None, jnp.asarray(do), jnp.asarray(dht), scale=scale,
            impl="reference")
    got = _grads(got)
    assert (got["h0"] is None) == (not with_h0), "dh0 must be given exactly when an initial state is"
    _check(got, torch_grads(xs, h0, do, dht, scale=scale), F32_TOL, case)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_op_vjp_wiring_with_l2norm_and_no_final_state(packed):
    """The custom VJP as api.py builds it (``kernel_vjp`` + ``mosaic_backward_pass``), the kernels replaced by
    their twin and the forward by the XLA form: jax.grad through the in-op L2 norm of raw q, k, with
    output_final_state False (no cotangent for the final state) and no initial state; dense rows, and packed
    sequences (cu_seqlens: the walk)."""
    b, t, hk, hv, dk, dv = (1, 70, 1, 2, 16, 16) if packed else (2, 70, 1, 2, 16, 16)
    cu = cu_of((20, 0, 45)) if packed else None
    xs, h0, do, dht = grad_case(13, b, t, hk, hv, dk, dv, jnp.float32, 3 if packed else b, l2=True)
    scale = dk ** -0.5
    forward = functools.partial(api._dense_xla, scale=scale, output_final_state=False, use_qk_l2norm=True,
                                chunk_size=64)
    backward = functools.partial(api.mosaic_backward_pass, scale=scale, use_qk_l2norm=True, impl="reference")
    op = kernel_vjp(forward, backward)

    def loss(q, k, v, g, beta):
        o, ht = op(q, k, v, g, beta, None, None if cu is None else jnp.asarray(cu))
        assert ht is None
        return jnp.sum(o * jnp.asarray(do))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*[jnp.asarray(x) for x in xs])
    want = torch_grads(xs, np.zeros_like(h0), do, np.zeros_like(dht), scale=scale, cu_seqlens=cu,
                       use_qk_l2norm=True)
    _check(_grads(got), want, F32_TOL, "l2norm, no final state")


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_slots_vjp_wiring(packed):
    """The slot op's custom VJP (``mosaic_slots_backward_pass``: the pool's gather and scatter differentiated in
    XLA around the op's backward, the kernels' twin in their place) against XLA autodiff of the slot op's own
    form: a stream on an id outside the pool (-1), a fresh stream (has_initial_state False), unnamed slots whose
    cotangent passes through."""
    hk, hv, dk, dv, num_slots = 1, 2, 16, 16, 6
    lens = (20, 0, 45) if packed else None
    b, t = (1, 70) if packed else (3, 40)
    n = len(lens) if packed else b
    cu = None if lens is None else jnp.asarray(cu_of(lens))
    xs, _, do, _ = grad_case(31, b, t, hk, hv, dk, dv, jnp.float32, n)
    rng = np.random.default_rng(31)
    pool = jnp.asarray(0.3 * rng.standard_normal((num_slots, hv, dk, dv)), jnp.float32)
    dpool = jnp.asarray(rng.standard_normal(pool.shape), jnp.float32)
    ids = jnp.asarray([4, -1, 0], jnp.int32)
    has = jnp.asarray([True, True, False])
    scale = dk ** -0.5
    forward = functools.partial(api._slots_xla, scale=scale, use_qk_l2norm=False, chunk_size=64)
    backward = functools.partial(api.mosaic_slots_backward_pass, scale=scale, use_qk_l2norm=False, impl="reference")

    def loss(op):
        def fn(q, k, v, g, beta, pool):
            o, new_pool = op(q, k, v, g, beta, pool, ids, has, cu)
            return jnp.sum(o * jnp.asarray(do)) + jnp.sum(new_pool * dpool)
        return fn
    args = [jnp.asarray(x) for x in xs] + [pool]
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.grad(loss(kernel_vjp(forward, backward)), argnums=tuple(range(6))))(*args)
        want = jax.jit(jax.grad(loss(forward), argnums=tuple(range(6))))(*args)
    for name, a, w in zip(("q", "k", "v", "g", "beta", "pool"), got, want):
        err = rel_rms(np.asarray(a, np.float64), np.asarray(w, np.float64))
        assert err < F32_TOL, f"d{name} rel RMS {err:.3e}"


#: packed sequences (lengths; Hk, Hv, K, V; with per-sequence h0): around the chunk with a zero-length and a
#: one-token sequence, FLA's [0, 15] and a long mix, grouped heads, PAD_TOKENS padding tokens after cu_seqlens[N]
VARLEN_CASES = {"odd-lengths-h0": ((1, 0, 63, 64, 65, 130), 1, 2, 16, 16, True),
                "fla-0-15": ((15,), 2, 4, 32, 32, False),
                "long-mix-h0": ((0, 256, 244, 500), 1, 3, 16, 32, True)}


@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_backward_with_kernel_twin_matches_float64(case):
    """The packed-sequence backward (repacked row, walk table) with the kernels' twin: float64 gradients, padding
    tokens' gradients exactly zero, dh0 per sequence (an empty sequence's is its dht)."""
    lens, hk, hv, dk, dv, with_h0 = VARLEN_CASES[case]
    cu = cu_of(lens)
    t = int(cu[-1]) + PAD_TOKENS
    xs, h0, do, dht = grad_case(23, 1, t, hk, hv, dk, dv, jnp.float32, len(lens))
    if not with_h0:
        h0 = np.zeros_like(h0)
    scale = dk ** -0.5
    with jax.default_matmul_precision("highest"):
        got = mosaic_backward.chunk_gated_delta_rule_varlen_bwd(
            *[jnp.asarray(x) for x in xs], jnp.asarray(cu), jnp.asarray(h0) if with_h0 else None, jnp.asarray(do),
            jnp.asarray(dht), scale=scale, impl="reference")
    got = _grads(got)
    _check(got, torch_grads(xs, h0, do, dht, scale=scale, cu_seqlens=cu), F32_TOL, case)
    for name in ("q", "k", "v", "g", "beta"):
        np.testing.assert_array_equal(got[name][:, cu[-1]:], 0, err_msg=f"d{name} of padding tokens")


def test_impl_is_checked():
    x = jnp.zeros((1, 4, 1, 16))
    v = jnp.zeros((1, 4, 1, 16))
    s = jnp.zeros((1, 4, 1))
    with pytest.raises(ValueError, match="impl must be one of"):
        mosaic_backward.chunk_gated_delta_rule_bwd(x, x, v, s, s, None, v, None, scale=1.0, impl="triton")


@pytest.mark.parametrize("walk", [False, True], ids=["dense", "walk"])
def test_kernels_trace_to_jaxprs(monkeypatch, walk):
    """The three kernels' bodies trace (jaxprs, before any Mosaic lowering) on this CPU, dense rows and with a walk
    table, with the shapes the composition expects: the Python of every kernel path runs here, though only the GPU
    compiles them (this CPU's jax 0.10 Mosaic GPU lowers some of their layouts differently)."""
    from tests.pallas_kernels.gated_delta_rule.test_mosaic_gpu_chunk import _shim_transposed_load
    _shim_transposed_load(monkeypatch)
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    t, hk, hv, d, rows = 512, 1, 2, 128, 3
    k, v = S((1, t, hk, d), bf), S((1, t, hv, d), bf)
    t0, g2 = S((1, hv, t, 64), bf), S((1, hv, t), f32)
    states = S((rows if walk else 1, hv, d, d), f32)
    table = S((rows, 3), jnp.int32)
    kw = lambda w: dict(walk=w) if walk else {}                                       # noqa: E731

    def fwd(k, v, t0, g2, beta, h0, w):
        return mosaic_backward.state_fwd_wy(k, v, t0, g2, beta, h0, **kw(w))

    def bwd(q, k, do, t0, g2, beta, dht, w):
        return mosaic_backward.state_bwd_wy(q, k, do, t0, g2, beta, dht, scale=0.1, want_dh0=True,
                                            **(dict(kw(w), num_states=rows) if walk else {}))
    h = jax.jit(fwd).trace(k, v, t0, g2, g2, states, table).out_info
    assert h.shape == (1, hv, t // 64, d, d)
    dh, dv, dh0 = jax.jit(bwd).trace(k, k, v, t0, g2, g2, states, table).out_info
    assert (dh.shape, dv.shape, dh0.shape) == (h.shape, (1, t, hv, d), states.shape)
    hh = S(h.shape, bf)
    grads = jax.jit(lambda *a: mosaic_backward.chunk_grads(*a, scale=0.1)).trace(k, k, v, v, t0, g2, g2, hh, hh)
    assert [x.shape for x in grads.out_info] == [(1, t, hv, d), (1, t, hv, d), (1, hv, t), (1, hv, t)]


# ---------------------------------------------------------------------------------------------------------------
# the kernels (a Hopper GPU)
# ---------------------------------------------------------------------------------------------------------------
#: (B, T, Hk, Hv, K = V, with h0): odd lengths, grouped heads, both head dims, the real dims of one layer
GPU_CASES = {"b1-t130-hk1-hv2-k128": (1, 130, 1, 2, 128, True), "b2-t1000-hk2-hv4-k64-noh0": (2, 1000, 2, 4, 64, False),
             "b1-t65-hk2-hv6-k128": (1, 65, 2, 6, 128, True), "b1-t1-hk1-hv2-k64": (1, 1, 1, 2, 64, True),
             "b1-t8192-hk16-hv32-k128": (1, 8192, 16, 32, 128, True)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_kernels_match_twin(case):
    from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk import is_hopper
    if not is_hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 (Hopper) GPU")
    b, t, hk, hv, d, with_h0 = GPU_CASES[case]
    xs, h0, do, dht = grad_case(17, b, t, hk, hv, d, d, jnp.bfloat16, b)
    bf = jnp.bfloat16
    q, k, v, g, beta = (jnp.asarray(xs[0], bf), jnp.asarray(xs[1], bf), jnp.asarray(xs[2], bf), jnp.asarray(xs[3]),
                        jnp.asarray(xs[4], bf))
    h0 = jnp.asarray(h0) if with_h0 else None
    scale = d ** -0.5
    got = _grads(mosaic_backward.chunk_gated_delta_rule_bwd(q, k, v, g, beta, h0, jnp.asarray(do, bf),
                                                            jnp.asarray(dht), scale=scale, impl="mosaic"))
    with jax.default_matmul_precision("highest"):
        want = _grads(mosaic_backward.chunk_gated_delta_rule_bwd(
            *(x.astype(jnp.float32) for x in (q, k, v, g, beta)), h0, jnp.asarray(do), jnp.asarray(dht),
            scale=scale, impl="reference"))
    _check(got, want, BF16_TOL, case)


#: FLA's dense gradient matrix at the head dims the kernels take (B, T, Hk, Hv, D, scale, gate divisor, share of
#: masked gates, use_qk_l2norm), through the op (jax.grad, backend "mosaic_gpu") against torch float64
FLA_MATRIX = {"b2-t75-h4-d64-gdiv0.01": (2, 75, 4, 4, 64, 1.0, 0.01, 0.0, False),
              "b2-t1000-h3-d64-scale0.1-mask0.5": (2, 1000, 3, 3, 64, 0.1, 1.0, 0.5, False),
              "b2-t256-hk2-hv4-d64": (2, 256, 2, 4, 64, 1.0, 1.0, 0.0, False),
              "b2-t512-hk2-hv8-d64-gdiv0.1-l2norm": (2, 512, 2, 8, 64, 1.0, 0.1, 0.0, True)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(FLA_MATRIX))
def test_op_grads_fla_matrix(case):
    from jax_gdn.ops import chunk_gated_delta_rule
    from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk import is_hopper
    if not is_hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 (Hopper) GPU")
    b, t, hk, hv, d, scale, gate_div, masked, l2 = FLA_MATRIX[case]
    xs, h0, do, dht = grad_case(19, b, t, hk, hv, d, d, jnp.bfloat16, b, gate_div=gate_div, masked=masked, l2=l2)
    bf = jnp.bfloat16

    def loss(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm=l2, backend="mosaic_gpu")
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(do)) + jnp.sum(ht * jnp.asarray(dht))
    args = (jnp.asarray(xs[0], bf), jnp.asarray(xs[1], bf), jnp.asarray(xs[2], bf), jnp.asarray(xs[3]),
            jnp.asarray(xs[4], bf), jnp.asarray(h0))
    got = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
    want = torch_grads(xs, h0, do, dht, scale=scale, use_qk_l2norm=l2)
    _check(_grads(got), want, BF16_TOL, case)


#: FLA's varlen gradient matrix (random h0) at K = V = 128, grouped heads, through the op with
#: DispatchConfig(mosaic_backward_varlen=True) against torch float64
GPU_VARLEN = {"fla-0-15": (15,), "fla-0-256-500-1000": (256, 244, 500),
              "fla-0-15-100-300-1200-2000": (15, 85, 200, 900, 800), "odd-lengths": (1, 0, 63, 64, 65, 130)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_VARLEN))
def test_op_grads_varlen_walk(case):
    from jax_gdn.ops import DispatchConfig, chunk_gated_delta_rule
    from pallas_kernels.gated_delta_rule.mosaic_gpu.chunk import is_hopper
    if not is_hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 (Hopper) GPU")
    lens = GPU_VARLEN[case]
    cu = cu_of(lens)
    t = int(cu[-1]) + PAD_TOKENS
    xs, h0, do, dht = grad_case(29, 1, t, 1, 2, 128, 128, jnp.bfloat16, len(lens))
    bf = jnp.bfloat16
    dispatch = DispatchConfig(mosaic_backward_varlen=True)

    def loss(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=jnp.asarray(cu), backend="mosaic_gpu", dispatch=dispatch)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(do)) + jnp.sum(ht * jnp.asarray(dht))
    args = (jnp.asarray(xs[0], bf), jnp.asarray(xs[1], bf), jnp.asarray(xs[2], bf), jnp.asarray(xs[3]),
            jnp.asarray(xs[4], bf), jnp.asarray(h0))
    got = _grads(jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args))
    _check(got, torch_grads(xs, h0, do, dht, scale=128 ** -0.5, cu_seqlens=cu), BF16_TOL, case)
    for name in ("q", "k", "v", "g", "beta"):
        np.testing.assert_array_equal(got[name][:, cu[-1]:], 0, err_msg=f"d{name} of padding tokens")
