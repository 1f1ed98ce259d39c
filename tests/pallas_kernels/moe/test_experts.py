"""MoE routed experts (pallas_kernels/moe): the Pallas grouped-GEMM kernels (interpret mode on CPU, Triton on a
GPU) and the XLA block path, each against a float64 NumPy loop over (token, expert) pairs.

Tolerances (relative RMS over the whole output, against float64 on the same rounded inputs): fp32 1e-5; bf16 2e-2
(h and y are rounded to bf16 inside, as HF does). The GPU test at Qwen3-Next-80B dims checks a token slice against
an fp32 oracle and the peak memory of one MoE layer.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.layers.ffn import moe_route, sparse_moe
from pallas_kernels.moe import api
from pallas_kernels.moe import reference as ref
from pallas_kernels.moe import triton as tr
from pallas_kernels.moe.triton import MoeConfig
from tests.numpy_reference import rel_rms
from tests.pallas_kernels.moe.base import routed_f64

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SMALL = MoeConfig(block_m=16, gate_up_n=32, gate_up_k=32, down_n=32, down_k=32)   # several column blocks


def _inputs(rng, t, d, e, inter, k, dtype, ti=None):
    """Rounded inputs (jax arrays) and their float64 copies."""
    x = rng.standard_normal((t, d))
    wgu = rng.standard_normal((e, d, 2 * inter)) * d ** -0.5
    wd = rng.standard_normal((e, inter, d)) * inter ** -0.5
    if ti is None:
        ti = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32) if t else np.zeros((0, k), np.int32)
    tw = rng.uniform(0.05, 1.0, ti.shape)
    js = [jnp.asarray(a, dtype) for a in (x, tw, wgu, wd)]
    f64 = [np.asarray(a.astype(jnp.float32), np.float64) for a in js]
    return js[0], js[1], jnp.asarray(ti, jnp.int32), js[2], js[3], f64, np.asarray(ti)


@pytest.mark.parametrize("backend", ["pallas_interpret"])
def test_split_partial_half_tiles(backend):
    """MoeConfig.split_partial: blocks at most half live run a BM / 2 tile. Mixed case: most experts get a few
    rows (half tiles), expert 0 gets every token (a full block and a partial one over half live); NaN in the
    rows of h the kernels leave unwritten must not reach the output."""
    rng = np.random.default_rng(11)
    t, d, e, inter, k = 54, 64, 16, 32, 3            # expert 0: 54 rows = a full block + 22 (> half: full tile)
    others = np.array([rng.permutation(np.arange(1, e))[:k - 1] for _ in range(t)])   # ~7 rows each: half tiles
    ti = np.concatenate([np.zeros((t, 1), np.int64), others], axis=1).astype(np.int32)
    cfg = MoeConfig(block_m=32, gate_up_n=32, gate_up_k=32, down_n=32, down_k=32, split_partial=True)
    x, tw, ti_j, wgu, wd, f64, _ = _inputs(rng, t, d, e, inter, k, jnp.float32, ti=ti)
    want = routed_f64(*f64[:2], ti, *f64[2:])
    out = api.moe_experts(x, tw, ti_j, wgu, wd, backend=backend, config=cfg)
    assert rel_rms(np.asarray(out), want) <= 1e-5
    lay = ref.moe_align(tw, ti_j, e, cfg.block_m)
    nlive = (np.asarray(lay.row_token).reshape(-1, 32) < t).sum(1)[np.asarray(lay.block_expert) < e]
    assert (nlive <= 16).any() and ((nlive > 16) & (nlive < 32)).any() and (nlive == 32).any()   # all 3 kinds
    h = tr.gate_up_silu(x, wgu, lay.block_expert, lay.row_token, config=cfg, interpret=True)
    live_row = np.zeros(h.shape[0], bool)
    live_row[np.asarray(lay.row_pos).reshape(-1)] = True
    h = jnp.where(jnp.asarray(live_row)[:, None], h, jnp.nan)
    y = tr.down_weighted(h, wd, lay.block_expert, lay.row_token, lay.row_weight, num_tokens=t, config=cfg,
                         interpret=True)
    assert rel_rms(np.asarray(ref.combine(y, lay.row_pos, x.dtype)), want) <= 1e-5
    with pytest.raises(ValueError, match="split_partial needs block_m >= 32"):
        api.moe_experts(x, tw, ti_j, wgu, wd, backend=backend, config=MoeConfig(block_m=16, split_partial=True))


DECODE_FUSED = dataclasses.replace(tr.DECODE_CONFIG, fused_combine=True)


@pytest.mark.parametrize("t,dtype,fused", [(1, jnp.float32, False), (7, jnp.bfloat16, False),
                                           (64, jnp.float32, False), (64, jnp.bfloat16, True),
                                           (7, jnp.float32, True)])
def test_decode_sizes_small_row_blocks_match_f64(t, dtype, fused):
    """Decode sizes (few rows per expert: T k / E <= 8) take select_config's 16-row blocks (DECODE_CONFIG, here
    with several column blocks in both kernels), with the XLA combine or the combine fused into the down kernel
    (atomic adds into fp32 [T, D]); against float64. A NaN token row (a padding token past cu_seqlens[N])
    stays in its own output row."""
    rng = np.random.default_rng(t * 10 + fused)
    d, inter, e, k = 256, 128, 64, 4
    assert tr.select_config(t, k, e) is tr.DECODE_CONFIG
    cfg = DECODE_FUSED if fused else None                                     # None: the api's own pick
    x, tw, ti, wgu, wd, f64, ti_np = _inputs(rng, t, d, e, inter, k, dtype)
    want = routed_f64(*f64[:2], ti_np, *f64[2:])
    out = api.moe_experts(x, tw, ti, wgu, wd, backend="pallas_interpret", config=cfg)
    assert out.shape == (t, d) and out.dtype == dtype
    assert rel_rms(np.asarray(out.astype(jnp.float32)), want) <= TOL[dtype]
    if t > 1:
        out = np.asarray(api.moe_experts(x.at[t // 2].set(jnp.nan), tw, ti, wgu, wd, backend="pallas_interpret",
                                         config=cfg).astype(jnp.float32))
        ok = np.arange(t) != t // 2
        assert np.all(np.isnan(out[t // 2])) and np.all(np.isfinite(out[ok]))
        assert rel_rms(out[ok], want[ok]) <= TOL[dtype]


@pytest.mark.parametrize("fused", [False, True])
def test_decode_one_expert_empty_experts_and_poisoned_h(fused):
    """16-row blocks: every token on one expert (64 rows = 4 full blocks, k = 1), then 2 of 64 experts used (62
    empty) with 7 tokens; NaN written into h's padding rows and dead blocks before the down kernel (the XLA
    combine's and the fused combine's) never reaches the output; fp32 against float64 (1e-5)."""
    rng = np.random.default_rng(21 + fused)
    d, inter, e = 64, 32, 64
    cfg = DECODE_FUSED if fused else tr.DECODE_CONFIG
    for t, ti in ((64, np.full((64, 1), 5, np.int32)),
                  (7, np.stack([np.full(7, 3), np.full(7, 60)], axis=1).astype(np.int32))):
        x, tw, ti_j, wgu, wd, f64, _ = _inputs(rng, t, d, e, inter, ti.shape[1], jnp.float32, ti=ti)
        want = routed_f64(*f64[:2], ti, *f64[2:])
        out = api.moe_experts(x, tw, ti_j, wgu, wd, backend="pallas_interpret", config=cfg)
        assert rel_rms(np.asarray(out), want) <= 1e-5
        lay = ref.moe_align(tw, ti_j, e, cfg.block_m)
        assert int(jnp.sum(lay.block_expert < e)) == -(-t // 16) * ti.shape[1]   # each used expert: ceil(t / 16)
        h = tr.gate_up_silu(x, wgu, lay.block_expert, lay.row_token, config=cfg, interpret=True)
        live_row = np.zeros(h.shape[0], bool)
        live_row[np.asarray(lay.row_pos).reshape(-1)] = True
        assert (~live_row).sum() > 0 or t == 64
        h = jnp.where(jnp.asarray(live_row)[:, None], h, jnp.nan)
        if fused:
            got = tr.down_combined(h, wd, lay.block_expert, lay.row_token, lay.row_weight, num_tokens=t,
                                   config=cfg, interpret=True)
        else:
            got = ref.combine(tr.down_weighted(h, wd, lay.block_expert, lay.row_token, lay.row_weight,
                                               num_tokens=t, config=cfg, interpret=True), lay.row_pos, x.dtype)
        assert rel_rms(np.asarray(got), want) <= 1e-5


def test_select_config_ladder_and_buffer_size():
    """select_config picks by mean rows per expert T k / E (static): 16-row blocks at the 80B decode sizes, 32,
    64, then the prefill config (c6 + split_partial); the padded rows Mp (h and y) shrink with the row block:
    64 tokens at 80B dims hold 552 x 16 rows instead of 517 x 128. moe_experts(config=None) traces with the
    pick (h of [Mp, I] in the jaxpr)."""
    e, k = 512, 10
    assert [tr.select_config(t, k, e).block_m for t in (1, 64, 256, 409, 410, 1638, 1639, 2457, 2458, 19027)] == \
        [16, 16, 16, 16, 32, 32, 64, 64, 128, 128]
    assert tr.select_config(8192, k, e) is tr.PREFILL_CONFIG and tr.PREFILL_CONFIG.split_partial
    assert ref.num_row_blocks(64, k, e, 16) * 16 == 8832 < ref.num_row_blocks(64, k, e, 128) * 128 == 66176
    d, inter, t = 32, 16, 64
    args = (jnp.zeros((t, d)), jnp.ones((t, k)), jnp.zeros((t, k), jnp.int32), jnp.zeros((e, d, 2 * inter)),
            jnp.zeros((e, inter, d)))
    jaxpr = jax.make_jaxpr(lambda *a: api.moe_experts(*a, backend="pallas_interpret"))(*args)
    shapes = _all_shapes(jaxpr.jaxpr)
    assert (8832, inter) in shapes and (66176, inter) not in shapes


def test_block_expert_count_matches_searchsorted():
    """moe_align's block_expert (a compare-and-count, no while loop) equals searchsorted over the experts' block
    ends, on random routings and with empty experts."""
    rng = np.random.default_rng(4)
    for t, k, e, bm in ((64, 10, 512, 16), (130, 4, 16, 32), (5, 2, 64, 16)):
        ti = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
        lay = jax.jit(ref.moe_align, static_argnums=(2, 3))(jnp.ones((t, k)), jnp.asarray(ti), e, bm)
        counts = np.bincount(ti.reshape(-1), minlength=e)
        ends = np.cumsum(-(-counts // bm))
        nb = ref.num_row_blocks(t, k, e, bm)
        np.testing.assert_array_equal(np.asarray(lay.block_expert), np.searchsorted(ends, np.arange(nb), "right"))


def test_layout_invariants():
    """moe_align: each copy once, each block one expert, padding rows weight 0 / token T, dead blocks = E,
    copies of one expert in token order, the static block bound holds even in the worst case."""
    rng = np.random.default_rng(0)
    t, k, e, bm = 37, 3, 8, 16
    ti = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    tw = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
    align = jax.jit(ref.moe_align, static_argnums=(2, 3))
    lay = jax.tree_util.tree_map(np.asarray, align(jnp.asarray(tw), jnp.asarray(ti), e, bm))
    nb = ref.num_row_blocks(t, k, e, bm)
    assert lay.block_expert.shape == (nb,) and lay.row_token.shape == (nb * bm,)
    pos = lay.row_pos.reshape(-1)
    assert len(set(pos.tolist())) == t * k                                   # every copy has its own row
    np.testing.assert_array_equal(lay.row_token[pos], np.repeat(np.arange(t), k))
    np.testing.assert_array_equal(lay.row_weight[pos], tw.reshape(-1))
    np.testing.assert_array_equal(lay.block_expert[pos // bm], ti.reshape(-1))   # a row's block is its expert's
    pad = np.setdiff1d(np.arange(nb * bm), pos)
    assert np.all(lay.row_token[pad] == t) and np.all(lay.row_weight[pad] == 0)
    live = lay.block_expert < e
    assert np.all(np.diff(lay.block_expert[live]) >= 0) and np.all(lay.block_expert[~live] == e)
    assert np.all(live[:live.sum()])                                          # live blocks first
    for ex in range(e):                                                       # stable: token order per expert
        rows = np.sort(pos[ti.reshape(-1) == ex])
        assert np.all(np.diff(lay.row_token[rows]) > 0)
    # worst case for the bound: every expert gets bm + 1 rows (two blocks each)
    ti_w = np.repeat(np.arange(e), bm + 1)[:, None].astype(np.int32)
    lay_w = align(jnp.ones(ti_w.shape), jnp.asarray(ti_w), e, bm)
    assert int(jnp.sum(lay_w.block_expert < e)) == 2 * e <= ref.num_row_blocks(ti_w.shape[0], 1, e, bm)


def test_nan_poisoned_padding_rows_do_not_leak():
    """The down kernel reads h's padding rows masked: NaN there (and in the rows of dead blocks) never reaches a
    live row of y nor the combined output. A NaN token row of x stays in its own output row (padding tokens
    past cu_seqlens[N] may hold anything: they must not touch other tokens)."""
    rng = np.random.default_rng(3)
    t, d, e, inter, k = 7, 64, 16, 32, 2
    x, tw, ti, wgu, wd, f64, ti_np = _inputs(rng, t, d, e, inter, k, jnp.float32)
    lay = ref.moe_align(tw, ti, e, SMALL.block_m)
    h = tr.gate_up_silu(x, wgu, lay.block_expert, lay.row_token, config=SMALL, interpret=True)
    live_row = np.zeros(h.shape[0], bool)
    live_row[np.asarray(lay.row_pos).reshape(-1)] = True
    assert (~live_row).sum() > 0                                              # the case has padding rows
    h_poison = jnp.where(jnp.asarray(live_row)[:, None], h, jnp.nan)
    y = tr.down_weighted(h_poison, wd, lay.block_expert, lay.row_token, lay.row_weight, num_tokens=t,
                         config=SMALL, interpret=True)
    out = np.asarray(ref.combine(y, lay.row_pos, x.dtype))
    assert np.all(np.isfinite(np.asarray(y)[live_row]))
    assert rel_rms(out, routed_f64(*f64[:2], ti_np, *f64[2:])) <= 1e-5
    # padding rows inside live blocks come out as zeros
    live_block_pad = (~live_row) & np.repeat(np.asarray(lay.block_expert) < e, SMALL.block_m)
    assert live_block_pad.sum() > 0 and np.all(np.asarray(y)[live_block_pad] == 0)
    for backend in ("xla", "pallas_interpret"):
        xn = x.at[4].set(jnp.nan)
        out = np.asarray(api.moe_experts(xn, tw, ti, wgu, wd, backend=backend, config=SMALL))
        ok = np.arange(t) != 4
        assert np.all(np.isnan(out[4]))
        assert rel_rms(out[ok], routed_f64(*f64[:2], ti_np, *f64[2:])[ok]) <= 1e-5, backend


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_sparse_moe_top_k_ties_and_qwen35_routing(backend):
    """A zero router gives every expert the same probability: top-k takes the lowest ids (lax.top_k, as
    torch.topk on CPU); with norm_topk_prob each weight is 1/k (Qwen3.5 MoE). Shared expert included."""
    rng = np.random.default_rng(7)
    t, d, e, inter, k = 9, 64, 16, 32, 4
    p = {"router": np.zeros((d, e)), "experts_gate_up": rng.standard_normal((e, d, 2 * inter)) * 0.1,
         "experts_down": rng.standard_normal((e, inter, d)) * 0.1,
         "shared_expert": {"gate_proj": rng.standard_normal((d, 32)) * 0.1,
                           "up_proj": rng.standard_normal((d, 32)) * 0.1,
                           "down_proj": rng.standard_normal((32, d)) * 0.1},
         "shared_expert_gate": rng.standard_normal((d, 1)) * 0.1}
    x = rng.standard_normal((t, d))
    pj = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), p)
    tw, ti = moe_route(pj["router"], jnp.asarray(x, jnp.float32), k, True)
    np.testing.assert_array_equal(np.asarray(ti), np.tile(np.arange(k), (t, 1)))
    np.testing.assert_allclose(np.asarray(tw), 1.0 / k, rtol=1e-6)
    out = sparse_moe(pj, jnp.asarray(x, jnp.float32), top_k=k, norm_topk_prob=True, backend=backend)
    sp = p["shared_expert"]
    gu = x @ sp["gate_proj"]
    shared = ((gu / (1 + np.exp(-gu))) * (x @ sp["up_proj"])) @ sp["down_proj"]
    gate = 1 / (1 + np.exp(-(x @ p["shared_expert_gate"])))
    want = routed_f64(x, np.full((t, k), 1.0 / k), np.tile(np.arange(k), (t, 1)), p["experts_gate_up"],
                       p["experts_down"]) + gate * shared
    assert rel_rms(np.asarray(out), want) <= 1e-5


def _all_shapes(jaxpr) -> set:
    """Shapes of every equation output of the jaxpr, sub-jaxprs included."""
    out = set()
    for eqn in jaxpr.eqns:
        out |= {tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars}
        for prm in eqn.params.values():
            for j in (prm if isinstance(prm, (tuple, list)) else (prm,)):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    out |= _all_shapes(inner)
    return out


def _max_intermediate_size(jaxpr) -> int:
    """Largest array any equation of the jaxpr (sub-jaxprs of scan / jit / pallas_call included) produces."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            best = max(best, int(np.prod(getattr(v.aval, "shape", ()))))
        for prm in eqn.params.values():
            for j in (prm if isinstance(prm, (tuple, list)) else (prm,)):
                inner = getattr(j, "jaxpr", j)                        # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    best = max(best, _max_intermediate_size(inner))
    return best


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_no_intermediate_scales_with_tokens_times_experts(backend):
    """Many experts, few tokens: no intermediate array reaches T * E * I elements (the old lax.ragged_dot path
    was expanded densely over all experts by XLA:GPU); the largest is O(T k (I + D) + E)."""
    t, k, e, d, inter = 16, 2, 2048, 32, 32
    x = jnp.zeros((t, d), jnp.float32)
    tw, ti = jnp.ones((t, k), jnp.float32), jnp.zeros((t, k), jnp.int32)
    wgu, wd = jnp.zeros((e, d, 2 * inter)), jnp.zeros((e, inter, d))
    jaxpr = jax.make_jaxpr(lambda *a: api.moe_experts(*a, backend=backend, config=SMALL))(x, tw, ti, wgu, wd)
    biggest = _max_intermediate_size(jaxpr.jaxpr)
    assert biggest < t * e * inter // 8, biggest


