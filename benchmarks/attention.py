"""Section "attention": paged causal attention at Qwen3-Next-80B attention dims (16 query heads, 2 kv heads, head dim
256, bf16), all implementations in one run on one GPU.

Cases:
  prefill-varlen16        the 16 streams of ``benchmarks.cases.VARLEN16_LENS`` (19027 tokens), fresh
  prefill-varlen16-ctx2k  the same streams, each continuing 2048 tokens already in its pages
  prefill-32k             one fresh stream of 32768 tokens (the long-prompt case: 8.8 TFLOP causal per layer)
  decode-64x4096          64 streams, one query each against 4096 tokens of context
  decode-256x1024         256 streams x 1024 tokens of context
Columns (median ms; null where an implementation cannot run the case):
  pallas      ``pallas_kernels.paged_attention`` backend "pallas" (paged K/V, pages in a shuffled order; launch
              parameters: triton.prefill_config / decode_config unless triton.DEFAULT_* is set)
  xla         the same op, backend "xla" (reference.py: every block gathers all of its slot's pages)
  torch_sdpa  torch.nn.functional.scaled_dot_product_attention under sdpa_kernel([FLASH, EFFICIENT]) (flash
              is picked where it runs), dense contiguous per-stream K/V: one call per stream for prefill
              (lower-right causal mask when continuing), one batched call for decode
  cudnn       ``jax.nn.dot_product_attention(implementation="cudnn")`` on dense K/V padded to the longest
              stream (fresh prefill and decode; null for the continued prefill, whose lower-right causal mask
              it does not take)
  cudnn_packed  the same op, backend "cudnn" (pallas_kernels/paged_attention/cudnn.py: the pages gathered into
              one packed K/V buffer, cuDNN's packed layout, a causal call on the new tokens + a non-causal one on
              the context merged by LSE); prefill only (null for decode); "cudnn_xla" (its XLA stand-in) on CPU
tflops (prefill): the causal FLOPs needed, 4 H Dh sum_n (L_n (L_n + 1) / 2 + L_n ctx), over each time;
gbps (decode): the K/V bytes a decode must read, N ctx Hkv Dh 2 (K and V) * 2 bytes, over each time.
Timing, the same for every column (``jax_gdn.timing``): warm-up, then groups of ~20 ms of back-to-back calls
closed by one sync (median of the groups; an op slower than 20 ms: 5 single calls). torch SDPA's triton do_bench
median (GPU events, L2 flushed) is kept beside in the row as "torch_sdpa_do_bench", never in a ratio.
"""
from __future__ import annotations

import numpy as np

from benchmarks.cases import VARLEN16_LENS

KEY = "attention"
H, HKV, DH = 16, 2, 256
PAGE = 16
SMALL = dict(h=4, hkv=2, dh=64)          # CPU smoke dims


def attention_cases(small: bool):
    """[(name, kind, lens, context per stream)]: the section's cases (``small``: CPU smoke stand-ins)."""
    if small:
        lens = (70, 1, 33, 130)
        return [("prefill-varlen16", "prefill", lens, 0), ("prefill-varlen16-ctx2k", "prefill", lens, 40),
                ("prefill-32k", "prefill", (257,), 0),
                ("decode-64x4096", "decode", (1,) * 8, 100), ("decode-256x1024", "decode", (1,) * 16, 30)]
    return [("prefill-varlen16", "prefill", tuple(VARLEN16_LENS), 0),
            ("prefill-varlen16-ctx2k", "prefill", tuple(VARLEN16_LENS), 2048),
            ("prefill-32k", "prefill", (32768,), 0),
            ("decode-64x4096", "decode", (1,) * 64, 4095),
            ("decode-256x1024", "decode", (1,) * 256, 1023)]


def time_jax(fn, args, **kw):
    """jax_gdn.timing.time_jax with its slow-path shortcut at 20 ms (the XLA reference: 5 single calls)."""
    from jax_gdn.timing import time_jax as _time_jax
    return _time_jax(fn, args, slow_ms=20.0, **kw)


