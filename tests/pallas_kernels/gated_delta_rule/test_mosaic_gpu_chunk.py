"""The Mosaic GPU backend of the gated delta rule (pallas_kernels/gated_delta_rule/mosaic_gpu/, backend
"mosaic_gpu").

CPU: the algebra the kernels implement, as their jnp twins (``fused_state_pass_reference`` behind Triton's stage 1a
in interpret mode or behind ``kkt_fwd_reference``, the gate-free T0 with the decay applied in the pass; the
sequence split's state maps and start states), against the float64 per-token oracle at fp32 (tolerance 2e-4
relative RMS: fp32 dots everywhere), odd lengths, grouped heads, a NaN initial state; the split policy; the
argument checks; the api's routing and fallbacks (a stand-in Hopper). GPU (`pytest -m gpu`, Hopper): the kernels
against the float64 oracle at bf16 / fp16 (1e-2 relative RMS, the harness's half-precision bound), the Mosaic
stage 1a against its twin, the split, and the public op beside Pallas Triton.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.cases import Case
from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mg
from tests.gdn_harness import make_inputs, oracle, rel_rms, tol


def _run(case, dtype=jnp.float32, impl="reference", seed=0, with_h0=True, poison_row=None, stage1a="triton",
         pieces=1, g_scale=1.0, **fwd_kw):
    """``g_scale`` < 1 weakens the decay (the harness's g ~ log U(0.5, 0.999) forgets a start state within ~64
    tokens, so a split's state maps M would be ~0 and go untested: at 0.01 they matter)."""
    q, k, v, g, beta, h0, _ = make_inputs(case, seed, dtype, with_h0=with_h0)
    g = (g * g_scale).astype(np.float32)
    if poison_row is not None:
        h0 = h0.copy()
        h0[poison_row] = np.nan                      # a stale NaN state in one row must stay in that row
    o, s = mg.chunk_gated_delta_rule_fwd(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                         jnp.asarray(g), jnp.asarray(beta, dtype),
                                         None if h0 is None else jnp.asarray(h0), impl=impl, stage1a=stage1a,
                                         pieces=pieces, **fwd_kw)
    return (q, k, v, g, beta, h0), np.asarray(o.astype(jnp.float32)), np.asarray(s)


def test_defaults():
    assert mg.DEFAULT_CONFIG.stage1a in mg.STAGE1A
    # the measured choices: states in [B, Hv, K, V] inside the pass, exp2, the split where its time model says
    assert mg.DEFAULT_CONFIG == mg.MosaicConfig(stage1a="mosaic", pieces=0, exp2=True, state_kv=True,
                                                split=mg.SplitConfig(), wide="auto", solve=False)
    # the split's first piece from h0, the Triton scan in tf32 above P = 2 (at P = 2 XLA's stack, no product)
    sp = mg.DEFAULT_CONFIG.split
    assert (sp.first, sp.scan, sp.serial_max_pieces, sp.precision, sp.paired) == ("h0", "auto", 2, "default", "auto")
    assert (sp.max_pieces, sp.min_piece_chunks, sp.max_split_ctas) == (8, 8, 64)
    assert (sp.map_step, sp.fixed, sp.per_piece, sp.paired_step) == (0.6, 1.0, 5.8, 1.86)
    with pytest.raises(ValueError, match="stage1a"):
        mg.MosaicConfig(stage1a="cuda")
    with pytest.raises(ValueError, match="pieces"):
        mg.MosaicConfig(pieces=3.0)
    with pytest.raises(ValueError, match="MosaicConfig.wide"):
        mg.MosaicConfig(wide="yes")
    with pytest.raises(ValueError, match="MosaicConfig.solve"):
        mg.MosaicConfig(solve=1)


def test_wide_policy():
    """The wide pass where the narrow one runs more than one wave of CTAs (B4-T4096: 256, B16-T1024: 1024 and the
    packed mixes on the H200's 132 SMs), never at V = 64 and never where the narrow pass fits one wave (B2: 128)."""
    assert mg.use_wide(4, 32, 128, sms=132) and mg.use_wide(16, 32, 128, sms=132)
    assert not mg.use_wide(2, 32, 128, sms=132) and not mg.use_wide(1, 32, 128, sms=132)
    assert not mg.use_wide(16, 32, 64, sms=132)
    assert mg.use_wide(3, 32, 128, sms=132)            # 192 narrow CTAs


@pytest.mark.parametrize("key_dim", [64, 128])
@pytest.mark.parametrize("form", ["narrow", "narrow_map", "wide", "wide_solve"])
def test_every_fused_pass_layout_fits_the_sm(form, key_dim):
    """The fused pass's SMEM in every form (in place or not, with or without a state tile, either state layout),
    counted as Mosaic GPU counts it at lowering, within what the H200 gives a CTA. The count is the device's: the
    wide layout that once also took the narrow form's published tiles counts 250000 bytes, the figure the H200
    refused it with."""
    from pallas_kernels.gated_delta_rule.mosaic_gpu import common
    plgpu = common.plgpu()
    wide, solve, write_o = form.startswith("wide"), form == "wide_solve", form != "narrow_map"
    for in_place, has_state, state_kv, dtype in [(a, b, c, d) for a in (False, True) for b in (False, True)
                                                 for c in (False, True) for d in (jnp.bfloat16, jnp.float16)]:
        if in_place and not write_o:
            continue
        stages, copies, scratch = mg.fused_pass_scratch(key_dim, dtype, dtype, write_o=write_o,
                                                        has_state=has_state, state_kv=state_kv,
                                                        in_place=in_place, wide=wide, solve=solve)
        assert 2 <= stages <= 4 and copies == int(write_o) + 1 + (2 if wide else 1) + (0 if solve else 1) + (
            5 if solve else 4)
        assert common.smem_bytes(scratch) <= common.SMEM_LIMIT, (form, in_place, has_state, state_kv)
    if form == "wide" and key_dim == 128:
        _, _, scratch = mg.fused_pass_scratch(128, jnp.bfloat16, jnp.bfloat16, write_o=True, has_state=True,
                                              state_kv=True, in_place=False, wide=True, solve=False)
        scratch.update(s_pub=common.smem((2, 64, 128), jnp.bfloat16), vn_pub=common.smem((2, 64, 64), jnp.bfloat16),
                       s_ready=plgpu.Barrier(num_barriers=2), s_free=plgpu.Barrier(num_barriers=2))
        assert common.smem_bytes(scratch) == 250000


def test_wide_pass_checks_its_arguments():
    q = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
    v64 = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    g = jnp.zeros((1, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="wide needs V = 128"):
        mg.fused_state_pass(q, q, v64, jnp.zeros((1, 2, 64, 64), jnp.bfloat16), g, g, None, scale=1.0,
                            out_final=True, head_major=True, wide=True)
    v = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="solve"):
        mg.fused_state_pass(q, q, v, None, g, g, None, scale=1.0, out_final=True, head_major=True, wide=False,
                            solve=True)


@pytest.mark.parametrize("t,pieces", [(1, 1), (63, 1), (130, 1), (65, 4), (130, 2), (300, 0)])
def test_reference_mosaic_stage1a_and_split_match_f64(t, pieces):
    """Gate-free T0 (kkt_fwd's twin) with the decay applied in the pass; the sequence split (P pieces, the start
    states from the state-map pass of augmented values [0 | v] from [I | 0]); odd lengths padded to C * P."""
    case = Case(f"cpu-B2-T{t}-Hk1-Hv2-K16-V8", 2, t, 1, 2, 16, 8)
    (q, k, v, g, beta, h0), o, s = _run(case, stage1a="mosaic", pieces=pieces, g_scale=0.01)
    ro, rs = oracle(q, k, v, g, beta, h0)
    assert o.shape == ro.shape and s.shape == rs.shape
    assert rel_rms(o, ro) < 2e-4, rel_rms(o, ro)
    assert rel_rms(s, rs) < 2e-4, rel_rms(s, rs)


def test_reference_exp2_gates_match_f64():
    """MosaicConfig.exp2: log2 gates from the glue (G log2 e), exp2 in the pass, through the split."""
    case = Case("cpu-B1-T130-Hk1-Hv2-K16-V8", 1, 130, 1, 2, 16, 8)
    q, k, v, g, beta, h0, _ = make_inputs(case, 4, jnp.float32)
    g = (g * 0.01).astype(np.float32)
    o, s = mg.chunk_gated_delta_rule_fwd(*(jnp.asarray(x) for x in (q, k, v, g, beta, h0)), impl="reference",
                                         stage1a="mosaic", pieces=2, exp2=True)
    ro, rs = oracle(q, k, v, g, beta, h0)
    assert rel_rms(np.asarray(o), ro) < 2e-4 and rel_rms(np.asarray(s), rs) < 2e-4


def test_reference_split_behind_triton_stage1a_grouped_no_h0():
    case = Case("cpu-B1-T200-Hk2-Hv4-K8-V16", 1, 200, 2, 4, 8, 16)
    (q, k, v, g, beta, _), o, s = _run(case, with_h0=False, pieces=2, g_scale=0.01)
    ro, rs = oracle(q, k, v, g, beta, None)
    assert rel_rms(o, ro) < 2e-4 and rel_rms(s, rs) < 2e-4, (rel_rms(o, ro), rel_rms(s, rs))


@pytest.mark.parametrize("part", ["E", "M"])
def test_split_start_states_are_used(monkeypatch, request, part):
    """A wrong start state for the later pieces must show in o (the check above can fail): the start states
    scaled ("E"), or the maps' M part dropped (start = E alone: right only where the decay forgets the start).
    The forward is jitted: its cache is cleared before and after, so the patch is traced and leaves no trace
    behind (a program of the same shapes cached by an earlier test in the worker had hidden that "M" patched a
    name the split module no longer called)."""
    case = Case("cpu-B1-T256-Hk1-Hv1-K8-V8", 1, 256, 1, 1, 8, 8)
    mg.chunk_gated_delta_rule_fwd.clear_cache()
    request.addfinalizer(mg.chunk_gated_delta_rule_fwd.clear_cache)
    if part == "E":
        orig = ms.start_states
        monkeypatch.setattr(ms, "start_states", lambda *a, **kw: orig(*a, **kw).at[1:].multiply(0.5))
    else:
        from pallas_kernels.gated_delta_rule.mosaic_gpu import split
        orig = split.fused_state_pass_reference           # the map pass's twin, as the split module calls it

        def no_m(q, k, v, t, gcum, beta_c, h0t, **kw):
            if kw.get("write_o", True):
                return orig(q, k, v, t, gcum, beta_c, h0t, **kw)
            return orig(q, k, v, t, gcum, beta_c, jnp.zeros_like(h0t), **kw)
        monkeypatch.setattr(split, "fused_state_pass_reference", no_m)
    (q, k, v, g, beta, h0), o, s = _run(case, stage1a="mosaic", pieces=4, g_scale=0.01)
    ro, rs = oracle(q, k, v, g, beta, h0)
    assert rel_rms(o[:, :64], ro[:, :64]) < 1e-3 < rel_rms(o[:, 64:], ro[:, 64:])


def test_kkt_reference_is_the_gate_free_inverse():
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((1, 128, 1, 16)) / 4, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 0.99, (1, 2, 128)), jnp.float32)
    t0 = np.asarray(mg.kkt_fwd_reference(k, beta, heads=2), np.float64).reshape(1, 2, 2, 64, 64)
    kk = np.asarray(k, np.float64)[0, :, 0].reshape(2, 64, 16)
    for h in range(2):
        for c in range(2):
            a0 = np.tril(kk[c] @ kk[c].T, -1) * np.asarray(beta)[0, h, c * 64:(c + 1) * 64, None]
            np.testing.assert_allclose(t0[0, h, c] @ (np.eye(64) + a0), np.eye(64), atol=1e-5)


