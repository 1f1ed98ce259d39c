"""The Mosaic GPU decode kernel (pallas_kernels/gated_delta_rule/mosaic_gpu/decode.py) against the float64 per-token loop.

CPU: the kernel body itself in Mosaic GPU interpret mode (plain loads in place of the register layouts) at
K = V = 128 and 64, grouped heads, both value blocks, ids -1 and S, a fresh stream over a NaN-stale slot, NaN
untouched slots left bitwise as they were, the raw gates, copy_only, and the route through backend
"mosaic_gpu_interpret" and the public op; its jnp twin (``decode_reference``) at small odd dims; the lowering for CUDA (Mosaic
GPU's layout and transfer checks run at lowering) with the pool aliased; the refusals. GPU (`pytest -m gpu`): the
compiled kernel against the XLA step at Qwen3-Next heads, in place, and the public op running it.
Tolerances (relative RMS vs float64, the reference fed the same rounded inputs, all math fp32): 1e-5 on o and the
state; bf16 o 1e-2 (its own rounding); the GPU run against the fp32 XLA step: fp32 1e-5, bf16 q/k/v 2e-2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta_rule.triton import decode
from pallas_kernels.gated_delta_rule.mosaic_gpu import decode as dm
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

TOL = 1e-5


def _case(seed, n, hk, hv, dk, dv, num_slots, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, 1, hk, dk)).astype(np.float32)
    k = rng.standard_normal((n, 1, hk, dk)).astype(np.float32)
    v = rng.standard_normal((n, 1, hv, dv)).astype(np.float32)
    q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))
    g = -rng.uniform(0.01, 0.5, (n, 1, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (n, 1, hv)).astype(np.float32)
    pool = rng.standard_normal((num_slots, hv, dk, dv)).astype(np.float32)
    return [q, k, v, g, beta], pool


def _expected(xs, pool, ids, has, l2):
    s = pool.shape[0]
    init = np.zeros((len(ids),) + pool.shape[1:])
    for i, (sid, h) in enumerate(zip(ids, has)):
        if h and 0 <= sid < s:
            init[i] = pool[sid]
    o, final = gated_delta_rule_f64(*xs, initial_state=init, use_qk_l2norm=l2)
    new_pool = np.where(np.isnan(pool), np.nan, pool).astype(np.float64)
    for i, sid in enumerate(ids):
        if 0 <= sid < s:
            new_pool[sid] = final[i]
    return o, new_pool


def _poisoned(seed, n, hk, hv, dk, dv, s, dtype=jnp.float32):
    """Inputs with ids [.., -1, .., S, ..] permuted, stream 2 fresh over a NaN slot, one NaN untouched slot."""
    xs, pool = _case(seed, n, hk, hv, dk, dv, s, dtype)
    ids = np.random.default_rng(seed + 1).permutation(s)[:n].astype(np.int32)
    ids[1], ids[3] = -1, s
    has = np.ones(n, bool)
    has[2] = False
    pool[ids[2]] = np.nan                                          # stale: read as zeros
    untouched = np.setdiff1d(np.arange(s), ids)
    pool[untouched[0]] = np.nan                                    # untouched: stays NaN
    return xs, pool, ids, has, untouched


def _raw_gates(xs, hk, hv):
    """(ba, RawGates) that make the case's g and beta inside the kernel: Qwen3-Next's [b | a] per key head [N, 1, Hk,
    2 Hv / Hk] with A_log = dt_bias = 0, so g = -softplus(a) and beta = sigmoid(b)."""
    g, beta = xs[3], xs[4]
    n, r = g.shape[0], hv // hk
    a = np.log(np.expm1(-g.astype(np.float64))).astype(np.float32).reshape(n, 1, hk, r)   # softplus(a) = -g
    b = np.log(beta / (1 - beta)).astype(np.float32).reshape(n, 1, hk, r)
    ba = jnp.asarray(np.concatenate([b, a], axis=-1))
    return ba, decode.RawGates(jnp.zeros((hv,)), jnp.zeros((hv,)), a_offset=r, b_offset=0)


def _check(o, new_pool, xs, pool, ids, has, untouched, l2, o_tol=TOL):
    o_ref, pool_ref = _expected(xs, pool, ids, has, l2)
    o, new_pool = np.asarray(o, np.float64), np.asarray(new_pool)
    written = ids[(ids >= 0) & (ids < pool.shape[0])]
    assert np.isfinite(o).all()
    assert rel_rms(o, o_ref) < o_tol
    assert rel_rms(new_pool[written], pool_ref[written]) < TOL
    for u in untouched:                                            # bitwise, NaN included
        np.testing.assert_array_equal(new_pool[u], pool[u])


# ---- the kernel body in Mosaic GPU interpret mode -------------------------------------------------------------
@pytest.mark.parametrize("block_v,hk,hv,l2,dtype", [
    (64, 1, 2, True, jnp.float32),      # 20 tiles, one CTA each
    (128, 2, 4, False, jnp.float32),    # one value block per head, GVA 2
    (64, 1, 3, True, jnp.bfloat16),     # GVA 3, bf16 o
], ids=["bv64", "bv128-gva2", "bv64-gva3-bf16"])
def test_kernel_interpret_matches_f64(block_v, hk, hv, l2, dtype):
    """One CTA per tile, global memory straight to registers: the kernel body in interpret mode against float64,
    with the poisoned ids, the fresh stream over a NaN slot and the untouched NaN slot."""
    n, s, d = 5, 7, 128
    xs, pool, ids, has, untouched = _poisoned(block_v + hv, n, hk, hv, d, d, s, dtype)
    cfg = dm.MosaicDecodeConfig(block_v=block_v)
    fn = jax.jit(lambda xs, pool: dm.fused_recurrent_gated_delta_rule_slots_fwd(
        *xs, scale=None, ssm_state=pool, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
        use_qk_l2norm=l2, interpret=True, config=cfg))
    o, new_pool = fn([jnp.asarray(x, dtype) for x in xs[:3]] + [jnp.asarray(x) for x in xs[3:]], jnp.asarray(pool))
    assert o.shape == (n, 1, hv, d) and o.dtype == dtype
    _check(o, new_pool, xs, pool, ids, has, untouched, l2, o_tol=1e-2 if dtype == jnp.bfloat16 else TOL)


def test_shipped_route_is_the_direct_kernel():
    """What ships: the dispatch table's decode rows for "auto" (Mosaic on a Hopper GPU where it takes the call,
    Triton elsewhere) and the Mosaic kernel's DEFAULT_CONFIG (64 value columns a tile, the op itself)."""
    from pallas_kernels.gated_delta_rule import api
    q, v = jnp.zeros((3, 1, 2, 128), jnp.bfloat16), jnp.zeros((3, 1, 4, 128), jnp.bfloat16)
    pick = lambda hopper: api.TABLE.resolve("auto", api.GdnCase.of("decode", q, q, v, platform="gpu",  # noqa: E731
                                                                    hopper=hopper)).name
    assert pick(True) == "mosaic_gpu.decode" and pick(False) == "triton.decode"
    assert dm.DEFAULT_CONFIG == dm.MosaicDecodeConfig(block_v=64, copy_only=False)
    q = jnp.zeros((3, 1, 2, 128), jnp.bfloat16)
    assert dm.fallback_reason(q, q, jnp.zeros((3, 1, 4, 128), jnp.bfloat16), interpret=True) is None


