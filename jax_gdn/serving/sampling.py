"""Sampling parameters and the on-device sampler of the serving engine.

    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=64, stop_token_ids=(2,), seed=1)

:func:`sample_rows` draws one token per row of a [Nb, Vocab] logits array (:func:`sample` is it jitted alone; the
engine runs the same draws as :func:`draw_rows` and, for the rows that need it, :func:`fallback_rows`: programs with
no branch on the device, chosen on the host): greedy (argmax, lowest id on ties) where temperature is 0, else a
categorical draw from softmax(logits / temperature) restricted to the top_k highest logits (0: all; ties ranked by
ascending id) and then to the tokens whose probability ranked above them (among those) is < top_p (the token that
crosses top_p included; top_p 1 keeps all of them). :func:`kept_tokens` is that set as a mask. A request's draw at
its n-th generated token uses the key fold_in(PRNGKey(seed), n): the same seed gives the same tokens whatever else
is in the batch and after a preemption. When every row is greedy the program skips the rest (``lax.cond``).

Methods (``METHODS``; all keep the same tokens, but where a top-p boundary lies within float rounding of top_p):
  threshold  no sort. The top-k and top-p boundaries are found as values of order-preserving
             uint32 keys of the floats, 4 bits a round from the top (one reduction over the row per round, for
             15 candidates at once): the top-k one counting tokens, the top-p one summing exp(x - max); tokens
             tied at a boundary are split by id with the same search on the ids. A search that no sampled row
             needs is skipped (``lax.cond``: no top-k, top_p 1). The draw is an inverse CDF in id order over the
             kept tokens' mass with one uniform number per row (block sums, then within the block); it never lands on a
             token of zero mass.
  keys,      a full sort of each row (``SORTS``: ``descending_order``; "keys" sorts int32 keys),
  argsort    softmax and cumsum in rank order, then a Gumbel-max draw (``jax.random.categorical``) over the kept
             ranks; the two draw alike.
  blocks     short sorts only (``_blocks_keep``): each block of CANDIDATE_BLOCK tokens sorted alone, its
             CANDIDATES_PER_BLOCK best kept as candidates, the candidates sorted; the candidates above the best
             token left out are the row's exact first ranks, so where top_k <= their count (or top_k is off and
             they hold top_p of the mass) they decide the kept set and the Gumbel-max draw; a row keeping every
             token draws over the whole row; any other row falls back to "keys" (``lax.cond``). Draws differ from
             "keys"' (another mapping of the key) but follow the same distribution.
  maxblocks  no sort of the row (``_blocks_keep(select="max")``): the max of each block of MAX_BLOCK tokens, the
             MAX_BLOCKS_KEPT blocks of the largest maxima kept whole as candidates (one sort of the block maxima),
             then as "blocks" (the same kept set; draws differ from "blocks"' as the candidates do, same
             distribution). Its first ranks are fewer (L >= MAX_BLOCKS_KEPT where no block maxima tie), so top-p
             alone falls back to "keys" on more rows. The default.
Measured on the H200 (``python -m benchmarks serving --cases sampling``, commit 8c8daaf, 2026-12-03; [rows,
151936] fp32 logits, temperature 0.8, top-k 50, top-p 0.95; results "serving" in benchmarks/results/h200.json), the
sampler alone, ms at 16 / 64 rows: blocks 0.281 / 0.924, keys 0.738 / 1.473, argsort 0.758 / 2.090, threshold
1.209 / 4.655 (its ~26 dependent reductions over [rows, Vocab, 15] cost more than XLA's sort), greedy 0.121 /
0.088. Hence "blocks" the default then (``DEFAULT_METHOD``); with "keys" the decode step of 8 layers at 80B dims took
+18.7% / +2.8% over its greedy step (3.143 / 7.405 ms), with "blocks" +5.7% / +11.1% (3.060 / 6.933 ms; aef319c).
At 110464b (the same command) maxblocks alone took 0.131 / 0.356 ms against blocks' 0.286 / 0.790, so it is the
default since; inside the step (d311ca9) +0.4% / +7.9% over greedy (3.085 / 7.037 ms).
threshold's draws differ from the sort methods' (another mapping of the same key to a token) but follow the same
distribution. A row of all -inf logits: threshold draws uniformly over its kept tokens, the sort methods draw the
first-ranked.

Shape legend: Nb rows (the stream bucket of a step), Vocab the vocabulary.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEFAULT_METHOD", "METHODS", "SORTS", "SamplingParams", "descending_order", "draw_full_rows", "draw_rows",
           "fallback_rows", "keeps_every_token", "kept_tokens", "sample", "sample_rows", "sampling_arrays"]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops (vLLM's names and defaults where vLLM has them).

    temperature: >= 0; 0 is greedy. top_k: >= 0; 0 keeps every token. top_p: in (0, 1]. max_tokens: >= 1
    tokens to generate at most (finish_reason "length"). stop_token_ids: ids that end the request when sampled
    (finish_reason "stop"; the stop id is the last of the output's token_ids). seed: the request's sampling seed
    (an int in [0, 2**31))."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple = ()
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0: greedy); "
                             f"got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0: every token); got {self.top_k!r}")
        if not isinstance(self.top_p, numbers.Real) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1]; got {self.top_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1; got {self.max_tokens!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__") \
                or not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of token ids >= 0; got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not _is_int(self.seed) or not 0 <= self.seed < 2 ** 31:
            raise ValueError(f"SamplingParams.seed must be an int in [0, 2**31); got {self.seed!r}")


def sampling_arrays(params, steps, rows: int):
    """The per-row operands of :func:`sample` for ``params`` (a list of SamplingParams, one per stream) and
    ``steps`` (each stream's count of tokens generated so far), padded to ``rows`` with greedy rows: (temperature
    [rows] fp32, top_k [rows] int32, top_p [rows] fp32, seed [rows] int32, step [rows] int32) as NumPy arrays."""
    n = len(params)
    temp = np.zeros((rows,), np.float32)
    top_k = np.zeros((rows,), np.int32)
    top_p = np.ones((rows,), np.float32)
    seed = np.zeros((rows,), np.int32)
    step = np.zeros((rows,), np.int32)
    for i, (p, s) in enumerate(zip(params, steps)):
        temp[i], top_k[i], top_p[i], seed[i], step[i] = p.temperature, p.top_k, p.top_p, p.seed, s
    assert n <= rows
    return temp, top_k, top_p, seed, step


#: how :func:`descending_order` ranks a row's logits (descending, ties by id; both give the same order):
#: "argsort" ``jnp.argsort(-x, stable=True)`` (a sort under a float total-order comparator); "keys" a stable
#: sort of int32 keys made from the float bits (order-preserving) with the ids as values: a plain integer
#: comparison, which XLA's GPU backend can hand to a radix sort
SORTS = ("argsort", "keys")
#: how :func:`sample_rows` finds the kept tokens and draws (module docstring): a full sort of each row by one of
#: ``SORTS``, "threshold" (no sort), "blocks" (sorts of short rows only) or "maxblocks" (no sort of the row; the
#: default: the fastest measured)
METHODS = ("keys", "argsort", "threshold", "blocks", "maxblocks")
DEFAULT_METHOD = "maxblocks"
#: tokens per block of the threshold method's two-level inverse-CDF search
_BLOCK = 1024
#: the blocks method: tokens per block sorted (one short sort per block), candidates kept per block
CANDIDATE_BLOCK = 1024
CANDIDATES_PER_BLOCK = 64
#: the maxblocks method: tokens per block (one max each), blocks kept whole as candidates (8192 tokens)
MAX_BLOCK = 128
MAX_BLOCKS_KEPT = 64
#: the methods that draw from candidates (``_blocks_keep``'s arguments)
BLOCK_METHODS = {"blocks": {}, "maxblocks": {"block": MAX_BLOCK, "per_block": MAX_BLOCKS_KEPT, "select": "max"}}


def _check_method(method):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")


def _order_key(x):
    """int32 keys of fp32 ``x`` whose signed order is the float order (-0.0 and 0.0 alike)."""
    x = jnp.where(x == 0, jnp.float32(0), x)                            # -0.0 ties with 0.0, as in argsort
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))               # ascending key = ascending float


def descending_order(x, sort: str = "argsort"):
    """[Nb, Vocab] int32: each row's token ids by descending ``x`` (fp32), ties by ascending id (``SORTS``)."""
    if sort == "argsort":
        return jnp.argsort(-x, axis=-1, stable=True).astype(jnp.int32)
    if sort != "keys":
        raise ValueError(f"sort must be one of {SORTS}; got {sort!r}")
    key = _order_key(x)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    _, order = jax.lax.sort_key_val(~key, ids, dimension=-1, is_stable=True)    # ~key: descending
    return order


