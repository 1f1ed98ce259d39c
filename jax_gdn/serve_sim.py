"""Serving simulation: random arrivals, chunked prefill under a per-step token budget mixed with decode, releases.

    python -m jax_gdn serve-sim                                    # the tiny preset, random weights, CPU
    python -m jax_gdn serve-sim --model DIR                        # a HF checkpoint directory
    python -m jax_gdn serve-sim --dims qwen3_next_80b --layers 8   # Qwen3-Next-80B dims, random bf16 (a GPU)
    python -m jax_gdn serve-sim --shared-prefixes 2 --prefix-len 96 --prefix-cache both   # the prefix cache

Two engines serve the same arrivals. ``--engine llm`` (the default, :func:`simulate_engine`): the serving engine
``jax_gdn.serving.LLM`` through its online calls (``add_request`` as each request arrives, one ``step()`` per
step, sampling on the device), with the prefix cache off, on or both; it reports tokens/s, time to first token
(from arrival) and time per output token (p50, p99), the prefix hit rate and the programs compiled after its
warm-up. ``--engine model`` (:func:`simulate`): this module's own loop over ``model.prefill`` / ``decode``,
described below, which counts every XLA compile of the process.

What one step does (a continuous-batching engine's loop, one model call per step):
  1. requests whose arrival step has come join the waiting queue (arrival steps drawn once from a Poisson process
     with ``rate`` requests per step, fixed seed); waiting requests take free slots (FIFO, at most ``max_seqs``).
  2. every running stream whose prompt is done decodes one token; the rest of the step's ``token_budget`` goes to
     prompt chunks of streams still prefilling (FIFO; a prompt longer than what is left is cut: chunked prefill).
  3. one call: ``model.prefill`` with the decode tokens as 1-token streams packed beside the prompt chunks (a slot
     holding tokens continues, so a 1-token stream is a decode step), or ``model.decode`` when no prompt chunk is
     left. Greedy next tokens are read back (argmax on the host, so no extra program is compiled per shape).
  4. a stream that completed its prompt gets its first token (time to first token); the streams holding
     ``gen_len`` generated tokens are released (one ``model.release`` call for all of them) and their slots freed.

Warm-up (``warmup=True``) before the measured run: where the model pads calls to shape buckets (``token_bucket``
/ ``stream_bucket``), one call of every bucket shape the loop can make (prefill, decode, release); otherwise the
same simulation with another seed. "after warm-up" counts cover the measured run only. Compiles are counted two
ways: ``model.compiled_programs()`` (the model's own prefill / decode / release programs, where the model offers
it) and every XLA backend compile in the process while the simulation runs (``jax.monitoring`` event
``/jax/core/compile/backend_compile_duration``): the model's programs plus small eager programs outside them
(init_cache filling the pools, staging call arguments, slicing padded logits), so the second count is larger.

Shape legend: S slots (max_seqs), T tokens of one call (<= token_budget), N streams of one call (<= S).

Returned dict (also printed unless ``verbose=False``): {"model", "device", "sim" (the settings), "requests",
"steps", "calls": {"prefill", "decode", "release"}, "tokens": {"prompt", "generated"}, "wall_s",
"tokens_per_s": {"prefill", "decode", "total"}, "ttft_s": {p50, p90, p99, mean}, "ttft_steps": {...},
"step_ms": {p50, p90, p99, max, mean}, "step_ms_by_kind": {"mixed": {...}, "decode": {...}},
"compiles": {"total", "warmup", "after_warmup", "compile_s", "model_programs", "model_programs_after_warmup"},
"warmup": "buckets" | "run" | "none", "all_served": bool,
"per_request": [{"prompt_len", "gen_len", "generated", "ttft_s", "ttft_steps"}]}.
tokens_per_s counts over the measured run's busy time (the sum of step times; idle gaps are skipped):
"prefill" prompt tokens / that time, "decode" generated tokens / that time, "total" both.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from typing import Optional, Tuple

import numpy as np

from jax_gdn.cli_types import existing_dir, min_max_pair, positive_float, positive_int, writable_file

# ================================================================================================================
# Compile counter (process-wide XLA backend compiles)
# ================================================================================================================
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILES = {"n": 0, "s": 0.0}
_LISTENING = False


def _on_duration(event: str, duration: float, **_kw) -> None:
    if event == _COMPILE_EVENT:
        _COMPILES["n"] += 1
        _COMPILES["s"] += float(duration)


def compile_counter() -> dict:
    """The live {"n": backend compiles so far, "s": their seconds}; starts counting on the first call."""
    global _LISTENING
    if not _LISTENING:
        import jax
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _LISTENING = True
    return _COMPILES


def _model_programs(model) -> Optional[int]:
    fn = getattr(model, "compiled_programs", None)
    if fn is None:
        return None
    try:
        return int(fn())
    except Exception:  # pragma: no cover - report, never fail the simulation for a counter
        return None


# ================================================================================================================
# Settings and requests
# ================================================================================================================
@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Settings of one simulation.

    num_requests: requests in the measured run (the warm-up run has as many).
    max_seqs: S, slots of the cache (concurrent streams). token_budget: tokens per step (>= max_seqs, so that every
    running stream can decode in every step). prompt_len / gen_len: inclusive (min, max); prompts are drawn
    log-uniform (many short, some long), generation lengths uniform. rate: mean arrivals per step.
    page_size: KV page size; the pool holds max_seqs full-length streams (never out of pages).
    shared_prefixes, prefix_len: a shared-prefix workload: that many system prompts of prefix_len tokens, request i
    starting with system prompt i mod shared_prefixes before its own prompt (0, 0: none).
    """

    num_requests: int = 16
    max_seqs: int = 4
    token_budget: int = 32
    prompt_len: Tuple[int, int] = (1, 128)
    gen_len: Tuple[int, int] = (1, 16)
    rate: float = 0.5
    seed: int = 0
    page_size: int = 16
    warmup: bool = True
    shared_prefixes: int = 0
    prefix_len: int = 0

    def __post_init__(self):
        for name in ("num_requests", "max_seqs", "token_budget", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"SimConfig.{name} must be a positive int, got {value!r}")
        for name in ("prompt_len", "gen_len"):
            lo_hi = getattr(self, name)
            if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
                raise ValueError(f"SimConfig.{name} must be (min, max) with 1 <= min <= max, got {lo_hi!r}")
        if self.token_budget < self.max_seqs:
            raise ValueError(f"SimConfig.token_budget ({self.token_budget}) must be >= max_seqs ({self.max_seqs}): "
                             f"every running stream decodes one token per step")
        if not self.rate > 0:
            raise ValueError(f"SimConfig.rate must be > 0 arrivals per step, got {self.rate!r}")
        for name in ("shared_prefixes", "prefix_len"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"SimConfig.{name} must be an int >= 0, got {value!r}")
        if (self.shared_prefixes > 0) != (self.prefix_len > 0):
            raise ValueError(f"SimConfig.shared_prefixes ({self.shared_prefixes}) and prefix_len ({self.prefix_len}) "
                             f"must both be 0 (no shared prefix) or both positive")

    @property
    def max_tokens(self) -> int:
        """KV pool size: every slot can hold a longest prompt (its shared prefix included) plus a longest generation
        (+ one page of slack)."""
        return self.max_seqs * (self.prefix_len + self.prompt_len[1] + self.gen_len[1] + self.page_size)


