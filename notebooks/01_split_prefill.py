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
# # 01 - The GDN split-prefill protocol, phase by phase
#
# One Gated DeltaNet layer (`jax_gdn.layers.gdn`) prefills a **packed batch** of N streams (T tokens stacked
# along one axis, `cu_seqlens` marks where each stream starts) through five phases. Each phase is a pure
# function: all state comes in as an argument and goes out as a return value (no hidden mutation). The block
# around the mixer (`jax_gdn.layers.block`) owns the input norm, the residual add and the FFN / MoE.
#
# ```
# hidden [T, D] --phase1_proj_batched-->  mixed_qkv [T, conv_dim], z [T, Hv, V], beta, g [T, Hv] (fp32)
#               --phase1_conv1d_varlen--> conv_out [T, conv_dim]      reads/writes slots.conv_state[slot_ids]
#               --phase1_l2_batched-->    q, k [T, Hk, K] (unit rows), v [T, Hv, V]
#               --gdn_full_varlen-->      o [T, Hv, V]                reads/writes slots.ssm_state[slot_ids]
#               --phase3-->               out_proj(norm(o) * silu(z))   [T, D]
# ```
#
# This notebook runs a small random layer through each phase, prints what each one reads and writes, checks
# the packed result against the independent monolithic path (one stream at a time), checks that a chunked
# continuation (two calls) equals one call, and plots how the recurrent state's norm evolves along a sequence.
# Everything is on CPU with the `"xla"` backend and tiny dims.

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
from jax_gdn.config import GdnDims
from jax_gdn.layers import gdn
from jax_gdn.state import BatchMeta, GdnSlots

# Qwen3-Next layout (fused in_proj_qkvz / in_proj_ba), 2 key heads shared by 4 value heads (GVA ratio 2)
dims = GdnDims(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
               conv_kernel_size=4, layout="qwen3_next")
params = gdn.init_params(dims, jax.random.PRNGKey(0), randomize_norms=True)

# every phase is a pure function of arrays, so each one jits on its own (dims and backend are static)
jit = lambda f, static=("dims",): jax.jit(f, static_argnames=static)
phase1_proj_batched = jit(gdn.phase1_proj_batched)
phase1_conv1d_varlen = jit(gdn.phase1_conv1d_varlen)
phase1_l2_batched = jit(gdn.phase1_l2_batched)
gdn_full_varlen = jax.jit(lambda *a: gdn.gdn_full_varlen(*a, backend="xla")[:2])  # (o, slots)
phase3 = jit(gdn.phase3)
gdn_layer_monolithic = jit(gdn.gdn_layer_monolithic, ("dims", "backend"))
gdn_layer_prefill = jit(gdn.gdn_layer_prefill, ("dims", "backend"))
print(dims)
print(f"conv_dim = 2 Hk K + Hv V = {dims.conv_dim}   (the [q | k | v] channels of the causal conv)")
print("\nparameters (HF names; Linear weights [in, out], y = x @ W):")
for name, x in params.items():
    print(f"  {name:16s} {str(tuple(x.shape)):10s} {x.dtype}")

# %% [markdown]
# ## The state pytrees
#
# * `GdnSlots` - the slot pools of one layer: `conv_state [S, conv_dim, Kc-1]` (the last Kc-1 pre-conv inputs of
#   each slot, activation dtype) and `ssm_state [S, Hv, K, V]` (the recurrent state, **always fp32**).
# * `BatchMeta` - one packed call: `cu_seqlens [N+1]`, `slot_ids [N]` (which slot each stream owns),
#   `has_initial_state [N]` (False: start from zeros whatever the slot holds), `positions [N]`.
#
# Below, 4 streams of 5, 70, 1 and 33 tokens go to slots 4, 0, 2, 5 of a 6-slot pool. To show slot hygiene,
# every slot starts **poisoned with NaN**: fresh streams must ignore it, and the two unused slots (1, 3) must
# come back untouched.

# %%
NUM_SLOTS = 6
lengths = [5, 70, 1, 33]
slot_ids = [4, 0, 2, 5]
meta = BatchMeta.from_lengths(lengths, slot_ids=slot_ids)        # positions 0: every stream is fresh
T = int(meta.cu_seqlens[-1])
nan_slots = GdnSlots.zeros(dims, NUM_SLOTS)
nan_slots = nan_slots.replace(conv_state=jnp.full_like(nan_slots.conv_state, jnp.nan),
                              ssm_state=jnp.full_like(nan_slots.ssm_state, jnp.nan))
hidden = jax.random.normal(jax.random.PRNGKey(1), (T, dims.hidden_size), jnp.float32)

