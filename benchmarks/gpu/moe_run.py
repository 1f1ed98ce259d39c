"""MoE on the H200 at Qwen3-Next-80B dims: compile + numerics vs a float32 oracle on a token slice + timing of the
Pallas grouped-GEMM kernels for a few launch configs, the per-kernel split, the XLA path, and peak memory.

    python benchmarks/gpu/moe_run.py [--configs c0,c1,...] [--tokens 19027,8192]
    python benchmarks/gpu/moe_run.py --mode decode [--plan 1|2] [--tokens 64,256,...] [--budget-s 70]
        decode sizes: a config sweep per token count (the 16-row-block configs d16*, d32, m64 against the
        prefill default c6; c6s split_partial and c6f fused combine at 8192), each against an fp32 oracle on a
        token slice, then the whole layer (pallas with c6 and with the best config, xla) beside the bytes floor
        (weights of the experts hit + router + shared expert at 4.8 TB/s). --dry: tiny dims in interpret mode
        (a CPU check of the script).

Writes $OUT/moe_run.json and prints a table last. Timing: jax_gdn.bench.time_jax (warm-up, then median of groups
of back-to-back calls closed by block_until_ready).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jax_gdn.bench import time_jax
from jax_gdn.layers.ffn import moe_route, sparse_moe
from pallas_kernels.moe import api
from pallas_kernels.moe import reference as ref
from pallas_kernels.moe import triton as tr
from pallas_kernels.moe.triton import MoeConfig

D, E, K, I, SI = 2048, 512, 10, 512, 512
_C1 = dict(block_m=128, gate_up_n=128, gate_up_k=64, gate_up_warps=8, gate_up_stages=3,
           down_n=128, down_k=64, down_warps=8, down_stages=3)
# run 1 (rows fastest): c1 best, 3.61 ms routed at T = 19027; run 2 (columns fastest): c6 best, 3.12 ms (now the
# default MoeConfig()). Logs: benchmarks/logs/moe_h200_run{1,2}.json
CONFIGS = {
    "c0": MoeConfig(block_m=64, gate_up_n=128, gate_up_k=64, gate_up_warps=4, gate_up_stages=4,
                    down_n=128, down_k=64, down_warps=4, down_stages=4),     # the first default
    "c1": MoeConfig(**_C1),
    "c1r": MoeConfig(**{**_C1, "columns_fastest": False}),
    "c2": MoeConfig(block_m=64, gate_up_n=64, gate_up_k=64, gate_up_warps=4, gate_up_stages=4,
                    down_n=256, down_k=64, down_warps=8, down_stages=3),
    "c3": MoeConfig(block_m=128, gate_up_n=64, gate_up_k=64, gate_up_warps=4, gate_up_stages=4,
                    down_n=128, down_k=64, down_warps=4, down_stages=4),
    "c6": MoeConfig(**{**_C1, "gate_up_stages": 4, "down_n": 256}),
    "c7": MoeConfig(**{**_C1, "gate_up_k": 128, "down_k": 128}),
    "c8": MoeConfig(**{**_C1, "down_n": 64, "down_warps": 4, "down_stages": 4}),
    "c9": MoeConfig(block_m=64, gate_up_n=256, gate_up_k=64, gate_up_warps=8, gate_up_stages=3,
                    down_n=256, down_k=64, down_warps=8, down_stages=3),
    "c10": MoeConfig(**{**_C1, "gate_up_warps": 4, "down_warps": 4}),
    "c6s": MoeConfig(split_partial=True),        # the default + half tiles for partial blocks: not yet measured
    "c6f": MoeConfig(fused_combine=True),        # the default + combine fused into the down epilogue (atomics)
    # decode sizes (few rows per expert): 16 / 32-row blocks
    "d16a": tr.DECODE_CONFIG,
    "d16b": MoeConfig(block_m=16, gate_up_n=128, gate_up_k=64, gate_up_warps=4, gate_up_stages=4,
                      down_n=256, down_k=64, down_warps=4, down_stages=4),
    "d16c": MoeConfig(block_m=16, gate_up_n=32, gate_up_k=128, gate_up_warps=4, gate_up_stages=4,
                      down_n=64, down_k=128, down_warps=4, down_stages=4),
    "d16d": MoeConfig(block_m=16, gate_up_n=64, gate_up_k=128, gate_up_warps=4, gate_up_stages=3,
                      down_n=128, down_k=128, down_warps=4, down_stages=3),
    "d16e": MoeConfig(block_m=16, gate_up_n=64, gate_up_k=64, gate_up_warps=4, gate_up_stages=6,
                      down_n=128, down_k=64, down_warps=4, down_stages=6),
    "d16f": MoeConfig(**{**tr.DECODE_CONFIG.__dict__, "fused_combine": True}),
    "d32": MoeConfig(**{**tr.DECODE_CONFIG.__dict__, "block_m": 32}),
    "m64": tr.MID_CONFIG,
}
OUT = os.environ.get("OUT", "/tmp")
BACKEND = "pallas"           # decode mode --dry: pallas_interpret
LOG = []


def log(**kw):
    LOG.append(kw)
    print(json.dumps(kw), flush=True)


def params_80b(key, e=E, d=D, inter=I, si=SI, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 7)

    def w(k, shape, fan_in):
        return (jax.random.normal(k, shape, dtype) * (fan_in ** -0.5)).astype(dtype)
    return {"router": w(ks[0], (d, e), d), "experts_gate_up": w(ks[1], (e, d, 2 * inter), d),
            "experts_down": w(ks[2], (e, inter, d), inter),
            "shared_expert": {"gate_proj": w(ks[3], (d, si), d), "up_proj": w(ks[4], (d, si), d),
                              "down_proj": w(ks[5], (si, d), si)},
            "shared_expert_gate": w(ks[6], (d, 1), d)}


def oracle_rows(x, top_w, top_i, wgu, wd, rows):
    """fp32 HIGHEST routed experts for the token rows `rows` (gathers only those tokens' experts)."""
    hp = jax.lax.Precision.HIGHEST
    xs = x[rows].astype(jnp.float32)                                   # [R, D]
    ti, tw = top_i[rows], top_w[rows].astype(jnp.float32)              # [R, k]
    inter = wd.shape[1]
    gu = jnp.einsum("rd,rkdn->rkn", xs, wgu[ti].astype(jnp.float32), precision=hp)
    h = jax.nn.silu(gu[..., :inter]) * gu[..., inter:]
    h = h.astype(x.dtype).astype(jnp.float32)                          # the kernel stores h in x's dtype
    y = jnp.einsum("rki,rkid->rkd", h, wd[ti].astype(jnp.float32), precision=hp)
    return jnp.sum(y * tw[..., None], axis=1)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(((a - b) ** 2).sum()) / max(np.sqrt((b ** 2).sum()), 1e-30))


