"""The per-token varlen kernel (pallas_kernels/gated_delta_rule/recurrent_varlen.py), directly and through the public
ops that route mixes of short sequences to it, against the float64 per-token loop.

CPU (interpret mode, whose output buffers start as NaN, so a row or a final state the kernel never writes fails):
every length of (1, 2, 3, 4, 63, 64, 65, 130) packed, a mix with zero-length sequences and padding tokens past
cu_seqlens[N] (zero rows, NaN-poisoned inputs there), grouped heads (Hv = 2 Hk, 4 Hk), K != V and dims padded to
the kernel's sizes, initial states or none, final states or none, fused q/k L2 norm, bf16 inputs, slots with
permuted ids, -1 and S under jit over NaN stale and untouched slots, dense rows, NaN locality, the routing rule, the
GDN layer's varlen call, every launch variant and the Triton lowering (cross-lowered for CUDA).
GPU (`pytest -m gpu`): tiny64 at Qwen3-Next heads (K = V = 128), bf16 and fp32, the pool donated and updated in place.

Tolerances (relative RMS against float64, the oracle taking the same rounded inputs, all kernel math fp32): fp32
inputs 1e-5; bf16 inputs 2e-2 on o (o rounded to bf16), 1e-5 on states.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.ops import chunk_gated_delta_rule, chunk_gated_delta_rule_slots
from pallas_kernels.gated_delta_rule import api
from pallas_kernels.gated_delta_rule.triton import recurrent_varlen as rv
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
STATE_TOL = 1e-5


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(seed, lens, hk, hv, dk, dv, *, pad=0, dtype=jnp.float32, nan_pad=True):
    """Packed inputs [1, T, ...] with T = sum(lens) + pad (padding rows NaN-poisoned), h0 [N, Hv, K, V], cu."""
    rng = np.random.default_rng(seed)
    t = int(sum(lens)) + pad
    q = rng.standard_normal((1, t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((1, t, hk, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, t, hv, dv)).astype(np.float32)
    q, k, v = (np.array(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))
    g = np.log(rng.uniform(0.5, 0.999, (1, t, hv))).astype(np.float32)
    beta = rng.uniform(0.05, 0.99, (1, t, hv)).astype(np.float32)
    xs = [q, k, v, g, beta]
    if pad and nan_pad:
        for x in xs:
            x[:, t - pad:] = np.nan                   # padding tokens: must touch no state, output rows zero
    h0 = rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    return xs, h0, _cu(lens)


def _oracle(xs, h0, cu, **kw):
    real = int(cu[-1])
    o, final = gated_delta_rule_f64(*(x[:, :real] for x in xs), initial_state=h0, cu_seqlens=cu, **kw)
    t = xs[0].shape[1]
    return np.concatenate([o, np.zeros((1, t - real) + o.shape[2:])], axis=1), final


def _dev(xs, dtype):
    return [jnp.asarray(x, dtype) for x in xs[:3]] + [jnp.asarray(xs[3]), jnp.asarray(xs[4])]


def _direct(xs, h0, cu, dtype=jnp.float32, config=None, **kw):
    """The kernel's plain entry point, interpret mode, under jit (cu traced)."""
    fn = jax.jit(lambda xs, h0, cu: rv.recurrent_varlen_fwd(
        *xs, scale=xs[0].shape[-1] ** -0.5, initial_state=h0, cu_seqlens=cu, output_final_state=True,
        interpret=True, config=config, **kw))
    o, final = fn(_dev(xs, dtype), None if h0 is None else jnp.asarray(h0), jnp.asarray(cu))
    return np.asarray(o, np.float64), np.asarray(final)


def _names(fn, *args) -> str:
    """The pallas_call names in fn's jaxpr (which kernels a call runs)."""
    return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("length", [1, 2, 3, 4, 63, 64, 65, 130])
