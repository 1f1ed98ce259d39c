"""Section "train" (results key "train"): one optimiser step of a ~1B-parameter hybrid on packed documents.

Model (``train_config``): Qwen3-Next's layer plan and GDN / attention dims (hidden 2048; GDN 16 key / 32 value
heads x 128; attention 16 q / 2 kv heads x 256) at 8 layers (6 GDN + 2 attention), each with a dense SwiGLU FFN of
5632 instead of the MoE, vocab 151936, untied head: ``params`` in the JSON (1.156B; 0.845B without the embedding,
the 0.311B head included). Random bf16 weights, backend "auto"; ``jax_gdn.train.Trainer`` with optax AdamW (lr 1e-4),
fp32 master weights, global-norm clip 1.0.
Batch: ``tokens`` = 4096 tokens of ``docs`` = 8 packed documents (random lengths summing to 4096, random ids),
the same batch every step.
Columns: "ours" (``RuntimeOptions(remat="none")``) and "ours_remat" (``remat="layers"``: each layer recomputed in
the backward, the GDN and attention cores' outputs saved). Per column: ms per step (``jax_gdn.timing.time_threaded``:
the train state donated and fed back), tokens/s, MFU = 6 x (params without the embedding) x tokens / time / the
H200's 989 TFLOP/s bf16 dense peak (attention scores not counted: the documents are short), peak MiB (XLA's
buffer assignment of the compiled step: arguments + outputs + temporaries - aliased), and the first step's loss.
FLA's model of the same config (``fla.models``, FlashQLA on) is the peer the issue names: not run yet.

--quick: the tiny preset at 2 layers on the CPU, 128 tokens of 4 documents (a smoke run, not a measurement).
"""
from __future__ import annotations

import numpy as np

KEY = "train"
IMPLS = ("ours", "ours_remat")
FULL = dict(layers=8, intermediate=5632, tokens=4096, docs=8)
QUICK = dict(layers=2, intermediate=None, tokens=128, docs=4)


def train_config(quick: bool = False):
    """The section's HybridConfig (module docstring)."""
    from jax_gdn.config import preset
    w = QUICK if quick else FULL
    if quick:
        return preset("tiny", num_hidden_layers=w["layers"], layer_types=("linear_attention", "full_attention"),
                      mlp_only_layers=tuple(range(w["layers"])))
    return preset("qwen3_next_80b", num_hidden_layers=w["layers"], mlp_only_layers=tuple(range(w["layers"])),
                  intermediate_size=w["intermediate"], tie_word_embeddings=False)


def _batch(vocab: int, tokens: int, docs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, tokens), docs - 1, replace=False))
    cu = np.concatenate([[0], cuts, [tokens]]).astype(np.int32)
    return rng.integers(0, vocab, tokens).astype(np.int32), cu


def _count(params) -> int:
    import jax
    return int(sum(x.size for x in jax.tree.leaves(params)))