def test_kernel_interpret_head_dim_64():
    """K = V = 64 (the layout's other head dim: 8 rows a thread)."""
    n, s, d = 4, 5, 64
    xs, pool, ids, has, untouched = _poisoned(5, n, 1, 2, d, d, s)
    o, new_pool = jax.jit(lambda xs, p: dm.fused_recurrent_gated_delta_rule_slots_fwd(
        *xs, scale=None, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
        use_qk_l2norm=True, interpret=True))([jnp.asarray(x) for x in xs], jnp.asarray(pool))
    _check(o, new_pool, xs, pool, ids, has, untouched, True)


def test_copy_only_and_raw_gates_interpret():
    """copy_only stores every written tile as loaded (a fresh stream's as zeros, ids outside
    [0, S) nothing) with o zero; the raw gates (Qwen3-Next's [b | a]) made inside match float64."""
    n, s, hk, hv, d = 4, 6, 1, 2, 128
    xs, pool, ids, has, untouched = _poisoned(13, n, hk, hv, d, d, s)
    run = lambda cfg, *a, **kw: jax.jit(lambda xs, p: dm.fused_recurrent_gated_delta_rule_slots_fwd(
        *xs, scale=None, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
        interpret=True, config=cfg, **kw))(*a)
    o, new_pool = run(dm.MosaicDecodeConfig(copy_only=True),
                      [jnp.asarray(x) for x in xs], jnp.asarray(pool))
    expect = pool.copy()
    expect[ids[2]] = 0.0                                           # the fresh stream's slot: zeros
    np.testing.assert_array_equal(np.asarray(new_pool), expect)
    assert not np.asarray(o).any()
    ba, gates = _raw_gates(xs, hk, hv)
    o, new_pool = run(dm.MosaicDecodeConfig(),
                      [jnp.asarray(x) for x in xs[:3]] + [ba, ba], jnp.asarray(pool), use_qk_l2norm=True,
                      raw_gates=gates)
    _check(o, new_pool, xs, pool, ids, has, untouched, True)


