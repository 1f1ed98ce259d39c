"""Model demo: a packed prefill of several streams, then greedy decode steps, with per-phase times and tokens/s.

By default it builds the ``"tiny"`` preset (jax_gdn.config.PRESETS: 3 GDN + 1 attention layers, sparse MoE with a
shared expert and one dense layer) with random weights in memory; ``--model DIR`` loads a HF checkpoint directory
instead.

    python -m jax_gdn.model_demo [--model DIR] [--lens 1,63,130,257,65] [--decode-steps 8] [--dtype bfloat16]

From another entry point: ``add_model_demo_args(parser)`` registers the options, ``run_model_demo(args)`` runs it
(``args``: an argparse Namespace, a dict, or None for the defaults) and returns a dict of the measurements.

Shape legend: T stacked prompt tokens, N streams, Vocab vocabulary.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_gdn.cli_types import existing_dir, nonnegative_int, positive_int, positive_int_list

DEFAULTS = dict(model=None, lens="1,63,130,257,65", decode_steps=8, dtype="float32", backend="auto",
                max_tokens=4096, page_size=16, seed=0)


def add_model_demo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", type=existing_dir, default=DEFAULTS["model"], metavar="DIR",
                        help="HF checkpoint directory (qwen3_next / qwen3_5 / qwen3_5_moe); default: the tiny "
                             "preset with random weights")
    parser.add_argument("--lens", type=positive_int_list, default=DEFAULTS["lens"],
                        help="comma-separated prompt lengths, one per stream")
    parser.add_argument("--decode-steps", type=nonnegative_int, default=DEFAULTS["decode_steps"])
    parser.add_argument("--dtype", default=DEFAULTS["dtype"], choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default=DEFAULTS["backend"], choices=["auto", "xla", "pallas",
                                                                          "pallas_interpret"])
    parser.add_argument("--max-tokens", type=positive_int, default=DEFAULTS["max_tokens"],
                        help="KV pool size in tokens")
    parser.add_argument("--page-size", type=positive_int, default=DEFAULTS["page_size"])
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    return parser


def _options(args) -> dict:
    if args is None:
        return dict(DEFAULTS)
    src = args if isinstance(args, dict) else vars(args)
    out = dict(DEFAULTS)
    for key in DEFAULTS:
        if src.get(key) is not None:
            out[key] = src[key]
    return out


def _sync(x):
    jax.block_until_ready(x)
    return x


def run_model_demo(args=None, *, verbose: bool = True) -> dict:
    """Runs the demo and returns {"model", "streams", "prompt_tokens", "prefill_compile_s", "prefill_s",
    "prefill_tok_s", "decode_compile_s", "decode_step_s", "decode_tok_s", "generated", "finite" (the last logits),
    "prefill_repeat_rel_err" (the second prefill, after releasing the slots, against the first: max abs difference
    over max abs logit)}."""
    from jax_gdn.checkpoint import load_pretrained, random_model
    from jax_gdn.config import preset
    opt = _options(args)
    dtype = jnp.dtype(opt["dtype"])
    lens = [int(x) for x in str(opt["lens"]).split(",") if x.strip()] if isinstance(opt["lens"], str) \
        else [int(x) for x in opt["lens"]]
    if not lens or min(lens) < 1:
        raise ValueError(f"--lens must be positive prompt lengths, got {opt['lens']!r}")

    t0 = time.perf_counter()
    if opt["model"]:
        model = load_pretrained(opt["model"], dtype=dtype, backend=opt["backend"])
    else:
        model = random_model(preset("tiny"), seed=opt["seed"], dtype=dtype, backend=opt["backend"])
    load_s = time.perf_counter() - t0
    cfg = model.config
    n = len(lens)
    rng = np.random.default_rng(opt["seed"])
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu = np.cumsum([0] + lens).astype(np.int32)
    slots = np.arange(n, dtype=np.int32)[::-1].copy()           # permuted slots
    need = sum(lens) + n * (opt["decode_steps"] + opt["page_size"])
    cache = model.init_cache(max_seqs=n, max_tokens=max(int(opt["max_tokens"]), need),
                             page_size=int(opt["page_size"]))

    # ---- prefill: first call compiles, the second (after release) is the steady state ----
    t0 = time.perf_counter()
    logits, cache = model.prefill(cache, ids, cu, slots)
    _sync(logits)
    prefill_compile_s = time.perf_counter() - t0
    first_logits = np.asarray(logits, np.float64)
    cache = model.release(cache, slots)
    t0 = time.perf_counter()
    logits, cache = model.prefill(cache, ids, cu, slots)
    _sync(logits)
    prefill_s = time.perf_counter() - t0
    # the released slots start fresh: the same prompts give the same logits (a stale state would not)
    repeat_err = float(np.max(np.abs(np.asarray(logits, np.float64) - first_logits))
                       / max(float(np.max(np.abs(first_logits))), 1e-30))

    # ---- greedy decode ----
    generated = [[] for _ in range(n)]
    step_times = []
    decode_compile_s = 0.0
    for step in range(int(opt["decode_steps"])):
        nxt = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
        for i in range(n):
            generated[i].append(int(nxt[i]))
        t0 = time.perf_counter()
        logits, cache = model.decode(cache, nxt, slots)
        _sync(logits)
        dt = time.perf_counter() - t0
        if step == 0:
            decode_compile_s = dt
        else:
            step_times.append(dt)
    decode_step_s = float(np.median(step_times)) if step_times else float("nan")
    result = {
        "model": repr(model), "streams": n, "prompt_lens": lens, "prompt_tokens": int(sum(lens)),
        "load_s": load_s, "prefill_compile_s": prefill_compile_s, "prefill_s": prefill_s,
        "prefill_tok_s": sum(lens) / prefill_s, "decode_compile_s": decode_compile_s,
        "decode_step_s": decode_step_s, "decode_tok_s": n / decode_step_s if step_times else float("nan"),
        "generated": generated, "device": str(jax.devices()[0]),
        "finite": bool(np.all(np.isfinite(np.asarray(logits)))), "prefill_repeat_rel_err": repeat_err,
    }
    if verbose:
        print(f"{result['model']} on {result['device']}")
        print(f"  {n} streams, prompt lengths {lens} ({sum(lens)} tokens), slots {slots.tolist()}")
        print(f"  load/build      {load_s * 1e3:10.1f} ms")
        print(f"  prefill compile {prefill_compile_s * 1e3:10.1f} ms (first call)")
        print(f"  prefill         {prefill_s * 1e3:10.1f} ms  {result['prefill_tok_s']:12.0f} tokens/s")
        print(f"  decode compile  {decode_compile_s * 1e3:10.1f} ms (first step)")
        print(f"  decode step     {decode_step_s * 1e3:10.2f} ms  {result['decode_tok_s']:12.0f} tokens/s "
              f"(median of {len(step_times)} steps, {n} streams)")
        for i in range(min(n, 4)):
            print(f"  stream {i} (slot {int(slots[i])}) greedy: {generated[i]}")
    return result


def main(argv=None) -> dict:
    parser = add_model_demo_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    return run_model_demo(parser.parse_args(argv))


if __name__ == "__main__":
    main()
