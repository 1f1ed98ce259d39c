"""jax_gdn.serving: SamplingParams, the on-device sampler and the LLM engine, on a tiny fp32 model (1 GDN + 1
attention layer, XLA backends) on the CPU.

- The sampler: greedy is argmax; temperature / top-k / top-p draws follow the truncated softmax (a chi-square test
  over 6000 draws on a vocabulary of 6, critical value at p = 1e-4 for its degrees of freedom) and never pick a
  truncated token; a (seed, step) pair always draws the same token; the engine's branch-free sampler programs
  (draw_rows, then fallback_rows for the rows it marks) give sample_rows' tokens exactly.
- The engine: greedy generate equals a hand-written prefill / decode argmax loop token for token; requests added
  online (add_request / step) while others run get the tokens each gets alone; a request's
  output does not depend on what else is in the batch (alone against with 7 others, greedy and sampled); stop ids
  and max_tokens end requests with "stop" / "length"; nothing compiles after the warm-up; out of KV pages under
  load every request finishes with a stated reason and every emitted token equals the one the request gets
  alone (none comes from a refused step's zero logits), and a slot stops at what the pool holds ("length"); a
  checkpoint directory loads with the tokenizer.json beside it (trained offline with `tokenizers`), which
  round-trips a prompt and decodes the output text; bad arguments are
  refused naming the argument before any work.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_gdn.config import preset
from jax_gdn.model import HybridModel
from jax_gdn.serving import LLM, SamplingParams
from jax_gdn.serving.sampling import (METHODS, SORTS, draw_full_rows, draw_rows, fallback_rows, kept_tokens, sample,
                                      sampling_arrays)

VOCAB = 96
CHI2_CRIT_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}     # chi-square critical values, p = 1e-4


#: the tests of the module's LLM engine run on one xdist worker (``--dist loadgroup``), so its fixture (~35 s of
#: compiles at the CPU tests' -O0) is built once, not once per worker
ENGINE = pytest.mark.xdist_group("llm_engine")


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny", num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                 mlp_only_layers=(1,), vocab_size=VOCAB)
    return HybridModel.random(cfg, 3, dtype=jnp.float32, backend="xla", std=0.2)


@pytest.fixture(scope="module")
def llm(model):
    """The step-by-step engine (every step's ids read before the next is dispatched): the oracle of the
    overlapped one."""
    return LLM(model, max_seqs=8, max_tokens=512, page_size=16, token_budget=32, progress=False,
               async_decode=False)


def _prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _manual_greedy(model, prompt, n):
    """The hand-written loop: prefill the prompt, then decode argmax tokens one at a time (one stream, slot 0)."""
    cache = model.init_cache(max_seqs=1, max_tokens=256, page_size=16)
    logits, cache = model.prefill(cache, np.asarray(prompt, np.int32), np.asarray([0, len(prompt)], np.int32),
                                  np.asarray([0], np.int32))
    out = [int(np.argmax(np.asarray(logits)[0]))]
    while len(out) < n:
        logits, cache = model.decode(cache, np.asarray([out[-1]], np.int32), np.asarray([0], np.int32))
        out.append(int(np.argmax(np.asarray(logits)[0])))
    model.check(cache)
    return out


# ---- the sampler -----------------------------------------------------------------------------------------------
def test_sampling_params_are_checked_naming_the_field():
    for kw, field in ((dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
                      (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"),
                      (dict(top_p=1.5), "top_p"), (dict(max_tokens=0), "max_tokens"),
                      (dict(stop_token_ids=(1, -2)), "stop_token_ids"), (dict(stop_token_ids="ab"), "stop_token_ids"),
                      (dict(seed=-1), "seed")):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize("method", METHODS)
def test_sampler_follows_the_truncated_softmax(method):
    """6000 rows of the same logits, each its own seed: temperature 0.7, top-k 4 and top-p 0.9 leave the tokens
    whose mass ranked above them is < 0.9 among the 4 best; their frequencies match the renormalised softmax (chi-
    square), the truncated ones never appear; greedy rows are argmax; a (seed, step) pair repeats its draw."""
    logits = np.log(np.asarray([0.05, 0.30, 0.02, 0.25, 0.18, 0.20], np.float64))
    n = 6000
    rows = np.broadcast_to(logits.astype(np.float32), (n, 6))
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=i) for i in range(n)]
    got = np.asarray(sample(jnp.asarray(rows), *sampling_arrays(params, [5] * n, n), method=method))
    p = np.exp(logits / 0.7)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")[:4]
    before = np.cumsum(p[order]) - p[order]
    keep = order[before / p[order].sum() < 0.9]
    want = np.zeros(6)
    want[keep] = p[keep] / p[keep].sum()
    counts = np.bincount(got, minlength=6)
    assert counts[want == 0].sum() == 0, counts
    stat = float(((counts[keep] - n * want[keep]) ** 2 / (n * want[keep])).sum())
    assert stat < CHI2_CRIT_1E4[len(keep) - 1], (stat, counts, want)
    again = np.asarray(sample(jnp.asarray(rows[:64]), *sampling_arrays(params[:64], [5] * 64, 64),
                              method=method))
    assert np.array_equal(again, got[:64])
    mixed = [SamplingParams()] * 3 + params[:3]
    out = np.asarray(sample(jnp.asarray(rows[:6]), *sampling_arrays(mixed, [5] * 6, 6), method=method))
    assert out[:3].tolist() == [1, 1, 1] and np.array_equal(out[3:], got[:3])


def test_both_sorts_rank_alike_and_draw_alike():
    """descending_order "keys" (int32 keys from the float bits) gives argsort's order (descending, ties by id) on
    rows with many ties, +-inf, signed zeros, subnormals and random floats; sample draws the same tokens with
    either sort."""
    from jax_gdn.serving.sampling import descending_order
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 3, (6, 300)).astype(np.float32)
    x[0, :5] = -np.inf
    x[1, 7] = np.inf
    x[2] = -0.0
    x[2, ::3] = 0.0
    x[3] = rng.standard_normal(300).astype(np.float32) * 1e-39            # subnormals
    x[4:] = rng.standard_normal((2, 300)).astype(np.float32) * 30
    orders = [np.asarray(descending_order(jnp.asarray(x), s)) for s in SORTS]
    assert all(np.array_equal(orders[0], o) for o in orders[1:])
    normal = [0, 1, 2, 4, 5]                    # XLA on the CPU flushes row 3's subnormals to zero (both sorts alike)
    assert np.array_equal(orders[0][normal], np.argsort(-x[normal], axis=-1, kind="stable"))
    params = [SamplingParams(temperature=0.9, top_k=k, top_p=p, seed=i)
              for i, (k, p) in enumerate([(0, 0.9), (5, 1.0), (50, 0.5), (0, 1.0), (3, 0.8), (0, 0.99)])]
    draws = [np.asarray(sample(jnp.asarray(x), *sampling_arrays(params, [2] * 6, 6), method=s))
             for s in SORTS]
    assert all(np.array_equal(draws[0], d) for d in draws[1:])


_kept = jax.jit(kept_tokens, static_argnames="method")


def _kept_alike(x, settings=None, method="threshold"):
    """Asserts ``method`` keeps argsort's tokens on every row of ``x`` for each (top_k, top_p) of ``settings``
    (default: every top_k in {0, 1, 5, 50, V-1, V} with every top_p in {1, 0.9, 0.5, 1e-6}; one batch, each row
    of x once per setting)."""
    vocab = x.shape[1]
    if settings is None:
        settings = [(k, p) for k in (0, 1, 5, 50, vocab - 1, vocab) for p in (1.0, 0.9, 0.5, 1e-6)]
    rows = jnp.asarray(np.repeat(x, len(settings), axis=0))
    top_k = np.tile(np.asarray([k for k, _ in settings], np.int32), len(x))
    top_p = np.tile(np.asarray([p for _, p in settings], np.float32), len(x))
    want, got = (np.asarray(_kept(rows, top_k, top_p, method=m)) for m in ("argsort", method))
    bad = np.flatnonzero((want != got).any(axis=1))
    assert bad.size == 0, [(b // len(settings), int(top_k[b]), float(top_p[b])) for b in bad]
    full = top_p == 1
    assert want[full].sum(axis=1).tolist() == np.where(top_k > 0, top_k, vocab)[full].tolist()
    assert (want[top_p < 1e-5].sum(axis=1) == 1).all()                # top_p 1e-6: the first token alone


def test_threshold_keeps_the_sort_methods_tokens():
    """kept_tokens "threshold" (no sort) equals "argsort" token for token on rows with many ties (integer
    logits), -inf and +inf entries, a row all -inf but one, signed zeros, bf16-rounded normals and plain normals,
    each top_k in {0, 1, 5, 50, V-1, V} with each top_p in {1, 0.9, 0.5, 1e-6}; and on 2 rows of the real
    vocabulary (151936: every key and id bit searched; bf16-rounded normals and integer logits, -inf at the end)
    under 6 settings each that take every top_k and top_p (the CPU tests compile at -O0, where a full sort of
    151936 logits is slow). The inputs avoid top-p boundaries that are exact in real arithmetic (a kept set of n
    equal logits with top_p * n an integer, where the sort's cumsum rounds either way and threshold keeps the
    exact count: every integer row of 300 has fewer than 50 at its max, so top-k 50 never keeps one tie group),
    and on random floats a boundary within rounding of top_p (none here)."""
    rng = np.random.default_rng(3)
    x = rng.integers(-4, 3, (7, 300)).astype(np.float32)
    x[1, :5] = -np.inf
    x[1, 100:103] = -np.inf
    x[2, 7] = np.inf
    x[3] = -np.inf
    x[3, 200] = 1.5
    x[4][x[4] == 0] = rng.choice(np.float32([0.0, -0.0]), int((x[4] == 0).sum()))    # signed zeros tie
    x[5] = (rng.standard_normal(300) * 3).astype(jnp.bfloat16).astype(np.float32)
    x[6] = rng.standard_normal(300).astype(np.float32) * 4
    assert np.signbit(x[4][x[4] == 0]).any() and not np.signbit(x[4][x[4] == 0]).all()
    assert ((x[[0, 1, 4]] == x[[0, 1, 4]].max(axis=1, keepdims=True)).sum(axis=1) < 50).all()
    _kept_alike(x)
    vocab = 151936
    big = np.stack([(rng.standard_normal(vocab) * 3).astype(jnp.bfloat16).astype(np.float32),
                    np.floor(rng.standard_normal(vocab) * 4).astype(np.float32)])
    big[1, -3:] = -np.inf
    _kept_alike(big[:1], [(0, 0.9), (1, 1.0), (5, 0.5), (50, 0.9), (vocab - 1, 1e-6), (vocab, 0.5)])
    _kept_alike(big[1:], [(0, 0.5), (1, 1e-6), (5, 0.9), (50, 0.5), (vocab - 1, 1.0), (vocab, 0.9)])


@pytest.mark.parametrize("method, decides", [
    ("blocks", [True, True, True, True, False, True]),
    ("maxblocks", [True, True, True, False, False, False])])
def test_blocks_keeps_the_sort_methods_tokens(method, decides):
    """kept_tokens "blocks" (short sorts of 1024-token blocks and of their 64 best each) and "maxblocks" (the 64
    128-token blocks of the largest maxima, whole) equal "argsort" on the threshold test's rows and settings, and on
    a row of the real vocabulary under the serving settings; the candidates alone decide (no fallback to the full
    sort) wherever top_k <= 64 (every top_k <= 50 setting of the real-vocabulary row), and with "blocks" where top-p
    holds within them (top_p 0.9 or 0.5 alone on a peaked row; "maxblocks"' fewer first ranks do not hold it there
    and fall back); top_k V - 1 falls back."""
    from jax_gdn.serving.sampling import BLOCK_METHODS, _blocks_keep
    rng = np.random.default_rng(5)
    x = rng.integers(-4, 3, (5, 300)).astype(np.float32)
    x[1, :5] = -np.inf
    x[2, 7] = np.inf
    x[3] = -np.inf
    x[3, 200] = 1.5
    x[4] = (rng.standard_normal(300) * 3).astype(jnp.bfloat16).astype(np.float32)
    _kept_alike(x, method=method)
    vocab = 151936
    big = (rng.standard_normal((1, vocab)) * 3).astype(jnp.bfloat16).astype(np.float32)
    big[0, 1000:1010] = 12.0                                           # a peaked row: top-p 0.9 inside the peak
    settings = [(50, 0.95), (1, 1.0), (5, 0.5), (0, 0.9), (vocab - 1, 1.0), (vocab, 0.5)]
    _kept_alike(big, settings, method=method)
    rows = jnp.asarray(np.repeat(big, len(settings), axis=0))
    exact = np.asarray(_blocks_keep(rows, jnp.asarray([k for k, _ in settings], jnp.int32),
                                    jnp.asarray([p for _, p in settings], jnp.float32), **BLOCK_METHODS[method])[3])
    assert exact.tolist() == decides                                   # top_k V - 1: the full sort decides


@pytest.mark.parametrize("method, vocab", [("blocks", 3000), ("maxblocks", 9000)])
def test_blocks_draws_from_the_kept_set_on_every_path(method, vocab):
    """methods "blocks" on 3000-token rows (3 blocks of 1024) and "maxblocks" on 9000-token rows (71 blocks of 128,
    64 kept): rows its candidates decide (top-k 50, a peaked top-p), rows that keep every token (one draw over the
    row) and rows that fall back to the full sort (top_k V - 1, top-p on a flat row), side by side: every draw lies
    in argsort's kept set, a (seed, step) repeats its draw, greedy rows are argmax."""
    rng = np.random.default_rng(9)
    n = 240
    flat = rng.standard_normal(vocab).astype(np.float32) * 0.01
    peaked = flat.copy()
    peaked[[10, 1500, vocab - 1]] = [6.0, 6.5, 6.2]
    settings = [(50, 0.9, peaked), (0, 0.8, peaked), (0, 1.0, flat), (vocab - 1, 1.0, flat), (0, 0.9, flat),
                (1, 1.0, flat)]
    rows = np.stack([settings[i % len(settings)][2] for i in range(n)])
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=i)
              for i, (k, p, _) in zip(range(n), settings * n)]
    arrays = sampling_arrays(params, [3] * n, n)
    from jax_gdn.serving.sampling import BLOCK_METHODS, _blocks_keep
    _, _, _, exact, every = (np.asarray(a) for a in _blocks_keep(jnp.asarray(rows[:6]), arrays[1][:6],
                                                                 arrays[2][:6], **BLOCK_METHODS[method]))
    assert exact[[0, 5]].all() and every[2] and not (exact | every)[[3, 4]].any()     # each path taken
    got = np.asarray(sample(jnp.asarray(rows), *arrays, method=method))
    kept = np.asarray(_kept(jnp.asarray(rows), arrays[1], arrays[2], method="argsort"))
    assert kept[np.arange(n), got].all()
    assert np.array_equal(np.asarray(sample(jnp.asarray(rows), *arrays, method=method)), got)
    assert len(set(got[2::6].tolist())) > 20                           # every token kept: the draws spread
    mixed = [SamplingParams()] * 2 + params[:2]
    out = np.asarray(sample(jnp.asarray(rows[[0, 1, 0, 1]]), *sampling_arrays(mixed, [3] * 4, 4), method=method))
    assert out.tolist() == [int(np.argmax(rows[0])), int(np.argmax(rows[1]))] + got[:2].tolist()
    # the engine's branch-free programs: draw_rows' ids where it needs no fallback, fallback_rows' where it does,
    # merged, are sample's draws exactly; without ``plain`` the rows keeping every token are left to the fallback.
    # One row of each setting and two greedy rows (the draws do not depend on the other rows)
    eight = [SamplingParams()] * 2 + params[:6]
    x8 = jnp.asarray(np.concatenate([rows[:2], rows[:6]]))
    a8 = sampling_arrays(eight, [3] * 8, 8)
    want = [int(np.argmax(rows[0])), int(np.argmax(rows[1]))] + got[:6].tolist()
    draw = jax.jit(draw_rows, static_argnames=("plain", "method"))
    full = np.asarray(jax.jit(fallback_rows, static_argnames=("method",))(x8, *a8, method=method))
    for plain in (False, True):
        ids, need = (np.asarray(a) for a in draw(x8, *a8, plain=plain, method=method))
        assert need[[5, 6]].all() and not need[[0, 1, 2, 7]].any() and need[4] != plain      # settings 3, 4; 2
        assert np.where(need, full, ids).tolist() == want, plain
        merged, merged_need = (np.asarray(a) for a in jax.jit(draw_full_rows, static_argnames=("plain", "method"))(
            x8, *a8, plain=plain, method=method))                      # the two in one program: the same ids
        assert merged.tolist() == want and np.array_equal(merged_need, need), plain


