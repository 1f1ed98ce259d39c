"""The checks every backend of the gated delta rule op passes, against the float64 per-token loop
(tests/numpy_reference.py), through the public entry points of ``jax_gdn.ops``:
``chunk_gated_delta_rule``, ``chunk_gated_delta_rule_slots`` and ``fused_recurrent_gated_delta_rule_slots``.

A backend's test file subclasses :class:`GatedDeltaRuleBackendTest` and sets ``backend`` (the name the op takes),
and where they differ ``dtypes`` and the head dims; the class is collected as ``Test...`` there.

Shape legend: B rows, T tokens, N sequences, S slots, Hk / Hv key / value heads, K / V head dims.

Cases: dense rows of 1, 63, 64, 65 and 130 tokens (around the chunk of 64) with initial states; grouped value
heads Hv = 2 Hk, 3 Hk and 4 Hk; packed sequences (cu_seqlens) with per-sequence initial states and zero-length and
one-token sequences, both as a long mix (chunked kernels) and as a mix of short sequences (the per-token route of
the Pallas backends); tokens past cu_seqlens[N] NaN-poisoned (zero rows, no state touched); the slot pool with
NaN-poisoned slots (untouched ones stay NaN bit for bit, a fresh stream over a NaN slot reads zeros), ids -1 and
S (zeros read, writes dropped, no wrap onto S - 1), the pool donated under jit; g = -inf and g = -1e37 (hard
resets); head dims outside the kernels' list (K = 24, V = 40), padded inside the op. Gradients
(``GatedDeltaRuleGradTest``): jax.grad of sum(o * do) + sum(ht * dht) against torch float64 autograd of the
per-token loop, for q, k, v, g, beta and h0 on a re-drawn FLA matrix (scale, gate divisor, masked gates, the
in-op L2 norm), packed sequences of 1, 63, 64, 65, 130 and 0 tokens with per-sequence h0 (padding gets exactly zero
gradients; jax.checkpoint gives the same), g = -inf, initial_state None, and the slot pool.

Inputs are drawn in a real layer's ranges (unit-norm q and k, g = log(uniform(0.5, 0.999)), beta in (0.05, 0.99))
and q, k, v are rounded to the dtype the kernel sees before the oracle takes them.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops import (chunk_gated_delta_rule, chunk_gated_delta_rule_slots,
                         fused_recurrent_gated_delta_rule_slots)
from tests.numpy_reference import gated_delta_rule_f64, l2norm_f64, rel_rms

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

#: relative RMS against the float64 loop. Chunked prefill: fp32 inputs (IEEE fp32 dots) 2e-4; bf16 inputs (bf16
#: dot operands, fp32 accumulation and state) 1e-2, for o and the final state alike.
CHUNK_TOL = {F32: 2e-4, BF16: 1e-2}
#: per-token decode (no chunking, fp32 math and state): the state 1e-5 for either input dtype; o 1e-5 in fp32,
#: 1e-2 in bf16 (o is stored in v's dtype: one bf16 rounding)
DECODE_TOL_O = {F32: 1e-5, BF16: 1e-2}
DECODE_TOL_STATE = {F32: 1e-5, BF16: 1e-5}

#: packed sequences with a zero-length and a one-token one: a long mix (chunked kernels) and a short one
#: (B T <= 8 N: the per-token route of the Pallas backends)
VARLEN_LENS = {"long-mix": (3, 0, 64, 1, 70, 2, 5), "short-mix": (1, 0, 3, 1, 2, 1, 2)}
PAD_TOKENS = 5


def _rounded(x, dtype) -> np.ndarray:
    return np.array(jnp.asarray(x, dtype).astype(jnp.float32))


def make_inputs(seed, b, t, hk, hv, dk, dv, dtype) -> list:
    """[q, k, v, g, beta] as float32 NumPy arrays, q / k / v holding values of ``dtype``."""
    rng = np.random.default_rng(seed)
    q = l2norm_f64(rng.standard_normal((b, t, hk, dk)))
    k = l2norm_f64(rng.standard_normal((b, t, hk, dk)))
    v = rng.standard_normal((b, t, hv, dv))
    g = np.log(rng.uniform(0.5, 0.999, (b, t, hv))).astype(np.float32)
    beta = rng.uniform(0.05, 0.99, (b, t, hv)).astype(np.float32)
    return [_rounded(q, dtype), _rounded(k, dtype), _rounded(v, dtype), g, beta]


def device_inputs(xs, dtype) -> list:
    q, k, v, g, beta = xs
    return [jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g), jnp.asarray(beta)]


def cu_of(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def pool_case(seed, num_slots, hv, dk, dv):
    """A pool [S, Hv, K, V] fp32 with slots 0 and 3 NaN-poisoned (0: stale under a fresh stream; 3: named by no
    stream), and 7 streams' (slot_ids, has_initial_state): ids -1, S and S + 3 name no slot; slot S - 1 is named
    by no stream either (a wrapped -1 or a clamped S would land there)."""
    pool = np.random.default_rng(seed).standard_normal((num_slots, hv, dk, dv)).astype(np.float32)
    pool[[0, 3]] = np.nan
    ids = np.array([4, 1, 0, -1, num_slots, 2, num_slots + 3], np.int32)
    has = np.array([True, True, False, True, True, True, True])
    return pool, ids, has


def start_states(pool, ids, has) -> np.ndarray:
    """[N, Hv, K, V] float64: each stream's start state under the slot contract."""
    s = pool.shape[0]
    out = np.zeros((len(ids),) + pool.shape[1:])
    for n, (sid, h) in enumerate(zip(ids, has)):
        if h and 0 <= sid < s:
            out[n] = pool[sid]
    return out