def test_split_policy():
    """The H200's fastest P on each dense bench row (``python -m benchmarks gdn``): no split where the rows
    fill the 132 SMs (B4-T4096, B16-T1024: 256+ CTAs), P = 2 on the 64-CTA rows, P = 4 at Hk2-Hv8."""
    for b, t, hv in [(4, 4096, 32), (16, 1024, 32), (2, 8192, 32)]:
        assert mg.split_pieces(b, hv, 128, 128, t, sms=132) == 1, (b, t, hv)
    for b, t, hv in [(1, 8192, 32), (1, 32768, 32), (1, 131072, 32)]:
        assert mg.split_pieces(b, hv, 128, 128, t, sms=132) == 2, (b, t, hv)
    assert mg.split_pieces(1, 8, 128, 128, 8192, sms=132) == 4        # P = 4 beat P = 8 in every round
    assert mg.split_pieces(1, 8, 128, 128, 8192, sms=132, has_h0=False) == 4
    assert mg.split_pieces(1, 8, 128, 128, 256, sms=132) == 1        # pieces of >= 8 chunks only
    assert mg.split_pieces(1, 40, 128, 128, 8192, sms=132) == 1      # 80 CTAs > max_split_ctas
    assert mg.DEFAULT_CONFIG.pieces == 0                             # the policy decides


def test_routing_and_fallbacks(monkeypatch):
    """The dispatch table's Mosaic rows: fallback_reason's limits; an explicit "mosaic_gpu" runs Mosaic where it
    takes the call (dense, packed and slot calls alike) and Pallas Triton with a warning naming the reason
    elsewhere; "auto" picks it where it takes the call, Triton otherwise, never over "xla"'s refusal of Pallas."""
    from pallas_kernels.gated_delta_rule import api
    bf = jnp.bfloat16
    q, v = jax.ShapeDtypeStruct((1, 64, 2, 128), bf), jax.ShapeDtypeStruct((1, 64, 4, 128), bf)
    assert "sm_90" in mg.fallback_reason(q, q, v)                      # this CPU is no Hopper
    with pytest.raises(ValueError, match="needs a GPU"):
        api.resolve_backend("mosaic_gpu")
    monkeypatch.setattr(mg, "is_hopper", lambda: True)
    assert mg.fallback_reason(q, q, v) is None
    q32 = jax.ShapeDtypeStruct((1, 64, 2, 128), jnp.float32)
    q100 = jax.ShapeDtypeStruct((1, 64, 2, 100), bf)
    assert "chunk_size" in mg.fallback_reason(q, q, v, chunk_size=32)
    assert "16-bit" in mg.fallback_reason(q32, q32, v) and "head dims" in mg.fallback_reason(q100, q100, v)
    assert "empty" in mg.fallback_reason(jax.ShapeDtypeStruct((0, 64, 2, 128), bf), q, v)

    def pick(backend, form, q, k, v, chunk_size=64):
        case = api.GdnCase.of(form, q, k, v, num_seqs=1, chunk_size=chunk_size, platform="gpu", hopper=True)
        return api.TABLE.resolve(backend, case).name
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert pick("mosaic_gpu", "varlen", q, q, v, chunk_size=32) == "triton.chunk"
        assert pick("mosaic_gpu", "dense", q, q, v) == "mosaic_gpu.chunk"
    assert len(rec) == 1 and "chunk_size" in str(rec[0].message)
    assert pick("mosaic_gpu", "varlen", q, q, v) == "mosaic_gpu.varlen"
    assert pick("mosaic_gpu", "slots", q, q, v) == "mosaic_gpu.varlen"
    assert pick("pallas", "dense", q, q, v) == "triton.chunk"
    for form, want in (("dense", "mosaic_gpu.chunk"), ("varlen", "mosaic_gpu.varlen"), ("slots", "mosaic_gpu.varlen")):
        assert pick("auto", form, q, q, v) == want
    assert pick("auto", "dense", q32, q32, v) == "triton.chunk"
    assert pick("xla", "dense", q, q, v) == "xla"