@pytest.mark.parametrize("block,per_block,select", [(32, 4, "sort"), (16, 8, "sort"), (300, 300, "sort"),
                                                    (16, 6, "max"), (7, 20, "max"), (300, 1, "max")])
def test_blocks_candidates_are_the_exact_top_ranks(block, per_block, select):
    """Where "blocks" / "maxblocks" (select "max": per_block blocks kept) says its candidates decide, their kept set
    is argsort's, for blocks that cut the row anywhere (and a block of the whole row): the first L candidates are
    the row's first L ranks."""
    from jax_gdn.serving.sampling import _blocks_keep
    rng = np.random.default_rng(8)
    x = rng.integers(-4, 3, (4, 300)).astype(np.float32)
    x[1, :5] = -np.inf
    x[2] = (rng.standard_normal(300) * 3).astype(jnp.bfloat16).astype(np.float32)
    settings = [(k, p) for k in (0, 1, 5, 50, 299, 300) for p in (1.0, 0.9, 0.5, 1e-6)]
    rows = jnp.asarray(np.repeat(x, len(settings), axis=0))
    top_k = jnp.asarray(np.tile([k for k, _ in settings], len(x)).astype(np.int32))
    top_p = jnp.asarray(np.tile([p for _, p in settings], len(x)).astype(np.float32))
    want = np.asarray(_kept(rows, top_k, top_p, method="argsort"))
    ids, _, keep, exact, _ = (np.asarray(a) for a in _blocks_keep(rows, top_k, top_p, block=block,
                                                                  per_block=per_block, select=select))
    assert exact.any()
    for r in np.flatnonzero(exact):
        mine = np.zeros(300, bool)
        real = ids[r] < 300
        mine[ids[r][real]] = keep[r][real]
        assert np.array_equal(mine, want[r]), (r, int(top_k[r]), float(top_p[r]))