def _mass(x, keep):
    """Unnormalised softmax of ``x`` over ``keep`` (0 elsewhere): exp(x - max), and 1 where x is the row's
    max (a +inf max gets the whole mass, a row of -inf is uniform); the max is the first-ranked token's, always
    kept."""
    m = jnp.max(jnp.where(keep, x, -jnp.inf), axis=-1, keepdims=True)
    return jnp.where(keep, jnp.where(x == m, jnp.float32(1), jnp.exp(x - m)), jnp.float32(0))


def _top_k(top_k, vocab):
    """The kept ranks per row: top_k where 0 < top_k < vocab, else vocab."""
    return jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab).astype(jnp.int32)


def _sorted_keep(x, top_k, top_p, sort):
    """(order, x by rank, kept ranks [Nb, Vocab] bool) by a full sort of each row."""
    vocab = x.shape[-1]
    order = descending_order(x, sort)                                   # descending, ties by id
    xs = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    keep = rank < _top_k(top_k, vocab)[:, None]
    p = _mass(xs, keep)
    probs = p / jnp.sum(p, axis=-1, keepdims=True)
    before = jnp.cumsum(probs, axis=-1) - probs                        # mass of the tokens ranked above
    keep = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1))  # the first token is always kept
    return order, xs, keep


def _boundary(ukey, w, target, bits: int):
    """Per row the largest c with sum(w[ukey >= c]) >= target (uint32 [Nb]; 0 when none is): ``ukey`` [Nb, V]
    uint32, ``w`` [Nb, V] >= 0 (int32 or fp32), ``target`` [Nb]; the keys' values below 2**bits. Found 4 bits a
    round from the top, one reduction over the row per round for the 15 candidates c | d << shift (d = 1..15;
    the sums fall as d grows, so the largest d whose sum reaches the target is the round's digit). No candidate
    overflows: d fills bits that are zero in c."""
    rounds = -(-bits // 4)
    d = jnp.arange(1, 16, dtype=jnp.uint32)
    c = jnp.zeros(ukey.shape[:1], jnp.uint32)
    zero = jnp.zeros((), w.dtype)
    for r in reversed(range(rounds)):
        cand = c[:, None] | (d[None, :] << jnp.uint32(4 * r))                                       # [Nb, 15]
        sums = jnp.sum(jnp.where(ukey[:, :, None] >= cand[:, None, :], w[:, :, None], zero), axis=1)
        digit = jnp.max(jnp.where(sums >= target[:, None], d[None, :], jnp.uint32(0)), axis=1)
        c = c | (digit << jnp.uint32(4 * r))
    return c


def _first_ties(rid, tie, m, bits: int):
    """[Nb, V] bool: the first ``m`` [Nb] tokens by ascending id among ``tie`` [Nb, V] bool (``rid`` = V-1-id)."""
    b = _boundary(rid, tie.astype(jnp.int32), m, bits)
    return tie & (rid >= b[:, None])


def _threshold_keep(x, top_k, top_p, active):
    """(kept tokens [Nb, V] bool, their unnormalised mass [Nb, V] fp32, 0 where not kept) with no sort: the top-k
    and top-p boundaries as key values by :func:`_boundary`, ties at a boundary split by id. ``active`` [Nb] bool:
    the rows whose result is used; a search no active row needs is skipped (``lax.cond``)."""
    nb, vocab = x.shape
    ukey = jax.lax.bitcast_convert_type(_order_key(x), jnp.uint32) ^ jnp.uint32(0x80000000)  # unsigned order
    id_bits = max(1, (vocab - 1).bit_length())
    rid = (vocab - 1 - jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)).astype(jnp.uint32)
    every = jnp.ones(x.shape, bool)
    k = _top_k(top_k, vocab)
    use_k = active & (k < vocab)
    use_p = active & (top_p < 1)

    def by_top_k():
        c = _boundary(ukey, jnp.ones(x.shape, jnp.int32), k, 32)[:, None]
        above, tie = ukey > c, ukey == c
        m = k - jnp.sum(above, axis=1, dtype=jnp.int32)                # ties kept: the first m by id
        return above | _first_ties(rid, tie, m, id_bits) | ~use_k[:, None]
    kept = jax.lax.cond(jnp.any(use_k), by_top_k, lambda: every)
    p = _mass(x, kept)

    def by_top_p():
        target = top_p * jnp.sum(p, axis=1)
        c = _boundary(ukey, p, target, 32)[:, None]
        above, tie = kept & (ukey > c), kept & (ukey == c)
        ties = jnp.sum(tie, axis=1, dtype=jnp.int32)
        q = jnp.max(jnp.where(tie, p, 0), axis=1)                       # the tied tokens' (equal) mass
        rest = target - jnp.sum(jnp.where(above, p, 0), axis=1)        # mass before the j-th tie < target: j < rest / q
        m = jnp.clip(jnp.ceil(rest / jnp.where(q > 0, q, 1)), 1, jnp.maximum(ties, 1)).astype(jnp.int32)
        return jnp.where(use_p[:, None], above | _first_ties(rid, tie, m, id_bits), kept)
    kept = jax.lax.cond(jnp.any(use_p), by_top_p, lambda: kept)
    return kept, jnp.where(kept, p, 0)