def fp32_small_check():
    rng = np.random.default_rng(1)
    t, d, e, inter, k = 130, 256, 16, 128, 4
    x = rng.standard_normal((t, d)).astype(np.float32)
    wgu = (rng.standard_normal((e, d, 2 * inter)) * d ** -0.5).astype(np.float32)
    wd = (rng.standard_normal((e, inter, d)) * inter ** -0.5).astype(np.float32)
    ti = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    tw = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
    out = np.zeros((t, d))
    for tt in range(t):
        for j in range(k):
            gu = x[tt].astype(np.float64) @ wgu[ti[tt, j]]
            out[tt] += tw[tt, j] * ((gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]) @ wd[ti[tt, j]])
    for be in ("pallas", "xla"):
        got = api.moe_experts(*map(jnp.asarray, (x, tw, ti, wgu, wd)), backend=be)
        log(check="fp32_small_vs_f64", backend=be, rel_rms=rel(got, out))


def hit_bytes_floor(top_i):
    """(experts hit, bytes floor ms at 4.8 TB/s): the weights of the experts hit (gate_up + down), router,
    shared expert (+ gate) and x in / out, bf16."""
    hit = int(np.unique(np.asarray(top_i)).size)
    t, e, d, inter, si = top_i.shape[0], E, D, I, SI
    nbytes = 2 * (hit * 3 * d * inter + d * e + 3 * d * si + d + 2 * t * d)
    return hit, nbytes / 4.8e12 * 1e3


