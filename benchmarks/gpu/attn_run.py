"""One device call for the paged-attention kernels (issue 11): numerics at the real dims, a launch-parameter
sweep, the attention bench section and the attention layer (pallas vs xla). Each step is printed as it finishes
and appended to $OUT/attn_run.json, so a cut run still leaves what it measured; a short table is printed last.

    python benchmarks/gpu/attn_run.py [steps...]
    steps: check sweep decode tests section layer (default: those), and (v3) layerv (the attention layer fused /
    unfused / fused qkv, its GEMMs and its core alone, fused vs unfused numerics, copies in the HLO), long (one
    32768-token stream: pallas launch configs, torch SDPA, cuDNN), gtests (the gpu tests of both paged-attention
    test files)

Timing: jax over groups of back-to-back calls closed by block_until_ready (median), as jax_gdn.bench.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
LOG = os.path.join(OUT, "attn_run.json")
DRY = os.environ.get("ATTN_RUN_CPU") == "1"      # CPU dry run of this script: small dims, interpret mode
PALLAS = "pallas_interpret" if DRY else "pallas"
RESULT: dict = {}
SUMMARY: list = []


def save(key, value):
    RESULT[key] = value
    with open(LOG, "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def step_tests():
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:randomly", "-p",
                        "no:cacheprovider", "tests/pallas_kernels/test_paged_attention.py"],
                       capture_output=True, text=True, timeout=200)
    tail = (r.stdout + r.stderr)[-2500:]
    print(tail, flush=True)
    save("tests", {"rc": r.returncode, "tail": tail, "s": time.time() - t0})
    SUMMARY.append(f"gpu tests rc={r.returncode} ({time.time() - t0:.0f} s)")


def step_gtests():
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:randomly", "-p",
                        "no:cacheprovider", "tests/pallas_kernels/test_paged_attention_gated.py"]
                       + (["tests/pallas_kernels/test_paged_attention.py"] if os.environ.get("ATTN_ALL_TESTS") else []),
                       capture_output=True, text=True, timeout=240)
    tail = (r.stdout + r.stderr)[-2500:]
    print(tail, flush=True)
    save("gtests", {"rc": r.returncode, "tail": tail, "s": time.time() - t0})
    SUMMARY.append(f"gpu tests rc={r.returncode} ({time.time() - t0:.0f} s): "
                   + (r.stdout.strip().splitlines() or ["?"])[-1])


def _layer_inputs(small, seed=0):
    """The bench_layers attention inputs: varlen16 at the 80B dims (or small), empty pool of shuffled pages."""
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench_layers import _dims
    from jax_gdn.state import KvPages
    _, adims, lens = _dims(small)
    t, n = sum(lens), len(lens)
    ps = 16
    pages_per = [-(-x // ps) for x in lens]
    num_pages = sum(pages_per)
    ak = jax.random.split(jax.random.PRNGKey(seed), 7)
    d, h, hkv, dh = adims.hidden_size, adims.num_heads, adims.num_kv_heads, adims.head_dim
    dt = jnp.bfloat16

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(dt)
    params = {"q_proj": w(ak[0], (d, h * 2 * dh)), "k_proj": w(ak[1], (d, hkv * dh)),
              "v_proj": w(ak[2], (d, hkv * dh)), "o_proj": w(ak[3], (h * dh, d)),
              "q_norm": 0.1 * jax.random.normal(ak[4], (dh,)), "k_norm": 0.1 * jax.random.normal(ak[5], (dh,))}
    hidden = jax.random.normal(ak[6], (t, d), jnp.float32).astype(dt)
    order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    first = np.cumsum([0] + pages_per[:-1])
    pt = np.zeros((n, max(pages_per)), np.int32)
    for i, (f, p) in enumerate(zip(first, pages_per)):
        pt[i, :p] = order[f:f + p]
    tok_slot = np.concatenate([[i] * x for i, x in enumerate(lens)]).astype(np.int32)
    tok_pos = np.concatenate([np.arange(x) for x in lens]).astype(np.int32)
    meta = tuple(jnp.asarray(x) for x in (tok_pos, pt[tok_slot, tok_pos // ps].astype(np.int32), tok_pos % ps, pt,
                                          np.asarray(lens, np.int32), np.cumsum([0] + lens).astype(np.int32),
                                          np.arange(n, dtype=np.int32)))
    kv = KvPages.zeros(num_pages, ps, hkv, dh, dt)
    return adims, params, hidden, kv, meta, lens


def step_layerv():
    """The attention layer's variants and parts at varlen16 (same timing for all: jax_gdn.bench.time_jax): the
    unfused layer, the fused one (fused qkv weight) with the q prologue in each place (triton.PrefillConfig
    .q_prologue), the GEMMs alone (3 or 1 + o_proj), the cores alone; fused vs unfused numerics; HLO op counts."""
    import dataclasses
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench_attention import time_jax
    from jax_gdn.layers import attention as A
    from jax_gdn.layers.rope import rope_cos_sin
    from pallas_kernels.paged_attention import api
    from pallas_kernels.paged_attention import triton as tr
    adims, params, hidden, kv, meta, lens = _layer_inputs(DRY)
    reps = dict(warmup=2, groups=3, per_group=2) if DRY else dict(warmup=3, groups=10, per_group=5)
    h, hkv, dh = adims.num_heads, adims.num_kv_heads, adims.head_dim
    fparams = A.fuse_qkv(params)
    base = tr.prefill_config(jnp.bfloat16, dh)

    def layer(fused):
        def f(p, x, kv, tp, tpg, tof, pt, sl, cu, ids):
            return A.attention_layer(p, adims, x, kv, token_pos=tp, token_page=tpg, token_offset=tof,
                                     page_table=pt, slot_lens=sl, cu_seqlens=cu, slot_ids=ids, backend=PALLAS,
                                     fused=fused)
        return jax.jit(f)
    out = {}
    outs = {}
    tp, tpg, tof, pt, sl, cu, ids = meta
    q, k, v, gate = jax.jit(lambda p, x, tp: A.attention_qkv(p, adims, x, tp))(params, hidden, tp)
    kvw = A.write_kv_pages(kv, k, v, tpg, tof)
    core = jax.jit(lambda q, kp, vp, pt, sl, cu, ids: api.paged_attention(q, kp, vp, pt, sl, cu, ids,
                                                                          scale=dh ** -0.5, backend=PALLAS))
    out["core"] = time_jax(core, (q, kvw.k_pages, kvw.v_pages, pt, sl, cu, ids), **reps)
    y = hidden @ fparams["qkv_proj"]
    cos, sin = rope_cos_sin(tp, adims.rotary_dim, adims.rope_theta)
    variants = [("unfused", False, params, None)]
    for mode in ("xla", "reload", "kernel"):
        variants.append((f"fused_qkv_{mode}", True, fparams, mode))
    variants.append(("fused_3proj_xla", True, params, "xla"))          # T >= QKV_CONCAT_MIN_TOKENS: concat per call
    for name, fused, p, mode in variants:
        tr.DEFAULT_PREFILL = None if mode is None else dataclasses.replace(base, q_prologue=mode)
        A.QKV_CONCAT_MIN_TOKENS = 1 << 30 if name == "unfused" else 4096    # unfused: run 3's baseline (3 GEMMs)
        api._gated_jit.clear_cache()
        api._prefill_jit.clear_cache()
        try:
            fn = layer(fused)
            args = (p, hidden, kv) + meta
            outs[name] = np.asarray(fn(*args)[0].astype(jnp.float32))
            out[name] = time_jax(fn, args, **reps)
            if mode is not None and not name.startswith("fused_3"):
                gated = jax.jit(lambda y, kp, vp, pt, sl, cu, ids, qn, c, s_: api.paged_attention_gated(
                    y, kp, vp, pt, sl, cu, ids, q_norm=qn, cos=c, sin=s_, num_heads=h, scale=dh ** -0.5,
                    backend=PALLAS))
                out[f"core_gated_{mode}"] = time_jax(
                    gated, (y, kvw.k_pages, kvw.v_pages, pt, sl, cu, ids, params["q_norm"], cos, sin), **reps)
            if name == "fused_qkv_xla":
                hlo = fn.lower(*args).compile().as_text()
                out["hlo_fused_qkv_xla"] = {k: hlo.count(k) for k in (" copy(", " transpose(", "custom-call(",
                                                                         "fusion(")}
            if name != "unfused":
                out[f"rel_rms_{name}_vs_unfused"] = rel_rms(outs[name], outs["unfused"])
        except Exception as err:
            out[name] = f"{type(err).__name__}: {str(err)[:300]}"
        print(name, {k: v for k, v in out.items() if name in k}, flush=True)
        save("layerv", out)
    tr.DEFAULT_PREFILL = None
    A.QKV_CONCAT_MIN_TOKENS = 4096
    api._gated_jit.clear_cache()
    o_in = jnp.zeros((hidden.shape[0], h * dh), hidden.dtype)
    gemm3 = jax.jit(lambda x, p, o: (x @ p["q_proj"], x @ p["k_proj"], x @ p["v_proj"], o @ p["o_proj"]))
    concat = jax.jit(lambda p: A.fuse_qkv(p)["qkv_proj"])
    out["qkv_concat"] = time_jax(concat, (params,), **reps)
    gemm1 = jax.jit(lambda x, p, o: (x @ p["qkv_proj"], o @ p["o_proj"]))
    out["gemms_3"] = time_jax(gemm3, (hidden, params, o_in), **reps)
    out["gemms_fused"] = time_jax(gemm1, (hidden, fparams, o_in), **reps)
    print(out, flush=True)
    save("layerv", out)
    SUMMARY.append("layer varlen16 ms: " + " ".join(f"{k}={v:.3f}" for k, v in out.items()
                                                   if isinstance(v, float) and not k.startswith("rel")))
    SUMMARY.append("rel rms vs unfused: " + " ".join(f"{k[8:-11]}={v:.1e}" for k, v in out.items()
                                                     if k.startswith("rel")))
    SUMMARY.append(f"hlo {out.get('hlo_fused_qkv_xla')}")
    SUMMARY.extend(f"{k}: {v}" for k, v in out.items() if isinstance(v, str))


def step_long():
    """One 32768-token stream (fresh): pallas launch configs, torch SDPA (flash), cuDNN; same timing per column."""
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_attention as ba
    from pallas_kernels.paged_attention import api
    from pallas_kernels.paged_attention import triton as tr
    kind, lens, ctx, args = _case("prefill-32k")
    q, kp, vp, pt, sl, cu, ids = args
    dims = ba.SMALL if DRY else dict(h=ba.H, hkv=ba.HKV, dh=ba.DH)
    flop = ba.prefill_flop(lens, ctx, dims["h"], dims["dh"])
    reps = dict(warmup=1, groups=3, per_group=2) if DRY else dict(warmup=2, groups=5, per_group=3)
    out = {"gflop": flop / 1e9, "ms": {}}
    for cfg in ((128, 64, 8, 2), (128, 128, 8, 1), (128, 32, 8, 3)):
        c = tr.PrefillConfig(*cfg)
        try:
            fn = jax.jit(lambda *x, c=c: api.paged_attention(*x, scale=dims["dh"] ** -0.5, backend=PALLAS, config=c))
            out["ms"][f"pallas{list(cfg)}"] = ba.time_jax(fn, args, **reps)
        except Exception as err:
            out["ms"][f"pallas{list(cfg)}"] = f"{type(err).__name__}: {str(err)[:200]}"
        print(out, flush=True)
        save("long", out)
    if not DRY:
        kp_np, vp_np = np.asarray(kp), np.asarray(vp)
        page_table = np.asarray(pt)
        dense = [(ba._dense_kv(kp_np, page_table[i], x), ba._dense_kv(vp_np, page_table[i], x))
                 for i, x in enumerate(lens)]
        for name, f in (("torch_sdpa", lambda: ba._time_torch(np.asarray(q.astype(jnp.float32)), dense, lens, 0,
                                                              False, dims["dh"] ** -0.5)),
                        ("cudnn", lambda: ba._time_cudnn(q, dense, lens, False, dims["h"], dims["hkv"],
                                                         dims["dh"], dims["dh"] ** -0.5, reps))):
            try:
                out["ms"][name] = f()
            except Exception as err:
                out["ms"][name] = f"{type(err).__name__}: {str(err)[:200]}"
            print(out, flush=True)
            save("long", out)
    SUMMARY.append("32k stream: " + " ".join(
        f"{k}={v:.2f}ms({flop / v / 1e9:.0f}TF/s)" if isinstance(v, float) else f"{k}={v}"
        for k, v in out["ms"].items()))


def _case(name):
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_attention as ba
    cases = {c[0]: c for c in ba._cases(DRY)}
    _, kind, lens, ctx = cases[name]
    dims = ba.SMALL if DRY else dict(h=ba.H, hkv=ba.HKV, dh=ba.DH)
    args, _ = ba.build_case(lens, ctx, dtype=jnp.bfloat16, **dims)
    return kind, lens, ctx, args


def step_check():
    """Pallas vs the XLA path at the real dims on the two prefill cases and one decode case (bf16)."""
    import jax
    from pallas_kernels.paged_attention import api
    out = {}
    for name in ("prefill-varlen16", "prefill-varlen16-ctx2k", "decode-256x1024"):
        kind, lens, ctx, args = _case(name)
        scale = 256 ** -0.5
        if kind == "decode":
            q, kp, vp, pt, sl, cu, ids = args
            a = (q, kp, vp, pt, sl, ids)
            f = lambda b: jax.jit(lambda *x: api.paged_attention_decode(*x, scale=scale, backend=b))(*a)  # noqa
        else:
            f = lambda b: jax.jit(lambda *x: api.paged_attention(*x, scale=scale, backend=b))(*args)  # noqa
        o_p = np.asarray(f(PALLAS).astype(np.float32))
        o_x = np.asarray(f("xla").astype(np.float32))
        out[name] = {"rel_rms_pallas_vs_xla": rel_rms(o_p, o_x), "finite": bool(np.all(np.isfinite(o_p)))}
        print(name, out[name], flush=True)
    save("check", out)
    SUMMARY.append("check " + ", ".join(f"{k}: {v['rel_rms_pallas_vs_xla']:.1e}" for k, v in out.items()))


def step_sweep(configs=None):
    import jax
    from jax_gdn.bench_attention import prefill_flop, time_jax
    from pallas_kernels.paged_attention import api
    from pallas_kernels.paged_attention import triton as tr
    configs = configs or [(128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2), (128, 128, 8, 1), (64, 64, 4, 3)]
    rows = []
    for name in ("prefill-varlen16",):
        kind, lens, ctx, args = _case(name)
        flop = prefill_flop(lens, ctx, *((4, 64) if DRY else ()))
        for bm, bk, nw, ns in configs:
            cfg = tr.PrefillConfig(block_m=bm, block_k=bk, num_warps=nw, num_stages=ns)
            try:
                fn = jax.jit(lambda *x, cfg=cfg: api.paged_attention(*x, scale=1 / 16, backend=PALLAS,
                                                                      config=cfg))
                ms = time_jax(fn, args, warmup=2, groups=5, per_group=5)
                rows.append({"case": name, "cfg": [bm, bk, nw, ns], "ms": ms, "tflops": flop / ms / 1e9})
            except Exception as err:
                rows.append({"case": name, "cfg": [bm, bk, nw, ns], "err": f"{type(err).__name__}: {str(err)[:200]}"})
            print(rows[-1], flush=True)
            save("sweep", rows)
    for name in ("prefill-varlen16", "prefill-varlen16-ctx2k"):
        ok = [r for r in rows if r["case"] == name and "ms" in r]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            SUMMARY.append(f"sweep {name}: best {best['cfg']} {best['ms']:.3f} ms ({best['tflops']:.0f} TF/s)")
            if name == "prefill-varlen16" and os.environ.get("ATTN_USE_BEST") == "1":
                tr.DEFAULT_PREFILL = tr.PrefillConfig(*best["cfg"])   # the section and the layer run it
                api._prefill_jit.clear_cache()
    return rows


def step_decode_sweep():
    import jax
    from jax_gdn.bench_attention import decode_bytes, time_jax
    from pallas_kernels.paged_attention import api
    from pallas_kernels.paged_attention import triton as tr
    rows = []
    for name in ("decode-64x4096", "decode-256x1024"):
        kind, lens, ctx, args = _case(name)
        q, kp, vp, pt, sl, cu, ids = args
        nbytes = decode_bytes(len(lens), ctx + 1, *((2, 64) if DRY else ()))
        for bk, nw, ns, splits in ((64, 4, 2, None), (32, 4, 3, None), (128, 8, 2, None), (64, 8, 3, None)):
            cfg = tr.DecodeConfig(block_k=bk, num_warps=nw, num_stages=ns, num_splits=splits)
            try:
                fn = jax.jit(lambda *x, cfg=cfg: api.paged_attention_decode(*x, scale=1 / 16, backend=PALLAS,
                                                                             config=cfg))
                ms = time_jax(fn, (q, kp, vp, pt, sl, ids), warmup=2, groups=5, per_group=10)
                rows.append({"case": name, "cfg": [bk, nw, ns, splits], "ms": ms, "gbps": nbytes / ms / 1e6})
            except Exception as err:
                rows.append({"case": name, "cfg": [bk, nw, ns, splits],
                             "err": f"{type(err).__name__}: {str(err)[:200]}"})
            print(rows[-1], flush=True)
            save("decode_sweep", rows)
        ok = [r for r in rows if r["case"] == name and "ms" in r]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            SUMMARY.append(f"decode {name}: best {best['cfg']} {best['ms']:.3f} ms ({best['gbps']:.0f} GB/s)")

    return rows


def step_section():
    from jax_gdn import bench_attention as ba
    sec = ba.run_section(quick=DRY, small=DRY)
    ba.print_section(sec)
    save("attention", sec)
    for r in sec["rows"]:
        SUMMARY.append(f"{r['case']}: " + " ".join(f"{k}={v:.3f}ms" if v is not None else f"{k}=-"
                                                   for k, v in r["ms"].items()))


def step_layer():
    from jax_gdn.bench_layers import bench_layers
    res = []
    for backend in os.environ.get("ATTN_LAYER_BACKENDS", "pallas,xla").split(","):
        try:
            r = bench_layers(PALLAS if backend == "pallas" else backend, reps=10, with_gdn=False, small=DRY)
            res.append(r)
            SUMMARY.append(f"attention layer ({backend}): {r['attention']['ms']:.2f} ms")
        except Exception as err:
            SUMMARY.append(f"attention layer ({backend}): {type(err).__name__}: {str(err)[:200]}")
        print(SUMMARY[-1], flush=True)
    save("layer", res)


def main(argv):
    import jax
    print("jax", jax.__version__, jax.devices(), flush=True)
    steps = argv or ["check", "sweep", "decode", "tests", "layer", "section"]
    t0 = time.time()
    for s in steps:
        t1 = time.time()
        try:
            {"tests": step_tests, "check": step_check, "sweep": step_sweep, "decode": step_decode_sweep,
             "section": step_section, "layer": step_layer, "layerv": step_layerv, "long": step_long,
             "gtests": step_gtests}[s]()
        except Exception as err:
            SUMMARY.append(f"{s}: FAILED {type(err).__name__}: {str(err)[:300]}")
            print(SUMMARY[-1], flush=True)
        print(f"--- {s} took {time.time() - t1:.0f} s", flush=True)
    print(f"\n==== summary ({time.time() - t0:.0f} s) ====")
    for line in SUMMARY:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
