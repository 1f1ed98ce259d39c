"""The decode kernel (pallas_kernels/gated_delta_rule/decode.py) through
jax_gdn.ops.fused_recurrent_gated_delta_rule_slots, against the float64 per-token loop, on every backend.

CPU: "pallas_interpret" and "xla" at tiny dims (K != V, dims padded to the kernel's sizes, grouped heads, T = 1 and
T = 3, permuted slots, ids -1 and S under jit, NaN-poisoned stale and untouched slots, fused L2 norm, bf16 inputs,
the gates made inside from raw a / b (RawGates), every launch variant), and the Triton lowering (cross-lowered).
GPU (`pytest -m gpu`): K = V = 128, Qwen3-Next heads, bf16 and fp32, the pool donated and updated in place.
Tolerances (relative RMS vs float64): fp32 inputs 1e-5 (no chunking: fp32 rounding only), bf16 inputs 1e-5 too
(the reference takes the same rounded inputs; all math is fp32).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops import fused_recurrent_gated_delta_rule_slots
from pallas_kernels.gated_delta_rule.triton import decode
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

TOL = 1e-5


def _case(seed, n, t, hk, hv, dk, dv, num_slots, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((n, t, hk, dk)).astype(np.float32)
    v = rng.standard_normal((n, t, hv, dv)).astype(np.float32)
    q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))
    g = -rng.uniform(0.01, 0.5, (n, t, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (n, t, hv)).astype(np.float32)
    pool = rng.standard_normal((num_slots, hv, dk, dv)).astype(np.float32)
    return [q, k, v, g, beta], pool


def _expected(xs, pool, ids, has, use_qk_l2norm):
    s = pool.shape[0]
    init = np.zeros((len(ids),) + pool.shape[1:], np.float64)
    for i, (sid, h) in enumerate(zip(ids, has)):
        if h and 0 <= sid < s:
            init[i] = pool[sid]
    o, final = gated_delta_rule_f64(*xs, initial_state=init, use_qk_l2norm=use_qk_l2norm)
    new_pool = pool.astype(np.float64).copy()
    for i, sid in enumerate(ids):
        if 0 <= sid < s:
            new_pool[sid] = final[i]
    return o, new_pool


CONFIGS = [decode.DecodeConfig(block_v=16, v_fastest=vf, fused_output=fo) for vf in (True, False)
           for fo in (True, False)] + [decode.DecodeConfig(block_v=128, num_warps=8)]


def _config_id(c):
    return f"bv{c.block_v}-vf{int(c.v_fastest)}-fo{int(c.fused_output)}-w{c.num_warps}"


def _check_config_interpret(config, t, *, seed, hk, hv, reset_head):
    """The decode kernel with ``config`` in interpret mode against the float64 step on 4 streams over 6 slots: ids
    1 (stale NaN slot, has False: read as zeros), S and -1 (no slot: nothing written), 5 (the last block); a hard
    reset (g = -inf) on head ``reset_head`` of
    stream 0; slot 3 (NaN, named by nobody) stays NaN."""
    n, s, dk, dv = 4, 6, 16, 32
    xs, pool = _case(seed + t, n, t, hk, hv, dk, dv, s)
    xs[3][0, 0, reset_head] = -np.inf
    ids = np.array([1, s, -1, 5], np.int32)
    has = np.array([False, True, True, True])
    pool[1] = np.nan
    pool[3] = np.nan
    o_ref, pool_ref = _expected(xs, np.where(np.isnan(pool), 0, pool), ids, has, True)
    fn = jax.jit(lambda xs, pool, ids, has: decode.fused_recurrent_gated_delta_rule_slots_fwd(
        *xs, scale=None, ssm_state=pool, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True, interpret=True,
        config=config))
    o, new_pool = fn([jnp.asarray(x) for x in xs], jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(has))
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    assert np.isfinite(o).all() and rel_rms(o, o_ref) < TOL
    assert rel_rms(new_pool[[1, 5]], pool_ref[[1, 5]]) < TOL
    assert np.isnan(new_pool[3]).all()
    for untouched in (0, 2, 4):                           # ids S and -1 wrote nowhere
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("t", [1, 3])
def test_decode_configs_interpret(config, t):
    _check_config_interpret(config, t, seed=40, hk=1, hv=3, reset_head=1)


def _raw_gates(g, beta, hk, r, layout):
    """(a_src, b_src, RawGates) whose gates are g and beta: A_log = log 2, dt_bias = 0.25 per head,
    softplus(a + 0.25) = -g / 2, sigmoid(b) = beta; ``layout`` "ba" packs [b (r) | a (r)] per key head (Qwen3-Next's
    in_proj_ba), "separate" gives a and b their own [N, T, Hk, r] arrays (Qwen3.5)."""
    g64, beta64 = np.asarray(g, np.float64), np.asarray(beta, np.float64)
    n, t, hv = g64.shape
    a = (np.log(np.expm1(-g64 / 2.0)) - 0.25).reshape(n, t, hk, r).astype(np.float32)
    b = np.log(beta64 / (1 - beta64)).reshape(n, t, hk, r).astype(np.float32)
    a_log, dt_bias = jnp.full((hv,), np.log(2.0), jnp.float32), jnp.full((hv,), 0.25, jnp.bfloat16)
    if layout == "ba":
        ba = jnp.asarray(np.concatenate([b, a], axis=-1))
        return ba, ba, decode.RawGates(a_log, dt_bias, a_offset=r, b_offset=0)
    return jnp.asarray(a), jnp.asarray(b), decode.RawGates(a_log, dt_bias)


@pytest.mark.parametrize("layout,t", [("ba", 1), ("separate", 2)], ids=["ba-T1", "separate-T2"])
def test_decode_raw_gates_match_f64(layout, t):
    """The gates made inside the kernel from raw a, b (RawGates: the layer's fused decode step) against the float64
    loop run with the gates they stand for; GVA 3, permuted ids with -1 and S, a fresh stream over a NaN slot."""
    n, s, hk, hv, dk, dv = 4, 6, 2, 6, 16, 32
    xs, pool = _case(60 + t, n, t, hk, hv, dk, dv, s)
    ids = np.array([2, -1, 5, s], np.int32)
    has = np.array([True, True, False, True])
    pool[5] = np.nan                                      # stale, has False: read as zeros
    pool[0] = np.nan                                      # untouched: stays NaN
    o_ref, pool_ref = _expected(xs, np.where(np.isnan(pool), 0, pool), ids, has, True)
    a_src, b_src, gates = _raw_gates(xs[3], xs[4], hk, hv // hk, layout)
    fn = jax.jit(lambda q, k, v, a, b, pool, gates: decode.fused_recurrent_gated_delta_rule_slots_fwd(
        q, k, v, a, b, scale=None, ssm_state=pool, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
        use_qk_l2norm=True, interpret=True, raw_gates=gates, config=decode.DecodeConfig(block_v=16)))
    o, new_pool = fn(*[jnp.asarray(x) for x in xs[:3]], a_src, b_src, jnp.asarray(pool), gates)
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    assert np.isfinite(o).all() and rel_rms(o, o_ref) < TOL
    assert rel_rms(new_pool[[2, 5]], pool_ref[[2, 5]]) < TOL
    assert np.isnan(new_pool[0]).all()
    for untouched in (1, 3, 4):
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_decode_lowers_to_triton():
    """The kernel (both output forms, 2 and 4 warps) and its raw-gates form lower to Triton IR (cross-lowered for
    CUDA on any machine: interpret mode does not run the Triton lowering)."""
    n, hk, hv, d = 3, 2, 4, 32
    q = jnp.zeros((n, 1, hk, d), jnp.bfloat16)
    v = jnp.zeros((n, 1, hv, d), jnp.bfloat16)
    g = jnp.zeros((n, 1, hv))
    ba = jnp.zeros((n, 1, hk, 4), jnp.bfloat16)
    pool = jnp.zeros((n + 1, hv, d, d))
    ids, has = jnp.arange(n, dtype=jnp.int32), jnp.ones((n,), bool)
    cfgs = [decode.DecodeConfig(), decode.DecodeConfig(num_warps=4, fused_output=False),
            decode.DecodeConfig(v_fastest=False)]
    for cfg in cfgs:
        f = lambda q, v, g, pool, cfg=cfg: decode.fused_recurrent_gated_delta_rule_slots_fwd(
            q, q, v, g, g, scale=None, ssm_state=pool, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
            config=cfg)
        assert "gdn_decode" in jax.jit(f).trace(q, v, g, pool).lower(lowering_platforms=("cuda",)).as_text()
    gates = decode.RawGates(jnp.zeros((hv,)), jnp.zeros((hv,)), a_offset=2)
    for cfg in (None, decode.DecodeConfig(fused_output=False)):
        f = lambda q, v, ba, pool, cfg=cfg: decode.fused_recurrent_gated_delta_rule_slots_fwd(
            q, q, v, ba, ba, scale=None, ssm_state=pool, slot_ids=ids, has_initial_state=has, raw_gates=gates,
            config=cfg)
        assert "gdn_decode" in jax.jit(f).trace(q, v, ba, pool).lower(lowering_platforms=("cuda",)).as_text()


def test_decode_config_errors():
    xs, pool = _case(6, 2, 1, 1, 1, 16, 48, 3)           # V = 48 runs padded to 64
    with pytest.raises(ValueError, match=r"block_v \(24\) must divide V = 64"):
        decode.fused_recurrent_gated_delta_rule_slots_fwd(
            *[jnp.asarray(x) for x in xs], scale=None, ssm_state=jnp.asarray(pool), slot_ids=jnp.array([0, 1]),
            has_initial_state=jnp.ones((2,), bool), interpret=True, config=decode.DecodeConfig(block_v=24))


def test_decode_bf16_inputs_and_default_has_initial_state():
    xs, pool = _case(3, 4, 1, 1, 2, 16, 16, 4, dtype=jnp.bfloat16)
    ids = np.array([3, 1, 0, 2], np.int32)
    o_ref, pool_ref = _expected(xs, pool, ids, [True] * 4, True)
    args = [jnp.asarray(x, jnp.bfloat16) for x in xs[:3]] + [jnp.asarray(xs[3]), jnp.asarray(xs[4])]
    for backend in ("pallas_interpret", "xla"):
        o, new_pool = fused_recurrent_gated_delta_rule_slots(*args, ssm_state=jnp.asarray(pool), slot_ids=ids,
                                                             use_qk_l2norm=True, backend=backend)
        assert o.dtype == jnp.bfloat16
        assert rel_rms(np.asarray(o, np.float64), o_ref) < 1e-2     # o rounded to bf16
        assert rel_rms(new_pool, pool_ref) < TOL, backend


def test_decode_errors():
    xs, pool = _case(5, 2, 1, 1, 1, 16, 16, 3)
    xs = [jnp.asarray(x) for x in xs]
    with pytest.raises(ValueError, match="slot_ids must not repeat"):
        fused_recurrent_gated_delta_rule_slots(*xs, ssm_state=jnp.asarray(pool), slot_ids=np.array([1, 1]),
                                               backend="pallas_interpret")
    with pytest.raises(ValueError, match=r"ssm_state must have shape \[S, Hv, K, V\]"):
        fused_recurrent_gated_delta_rule_slots(*xs, ssm_state=jnp.asarray(pool)[:, :, :8],
                                               slot_ids=np.array([0, 1]), backend="xla")
    empty = [x[:0] for x in xs]                                  # N = 0 streams: nothing runs, pool unchanged
    for backend in ("pallas_interpret", "xla"):
        o, same = fused_recurrent_gated_delta_rule_slots(*empty, ssm_state=jnp.asarray(pool),
                                                         slot_ids=np.zeros((0,), np.int32), backend=backend)
        assert o.shape == (0, 1, 1, 16)
        np.testing.assert_array_equal(np.asarray(same), pool)
    with pytest.raises(NotImplementedError, match="backend='xla'"):
        jax.grad(lambda p: jnp.sum(fused_recurrent_gated_delta_rule_slots(
            *xs, ssm_state=p, slot_ids=np.array([0, 1]), backend="pallas_interpret")[1]))(jnp.asarray(pool))


# ----------------------------------------------------------------------------------------------------------------
# GPU (device tool): K = V = 128
# ----------------------------------------------------------------------------------------------------------------
def _gpu_check(fn, dtype, *, seed, n, s, label):
    """Runs ``fn(xs, pool, ids, has) -> (o, new pool)`` (pool donated) at K = V = 128, Qwen3-Next heads (Hk 16, Hv 32)
    on a case with ids -1 and S and every third stream fresh, against the float64 loop; prints the FIGURE line
    (``label``, whether the pool was updated in place) and asserts o and the pool within the dtype's tolerance."""
    jax.config.update("jax_default_matmul_precision", "highest")
    xs, pool = _case(seed, n, 1, 16, 32, 128, 128, s, dtype=dtype)
    ids = np.random.default_rng(seed + 1).permutation(s)[:n].astype(np.int32)
    ids[3], ids[5] = -1, s
    has = np.arange(n) % 3 != 0
    o_ref, pool_ref = _expected(xs, pool, ids, has, True)
    args = [jnp.asarray(x, dtype) for x in xs[:3]] + [jnp.asarray(xs[3]), jnp.asarray(xs[4])]
    pool_dev = jnp.asarray(pool)
    ptr = pool_dev.unsafe_buffer_pointer()
    o, new_pool = fn(args, pool_dev, jnp.asarray(ids), jnp.asarray(has))
    eo, es = rel_rms(np.asarray(o, np.float64), o_ref), rel_rms(np.asarray(new_pool), pool_ref)
    print(f"FIGURE decode {label}{jnp.dtype(dtype).name} o_rel_rms={eo:.3e} pool_rel_rms={es:.3e} "
          f"in_place={new_pool.unsafe_buffer_pointer() == ptr}")
    assert eo < (1e-2 if dtype == jnp.bfloat16 else TOL) and es < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_gpu_decode_in_place(dtype):
    """The public op (backend "pallas": on Hopper the Mosaic kernel) against the float64 loop."""
    fn = jax.jit(lambda xs, pool, ids, has: fused_recurrent_gated_delta_rule_slots(
        *xs, ssm_state=pool, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True, backend="pallas"),
        donate_argnums=1)
    _gpu_check(fn, dtype, seed=7, n=48, s=64, label="")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [decode.DecodeConfig(num_warps=4), decode.DecodeConfig(fused_output=False)],
                         ids=_config_id)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_gpu_decode_configs_match_f64(config, dtype):
    """Launch variants of the Triton kernel (4 warps, the unfused output) on the GPU at K = V = 128, Qwen3-Next
    heads, against the float64 loop: ids -1 and S, fresh streams, the pool donated."""
    fn = jax.jit(lambda xs, pool, ids, has: decode.fused_recurrent_gated_delta_rule_slots_fwd(
        *xs, scale=None, ssm_state=pool, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True, config=config),
        donate_argnums=1)
    _gpu_check(fn, dtype, seed=9, n=24, s=32, label=f"{_config_id(config)} ")