def split_times(cfg, x, wgu, wd, top_w, top_i, reps: dict, ndigits: int) -> dict:
    """The routed experts' stages timed one by one (align / gate_up / down / combine, ms, time_jax with ``reps``)
    with the live and padded row counts of the layout."""
    t = x.shape[0]
    lay_fn = jax.jit(lambda tw, ti: ref.moe_align(tw, ti, E, cfg.block_m))
    lay = lay_fn(top_w, top_i)
    itp = BACKEND != "pallas"
    gu = jax.jit(lambda x, a, be, rt: tr.gate_up_silu(x, a, be, rt, config=cfg, interpret=itp))
    dn = jax.jit(lambda h, b, be, rt, rw: tr.down_weighted(h, b, be, rt, rw, num_tokens=t, config=cfg,
                                                           interpret=itp))
    h = gu(x, wgu, lay.block_expert, lay.row_token)
    y = dn(h, wd, lay.block_expert, lay.row_token, lay.row_weight)
    combine = jax.jit(lambda y, rp: ref.combine(y, rp, jnp.bfloat16))
    return {"align_ms": round(time_jax(lay_fn, (top_w, top_i), **reps), ndigits),
            "gate_up_ms": round(time_jax(gu, (x, wgu, lay.block_expert, lay.row_token), **reps), ndigits),
            "down_ms": round(time_jax(dn, (h, wd, lay.block_expert, lay.row_token, lay.row_weight), **reps),
                             ndigits),
            "combine_ms": round(time_jax(combine, (y, lay.row_pos), **reps), ndigits),
            "padded_rows": int(lay.block_expert.shape[0] * cfg.block_m),
            "live_blocks": int(jnp.sum(lay.block_expert < E))}