def test_kernel_interpret_raw_gates_and_bf16():
    """The gates made inside from raw a, b (Qwen3-Next's [b | a] per key head), bf16 q/k/v (o in bf16)."""
    n, s, hk, hv, d = 4, 6, 1, 2, 128
    xs, pool, ids, has, untouched = _poisoned(11, n, hk, hv, d, d, s, jnp.bfloat16)
    ba, gates = _raw_gates(xs, hk, hv)
    args = [jnp.asarray(x, jnp.bfloat16) for x in xs[:3]]
    fn = jax.jit(lambda q, k, v, ba, pool, gates: dm.fused_recurrent_gated_delta_rule_slots_fwd(
        q, k, v, ba, ba, scale=None, ssm_state=pool, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
        use_qk_l2norm=True, interpret=True, raw_gates=gates))
    o, new_pool = fn(*args, ba, jnp.asarray(pool), gates)
    assert o.dtype == jnp.bfloat16
    _check(o, new_pool, xs, pool, ids, has, untouched, True, o_tol=1e-2)


def test_backend_switch_routes_the_op(monkeypatch):
    """backend "mosaic_gpu_interpret": the public op runs the Mosaic kernel where it takes the call (K = V = 128,
    T = 1) and the Triton kernel otherwise (T = 2), both right; "pallas_interpret" runs Triton in interpret mode;
    a misspelt backend is refused by name."""
    from jax_gdn.ops import fused_recurrent_gated_delta_rule_slots
    calls = []
    real = dm.fused_recurrent_slots_mosaic
    monkeypatch.setattr(dm, "fused_recurrent_slots_mosaic", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    n, s, d = 3, 4, 128
    xs, pool, ids, has, untouched = _poisoned(21, n + 1, 1, 2, d, d, s + 1)
    o, new_pool = fused_recurrent_gated_delta_rule_slots(
        *[jnp.asarray(x) for x in xs], ssm_state=jnp.asarray(pool), slot_ids=ids, has_initial_state=has,
        use_qk_l2norm=True, backend="mosaic_gpu_interpret")
    assert calls == [1]
    _check(o, new_pool, xs, pool, ids, has, untouched, True)
    with pytest.raises(NotImplementedError, match="backend='xla'"):
        jax.grad(lambda p: jnp.sum(fused_recurrent_gated_delta_rule_slots(
            *[jnp.asarray(x) for x in xs], ssm_state=p, slot_ids=ids, has_initial_state=has,
            backend="mosaic_gpu_interpret")[1]))(jnp.asarray(pool))
    x2, pool2 = _case(22, 2, 1, 1, 16, 16, 3)                       # K = 16: the Triton kernel
    x2 = [np.concatenate([x, x], axis=1) for x in x2]               # T = 2
    fused_recurrent_gated_delta_rule_slots(*[jnp.asarray(x) for x in x2], ssm_state=jnp.asarray(pool2),
                                           slot_ids=np.array([0, 2]), backend="mosaic_gpu_interpret")
    assert calls == [1]
    o2, new_pool2 = fused_recurrent_gated_delta_rule_slots(
        *[jnp.asarray(x) for x in xs], ssm_state=jnp.asarray(pool), slot_ids=ids, has_initial_state=has,
        use_qk_l2norm=True, backend="pallas_interpret")
    assert calls == [1]
    _check(o2, new_pool2, xs, pool, ids, has, untouched, True)
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_recurrent_gated_delta_rule_slots(*[jnp.asarray(x) for x in xs], ssm_state=jnp.asarray(pool),
                                               slot_ids=ids, has_initial_state=has, backend="mosiac_gpu")


# ---- the jnp twin of the tile algebra ----------------------------------------------------------------------------
@pytest.mark.parametrize("n,hk,hv,dk,dv,block_v,l2,dtype", [
    (1, 1, 1, 16, 16, 64, True, jnp.float32),
    (5, 2, 6, 24, 40, 8, False, jnp.float32),       # odd dims, 5 value blocks, GVA 3
    (7, 1, 2, 63, 65, 13, True, jnp.bfloat16),
], ids=["N1", "N5-gva3-K24-V40", "N7-K63-V65-bf16"])
def test_reference_twin_matches_f64(n, hk, hv, dk, dv, block_v, l2, dtype):
    s = n + 4
    xs, pool, ids, has, untouched = _poisoned(n + dk, n, hk, hv, dk, dv, s, dtype) if n >= 4 else (
        *_case(n, n, hk, hv, dk, dv, s, dtype), np.arange(n, dtype=np.int32), np.ones(n, bool), np.arange(n, s))
    if dv % block_v:
        block_v = dv                                                 # the twin's tiles must divide V
    args = [jnp.asarray(x, dtype) for x in xs[:3]] + [jnp.asarray(xs[3]), jnp.asarray(xs[4])]
    o, new_pool = jax.jit(lambda a, p: dm.decode_reference(
        *a, pool=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has), scale=dk ** -0.5,
        use_qk_l2norm=l2, block_v=block_v))(args, jnp.asarray(pool))
    _check(o, new_pool, xs, pool, ids, has, untouched, l2, o_tol=TOL if dtype == jnp.float32 else 1e-2)


