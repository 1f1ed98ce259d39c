"""The offline serving interface (vLLM's): an engine over one HybridModel and its cache.

    from jax_gdn.serving import LLM, SamplingParams
    llm = LLM(model, max_seqs=8, max_tokens=4096, page_size=16)          # a HybridModel or a checkpoint directory
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason     # [..], "stop" | "length" | "abort"

What one engine step does (continuous batching; the model's step, then the sampler, queued back to back):
  1. waiting requests take free slots (FIFO, at most ``max_seqs`` running);
  2. each running request feeds the tokens of its sequence (prompt + generated) not yet in the cache: one token
     for a request that is generating, a chunk of its prompt otherwise, chunks cut to what is left of the step's
     ``token_budget`` after the generating requests' tokens (chunked prefill mixed with decode);
  3. one call of the model's pure step (``model.step_fn``: decode when every fed stream has one token and is
     generating, else prefill with the streams packed, padded to the model's shape buckets), then one call of a
     sampler program on its logits, chosen on the host from the requests' SamplingParams (argmax when every row
     is greedy, else :func:`jax_gdn.serving.sampling.draw_rows`, which branches nowhere on the device: XLA's GPU
     runtime waits on the host at a ``lax.cond`` it runs outside a CUDA graph), then ONE device-to-host copy of
     the sampled ids, the rows that need the full-sort fallback and the cache's status; only a step with such
     rows runs the fallback program (:func:`~jax_gdn.serving.sampling.fallback_rows`) and copies its ids. A
     request whose last draw needed the fallback draws its next token with the full sort in the same program
     (:func:`~jax_gdn.serving.sampling.draw_full_rows`: no second program or copy). The tokens are
     :func:`~jax_gdn.serving.sampling.sample_rows`' exactly, whichever program ran;
  4. a request whose sequence is now wholly in the cache takes its sampled token; it finishes on a stop id
     ("stop"), at max_tokens or at the slot's length limit ("length"); finished slots are released (one call).

Out of KV pages: the model refuses the whole step on the device (nothing written, zero logits) and records it
in the cache's status, which step 3's copy brings back: no token of that step is used. The engine clears the
status, preempts the request admitted last (its slot released; it waits at the head of the queue, admitted again
once a request has finished, and recomputes its prompt and the tokens generated so far, which are kept, so its
output is the same) and runs the step again. A request is never refused while it runs alone (a slot's length
limit, which the engine applies as "length", fits the pool); if the model refused one anyway it would finish
with "abort" rather than loop.

Prefix cache (``prefix_cache=True``, :mod:`jax_gdn.serving.prefix_cache`): a prompt chunk is cut where the
cache wants a snapshot (the end of the prefix this prompt shares with earlier ones, on the grid of ``block_size``
tokens), else it runs to the budget as without the cache; after a step that leaves a request's prompt on a wanted
boundary, its slot is copied into one of
``prefix_slots`` snapshot slots (``HybridModel.fork``: GDN states, length, its KV pages shared), keyed by
the hash chain of its blocks; an admitted request whose sequence starts with a cached prefix starts from a fork of
that snapshot and feeds only the rest. Out of pages, the least recently used snapshot goes before any request is
preempted. ``llm.prefix_cache.stats``: lookups, hits, hit_tokens, snapshots, evictions. ``llm.host_s``: the host's
wall seconds of every step so far by phase (``HOST_PHASES``).

Overlapped decode (``async_decode``, on by default): a decode step whose sampled ids are final on the device (every row
greedy, or every sampled row keeping every token, or the merged full-sort draw), with nobody waiting to be admitted
and no row at its last token, queues the next decode step of the same requests, fed those ids on the device,
before it copies them to the host; the host's work between steps (the copy, the tokens, the next step's
dispatch) then overlaps the device's. A request that stops at the first of the two has one token computed past
its end, dropped; a refused first step voids the second (it ran on the refused cache and wrote nothing). Tokens
and finish reasons are the step-by-step engine's (tested); out of pages the two may preempt at different steps.

Online use (vLLM's LLMEngine calls): ``rid = llm.add_request(prompt, params)`` queues a request at any time (its
metrics count from then); each ``llm.step()`` runs one engine step and returns the RequestOutputs that finished in
it; ``llm.has_unfinished_requests()``. ``generate`` queues its prompts and steps until they have finished.

No request pays a compile: :meth:`LLM.warmup` (run by the constructor unless ``warmup=False``) compiles every
program the loop can call (each prefill token bucket up to the budget with each stream bucket, each decode
stream bucket, the sampler per stream bucket, the release) behind a progress bar; ``compiled_programs()`` then
stays fixed.

Shape legend: S slots (max_seqs), T tokens of one step (<= token_budget), N streams of one step (<= S),
Nb its stream bucket.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import time
import weakref
from typing import List, Optional, Sequence

import jax
import numpy as np

from jax_gdn.serving.prefix_cache import PrefixCache, block_hashes
from jax_gdn.serving.sampling import (SamplingParams, draw_full_rows, draw_rows, fallback_rows,
                                      keeps_every_token, sampling_arrays)

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "FINISH_REASONS"]

FINISH_REASONS = ("stop", "length", "abort")
#: the phases of ``LLM.host_s`` (host wall time of the engine's steps): "admit" (queue to slots, and with the
#: prefix cache the lookup, the fork of hits and the read of its status), "plan" (each request's tokens),
#: "dispatch" (padding, the step's and the sampler's program calls: queued, not waited on), "wait" (the copy of
#: the ids and status, so the device's time shows here), "fallback" (the full-sort program and its copy, on the
#: steps that need it), "tokens" (taking tokens, finishing requests), "snapshot" (the prefix cache's forks),
#: "release" (finished slots)
HOST_PHASES = ("admit", "plan", "dispatch", "wait", "fallback", "tokens", "snapshot", "release")


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request: generated token ids, their text (with a tokenizer, else ""), finish_reason
    ("stop", "length" or "abort"), index (0: one completion per request)."""
    index: int
    token_ids: List[int]
    text: str
    finish_reason: str