def build_case(lens, ctx, *, h, hkv, dh, dtype, seed=0):
    """Paged inputs of one case: every stream in its own slot, its ctx + L tokens' K/V already in pages handed
    out in a shuffled order. Returns (q [T, H, Dh], k_pages, v_pages, page_table [N, W], slot_lens [N],
    cu_seqlens [N + 1], slot_ids [N]) as jax arrays, and the per-stream dense K/V [L + ctx, Hkv, Dh] (numpy
    views of the same values) for the dense baselines."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    n = len(lens)
    total = [ctx + x for x in lens]
    need = [-(-t // PAGE) for t in total]
    w = max(need)
    p = sum(need)
    order = rng.permutation(p).astype(np.int32)
    page_table = np.zeros((n, w), np.int32)
    off = 0
    for i, k in enumerate(need):
        page_table[i, :k] = order[off:off + k]
        off += k
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    t = sum(lens)
    q = jax.random.normal(kq, (t, h, dh), jnp.float32).astype(dtype)
    k_pages = jax.random.normal(kk, (p, PAGE, hkv, dh), jnp.float32).astype(dtype)
    v_pages = jax.random.normal(kv, (p, PAGE, hkv, dh), jnp.float32).astype(dtype)
    slot_lens = np.asarray(total, np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    args = (q, k_pages, v_pages, jnp.asarray(page_table), jnp.asarray(slot_lens), jnp.asarray(cu),
            jnp.arange(n, dtype=jnp.int32))
    return args, page_table


def _dense_kv(k_pages, page_table_row, length):
    """[length, Hkv, Dh] of one slot, gathered once (outside any timing)."""
    pages = page_table_row[: -(-length // PAGE)]
    return k_pages[pages].reshape(-1, *k_pages.shape[2:])[:length]


def prefill_flop(lens, ctx, h=H, dh=DH):
    return sum(4 * h * dh * (x * (x + 1) / 2 + x * ctx) for x in lens)


def decode_bytes(n, ctx, hkv=HKV, dh=DH, itemsize=2):
    return n * ctx * hkv * dh * 2 * itemsize


def run_section(quick: bool = False, cases=None, small=None) -> dict:
    """Times every case (``cases``: names, default all) and implementation; returns {"rows": [...], "device",
    "dims"} (see the module doc). Off a GPU (or ``small``) the CPU stand-ins at small dims, a smoke run."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import api
    on_gpu = jax.default_backend() == "gpu"
    small = (not on_gpu) if small is None else small
    dims = SMALL if small else dict(h=H, hkv=HKV, dh=DH)
    h, hkv, dh = dims["h"], dims["hkv"], dims["dh"]
    dtype = jnp.bfloat16
    scale = dh ** -0.5
    reps = dict(groups=3, per_group=2) if (quick or not on_gpu) else dict(groups=15)
    rows = []
    for name, kind, lens, ctx in attention_cases(small):
        if cases is not None and name not in cases:
            continue
        decode = kind == "decode"
        q_lens = lens
        args, page_table = build_case(lens, ctx, h=h, hkv=hkv, dh=dh, dtype=dtype)
        q, k_pages, v_pages, pt, sl, cu, ids = args
        row = {"case": name, "kind": kind, "lens": list(lens) if not decode else len(lens),
               "context": ctx if not decode else ctx + 1, "ms": {}, "errors": {}}

        def ours(backend):
            if decode:
                return jax.jit(lambda q, kp, vp, pt, sl, ids: api.paged_attention_decode(
                    q, kp, vp, pt, sl, ids, scale=scale, backend=backend)), (q, k_pages, v_pages, pt, sl, ids)
            return jax.jit(lambda *a: api.paged_attention(*a, scale=scale, backend=backend)), args

        impls = {"pallas": lambda: ours("pallas" if on_gpu else "pallas_interpret"), "xla": lambda: ours("xla")}
        if not decode:
            impls["cudnn_packed"] = lambda: ours("cudnn" if on_gpu else "cudnn_xla")
        else:
            row["ms"]["cudnn_packed"] = None
        for impl, make in impls.items():
            try:
                fn, a = make()
                row["ms"][impl] = time_jax(fn, a, **reps)
            except Exception as err:  # report and go on
                row["ms"][impl] = None
                row["errors"][impl] = f"{type(err).__name__}: {str(err)[:300]}"
        kp_np, vp_np = np.asarray(k_pages), np.asarray(v_pages)     # host copies for the dense baselines
        dense = [(_dense_kv(kp_np, page_table[i], ctx + x), _dense_kv(vp_np, page_table[i], ctx + x))
                 for i, x in enumerate(lens)]
        row["ms"]["cudnn"] = None
        if on_gpu and (ctx == 0 or decode):
            try:
                row["ms"]["cudnn"] = _time_cudnn(q, dense, lens, decode, h, hkv, dh, scale, reps)
            except Exception as err:
                row["errors"]["cudnn"] = f"{type(err).__name__}: {str(err)[:300]}"
        row["ms"]["torch_sdpa"] = None
        if on_gpu:
            try:
                row["ms"]["torch_sdpa"], row["torch_sdpa_do_bench"] = _time_torch(
                    np.asarray(q.astype(jnp.float32)), dense, q_lens, ctx, decode, scale)
            except Exception as err:
                row["errors"]["torch_sdpa"] = f"{type(err).__name__}: {str(err)[:300]}"
        if decode:
            nbytes = decode_bytes(len(lens), ctx + 1, hkv, dh)
            row["gbps"] = {k: (None if v is None else nbytes / v / 1e6) for k, v in row["ms"].items()}
        else:
            flop = prefill_flop(lens, ctx, h, dh)
            row["gflop"] = flop / 1e9
            row["tflops"] = {k: (None if v is None else flop / v / 1e9) for k, v in row["ms"].items()}
        if not row["errors"]:
            del row["errors"]
        rows.append(row)
    return {"rows": rows, "device": str(jax.devices()[0]), "dims": dict(dims, dtype="bfloat16", page_size=PAGE),
            "small": small}