def _block_candidates(xp, blk: int, per_block: int):
    """The blocks method's candidates of the padded rows ``xp`` [Nb, nblk blk]: (ids [Nb, nblk kb] in id order,
    m* [Nb] the largest logit not a candidate): each block sorted alone, its kb = min(per_block, blk) best."""
    nb = xp.shape[0]
    nblk = xp.shape[1] // blk
    kb = min(per_block, blk)
    key = _order_key(xp).reshape(nb, nblk, blk)
    local = jax.lax.broadcasted_iota(jnp.int32, key.shape, 2)
    _, order = jax.lax.sort_key_val(~key, local, dimension=-1, is_stable=True)     # each block, descending
    base = (jnp.arange(nblk, dtype=jnp.int32) * blk)[None, :, None]
    ids = (order[:, :, :kb] + base).reshape(nb, nblk * kb)           # block by block: ties in id order
    if kb < blk:
        left = jnp.take_along_axis(xp.reshape(nb, nblk, blk), order[:, :, kb:kb + 1], axis=2)
        return ids, jnp.max(left[:, :, 0], axis=1)                     # the largest logit not a candidate
    return ids, jnp.full((nb,), -jnp.inf, xp.dtype)


def _max_block_candidates(xp, blk: int, blocks: int):
    """The maxblocks method's candidates (as :func:`_block_candidates`): every token of the ``blocks`` blocks of
    ``blk`` tokens with the largest maxima (ties by block index); m* is the next block's max. One reduction over
    the row and a sort of the block maxima, no sort of the row."""
    nb = xp.shape[0]
    nblk = xp.shape[1] // blk
    kb = min(blocks, nblk)
    bmax = jnp.max(xp.reshape(nb, nblk, blk), axis=2)                  # [Nb, nblk]
    _, border = jax.lax.sort_key_val(~_order_key(bmax), jax.lax.broadcasted_iota(jnp.int32, bmax.shape, 1),
                                     dimension=-1, is_stable=True)     # blocks by descending max
    chosen = jnp.sort(border[:, :kb], axis=1)                          # id order, so ties stay by id
    ids = (chosen[:, :, None] * blk + jnp.arange(blk, dtype=jnp.int32)[None, None, :]).reshape(nb, kb * blk)
    if kb < nblk:
        return ids, jnp.take_along_axis(bmax, border[:, kb:kb + 1], axis=1)[:, 0]
    return ids, jnp.full((nb,), -jnp.inf, xp.dtype)