@dataclasses.dataclass
class RequestOutput:
    """A request's result: request_id (the engine's count of requests before it: in one ``generate`` on a fresh
    engine, its position in the prompts), prompt, prompt_token_ids, outputs, metrics (seconds from its arrival, the
    start of ``generate`` or its ``add_request``: "first_token_s", "finished_s"; "tpot_s": the mean time between its
    output tokens after the first; "prefix_hit_tokens": prompt tokens taken from the prefix cache)."""
    request_id: int
    prompt: object
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool = True
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Request:
    rid: int
    prompt_ids: np.ndarray
    params: SamplingParams
    limit: int                                # tokens the request may generate (max_tokens, or the slot's room)
    generated: list = dataclasses.field(default_factory=list)
    slot: int = -1
    fed: int = 0                              # tokens of the sequence already in the cache (its slot)
    finish: Optional[str] = None
    token_times: list = dataclasses.field(default_factory=list)   # seconds from its arrival, per token
    arrival: float = 0.0                      # perf_counter when it was queued (add_request / generate)
    prompt: object = None                     # as the caller gave it (RequestOutput.prompt)
    hit_tokens: int = 0
    block_keys: Optional[list] = None         # the prefix cache's chain hashes of the prompt's blocks
    full_sort: bool = False                   # its last draw needed the full sort: the next one runs it at once

    @property
    def seq_len(self) -> int:
        return self.prompt_ids.shape[0] + len(self.generated)

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        p = self.prompt_ids.shape[0]
        head = self.prompt_ids[lo:min(hi, p)]
        tail = np.asarray(self.generated[max(lo - p, 0):max(hi - p, 0)], np.int32)
        return np.concatenate([head, tail]).astype(np.int32)


_UNPLACED = object()


@dataclasses.dataclass
class _Queued:
    """A step queued on the device and not read yet: its kind ("prefill" / "decode"), its feeds, the logits and
    sampling arrays (for a fallback), the sampler's ids and need (device arrays; need None: every row greedy),
    whether the full sort is merged in, the cache's status after it, and whether its ids are final on the device
    (no fallback can replace one)."""
    kind: str
    feeds: list
    logits: object
    arrays: tuple
    ids: object
    need: object
    merged: bool
    status: object
    final: bool


#: the prefix cache's default block size (tokens): the snapshot grid. Measured (docs/serving.md, the block sweep):
#: with snapshots only at branch points, smaller blocks lose fewer prefix tokens to rounding and take about as many
#: snapshots; 64 serves 95% of 16's hit tokens with a quarter of its block hashes and sightings on the host.
DEFAULT_BLOCK_SIZE = 64


