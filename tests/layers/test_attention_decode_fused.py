"""The fused attention decode step (attention_layer(decode=True, fused=True): one K/V write kernel, the gated
decode kernel, o_proj) against the unfused layer (XLA norms / RoPE / scatters / gate) on the same inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.config import AttnDims
from jax_gdn.layers import attention as A
from jax_gdn.options import RuntimeOptions
from jax_gdn.state import KvPages


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


@pytest.mark.parametrize("backend,qkv,dtype,tol", [("pallas_interpret", False, jnp.float32, 1e-5),
                                                   ("pallas_interpret", True, jnp.bfloat16, 2e-2),
                                                   ("xla", True, jnp.float32, 1e-5)])
def test_fused_decode_step_matches_unfused(backend, qkv, dtype, tol):
    """4 streams with contexts 0, 62, 64, 129 (+1 new token) in permuted slots and shuffled pages, one padding
    stream (slot id S, page id P: writes nothing, reads nothing); the same output rows and the same pools."""
    rng = np.random.default_rng(3)
    d, h, hkv, dh, ps, w, s = 32, 4, 2, 16, 8, 20, 6
    dims = AttnDims(hidden_size=d, num_heads=h, num_kv_heads=hkv, head_dim=dh, partial_rotary_factor=0.5,
                    rope_theta=1000.0)
    shapes = {"q_proj": (d, h * 2 * dh), "k_proj": (d, hkv * dh), "v_proj": (d, hkv * dh), "o_proj": (h * dh, d)}
    params = {n: jnp.asarray(rng.standard_normal(sh) / np.sqrt(sh[0]), dtype) for n, sh in shapes.items()}
    params["q_norm"] = jnp.asarray(0.1 * rng.standard_normal(dh), jnp.float32)
    params["k_norm"] = jnp.asarray(0.1 * rng.standard_normal(dh), jnp.float32)
    if qkv:
        params = A.fuse_qkv(params)
    p = s * w
    kv = KvPages(k_pages=jnp.asarray(rng.standard_normal((p, ps, hkv, dh)), dtype),
                 v_pages=jnp.asarray(rng.standard_normal((p, ps, hkv, dh)), dtype))
    table = rng.permutation(p).astype(np.int32).reshape(s, w)
    ctx = np.array([0, 62, 64, 129])
    slots = np.array([4, 0, 5, 2, s], np.int32)                      # the last: a padding stream
    n = len(slots)
    pos = np.r_[ctx, 0].astype(np.int32)
    slot_lens = np.zeros(s, np.int32)
    slot_lens[slots[:4]] = ctx + 1
    tok_page = np.r_[table[slots[:4], ctx // ps], p].astype(np.int32)
    x = jnp.asarray(rng.standard_normal((n, d)), dtype)
    meta = dict(token_pos=jnp.asarray(pos), token_page=jnp.asarray(tok_page), token_offset=jnp.asarray(pos % ps),
                page_table=jnp.asarray(table), slot_lens=jnp.asarray(slot_lens),
                cu_seqlens=jnp.arange(n + 1, dtype=jnp.int32), slot_ids=jnp.asarray(slots))
    ref, kv_ref = A.attention_layer(params, dims, x, kv, decode=True, backend="xla", fused=False, **meta)
    out, kv_out = jax.jit(lambda x, kv: A.attention_layer(params, dims, x, kv, decode=True, backend=backend,
                                                          fused=True, **meta))(x, kv)
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)   # noqa: E731
    for i in range(4):
        assert _rel(f(out)[i], f(ref)[i]) <= tol, f"stream {i} (context {ctx[i]})"
    np.testing.assert_array_equal(f(out)[4], 0.0)                    # no slot: o is zero, o_proj(0) = 0
    np.testing.assert_allclose(f(kv_out.k_pages), f(kv_ref.k_pages), atol=0 if dtype == jnp.float32 else 1e-2,
                               rtol=1e-5 if dtype == jnp.float32 else 1e-2)
    np.testing.assert_array_equal(f(kv_out.v_pages), f(kv_ref.v_pages))


def test_decode_fused_switch(monkeypatch):
    """fused=None follows RuntimeOptions.attention_decode_fused on the Pallas backends with qkv_proj held, never on "xla" or with three
    projection weights."""
    calls = []
    monkeypatch.setattr(A, "attention_decode_fused", lambda *a, **k: calls.append(k["backend"]) or (a[2], a[3]))
    d, h, hkv, dh = 16, 2, 1, 8
    dims = AttnDims(hidden_size=d, num_heads=h, num_kv_heads=hkv, head_dim=dh)
    params3 = {k: jnp.zeros(v, jnp.float32) for k, v in A.attention_param_shapes(dims).items()}
    params = A.fuse_qkv(params3)
    kv = KvPages(k_pages=jnp.zeros((4, 8, hkv, dh)), v_pages=jnp.zeros((4, 8, hkv, dh)))
    meta = dict(token_pos=jnp.zeros(1, jnp.int32), token_page=jnp.zeros(1, jnp.int32),
                token_offset=jnp.zeros(1, jnp.int32), page_table=jnp.zeros((1, 4), jnp.int32),
                slot_lens=jnp.ones(1, jnp.int32), cu_seqlens=jnp.arange(2, dtype=jnp.int32),
                slot_ids=jnp.zeros(1, jnp.int32))
    x = jnp.ones((1, d))
    for flag, backend, p, want in ((False, "pallas_interpret", params, 0), (True, "pallas_interpret", params, 1),
                                   (True, "xla", params, 1), (True, "pallas_interpret", params3, 1)):
        A.attention_layer(p, dims, x, kv, decode=True, backend=backend,
                          options=RuntimeOptions(attention_decode_fused=flag), **meta)
        assert len(calls) == want, (flag, backend)