# ---- lowering for CUDA on the CPU (Mosaic GPU's layout and transfer checks) ------------------------------------
@pytest.mark.parametrize("cfg,dtype,raw", [
    (dm.MosaicDecodeConfig(), jnp.bfloat16, False),
    (dm.MosaicDecodeConfig(), jnp.bfloat16, True),
    (dm.MosaicDecodeConfig(block_v=128), jnp.float32, False),
    (dm.MosaicDecodeConfig(block_v=128), jnp.bfloat16, True),
    (dm.MosaicDecodeConfig(copy_only=True), jnp.float32, False),
], ids=["bf16", "bf16-raw", "bv128-fp32", "bv128-bf16-raw", "copy-only"])
def test_kernel_lowers_for_cuda(cfg, dtype, raw):
    n, hk, hv, d, s = 6, 2, 4, 128, 9
    q = jax.ShapeDtypeStruct((n, 1, hk, d), dtype)
    v = jax.ShapeDtypeStruct((n, 1, hv, d), dtype)
    g = jax.ShapeDtypeStruct((n, 1, hk, 2 * (hv // hk)) if raw else (n, 1, hv), jnp.float32)
    pool = jax.ShapeDtypeStruct((s, hv, d, d), jnp.float32)
    gates = decode.RawGates(jnp.zeros((hv,)), jnp.zeros((hv,)), a_offset=2) if raw else None
    ids, has = jnp.arange(n, dtype=jnp.int32), jnp.ones((n,), bool)

    def f(q, v, g, pool):
        return dm.fused_recurrent_slots_mosaic(q, q, v, g, g, pool=pool, slot_ids=ids, has_initial_state=has,
                                               scale=0.1, use_qk_l2norm=True, raw_gates=gates, config=cfg)
    text = jax.jit(f, donate_argnums=3).trace(q, v, g, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert "tf.aliasing_output = 1" in text                         # the donated pool is the second output


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_fallback_reasons_and_config_errors():
    q = jnp.zeros((2, 1, 1, 128), jnp.bfloat16)
    v = jnp.zeros((2, 1, 2, 128), jnp.bfloat16)
    assert dm.fallback_reason(q, q, v, interpret=True) is None
    assert "sm_90" in dm.fallback_reason(q, q, v)                    # this CPU
    assert "one token" in dm.fallback_reason(jnp.zeros((2, 3, 1, 128)), q, jnp.zeros((2, 3, 2, 128)),
                                             interpret=True)
    assert "K, V in" in dm.fallback_reason(q[..., :32], q[..., :32], v, interpret=True)
    for bad, match in [(dict(block_v=32), "block_v"), (dict(copy_only="regs"), "copy_only")]:
        with pytest.raises(ValueError, match=f"MosaicDecodeConfig.{match}"):
            dm.MosaicDecodeConfig(**bad)
    with pytest.raises(ValueError, match="decode_mosaic: .*one token"):
        dm.fused_recurrent_gated_delta_rule_slots_fwd(
            jnp.zeros((2, 2, 1, 128)), jnp.zeros((2, 2, 1, 128)), jnp.zeros((2, 2, 2, 128)), jnp.zeros((2, 2, 2)),
            jnp.zeros((2, 2, 2)), scale=None, ssm_state=jnp.zeros((2, 2, 128, 128)), slot_ids=jnp.arange(2),
            has_initial_state=jnp.ones(2, bool), interpret=True)


# ---- GPU (device tool): the compiled kernel -----------------------------------------------------------------------
def _gpu_case(dtype, n=48, s=64, hk=16, hv=32, d=128):
    xs, pool, ids, has, untouched = _poisoned(7, n, hk, hv, d, d, s, dtype)
    return xs, pool, ids, has, untouched


def _gpu_kernel_check(dtype, cfg, d=128):
    """The compiled kernel against the fp32 XLA step (matmul precision highest) and float64, in place: permuted
    ids with -1 and S, a fresh stream over a NaN slot, untouched slots bitwise unchanged, o finite everywhere."""
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax_gdn.ops import fused_recurrent_gated_delta_rule_slots
    xs, pool, ids, has, untouched = _gpu_case(dtype, d=d)
    args = [jnp.asarray(x, dtype) for x in xs[:3]] + [jnp.asarray(xs[3]), jnp.asarray(xs[4])]
    fn = jax.jit(lambda a, p: dm.fused_recurrent_gated_delta_rule_slots_fwd(
        *a, scale=None, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has),
        use_qk_l2norm=True, config=cfg), donate_argnums=1)
    pool_dev = jnp.asarray(pool)
    ptr = pool_dev.unsafe_buffer_pointer()
    o, new_pool = fn(args, pool_dev)
    in_place = new_pool.unsafe_buffer_pointer() == ptr
    xla_o, xla_pool = jax.jit(lambda a, p: fused_recurrent_gated_delta_rule_slots(
        *[x.astype(jnp.float32) for x in a], ssm_state=p, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
        backend="xla"))(args, jnp.asarray(pool))
    written = ids[(ids >= 0) & (ids < pool.shape[0])]
    eo = rel_rms(np.asarray(o, np.float64), np.asarray(xla_o, np.float64))
    es = rel_rms(np.asarray(new_pool)[written], np.asarray(xla_pool)[written])
    print(f"FIGURE decode_mosaic {jnp.dtype(dtype).name} {cfg} o_rel={eo:.3e} pool_rel={es:.3e} in_place={in_place}")
    assert eo < (2e-2 if dtype == jnp.bfloat16 else TOL) and es < TOL
    _check(o, new_pool, xs, pool, ids, has, untouched, True, o_tol=2e-2 if dtype == jnp.bfloat16 else TOL)


@pytest.mark.gpu
def test_gpu_kernel_fp32_matches_xla_step():
    _gpu_kernel_check(jnp.float32, dm.MosaicDecodeConfig())


@pytest.mark.gpu
def test_gpu_layer_decode_through_switch():
    """The layer's fused decode step (raw gates inside) with backend "auto" (the Mosaic kernel on the H200) matches
    the Triton step (backend "pallas")."""
    from benchmarks.configs import qwen3_next_80b_config
    from jax_gdn.layers import gdn
    from jax_gdn.state import GdnSlots
    dims = qwen3_next_80b_config(4).gdn_dims
    n, s = 16, 20
    params = gdn.init_params(dims, jax.random.PRNGKey(0), jnp.bfloat16, randomize_norms=True)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.permutation(s)[:n].astype(np.int32))
    slots = GdnSlots(conv_state=jnp.asarray(rng.standard_normal((s, dims.conv_dim, dims.conv_kernel_size - 1)),
                                            jnp.bfloat16),
                     ssm_state=jnp.asarray(0.3 * rng.standard_normal((s, dims.num_v_heads, dims.head_k_dim,
                                                                          dims.head_v_dim)), jnp.float32))
    hidden = jnp.asarray(rng.standard_normal((n, dims.hidden_size)), jnp.bfloat16)
    step = lambda backend: jax.jit(lambda p, x, sl: gdn.gdn_layer_decode(  # noqa: E731
        p, dims, x, sl, ids, backend=backend, step="fused"))(params, hidden, slots)
    ref_o, ref_s = step("pallas")
    o, sl = step("auto")
    eo = rel_rms(np.asarray(o, np.float64), np.asarray(ref_o, np.float64))
    es = rel_rms(np.asarray(sl.ssm_state), np.asarray(ref_s.ssm_state))
    print(f"FIGURE decode_mosaic layer o_rel={eo:.3e} ssm_rel={es:.3e}")
    assert eo < 2e-2 and es < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dm.MosaicDecodeConfig(), dm.MosaicDecodeConfig(block_v=128)], ids=["bv64", "bv128"])