@pytest.mark.parametrize("t", [1, 63, 65, 130])
def test_reference_algebra_matches_f64(t):
    """Odd lengths (padded inside to a multiple of 64 with zero tokens), Hv = 2 Hk, K != V."""
    case = Case(f"cpu-B2-T{t}-Hk1-Hv2-K16-V8", 2, t, 1, 2, 16, 8)
    (q, k, v, g, beta, h0), o, s = _run(case)
    ro, rs = oracle(q, k, v, g, beta, h0)
    assert o.shape == ro.shape and s.shape == rs.shape
    assert rel_rms(o, ro) < 2e-4, rel_rms(o, ro)
    assert rel_rms(s, rs) < 2e-4, rel_rms(s, rs)


def test_reference_grouped_heads_no_initial_state():
    case = Case("cpu-B1-T64-Hk2-Hv6-K8-V16", 1, 64, 2, 6, 8, 16)
    (q, k, v, g, beta, _), o, s = _run(case, with_h0=False)
    ro, rs = oracle(q, k, v, g, beta, None)
    assert rel_rms(o, ro) < 2e-4 and rel_rms(s, rs) < 2e-4, (rel_rms(o, ro), rel_rms(s, rs))


def test_reference_nan_state_stays_in_its_row():
    case = Case("cpu-B2-T65-Hk1-Hv2-K16-V8", 2, 65, 1, 2, 16, 8)       # same shapes as above: no new compile
    (q, k, v, g, beta, h0), o, s = _run(case, poison_row=1)
    assert np.isnan(o[1]).any()                                         # the poisoned row is poisoned...
    ro, rs = oracle(q[:1], k[:1], v[:1], g[:1], beta[:1], h0[:1])
    assert np.isfinite(o[0]).all() and rel_rms(o[:1], ro) < 2e-4       # ...and row 0 is exact
    assert rel_rms(s[:1], rs) < 2e-4


def test_check_supported_names_the_argument():
    f32, bf = jnp.float32, jnp.bfloat16
    q = jnp.zeros((1, 64, 1, 64), bf)
    v = jnp.zeros((1, 64, 2, 64), bf)
    g = jnp.zeros((1, 64, 2), f32)
    mg.check_supported(q, q, v, g, g)                                   # fine
    with pytest.raises(ValueError, match="dtype"):
        mg.check_supported(q.astype(f32), q.astype(f32), v.astype(f32), g, g)
    with pytest.raises(ValueError, match="head dims"):
        mg.check_supported(jnp.zeros((1, 64, 1, 100), bf), jnp.zeros((1, 64, 1, 100), bf), v, g, g)
    with pytest.raises(ValueError, match="beta must"):
        mg.check_supported(q, q, v, g, g[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        mg.check_supported(q, q, v, g, g, jnp.zeros((1, 2, 64, 32), f32))
    with pytest.raises(ValueError, match="multiple of Hk"):
        mg.check_supported(jnp.zeros((1, 64, 2, 64), bf), jnp.zeros((1, 64, 2, 64), bf),
                           jnp.zeros((1, 64, 3, 64), bf), g, g)
    with pytest.raises(ValueError, match="impl"):
        mg.chunk_gated_delta_rule_fwd(q, q, v, g, g, impl="triton")
    with pytest.raises(ValueError, match="stage1a"):
        mg.chunk_gated_delta_rule_fwd(q, q, v, g, g, stage1a="xla")
    with pytest.raises(ValueError, match="pieces"):
        mg.chunk_gated_delta_rule_fwd(q, q, v, g, g, pieces=16)


# ---- GPU (Hopper): the kernel itself ----
def _hopper():
    d = jax.devices()[0]
    return d.platform == "gpu" and getattr(d, "compute_capability", None) == "9.0"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
def test_gpu_kernel_matches_f64(t, dtype):
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    case = Case(f"B2-T{t}-Hk2-Hv4-K64-V64", 2, t, 2, 4, 64, 64)
    (q, k, v, g, beta, h0), o, s = _run(case, dtype, impl="mosaic")
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, dtype).astype(jnp.float32)), h0)
    assert rel_rms(o, ro) < tol(dtype), rel_rms(o, ro)
    assert rel_rms(s, rs) < tol(dtype), rel_rms(s, rs)


@pytest.mark.gpu
@pytest.mark.parametrize("solve", [False, True])
@pytest.mark.parametrize("t,kdim,with_h0", [(1, 128, True), (63, 64, True), (64, 128, False), (65, 128, True),
                                            (130, 64, False), (130, 128, True)])
