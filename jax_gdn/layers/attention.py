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
``QKV_CONCAT_MIN_TOKENS`` tokens the three projections run as one GEMM (a model holds qkv_proj already:
``HOLD_FUSED_QKV``). The cuDNN backends ("cudnn": cuDNN's packed fused attention,
pallas_kernels/paged_attention/cudnn.py; "cudnn_xla" its CPU stand-in) take the same fused entry with the new
K/V handed over (``CUDNN_DIRECT``: the q norm / RoPE in one Pallas kernel (``cudnn.Q_PROLOGUE``), the causal
call on the projected k, v, the context call and merge only when a stream has context, the gate in the last
pass). The XLA backend and decode take the
unfused path (``attention_qkv``, the reference the fused one is tested against); decode on the cuDNN backends
runs the Pallas decode kernel (or XLA).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_gdn.config import AttnDims
from jax_gdn.layers.rope import apply_partial_rope, rope_cos_sin
from jax_gdn.ops.norms import rms_norm
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


#: The model (one device, no mesh) holds each attention layer's projections as ONE qkv_proj weight, concatenated
#: once when the model is built (``fuse_qkv_tree``): the per-call concat (0.13 ms per attention layer per prefill
#: call on the H200 at varlen16, 37.7 MB) goes away and decode runs one GEMM instead of three. Under a mesh the
#: three weights stay (jax_gdn.sharding splits each one's columns by heads; one fused weight would need a
#: per-device column order). False: keep the three weights (the layer then concatenates from
#: QKV_CONCAT_MIN_TOKENS tokens).
HOLD_FUSED_QKV = True


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


# From this many tokens (static T) the layer concatenates q_proj, k_proj, v_proj at call time and runs ONE GEMM:
# on the H200 at varlen16 (T 19027, 80B dims) the three GEMMs + o_proj took 1.60 ms, one fused + o_proj 1.43 ms
# (NOTES.md, run 3), while the weight copy is ~38 MB read + written (~0.02 ms, estimated, not measured). Below it
# (decode, short chunks: the GEMMs are weight-bandwidth bound) the copy would cost about what it saves. A model
# holding qkv_proj (``fuse_qkv``) skips the copy at any T.
QKV_CONCAT_MIN_TOKENS = 8192

#: Prefill on the cuDNN backends goes through ``paged_attention_gated`` with the new K/V straight from the
#: projection (``cudnn.prefill_direct``: no gather of them back from the pages, the gate in the merge's pass, no
#: context call when no stream has context). False: the unfused path (q / gate sliced here, the cuDNN core
#: gathering every key from the pages, context call and merge always).
CUDNN_DIRECT = True


def _project(params: dict, dims: AttnDims, hidden: jax.Array):
    """hidden [T, D] -> (qg [T, C] with head h's [query | gate] at columns h 2 Dh .. (C >= H 2 Dh), k, v
    [T, Hkv, Dh]); one GEMM with qkv_proj (qg is then the whole [T, H 2 Dh + 2 Hkv Dh] output) or, from
    QKV_CONCAT_MIN_TOKENS tokens, with the three weights concatenated; else three GEMMs."""
    t = hidden.shape[0]
    h, hkv, dh = dims.num_heads, dims.num_kv_heads, dims.head_dim
    if "qkv_proj" in params or t >= QKV_CONCAT_MIN_TOKENS:
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
def attention_qkv(params: dict, dims: AttnDims, hidden: jax.Array, positions: jax.Array):
    """Projects ``hidden [T, D]`` at integer ``positions [T]``.

    Returns q [T, H, Dh] (normed, rotated), k [T, Hkv, Dh] (normed, rotated), v [T, Hkv, Dh], gate [T, H, Dh],
    all in hidden's dtype.
    """
    t = hidden.shape[0]
    h, dh = dims.num_heads, dims.head_dim
    y, k, v = _project(params, dims, hidden)
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
#: How ``write_kv_pages`` scatters: True: rows of the flat [P Ps, Hkv Dh] pool with ``unique_indices`` (every
#: kept token has its own (page, offset), dropped tokens get distinct out-of-range rows), so XLA may store the
#: rows directly (no atomic read-modify-write per 16-bit element); False: the two-index (page, offset) scatter.
KV_WRITE_UNIQUE = True