def show(tree, title):
    print(title)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        extra = f" = {np.asarray(leaf).tolist()}" if leaf.size <= 8 else ""
        print(f"  {name:20s} {str(tuple(leaf.shape)):16s} {str(leaf.dtype):8s}{extra}")

show(nan_slots, f"GdnSlots (S = {NUM_SLOTS} slots):")
show(meta, f"BatchMeta (N = {meta.num_seqs} streams, T = {T} tokens):")


# %% [markdown]
# ## Phase 1a - in_proj and the gates (`phase1_proj_batched`)
#
# Reads only the hidden states and the parameters; batched over all T tokens (no per-stream logic, no state).
# The Qwen3-Next fused projection is de-interleaved per key head into `[q | k | v]`, `z`, `b`, `a`;
# `beta = sigmoid(b)` and the log-decay `g = -exp(A_log) * softplus(a + dt_bias)` (<= 0) are fp32.

# %%
def shapes(**arrays):
    for name, x in arrays.items():
        print(f"  {name:10s} {str(tuple(x.shape)):14s} {x.dtype}")

p1 = phase1_proj_batched(params, dims, hidden)
print("reads:");  shapes(hidden=hidden)
print("writes:"); shapes(mixed_qkv=p1.mixed_qkv, z=p1.z, beta=p1.beta, g=p1.g)
print(f"g range [{float(p1.g.min()):.3f}, {float(p1.g.max()):.3f}]  ->  per-token decay exp(g) in "
      f"[{float(jnp.exp(p1.g.min())):.3f}, {float(jnp.exp(p1.g.max())):.3f}]")

# %% [markdown]
# ## Phase 1b - causal depthwise conv + SiLU over `cu_seqlens` (`phase1_conv1d_varlen`)
#
# Each stream's conv window starts from its slot's `conv_state` (zeros for a fresh stream) and never reaches
# into the previous stream of the packed row; the last Kc-1 inputs of each stream are written back to its slot.
# (`phase1_conv1d_one` is the same for one stream and one slot.)

# %%
conv_out, slots_a = phase1_conv1d_varlen(params, dims, p1.mixed_qkv, nan_slots, meta)
print("reads:");  shapes(mixed_qkv=p1.mixed_qkv, conv_state=nan_slots.conv_state[meta.slot_ids])
print("writes:"); shapes(conv_out=conv_out, conv_state=slots_a.conv_state[meta.slot_ids])
finite = lambda x: bool(jnp.isfinite(x).all())
print("conv_out finite although every slot held NaN:", finite(conv_out))
for s in range(NUM_SLOTS):
    print(f"  slot {s}: conv_state finite = {finite(slots_a.conv_state[s])}")

# %% [markdown]
# ## Phase 1c - split and L2-normalise q, k (`phase1_l2_batched`)

# %%
q, k, v = phase1_l2_batched(dims, conv_out)
print("reads:");  shapes(conv_out=conv_out)
print("writes:"); shapes(q=q, k=k, v=v)
print("|q| per row in [%.6f, %.6f]" % tuple(float(f(jnp.linalg.norm(q, axis=-1))) for f in (jnp.min, jnp.max)))

# %% [markdown]
# ## Phase 2 - the chunked gated delta rule over the slot pool (`gdn_full_varlen`)
#
# One call of `jax_gdn.ops.chunk_gated_delta_rule_slots` for all N streams: stream n starts from
# `ssm_state[slot_ids[n]]` (zeros when `has_initial_state[n]` is False) and its final state is written back.
# Per token and value head: `S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T (q / sqrt(K))`.
# The third return value says whether the batch was eligible for the one-call varlen path (always True for
# `"xla"`); otherwise the caller falls back to `gdn_full_per_stream`. The other forms of this phase are
# `gdn_full` (one stream, one slot) and `gdn_full_batched` (N equal-length streams as one dense [N, L] call).

# %%
print("eligible for one varlen call:", gdn.varlen_eligibility(q, k, v, backend="xla"))
o, slots_b = gdn_full_varlen(q, k, v, p1.g, p1.beta, slots_a, meta)
print("reads:");  shapes(q=q, k=k, v=v, g=p1.g, beta=p1.beta, ssm_state=slots_a.ssm_state[meta.slot_ids])
print("writes:"); shapes(o=o, ssm_state=slots_b.ssm_state[meta.slot_ids])
for s in range(NUM_SLOTS):
    print(f"  slot {s}: ssm_state finite = {finite(slots_b.ssm_state[s])}")

# %% [markdown]
# ## Phase 3 - gated RMSNorm with z, then out_proj (`phase3`)
#
# Batched over tokens again. The residual add and the FFN / MoE that follow belong to the block.

# %%
out = phase3(params, dims, o, p1.z, hidden)
print("reads:");  shapes(o=o, z=p1.z, residual=hidden)
print("writes:"); shapes(hidden_out=out)

