"""The conv1d decode step (pallas_kernels/conv1d/decode.py through api.causal_conv1d_l2_decode): ONE token per stream,
the conv state of each stream's slot read and advanced in place. The Pallas kernel (interpret mode) and the XLA form
against a float64 NumPy oracle; the kernel's Triton lowering (cross-lowered for CUDA).

Cases: N = 1 and N = 7 streams, permuted slot ids, padding streams (id S) and a negative id (zeros read, nothing
written), a fresh stream over a NaN-poisoned slot, NaN-poisoned untouched slots, grouped heads (Hv = 2 Hk and 3 Hk),
the identity and Qwen3-Next's fused in_proj_qkvz source layouts (z columns NaN: never read), Kc = 4 and 2.
Tolerances: fp32 2e-5 abs (Kc fp32 products, a normalisation); bf16 2e-2 abs (one bf16 rounding of values of order 1).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.conv1d import api, reference


def _oracle(xc, w, pool, ids, has, hk, d):
    """float64, one token per stream: y [N, C] (q, k heads normalised) in channel order and the new pool."""
    xc, w, pool = (np.asarray(a, np.float64) for a in (xc, w, pool))
    s, c, km1 = pool.shape
    y = np.zeros((len(ids), c))
    new_pool = pool.copy()
    for n, sid in enumerate(ids):
        ok = 0 <= sid < s
        prev = pool[sid] if (ok and has[n]) else np.zeros((c, km1))
        xs = np.concatenate([prev, xc[n][:, None]], axis=1)                           # [C, Kc]
        acc = (xs * w).sum(1)
        y[n] = acc / (1 + np.exp(-acc))
        if ok:
            new_pool[sid] = xs[:, 1:]
    kd = hk * d
    for lo, hi in ((0, kd), (kd, 2 * kd)):
        h = y[:, lo:hi].reshape(len(ids), -1, d)
        y[:, lo:hi] = (h / np.sqrt((h * h).sum(-1, keepdims=True) + 1e-6)).reshape(len(ids), -1)
    return y, new_pool


CASES = [  # (N, Hk, Hv, D, Kc, layout, ids)
    (7, 2, 4, 16, 4, "qkvz", [4, 6, -1, 0, 6 + 1, 2, 5]),         # -1 and S = 7
    (7, 1, 3, 16, 2, "identity", [3, 7, 1, 0, 2, 6, 5]),
    (1, 2, 4, 32, 4, "qkvz", [2]),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["pallas_interpret", "xla"])
@pytest.mark.parametrize("case", CASES, ids=["N7-r2-qkvz", "N7-r3-kc2-identity", "N1-qkvz"])
def test_conv1d_decode_matches_f64(case, backend, dtype):
    n, hk, hv, d, kc, layout, ids = case
    s = 7
    c = (2 * hk + hv) * d
    rng = np.random.default_rng(n * 10 + kc)
    ids = np.asarray(ids, np.int32)
    has = np.ones(n, bool)
    if n > 1:
        has[3] = False                                    # slot 0: stale NaN, read as zeros
    rnd = lambda a: np.array(jnp.asarray(a, dtype).astype(jnp.float32))
    xc = rnd(rng.standard_normal((n, c)))
    w = rnd(rng.standard_normal((c, kc)) * 0.5)
    pool = rnd(rng.standard_normal((s, c, kc - 1)))
    live = [int(i) for i in ids if 0 <= i < s]
    for sid in range(s):
        if sid not in live:
            pool[sid] = np.nan                            # untouched: stays NaN
    if n > 1:
        pool[0] = np.nan
    if layout == "qkvz":
        cols = reference.qkvz_block_cols(hk, hv, d)
        x = np.full((n, 2 * hk * d + 2 * hv * d), np.nan, np.float32)                  # z columns: NaN
        x[:, reference.channel_source_index(cols, d, c)] = xc
    else:
        cols, x = None, xc
    y_ref, pool_ref = _oracle(xc, w, np.nan_to_num(pool), ids, has, hk, d)
    fn = jax.jit(lambda x, w, pool: api.causal_conv1d_l2_decode(
        x, w, pool, jnp.asarray(ids), jnp.asarray(has), num_k_heads=hk, num_v_heads=hv, head_dim=d, block_cols=cols,
        backend=backend), donate_argnums=2)
    q, k, v, new_pool = fn(jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(pool, dtype))
    assert q.shape == (n, hk, d) and v.shape == (n, hv, d) and q.dtype == dtype and new_pool.dtype == dtype
    y = np.concatenate([np.asarray(a, np.float32).reshape(n, -1) for a in (q, k, v)], axis=1)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(y, y_ref, atol=tol, rtol=0)     # padding streams too: from zero states
    new_pool = np.asarray(new_pool, np.float32)
    np.testing.assert_allclose(new_pool[live], pool_ref[live], atol=tol, rtol=0)
    for sid in range(s):
        if sid not in live:
            assert np.isnan(new_pool[sid]).all(), sid     # ids -1 and S wrote nowhere


def test_conv1d_decode_errors_and_lowering():
    hk, hv, d = 1, 2, 16
    c = (2 * hk + hv) * d
    x, w, pool = jnp.zeros((2, c)), jnp.zeros((c, 4)), jnp.zeros((3, c, 3))
    kw = dict(num_k_heads=hk, num_v_heads=hv, head_dim=d, backend="pallas_interpret")
    with pytest.raises(ValueError, match="slot_ids must be"):
        api.causal_conv1d_l2_decode(x, w, pool, jnp.zeros((3,), jnp.int32), jnp.ones((3,), bool), **kw)
    with pytest.raises(ValueError, match="conv_state_pool must be"):
        api.causal_conv1d_l2_decode(x, w, pool[:, :, :2], jnp.zeros((2,), jnp.int32), jnp.ones((2,), bool), **kw)
    with pytest.raises(ValueError, match="power of two"):
        api.causal_conv1d_l2_decode(jnp.zeros((2, 4 * 24)), jnp.zeros((4 * 24, 4)), jnp.zeros((3, 4 * 24, 3)),
                                    jnp.zeros((2,), jnp.int32), jnp.ones((2,), bool), num_k_heads=1, num_v_heads=2,
                                    head_dim=24, backend="pallas_interpret")
    from pallas_kernels.conv1d.decode import conv1d_l2_decode_pallas
    cols = jnp.asarray(reference.qkvz_block_cols(2, 4, 128))
    f = lambda x, w, pool: conv1d_l2_decode_pallas(x, w, pool, jnp.arange(3), jnp.ones(3, bool), cols,
                                                   num_k_heads=2, num_v_heads=4, head_dim=128)
    text = jax.jit(f).trace(jnp.zeros((3, 12 * 128), jnp.bfloat16), jnp.zeros((8 * 128, 4)),
                            jnp.zeros((5, 8 * 128, 3), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "conv1d_decode" in text
