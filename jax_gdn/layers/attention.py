"""Gated softmax attention of Qwen3-Next / Qwen3.5 over a paged KV cache.

Shape legend: T stacked tokens of all streams, N streams, D hidden size, H query heads, Hkv kv heads
(G = H / Hkv queries per kv head), Dh head dim, R rotary dims, P pages in the pool, Ps tokens per page, S slots,
W pages per slot in the page table.

Per layer (HF ``Qwen3NextAttention``):
  q_proj(x) -> per head ``[query | gate]`` (2 * Dh); q_norm / k_norm zero-centred fp32 RMSNorm over Dh;
  partial NeoX RoPE on the first R dims; softmax(q k^T * Dh^-0.5) v with GQA; ``o * sigmoid(gate)``; o_proj.

Parameters (one layer, a dict; linear weights stored [in, out] so that ``y = x @ W``):
  q_proj [D, H * 2 * Dh]  k_proj [D, Hkv * Dh]  v_proj [D, Hkv * Dh]  o_proj [H * Dh, D]
  q_norm [Dh]  k_norm [Dh]
or, with the three projections in one GEMM (``fuse_qkv``), qkv_proj [D, H * 2 * Dh + 2 * Hkv * Dh] (columns:
q_proj's, then k_proj's, then v_proj's) in place of q_proj / k_proj / v_proj.

The cache side: new K/V are written to pool pages first (``write_kv_pages``), then every query attends to the
keys of its own slot with position <= its own (``paged_attention``, or ``paged_attention_decode`` for one query
per stream): the earlier tokens of a continued stream come from the pages, the new ones were just written. Both
live in ``pallas_kernels/paged_attention`` (api.py: checks and backend pick; reference.py: the XLA path;
triton.py: the Pallas kernels). Nothing reads a value back to the host: the kernels' loop trip counts come
from the device-side slot lengths, so one compiled program serves any lengths with the same (T, N).

Prefill on the Pallas backends (``fused``, the default there) goes through ``paged_attention_gated``: it takes
the projection's raw output (no slicing), applies the output gate in the kernel's epilogue and writes o_proj's
input; the q RMSNorm + RoPE run in one XLA fusion before the kernel by default (or on the kernel's query tile:
``PrefillConfig.q_prologue``, pallas_kernels/paged_attention/NOTES.md says why not by default). From
``RuntimeOptions.qkv_concat_min_tokens`` tokens the three projections run as one GEMM (a model holds qkv_proj
already: ``RuntimeOptions.hold_fused_qkv``). The cuDNN backends ("cudnn": cuDNN's packed fused attention,
pallas_kernels/paged_attention/cudnn.py; "cudnn_xla" its CPU stand-in) take the same fused entry with the new
K/V handed over (``RuntimeOptions.cudnn_direct``: the q norm / RoPE in one Pallas kernel (``cudnn.Q_PROLOGUE``),
the causal call on the projected k, v, the context call and merge when a stream has context (a long call skips
them otherwise, a short one always runs them: cudnn.FRESH), the gate in the last pass). The XLA backend and
decode take the unfused path (``attention_qkv``, the reference the fused one is
tested against); decode on the cuDNN backends runs the Pallas decode kernel (or XLA), fused with the page writes
where ``RuntimeOptions.attention_decode_fused`` says (``attention_decode_fused``).

``options`` (jax_gdn.options.RuntimeOptions, static; None: the defaults) picks between these implementations of
the same math.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_gdn.config import AttnDims
from jax_gdn.layers.rope import apply_partial_rope, rope_cos_sin
from jax_gdn.ops.norms import rms_norm
from jax_gdn.options import DEFAULT_OPTIONS, RuntimeOptions
from jax_gdn.state import KvPages
from pallas_kernels.paged_attention import api as _pa


def attention_param_shapes(dims: AttnDims) -> dict:
    """Shapes of one layer's parameters (the layout of this module, [in, out])."""
    d, h, hkv, dh = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim
    return {"q_proj": (d, h * 2 * dh), "k_proj": (d, hkv * dh), "v_proj": (d, hkv * dh),
            "o_proj": (h * dh, d), "q_norm": (dh,), "k_norm": (dh,)}