# %% [markdown]
# ## Packed split protocol vs the monolithic path
#
# `gdn_layer_monolithic` is an independent straight-line form of **one** stream (its own `lax.conv` over the
# state-prefixed input, and the non-slot op with `use_qk_l2norm=True`). Running it stream by stream must give
# the packed result; so must `gdn_layer_prefill`, the five phases chained in one `jax.jit` (the mixer as the model's block runs it).

# %%
cu = np.asarray(meta.cu_seqlens)
mono_slots = nan_slots
print(f"{'stream':>6} {'len':>4} {'slot':>4} {'max |split - mono|':>20} {'max |ssm diff|':>16}")
worst = 0.0
for i, s in enumerate(slot_ids):
    a, b = cu[i], cu[i + 1]
    out_i, mono_slots = gdn_layer_monolithic(params, dims, hidden[a:b], mono_slots, jnp.int32(s), False,
                                             backend="xla")
    err = float(jnp.max(jnp.abs(out[a:b] - out_i)))
    serr = float(jnp.max(jnp.abs(slots_b.ssm_state[s] - mono_slots.ssm_state[s])))
    worst = max(worst, err, serr)
    print(f"{i:>6} {b - a:>4} {s:>4} {err:>20.2e} {serr:>16.2e}")
print(f"max error, split vs monolithic: {worst:.2e}")

out_jit, slots_jit = gdn_layer_prefill(params, dims, hidden, nan_slots, meta, backend="xla")
print(f"max |one-jit gdn_layer_prefill - phase by phase| = {float(jnp.max(jnp.abs(out_jit - out))):.2e}")
print("unused slots 1 and 3 still NaN:", bool(jnp.isnan(slots_jit.ssm_state[jnp.array([1, 3])]).all()))

# %% [markdown]
# ## Chunked continuation: two calls == one call
#
# A long prompt can be prefilled in pieces. The second call names the same slots with
# `has_initial_state=True` (`positions > 0`), so each stream resumes from the conv and ssm states the first call
# left in its slot. Here streams 0, 1 and 3 are cut in two; stream 2 (one token) is finished after the first
# call, and a **new** stream joins the second call in the free slot 1.

# %%
first = [3, 35, 1, 18]                          # tokens of each stream in the first call (57 in all)
rest = [l - f for l, f in zip(lengths, first)]  # [2, 35, 0, 15]
h_streams = [hidden[cu[i]:cu[i + 1]] for i in range(len(lengths))]
new_stream = jax.random.normal(jax.random.PRNGKey(7), (5, dims.hidden_size))

# first call: all four streams, fresh
meta1 = BatchMeta.from_lengths(first, slot_ids=slot_ids)
h1 = jnp.concatenate([h[:f] for h, f in zip(h_streams, first)])
out1, slots1 = gdn_layer_prefill(params, dims, h1, nan_slots, meta1, backend="xla")

# second call: streams 0, 1, 3 continue (positions = tokens already seen), a new stream starts in slot 1.
# Same T (57) and N (4) as the first call, so the compiled program is reused: lengths are data, not shapes.
cont = [0, 1, 3]
meta2 = BatchMeta.from_lengths([rest[i] for i in cont] + [5], slot_ids=[slot_ids[i] for i in cont] + [1],
                               positions=[first[i] for i in cont] + [0])
show(meta2, "second call's BatchMeta:")
h2 = jnp.concatenate([h_streams[i][first[i]:] for i in cont] + [new_stream])
out2, slots2 = gdn_layer_prefill(params, dims, h2, slots1, meta2, backend="xla")

# compare with the one-shot call above (and the new stream through the monolithic path)
c1, c2 = np.cumsum([0] + first), np.cumsum([0] + [rest[i] for i in cont] + [5])
errs = []
for j, i in enumerate(cont):
    two = jnp.concatenate([out1[c1[i]:c1[i + 1]], out2[c2[j]:c2[j + 1]]])
    errs.append(float(jnp.max(jnp.abs(two - out_jit[cu[i]:cu[i + 1]]))))
    errs.append(float(jnp.max(jnp.abs(slots2.ssm_state[slot_ids[i]] - slots_jit.ssm_state[slot_ids[i]]))))
    errs.append(float(jnp.max(jnp.abs(slots2.conv_state[slot_ids[i]] - slots_jit.conv_state[slot_ids[i]]))))
alone, _ = gdn_layer_monolithic(params, dims, new_stream, nan_slots, jnp.int32(1), False, backend="xla")
errs.append(float(jnp.max(jnp.abs(out2[c2[3]:] - alone))))
print(f"max error, two calls vs one call (outputs, ssm and conv states, new stream): {max(errs):.2e}")