def test_threshold_draws():
    """method "threshold": 600 rows of a few dominant and many tiny logits (top-k / top-p settings mixed, each
    row its own seed) never draw a token outside the kept set, draw some tiny token where every token is kept
    (they hold ~5% of the mass), repeat a (seed, step)'s draw and change with the step; greedy rows are argmax
    (lowest id on ties)."""
    vocab, n = 400, 600
    row = np.full(vocab, -6.0, np.float32)
    row[[3, 200, 399]] = [2.0, 2.0, 1.0]
    rows = np.broadcast_to(row, (n, vocab))
    settings = [(0, 1.0), (2, 1.0), (0, 0.9), (5, 0.95), (1, 1.0), (0, 0.7)]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=i)
              for i, (k, p) in zip(range(n), settings * n)]
    arrays = sampling_arrays(params, [7] * n, n)
    got = np.asarray(sample(jnp.asarray(rows), *arrays, method="threshold"))
    kept = np.asarray(_kept(jnp.asarray(rows), arrays[1], arrays[2], method="threshold"))
    assert kept[np.arange(n), got].all()
    assert kept[2].sum() == 3 and kept[1].sum() == 2 and kept[1, [3, 200]].all()
    assert not np.isin(got[0::6], [3, 200, 399]).all()
    assert np.array_equal(np.asarray(sample(jnp.asarray(rows), *arrays, method="threshold")), got)
    later = np.asarray(sample(jnp.asarray(rows), *sampling_arrays(params, [8] * n, n), method="threshold"))
    assert kept[np.arange(n), later].all() and (later != got).any()
    mixed = [SamplingParams()] * 2 + params[:2]
    out = np.asarray(sample(jnp.asarray(rows[:4]), *sampling_arrays(mixed, [7] * 4, 4), method="threshold"))
    assert out.tolist() == [3, 3] + got[:2].tolist()