class LLM:
    """The serving engine (module docstring).

    model: a :class:`jax_gdn.model.HybridModel` or a HF checkpoint directory (``jax_gdn.checkpoint.load_pretrained``
    with ``dtype`` and ``backend``; its tokenizer.json is loaded when ``tokenizer`` is None and the file exists).
    max_seqs, max_tokens, page_size, max_seq_len: the cache (``model.init_cache``): concurrent requests, KV pool
    tokens, tokens per page, tokens per slot (default max_tokens). token_budget: tokens fed per step (default
    min(max_tokens, 2048)). tokenizer: None, a path to a tokenizer.json, or an object with ``encode(str)`` ->
    ids (or ``.ids``) and ``decode(ids)`` -> str (``tokenizers.Tokenizer``). progress: tqdm bars for warm-up and
    generate. warmup: compile every program now (:meth:`warmup`). prefix_cache: the exact prefix cache (module
    docstring) with ``block_size`` tokens per block (default ``DEFAULT_BLOCK_SIZE`` = 64, rounded up to a
    multiple of page_size so that snapshots share whole pages; docs/serving.md has the measurement) and
    ``prefix_slots`` snapshot slots (default max_seqs; the cache gets max_seqs + prefix_slots slots); a boundary
    is snapshotted once ``prefix_min_uses`` prompts have reached it (default 2: once it is shared).
    prefill_buckets: the token counts prefill steps are padded to (increasing, the last >= token_budget; default
    the model's ``token_buckets`` up to the budget's): fewer buckets, fewer programs for the warm-up to compile
    (vLLM's capture sizes), more padding per step.
    async_decode: queue the next decode step before reading this one's ids (module docstring, "Overlapped
    decode"); on by default (False: every step's ids read before the next step is dispatched).
    """

    def __init__(self, model, *, max_seqs: int = 8, max_tokens: int = 4096, page_size: int = 16,
                 max_seq_len: Optional[int] = None, token_budget: Optional[int] = None, tokenizer=None,
                 dtype=None, backend: str = "auto", progress: bool = True, warmup: bool = True,
                 prefix_cache: bool = False, block_size: Optional[int] = None, prefix_slots: Optional[int] = None,
                 prefix_min_uses: int = 2, prefill_buckets: Optional[Sequence[int]] = None,
                 async_decode: bool = True):
        for name, value in (("max_seqs", max_seqs), ("max_tokens", max_tokens), ("page_size", page_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LLM: {name} must be a positive int; got {value!r}")
        if token_budget is None:
            token_budget = min(int(max_tokens), 2048)
        if not isinstance(token_budget, (int, np.integer)) or isinstance(token_budget, bool) \
                or token_budget < max_seqs:
            raise ValueError(f"LLM: token_budget must be an int >= max_seqs={max_seqs} (every running request feeds "
                             f"a token each step); got {token_budget!r}")
        if prefill_buckets is not None:
            b = list(prefill_buckets) if isinstance(prefill_buckets, (list, tuple)) else None
            if not b or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1 for x in b) \
                    or b != sorted(set(b)) or b[-1] < token_budget:
                raise ValueError(f"LLM: prefill_buckets must be increasing positive ints, the last >= token_budget="
                                 f"{token_budget}; got {prefill_buckets!r}")
            prefill_buckets = tuple(int(x) for x in b)
        if isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isdir(path):
                raise ValueError(f"LLM: model must be a HybridModel or a checkpoint directory; {path!r} is not a "
                                 f"directory")
            from jax_gdn.checkpoint import load_pretrained
            import jax.numpy as jnp
            model = load_pretrained(path, dtype=dtype or jnp.bfloat16, backend=backend, progress=progress)
            if tokenizer is None and os.path.isfile(os.path.join(path, "tokenizer.json")):
                tokenizer = os.path.join(path, "tokenizer.json")
        elif not (hasattr(model, "prefill") and hasattr(model, "init_cache")):
            raise ValueError(f"LLM: model must be a HybridModel or a checkpoint directory; got {type(model).__name__}")
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"LLM: prefix_cache must be a bool; got {prefix_cache!r}")
        if not isinstance(async_decode, bool):
            raise ValueError(f"LLM: async_decode must be a bool; got {async_decode!r}")
        extra = 0
        self.prefix_cache = None
        if prefix_cache:
            if block_size is None:
                block_size = -(-DEFAULT_BLOCK_SIZE // int(page_size)) * int(page_size)
            extra = int(max_seqs) if prefix_slots is None else prefix_slots
            if not isinstance(extra, (int, np.integer)) or isinstance(extra, bool) or extra < 1:
                raise ValueError(f"LLM: prefix_slots must be a positive int; got {prefix_slots!r}")
            self.prefix_cache = PrefixCache(block_size, range(int(max_seqs), int(max_seqs) + int(extra)),
                                            min_uses=prefix_min_uses)
        self.model = model
        self.tokenizer = _load_tokenizer(tokenizer)
        self.max_seqs = int(max_seqs)
        self.token_budget = int(token_budget)
        self.prefill_buckets = prefill_buckets
        self.progress = progress
        self.cache = model.init_cache(max_seqs=self.max_seqs + int(extra), max_tokens=int(max_tokens),
                                      page_size=int(page_size), max_seq_len=max_seq_len)
        self.max_seq_len = int(self.cache.seq_len_limit) if self.model.config.attn_layers else None
        self.stats = collections.Counter()
        #: host wall seconds of the engine's steps by phase (``HOST_PHASES``), summed over every step so far
        self.host_s = collections.Counter()
        self._programs = _step_programs(model)
        self._waiting: collections.deque = collections.deque()     # the online engine's queues (add_request, step)
        self._running: list = []                   # admission order
        self._free = list(range(self.max_seqs))
        self._held = False                         # after a preemption: admit nobody until a request finishes
        self._next_id = 0
        self._unreported: list = []                # added requests that finished inside a generate call
        self.async_decode = async_decode
        self._ahead: Optional[_Queued] = None      # a decode step queued before the last one was read
        self._ids_placement = _UNPLACED            # the samplers' ids' sharding once seen (None: uncommitted)
        if warmup:
            self.warmup()

    # ---- compile everything up front ----------------------------------------------------------------------------
    def shapes(self):
        """The (kind, T, N) calls the loop can make: every prefill token bucket up to the budget's with every stream
        bucket that fits, every decode stream bucket, the sampler programs of every stream bucket ("sampler": greedy,
        the fallback, the draw and the merged draw with and without the whole-row path) and, with the prefix
        cache, the fork."""
        m, s = self.model, self.max_seqs
        top = self._token_bucket(self.token_budget)
        buckets = m.token_buckets if self.prefill_buckets is None else self.prefill_buckets
        t_values = sorted({b for b in buckets if b <= top} | {top})
        n_values = sorted({m.stream_bucket(n, s) for n in range(1, s + 1)})
        calls = [("prefill", t, n) for t in t_values for n in n_values if n <= t]
        calls += [("decode", n, n) for n in n_values]
        calls += [("sampler", n, n) for n in n_values]     # greedy, fallback, draw and draw_full with / without plain
        if self.prefix_cache is not None:
            calls += [("fork", n, n) for n in n_values]
        return calls

    def warmup(self) -> int:
        """Runs one call of every shape in :meth:`shapes` (and a release), so that later steps compile nothing.
        Returns the model's compiled program count."""
        shapes = self.shapes()
        bar = _bar(self.progress, len(shapes), "warm-up", "program")
        try:
            for kind, t, n in shapes:
                slots = np.arange(n, dtype=np.int32)
                if kind == "fork":                 # n pairs of distinct slots (as many as the cache has)
                    m = min(n, self.cache.num_slots // 2)
                    src, dst = np.arange(m, dtype=np.int32), np.arange(m, 2 * m, dtype=np.int32)
                    self.cache = self.model.fork(self.cache, src, dst)
                    self.cache = self.model.release(self.cache, dst)
                    self._clear_status()
                    if bar is not None:
                        bar.update(1)
                    continue
                if kind == "sampler":
                    self._warm_samplers(n)
                    if bar is not None:
                        bar.update(1)
                    continue
                lens = [1] * (n - 1) + [t - (n - 1)] if kind == "prefill" else [1] * n
                self._run(kind, np.zeros((t,), np.int32), np.cumsum([0] + lens).astype(np.int32), slots)
                self.cache = self.model.release(self.cache, slots)
                self._clear_status()
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return self.compiled_programs()

    def _warm_samplers(self, nb: int) -> None:
        """Compiles the sampler programs of stream bucket ``nb`` (greedy, the fallback, the draw and the merged
        draw with and without the whole-row path) on zero logits."""
        logits = jax.numpy.zeros((nb, self.model.config.vocab_size), jax.numpy.float32)
        arrays = sampling_arrays([SamplingParams(temperature=1.0)] * nb, [0] * nb, nb)
        outs = [self._programs["greedy"](logits), self._programs["fallback"](logits, *arrays)]
        outs += [self._programs[name](logits, *arrays, plain=plain) for plain in (False, True)
                 for name in ("draw", "draw_full")]
        jax.block_until_ready(outs)

    def compiled_programs(self) -> int:
        """Programs compiled so far for this engine's model: the engines' steps and samplers (shared by every LLM
        of the model) and the model's own (release, fork, and any prefill / decode called directly)."""
        own = self.model.compiled_programs() if hasattr(self.model, "compiled_programs") else 0
        return own + sum(f._cache_size() for f in self._programs.values())

    # ---- generate ---------------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, use_tqdm: Optional[bool] = None) -> List[RequestOutput]:
        """Generates a completion for each prompt (a list of token ids, or a string with a tokenizer; or one of
        them alone) with ``sampling_params`` (one SamplingParams for all, or one per prompt; default greedy, 16
        tokens). Returns one RequestOutput per prompt, in order. Every argument is checked before any work."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and _is_token(prompts[0]))
        if single:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("generate: prompts must be a non-empty list of prompts (token id lists or strings)")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError(f"generate: sampling_params must be one SamplingParams or one per prompt "
                                 f"({len(prompts)}); got {len(params)} items")
        reqs = [self._request(self._next_id + i, p, sp, f"generate: prompt {i}")
                for i, (p, sp) in enumerate(zip(prompts, params))]
        self._next_id += len(reqs)
        self._serve(reqs, self.progress if use_tqdm is None else use_tqdm)
        return [self._output(r) for r in reqs]

    # ---- the online engine (vLLM's LLMEngine calls) ------------------------------------------------------------
    def add_request(self, prompt, sampling_params: Optional[SamplingParams] = None) -> int:
        """Queues one request (a list of token ids, or a string with a tokenizer) and returns its request_id. It is
        checked before anything changes; its metrics count from now (queueing included). Run :meth:`step` until
        :meth:`has_unfinished_requests` is False; :meth:`generate` is this loop over a list of prompts."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"add_request: sampling_params must be a SamplingParams; got {type(params).__name__}")
        r = self._request(self._next_id, prompt, params, "add_request: prompt")
        self._next_id += 1
        r.arrival = time.perf_counter()
        self._waiting.append(r)
        return r.rid

    def step(self) -> List[RequestOutput]:
        """One engine step over the queued and running requests (one program call; a refused step retries on the
        next call). Returns the RequestOutputs of the requests that finished in it."""
        done, self._unreported = self._unreported + self._engine_step(), []
        return [self._output(r) for r in done]

    def has_unfinished_requests(self) -> bool:
        """Whether a request added is still waiting or running, or finished with its output not yet returned."""
        return bool(self._waiting or self._running or self._unreported)

    def _request(self, rid: int, prompt, params: SamplingParams, what: str) -> _Request:
        """The checked request ``rid``; errors name it as ``what`` (e.g. "generate: prompt 3")."""
        vocab = self.model.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{what} is a string but the LLM has no tokenizer (pass tokenizer= "
                                 f"or token ids)")
            ids = _encode(self.tokenizer, prompt)
        else:
            ids = list(prompt)
            if not all(_is_token(t) for t in ids):
                raise ValueError(f"{what} must be a list of int token ids or a string")
        ids = np.asarray(ids, np.int32).reshape(-1)
        if ids.size == 0:
            raise ValueError(f"{what} is empty")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"{what} holds token ids outside [0, vocab_size={vocab})")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"{what}: sampling_params: stop id {t} >= vocab_size={vocab}")
        limit = params.max_tokens
        if self.max_seq_len is not None:
            room = self.max_seq_len - ids.size
            if room < 0:
                raise ValueError(f"{what} has {ids.size} tokens; a slot holds at most max_seq_len="
                                 f"{self.max_seq_len}")
            # the token sampled last is never fed back, so g tokens need prompt + g - 1 <= max_seq_len (and a
            # preempted request recomputes prompt + g < prompt + limit tokens: also within the slot)
            limit = min(limit, room + 1)
        return _Request(rid, ids, params, limit, prompt=prompt)

    def _output(self, r: _Request) -> RequestOutput:
        text = "" if self.tokenizer is None else self.tokenizer.decode(list(r.generated))
        tt = r.token_times
        metrics = {"first_token_s": tt[0] if tt else None, "finished_s": tt[-1] if tt else None,
                   "tpot_s": (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None,
                   "prefix_hit_tokens": r.hit_tokens}
        return RequestOutput(r.rid, r.prompt, r.prompt_ids.tolist(),
                             [CompletionOutput(0, list(r.generated), text, r.finish)], metrics=metrics)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def _serve(self, reqs: Sequence[_Request], progress: bool) -> None:
        """Runs engine steps until ``reqs`` (queued behind any request already added) have all finished."""
        now = time.perf_counter()
        for r in reqs:
            r.arrival = now
            self._waiting.append(r)
        mine = {id(r) for r in reqs}
        bar = _bar(progress, len(reqs), "generate", "req")
        try:
            while any(r.finish is None for r in reqs):
                done = self._engine_step()
                self._unreported += [r for r in done if id(r) not in mine]    # add_request's: the next step()
                if bar is not None:
                    bar.update(sum(id(r) in mine for r in done))
        finally:
            if bar is not None:
                bar.close()

    def _engine_step(self) -> list:
        """One engine step (module docstring): admit, plan, run, take tokens, release; a decode step the last step
        queued ahead (``async_decode``) is this step's, with no admission or plan. Returns the requests that
        finished in it. A refused step changes no request: a snapshot is evicted or the request admitted last is
        preempted (a lone one aborted), and the next step tries again."""
        waiting, running, free = self._waiting, self._running, self._free
        t = time.perf_counter()
        if self._ahead is not None:      # the decode step queued by the last one: this step's; admission waits
            feeds = self._ahead.feeds
            tokens, refused = self._step(feeds, self._ahead)
            return self._after(feeds, tokens, refused, time.perf_counter())
        admitted = []
        while waiting and free and not (self._held and running):
            r = waiting.popleft()
            r.slot, r.fed = free.pop(0), 0
            running.append(r)
            admitted.append(r)
        if admitted and self.prefix_cache is not None:
            self._restore(admitted)
        t = self._tick("admit", t)
        if not running:
            return []
        feeds = self._plan(running)
        self._tick("plan", t)
        tokens, refused = self._step(feeds)
        return self._after(feeds, tokens, refused, time.perf_counter())

    def _after(self, feeds, tokens, refused, t) -> list:
        """The rest of an engine step once its ids are on the host (``tokens``; ``refused``: the step was refused):
        the refusal's eviction or preemption, or each fed request's token, then the snapshots and the releases.
        Returns the requests that finished. A request that finished at the step before a queued one is skipped."""
        running, free, waiting = self._running, self._free, self._waiting
        if refused:
            self.stats["refused_steps"] += 1
        if refused and self.prefix_cache is not None and self.prefix_cache.entries:
            slot = self.prefix_cache.evict_lru()      # a snapshot goes before any request
            self.cache = self.model.release(self.cache, np.asarray([slot], np.int32))
            return []
        if refused:
            victim = running[-1]
            self.cache = self.model.release(self.cache, np.asarray([victim.slot], np.int32))
            running.remove(victim)
            free.append(victim.slot)
            if not running:                 # alone and still refused: it cannot fit in the pool
                victim.finish = "abort"
                self.stats["aborted"] += 1
                return [victim]
            self.stats["preempted"] += 1
            victim.slot, victim.fed = -1, 0
            waiting.appendleft(victim)
            self._held = True
            return []
        done, snaps = [], []
        now = time.perf_counter()                  # after the step's copy to the host
        for (r, lo, hi), tok in zip(feeds, tokens):
            if r.finish is not None or r.slot < 0:     # finished (or preempted) at the step before: not its token
                continue
            r.fed = hi
            if self.prefix_cache is not None and lo < r.prompt_ids.shape[0] and hi - lo > 0:
                key = self.prefix_cache.reach(self._keys(r), lo, hi)
                if key is not None:
                    snaps.append((r, key))
            if hi < r.seq_len:              # a prompt chunk: no token yet
                continue
            r.generated.append(int(tok))
            r.token_times.append(now - r.arrival)
            if int(tok) in r.params.stop_token_ids:
                r.finish = "stop"
            elif len(r.generated) >= r.limit:
                r.finish = "length"
            if r.finish:
                done.append(r)
        t = self._tick("tokens", t)
        if snaps:
            self._snapshot(snaps)
            t = self._tick("snapshot", t)
        if done:
            self._held = False
            self.cache = self.model.release(self.cache, np.asarray([r.slot for r in done], np.int32))
            for r in done:
                running.remove(r)
                free.append(r.slot)
            self._tick("release", t)
        return done

    def _tick(self, phase: str, t0: float) -> float:
        """Adds the host seconds since ``t0`` to ``host_s[phase]``; returns now."""
        now = time.perf_counter()
        self.host_s[phase] += now - t0
        return now

    def _plan(self, running):
        """[(request, lo, hi)]: the sequence tokens [lo, hi) each running request feeds this step (generating
        requests first, one token each; prompt chunks under what is left of the budget)."""
        feeds, left = [], self.token_budget
        for r in running:
            if r.seq_len - r.fed == 1:
                feeds.append((r, r.fed, r.fed + 1))
                left -= 1
        pc, pending = self.prefix_cache, collections.Counter()
        for r in running:
            todo = r.seq_len - r.fed
            if todo > 1 and left > 0:
                end = r.fed + min(todo, left)
                if pc is not None and r.fed < r.prompt_ids.shape[0]:   # end where a snapshot is wanted, if anywhere
                    keys = self._keys(r)
                    end = pc.cut(keys, r.fed, end, pending)
                    pending.update(pc.passed(keys, r.fed, end))
                feeds.append((r, r.fed, end))
                left -= end - r.fed
        return feeds

    def _keys(self, r: _Request) -> list:
        """The chain hashes of ``r``'s prompt blocks (made once per request)."""
        if r.block_keys is None:
            r.block_keys = block_hashes(r.prompt_ids, self.prefix_cache.block_size)
        return r.block_keys

    def _step(self, feeds, queued: Optional["_Queued"] = None):
        """The model's step and the sampler for ``feeds`` (``queued``: the step already queued by the last one),
        the next decode step queued where :meth:`_may_queue` allows, then this step's ids copied to the host.
        Returns (sampled ids [N] NumPy, refused?)."""
        t = time.perf_counter()
        self._ahead = None
        slots = np.asarray([r.slot for r, _, _ in feeds], np.int32)
        if queued is None:
            lens = [hi - lo for _, lo, hi in feeds]
            kind = "decode" if all(hi - lo == 1 and lo > 0 and hi == r.seq_len for r, lo, hi in feeds) \
                else "prefill"
            ids = np.concatenate([r.tokens(lo, hi) for r, lo, hi in feeds]).astype(np.int32)
            cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            queued = self._queue(kind, feeds, ids, cu, slots, [len(r.generated) for r, _, _ in feeds])
        self.stats[f"{queued.kind}_steps"] += 1
        if self._may_queue(queued):          # the next decode step, fed this one's ids on the device
            nxt = [(r, hi, hi + 1) for r, _, hi in feeds]
            self._ahead = self._queue("decode", nxt, queued.ids, np.arange(len(feeds) + 1, dtype=np.int32), slots,
                                      [len(r.generated) + 1 for r, _, _ in feeds])
            self.stats["queued_ahead_steps"] += 1
        t = self._tick("dispatch", t)
        toks, status, need = self._collect(queued, t)
        if status != 0:
            self._ahead = None               # it ran on the refused cache: nothing written, nothing to read
            self._clear_status()
            return None, True
        for (r, _, hi), row_needs in zip(feeds, need):
            if hi == r.seq_len:             # a row that draws a token: whether its draw needed the full sort
                r.full_sort = bool(row_needs)
        return toks[:len(feeds)], False

    def _may_queue(self, queued: "_Queued") -> bool:
        """Whether the decode step after ``queued`` may be queued before its ids are read (module docstring,
        "Overlapped decode"): its ids final on the device, every row a live request one token short of its
        limit or more, nobody waiting to be admitted."""
        if not (self.async_decode and queued.kind == "decode" and queued.final) or self._waiting:
            return False
        return all(r.finish is None and r.slot >= 0 and len(r.generated) + 2 <= r.limit
                   for r, _, _ in queued.feeds)

    def _queue(self, kind: str, feeds, ids, cu, slots, steps) -> "_Queued":
        """Queues the model's step and its sampler for ``feeds`` ([(request, lo, hi)]; ``ids`` [T] NumPy, or a
        decode step's [Nb] on the device; ``steps`` each row's count of generated tokens) without waiting: pads the
        call to the model's buckets (tokens past cu[N] are id 0, padding streams have zero length and slot id S, as
        the model's methods pad); the cache becomes the step's output."""
        s = self.cache.num_slots
        nb = self.model.stream_bucket(slots.shape[0], s)
        tb = nb if kind == "decode" else self._token_bucket(ids.shape[0])
        host_ids = isinstance(ids, np.ndarray)
        ids_p, cu_p, sl_p = self.model.pad_step_inputs(ids if host_ids else np.zeros((0,), np.int32), cu, slots,
                                                      tb, nb, s)
        if kind == "decode" and self.async_decode:
            # a device array either way, placed as the samplers place their ids: a queued step's ids (the last
            # step's sampled ids [Nb], one per stream) and host ids then take the same entry of the program's
            # cache, where a NumPy argument and a device array (or an uncommitted array and one a sharded model's
            # program placed) would compile it twice; without async_decode the program takes the NumPy ids itself
            placement = None if self._ids_placement is _UNPLACED else self._ids_placement
            ids_p = jax.device_put(ids_p, placement) if host_ids else ids
        logits, status, self.cache = self._programs[kind](self.model.params, self.cache, ids_p, cu_p, sl_p)
        full = np.zeros((nb,), bool)
        full[:len(feeds)] = [r.full_sort for r, _, _ in feeds]
        return self._queue_sampler(kind, feeds, logits, sampling_arrays([r.params for r, _, _ in feeds], steps, nb),
                                   status, full)

    def _queue_sampler(self, kind, feeds, logits, arrays, status, full=None) -> "_Queued":
        """The sampler program on a step's ``logits`` (:meth:`_sample`), queued; ``final``: its ids need no
        fallback (every row greedy, every sampled row keeping every token, or the merged draw)."""
        toks, need, merged, final = self._sample(logits, arrays, full)
        if self._ids_placement is _UNPLACED:         # how the sampler programs place their ids (see _queue)
            self._ids_placement = toks.sharding if getattr(toks, "committed", False) else None
        return _Queued(kind, feeds, logits, arrays, toks, need, merged, status, final)

    def _collect(self, queued: "_Queued", t: float):
        """A queued step's ids on the host: its one copy (ids, the rows needing the fallback, the status), then,
        where rows need it and the program did not draw them with the full sort already, the fallback program and
        its copy. Returns (ids [Nb] NumPy, status, need [Nb] bool NumPy: the rows whose draw needed the full sort);
        ``stats`` counts "fallback_steps" and "full_sort_steps"; the host phases wait and fallback from ``t``."""
        toks, need, status = jax.device_get((queued.ids, queued.need, queued.status))
        toks = np.asarray(toks)
        need = np.zeros(toks.shape, bool) if need is None else np.asarray(need)
        t = self._tick("wait", t)
        if queued.merged:
            self.stats["full_sort_steps"] += 1
        elif need.any():                                                # rows the candidates could not decide
            self.stats["fallback_steps"] += 1
            ids = np.asarray(jax.device_get(self._programs["fallback"](queued.logits, *queued.arrays)))
            toks = np.where(need, ids, toks)
            self._tick("fallback", t)
        return toks, None if status is None else int(status), need

    def _run(self, kind: str, ids, cu, slots) -> None:
        """One step of ``kind`` over ``slots`` with no request behind it (every row greedy), run to its copy: the
        warm-up's call of a shape."""
        queued = self._queue(kind, [], ids, cu, slots, [])
        self._collect(queued, time.perf_counter())

    def _sampled_ids(self, logits, arrays, status=None, t: Optional[float] = None, full=None):
        """A step's sampled ids on the host for ``logits`` [Nb, Vocab] and ``sampling_arrays``: the sampler
        program (:meth:`_sample`; ``full`` [Nb] bool or None: rows expected to need the full sort, their last draw
        did) and :meth:`_collect`. Returns (ids [Nb] NumPy, status as copied, need [Nb] bool NumPy); with ``t``
        (the step's start) the host phases dispatch, wait and fallback are timed from there."""
        t = time.perf_counter() if t is None else t
        queued = self._queue_sampler("step", [], logits, arrays, status, full)
        return self._collect(queued, self._tick("dispatch", t))

    def _sample(self, logits, arrays, full=None):
        """The sampler program for a step's ``logits`` [Nb, Vocab] and ``sampling_arrays`` (module docstring, step
        3), chosen on the host: (ids [Nb], rows needing the fallback [Nb] or None, whether the fallback's ids are
        merged in already, whether the ids are final: no fallback can replace one), the arrays on the device, not
        waited on. ``full`` [Nb] bool or None: rows expected to
        need the full sort; where a sampled one is among them the program is ``draw_full_rows``."""
        temperature, top_k, top_p = arrays[:3]
        sampled = temperature > 0
        if not sampled.any():
            return self._programs["greedy"](logits), None, False, True
        every = sampled & keeps_every_token(top_k, top_p, logits.shape[-1])
        if full is not None and bool(np.any(sampled & full)):
            ids, need = self._programs["draw_full"](logits, *arrays, plain=bool(np.any(every)))
            return ids, need, True, True
        ids, need = self._programs["draw"](logits, *arrays, plain=bool(np.any(every)))
        return ids, need, False, bool(np.all(every == sampled))     # final: every sampled row keeps every token

    def _token_bucket(self, t: int) -> int:
        """The token count a prefill step of t tokens is padded to: the smallest of ``prefill_buckets`` >= t, or the
        model's bucket."""
        if self.prefill_buckets is None:
            return self.model.token_bucket(t)
        return next(b for b in self.prefill_buckets if b >= t)

    def _restore(self, admitted) -> None:
        """Prefix-cache hits of newly admitted requests: each starts from a fork of its longest cached prefix
        (one fork call; a fork the pool cannot hold is refused, and those requests start cold)."""
        pairs = []
        for r in admitted:
            seq = r.tokens(0, r.seq_len)
            hit = self.prefix_cache.lookup(seq, r.seq_len - 1)        # leave a token to feed (its logits)
            if hit is not None:
                pairs.append((r, hit))
        if not pairs:
            return
        self.cache = self.model.fork(self.cache, np.asarray([h[0] for _, h in pairs], np.int32),
                                     np.asarray([r.slot for r, _ in pairs], np.int32))
        if int(jax.device_get(self.cache.status)) != 0:
            self._clear_status()
            self.stats["refused_restores"] += 1
            return
        for r, (_, n) in pairs:
            r.fed = n
            r.hit_tokens = max(r.hit_tokens, n)

    def _snapshot(self, snaps) -> None:
        """Copies each (request, key)'s slot into a snapshot slot (one fork call; the LRU entry is evicted where
        no snapshot slot is free; more new prefixes in one step than snapshot slots: the first ones are kept; a fork
        the pool cannot hold is refused and nothing is cached)."""
        pc = self.prefix_cache
        taken, seen = [], set()
        for r, key in snaps:
            if key in seen:
                continue
            if not pc.free and not pc.entries:       # every snapshot slot already taken by this step
                break
            seen.add(key)
            slot = pc.take_slot()
            taken.append((r, key, slot))
        self.cache = self.model.fork(self.cache, np.asarray([r.slot for r, _, _ in taken], np.int32),
                                     np.asarray([s for _, _, s in taken], np.int32))
        if int(jax.device_get(self.cache.status)) != 0:
            self._clear_status()
            self.stats["refused_snapshots"] += 1
            self.cache = self.model.release(self.cache, np.asarray([s for _, _, s in taken], np.int32))
            for _, _, s in taken:
                pc.give_back(s)
            return
        for r, key, slot in taken:
            pc.insert(key, slot, r.prompt_ids[:r.fed])

    def _clear_status(self):
        try:
            self.model.check(self.cache)
        except Exception as err:                   # OutOfKvPagesError: its .cache has the status cleared
            cache = getattr(err, "cache", None)
            if cache is None:
                raise
            self.cache = cache


# ---- helpers --------------------------------------------------------------------------------------------------
_PROGRAMS = weakref.WeakKeyDictionary()        # model -> its engines' step programs (shared by every LLM of it)


def _step_programs(model) -> dict:
    """The jitted programs of ``model``'s engines, made once per model, so that engines over the same model (and
    caches of the same shapes) reuse each other's compiled programs: "prefill", "decode" (the model's pure step:
    (logits, the cache's status, the cache), the cache donated), "greedy" (argmax of the logits), "draw"
    (:func:`~jax_gdn.serving.sampling.draw_rows`, ``plain`` static), "fallback" and "draw_full"
    (:func:`~jax_gdn.serving.sampling.draw_full_rows`: the draw and the fallback merged, ``plain`` static)."""
    progs = _PROGRAMS.get(model)
    if progs is None:
        progs = {kind: jax.jit(_status_step(model.step_fn(decode=kind == "decode")), donate_argnums=(1,))
                 for kind in ("prefill", "decode")}
        progs["greedy"] = jax.jit(lambda logits: jax.numpy.argmax(logits, axis=-1).astype(jax.numpy.int32))
        progs["draw"] = jax.jit(draw_rows, static_argnames=("plain", "method"))
        progs["fallback"] = jax.jit(fallback_rows, static_argnames=("method",))
        progs["draw_full"] = jax.jit(draw_full_rows, static_argnames=("plain", "method"))
        _PROGRAMS[model] = progs
    return progs


def _status_step(step):
    """The engine's step program: the model's pure step; returns (logits, the cache's status, the cache)."""
    def fn(params, cache, ids, cu, slots):
        logits, cache = step(params, cache, ids, cu, slots)
        return logits, cache.status, cache
    return fn


def _is_token(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _bar(progress: bool, total: int, desc: str, unit: str):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def _load_tokenizer(tokenizer):
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"LLM: tokenizer {os.fspath(tokenizer)!r}: no tokenizer.json there")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:                   # pragma: no cover - the test extra installs it
            raise ValueError("LLM: a tokenizer path needs the `tokenizers` package (pip install tokenizers)") from e
        return Tokenizer.from_file(path)
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise ValueError(f"LLM: tokenizer must be a path to tokenizer.json or have encode / decode; got "
                         f"{type(tokenizer).__name__}")
    return tokenizer


def _encode(tokenizer, text: str) -> list:
    enc = tokenizer.encode(text)
    return list(getattr(enc, "ids", enc))
