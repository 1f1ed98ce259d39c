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
# # 04 - From a Hugging Face checkpoint to packed prefill + greedy decode
#
# A tiny random **Qwen3-Next** (3 Gated DeltaNet layers + 1 gated attention layer, sparse MoE with a shared
# expert, one dense-MLP layer) is built with `transformers`, saved with `save_pretrained`, and loaded back with
# `jax_gdn.load_pretrained`. A packed batch of four prompts is prefilled in one call, then decoded greedily,
# and every logit is compared with `transformers`' own forward over each stream's full history
# (CPU, fp32, eager attention, the torch fallback of the GDN kernels).
#
# ```python
# model = jax_gdn.load_pretrained(path, dtype=jnp.float32)
# cache = model.init_cache(max_seqs=8, max_tokens=1024, page_size=16)
# logits, cache = model.prefill(cache, input_ids, cu_seqlens, slot_ids)   # N streams packed in input_ids [T]
# logits, cache = model.decode(cache, next_ids, slot_ids)                 # one token per stream
# ```

# %%
import time
NOTEBOOK_T0 = time.perf_counter()

import jax
import jax.numpy as jnp
import numpy as np
import matplotlib.pyplot as plt
# %matplotlib inline
plt.rcParams.update({"figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3})
print("jax", jax.__version__, "on", jax.devices())

# %%
import tempfile, os, warnings
warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's note when ipywidgets is absent
import torch
import transformers
transformers.logging.set_verbosity_error()      # no fast-path / initialisation chatter in the outputs
transformers.logging.disable_progress_bar()     # and no progress-bar widget saved with the outputs
import jax_gdn
print("torch", torch.__version__, "| transformers", transformers.__version__)

config = transformers.Qwen3NextConfig(
    vocab_size=128, hidden_size=32, num_hidden_layers=4, intermediate_size=40,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20,
    mlp_only_layers=[1])
config._attn_implementation = "eager"
print("layer types:", config.layer_types)
torch.manual_seed(0)
hf = transformers.Qwen3NextForCausalLM(config).eval()

# HF initialises norms to zeros / ones and A_log, dt_bias to fixed patterns, which would hide convention bugs:
# randomise every parameter (zero-centred norms stay small, the GDN output norm stays near one).
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in hf.named_parameters():
        r = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=gen)))
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * r)
        elif "linear_attn.norm" in name:
            p.copy_(1.0 + 0.2 * r)
        elif "norm" in name:
            p.copy_(0.2 * r)
        elif "embed_tokens" in name:
            p.copy_(0.5 * r)
        else:
            p.copy_(0.15 * r)
print(f"{sum(p.numel() for p in hf.parameters()):,} parameters")

# %% [markdown]
# ## Save with transformers, load with jax_gdn
#
# `load_pretrained` reads `config.json` and the safetensors file(s), checks every tensor's name and shape
# against the config, and returns a `HybridModel` (here in fp32 with the `"xla"` backend, to compare at fp32
# precision on CPU; on a GPU the default `backend="auto"` runs the Pallas kernel). Every Linear weight is
# transposed once to `[in, out]`; the fused Qwen3-Next projections stay fused (phase 1 splits them per key head).

# %%
ckpt = tempfile.mkdtemp(prefix="tiny-qwen3-next-")
hf.save_pretrained(ckpt)
for f in sorted(os.listdir(ckpt)):
    print(f"  {f:28s} {os.path.getsize(os.path.join(ckpt, f)):>9,} bytes")

model = jax_gdn.load_pretrained(ckpt, dtype=jnp.float32, backend="xla")
print(model)


# %% [markdown]
# ## Packed prefill
#
# Four prompts of 3, 17, 40 and 9 tokens, packed into one `input_ids [69]` row with `cu_seqlens`, in permuted
# cache slots. `return_all_logits=True` returns the logits of every prompt token (`[T, vocab]`), so the whole
# prompt can be checked, not only each stream's last token.

# %%
def hf_logits(ids):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids, np.int64))[None]).logits[0].float().numpy()

def rel_err(ours, ref):                       # max |ours - ref| / max |ref|, per row
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(ours - ref), axis=-1) / np.max(np.abs(ref))

rng = np.random.default_rng(0)
lens, slots = [3, 17, 40, 9], np.array([2, 0, 3, 1], np.int32)
prompts = [list(rng.integers(0, config.vocab_size, n)) for n in lens]
cu = np.cumsum([0] + lens).astype(np.int32)
cache = model.init_cache(max_seqs=4, max_tokens=256, page_size=16)

