"""jax_gdn.ops (xla backend) against the float64 per-token loop and HF transformers' torch recurrence.

Small dims (K, V in 8..32), seeded random inputs, odd lengths (1, 63, 64, 65, 130), grouped value heads
(Hv / Hk = 1, 2, 3), dk != dv, varlen with per-sequence initial states and an empty sequence.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_gdn.ops as ops
from jax_gdn.ops import chunk_gated_delta_rule, chunk_gated_delta_rule_slots, recurrent_gated_delta_rule
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

FP32_TOL = 2e-4
BF16_TOL = 1e-2


def make_inputs(seed, b, t, hk, hv, dk, dv, n_state=None, dtype=jnp.float32, unit_k=True, g_range=(0.01, 0.5)):
    """Seeded inputs in the ranges of a real layer: g in -[0.01, 0.5], beta in (0.1, 0.9), unit-norm k."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    if unit_k:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = -rng.uniform(*g_range, (b, t, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, t, hv)).astype(np.float32)
    init = None
    if n_state is not None:
        init = jnp.asarray((0.5 * rng.standard_normal((n_state, hv, dk, dv))).astype(np.float32))
    xs = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g), jnp.asarray(beta, dtype))
    return xs, init


def f64(xs):
    return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in xs]


def chunk_xla(*args, **kw):
    return chunk_gated_delta_rule(*args, backend="xla", **kw)


FNS = pytest.mark.parametrize("fn", [chunk_xla, recurrent_gated_delta_rule], ids=["chunk", "recurrent"])


# --------------------------------------------------------------------------------------------------------------
# against the float64 loop
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
@FNS
def test_dense_matches_f64_loop(fn, t):
    b, hk, hv, dk, dv = 2, 2, 4, 16, 24
    xs, init = make_inputs(t, b, t, hk, hv, dk, dv, n_state=b)
    o, final = fn(*xs, initial_state=init, output_final_state=True)
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init))
    assert o.shape == (b, t, hv, dv) and o.dtype == jnp.float32
    assert final.shape == (b, hv, dk, dv) and final.dtype == jnp.float32
    assert rel_rms(o, o_ref) < FP32_TOL
    assert rel_rms(final, f_ref) < FP32_TOL


@pytest.mark.parametrize("hk,hv,dk,dv", [(3, 3, 8, 32), (2, 4, 32, 8), (1, 3, 16, 16), (2, 6, 24, 16)],
                         ids=["gva1", "gva2", "gva3", "gva3x2"])
@FNS
def test_grouped_heads_and_unequal_dims(fn, hk, hv, dk, dv):
    xs, init = make_inputs(7, 1, 70, hk, hv, dk, dv, n_state=1)
    o, final = fn(*xs, initial_state=init, output_final_state=True)
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init))
    assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(final, f_ref) < FP32_TOL


CU = np.array([0, 63, 63, 128, 129, 200], np.int32)   # lengths 63, 0 (empty), 65, 1, 71


@FNS
def test_varlen_with_initial_states_and_empty_sequence(fn):
    n = len(CU) - 1
    xs, init = make_inputs(3, 1, int(CU[-1]), 2, 4, 16, 8, n_state=n)
    o, final = fn(*xs, initial_state=init, output_final_state=True, cu_seqlens=jnp.asarray(CU))
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init), cu_seqlens=CU)
    assert final.shape == (n, 4, 16, 8)
    assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(final, f_ref) < FP32_TOL
    np.testing.assert_array_equal(final[1], init[1])   # the empty sequence's final state is its initial state


def test_varlen_equals_separate_dense_calls():
    xs, init = make_inputs(4, 1, int(CU[-1]), 1, 2, 8, 16, n_state=len(CU) - 1)
    o, final = chunk_xla(*xs, initial_state=init, output_final_state=True, cu_seqlens=jnp.asarray(CU))
    for n in (0, 2, 4):
        a, b_ = int(CU[n]), int(CU[n + 1])
        o_n, f_n = chunk_xla(*(x[:, a:b_] for x in xs), initial_state=init[n:n + 1], output_final_state=True)
        assert rel_rms(o[:, a:b_], o_n) < 1e-5 and rel_rms(final[n:n + 1], f_n) < 1e-5