@pytest.mark.parametrize("name", ["c6", "prefill", "decode", "decode_fused", "prefill_fused"])
def test_pallas_kernels_lower_to_triton_on_cpu(name):
    """The GPU path's Triton IR is generated on CPU too (lowering for "cuda" needs no GPU): both kernels of each
    config of the ladder (c6; PREFILL_CONFIG = c6 + split_partial; DECODE_CONFIG's 16-row blocks) and of the
    fused combine (atomic adds) become Triton custom calls at the 80B block sizes. Compiling that IR to PTX and
    running it is the GPU test's job."""
    t, d, inter, e, k = 300, 2048, 512, 64, 4
    sds = jax.ShapeDtypeStruct
    args = (sds((t, d), jnp.bfloat16), sds((t, k), jnp.bfloat16), sds((t, k), jnp.int32),
            sds((e, d, 2 * inter), jnp.bfloat16), sds((e, inter, d), jnp.bfloat16))
    cfg = {"c6": MoeConfig(), "prefill": tr.PREFILL_CONFIG, "decode": tr.DECODE_CONFIG,
           "decode_fused": dataclasses.replace(tr.DECODE_CONFIG, fused_combine=True),
           "prefill_fused": dataclasses.replace(tr.PREFILL_CONFIG, fused_combine=True)}[name]
    fn = jax.jit(lambda *a: api._moe_experts(*a, jnp.int32(0), backend="pallas", config=cfg, num_experts=e))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("t", [1, 37])
