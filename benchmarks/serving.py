"""Section "serving" (results key "serving"): ``jax_gdn.serving.LLM.generate`` on a shared-prefix workload, with
the prefix cache off and on and with ``async_decode`` (the cache off), same prompts, same model, one process.

Workload: ``prefixes`` system prompts of ``prefix_len`` tokens, each shared by ``per_prefix`` requests that add
their own tail (``tail_len`` tokens, drawn in [tail_len / 2, tail_len]) and generate ``gen_len`` greedy tokens;
the requests are interleaved (prefix 0, 1, ..., 0, 1, ...) and handed to one ``generate`` call, so the first
request of each prefix fills the cache and the others can hit it. Each engine is warmed up first (every bucket's
program compiled; not counted). Reported per setting: wall time of the call, prompt and output tokens per
second of it, time to first token and time per output token (p50 / p99 over the requests, seconds from the
call's start: in an offline call every request arrives at 0, so time to first token includes queueing), the
prefix cache's hit rate and the prompt tokens it served, and whether the outputs with the cache on
("outputs_equal") and with async_decode ("outputs_equal_async") are those with neither.

Block sizes (``block_sweep``, also ``python -m benchmarks.serving --block-sweep``): the prefix cache's hit
statistics against ``block_size`` on a mixed-length shared-prefix workload (``BLOCK_SWEEP``: 4 system prompts of
250-1000 tokens x 6 requests, 16 running, 16 snapshot slots). Hits depend on the scheduler and the cache's
bookkeeping only (greedy, no stop ids: the same steps on any model and device), so the tiny model on the CPU
gives the figures of any size; what a snapshot costs in memory is the model's (``snapshot_bytes``).

Parts (``--cases``; default all but "branches", a part not run keeps its stored figures):
  workload  the shared-prefix workload above, cache off, on, and off with ``async_decode`` (``ENGINES``; each
            engine warmed up by ``LLM.warmup``: every bucket's program;
            at 80B dims two prefill buckets, 512 and 4096 tokens, and 8 running, so that the two engines' warm-ups
            compile 28 programs: the model's buckets at 16 running made 115)
  ttft      time to first token of one request alone, cold against a prefix-cache hit (``ttft_probe``): for each
            prefix length, a fresh prefix of that many tokens + a 64-token tail, three requests in turn (the first
            cold, the second makes the snapshot, the third hits), one generated token each; the first round (on its
            own prefix) compiles and is not counted, then ``reps`` rounds, medians; no other request runs; on a
            GPU one more hit is traced ("hit_trace": its kernels by kind beside its wall time)
  sampling  the cost of on-device sampling in the decode step (``sampling_cost``): the engine's decode program
            (model step + sampler) over N streams of a ``context``-token prefill, timed by ``jax_gdn.timing``
            with every row greedy, and with every row sampled (temperature 0.8, top-k 50, top-p 0.95; and
            temperature 1, top-p 0.9, no top-k): the ms and the share the sampler adds; and the sampler alone
            (``sampling.sample`` on random logits of the step's shape), greedy and with each of ``sampling.METHODS``
  branches  the TTFT probe at one prefix (4096 + 64 tokens) with the kernels' device-side choices in every call
            and as shipped, in turn, twice each (``branch_ab``): what the ``DEVICE_BRANCH_MIN_TOKENS`` bound saves

--quick: the tiny preset on the CPU (random fp32 weights, 2 prefixes of 64 tokens x 4 requests, 16-token
blocks; TTFT at a 128-token prefix; sampling over 4 streams). Otherwise Qwen3-Next-80B dims at 8 layers (random
bf16 weights made on the device), 4 prefixes of 2048 tokens x 4 requests, 8 running, 64-token blocks;
TTFT at 4096- and 16384-token prefixes; sampling over 16 and 64 streams of 512 tokens; on the default device.
Section "serving_35b" (results key "serving_35b"): the same parts and workload on Qwen3.5-35B-A3B at its full 40
layers (``FULL_35B``; random bf16 weights, 65 GiB).
"""
from __future__ import annotations

import time

import numpy as np

from benchmarks.configs import MODEL_DIMS
from benchmarks.tables import fmt, md_header

KEY = "serving"