def test_an_unknown_method_is_refused_naming_it():
    x = jnp.zeros((2, 8), jnp.float32)
    arrays = sampling_arrays([SamplingParams(temperature=1.0)] * 2, [0, 0], 2)
    with pytest.raises(ValueError, match="method"):
        sample(x, *arrays, method="bogus")
    with pytest.raises(ValueError, match="method"):
        kept_tokens(x, arrays[1], arrays[2], method="bogus")


# ---- the engine ------------------------------------------------------------------------------------------------
@ENGINE
def test_greedy_generate_equals_the_manual_loop_and_compiles_nothing(llm, model):
    prompts = _prompts(3, seed=1)
    before = llm.compiled_programs()
    outs = llm.generate(prompts, SamplingParams(max_tokens=6))
    assert llm.compiled_programs() == before                       # the warm-up compiled every program
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == _manual_greedy(model, p, 6)
        assert o.outputs[0].finish_reason == "length" and o.outputs[0].text == ""


@ENGINE
def test_a_request_does_not_depend_on_its_batch(llm):
    """Greedy and sampled: the first request alone, then with 7 others (chunked prefill: 8 prompts of up to 60
    tokens under a 32-token budget), the same tokens."""
    prompts = _prompts(8, seed=2, hi=60)
    for sp in (SamplingParams(max_tokens=5), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seed=7)):
        alone = llm.generate(prompts[0], sp)[0].outputs[0].token_ids
        batch = llm.generate(prompts, sp)
        assert batch[0].outputs[0].token_ids == alone
        repeat = llm.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in repeat] == [o.outputs[0].token_ids for o in batch]


