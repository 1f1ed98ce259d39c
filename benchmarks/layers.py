"""Section "layers": one GDN layer's whole split prefill (phases 1-3) and one gated attention layer prefill, at
Qwen3-Next-80B dims on the 16-stream varlen case, per backend (on a GPU: "pallas" and "cudnn", the attention-only
backend; ``bench_layers`` takes any backend of the layers).

Qwen3-Next-80B-A3B dims: hidden 2048; GDN 16 key / 32 value heads x 128, conv 4; attention 16 q / 2 kv heads x 256
(partial RoPE 0.25); bf16 activations and weights, fp32 recurrent state. Lens: ``benchmarks.cases.VARLEN16_LENS``
(T = 19027 tokens, N = 16), every stream fresh.
``small`` (the section's ``quick``) shrinks dims and lens so that it runs on a CPU in seconds (a smoke test, not a
measurement).

GDN phases (jax_gdn.layers.gdn, each jitted on its own, inputs precomputed):
  phase1  input RMSNorm + in_proj (phase1_proj_batched), varlen causal conv (phase1_conv1d_varlen), q/k L2 norm
          (phase1_l2_batched): gdn.phase1_varlen, as the model's GDN block runs it
  phase2  the chunked gated delta rule over the slot pool (gdn_full_varlen)
  phase3  gated RMSNorm, out_proj, residual (phase3)
  layer   gdn_layer_prefill, the three chained in one jit (what the model runs)
Attention: jax_gdn.layers.attention.attention_layer (projections, norms, RoPE, K/V page writes, paged causal
attention, gate, o_proj) into an empty pool of 16-token pages handed out in a shuffled order, the page table
[N, W] as wide as the longest stream needs; the paged attention runs the layer's backend
(pallas_kernels.paged_attention: "pallas" the Triton kernel, "xla" the reference gathering all W pages per block,
"cudnn" cuDNN's packed fused attention (``RuntimeOptions.cudnn_direct``: the new K/V straight from the projection,
the gate in the merge's pass); the GDN layer is not timed for "cudnn" / "cudnn_xla", attention-only backends).
The q/k/v projections are one qkv_proj weight when ``RuntimeOptions.hold_fused_qkv`` (as the model holds them).

Times are medians of ``reps`` calls (each closed by block_until_ready) after one warm-up call.
Returns / prints tokens/s (T / time) and the share of each GDN phase in the sum of the three.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cases import VARLEN16_LENS

KEY = "layers"
#: the backends of the section on a GPU (off a GPU: "xla")
GPU_BACKENDS = ("pallas", "cudnn")
LENS_SMALL = [190, 64, 51, 1, 130, 77, 63, 65]


def _dims(small: bool):
    from jax_gdn.config import AttnDims, GdnDims
    if small:
        return (GdnDims(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32),
                AttnDims(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32), LENS_SMALL)
    return (GdnDims(hidden_size=2048, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                    conv_kernel_size=4),
            AttnDims(hidden_size=2048, num_heads=16, num_kv_heads=2, head_dim=256, partial_rotary_factor=0.25,
                     rope_theta=10_000_000.0),
            list(VARLEN16_LENS))


def _median_time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))                      # warm-up (compile)
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_layers(backend: str = "xla", reps: int = 10, *, small: bool = False, dtype=jnp.bfloat16,
                 seed: int = 0, with_gdn: bool = True) -> dict:
    """Times one GDN layer (phases 1-3 and whole; skipped with with_gdn=False) and one attention layer
    prefill. Returns {"backend", "device", "T", "N", "lens", "gdn": {"phase1_ms", "phase2_ms", "phase3_ms",
    "layer_ms", "tokens_per_s", "share": {"phase1", "phase2", "phase3"}, "other_conv": {"conv", "phase1_ms",
    "layer_ms"}} or None, "attention": {"ms",
    "tokens_per_s", "page_table_width"}}."""
    from jax_gdn.layers import gdn
    from jax_gdn.layers.attention import attention_layer
    from jax_gdn.state import KvPages

    gdims, adims, lens = _dims(small)
    t, n = sum(lens), len(lens)
    key = jax.random.PRNGKey(seed)
    k_params, k_hidden, k_attn = jax.random.split(key, 3)
    hidden = (jax.random.normal(k_hidden, (t, gdims.hidden_size), jnp.float32)).astype(dtype)

    # ---- GDN layer ------------------------------------------------------------------------------------------------
    gdn_row = None
    if with_gdn and backend not in ("cudnn", "cudnn_xla"):     # the cuDNN backends are attention-only
        gdn_row = _bench_gdn(gdn, gdims, backend, hidden, k_params, n, lens, dtype, reps)

    # ---- attention layer ------------------------------------------------------------------------------------------
    ps = 16
    pages_per = [-(-x // ps) for x in lens]
    num_pages = sum(pages_per)
    ak = jax.random.split(k_attn, 6)
    d, h, hkv, dh = adims.hidden_size, adims.num_heads, adims.num_kv_heads, adims.head_dim

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(dtype)
    aparams = {"q_proj": w(ak[0], (d, h * 2 * dh)), "k_proj": w(ak[1], (d, hkv * dh)),
               "v_proj": w(ak[2], (d, hkv * dh)), "o_proj": w(ak[3], (h * dh, d)),
               "q_norm": 0.1 * jax.random.normal(ak[4], (dh,)), "k_norm": 0.1 * jax.random.normal(ak[5], (dh,))}
    from jax_gdn.layers import attention as attention_mod
    from jax_gdn.options import RuntimeOptions
    if RuntimeOptions().hold_fused_qkv:                # as HybridModel holds them (one device)
        aparams = attention_mod.fuse_qkv(aparams)
    order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    first_page = np.cumsum([0] + pages_per[:-1])
    page_table = np.zeros((n, max(pages_per)), np.int32)
    for i, (f, p) in enumerate(zip(first_page, pages_per)):
        page_table[i, :p] = order[f:f + p]
    tok_slot = np.concatenate([[i] * x for i, x in enumerate(lens)]).astype(np.int32)
    tok_pos = np.concatenate([np.arange(x) for x in lens]).astype(np.int32)
    tok_page = page_table[tok_slot, tok_pos // ps].astype(np.int32)
    meta_arrays = tuple(jnp.asarray(x) for x in (tok_pos, tok_page, tok_pos % ps, page_table,
                                                  np.asarray(lens, np.int32), np.cumsum([0] + lens).astype(np.int32),
                                                  np.arange(n, dtype=np.int32)))
    kv = KvPages.zeros(num_pages, ps, hkv, dh, dtype)

    def attn(p, x, kv, tp, tpg, tof, pt, sl, cu, ids):
        return attention_layer(p, adims, x, kv, token_pos=tp, token_page=tpg, token_offset=tof, page_table=pt,
                               slot_lens=sl, cu_seqlens=cu, slot_ids=ids, backend=backend)
    attn_fn = jax.jit(attn)
    ms_attn = 1e3 * _median_time(attn_fn, (aparams, hidden, kv) + meta_arrays, reps)

    return {
        "backend": backend, "device": str(jax.devices()[0]), "dtype": jnp.dtype(dtype).name, "small": small,
        "T": t, "N": n, "lens": lens, "reps": reps,
        "gdn": gdn_row,
        "attention": {"ms": ms_attn, "tokens_per_s": t / (ms_attn * 1e-3),
                      "page_table_width": int(page_table.shape[1])},
    }


def _bench_gdn(gdn, gdims, backend, hidden, k_params, n, lens, dtype, reps) -> dict:
    from jax_gdn.state import BatchMeta, GdnSlots
    t = sum(lens)
    params = gdn.init_params(gdims, k_params, dtype, randomize_norms=True)
    slots = GdnSlots.zeros(gdims, n, dtype)
    meta = BatchMeta.from_lengths(lens)

    p1_fn = jax.jit(lambda p, h, s, m: _phase1(gdn, gdims, p, h, s, m, backend))
    p1, conv_out_slots, (q, k, v) = p1_fn(params, hidden, slots, meta)
    p2_fn = jax.jit(lambda q, k, v, g, b, s, m: gdn.gdn_full_varlen(q, k, v, g, b, s, m, backend=backend)[:2])
    o, _ = p2_fn(q, k, v, p1.g, p1.beta, conv_out_slots, meta)
    p3_fn = jax.jit(lambda p, o, z, h: gdn.phase3(p, gdims, o, z, h))
    layer_fn = jax.jit(lambda p, h, s, m: gdn.gdn_layer_prefill(p, gdims, h, s, m, backend=backend))

    ms1 = 1e3 * _median_time(p1_fn, (params, hidden, slots, meta), reps)
    ms2 = 1e3 * _median_time(p2_fn, (q, k, v, p1.g, p1.beta, conv_out_slots, meta), reps)
    ms3 = 1e3 * _median_time(p3_fn, (params, o, p1.z, hidden), reps)
    ms_layer = 1e3 * _median_time(layer_fn, (params, hidden, slots, meta), reps)
    total = ms1 + ms2 + ms3
    return {"phase1_ms": ms1, "phase2_ms": ms2, "phase3_ms": ms3, "layer_ms": ms_layer,
            "tokens_per_s": t / (ms_layer * 1e-3),
            "share": {"phase1": ms1 / total, "phase2": ms2 / total, "phase3": ms3 / total},
            "other_conv": _other_conv(gdn, gdims, backend, params, hidden, slots, meta, reps)}


def _other_conv(gdn, gdims, backend, params, hidden, slots, meta, reps) -> dict:
    """Phase 1 and the whole layer with the conv + L2 form that RuntimeOptions.phase1_conv does not select
    ("two_step" <-> "fused"), timed the same way: {"conv", "phase1_ms", "layer_ms"} or {"conv", "error"}."""
    from jax_gdn.options import RuntimeOptions
    default = RuntimeOptions().phase1_conv
    if default == "auto":                              # what "auto" resolves to for this backend
        default = "fused" if gdn.conv_l2_backend(backend, gdims, hidden.dtype) == "pallas" else "two_step"
    other = "fused" if default == "two_step" else "two_step"
    try:
        p1_fn = jax.jit(lambda p, h, s, m: _phase1(gdn, gdims, p, h, s, m, backend, conv=other))
        layer_fn = jax.jit(lambda p, h, s, m: gdn.gdn_layer_prefill(p, gdims, h, s, m, backend=backend, conv=other))
        jax.block_until_ready((p1_fn(params, hidden, slots, meta), layer_fn(params, hidden, slots, meta)))
        return {"conv": other, "phase1_ms": 1e3 * _median_time(p1_fn, (params, hidden, slots, meta), reps),
                "layer_ms": 1e3 * _median_time(layer_fn, (params, hidden, slots, meta), reps)}
    except Exception as err:  # noqa: BLE001  (reported beside the default form's row)
        return {"conv": other, "error": f"{type(err).__name__}: {str(err)[:300]}"}


def _phase1(gdn, dims, params, hidden, slots, meta, backend, conv=None):
    """As the GDN block runs it (gdn.phase1_varlen); returns only what phases 2 and 3 read."""
    p1, q, k, v, slots = gdn.phase1_varlen(params, dims, hidden, slots, meta, backend=backend, conv=conv)
    return p1._replace(mixed_qkv=None, qkvz=None), slots, (q, k, v)


def print_table(results) -> None:
    print(f"{'backend':>16} {'T':>6} {'N':>3} | {'phase1':>9} {'phase2':>9} {'phase3':>9} {'GDN layer':>10} "
          f"{'GDN tok/s':>11} | {'attn':>9} {'attn tok/s':>11}")
    for r in results:
        g, a = r["gdn"], r["attention"]
        if g is None:
            print(f"{r['backend']:>16} {r['T']:>6} {r['N']:>3} | {'(GDN layer not timed)':>52} | "
                  f"{a['ms']:7.2f}ms {a['tokens_per_s']:11.0f}")
            continue
        s = g["share"]
        print(f"{r['backend']:>16} {r['T']:>6} {r['N']:>3} | "
              f"{g['phase1_ms']:7.2f}ms {g['phase2_ms']:7.2f}ms {g['phase3_ms']:7.2f}ms {g['layer_ms']:8.2f}ms "
              f"{g['tokens_per_s']:11.0f} | {a['ms']:7.2f}ms {a['tokens_per_s']:11.0f}")
        print(f"{'':>28}share {100 * s['phase1']:5.1f}% {100 * s['phase2']:7.1f}% {100 * s['phase3']:7.1f}%")
        oc = g.get("other_conv") or {}
        if "phase1_ms" in oc:
            print(f"{'':>22}conv {oc['conv']:>8}: phase1 {oc['phase1_ms']:7.2f}ms, GDN layer {oc['layer_ms']:8.2f}ms")
        elif oc:
            print(f"{'':>22}conv {oc['conv']:>8}: {oc['error']}")


def run_section(quick: bool = False, backends=None, reps: int = 10) -> list:
    """``bench_layers`` of each backend (default: GPU_BACKENDS on a GPU, "xla" elsewhere); a backend that fails is
    reported and left out. ``quick``: tiny dims (a CPU smoke run, not a measurement)."""
    if backends is None:
        backends = GPU_BACKENDS if jax.default_backend() == "gpu" else ("xla",)
    entries = []
    for backend in backends:
        try:
            entries.append(bench_layers(backend, reps, small=quick))
        except Exception as e:                             # report and go on with the other backend
            print(f"layers {backend}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return entries


def print_section(entries) -> None:
    print_table(entries)


def markdown(entries) -> list:
    """The README's table of the layer entries."""
    from benchmarks.tables import md_header
    out = md_header(["backend", "phase 1", "phase 2", "phase 3", "GDN layer", "GDN tokens/s", "attention layer",
                    "attention tokens/s"])
    for e in entries:
        g, a = e["gdn"], e["attention"]
        if g is None:                       # an attention-only backend (cudnn): the GDN layer is not timed
            gdn_cells = "- | - | - | - | -"
        else:
            sh = g["share"]
            gdn_cells = (f"{g['phase1_ms']:.2f} ms ({sh['phase1']:.0%}) | {g['phase2_ms']:.2f} ms "
                         f"({sh['phase2']:.0%}) | {g['phase3_ms']:.2f} ms ({sh['phase3']:.0%}) | "
                         f"{g['layer_ms']:.2f} ms | {g['tokens_per_s'] / 1e6:.2f} M")
        out.append(f"| {e['backend']} | {gdn_cells} | {a['ms']:.2f} ms | {a['tokens_per_s'] / 1e6:.2f} M |")
    return out