def check_pool(new_pool, pool, ids, final, tol):
    """Slots named by an in-range id hold that stream's final state (within ``tol``); every other slot keeps its
    bytes (NaN included)."""
    new_pool = np.asarray(new_pool)
    assert new_pool.shape == pool.shape and new_pool.dtype == np.float32
    named = {int(sid): n for n, sid in enumerate(ids) if 0 <= sid < pool.shape[0]}
    for slot in range(pool.shape[0]):
        if slot in named:
            got = new_pool[slot]
            assert np.isfinite(got).all(), f"slot {slot} (stream {named[slot]}) is not finite"
            err = rel_rms(got, final[named[slot]])
            assert err < tol, f"slot {slot} (stream {named[slot]}): rel RMS {err:.3e} >= {tol}"
        else:
            np.testing.assert_array_equal(new_pool[slot], pool[slot], err_msg=f"slot {slot} named by no stream "
                                          "changed (a dropped write landed, or an id wrapped / clamped)")


# ================================================================================================================
# Gradients: against torch float64 autograd of the per-token recurrence
# ================================================================================================================
#: relative RMS of the gradients against float64 (FLA's metric; its bf16 limits: o, ht 5e-3 -> our forward's
#: bf16 tolerance above; dq, dk, dv, dh0 8e-3; dg, dbeta 2e-2). fp32: the chunked XLA form's VJP in fp32.
GRAD_TOL = {F32: {"q": 1e-4, "k": 1e-4, "v": 1e-4, "h0": 1e-4, "g": 1e-4, "beta": 1e-4},
            BF16: {"q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3, "g": 2e-2, "beta": 2e-2}}
GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0")
#: FLA's gradient matrix, re-drawn at sizes that run in interpret mode on a CPU: (B, T, Hk, Hv, scale, gate
#: divisor, share of masked (g = -inf) gates, use_qk_l2norm)
GRAD_DENSE = {"b2-t75-h2-hv4-gdiv0.01": (2, 75, 2, 4, 1.0, 0.01, 0.0, False),
              "b1-t130-h1-hv2-scale0.1-mask0.5": (1, 130, 1, 2, 0.1, 1.0, 0.5, False),
              "b2-t64-h1-hv2-l2norm": (2, 64, 1, 2, 1.0, 0.1, 0.0, True)}
#: packed sequences for the gradients: lengths 1, 63, 64, 65, 130 with a zero-length one, random h0
GRAD_VARLEN = {"fla-0-15": (15,), "odd-lengths": (1, 0, 63, 64, 65, 130)}


def torch_gdn_f64(q, k, v, g, beta, h0, *, scale, cu_seqlens=None, use_qk_l2norm=False):
    """The per-token gated delta rule in torch float64 (autograd): q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta
    [B, T, Hv], h0 [N, Hv, K, V] (N = B, or len(cu_seqlens) - 1 with B = 1). Returns (o [B, T, Hv, V], ht
    [N, Hv, K, V]); tokens past cu_seqlens[N] give zero rows."""
    import torch
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    b, t = q.shape[:2]
    segs = ([(row, 0, t) for row in range(b)] if cu_seqlens is None
            else [(0, int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in range(len(cu_seqlens) - 1)])
    rows = [[None] * t for _ in range(b)]
    finals = []
    for n, (row, lo, hi) in enumerate(segs):
        s = h0[n]
        for i in range(lo, hi):
            s = s * torch.exp(g[row, i])[:, None, None]
            kt = k[row, i]
            u = beta[row, i][:, None] * (v[row, i] - torch.einsum("hkv,hk->hv", s, kt))
            s = s + torch.einsum("hk,hv->hkv", kt, u)
            rows[row][i] = torch.einsum("hkv,hk->hv", s, q[row, i] * scale)
        finals.append(s)
    zero = torch.zeros_like(v[0, 0])
    o = torch.stack([torch.stack([x if x is not None else zero for x in r]) for r in rows])
    return o, torch.stack(finals)


def grad_case(seed, b, t, hk, hv, dk, dv, dtype, n, *, gate_div=1.0, masked=0.0, l2=False):
    """Inputs (NumPy fp32, q / k / v holding ``dtype`` values) for the gradient checks: [q, k, v, g, beta], h0
    [N, Hv, K, V], and the cotangents do [B, T, Hv, V], dht [N, Hv, K, V]."""
    rng = np.random.default_rng(seed)
    xs = make_inputs(seed, b, t, hk, hv, dk, dv, dtype)
    if l2:                                        # raw (not unit) q and k: the op's L2 norm is differentiated
        xs[0] = _rounded(rng.standard_normal((b, t, hk, dk)), dtype)
        xs[1] = _rounded(rng.standard_normal((b, t, hk, dk)), dtype)
    xs[3] = (xs[3] / gate_div).astype(np.float32)
    if masked:
        xs[3] = np.where(rng.uniform(size=xs[3].shape) < masked, -np.inf, xs[3]).astype(np.float32)
    h0 = (0.3 * rng.standard_normal((n, hv, dk, dv))).astype(np.float32)
    do = _rounded(rng.standard_normal((b, t, hv, dv)), dtype)
    dht = rng.standard_normal((n, hv, dk, dv)).astype(np.float32)
    return xs, h0, do, dht


def torch_grads(xs, h0, do, dht, *, scale, cu_seqlens=None, use_qk_l2norm=False) -> dict:
    """{name: float64 gradient} of sum(o * do) + sum(ht * dht) by torch autograd of ``torch_gdn_f64``."""
    import torch
    ts = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in list(xs) + [h0]]
    o, ht = torch_gdn_f64(*ts, scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    loss = (o * torch.tensor(np.asarray(do, np.float64))).sum() + (ht * torch.tensor(np.asarray(dht, np.float64))).sum()
    loss.backward()
    return {name: x.grad.numpy() for name, x in zip(GRAD_NAMES, ts)}


class GatedDeltaRuleGradTest:
    """Gradient checks of one backend (a base of :class:`GatedDeltaRuleBackendTest`): jax.grad through
    ``chunk_gated_delta_rule`` and ``chunk_gated_delta_rule_slots`` against torch float64 autograd of the
    per-token loop, loss sum(o * do) + sum(ht * dht), gradients of q, k, v, g, beta and h0 (or the pool)."""

    def op_grads(self, xs, h0, do, dht, dtype, *, scale, cu_seqlens=None, use_qk_l2norm=False, remat=False):
        def loss(q, k, v, g, beta, h0):
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                           cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, backend=self.backend)
            return (jnp.sum(o.astype(jnp.float32) * jnp.asarray(do, jnp.float32))
                    + jnp.sum(ht * jnp.asarray(dht)))
        fn = jax.checkpoint(loss) if remat else loss
        args = device_inputs(xs, dtype) + [jnp.asarray(h0)]
        with self.precision():
            grads = jax.jit(jax.grad(fn, argnums=tuple(range(6))))(*args)
        return {name: np.asarray(gr, np.float64) for name, gr in zip(GRAD_NAMES, grads)}

    def check_grads(self, got, want, dtype, what):
        for name in GRAD_NAMES:
            assert np.isfinite(got[name]).all(), f"{what}: d{name} is not finite"
            err = rel_rms(got[name], want[name])
            assert err < GRAD_TOL[dtype][name], f"{what}: d{name} rel RMS {err:.3e} >= {GRAD_TOL[dtype][name]}"

    def test_grad_dense_matrix(self, dtype, grad_dense_case):
        case = grad_dense_case
        b, t, hk, hv, scale, gate_div, masked, l2 = GRAD_DENSE[case]
        dk, dv = self.head_k_dim, self.head_v_dim
        xs, h0, do, dht = grad_case(3, b, t, hk, hv, dk, dv, dtype, b, gate_div=gate_div, masked=masked, l2=l2)
        got = self.op_grads(xs, h0, do, dht, dtype, scale=scale, use_qk_l2norm=l2)
        self.check_grads(got, torch_grads(xs, h0, do, dht, scale=scale, use_qk_l2norm=l2), dtype, case)

    def test_grad_varlen_initial_states_and_padding(self, dtype, grad_varlen_case):
        """Packed sequences with per-sequence h0; PAD_TOKENS tokens past cu_seqlens[N] get exactly zero
        gradients; under jax.checkpoint the same gradients (the one-sequence case)."""
        case = grad_varlen_case
        lens = GRAD_VARLEN[case]
        cu = cu_of(lens)
        t = int(cu[-1]) + PAD_TOKENS
        dk, dv = self.head_k_dim, self.head_v_dim
        xs, h0, do, dht = grad_case(5, 1, t, 1, 2, dk, dv, dtype, len(lens))
        scale = dk ** -0.5
        got = self.op_grads(xs, h0, do, dht, dtype, scale=scale, cu_seqlens=jnp.asarray(cu))
        self.check_grads(got, torch_grads(xs, h0, do, dht, scale=scale, cu_seqlens=cu), dtype, case)
        for name in ("q", "k", "v", "g", "beta"):
            np.testing.assert_array_equal(got[name][:, cu[-1]:], 0, err_msg=f"d{name} of padding tokens")
        if len(lens) > 1:                 # jax.checkpoint on the short case only (a second compile)
            return
        remat = self.op_grads(xs, h0, do, dht, dtype, scale=scale, cu_seqlens=jnp.asarray(cu), remat=True)
        for name in GRAD_NAMES:
            np.testing.assert_allclose(remat[name], got[name], rtol=1e-5, atol=1e-6, err_msg=f"d{name} remat")

    def test_grad_hard_resets_and_no_initial_state(self, dtype):
        """g = -inf everywhere in a third of the tokens: finite gradients equal to float64's; initial_state None
        gives the gradients of zeros."""
        dk, dv = self.head_k_dim, self.head_v_dim
        xs, h0, do, dht = grad_case(7, 1, 70, 1, 2, dk, dv, dtype, 1, masked=0.33)
        h0 = np.zeros_like(h0)
        scale = dk ** -0.5
        got = self.op_grads(xs, h0, do, dht, dtype, scale=scale)
        self.check_grads(got, torch_grads(xs, h0, do, dht, scale=scale), dtype, "g=-inf")

        def loss_none(v):
            q, k, _, g, beta = device_inputs(xs, dtype)
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, output_final_state=True,
                                           backend=self.backend)
            return jnp.sum(o.astype(jnp.float32) * jnp.asarray(do, jnp.float32)) + jnp.sum(ht * jnp.asarray(dht))
        with self.precision():
            dv_none = jax.jit(jax.grad(loss_none))(jnp.asarray(xs[2], dtype))
        np.testing.assert_allclose(np.asarray(dv_none, np.float64), got["v"], rtol=1e-5, atol=1e-6)

    def test_grad_slots_pool(self, dtype):
        """The slot op: gradients of the pool reach the named slots with has_initial_state (their h0's gradient),
        pass through unnamed slots unchanged (d new_pool), and are zero for a fresh stream's slot read."""
        dk, dv, hv = self.head_k_dim, self.head_v_dim, 2
        lens = (3, 0, 64, 1, 70)
        cu = cu_of(lens)
        xs, _, do, dht_n = grad_case(9, 1, int(cu[-1]), 1, hv, dk, dv, dtype, len(lens))
        rng = np.random.default_rng(9)
        num_slots = 7
        pool = (0.3 * rng.standard_normal((num_slots, hv, dk, dv))).astype(np.float32)
        dpool = rng.standard_normal(pool.shape).astype(np.float32)
        ids = np.array([4, 1, 0, 6, 2], np.int32)
        has = np.array([True, True, False, True, True])
        scale = dk ** -0.5

        def loss(v, pool):
            q, k, _, g, beta = device_inputs(xs, dtype)
            o, new_pool = chunk_gated_delta_rule_slots(
                q, k, v, g, beta, ssm_state=pool, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
                cu_seqlens=jnp.asarray(cu), scale=scale, backend=self.backend)
            return (jnp.sum(o.astype(jnp.float32) * jnp.asarray(do, jnp.float32))
                    + jnp.sum(new_pool * jnp.asarray(dpool)))
        with self.precision():
            dv_got, dpool_got = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(xs[2], dtype), jnp.asarray(pool))
        h0 = start_states(pool, ids, has).astype(np.float32)
        want = torch_grads(xs, h0, do, dpool[ids], scale=scale, cu_seqlens=cu)
        tol = GRAD_TOL[dtype]
        assert rel_rms(dv_got, want["v"]) < tol["v"]
        dpool_got = np.asarray(dpool_got, np.float64)
        for slot in range(num_slots):
            if slot in ids:
                n = int(np.where(ids == slot)[0][0])
                if has[n]:
                    err = rel_rms(dpool_got[slot], want["h0"][n])
                    assert err < tol["h0"], f"slot {slot}: rel RMS {err:.3e}"
                else:
                    np.testing.assert_array_equal(dpool_got[slot], 0, err_msg=f"fresh stream's slot {slot}")
            else:
                np.testing.assert_allclose(dpool_got[slot], dpool[slot], rtol=1e-6,
                                           err_msg=f"unnamed slot {slot}: d new_pool passes through")