def test_each_length_packed(length):
    """Three sequences of one length packed end to end, 3 padding rows, Hv = 2 Hk, K != V."""
    xs, h0, cu = _inputs(length, (length,) * 3, 1, 2, 16, 32, pad=3)
    o_ref, f_ref = _oracle(xs, h0, cu)
    o, final = _direct(xs, h0, cu)
    assert rel_rms(o, o_ref) < TOL[jnp.dtype(jnp.float32)]
    assert rel_rms(final, f_ref) < STATE_TOL
    np.testing.assert_array_equal(o[0, int(cu[-1]):], 0.0)


MIX = (3, 0, 1, 130, 2, 64, 0, 4, 63, 65, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hk,hv", [(2, 4), (1, 4)], ids=["gva2", "gva4"])
def test_mix_matches_f64(hk, hv, dtype):
    """Every length, zero-length sequences (final = initial), 5 NaN padding rows (output zero), grouped heads."""
    xs, h0, cu = _inputs(7, MIX, hk, hv, 16, 32, pad=5, dtype=dtype)
    o_ref, f_ref = _oracle(xs, h0, cu)
    o, final = _direct(xs, h0, cu, dtype)
    assert rel_rms(o, o_ref) < TOL[jnp.dtype(dtype)]
    assert rel_rms(final, f_ref) < STATE_TOL
    np.testing.assert_array_equal(o[0, int(cu[-1]):], 0.0)
    for n in np.flatnonzero(np.diff(cu) == 0):
        np.testing.assert_array_equal(final[n], h0[n])


def test_no_initial_state_l2norm_odd_dims_no_final():
    """initial_state None (zeros), fused L2 norm of unnormalised q / k, K = 24 / V = 40 padded to 32 / 64 inside;
    output_final_state False returns None."""
    xs, _, cu = _inputs(3, (2, 5, 1, 0, 3), 1, 2, 24, 40, pad=2)
    xs[1] = xs[1] * 3.0
    o_ref, f_ref = _oracle(xs, np.zeros((5, 2, 24, 40)), cu, use_qk_l2norm=True)
    o, final = _direct(xs, None, cu, use_qk_l2norm=True)
    assert o.shape == o_ref.shape and final.shape == f_ref.shape
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(final, f_ref) < STATE_TOL
    o2, none = rv.recurrent_varlen_fwd(*_dev(xs, jnp.float32), scale=24 ** -0.5, initial_state=None,
                                       cu_seqlens=jnp.asarray(cu), output_final_state=False, use_qk_l2norm=True,
                                       interpret=True)
    assert none is None
    np.testing.assert_allclose(np.asarray(o2), o, rtol=0, atol=1e-6)


def test_nan_locality_and_hard_reset():
    """NaN in k at token 2 of sequence 1 poisons its tokens 2.. and final state only (per-token form: not the
    earlier tokens, not the other sequences); g = -inf (a hard reset) at token 1 of sequence 0 is exp(g) = 0."""
    lens = (4, 6, 3)
    xs, h0, cu = _inputs(11, lens, 1, 2, 16, 16)
    xs[3][0, 1] = -np.inf
    clean_o, clean_f = _oracle(xs, h0, cu)
    xs[1][0, cu[1] + 2] = np.nan
    o, final = _direct(xs, h0, cu)
    seq1 = slice(int(cu[1]), int(cu[2]))
    assert np.isnan(o[0, cu[1] + 2:cu[2]]).all() and np.isnan(final[1]).all()
    keep = np.ones(o.shape[1], bool)
    keep[seq1] = False
    keep[cu[1]:cu[1] + 2] = True                            # tokens before the NaN: finite and right
    assert rel_rms(o[0, keep], clean_o[0, keep]) < 1e-5
    assert rel_rms(final[[0, 2]], clean_f[[0, 2]]) < STATE_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_slots_public_op_routes_here(dtype):
    """chunk_gated_delta_rule_slots on a short mix (T <= short_mix_max_mean_len N) runs this kernel: permuted ids,
    -1 and S traced under jit (zeros in, write dropped, never another slot), fresh sequences over NaN stale slots,
    untouched slots (NaN or not) bit-equal, a zero-length sequence (its slot keeps its state or gets zeros)."""
    lens = (3, 1, 4, 0, 2, 1, 4)
    n, s = len(lens), 10
    xs, _, cu = _inputs(5, lens, 2, 4, 16, 32, pad=3, dtype=dtype)
    pool = np.random.default_rng(6).standard_normal((s, 4, 16, 32)).astype(np.float32)
    ids = np.array([7, -1, 2, 5, s, 3, 6], np.int32)       # -1 / S clipped would land on 0 / S - 1: untouched
    has = np.array([True, True, False, True, True, True, True])
    pool[2] = np.nan                                        # stale slot of a fresh sequence: read as zeros
    pool[0] = np.nan                                        # untouched: stays NaN
    init = np.stack([pool[i] if (h and 0 <= i < s) else np.zeros(pool.shape[1:]) for i, h in zip(ids, has)])
    o_ref, f_ref = _oracle(xs, init, cu)
    args = (_dev(xs, dtype), jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(has), jnp.asarray(cu))
    assert api.DEFAULT_DISPATCH.is_short_mix(xs[0].shape[1], n)

    def fn(xs, pool, ids, has, cu):
        return chunk_gated_delta_rule_slots(*xs, ssm_state=pool, slot_ids=ids, has_initial_state=has,
                                            cu_seqlens=cu, backend="pallas_interpret")

    text = _names(fn, *args)
    assert "gdn_recurrent_varlen" in text and "gdn_state_pass" not in text
    o, new_pool = jax.jit(fn)(*args)
    o, new_pool = np.asarray(o, np.float64), np.asarray(new_pool)
    assert o.dtype == np.float64 and rel_rms(o, o_ref) < TOL[jnp.dtype(dtype)]
    np.testing.assert_array_equal(o[0, int(cu[-1]):], 0.0)
    written = [i for i in ids if 0 <= i < s]
    assert rel_rms(new_pool[written], f_ref[[list(ids).index(i) for i in written]]) < STATE_TOL
    assert np.isnan(new_pool[0]).all()
    for untouched in sorted(set(range(s)) - set(written) - {0}):
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_plain_public_op_dense_rows_and_routing_rule():
    """The plain op routes dense short rows (B T <= short_mix_max_mean_len B) and short packed mixes here, and a
    batch over the bound (or short_mix_max_mean_len = 0) to the chunked kernels; both match float64."""
    rule = api.DEFAULT_DISPATCH
    assert rule.is_short_mix(8 * 5, 5) == (rule.short_mix_max_mean_len >= 8)
    assert not rule.is_short_mix(0, 3) and not rule.is_short_mix(4, 0)
    assert not rule.is_short_mix(rule.short_mix_max_mean_len * 5 + 1, 5)
    with pytest.raises(ValueError, match="short_mix_max_mean_len"):
        api.DispatchConfig(short_mix_max_mean_len=-1)
    rng = np.random.default_rng(9)
    b, t, hk, hv, d = 3, 2, 1, 2, 16
    xs = [rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hv, d)),
          np.log(rng.uniform(0.5, 0.99, (b, t, hv))), rng.uniform(0.1, 0.9, (b, t, hv))]
    xs = [x.astype(np.float32) for x in xs]
    h0 = rng.standard_normal((b, hv, d, d)).astype(np.float32)
    o_ref, f_ref = gated_delta_rule_f64(*xs, initial_state=h0, use_qk_l2norm=True)

    def fn(xs, h0):
        return chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                                      backend="pallas_interpret")

    args = ([jnp.asarray(x) for x in xs], jnp.asarray(h0))
    assert "gdn_recurrent_varlen" in _names(fn, *args)
    o, final = fn(*args)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(final, f_ref) < STATE_TOL
    off = api.DispatchConfig(short_mix_max_mean_len=0)
    text = _names(lambda xs, h0: chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True,
                                                        use_qk_l2norm=True, backend="pallas_interpret",
                                                        dispatch=off), *args)
    assert "gdn_recurrent_varlen" not in text and "gdn_state_pass" in text