def _blocks_keep(x, top_k, top_p, *, block: int = CANDIDATE_BLOCK, per_block: int = CANDIDATES_PER_BLOCK,
                 select: str = "sort"):
    """The blocks methods' candidates: (ids [Nb, M] int32 by rank, x by rank [Nb, M], kept ranks [Nb, M] bool,
    exact [Nb] bool, every [Nb] bool: the rows that keep every token).

    select "sort" (method "blocks"): each block of ``block`` tokens is sorted alone (descending, ties by id) and its
    first ``per_block`` tokens are candidates, M = ceil(Vocab / block) per_block. select "max" (method
    "maxblocks"): the ``per_block`` blocks of ``block`` tokens with the largest maxima are candidates whole, M =
    per_block block. Either way the candidates are sorted (a stable sort of the id-ordered list: ties stay by id),
    and every token above m* (the largest logit left out) is a candidate, so the first L candidates (those above
    m*) are exactly the row's first L ranks. The kept set is worked out on the
    candidates as :func:`_sorted_keep` does on the whole row (top-p normalised by the whole top-k set: the
    candidates' own mass where top_k <= L, the whole row's where top_k is off); ``exact`` says where that is the
    row's own kept set: top_k <= L, or top_k off, top_p < 1 and the first L ranks already hold top_p of the
    mass. Elsewhere (a flat row under top-p alone, top_k > L, or every token kept) the caller takes another path."""
    if select not in ("sort", "max"):
        raise ValueError(f"select must be 'sort' or 'max'; got {select!r}")
    nb, vocab = x.shape
    blk = min(block, vocab)
    nblk = -(-vocab // blk)
    pad = nblk * blk - vocab
    xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)     # padding ids >= Vocab, never kept
    if select == "sort":
        ids, m_star = _block_candidates(xp, blk, per_block)
    else:
        ids, m_star = _max_block_candidates(xp, blk, per_block)
    cx = jnp.take_along_axis(xp, ids, axis=1)
    _, rank_order = jax.lax.sort_key_val(~_order_key(cx), jax.lax.broadcasted_iota(jnp.int32, cx.shape, 1),
                                         dimension=-1, is_stable=True)
    ids = jnp.take_along_axis(ids, rank_order, axis=1)
    xs = jnp.take_along_axis(cx, rank_order, axis=1)
    exact_ranks = jnp.sum(xs > m_star[:, None], axis=1, dtype=jnp.int32)     # L
    rank = jnp.arange(xs.shape[1], dtype=jnp.int32)[None, :]
    k = _top_k(top_k, vocab)
    keep = (rank < k[:, None]) & (ids < vocab)
    p = _mass(xs, keep)
    m = xs[:, :1]                                                      # the row's max (always a candidate)
    whole = jnp.sum(jnp.where(x == m, jnp.float32(1), jnp.exp(x - m)), axis=1, keepdims=True)
    top_k_on = k < vocab
    probs = p / jnp.where(top_k_on[:, None], jnp.sum(p, axis=-1, keepdims=True), whole)
    cum = jnp.cumsum(probs, axis=-1)
    before = cum - probs
    keep = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    # the mass ranked above rank L, from the same cumsum the kept set was read from (no second rounding)
    held = jnp.take_along_axis(jnp.pad(cum, ((0, 0), (1, 0))), exact_ranks[:, None], axis=1)[:, 0]
    exact = (top_k_on & (k <= exact_ranks)) | (~top_k_on & (top_p < 1) & (held >= top_p))
    return ids, xs, keep, exact, ~top_k_on & (top_p >= 1)