def test_use_qk_l2norm_and_custom_scale():
    xs, init = make_inputs(5, 1, 65, 2, 4, 16, 16, n_state=1, unit_k=False)
    for fn in (chunk_xla, recurrent_gated_delta_rule):
        o, final = fn(*xs, initial_state=init, output_final_state=True, use_qk_l2norm=True, scale=0.3)
        o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init), use_qk_l2norm=True,
                                            scale=0.3)
        assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(final, f_ref) < FP32_TOL


@FNS
def test_bf16_inputs(fn):
    xs, init = make_inputs(6, 1, 130, 2, 4, 16, 24, n_state=1, dtype=jnp.bfloat16)
    o, final = fn(*xs, initial_state=init, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init))
    assert rel_rms(o, o_ref) < BF16_TOL and rel_rms(final, f_ref) < BF16_TOL


def test_bf16_g_is_accepted():
    xs, _ = make_inputs(6, 1, 20, 1, 1, 8, 8)
    q, k, v, g, beta = xs
    o, _ = chunk_xla(q, k, v, g.astype(jnp.bfloat16), beta)
    o_ref, _ = gated_delta_rule_f64(*f64((q, k, v, g.astype(jnp.bfloat16), beta)))
    assert rel_rms(o, o_ref) < FP32_TOL


def test_no_final_state_unless_asked():
    xs, init = make_inputs(8, 1, 5, 1, 1, 8, 8, n_state=1)
    for fn in (chunk_xla, recurrent_gated_delta_rule):
        assert fn(*xs, initial_state=init)[1] is None


# --------------------------------------------------------------------------------------------------------------
# consistency between forms and calls
# --------------------------------------------------------------------------------------------------------------
def test_recurrent_equals_chunked_varlen_and_other_chunk_size():
    xs, init = make_inputs(9, 1, int(CU[-1]), 2, 6, 8, 16, n_state=len(CU) - 1)
    cu = jnp.asarray(CU)
    o_r, f_r = recurrent_gated_delta_rule(*xs, initial_state=init, output_final_state=True, cu_seqlens=cu)
    o_c, f_c = chunk_xla(*xs, initial_state=init, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    assert rel_rms(o_c, o_r) < FP32_TOL and rel_rms(f_c, f_r) < FP32_TOL


@FNS
def test_two_call_continuation_equals_one_shot(fn):
    xs, init = make_inputs(10, 2, 130, 1, 2, 16, 8, n_state=2)
    o, final = fn(*xs, initial_state=init, output_final_state=True)
    o1, f1 = fn(*(x[:, :70] for x in xs), initial_state=init, output_final_state=True)
    o2, f2 = fn(*(x[:, 70:] for x in xs), initial_state=f1, output_final_state=True)
    assert rel_rms(jnp.concatenate([o1, o2], axis=1), o) < 1e-5 and rel_rms(f2, final) < 1e-5


# --------------------------------------------------------------------------------------------------------------
# slots
# --------------------------------------------------------------------------------------------------------------
def test_slots_permuted_and_stale():
    num_slots, hv, dk, dv = 6, 4, 16, 8
    n = len(CU) - 1
    xs, _ = make_inputs(11, 1, int(CU[-1]), 2, hv, dk, dv)
    pool = np.random.default_rng(12).standard_normal((num_slots, hv, dk, dv)).astype(np.float32)
    pool[[0, 2, 3]] = np.nan                                            # poison: stale slots and an untouched one
    pool = jnp.asarray(pool)
    slot_ids = jnp.asarray([4, 0, 5, 2, 1], jnp.int32)                 # permuted; slot 3 untouched
    has_init = jnp.asarray([True, False, True, False, True])            # slots 0 and 2 hold stale state: ignored
    o, new_pool = chunk_gated_delta_rule_slots(*xs, ssm_state=pool, slot_ids=slot_ids, has_initial_state=has_init,
                                               cu_seqlens=jnp.asarray(CU), backend="xla")
    init = np.where(np.asarray(has_init)[:, None, None, None], np.asarray(pool)[np.asarray(slot_ids)], 0.0)
    assert np.isfinite(init).all()
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=init, cu_seqlens=CU)
    assert rel_rms(o, o_ref) < FP32_TOL
    assert rel_rms(np.asarray(new_pool)[np.asarray(slot_ids)], f_ref) < FP32_TOL
    np.testing.assert_array_equal(new_pool[3], pool[3])                # untouched slot unchanged (NaN stays)
    assert np.isfinite(np.asarray(o)).all()
    np.testing.assert_array_equal(new_pool[0], np.zeros((hv, dk, dv)))  # empty fresh sequence: zeros written
    assert new_pool.dtype == jnp.float32 and new_pool.shape == pool.shape