def write_kv_pages(kv: KvPages, k: jax.Array, v: jax.Array, token_page: jax.Array,
                   token_offset: jax.Array) -> KvPages:
    """Writes k, v [T, Hkv, Dh] to ``pages[token_page[t], token_offset[t]]``; a token whose page is out of range
    (>= P, e.g. padding, or negative: never wrapped) or whose offset is outside [0, Ps) is dropped. Two kept
    tokens must not share a (page, offset) (which one lands is then undefined)."""
    p, ps = kv.k_pages.shape[:2]
    if KV_WRITE_UNIQUE:
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
# The decode step, fused (pallas_kernels/paged_attention/NOTES.md "Session 6: decode")
# ================================================================================================================
#: attention_layer(decode=True, fused=None) on the Pallas backends (and the cuDNN ones, whose decode is the Pallas
#: kernel), with the projections held as one qkv_proj, takes ``attention_decode_fused``: one GEMM, one kernel for
#: k norm + RoPE + both page writes (``paged_kv_write``), the gated decode kernel (gate in its epilogue / the
#: combine; q norm + RoPE where DecodeConfig.q_prologue says: in the kernel for 16-bit inputs), o_proj. H200
#: (pallas_kernels/paged_attention/NOTES.md "Session 6: decode" and "Session 7: decode step"; 64 streams x 1189
#: context, 80B dims, in-program, floor 0.0439): session 7, 2 splits, interleaved x3: 0.0811-0.0879 ms (median
#: 0.0816) with the in-kernel q prologue, 0.0831-0.0897 (0.0889) with the XLA one; unfused with qkv_proj 0.0851-0.0949;
#: with three weights the fused step measured 0.110 ms (session 6), so it is not taken then.
#: False: the unfused path (XLA norms, RoPE, two scatters, gate pass).
DECODE_FUSED = True


def _decode_fused_default(params: dict, dims: AttnDims, dtype, backend: str) -> bool:
    """Whether attention_layer(decode=True, fused=None) takes the fused step (DECODE_FUSED's rule)."""
    if not DECODE_FUSED or "qkv_proj" not in params:
        return False
    kw = dict(dtype=dtype, head_dim=dims.head_dim, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads)
    return _pa.decode_backend(_pa.resolve_backend(backend, **kw), **kw) in ("pallas", "pallas_interpret")


def attention_decode_fused(params: dict, dims: AttnDims, hidden: jax.Array, kv: KvPages, *, token_pos, token_page,
                           token_offset, page_table, slot_lens, slot_ids, backend: str, config=None):
    """One decode step (hidden [N, D], one token per stream) through the fused kernels; the arguments and the
    result are ``attention_layer``'s (the metadata already checked). With qkv_proj one GEMM feeds the q, k and
    v kernels (column offsets, no slices); with three weights, three GEMMs."""
    h, hkv, dh = dims.num_heads, dims.num_kv_heads, dims.head_dim
    y, k, v = _project(params, dims, hidden)
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
                    fused: bool | None = None):
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
    backends, and on the cuDNN ones when ``CUDNN_DIRECT``, not on "xla" (the same math, unfused). Decode:
    fused runs ``attention_decode_fused`` (None: when DECODE_FUSED is set, params hold qkv_proj and the decode
    kernel is the Pallas one).
    Returns (out [T, D] in hidden's dtype, new KvPages).
    """
    t = hidden.shape[0]
    if decode and t != slot_ids.shape[0]:
        raise ValueError(f"attention_layer(decode=True) takes one token per stream: hidden has T={t} rows "
                         f"but slot_ids has N={slot_ids.shape[0]}")
    # metadata checks (values too when concrete) before anything is computed or written
    _pa.check_call(page_table, slot_lens, cu_seqlens, slot_ids, num_pages=kv.num_pages, page_size=kv.page_size,
                   num_tokens=t, decode=decode)
    scale = dims.head_dim ** -0.5
    if decode and (fused or (fused is None and _decode_fused_default(params, dims, hidden.dtype, backend))):
        return attention_decode_fused(params, dims, hidden, kv, token_pos=token_pos, token_page=token_page,
                                      token_offset=token_offset, page_table=page_table, slot_lens=slot_lens,
                                      slot_ids=slot_ids, backend=backend)
    if fused is None:
        fused = not decode and _pa.resolve_backend(
            backend, dtype=hidden.dtype, head_dim=dims.head_dim, num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads) in (("pallas", "pallas_interpret")
                                                + (("cudnn", "cudnn_xla") if CUDNN_DIRECT else ()))
    if fused and not decode:
        y, k, v = _project(params, dims, hidden)
        cos, sin = rope_cos_sin(token_pos, dims.rotary_dim, dims.rope_theta)
        k = _norm_rope_k(params, dims, k, cos, sin)
        kv = write_kv_pages(kv, k, v, token_page, token_offset)
        o = _pa.paged_attention_gated(y, kv.k_pages, kv.v_pages, page_table, slot_lens, cu_seqlens, slot_ids,
                                      q_norm=params["q_norm"], cos=cos, sin=sin, num_heads=dims.num_heads,
                                      scale=scale, eps=dims.rms_norm_eps, backend=backend, k_new=k,
                                      v_new=v)                                          # [T, H * Dh]
        return (o @ params["o_proj"]).astype(hidden.dtype), kv
    q, k, v, gate = attention_qkv(params, dims, hidden, token_pos)
    kv = write_kv_pages(kv, k, v, token_page, token_offset)
    if decode:
        o = paged_attention_decode(q, kv, page_table, slot_lens, slot_ids, scale=scale, backend=backend)
    else:
        o = paged_attention(q, kv, page_table, slot_lens, cu_seqlens, slot_ids, scale=scale,
                            backend=backend)                                             # [T, H, Dh]
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    out = o.reshape(t, dims.num_heads * dims.head_dim) @ params["o_proj"]
    return out.astype(hidden.dtype), kv