def test_gpu_wide_pass_matches_f64(t, kdim, with_h0, solve):
    """The wide fused pass (one CTA per (row, value head), two state warpgroups; ``solve``: T0 formed inside it)
    at bf16 against the float64 oracle (1e-2): odd lengths, grouped heads (Hk 1, Hv 3), K = 64 and 128, with and
    without an initial state, a NaN initial state in one row that stays in that row."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    case = Case(f"B2-T{t}-Hk1-Hv3-K{kdim}-V128", 2, t, 1, 3, kdim, 128)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic", stage1a="mosaic", with_h0=with_h0,
                                        poison_row=1 if with_h0 else None, exp2=True, state_kv=True, wide=True,
                                        solve=solve)
    beta = np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32))
    rows = slice(0, 1) if with_h0 else slice(0, 2)
    ro, rs = oracle(q[rows], k[rows], v[rows], g[rows], beta[rows], None if h0 is None else h0[rows])
    assert np.isfinite(o[rows]).all() and np.isfinite(s[rows]).all()
    assert rel_rms(o[rows], ro) < 1e-2 and rel_rms(s[rows], rs) < 1e-2, (rel_rms(o[rows], ro), rel_rms(s[rows], rs))


@pytest.mark.gpu
def test_gpu_kernel_k128_grouped_and_nan_row():
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    case = Case("B2-T130-Hk1-Hv3-K128-V128", 2, 130, 1, 3, 128, 128)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic", poison_row=1)
    beta = np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32))
    ro, rs = oracle(q[:1], k[:1], v[:1], g[:1], beta[:1], h0[:1])
    assert np.isfinite(o[0]).all()
    assert rel_rms(o[:1], ro) < 1e-2 and rel_rms(s[:1], rs) < 1e-2, (rel_rms(o[:1], ro), rel_rms(s[:1], rs))


@pytest.mark.gpu
def test_gpu_kernel_beside_pallas_triton():
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    from jax_gdn import ops
    case = Case("B1-T1024-Hk2-Hv4-K128-V128", 1, 1024, 2, 4, 128, 128)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic")
    bf = jnp.bfloat16
    po, ps = ops.chunk_gated_delta_rule(jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
                                        jnp.asarray(beta, bf), initial_state=jnp.asarray(h0),
                                        output_final_state=True, backend="pallas")
    assert rel_rms(o, np.asarray(po.astype(jnp.float32))) < 1e-2
    assert rel_rms(s, np.asarray(ps)) < 1e-2


@pytest.mark.gpu
def test_gpu_mosaic_kkt_matches_its_twin():
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 256, 2, 128)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    kb = jnp.asarray(k, jnp.bfloat16)
    beta = jnp.asarray(rng.uniform(0.05, 0.99, (2, 4, 256)), jnp.float32)
    got = np.asarray(jax.jit(lambda a, b: mg.kkt_fwd(a, b, heads=4))(kb, beta).astype(jnp.float32))
    ref = np.asarray(mg.kkt_fwd_reference(kb.astype(jnp.float32), beta, heads=4).astype(jnp.float32))
    assert np.isfinite(got).all()
    assert np.all(np.triu(got.reshape(2, 4, 4, 64, 64), 1) == 0)
    assert rel_rms(got, ref) < 1e-2, rel_rms(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("t,pieces", [(1, 1), (63, 1), (65, 1), (130, 1), (64, 2), (130, 2)])
def test_gpu_mosaic_stage1a_matches_f64(t, pieces):
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    case = Case(f"B2-T{t}-Hk2-Hv4-K64-V64", 2, t, 2, 4, 64, 64)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic", stage1a="mosaic", pieces=pieces,
                                        g_scale=0.01 if pieces > 1 else 1.0)
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32)), h0)
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))


@pytest.mark.gpu
@pytest.mark.parametrize("stage1a", ["triton", "mosaic"])
def test_gpu_split_k128_grouped(stage1a):
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    case = Case("B1-T1000-Hk1-Hv2-K128-V128", 1, 1000, 1, 2, 128, 128)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic", stage1a=stage1a, pieces=4,
                                        g_scale=0.01)
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32)), h0)
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))


@pytest.mark.gpu
def test_gpu_public_op_mosaic_backend():
    """backend='mosaic_gpu' through jax_gdn.ops (l2 norm, no initial state, no final state) beside 'pallas', and
    a varlen call it does not take (chunk_size 32) falls back to Triton with a warning naming the reason."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    from jax_gdn import ops
    case = Case("B2-T333-Hk2-Hv4-K128-V128", 2, 333, 2, 4, 128, 128)
    q, k, v, g, beta, _, _ = make_inputs(case, 7, jnp.bfloat16, with_h0=False)
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf) * 3, jnp.asarray(k, bf) * 2, jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf))
    om, sm = ops.chunk_gated_delta_rule(*args, use_qk_l2norm=True, backend="mosaic_gpu")
    op, _ = ops.chunk_gated_delta_rule(*args, use_qk_l2norm=True, backend="pallas")
    assert sm is None and om.dtype == bf
    assert rel_rms(np.asarray(om.astype(jnp.float32)), np.asarray(op.astype(jnp.float32))) < 1e-2
    cu = jnp.asarray([0, 100, 333], jnp.int32)
    with pytest.warns(UserWarning, match="chunk_size"):
        ops.chunk_gated_delta_rule(*(x[:1] for x in args), cu_seqlens=cu, chunk_size=32, backend="mosaic_gpu")


def test_registry_entry(monkeypatch):
    from pallas_kernels import registry
    case = dict(platform="gpu", dtype="bfloat16", head_k_dim=128, head_v_dim=128, num_k_heads=16, num_v_heads=32)
    assert "sm_90" in registry.supports("gated_delta_rule", "mosaic_gpu", **case)     # no Hopper here
    monkeypatch.setattr(mg, "is_hopper", lambda: True)
    assert registry.supports("gated_delta_rule", "mosaic_gpu", **case) is None
    assert "float32" in registry.supports("gated_delta_rule", "mosaic_gpu", **dict(case, dtype="float32"))
    assert "head dims" in registry.supports("gated_delta_rule", "mosaic_gpu", **dict(case, head_v_dim=96))


# ---- the sequence split's start states (gated_delta_rule/mosaic_gpu/split.py) --------------------------------------
from pallas_kernels.gated_delta_rule.mosaic_gpu import split as ms  # noqa: E402


def _scan_f64(maps_t, h0t):
    """Start states by the definition, float64: S_0 = h0 (zeros if None), S_{p+1}^T = S_p^T M_p^T + E_p^T."""
    m = np.asarray(maps_t, np.float64)
    b, r, hv, rows, kdim = m.shape
    s = np.zeros((b, hv, rows - kdim, kdim)) if h0t is None else np.asarray(h0t, np.float64)
    out = [s]
    for p in range(r):
        s = np.einsum("bhvk,bhkj->bhvj", s, m[:, p, :, :kdim]) + m[:, p, :, kdim:]
        out.append(s)
    return np.stack(out, axis=1)


@pytest.mark.parametrize("pieces", [2, 3, 4, 8])
@pytest.mark.parametrize("with_h0", [True, False])
def test_split_piece_scans_match_f64(pieces, with_h0):
    """Every scan (the Triton one in interpret mode) against the definition; without an initial state M_0 is not
    read (garbage there changes nothing), with one a wrong M_0 must show."""
    rng = np.random.default_rng(pieces)
    b, hv, kdim, vdim = 2, 3, 8, 16
    maps = rng.standard_normal((b, pieces - 1, hv, kdim + vdim, kdim)).astype(np.float32) * 0.3
    h0t = rng.standard_normal((b, hv, vdim, kdim)).astype(np.float32) if with_h0 else None
    want = _scan_f64(maps, h0t)
    garbage = maps.copy()
    garbage[:, 0, :, :kdim] = 7.0
    for method in ms.SCANS:
        got = np.asarray(ms.piece_scan(jnp.asarray(maps), None if h0t is None else jnp.asarray(h0t), key_dim=kdim,
                                       method=method, precision="highest", interpret=True))
        assert got.shape == want.shape and rel_rms(got, want) < 1e-5, (method, rel_rms(got, want))
        other = np.asarray(ms.piece_scan(jnp.asarray(garbage), None if h0t is None else jnp.asarray(h0t),
                                         key_dim=kdim, method=method, interpret=True))
        if with_h0:
            assert rel_rms(other[:, 1:], want[:, 1:]) > 1e-2, method
        else:
            assert rel_rms(other, want) < 1e-5, method
    with pytest.raises(ValueError, match="method"):
        ms.piece_scan(jnp.asarray(maps), None, key_dim=kdim, method="tree")
    with pytest.raises(ValueError, match="precision"):
        ms.piece_scan(jnp.asarray(maps), None, key_dim=kdim, precision="fp64")
    with pytest.raises(ValueError, match="key_dim|K = "):
        ms.piece_scan(jnp.asarray(maps), None, key_dim=kdim + 1)


def _split_operands(case, pieces, *, seed=0, with_h0=True, g_scale=0.01):
    q, k, v, g, beta, h0, _ = make_inputs(case, seed, jnp.float32, with_h0=with_h0)
    g = (g * g_scale).astype(np.float32)
    ops_ = mg.prepare_head_major(*(jnp.asarray(x) for x in (q, k, v, g, beta)),
                                  None if h0 is None else jnp.asarray(h0), kernel=False, pieces=pieces)
    return (q, k, v, g, beta, h0), ops_