# %% [markdown]
# ## The recurrent state along a sequence
#
# The Frobenius norm of each value head's state `S_t [K, V]` after every token, computed with the per-token
# recurrence (a `lax.scan`, fp32) on the q, k, v, g, beta that phase 1 produces for three random sequences of
# 256 tokens. The scan's final state is checked against what `gdn_full_varlen` (chunked) wrote into the slots.

# %%
from jax import lax

def state_norms(q, k, v, g, beta):
    """Per-token recurrence of one stream; returns ||S_t||_F [T, Hv] and the final state [Hv, K, V]."""
    r = dims.head_ratio
    kh = jnp.repeat(k, r, axis=1)              # value head h reads key head h // r
    qh = jnp.repeat(q, r, axis=1) * dims.head_k_dim ** -0.5

    def step(S, x):
        q_t, k_t, v_t, g_t, b_t = x
        S = jnp.exp(g_t)[:, None, None] * S
        u = b_t[:, None] * (v_t - jnp.einsum("hkv,hk->hv", S, k_t))
        S = S + k_t[:, :, None] * u[:, None, :]
        return S, jnp.sqrt(jnp.sum(S * S, axis=(1, 2)))

    S0 = jnp.zeros((dims.num_v_heads, dims.head_k_dim, dims.head_v_dim), jnp.float32)
    final, norms = lax.scan(step, S0, (qh, kh, v, g, beta))
    return norms, final

@jax.jit
def phases_1_2(hidden, slots, meta):
    p1 = gdn.phase1_proj_batched(params, dims, hidden)
    conv_out, slots = gdn.phase1_conv1d_varlen(params, dims, p1.mixed_qkv, slots, meta)
    q, k, v = gdn.phase1_l2_batched(dims, conv_out)
    _, slots, _ = gdn.gdn_full_varlen(q, k, v, p1.g, p1.beta, slots, meta, backend="xla")
    return (q, k, v, p1.g, p1.beta), slots

L, NSEQ = 256, 3
hid = jax.random.normal(jax.random.PRNGKey(11), (NSEQ * L, dims.hidden_size))
(q3, k3, v3, g3, beta3), slots3 = phases_1_2(hid, GdnSlots.zeros(dims, NSEQ), BatchMeta.from_lengths([L] * NSEQ))

scan = jax.jit(state_norms)
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
err = 0.0
for n in range(NSEQ):
    sl = slice(n * L, (n + 1) * L)
    norms, final = scan(q3[sl], k3[sl], v3[sl], g3[sl], beta3[sl])
    err = max(err, float(jnp.max(jnp.abs(final - slots3.ssm_state[n]))))
    axes[0].plot(np.asarray(jnp.sqrt(jnp.sum(norms ** 2, axis=1))), label=f"sequence {n}")
    if n == 0:
        mean_decay = np.asarray(jnp.exp(g3[sl]).mean(0))
        for h in range(dims.num_v_heads):
            axes[1].plot(np.asarray(norms[:, h]), label=f"head {h}: mean exp(g) = {mean_decay[h]:.3f}")
print(f"max |scan final state - chunked slot state| = {err:.2e}")
# the same sequence 0 with its log-decay g scaled down (0: no forgetting, the pure delta rule)
sl = slice(0, L)
for c in (1.0, 0.1, 0.01, 0.0):
    norms, _ = scan(q3[sl], k3[sl], v3[sl], c * g3[sl], beta3[sl])
    axes[2].plot(np.asarray(jnp.sqrt(jnp.sum(norms ** 2, axis=1))), label=f"g x {c:g}")
axes[0].set(title="||S_t||_F over all value heads", xlabel="token", ylabel="Frobenius norm")
axes[1].set(title="sequence 0, per value head", xlabel="token", ylabel="||S_t||_F")
axes[2].set(title="sequence 0, log-decay g scaled", xlabel="token", ylabel="||S_t||_F, all heads")
for ax in axes:
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# With the layer's own decay (per-token `exp(g)` of about 0.8-0.9 for this random init, a memory of ~10 tokens)
# the norm reaches its level within a few tokens and then fluctuates with the input. Scaling the decay down
# (right) shows the other bound: each delta-rule update only rewrites the state along the unit key `k_t`
# (the value read back there becomes `beta v_t + (1 - beta) S^T k_t`), so even with no forgetting at all
# (`g x 0`) the norm saturates instead of growing without limit; it just takes longer and settles higher.
# The state is neither tiny nor huge, but it is a long running sum of small corrections, which is why it
# is kept in fp32 (see 02_numerics).

# %%
print(f"notebook ran in {time.perf_counter() - NOTEBOOK_T0:.1f} s")