def test_slots_dense_batch():
    xs, _ = make_inputs(13, 2, 40, 1, 2, 8, 8)
    pool = jnp.asarray(np.random.default_rng(14).standard_normal((3, 2, 8, 8)).astype(np.float32))
    o, new_pool = chunk_gated_delta_rule_slots(*xs, ssm_state=pool, slot_ids=jnp.asarray([2, 0], jnp.int32),
                                               has_initial_state=jnp.asarray([True, True]), backend="xla")
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(pool)[[2, 0]])
    assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(np.asarray(new_pool)[[2, 0]], f_ref) < FP32_TOL
    np.testing.assert_array_equal(new_pool[1], pool[1])


# --------------------------------------------------------------------------------------------------------------
# jit: every public function, no retrace for new lengths with the same T and N
# --------------------------------------------------------------------------------------------------------------
def test_public_functions_under_jit_without_retrace():
    t, n = 96, 3
    xs, init = make_inputs(15, 1, t, 1, 2, 8, 16, n_state=n)
    pool = jnp.asarray(np.random.default_rng(16).standard_normal((4, 2, 8, 16)).astype(np.float32))
    traces = {"chunk": 0, "recurrent": 0, "slots": 0}

    @jax.jit
    def chunk(xs, init, cu):
        traces["chunk"] += 1
        return chunk_gated_delta_rule(*xs, initial_state=init, output_final_state=True, cu_seqlens=cu,
                                      backend="xla")

    @jax.jit
    def recurrent(xs, init, cu):
        traces["recurrent"] += 1
        return recurrent_gated_delta_rule(*xs, initial_state=init, output_final_state=True, cu_seqlens=cu)

    @jax.jit
    def slots(xs, pool, cu, slot_ids, has_init):
        traces["slots"] += 1
        return chunk_gated_delta_rule_slots(*xs, ssm_state=pool, slot_ids=slot_ids, has_initial_state=has_init,
                                            cu_seqlens=cu, backend="xla")

    for cu in ([0, 10, 50, 96], [0, 0, 70, 96], [0, 96, 96, 96]):
        cu = np.asarray(cu, np.int32)
        ref_o, ref_f = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init), cu_seqlens=cu)
        cu = jnp.asarray(cu)
        for fn in (chunk, recurrent):
            o, f = fn(xs, init, cu)
            assert rel_rms(o, ref_o) < FP32_TOL and rel_rms(f, ref_f) < FP32_TOL
        o, new_pool = slots(xs, pool, cu, jnp.asarray([3, 1, 0], jnp.int32), jnp.asarray([True, True, True]))
        ref_o, ref_f = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(pool)[[3, 1, 0]],
                                            cu_seqlens=np.asarray(cu))
        assert rel_rms(o, ref_o) < FP32_TOL and rel_rms(np.asarray(new_pool)[[3, 1, 0]], ref_f) < FP32_TOL
    assert traces == {"chunk": 1, "recurrent": 1, "slots": 1}


# --------------------------------------------------------------------------------------------------------------
# robustness
# --------------------------------------------------------------------------------------------------------------
@FNS
def test_strong_decay_and_padding_stay_finite(fn):
    # g down to -40 per token: exp(G) underflows inside a chunk and exp(-G) would overflow if not masked;
    # packed lengths leave padding in chunks and padding chunk slots in the chunk map.
    cu = np.array([0, 5, 5, 75, 77], np.int32)
    xs, init = make_inputs(17, 1, 77, 2, 2, 8, 8, n_state=4, g_range=(0.0, 40.0))
    o, final = fn(*xs, initial_state=init, output_final_state=True, cu_seqlens=jnp.asarray(cu))
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(final)).all()
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init), cu_seqlens=cu)
    assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(final, f_ref) < FP32_TOL


# --------------------------------------------------------------------------------------------------------------
# HF transformers' torch recurrence
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_matches_hf_torch_recurrent(use_qk_l2norm):
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    xs, init = make_inputs(18, 2, 65, 2, 6, 16, 8, n_state=2, unit_k=not use_qk_l2norm)
    q, k, v, g, beta = (torch.from_numpy(np.array(x)) for x in xs)
    r = v.shape[2] // q.shape[2]
    # equal heads on the torch side: value head h reads key head h // r
    q_t, k_t = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    o_hf, f_hf = hf.torch_recurrent_gated_delta_rule(
        q_t, k_t, v, g, beta, initial_state=torch.from_numpy(np.array(init)), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm)
    o, final = chunk_xla(*xs, initial_state=init, output_final_state=True, use_qk_l2norm=use_qk_l2norm)
    assert rel_rms(o, o_hf.numpy()) < FP32_TOL and rel_rms(final, f_hf.numpy()) < FP32_TOL


