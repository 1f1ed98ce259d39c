"""The persistent state pass (pallas_triton.LaunchConfig.state_programs = P > 0, ``gdn_state_pass_persistent``)
against the float64 per-token loop and against the default grid, in interpret mode on CPU.

P is chosen so that the last round is partial (masked items) and the snake order reverses (P = 5, 7 against 8-48
items), and P >= the item count (one item per program). The kernel is also cross-lowered to Triton IR for CUDA. Tolerances (relative RMS vs float64, tests/gdn_harness.py):
fp32 2e-4; against the default grid kernel the same arithmetic runs per item, so 1e-6.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cases
from pallas_kernels.gated_delta_rule.triton import chunk as pallas_triton
from pallas_kernels.gated_delta_rule.chunk_map import build_chunk_map
from tests.gdn_harness import cu_of, make_inputs, oracle, rel_rms, tol
from tests.numpy_reference import gated_delta_rule_f64

LC = pallas_triton.LaunchConfig


def _plain(q, k, v, g, beta, h0, cu, *, config, final=True):
    cmap = None if cu is None else build_chunk_map(cu, q.shape[1], 64)
    return pallas_triton.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=h0, cu_seqlens=cu,
                                                    chunk_map=cmap, output_final_state=final, interpret=True,
                                                    config=config)


def test_persistent_item_snake_covers_every_item_once():
    for programs, total in ((5, 8), (7, 48), (4, 4), (3, 10), (1, 3)):
        rounds = -(-total // programs)
        got = np.array([[int(pallas_triton.persistent_item(p, r, programs)) for r in range(rounds)]
                        for p in range(programs)])
        real = got[got < total]
        assert sorted(real.tolist()) == list(range(total)), (programs, total)
        if rounds > 1:                                   # odd rounds reverse: program 0 gets the round's last item
            assert got[0, 1] == 2 * programs - 1


@pytest.mark.parametrize("case", cases.CPU_DENSE, ids=lambda c: c.name)
def test_persistent_dense_odd_lengths(case):
    """B2, T in (1, 63, 64, 65, 130), Hk 2 / Hv 4, K 16 / V 8: 8 items over 5 programs (2 rounds, the second
    partial and reversed), initial states in, final states out ("seq")."""
    q, k, v, g, beta, h0, _ = make_inputs(case, case.T + 100)
    ref_o, ref_s = oracle(q, k, v, g, beta, h0)
    fn = jax.jit(lambda *a: _plain(*a, None, config=LC(state_programs=5)))
    o, s = fn(*map(jnp.asarray, (q, k, v, g, beta, h0)))
    assert rel_rms(np.asarray(o), ref_o) < tol(jnp.float32)
    assert rel_rms(np.asarray(s), ref_s) < tol(jnp.float32)


def test_persistent_slots_varlen_grouped_poisoned(programs=7):
    """Varlen lengths 1 / 63 / 0 / 64 / 65 / 130 plus padding tokens past cu_seqlens[N], grouped heads (Hk 2,
    Hv 4), two value blocks per head (V 16, BV 8): 48 items. Slots permuted; a stale NaN slot with
    has_initial_state False reads as zeros; an id of -1 on a real sequence reads zeros and writes nowhere; the
    zero-length padding stream has id S; untouched slots keep their NaN bit for bit; padding rows of o are zero.
    The same call through the default grid gives the same o and pool (1e-6)."""
    lens = (1, 63, 0, 64, 65, 130)
    t_total = sum(lens) + 9                              # 9 padding tokens
    case = cases.Case("cpu-persist", 1, t_total, 2, 4, 16, 16)
    n, num_slots = len(lens), 9
    q, k, v, g, beta, _, _ = make_inputs(case, 55)
    slot_ids = np.array([4, 0, num_slots, 7, -1, 2], np.int32)
    has = np.array([True, False, True, True, True, True])
    rng = np.random.default_rng(56)
    init = rng.standard_normal((n, case.Hv, case.K, case.V)).astype(np.float32)
    pool = np.full((num_slots, case.Hv, case.K, case.V), np.nan, np.float32)
    for i in range(n):
        if has[i] and 0 <= slot_ids[i] < num_slots:
            pool[slot_ids[i]] = init[i]
    h0 = np.zeros_like(init)
    for i in range(n):
        if has[i] and 0 <= slot_ids[i] < num_slots:
            h0[i] = init[i]
    cu = cu_of(lens)
    ref_o, ref_s = gated_delta_rule_f64(q[:, :sum(lens)], k[:, :sum(lens)], v[:, :sum(lens)], g[:, :sum(lens)],
                                        beta[:, :sum(lens)], initial_state=h0, cu_seqlens=cu)

    def run(config):
        @jax.jit
        def fwd(q, k, v, g, beta, pool, slot_ids, has, cu):
            cmap = build_chunk_map(cu, q.shape[1], 64)
            return pallas_triton.chunk_gated_delta_rule_slots_fwd(
                q, k, v, g, beta, scale=None, ssm_state=pool, slot_ids=slot_ids, has_initial_state=has,
                cu_seqlens=cu, chunk_map=cmap, interpret=True, config=config)
        o, p = fwd(*map(jnp.asarray, (q, k, v, g, beta, pool, slot_ids, has, cu)))
        return np.asarray(o), np.asarray(p)

    o, new_pool = run(LC(block_v=8, state_programs=programs))
    real = sum(lens)
    assert np.isfinite(o).all()
    assert rel_rms(o[:, :real], ref_o) < tol(jnp.float32)
    assert (o[:, real:] == 0).all()
    written = [(i, s) for i, s in enumerate(slot_ids) if 0 <= s < num_slots]
    assert rel_rms(new_pool[[s for _, s in written]], ref_s[[i for i, _ in written]]) < tol(jnp.float32)
    untouched = np.setdiff1d(np.arange(num_slots), [s for _, s in written])
    assert np.isnan(new_pool[untouched]).all()           # -1 and S wrote nowhere (no wrap, no clamp)
    o_grid, pool_grid = run(LC(block_v=8))
    assert rel_rms(o, o_grid) < 1e-6
    ws = [s for _, s in written]
    assert rel_rms(new_pool[ws], pool_grid[ws]) < 1e-6


def test_persistent_no_initial_state_and_no_final_state():
    """Grouped heads (Hk 1, Hv 3), T 70, no initial state (every start-state load masked off), P = 1000 >= the 3
    items (one item per program, P clamped): final states out match the float64 loop; with output_final_state
    False o is the same and no state comes back."""
    case = cases.CPU_GVA[1]
    q, k, v, g, beta, _, _ = make_inputs(case, 61, with_h0=False)
    ref_o, ref_s = oracle(q, k, v, g, beta)
    cfg = LC(state_programs=1000)
    xs = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    o, s = jax.jit(lambda *a: _plain(*a, None, None, config=cfg))(*xs)
    o2, none = jax.jit(lambda *a: _plain(*a, None, None, config=cfg, final=False))(*xs)
    assert none is None
    assert rel_rms(np.asarray(o), ref_o) < tol(jnp.float32) and rel_rms(np.asarray(s), ref_s) < tol(jnp.float32)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))


def test_persistent_config_error():
    case = cases.CPU_DENSE[0]
    q, k, v, g, beta, h0, _ = make_inputs(case, 1)
    with pytest.raises(ValueError, match="state_programs must be >= 0"):
        _plain(*map(jnp.asarray, (q, k, v, g, beta, h0)), None, config=LC(state_programs=-1))
    assert dataclasses.replace(LC()).state_programs == 0          # off by default


@pytest.mark.parametrize("final", ["seq", "none", "slot"])
def test_persistent_lowers_to_triton(final):
    """The persistent kernel lowers to Triton IR for each final-state mode (cross-lowered for CUDA on any machine:
    interpret mode runs the kernel's jaxpr, not the Triton lowering, and the H200 run of commit f792283 failed
    there, on a jnp ``%`` whose Triton lowering met an i1 operand: AssertionError ('i32', 'i1'))."""
    lens = (1, 63, 0, 64, 65, 130)
    t, n = sum(lens) + 5, len(lens)
    q = jnp.zeros((1, t, 1, 16), jnp.bfloat16)
    v = jnp.zeros((1, t, 2, 16), jnp.bfloat16)
    g, beta = jnp.zeros((1, t, 2)), jnp.zeros((1, t, 2), jnp.bfloat16)
    cu = jnp.asarray(cu_of(lens))
    pool = jnp.zeros((n + 2, 2, 16, 16))
    kw = dict(scale=None, cu_seqlens=cu, chunk_map=build_chunk_map(cu, t, 64), interpret=False,
              config=LC(state_programs=5))

    def f(q, v, g, beta, pool):
        if final == "slot":
            return pallas_triton.chunk_gated_delta_rule_slots_fwd(
                q, q, v, g, beta, ssm_state=pool, slot_ids=jnp.arange(n, dtype=jnp.int32),
                has_initial_state=jnp.ones((n,), bool), **kw)
        return pallas_triton.chunk_gated_delta_rule_fwd(q, q, v, g, beta, initial_state=pool[:n],
                                                        output_final_state=final == "seq", **kw)
    text = jax.jit(f).trace(q, v, g, beta, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_state_pass_persistent" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_gpu_persistent_matches_f64_and_grid(dtype):
    """On the GPU (K = V = 128, varlen6-Hk2-Hv6: lengths 65 / 1 / 0 / 200 / 63 / 130): the persistent state pass
    (P = 5: partial, reversed rounds; P = 132: one per SM) against the float64 loop (tolerances of the harness)
    and against the default grid (the same arithmetic per item: 1e-6)."""
    case = cases.GPU_TEST_CASES[-1]
    q, k, v, g, beta, h0, cu = make_inputs(case, 71, dtype, lens=case.lens)
    ref_o, ref_s = oracle(q, k, v, g, beta, h0, cu)
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g), jnp.asarray(beta),
            jnp.asarray(h0))

    def run(config):
        def f(q, k, v, g, beta, h0):
            return pallas_triton.chunk_gated_delta_rule_fwd(
                q, k, v, g, beta, scale=None, initial_state=h0, cu_seqlens=jnp.asarray(cu),
                chunk_map=build_chunk_map(jnp.asarray(cu), q.shape[1], 64), output_final_state=True,
                interpret=False, config=config)
        o, s = jax.jit(f)(*args)
        return np.asarray(o, np.float64), np.asarray(s)
    o_grid, s_grid = run(None)
    for programs in (5, 132):
        o, s = run(LC(state_programs=programs))
        eo, es = rel_rms(o, ref_o), rel_rms(s, ref_s)
        print(f"FIGURE persistent P{programs} {jnp.dtype(dtype).name} o_rel_rms={eo:.3e} state_rel_rms={es:.3e}")
        assert eo < tol(dtype) and es < tol(dtype)
        assert rel_rms(o, o_grid) < 1e-6 and rel_rms(s, s_grid) < 1e-6
