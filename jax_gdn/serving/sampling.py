"""Sampling parameters and the on-device sampler of the serving engine.

    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=64, stop_token_ids=(2,), seed=1)

:func:`sample_rows` draws one token per row of a [Nb, Vocab] logits array (the engine runs it inside its step's
program; :func:`sample` is it jitted alone): greedy (argmax, lowest id on ties) where temperature is 0, else a categorical draw from
softmax(logits / temperature) restricted to the top_k highest logits (0: all) and then to the smallest set of
tokens whose probability reaches top_p (the token that crosses top_p included). A request's draw at its n-th
generated token uses the key fold_in(PRNGKey(seed), n): the same seed gives the same tokens whatever else is in
the batch and after a preemption. When every row is greedy the program skips the sort (``lax.cond``).

Shape legend: Nb rows (the stream bucket of a step), Vocab the vocabulary.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SORTS", "SamplingParams", "descending_order", "sample", "sample_rows", "sampling_arrays"]


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


#: how :func:`sample_rows` ranks a row's logits (descending, ties by id; both give the same order):
#: "argsort" ``jnp.argsort(-x, stable=True)`` (a sort under a float total-order comparator); "keys" a stable
#: sort of int32 keys made from the float bits (order-preserving) with the ids as values: a plain integer
#: comparison, which XLA's GPU backend can hand to a radix sort
SORTS = ("argsort", "keys")


def descending_order(x, sort: str = "argsort"):
    """[Nb, Vocab] int32: each row's token ids by descending ``x`` (fp32), ties by ascending id (``SORTS``)."""
    if sort == "argsort":
        return jnp.argsort(-x, axis=-1, stable=True).astype(jnp.int32)
    if sort != "keys":
        raise ValueError(f"sort must be one of {SORTS}; got {sort!r}")
    x = jnp.where(x == 0, jnp.float32(0), x)                            # -0.0 ties with 0.0, as in argsort
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))                # ascending key = ascending float
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    _, order = jax.lax.sort_key_val(~key, ids, dimension=-1, is_stable=True)    # ~key: descending
    return order


def _draw(logits, temperature, top_k, top_p, seed, step, sort="argsort"):
    """Sampled ids [Nb] (every row drawn, greedy rows ignored by the caller)."""
    vocab = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)
    x = logits.astype(jnp.float32) / t[:, None]
    order = descending_order(x, sort)                                   # descending, ties by id
    xs = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    keep = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, xs, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                        # mass of the tokens ranked above
    keep = keep & (before < top_p[:, None])                             # the first token is always kept
    masked = jnp.where(keep, xs, -jnp.inf)

    def one(row, s, n):
        key = jax.random.fold_in(jax.random.PRNGKey(s), n)
        return jax.random.categorical(key, row)
    pick = jax.vmap(one)(masked, seed, step)                           # a rank
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample_rows(logits, temperature, top_k, top_p, seed, step, sort: str = "argsort"):
    """One token id per row of ``logits [Nb, Vocab]`` (module docstring): temperature, top_p [Nb] fp32; top_k,
    seed, step [Nb] int32; ``sort`` how rows are ranked (``SORTS``: the same draws either way). Returns int32
    [Nb]. Traceable: the engine calls it inside its step's program."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(temperature > 0),
                         lambda: _draw(logits, temperature, top_k, top_p, seed, step, sort), lambda: greedy)
    return jnp.where(temperature > 0, drawn, greedy)


#: :func:`sample_rows` as its own program
sample = jax.jit(sample_rows, static_argnames=("sort",))