@dataclasses.dataclass
class _Request:
    rid: int
    arrival_step: int
    prompt: np.ndarray                 # [prompt_len] int32
    gen_len: int
    slot: int = -1
    prefilled: int = 0                 # prompt tokens already in the cache
    tokens: list = dataclasses.field(default_factory=list)   # generated tokens
    arrival_wall: float = 0.0
    ttft_s: float = float("nan")
    ttft_steps: int = -1
    arrived_at: int = -1               # the step index at which it entered the waiting queue

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == self.prompt.shape[0]


def make_requests(sim: SimConfig, vocab_size: int, seed: int) -> list:
    """The requests of one run: Poisson arrivals (``rate`` per step), log-uniform prompt lengths, uniform
    generation lengths, random prompt tokens in [0, vocab_size), each after its shared system prompt if any."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / sim.rate, sim.num_requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)            # the first request arrives at step 0
    lo, hi = sim.prompt_len
    plen = np.floor(np.exp(rng.uniform(np.log(lo), np.log(hi + 1), sim.num_requests))).astype(int)
    plen = np.clip(plen, lo, hi)
    glen = rng.integers(sim.gen_len[0], sim.gen_len[1] + 1, sim.num_requests)
    own = [rng.integers(0, vocab_size, int(plen[i])).astype(np.int32) for i in range(sim.num_requests)]
    if sim.shared_prefixes:
        systems = [rng.integers(0, vocab_size, sim.prefix_len).astype(np.int32) for _ in range(sim.shared_prefixes)]
        own = [np.concatenate([systems[i % sim.shared_prefixes], p]) for i, p in enumerate(own)]
    return [_Request(i, int(arrivals[i]), own[i], int(glen[i])) for i in range(sim.num_requests)]


# ================================================================================================================
# The loop
# ================================================================================================================
def _percentiles(x) -> dict:
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan"),
                "mean": float("nan"), "n": 0}
    return {"p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "max": float(x.max()), "mean": float(x.mean()), "n": int(x.size)}


def _run(model, cache, sim: SimConfig, requests: list, *, progress: bool, desc: str):
    """Serves ``requests`` to the end. Returns (raw stats dict, cache)."""
    import jax
    s, budget = sim.max_seqs, sim.token_budget
    pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_step, r.rid)))
    waiting = collections.deque()
    active = []                                    # admission order
    free = list(range(s))
    step = 0
    step_times, step_kind = [], []
    calls = {"prefill": 0, "decode": 0, "release": 0}
    done = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc=desc, unit="req", leave=True)
    try:
        while done < len(requests):
            if not active and not waiting and pending and pending[0].arrival_step > step:
                step = pending[0].arrival_step                                  # idle: jump to the next arrival
            now = time.perf_counter()
            while pending and pending[0].arrival_step <= step:
                r = pending.popleft()
                r.arrival_wall, r.arrived_at = now, step
                waiting.append(r)
            while waiting and free:
                r = waiting.popleft()
                r.slot = free.pop(0)
                active.append(r)

            # ---- the batch: decode tokens first, then prompt chunks under what is left of the budget ----
            dec = [r for r in active if r.prefill_done]
            left = budget - len(dec)
            chunks = []
            for r in active:
                if left <= 0:
                    break
                if not r.prefill_done:
                    c = min(r.prompt.shape[0] - r.prefilled, left)
                    chunks.append((r, c))
                    left -= c

            t0 = time.perf_counter()
            if chunks:
                pieces = [np.asarray([r.tokens[-1]], np.int32) for r in dec]
                pieces += [r.prompt[r.prefilled:r.prefilled + c] for r, c in chunks]
                lens = [1] * len(dec) + [c for _, c in chunks]
                ids = np.concatenate(pieces).astype(np.int32)
                cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                slots = np.asarray([r.slot for r in dec] + [r.slot for r, _ in chunks], np.int32)
                logits, cache = model.prefill(cache, ids, cu, slots)
                calls["prefill"] += 1
                kind = "mixed"
            else:
                ids = np.asarray([r.tokens[-1] for r in dec], np.int32)
                slots = np.asarray([r.slot for r in dec], np.int32)
                logits, cache = model.decode(cache, ids, slots)
                calls["decode"] += 1
                kind = "decode"
            nxt = np.asarray(jax.device_get(logits)).argmax(axis=-1)            # host argmax: syncs the step
            t1 = time.perf_counter()
            step_times.append(t1 - t0)
            step_kind.append(kind)

            # ---- bookkeeping: new tokens, first tokens, releases ----
            for i, r in enumerate(dec):
                r.tokens.append(int(nxt[i]))
            for j, (r, c) in enumerate(chunks):
                r.prefilled += c
                if r.prefill_done:
                    r.tokens.append(int(nxt[len(dec) + j]))
                    r.ttft_s = t1 - r.arrival_wall
                    r.ttft_steps = step - r.arrived_at + 1
            finished = [r for r in active if len(r.tokens) >= r.gen_len]
            if finished:
                cache = model.release(cache, np.asarray([r.slot for r in finished], np.int32))
                calls["release"] += 1
                for r in finished:
                    active.remove(r)
                    free.append(r.slot)
                done += len(finished)
                if bar is not None:
                    bar.update(len(finished))
            step += 1
        jax.block_until_ready(cache)
        if hasattr(model, "check"):
            model.check(cache)            # raises if a step was refused (out of KV pages): never expected here
    finally:
        if bar is not None:
            bar.close()
    return {"step_times": step_times, "step_kind": step_kind, "calls": calls, "steps": len(step_times)}, cache


def _warmup(model, cache, sim: SimConfig, progress: bool):
    """Compiles what the simulation can use before it is measured. Returns (how, cache).

    "buckets" (a model with ``token_bucket`` / ``stream_bucket``): every (token bucket <= the budget's, stream
    bucket <= S) prefill, then for every N in 1..S a prefill of N fresh streams, a decode of them and a release
    (the programs of every call shape the loop can make). "run" (other models): the simulation with another seed.
    """
    if not (hasattr(model, "token_bucket") and hasattr(model, "stream_bucket")):
        _, cache = _run(model, cache, sim, make_requests(sim, model.config.vocab_size, sim.seed + 7919),
                        progress=progress, desc="warm-up")
        return "run", cache
    s, budget = sim.max_seqs, sim.token_budget
    top = model.token_bucket(budget)
    t_values = sorted({min(b, budget) for b in getattr(model, "token_buckets", (budget,)) if b <= top} | {budget})
    n_values = sorted({model.stream_bucket(n, s) for n in range(1, s + 1)})
    shapes = [(t, n) for t in t_values for n in n_values if n <= t] + [(n, n) for n in range(1, s + 1)]
    for t, n in shapes:
        lens = [1] * (n - 1) + [t - (n - 1)]
        slots = np.arange(n, dtype=np.int32)
        logits, cache = model.prefill(cache, np.zeros((t,), np.int32), np.cumsum([0] + lens).astype(np.int32), slots)
        np.asarray(logits)
        logits, cache = model.decode(cache, np.zeros((n,), np.int32), slots)
        np.asarray(logits)
        cache = model.release(cache, slots)
    jax_block(cache)
    return "buckets", cache


def jax_block(x):
    import jax
    return jax.block_until_ready(x)


def _summarise(raw: dict, requests: list) -> dict:
    times = np.asarray(raw["step_times"])
    kinds = np.asarray(raw["step_kind"])
    busy = float(times.sum())
    prompt = int(sum(r.prompt.shape[0] for r in requests))
    generated = int(sum(len(r.tokens) for r in requests))
    return {
        "requests": len(requests), "steps": raw["steps"], "calls": raw["calls"],
        "tokens": {"prompt": prompt, "generated": generated},
        "wall_s": busy,
        "tokens_per_s": {"prefill": prompt / busy, "decode": generated / busy, "total": (prompt + generated) / busy},
        "ttft_s": _percentiles([r.ttft_s for r in requests]),
        "ttft_steps": _percentiles([r.ttft_steps for r in requests]),
        "step_ms": _percentiles(1e3 * times),
        "step_ms_by_kind": {k: _percentiles(1e3 * times[kinds == k]) for k in ("mixed", "decode")},
        "all_served": all(len(r.tokens) == r.gen_len and r.prefill_done for r in requests),
        "per_request": [{"prompt_len": int(r.prompt.shape[0]), "gen_len": r.gen_len, "generated": len(r.tokens),
                         "ttft_s": r.ttft_s, "ttft_steps": r.ttft_steps} for r in requests],
    }


def simulate(model, sim: SimConfig = SimConfig(), *, progress: bool = True, verbose: bool = True) -> dict:
    """Runs the warm-up (``sim.warmup``) and the measured simulation on ``model`` (a HybridModel). Returns the dict
    described in the module docstring."""
    import jax
    if not isinstance(sim, SimConfig):
        raise ValueError(f"sim must be a SimConfig, got {type(sim).__name__}")
    counter = compile_counter()
    n0, s0, m0 = counter["n"], counter["s"], _model_programs(model)
    cache = model.init_cache(max_seqs=sim.max_seqs, max_tokens=sim.max_tokens, page_size=sim.page_size)
    vocab = model.config.vocab_size
    warmup = "none"
    if sim.warmup:
        warmup, cache = _warmup(model, cache, sim, progress)
    n1, m1 = counter["n"], _model_programs(model)
    requests = make_requests(sim, vocab, sim.seed)
    raw, cache = _run(model, cache, sim, requests, progress=progress, desc="serving")
    n2, s2, m2 = counter["n"], counter["s"], _model_programs(model)
    out = {"model": repr(model), "device": str(jax.devices()[0]), "sim": dataclasses.asdict(sim)}
    out.update(_summarise(raw, requests))
    out["warmup"] = warmup
    out["compiles"] = {
        "total": n2 - n0, "warmup": n1 - n0, "after_warmup": n2 - n1, "compile_s": s2 - s0,
        "model_programs": None if m2 is None else m2 - (m0 or 0),
        "model_programs_after_warmup": None if m2 is None or m1 is None else m2 - m1,
    }
    if verbose:
        print_summary(out)
    return out


def simulate_llm(model, sim: SimConfig = SimConfig(), *, prefix_cache: bool = False, block_size: int = 64,
                 progress: bool = True) -> dict:
    """The same arrivals served by :class:`jax_gdn.serving.LLM` (its online calls: ``add_request`` when a request's
    arrival step comes, one ``step()`` per step; greedy, ``max_tokens`` = the request's gen_len), warmed up by
    ``LLM.warmup`` when ``sim.warmup``. Returns {"prefix_cache", "requests", "steps", "tokens", "wall_s",
    "tokens_per_s", "ttft_s", "tpot_s", "step_ms", "hit_rate", "hit_tokens", "preempted", "compiled_after_warmup",
    "all_served", "outputs"}: ttft_s from each request's arrival (queueing included), tpot_s the mean time between
    its later tokens, wall_s and tokens/s over the busy time (the sum of step times)."""
    from jax_gdn.serving import LLM, SamplingParams
    if not isinstance(sim, SimConfig):
        raise ValueError(f"sim must be a SimConfig, got {type(sim).__name__}")
    snap_room = sim.max_seqs * (sim.prefix_len + sim.prompt_len[1] + sim.page_size) if prefix_cache else 0
    llm = LLM(model, max_seqs=sim.max_seqs, max_tokens=sim.max_tokens + snap_room, page_size=sim.page_size,
              token_budget=sim.token_budget, progress=progress, warmup=sim.warmup, prefix_cache=prefix_cache,
              **({"block_size": block_size} if prefix_cache else {}))
    programs = llm.compiled_programs()
    requests = make_requests(sim, model.config.vocab_size, sim.seed)
    pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_step, r.rid)))
    rid_of, outs, step, step_times = {}, {}, 0, []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="serving (LLM)", unit="req", leave=True)
    try:
        while len(outs) < len(requests):
            if not llm.has_unfinished_requests() and pending and pending[0].arrival_step > step:
                step = pending[0].arrival_step                                  # idle: jump to the next arrival
            while pending and pending[0].arrival_step <= step:
                r = pending.popleft()
                rid_of[llm.add_request(r.prompt.tolist(), SamplingParams(max_tokens=r.gen_len))] = r.rid
            t0 = time.perf_counter()
            done = llm.step()
            step_times.append(time.perf_counter() - t0)
            for o in done:
                outs[rid_of[o.request_id]] = o
            if bar is not None and done:
                bar.update(len(done))
            step += 1
    finally:
        if bar is not None:
            bar.close()
    ordered = [outs[r.rid] for r in requests]
    busy = float(np.sum(step_times))
    prompt = int(sum(r.prompt.shape[0] for r in requests))
    generated = int(sum(len(o.outputs[0].token_ids) for o in ordered))
    pc = llm.prefix_cache
    return {
        "prefix_cache": prefix_cache, "requests": len(requests), "steps": len(step_times),
        "tokens": {"prompt": prompt, "generated": generated}, "wall_s": busy,
        "tokens_per_s": {"prefill": prompt / busy, "decode": generated / busy, "total": (prompt + generated) / busy},
        "ttft_s": _percentiles([o.metrics["first_token_s"] for o in ordered]),
        "tpot_s": _percentiles([o.metrics["tpot_s"] for o in ordered if o.metrics["tpot_s"] is not None]),
        "step_ms": _percentiles(1e3 * np.asarray(step_times)),
        "hit_rate": None if pc is None else pc.hit_rate,
        "hit_tokens": 0 if pc is None else int(pc.stats["hit_tokens"]),
        "preempted": int(llm.stats["preempted"]),
        "compiled_after_warmup": llm.compiled_programs() - programs if sim.warmup else None,
        "all_served": all(len(o.outputs[0].token_ids) == r.gen_len and o.outputs[0].finish_reason == "length"
                          for o, r in zip(ordered, requests)),
        "outputs": [o.outputs[0].token_ids for o in ordered],
    }


def print_llm_summary(res: dict) -> None:
    sim = res["sim"]
    print(f"{res['model']} on {res['device']}: LLM, {sim['num_requests']} requests, S={sim['max_seqs']} slots, "
          f"budget {sim['token_budget']} tokens/step"
          + (f", {sim['shared_prefixes']} shared prefixes of {sim['prefix_len']} tokens" if sim["shared_prefixes"]
             else ""))
    print(f"{'prefix cache':>12} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'hit rate':>8} {'steps':>6} {'compiles':>8}")
    for name, r in res["runs"].items():
        t, tp = r["ttft_s"], r["tpot_s"]
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        comp = "-" if r["compiled_after_warmup"] is None else str(r["compiled_after_warmup"])
        print(f"{name:>12} {r['tokens_per_s']['total']:>9.0f} {1e3 * t['p50']:>7.1f}ms {1e3 * t['p99']:>7.1f}ms "
              f"{1e3 * tp['p50']:>7.1f}ms {1e3 * tp['p99']:>7.1f}ms {hit:>8} {r['steps']:>6} {comp:>8}")
    if "outputs_equal" in res:
        print(f"  outputs equal with the prefix cache off and on: {res['outputs_equal']}")
    print(f"  every request served: {res['all_served']}")


def print_summary(res: dict) -> None:
    c, tps, sim = res["compiles"], res["tokens_per_s"], res["sim"]
    print(f"{res['model']} on {res['device']}")
    print(f"  {res['requests']} requests, {res['steps']} steps ({res['calls']['prefill']} mixed prefill + "
          f"{res['calls']['decode']} decode calls, {res['calls']['release']} releases), S={sim['max_seqs']} slots, "
          f"budget {sim['token_budget']} tokens/step")
    print(f"  compiles        {c['total']} XLA programs in the process ({c['warmup']} in warm-up, "
          f"{c['after_warmup']} after), {c['compile_s']:.1f} s" + (":" if c["model_programs"] is not None else ""))
    if c["model_programs"] is not None:
        print(f"                  {c['model_programs']} the model's own prefill / decode / release programs "
              f"(model.compiled_programs(); {c['model_programs_after_warmup']} after warm-up)")
        print(f"                  {c['total'] - c['model_programs']} small eager programs outside those calls "
              f"(init_cache filling the pools, staging call arguments, slicing padded logits)")
    print(f"  tokens          {res['tokens']['prompt']} prompt + {res['tokens']['generated']} generated in "
          f"{res['wall_s']:.2f} s busy")
    print(f"  tokens/s        prefill {tps['prefill']:.0f}   decode {tps['decode']:.0f}   total {tps['total']:.0f}")
    t, ts = res["ttft_s"], res["ttft_steps"]
    print(f"  TTFT            p50 {1e3 * t['p50']:.1f} ms  p90 {1e3 * t['p90']:.1f} ms  p99 {1e3 * t['p99']:.1f} ms"
          f"   (steps p50 {ts['p50']:.0f}, p99 {ts['p99']:.0f})")
    for name, p in [("all", res["step_ms"])] + list(res["step_ms_by_kind"].items()):
        if p["n"]:
            print(f"  step {name:<10} p50 {p['p50']:.2f} ms  p90 {p['p90']:.2f} ms  p99 {p['p99']:.2f} ms "
                  f"({p['n']} steps)")
    print(f"  every request served: {res['all_served']}")


# ================================================================================================================
# Models and the command line
# ================================================================================================================
def build_model(model_dir: Optional[str] = None, dims: str = "tiny", layers: Optional[int] = None,
                dtype: str = "float32", backend: str = "auto", seed: int = 0):
    """A checkpoint (``model_dir``), or a random model of preset ``dims`` (jax_gdn.config.PRESETS) cut to
    ``layers`` layers (None: the preset's depth; the 3 GDN + 1 attention pattern is kept): ``"tiny"`` with
    host-made random weights (every norm, gate and conv randomised), the real-size presets with random weights
    made on the device."""
    import jax.numpy as jnp
    from jax_gdn.checkpoint import load_pretrained, random_model
    from jax_gdn.config import preset
    from jax_gdn.model import HybridModel
    dt = jnp.dtype(dtype)
    if model_dir:
        return load_pretrained(model_dir, dtype=dt, backend=backend)
    cfg = preset(dims) if layers is None else preset(dims, num_hidden_layers=layers)
    if dims == "tiny":
        return random_model(cfg, seed=seed, dtype=dt, backend=backend)
    return HybridModel.random(cfg, seed, dtype=dt, backend=backend)


def build_parser() -> argparse.ArgumentParser:
    from jax_gdn.config import PRESETS
    d = SimConfig()
    p = argparse.ArgumentParser(prog="python -m jax_gdn serve-sim", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=existing_dir, default=None, metavar="DIR",
                   help="HF checkpoint directory (default: a random model of --dims)")
    p.add_argument("--dims", default="tiny", choices=sorted(PRESETS), help="preset of the random model")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="layers of the random model (default: the preset's; real-size presets: 8)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: float32 for tiny, bfloat16 otherwise")
    p.add_argument("--backend", default="auto", choices=["auto", "xla", "pallas", "pallas_interpret"])
    p.add_argument("--requests", type=positive_int, default=d.num_requests)
    p.add_argument("--max-seqs", type=positive_int, default=d.max_seqs, help="slots (concurrent streams)")
    p.add_argument("--budget", type=positive_int, default=d.token_budget, help="tokens per step (>= --max-seqs)")
    p.add_argument("--prompt-len", type=min_max_pair, default=f"{d.prompt_len[0]},{d.prompt_len[1]}",
                   help="MIN,MAX prompt tokens")
    p.add_argument("--gen-len", type=min_max_pair, default=f"{d.gen_len[0]},{d.gen_len[1]}",
                   help="MIN,MAX generated tokens")
    p.add_argument("--rate", type=positive_float, default=d.rate, help="mean arrivals per step")
    p.add_argument("--page-size", type=positive_int, default=d.page_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--engine", default="llm", choices=["llm", "model"],
                   help="llm: jax_gdn.serving.LLM (add_request / step, on-device greedy sampling, the prefix cache); "
                        "model: the loop of this module over model.prefill / decode (its compile counts)")
    p.add_argument("--prefix-cache", default="off", choices=["off", "on", "both"],
                   help="--engine llm: serve with the prefix cache off, on, or both (the same arrivals twice)")
    p.add_argument("--shared-prefixes", type=int, default=d.shared_prefixes, metavar="K",
                   help="system prompts shared by the requests (request i starts with prompt i mod K)")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len, help="tokens of each shared system prompt")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=writable_file, default=None, metavar="FILE",
                   help="write the result dict to this file (its directory must exist)")
    return p


def run(argv=None) -> dict:
    """Parses ``argv`` (every option checked before any work: a bad one exits 2), builds the model, runs the
    simulation, prints the summary and writes ``--json``. Returns the result dict."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model and args.layers is not None:
        parser.error("--layers applies to a random model (--dims), not to --model")
    if args.budget < args.max_seqs:
        parser.error(f"--budget ({args.budget}) must be >= --max-seqs ({args.max_seqs}): every running stream "
                     f"decodes one token per step")
    try:
        sim = SimConfig(num_requests=args.requests, max_seqs=args.max_seqs, token_budget=args.budget,
                        prompt_len=args.prompt_len, gen_len=args.gen_len, rate=args.rate, seed=args.seed,
                        page_size=args.page_size, warmup=not args.no_warmup,
                        shared_prefixes=args.shared_prefixes, prefix_len=args.prefix_len)
    except ValueError as err:
        parser.error(str(err))
    if args.engine == "model" and (args.prefix_cache != "off" or args.shared_prefixes):
        parser.error("--prefix-cache and --shared-prefixes need --engine llm")
    layers = args.layers if args.layers is not None or args.dims == "tiny" else 8
    dtype = args.dtype or ("float32" if args.dims == "tiny" and not args.model else "bfloat16")
    model = build_model(args.model, args.dims, layers, dtype, args.backend, args.seed)
    if args.engine == "llm":
        res = simulate_engine(model, sim, prefix_cache=args.prefix_cache, progress=not args.no_progress)
    else:
        res = simulate(model, sim, progress=not args.no_progress)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def simulate_engine(model, sim: SimConfig, *, prefix_cache: str = "off", progress: bool = True,
                    verbose: bool = True) -> dict:
    """``--engine llm``: :func:`simulate_llm` with the prefix cache "off", "on" or "both" (the same arrivals twice,
    on a fresh engine each). Returns {"model", "device", "sim", "engine": "llm", "runs": {"off" / "on": ...},
    "all_served", "outputs_equal" (both)}, printed unless ``verbose=False``."""
    import jax
    settings = {"off": (False,), "on": (True,), "both": (False, True)}.get(prefix_cache)
    if settings is None:
        raise ValueError(f"prefix_cache must be 'off', 'on' or 'both'; got {prefix_cache!r}")
    runs = {("on" if on else "off"): simulate_llm(model, sim, prefix_cache=on, progress=progress)
            for on in settings}
    res = {"model": repr(model), "device": str(jax.devices()[0]), "sim": dataclasses.asdict(sim), "engine": "llm",
           "runs": runs, "all_served": all(r["all_served"] for r in runs.values())}
    if len(runs) == 2:
        res["outputs_equal"] = runs["off"]["outputs"] == runs["on"]["outputs"]
    if verbose:
        print_llm_summary(res)
    return res


def main(argv=None) -> int:
    """``python -m jax_gdn serve-sim``: exit status 0 when every request was served, else 1 (2: a bad option)."""
    return 0 if run(argv)["all_served"] else 1


if __name__ == "__main__":
    import sys
    sys.exit(main())
