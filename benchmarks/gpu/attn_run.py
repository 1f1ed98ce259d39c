"""One device call for the paged-attention kernels (issue 11): numerics at the real dims, a launch-parameter
sweep, the attention bench section and the attention layer (pallas vs xla). Each step is printed as it finishes
and appended to $OUT/attn_run.json, so a cut run still leaves what it measured; a short table is printed last.

    python benchmarks/gpu/attn_run.py [steps...]     steps: check sweep decode section layer (default: all)

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
             "section": step_section, "layer": step_layer}[s]()
        except Exception as err:
            SUMMARY.append(f"{s}: FAILED {type(err).__name__}: {str(err)[:300]}")
            print(SUMMARY[-1], flush=True)
        print(f"--- {s} took {time.time() - t1:.0f} s", flush=True)
    print(f"\n==== summary ({time.time() - t0:.0f} s) ====")
    for line in SUMMARY:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