def test_gdn_layer_varlen_runs_it():
    """The GDN layer's packed call (gdn_full_varlen -> chunk_gated_delta_rule_slots) takes the kernel for a short
    mix, and agrees with the layer's XLA backend."""
    from jax_gdn.layers.gdn import gdn_full_varlen
    from jax_gdn.state import BatchMeta, GdnSlots
    lens = (2, 1, 3, 0)
    xs, _, cu = _inputs(13, lens, 1, 2, 16, 16)
    q, k, v, g, beta = (jnp.asarray(x[0]) for x in xs)
    pool = jnp.asarray(np.random.default_rng(14).standard_normal((5, 2, 16, 16)).astype(np.float32))
    slots = GdnSlots(conv_state=jnp.zeros((5, 3, 48)), ssm_state=pool)
    meta = BatchMeta(cu_seqlens=jnp.asarray(cu), slot_ids=jnp.array([3, 0, 4, 1], jnp.int32),
                     has_initial_state=jnp.array([True, False, True, True]), positions=jnp.zeros((4,), jnp.int32))
    run = lambda backend: gdn_full_varlen(q, k, v, g, beta, slots, meta, backend=backend)
    assert "gdn_recurrent_varlen" in _names(lambda: run("pallas_interpret")[:2])
    (o, s1, ok), (o_x, s_x, _) = run("pallas_interpret"), run("xla")
    assert ok and rel_rms(o, o_x) < 1e-5 and rel_rms(s1.ssm_state, s_x.ssm_state) < 1e-5


