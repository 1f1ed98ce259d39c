"""The cuDNN prefill backend of paged attention (pallas_kernels/paged_attention/cudnn.py).

On CPU: everything but the cuDNN call itself, through backend "cudnn_xla" (the same packing of the pages into one
K/V buffer, the same per-segment offsets, the same two-call split and LSE merge, with ``segments_xla`` standing
in for cuDNN; it leaves NaN on rows no segment covers, as cuDNN leaves them unwritten) against the float64 oracle
of test_triton.py: streams of 1, 63, 64, 65, 130 tokens continuing 0-300 tokens of context, GQA, pages in
a shuffled order, NaN-poisoned free pages and page tails, padding tokens and streams. Also jax's conversion of our
token offsets into cuDNN's element offsets (the GQA scaling jax applied before its fix), capacity overflow, page
ids out of range under jit, the fresh-only switch, the decode and gated entries, the backend checks.
On a GPU (``gpu`` marker): the real cuDNN call against the same oracle at head dim 256 / 128.
Tolerances (relative RMS per stream, against float64): fp32 1e-5 (stand-in), bf16 / fp16 2e-2.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import registry
from pallas_kernels.paged_attention import api, cudnn
from pallas_kernels.paged_attention.cudnn import CudnnConfig
from tests.pallas_kernels.paged_attention.test_triton import (STREAMS_ODD, check_against_oracle, make_case, oracle,
                                                       rel_rms)


def _run(case, dtype, scale, **kw):
    fn = jax.jit(lambda *a: cudnn.paged_attention_prefill_cudnn(*a, scale=scale, impl="xla", **kw))
    return fn(*case.args(dtype))


@pytest.mark.parametrize("dtype,stats_rows", [(jnp.float32, "segment"), (jnp.bfloat16, "segment"),
                                              (jnp.float32, "packed")])
def test_odd_lengths_continued_streams(dtype, stats_rows, monkeypatch):
    """Also with the other statistics layout (``cudnn.STATS_ROWS``: LSE rows at the packed token index)."""
    monkeypatch.setattr(cudnn, "STATS_ROWS", stats_rows)
    api._prefill_jit.clear_cache()
    rng = np.random.default_rng(0)
    case = make_case(rng, streams=STREAMS_ODD, hkv=2, group=4, dh=32, dtype=dtype)
    out = api.paged_attention(*case.args(dtype), scale=32 ** -0.5, backend="cudnn_xla")
    assert out.dtype == jnp.dtype(dtype)
    check_against_oracle(case, out, 32 ** -0.5, dtype)


@pytest.mark.parametrize("group,hkv,dh,align", [(1, 3, 64, 1), (8, 1, 32, 8), (4, 2, 16, 4)])
def test_gqa_and_aligned_regions(group, hkv, dh, align):
    """align = G is the layout used where jax scales kv offsets by the query heads (regions start at multiples
    of G tokens); it must give the same answer."""
    rng = np.random.default_rng(group + align)
    case = make_case(rng, streams=[(4, 20, 33), (0, 0, 70), (1, 100, 2), (2, 0, 1)], hkv=hkv, group=group, dh=dh,
                     ps=8)
    out = _run(case, jnp.float32, 0.3, align=align)
    check_against_oracle(case, out, 0.3, jnp.float32)


def test_cudnn_impl_path_with_the_call_stood_in(monkeypatch):
    """impl="cudnn" end to end on CPU with only the custom call replaced: jax's offset unit (G on jax before PR
    39521), the G-aligned regions, the kv offsets passed in units, then the stand-in reading them back."""
    seen = {}

    def fake(q, k, v, seg, *, causal, scale, unit):
        seen["unit"] = unit
        kv_off = jnp.where(seg.kv_off >= 0, seg.kv_off // unit, -1)            # what segments_cudnn passes on
        back = jnp.where(kv_off >= 0, kv_off * unit, -1)                        # what cuDNN then addresses
        return cudnn.segments_xla(q, k, v, seg._replace(kv_off=back), causal=causal, scale=scale)
    monkeypatch.setattr(cudnn, "segments_cudnn", fake)
    rng = np.random.default_rng(12)
    case = make_case(rng, streams=[(0, 13, 63), (2, 0, 1), (1, 64, 65)], hkv=2, group=8, dh=32)
    out = jax.jit(lambda *a: cudnn.paged_attention_prefill_cudnn(*a, scale=0.2, impl="cudnn"))(
        *case.args(jnp.bfloat16))
    assert seen["unit"] == cudnn.kv_offset_unit(16, 2, 32)
    check_against_oracle(case, out, 0.2, jnp.bfloat16)


def test_fresh_only_switch_gives_zero_rows_to_continued_streams():
    rng = np.random.default_rng(2)
    case = make_case(rng, streams=[(0, 0, 63), (1, 9, 20), (2, 0, 65)], group=2, dh=32)
    out = np.asarray(_run(case, jnp.float32, 0.2, config=CudnnConfig(context=False)))
    ref = oracle(case, 0.2)
    for i, (s, o, n, _, _) in enumerate(case.streams):
        rows = slice(case.cu[i], case.cu[i] + n)
        if s >= 0 and n and o == 0:
            assert rel_rms(out[rows], ref[rows]) <= 1e-5, i
        elif n:
            np.testing.assert_array_equal(out[rows], 0.0)
    np.testing.assert_array_equal(out[case.cu[-1]:], 0.0)


def test_one_program_for_any_lengths():
    rng = np.random.default_rng(3)
    api._prefill_jit.clear_cache()
    for streams in ([(0, 0, 40), (1, 5, 24)], [(1, 70, 1), (0, 0, 63)]):
        case = make_case(rng, streams=streams, group=2, dh=32, width=8, num_pages=14, pad_tokens=4)
        out = api.paged_attention(*case.args(jnp.float32), scale=0.2, backend="cudnn_xla")
        check_against_oracle(case, out, 0.2, jnp.float32)
    assert api._prefill_jit._cache_size() == 1


def test_capacity_overflow_gives_zero_rows_never_wrong_ones():
    """Streams whose region would pass the buffer's K rows read nothing; those before them are exact."""
    rng = np.random.default_rng(4)
    case = make_case(rng, streams=[(0, 10, 20), (1, 50, 30)], group=2, dh=32, pad_streams=0, pad_tokens=0)
    out = np.asarray(_run(case, jnp.float32, 0.2, config=CudnnConfig(kv_capacity=40)))
    ref = oracle(case, 0.2)
    assert rel_rms(out[:20], ref[:20]) <= 1e-5
    np.testing.assert_array_equal(out[20:], 0.0)