def test_expert_pool_equals_the_layers_own_experts(backend, t):
    """The model's scan hands the MoE the stacked experts of R layers as one pool [R E, ...] and an offset r E:
    the result equals the call on layer r's own [E, ...] experts (fp32, 1e-6), and blocks past the live rows never
    read another layer's experts (their sentinel is the pool size, skipped)."""
    d, inter, e, k, r = 32, 16, 6, 2, 3
    ks = jax.random.split(jax.random.PRNGKey(t), 5)
    x = jax.random.normal(ks[0], (t, d), jnp.float32)
    tw = jax.nn.softmax(jax.random.normal(ks[1], (t, k)), -1)
    ti = jnp.argsort(jax.random.normal(ks[2], (t, e)), -1)[:, :k].astype(jnp.int32)
    wgu = jax.random.normal(ks[3], (r, e, d, 2 * inter), jnp.float32) / 8
    wd = jax.random.normal(ks[4], (r, e, inter, d), jnp.float32) / 8
    pool_gu, pool_d = wgu.reshape(r * e, d, 2 * inter), wd.reshape(r * e, inter, d)
    for layer in range(r):
        want = api.moe_experts(x, tw, ti, wgu[layer], wd[layer], backend=backend, config=SMALL)
        got = jax.jit(lambda off: api.moe_experts(x, tw, ti, pool_gu, pool_d, backend=backend, config=SMALL,
                                                  num_experts=e, expert_offset=off))(jnp.int32(layer * e))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expert_offset"):
        api.moe_experts(x, tw, ti, pool_gu, pool_d, backend=backend, config=SMALL, num_experts=e)
    with pytest.raises(ValueError, match="num_experts=4 must divide"):
        api.moe_experts(x, tw, ti, pool_gu, pool_d, backend=backend, config=SMALL, num_experts=4,
                        expert_offset=0)