@ENGINE
def test_online_requests_arriving_while_others_run(llm):
    """add_request / step / has_unfinished_requests: 6 requests arriving one every 2 steps (chunked prefill under the
    32-token budget, mixed with decode) give the tokens generate gives each alone; step() returns each output once,
    when it finishes; ids count up over both calls; the metrics count from the arrival; a generate call in the
    middle keeps the added requests' outputs for the next step(); a bad request is refused naming it, with nothing
    queued."""
    prompts = _prompts(6, seed=5, hi=60)
    sp = SamplingParams(max_tokens=4)
    want = [llm.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    with pytest.raises(ValueError, match="add_request: prompt holds token ids outside"):
        llm.add_request([VOCAB])
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        llm.add_request([1], {"max_tokens": 4})
    assert not llm.has_unfinished_requests()
    ids, got, steps = [], {}, 0
    while len(got) < len(prompts):
        if steps % 2 == 0 and len(ids) < len(prompts):
            ids.append(llm.add_request(prompts[len(ids)], sp))
        if steps == 3:                              # a generate call while added requests run
            assert llm.generate(prompts[0], sp)[0].outputs[0].token_ids == want[0]
        for o in llm.step():
            assert o.request_id not in got
            got[o.request_id] = o
        steps += 1
        assert steps < 200
    assert not llm.has_unfinished_requests() and llm.step() == []
    assert ids == sorted(set(ids)) and set(got) == set(ids)      # ids count up (generate's call took one too)
    assert [got[i].outputs[0].token_ids for i in ids] == want
    assert [got[i].prompt_token_ids for i in ids] == prompts
    assert all(0 < got[i].metrics["first_token_s"] <= got[i].metrics["finished_s"] for i in ids)


@ENGINE
def test_prefill_buckets_fewer_programs_same_tokens(llm, model):
    """prefill_buckets=(32,): every prefill step padded to 32 tokens, so the warm-up runs only those prefill shapes
    (4 stream buckets, against 24 with the model's buckets), the outputs equal the default engine's, and nothing
    compiles after the warm-up; bad bucket lists are refused naming the argument."""
    few = LLM(model, max_seqs=8, max_tokens=512, page_size=16, token_budget=32, progress=False,
              prefill_buckets=(32,))
    assert {t for kind, t, _ in few.shapes() if kind == "prefill"} == {32}
    assert len(few.shapes()) < len(llm.shapes())
    prompts = _prompts(4, seed=8, hi=50)
    sp = SamplingParams(max_tokens=4)
    before = few.compiled_programs()
    got = [o.outputs[0].token_ids for o in few.generate(prompts, sp)]
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert few.compiled_programs() == before
    for bad in ((16,), (32, 16), (0, 32), [], "32"):
        with pytest.raises(ValueError, match="prefill_buckets"):
            LLM(model, max_seqs=8, token_budget=32, warmup=False, prefill_buckets=bad)


@ENGINE
def test_stop_ids_and_max_tokens(llm):
    prompt = _prompts(1, seed=4)[0]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=4))[0].outputs[0].token_ids
    stop_at = greedy[2]
    first = greedy.index(stop_at)
    out = llm.generate(prompt, SamplingParams(max_tokens=4, stop_token_ids=(stop_at,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[:first + 1]
    outs = llm.generate([prompt, prompt], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=3)])
    assert [o.outputs[0].token_ids for o in outs] == [greedy[:1], greedy[:3]]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@ENGINE
def test_out_of_pages_under_load_preempts_and_never_emits_refused_tokens(model, llm):
    """A pool of 5 pages of 16 tokens for 4 slots: 6 requests of 20-30 prompt tokens generating 12 each run out
    of pages; the engine preempts and recomputes; every request ends "length" with exactly the tokens it gets
    alone. A slot holds at most the pool (80 tokens, whatever max_seq_len asks): a 70-token prompt asking for 20
    tokens gets 11 (the last one sampled is never fed back), "length", the prefix of its alone-run tokens."""
    small = LLM(model, max_seqs=4, max_tokens=80, page_size=16, max_seq_len=128, token_budget=32, progress=False,
                warmup=False)
    assert small.max_seq_len == 80
    prompts = _prompts(6, seed=5, lo=20, hi=31)
    sp = SamplingParams(max_tokens=12)
    outs = small.generate(prompts, sp)
    assert small.stats["preempted"] > 0 and small.stats["refused_steps"] > 0 and small.stats["aborted"] == 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == llm.generate(p, sp)[0].outputs[0].token_ids
    big = _prompts(1, seed=6, lo=70, hi=71)[0]
    out = small.generate(big, SamplingParams(max_tokens=20))[0].outputs[0]
    alone = llm.generate(big, SamplingParams(max_tokens=20))[0].outputs[0].token_ids
    assert out.finish_reason == "length" and out.token_ids == alone[:11]


@ENGINE
def test_async_decode_gives_the_step_by_step_tokens(model, llm):
    """async_decode: the decode step after one whose ids are final on the device is queued before they are read.
    Greedy, plain temperature (every token kept: queued too) and top-k / top-p (candidates that may need the
    fallback: never queued) requests of mixed lengths, stop ids and max_tokens, 10 prompts for 8 slots (admissions
    while others decode), online arrivals: the same tokens and finish reasons as the step-by-step engine, steps were
    queued ahead, and no program is compiled past the warm-up. Out of pages (the small pool of the test above):
    every request ends "length" with its alone-run tokens."""
    fast = LLM(model, max_seqs=8, max_tokens=512, page_size=16, token_budget=32, progress=False)   # the default
    programs = fast.compiled_programs()
    prompts = _prompts(10, seed=11, lo=3, hi=40)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], SamplingParams(max_tokens=6))]
    settings = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=9, stop_token_ids=(greedy[0][2],)),
                SamplingParams(temperature=0.9, max_tokens=7, seed=4),
                SamplingParams(temperature=1.0, top_k=5, top_p=0.8, max_tokens=5, seed=5)]
    for sp in settings + [[settings[i % 4] for i in range(10)]]:
        want = llm.generate(prompts, sp)
        got = fast.generate(prompts, sp)
        assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == \
               [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in want], sp
    assert fast.stats["queued_ahead_steps"] > 0
    queued = fast.stats["queued_ahead_steps"]
    fast.generate(prompts[:4], settings[3])                    # top-p rows: no step queued ahead
    assert fast.stats["queued_ahead_steps"] == queued
    rid = fast.add_request(prompts[0], settings[0])            # online: one running, one arriving mid-decode
    done = fast.step() + fast.step()
    rid2 = fast.add_request(prompts[1], settings[0])
    while fast.has_unfinished_requests():
        done += fast.step()
    by_id = {o.request_id: o.outputs[0].token_ids for o in done}
    assert by_id[rid] == llm.generate(prompts[0], settings[0])[0].outputs[0].token_ids
    assert by_id[rid2] == llm.generate(prompts[1], settings[0])[0].outputs[0].token_ids
    assert fast.compiled_programs() == programs
    small = LLM(model, max_seqs=4, max_tokens=80, page_size=16, max_seq_len=128, token_budget=32, progress=False,
                warmup=False)
    assert fast.async_decode and small.async_decode                   # the default
    crowd = _prompts(6, seed=5, lo=20, hi=31)
    outs = small.generate(crowd, SamplingParams(max_tokens=12))
    assert small.stats["preempted"] > 0 and small.stats["aborted"] == 0
    for p, o in zip(crowd, outs):
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == llm.generate(p, SamplingParams(max_tokens=12))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="async_decode"):
        LLM(model, max_seqs=2, progress=False, warmup=False, async_decode=1)