def test_out_of_range_pages_under_jit_are_zero_keys_and_read_no_other_slot():
    """The documented deviation: a live key on a page id outside [0, P) is a zero vector (score 0, value 0)."""
    rng = np.random.default_rng(5)
    case = make_case(rng, streams=[(0, 30, 10), (1, 0, 20)], group=2, dh=32, ps=8)
    case.page_table[0, 1] = case.k_pages.shape[0] + 4        # keys 8..15 of slot 0: no page
    case.page_table[0, 2] = -1                                # keys 16..23
    out = np.asarray(_run(case, jnp.float32, 0.2))
    assert np.all(np.isfinite(out))
    s, o, n, kk, vv = case.streams[0]
    kk, vv = kk.copy(), vv.copy()
    kk[8:24] = 0.0
    vv[8:24] = 0.0
    case.streams[0] = (s, o, n, kk, vv)
    ref = oracle(case, 0.2)
    assert rel_rms(out[:30], ref[:30]) <= 1e-5


def test_jax_offsets_become_cudnn_element_offsets():
    """Our segments through jax's own ``_fix_seqlen_offsets`` (the step before the custom call): every live
    segment's q / kv element offset is its first token times H Dh / Hkv Dh, whichever way this jax scales kv."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    h, hkv, dh = 16, 2, 32
    unit = cudnn.kv_offset_unit(h, hkv, dh)
    assert unit in (1, h // hkv)
    rng = np.random.default_rng(6)
    case = make_case(rng, streams=[(0, 9, 5), (1, 0, 3), (2, 17, 11)], hkv=hkv, group=h // hkv, dh=dh, ps=8)
    q, kp, vp, pt, sl, cu, ids = case.args(jnp.bfloat16)
    cap = cudnn.default_capacity(q.shape[0], ids.shape[0], kp.shape[0], 8, pt.shape[1], unit, True)
    assert cap % unit == 0
    pk = jax.jit(lambda *a: cudnn.build_packing(*a, num_pages=kp.shape[0], page_size=8, capacity=cap,
                                                align=unit, context=True))(pt, sl, cu, ids)
    assert np.all(np.asarray(pk.kv_start) % unit == 0) and np.all(np.asarray(pk.ctx_pad) % unit == 0)
    qs, ks = jax.ShapeDtypeStruct((1, q.shape[0], h, dh), q.dtype), jax.ShapeDtypeStruct((1, cap, hkv, dh), q.dtype)

    @jax.jit
    def fixed(pk, cu):
        seg = cudnn._segments(pk.live, cu[:-1], pk.length, pk.kv_start + pk.ctx_pad, pk.length, m=4,
                              q_end=q.shape[0], kv_end=cap)
        kv_off = jnp.where(seg.kv_off >= 0, seg.kv_off // unit, -1)
        return fa._fix_seqlen_offsets(seg.q_len, seg.kv_len, seg.q_off, kv_off, qs, ks)
    q_len, kv_len, q_off, kv_el = fixed(pk, cu)
    live = np.asarray(pk.live)
    starts = np.asarray(cu[:-1])[live]
    kv_starts = np.asarray(pk.kv_start + pk.ctx_pad)[live]
    k = int(live.sum())
    np.testing.assert_array_equal(np.asarray(q_len)[0, :k], np.asarray(pk.length)[live])
    np.testing.assert_array_equal(np.asarray(q_off)[0, :k], starts * h * dh)
    np.testing.assert_array_equal(np.asarray(kv_el)[0, :k], kv_starts * hkv * dh)
    np.testing.assert_array_equal(np.asarray(q_len)[0, k:], 0)               # dropped: zero-length segments


def test_gated_and_decode_entries():
    rng = np.random.default_rng(8)
    case = make_case(rng, streams=[(0, 12, 17), (2, 0, 64)], group=2, dh=16)
    q, kp, vp, pt, sl, cu, ids = case.args(jnp.float32)
    t, h, dh = q.shape
    qg = jnp.asarray(rng.standard_normal((t, h * 2 * dh)), jnp.float32)
    q_norm = jnp.asarray(0.1 * rng.standard_normal(dh), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)
    cos, sin = jnp.cos(pos[:, None] * 0.1 * jnp.ones((1, 8))), jnp.sin(pos[:, None] * 0.1 * jnp.ones((1, 8)))
    args = (qg, kp, vp, pt, sl, cu, ids)
    kw = dict(q_norm=q_norm, cos=cos, sin=sin, num_heads=h, scale=0.25)
    ours = api.paged_attention_gated(*args, backend="cudnn_xla", **kw)
    ref = api.paged_attention_gated(*args, backend="xla", **kw)
    live = int(case.cu[-1])
    assert rel_rms(ours[:live], ref[:live]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(ours[live:]), 0.0)
    # decode on this backend is the XLA / Pallas decode (the cuDNN path is prefill only)
    qd = q[:2]
    dec = api.paged_attention_decode(qd, kp, vp, pt, sl, ids[:2], scale=0.25, backend="cudnn_xla")
    np.testing.assert_array_equal(np.asarray(dec), np.asarray(
        api.paged_attention_decode(qd, kp, vp, pt, sl, ids[:2], scale=0.25, backend="xla")))
    dims = dict(dtype=jnp.bfloat16, head_dim=256, num_heads=16, num_kv_heads=2)
    assert api.decode_backend("cudnn_xla", **dims) == "xla"
    assert api.decode_backend("cudnn", **dims) == ("pallas" if jax.default_backend() == "gpu" else "xla")


def test_supports_and_backend_checks():
    dims = dict(head_dim=256, num_heads=16, num_kv_heads=2)
    assert "bfloat16 or float16" in cudnn.supports(platform="gpu", dtype=jnp.float32, **dims)
    assert "multiples of 8 up to 256" in cudnn.supports(platform="gpu", dtype=jnp.bfloat16,
                                                       **dict(dims, head_dim=320))
    assert "needs a CUDA GPU" in cudnn.supports(platform="cpu", dtype=jnp.bfloat16, **dims)
    assert "multiple of num_kv_heads" in cudnn.supports(platform="xla", dtype=jnp.float32,
                                                       **dict(dims, num_kv_heads=3))
    assert cudnn.supports(platform="xla", dtype=jnp.float32, **dims) is None
    case = dict(platform=jax.default_backend(), dtype=jnp.bfloat16, **dims)
    # "auto" never picks cuDNN where its row may not be picked by "auto", nor the stand-in ever
    no_auto_cudnn = dataclasses.replace(api.TABLE, implementations=tuple(
        dataclasses.replace(i, auto=False) if i.name == "cudnn" else i for i in api.TABLE.implementations))
    gpu_case = api.PagedCase("prefill", "gpu", jnp.bfloat16, hopper=True, **dims)
    assert api.TABLE.resolve("auto", gpu_case).name == "cudnn"
    assert no_auto_cudnn.resolve("auto", gpu_case).name in ("triton", "xla")
    assert registry.resolve("paged_attention", "cudnn_xla", **case) == "cudnn_xla"
    if jax.default_backend() != "gpu":
        assert registry.resolve("paged_attention", "auto", **case) == "xla"
        with pytest.raises(ValueError, match="backend 'cudnn' cannot run here.*CUDA GPU"):
            api.resolve_backend("cudnn", dtype=jnp.bfloat16, **dims)
        with pytest.raises(ValueError, match="cannot run paged_attention here"):
            registry.resolve("paged_attention", "cudnn", **case)
    with pytest.raises(ValueError, match="impl must be"):
        cudnn.paged_attention_prefill_cudnn(*make_case(np.random.default_rng(0), streams=[(0, 0, 3)]).args(
            jnp.float32), scale=1.0, impl="triton")


# ----------------------------------------------------------------------------------------------------------------
# prefill_direct: the new tokens' K/V from the projection, the context from the pages, lax.cond on "any context"
# ----------------------------------------------------------------------------------------------------------------
STREAMS_FRESH = [(2, 0, 1), (0, 0, 63), (5, 0, 64), (3, 0, 65), (1, 0, 130)]


def _new_kv(case, dtype):
    """k_new, v_new [T, Hkv, Dh]: each stream's new tokens' K/V in token order (what the layer wrote to the
    pages); rows of padding tokens NaN (the op must not read them)."""
    t = case.q.shape[0]
    hkv, dh = case.k_pages.shape[2:]
    kn, vn = np.full((t, hkv, dh), np.nan), np.full((t, hkv, dh), np.nan)
    for i, (s, o, n, kk, vv) in enumerate(case.streams):
        if s >= 0 and n:
            kn[case.cu[i]:case.cu[i] + n], vn[case.cu[i]:case.cu[i] + n] = kk[o:], vv[o:]
    return jnp.asarray(kn, dtype), jnp.asarray(vn, dtype)


def _direct(case, dtype, scale, *, gate=None, record=None, **cfg):
    """prefill_direct (impl "xla") under jit; record: a list receiving, per executed segment call, whether it
    asked for statistics (the fresh branch does not) through a debug callback (untaken cond branches run none)."""
    q, kp, vp, pt, sl, cu, ids = case.args(dtype)
    kn, vn = _new_kv(case, dtype)
    if record is not None:
        real = cudnn.segments_xla

        def attend(*a, stats=True, **kw):
            jax.debug.callback(lambda: record.append(stats))
            return real(*a, stats=stats, **kw)
        mp = pytest.MonkeyPatch()
        mp.setattr(cudnn, "segments_xla", attend)
    try:
        fn = jax.jit(lambda *a: cudnn.prefill_direct(*a, scale=scale, gate=gate, config=CudnnConfig(**cfg),
                                                     impl="xla"))
        return jax.block_until_ready(fn(q, kn, vn, kp, vp, pt, sl, cu, ids))
    finally:
        if record is not None:
            mp.undo()


@pytest.mark.parametrize("fresh", ["cond", "merge", "auto", "auto-long"])
@pytest.mark.parametrize("streams", [STREAMS_FRESH, STREAMS_ODD], ids=["fresh", "mixed"])
def test_direct_fresh_and_mixed_batches(fresh, streams, monkeypatch):
    """Every way of handling a batch without context, on a fresh batch and on one mixing fresh and continued
    streams (padding tokens with NaN k_new / v_new rows, a padding stream, NaN-poisoned page tails), fp32 1e-5.
    With "cond" the fresh batch takes the causal call alone (one call, no statistics), the mixed one both; "auto"
    is "merge" in a call shorter than DEVICE_BRANCH_MIN_TOKENS (these are) and "cond" from it on ("auto-long":
    the bound lowered to the call's T)."""
    rng = np.random.default_rng(20)
    case = make_case(rng, streams=streams, hkv=2, group=4, dh=32)
    calls = []
    if fresh == "auto-long":
        monkeypatch.setattr(cudnn, "DEVICE_BRANCH_MIN_TOKENS", case.args(jnp.float32)[0].shape[0])
    else:
        assert case.args(jnp.float32)[0].shape[0] < cudnn.DEVICE_BRANCH_MIN_TOKENS
    out = _direct(case, jnp.float32, 32 ** -0.5, fresh=fresh.split("-")[0], record=calls)
    check_against_oracle(case, out, 32 ** -0.5, jnp.float32)
    if fresh in ("cond", "auto-long") and streams is STREAMS_FRESH:
        assert calls == [False]
    else:
        assert calls == [True, True]


def test_direct_bf16_gqa_and_gate():
    """bf16 (2e-2) with 8 query heads per kv head, the output gate applied in the same pass: o * sigmoid(gate)."""
    rng = np.random.default_rng(21)
    case = make_case(rng, streams=[(0, 40, 33), (1, 0, 64), (3, 17, 1)], hkv=1, group=8, dh=64,
                     dtype=jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal(case.q.shape), jnp.bfloat16)
    g = 1.0 / (1.0 + np.exp(-np.asarray(gate.astype(jnp.float32), np.float64)))
    ref = oracle(case, 0.125) * g
    t, h, dh = case.q.shape
    qg = jnp.concatenate([jnp.zeros((t, h, dh), jnp.bfloat16), gate], axis=-1).reshape(t, 2 * h * dh)
    qg = jnp.concatenate([qg, jnp.full((t, 5), jnp.nan, jnp.bfloat16)], axis=1)   # a fused projection's k, v
    for gate_arg in (gate, qg):                       # the gate, or q_proj's raw output holding it
        out = np.asarray(_direct(case, jnp.bfloat16, 0.125, gate=gate_arg).astype(jnp.float32), np.float64)
        for i, (s, o, n, _, _) in enumerate(case.streams):
            if s >= 0 and n:
                rows = slice(case.cu[i], case.cu[i] + n)
                assert rel_rms(out[rows], ref[rows]) <= 2e-2, i
        np.testing.assert_array_equal(out[case.cu[-1]:], 0.0)


def test_direct_context_off_and_overflow_give_zero_rows():
    """context=False: continued streams read nothing (zero rows), fresh ones are exact; a context region past
    kv_capacity: that stream gets zero rows from BOTH calls (never attention to its new tokens alone)."""
    rng = np.random.default_rng(22)
    case = make_case(rng, streams=[(0, 0, 63), (1, 9, 20), (2, 0, 65)], group=2, dh=32)
    out = np.asarray(_direct(case, jnp.float32, 0.2, context=False))
    ref = oracle(case, 0.2)
    assert rel_rms(out[:63], ref[:63]) <= 1e-5 and rel_rms(out[83:148], ref[83:148]) <= 1e-5
    np.testing.assert_array_equal(out[63:83], 0.0)
    case = make_case(rng, streams=[(0, 10, 20), (1, 50, 30), (2, 0, 5)], group=2, dh=32, pad_streams=0)
    out = np.asarray(_direct(case, jnp.float32, 0.2, kv_capacity=40))
    ref = oracle(case, 0.2)
    assert rel_rms(out[:20], ref[:20]) <= 1e-5 and rel_rms(out[50:55], ref[50:55]) <= 1e-5
    np.testing.assert_array_equal(out[20:50], 0.0)


def test_direct_bad_input():
    case = make_case(np.random.default_rng(23), streams=[(0, 0, 3)], group=2, dh=16)
    q, kp, vp, pt, sl, cu, ids = case.args(jnp.float32)
    kn, vn = _new_kv(case, jnp.float32)
    with pytest.raises(ValueError, match="k_new must be"):
        cudnn.prefill_direct(q, kn[:-1], vn, kp, vp, pt, sl, cu, ids, scale=1.0, impl="xla")
    with pytest.raises(ValueError, match="CudnnConfig.fresh"):
        cudnn.prefill_direct(q, kn, vn, kp, vp, pt, sl, cu, ids, scale=1.0, impl="xla",
                             config=CudnnConfig(fresh="maybe"))
    with pytest.raises(ValueError, match="k_new and v_new"):
        api.paged_attention_gated(q.reshape(q.shape[0], -1).repeat(2, axis=1), kp, vp, pt, sl, cu, ids,
                                  q_norm=jnp.zeros(16), cos=jnp.zeros((q.shape[0], 0)), sin=jnp.zeros((q.shape[0], 0)),
                                  num_heads=q.shape[1], scale=1.0, backend="cudnn_xla", k_new=kn)


@pytest.mark.parametrize("dtype,t,r", [(jnp.float32, 130, 16), (jnp.bfloat16, 63, 8), (jnp.float32, 1, 0),
                                       (jnp.bfloat16, 65, 32)])
def test_q_prologue_kernel_matches_xla(dtype, t, r):
    """q_prologue.gated_query_pallas (interpret mode, both layouts) against reference.gated_query: fp32 1e-6
    relative, bf16 4e-3 (one rounding step); NaN in q_proj's gate columns and in a fused projection's extra
    columns not read."""
    from pallas_kernels.paged_attention.q_prologue import gated_query_pallas
    from pallas_kernels.paged_attention.reference import gated_query
    rng = np.random.default_rng(t + r)
    h, dh = 4, 32
    x = rng.standard_normal((t, h, 2 * dh))
    x[..., dh:] = np.nan                                            # gate columns: not read by the prologue
    qg = jnp.asarray(np.concatenate([x.reshape(t, -1), np.full((t, 24), np.nan)], axis=1), dtype)
    w = jnp.asarray(0.1 * rng.standard_normal(dh), jnp.float32)
    ang = np.arange(t)[:, None] * 0.37 * (1.0 + np.arange(r // 2))[None] if r else np.zeros((t, 0))
    cos = jnp.asarray(np.cos(np.concatenate([ang, ang], 1)), jnp.float32)
    sin = jnp.asarray(np.sin(np.concatenate([ang, ang], 1)), jnp.float32)
    want, _ = gated_query(qg, w, cos, sin, num_heads=h, head_dim=dh, eps=1e-6)
    want = np.asarray(want.astype(jnp.float32))
    for layout, block_t in (("gather", 32), ("halves", 16)):
        got = gated_query_pallas(qg, w, cos, sin, num_heads=h, head_dim=dh, eps=1e-6, interpret=True,
                                 layout=layout, block_t=block_t)
        got = np.asarray(got.astype(jnp.float32))
        assert got.shape == (t, h, dh) and np.all(np.isfinite(got)), layout
        assert rel_rms(got, want) <= (1e-6 if dtype == jnp.float32 else 4e-3), layout
    with pytest.raises(ValueError, match="head_dim=24 must be a power of two"):
        gated_query_pallas(qg, jnp.zeros(24), cos[:, :0], sin[:, :0], num_heads=h, head_dim=24, eps=1e-6,
                           interpret=True)


# ----------------------------------------------------------------------------------------------------------------
# GPU: the real cuDNN call (skipped on CPU)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dh,group", [(256, 8), (128, 4)])
def test_gpu_cudnn_matches_f64(dtype, dh, group):
    rng = np.random.default_rng(dh + group)
    case = make_case(rng, streams=STREAMS_ODD + [(4, 300, 257)], hkv=2, group=group, dh=dh, num_slots=7,
                     dtype=dtype)
    out = api.paged_attention(*case.args(dtype), scale=dh ** -0.5, backend="cudnn")
    check_against_oracle(case, out, dh ** -0.5, dtype)


@pytest.mark.gpu
def test_gpu_cudnn_fresh_only_and_single_stream():
    rng = np.random.default_rng(11)
    case = make_case(rng, streams=[(0, 0, 1), (1, 0, 64), (2, 0, 130)], hkv=2, group=8, dh=256,
                     dtype=jnp.bfloat16)
    out = api.paged_attention(*case.args(jnp.bfloat16), scale=256 ** -0.5, backend="cudnn",
                              config=CudnnConfig(context=False))
    check_against_oracle(case, out, 256 ** -0.5, jnp.bfloat16)
    case = make_case(rng, streams=[(3, 0, 513)], hkv=2, group=8, dh=256, dtype=jnp.bfloat16, pad_streams=0)
    out = api.paged_attention(*case.args(jnp.bfloat16), scale=256 ** -0.5, backend="cudnn")
    check_against_oracle(case, out, 256 ** -0.5, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fresh", ["cond", "merge"])
def test_gpu_cudnn_direct_matches_f64(fresh):
    for streams in (STREAMS_FRESH, STREAMS_ODD + [(4, 300, 257)]):
        rng = np.random.default_rng(len(streams))
        case = make_case(rng, streams=streams, hkv=2, group=8, dh=256, num_slots=7, dtype=jnp.bfloat16)
        q, kp, vp, pt, sl, cu, ids = case.args(jnp.bfloat16)
        kn, vn = _new_kv(case, jnp.bfloat16)
        out = jax.jit(lambda *a: cudnn.prefill_direct(*a, scale=256 ** -0.5, config=CudnnConfig(fresh=fresh),
                                                      impl="cudnn"))(q, kn, vn, kp, vp, pt, sl, cu, ids)
        check_against_oracle(case, out, 256 ** -0.5, jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_q_prologue_kernel_at_80b_dims():
    """The compiled Pallas q norm + RoPE at Dh 256, R 64, H 16 (bf16; odd token counts) against the XLA form."""
    from pallas_kernels.paged_attention.q_prologue import gated_query_pallas
    from pallas_kernels.paged_attention.reference import gated_query
    rng = np.random.default_rng(30)
    h, dh, r = 16, 256, 64
    for t in (1, 63, 65, 130):
        qg = jnp.asarray(rng.standard_normal((t, h * 2 * dh + 1024)), jnp.bfloat16)
        w = jnp.asarray(0.1 * rng.standard_normal(dh), jnp.float32)
        ang = np.arange(t)[:, None] * 0.01 * (1.0 + np.arange(r // 2))[None]
        cos = jnp.asarray(np.cos(np.concatenate([ang, ang], 1)), jnp.float32)
        sin = jnp.asarray(np.sin(np.concatenate([ang, ang], 1)), jnp.float32)
        want, _ = gated_query(qg, w, cos, sin, num_heads=h, head_dim=dh, eps=1e-6)
        for layout in ("gather", "halves"):
            got = gated_query_pallas(qg, w, cos, sin, num_heads=h, head_dim=dh, eps=1e-6, layout=layout)
            assert rel_rms(got.astype(jnp.float32), want.astype(jnp.float32)) <= 4e-3, (t, layout)


# ----------------------------------------------------------------------------------------------------------------
# The gated entry's VJP on the direct path: the fresh causal call differentiated itself, the XLA form with context
# ----------------------------------------------------------------------------------------------------------------
def _token_rows(case):
    """[T] flat pool row (page * Ps + offset) each new token's K/V is written to; P * Ps (dropped) for padding."""
    p, ps = case.k_pages.shape[:2]
    rows = np.full(case.q.shape[0], p * ps, np.int32)
    for i, (s, o, n, _, _) in enumerate(case.streams):
        for j in range(n if s >= 0 else 0):
            rows[case.cu[i] + j] = case.page_table[s, (o + j) // ps] * ps + (o + j) % ps
    return jnp.asarray(rows)


@pytest.mark.parametrize("fresh", ["auto", "cond"])
@pytest.mark.parametrize("streams", [STREAMS_FRESH, STREAMS_ODD], ids=["fresh", "mixed"])
def test_gated_direct_gradients_equal_the_xla_form(streams, fresh):
    """jax.grad of a layer-like function (write k_new / v_new to the pages, then ``paged_attention_gated`` with
    them as k_new / v_new) on "cudnn_xla" equals the "xla" backend's (which reads the pages) for qg, q_norm,
    k_new, v_new and both page pools, fp32 1e-5 relative. The fresh batch's backward is the fresh causal call's
    own VJP (one more statistics-free segment call, in the backward; no XLA-form loop), the mixed batch's the XLA
    form's (no segment call in the backward). Forward: "cond" takes the fresh batch's causal call alone, "auto"
    (a short call: "merge") both calls."""
    _check_gated_direct_gradients(streams, "cudnn_xla", jnp.float32, hkv=2, group=4, dh=32, tol=1e-5, fresh=fresh)


@pytest.mark.gpu
@pytest.mark.parametrize("fresh", ["auto", "cond"])
@pytest.mark.parametrize("streams", [STREAMS_FRESH, STREAMS_ODD], ids=["fresh", "mixed"])
def test_gpu_gated_direct_gradients_equal_the_xla_form(streams, fresh):
    """The same on the real cuDNN call (its fused attention backward) at Qwen3-Next's attention dims (Dh 256, 8
    query heads per kv head), bf16: every gradient within 2e-2 relative RMS of the XLA form's in bf16."""
    _check_gated_direct_gradients(streams, "cudnn", jnp.bfloat16, hkv=2, group=8, dh=256, tol=2e-2, fresh=fresh)


def _check_gated_direct_gradients(streams, backend, dtype, *, hkv, group, dh, tol, fresh):
    from tests.pallas_kernels.paged_attention.test_gated import gated_inputs
    rng = np.random.default_rng(23)
    h = hkv * group
    case = make_case(rng, streams=streams, hkv=hkv, group=group, dh=dh, dtype=dtype)
    _, kp, vp, pt, sl, cu, ids = case.args(dtype)
    kn, vn = _new_kv(case, dtype)
    qg, q_norm, cos, sin = gated_inputs(rng, case, dh=dh, group=group, hkv=hkv, rotary=8, dtype=dtype, extra_cols=0)
    qg, q_norm, cos, sin = jnp.asarray(qg, dtype), jnp.asarray(q_norm, dtype), jnp.asarray(cos), jnp.asarray(sin)
    rows = _token_rows(case)
    ct = jnp.asarray(rng.standard_normal((qg.shape[0], h * dh)), dtype)
    stand_in = backend == "cudnn_xla"

    def loss(qg, q_norm, kn, vn, kp, vp, backend):
        flat = (kp.shape[0] * kp.shape[1],) + kp.shape[2:]
        kp2 = kp.reshape(flat).at[rows].set(kn, mode="drop").reshape(kp.shape)
        vp2 = vp.reshape(flat).at[rows].set(vn, mode="drop").reshape(vp.shape)
        o = api.paged_attention_gated(qg, kp2, vp2, pt, sl, cu, ids, q_norm=q_norm, cos=cos, sin=sin, num_heads=h,
                                      scale=dh ** -0.5, backend=backend, k_new=kn, v_new=vn,
                                      config=CudnnConfig(q_prologue="xla", fresh=fresh) if backend != "xla" else None)
        return jnp.sum((o * ct).astype(jnp.float32))
    calls = []
    real = cudnn.segments_xla if stand_in else cudnn.segments_cudnn

    def attend(*a, stats=True, **kw):
        jax.debug.callback(lambda: calls.append(stats))
        return real(*a, stats=stats, **kw)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), static_argnums=6)
    want = grad(qg, q_norm, kn, vn, kp, vp, "xla")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cudnn, "segments_xla" if stand_in else "segments_cudnn", attend)
        got = jax.block_until_ready(grad(qg, q_norm, kn, vn, kp, vp, backend))
    assert qg.shape[0] < cudnn.DEVICE_BRANCH_MIN_TOKENS                 # "auto" is "merge" here
    if streams is not STREAMS_FRESH:
        assert calls == [True, True], calls
    else:       # forward (the causal call alone, or both), then the backward's fresh causal call
        assert calls == ([False, False] if fresh == "cond" else [True, True, False]), calls
    live = np.asarray(rows) < kp.shape[0] * kp.shape[1]
    for name, a, b in zip(("qg", "q_norm", "k_new", "v_new", "k_pages", "v_pages"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if name in ("k_new", "v_new"):
            a, b = a[live], b[live]                          # padding rows: NaN inputs, never read by either
            assert np.isfinite(a).all()
        assert np.isfinite(b).all() and np.isfinite(a).all(), name
        assert rel_rms(a, b) <= tol or np.abs(a - b).max() <= tol / 10, (name, rel_rms(a, b))