@pytest.mark.parametrize("t,pieces,with_h0", [(130, 2, True), (63, 4, False), (300, 8, True), (1, 2, False)])
def test_split_start_states_match_f64(t, pieces, with_h0):
    """The map twin + each scan give the true state at every piece start (float64 oracle on the first tokens of
    the row up to that start), weak decay (g x 0.01: a start state survives its piece), grouped heads, K != V,
    odd T padded to C P (K = 32: the delta rule's own contraction leaves M ~ 0.1-1 over a piece); the first
    piece's M is zeros without an initial state and the rest is the same."""
    case = Case(f"cpu-B2-T{t}-Hk2-Hv4-K32-V16", 2, t, 2, 4, 32, 16)
    (q, k, v, g, beta, h0), ops_ = _split_operands(case, pieces, with_h0=with_h0)
    lp = ops_[1].shape[1] // pieces
    for scan in ms.SCANS:
        starts = np.asarray(ms.start_states(ops_, pieces, kernel=False, head_major=True,
                                            config=mg.SplitConfig(scan=scan)))
        starts = np.swapaxes(starts.reshape(2, pieces, 4, 16, 32), -1, -2)           # [B, P, Hv, K, V]
        for p in range(pieces):
            n = min(p * lp, t)
            if n == 0:
                want = np.zeros_like(starts[:, 0]) if h0 is None else h0
            else:
                want = oracle(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], h0)[1]
            assert rel_rms(starts[:, p], want) < 2e-4, (scan, p, rel_rms(starts[:, p], want))
    maps = np.asarray(ms.state_map_pass_reference(*ops_[1:6], pieces=pieces, need_first=False))
    full = np.asarray(ms.state_map_pass_reference(*ops_[1:6], pieces=pieces, need_first=True))
    maps, full = (x.reshape(2, pieces - 1, 4, 48, 32) for x in (maps, full))
    assert np.all(maps[:, 0, :, :32] == 0) and np.abs(full[:, 0, :, :32]).max() > 0.1
    np.testing.assert_array_equal(maps[:, :, :, 32:], full[:, :, :, 32:])
    np.testing.assert_array_equal(maps[:, 1:], full[:, 1:])


def test_split_paired_policy():
    """Pairs where they save a wave at the measured ~1.86x step (P = 8 at Hk2-Hv8: 224 CTAs), not where one wave
    holds every block (P = 4: 96); never with an odd count of 64-blocks (K = 64); paired True / False force it."""
    auto, on, off = mg.SplitConfig(paired="auto"), mg.SplitConfig(paired=True), mg.SplitConfig(paired=False)
    assert ms.use_pairs(224, 128, 128, sms=132, config=auto) and not ms.use_pairs(96, 128, 128, sms=132, config=auto)
    assert not ms.use_pairs(224, 64, 128, sms=132, config=on)
    assert ms.use_pairs(96, 128, 128, config=on) and not ms.use_pairs(224, 128, 128, config=off)


def test_split_map_pass_argument_checks():
    k = jnp.zeros((1, 256, 1, 16), jnp.float32)
    v = jnp.zeros((1, 256, 2, 8), jnp.float32)
    t, g = jnp.zeros((1, 2, 256, 64), jnp.float32), jnp.zeros((1, 2, 256), jnp.float32)
    with pytest.raises(ValueError, match="pieces"):
        ms.state_map_pass_reference(k, v, t, g, g, pieces=1)
    with pytest.raises(ValueError, match="multiple of C"):
        ms.state_map_pass_reference(k, v, t, g, g, pieces=8)
    with pytest.raises(ValueError, match="multiples of 64"):
        ms.state_map_pass(k, v, t, g, g, pieces=2)
    with pytest.raises(ValueError, match="map_impl"):
        ms.start_states((k, k, v, t, g, g, None), 2, kernel=False, head_major=True, map_impl="scan")


def _shim_transposed_load(monkeypatch):
    """jax 0.10 (this CPU): plgpu.load takes the index positionally and cannot load a transposed swizzled tile, so
    the lowering checks drop the transpose of the loaded tile's view (the shapes still match); jax 0.11 (the GPU)
    needs no shim and gets none."""
    import dataclasses
    import inspect
    from pallas_kernels.gated_delta_rule.mosaic_gpu.common import plgpu as mosaic_plgpu
    plgpu = mosaic_plgpu()
    orig = plgpu.load
    if "idx" in inspect.signature(orig).parameters and \
            inspect.signature(orig).parameters["idx"].default is inspect.Parameter.empty:
        def load(ref, idx=(), **kw):
            tr = getattr(ref, "transforms", ())
            if tr and "Transpose" in type(tr[-1]).__name__:
                ref = dataclasses.replace(ref, transforms=tr[:-1])
            return orig(ref, idx, **kw)
        monkeypatch.setattr(plgpu, "load", load)


@pytest.mark.parametrize("need_first,exp2,head_major,paired", [(True, False, True, False), (False, True, True, False),
                                                               (True, False, False, False), (True, False, True, True),
                                                               (False, False, False, True)])
def test_state_map_pass_lowers_for_cuda(monkeypatch, need_first, exp2, head_major, paired):
    """The map kernel traces and lowers for CUDA on this CPU (Mosaic GPU's layout, transfer and TMA checks). jax
    0.10 here: plgpu.load takes the index positionally and cannot load a transposed swizzled tile, so the check
    drops the transpose of v's tile ([64, 64]: the shapes still match); jax 0.11 (the GPU) needs neither."""
    _shim_transposed_load(monkeypatch)
    bf = jnp.bfloat16
    b, t, hk, hv, kd, vd = 2, 512, 1, 2, 128, 128 if paired else 64
    k, v = jax.ShapeDtypeStruct((b, t, hk, kd), bf), jax.ShapeDtypeStruct((b, t, hv, vd), bf)
    if head_major:
        tt, gg = jax.ShapeDtypeStruct((b, hv, t, 64), bf), jax.ShapeDtypeStruct((b, hv, t), jnp.float32)
    else:
        tt = jax.ShapeDtypeStruct((b * t // 64, hv, 64, 64), bf)
        gg = jax.ShapeDtypeStruct((b * t // 64, hv, 64), jnp.float32)

    def f(k, v, t_, g, beta):
        return ms.state_map_pass(k, v, t_, g, beta, pieces=4, need_first=need_first, exp2=exp2,
                                 head_major=head_major, config=mg.SplitConfig(paired=paired))
    lowered = jax.jit(f).trace(k, v, tt, gg, gg).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and ("gdn_mosaic_split_map2" in text) == paired
    assert lowered.out_info.shape == (b * 3, hv, kd + vd, kd)


@pytest.mark.parametrize("with_h0", [True, False])
def test_piece_scan_triton_lowers_for_cuda(with_h0):
    """The Triton piece scan lowers for CUDA on this CPU (block shapes, dot sizes) at the bench's K = V = 128."""
    m = jax.ShapeDtypeStruct((1, 7, 8, 256, 128), jnp.float32)
    h = jax.ShapeDtypeStruct((1, 8, 128, 128), jnp.float32)
    for precision in (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT):
        def f(m, *h0):
            return ms.piece_scan_triton(m, h0[0] if h0 else None, precision=precision)
        lowered = jax.jit(f).trace(*((m, h) if with_h0 else (m,))).lower(lowering_platforms=("cuda",))
        assert "gdn_split_piece_scan" in lowered.as_text() and lowered.out_info.shape == (1, 8, 8, 128, 128)


def _weak_decay_operands(case, seed: int, *, pieces: int):
    """The fused pass's head-major operands (Mosaic stage 1a on the GPU) of the case's bf16 inputs with g x 0.01,
    so a start state survives a piece and the split's state maps M matter."""
    q, k, v, g, beta, h0, _ = make_inputs(case, seed, jnp.bfloat16)
    bf = jnp.bfloat16
    return jax.jit(lambda *a: mg.prepare_head_major(*a, kernel=True, pieces=pieces))(
        jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g * 0.01), jnp.asarray(beta, bf),
        jnp.asarray(h0))


@pytest.mark.gpu
@pytest.mark.parametrize("need_first,paired", [(True, False), (False, True), (False, False), (True, True)])
def test_gpu_split_map_pass_matches_twin(need_first, paired):
    """The map kernel (one or two blocks per CTA) against its jnp twin on the same operands (Mosaic stage 1a's
    T0), two rows, grouped heads, K = V = 128, weak decay; without an initial state the first piece's M rows are
    zeros."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    ops_ = _weak_decay_operands(Case("B2-T1000-Hk1-Hv2-K128-V128", 2, 1000, 1, 2, 128, 128), 11, pieces=4)
    got = np.asarray(jax.jit(lambda *a: ms.state_map_pass(*a, pieces=4, need_first=need_first,
                                                          config=mg.SplitConfig(paired=paired)))(*ops_[1:6]))
    ref = np.asarray(ms.state_map_pass_reference(*ops_[1:6], pieces=4, need_first=need_first))
    assert np.isfinite(got).all()
    assert rel_rms(got, ref) < 1e-2, rel_rms(got, ref)
    m0 = got.reshape(2, 3, 2, 256, 128)[:, 0, :, :128]
    ref_m0 = ref.reshape(2, 3, 2, 256, 128)[:, 0, :, :128]      # M ~ 0.2 after 256 tokens at K = 128
    assert (np.all(m0 == 0) if not need_first else np.abs(m0).max() > 0.5 * np.abs(ref_m0).max() > 0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("t,pieces,with_h0", [(1000, 4, True), (130, 8, True), (1000, 8, False), (1000, 2, True),
                                              (130, 2, False), (1000, 8, True)])
def test_gpu_split_op_weak_decay_matches_f64(t, pieces, with_h0):
    """The op split at P = 2, 4, 8 (the map kernel and the default scan) against float64, g x 0.01 so a start
    state survives its piece (a wrong M shows), grouped heads, K = V = 128, bf16 bound 1e-2."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    case = Case(f"B1-T{t}-Hk1-Hv2-K128-V128", 1, t, 1, 2, 128, 128)
    (q, k, v, g, beta, h0), o, s = _run(case, jnp.bfloat16, impl="mosaic", stage1a="mosaic", pieces=pieces,
                                        g_scale=0.01, with_h0=with_h0)
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32)), h0)
    assert np.isfinite(o).all()
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))