# --------------------------------------------------------------------------------------------------------------
# backend dispatch
# --------------------------------------------------------------------------------------------------------------
def test_backend_resolution():
    assert ops.resolve_backend("xla") == "xla"
    assert ops.resolve_backend("pallas_interpret") == "pallas_interpret"
    expected_auto = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert ops.resolve_backend("auto") == expected_auto
    with pytest.raises(ValueError, match="backend"):
        ops.resolve_backend("cuda")
    if jax.default_backend() != "gpu":
        xs, _ = make_inputs(19, 1, 4, 1, 1, 8, 8)
        with pytest.raises(ValueError, match="needs a GPU"):
            chunk_gated_delta_rule(*xs, backend="pallas")


def test_pallas_dispatch_calls_the_kernel_api(monkeypatch):
    """The kernel entry points are called after validation and the q/k norm, with check_supported first (stubs
    returning marker arrays: the op's VJP wrapper takes arrays only)."""
    calls = []
    marks = {name: jnp.full((1,), i, jnp.float32) for i, name in enumerate(("o", "final", "pool"))}

    def check_supported(q, k, v, *, interpret):
        calls.append(("check_supported", interpret))

    def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, chunk_map,
                                   output_final_state, chunk_size=64, interpret=False):
        calls.append(("fwd", q.dtype, g.dtype, scale, chunk_map is None, interpret))
        np.testing.assert_allclose(np.linalg.norm(np.asarray(q, np.float32), axis=-1), 1.0, rtol=1e-2)
        return marks["o"], marks["final"]

    def chunk_gated_delta_rule_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state,
                                         cu_seqlens, chunk_map, chunk_size=64, interpret=False):
        calls.append(("slots_fwd", chunk_map.chunk_len.shape, interpret))
        return marks["o"], marks["pool"]

    from pallas_kernels.gated_delta_rule import api
    from pallas_kernels.gated_delta_rule.triton import chunk as pallas_triton
    no_short_mix = api.DispatchConfig(short_mix_max_mean_len=0)   # T = 10 for N = 2 is a short mix otherwise
    monkeypatch.setattr(api, "check_supported", check_supported)
    monkeypatch.setattr(pallas_triton, "chunk_gated_delta_rule_fwd", chunk_gated_delta_rule_fwd)
    monkeypatch.setattr(pallas_triton, "chunk_gated_delta_rule_slots_fwd", chunk_gated_delta_rule_slots_fwd)

    xs, _ = make_inputs(20, 1, 10, 1, 2, 8, 8, dtype=jnp.bfloat16, unit_k=False)
    o, final = chunk_gated_delta_rule(*xs, use_qk_l2norm=True, backend="pallas_interpret")
    assert (float(o[0]), float(final[0])) == (0.0, 1.0)
    pool = jnp.zeros((2, 2, 8, 8), jnp.float32)
    out = chunk_gated_delta_rule_slots(*xs, ssm_state=pool, slot_ids=jnp.asarray([1, 0], jnp.int32),
                                       has_initial_state=jnp.asarray([False, True]),
                                       cu_seqlens=jnp.asarray([0, 4, 10], jnp.int32), chunk_size=16,
                                       backend="pallas_interpret", dispatch=no_short_mix)
    assert (float(out[0][0]), float(out[1][0])) == (0.0, 2.0)
    assert calls == [("check_supported", True), ("fwd", jnp.bfloat16, jnp.float32, 8 ** -0.5, True, True),
                     ("check_supported", True), ("slots_fwd", (10 // 16 + 2,), True)]


def test_zero_tokens_keep_initial_states():
    q, v, g = jnp.zeros((1, 0, 1, 8)), jnp.zeros((1, 0, 2, 8)), jnp.zeros((1, 0, 2))
    init = jnp.asarray(np.random.default_rng(21).standard_normal((2, 2, 8, 8)).astype(np.float32))
    for fn in (chunk_xla, recurrent_gated_delta_rule):
        o, final = fn(q, q, v, g, g, initial_state=init, output_final_state=True,
                      cu_seqlens=jnp.asarray([0, 0, 0], jnp.int32))
        assert o.shape == (1, 0, 2, 8)
        np.testing.assert_array_equal(final, init)


_T_PROP, _N_PROP = 40, 4
_PROP_XS, _PROP_INIT = make_inputs(22, 1, _T_PROP, 1, 2, 8, 8, n_state=_N_PROP)
_prop_chunk = jax.jit(lambda cu: chunk_gated_delta_rule(*_PROP_XS, initial_state=_PROP_INIT, output_final_state=True,
                                                        cu_seqlens=cu, chunk_size=8, backend="xla"))


def test_random_packings_match_f64_loop():
    """Random splits of T = 40 tokens into 4 sequences (empty ones included), chunk 8, one compiled program."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=15, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.integers(0, _T_PROP), min_size=_N_PROP - 1, max_size=_N_PROP - 1))
    def check(cuts):
        cu = np.asarray([0] + sorted(cuts) + [_T_PROP], np.int32)
        o, final = _prop_chunk(jnp.asarray(cu))
        o_ref, f_ref = gated_delta_rule_f64(*f64(_PROP_XS), initial_state=np.asarray(_PROP_INIT), cu_seqlens=cu)
        assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(final, f_ref) < FP32_TOL

    check()


def test_pallas_interpret_through_the_public_slots_call():
    """End to end through the dispatch into the real kernel API (interpret mode): l2norm, packing, slots."""
    pytest.importorskip("pallas_kernels.gated_delta_rule.api")
    cu = np.array([0, 5, 5, 40], np.int32)
    xs, _ = make_inputs(23, 1, 40, 1, 2, 8, 16, unit_k=False)
    pool = np.random.default_rng(24).standard_normal((4, 2, 8, 16)).astype(np.float32)
    pool[1] = np.nan                                                    # stale slot, has_initial_state False
    slot_ids, has_init = np.array([3, 1, 0], np.int32), np.array([True, False, True])
    o, new_pool = chunk_gated_delta_rule_slots(
        *xs, ssm_state=jnp.asarray(pool), slot_ids=jnp.asarray(slot_ids), has_initial_state=jnp.asarray(has_init),
        cu_seqlens=jnp.asarray(cu), use_qk_l2norm=True, chunk_size=16, backend="pallas_interpret")
    init = np.where(has_init[:, None, None, None], pool[slot_ids], 0.0)
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=init, cu_seqlens=cu, use_qk_l2norm=True)
    assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(np.asarray(new_pool)[slot_ids], f_ref) < FP32_TOL
    np.testing.assert_array_equal(new_pool[2], pool[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, FP32_TOL), (jnp.bfloat16, BF16_TOL)], ids=["fp32", "bf16"])
def test_pallas_on_gpu_through_the_public_calls(dtype, tol):
    """backend="pallas" and "auto" on the GPU: packed, grouped heads, initial states, q/k norm, slots."""
    cu = np.array([0, 63, 63, 128, 129, 200], np.int32)
    n = len(cu) - 1
    xs, init = make_inputs(25, 1, 200, 2, 4, 32, 64, n_state=n, dtype=dtype, unit_k=False)
    o_ref, f_ref = gated_delta_rule_f64(*f64(xs), initial_state=np.asarray(init), cu_seqlens=cu, use_qk_l2norm=True)
    for backend in ("pallas", "auto"):
        o, final = chunk_gated_delta_rule(*xs, initial_state=init, output_final_state=True,
                                          cu_seqlens=jnp.asarray(cu), use_qk_l2norm=True, backend=backend)
        assert o.dtype == dtype and rel_rms(o, o_ref) < tol and rel_rms(final, f_ref) < tol
    pool = np.full((n + 1, 4, 32, 64), np.nan, np.float32)
    pool[np.arange(n)] = np.asarray(init)
    o, new_pool = jax.jit(lambda pool: chunk_gated_delta_rule_slots(
        *xs, ssm_state=pool, slot_ids=jnp.arange(n, dtype=jnp.int32), has_initial_state=jnp.ones((n,), bool),
        cu_seqlens=jnp.asarray(cu), use_qk_l2norm=True, backend="pallas"), donate_argnums=0)(jnp.asarray(pool))
    assert rel_rms(o, o_ref) < tol and rel_rms(np.asarray(new_pool)[:n], f_ref) < tol
    assert np.isnan(np.asarray(new_pool)[n]).all()                      # the spare slot is untouched
