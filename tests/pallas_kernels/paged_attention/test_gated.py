"""Gated attention prefill (``paged_attention_gated``: q RMSNorm + partial RoPE on q_proj's raw output, paged
causal attention, * sigmoid(gate)) against a float64 NumPy oracle: the XLA reference and the one Pallas kernel
(interpret mode on CPU; compiled on a GPU in the `gpu` tests).

Cases reuse test_triton.make_case (continued streams with context in pages, shuffled pages, NaN-poisoned
free pages and page tails, stale page-table entries, padding tokens and padding streams with slot id S). qg has
extra columns past H 2 Dh (the k and v of a fused projection) filled with NaN: a kernel reading them fails.
Tolerances (relative RMS against float64, per stream): fp32 1e-5, bf16 2e-2 (test_triton.TOL).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import api, triton
from tests.pallas_kernels.paged_attention.test_triton import (CPU_BACKENDS, STREAMS_ODD, TOL, _round, make_case, oracle,
                                                       rel_rms)

EPS = 1e-6


def gated_inputs(rng, case, *, dh, group, hkv, rotary, dtype, extra_cols=None, theta=1000.0):
    """qg [T, H 2 Dh + extra] (extra columns NaN), q_norm [Dh], cos / sin [T, R] at each token's position."""
    h = hkv * group
    t = case.q.shape[0]
    extra = 2 * hkv * dh if extra_cols is None else extra_cols
    qg = _round(rng.standard_normal((t, h * 2 * dh)) * 2.0, dtype)
    qg = np.concatenate([qg, np.full((t, extra), np.nan)], axis=1)
    pos = np.zeros(t, np.int64)
    for i, (s, o, n, _, _) in enumerate(case.streams):
        pos[case.cu[i]:case.cu[i] + n] = o + np.arange(n)
    inv = 1.0 / theta ** (np.arange(0, rotary, 2) / max(rotary, 1))
    fr = pos[:, None] * inv[None, :]
    emb = np.concatenate([fr, fr], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    q_norm = _round(0.3 * rng.standard_normal(dh), dtype)
    return qg, q_norm, cos, sin


def gated_oracle(case, qg, q_norm, cos, sin, *, h, dh, scale):
    """float64 [T, H * Dh]: sigmoid(gate) * attention(RoPE(RMSNorm(query))); zeros for padding tokens."""
    t = qg.shape[0]
    x = qg[:, :h * 2 * dh].reshape(t, h, 2 * dh).astype(np.float64)
    q, gate = x[..., :dh], x[..., dh:]
    q = q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + EPS) * (1.0 + q_norm.astype(np.float64))
    r = cos.shape[1]
    if r:
        c, s = cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
        x1, x2 = q[..., :r // 2], q[..., r // 2:r]
        q = np.concatenate([q[..., :r] * c + np.concatenate([-x2, x1], -1) * s, q[..., r:]], axis=-1)
    case.q = q
    o = oracle(case, scale) / (1.0 + np.exp(-gate))
    return o.reshape(t, h * dh)


def run_and_check(case, qg, q_norm, cos, sin, *, h, dh, scale, dtype, backend, config=None):
    q, kp, vp, pt, sl, cu, ids = case.args(dtype)
    out = api.paged_attention_gated(jnp.asarray(qg, dtype), kp, vp, pt, sl, cu, ids, q_norm=jnp.asarray(q_norm),
                                    cos=jnp.asarray(cos), sin=jnp.asarray(sin), num_heads=h, scale=scale, eps=EPS,
                                    backend=backend, config=config)
    assert out.shape == (qg.shape[0], h * dh) and out.dtype == jnp.dtype(dtype)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = gated_oracle(case, qg, q_norm, cos, sin, h=h, dh=dh, scale=scale)
    assert np.all(np.isfinite(out))
    for i, (s, o, n, _, _) in enumerate(case.streams):
        rows = slice(case.cu[i], case.cu[i] + n)
        if s >= 0 and n:
            err = rel_rms(out[rows], ref[rows])
            assert err <= TOL[jnp.dtype(dtype)], f"stream {i} (slot {s}, {o} old + {n} new): {err:.2e}"
    np.testing.assert_array_equal(out[case.cu[-1]:], 0.0)          # padding tokens: zeros


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_prefill_odd_lengths_continued_streams(backend, dtype):
    """Lengths 1, 63, 64, 65, 130 continuing 0-64 tokens of context; partial RoPE (R = Dh / 4)."""
    rng = np.random.default_rng(0)
    case = make_case(rng, streams=STREAMS_ODD, hkv=2, group=4, dh=32, dtype=dtype)
    qg, qn, cos, sin = gated_inputs(rng, case, dh=32, group=4, hkv=2, rotary=8, dtype=dtype)
    run_and_check(case, qg, qn, cos, sin, h=8, dh=32, scale=32 ** -0.5, dtype=dtype, backend=backend)


@pytest.mark.parametrize("prologue", ["kernel", "reload"])
def test_gated_prefill_q_prologue_modes(prologue):
    """The other two places of the q norm + RoPE (the default, "xla", runs in every other test)."""
    rng = np.random.default_rng(4)
    case = make_case(rng, streams=STREAMS_ODD, hkv=2, group=4, dh=32, dtype=jnp.bfloat16)
    qg, qn, cos, sin = gated_inputs(rng, case, dh=32, group=4, hkv=2, rotary=8, dtype=jnp.bfloat16)
    cfg = dataclasses.replace(triton.prefill_config(jnp.bfloat16, 32), q_prologue=prologue)
    run_and_check(case, qg, qn, cos, sin, h=8, dh=32, scale=32 ** -0.5, dtype=jnp.bfloat16,
                  backend="pallas_interpret", config=cfg)
    with pytest.raises(ValueError, match="q_prologue must be"):
        triton.PrefillConfig(q_prologue="smem")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("group,hkv,dh,rotary", [(1, 3, 64, 64), (3, 2, 16, 0), (8, 1, 32, 16)])
def test_gated_prefill_gqa_and_rotary_dims(backend, group, hkv, dh, rotary):
    """GQA 1 / 3 / 8; RoPE over all dims, none, half."""
    rng = np.random.default_rng(group)
    case = make_case(rng, streams=[(4, 20, 33), (0, 0, 70), (1, 100, 2)], hkv=hkv, group=group, dh=dh, ps=8)
    qg, qn, cos, sin = gated_inputs(rng, case, dh=dh, group=group, hkv=hkv, rotary=rotary, dtype=jnp.float32,
                                    extra_cols=0 if group == 3 else None)
    run_and_check(case, qg, qn, cos, sin, h=hkv * group, dh=dh, scale=0.3, dtype=jnp.float32, backend=backend)


def test_gated_prefill_bad_input():
    rng = np.random.default_rng(1)
    case = make_case(rng, streams=[(0, 10, 20), (1, 0, 5)], group=2, dh=32, ps=8)
    qg, qn, cos, sin = gated_inputs(rng, case, dh=32, group=2, hkv=2, rotary=8, dtype=jnp.float32)
    _, kp, vp, pt, sl, cu, ids = case.args(jnp.float32)
    kw = dict(q_norm=jnp.asarray(qn), cos=jnp.asarray(cos), sin=jnp.asarray(sin), num_heads=4, scale=0.1)
    with pytest.raises(ValueError, match="qg has 200 columns, fewer than"):
        api.paged_attention_gated(jnp.asarray(qg[:, :200]), kp, vp, pt, sl, cu, ids, **kw)
    with pytest.raises(ValueError, match=r"qg must be \[T, C\]"):
        api.paged_attention_gated(jnp.asarray(qg)[None], kp, vp, pt, sl, cu, ids, **kw)
    with pytest.raises(ValueError, match="q_norm must have shape"):
        api.paged_attention_gated(jnp.asarray(qg), kp, vp, pt, sl, cu, ids, **dict(kw, q_norm=jnp.zeros(16)))
    with pytest.raises(ValueError, match="sin must be"):
        api.paged_attention_gated(jnp.asarray(qg), kp, vp, pt, sl, cu, ids, **dict(kw, sin=jnp.zeros((3, 8))))
    with pytest.raises(ValueError, match="must be even"):
        api.paged_attention_gated(jnp.asarray(qg), kp, vp, pt, sl, cu, ids,
                                  **dict(kw, cos=jnp.asarray(cos[:, :7]), sin=jnp.asarray(sin[:, :7])))
    bad = np.array(case.slot_lens)
    bad[0] = 19
    with pytest.raises(ValueError, match="stream 0 has 20 tokens but slot_lens"):
        api.paged_attention_gated(jnp.asarray(qg), kp, vp, pt, jnp.asarray(bad), cu, ids, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,dh,group,rotary,prologue", [
    (jnp.bfloat16, 256, 8, 64, None), (jnp.float32, 256, 8, 64, None), (jnp.bfloat16, 128, 4, 128, None),
    (jnp.bfloat16, 256, 8, 64, "kernel"), (jnp.bfloat16, 256, 8, 64, "reload")])
def test_gpu_gated_prefill_matches_f64(dtype, dh, group, rotary, prologue):
    """The compiled kernel at the Qwen3-Next dims (Dh 256, 8 heads per kv head, R 64) and at Dh 128; the q
    prologue in each of its three places at the 80B dims."""
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(dh + group)
    case = make_case(rng, streams=STREAMS_ODD + [(4, 300, 257)], hkv=2, group=group, dh=dh, num_slots=7,
                     dtype=dtype)
    qg, qn, cos, sin = gated_inputs(rng, case, dh=dh, group=group, hkv=2, rotary=rotary, dtype=dtype)
    cfg = None if prologue is None else dataclasses.replace(triton.prefill_config(dtype, dh), q_prologue=prologue)
    run_and_check(case, qg, qn, cos, sin, h=2 * group, dh=dh, scale=dh ** -0.5, dtype=dtype, backend="pallas",
                  config=cfg)