t0 = time.perf_counter()
all_logits, cache = model.prefill(cache, np.concatenate(prompts).astype(np.int32), cu, slots,
                                  return_all_logits=True)
all_logits = np.asarray(all_logits)
print(f"prefill of {cu[-1]} tokens in {len(lens)} streams: logits {all_logits.shape}, "
      f"{time.perf_counter() - t0:.1f} s (including compilation)")

prefill_err = []
for i, p in enumerate(prompts):
    e = rel_err(all_logits[cu[i]:cu[i + 1]], hf_logits(p))
    prefill_err.append(e)
    print(f"  stream {i} (slot {slots[i]}, {lens[i]:2d} tokens): max relative error {e.max():.1e}")

# %% [markdown]
# ## Greedy decode
#
# Each step feeds every stream's argmax token back (one token per stream, one call for all four). The logits
# of every step are then compared with transformers' forward over the stream's whole history (prompt +
# generated tokens), and each greedy choice with transformers' argmax at the same position.

# %%
STEPS = 6
histories = [list(p) for p in prompts]
logits = all_logits[cu[1:] - 1]                 # each stream's last prompt token
steps = []
t0 = time.perf_counter()
for step in range(STEPS):
    nxt = logits.argmax(-1).astype(np.int32)
    for i in range(len(lens)):
        histories[i].append(int(nxt[i]))
    logits, cache = model.decode(cache, nxt, slots)
    logits = np.asarray(logits)
    steps.append(logits)
ours = np.stack(steps, axis=1)                  # [N, STEPS, vocab]
print(f"{STEPS} decode steps x {len(lens)} streams: {time.perf_counter() - t0:.1f} s (including compilation)")

# one transformers forward per stream over prompt + generated tokens gives the reference of every step:
# row lens[i] + s holds the logits after generated token s (what decode step s returned)
decode_err = np.zeros((STEPS, len(lens)))
hf_full, agree = [], 0
for i, h in enumerate(histories):
    ref = hf_logits(h)
    hf_full.append(ref)
    decode_err[:, i] = rel_err(ours[i], ref[lens[i]:])
    agree += int((ref[lens[i] - 1:lens[i] - 1 + STEPS].argmax(-1) == np.array(h[lens[i]:])).sum())
for i, h in enumerate(histories):
    print(f"  stream {i} generated {h[lens[i]:]}")
print(f"greedy next token identical to transformers in {agree} / {STEPS * len(lens)} checks")
print("cache.slot_lens:", np.asarray(cache.slot_lens).tolist(), "(slot order)")
worst = max(max(e.max() for e in prefill_err), decode_err.max())
print(f"max relative error vs transformers over prefill + decode: {worst:.1e}")

# %% [markdown]
# ## The errors, token by token

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 4))
for i, e in enumerate(prefill_err):
    x = np.arange(len(e))
    axes[0].plot(x, e, marker=".", color=f"C{i}", label=f"stream {i} ({lens[i]} tokens)")
    axes[0].plot(lens[i] + np.arange(STEPS), decode_err[:, i], marker="x", ls="--", color=f"C{i}")
axes[0].set(yscale="log", xlabel="position in the stream (dots: prefill, crosses: decode)",
            ylabel="max |ours - HF| / max |HF|", title="logits vs transformers, per token")
axes[0].legend(fontsize=8)

axes[1].bar(np.arange(len(lens)) - 0.2, [e.max() for e in prefill_err], 0.4, label="prefill (all tokens)")
axes[1].bar(np.arange(len(lens)) + 0.2, decode_err.max(0), 0.4, label=f"decode ({STEPS} steps)")
axes[1].set_xticks(range(len(lens)), [f"stream {i}" for i in range(len(lens))])
axes[1].set(yscale="log", ylabel="max relative error", title="per stream")
axes[1].legend(fontsize=8)

ref = hf_full[2][-1]
axes[2].scatter(ref, ours[2, -1], s=8)
lim = [ref.min(), ref.max()]
axes[2].plot(lim, lim, "k", lw=0.8)
axes[2].set(xlabel="transformers logit", ylabel="jax_gdn logit", title="stream 2, last decode step")
fig.tight_layout()
plt.show()

# %% [markdown]
# The JAX model matches transformers to fp32 rounding (relative errors of 1e-6 to 1e-5) over the packed
# prefill of every prompt token and every decode step, and the greedy continuations are identical. The same
# loader reads Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe` with the multimodal layout) and sharded checkpoints;
# those are covered by `tests/model/test_hf_parity.py`.

# %%
import shutil
shutil.rmtree(ckpt, ignore_errors=True)
print(f"notebook ran in {time.perf_counter() - NOTEBOOK_T0:.1f} s")