def _time_cudnn(q, dense, lens, decode, h, hkv, dh, scale, reps):
    import jax
    import jax.numpy as jnp
    n = len(lens)
    lk = max(k.shape[0] for k, _ in dense)
    kk = np.zeros((n, lk, hkv, dh), np.float32)
    vv = np.zeros((n, lk, hkv, dh), np.float32)
    for i, (k, v) in enumerate(dense):
        kk[i, :k.shape[0]] = np.asarray(k, np.float32)
        vv[i, :v.shape[0]] = np.asarray(v, np.float32)
    kk, vv = jnp.asarray(kk, jnp.bfloat16), jnp.asarray(vv, jnp.bfloat16)
    kv_lens = jnp.asarray([k.shape[0] for k, _ in dense], jnp.int32)
    if decode:
        qq = q[:, None]                                                       # [N, 1, H, Dh]
        q_lens = jnp.ones((n,), jnp.int32)
        causal = False
    else:
        lq = max(lens)
        cu = np.concatenate([[0], np.cumsum(lens)])
        qn = np.zeros((n, lq, h, dh), np.float32)
        qh = np.asarray(q.astype(jnp.float32))
        for i, x in enumerate(lens):
            qn[i, :x] = qh[cu[i]:cu[i] + x]
        qq = jnp.asarray(qn, jnp.bfloat16)
        q_lens = jnp.asarray(lens, jnp.int32)
        causal = True
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        implementation="cudnn"))
    return time_jax(fn, (qq, kk, vv), **reps)


def _time_torch(q, dense, lens, ctx, decode, scale):
    """(ms by benchmarks.timing.time_torch, triton do_bench ms) of the SDPA calls of one case
    (``benchmarks.peers.torch_sdpa``), flash / efficient backends."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks import peers, timing
    run = peers.torch_sdpa(q, dense, lens, ctx, decode, scale)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        run()
        torch.cuda.synchronize()
        return timing.time_torch(run, slow_ms=20.0), timing.do_bench(run, warmup=10, rep=100)


def print_section(section: dict) -> None:
    cols = ("pallas", "cudnn_packed", "xla", "torch_sdpa", "cudnn")
    print(f"attention ({section.get('device', '?')}, dims {section.get('dims')})")
    print(f"{'case':>24} | " + " ".join(f"{c:>11}" for c in cols) + " | " + " ".join(f"{c:>10}" for c in cols))
    for r in section["rows"]:
        ms = " ".join(f"{r['ms'][c]:9.3f}ms" if r["ms"].get(c) is not None else f"{'-':>11}" for c in cols)
        unit, key = ("TF/s", "tflops") if r["kind"] == "prefill" else ("GB/s", "gbps")
        rate = " ".join(f"{r[key][c]:6.0f}{unit}" if r[key].get(c) is not None else f"{'-':>10}" for c in cols)
        print(f"{r['case']:>24} | {ms} | {rate}")
        for impl, err in r.get("errors", {}).items():
            print(f"{'':>24}   {impl}: {err}")


def markdown(section: dict) -> list:
    """The README's table of the attention rows: ms per implementation, the rate of ours and of cuDNN packed."""
    from benchmarks.tables import PEAK_TBPS, fmt, md_header
    impls = ("pallas", "cudnn_packed", "xla", "torch_sdpa", "cudnn")
    rated = ("pallas", "cudnn_packed")

    def rate(r, i):
        return (f"{r['tflops'][i]:.0f} TFLOP/s" if (r.get("tflops") or {}).get(i)
                else f"{r['gbps'][i]:.0f} GB/s ({r['gbps'][i] / (10 * PEAK_TBPS):.0f}% of HBM)"
                if (r.get("gbps") or {}).get(i) else "-")
    out = md_header(["attention", "kind", "context"] + [f"{i} ms" for i in impls] + [f"{i} rate" for i in rated],
                    text_cols=2)
    for r in section["rows"]:
        ms = r["ms"]
        out.append(f"| {r['case']} | {r['kind']} | {r.get('context', '-')} | "
                   + " | ".join(fmt(ms.get(i)) for i in impls) + " | "
                   + " | ".join(rate(r, i) for i in rated) + " |")
    return out