@pytest.mark.gpu
def test_gpu_split_variants_agree():
    """The Triton and the log-depth scans and the paired map kernel give the start states of the map kernel and
    the serial scan (P = 8, weak decay, initial state)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    ops_ = _weak_decay_operands(Case("B1-T1024-Hk1-Hv2-K128-V128", 1, 1024, 1, 2, 128, 128), 12, pieces=8)
    runs = {(m, s): np.asarray(jax.jit(lambda o, m=m, s=s: ms.start_states(
        o, 8, kernel=True, head_major=True, map_impl=m, config=mg.SplitConfig(scan=s)))(ops_))
            for m, s in [("map", "serial"), ("map", "triton"), ("paired", "serial"), ("map", "log")]}
    base = runs[("map", "serial")]
    assert np.isfinite(base).all() and np.abs(base[-2:]).max() > 0.05
    for key, got in runs.items():
        assert rel_rms(got, base) < 1e-2, (key, rel_rms(got, base))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["default", "high"])
def test_gpu_split_fast_scan_matches_f64(precision):
    """The split at P = 8 with the scan's products on the tensor cores (tf32 / bf16 x 3) against float64 at weak
    decay (a start state survives its piece), initial state in, K = V = 128, grouped heads (bf16 1e-2); its start
    states within 2e-3 of the IEEE fp32 scan's."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    case = Case("B1-T1000-Hk1-Hv2-K128-V128", 1, 1000, 1, 2, 128, 128)
    q, k, v, g, beta, h0, _ = make_inputs(case, 13, jnp.bfloat16)
    g = (g * 0.01).astype(np.float32)
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf),
            jnp.asarray(h0))

    @jax.jit
    def run(q, k, v, g, beta, h0):
        ops_ = mg.prepare_head_major(q, k, v, g, beta, h0, kernel=True, pieces=8)
        fast = ms.start_states(ops_, 8, kernel=True, head_major=True, config=mg.SplitConfig(precision=precision))
        exact = ms.start_states(ops_, 8, kernel=True, head_major=True, config=mg.SplitConfig(precision="highest"))
        o, ht = mg.fused_state_pass(*ops_[:6], fast, scale=128 ** -0.5, out_final=True, head_major=True, pieces=8)
        return o[:, :1000], jnp.swapaxes(ht[-1:], -1, -2), fast, exact
    o, s, fast, exact = (np.asarray(x.astype(jnp.float32)) for x in run(*args))
    assert rel_rms(fast, exact) < 2e-3, rel_rms(fast, exact)
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, bf).astype(jnp.float32)), h0)
    assert np.isfinite(o).all()
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))


# ---- the dense rows' launch choices (MosaicConfig.state_kv, exp2) ---------------------------------------------
def test_config_state_kv_is_checked_and_passed_through(monkeypatch):
    """MosaicConfig.state_kv is a bool (a clear ValueError otherwise) and op_fwd hands every field of the config to
    the dense entry (a stand-in records the call)."""
    with pytest.raises(ValueError, match="state_kv"):
        mg.MosaicConfig(state_kv=1)
    with pytest.raises(ValueError, match="exp2"):
        mg.MosaicConfig(exp2="yes")
    seen = {}

    def fake(q, k, v, g, beta, h0=None, **kw):
        seen.update(kw, h0=h0)
        return jnp.zeros(v.shape, v.dtype), jnp.zeros(v.shape[:1] + v.shape[2:3] + (q.shape[3], v.shape[3]))
    monkeypatch.setattr(mg, "chunk_gated_delta_rule_fwd", fake)
    q = jnp.zeros((1, 70, 1, 16), jnp.bfloat16)
    v = jnp.zeros((1, 70, 2, 16), jnp.bfloat16)
    g = jnp.zeros((1, 70, 2), jnp.float32)
    cfg = mg.MosaicConfig(stage1a="mosaic", pieces=1, exp2=True, state_kv=True)
    mg.op_fwd(q, q, v, g, g, scale=0.25, initial_state=jnp.zeros((1, 2, 16, 16)), output_final_state=True,
              config=cfg)
    assert (seen["stage1a"], seen["pieces"], seen["exp2"], seen["state_kv"]) == ("mosaic", 1, True, True)
    assert seen["h0"] is not None and seen["impl"] == "mosaic"


