"""HybridModel: a Qwen3-Next / Qwen3.5 decoder (GDN + gated attention layers) over one cache pytree.

Shape legend: T stacked tokens of all streams in one call, N streams in the call, S slots (max_seqs), D hidden
size, Vocab vocabulary, P KV pages in the pool, Ps tokens per page, A = min(P, T // Ps + N) pages a call can
allocate at most.

    model = load_pretrained(path, dtype=jnp.bfloat16)            # or HybridModel(config, params)
    cache = model.init_cache(max_seqs=8, max_tokens=4096, page_size=16)
    logits, cache = model.prefill(cache, input_ids, cu_seqlens, slot_ids, return_all_logits=False)
    logits, cache = model.decode(cache, input_ids, slot_ids)
    cache = model.release(cache, slot_ids)

- prefill: input_ids int [T] (the stacked tokens of N streams), cu_seqlens int [N + 1] (stream n owns tokens
  cu_seqlens[n]:cu_seqlens[n+1], every stream at least one token), slot_ids int [N] (distinct, < S). Returns the
  last token's logits of each stream [N, Vocab] fp32 (or every token's [T, Vocab] with return_all_logits=True).
  A slot holding no tokens starts fresh (its stale GDN state and pages are ignored); a slot holding tokens
  continues (chunked prefill): positions, conv / recurrent state and KV pages carry on.
- decode: one token per stream, input_ids [N], slot_ids [N]; returns [N, Vocab] fp32.
- release: empties the slots and returns their pages to the pool.

prefill / decode / release are jit-compiled pure functions of the cache, which is donated (updated in place): use
the returned cache, never the one passed in. Page allocation happens on the device (free bitmap
``page_owner < 0``); when the pool cannot hold the call's new tokens, the jitted function leaves the cache as it
was and returns a flag, and the wrapper raises :class:`OutOfKvPagesError` carrying that (unchanged) cache.

backend: "auto" (default) is handed to the GDN layers, which run the Pallas kernel on a GPU where it accepts the
head dims and XLA elsewhere; "xla" / "pallas" / "pallas_interpret" force one. Attention always runs the XLA
paged attention (jax_gdn.layers.attention.paged_attention is the one function a kernel would replace).

Parameters (a pytree of dicts, weights [in, out]):
    embed [Vocab, D]; final_norm [D]; lm_head [D, Vocab] (absent when tied: embed.T is used);
    GDN layer i:       {"mixer": jax_gdn.layers.gdn params (HF names, torch [out, in] layout, with
                        "input_layernorm"), "post_norm": [D], "ffn": MLP or MoE params}
    attention layer i: {"input_norm": [D], "mixer": jax_gdn.layers.attention params, "post_norm": [D], "ffn": ...}
FFN params: see jax_gdn.layers.ffn.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_gdn.config import HybridConfig
from jax_gdn.layers.attention import attention_layer, attention_plan, build_query_blocks
from jax_gdn.layers.ffn import sparse_moe, swiglu_mlp
from jax_gdn.layers.gdn import gdn_layer_decode, gdn_layer_prefill
from jax_gdn.ops import validation
from jax_gdn.ops.norms import rms_norm
from jax_gdn.ops.varlen import token_streams
from jax_gdn.state import BatchMeta, Cache, GdnSlots, KvPages


class OutOfKvPagesError(RuntimeError):
    """The KV page pool cannot hold a call's new tokens. Nothing was written; ``.cache`` is the cache to keep
    using (the one passed in was donated)."""

    def __init__(self, message: str, cache: Cache):
        super().__init__(message)
        self.cache = cache


# ================================================================================================================
# Page allocation (on device)
# ================================================================================================================
def _allocate(cache: Cache, slot_ids, old_lens, seq_lens, total_tokens: int):
    """New pages for N streams growing from old_lens to old_lens + seq_lens. Returns (page_table, page_owner,
    page_index, ok): ok is False when the pool has too few free pages (then nothing must be written)."""
    ps, p, s = cache.page_size, cache.num_pages, cache.num_slots
    n = slot_ids.shape[0]
    have = (old_lens + ps - 1) // ps                                               # [N] pages held
    need = (old_lens + seq_lens + ps - 1) // ps                                    # [N] pages needed
    new = need - have
    new_end = jnp.cumsum(new)
    new_off = new_end - new
    total = new_end[-1]
    free = cache.page_owner < 0
    ok = total <= jnp.sum(free.astype(jnp.int32))
    a = min(p, total_tokens // ps + n)                                             # static bound of new pages
    free_ids = jnp.nonzero(free, size=a, fill_value=p)[0].astype(jnp.int32)        # [A]
    j = jnp.arange(a, dtype=jnp.int32)
    stream = jnp.minimum(jnp.searchsorted(new_end, j, side="right"), n - 1)
    valid = (j < total) & ok
    slot_j = slot_ids[stream]
    idx_j = have[stream] + j - new_off[stream]
    page_table = cache.page_table.at[jnp.where(valid, slot_j, s), idx_j].set(free_ids, mode="drop")
    page_owner = cache.page_owner.at[jnp.where(valid, free_ids, p)].set(slot_j, mode="drop")
    page_index = cache.page_index.at[jnp.where(valid, free_ids, p)].set(idx_j, mode="drop")
    return page_table, page_owner, page_index, ok


# ================================================================================================================
# The forward pass (pure; jitted by HybridModel)
# ================================================================================================================
def forward(params: dict, cache: Cache, input_ids: jax.Array, cu_seqlens: jax.Array, slot_ids: jax.Array, *,
            config: HybridConfig, backend: str, return_all_logits: bool, decode: bool, window_pages: int = 0,
            block_q: int = 1):
    """Prefill (or decode, with one token per stream) of N streams. Returns (logits fp32, new cache, status).

    window_pages / block_q (static): the attention plan (``jax_gdn.layers.attention.attention_plan``); every
    stream of the call must end up holding at most window_pages * Ps tokens (0: the whole pool).
    status: 0 done; 1 out of KV pages; 2 a stream longer than the attention window. Unless 0, the cache is
    returned unchanged and the logits are zeros.
    """
    t = input_ids.shape[0]
    n = slot_ids.shape[0]
    ps = cache.page_size
    seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]                                    # [N]
    old_lens = cache.slot_lens[slot_ids]                                           # [N]
    has_init = old_lens > 0
    meta = BatchMeta(cu_seqlens=cu_seqlens, slot_ids=slot_ids, has_initial_state=has_init, positions=old_lens)

    # ---- per-token metadata -----------------------------------------------------------------------------------
    tok_stream, tok_rel = token_streams(cu_seqlens, t)                             # [T], [T]
    tok_slot = slot_ids[tok_stream]
    tok_pos = old_lens[tok_stream] + tok_rel

    if config.attn_layers:
        page_table, page_owner, page_index, ok = _allocate(cache, slot_ids, old_lens, seq_lens, t)
    else:  # no attention layer: no KV pages to hand out
        page_table, page_owner, page_index, ok = (cache.page_table, cache.page_owner, cache.page_index,
                                                  jnp.asarray(True))
    tok_page = page_table[tok_slot, jnp.minimum(tok_pos // ps, cache.num_pages - 1)]
    tok_page = jnp.where(ok, tok_page, cache.num_pages)                            # drop every write if not ok
    tok_offset = tok_pos % ps
    new_slot_lens = cache.slot_lens.at[slot_ids].add(seq_lens)                     # [S] after this call
    window = window_pages or cache.num_pages
    if config.attn_layers:
        blocks = build_query_blocks(cu_seqlens, slot_ids, t, block_q)
        window_ok = jnp.max(new_slot_lens[slot_ids]) <= window * ps
    else:
        blocks, window_ok = None, jnp.asarray(True)
    status = jnp.where(ok, jnp.where(window_ok, 0, 2), 1).astype(jnp.int32)
    tok_page = jnp.where(status == 0, tok_page, cache.num_pages)

    out_rows = t if return_all_logits else n
    vocab = config.vocab_size

    def run(cache):
        x = params["embed"][input_ids]                                             # [T, D]
        gdn_states, kv_states = list(cache.gdn), list(cache.kv)
        gi = ai = 0
        for i, layer in enumerate(params["layers"]):
            if config.layer_types[i] == "linear_attention":
                # jax_gdn.layers.gdn owns the input norm and the residual add: x -> x + gdn(norm(x))
                if decode:
                    x, gdn_states[gi] = gdn_layer_decode(layer["mixer"], config.gdn_dims, x, gdn_states[gi],
                                                         slot_ids, has_init)
                else:
                    x, gdn_states[gi] = gdn_layer_prefill(layer["mixer"], config.gdn_dims, x, gdn_states[gi],
                                                          meta, backend=backend)
                gi += 1
            else:
                h = rms_norm(x, layer["input_norm"], config.rms_norm_eps)
                h, kv_states[ai] = attention_layer(
                    layer["mixer"], config.attn_dims, h, kv_states[ai], token_pos=tok_pos, token_page=tok_page,
                    token_offset=tok_offset, page_table=page_table, slot_lens=new_slot_lens, blocks=blocks,
                    window_pages=window, backend=backend)
                ai += 1
                x = x + h
            h = rms_norm(x, layer["post_norm"], config.rms_norm_eps)
            if config.layer_is_moe(i):
                h = sparse_moe(layer["ffn"], h, top_k=config.num_experts_per_tok,
                               norm_topk_prob=config.norm_topk_prob)
            else:
                h = swiglu_mlp(layer["ffn"], h)
            x = x + h
        if not return_all_logits:
            x = x[cu_seqlens[1:] - 1]                                              # last token of each stream
        x = rms_norm(x, params["final_norm"], config.rms_norm_eps)
        head = params["lm_head"] if "lm_head" in params else params["embed"].T
        logits = jnp.matmul(x, head, preferred_element_type=jnp.float32)
        new_cache = cache.replace(
            gdn=tuple(gdn_states), kv=tuple(kv_states), page_table=page_table, page_owner=page_owner,
            page_index=page_index, slot_lens=new_slot_lens)
        return logits, new_cache

    def skip(cache):
        return jnp.zeros((out_rows, vocab), jnp.float32), cache

    logits, new_cache = jax.lax.cond(status == 0, run, skip, cache)
    return logits, new_cache, status


def release_slots(cache: Cache, slot_ids: jax.Array) -> Cache:
    """Empties the slots: their pages go back to the free pool, their lengths to 0 (state is ignored after)."""
    s = cache.num_slots
    releasing = jnp.zeros((s,), bool).at[slot_ids].set(True)
    owner = cache.page_owner
    freed = (owner >= 0) & releasing[jnp.maximum(owner, 0)]
    return cache.replace(
        page_owner=jnp.where(freed, -1, owner),
        page_index=jnp.where(freed, 0, cache.page_index),
        page_table=jnp.where(releasing[:, None], 0, cache.page_table),
        slot_lens=jnp.where(releasing, 0, cache.slot_lens))


_forward_jit = jax.jit(forward, static_argnames=("config", "backend", "return_all_logits", "decode",
                                                "window_pages", "block_q"),
                       donate_argnames=("cache",))
_release_jit = jax.jit(release_slots, donate_argnames=("cache",))


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


# ================================================================================================================
# The model
# ================================================================================================================
class HybridModel:
    """A hybrid GDN + attention decoder with its parameters; see the module docstring for the API and shapes."""

    def __init__(self, config: HybridConfig, params: dict, *, dtype=jnp.bfloat16, backend: str = "auto"):
        if not isinstance(config, HybridConfig):
            raise ValueError(f"config must be a HybridConfig, got {type(config).__name__}")
        validation.check_backend(backend)
        if len(params["layers"]) != config.num_hidden_layers:
            raise ValueError(f"params['layers'] has {len(params['layers'])} layers, config says "
                             f"{config.num_hidden_layers}")
        self.config = config
        self.params = params
        self.dtype = jnp.dtype(dtype)
        self.backend = backend

    # ---- cache ------------------------------------------------------------------------------------------------
    def init_cache(self, max_seqs: int = 8, max_tokens: int = 4096, page_size: int = 16) -> Cache:
        """An empty cache for up to ``max_seqs`` concurrent streams (slots) and a KV pool of
        ``ceil(max_tokens / page_size)`` pages shared by all slots (max_tokens tokens in total)."""
        for name, value in (("max_seqs", max_seqs), ("max_tokens", max_tokens), ("page_size", page_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
        cfg = self.config
        num_pages = -(-int(max_tokens) // int(page_size))
        gdn = tuple(GdnSlots.zeros(cfg.gdn_dims, int(max_seqs), self.dtype) for _ in cfg.gdn_layers)
        kv = tuple(KvPages.zeros(num_pages, int(page_size), cfg.num_key_value_heads, cfg.head_dim, self.dtype)
                   for _ in cfg.attn_layers)
        return Cache(gdn=gdn, kv=kv,
                     page_table=jnp.zeros((int(max_seqs), num_pages), jnp.int32),
                     page_owner=jnp.full((num_pages,), -1, jnp.int32),
                     page_index=jnp.zeros((num_pages,), jnp.int32),
                     slot_lens=jnp.zeros((int(max_seqs),), jnp.int32),
                     page_size=int(page_size))

    def _check_cache(self, cache):
        if not isinstance(cache, Cache):
            raise ValueError(f"cache must be the Cache returned by init_cache / prefill, got {type(cache).__name__}")
        if len(cache.gdn) != len(self.config.gdn_layers) or len(cache.kv) != len(self.config.attn_layers):
            raise ValueError(f"cache has {len(cache.gdn)} GDN / {len(cache.kv)} attention layers; the model has "
                             f"{len(self.config.gdn_layers)} / {len(self.config.attn_layers)}")

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

    def _run(self, cache, ids, cu, sl, *, return_all_logits, decode):
        window, block_q = 0, 1
        if self.config.attn_layers:
            # the attention plan (static sizes) from the slot lengths: the previous call has finished anyway
            # (its status was read), so this read costs a tiny transfer, not a pipeline stall
            new_lens = np.diff(cu)
            total = np.asarray(cache.slot_lens)[sl] + new_lens
            window, block_q = attention_plan(int(total.max()), int(new_lens.max()), cache.num_pages,
                                             cache.page_size, self.config.num_attention_heads)
        logits, new_cache, status = _forward_jit(
            self.params, cache, jnp.asarray(ids, jnp.int32), jnp.asarray(cu, jnp.int32), jnp.asarray(sl, jnp.int32),
            config=self.config, backend=self.backend, return_all_logits=bool(return_all_logits),
            decode=decode, window_pages=window, block_q=block_q)
        status = int(status)
        if status == 2:  # pragma: no cover - the plan above always covers the call
            raise OutOfKvPagesError("internal: attention window smaller than a stream; nothing was written; "
                                    "continue with the error's .cache", new_cache)
        if status == 1:
            raise OutOfKvPagesError(
                f"out of KV pages: the pool ({new_cache.num_pages} pages of {new_cache.page_size} tokens) cannot "
                f"hold this call's {int(ids.shape[0])} new tokens; nothing was written. Release slots or make a "
                f"larger cache (init_cache max_tokens); continue with the error's .cache", new_cache)
        return logits, new_cache

    # ---- prefill / decode / release ---------------------------------------------------------------------------
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
        return self._run(cache, ids, cu, sl, return_all_logits=return_all_logits, decode=False)

    def decode(self, cache: Cache, input_ids, slot_ids):
        """One token per stream: input_ids [N], slot_ids [N]. Returns (logits [N, Vocab] fp32, new cache)."""
        self._check_cache(cache)
        ids = _int_array(input_ids, "input_ids", 1, "[N]")
        n = ids.shape[0]
        if n < 1:
            raise ValueError("input_ids must have shape [N] with N >= 1 (one token per stream)")
        sl = self._check_slots(slot_ids, n, cache)
        self._check_tokens(ids)
        cu = np.arange(n + 1, dtype=np.int64)
        return self._run(cache, ids, cu, sl, return_all_logits=False, decode=True)

    def release(self, cache: Cache, slot_ids) -> Cache:
        """Empties ``slot_ids [N]`` and returns their pages to the pool. Returns the new cache."""
        self._check_cache(cache)
        sl = self._check_slots(slot_ids, None, cache)
        if sl.shape[0] == 0:
            return cache
        return _release_jit(cache, jnp.asarray(sl, jnp.int32))

    def __repr__(self):
        c = self.config
        return (f"HybridModel({c.model_type}, layers={c.num_hidden_layers} ({len(c.gdn_layers)} GDN / "
                f"{len(c.attn_layers)} attention), hidden={c.hidden_size}, vocab={c.vocab_size}, "
                f"experts={c.num_experts}, dtype={self.dtype.name}, backend={self.backend})")