def test_gpu_kernel_bf16_matches_xla_step(cfg):
    _gpu_kernel_check(jnp.bfloat16, cfg)


@pytest.mark.gpu
def test_gpu_kernel_head_dim_64():
    """K = V = 64 (8 rows a thread), compiled: against the XLA step and float64."""
    _gpu_kernel_check(jnp.bfloat16, dm.MosaicDecodeConfig(), d=64)


@pytest.mark.gpu
def test_gpu_public_op_runs_the_direct_kernel():
    """The public op (backend "auto") on the H200 runs the Mosaic kernel (its custom call in the compiled program)
    and matches the XLA step: fp32 o and state 1e-5, in place."""
    from jax_gdn.ops import fused_recurrent_gated_delta_rule_slots
    jax.config.update("jax_default_matmul_precision", "highest")
    xs, pool, ids, has, untouched = _gpu_case(jnp.float32)
    args = [jnp.asarray(x) for x in xs]
    run = lambda backend: jax.jit(lambda a, p: fused_recurrent_gated_delta_rule_slots(
        *a, ssm_state=p, slot_ids=jnp.asarray(ids), has_initial_state=jnp.asarray(has), use_qk_l2norm=True,
        backend=backend), donate_argnums=1)
    fn = run("auto")
    text = fn.lower(args, jnp.asarray(pool)).compile().as_text()
    assert "mosaic_gpu" in text
    o, new_pool = fn(args, jnp.asarray(pool))
    _check(o, new_pool, xs, pool, ids, has, untouched, True)


