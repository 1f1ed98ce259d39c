"""The checks every backend of the fused causal conv1d + SiLU + q/k L2 norm passes (``pallas_kernels.conv1d.api``:
``causal_conv1d_l2_varlen`` for prefill, ``causal_conv1d_l2_decode`` for one token per stream), against a float64
NumPy loop per stream from its slot's conv state.

A backend's test file subclasses :class:`Conv1dBackendTest` and sets ``backend`` (and where they differ
``dtypes`` and ``head_dim``).

Shape legend: T stacked tokens, N streams, S slots, Hk / Hv key / value heads, D head dim, C = (2 Hk + Hv) D conv
channels ([q | k | v]), Kc kernel size.

Cases: streams of 1, 63, 64, 65 and 130 tokens and an empty one, tokens past cu_seqlens[N] NaN-poisoned (zero
rows, no state touched), a padding stream with slot id S and a stream with id -1 (zeros read, nothing written),
a fresh stream over a NaN-poisoned slot (reads zeros), an untouched NaN slot (stays NaN bit for bit), grouped
heads (Hv = 2 Hk), the identity and Qwen3-Next's fused in_proj_qkvz source layouts (the z columns NaN: never
read), Kc = 4 and 2, the pool donated under jit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.conv1d import api, reference

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
#: absolute error against float64 on the same rounded inputs: fp32 2e-5 (Kc fp32 products and a normalisation of
#: values of order 1); bf16 2e-2 (one bf16 rounding of the outputs, and of the pool's states)
TOL = {F32: 2e-5, BF16: 2e-2}
#: the advanced conv states (copies of the last Kc - 1 inputs, in the pool's dtype): fp32 1e-6, bf16 2e-2
POOL_TOL = {F32: 1e-6, BF16: 2e-2}
HK, HV = 2, 4
NUM_SLOTS = 7
#: (lengths, slot ids, has_initial_state) of the prefill streams; NUM_SLOTS names no slot, so does -1
PREFILL_STREAMS = ((1, 63, 0, 64, 65, 130, 0, 5),
                   (3, 0, 5, 1, 6, 2, NUM_SLOTS, -1),
                   (True, True, False, True, False, True, True, True))
PAD_TOKENS = 6
#: decode: slot ids (-1 and S name no slot) and has_initial_state of 7 streams
DECODE_IDS = (4, 6, -1, 0, NUM_SLOTS, 2, 5)
DECODE_HAS = (True, True, True, False, True, True, True)


def oracle(xc, w, pool, cu, ids, has, hk, d):
    """float64: y [T, C] in channel order (q, k heads L2-normalised, SiLU before) and the new pool."""
    xc, w, pool = (np.asarray(a, np.float64) for a in (xc, w, pool))
    s, c, km1 = pool.shape
    kc = km1 + 1
    y = np.zeros(xc.shape)
    new_pool = pool.copy()
    for n in range(len(cu) - 1):
        s0, s1, sid = int(cu[n]), int(cu[n + 1]), int(ids[n])
        ok = 0 <= sid < s
        prev = pool[sid] if (ok and has[n]) else np.zeros((c, km1))
        xs = np.concatenate([prev.T, xc[s0:s1]], 0)                                   # [Kc - 1 + L, C]
        for i in range(s1 - s0):
            acc = (xs[i:i + kc] * w.T).sum(0)
            y[s0 + i] = acc / (1 + np.exp(-acc))
        if ok:
            new_pool[sid] = xs[-km1:].T
    kd = hk * d
    for lo, hi in ((0, kd), (kd, 2 * kd)):
        h = y[:, lo:hi].reshape(len(y), -1, d)
        y[:, lo:hi] = (h / np.sqrt((h * h).sum(-1, keepdims=True) + 1e-6)).reshape(len(y), -1)
    return y, new_pool


class Conv1dBackendTest:
    """Checks of one backend of the fused conv1d. Subclass it as ``Test<Backend>`` and set ``backend``."""

    #: the api's backend name ("xla", "pallas_interpret", "pallas")
    backend: str = ""
    dtypes: tuple = (F32, BF16)
    head_dim: int = 16

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=[jnp.dtype(d).name for d in self.dtypes])
        if "layout" in metafunc.fixturenames:
            metafunc.parametrize("layout", ["identity", "qkvz"])

    def case(self, seed, t, kc, ids, has, layout, dtype):
        """(x as the op takes it, w, pool, block_cols) on the device and (xc [T, C], w, pool) rounded, float32."""
        d = self.head_dim
        c = (2 * HK + HV) * d
        rng = np.random.default_rng(seed)
        rnd = lambda a: np.array(jnp.asarray(a, dtype).astype(jnp.float32))
        xc = rnd(rng.standard_normal((t, c)))
        w = rnd(rng.standard_normal((c, kc)) * 0.5)
        pool = rnd(rng.standard_normal((NUM_SLOTS, c, kc - 1)))
        named = {int(i) for i in ids if 0 <= i < NUM_SLOTS}
        for sid in range(NUM_SLOTS):                      # untouched slots: NaN, must stay NaN
            if sid not in named:
                pool[sid] = np.nan
        for sid, h in zip(ids, has):                      # fresh streams over NaN-poisoned slots
            if 0 <= sid < NUM_SLOTS and not h:
                pool[sid] = np.nan
        if layout == "qkvz":
            cols = reference.qkvz_block_cols(HK, HV, d)
            x = np.full((t, 2 * HK * d + 2 * HV * d), np.nan, np.float32)             # z columns: NaN
            x[:, reference.channel_source_index(cols, d, c)] = xc
        else:
            cols, x = None, xc.copy()
        device = (jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(pool, dtype))
        return device, cols, (xc, w, pool)

    def check(self, q, k, v, new_pool, y_ref, pool_ref, pool, ids, rows, dtype):
        d = self.head_dim
        assert q.dtype == dtype and q.shape[1:] == (HK, d) and v.shape[1:] == (HV, d)
        assert new_pool.dtype == dtype
        y = np.concatenate([np.asarray(a.astype(jnp.float32)).reshape(a.shape[0], -1) for a in (q, k, v)], 1)
        np.testing.assert_allclose(y[:rows], y_ref[:rows], atol=TOL[dtype], rtol=0)
        new_pool = np.asarray(new_pool.astype(jnp.float32))
        named = [int(i) for i in ids if 0 <= i < NUM_SLOTS]
        np.testing.assert_allclose(new_pool[named], pool_ref[named], atol=POOL_TOL[dtype], rtol=0)
        for sid in range(NUM_SLOTS):
            if sid not in named:
                np.testing.assert_array_equal(new_pool[sid], pool[sid], err_msg=f"slot {sid} is named by no "
                                              "stream (ids -1 and S write nowhere)")
        return y

    def test_prefill_streams(self, dtype, layout):
        """PREFILL_STREAMS packed, then PAD_TOKENS NaN-poisoned tokens: rows match, padding rows are zero."""
        lens, ids, has = PREFILL_STREAMS
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        real = int(cu[-1])
        t = real + PAD_TOKENS
        (x, w, pool), cols, (xc, w64, pool64) = self.case(len(lens), t, 4, ids, has, layout, dtype)
        x = x.at[real:].set(jnp.nan)
        y_ref, pool_ref = oracle(xc[:real], w64, np.nan_to_num(pool64), cu, ids, has, HK, self.head_dim)
        fn = jax.jit(lambda x, w, pool, cu, ids, has: api.causal_conv1d_l2_varlen(
            x, w, pool, cu, ids, has, num_k_heads=HK, num_v_heads=HV, head_dim=self.head_dim, block_cols=cols,
            backend=self.backend), donate_argnums=2)
        q, k, v, new_pool = fn(x, w, pool, jnp.asarray(cu), jnp.asarray(ids, jnp.int32), jnp.asarray(has))
        y = self.check(q, k, v, new_pool, y_ref, pool_ref, pool64, ids, real, dtype)
        assert y.shape[0] == t
        np.testing.assert_array_equal(y[real:], 0.0, err_msg="padding tokens must give zero rows")

    def test_decode_streams(self, dtype, layout):
        """One token per stream (DECODE_IDS / DECODE_HAS), Kc = 4 and 2, the pool donated."""
        ids, has = np.asarray(DECODE_IDS, np.int32), np.asarray(DECODE_HAS)
        n = len(ids)
        for kc in (4, 2):
            (x, w, pool), cols, (xc, w64, pool64) = self.case(kc, n, kc, ids, has, layout, dtype)
            y_ref, pool_ref = oracle(xc, w64, np.nan_to_num(pool64), np.arange(n + 1), ids, has, HK,
                                     self.head_dim)
            fn = jax.jit(lambda x, w, pool: api.causal_conv1d_l2_decode(
                x, w, pool, jnp.asarray(ids), jnp.asarray(has), num_k_heads=HK, num_v_heads=HV,
                head_dim=self.head_dim, block_cols=cols, backend=self.backend), donate_argnums=2)
            q, k, v, new_pool = fn(x, w, pool)
            self.check(q, k, v, new_pool, y_ref, pool_ref, pool64, ids, n, dtype)

    def test_prefill_gradients(self):
        """jax.grad through the prefill op (fp32, identity layout, no NaN slots) equals the XLA form's gradients of x,
        w and the pool (the kernels' VJP is the XLA form's, evaluated at the same inputs), and is finite."""
        lens, ids, has = (3, 0, 20, 5), (2, 0, 5, NUM_SLOTS), (True, False, True, True)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        (x, w, pool), _, _ = self.case(11, int(cu[-1]) + 2, 4, ids, has, "identity", F32)
        pool = jnp.nan_to_num(pool)
        rng = np.random.default_rng(12)
        d = self.head_dim
        cot = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
               ((x.shape[0], HK, d), (x.shape[0], HK, d), (x.shape[0], HV, d), pool.shape)]

        def loss(x, w, pool, backend):
            outs = api.causal_conv1d_l2_varlen(x, w, pool, cu, jnp.asarray(ids, jnp.int32), jnp.asarray(has),
                                               num_k_heads=HK, num_v_heads=HV, head_dim=d, backend=backend)
            return sum(jnp.sum(o * c) for o, c in zip(outs, cot))
        got = jax.grad(loss, argnums=(0, 1, 2))(x, w, pool, self.backend)
        want = jax.grad(loss, argnums=(0, 1, 2))(x, w, pool, "xla")
        for name, a, b in zip(("x", "w", "pool"), got, want):
            assert np.isfinite(np.asarray(a)).all(), name
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
