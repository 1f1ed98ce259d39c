"""HybridModel: a Qwen3-Next / Qwen3.5 decoder (GDN + gated attention blocks) over one cache pytree.

Shape legend: T stacked tokens of all streams in one call, N streams in the call, S slots (max_seqs), D hidden
size, Vocab vocabulary, P KV pages in the pool, Ps tokens per page, W pages per slot (ceil(max_seq_len / Ps)),
Lg / La GDN / attention layers, R repeats of the layer pattern, Tb / Nb the bucketed T / N.

    model = load_pretrained(path, dtype=jnp.bfloat16)            # or HybridModel(config, params), HybridModel.random
    cache = model.init_cache(max_seqs=8, max_tokens=4096, page_size=16, max_seq_len=None)
    logits, cache = model.prefill(cache, input_ids, cu_seqlens, slot_ids, return_all_logits=False)
    logits, cache = model.decode(cache, input_ids, slot_ids)
    cache = model.release(cache, slot_ids)
    model.check(cache)                                            # raises OutOfKvPagesError if a step was refused

- prefill: input_ids int [T] (the stacked tokens of N streams), cu_seqlens int [N + 1] (stream n owns tokens
  cu_seqlens[n]:cu_seqlens[n+1], every stream at least one token), slot_ids int [N] (distinct, in [0, S)).
  Returns the last token's logits of each stream [N, Vocab] fp32 (or every token's [T, Vocab] with
  return_all_logits=True). A slot holding no tokens starts fresh (its stale GDN state and pages are ignored); a
  slot holding tokens continues (chunked prefill): positions, conv / recurrent state and KV pages carry on.
- decode: one token per stream, input_ids [N], slot_ids [N]; returns [N, Vocab] fp32.
- release: empties the slots and returns their pages to the pool.

Check once, then no host sync: the public methods check their inputs on the host (shapes, dtypes, ranges, the
cache against the model: every leaf's shape and dtype) and raise ValueError before any state is touched. Then
the call is padded to shape buckets (T up to ``token_buckets``: 16, 32, ..., 1024, then multiples of 1024;
N up to a power of two, at most max_seqs; padding tokens sit past cu_seqlens[N], padding streams have zero length
and slot id S) and runs as ONE compiled program per (bucket, kind): page allocation and every layer run on the
device, nothing is read back. ``compiled_programs()`` counts the programs compiled so far.

Running out of KV pages (or a slot growing past max_seq_len, exactly: a slot holds at most max_seq_len tokens) is
found on the device: that step writes nothing, returns zero logits and records the reason in ``cache.status`` (1:
out of pages, 2: past max_seq_len). The status is sticky: every later step is refused the same way (so no stream
runs ahead of a lost step) until the user calls ``model.check(cache)``, which reads the status (one small
device-to-host copy) and raises :class:`OutOfKvPagesError` carrying the cache with its status cleared (release
slots, then carry on). ``HybridModel(..., strict=True)`` decides every prefill / decode on the host before running
it (a sync per step): a step that would be refused raises OutOfKvPagesError without running, so the cache passed
in stays live and unchanged (``err.cache`` is the same cache, status cleared).

prefill / decode / release are jit-compiled pure functions of the cache, which is donated (updated in place): use
the returned cache, never the one passed in. They check their inputs on the host and pick a compiled program, so
they cannot be traced (``jax.jit(model.prefill)`` raises a TypeError saying so); ``model.step_fn()`` is the pure
step function for a jit of one's own.

Layers: identical blocks are stacked and run by ``lax.scan`` over the repeating period of ``layer_types`` (3 GDN
+ 1 attention for Qwen3-Next; see ``layer_plan``), a leftover tail unrolled; compile time does not grow with
depth (decode unrolls the scan by 2: ``RuntimeOptions.scan_unroll_decode``). Cache leaves are stacked the same way
(``Cache.gdn`` leaves [Lg, S, ...], ``Cache.kv`` leaves [La, P, ...]) and each layer reads and writes them in place
through offset slot / page ids (see ``_layers``).

backend: "auto" (default), "xla", "pallas", "mosaic_gpu", "pallas_interpret" or "mosaic_gpu_interpret" names the
gated delta rule's backend (attention and MoE take "xla" / "pallas_interpret" too, "auto" for the others); or a
dict {"gated_delta_rule" | "paged_attention" | "moe": name}. Each op's dispatch table
(``pallas_kernels.registry``) is resolved once here for this model's dims, dtype and platform, per call kind:
``model.kernels`` {op: {call kind: implementation}}, shown in repr; an explicit name that cannot run is refused
with the table's reason. The layers pass the names (``model.backends``) to the ops, whose tables make the same
pick per call ("auto": Mosaic GPU on a Hopper GPU where it takes the call, Triton elsewhere on a GPU, XLA on CPU).

Parameters (the model's layout; every Linear weight [in, out]):
    embed [Vocab, D]; final_norm [D]; lm_head [D, Vocab] (absent when tied: embed.T is used);
    period: tuple of p block dicts (jax_gdn.layers.block), each leaf stacked [R, ...] over the repeats;
    tail:   tuple of block dicts of the layers after the R full periods.
``HybridModel`` also accepts {"embed", "final_norm", "lm_head"?, "layers": [block dict per layer]} (what
jax_gdn.checkpoint builds) and stacks it once.

options: a ``jax_gdn.options.RuntimeOptions`` (implementation choices of the layers and the runtime, same math;
held as ``model.options`` and passed down to every block as a static value).

Several devices: ``HybridModel(config, params, mesh=jax.make_mesh((2,), ("model",)))`` (or ``load_pretrained(...,
mesh=)``, ``init_params(..., mesh=)``) splits heads, expert columns and the vocabulary over a one-axis mesh by the
rules of ``jax_gdn.sharding``: params and cache are placed with NamedSharding and each step runs per device in
``jax.shard_map`` (kernels included) with one psum per row-parallel projection; logits come back split over the
vocabulary. mesh=None (default): one device, unchanged. ``moe_sharding``: "expert" splits the routed experts
whole over the mesh (expert parallel, ``jax_gdn.layers.moe_ep``), "tensor" splits their columns, "auto" (default)
takes "expert" where the mesh divides the experts (``jax_gdn.sharding.resolve_moe_sharding``: measured faster on
two H200s); params already placed on the mesh must have been placed with the same moe_sharding (one-device
params: any).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_gdn.config import HybridConfig
from jax_gdn.layers import block as blk
from jax_gdn.layers import gdn as gdn_layer
from jax_gdn.layers import attention as _attn
from jax_gdn.layers.attention import attention_param_shapes
from jax_gdn.ops import validation
from jax_gdn.ops.norms import rms_norm
from jax_gdn.ops.varlen import count_le, token_streams
from jax_gdn.options import CORE_NAMES, DEFAULT_OPTIONS, RuntimeOptions
from jax_gdn.state import BatchMeta, Cache, GdnSlots, KvPages

__all__ = ["HybridModel", "OutOfKvPagesError", "RuntimeOptions", "LayerPlan", "layer_plan", "init_params",
           "stack_layers", "step", "release_slots", "fork_slots", "default_token_buckets", "STATUS_OK", "STATUS_OUT_OF_PAGES",
           "STATUS_PAST_MAX_SEQ_LEN"]

try:
    from jax.core import Tracer as _Tracer
except ImportError:  # pragma: no cover - a jax without the public alias
    from jax._src.core import Tracer as _Tracer

STATUS_OK, STATUS_OUT_OF_PAGES, STATUS_PAST_MAX_SEQ_LEN = 0, 1, 2


def _shd():
    """jax_gdn.sharding, imported when a mesh is used (one device needs none of it)."""
    from jax_gdn import sharding
    return sharding


class OutOfKvPagesError(RuntimeError):
    """A step was refused: the KV page pool could not hold its new tokens, or a slot would pass max_seq_len.
    Nothing was written by that step (nor by later refused ones); ``.cache`` is the cache to keep using (status
    cleared)."""

    def __init__(self, message: str, cache: Cache):
        super().__init__(message)
        self.cache = cache


# ================================================================================================================
# The layer plan: the repeating period of layer kinds
# ================================================================================================================
@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """kinds: BlockKind of each layer; period p; repeats R (layers [0, R p) run as a scan over R of p blocks);
    the tail (layers [R p, L)) is unrolled."""

    kinds: tuple
    period: int
    repeats: int

    @property
    def tail(self) -> tuple:
        return tuple(range(self.period * self.repeats, len(self.kinds)))

    def gdn_index(self, i: int) -> int:   # position of layer i in the GDN stack
        return sum(k.mixer == "gdn" for k in self.kinds[:i])

    def attn_index(self, i: int) -> int:
        return sum(k.mixer == "attention" for k in self.kinds[:i])


def layer_plan(config: HybridConfig) -> LayerPlan:
    """The period p minimising the blocks traced (p + the tail), kinds repeating every p layers up to R p."""
    kinds = tuple(blk.BlockKind("gdn" if t == "linear_attention" else "attention", config.layer_is_moe(i))
                  for i, t in enumerate(config.layer_types))
    n = len(kinds)
    best = (n + 1, n, 1)
    for p in range(1, n + 1):
        r = n // p
        if all(kinds[i] == kinds[i % p] for i in range(r * p)):
            cost = p + (n - r * p)
            if cost < best[0]:
                best = (cost, p, r)
    return LayerPlan(kinds=kinds, period=best[1], repeats=best[2])


def stack_layers(config: HybridConfig, layers: Sequence[dict]) -> dict:
    """Per-layer block dicts [L] -> {"period": p dicts stacked [R, ...], "tail": dicts} (one copy)."""
    plan = layer_plan(config)
    p, r = plan.period, plan.repeats
    period = tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[q * p + j] for q in range(r)])
                   for j in range(p))
    return {"period": period, "tail": tuple(layers[i] for i in plan.tail)}


# ================================================================================================================
# Random parameters on the device (benchmarks at real dims: no host copy)
# ================================================================================================================
def _block_shapes(config: HybridConfig, kind: blk.BlockKind) -> dict:
    d = config.hidden_size
    shapes = {"input_norm": (d,), "post_norm": (d,)}
    if kind.mixer == "gdn":
        shapes["mixer"] = gdn_layer.mixer_param_shapes(config.gdn_dims)
    else:
        shapes["mixer"] = attention_param_shapes(config.attn_dims)
    if kind.moe:
        e, i = config.num_experts, config.moe_intermediate_size
        ffn = {"router": (d, e), "experts_gate_up": (e, d, 2 * i), "experts_down": (e, i, d)}
        if config.shared_expert_intermediate_size:
            si = config.shared_expert_intermediate_size
            ffn["shared_expert"] = {"gate_proj": (d, si), "up_proj": (d, si), "down_proj": (si, d)}
            ffn["shared_expert_gate"] = (d, 1)
    else:
        ffn = {"gate_proj": (d, config.intermediate_size), "up_proj": (d, config.intermediate_size),
               "down_proj": (config.intermediate_size, d)}
    shapes["ffn"] = ffn
    return shapes


def _is_fp32(name: str) -> bool:
    return name.endswith(("norm", "A_log", "dt_bias"))


def _random_leaf(key, name: str, shape: tuple, dtype, std: float, conv_kernel: int):
    """One parameter: N(0, std) weights; zero-centred norms 0 (neutral 1 + w); the GDN gated norm 1; A_log log
    U(1, 16); dt_bias inverse-softplus of U(1e-3, 0.1); conv U(+-1/sqrt(Kc))."""
    if name == "norm":                                   # GDN gated norm: plain weight
        return jnp.ones(shape, jnp.float32)
    if name.endswith("norm"):
        return jnp.zeros(shape, jnp.float32)
    if name == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0))
    if name == "dt_bias":
        dt = jax.random.uniform(key, shape, jnp.float32, 1e-3, 0.1)
        return dt + jnp.log(-jnp.expm1(-dt))
    if name == "conv1d":
        b = 1.0 / math.sqrt(conv_kernel)
        return jax.random.uniform(key, shape, jnp.float32, -b, b).astype(dtype)
    return (jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)).astype(dtype)


def init_params(config: HybridConfig, key, dtype=jnp.bfloat16, *, std: float = 0.02, mesh=None,
                moe_sharding: str = "auto") -> dict:
    """Random parameters made directly on the default device in the model's stacked layout (no host copy):
    weights N(0, std) in ``dtype``, norms at their neutral value, A_log / dt_bias / norms fp32.

    mesh: made on the mesh's devices already split (``jax_gdn.sharding``; each device generates its slice), in
    the sharded layout ``HybridModel(..., mesh=mesh, moe_sharding=moe_sharding)`` takes as is."""
    if isinstance(key, int):
        key = jax.random.PRNGKey(key)
    if mesh is not None:
        return _shd().ShardRules(config, mesh, moe_sharding).random_params(
            lambda: init_params(config, key, dtype, std=std))
    plan = layer_plan(config)
    counter = [0]

    def leaf(name, shape, lead=()):
        counter[0] += 1
        k = jax.random.fold_in(key, counter[0])
        return _random_leaf(k, name, lead + tuple(shape), dtype, std, config.linear_conv_kernel_dim)

    def tree(shapes, lead=()):
        return {n: tree(s, lead) if isinstance(s, dict) else leaf(n, s, lead) for n, s in shapes.items()}

    d, v = config.hidden_size, config.vocab_size
    params = {"embed": leaf("embed", (v, d)), "final_norm": leaf("final_norm", (d,))}
    if not config.tie_word_embeddings:
        params["lm_head"] = leaf("lm_head", (d, v))
    params["period"] = tuple(tree(_block_shapes(config, plan.kinds[j]), (plan.repeats,))
                             for j in range(plan.period))
    params["tail"] = tuple(tree(_block_shapes(config, plan.kinds[i])) for i in plan.tail)
    return params


def default_token_buckets(max_tokens: int = 1 << 20) -> tuple:
    """16, 32, ..., 1024, then 2048, 3072, ... (multiples of 1024) up to max_tokens."""
    out = [16 << i for i in range(7)]
    out += list(range(2048, max(max_tokens, 2048) + 1, 1024))
    return tuple(out)


# ================================================================================================================
# Page allocation (on device)
# ================================================================================================================
def _fit_status(page_refs, real, old_lens, seq_lens, *, page_size: int, seq_len_limit: int):
    """Whether N streams growing from old_lens to old_lens + seq_lens (padding streams: real False, zero length)
    fit: (status [] int32: 0, 1 when the pool has too few free pages, 2 when a stream would hold more than
    seq_len_limit tokens; pages held [N], pages needed [N], new pages [N]). One definition for the step and for
    strict mode's host-side decision (``HybridModel``)."""
    ps = page_size
    have = (old_lens + ps - 1) // ps                                               # [N] pages held
    need = (old_lens + seq_lens + ps - 1) // ps                                    # [N] pages needed
    new = jnp.where(real, need - have, 0)
    fits_pool = jnp.sum(new) <= jnp.sum((page_refs == 0).astype(jnp.int32))
    fits_len = jnp.all(~real | (old_lens + seq_lens <= seq_len_limit))            # implies need <= W
    status = jnp.where(fits_len, jnp.where(fits_pool, STATUS_OK, STATUS_OUT_OF_PAGES), STATUS_PAST_MAX_SEQ_LEN)
    return status.astype(jnp.int32), have, need, new


