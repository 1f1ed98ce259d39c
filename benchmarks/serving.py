"""Section "serving" (results key "serving"): ``jax_gdn.serving.LLM.generate`` on a shared-prefix workload, with
the prefix cache off and on, same prompts, same model, one process.

Workload: ``prefixes`` system prompts of ``prefix_len`` tokens, each shared by ``per_prefix`` requests that add
their own tail (``tail_len`` tokens, drawn in [tail_len / 2, tail_len]) and generate ``gen_len`` greedy tokens;
the requests are interleaved (prefix 0, 1, ..., 0, 1, ...) and handed to one ``generate`` call, so the first
request of each prefix fills the cache and the others can hit it. Each engine is warmed up first (every bucket's
program compiled; not counted). Reported per setting: wall time of the call, prompt and output tokens per
second of it, time to first token and time per output token (p50 / p99 over the requests, seconds from the
call's start: in an offline call every request arrives at 0, so time to first token includes queueing), the
prefix cache's hit rate and the prompt tokens it served, and whether the outputs of both settings are equal.

Block sizes (``block_sweep``, also ``python -m benchmarks.serving --block-sweep``): the prefix cache's hit
statistics against ``block_size`` on a mixed-length shared-prefix workload (``BLOCK_SWEEP``: 4 system prompts of
250-1000 tokens x 6 requests, 16 running, 16 snapshot slots). Hits depend on the scheduler and the cache's
bookkeeping only (greedy, no stop ids: the same steps on any model and device), so the tiny model on the CPU
gives the figures of any size; what a snapshot costs in memory is the model's (``snapshot_bytes``).

--quick: the tiny preset on the CPU (random fp32 weights, 2 prefixes of 64 tokens x 4 requests, 16-token
blocks). Otherwise Qwen3-Next-80B dims at 8 layers (random bf16 weights made on the device), 4 prefixes of 2048
tokens x 8 requests, 256-token blocks, on the default device.
"""
from __future__ import annotations

import time

import numpy as np

from benchmarks.tables import fmt, md_header

KEY = "serving"

QUICK = dict(dims="tiny", layers=None, prefixes=2, per_prefix=4, prefix_len=64, tail_len=24, gen_len=8,
             max_seqs=4, max_tokens=2048, page_size=16, token_budget=64, block_size=16)
FULL = dict(dims="qwen3_next_80b", layers=8, prefixes=4, per_prefix=8, prefix_len=2048, tail_len=256, gen_len=32,
            max_seqs=16, max_tokens=131072, page_size=16, token_budget=4096, block_size=256)


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


def run_section(quick: bool = False, seed: int = 0) -> dict:
    from jax_gdn.serving import LLM, SamplingParams
    w = dict(QUICK if quick else FULL)
    model = _model(w)
    prompts = workload(w, model.config.vocab_size, seed)
    sp = SamplingParams(max_tokens=w["gen_len"])
    rows, outputs = [], {}
    for cache_on in (False, True):
        kw = dict(prefix_cache=True, block_size=w["block_size"]) if cache_on else {}
        llm = LLM(model, max_seqs=w["max_seqs"], max_tokens=w["max_tokens"], page_size=w["page_size"],
                  token_budget=w["token_budget"], progress=False, **kw)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        outputs[cache_on] = [o.outputs[0].token_ids for o in outs]
        prompt_tokens = sum(len(p) for p in prompts)
        out_tokens = sum(len(t) for t in outputs[cache_on])
        pc = llm.prefix_cache
        rows.append({
            "prefix_cache": cache_on, "wall_s": round(wall, 4),
            "prompt_tok_s": round(prompt_tokens / wall, 1), "output_tok_s": round(out_tokens / wall, 1),
            "ttft_s": {"p50": _pct([o.metrics["first_token_s"] for o in outs], 50),
                       "p99": _pct([o.metrics["first_token_s"] for o in outs], 99)},
            "tpot_s": {"p50": _pct([o.metrics["tpot_s"] for o in outs], 50),
                       "p99": _pct([o.metrics["tpot_s"] for o in outs], 99)},
            "hit_rate": round(pc.hit_rate, 4) if pc else None,
            "hit_tokens": int(pc.stats["hit_tokens"]) if pc else 0,
            "steps": int(llm.stats["prefill_steps"] + llm.stats["decode_steps"]),
            "preempted": int(llm.stats["preempted"]),
        })
    import jax
    return {"device": jax.devices()[0].device_kind, "workload": w, "requests": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts), "rows": rows,
            "outputs_equal": outputs[False] == outputs[True]}


def print_section(value: dict) -> None:
    w = value["workload"]
    print(f"serving: {value['requests']} requests, {w['prefixes']} prefixes of {w['prefix_len']} tokens, "
          f"{value['prompt_tokens']} prompt tokens, {w['gen_len']} generated each ({w['dims']}"
          f"{'' if w['layers'] is None else ', ' + str(w['layers']) + ' layers'}; {value['device']})")
    print(f"{'prefix cache':>12} {'wall s':>8} {'prompt tok/s':>12} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'hit rate':>8} {'steps':>6}")
    for r in value["rows"]:
        print(f"{'on' if r['prefix_cache'] else 'off':>12} {r['wall_s']:>8.3f} {r['prompt_tok_s']:>12.1f} "
              f"{r['output_tok_s']:>10.1f} {fmt(r['ttft_s']['p50']):>9} {fmt(r['ttft_s']['p99']):>9} "
              f"{fmt(r['tpot_s']['p50']):>9} {fmt(r['tpot_s']['p99']):>9} "
              f"{fmt(r['hit_rate']):>8} {r['steps']:>6}")
    print(f"outputs equal with and without the cache: {value['outputs_equal']}")


def markdown(value: dict) -> list:
    lines = md_header(["prefix cache", "wall s", "prompt tok/s", "TTFT p50 / p99 s", "TPOT p50 / p99 s",
                       "hit rate"])
    for r in value["rows"]:
        lines.append(f"| {'on' if r['prefix_cache'] else 'off'} | {r['wall_s']} | {r['prompt_tok_s']} | "
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