@pytest.mark.parametrize("config", [rv.RecurrentVarlenConfig(block_v=16, longest_first=True),
                                    rv.RecurrentVarlenConfig(v_fastest=False, num_warps=4, num_stages=2),
                                    rv.RecurrentVarlenConfig(block_v=128, prefetch=False)],
                         ids=["bv16-longest", "n-fastest", "bv128-no-prefetch"])
def test_launch_variants(config):
    """Each launch variant (two V blocks of 16, longest first; stream-fastest grid; a block clamped to V, each token
    loaded in its own step) gives the float64 result."""
    xs, h0, cu = _inputs(17, (1, 65, 0, 3, 2), 2, 4, 16, 32, pad=2)
    o_ref, f_ref = _oracle(xs, h0, cu)
    o, final = _direct(xs, h0, cu, config=config)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(final, f_ref) < STATE_TOL
    np.testing.assert_array_equal(o[0, int(cu[-1]):], 0.0)


def test_errors():
    xs, h0, cu = _inputs(19, (2, 1), 1, 1, 16, 48)               # V = 48 runs padded to 64
    args = _dev(xs, jnp.float32)
    with pytest.raises(ValueError, match=r"block_v \(24\) must divide V = 64"):
        rv.recurrent_varlen_fwd(*args, scale=0.25, initial_state=jnp.asarray(h0), cu_seqlens=jnp.asarray(cu),
                                output_final_state=True, interpret=True, config=rv.RecurrentVarlenConfig(block_v=24))
    with pytest.raises(ValueError, match="final must be"):
        rv.recurrent_varlen(*(a[0] for a in args), cu_seqlens=jnp.asarray(cu), pool=jnp.zeros((2, 1, 16, 64)),
                            slot_ids=jnp.arange(2), has_initial_state=jnp.ones(2), scale=0.25, use_qk_l2norm=False,
                            final="both", interpret=True)
    with pytest.raises(NotImplementedError, match="backend='xla'"):     # the kernel itself has no autodiff rule
        jax.grad(lambda h: jnp.sum(rv.recurrent_varlen_fwd(*args, scale=0.25, initial_state=h,
                                                           cu_seqlens=jnp.asarray(cu), output_final_state=True,
                                                           interpret=True)[1]))(jnp.asarray(h0))
    # through the op (this short mix runs this kernel) jax.grad is the XLA form's
    grads = [jax.grad(lambda h, be=be: jnp.sum(chunk_gated_delta_rule(
        *args, initial_state=h, output_final_state=True, cu_seqlens=jnp.asarray(cu), backend=be)[1] ** 2))(
        jnp.asarray(h0)) for be in ("pallas_interpret", "xla")]
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("final", ["slot", "seq"])
def test_lowers_to_triton(final):
    """The kernel lowers to Triton IR (cross-lowered for CUDA on any machine; interpret mode never runs the Triton
    lowering): the dynamic trip counts, the masked state load, the padding-row loop, each grid order, the token loop
    with and without the prefetch."""
    t, hk, hv, d = 20, 2, 4, 32
    q = jnp.zeros((1, t, hk, d), jnp.bfloat16)
    v = jnp.zeros((1, t, hv, d), jnp.bfloat16)
    g = jnp.zeros((1, t, hv))
    cu = jnp.array([0, 3, 4, 4, 9], jnp.int32)
    pool = jnp.zeros((5, hv, d, d))
    ids, has = jnp.arange(4, dtype=jnp.int32), jnp.ones((4,), bool)
    for cfg in (rv.RecurrentVarlenConfig(), rv.RecurrentVarlenConfig(v_fastest=False, longest_first=True,
                                                                      num_stages=2, prefetch=False)):
        if final == "slot":
            f = lambda q, v, g, pool, cu, cfg=cfg: rv.recurrent_varlen_slots_fwd(
                q, q, v, g, g, scale=0.1, ssm_state=pool, slot_ids=ids, has_initial_state=has, cu_seqlens=cu,
                use_qk_l2norm=True, config=cfg)
        else:
            f = lambda q, v, g, pool, cu, cfg=cfg: rv.recurrent_varlen_fwd(
                q, q, v, g, g, scale=0.1, initial_state=pool[:4], cu_seqlens=cu, output_final_state=True,
                config=cfg)
        text = jax.jit(f).trace(q, v, g, pool, cu).lower(lowering_platforms=("cuda",)).as_text()
        assert "gdn_recurrent_varlen" in text


