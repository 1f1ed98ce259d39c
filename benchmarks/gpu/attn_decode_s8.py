"""Session 8 device run for the paged-attention decode op (issue 11: >= 70% of HBM on the K/V bytes it reads), under
the bench's one timing method (``jax_gdn.timing``) beside the groups of 10 the tables used before. Budget ~60 s.

    python benchmarks/gpu/attn_decode_s8.py [--quick] [--budget 60]
    --quick: CPU, interpret mode, tiny dims (tests this script end to end; numbers mean nothing)

Cases (80B attention dims: H 16, Hkv 2, Dh 256, bf16, pages of 16 shuffled; jax_gdn.bench_attention.build_case):
64x4096, 256x1024 (the bench's rows) and model-64x1190 (the model's decode table width W 75). Variants: the op's
default (decode_config: NS by _num_splits, the Pallas combine) and the same with combine="fused" (the last split
program merges; no combine launch). Numerics of each against the fp32 XLA reference (rel RMS, bf16 passes at 2e-2).
Timing: 3 rounds, the variants' order rotated each round; in each round every variant twice, "sized" (timing's
default: groups of ~20 ms) and "g10" (groups of 10 calls, the pre-session-8 tables); torch SDPA on dense K/V
(flash / efficient) timed "sized" and by triton do_bench. GB/s and % of 4.8 TB/s on N keys Hkv Dh 2 2 bytes.

Output: $OUT/attn_decode_s8.json, $OUT/attn_decode_s8.log; the table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "attn_decode_s8.log"), "w")
RESULT: dict = {"rows": [], "torch": {}, "notes": []}
HBM = 4.8e12


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def save():
    with open(os.path.join(OUT, "attn_decode_s8.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=60.0)
    args = ap.parse_args()
    quick = args.quick
    if quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench_attention import _dense_kv, _time_torch, build_case
    from jax_gdn.timing import time_jax
    from pallas_kernels.paged_attention import api, reference
    from pallas_kernels.paged_attention import triton as tr
    gpu = jax.default_backend() == "gpu"
    backend = "pallas" if gpu else "pallas_interpret"
    dims = dict(h=16, hkv=2, dh=32) if quick else dict(h=16, hkv=2, dh=256)
    cases = ([("64x4096", 4, 160, None), ("256x1024", 8, 40, None), ("model-64x1190", 4, 70, 12)] if quick else
             [("64x4096", 64, 4096, None), ("256x1024", 256, 1024, None), ("model-64x1190", 64, 1190, 75)])
    timings = ({"sized": dict(warmup=1, groups=2, per_group=2), "g10": dict(warmup=1, groups=2, per_group=2)}
               if quick else {"sized": dict(warmup=3, groups=15), "g10": dict(warmup=3, groups=15, per_group=10)})
    rounds = 2 if quick else 3
    scale = dims["dh"] ** -0.5
    base = tr.decode_config(jnp.bfloat16, dims["dh"])
    variants = [("default", None), ("fused", dataclasses.replace(base, combine="fused"))]
    log(f"device {jax.devices()[0]}, jax {jax.__version__}, default decode config {base}")
    for case, n, keys, width in cases:
        if time.time() - T0 > args.budget:
            RESULT["notes"].append(f"{case} skipped (budget)")
            continue
        a_, page_table = build_case((1,) * n, keys - 1, dtype=jnp.bfloat16, **dims)
        q, kp, vp, pt, sl, _, ids = a_
        if width is not None and width > pt.shape[1]:
            pt = jnp.concatenate([pt, jnp.full((n, width - pt.shape[1]), kp.shape[0], jnp.int32)], axis=1)
        a = (q, kp, vp, pt, sl, ids)
        nbytes = n * keys * dims["hkv"] * dims["dh"] * 2 * 2
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda q, kp, vp, pt, sl, ids: reference.paged_attention_decode_xla(
                q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), pt, sl, ids,
                scale=scale))(*a)
        ref = np.asarray(ref, np.float64)
        fns = {}
        for name, cfg in variants:
            fn = jax.jit(lambda *x, cfg=cfg: api.paged_attention_decode(*x, scale=scale, backend=backend, config=cfg))
            o = np.asarray(fn(*a).astype(jnp.float32), np.float64)
            rel = float(np.sqrt(np.mean((o - ref) ** 2) / np.mean(ref ** 2)))
            fns[name] = fn
            RESULT["rows"].append({"case": case, "variant": name, "rel": rel, "ok": rel <= 2e-2, "mbytes": nbytes / 1e6,
                                   "ms": {m: [] for m in timings}})
            log(f"{case} {name}: rel {rel:.2e}")
        rows = {r["variant"]: r for r in RESULT["rows"] if r["case"] == case}
        order = [v for v, _ in variants]
        for rnd in range(rounds):
            for name in order[rnd % len(order):] + order[:rnd % len(order)]:
                for m, kw in timings.items():
                    ms = time_jax(fns[name], a, **kw)
                    rows[name]["ms"][m].append(ms)
                    log(f"  round {rnd} {case} {name} {m}: {ms:.4f} ms {100 * nbytes / ms / 1e-3 / HBM:.1f}%")
            save()
        if gpu:
            dense = [(_dense_kv(np.asarray(kp), page_table[i], keys), _dense_kv(np.asarray(vp), page_table[i], keys))
                     for i in range(n)]
            t = []
            for _ in range(rounds):
                t.append(_time_torch(np.asarray(q.astype(jnp.float32)), dense, (1,) * n, keys - 1, True, scale))
            RESULT["torch"][case] = {"sized": [x[0] for x in t], "do_bench": [x[1] for x in t], "mbytes": nbytes / 1e6}
            log(f"  torch sdpa {case}: sized {[round(x[0], 4) for x in t]} do_bench {[round(x[1], 4) for x in t]}")
        save()
    log("\n==== attn_decode_s8: decode op, median of rounds (ms, % of 4.8 TB/s on K/V bytes); per-round lists in JSON ====")
    log(f"{'case':>14} {'variant':>8} {'rel':>8} | " + " | ".join(f"{m:>16}" for m in timings) + " | rounds (sized)")
    for r in RESULT["rows"]:
        cells = []
        for m in timings:
            if r["ms"][m]:
                med = statistics.median(r["ms"][m])
                cells.append(f"{med:8.4f} {100 * r['mbytes'] * 1e6 / med / 1e-3 / HBM:5.1f}%")
            else:
                cells.append(f"{'-':>16}")
        log(f"{r['case']:>14} {r['variant']:>8} {r['rel']:8.1e} | " + " | ".join(cells) + " | "
            + " ".join(f"{x:.4f}" for x in r["ms"]["sized"]))
    for case, t in RESULT["torch"].items():
        med = statistics.median(t["sized"])
        log(f"{case:>14} {'sdpa':>8} {'':>8} | {med:8.4f} {100 * t['mbytes'] * 1e6 / med / 1e-3 / HBM:5.1f}% | "
            f"do_bench {statistics.median(t['do_bench']):.4f}")
    log(f"total {time.time() - T0:.0f} s; notes {RESULT['notes']}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