def _stream_lens(cache_slot_lens, slot_ids, cu_seqlens):
    """(real [N], slot ids clamped into range [N], seq_lens [N], old_lens [N]) of a padded call."""
    s = cache_slot_lens.shape[0]
    real = (slot_ids >= 0) & (slot_ids < s)
    sid = jnp.where(real, slot_ids, 0)
    seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    old_lens = jnp.where(real, cache_slot_lens[sid], 0)
    return real, sid, seq_lens, old_lens


def step_status(page_refs, slot_lens, status, slot_ids, cu_seqlens, *, page_size: int, seq_len_limit: int,
                has_attention: bool) -> jax.Array:
    """[] int32: the status ``step`` would record for this padded call (the sticky status first), from the cache's
    page_refs [P], slot_lens [S] and status []: what strict mode reads before it runs a step."""
    real, _, seq_lens, old_lens = _stream_lens(slot_lens, slot_ids, cu_seqlens)
    if has_attention:
        new = _fit_status(page_refs, real, old_lens, seq_lens, page_size=page_size, seq_len_limit=seq_len_limit)[0]
    else:
        new = jnp.asarray(STATUS_OK, jnp.int32)
    return jnp.where(status != STATUS_OK, status, new)


def _allocate(cache: Cache, slot_ids, real, old_lens, seq_lens, total_tokens: int):
    """New pages for N streams growing from old_lens to old_lens + seq_lens (padding streams: real False, zero
    length). Returns (page_table, page_refs, status): status 1 when the pool has too few free pages,
    2 when a stream would hold more than ``cache.seq_len_limit`` tokens; then the returned tables must not be
    used."""
    ps, p, s = cache.page_size, cache.num_pages, cache.num_slots
    n = slot_ids.shape[0]
    status, have, need, new = _fit_status(cache.page_refs, real, old_lens, seq_lens, page_size=ps,
                                          seq_len_limit=cache.seq_len_limit)
    new_end = jnp.cumsum(new)
    new_off = new_end - new
    total = new_end[-1]
    free = cache.page_refs == 0
    ok = status == STATUS_OK
    a = max(1, min(p, total_tokens // ps + n))                                     # static bound of new pages
    free_ids = jnp.nonzero(free, size=a, fill_value=p)[0].astype(jnp.int32)        # [A]
    j = jnp.arange(a, dtype=jnp.int32)
    stream = jnp.minimum(count_le(new_end, a), n - 1)          # searchsorted(new_end, j, "right"), loop-free
    valid = (j < total) & ok
    slot_j = slot_ids[stream]
    idx_j = have[stream] + j - new_off[stream]
    page_table = cache.page_table.at[jnp.where(valid, slot_j, s), idx_j].set(free_ids, mode="drop")
    page_refs = cache.page_refs.at[jnp.where(valid, free_ids, p)].set(1, mode="drop")
    return page_table, page_refs, status


def _unref_slots(cache: Cache, releasing) -> jax.Array:
    """page_refs [P] once the slots marked in ``releasing [S]`` bool let go of the pages they hold (their first
    ceil(slot_lens / Ps) page-table entries; a page shared with another slot stays held by it)."""
    p, ps, w = cache.num_pages, cache.page_size, cache.pages_per_slot
    held = (cache.slot_lens + ps - 1) // ps                                        # [S]
    mine = releasing[:, None] & (jnp.arange(w, dtype=jnp.int32)[None, :] < held[:, None])
    return cache.page_refs.at[jnp.where(mine, cache.page_table, p).reshape(-1)].add(-1, mode="drop")


# ================================================================================================================
# One step (pure; jitted per model)
# ================================================================================================================
def _flat(tree):
    """[L, X, ...] leaves -> [L * X, ...] (a free reshape): one pool holding every layer's slots / pages."""
    return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), tree)