def test_layer_fused_decode_through_switch_interpret(monkeypatch):
    """The layer's fused decode step (conv kernel, then the decode kernel with raw gates from in_proj_ba's
    [b | a] layout) with backend "mosaic_gpu_interpret" (Mosaic GPU interpret mode) equals the Triton kernel's step
    (Triton interpret mode) at K = V = 128, GVA 2, one padding stream (id S) and a fresh stream."""
    from jax_gdn.config import GdnDims
    from jax_gdn.layers import gdn
    from jax_gdn.state import GdnSlots
    dims = GdnDims(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128)
    n, s = 3, 5
    params = gdn.init_params(dims, jax.random.PRNGKey(1), jnp.float32, randomize_norms=True)
    rng = np.random.default_rng(4)
    ids = jnp.array([3, s, 0], jnp.int32)
    has = jnp.array([True, True, False])
    slots = GdnSlots(conv_state=jnp.asarray(rng.standard_normal((s, dims.conv_dim, dims.conv_kernel_size - 1)),
                                            jnp.float32),
                     ssm_state=jnp.asarray(0.3 * rng.standard_normal((s, 2, 128, 128)), jnp.float32))
    hidden = jnp.asarray(rng.standard_normal((n, 32)), jnp.float32)
    calls = []
    real = dm.fused_recurrent_slots_mosaic
    monkeypatch.setattr(dm, "fused_recurrent_slots_mosaic", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def step(backend):
        return jax.jit(lambda p, x, sl, ids: gdn.gdn_layer_decode(          # traced ids: S is a padding stream
            p, dims, x, sl, ids, has, backend=backend, step="fused"))(params, hidden, slots, ids)
    ref_o, ref_s = step("pallas_interpret")
    assert calls == []
    o, sl = step("mosaic_gpu_interpret")
    assert calls == [1]
    assert rel_rms(np.asarray(o), np.asarray(ref_o)) < TOL
    assert rel_rms(np.asarray(sl.ssm_state), np.asarray(ref_s.ssm_state)) < TOL
    np.testing.assert_array_equal(np.asarray(sl.ssm_state)[[1, 2, 4]], np.asarray(slots.ssm_state)[[1, 2, 4]])


def _model_decode_outputs(dtype, monkeypatch, kernel_backend):
    """A 4-layer hybrid (3 GDN + 1 attention: the scanned period) with K = V = 128 GDN heads, prefilled then decoded
    one token with the model's backend ``kernel_backend``: (decode logits, ssm pool, Mosaic kernel calls)."""
    from jax_gdn.config import HybridConfig
    from jax_gdn.model import HybridModel
    cfg = HybridConfig(model_type="qwen3_next", vocab_size=37, hidden_size=16, num_hidden_layers=4,
                       layer_types=("linear_attention",) * 3 + ("full_attention",), intermediate_size=16,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5,
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
                       linear_value_head_dim=128)
    calls = []
    real = dm.fused_recurrent_slots_mosaic
    monkeypatch.setattr(dm, "fused_recurrent_slots_mosaic", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    m = HybridModel.random(cfg, 0, dtype=dtype, backend=kernel_backend)
    cache = m.init_cache(max_seqs=3, max_tokens=64, page_size=8)
    ids, cu, slots = np.arange(11, dtype=np.int32) % 37, np.array([0, 4, 11], np.int32), np.array([1, 0], np.int32)
    _, cache = m.prefill(cache, ids, cu, slots)
    logits, cache = m.decode(cache, ids[:2], slots)
    return np.asarray(logits, np.float64), np.asarray(cache.gdn.ssm_state, np.float64), len(calls)


def test_model_decode_through_switch_interpret(monkeypatch):
    """``model.decode`` (the layers scanned, the GDN pools sliced per layer) with backend "mosaic_gpu_interpret"
    (Mosaic GPU interpret mode) gives the Triton kernel's logits and states (backend "pallas_interpret")."""
    ref_logits, ref_ssm, n0 = _model_decode_outputs(jnp.float32, monkeypatch, "pallas_interpret")
    logits, ssm, n1 = _model_decode_outputs(jnp.float32, monkeypatch, "mosaic_gpu_interpret")
    assert n0 == 0 and n1 > 0
    assert np.isfinite(logits).all()
    assert rel_rms(logits, ref_logits) < TOL and rel_rms(ssm, ref_ssm) < TOL


@pytest.mark.gpu
def test_gpu_model_decode_through_switch(monkeypatch):
    """The same on the H200, compiled, bf16: backend "auto" (Mosaic where compiled) against "pallas" (Triton)."""
    ref_logits, ref_ssm, n0 = _model_decode_outputs(jnp.bfloat16, monkeypatch, "pallas")
    logits, ssm, n1 = _model_decode_outputs(jnp.bfloat16, monkeypatch, "auto")
    print(f"FIGURE decode_mosaic model logits_rel={rel_rms(logits, ref_logits):.3e} "
          f"ssm_rel={rel_rms(ssm, ref_ssm):.3e} mosaic_calls={n1}")
    assert n0 == 0 and n1 > 0
    assert np.isfinite(logits).all()
    assert rel_rms(logits, ref_logits) < 2e-2 and rel_rms(ssm, ref_ssm) < 1e-3