def kept_tokens(x, top_k, top_p, method: str = DEFAULT_METHOD):
    """[Nb, Vocab] bool, in id order: the tokens each row may draw from (module docstring) for fp32 ``x`` (the
    logits over the temperature), top_k [Nb] int32 and top_p [Nb] fp32; ``method`` one of ``METHODS`` (every
    method keeps the same tokens)."""
    _check_method(method)
    if method == "threshold":
        return _threshold_keep(x, top_k, top_p, jnp.ones(x.shape[:1], bool))[0]
    rows = jnp.arange(x.shape[0])[:, None]
    if method in BLOCK_METHODS:
        ids, _, keep, exact, every = _blocks_keep(x, top_k, top_p, **BLOCK_METHODS[method])
        mine = jnp.zeros(x.shape, bool).at[rows, ids].set(keep, mode="drop")
        full = jax.lax.cond(jnp.any(~exact & ~every), lambda: kept_tokens(x, top_k, top_p, "keys"),
                            lambda: jnp.zeros(x.shape, bool))
        return jnp.where(exact[:, None], mine, every[:, None] | full)
    order, _, keep = _sorted_keep(x, top_k, top_p, method)
    return jnp.zeros(x.shape, bool).at[rows, order].set(keep)


def _inverse_cdf(w, u):
    """[Nb] int32: per row the token whose cumulative mass (id order) first exceeds u * total, u [Nb] in [0, 1),
    ``w`` [Nb, V] >= 0 with a positive entry in every row; by block sums then within the block. The pick always
    has positive mass, whatever the rounding."""
    nb, vocab = w.shape
    block = min(_BLOCK, vocab)
    nblk = -(-vocab // block)
    w = jnp.pad(w, ((0, 0), (0, nblk * block - vocab))).reshape(nb, nblk, block)
    sums = jnp.sum(w, axis=2)                                           # [Nb, nblk]
    cum = jnp.cumsum(sums, axis=1)
    total = cum[:, -1]
    target = jnp.minimum(u * total, jnp.nextafter(total, jnp.float32(0)))

    def first(hit, fallback):
        """Index of the first True of ``hit`` [Nb, n], else of the last True of ``fallback``."""
        n = hit.shape[1]
        last = n - 1 - jnp.argmax(fallback[:, ::-1], axis=1)
        return jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), last).astype(jnp.int32)
    b = first((cum > target[:, None]) & (sums > 0), sums > 0)
    before = jnp.where(b > 0, jnp.take_along_axis(cum, jnp.maximum(b - 1, 0)[:, None], axis=1)[:, 0], 0)
    inner = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]      # [Nb, block]
    i = first((before[:, None] + jnp.cumsum(inner, axis=1) > target[:, None]) & (inner > 0), inner > 0)
    return b * block + i