def _unflat(tree, like):
    return jax.tree.map(lambda a, b: a.reshape(b.shape), tree, like)


def _gdn_view(batch: blk.Batch, gi, num_layers: int, s: int) -> blk.Batch:
    """The batch for GDN layer gi over the flat pool [Lg * S]: slot ids offset by gi * S; padding streams (ids
    outside [0, S)) get Lg * S, out of range of every layer (dropped, never another layer's slot)."""
    sl = batch.meta.slot_ids
    real = (sl >= 0) & (sl < s)
    return batch.replace(meta=batch.meta.replace(slot_ids=jnp.where(real, sl + gi * s, num_layers * s)))


def _kv_view(batch: blk.Batch, ai, num_layers: int, p: int) -> blk.Batch:
    """The batch for attention layer ai over the flat page pool [La * P]: page ids offset by ai * P; dropped
    writes (page outside [0, P)) get La * P, out of range of every layer."""
    tp = batch.token_page
    tp = jnp.where((tp >= 0) & (tp < p), tp + ai * p, num_layers * p)
    return batch.replace(token_page=tp, page_table=batch.page_table + ai * p)


_EXPERT_KEYS = ("experts_gate_up", "experts_down")


def _expert_pool(bparams: dict):
    """A period position's stacked routed experts [R, E, ...] -> (gate_up [R E, D, 2I], down [R E, I, D])."""
    return tuple(bparams["ffn"][k].reshape((-1,) + bparams["ffn"][k].shape[2:]) for k in _EXPERT_KEYS)


def _without_experts(bparams: dict) -> dict:
    return dict(bparams, ffn={k: v for k, v in bparams["ffn"].items() if k not in _EXPERT_KEYS})


def _with_experts(bparams: dict, pool) -> dict:
    return dict(bparams, ffn=dict(bparams["ffn"], **dict(zip(_EXPERT_KEYS, pool))))


def _slice_layer(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put_layer(tree, new, i):
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), i, 0), tree, new)


