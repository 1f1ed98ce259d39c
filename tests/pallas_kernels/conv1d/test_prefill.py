"""The fused conv1d + SiLU + q/k L2 norm (pallas_kernels/conv1d): the XLA reference and the Pallas kernel in
interpret mode against a float64 NumPy oracle (per stream, from its slot's conv state).

Cases: odd lengths (1, 63, 64, 65, 130), an empty stream, NaN padding tokens past cu[N] and padding streams with
slot id S, a negative slot id, fresh streams over NaN-poisoned slots, grouped heads (Hv = 2 Hk), the identity and the
Qwen3-Next fused ``in_proj_qkvz`` source layouts (z columns NaN: never read). Tolerances: fp32 2e-5 abs (sums of
Kc = 4 fp32 products and a normalisation); bf16 outputs 2e-2 abs (one bf16 rounding of values of order 1).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.conv1d import api, reference

HK, HV, D, KC = 2, 4, 16, 4
C = (2 * HK + HV) * D
S = 6


def _oracle(xc, w, pool, cu, slot_ids, has_init, t):
    """float64: q, k (normalised), v [T, C] in channel order and the new pool."""
    xc, w, pool = (np.asarray(a, np.float64) for a in (xc, w, pool))
    y = np.zeros((t, C))
    new_pool = pool.copy()
    for n in range(len(cu) - 1):
        s0, s1, sid = int(cu[n]), int(cu[n + 1]), int(slot_ids[n])
        ok = 0 <= sid < S
        prev = pool[sid] if (ok and has_init[n]) else np.zeros((C, KC - 1))
        xs = np.concatenate([prev.T, xc[s0:s1]], 0)                                   # [Kc-1+L, C]
        for i in range(s1 - s0):
            acc = (xs[i:i + KC] * w.T).sum(0)
            y[s0 + i] = acc / (1 + np.exp(-acc))
        if ok:
            new_pool[sid] = xs[-(KC - 1):].T
    kd = HK * D
    for lo, hi in ((0, kd), (kd, 2 * kd)):
        h = y[:, lo:hi].reshape(t, -1, D)
        y[:, lo:hi] = (h / np.sqrt((h * h).sum(-1, keepdims=True) + 1e-6)).reshape(t, -1)
    return y, new_pool


def _case(seed, lens, t_pad, slot_ids, has_init, layout, dtype):
    rng = np.random.default_rng(seed)
    t = t_pad
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    xc = rng.standard_normal((t, C)).astype(np.float32)
    xc[int(cu[-1]):] = np.nan                               # padding tokens: never read into a stream's rows
    w = (rng.standard_normal((C, KC)) * 0.5).astype(np.float32)
    pool = rng.standard_normal((S, C, KC - 1)).astype(np.float32)
    for n, sid in enumerate(slot_ids):                      # fresh streams over NaN-poisoned slots
        if 0 <= sid < S and not has_init[n]:
            pool[sid] = np.nan
    if layout == "qkvz":
        cols = reference.qkvz_block_cols(HK, HV, D)
        x = np.full((t, 2 * HK * D + 2 * HV * D), np.nan, np.float32)                  # z columns stay NaN
        src = reference.channel_source_index(cols, D, C)
        x[:, src] = xc
    else:
        cols, x = None, xc
    x = jnp.asarray(x, dtype)
    xc_rounded = np.nan_to_num(np.asarray(jnp.asarray(xc, dtype).astype(jnp.float32)))
    return (x, jnp.asarray(w), jnp.asarray(pool), jnp.asarray(cu), jnp.asarray(slot_ids, jnp.int32),
            jnp.asarray(has_init), cols, xc_rounded)


CASES = [
    # lens, padded T, slot ids, has_initial_state
    ([1, 63, 64, 65, 130], 330, [0, 1, 2, 3, 4], [False, True, False, True, True]),
    ([70, 0, 2, 5], 96, [5, 1, 6, -1], [True, True, False, True]),      # empty stream, padding slot S, no slot -1
]


def test_bf16_pallas_matches_reference_and_jits_once():
    lens, t, slot_ids, has_init = CASES[0]
    x, w, pool, cu, ids, hi, cols, xc = _case(7, lens, t, slot_ids, has_init, "qkvz", jnp.bfloat16)
    pool = pool.astype(jnp.bfloat16)
    want_y, _ = _oracle(xc, w, np.asarray(pool.astype(jnp.float32)), np.asarray(cu), slot_ids, has_init, t)
    fn = jax.jit(lambda x, pool, cu: api.causal_conv1d_l2_varlen(
        x, w, pool, cu, ids, hi, num_k_heads=HK, num_v_heads=HV, head_dim=D, block_cols=cols,
        backend="pallas_interpret"))
    q, k, v, _ = fn(x, pool, cu)
    assert q.dtype == jnp.bfloat16 and v.shape == (t, HV, D)
    got = np.concatenate([np.asarray(a.astype(jnp.float32)).reshape(t, -1) for a in (q, k, v)], 1)
    np.testing.assert_allclose(got, want_y, atol=2e-2, rtol=0)
    cu2 = jnp.asarray(np.concatenate([[0], np.cumsum([100, 1, 99, 64, 66])]).astype(np.int32))
    fn(x, pool, cu2)                                       # other lengths, same T and N: no recompile
    assert fn._cache_size() == 1


def test_bad_arguments_raise():
    x = jnp.zeros((8, C))
    w = jnp.zeros((C, KC))
    pool = jnp.zeros((S, C, KC - 1))
    cu, ids, hi = jnp.array([0, 8], jnp.int32), jnp.array([0], jnp.int32), jnp.array([True])
    kw = dict(num_k_heads=HK, num_v_heads=HV, head_dim=D)
    with pytest.raises(ValueError, match="backend"):
        api.causal_conv1d_l2_varlen(x, w, pool, cu, ids, hi, backend="cuda", **kw)
    with pytest.raises(ValueError, match="w must be"):
        api.causal_conv1d_l2_varlen(x, w[:-1], pool, cu, ids, hi, **kw)
    with pytest.raises(ValueError, match="block_cols"):
        api.causal_conv1d_l2_varlen(x, w, pool, cu, ids, hi, block_cols=(0,) * 3, **kw)
    with pytest.raises(ValueError, match="conv_state_pool"):
        api.causal_conv1d_l2_varlen(x, w, pool[:, :, :1], cu, ids, hi, **kw)
    with pytest.raises(ValueError, match="slot_ids"):
        api.causal_conv1d_l2_varlen(x, w, pool, cu, jnp.array([0, 1]), hi, **kw)
    assert api.supports(platform="cpu", dtype=jnp.float32, head_k_dim=16, head_v_dim=16) is not None
    assert api.supports(platform="gpu", dtype=jnp.float32, head_k_dim=16, head_v_dim=32) is not None
    assert api.supports(platform="gpu", dtype=jnp.bfloat16, head_k_dim=128, head_v_dim=128) is None
    assert "multiple of 16" in api.supports(platform="gpu", dtype=jnp.bfloat16, head_k_dim=24, head_v_dim=24)
    assert api.supports(platform="cpu", dtype=jnp.bfloat16, head_k_dim=24, head_v_dim=24, interpret=True) is None


def test_head_dim_not_a_power_of_two(monkeypatch):
    """D = 24: the kernel's tile is padded to 32 columns and masked."""
    import sys
    mod = sys.modules[__name__]
    monkeypatch.setattr(mod, "D", 24)
    monkeypatch.setattr(mod, "C", (2 * HK + HV) * 24)
    lens, t, slot_ids, has_init = CASES[1]
    x, w, pool, cu, ids, hi, cols, xc = _case(3, lens, t, slot_ids, has_init, "qkvz", jnp.float32)
    want_y, _ = _oracle(xc, w, pool, np.asarray(cu), slot_ids, has_init, t)
    q, k, v, _ = api.causal_conv1d_l2_varlen(x, w, pool, cu, ids, hi, num_k_heads=HK, num_v_heads=HV, head_dim=24,
                                             block_cols=cols, backend="pallas_interpret")
    got = np.concatenate([np.asarray(a).reshape(t, -1) for a in (q, k, v)], 1)
    np.testing.assert_allclose(got, want_y, atol=2e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_80b_dims_on_gpu(dtype):
    """Qwen3-Next-80B GDN dims (16 / 32 heads x 128, conv 4, fused in_proj_qkvz source), varlen16 lengths padded to
    19456 tokens with NaN padding rows, half the streams continuing from random states: the compiled kernel against
    the XLA form and, for the first 2000 tokens, against the float64 oracle (fp32: 1e-5 abs; bf16: 1.6e-2 abs +
    8e-3 relative: q, k are L2-normed (<= 1) but v is SiLU of the conv, up to ~9 here, where one bf16 ulp is
    0.0625, so an absolute bound alone fails on correct values: the first H200 run had 6 of 16.1M elements
    1 ulp off, 3.3e-3 relative); padding rows zero; the pools equal."""
    from benchmarks.cases import VARLEN16_LENS
    hk, hv, d, kc = 16, 32, 128, 4
    c = (2 * hk + hv) * d
    lens = list(VARLEN16_LENS)
    t, n = 19456, len(lens)
    rng = np.random.default_rng(0)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cols = reference.qkvz_block_cols(hk, hv, d)
    src = rng.standard_normal((t, 2 * hk * d + 2 * hv * d)).astype(np.float32)
    src[cu[-1]:] = np.nan
    x = jnp.asarray(src, dtype)
    w = jnp.asarray(rng.standard_normal((c, kc)) * 0.5, jnp.float32).astype(dtype)
    pool = jnp.asarray(rng.standard_normal((n + 2, c, kc - 1)), jnp.float32).astype(dtype)
    ids = jnp.arange(n, dtype=jnp.int32)
    hi = jnp.asarray(np.arange(n) % 2 == 1)
    outs = {be: jax.jit(lambda x, pool, be=be: api.causal_conv1d_l2_varlen(
        x, w, pool, jnp.asarray(cu), ids, hi, num_k_heads=hk, num_v_heads=hv, head_dim=d, block_cols=cols,
        backend=be))(x, pool) for be in ("xla", "pallas")}
    tol = dict(atol=1e-5, rtol=0) if dtype == "float32" else dict(atol=1.6e-2, rtol=8e-3)
    for a, b in zip(outs["xla"][:3], outs["pallas"][:3]):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        assert np.isfinite(b).all() and not b[cu[-1]:].any()
        np.testing.assert_allclose(b, a, **tol)
    np.testing.assert_array_equal(np.asarray(outs["xla"][3].astype(jnp.float32)),
                                  np.asarray(outs["pallas"][3].astype(jnp.float32)))
    # float64 oracle on the first streams (up to 2000 tokens)
    m = int(np.searchsorted(cu, 2000, side="right")) - 1
    src_index = reference.channel_source_index(cols, d, c)
    xc = np.asarray(x.astype(jnp.float32))[:cu[m], src_index].astype(np.float64)
    w64, pool64 = np.asarray(w.astype(jnp.float32), np.float64), np.asarray(pool.astype(jnp.float32), np.float64)
    y = np.zeros((cu[m], c))
    for s in range(m):
        prev = pool64[s] if hi[s] else np.zeros((c, kc - 1))
        xs = np.concatenate([prev.T, xc[cu[s]:cu[s + 1]]], 0)
        for i in range(cu[s + 1] - cu[s]):
            acc = (xs[i:i + kc] * w64.T).sum(0)
            y[cu[s] + i] = acc / (1 + np.exp(-acc))
    for lo, hi_ in ((0, hk * d), (hk * d, 2 * hk * d)):
        h = y[:, lo:hi_].reshape(len(y), -1, d)
        y[:, lo:hi_] = (h / np.sqrt((h * h).sum(-1, keepdims=True) + 1e-6)).reshape(len(y), -1)
    got = np.concatenate([np.asarray(a.astype(jnp.float32))[:cu[m]].reshape(cu[m], -1) for a in outs["pallas"][:3]],
                         1)
    np.testing.assert_allclose(got, y, **tol)