QUICK = dict(dims="tiny", layers=None, prefixes=2, per_prefix=4, prefix_len=64, tail_len=24, gen_len=8,
             max_seqs=4, max_tokens=2048, page_size=16, token_budget=64, block_size=16)
FULL = dict(dims="qwen3_next_80b", layers=MODEL_DIMS["qwen3_next_80b"], prefixes=4, per_prefix=4, prefix_len=2048,
            tail_len=256, gen_len=32, max_seqs=8, max_tokens=65536, page_size=16, token_budget=4096, block_size=64,
            prefill_buckets=(512, 4096))
#: section "serving_35b": the same workload on Qwen3.5-35B-A3B at its full 40 layers
FULL_35B = dict(FULL, dims="qwen3_5_35b_a3b", layers=MODEL_DIMS["qwen3_5_35b_a3b"])
#: the CLI's sections of this module -> (results key, full-size workload)
SECTION_SIZES = {"serving": (KEY, FULL), "serving_35b": ("serving_35b", FULL_35B)}
#: the workload's engines: (prefix cache, async_decode), each over the same prompts
ENGINES = ((False, False), (True, False), (False, True))
#: the parts of the section (``--cases``)
PARTS = ("workload", "ttft", "sampling", "branches")
#: the parts a run without ``--cases`` measures ("branches" is an A/B of a choice made already: asked for by name)
DEFAULT_PARTS = ("workload", "ttft", "sampling")
#: (prefix lengths, tail, token budget, rounds) of the TTFT probe; (streams, context) of the sampling cost
TTFT = {"quick": dict(prefixes=(128,), tail=8, token_budget=64, reps=2),
        "full": dict(prefixes=(4096, 16384), tail=64, token_budget=4096, reps=3)}
SAMPLING = {"quick": dict(streams=(4,), context=32), "full": dict(streams=(16, 64), context=512)}
#: (prefix, tail, token budget, rounds of the probe, alternations) of the device-branch A/B (part "branches")
BRANCHES = {"quick": dict(prefix=128, tail=8, token_budget=64, reps=2, turns=1),
            "full": dict(prefix=4096, tail=64, token_budget=4096, reps=3, turns=2)}
#: the sampled settings of the sampling cost (SamplingParams fields)
SAMPLED = {"t0.8-k50-p0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
           "t1-p0.9": dict(temperature=1.0, top_k=0, top_p=0.9)}


#: the block-size sweep's workload: prefixes of mixed lengths (1-4k tokens at 1/4 scale), tails of 16-64 tokens
BLOCK_SWEEP = dict(prefix_lens=(250, 475, 725, 1000), per_prefix=6, tail=(16, 64), gen_len=8, max_seqs=16,
                   max_tokens=32768, page_size=16, token_budget=1024, block_sizes=(16, 32, 64, 128, 256, 512))


def snapshot_bytes(config) -> int:
    """Bytes of one prefix-cache snapshot of ``config``'s model beyond its KV pages (shared by reference): one
    cache slot's GDN states, recurrent (fp32) and conv (bf16), over every GDN layer."""
    d = config.gdn_dims
    per_layer = d.num_v_heads * d.head_k_dim * d.head_v_dim * 4 + d.conv_dim * (d.conv_kernel_size - 1) * 2
    return len(config.gdn_layers) * per_layer


def block_sweep(w: dict = BLOCK_SWEEP, seed: int = 0) -> dict:
    """{"workload", "prompt_tokens", "rows": [{"block_size", "hits", "lookups", "hit_tokens", "snapshots",
    "evictions"}]}: one ``LLM.generate`` of the workload per block size (tiny fp32 model, programs compiled as
    they are met: no timing here)."""
    import jax.numpy as jnp
    from jax_gdn.config import preset
    from jax_gdn.model import HybridModel
    from jax_gdn.serving import LLM, SamplingParams
    model = HybridModel.random(preset("tiny"), 0, dtype=jnp.float32, backend="xla")
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    systems = [rng.integers(0, vocab, n).tolist() for n in w["prefix_lens"]]
    prompts = [s + rng.integers(0, vocab, int(rng.integers(w["tail"][0], w["tail"][1] + 1))).tolist()
               for _ in range(w["per_prefix"]) for s in systems]
    rows = []
    for bs in w["block_sizes"]:
        llm = LLM(model, max_seqs=w["max_seqs"], max_tokens=w["max_tokens"], page_size=w["page_size"],
                  token_budget=w["token_budget"], progress=False, warmup=False, prefix_cache=True, block_size=bs)
        llm.generate(prompts, SamplingParams(max_tokens=w["gen_len"]), use_tqdm=False)
        st = llm.prefix_cache.stats
        rows.append({"block_size": bs, **{k: int(st[k]) for k in ("hits", "lookups", "hit_tokens", "snapshots",
                                                                   "evictions")}})
        print(f"block_size {bs}: {rows[-1]}", flush=True)
    return {"workload": dict(w), "prompt_tokens": sum(len(p) for p in prompts), "rows": rows}