def _layers(params: dict, x, gdn_all, kv_all, batch: blk.Batch, *, config: HybridConfig, plan: LayerPlan,
            backends: blk.Backends, options: RuntimeOptions, scan_unroll: int | bool = 1):
    """Every block: a scan over the R repeats of the period, then the tail. Returns (x, gdn_all, kv_all).

    The stacked states are seen as one flat pool per kind (GDN slots [Lg * S], KV pages [La * P]) and each layer
    addresses its own part through offset slot / page ids, so every layer reads and writes the pools in place:
    no per-layer slice or copy of a state. A kind run by a Pallas kernel (GDN: always) whose flat leaves would pass
    ``options.flat_pool_limit`` elements (int32 addressing in the kernels) runs per layer instead: dynamic slice,
    block, dynamic update (a copy of the layer's state each way, far slower than in place). At 80B dims that is
    past ~113 slots (GDN: 36 layers x 32 x 128 x 128 fp32 per slot) or ~350k KV tokens."""
    kinds = plan.kinds
    p = plan.period
    pg = sum(k.mixer == "gdn" for k in kinds[:p])
    pa = p - pg
    lg, s = gdn_all.ssm_state.shape[:2]
    la, num_pages = kv_all.k_pages.shape[:2]
    # XLA addresses with 64-bit offsets: only the Pallas kernels need the limit (GDN: always, the decode step picks
    # its kernel itself)
    limit = options.flat_pool_limit
    flat_gdn = all(a.size <= limit for a in jax.tree.leaves(gdn_all))
    flat_kv = backends.paged_attention == "xla" or all(a.size <= limit for a in jax.tree.leaves(kv_all))
    gdn = _flat(gdn_all) if flat_gdn else gdn_all
    kv = _flat(kv_all) if flat_kv else kv_all

    # Routed expert weights stay out of the scan's xs: each period position's stacked [R, E, ...] experts are seen
    # as one pool [R E, ...] (a free reshape) that the MoE kernels index in place from an expert offset r E. As
    # xs, every repeat would slice its layer's [E, ...] experts out, and XLA materialises that dynamic slice
    # before the kernel's custom call: 3.2 GB copied per MoE layer at 80B dims.
    period = params["period"]
    pools = [_expert_pool(period[j]) if kinds[j].moe else None for j in range(p)]
    xs_period = tuple(_without_experts(period[j]) if kinds[j].moe else period[j] for j in range(p))

    def run_block(kind, bparams, x, gdn, kv, gi, ai, expert_offset=None):
        fn = functools.partial(_run_block, kind)
        if options.remat == "layers":              # the backward recomputes the block, its mixer's core saved
            fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*CORE_NAMES),
                                prevent_cse=False)
        return fn(bparams, x, gdn, kv, gi, ai, expert_offset)

    def _run_block(kind, bparams, x, gdn, kv, gi, ai, expert_offset=None):
        b = batch if expert_offset is None else batch.replace(expert_offset=expert_offset)
        kw = dict(config=config, backends=backends, options=options)
        if kind.mixer == "gdn":
            if flat_gdn:
                x, gdn = blk.block(kind, bparams, x, gdn, _gdn_view(b, gi, lg, s), **kw)
            else:
                x, st = blk.block(kind, bparams, x, _slice_layer(gdn, gi), b, **kw)
                gdn = _put_layer(gdn, st, gi)
        elif flat_kv:
            x, kv = blk.block(kind, bparams, x, kv, _kv_view(b, ai, la, num_pages), **kw)
        else:
            x, st = blk.block(kind, bparams, x, _slice_layer(kv, ai), b, **kw)
            kv = _put_layer(kv, st, ai)
        return x, gdn, kv

    def body(carry, xs):
        x, gdn, kv = carry
        r, pparams = xs
        gi, ai = r * pg, r * pa
        for j in range(p):
            bparams, eo = pparams[j], None
            if pools[j] is not None:
                bparams = _with_experts(bparams, pools[j])
                eo = r * (pools[j][0].shape[0] // plan.repeats)
            x, gdn, kv = run_block(kinds[j], bparams, x, gdn, kv, gi, ai, eo)
            if kinds[j].mixer == "gdn":
                gi = gi + 1
            else:
                ai = ai + 1
        return (x, gdn, kv), None

    if plan.repeats:
        (x, gdn, kv), _ = jax.lax.scan(
            body, (x, gdn, kv), (jnp.arange(plan.repeats, dtype=jnp.int32), xs_period), unroll=scan_unroll)
    for bparams, i in zip(params["tail"], plan.tail):
        x, gdn, kv = run_block(kinds[i], bparams, x, gdn, kv, plan.gdn_index(i), plan.attn_index(i))
    return (x, _unflat(gdn, gdn_all) if flat_gdn else gdn, _unflat(kv, kv_all) if flat_kv else kv)


def step(params: dict, cache: Cache, input_ids, cu_seqlens, slot_ids, *, config: HybridConfig, plan: LayerPlan,
         backends: blk.Backends, decode: bool, return_all_logits: bool, axis_name=None, vocab_split: bool = False,
         expert_parallel: bool = False, options: RuntimeOptions = DEFAULT_OPTIONS):
    """Prefill (or decode: one token per stream) of N (padded) streams over T (padded) tokens, inputs already
    checked: input_ids [T] int32, cu_seqlens [N + 1] int32 (cu[N] <= T; padding streams of zero length last),
    slot_ids [N] int32 (padding streams: S). Returns (logits fp32 [N, Vocab] or [T, Vocab], new cache).
    options: the layers' implementation choices and the layer scan's unroll (static).
    Under shard_map (jax_gdn.sharding): axis_name is the mesh axis, config the per-device config, params / cache
    the device's slices, and the logits the device's vocabulary columns when vocab_split; expert_parallel: the
    params hold whole experts split over axis_name (jax_gdn.layers.moe_ep)."""
    t = input_ids.shape[0]
    n = slot_ids.shape[0]
    s, p, ps = cache.num_slots, cache.num_pages, cache.page_size
    w = cache.page_table.shape[1]
    real, sid, seq_lens, old_lens = _stream_lens(cache.slot_lens, slot_ids, cu_seqlens)     # [N] each

    tok_stream, tok_rel = token_streams(cu_seqlens, t)                             # [T], [T]
    valid = jnp.arange(t, dtype=jnp.int32) < cu_seqlens[n]
    tok_pos = jnp.where(valid, old_lens[tok_stream] + tok_rel, 0)
    if config.attn_layers:
        page_table, page_refs, status = _allocate(cache, slot_ids, real, old_lens, seq_lens, t)
    else:  # no attention layer: no KV pages to hand out, no length limit
        page_table, page_refs = cache.page_table, cache.page_refs
        status = jnp.asarray(STATUS_OK, jnp.int32)
    status = jnp.where(cache.status != STATUS_OK, cache.status, status)           # sticky
    go = status == STATUS_OK
    # A refused step still runs, with every write dropped: slot ids out of range (S) for the state pools, pages
    # out of range (P) for the KV writes, the old tables kept, zero logits. (A lax.cond around the layers would
    # make XLA copy the whole cache through its branches on every step.)
    page_table = jnp.where(go, page_table, cache.page_table)
    page_refs = jnp.where(go, page_refs, cache.page_refs)
    tok_page = page_table[sid[tok_stream], jnp.minimum(tok_pos // ps, w - 1)]
    tok_page = jnp.where(valid & go, tok_page, p)                                  # padding / refused: dropped
    new_slot_lens = jnp.where(go, cache.slot_lens.at[slot_ids].add(seq_lens, mode="drop"), cache.slot_lens)
    meta = BatchMeta(cu_seqlens=cu_seqlens, slot_ids=jnp.where(go, slot_ids, s), has_initial_state=old_lens > 0,
                     positions=old_lens)
    batch = blk.Batch(meta=meta, token_pos=tok_pos, token_page=tok_page, token_offset=tok_pos % ps,
                      page_table=page_table, slot_lens=new_slot_lens, decode=decode, axis_name=axis_name,
                      expert_axis=axis_name if expert_parallel else None)

    x = (params["embed"][input_ids] if axis_name is None or not vocab_split                # [T, D]
         else _shd().embed_lookup(params["embed"], input_ids, axis_name, vocab_split))
    x, gdn_all, kv_all = _layers(params, x, cache.gdn, cache.kv, batch, config=config, plan=plan,
                                 backends=backends, options=options, scan_unroll=options.scan_unroll(decode))
    if not return_all_logits:
        x = x[jnp.maximum(cu_seqlens[1:] - 1, 0)]                                  # last token of each stream
    x = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    logits = jnp.where(go, head_logits(x, head), 0.0)
    return logits, cache.replace(gdn=gdn_all, kv=kv_all, page_table=page_table, page_refs=page_refs,
                                 slot_lens=new_slot_lens, status=status)


@jax.custom_vjp
def head_logits(x, head):
    """fp32 logits [T, Vocab] of x [T, D] @ head [D, Vocab] (fp32 accumulation), whose VJP rounds the logits'
    cotangent to the head's dtype before both backward GEMMs (fp32 accumulation again). Autodiff would multiply
    the fp32 cotangent with the bf16 head promoted to fp32: two tf32 GEMMs at half the bf16 rate, 15.2 of the
    90 ms of a 4096-token training step at 80B dims (vocab 151936) on the H200. A fp32 head is unchanged."""
    return jnp.matmul(x, head, preferred_element_type=jnp.float32)


def _head_logits_fwd(x, head):
    return head_logits(x, head), (x, head)


def _head_logits_bwd(res, g):
    x, head = res
    g = g.astype(head.dtype)
    dx = jnp.matmul(g, head.T, preferred_element_type=jnp.float32).astype(x.dtype)
    dhead = jnp.matmul(x.T.astype(head.dtype), g, preferred_element_type=jnp.float32).astype(head.dtype)
    return dx, dhead


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def release_slots(cache: Cache, slot_ids: jax.Array, axis_name=None) -> Cache:
    """Empties the slots (ids outside [0, S) are ignored): their pages go back to the free pool (a page another slot
    shares stays with it), their lengths to 0 (their GDN state is ignored after: the next prefill starts fresh)."""
    s = cache.num_slots
    releasing = jnp.zeros((s,), bool).at[slot_ids].set(True, mode="drop")
    return cache.replace(
        page_refs=_unref_slots(cache, releasing),
        page_table=jnp.where(releasing[:, None], 0, cache.page_table),
        slot_lens=jnp.where(releasing, 0, cache.slot_lens))


def fork_slots(cache: Cache, src_ids: jax.Array, dst_ids: jax.Array, axis_name=None) -> Cache:
    """Slot dst_ids[m] becomes a copy of slot src_ids[m] (pairs with an id outside [0, S) are ignored): dst's own
    pages are let go first, then it takes its source's length, GDN state (conv and recurrent, every layer) and KV:
    the source's full pages shared (their reference counts raised: no write ever reaches a full page, so nothing
    is copied) and its partial last page, if any, copied into a fresh page (the next tokens of dst and of src go
    there). dst continues exactly where src stands. When the pool lacks the fresh pages the call writes nothing
    and records STATUS_OUT_OF_PAGES (sticky, as a refused step; a cache already refused is returned unchanged).
    Sources must not be destinations of the same call."""
    del axis_name                                   # per device the same index work (heads are what is split)
    s, p, ps, w = cache.num_slots, cache.num_pages, cache.page_size, cache.pages_per_slot
    m = dst_ids.shape[0]
    real = (src_ids >= 0) & (src_ids < s) & (dst_ids >= 0) & (dst_ids < s)
    src = jnp.where(real, src_ids, 0)
    dst = jnp.where(real, dst_ids, s)
    releasing = jnp.zeros((s,), bool).at[dst].set(True, mode="drop")
    lens = jnp.where(real, cache.slot_lens[src], 0)                                # [M]
    full = lens // ps                                                              # [M] pages shared
    i = jnp.arange(w, dtype=jnp.int32)[None, :]
    src_rows = cache.page_table[src]                                               # [M, W]
    share = real[:, None] & (i < full[:, None])
    refs = _unref_slots(cache, releasing).at[jnp.where(share, src_rows, p).reshape(-1)].add(1, mode="drop")
    table = cache.page_table.at[dst].set(jnp.where(share, src_rows, 0), mode="drop")    # dst rows: shared only
    shared = cache.replace(page_refs=refs, page_table=table, slot_lens=jnp.where(releasing, 0, cache.slot_lens))
    page_table, page_refs, status = _allocate(shared, dst, real, full * ps, lens - full * ps, total_tokens=m * ps)
    ok = (status == STATUS_OK) & (cache.status == STATUS_OK)
    partial = ok & real & (lens > full * ps)                                       # [M] one page copied each
    last = jnp.minimum(full, w - 1)[:, None]
    from_page = jnp.where(partial, jnp.take_along_axis(src_rows, last, 1)[:, 0], 0)
    to_page = jnp.where(partial, jnp.take_along_axis(page_table[jnp.minimum(dst, s - 1)], last, 1)[:, 0], p)
    kv = jax.tree.map(lambda x: x.at[:, to_page].set(x[:, from_page], mode="drop"), cache.kv)
    to_slot = jnp.where(ok & real, dst, s)
    gdn = jax.tree.map(lambda x: x.at[:, to_slot].set(x[:, src], mode="drop"), cache.gdn)
    slot_lens = shared.slot_lens.at[to_slot].set(lens, mode="drop")

    def pick(new, old):                             # the small tables only: the pools were written under ``ok``
        return jnp.where(ok, new, old)
    return cache.replace(gdn=gdn, kv=kv, page_table=pick(page_table, cache.page_table),
                         page_refs=pick(page_refs, cache.page_refs), slot_lens=pick(slot_lens, cache.slot_lens),
                         status=jnp.where(cache.status != STATUS_OK, cache.status, status).astype(jnp.int32))


# ================================================================================================================
# Host-side checks (before any state is touched)
# ================================================================================================================
def _int_array(x, name: str, ndim: int, shape_doc: str) -> np.ndarray:
    if isinstance(x, (list, tuple)):
        x = np.asarray(x, dtype=np.int64)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise ValueError(f"{name} must be an int32 array of shape {shape_doc}, got {type(x).__name__}")
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise ValueError(f"{name} must be an int32 array of shape {shape_doc}, got dtype {x.dtype}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}")
    return np.asarray(x).astype(np.int64)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _with_scan_unroll(options: RuntimeOptions, value) -> RuntimeOptions:
    """options with HybridModel's scan_unroll applied: None (options' own), an int >= 1 or a bool for both
    programs, or a dict with the keys "prefill" and "decode"."""
    if value is None:
        return options
    pair = dict(value) if isinstance(value, dict) else {"prefill": value, "decode": value}
    if set(pair) != {"prefill", "decode"}:
        raise ValueError(f"scan_unroll as a dict takes the keys 'prefill' and 'decode', got {sorted(pair)}")
    for k, v in pair.items():
        if not isinstance(v, (bool, int, np.integer)) or (not isinstance(v, bool) and v < 1):
            raise ValueError(f"scan_unroll[{k!r}] must be True, False or an int >= 1, got {v!r}")
        pair[k] = v if isinstance(v, bool) else int(v)
    return dataclasses.replace(options, scan_unroll_prefill=pair["prefill"], scan_unroll_decode=pair["decode"])


#: the call kinds each op's table is asked about at build (what the model's programs call)
MODEL_CALLS = {"gated_delta_rule": ("slots", "short_mix", "decode"), "paged_attention": ("prefill", "decode"),
               "moe": ("experts", "routing")}


def _resolve_backends(config: HybridConfig, dtype, backend) -> tuple[blk.Backends, dict]:
    """(the backend name each op's layers pass: the user's, checked; {op: {call kind: implementation "auto" or the
    explicit name runs here}}) from each op's dispatch table at this model's dims, dtype and platform. An
    explicit name that cannot run a call kind is refused with the table's reason."""
    from pallas_kernels import registry
    platform = jax.default_backend()
    if isinstance(backend, dict):
        unknown = sorted(set(backend) - set(MODEL_CALLS))
        if unknown:
            raise ValueError(f"backend: unknown op(s) {unknown}; known: {sorted(MODEL_CALLS)}")
        names = dict(backend)
    else:
        registry.table("gated_delta_rule").check_backend(backend)
        other = {"xla": "xla", "pallas_interpret": "pallas_interpret",
                 "mosaic_gpu_interpret": "pallas_interpret"}.get(backend, "auto")
        names = {"gated_delta_rule": backend, "paged_attention": other, "moe": other}
    cases = {"gated_delta_rule": dict(dtype=dtype, head_k_dim=config.linear_key_head_dim,
                                      head_v_dim=config.linear_value_head_dim,
                                      num_k_heads=config.linear_num_key_heads,
                                      num_v_heads=config.linear_num_value_heads),
             "paged_attention": dict(dtype=dtype, head_dim=config.head_dim, num_heads=config.num_attention_heads,
                                     num_kv_heads=config.num_key_value_heads),
             "moe": dict(dtype=dtype, num_experts=config.num_experts, hidden=config.hidden_size,
                         inter=config.moe_intermediate_size, top_k=config.num_experts_per_tok)}
    used = {"gated_delta_rule": bool(config.gdn_layers), "paged_attention": bool(config.attn_layers),
            "moe": bool(config.num_experts)}
    kernels = {}
    for op, calls in MODEL_CALLS.items():
        name = names.get(op, "auto")
        t = registry.table(op)
        try:
            t.check_backend(name)
            if used[op]:
                kernels[op] = {call: registry.resolve(op, name, call=call, platform=platform, **cases[op])
                               for call in calls}
        except ValueError as err:
            raise ValueError(f"HybridModel backend={backend!r}: {err}") from None
    return blk.Backends(**{op: names.get(op, "auto") for op in MODEL_CALLS}), kernels


# ================================================================================================================
# The model
# ================================================================================================================
def _host_method(method):
    """Turns the error a traced input raises inside a host-side method (``jax.jit(model.prefill)``: the inputs
    are checked and padded on the host) into a TypeError naming the method and what to use instead. Costs
    nothing on the normal path: the inputs are looked at only when the method raised."""
    name = method.__name__
    instead = ("jax_gdn.model.release_slots (the pure release)" if name == "release" else
               "model.step_fn() (the pure step function; see its docstring for the padded inputs it takes)")
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError) as err:
            bound = signature.bind(self, *args, **kwargs)
            if not any(isinstance(x, _Tracer) for x in jax.tree.leaves(tuple(bound.arguments.values())[1:])):
                raise
            raise TypeError(
                f"HybridModel.{name} was called with traced arrays (inside jax.jit, vmap, grad or another "
                f"transformation): it checks its inputs on the host and runs a program it compiled itself, so it "
                f"cannot be traced. Call model.{name}(...) directly (it is already compiled), or use {instead} "
                f"inside your own jit") from err
    return wrapped


class HybridModel:
    """A hybrid GDN + attention decoder with its parameters; see the module docstring for the API and shapes.

    token_buckets: ascending token counts T is padded up to (default ``default_token_buckets()``); past the last
    one T is rounded up to a multiple of it. strict: decide every prefill / decode on the host before running it
    (a sync per step; a step that would be refused raises OutOfKvPagesError without running: the cache passed in
    is neither donated nor changed). scan_unroll: the ``unroll`` of the scan over the repeats of the layer period,
    for both programs or as {"prefill": ..., "decode": ...} (None: the options' ``scan_unroll_prefill`` /
    ``scan_unroll_decode``, prefill rolled, decode by 2; compile time grows at most 2x the loop body, not with
    depth). options: ``RuntimeOptions`` (None: the defaults), held as ``self.options`` (scan_unroll applied).
    compiler_options: XLA options of the prefill / decode programs (``jax.jit(compiler_options=...)``, e.g.
    {"xla_gpu_enable_command_buffer": ...}).
    """

    def __init__(self, config: HybridConfig, params: dict, *, dtype=jnp.bfloat16, backend="auto",
                 token_buckets: Optional[Sequence[int]] = None, strict: bool = False, mesh=None,
                 moe_sharding: str = "auto", scan_unroll=None, compiler_options: Optional[dict] = None,
                 options: Optional[RuntimeOptions] = None):
        if not isinstance(config, HybridConfig):
            raise ValueError(f"config must be a HybridConfig, got {type(config).__name__}")
        if options is None:
            options = DEFAULT_OPTIONS
        if not isinstance(options, RuntimeOptions):
            raise ValueError(f"options must be a jax_gdn.options.RuntimeOptions, got {type(options).__name__}")
        if moe_sharding not in _shd().MOE_SHARDINGS:
            raise ValueError(f"moe_sharding must be one of {_shd().MOE_SHARDINGS}, got {moe_sharding!r}")
        self.config = config
        self.mesh = mesh
        self.shard_rules = (None if mesh is None                                    # checks the mesh first
                            else _shd().ShardRules(config, mesh, moe_sharding))
        self.dtype = jnp.dtype(dtype)
        self.plan = layer_plan(config)
        if "layers" in params:
            if len(params["layers"]) != config.num_hidden_layers:
                raise ValueError(f"params['layers'] has {len(params['layers'])} layers, config says "
                                 f"{config.num_hidden_layers}")
            params = {**{k: v for k, v in params.items() if k != "layers"}, **stack_layers(config, params["layers"])}
        elif "period" not in params or "tail" not in params:
            raise ValueError("params must hold 'layers' (a list of block dicts) or 'period' / 'tail' (stacked); "
                             f"got keys {sorted(params)}")
        elif len(params["period"]) != self.plan.period or len(params["tail"]) != len(self.plan.tail):
            raise ValueError(f"params['period'] / ['tail'] hold {len(params['period'])} / {len(params['tail'])} "
                             f"blocks; the layer plan of this config has {self.plan.period} / {len(self.plan.tail)}")
        if self.shard_rules is not None:
            params = self.shard_rules.ensure_placed(params)
        elif options.hold_fused_qkv:         # one qkv_proj per attention layer, made once (no per-call concat)
            params = _attn.fuse_qkv_tree(params)
        self.params = params
        self.backend = backend
        self.backends, self.kernels = _resolve_backends(config, self.dtype, backend)
        buckets = default_token_buckets() if token_buckets is None else tuple(int(b) for b in token_buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"token_buckets must be ascending positive ints, got {token_buckets!r}")
        self.token_buckets = buckets
        self.strict = bool(strict)
        self._traces = 0
        self._cache_sig = {}       # (S, P, Ps, W) -> leaf (shape, dtype) signature of a cache _check_cache passed
        self.options = _with_scan_unroll(options, scan_unroll)
        self.compiler_options = dict(compiler_options or {})
        kw = dict(config=config, plan=self.plan, backends=self.backends, options=self.options)
        if self.shard_rules is not None:
            kw.update(config=self.shard_rules.local_config, vocab_split=self.shard_rules.vocab_split,
                      expert_parallel=self.shard_rules.expert_parallel)

        def traced(fn):
            def wrapped(*args, **kwargs):
                self._traces += 1          # runs once per trace, i.e. per compiled program
                return fn(*args, **kwargs)
            return wrapped

        def prefill_fn(params, cache, ids, cu, sl, return_all_logits, axis_name):
            return step(params, cache, ids, cu, sl, decode=False, return_all_logits=return_all_logits,
                        axis_name=axis_name, **kw)

        def decode_fn(params, cache, ids, cu, sl, axis_name):
            return step(params, cache, ids, cu, sl, decode=True, return_all_logits=False, axis_name=axis_name, **kw)

        release_fn = release_slots
        fork_fn = fork_slots
        if self.shard_rules is not None:   # one program per device: shard_map over the mesh axis
            prefill_fn = self.shard_rules.shard_step(prefill_fn)
            decode_fn = self.shard_rules.shard_step(decode_fn)
            release_fn = self.shard_rules.shard_step(release_slots, with_params=False)
            fork_fn = self.shard_rules.shard_step(fork_slots, with_params=False)
        else:
            prefill_fn = functools.partial(prefill_fn, axis_name=None)
            decode_fn = functools.partial(decode_fn, axis_name=None)
        self._step_fns = (prefill_fn, decode_fn)
        self._status_jit = jax.jit(step_status, static_argnames=("page_size", "seq_len_limit", "has_attention"))
        copts = {"compiler_options": self.compiler_options} if self.compiler_options else {}
        self._prefill_jit = jax.jit(traced(prefill_fn), static_argnames=("return_all_logits",),
                                    donate_argnums=(1,), **copts)   # the cache (by position: the wrapper hides names)
        self._decode_jit = jax.jit(traced(decode_fn), donate_argnums=(1,), **copts)
        self._release_jit = jax.jit(traced(release_fn), donate_argnums=(0,))
        self._fork_jit = jax.jit(traced(fork_fn), donate_argnums=(0,))

    @classmethod
    def random(cls, config: HybridConfig, key=0, *, dtype=jnp.bfloat16, backend="auto", std: float = 0.02,
               **kwargs) -> "HybridModel":
        """A model with ``init_params`` weights (made on the device; on the mesh's devices, split, with mesh=)."""
        return cls(config, init_params(config, key, dtype, std=std, mesh=kwargs.get("mesh"),
                                       moe_sharding=kwargs.get("moe_sharding", "auto")),
                   dtype=dtype, backend=backend, **kwargs)

    def compiled_programs(self) -> int:
        """How many XLA programs this model's prefill / decode / release have compiled so far."""
        return self._traces

    @property
    def scan_unroll(self) -> dict:
        """{"prefill": ..., "decode": ...}: the layer scan's unroll in each program (from ``self.options``)."""
        return {"prefill": self.options.scan_unroll_prefill, "decode": self.options.scan_unroll_decode}

    def step_fn(self, *, decode: bool = False, return_all_logits: bool = False):
        """The pure step behind ``prefill`` (or ``decode``) with this model's config, layer plan, backends and
        options bound: ``fn(params, cache, input_ids, cu_seqlens, slot_ids) -> (logits, cache)``, for a
        ``jax.jit`` (or scan) of one's own; pass ``model.params``. The methods check their inputs on the host and
        compile their own programs; this function trusts its inputs, already padded: input_ids [T] int32 ids in
        [0, vocab); cu_seqlens [N + 1] int32 non-decreasing from 0 with cu[N] <= T (tokens past cu[N] are
        padding); slot_ids [N] int32, distinct in [0, S), or S for a padding stream of zero length; decode: T ==
        N and one token per stream. Logits fp32 [N, Vocab] ([T, Vocab] with return_all_logits); a refused step
        (out of pages, past max_seq_len) writes nothing and records the reason in the returned cache's status,
        as the methods do. On a mesh it is the shard_map-ed step (params and cache placed as the model places
        them)."""
        prefill_fn, decode_fn = self._step_fns
        if decode:
            if return_all_logits:
                raise ValueError("step_fn(decode=True) returns one row of logits per stream; "
                                 "return_all_logits must be False")
            return lambda params, cache, input_ids, cu_seqlens, slot_ids: decode_fn(
                params, cache, input_ids, cu_seqlens, slot_ids)
        flag = bool(return_all_logits)
        return lambda params, cache, input_ids, cu_seqlens, slot_ids: prefill_fn(
            params, cache, input_ids, cu_seqlens, slot_ids, return_all_logits=flag)

    # ---- cache ------------------------------------------------------------------------------------------------
    def _cache_leaves(self, max_seqs: int, num_pages: int, page_size: int, pages_per_slot: int) -> Cache:
        cfg = self.config
        lg, la = len(cfg.gdn_layers), len(cfg.attn_layers)
        d = cfg.gdn_dims
        gdn = GdnSlots(
            conv_state=jax.ShapeDtypeStruct((lg, max_seqs, d.conv_dim, d.conv_kernel_size - 1), self.dtype),
            ssm_state=jax.ShapeDtypeStruct((lg, max_seqs, d.num_v_heads, d.head_k_dim, d.head_v_dim),
                                           jnp.float32))
        kv_heads = cfg.num_key_value_heads if self.shard_rules is None else self.shard_rules.kv_heads
        kv_shape = (la, num_pages, page_size, kv_heads, cfg.head_dim)
        kv = KvPages(k_pages=jax.ShapeDtypeStruct(kv_shape, self.dtype),
                     v_pages=jax.ShapeDtypeStruct(kv_shape, self.dtype))
        i32 = jnp.int32
        return Cache(gdn=gdn, kv=kv, page_table=jax.ShapeDtypeStruct((max_seqs, pages_per_slot), i32),
                     page_refs=jax.ShapeDtypeStruct((num_pages,), i32),
                     slot_lens=jax.ShapeDtypeStruct((max_seqs,), i32),
                     status=jax.ShapeDtypeStruct((), i32), page_size=page_size)

    def init_cache(self, max_seqs: int = 8, max_tokens: int = 4096, page_size: int = 16,
                   max_seq_len: Optional[int] = None) -> Cache:
        """An empty cache for up to ``max_seqs`` concurrent streams (slots), a KV pool of
        ``ceil(max_tokens / page_size)`` pages shared by all slots, and at most ``max_seq_len`` tokens per slot
        (default max_tokens; exact: a step taking a slot past it is refused; a model without attention layers
        has no length limit): page_table [S, W = min(ceil(max_seq_len / page_size), pages)] (attention work per
        slot is bounded by W pages, not by the pool)."""
        for name, value in (("max_seqs", max_seqs), ("max_tokens", max_tokens), ("page_size", page_size),
                            ("max_seq_len", max_tokens if max_seq_len is None else max_seq_len)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
        num_pages = -(-int(max_tokens) // int(page_size))
        per_slot = -(-int(max_tokens if max_seq_len is None else max_seq_len) // int(page_size))
        spec = self._cache_leaves(int(max_seqs), num_pages, int(page_size), min(per_slot, num_pages))
        spec = spec.replace(max_seq_len=int(max_tokens if max_seq_len is None else max_seq_len))

        def make():
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), spec)
        if self.shard_rules is None:
            return make()
        return jax.jit(make, out_shardings=self.shard_rules.cache_shardings(spec))()   # made on the devices

    def _check_cache(self, cache):
        if not isinstance(cache, Cache):
            raise ValueError(f"cache must be the Cache returned by init_cache / prefill, got {type(cache).__name__}")
        try:
            s, w = cache.page_table.shape
            key = (s, cache.num_pages, cache.page_size, w)
            sig = tuple((x.shape, x.dtype) for x in jax.tree.leaves(cache))
            if self._cache_sig.get(key) == sig:   # the per-call fast path (host time counts in every decode step)
                return
            spec = self._cache_leaves(s, cache.num_pages, cache.page_size, w)
            got = jax.tree_util.tree_flatten_with_path(cache)[0]
            want = jax.tree_util.tree_flatten_with_path(spec)[0]
        except (AttributeError, ValueError, TypeError) as err:
            raise ValueError(f"cache does not have this model's layout ({err}); make it with model.init_cache"
                             ) from None
        if len(got) != len(want):
            raise ValueError(f"cache has {len(got)} leaves, this model's cache has {len(want)}; make it with "
                             f"model.init_cache")
        for (path, x), (_, y) in zip(got, want):
            if tuple(x.shape) != tuple(y.shape) or jnp.dtype(x.dtype) != jnp.dtype(y.dtype):
                raise ValueError(
                    f"cache{jax.tree_util.keystr(path)} has shape {tuple(x.shape)} {jnp.dtype(x.dtype).name}; this "
                    f"model ({self.dtype.name}) needs {tuple(y.shape)} {jnp.dtype(y.dtype).name}: make the cache "
                    f"with this model's init_cache")
        self._cache_sig[key] = sig

    def _check_slots(self, slot_ids, n, cache: Cache) -> np.ndarray:
        """slot_ids [N] int: shape, dtype, range [0, max_seqs) and no repeat through ``validation.check_slot_ids``
        (the layers' wording); ``n`` (None: any N) is the stream count of the call, checked against max_seqs."""
        s = cache.num_slots
        if n is not None and n > s:
            raise ValueError(f"{n} streams in one call but the cache has max_seqs={s} slots")
        if isinstance(slot_ids, (list, tuple)):
            slot_ids = np.asarray(slot_ids) if len(slot_ids) else np.zeros((0,), np.int64)
        validation.check_slot_ids(slot_ids, s, n)
        return np.asarray(slot_ids).astype(np.int64)

    def _check_tokens(self, ids: np.ndarray):
        v = self.config.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= v):
            bad = ids[(ids < 0) | (ids >= v)]
            raise ValueError(f"input_ids must be token ids in [0, vocab_size={v}), got {bad[:8].tolist()}")

    # ---- buckets ----------------------------------------------------------------------------------------------
    def token_bucket(self, t: int) -> int:
        for b in self.token_buckets:
            if b >= t:
                return b
        last = self.token_buckets[-1]
        return -(-t // last) * last

    @staticmethod
    def stream_bucket(n: int, max_seqs: int) -> int:
        return min(_pow2(n), max_seqs)

    @staticmethod
    def pad_step_inputs(ids, cu, sl, tb: int, nb: int, s: int):
        """The padding of every step (prefill / decode here, the serving engine's step on ``step_fn``): tokens
        ids [T] to tb (id 0 past cu[N]), streams to nb (cu [N + 1] extended by zero-length streams, slot ids sl [N]
        by S): int32 NumPy arrays (the jitted step transfers them itself: an eager jnp.asarray per array cost host
        time in every step)."""
        n = sl.shape[0]
        ids_p = np.zeros((tb,), np.int32)
        ids_p[:ids.shape[0]] = ids
        cu_p = np.full((nb + 1,), cu[-1], np.int32)
        cu_p[:n + 1] = cu
        sl_p = np.full((nb,), s, np.int32)
        sl_p[:n] = sl
        return ids_p, cu_p, sl_p

    @_host_method
    def check(self, cache: Cache) -> None:
        """Reads ``cache.status`` (a sync) and raises OutOfKvPagesError (with ``.cache``: the status cleared) when
        a step since the last check was refused. Cheap enough to call every few steps."""
        status = int(cache.status)
        if status != STATUS_OK:
            raise self._refusal(cache, status, "; that step and every later one were refused (nothing written, "
                                               "zero logits)")

    @staticmethod
    def _refusal(cache: Cache, status: int, what: str) -> OutOfKvPagesError:
        why = ("out of KV pages: the pool ({p} pages of {ps} tokens) could not hold a step's new tokens"
               if status == STATUS_OUT_OF_PAGES else
               "a slot would pass max_seq_len ({m} tokens per slot)")
        return OutOfKvPagesError(
            why.format(p=cache.num_pages, ps=cache.page_size, m=cache.seq_len_limit) + what
            + ". Release slots or make a larger cache (init_cache max_tokens / max_seq_len); continue with the "
              "error's .cache", cache.replace(status=jnp.zeros((), jnp.int32)))

    def _refuse_before(self, cache: Cache, cu_p, sl_p) -> None:
        """Strict mode: the status this step would record, read on the host before the (donating) call; raises
        OutOfKvPagesError when it would be refused, so the cache passed in stays live and unchanged."""
        status = int(self._status_jit(cache.page_refs, cache.slot_lens, cache.status, sl_p, cu_p,
                                      page_size=cache.page_size, seq_len_limit=cache.seq_len_limit,
                                      has_attention=bool(self.config.attn_layers)))
        if status != STATUS_OK:
            raise self._refusal(cache, status, "; the step was refused before it ran: nothing written, the cache "
                                               "passed in is unchanged and still usable")

    def _finish(self, logits, new_cache, rows: int):
        return (logits if rows == logits.shape[0] else logits[:rows]), new_cache   # no eager slice when unpadded

    # ---- prefill / decode / release ---------------------------------------------------------------------------
    @_host_method
    def prefill(self, cache: Cache, input_ids, cu_seqlens, slot_ids, return_all_logits: bool = False):
        """Prefill N streams packed in ``input_ids [T]`` (see the module docstring).
        Returns (logits [N, Vocab] fp32, or [T, Vocab] with return_all_logits, new cache)."""
        self._check_cache(cache)
        ids = _int_array(input_ids, "input_ids", 1, "[T]")
        t = ids.shape[0]
        if t < 1:
            raise ValueError("input_ids must have shape [T] with T >= 1, got an empty array")
        cu = _int_array(cu_seqlens, "cu_seqlens", 1, "[N + 1]")
        if cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1, got shape {tuple(cu.shape)}")
        n = cu.shape[0] - 1
        if cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) < 1):
            raise ValueError(f"cu_seqlens [N + 1] must start at 0, end at T={t} and grow by at least 1 token per "
                             f"stream, got {cu.tolist()}")
        sl = self._check_slots(slot_ids, n, cache)
        self._check_tokens(ids)
        s = cache.num_slots
        tb, nb = self.token_bucket(t), self.stream_bucket(n, s)
        ids_p, cu_p, sl_p = self.pad_step_inputs(ids, cu, sl, tb, nb, s)
        if self.strict:
            self._refuse_before(cache, cu_p, sl_p)
        logits, new_cache = self._prefill_jit(self.params, cache, ids_p, cu_p, sl_p,
                                              return_all_logits=bool(return_all_logits))
        return self._finish(logits, new_cache, t if return_all_logits else n)

    @_host_method
    def decode(self, cache: Cache, input_ids, slot_ids):
        """One token per stream: input_ids [N], slot_ids [N]. Returns (logits [N, Vocab] fp32, new cache)."""
        self._check_cache(cache)
        ids = _int_array(input_ids, "input_ids", 1, "[N]")
        n = ids.shape[0]
        if n < 1:
            raise ValueError("input_ids must have shape [N] with N >= 1 (one token per stream)")
        sl = self._check_slots(slot_ids, n, cache)
        self._check_tokens(ids)
        s = cache.num_slots
        nb = self.stream_bucket(n, s)
        ids_p, cu_p, sl_p = self.pad_step_inputs(ids, np.arange(n + 1), sl, nb, nb, s)
        if self.strict:
            self._refuse_before(cache, cu_p, sl_p)
        logits, new_cache = self._decode_jit(self.params, cache, ids_p, cu_p, sl_p)
        return self._finish(logits, new_cache, n)

    @_host_method
    def release(self, cache: Cache, slot_ids) -> Cache:
        """Empties ``slot_ids [N]`` and returns their pages to the pool. Returns the new cache."""
        self._check_cache(cache)
        sl = self._check_slots(slot_ids, None, cache)
        if sl.shape[0] == 0:
            return cache
        s = cache.num_slots
        nb = self.stream_bucket(sl.shape[0], s)
        sl_p = np.full((nb,), s, np.int32)
        sl_p[:sl.shape[0]] = sl
        return self._release_jit(cache, sl_p)          # NumPy: the program transfers it (no eager op)

    @_host_method
    def fork(self, cache: Cache, src_slot_ids, dst_slot_ids) -> Cache:
        """Slot dst_slot_ids[m] becomes a copy of slot src_slot_ids[m] (its length, GDN state and KV: the full pages
        shared by reference count, a partial last page copied; what dst held is released first): dst continues
        exactly where src stands, and src is unchanged (the prefix cache's snapshot and its restore). Both [M] int in
        [0, max_seqs), no id in both; a source may repeat (one snapshot into several slots), a destination may not.
        Out of pages: refused like a step (``cache.status``, :meth:`check`). Returns the new cache."""
        self._check_cache(cache)
        dst = self._check_slots(dst_slot_ids, None, cache)
        src = _int_array(src_slot_ids, "src_slot_ids", 1, "[M]") if not isinstance(src_slot_ids, (list, tuple)) \
            else np.asarray(src_slot_ids, np.int64).reshape(-1)
        s = cache.num_slots
        if src.size and (src.min() < 0 or src.max() >= s):
            raise ValueError(f"fork: src_slot_ids must lie in [0, {s}) (S = {s} slots); got {src.tolist()}")
        if src.shape != dst.shape:
            raise ValueError(f"fork: src_slot_ids and dst_slot_ids must have the same length; got {src.shape[0]} "
                             f"and {dst.shape[0]}")
        if set(src.tolist()) & set(dst.tolist()):
            raise ValueError(f"fork: a slot cannot be both a source and a destination; got src {src.tolist()}, "
                             f"dst {dst.tolist()}")
        if src.shape[0] == 0:
            return cache
        nb = self.stream_bucket(src.shape[0], s)
        src_p, dst_p = np.full((nb,), s, np.int32), np.full((nb,), s, np.int32)
        src_p[:src.shape[0]], dst_p[:dst.shape[0]] = src, dst
        return self._fork_jit(cache, src_p, dst_p)     # NumPy: the program transfers them (no eager op)

    def __repr__(self):
        c = self.config
        b = self.backends
        short = {"gated_delta_rule": "gdn", "paged_attention": "attention", "moe": "moe"}

        def picks(op):
            calls = self.kernels.get(op)
            name = getattr(b, op)
            if not calls:
                return f"{short[op]}={name}"
            return f"{short[op]}={name} [" + ", ".join(f"{call}: {impl}" for call, impl in calls.items()) + "]"
        return (f"HybridModel({c.model_type}, layers={c.num_hidden_layers} ({len(c.gdn_layers)} GDN / "
                f"{len(c.attn_layers)} attention; scan of {self.plan.repeats} x {self.plan.period} + "
                f"{len(self.plan.tail)}), hidden={c.hidden_size}, vocab={c.vocab_size}, experts={c.num_experts}, "
                f"dtype={self.dtype.name}, backends=({', '.join(picks(op) for op in short)}))")
