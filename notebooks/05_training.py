# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 - Training a byte-level hybrid on the Python standard library
#
# A small hybrid (1 Gated DeltaNet layer + 1 gated attention layer, dense MLPs, 256 byte values as its vocabulary)
# is trained from random weights on text no one here wrote and every machine has: the source files and docstrings
# of this Python's standard library. Each training document is a window of one file; documents are packed back to
# back with `cu_seqlens`, so the GDN state and the attention context restart at every boundary.
#
# The training step is the model's own prefill step (the serving kernels; on a CPU the XLA forms) under
# `jax.value_and_grad`, with fp32 master weights, gradient clipping and AdamW (`jax_gdn.train.Trainer`):
#
# ```python
# trainer = Trainer(model, optax.adamw(schedule), max_tokens=T, max_docs=N)   # clip_norm=1.0
# state = trainer.init()
# tokens, cu_seqlens = pack_documents(docs, max_tokens=T, max_docs=N)       # docs: lists of token ids
# state, metrics = trainer.step(state, tokens, cu_seqlens)                   # {"loss", "grad_norm", "tokens"}
# ```
#
# Shape legend: T tokens of a packed batch, N documents per batch, L bytes per document window.

# %%
import time
NOTEBOOK_T0 = time.perf_counter()

import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import matplotlib.pyplot as plt
from tqdm import tqdm
# %matplotlib inline
plt.rcParams.update({"figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3})

from jax_gdn import HybridModel, preset
from jax_gdn.train import Trainer, next_token_loss, pack_documents
print("jax", jax.__version__, "on", jax.devices(), "| Python", sys.version.split()[0])

# %% [markdown]
# ## The corpus: this Python's standard library
#
# The top-level `.py` files of the standard library, as bytes. The last five files (in name order) are held out
# for evaluation. The unigram entropy of the training bytes (the loss of a model that ignores context) is the
# reference line of the plots.

# %%
root = pathlib.Path(os.__file__).parent
files = sorted(root.glob("*.py"))
texts = [p.read_bytes() for p in files]
train_texts, held_texts = texts[:-5], texts[-5:]
print(f"{len(files)} files under {root}, {sum(map(len, texts)) / 1e6:.2f} MB; held out: "
      f"{', '.join(p.name for p in files[-5:])}")
counts = np.bincount(np.frombuffer(b"".join(train_texts), np.uint8), minlength=256).astype(np.float64)
p_byte = counts / counts.sum()
unigram_bits = float(-(p_byte[p_byte > 0] * np.log2(p_byte[p_byte > 0])).sum())
print(f"unigram entropy of the training bytes: {unigram_bits:.2f} bits per byte")

T, N, L = 512, 4, 128            # tokens per batch, documents per batch, bytes per document window
rng = np.random.default_rng(0)


def windows(src, n, length, rng):
    """n windows of `length` bytes, each from a random file of `src` at a random offset."""
    out = []
    for _ in range(n):
        f = src[rng.integers(len(src))]
        start = rng.integers(0, max(1, len(f) - length))
        out.append(list(f[start:start + length]))
    return out


# %% [markdown]
# ## The model
#
# The `tiny` preset with a 256-byte vocabulary, hidden size 96 and two layers: a GDN layer (2 key / 4 value heads
# of 32) and a gated attention layer (4 query / 2 kv heads of 64), each followed by a dense SwiGLU MLP. fp32.

# %%
config = preset("tiny", vocab_size=256, hidden_size=96, num_hidden_layers=2,
                layer_types=("linear_attention", "full_attention"), mlp_only_layers=(0, 1), intermediate_size=256)
model = HybridModel.random(config, jax.random.key(0), dtype=jnp.float32)
print(model)
print(f"{sum(x.size for x in jax.tree.leaves(model.params)):,} parameters")

# %% [markdown]
# ## Training
#
# 200 steps of 4 documents of 128 bytes (512 tokens), AdamW with a warm-up and cosine decay. The first step
# compiles the program; every later one reuses it (one shape). Every 50 steps the held-out loss is measured on
# 4 fixed batches of held-out windows.

# %%
STEPS = int(os.environ.get("JAX_GDN_TRAIN_STEPS", 200))   # the CI run of this notebook takes fewer
schedule = optax.warmup_cosine_decay_schedule(0.0, 4e-3, 20, STEPS, 4e-4)
trainer = Trainer(model, optax.adamw(schedule, weight_decay=0.01), max_tokens=T, max_docs=N)
state = trainer.init()

eval_rng = np.random.default_rng(1)
held_batches = [pack_documents(windows(held_texts, N, L, eval_rng), max_tokens=T, max_docs=N) for _ in range(4)]
eval_loss = jax.jit(lambda p, c, x, cu: next_token_loss(p, c, x, cu, step_fn=model.step_fn(return_all_logits=True)))


def held_out_bits(state):
    params = trainer.compute_params(state)
    losses = [float(eval_loss(params, trainer.cache, jnp.asarray(x), jnp.asarray(cu))[0]) for x, cu in held_batches]
    return float(np.mean(losses)) / np.log(2)


train_bits, held = [], [(0, held_out_bits(state))]
t0 = time.perf_counter()
for step in tqdm(range(STEPS), desc="training", mininterval=10, ncols=80, file=sys.stdout):
    tokens, cu_seqlens = pack_documents(windows(train_texts, N, L, rng), max_tokens=T, max_docs=N)
    state, metrics = trainer.step(state, tokens, cu_seqlens)
    train_bits.append(float(metrics["loss"]) / np.log(2))
    if step == 0:
        first_step_s = time.perf_counter() - t0
    if (step + 1) % 50 == 0:
        held.append((step + 1, held_out_bits(state)))
train_s = time.perf_counter() - t0
print(f"first step (compile) {first_step_s:.1f} s; {STEPS - 1} more in {train_s - first_step_s:.1f} s "
      f"({(STEPS - 1) * T / (train_s - first_step_s):,.0f} tokens/s on this CPU)")
print(f"held-out loss: {held[0][1]:.2f} -> {held[-1][1]:.2f} bits per byte (unigram {unigram_bits:.2f})")

# %%
fig, ax = plt.subplots(figsize=(8, 4))
smooth = np.convolve(train_bits, np.ones(10) / 10, mode="valid")
ax.plot(np.arange(1, STEPS + 1), train_bits, color="C0", alpha=0.25, lw=0.8)
ax.plot(np.arange(10, STEPS + 1), smooth, color="C0", label="training batches (10-step mean)")
ax.plot(*zip(*held), "o-", color="C1", label="held-out files")
ax.axhline(unigram_bits, color="k", ls="--", lw=0.8, label="unigram entropy")
ax.set(xlabel="optimiser step", ylabel="bits per byte", ylim=(0, 8.5),
       title="byte-level GDN + attention hybrid on the Python standard library")
ax.legend()
plt.show()

# %% [markdown]
# ## Samples
#
# The trained weights (in the model's dtypes) go back into a `HybridModel`, which prefills a prompt and decodes
# bytes one at a time through the serving path, sampling at temperature 0.7.

# %%
trained = HybridModel(config, trainer.compute_params(state), dtype=jnp.float32)
sample_rng = np.random.default_rng(2)


def sample(prompt: bytes, n: int = 160, temperature: float = 0.7) -> bytes:
    cache = trained.init_cache(max_seqs=1, max_tokens=len(prompt) + n + 16, page_size=16)
    ids = np.frombuffer(prompt, np.uint8).astype(np.int32)
    logits, cache = trained.prefill(cache, ids, np.array([0, len(ids)], np.int32), np.array([0], np.int32))
    out = []
    for _ in range(n):
        z = np.asarray(logits[0], np.float64) / temperature
        p = np.exp(z - z.max())
        nxt = int(sample_rng.choice(256, p=p / p.sum()))
        out.append(nxt)
        logits, cache = trained.decode(cache, np.array([nxt], np.int32), np.array([0], np.int32))
    return prompt + bytes(out)


for prompt in (b"def ", b"    \"\"\"Return the ", b"import "):
    print(sample(prompt).decode("utf-8", errors="replace"))
    print("-" * 60)

# %% [markdown]
# ## On the GPU
#
# The same `Trainer` runs the model's default kernels on a GPU: on Hopper the GDN op's forward and backward are
# Mosaic GPU kernels (`pallas_kernels/gated_delta_rule/mosaic_gpu/backward.py`), dense rows and packed documents
# alike. Measured on one H200 (bf16 q, k, v; loss sum(o do) + sum(ht dht), gradients of q, k, v, g, beta, h0;
# `python -m benchmarks backward`, `benchmarks/results/h200.json`; ours and jla at 54a3c37, FlashQLA at 33a0028),
# ms:
#
# | GDN op | forward | forward + backward | forward + the XLA VJP | jax-linear-attention 0.1 | FlashQLA 0.1.3 |
# |---|---|---|---|---|---|
# | B1-T8192-Hk16-Hv32 | 0.249 | 0.894 | 15.71 | 0.892 | 2.103 |
# | B1-T8192-Hk2-Hv8 | 0.122 | 0.544 | 7.68 | 0.390 | - |
# | varlen16-T19027 (16 packed documents) | 0.672 | 2.187 | 48.53 | takes no cu_seqlens | 2.120 |
#
# The other kernels (the fused conv1d, paged attention, the MoE) run their forward and take the VJP of their XLA
# form (`pallas_kernels.autodiff.reference_vjp`); attention on cuDNN differentiates its own fused call when no
# stream has context (every training batch); the projections and norms are XLA throughout.
#
# One whole optimiser step (`python -m benchmarks train`, code of d311ca9: a 1.16B hybrid at Qwen3-Next's dims,
# 8 layers with a dense 5632 FFN, 4096 tokens in 8 documents, bf16 with fp32 master weights, AdamW):
#
# | column | ms / step | tokens/s | MFU | peak GiB |
# |---|---|---|---|---|
# | ours | 80.4 | 50.9k | 26.1% | 32.4 |
# | ours, remat="layers" | 75.4 | 54.4k | 27.9% | 24.8 |

# %%
print(f"notebook ran in {time.perf_counter() - NOTEBOOK_T0:.1f} s")