def test_expert_pool_lowers_to_triton_on_cpu():
    """A pool of 12 layers' experts at 80B dims (12.9e9 elements, past int32 element offsets): the kernels still
    lower (Pallas Triton switches to 64-bit offsets for operands over 4 GiB)."""
    t, d, inter, e, k, r = 64, 2048, 512, 512, 10, 12
    sds = jax.ShapeDtypeStruct
    args = (sds((t, d), jnp.bfloat16), sds((t, k), jnp.bfloat16), sds((t, k), jnp.int32),
            sds((r * e, d, 2 * inter), jnp.bfloat16), sds((r * e, inter, d), jnp.bfloat16))
    cfg = tr.select_config(t, k, e)
    fn = jax.jit(lambda *a: api._moe_experts(*a, jnp.int32(5 * e), backend="pallas", config=cfg, num_experts=e))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2


def test_checks_name_the_argument():
    x = jnp.zeros((5, 64), jnp.float32)
    tw, ti = jnp.ones((5, 2)), jnp.zeros((5, 2), jnp.int32)
    wgu, wd = jnp.zeros((4, 64, 64)), jnp.zeros((4, 32, 64))
    with pytest.raises(ValueError, match="backend"):
        api.moe_experts(x, tw, ti, wgu, wd, backend="cuda")
    with pytest.raises(ValueError, match="top_w and top_i"):
        api.moe_experts(x, tw[:4], ti, wgu, wd, backend="xla")
    with pytest.raises(ValueError, match="w_gate_up"):
        api.moe_experts(x, tw, ti, wgu[:, :32], wd, backend="xla")
    with pytest.raises(ValueError, match="w_down"):
        api.moe_experts(x, tw, ti, wgu, wd[:, :16], backend="xla")
    with pytest.raises(ValueError, match="top_i must be an integer"):
        api.moe_experts(x, tw, tw, wgu, wd, backend="xla")
    with pytest.raises(ValueError, match="block_m"):
        api.moe_experts(x, tw, ti, wgu, wd, backend="xla", config=MoeConfig(block_m=24))
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_moe({"router": jnp.zeros((64, 4)), "experts_gate_up": wgu, "experts_down": wd}, x, top_k=2,
                   norm_topk_prob=True, backend="triton")
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(ValueError, match="CUDA GPU"):
            api.moe_experts(x, tw, ti, wgu, wd, backend="pallas")
    assert api.moe_experts(x[:0], tw[:0], ti[:0], wgu, wd, backend="xla").shape == (0, 64)