def sweep(p, t, names, table, deadline, split=(), layer_cfgs=(), xla=True):
    """Routed experts at T tokens for each config (numerics on a slice + time), then the whole layer."""
    x = jax.random.normal(jax.random.PRNGKey(t), (t, D), jnp.bfloat16)
    top_w, top_i = jax.jit(lambda x: moe_route(p["router"], x, K, True))(x)
    hit, bfloor = hit_bytes_floor(top_i)
    flops = 2 * t * (D * E + K * 3 * D * I + 3 * D * SI + D)
    log(tokens=t, experts_hit=hit, bytes_floor_ms=round(bfloor, 4), flop_floor_ms=round(flops / 700e12 * 1e3, 4),
        selected=str(tr.select_config(t, K, E)))
    rows = jnp.asarray(np.unique(np.linspace(0, t - 1, 16).astype(np.int32)))
    orc = oracle_rows(x, top_w, top_i, p["experts_gate_up"], p["experts_down"], rows)
    wgu, wd = p["experts_gate_up"], p["experts_down"]
    reps = dict(warmup=2, groups=7, per_group=20 if t <= 256 else 5)
    for name in names:
        if time.perf_counter() > deadline:
            log(tokens=t, impl=f"pallas {name}", skipped="deadline")
            continue
        cfg = tr.select_config(t, K, E) if name == "sel" else CONFIGS[name]      # sel: what the api picks
        row = {"tokens": t, "impl": f"pallas {name}", "floor_ms": round(max(bfloor, flops / 700e12 * 1e3), 4)}
        try:
            fn = jax.jit(lambda x, tw, ti, a, b, cfg=cfg: api.moe_experts(x, tw, ti, a, b, backend=BACKEND,
                                                                          config=cfg))
            t0 = time.perf_counter()
            fn = fn.lower(x, top_w, top_i, wgu, wd).compile()
            ma = fn.memory_analysis()
            row["temp_MiB"] = round(ma.temp_size_in_bytes / 2 ** 20, 2) if ma is not None else None
            out = jax.block_until_ready(fn(x, top_w, top_i, wgu, wd))
            row["first_call_s"] = round(time.perf_counter() - t0, 1)
            row["rel_rms_slice"] = rel(out[rows].astype(jnp.float32), orc)
            row["finite"] = bool(jnp.all(jnp.isfinite(out)))
            row["routed_ms"] = round(time_jax(fn, (x, top_w, top_i, wgu, wd), **reps), 4)
            if name in split:
                row.update(split_times(cfg, x, wgu, wd, top_w, top_i, reps, ndigits=4))
        except Exception as ex:                                        # noqa: BLE001
            row["err"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            traceback.print_exc()
        log(**row)
        table.append(row)
    best = min((r for r in table if r["tokens"] == t and "routed_ms" in r), key=lambda r: r["routed_ms"],
               default=None)
    cfgs = list(layer_cfgs) + ([best["impl"].split()[1]] if best else [])
    for be, name in [(BACKEND, n) for n in dict.fromkeys(cfgs)] + ([("xla", None)] if xla else []):
        if time.perf_counter() > deadline + 15:
            continue
        row = {"tokens": t, "impl": f"layer {be}" + (f" {name}" if name else ""),
               "floor_ms": round(max(bfloor, flops / 700e12 * 1e3), 4)}
        try:
            cfg = CONFIGS[name] if name and name != "sel" else None            # sel: moe_config=None
            fn = jax.jit(lambda p, x, be=be, cfg=cfg: sparse_moe(p, x, top_k=K, norm_topk_prob=True, backend=be,
                                                                 moe_config=cfg))
            row["layer_ms"] = round(time_jax(fn, (p, x), **reps), 4)
        except Exception as ex:                                        # noqa: BLE001
            row["err"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            traceback.print_exc()
        log(**row)
        table.append(row)


def decode_main(args):
    global D, E, I, SI, BACKEND
    if args.dry:
        D, E, I, SI, BACKEND = 64, 32, 32, 32, "pallas_interpret"
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    log(device=jax.devices()[0].device_kind, jax=jax.__version__, mode="decode")
    p = params_80b(jax.random.PRNGKey(0), e=E, d=D, inter=I, si=SI)
    jax.block_until_ready(p)
    table = []
    # tokens -> (configs swept, configs with a kernel split, layer rows besides the best, xla layer row)
    # run 1 (log benchmarks/logs/moe_h200_decode_run1.json): the first sweep at decode sizes
    plan1 = {64: (("d16a", "c6", "d16b", "d16c", "d16d", "d16e", "d32", "d16f"), ("c6", "d16a"), ("c6",), True),
             256: (("d16a", "c6", "d16d", "d32", "m64"), (), ("c6",), True),
             8: (("d16a", "c6", "d16c"), (), ("c6",), True), 1: (("d16a", "c6", "d16c"), (), ("c6",), True),
             1024: (("c6", "m64", "d32"), (), ("c6",), False), 8192: (("c6", "c6s", "c6f"), (), ("c6",), False)}
    # run 2: "sel" = select_config's pick (align without the searchsorted loop), the ladder's crossovers, and
    # split_partial / fused combine at prefill sizes
    plan2 = {64: (("sel", "d16f", "c6"), ("sel",), ("c6", "sel"), False), 1: (("sel",), (), ("sel",), False),
             8: (("sel",), (), ("sel",), False), 256: (("sel",), (), ("sel",), False),
             2048: (("d32", "m64", "c6s"), (), (), False), 4096: (("m64", "c6s"), (), (), False),
             8192: (("c6s",), (), (), False), 19027: (("c6", "c6s", "c6f"), (), ("sel",), False)}
    plan = plan1 if args.plan == 1 else plan2
    for t in [int(v) for v in args.tokens.split(",")]:
        names, split, layers, xla = plan.get(t, (("sel", "c6"), (), ("sel",), False))
        sweep(p, t, names, table, deadline, split=split, layer_cfgs=layers, xla=xla)
    with open(os.path.join(OUT, "moe_run.json"), "w") as f:
        json.dump(LOG, f, indent=1)
    print(f"\nwall {time.perf_counter() - t_start:.1f} s")
    print("%-6s %-14s %9s %9s %8s %8s %8s %8s %9s %9s" % ("tokens", "impl", "routed", "layer", "gate_up", "down",
                                                          "align", "combine", "floor", "rel_slice"))
    for r in table:
        print("%-6s %-14s %9s %9s %8s %8s %8s %8s %9s %9s" % (
            r["tokens"], r["impl"], r.get("routed_ms", "-"), r.get("layer_ms", "-"), r.get("gate_up_ms", "-"),
            r.get("down_ms", "-"), r.get("align_ms", "-"), r.get("combine_ms", "-"), r.get("floor_ms", "-"),
            "%.1e" % r["rel_rms_slice"] if "rel_rms_slice" in r else r.get("err", "-")[:20]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="c0,c1,c2,c3")
    ap.add_argument("--tokens", default="19027,8192")
    ap.add_argument("--xla", type=int, default=1)
    ap.add_argument("--bench", type=int, default=0, help="then jax_gdn.bench_moe with the best config")
    ap.add_argument("--mode", default="prefill", choices=("prefill", "decode"),
                    help="decode: per-size config sweep (tokens default 64,256,8,1,1024,8192) and layer rows")
    ap.add_argument("--budget-s", type=float, default=70.0, help="decode mode: stop sweeping after this")
    ap.add_argument("--dry", action="store_true", help="decode mode: tiny dims, interpret mode (CPU)")
    ap.add_argument("--plan", type=int, default=2, help="decode mode: 1 = run 1's sweep, 2 = run 2's")
    args = ap.parse_args()
    if args.mode == "decode":
        if args.tokens == "19027,8192":
            args.tokens = "64,256,8,1,1024,8192" if args.plan == 1 else "64,1,8,256,2048,4096,8192,19027"
        return decode_main(args)
    jax.config.update("jax_default_matmul_precision", "highest")       # fp32 checks: no TF32
    log(device=jax.devices()[0].device_kind, jax=jax.__version__)
    try:
        fp32_small_check()
    except Exception as ex:                                            # noqa: BLE001
        log(check="fp32_small_vs_f64", err=f"{type(ex).__name__}: {str(ex)[:400]}")
        traceback.print_exc()
    jax.config.update("jax_default_matmul_precision", None)

    p = params_80b(jax.random.PRNGKey(0))
    jax.block_until_ready(p)
    table = []
    for t in [int(v) for v in args.tokens.split(",")]:
        flops = 2 * t * (D * E + K * 3 * D * I + 3 * D * SI + D)
        floor_ms = flops / 700e12 * 1e3
        routed_floor_ms = 2 * t * K * 3 * D * I / 700e12 * 1e3
        x = jax.random.normal(jax.random.PRNGKey(t), (t, D), jnp.bfloat16)
        top_w, top_i = jax.jit(lambda x: moe_route(p["router"], x, K, True))(x)
        counts = np.bincount(np.asarray(top_i).reshape(-1), minlength=E)
        log(tokens=t, floor_ms=round(floor_ms, 3), routed_floor_ms=round(routed_floor_ms, 3),
            rows_per_expert_min=int(counts.min()), rows_per_expert_max=int(counts.max()))
        rows = jnp.asarray(np.linspace(0, t - 1, 16).astype(np.int32))
        orc = oracle_rows(x, top_w, top_i, p["experts_gate_up"], p["experts_down"], rows)
        wgu, wd = p["experts_gate_up"], p["experts_down"]
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            row = {"tokens": t, "impl": f"pallas {name}"}
            try:
                fn = jax.jit(lambda x, tw, ti, a, b, cfg=cfg: api.moe_experts(x, tw, ti, a, b, backend="pallas",
                                                                              config=cfg))
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn(x, top_w, top_i, wgu, wd))
                row["first_call_s"] = round(time.perf_counter() - t0, 1)
                row["rel_rms_slice"] = rel(out[rows].astype(jnp.float32), orc)
                row["finite"] = bool(jnp.all(jnp.isfinite(out)))
                row["routed_ms"] = round(time_jax(fn, (x, top_w, top_i, wgu, wd), warmup=2, groups=7,
                                                  per_group=5), 3)
                row.update(split_times(cfg, x, wgu, wd, top_w, top_i,
                                       dict(warmup=2, groups=5, per_group=5), ndigits=3))
            except Exception as ex:                                    # noqa: BLE001
                row["err"] = f"{type(ex).__name__}: {str(ex)[:400]}"
                traceback.print_exc()
            log(**row)
            table.append(row)
        best = min((r for r in table if r["tokens"] == t and "routed_ms" in r), key=lambda r: r["routed_ms"],
                   default=None)
        # the whole layer (routing + routed + shared) with the best config, pallas and xla; memory
        for be in ("pallas", "xla") if args.xla else ("pallas",):
            row = {"tokens": t, "impl": f"layer {be}"}
            try:
                cfg = CONFIGS[best["impl"].split()[1]] if be == "pallas" and best is not None else None
                fn = jax.jit(lambda p, x, be=be, cfg=cfg: sparse_moe(p, x, top_k=K, norm_topk_prob=True,
                                                                     backend=be, moe_config=cfg))
                comp = fn.lower(p, x).compile()
                ma = comp.memory_analysis()
                row["temp_MiB"] = round(ma.temp_size_in_bytes / 2 ** 20, 1) if ma is not None else None
                st0 = jax.devices()[0].memory_stats() or {}
                out = jax.block_until_ready(fn(p, x))
                st1 = jax.devices()[0].memory_stats() or {}
                if "peak_bytes_in_use" in st0:
                    row["peak_delta_MiB"] = round((st1["peak_bytes_in_use"] - st0["peak_bytes_in_use"]) / 2 ** 20, 1)
                    row["in_use_before_MiB"] = round(st0["bytes_in_use"] / 2 ** 20, 1)
                    row["peak_MiB"] = round(st1["peak_bytes_in_use"] / 2 ** 20, 1)
                row["finite"] = bool(jnp.all(jnp.isfinite(out)))
                row["layer_ms"] = round(time_jax(fn, (p, x), warmup=2, groups=5, per_group=3), 3)
                row["floor_ms"] = round(floor_ms, 3)
                if be == "xla":
                    pal = jax.jit(lambda p, x: sparse_moe(p, x, top_k=K, norm_topk_prob=True, backend="pallas"))(p, x)
                    row["rel_rms_vs_pallas"] = rel(out.astype(jnp.float32), pal.astype(jnp.float32))
            except Exception as ex:                                    # noqa: BLE001
                row["err"] = f"{type(ex).__name__}: {str(ex)[:400]}"
                traceback.print_exc()
            log(**row)
            table.append(row)
    if args.bench:
        best = min((r for r in table if "routed_ms" in r), key=lambda r: r["routed_ms"])
        from jax_gdn import bench_moe
        log(bench_config="select_config (per shape)")
        del p
        sec = bench_moe.run_section()
        log(bench_moe=sec)
        bench_moe.print_section(sec)
    with open(os.path.join(OUT, "moe_run.json"), "w") as f:
        json.dump(LOG, f, indent=1)
    print("\n%-8s %-12s %9s %9s %9s %9s %9s %9s %10s" % ("tokens", "impl", "routed", "gate_up", "down", "align",
                                                          "combine", "layer", "rel_slice"))
    for r in table:
        print("%-8s %-12s %9s %9s %9s %9s %9s %9s %10s" % (
            r["tokens"], r["impl"], r.get("routed_ms"), r.get("gate_up_ms"), r.get("down_ms"), r.get("align_ms"),
            r.get("combine_ms"), r.get("layer_ms"), "%.2e" % r["rel_rms_slice"] if "rel_rms_slice" in r else "-"))


if __name__ == "__main__":
    main()