def workload(w: dict, vocab: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, w["prefix_len"]).tolist() for _ in range(w["prefixes"])]
    out = []
    for j in range(w["per_prefix"]):
        for i in range(w["prefixes"]):
            n = int(rng.integers(w["tail_len"] // 2, w["tail_len"] + 1))
            out.append(systems[i] + rng.integers(0, vocab, n).tolist())
    return out


def _pct(x, q):
    x = [v for v in x if v is not None]
    return round(float(np.percentile(x, q)), 5) if x else None


def _model(w: dict):
    import jax.numpy as jnp
    from jax_gdn.config import preset
    from jax_gdn.model import HybridModel
    if w["dims"] == "tiny":
        return HybridModel.random(preset("tiny"), 0, dtype=jnp.float32, backend="xla")
    from benchmarks.configs import random_device_model
    return random_device_model(preset(w["dims"], num_hidden_layers=w["layers"]), jnp.bfloat16, "auto")


def ttft_probe(model, prefixes=(4096,), tail: int = 64, token_budget: int = 4096, reps: int = 3,
               block_size: int = 64, seed: int = 0, trace=None) -> list:
    """[{"prefix", "tail", "cold_s", "hit_s", "ratio", "hit_tokens", "hit_host_ms"}] per prefix length (module
    docstring, part "ttft"): medians over ``reps`` rounds of time to first token, each request alone in the engine;
    "hit_host_ms" the hit's ``LLM.host_s`` by phase (``jax_gdn.serving.llm.HOST_PHASES``; "wait" holds the
    device's time), medians. ``trace`` (None:
    on a GPU only) adds "hit_trace": one more hit, traced (``benchmarks.profile.kernel_time``): {"wall_ms" (the
    traced call, profiler overhead included), "gpu_ms" (its kernels summed), "kinds" {kind: ms}, "top" {kernel:
    ms}, "hit_tokens"}, which tells the hit's device time from its host time."""
    from jax_gdn.serving import LLM, SamplingParams
    from jax_gdn.serving.llm import HOST_PHASES
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    sp = SamplingParams(max_tokens=1)
    rows = []
    for n in prefixes:
        # the pool holds a round's requests beside the last round's snapshot: no step is refused
        llm = LLM(model, max_seqs=1, max_tokens=2 * n + 4 * tail, page_size=16, token_budget=token_budget,
                  progress=False, warmup=False, prefix_cache=True, block_size=block_size, prefix_slots=1)
        cold, hit, hit_tokens, hit_host = [], [], [], []
        for rnd in range(reps + 1):                  # the first pass compiles what the others call
            prefix = rng.integers(0, vocab, n).tolist()
            ttft = []
            for _ in range(3):                       # the third is the hit: its host phases are kept
                before = dict(llm.host_s)
                out = llm.generate(prefix + rng.integers(0, vocab, tail).tolist(), sp, use_tqdm=False)[0]
                ttft.append(out.metrics["first_token_s"])
            if rnd:
                cold.append(ttft[0])
                hit.append(ttft[2])
                hit_tokens.append(out.metrics["prefix_hit_tokens"])
                hit_host.append({k: v - before.get(k, 0.0) for k, v in llm.host_s.items()})
        c, h = float(np.median(cold)), float(np.median(hit))
        rows.append({"prefix": n, "tail": tail, "cold_s": round(c, 5), "hit_s": round(h, 5),
                     "ratio": round(h / c, 4), "hit_tokens": int(min(hit_tokens)),
                     "hit_host_ms": {k: round(float(np.median([d.get(k, 0.0) for d in hit_host])) * 1e3, 3)
                                     for k in HOST_PHASES if any(k in d for d in hit_host)}})
        print(f"ttft prefix {n}: cold {c * 1e3:.2f} ms, hit {h * 1e3:.2f} ms ({h / c:.3f}x), "
              f"{min(hit_tokens)} tokens hit; the hit's host ms by phase {rows[-1]['hit_host_ms']}", flush=True)
        if trace if trace is not None else _on_gpu():
            prompt = prefix + rng.integers(0, vocab, tail).tolist()      # the last round's prefix: cached
            got = []
            rows[-1]["hit_trace"] = _traced(lambda: got.append(llm.generate(prompt, sp, use_tqdm=False)[0]))
            rows[-1]["hit_trace"]["hit_tokens"] = int(got[0].metrics["prefix_hit_tokens"])
            print(f"  traced hit: wall {rows[-1]['hit_trace']['wall_ms']:.2f} ms, kernels "
                  f"{rows[-1]['hit_trace']['gpu_ms']:.2f} ms: {rows[-1]['hit_trace']['kinds']}", flush=True)
    return rows


def _on_gpu() -> bool:
    import jax
    return jax.default_backend() == "gpu"


def _traced(call) -> dict:
    """``benchmarks.profile.kernel_time`` of one host-blocking ``call`` as a JSON-ready dict (ms, rounded there)."""
    from benchmarks.profile import kernel_time
    wall, kinds, top, _ = kernel_time(call, lambda out: out)
    return {"wall_ms": wall, "gpu_ms": round(sum(kinds.values()), 3), "kinds": kinds, "top": top}


def sampling_cost(model, streams=(16, 64), context: int = 512, seed: int = 0) -> list:
    """[{"streams", "context", "greedy_ms", "ms": {setting: ms}, "overhead": {setting: share}, "fallback_calls",
    "full_sort_calls"}]: the engine's decode step over ``streams`` slots holding ``context`` tokens each, every row
    greedy against every row sampled with each of ``SAMPLED`` (module docstring, part "sampling"). Each call is the
    engine's step: the model's decode program, the sampler program the engine picks (the merged draw where a row's
    last draw needed the full sort, as the engine carries it from step to step), the copy of the ids to the host
    and, where rows need it, the fallback program and its copy ("fallback_calls" / "full_sort_calls": how many
    calls of each setting, warm-up included, took the fallback / the merged draw).
    Each call decodes one more token per stream (the cache goes on from call to call)."""
    import jax
    from jax_gdn.serving import LLM, SamplingParams
    from jax_gdn.serving.sampling import sampling_arrays
    from jax_gdn.timing import jax_sync, time_calls
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    rows = []
    for n in streams:
        llm = LLM(model, max_seqs=n, max_tokens=n * (context + 4096), page_size=16, token_budget=n * context,
                  progress=False, warmup=False)
        m, prog = llm.model, llm._programs["decode"]
        slots = np.arange(n, dtype=np.int32)
        ids = rng.integers(0, vocab, n * context).astype(np.int32)
        cu = (np.arange(n + 1) * context).astype(np.int32)
        _, llm.cache = m.prefill(llm.cache, ids, cu, slots)
        nb = m.stream_bucket(n, llm.cache.num_slots)
        ids_p, cu_p, sl_p = m.pad_step_inputs(ids[:n], np.arange(n + 1, dtype=np.int32), slots, nb, nb,
                                              llm.cache.num_slots)
        settings = {"greedy": SamplingParams(), **{k: SamplingParams(**v) for k, v in SAMPLED.items()}}
        ms, fallbacks, merged = {}, {}, {}
        for name, params in settings.items():
            arrays = sampling_arrays([params] * n, [1] * n, nb)          # host arrays, as the engine passes them
            last = {"need": None}                 # the rows whose last draw needed the full sort, as the engine keeps
            before = dict(llm.stats)

            def call(arrays=arrays, last=last):   # the engine's step: the model's program, its sampler's, the copy
                logits, _, llm.cache = prog(m.params, llm.cache, ids_p, cu_p, sl_p)    # the cache is donated
                toks, _, last["need"] = llm._sampled_ids(logits, arrays, full=last["need"])
                return toks
            ms[name] = time_calls(call, jax_sync)
            fallbacks[name] = llm.stats["fallback_steps"] - before.get("fallback_steps", 0)
            merged[name] = llm.stats["full_sort_steps"] - before.get("full_sort_steps", 0)
        if int(jax.device_get(llm.cache.status)) != 0:
            raise RuntimeError(f"sampling_cost: a timed decode step was refused (N={n}): the figures are void")
        greedy = ms.pop("greedy")
        alone = _sampler_alone(nb, vocab, n, rng)
        rows.append({"streams": n, "context": context, "greedy_ms": round(greedy, 4),
                     "ms": {k: round(v, 4) for k, v in ms.items()}, "fallback_calls": fallbacks,
                     "full_sort_calls": merged,
                     "overhead": {k: round(v / greedy - 1, 4) for k, v in ms.items()},
                     "sampler_alone_ms": alone})
        print(f"sampling N={n}: greedy {greedy:.3f} ms; " + ", ".join(f"{k} {v:.3f} ms ({v / greedy - 1:+.1%})"
                                                                     for k, v in ms.items()), flush=True)
    return rows


def _sampler_alone(rows: int, vocab: int, n: int, rng) -> dict:
    """{"greedy", each of ``sampling.METHODS``, "engine_draw": ms}: ``sampling.sample`` alone on random [rows, vocab]
    fp32 logits, all greedy, then every row sampled (temperature 0.8, top-k 50, top-p 0.95) with each method; and
    the engine's sampler program on the sampled rows (``draw_rows`` of the default method, no device branch)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax_gdn.serving import SamplingParams
    from jax_gdn.serving.sampling import METHODS, draw_rows, sample, sampling_arrays
    from jax_gdn.timing import time_jax
    logits = jnp.asarray(rng.standard_normal((rows, vocab)).astype(np.float32) * 2)
    out = {}
    greedy = [jax.device_put(a) for a in sampling_arrays([SamplingParams()] * n, [1] * n, rows)]
    out["greedy"] = round(time_jax(sample, (logits, *greedy)), 4)
    drawn = [jax.device_put(a) for a in sampling_arrays([SamplingParams(**SAMPLED["t0.8-k50-p0.95"])] * n, [1] * n,
                                                        rows)]
    for method in METHODS:
        out[method] = round(time_jax(functools.partial(sample, method=method), (logits, *drawn)), 4)
    # the engine's sampler program (the default method's draw_rows: no lax.cond; every row decided here)
    draw = jax.jit(functools.partial(draw_rows, plain=False))
    out["engine_draw"] = round(time_jax(draw, (logits, *drawn)), 4)
    return out


def run_section(quick: bool = False, cases=None, seed: int = 0, full: dict = None) -> dict:
    """The section's value: {"device", "dims", "layers"} and each part run (``cases``: names from PARTS; None:
    DEFAULT_PARTS): "workload" {workload, requests, prompt_tokens, rows, outputs_equal, outputs_equal_async},
    "ttft" [rows], "sampling" [rows], "branches" [rows]. ``full``: the workload and model when not ``quick``
    (default ``FULL``; ``FULL_35B``)."""
    import jax
    parts = DEFAULT_PARTS if cases is None else tuple(cases)
    w = dict(QUICK if quick else (full or FULL))
    model = _model(w)
    value = {"device": jax.devices()[0].device_kind, "dims": w["dims"], "layers": w["layers"]}
    size = "quick" if quick else "full"
    if "ttft" in parts:
        value["ttft"] = ttft_probe(model, seed=seed, **TTFT[size])
    if "sampling" in parts:
        value["sampling"] = sampling_cost(model, seed=seed, **SAMPLING[size])
    if "workload" in parts:
        value["workload"] = _workload(model, w, seed)
    if "branches" in parts:
        value["branches"] = branch_ab(model, seed=seed, **BRANCHES[size])
    return value


def branch_ab(model, prefix: int = 4096, tail: int = 64, token_budget: int = 4096, reps: int = 3, turns: int = 2,
              seed: int = 0) -> list:
    """[{"branches", "cold_s", "hit_s", "ratio", "hit_host_ms"}]: the TTFT probe at one prefix (part "branches"),
    ``turns`` times each way in turn: "every call" (the kernels' device-side choices made in every call, as before
    ``pallas_kernels.dispatch.DEVICE_BRANCH_MIN_TOKENS``: ``VarlenConfig.cond_min_tokens`` 0, ``cudnn.FRESH``
    "cond") and "shipped" (the defaults). Each turn is a model of its own over the same params, so that its
    programs are traced under that turn's defaults; the defaults are put back after. On the CPU the tiny model
    runs backend "xla", which holds neither choice: both ways run the same programs there."""
    import dataclasses

    from jax_gdn.model import HybridModel
    from pallas_kernels.gated_delta_rule.mosaic_gpu import varlen
    from pallas_kernels.paged_attention import cudnn
    shipped = (varlen.DEFAULT_CONFIG, cudnn.FRESH)
    rows = []
    try:
        for i in range(2 * turns):
            always = i % 2 == 0
            varlen.DEFAULT_CONFIG = dataclasses.replace(shipped[0], cond_min_tokens=0) if always else shipped[0]
            cudnn.FRESH = "cond" if always else shipped[1]
            turn = HybridModel(model.config, model.params, dtype=model.dtype, backend=model.backend,
                               token_buckets=model.token_buckets, options=model.options,
                               compiler_options=model.compiler_options)
            r = ttft_probe(turn, prefixes=(prefix,), tail=tail, token_budget=token_budget, reps=reps,
                           seed=seed + i, trace=False)[0]
            rows.append({"branches": "every call" if always else "shipped",
                         **{k: r[k] for k in ("prefix", "tail", "cold_s", "hit_s", "ratio", "hit_host_ms")}})
    finally:
        varlen.DEFAULT_CONFIG, cudnn.FRESH = shipped
    return rows


def _workload(model, w: dict, seed: int) -> dict:
    from jax_gdn.serving import LLM, SamplingParams
    prompts = workload(w, model.config.vocab_size, seed)
    sp = SamplingParams(max_tokens=w["gen_len"])
    rows, outputs = [], {}
    for cache_on, overlap in ENGINES:
        kw = dict(prefix_cache=True, block_size=w["block_size"]) if cache_on else {}
        llm = LLM(model, max_seqs=w["max_seqs"], max_tokens=w["max_tokens"], page_size=w["page_size"],
                  token_budget=w["token_budget"], progress=False, prefill_buckets=w.get("prefill_buckets"),
                  async_decode=overlap, **kw)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        outputs[cache_on, overlap] = [o.outputs[0].token_ids for o in outs]
        prompt_tokens = sum(len(p) for p in prompts)
        out_tokens = sum(len(t) for t in outputs[cache_on, overlap])
        pc = llm.prefix_cache
        rows.append({
            "prefix_cache": cache_on, "async_decode": overlap, "wall_s": round(wall, 4),
            "prompt_tok_s": round(prompt_tokens / wall, 1), "output_tok_s": round(out_tokens / wall, 1),
            "ttft_s": {"p50": _pct([o.metrics["first_token_s"] for o in outs], 50),
                       "p99": _pct([o.metrics["first_token_s"] for o in outs], 99)},
            "tpot_s": {"p50": _pct([o.metrics["tpot_s"] for o in outs], 50),
                       "p99": _pct([o.metrics["tpot_s"] for o in outs], 99)},
            "hit_rate": round(pc.hit_rate, 4) if pc else None,
            "hit_tokens": int(pc.stats["hit_tokens"]) if pc else 0,
            "steps": int(llm.stats["prefill_steps"] + llm.stats["decode_steps"]),
            "preempted": int(llm.stats["preempted"]), "queued_ahead_steps": int(llm.stats["queued_ahead_steps"]),
        })
    return {"workload": w, "requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts), "rows": rows,
            "outputs_equal": outputs[False, False] == outputs[True, False],
            "outputs_equal_async": outputs[False, False] == outputs[False, True]}


def print_section(value: dict) -> None:
    depth = "" if value.get("layers") is None else f", {value['layers']} layers"
    print(f"serving ({value.get('dims')}{depth}; {value.get('device')})")
    for r in value.get("ttft") or []:
        print(f"  TTFT, {r['prefix']}-token prefix + {r['tail']}: cold {r['cold_s'] * 1e3:.2f} ms, prefix hit "
              f"{r['hit_s'] * 1e3:.2f} ms ({r['ratio']:.3f}x, {r['hit_tokens']} tokens from the cache)")
    for r in value.get("branches") or []:
        print(f"  TTFT, device branches {r['branches']}: cold {r['cold_s'] * 1e3:.2f} ms, hit {r['hit_s'] * 1e3:.2f} "
              f"ms; the hit's host dispatch {r['hit_host_ms'].get('dispatch', 0):.2f} ms")
    for r in value.get("sampling") or []:
        print(f"  decode step, {r['streams']} streams: greedy {r['greedy_ms']:.3f} ms; "
              + ", ".join(f"{k} {v:.3f} ms ({r['overhead'][k]:+.1%})" for k, v in r["ms"].items()))
        if r.get("sampler_alone_ms"):
            print("    the sampler alone: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r["sampler_alone_ms"].items()))
    wl = value.get("workload")
    if not wl:
        return
    w = wl["workload"]
    print(f"  workload: {wl['requests']} requests, {w['prefixes']} prefixes of {w['prefix_len']} tokens, "
          f"{wl['prompt_tokens']} prompt tokens, {w['gen_len']} generated each")
    print(f"{'prefix cache':>12} {'async':>5} {'wall s':>8} {'prompt tok/s':>12} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'hit rate':>8} {'steps':>6}")
    for r in wl["rows"]:
        print(f"{'on' if r['prefix_cache'] else 'off':>12} {'on' if r.get('async_decode') else 'off':>5} "
              f"{r['wall_s']:>8.3f} {r['prompt_tok_s']:>12.1f} "
              f"{r['output_tok_s']:>10.1f} {fmt(r['ttft_s']['p50']):>9} {fmt(r['ttft_s']['p99']):>9} "
              f"{fmt(r['tpot_s']['p50']):>9} {fmt(r['tpot_s']['p99']):>9} "
              f"{fmt(r['hit_rate']):>8} {r['steps']:>6}")
    print(f"outputs equal with and without the cache: {wl['outputs_equal']}"
          + (f"; with and without async_decode: {wl['outputs_equal_async']}" if "outputs_equal_async" in wl else ""))


def markdown(value: dict) -> list:
    depth = "" if value.get("layers") is None else f", {value['layers']} layers"
    lines = [f"Serving, {value.get('dims')}{depth}:", ""]
    if value.get("ttft"):
        lines += md_header(["prefix + tail tokens", "TTFT cold ms", "TTFT prefix hit ms", "hit / cold"])
        lines += [f"| {r['prefix']} + {r['tail']} | {r['cold_s'] * 1e3:.2f} | {r['hit_s'] * 1e3:.2f} | "
                  f"{r['ratio']:.3f} |" for r in value["ttft"]]
        lines.append("")
    if value.get("sampling"):
        names = list(value["sampling"][0]["ms"])
        lines += md_header(["streams", "greedy step ms"] + [f"{k} ms (added)" for k in names])
        lines += [f"| {r['streams']} | {r['greedy_ms']:.3f} | " + " | ".join(
            f"{r['ms'][k]:.3f} ({r['overhead'][k]:+.1%})" for k in names) + " |" for r in value["sampling"]]
        lines.append("")
    wl = value.get("workload")
    if wl:
        lines += md_header(["prefix cache", "async decode", "wall s", "prompt tok/s", "TTFT p50 / p99 s",
                            "TPOT p50 / p99 s", "hit rate"])
        for r in wl["rows"]:
            lines.append(f"| {'on' if r['prefix_cache'] else 'off'} | {'on' if r.get('async_decode') else 'off'} | "
                         f"{r['wall_s']} | {r['prompt_tok_s']} | "
                         f"{fmt(r['ttft_s']['p50'])} / {fmt(r['ttft_s']['p99'])} | "
                         f"{fmt(r['tpot_s']['p50'])} / {fmt(r['tpot_s']['p99'])} | {fmt(r['hit_rate'])} |")
    return lines


if __name__ == "__main__":
    import argparse
    import json
    ap = argparse.ArgumentParser(description="the prefix cache's hit statistics against block_size (block_sweep)")
    ap.add_argument("--block-sweep", action="store_true", required=True)
    ap.parse_args()
    print(json.dumps(block_sweep(), indent=1))