def test_checkpoint_dir_with_its_tokenizer_round_trips(tmp_path):
    """``LLM(directory)``: a HF-layout checkpoint (config.json, model.safetensors) with a word-level tokenizer
    trained offline (``tokenizers``) saved beside it as tokenizer.json: the model and the tokenizer are loaded,
    string prompts are encoded with it, outputs decoded with it, and the prompt decodes back to itself."""
    import dataclasses
    import json
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from jax_gdn.checkpoint import random_state_dict
    cfg = preset("tiny", num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                 mlp_only_layers=(1,), vocab_size=VOCAB)
    save_file(random_state_dict(cfg, seed=3), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the gated delta rule keeps a state per head", "attention reads every page of its slot",
              "a state per slot and a page table per slot", "the model decodes one token per stream"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path), max_seqs=2, max_tokens=128, page_size=16, token_budget=16, dtype=jnp.float32,
              backend="xla", progress=False, warmup=False)
    assert llm.model.config.vocab_size == VOCAB and llm.tokenizer is not None
    prompt = "the model reads a state per slot"
    out = llm.generate(prompt, SamplingParams(max_tokens=4))[0]
    assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt).ids
    assert tok.decode(out.prompt_token_ids) == prompt
    ids = out.outputs[0].token_ids
    assert len(ids) == 4 and out.outputs[0].text == tok.decode(ids)