def _scaled(logits, temperature, seed, step):
    """(logits / temperature fp32 [Nb, Vocab] (greedy rows over 1), each row's key fold_in(PRNGKey(seed), step))."""
    t = jnp.where(temperature > 0, temperature, 1.0)
    x = logits.astype(jnp.float32) / t[:, None]
    return x, jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seed, step)


def _draw(logits, temperature, top_k, top_p, seed, step, method):
    """Sampled ids [Nb] (every row drawn, greedy rows ignored by the caller)."""
    x, keys = _scaled(logits, temperature, seed, step)
    if method == "threshold":
        _, w = _threshold_keep(x, top_k, top_p, temperature > 0)
        return _inverse_cdf(w, jax.vmap(jax.random.uniform)(keys))
    if method in BLOCK_METHODS:
        ids, xs, keep, exact, every = _blocks_keep(x, top_k, top_p, **BLOCK_METHODS[method])
        pick = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, xs, -jnp.inf))
        mine = jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
        sampled = temperature > 0
        none = lambda: jnp.zeros_like(mine)  # noqa: E731  (a branch no sampled row reads)
        # every token kept: one draw over the whole row, only where such a row is sampled
        plain = jax.lax.cond(jnp.any(every & sampled),
                             lambda: jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32), none)
        full = jax.lax.cond(jnp.any(~exact & ~every & sampled),
                            lambda: _draw(logits, temperature, top_k, top_p, seed, step, "keys"), none)
        return jnp.where(exact, mine, jnp.where(every, plain, full))
    order, xs, keep = _sorted_keep(x, top_k, top_p, method)
    pick = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, xs, -jnp.inf))    # a rank
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample_rows(logits, temperature, top_k, top_p, seed, step, method: str = DEFAULT_METHOD):
    """One token id per row of ``logits [Nb, Vocab]`` (module docstring): temperature, top_p [Nb] fp32; top_k,
    seed, step [Nb] int32; ``method`` how the kept tokens are found and drawn from (``METHODS``). Returns int32
    [Nb]. Traceable; its ``lax.cond``s skip the work no row needs (on a GPU each may wait on the host: the engine
    uses :func:`draw_rows` instead)."""
    _check_method(method)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(temperature > 0),
                         lambda: _draw(logits, temperature, top_k, top_p, seed, step, method), lambda: greedy)
    return jnp.where(temperature > 0, drawn, greedy)