def fuse_qkv(params: dict) -> dict:
    """The same layer with q_proj, k_proj, v_proj concatenated once into qkv_proj [..., D, H 2 Dh + 2 Hkv Dh]
    (one GEMM per call instead of three; leading axes, e.g. the model's stacked layers [R, ...], are kept); the
    other entries are kept. A dict that already holds qkv_proj is returned as is."""
    if "qkv_proj" in params:
        return params
    out = {k: v for k, v in params.items() if k not in ("q_proj", "k_proj", "v_proj")}
    parts = [params["q_proj"], params["k_proj"], params["v_proj"]]
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in parts):      # abstract params (compile-time measurement)
        out["qkv_proj"] = jax.eval_shape(lambda *a: jnp.concatenate(a, axis=-1), *parts)
    else:
        out["qkv_proj"] = jnp.concatenate(parts, axis=-1)
    return out


def fuse_qkv_tree(params):
    """``fuse_qkv`` applied to every attention mixer (a dict holding q_proj, k_proj, v_proj under the key
    "mixer") in a model parameter tree (dicts, tuples and lists rebuilt; every other leaf the same array)."""
    if isinstance(params, dict):
        if "mixer" in params and isinstance(params["mixer"], dict) and "q_proj" in params["mixer"]:
            return {**params, "mixer": fuse_qkv(params["mixer"])}
        return {k: fuse_qkv_tree(v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(fuse_qkv_tree(v) for v in params)
    return params


def _project(params: dict, dims: AttnDims, hidden: jax.Array, concat_min_tokens: int):
    """hidden [T, D] -> (qg [T, C] with head h's [query | gate] at columns h 2 Dh .. (C >= H 2 Dh), k, v
    [T, Hkv, Dh]); one GEMM with qkv_proj (qg is then the whole [T, H 2 Dh + 2 Hkv Dh] output) or, from
    ``concat_min_tokens`` tokens (``RuntimeOptions.qkv_concat_min_tokens``: at prefill sizes one GEMM over the
    concatenated weights beats three; at decode sizes the GEMMs are weight-bandwidth bound and the copy would
    cost about what it saves), with the three weights concatenated; else three GEMMs."""
    t = hidden.shape[0]
    h, hkv, dh = dims.num_heads, dims.num_kv_heads, dims.head_dim
    if "qkv_proj" in params or t >= concat_min_tokens:
        w = params["qkv_proj"] if "qkv_proj" in params else fuse_qkv(params)["qkv_proj"]
        y = hidden @ w
        q_cols = h * 2 * dh
        k = y[:, q_cols:q_cols + hkv * dh].reshape(t, hkv, dh)
        v = y[:, q_cols + hkv * dh:q_cols + 2 * hkv * dh].reshape(t, hkv, dh)
        return y, k, v
    k = (hidden @ params["k_proj"]).reshape(t, hkv, dh)
    v = (hidden @ params["v_proj"]).reshape(t, hkv, dh)
    return hidden @ params["q_proj"], k, v


def _norm_rope_k(params: dict, dims: AttnDims, k: jax.Array, cos, sin):
    k = rms_norm(k, params["k_norm"], dims.rms_norm_eps)
    return apply_partial_rope(k, cos, sin) if dims.rotary_dim else k


# ================================================================================================================
# Stage 1: projections, q/k norms, RoPE
# ================================================================================================================
def attention_qkv(params: dict, dims: AttnDims, hidden: jax.Array, positions: jax.Array, *,
                  options: Optional[RuntimeOptions] = None):
    """Projects ``hidden [T, D]`` at integer ``positions [T]`` (options: ``qkv_concat_min_tokens``).

    Returns q [T, H, Dh] (normed, rotated), k [T, Hkv, Dh] (normed, rotated), v [T, Hkv, Dh], gate [T, H, Dh],
    all in hidden's dtype.
    """
    options = options or DEFAULT_OPTIONS
    t = hidden.shape[0]
    h, dh = dims.num_heads, dims.head_dim
    y, k, v = _project(params, dims, hidden, options.qkv_concat_min_tokens)
    qg = y[:, :h * 2 * dh].reshape(t, h, 2 * dh)                     # per head [query | gate]
    q, gate = qg[..., :dh], qg[..., dh:]
    q = rms_norm(q, params["q_norm"], dims.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, dims.rotary_dim, dims.rope_theta)
    if dims.rotary_dim:
        q = apply_partial_rope(q, cos, sin)
    return q, _norm_rope_k(params, dims, k, cos, sin), v, gate


# ================================================================================================================
# Stage 2: the paged cache
# ================================================================================================================
def write_kv_pages(kv: KvPages, k: jax.Array, v: jax.Array, token_page: jax.Array,
                   token_offset: jax.Array, *, unique: bool = True) -> KvPages:
    """Writes k, v [T, Hkv, Dh] to ``pages[token_page[t], token_offset[t]]``; a token whose page is out of range
    (>= P, e.g. padding, or negative: never wrapped) or whose offset is outside [0, Ps) is dropped. Two kept
    tokens must not share a (page, offset) (which one lands is then undefined).

    unique (``RuntimeOptions.kv_write_unique``): scatter rows of the flat [P Ps, Hkv Dh] pool with
    ``unique_indices`` (every kept token has its own (page, offset), dropped tokens get distinct out-of-range
    rows), so XLA may store the rows directly (no atomic read-modify-write per 16-bit element); False: the
    two-index (page, offset) scatter."""
    p, ps = kv.k_pages.shape[:2]
    if unique:
        t = k.shape[0]
        ok = (token_page >= 0) & (token_page < p) & (token_offset >= 0) & (token_offset < ps)
        rows = jnp.where(ok, token_page * ps + token_offset, p * ps + jnp.arange(t, dtype=jnp.int32))

        def put(pages, x):
            flat = pages.reshape(p * ps, -1).at[rows].set(x.reshape(t, -1).astype(pages.dtype), mode="drop",
                                                          unique_indices=True)
            return flat.reshape(pages.shape)
        return KvPages(k_pages=put(kv.k_pages, k), v_pages=put(kv.v_pages, v))
    token_page = jnp.where(token_page < 0, p, token_page)
    k_pages = kv.k_pages.at[token_page, token_offset].set(k.astype(kv.k_pages.dtype), mode="drop")
    v_pages = kv.v_pages.at[token_page, token_offset].set(v.astype(kv.v_pages.dtype), mode="drop")
    return KvPages(k_pages=k_pages, v_pages=v_pages)


def paged_attention(q: jax.Array, kv: KvPages, page_table: jax.Array, slot_lens: jax.Array,
                    cu_seqlens: jax.Array, slot_ids: jax.Array, *, scale: float, backend: str = "xla") -> jax.Array:
    """Causal attention of stacked queries q [T, H, Dh] of N streams over their own slot's pages (prefill).

    page_table [S, W] int32 (W pages per slot, any width); slot_lens [S] int32: tokens each slot holds AFTER this
    call's K/V were written; cu_seqlens [N + 1], slot_ids [N] int32. Query j of stream n sits at position
    slot_lens[slot] - len_n + j and attends to its slot's keys 0 .. that position. Padding tokens (>= cu[N]),
    streams with a slot id outside [0, S) and page ids outside [0, P) read nothing (zero output rows).
    Returns o [T, H, Dh] in q's dtype. See ``pallas_kernels.paged_attention.api`` for checks and backends.
    """
    return _pa.paged_attention(q, kv.k_pages, kv.v_pages, page_table, slot_lens, cu_seqlens, slot_ids,
                               scale=scale, backend=backend)


def paged_attention_decode(q: jax.Array, kv: KvPages, page_table: jax.Array, slot_lens: jax.Array,
                           slot_ids: jax.Array, *, scale: float, backend: str = "xla") -> jax.Array:
    """One query per stream, q [N, H, Dh], at position slot_lens[slot] - 1 against the slot's whole paged
    context (decode). Returns o [N, H, Dh] in q's dtype; streams with a slot id outside [0, S) get zeros."""
    return _pa.paged_attention_decode(q, kv.k_pages, kv.v_pages, page_table, slot_lens, slot_ids, scale=scale,
                                      backend=backend)


# ================================================================================================================
# The decode step, fused
# ================================================================================================================
def _decode_fused_default(params: dict, dims: AttnDims, dtype, backend: str, enabled: bool) -> bool:
    """Whether attention_layer(decode=True, fused=None) takes the fused step: ``enabled``
    (``RuntimeOptions.attention_decode_fused``), the projections held as one qkv_proj (with three weights the
    fused step is slower than the unfused one, so it is not taken) and a Pallas decode kernel (the Pallas
    backends, and the cuDNN ones, whose decode is the Pallas kernel)."""
    if not enabled or "qkv_proj" not in params:
        return False
    kw = dict(dtype=dtype, head_dim=dims.head_dim, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads)
    return _pa.decode_backend(_pa.resolve_backend(backend, **kw), **kw) in ("pallas", "pallas_interpret")


def attention_decode_fused(params: dict, dims: AttnDims, hidden: jax.Array, kv: KvPages, *, token_pos, token_page,
                           token_offset, page_table, slot_lens, slot_ids, backend: str, config=None,
                           options: Optional[RuntimeOptions] = None):
    """One decode step (hidden [N, D], one token per stream) through the fused kernels: one kernel for k norm +
    RoPE + both page writes (``paged_kv_write``), the gated decode kernel (gate in its epilogue / the combine; q
    norm + RoPE where DecodeConfig.q_prologue says), o_proj. The arguments and the result are
    ``attention_layer``'s (the metadata already checked). With qkv_proj one GEMM feeds the q, k and v kernels
    (column offsets, no slices); with three weights, three GEMMs (options: ``qkv_concat_min_tokens``)."""
    h, hkv, dh = dims.num_heads, dims.num_kv_heads, dims.head_dim
    y, k, v = _project(params, dims, hidden, (options or DEFAULT_OPTIONS).qkv_concat_min_tokens)
    cos, sin = rope_cos_sin(token_pos, dims.rotary_dim, dims.rope_theta)
    if "qkv_proj" in params:
        yk, yv, k_col, v_col = y, y, h * 2 * dh, h * 2 * dh + hkv * dh
    else:
        yk, yv, k_col, v_col = k.reshape(k.shape[0], hkv * dh), v.reshape(v.shape[0], hkv * dh), 0, 0
    kp, vp = _pa.paged_kv_write(kv.k_pages, kv.v_pages, yk, yv, token_page, token_offset, k_norm=params["k_norm"],
                                cos=cos, sin=sin, k_col=k_col, v_col=v_col, eps=dims.rms_norm_eps,
                                backend=backend)
    kv = KvPages(k_pages=kp, v_pages=vp)
    o = _pa.paged_attention_decode_gated(y, kp, vp, page_table, slot_lens, slot_ids, q_norm=params["q_norm"],
                                         cos=cos, sin=sin, num_heads=h, scale=dh ** -0.5, eps=dims.rms_norm_eps,
                                         backend=backend, config=config)                  # [N, H * Dh]
    return (o @ params["o_proj"]).astype(hidden.dtype), kv


# ================================================================================================================
# The layer
# ================================================================================================================
def attention_layer(params: dict, dims: AttnDims, hidden: jax.Array, kv: KvPages, *, token_pos: jax.Array,
                    token_page: jax.Array, token_offset: jax.Array, page_table: jax.Array, slot_lens: jax.Array,
                    cu_seqlens: jax.Array, slot_ids: jax.Array, decode: bool = False, backend: str = "xla",
                    fused: bool | None = None, options: Optional[RuntimeOptions] = None):
    """One gated attention layer over stacked tokens (prefill of N streams, or one decode step).

    hidden [T, D]; token_pos [T] int32 (absolute position, for RoPE); token_page / token_offset [T] int32 (where
    each token's K/V go; a page >= P drops the write, e.g. padding); page_table [S, W] and slot_lens [S] describe
    the pool *after* this call's allocation and writes; cu_seqlens [N + 1], slot_ids [N] the streams (see
    ``paged_attention`` for the padding contract). decode (static): one token per stream (T == N, token n is
    stream n's, cu_seqlens is then ignored) through ``paged_attention_decode``.
    backend: "xla" | "pallas" | "pallas_interpret" | "cudnn" | "cudnn_xla" | "auto"
    (``pallas_kernels.paged_attention.api``).
    fused (static): prefill through ``paged_attention_gated`` (the gate in the kernel's epilogue, the q norm and
    RoPE before it or in it; on the cuDNN backends with this call's K/V handed over); None: on the Pallas
    backends, and on the cuDNN ones when ``options.cudnn_direct``, not on "xla" (the same math, unfused). Decode:
    fused runs ``attention_decode_fused`` (None: when ``options.attention_decode_fused`` is set, params hold
    qkv_proj and the decode kernel is the Pallas one).
    options: jax_gdn.options.RuntimeOptions (static; None: the defaults).
    Returns (out [T, D] in hidden's dtype, new KvPages).
    """
    options = options or DEFAULT_OPTIONS
    t = hidden.shape[0]
    if decode and t != slot_ids.shape[0]:
        raise ValueError(f"attention_layer(decode=True) takes one token per stream: hidden has T={t} rows "
                         f"but slot_ids has N={slot_ids.shape[0]}")
    # metadata checks (values too when concrete) before anything is computed or written
    _pa.check_call(page_table, slot_lens, cu_seqlens, slot_ids, num_pages=kv.num_pages, page_size=kv.page_size,
                   num_tokens=t, decode=decode)
    scale = dims.head_dim ** -0.5
    if decode and (fused or (fused is None and _decode_fused_default(params, dims, hidden.dtype, backend,
                                                                     options.attention_decode_fused))):
        return attention_decode_fused(params, dims, hidden, kv, token_pos=token_pos, token_page=token_page,
                                      token_offset=token_offset, page_table=page_table, slot_lens=slot_lens,
                                      slot_ids=slot_ids, backend=backend, options=options)
    if fused is None:
        fused = not decode and _pa.resolve_backend(
            backend, dtype=hidden.dtype, head_dim=dims.head_dim, num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads) in (("pallas", "pallas_interpret")
                                                + (("cudnn", "cudnn_xla") if options.cudnn_direct else ()))
    if fused and not decode:
        y, k, v = _project(params, dims, hidden, options.qkv_concat_min_tokens)
        cos, sin = rope_cos_sin(token_pos, dims.rotary_dim, dims.rope_theta)
        k = _norm_rope_k(params, dims, k, cos, sin)
        kv = write_kv_pages(kv, k, v, token_page, token_offset, unique=options.kv_write_unique)
        o = _pa.paged_attention_gated(y, kv.k_pages, kv.v_pages, page_table, slot_lens, cu_seqlens, slot_ids,
                                      q_norm=params["q_norm"], cos=cos, sin=sin, num_heads=dims.num_heads,
                                      scale=scale, eps=dims.rms_norm_eps, backend=backend, k_new=k,
                                      v_new=v)                                          # [T, H * Dh]
        o = checkpoint_name(o, "attention_core")   # what RuntimeOptions(remat="layers") keeps for the backward
        return (o @ params["o_proj"]).astype(hidden.dtype), kv
    q, k, v, gate = attention_qkv(params, dims, hidden, token_pos, options=options)
    kv = write_kv_pages(kv, k, v, token_page, token_offset, unique=options.kv_write_unique)
    if decode:
        o = paged_attention_decode(q, kv, page_table, slot_lens, slot_ids, scale=scale, backend=backend)
    else:
        o = paged_attention(q, kv, page_table, slot_lens, cu_seqlens, slot_ids, scale=scale,
                            backend=backend)                                             # [T, H, Dh]
    o = checkpoint_name(o, "attention_core")       # what RuntimeOptions(remat="layers") keeps for the backward
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    out = o.reshape(t, dims.num_heads * dims.head_dim) @ params["o_proj"]
    return out.astype(hidden.dtype), kv