def run_section(quick: bool = False, impls=IMPLS, seed: int = 0) -> dict:
    """{"config", "params", "params_no_embedding", "tokens", "docs", "rows": [{"impl", "ms", "tokens_per_s",
    "mfu", "peak_mb", "loss", "kernels_ms", "top_kernels_ms", "top_kernel_calls"}]}."""
    import jax
    import jax.numpy as jnp
    import optax
    from benchmarks.backward import compiled_peak_mb
    from benchmarks.configs import random_device_model
    from benchmarks.profile import kernel_time
    from benchmarks.tables import HW_PEAK_TFLOPS
    from jax_gdn.model import HybridModel
    from jax_gdn.options import RuntimeOptions
    from jax_gdn.timing import jax_sync, time_threaded
    from jax_gdn.train import Trainer
    w = QUICK if quick else FULL
    cfg = train_config(quick)
    gpu = any(d.platform == "gpu" for d in jax.devices())
    tokens, cu = _batch(cfg.vocab_size, w["tokens"], w["docs"], seed)
    value = {"config": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                        "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size},
             "tokens": w["tokens"], "docs": w["docs"], "rows": [],
             "note": "CPU smoke run, not a measurement" if quick or not gpu else "bf16, fp32 master weights"}
    base = (HybridModel.random(cfg, seed, dtype=jnp.float32, backend="xla") if quick
            else random_device_model(cfg, jnp.bfloat16, "auto", seed))              # one set of weights for all
    value["params"] = _count(base.params)
    value["params_no_embedding"] = value["params"] - int(base.params["embed"].size)
    for impl in impls:
        options = RuntimeOptions(remat="layers" if impl == "ours_remat" else "none")
        model = HybridModel(cfg, base.params, dtype=base.dtype, backend=base.backend, options=options)
        trainer = Trainer(model, optax.adamw(1e-4), max_tokens=w["tokens"], max_docs=w["docs"])
        state = trainer.init()
        args = (state, trainer.cache, jnp.asarray(tokens), jnp.asarray(cu))
        peak = compiled_peak_mb(trainer._step, args)
        state, metrics = trainer.step(state, tokens, cu)
        loss = float(metrics["loss"])
        kinds = top = calls = None
        if gpu and not quick:                        # one step traced: where its GPU time goes
            box = [state]

            def traced():
                box[0] = trainer.step(box[0], tokens, cu)[0]
                return box[0]
            _, kinds, top, calls = kernel_time(traced, jax_sync, top=12)
            state = box[0]
        timing = dict(warmup=1, groups=2, per_group=1) if quick or not gpu else {}
        ms = time_threaded(lambda st: trainer.step(st, tokens, cu)[0], state, **timing)
        tps = w["tokens"] / (ms / 1e3)
        flops = 6.0 * value["params_no_embedding"] * w["tokens"]
        value["rows"].append({"impl": impl, "ms": round(ms, 3), "tokens_per_s": round(tps, 1),
                              "mfu": round(flops / (ms / 1e3) / (HW_PEAK_TFLOPS * 1e12), 4) if gpu else None,
                              "peak_mb": round(peak, 1), "loss": round(loss, 4),
                              "kernels_ms": kinds, "top_kernels_ms": top, "top_kernel_calls": calls})
        print(f"train {impl}: {ms:.2f} ms/step, {tps:.0f} tokens/s, peak {peak:.0f} MiB, loss {loss:.3f}",
              flush=True)
        del trainer, state, model
    return value


def print_section(value: dict) -> None:
    c = value["config"]
    print(f"train: one optimiser step, {value['tokens']} tokens in {value['docs']} documents; {c['layers']} layers, "
          f"hidden {c['hidden']}, FFN {c['intermediate']}, {value.get('params', 0) / 1e9:.2f}B params "
          f"({value.get('params_no_embedding', 0) / 1e9:.2f}B without the embedding); {value['note']}")
    print(f"{'impl':>12} {'ms/step':>9} {'tokens/s':>10} {'MFU':>7} {'peak MiB':>9} {'loss':>7}")
    for r in value["rows"]:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"{r['impl']:>12} {r['ms']:>9.2f} {r['tokens_per_s']:>10.0f} {mfu:>7} {r['peak_mb']:>9.0f} "
              f"{r['loss']:>7.3f}")
    for r in value["rows"]:
        if r.get("kernels_ms"):
            print(f"  {r['impl']} GPU ms by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_ms"].items()))
            calls = r.get("top_kernel_calls") or {}
            print(f"  {r['impl']} costliest kernels (ms, launches): " + "; ".join(
                f"{k} {v:.1f} x{calls.get(k, '?')}" for k, v in r["top_kernels_ms"].items()))


def markdown(value: dict) -> list:
    from benchmarks.tables import md_header
    lines = md_header(["impl", "ms / step", "tokens/s", "MFU", "peak MiB"])
    for r in value["rows"]:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {r['impl']} | {r['ms']} | {r['tokens_per_s']:.0f} | {mfu} | {r['peak_mb']:.0f} |")
    return lines