#: :func:`sample_rows` as its own program
sample = jax.jit(sample_rows, static_argnames=("method",))


# ---- the engine's sampler: the same draws as sample_rows, with no branch on the device ----------------------------
# XLA's GPU runtime runs a ``lax.cond`` that it has not captured into a command buffer (a CUDA graph) by copying its
# predicate to the host and waiting for the device there (its ConditionalThunk), so each such cond of sample_rows
# drains the step's queue of launched kernels (three in a sampled step). The engine instead
# picks, on the host, from what its requests asked for, which of these programs to run after the model's step, and
# reads back which rows need the full-sort fallback with the sampled ids (the same copy); only then, and only for a
# step that has such rows, does it run the fallback program. Their merged result is sample_rows' exactly.
def keeps_every_token(top_k, top_p, vocab: int):
    """Per row, whether it keeps every token (top_k off, top_p 1): bool [Nb], on the host (NumPy operands, how the
    engine picks its sampler) or traced (jax operands)."""
    return ~((top_k > 0) & (top_k < vocab)) & (top_p >= 1)


def draw_rows(logits, temperature, top_k, top_p, seed, step, *, plain: bool, method: str = DEFAULT_METHOD):
    """(ids [Nb] int32, need [Nb] bool) for :func:`sample_rows`' operands, with no ``lax.cond``: ids are
    sample_rows' wherever ``need`` is False; a row with ``need`` takes :func:`fallback_rows`' id instead.
    ``plain`` (static, from :func:`keeps_every_token` on the host): some sampled row keeps every token, so the
    whole-row draw is made here; without it such rows are left to the fallback. Methods outside ``BLOCK_METHODS``
    draw every row here (need all False; "threshold" keeps the conds of its searches)."""
    _check_method(method)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0
    if method not in BLOCK_METHODS:
        drawn = _draw(logits, temperature, top_k, top_p, seed, step, method)
        return jnp.where(sampled, drawn, greedy), jnp.zeros(sampled.shape, bool)
    x, keys = _scaled(logits, temperature, seed, step)
    ids, xs, keep, exact, every = _blocks_keep(x, top_k, top_p, **BLOCK_METHODS[method])
    pick = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, xs, -jnp.inf))
    mine = jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    drawn = mine
    if plain:
        drawn = jnp.where(every & ~exact, jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32), mine)
    need = sampled & ~exact & (~every if plain else True)
    return jnp.where(sampled, drawn, greedy), need


def draw_full_rows(logits, temperature, top_k, top_p, seed, step, *, plain: bool, method: str = DEFAULT_METHOD):
    """(ids [Nb] int32, need [Nb] bool): :func:`draw_rows` and :func:`fallback_rows` in one program, merged on the
    device where ``need``: sample_rows' ids on every row, with no cond and no second copy, for the price of the
    full sort over every row. The engine runs it in place of ``draw_rows`` for a step where a sampled row needed
    the fallback at its previous token (random weights' flat rows under top-p alone need it at every token)."""
    ids, need = draw_rows(logits, temperature, top_k, top_p, seed, step, plain=plain, method=method)
    full = fallback_rows(logits, temperature, top_k, top_p, seed, step, method=method)
    return jnp.where(need, full, ids), need


def fallback_rows(logits, temperature, top_k, top_p, seed, step, *, method: str = DEFAULT_METHOD):
    """[Nb] int32: sample_rows' ids for the rows :func:`draw_rows` marked ``need`` (rows keeping every token: the
    whole-row draw; the others: the "keys" sort's draw); the other rows' ids are not sample_rows'. No cond."""
    _check_method(method)
    x, keys = _scaled(logits, temperature, seed, step)
    every = keeps_every_token(top_k, top_p, x.shape[-1])
    full = _draw(logits, temperature, top_k, top_p, seed, step, "keys")
    return jnp.where(every, jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32), full)