# ----------------------------------------------------------------------------------------------------------------
# GPU (device tool): tiny64 at Qwen3-Next heads
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_gpu_tiny64_slots_in_place(dtype):
    from benchmarks.cases import TINY64_LENS
    jax.config.update("jax_default_matmul_precision", "highest")
    lens = TINY64_LENS[:48] + (0, 130, 65)                   # one long and one empty sequence in the mix
    n, s = len(lens), 64
    xs, _, cu = _inputs(21, lens, 16, 32, 128, 128, pad=7, dtype=dtype)
    pool = np.random.default_rng(22).standard_normal((s, 32, 128, 128)).astype(np.float32) * 0.1
    ids = 1 + np.random.default_rng(23).permutation(s - 2)[:n].astype(np.int32)   # slots 0, S - 1 untouched
    ids[3], ids[5] = -1, s
    has = np.arange(n) % 4 != 1
    init = np.stack([pool[i] if (h and 0 <= i < s) else np.zeros(pool.shape[1:]) for i, h in zip(ids, has)])
    o_ref, f_ref = _oracle(xs, init, cu)
    fn = jax.jit(lambda xs, pool, ids, has, cu: chunk_gated_delta_rule_slots(
        *xs, ssm_state=pool, slot_ids=ids, has_initial_state=has, cu_seqlens=cu, backend="pallas"),
        donate_argnums=1)
    pool_dev = jnp.asarray(pool)
    ptr = pool_dev.unsafe_buffer_pointer()
    o, new_pool = fn(_dev(xs, dtype), pool_dev, jnp.asarray(ids), jnp.asarray(has), jnp.asarray(cu))
    o, in_place, new_pool = np.asarray(o, np.float64), new_pool.unsafe_buffer_pointer() == ptr, np.asarray(new_pool)
    written = [i for i in ids if 0 <= i < s]
    eo = rel_rms(o, o_ref)
    es = rel_rms(new_pool[written], f_ref[[list(ids).index(i) for i in written]])
    print(f"FIGURE recurrent_varlen {jnp.dtype(dtype).name} o_rel_rms={eo:.3e} state_rel_rms={es:.3e} "
          f"in_place={in_place}")
    assert eo < TOL[jnp.dtype(dtype)] and es < STATE_TOL
    np.testing.assert_array_equal(o[0, int(cu[-1]):], 0.0)
    for untouched in sorted(set(range(s)) - set(written)):
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])