class GatedDeltaRuleBackendTest(GatedDeltaRuleGradTest):
    """Checks of one backend of the gated delta rule op (forward, and the gradients of GatedDeltaRuleGradTest). Subclass it as ``Test<Backend>`` and set ``backend``."""

    #: the op's backend name ("xla", "pallas_interpret", "pallas", "mosaic_gpu")
    backend: str = ""
    #: input dtypes of q, k, v the backend takes (g, beta and states are fp32)
    dtypes: tuple = (F32, BF16)
    head_k_dim: int = 16
    head_v_dim: int = 32
    #: head dims (K, V) outside the kernels' list, zero-padded inside the Pallas ops; None where the backend
    #: takes only its own dims (and runs another backend for these)
    padded_head_dims: Optional[tuple] = (24, 40)
    #: jax_default_matmul_precision around the calls (None: leave it)
    matmul_precision: Optional[str] = None
    #: the gradient cases this backend runs (names of GRAD_DENSE / GRAD_VARLEN)
    grad_dense_cases: tuple = tuple(GRAD_DENSE)
    grad_varlen_cases: tuple = tuple(GRAD_VARLEN)

    def precision(self):
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=[jnp.dtype(d).name for d in self.dtypes])
        if "grad_dense_case" in metafunc.fixturenames:
            metafunc.parametrize("grad_dense_case", self.grad_dense_cases)
        if "grad_varlen_case" in metafunc.fixturenames:
            metafunc.parametrize("grad_varlen_case", self.grad_varlen_cases)

    # ---- calls through the public ops, under jit --------------------------------------------------------------
    def chunk(self, xs, dtype, *, initial_state=None, cu_seqlens=None):
        fn = jax.jit(functools.partial(chunk_gated_delta_rule, output_final_state=True, backend=self.backend))
        with self.precision():
            o, final = fn(*device_inputs(xs, dtype), initial_state=None if initial_state is None else
                          jnp.asarray(initial_state),
                          cu_seqlens=None if cu_seqlens is None else jnp.asarray(cu_seqlens))
        assert o.dtype == dtype and final.dtype == jnp.float32
        return np.asarray(o.astype(jnp.float32)), np.asarray(final)

    def chunk_slots(self, xs, dtype, pool, ids, has, cu_seqlens=None):
        fn = jax.jit(lambda xs, pool, ids, has, cu: chunk_gated_delta_rule_slots(
            *xs, ssm_state=pool, slot_ids=ids, has_initial_state=has, cu_seqlens=cu, backend=self.backend),
            donate_argnums=1)
        with self.precision():
            o, new_pool = fn(device_inputs(xs, dtype), jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(has),
                             None if cu_seqlens is None else jnp.asarray(cu_seqlens))
        assert o.dtype == dtype
        return np.asarray(o.astype(jnp.float32)), np.asarray(new_pool)

    def decode_slots(self, xs, dtype, pool, ids, has, use_qk_l2norm=False):
        fn = jax.jit(lambda xs, pool, ids, has: fused_recurrent_gated_delta_rule_slots(
            *xs, ssm_state=pool, slot_ids=ids, has_initial_state=has, use_qk_l2norm=use_qk_l2norm,
            backend=self.backend), donate_argnums=1)
        with self.precision():
            o, new_pool = fn(device_inputs(xs, dtype), jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(has))
        assert o.dtype == dtype
        return np.asarray(o.astype(jnp.float32)), np.asarray(new_pool)

    def inputs(self, seed, b, t, hk, hv, dtype):
        return make_inputs(seed, b, t, hk, hv, self.head_k_dim, self.head_v_dim, dtype)

    def test_padded_head_dims(self):
        """K, V = padded_head_dims, Hv = 3 Hk, the first of ``dtypes``: dense prefill of 65 tokens from initial
        states, and one decode step over pool_case's pool."""
        if self.padded_head_dims is None:
            pytest.skip(f"backend {self.backend!r} takes only its own head dims")
        dtype = jnp.dtype(self.dtypes[0])
        dk, dv = self.padded_head_dims
        xs = make_inputs(30, 1, 65, 1, 3, dk, dv, dtype)
        h0 = np.random.default_rng(31).standard_normal((1, 3, dk, dv)).astype(np.float32)
        o, final = self.chunk(xs, dtype, initial_state=h0)
        o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=h0)
        assert o.shape == o_ref.shape and final.shape == f_ref.shape
        eo, es = rel_rms(o, o_ref), rel_rms(final, f_ref)
        assert eo < CHUNK_TOL[dtype] and es < CHUNK_TOL[dtype], f"prefill: o {eo:.3e}, state {es:.3e}"
        xs = make_inputs(32, 7, 1, 1, 3, dk, dv, dtype)
        pool, ids, has = pool_case(33, 6, 3, dk, dv)
        o, new_pool = self.decode_slots(xs, dtype, pool, ids, has)
        o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=start_states(pool, ids, has))
        assert rel_rms(o, o_ref) < DECODE_TOL_O[dtype]
        check_pool(new_pool, pool, ids, f_ref, DECODE_TOL_STATE[dtype])

    # ---- chunk_gated_delta_rule ---------------------------------------------------------------------------------
    def full_sweep(self, dtype) -> bool:
        """Whether ``dtype`` runs every length / head ratio of a sweep (the first of ``dtypes``) or one of them:
        the other dtypes share the kernels' indexing and differ in rounding only."""
        return jnp.dtype(dtype) == jnp.dtype(self.dtypes[0])

    def test_dense_rows_odd_lengths(self, dtype):
        """B = 2 rows of 1, 63, 64, 65, 130 tokens (the other dtypes: 130) from initial states: o and the final
        states."""
        for t in (1, 63, 64, 65, 130) if self.full_sweep(dtype) else (130,):
            xs = self.inputs(t, 2, t, 1, 2, dtype)
            h0 = np.random.default_rng(t + 1).standard_normal((2, 2, self.head_k_dim, self.head_v_dim))
            h0 = h0.astype(np.float32)
            o, final = self.chunk(xs, dtype, initial_state=h0)
            o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=h0)
            eo, es = rel_rms(o, o_ref), rel_rms(final, f_ref)
            assert eo < CHUNK_TOL[dtype] and es < CHUNK_TOL[dtype], f"T={t}: o {eo:.3e}, state {es:.3e}"

    def test_grouped_value_heads(self, dtype):
        """Hv = 2 Hk, 3 Hk and 4 Hk (the other dtypes: 4 Hk; Hk = 2: value head h reads key head h // (Hv // Hk)),
        no initial state."""
        for hv in (4, 6, 8) if self.full_sweep(dtype) else (8,):
            xs = self.inputs(hv, 1, 65, 2, hv, dtype)
            o, final = self.chunk(xs, dtype)
            o_ref, f_ref = gated_delta_rule_f64(*xs)
            eo, es = rel_rms(o, o_ref), rel_rms(final, f_ref)
            assert eo < CHUNK_TOL[dtype] and es < CHUNK_TOL[dtype], f"Hv={hv}: o {eo:.3e}, state {es:.3e}"

    def test_varlen_initial_states_and_padding(self, dtype):
        """Packed sequences (zero-length and one-token ones among them) from their own initial states, then
        PAD_TOKENS NaN-poisoned tokens past cu_seqlens[N]: o matches on the real tokens, padding rows are zero,
        a zero-length sequence's final state is its initial state, bit for bit."""
        for name, lens in VARLEN_LENS.items():
            cu = cu_of(lens)
            real = int(cu[-1])
            xs = self.inputs(real, 1, real + PAD_TOKENS, 1, 2, dtype)
            for x in xs:
                x[:, real:] = np.nan
            h0 = np.random.default_rng(real).standard_normal((len(lens), 2, self.head_k_dim, self.head_v_dim))
            h0 = h0.astype(np.float32)
            o, final = self.chunk(xs, dtype, initial_state=h0, cu_seqlens=cu)
            o_ref, f_ref = gated_delta_rule_f64(*(x[:, :real] for x in xs), initial_state=h0, cu_seqlens=cu)
            eo, es = rel_rms(o[:, :real], o_ref), rel_rms(final, f_ref)
            assert eo < CHUNK_TOL[dtype] and es < CHUNK_TOL[dtype], f"{name}: o {eo:.3e}, state {es:.3e}"
            np.testing.assert_array_equal(o[:, real:], 0.0, err_msg=f"{name}: padding rows must be zero")
            empty = [n for n, length in enumerate(lens) if length == 0]
            np.testing.assert_array_equal(final[empty], h0[empty], err_msg=f"{name}: zero-length sequence")

    def test_hard_resets(self, dtype):
        """g = -inf at token 3 (both heads) and at 64 (head 1, a chunk's first token), g = -1e37 at token 100, and
        g = -5e37 over a whole chunk (tokens 64..127) of row 1: exp(g) = 0 as in the per-token form, nothing NaN."""
        xs = self.inputs(5, 2, 130, 1, 2, dtype)
        g = xs[3]
        g[0, 3], g[0, 64, 1], g[0, 100] = -np.inf, -np.inf, -1e37
        g[1, 64:128] = -5e37
        h0 = np.random.default_rng(6).standard_normal((2, 2, self.head_k_dim, self.head_v_dim)).astype(np.float32)
        o, final = self.chunk(xs, dtype, initial_state=h0)
        assert np.isfinite(o).all() and np.isfinite(final).all()
        o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=h0)
        eo, es = rel_rms(o, o_ref), rel_rms(final, f_ref)
        assert eo < CHUNK_TOL[dtype] and es < CHUNK_TOL[dtype], (eo, es)

    # ---- chunk_gated_delta_rule_slots -------------------------------------------------------------------------
    def test_slots_varlen_pool(self, dtype):
        """Seven packed streams over a pool of 6 slots (pool_case: permuted ids, -1, S and S + 3, a fresh stream
        over a NaN slot, an untouched NaN slot, S - 1 untouched), a zero-length stream, padding tokens
        NaN-poisoned, the pool donated."""
        for name, lens in VARLEN_LENS.items():
            cu = cu_of(lens)
            real = int(cu[-1])
            xs = self.inputs(real + 7, 1, real + PAD_TOKENS, 1, 2, dtype)
            for x in xs:
                x[:, real:] = np.nan
            pool, ids, has = pool_case(real, 6, 2, self.head_k_dim, self.head_v_dim)
            h0 = start_states(pool, ids, has)
            o, new_pool = self.chunk_slots(xs, dtype, pool, ids, has, cu_seqlens=cu)
            o_ref, f_ref = gated_delta_rule_f64(*(x[:, :real] for x in xs), initial_state=h0, cu_seqlens=cu)
            eo = rel_rms(o[:, :real], o_ref)
            assert eo < CHUNK_TOL[dtype], f"{name}: o {eo:.3e}"
            np.testing.assert_array_equal(o[:, real:], 0.0, err_msg=f"{name}: padding rows must be zero")
            check_pool(new_pool, pool, ids, f_ref, CHUNK_TOL[dtype])

    def test_slots_dense_rows(self, dtype):
        """Without cu_seqlens (N = B = 3 rows of 65 tokens): rows read and write permuted slots, one row fresh over
        a NaN slot; the other slots keep their bytes."""
        xs = self.inputs(9, 3, 65, 1, 2, dtype)
        pool = np.random.default_rng(10).standard_normal((5, 2, self.head_k_dim, self.head_v_dim))
        pool = pool.astype(np.float32)
        pool[[1, 4]] = np.nan
        ids, has = np.array([3, 1, 0], np.int32), np.array([True, False, True])
        o, new_pool = self.chunk_slots(xs, dtype, pool, ids, has)
        o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=start_states(pool, ids, has))
        assert rel_rms(o, o_ref) < CHUNK_TOL[dtype]
        check_pool(new_pool, pool, ids, f_ref, CHUNK_TOL[dtype])

    # ---- fused_recurrent_gated_delta_rule_slots (decode) ------------------------------------------------------
    def test_decode_slots_pool(self, dtype):
        """Seven streams of T = 1 (Hv = 2 Hk) and T = 3 (Hv = 4 Hk, the L2 norm fused) over pool_case's pool,
        donated; stream 2 (fresh, over a NaN slot) has g = -inf at its first token on head 1."""
        for t, hv, l2 in ((1, 2, False), (3, 4, True)):
            xs = self.inputs(20 + t, 7, t, 1, hv, dtype)
            xs[3][2, 0, 1] = -np.inf
            pool, ids, has = pool_case(21 + t, 6, hv, self.head_k_dim, self.head_v_dim)
            o, new_pool = self.decode_slots(xs, dtype, pool, ids, has, use_qk_l2norm=l2)
            o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=start_states(pool, ids, has), use_qk_l2norm=l2)
            assert o.shape == (7, t, hv, self.head_v_dim)
            eo = rel_rms(o, o_ref)
            assert eo < DECODE_TOL_O[dtype], f"T={t}: o {eo:.3e}"
            check_pool(new_pool, pool, ids, f_ref, DECODE_TOL_STATE[dtype])