def test_reference_state_kv_is_the_same_op():
    """state_kv changes where the kernel keeps the states, not the op: the reference route (which ignores it) and
    the argument checks agree with state_kv off; split calls keep their transposed start states."""
    case = Case("cpu-B2-T65-Hk1-Hv2-K16-V8", 2, 65, 1, 2, 16, 8)
    q, k, v, g, beta, h0, _ = make_inputs(case, 8, jnp.float32)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta, h0)]
    a = mg.chunk_gated_delta_rule_fwd(*args, impl="reference", stage1a="mosaic", state_kv=True)
    b = mg.chunk_gated_delta_rule_fwd(*args, impl="reference", stage1a="mosaic", state_kv=False)
    ro, rs = oracle(q, k, v, g, beta, h0)
    assert rel_rms(np.asarray(a[1]), rs) < 2e-4 and np.array_equal(np.asarray(a[0]), np.asarray(b[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("exp2", [False, True])
def test_gpu_state_kv_matches_f64(exp2):
    """The fused pass reading h0 and writing the final state in [B, Hv, K, V] itself (no XLA transposes): against
    float64 (bf16 1e-2) on T = 130 with a NaN initial state in one row (it stays there), K = V = 128, Hv = 3 Hk; the
    states bitwise those of the transposed route (the transposed SMEM load / store is exact)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernel needs an sm_90 GPU")
    case = Case("B2-T130-Hk1-Hv3-K128-V128", 2, 130, 1, 3, 128, 128)
    q, k, v, g, beta, h0, _ = make_inputs(case, 21, jnp.bfloat16)
    h0 = h0.copy()
    h0[1] = np.nan
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf),
            jnp.asarray(h0))
    runs = [mg.chunk_gated_delta_rule_fwd(*args, impl="mosaic", stage1a="mosaic", pieces=1, exp2=exp2, state_kv=kv)
            for kv in (True, False)]
    (o, s), (o_t, s_t) = ([np.asarray(x.astype(jnp.float32)) for x in r] for r in runs)
    ro, rs = oracle(q[:1], k[:1], v[:1], g[:1], np.asarray(jnp.asarray(beta, bf).astype(jnp.float32))[:1], h0[:1])
    assert np.isfinite(o[0]).all() and np.isfinite(s[0]).all() and np.isnan(s[1]).all()
    assert rel_rms(o[:1], ro) < 1e-2 and rel_rms(s[:1], rs) < 1e-2, (rel_rms(o[:1], ro), rel_rms(s[:1], rs))
    assert np.array_equal(s[:1], s_t[:1]) and np.array_equal(o[:1], o_t[:1])


def _split_weak_decay_check(t: int, seed: int, **split):
    """The Mosaic op split as ``split`` asks (``mg.chunk_gated_delta_rule_fwd``'s options, a ``split`` SplitConfig
    among them) against float64 at weak
    decay (g x 0.01: a wrong start state shows): one stream of T tokens, initial state in, K = V = 128, Hv = 2 Hk,
    bf16 inputs; o finite, o and the final state within 1e-2."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    case = Case(f"B1-T{t}-Hk1-Hv2-K128-V128", 1, t, 1, 2, 128, 128)
    q, k, v, g, beta, h0, _ = make_inputs(case, seed, jnp.bfloat16)
    g = (g * 0.01).astype(np.float32)
    bf = jnp.bfloat16
    o, s = mg.chunk_gated_delta_rule_fwd(jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
                                         jnp.asarray(beta, bf), jnp.asarray(h0), impl="mosaic", stage1a="mosaic",
                                         **split)
    o, s = np.asarray(o.astype(jnp.float32)), np.asarray(s)
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, bf).astype(jnp.float32)), h0)
    assert np.isfinite(o).all()
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))


@pytest.mark.gpu
@pytest.mark.parametrize("t,hv,pieces", [(4000, 2, 4), (130, 3, 1)])
def test_gpu_default_config_matches_f64(t, hv, pieces):
    """The backend's DEFAULT_CONFIG as op_fwd runs it (exp2, state_kv, the split policy: P = 4 at T = 4000 with 4
    CTAs, unsplit at T = 130) against float64 at weak decay (g x 0.01: a wrong piece start or state layout shows),
    initial state in, K = V = 128, grouped heads, bf16 1e-2."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    assert mg.split_pieces(1, hv, 128, 128, t + (-t) % 64) == pieces
    case = Case(f"B1-T{t}-Hk1-Hv{hv}-K128-V128", 1, t, 1, hv, 128, 128)
    q, k, v, g, beta, h0, _ = make_inputs(case, 23, jnp.bfloat16)
    g = (g * 0.01).astype(np.float32)
    bf = jnp.bfloat16
    o, s = mg.op_fwd(jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf),
                     scale=128 ** -0.5, initial_state=jnp.asarray(h0), output_final_state=True)
    o, s = np.asarray(o.astype(jnp.float32)), np.asarray(s)
    ro, rs = oracle(q, k, v, g, np.asarray(jnp.asarray(beta, bf).astype(jnp.float32)), h0)
    assert np.isfinite(o).all()
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))


# ---- the split's first piece from h0, the scan and the split policy as config fields -----------------------------
def test_config_split_fields_are_checked_and_passed_through(monkeypatch):
    """SplitConfig's fields: known names and positive numbers (a ValueError naming the field otherwise), and
    op_fwd hands the config's split to the dense entry."""
    for bad, match in [(dict(scan="tree"), "scan"), (dict(first="eye"), "first"), (dict(precision="fp64"), "precision"),
                       (dict(paired="yes"), "paired"), (dict(max_pieces=0), "max_pieces"),
                       (dict(min_piece_chunks=1.5), "min_piece_chunks"), (dict(map_step=-1.0), "map_step"),
                       (dict(serial_max_pieces=True), "serial_max_pieces")]:
        with pytest.raises(ValueError, match=f"SplitConfig.{match}"):
            mg.SplitConfig(**bad)
    with pytest.raises(ValueError, match="MosaicConfig.split"):
        mg.MosaicConfig(split="serial")
    with pytest.raises(ValueError, match="MosaicConfig.pieces"):
        mg.MosaicConfig(pieces=8, split=mg.SplitConfig(max_pieces=4))
    seen = {}

    def fake(q, k, v, g, beta, h0=None, **kw):
        seen.update(kw)
        return jnp.zeros(v.shape, v.dtype), jnp.zeros(v.shape[:1] + v.shape[2:3] + (q.shape[3], v.shape[3]))
    monkeypatch.setattr(mg, "chunk_gated_delta_rule_fwd", fake)
    q = jnp.zeros((1, 70, 1, 16), jnp.bfloat16)
    v = jnp.zeros((1, 70, 2, 16), jnp.bfloat16)
    g = jnp.zeros((1, 70, 2), jnp.float32)
    split = mg.SplitConfig(scan="serial", first="h0", precision="default")
    mg.op_fwd(q, q, v, g, g, scale=0.25, initial_state=None, output_final_state=True,
              config=mg.MosaicConfig(split=split))
    assert seen["split"] is split


@pytest.mark.parametrize("pieces", [2, 4, 5])
def test_split_first_from_h0_matches_the_maps(pieces):
    """first="h0": piece 0 walked from h0 (its identity rows zero, its value rows piece 1's true start) gives every
    scan the start states of the maps from [I | 0] (jnp twins, weak decay, K = 32 so M matters, grouped heads, odd
    T padded to C P); without an initial state "h0" is "map"."""
    case = Case("cpu-B2-T300-Hk2-Hv4-K32-V16", 2, 300, 2, 4, 32, 16)
    _, ops_ = _split_operands(case, pieces, seed=5)
    base = np.asarray(ms.start_states(ops_, pieces, kernel=False, head_major=True,
                                      config=mg.SplitConfig(scan="serial", first="map")))
    assert np.abs(base[1::pieces]).max() > 0.05
    for scan in ms.SCANS:
        got = np.asarray(ms.start_states(ops_, pieces, kernel=False, head_major=True,
                                         config=mg.SplitConfig(scan=scan, first="h0")))
        assert got.shape == base.shape and rel_rms(got, base) < 1e-5, (scan, rel_rms(got, base))
    maps = np.asarray(ms.state_map_pass_reference(*ops_[1:6], pieces=pieces, h0t=ops_[6]))
    maps = maps.reshape(2, pieces - 1, 4, 48, 32)
    assert np.all(maps[:, 0, :, :32] == 0)
    np.testing.assert_allclose(maps[:, 0, :, 32:], base.reshape(2, pieces, 4, 16, 32)[:, 1], rtol=1e-5, atol=1e-6)
    _, ops0 = _split_operands(case, pieces, seed=5, with_h0=False)
    a = np.asarray(ms.start_states(ops0, pieces, kernel=False, head_major=True, config=mg.SplitConfig(first="h0")))
    b = np.asarray(ms.start_states(ops0, pieces, kernel=False, head_major=True, config=mg.SplitConfig(first="map")))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("pieces", [3, 4])
