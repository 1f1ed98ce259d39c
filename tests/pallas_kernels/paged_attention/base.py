"""The checks every backend of paged causal attention passes (``pallas_kernels.paged_attention.api``:
``paged_attention`` for prefill, ``paged_attention_decode`` for one query per stream), against a float64 NumPy
softmax attention per stream.

A backend's test file subclasses :class:`PagedAttentionBackendTest` and sets ``backend`` (and where they differ
``dtypes``, ``head_dim``, ``matmul_precision``).

Shape legend: T stacked query tokens, N streams, S slots, H query heads, Hkv kv heads (G = H / Hkv), Dh head dim,
P pages, Ps tokens per page, W pages per slot in the page table.

Every case: streams continuing context already in their pages (old tokens) plus this call's new tokens, pages
handed out in a shuffled order, free pages and page tails NaN-poisoned, page-table entries past a slot's pages
pointing at other slots' pages or out of range, stale page-table rows and lengths of idle slots, padding tokens
past cu_seqlens[N] and zero-length padding streams with slot id S (zero rows).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import api
from tests.numpy_reference import rel_rms

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
#: relative RMS per stream against float64 on the same rounded inputs: fp32 1e-5 (fp32 scores and softmax),
#: bf16 2e-2 (bf16 probabilities into the value product, o stored in bf16)
TOL = {F32: 1e-5, BF16: 2e-2}
#: prefill streams (slot, old tokens, new tokens): new lengths 1, 63, 64, 65, 130 around the 64-token tiles
STREAMS_ODD = ((2, 0, 1), (0, 13, 63), (5, 64, 64), (3, 0, 65), (1, 7, 130))
#: decode contexts (tokens in the slot, this step's included)
DECODE_CONTEXTS = (1, 63, 64, 65, 130, 300)


def _round(x, dtype):
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


@dataclasses.dataclass
class Case:
    """One call: the op's arrays (float64, NaN where nothing was written) and, per stream, (slot, old, new,
    k [old + new, Hkv, Dh], v) in float64 (slot -1: a padding stream)."""

    q: np.ndarray
    k_pages: np.ndarray
    v_pages: np.ndarray
    page_table: np.ndarray
    slot_lens: np.ndarray
    cu: np.ndarray
    slot_ids: np.ndarray
    streams: list

    def args(self, dtype):
        return (jnp.asarray(self.q, dtype), jnp.asarray(self.k_pages, dtype), jnp.asarray(self.v_pages, dtype),
                jnp.asarray(self.page_table), jnp.asarray(self.slot_lens), jnp.asarray(self.cu),
                jnp.asarray(self.slot_ids))


def make_case(rng, *, streams, hkv=2, group=4, dh=32, ps=16, num_slots=6, width=None, pad_tokens=3,
              pad_streams=1, dtype=F32, num_pages=None):
    """``streams``: (slot, old, new) per real stream; every old and new token's K/V already in its pages, handed
    out in a shuffled order. ``width`` / ``num_pages``: the page table's columns and the pool's pages (default: as
    many as the streams need, plus spare)."""
    h = hkv * group
    need = {s: -(-(o + n) // ps) for s, o, n in streams}
    width = width or max(max(need.values()) + 2, 2)
    num_pages = num_pages or sum(need.values()) + 5
    k_pages = np.full((num_pages, ps, hkv, dh), np.nan)
    v_pages = np.full((num_pages, ps, hkv, dh), np.nan)
    order = list(rng.permutation(num_pages))
    page_table = rng.integers(-3, num_pages + 3, (num_slots, width)).astype(np.int32)   # stale rows
    slot_lens = rng.integers(0, 50, num_slots).astype(np.int32)                          # idle slots: stale
    out_streams, qs, owned = [], [], []
    for s, o, n in streams:
        pages = [order.pop() for _ in range(need[s])]
        owned.append(pages)
        page_table[s, :need[s]] = pages
        slot_lens[s] = o + n
        kk = _round(rng.standard_normal((o + n, hkv, dh)), dtype)
        vv = _round(rng.standard_normal((o + n, hkv, dh)), dtype)
        for pos in range(o + n):
            k_pages[pages[pos // ps], pos % ps] = kk[pos]
            v_pages[pages[pos // ps], pos % ps] = vv[pos]
        out_streams.append((s, o, n, kk, vv))
        qs.append(_round(rng.standard_normal((n, h, dh)), dtype))
    for i, (s, o, n) in enumerate(streams):      # entries past a slot's pages: other slots' pages, out of range
        others = [p for j, pg in enumerate(owned) if j != i for p in pg] or [0]
        for c in range(need[s], width):
            page_table[s, c] = rng.choice(others) if c % 2 else num_pages + c
    lens = [n for _, _, n in streams] + [0] * pad_streams
    ids = [s for s, _, _ in streams] + [num_slots] * pad_streams
    out_streams += [(-1, 0, 0, None, None)] * pad_streams
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = np.concatenate(qs + [_round(rng.standard_normal((pad_tokens, h, dh)), dtype)], axis=0)
    return Case(q, k_pages, v_pages, page_table, slot_lens, cu, np.asarray(ids, np.int32), out_streams)


def oracle(case: Case, scale: float) -> np.ndarray:
    """float64 [T, H, Dh]: causal softmax attention of each stream over its slot; zeros for padding tokens."""
    t, h, dh = case.q.shape
    out = np.zeros((t, h, dh))
    for i, (s, o, n, kk, vv) in enumerate(case.streams):
        if s < 0 or n == 0:
            continue
        q = case.q[case.cu[i]:case.cu[i] + n]
        g = h // kk.shape[1]
        kr, vr = np.repeat(kk, g, axis=1), np.repeat(vv, g, axis=1)
        sc = np.einsum("qhd,khd->hqk", q, kr) * scale
        mask = np.arange(o + n)[None, :] <= (o + np.arange(n))[:, None]
        sc = np.where(mask[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        out[case.cu[i]:case.cu[i] + n] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vr)
    return out


class PagedAttentionBackendTest:
    """Checks of one backend of paged attention. Subclass it as ``Test<Backend>`` and set ``backend``."""

    #: the api's backend name ("xla", "pallas_interpret", "pallas", "cudnn", "cudnn_xla")
    backend: str = ""
    dtypes: tuple = (F32, BF16)
    head_dim: int = 32
    #: jax_default_matmul_precision around the calls (None: leave it)
    matmul_precision: Optional[str] = None

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=[jnp.dtype(d).name for d in self.dtypes])

    def precision(self):
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    def check_prefill(self, case, scale, dtype):
        with self.precision():
            out = jax.jit(lambda *a: api.paged_attention(*a, scale=scale, backend=self.backend))(*case.args(dtype))
        assert out.dtype == dtype
        out = np.asarray(out.astype(jnp.float32), np.float64)
        ref = oracle(case, scale)
        assert out.shape == ref.shape and np.isfinite(out).all()
        for i, (s, o, n, _, _) in enumerate(case.streams):
            rows = slice(case.cu[i], case.cu[i] + n)
            if s >= 0 and n:
                err = rel_rms(out[rows], ref[rows])
                assert err <= TOL[dtype], f"stream {i} (slot {s}, {o} old + {n} new): rel RMS {err:.3e}"
        np.testing.assert_array_equal(out[case.cu[-1]:], 0.0, err_msg="padding tokens must give zero rows")

    def test_prefill_odd_lengths_continued_streams(self, dtype):
        """STREAMS_ODD over shuffled pages, G = 4 query heads per kv head, Hkv = 2."""
        case = make_case(np.random.default_rng(0), streams=STREAMS_ODD, hkv=2, group=4, dh=self.head_dim,
                         dtype=dtype)
        self.check_prefill(case, self.head_dim ** -0.5, dtype)

    def test_prefill_grouped_heads(self, dtype):
        """G = 1 (Hkv = 3), G = 3 (Hkv = 2) and G = 8 (Hkv = 1) (the dtypes after the first: G = 8), 8-token pages,
        two padding streams and no padding tokens."""
        full = jnp.dtype(dtype) == jnp.dtype(self.dtypes[0])
        for group, hkv in ((1, 3), (3, 2), (8, 1)) if full else ((8, 1),):
            case = make_case(np.random.default_rng(group), streams=[(4, 20, 33), (0, 0, 70), (1, 100, 2)],
                             hkv=hkv, group=group, dh=self.head_dim, ps=8, pad_streams=2, pad_tokens=0,
                             dtype=dtype)
            self.check_prefill(case, 0.3, dtype)

    def test_decode(self, dtype):
        """One query per stream at the end of DECODE_CONTEXTS tokens, permuted slots, two idle slots, a padding
        stream (slot id S) whose query row is 7.0 everywhere: its output is zeros."""
        rng = np.random.default_rng(11)
        perm = rng.permutation(len(DECODE_CONTEXTS) + 2)
        streams = [(int(perm[i]), c - 1, 1) for i, c in enumerate(DECODE_CONTEXTS)]
        case = make_case(rng, streams=streams, hkv=2, group=4, dh=self.head_dim,
                         num_slots=len(DECODE_CONTEXTS) + 2, pad_tokens=0, pad_streams=1, dtype=dtype)
        q, kp, vp, pt, sl, _, ids = case.args(dtype)
        q = jnp.concatenate([q, jnp.full((1,) + q.shape[1:], 7.0, dtype)])
        with self.precision():
            out = jax.jit(lambda *a: api.paged_attention_decode(*a, scale=0.25, backend=self.backend))(
                q, kp, vp, pt, sl, ids)
        assert out.dtype == dtype
        out = np.asarray(out.astype(jnp.float32), np.float64)
        ref = oracle(case, 0.25)
        for i, ctx in enumerate(DECODE_CONTEXTS):
            err = rel_rms(out[i], ref[i])
            assert err <= TOL[dtype], f"stream {i} (context {ctx}): rel RMS {err:.3e}"
        np.testing.assert_array_equal(out[len(DECODE_CONTEXTS):], 0.0, err_msg="padding stream: zeros")

    def test_prefill_gradients(self):
        """jax.grad through the prefill op (fp32) equals the XLA form's gradients of q and both page pools (the
        kernels' VJP is the XLA form's, evaluated at the same inputs), and is finite."""
        if F32 not in self.dtypes:
            pytest.skip("the backend takes no fp32 (its bf16 forward is checked above)")
        case = make_case(np.random.default_rng(3), streams=STREAMS_ODD, hkv=2, group=4, dh=self.head_dim, dtype=F32)
        args = case.args(F32)
        cot = jnp.asarray(np.random.default_rng(4).standard_normal(args[0].shape), jnp.float32)
        scale = self.head_dim ** -0.5

        def loss(q, kp, vp, backend):
            return jnp.sum(api.paged_attention(q, kp, vp, *args[3:], scale=scale, backend=backend) * cot)
        with self.precision():
            got = jax.grad(loss, argnums=(0, 1, 2))(*args[:3], self.backend)
            want = jax.grad(loss, argnums=(0, 1, 2))(*args[:3], "xla")
        for name, a, b in zip(("q", "k_pages", "v_pages"), got, want):
            a = np.asarray(a)
            assert np.isfinite(a).all(), name
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