@ENGINE
def test_bad_arguments_are_refused_before_any_work(llm, model):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("a string prompt")
    with pytest.raises(ValueError, match="prompt 1 holds token ids outside"):
        llm.generate([[1, 2], [VOCAB + 3]])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="stop id"):
        llm.generate([[1]], SamplingParams(stop_token_ids=(VOCAB,)))
    with pytest.raises(ValueError, match="max_seq_len=512"):
        llm.generate([[1] * 513])
    with pytest.raises(ValueError, match="token_budget"):
        LLM(model, max_seqs=8, token_budget=4, warmup=False)
    with pytest.raises(ValueError, match="not a directory"):
        LLM("/no/such/dir", warmup=False)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model, tokenizer="/no/such/tokenizer.json", warmup=False)


def test_a_row_needing_the_full_sort_takes_it_in_one_program_from_its_next_token(monkeypatch):
    """top-p 0.9 alone on near-flat rows of 20000 logits (maxblocks' 8192 candidates hold ~0.4 of the mass): every
    draw needs the full sort. The first draw of each request runs the draw, the copy, the fallback program and its
    copy; from its next token on the engine runs the merged program (``draw_full_rows``: no fallback step). The
    tokens equal those of an engine that never merges (every step draws, then falls back), request by request."""
    cfg = preset("tiny", num_hidden_layers=1, layer_types=("linear_attention",), vocab_size=20000)
    model = HybridModel.random(cfg, 5, dtype=jnp.float32, backend="xla", std=0.02)
    prompts = _prompts(2, seed=4, lo=5, hi=20)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seed=3)

    def engine():
        return LLM(model, max_seqs=2, max_tokens=256, page_size=16, token_budget=64, progress=False, warmup=False)
    merged = engine()
    got = [o.outputs[0].token_ids for o in merged.generate(prompts, sp)]
    assert merged.stats["fallback_steps"] == 1 and merged.stats["full_sort_steps"] == 4      # 1 prefill + 4 decodes
    original = LLM._sample
    monkeypatch.setattr(LLM, "_sample", lambda self, logits, arrays, full=None: original(self, logits, arrays))
    plain = engine()
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    assert plain.stats["fallback_steps"] == 5 and plain.stats["full_sort_steps"] == 0
    assert got == want and all(len(t) == 5 for t in got)