def test_supports():
    ok = dict(platform="gpu", dtype=jnp.bfloat16, num_experts=512, hidden=2048, inter=512)
    assert api.supports(**ok) is None
    assert "CUDA GPU" in api.supports(**{**ok, "platform": "cpu"})
    assert "bfloat16" in api.supports(**{**ok, "dtype": np.float64})
    assert "inter % 16" in api.supports(**{**ok, "inter": 24})
    assert "hidden % 16" in api.supports(**{**ok, "hidden": 100})


@pytest.mark.gpu
def test_moe_80b_dims_on_gpu():
    """Qwen3-Next-80B MoE (D 2048, 512 experts top-10, I 512, shared 512, bf16, 8192 tokens) through
    sparse_moe(backend="pallas"): routed part of 16 tokens against an fp32 oracle (2e-2), whole layer against
    the XLA path (2e-2), and the layer's peak memory; then 64 tokens (decode: 16-row blocks, and the fused
    combine) against the oracle on 32 rows (2e-2). Weights are filled 64 experts at a time into donated
    buffers so that the peak before the call is weights + one slice; the call itself must add under 2 GiB
    (the dense ragged_dot expansion needed 160 GiB; the layer's h + y + combine need about 0.75 GiB)."""
    d, e, k, inter, si, t = 2048, 512, 10, 512, 512, 8192
    bf = jnp.bfloat16
    fill = jax.jit(lambda w, piece, i: jax.lax.dynamic_update_slice_in_dim(w, piece, i, 0), donate_argnums=0)

    def filled(shape, fan_in, seed):
        w = jnp.zeros(shape, bf)
        for i in range(0, shape[0], 64):
            piece = (jax.random.normal(jax.random.PRNGKey(seed * 1000 + i), (64,) + shape[1:], jnp.float32)
                     * fan_in ** -0.5).astype(bf)
            w = fill(w, piece, i)
        return w
    key = jax.random.split(jax.random.PRNGKey(0), 6)
    p = {"router": (jax.random.normal(key[0], (d, e)) * d ** -0.5).astype(bf),
         "experts_gate_up": filled((e, d, 2 * inter), d, 1), "experts_down": filled((e, inter, d), inter, 2),
         "shared_expert": {"gate_proj": (jax.random.normal(key[1], (d, si)) * d ** -0.5).astype(bf),
                           "up_proj": (jax.random.normal(key[2], (d, si)) * d ** -0.5).astype(bf),
                           "down_proj": (jax.random.normal(key[3], (si, d)) * si ** -0.5).astype(bf)},
         "shared_expert_gate": (jax.random.normal(key[4], (d, 1)) * d ** -0.5).astype(bf)}
    x = jax.random.normal(key[5], (t, d), bf)
    jax.block_until_ready((p, x))
    layer = jax.jit(lambda p, x: sparse_moe(p, x, top_k=k, norm_topk_prob=True, backend="pallas"))
    compiled = layer.lower(p, x).compile()
    dev = jax.devices()[0]
    before = dev.memory_stats()["peak_bytes_in_use"]
    out = jax.block_until_ready(compiled(p, x))
    delta = dev.memory_stats()["peak_bytes_in_use"] - before
    assert delta < 2 * 2 ** 30, f"peak grew by {delta / 2**30:.2f} GiB"
    assert bool(jnp.all(jnp.isfinite(out)))
    # routed part on a slice against an fp32 oracle
    tw, ti = moe_route(p["router"], x, k, True)
    routed = api.moe_experts(x, tw, ti, p["experts_gate_up"], p["experts_down"], backend="pallas")
    rows = jnp.asarray(np.linspace(0, t - 1, 16).astype(np.int32))
    hp = jax.lax.Precision.HIGHEST

    def oracle(x, tw, ti, rows):
        xs, tis = x[rows].astype(jnp.float32), ti[rows]
        gu = jnp.einsum("rd,rkdn->rkn", xs, p["experts_gate_up"][tis].astype(jnp.float32), precision=hp)
        h = jax.nn.silu(gu[..., :inter]) * gu[..., inter:]
        y = jnp.einsum("rki,rkid->rkd", h, p["experts_down"][tis].astype(jnp.float32), precision=hp)
        return np.asarray(jnp.sum(y * tw[rows].astype(jnp.float32)[..., None], axis=1))
    assert rel_rms(np.asarray(routed[rows].astype(jnp.float32)), oracle(x, tw, ti, rows)) <= 2e-2
    out_xla = jax.jit(lambda p, x: sparse_moe(p, x, top_k=k, norm_topk_prob=True, backend="xla"))(p, x)
    assert rel_rms(np.asarray(out.astype(jnp.float32)), np.asarray(out_xla.astype(jnp.float32))) <= 2e-2
    # decode size: 64 tokens take select_config's 16-row blocks; the fused combine too (every other row checked)
    xd = x[:64]
    twd, tid = moe_route(p["router"], xd, k, True)
    rows = jnp.arange(0, 64, 2)
    want = oracle(xd, twd, tid, rows)
    for cfg in (None, dataclasses.replace(tr.DECODE_CONFIG, fused_combine=True)):
        got = api.moe_experts(xd, twd, tid, p["experts_gate_up"], p["experts_down"], backend="pallas", config=cfg)
        assert rel_rms(np.asarray(got[rows].astype(jnp.float32)), want) <= 2e-2, cfg