def test_piece_scan_first_end_skips_m0(pieces):
    """piece_scan(first_end=True): piece 0's rows K: are piece 1's start (M_0 not read: garbage there changes
    nothing), index 0 is h0; serial and the Triton kernel (interpret mode) agree with the definition on M_0 = 0."""
    rng = np.random.default_rng(pieces)
    b, hv, kdim, vdim = 1, 2, 8, 16
    maps = rng.standard_normal((b, pieces - 1, hv, kdim + vdim, kdim)).astype(np.float32) * 0.3
    maps[:, 0, :, :kdim] = 0.0
    h0t = rng.standard_normal((b, hv, vdim, kdim)).astype(np.float32)
    want = _scan_f64(maps, h0t)
    garbage = maps.copy()
    garbage[:, 0, :, :kdim] = 7.0
    for method in ("serial", "triton"):
        got = np.asarray(ms.piece_scan(jnp.asarray(garbage), jnp.asarray(h0t), key_dim=kdim, method=method,
                                       interpret=True, first_end=True))
        assert rel_rms(got, want) < 1e-5, (method, rel_rms(got, want))


def test_reference_split_options_match_f64():
    """The dense entry with SplitConfig first="h0" and each scan, at P = 3 and 5 (not powers of two), matches
    float64 at weak decay (jnp twins, impl="reference")."""
    case = Case("cpu-B1-T400-Hk1-Hv2-K16-V8", 1, 400, 1, 2, 16, 8)
    q, k, v, g, beta, h0, _ = make_inputs(case, 6, jnp.float32)
    g = (g * 0.01).astype(np.float32)
    ro, rs = oracle(q, k, v, g, beta, h0)
    for pieces, scan, first in [(3, "serial", "h0"), (5, "triton", "h0"), (5, "log", "map")]:
        o, s = mg.chunk_gated_delta_rule_fwd(*(jnp.asarray(x) for x in (q, k, v, g, beta, h0)), impl="reference",
                                             stage1a="mosaic", pieces=pieces,
                                             split=mg.SplitConfig(scan=scan, first=first))
        assert rel_rms(np.asarray(o), ro) < 2e-4 and rel_rms(np.asarray(s), rs) < 2e-4, (pieces, scan, first)


def test_state_map_pass_from_h0_lowers_for_cuda(monkeypatch):
    """The map kernel with h0t (the first piece from the initial state: an extra TMA load and a masked select in
    the state warpgroup) traces and lowers for CUDA on this CPU, at the bench's K = V = 128 (jax 0.10's
    transposed-load limit shimmed as in test_state_map_pass_lowers_for_cuda)."""
    _shim_transposed_load(monkeypatch)
    bf = jnp.bfloat16
    b, t, hk, hv, kd, vd = 1, 1024, 1, 2, 128, 128
    k, v = jax.ShapeDtypeStruct((b, t, hk, kd), bf), jax.ShapeDtypeStruct((b, t, hv, vd), bf)
    tt, gg = jax.ShapeDtypeStruct((b, hv, t, 64), bf), jax.ShapeDtypeStruct((b, hv, t), jnp.float32)
    h0 = jax.ShapeDtypeStruct((b, hv, vd, kd), jnp.float32)

    def f(k, v, t_, g, beta, h0t):
        return ms.state_map_pass(k, v, t_, g, beta, pieces=4, exp2=True, config=mg.SplitConfig(paired=True),
                                 h0t=h0t)
    lowered = jax.jit(f).trace(k, v, tt, gg, gg, h0).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "gdn_mosaic_split_map" in text and "gdn_mosaic_split_map2" not in text    # never paired
    assert lowered.out_info.shape == (b * 3, hv, kd + vd, kd)
    with pytest.raises(ValueError, match="h0t"):
        jax.jit(f).trace(k, v, tt, gg, gg, jax.ShapeDtypeStruct((b, hv, kd, kd + 1), jnp.float32))


@pytest.mark.gpu
def test_gpu_split_map_from_h0_matches_twin():
    """The map kernel with h0t against its jnp twin (Mosaic stage 1a's T0, two rows, grouped heads, K = V = 128,
    weak decay): piece 0's identity rows exactly zero, its value rows piece 1's start."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    ops_ = _weak_decay_operands(Case("B2-T1000-Hk1-Hv2-K128-V128", 2, 1000, 1, 2, 128, 128), 31, pieces=4)
    got = np.asarray(jax.jit(lambda *a: ms.state_map_pass(*a[:5], pieces=4, exp2=False, h0t=a[5]))(*ops_[1:]))
    ref = np.asarray(ms.state_map_pass_reference(*ops_[1:6], pieces=4, h0t=ops_[6]))
    assert np.isfinite(got).all()
    assert rel_rms(got, ref) < 1e-2, rel_rms(got, ref)
    got = got.reshape(2, 3, 2, 256, 128)
    assert np.all(got[:, 0, :, :128] == 0) and np.abs(got[:, 0, :, 128:]).max() > 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("pieces,scan,first,prec", [(4, "triton", "h0", "highest"), (4, "serial", "h0", "highest"),
                                                    (5, "triton", "map", "highest"), (5, "triton", "h0", "highest"),
                                                    (3, "serial", "map", "highest"), (6, "triton", "h0", "highest"),
                                                    (5, "triton", "h0", "default")])
def test_gpu_split_options_weak_decay_matches_f64(pieces, scan, first, prec):
    """The op split with each start-state option (first piece from h0 or mapped, the XLA serial scan, P = 3, 5, 6,
    the scan in tf32) against float64 at weak decay (g x 0.01: a wrong start state shows), initial state in, K = V = 128,
    Hv = 2 Hk, exp2 on (the default), bf16 1e-2."""
    _split_weak_decay_check(2000, 37, pieces=pieces, exp2=True,
                            split=mg.SplitConfig(scan=scan, first=first, precision=prec))


@pytest.mark.parametrize("pieces,want", [(2, "serial"), (4, "triton")])
def test_split_scan_auto_resolves_by_pieces(monkeypatch, pieces, want):
    """scan="auto" (the default) runs the XLA serial scan up to serial_max_pieces pieces and the Triton kernel
    above (a stand-in piece_scan records the method)."""
    case = Case("cpu-B1-T1024-Hk1-Hv2-K16-V8", 1, 1024, 1, 2, 16, 8)
    _, ops_ = _split_operands(case, pieces, seed=2)
    seen = []
    real = ms.piece_scan

    def spy(*a, method="serial", **kw):
        seen.append(method)
        return real(*a, method=method, **kw)
    monkeypatch.setattr(ms, "piece_scan", spy)
    ms.start_states(ops_, pieces, kernel=False, head_major=True, config=mg.SplitConfig(scan="auto"))
    ms.start_states(ops_, pieces, kernel=False, head_major=True)
    ms.start_states(ops_, pieces, kernel=False, head_major=True, config=mg.SplitConfig(serial_max_pieces=4))
    assert seen == [want, want, "serial"]
    with pytest.raises(ValueError, match="scan"):
        mg.SplitConfig(scan="fast")
