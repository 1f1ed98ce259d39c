"""Paged causal attention (pallas_kernels/paged_attention): the XLA reference and the Pallas kernels (interpret
mode on CPU; compiled on a GPU in the `gpu` tests) against a float64 NumPy oracle.

Every case: streams continuing with context already in the pages (old tokens) plus this call's new tokens, pages
handed out in a shuffled order, free pages and page tails NaN-poisoned, page-table entries past a slot's pages
pointing at other slots' pages or out of range, padding tokens past cu_seqlens[N] and zero-length padding streams
with slot id S. Tolerances (relative RMS against float64, per stream): fp32 1e-5, bf16 / fp16 2e-2.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import api
from pallas_kernels.paged_attention.reference import build_query_blocks
from tests.pallas_kernels.paged_attention.base import _round, make_case, oracle

TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-2}
CPU_BACKENDS = ("xla", "pallas_interpret")


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def check_against_oracle(case, out, scale, dtype):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    ref = oracle(case, scale)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    tol = TOL[jnp.dtype(dtype)]
    for i, (s, o, n, _, _) in enumerate(case.streams):
        rows = slice(case.cu[i], case.cu[i] + n)
        if s >= 0 and n:
            assert rel_rms(out[rows], ref[rows]) <= tol, f"stream {i} (slot {s}, {o} old + {n} new)"
    np.testing.assert_array_equal(out[case.cu[-1]:], 0.0)      # padding tokens: zeros


STREAMS_ODD = [(2, 0, 1), (0, 13, 63), (5, 64, 64), (3, 0, 65), (1, 7, 130)]


# ----------------------------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("group,hkv,dh", [(1, 3, 64), (3, 2, 16), (8, 1, 32)])
def test_prefill_gqa(backend, group, hkv, dh):
    rng = np.random.default_rng(group)
    case = make_case(rng, streams=[(4, 20, 33), (0, 0, 70), (1, 100, 2)], hkv=hkv, group=group, dh=dh, ps=8)
    out = api.paged_attention(*case.args(jnp.float32), scale=0.3, backend=backend)
    check_against_oracle(case, out, 0.3, jnp.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_prefill_fp16_and_permuted_slots(backend):
    rng = np.random.default_rng(7)
    case = make_case(rng, streams=[(5, 3, 17), (0, 40, 40), (2, 0, 9)], group=2, dh=32, num_slots=7,
                     pad_streams=2, pad_tokens=0, dtype=jnp.float16)
    out = api.paged_attention(*case.args(jnp.float16), scale=32 ** -0.5, backend=backend)
    check_against_oracle(case, out, 32 ** -0.5, jnp.float16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_prefill_one_program_for_any_lengths(backend):
    """Same (T, N) and pool shapes, new lengths and contexts: same answer as the oracle, one compile."""
    rng = np.random.default_rng(3)
    api._prefill_jit.clear_cache()
    for streams in ([(0, 0, 40), (1, 5, 24)], [(1, 70, 1), (0, 0, 63)]):
        case = make_case(rng, streams=streams, group=2, dh=32, width=8, num_pages=14, pad_tokens=4)
        out = api.paged_attention(*case.args(jnp.float32), scale=0.2, backend=backend)
        check_against_oracle(case, out, 0.2, jnp.float32)
    assert api._prefill_jit._cache_size() == 1


def test_prefill_reads_no_page_outside_its_slot_under_jit():
    """Under jit nothing is checked by value: a slot whose live page ids are out of range gets those keys masked
    (never another slot's page, never NaN); every backend agrees on it."""
    rng = np.random.default_rng(5)
    case = make_case(rng, streams=[(0, 30, 10), (1, 0, 20)], group=2, dh=32, ps=8)
    case.page_table[0, 1] = case.k_pages.shape[0] + 4        # tokens 8..15 of slot 0: no page
    case.page_table[0, 2] = -1                                # tokens 16..23 of slot 0: no page
    outs = {b: np.asarray(jax.jit(lambda *a, b=b: api.paged_attention(*a, scale=0.2, backend=b))(
        *case.args(jnp.float32))) for b in CPU_BACKENDS}
    # the oracle of the same stream with those keys absent
    keep = np.ones(40, bool)
    keep[8:24] = False
    s, o, n, kk, vv = case.streams[0]
    case.streams[0] = (s, o, n, kk, vv)
    q = case.q[:10]
    kr, vr = np.repeat(kk, 2, axis=1), np.repeat(vv, 2, axis=1)
    sc = np.einsum("qhd,khd->hqk", q, kr) * 0.2
    mask = (np.arange(40)[None, :] <= (30 + np.arange(10))[:, None]) & keep[None, :]
    sc = np.where(mask[None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    ref = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vr)
    for b, out in outs.items():
        assert np.all(np.isfinite(out)), b
        assert rel_rms(out[:10], ref) <= 1e-5, b
        assert rel_rms(out[10:30], oracle(case, 0.2)[10:30]) <= 1e-5, b


# ----------------------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------------------
def decode_case(rng, ctx, *, group=4, hkv=2, dh=32, ps=16, dtype=jnp.float32, pad=1, **kw):
    """One query per stream at the last position of a slot holding ctx[i] tokens (written already); kw: make_case's
    width / num_pages."""
    streams = [(i, c - 1, 1) for i, c in enumerate(ctx)]
    perm = rng.permutation(len(ctx) + 2)[:len(ctx)]               # permuted slots, two idle ones
    streams = [(int(perm[i]), o, n) for i, (_, o, n) in enumerate(streams)]
    return make_case(rng, streams=streams, hkv=hkv, group=group, dh=dh, ps=ps, num_slots=len(ctx) + 2,
                     pad_tokens=0, pad_streams=pad, dtype=dtype, **kw)


def decode_args(case, dtype):
    q, kp, vp, pt, sl, _, ids = case.args(dtype)
    n = ids.shape[0]
    qd = jnp.concatenate([q, jnp.full((n - q.shape[0],) + q.shape[1:], 7.0, dtype)])   # padding streams' rows
    return qd, kp, vp, pt, sl, ids


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("group,hkv", [(1, 2), (8, 1)])
def test_decode_gqa(backend, group, hkv):
    rng = np.random.default_rng(group)
    case = decode_case(rng, [5, 129, 64], group=group, hkv=hkv, dh=64, ps=8)
    out = np.asarray(api.paged_attention_decode(*decode_args(case, jnp.float32), scale=0.2, backend=backend))
    ref = oracle(case, 0.2)
    for i in range(3):
        assert rel_rms(out[i], ref[i]) <= 1e-5


# every decode launch path (triton.DecodeConfig): dynamic / static split lengths, kv heads packed in one program,
# one split (the kernel writes o, no combine), each combine; splits of 16-64 keys so that the short contexts of
# the case cross several splits and leave some empty
DECODE_CONFIGS = [
    dict(num_splits=3, block_k=16, combine="xla"),                           # dynamic split, XLA combine
    dict(num_splits=3, block_k=16, dynamic_split=False, combine="xla"),      # static split
    dict(num_splits=5, block_k=32, pack_kv_heads=True),                      # both kv heads per program
    dict(num_splits=1, block_k=16),                                          # no combine
    dict(num_splits=1, block_k=64, pack_kv_heads=True),
    dict(num_splits=4, block_k=16, combine="pallas"),                        # combine kernel (the default)
    dict(num_splits=6, block_k=32, combine="einsum", pack_kv_heads=True),
    dict(num_splits=2, block_k=32, pack_kv_heads=True),
    dict(num_splits=20, block_k=16),                                         # combine kernel's loop (> 16)
]


@pytest.mark.parametrize("cfg,dtype", [(c, jnp.float32) for c in DECODE_CONFIGS]       # bf16: 3 paths (CI time)
                         + [(DECODE_CONFIGS[i], jnp.bfloat16) for i in (0, 2, 5, 7)],
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict)
                         else jnp.dtype(x).name)
def test_decode_configs_interpret(cfg, dtype):
    from pallas_kernels.paged_attention import triton as tr
    rng = np.random.default_rng(17)
    ctx = [1, 63, 64, 65, 130, 221]
    case = decode_case(rng, ctx, group=4, hkv=2, dh=32, ps=8, dtype=dtype, pad=2)
    out = api.paged_attention_decode(*decode_args(case, dtype), scale=0.3, backend="pallas_interpret",
                                     config=tr.DecodeConfig(**cfg))
    assert out.dtype == jnp.dtype(dtype)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = oracle(case, 0.3)
    assert np.all(np.isfinite(out))
    for i in range(len(ctx)):
        assert rel_rms(out[i], ref[i]) <= TOL[jnp.dtype(dtype)], f"stream {i} (context {ctx[i]})"
    np.testing.assert_array_equal(out[len(ctx):], 0.0)               # padding streams (slot id S): zeros


def test_decode_one_program_for_any_lengths():
    """The split lengths come from the device-side slot lengths: new contexts, same shapes, one compile."""
    from pallas_kernels.paged_attention import triton as tr
    rng = np.random.default_rng(4)
    cfg = tr.DecodeConfig(num_splits=3, block_k=16)
    api._decode_jit.clear_cache()
    for ctx in ([5, 90, 33], [120, 1, 64]):
        case = decode_case(rng, ctx, group=2, hkv=2, dh=32, ps=8, width=24, num_pages=40)
        out = np.asarray(api.paged_attention_decode(*decode_args(case, jnp.float32), scale=0.2,
                                                    backend="pallas_interpret", config=cfg))
        ref = oracle(case, 0.2)
        for i in range(len(ctx)):
            assert rel_rms(out[i], ref[i]) <= 1e-5
    assert api._decode_jit._cache_size() == 1


def test_decode_config_errors():
    from pallas_kernels.paged_attention import triton as tr
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        tr.DecodeConfig(block_k=48)
    with pytest.raises(ValueError, match="num_splits must be None or >= 1"):
        tr.DecodeConfig(num_splits=0)
    with pytest.raises(ValueError, match="combine must be"):
        tr.DecodeConfig(combine="cuda")
    with pytest.raises(ValueError, match="combine must be"):
        tr.DecodeConfig(combine="fused")
    # the split rule: the power of two for about ``waves`` programs per SM, never splits under 4 steps of a
    # full-width slot; the default (2 per SM) runs 256 x 1024 at 80B dims (512 pairs) in one split, 64 x 4096 (128)
    # in 2
    assert tr.DecodeConfig().waves == 2 and tr.DecodeConfig().combine == "pallas"
    assert tr._num_splits(512, 1024, 64, waves=2, sms=132) == 1
    assert tr._num_splits(128, 4096, 64, waves=2, sms=132) == 2          # a power of two (3 measured slower)
    assert tr._num_splits(128, 4096, 64, waves=4, sms=132) == 4
    assert tr._num_splits(64, 4096, 64, waves=2, sms=132) == 4
    assert tr._num_splits(512, 1024, 64, waves=4, sms=132) == 1
    assert tr._num_splits(8, 256, 64, waves=4, sms=132) == 1
    assert tr._num_splits(8, 64 * 12 * 4, 64, waves=4, sms=132) == 8      # capped at 12 -> 8 (power of two)


# ----------------------------------------------------------------------------------------------------------------
# bad input: clear errors on the checked path, before anything runs
# ----------------------------------------------------------------------------------------------------------------
def test_checked_path_errors():
    rng = np.random.default_rng(1)
    case = make_case(rng, streams=[(0, 10, 20), (1, 0, 5)], group=2, dh=32, ps=8)
    args = list(case.args(jnp.float32))
    run = lambda a: api.paged_attention(*a, scale=0.1)             # noqa: E731

    bad = [a for a in args]
    pt = np.array(case.page_table)
    pt[0, 1] = case.k_pages.shape[0]
    bad[3] = jnp.asarray(pt)
    with pytest.raises(ValueError, match=r"page_table\[0\].*outside \[0, P="):
        run(bad)
    bad = list(args)
    sl = np.array(case.slot_lens)
    sl[1] = pt.shape[1] * 8 + 1
    bad[4] = jnp.asarray(sl)
    with pytest.raises(ValueError, match="more than its W="):
        run(bad)
    sl = np.array(case.slot_lens)
    sl[0] = 19
    bad[4] = jnp.asarray(sl)
    with pytest.raises(ValueError, match="stream 0 has 20 tokens but slot_lens"):
        run(bad)
    bad = list(args)
    bad[5] = jnp.asarray(np.array([0, 30, 20, 20], np.int32))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        run(bad)
    bad = list(args)
    bad[1], bad[2] = args[1][..., :16], args[2][..., :16]
    with pytest.raises(ValueError, match="head dim"):
        run(bad)
    bad = list(args)
    bad[2] = args[2][..., :16]
    with pytest.raises(ValueError, match="k_pages and v_pages must share one shape"):
        run(bad)
    bad = list(args)
    bad[0] = args[0][:, :3]
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        run(bad)
    bad = list(args)
    bad[4] = args[4].astype(jnp.float32)
    with pytest.raises(ValueError, match="slot_lens must be an int32"):
        run(bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        api.paged_attention(*args, scale=0.1, backend="cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="backend 'pallas' cannot run here"):
            api.paged_attention(*args, scale=0.1, backend="pallas")


def test_supports():
    assert api.supports(platform="gpu", dtype=jnp.bfloat16, head_dim=256, num_heads=16, num_kv_heads=2) is None
    assert "head_dim" in api.supports(platform="gpu", dtype=jnp.bfloat16, head_dim=96, num_heads=16,
                                      num_kv_heads=2)
    assert "multiple" in api.supports(platform="gpu", dtype=jnp.float32, head_dim=128, num_heads=6,
                                      num_kv_heads=4)
    assert api.supports(platform="interpret", dtype=jnp.float32, head_dim=24, num_heads=6, num_kv_heads=2) is None
    assert "platform" in api.supports(platform="cpu", dtype=jnp.float32, head_dim=128, num_heads=4,
                                      num_kv_heads=2)


def test_query_blocks_cover_every_token_once():
    cu = jnp.asarray([0, 5, 5, 70, 71], jnp.int32)
    ids = jnp.asarray([1, 3, 0, 4], jnp.int32)                  # slot 4 == S: padding stream with a token
    lens = jnp.asarray([65, 9, 0, 0], jnp.int32)
    b = build_query_blocks(cu, ids, lens, 75, 16)
    tok0, count, klen = (np.asarray(x) for x in (b.tok0, b.count, b.klen))
    covered = np.concatenate([np.arange(t0, t0 + c) for t0, c in zip(tok0, count)])
    np.testing.assert_array_equal(np.sort(covered), np.arange(75))
    assert tok0.shape == (75 // 16 + 4 + 1,)
    live = count > 0
    # stream 0 (slot 1, 5 tokens into 9): pos0 4; the no-slot stream and the padding tail read no key
    assert np.asarray(b.pos0)[0] == 4 and klen[0] == 9
    assert klen[(tok0 >= 70) & live].tolist() == [0, 0]


# ----------------------------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernels at the real head dims (skipped on CPU)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("dh,group", [(256, 8), (128, 4)])
def test_gpu_prefill_matches_f64(dtype, dh, group):
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(dh + group)
    case = make_case(rng, streams=STREAMS_ODD + [(4, 300, 257)], hkv=2, group=group, dh=dh, num_slots=7,
                     dtype=dtype)
    out = api.paged_attention(*case.args(dtype), scale=dh ** -0.5, backend="pallas")
    check_against_oracle(case, out, dh ** -0.5, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("dh,group", [(256, 8), (128, 1)])
def test_gpu_decode_matches_f64(dtype, dh, group):
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(dh)
    ctx = [1, 63, 64, 65, 130, 1000, 2500]
    case = decode_case(rng, ctx, group=group, dh=dh, dtype=dtype)
    out = api.paged_attention_decode(*decode_args(case, dtype), scale=dh ** -0.5, backend="pallas")
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = oracle(case, dh ** -0.5)
    for i in range(len(ctx)):
        assert rel_rms(out[i], ref[i]) <= TOL[jnp.dtype(dtype)], f"stream {i} (context {ctx[i]})"
    np.testing.assert_array_equal(out[len(ctx):], 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", DECODE_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_gpu_decode_configs(cfg):
    """Every decode launch path compiled at the 80B dims (Dh 256, G 8, Hkv 2), bf16, against float64."""
    from pallas_kernels.paged_attention import triton as tr
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(5)
    ctx = [1, 63, 64, 65, 130, 1000, 2500]
    case = decode_case(rng, ctx, group=8, dh=256, dtype=jnp.bfloat16)
    out = api.paged_attention_decode(*decode_args(case, jnp.bfloat16), scale=256 ** -0.5, backend="pallas",
                                     config=tr.DecodeConfig(**cfg))
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = oracle(case, 256 ** -0.5)
    for i in range(len(ctx)):
        assert rel_rms(out[i], ref[i]) <= TOL[jnp.dtype(jnp.bfloat16)], f"stream {i} (context {ctx[i]})"
    np.testing.assert_array_equal(out[len(ctx):], 0.0)


def test_empty_call_and_int32_addressing_limit():
    rng = np.random.default_rng(2)
    case = make_case(rng, streams=[(0, 3, 4)], group=2, dh=32, ps=8, pad_tokens=0, pad_streams=0)
    q, kp, vp, pt, sl, cu, ids = case.args(jnp.float32)
    no_slot = jnp.full((1,), case.page_table.shape[0], jnp.int32)           # one padding stream, no token
    out = api.paged_attention(q[:0], kp, vp, pt, jnp.zeros_like(sl), jnp.zeros((2,), jnp.int32), no_slot,
                              scale=0.1, backend="pallas_interpret")
    assert out.shape == (0,) + q.shape[1:]
    assert api.resolve_backend("auto", dtype=jnp.bfloat16, head_dim=256, num_heads=16, num_kv_heads=2,
                               sizes={"k_pages": 2 ** 31}) == "xla"
    with pytest.raises(ValueError, match="int32 offsets"):
        api.resolve_backend("pallas_interpret", dtype=jnp.bfloat16, head_dim=256, num_heads=16, num_kv_heads=2,
                            sizes={"k_pages": 2 ** 31})


# ----------------------------------------------------------------------------------------------------------------
# the gated decode step (q norm + RoPE + gate around the decode kernel) and the K/V page write kernel
# ----------------------------------------------------------------------------------------------------------------
def _gated_decode_inputs(rng, case, h, dh, rot, dtype):
    """qg [N, C] (per head [query | gate], then 2 Hkv Dh more columns; padding streams' rows NaN), q_norm, cos,
    sin at each stream's position, and the float64 oracle o [N, H * Dh]."""
    n = case.slot_ids.shape[0]
    c = h * 2 * dh + 64
    qg = _round(rng.standard_normal((n, c)), dtype)
    real = [i for i, st in enumerate(case.streams) if st[0] >= 0]
    qg[len(real):] = np.nan                                            # padding streams' rows: never read
    q_norm = _round(0.2 * rng.standard_normal(dh), jnp.float32)
    pos = np.array([case.slot_lens[s] - 1 if s >= 0 else 0 for s, *_ in case.streams], np.float64)
    inv = 1.0 / (1e4 ** (np.arange(0, rot, 2) / rot)) if rot else np.zeros(0)
    ang = pos[:, None] * np.concatenate([inv, inv])[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x = qg[:, :h * 2 * dh].reshape(n, h, 2 * dh)
    q, gate = x[..., :dh], x[..., dh:]
    q = q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + 1e-6) * (1.0 + q_norm)
    if rot:
        half = rot // 2
        rh = np.concatenate([-q[..., half:rot], q[..., :half]], axis=-1)
        q = np.concatenate([q[..., :rot] * cos[:, None] + rh * sin[:, None], q[..., rot:]], axis=-1)
    ref = np.zeros((n, h, dh))
    for i, (s, o, m, kk, vv) in enumerate(case.streams):
        if s < 0:
            continue
        g = h // kk.shape[1]
        sc = np.einsum("hd,khd->hk", q[i], np.repeat(kk, g, axis=1)) * dh ** -0.5
        p = np.exp(sc - sc.max(-1, keepdims=True))
        ref[i] = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), np.repeat(vv, g, axis=1))
    ref = ref / (1.0 + np.exp(-gate))
    args = (jnp.asarray(qg, dtype), jnp.asarray(q_norm, jnp.float32), jnp.asarray(cos, jnp.float32),
            jnp.asarray(sin, jnp.float32))
    return args, ref.reshape(n, h * dh), len(real)


GATED_DECODE_CONFIGS = [
    dict(num_splits=1, block_k=16),                                         # the kernel writes o * gate
    dict(num_splits=3, block_k=16, combine="pallas", q_prologue="kernel"),  # gate in the combine kernel
    dict(num_splits=4, block_k=32, combine="xla"),                          # gate in the XLA merge
]


@pytest.mark.parametrize("cfg,dtype,rot", [(c, jnp.float32, 8) for c in GATED_DECODE_CONFIGS]
                         + [(GATED_DECODE_CONFIGS[1], jnp.bfloat16, 0), (None, jnp.float32, 8)],
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict)
                         else (jnp.dtype(x).name if x is not None and not isinstance(x, int) else str(x)))
def test_decode_gated_matches_f64(cfg, dtype, rot):
    """The gated decode (interpret mode; cfg None: the XLA backend) against float64: odd contexts (1 .. 130),
    permuted slots, NaN page tails and free pages, a padding stream whose qg row is NaN (zeros out)."""
    from pallas_kernels.paged_attention import triton as tr
    rng = np.random.default_rng(23)
    ctx = [1, 63, 64, 65, 130]
    h, dh = 8, 32
    case = decode_case(rng, ctx, group=4, hkv=2, dh=dh, ps=8, dtype=dtype, pad=1)
    (qg, q_norm, cos, sin), ref, nreal = _gated_decode_inputs(rng, case, h, dh, rot, dtype)
    _, kp, vp, pt, sl, ids = decode_args(case, dtype)
    out = api.paged_attention_decode_gated(
        qg, kp, vp, pt, sl, ids, q_norm=q_norm, cos=cos[:, :rot], sin=sin[:, :rot], num_heads=h,
        scale=dh ** -0.5, eps=1e-6, backend="xla" if cfg is None else "pallas_interpret",
        config=None if cfg is None else tr.DecodeConfig(**cfg))
    assert out.shape == (len(ids), h * dh) and out.dtype == jnp.dtype(dtype)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    for i in range(nreal):
        assert rel_rms(out[i], ref[i]) <= TOL[jnp.dtype(dtype)], f"stream {i} (context {ctx[i]})"
    if cfg is not None:
        np.testing.assert_array_equal(out[nreal:], 0.0)              # padding stream, NaN qg row: zeros


def test_kv_write_kernel_matches_xla():
    """paged_kv_write's kernel (interpret) against its XLA form: k normed + rotated, v as is, both pools, the
    fused projection's columns; a page id P, -1 and an offset Ps (padding) write nothing; the rest untouched."""
    rng = np.random.default_rng(8)
    p, ps, hkv, dh, t = 12, 8, 2, 32, 5
    kp = jnp.asarray(rng.standard_normal((p, ps, hkv, dh)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((p, ps, hkv, dh)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((t, 96 + 2 * hkv * dh)), jnp.bfloat16)
    page = jnp.asarray([3, 11, p, -1, 0], jnp.int32)
    off = jnp.asarray([0, 7, 1, 2, ps], jnp.int32)
    kn = jnp.asarray(0.3 * rng.standard_normal(dh), jnp.float32)
    ang = np.arange(t)[:, None] * 0.37 * np.arange(1, 9)[None, :]
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    kw = dict(k_norm=kn, cos=cos, sin=sin, k_col=96, v_col=96 + hkv * dh, eps=1e-6)
    ka, va = api.paged_kv_write(kp, vp, y, y, page, off, backend="xla", **kw)
    kb, vb = api.paged_kv_write(kp, vp, y, y, page, off, backend="pallas_interpret", **kw)
    f = lambda a: np.asarray(a.astype(jnp.float32))   # noqa: E731
    np.testing.assert_allclose(f(kb), f(ka), atol=1e-2, rtol=1e-2)    # bf16: one rounding apart at most
    np.testing.assert_array_equal(f(vb), f(va))
    changed = np.any(f(kb) != f(kp), axis=(2, 3))
    assert changed.sum() == 2 and changed[3, 0] and changed[11, 7]    # only the two live tokens' rows
    assert not np.any(f(vb) != f(vp), axis=(2, 3))[[0, 1], [ps - 1, 2]].any()
    with pytest.raises(ValueError, match="k_col"):
        api.paged_kv_write(kp, vp, y, y, page, off, backend="xla", **dict(kw, k_col=200))
    with pytest.raises(ValueError, match="token_page"):
        api.paged_kv_write(kp, vp, y, y, page[:3], off, backend="xla", **kw)


def test_decode_gated_errors():
    rng = np.random.default_rng(1)
    case = decode_case(rng, [5, 9], group=2, hkv=2, dh=32, ps=8)
    q, kp, vp, pt, sl, ids = decode_args(case, jnp.float32)
    n = ids.shape[0]
    qg = jnp.zeros((n, 4 * 2 * 32), jnp.float32)
    kw = dict(q_norm=jnp.zeros(32), cos=jnp.zeros((n, 8)), sin=jnp.zeros((n, 8)), num_heads=4, scale=0.1)
    with pytest.raises(ValueError, match="qg has"):
        api.paged_attention_decode_gated(qg[:, :100], kp, vp, pt, sl, ids, **kw)
    with pytest.raises(ValueError, match="q_norm"):
        api.paged_attention_decode_gated(qg, kp, vp, pt, sl, ids, **dict(kw, q_norm=jnp.zeros(31)))
    with pytest.raises(ValueError, match="cos"):
        api.paged_attention_decode_gated(qg, kp, vp, pt, sl, ids, **dict(kw, cos=jnp.zeros((n, 7)),
                                                                           sin=jnp.zeros((n, 7))))
    with pytest.raises(ValueError, match="q_prologue"):
        from pallas_kernels.paged_attention import triton as tr
        tr.DecodeConfig(q_prologue="reload")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GATED_DECODE_CONFIGS + [{}], ids=lambda c: "-".join(f"{k}={v}" for k, v in
                                                                                  c.items()) or "default")
def test_gpu_decode_gated(cfg):
    """The gated decode compiled at the 80B dims (Dh 256, G 8, Hkv 2, R 64), bf16, against float64."""
    from pallas_kernels.paged_attention import triton as tr
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(6)
    ctx = [1, 63, 64, 65, 130, 1000, 2500]
    h, dh = 16, 256
    case = decode_case(rng, ctx, group=8, hkv=2, dh=dh, dtype=jnp.bfloat16)
    (qg, q_norm, cos, sin), ref, nreal = _gated_decode_inputs(rng, case, h, dh, 64, jnp.bfloat16)
    _, kp, vp, pt, sl, ids = decode_args(case, jnp.bfloat16)
    out = api.paged_attention_decode_gated(qg, kp, vp, pt, sl, ids, q_norm=q_norm, cos=cos, sin=sin, num_heads=h,
                                           scale=dh ** -0.5, backend="pallas",
                                           config=tr.DecodeConfig(**cfg) if cfg else None)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    for i in range(nreal):
        assert rel_rms(out[i], ref[i]) <= 2e-2, f"stream {i} (context {ctx[i]})"
    np.testing.assert_array_equal(out[nreal:], 0.0)


@pytest.mark.gpu
def test_gpu_kv_write_kernel():
    rng = np.random.default_rng(9)
    p, ps, hkv, dh, t = 300, 16, 2, 256, 64
    kp = jnp.asarray(rng.standard_normal((p, ps, hkv, dh)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((p, ps, hkv, dh)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((t, 8192 + 2 * hkv * dh)), jnp.bfloat16)
    page = jnp.asarray(np.r_[rng.permutation(p)[:t - 2], p, -1].astype(np.int32))
    off = jnp.asarray(rng.integers(0, ps, t).astype(np.int32))
    ang = np.arange(t)[:, None] * 0.37 * np.arange(1, 65)[None, :]
    kw = dict(k_norm=jnp.asarray(0.3 * rng.standard_normal(dh), jnp.float32), cos=jnp.asarray(np.cos(ang)),
              sin=jnp.asarray(np.sin(ang)), k_col=8192, v_col=8192 + hkv * dh)
    ka, va = api.paged_kv_write(kp, vp, y, y, page, off, backend="xla", **kw)
    kb, vb = jax.jit(lambda *a: api.paged_kv_write(*a, backend="pallas", **kw))(kp, vp, y, y, page, off)
    f = lambda a: np.asarray(a.astype(jnp.float32))   # noqa: E731
    np.testing.assert_allclose(f(kb), f(ka), atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(f(vb), f(va))
