"""One device run for paged-attention DECODE (issue 11, issue 9): every DecodeConfig variant checked against the
fp32 reference and timed on the issue's two cases and the model's decode step, torch SDPA in the same process as
the anchor, an XLA read of the same bytes as the achievable floor, and a profile of one jitted attention DECODE
LAYER at 80B dims (which GPU kernels it spends its time in). Budget ~100 s on a warm H200.

    python benchmarks/gpu/attn_decode.py [--quick] [--budget 95]
    --quick: CPU, interpret mode, tiny dims (tests this script end to end; numbers mean nothing)

Cases (Hkv 2, H 16, Dh 256, bf16, pages of 16 handed out shuffled):
  64x4096        64 streams x 4096 keys, page table width W = 256 (exactly the pages needed)
  256x1024       256 streams x 1024 keys, W = 64
  model-64x1189  the model's decode step: 64 x 1190 keys (1189 context + the new token) in a page table of
                 W = 256 (max_seq_len 4096): the width the split rule sees is 3.4x the real length
K/V bytes a decode must read: N keys Hkv Dh 2 (K, V) 2 bytes (64x4096 and 256x1024: 536.9 MB). % is of 4.8 TB/s.

Every implementation is timed the same way: groups of back-to-back calls closed by a device sync (jax:
block_until_ready; torch: torch.cuda.synchronize), the median of the groups' per-call ms. torch SDPA: dense
contiguous [N, Hkv, keys, Dh] K/V per case (gathered once on the device), one batched call with a [N, H, 1, Dh]
query, sdpa_kernel([FLASH, EFFICIENT]) as jax_gdn.bench_attention._time_torch. Read floor: an XLA max
over each of the two pools (their bytes = the live K/V, + 0.8% of page tail at 1190 keys), read once, no write.

Numerics: each variant's output against reference.paged_attention_decode_xla on fp32 copies of the inputs (matmul
precision highest), relative RMS; bf16 passes at <= 2e-2 (the float64-oracle tests' tolerance).

Layer profile: jax_gdn.layers.attention.attention_layer(..., decode=True, backend "pallas") at 80B dims (hidden
2048, H 16, Hkv 2, Dh 256) on 64 streams x 1189 context, the pool donated as the model's step does; timed, then
5 calls under jax.profiler.trace: GPU kernel ms per call by kernel name (the Perfetto trace's "Stream" lines, as
benchmarks/gpu/shard_x2.py parses them), and the compiled HLO's fusions / custom calls as a fallback.

Output: $OUT/attn_decode.json (written after every step), $OUT/attn_decode.log (everything printed), a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "attn_decode.log"), "w")
RESULT: dict = {"rows": [], "anchors": [], "layer": None, "notes": []}
HBM = 4.8e12                                             # H200 HBM3e peak, bytes/s


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def save():
    with open(os.path.join(OUT, "attn_decode.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def elapsed():
    return time.time() - T0


def timeit(fn, sync, *, warmup=3, groups=7, per_group=20):
    """Median ms per call over groups of back-to-back calls closed by sync(last result)."""
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(groups):
        t0 = time.perf_counter()
        out = None
        for _ in range(per_group):
            out = fn()
        sync(out)
        times.append((time.perf_counter() - t0) / per_group * 1e3)
    return statistics.median(times)


# the variants, in the order they are run (the deadline cuts from the end); predictions and run 1's measurements:
# NOTES.md "Decode (session 5)". Each names every field that differs from run 1's base (waves 4, XLA combine), so
# the names keep their run-1 meaning now that DecodeConfig's defaults are run 1's pick ("default").
def variants(tr):
    import jax.numpy as jnp

    def D(**kw):
        return tr.DecodeConfig(**{"waves": 4, "combine": "xla", **kw})
    return [
        ("default", tr.decode_config(jnp.bfloat16, 256)),            # the op's default (run 1's pick)
        ("s4", D(dynamic_split=False, combine="einsum")),            # the session-4 kernel (baseline)
        ("dyn", D()),                                                # dynamic split, one-reduction combine
        ("cmb-pallas", D(combine="pallas")),                         # combine in a second small kernel
        ("fused", D(combine="fused")),                               # the last split merges (not run yet)
        ("waves2-fused", D(waves=2, combine="fused")),
        ("pf2", D(prefetch_pages=2)),                                # page ids two steps ahead
        ("pf1", D(prefetch_pages=1)),                                # ... one step ahead
        ("pack", D(pack_kv_heads=True)),                             # both kv heads per program
        ("pack-pf2", D(pack_kv_heads=True, prefetch_pages=2)),
        ("ns1", D(num_splits=1)),                                    # no combine
        ("pack-ns1", D(pack_kv_heads=True, num_splits=1)),
        ("hkfast", D(heads_fastest=True)),                           # kv head the fastest grid axis
        ("bk32-s2", D(block_k=32)),                                  # 64 KB of smem: 3 programs per SM
        ("bk16-s2", D(block_k=16)),
        ("pf2-bk32", D(block_k=32, prefetch_pages=2)),
        ("bk32-s3", D(block_k=32, num_stages=3)),
        ("bk64-s3", D(num_stages=3)),
        ("pf2-s3", D(prefetch_pages=2, num_stages=3)),
        ("waves2", D(waves=2)),
        ("pf2-waves8", D(prefetch_pages=2, waves=8)),
        ("pack-pf2-bk32", D(pack_kv_heads=True, prefetch_pages=2, block_k=32)),
        ("w8", D(num_warps=8)),
    ]


def build(n, keys, width, *, h, hkv, dh, ps, seed=0):
    """Paged inputs (jax arrays): q [N, H, Dh], k/v pages [P, Ps, Hkv, Dh] bf16 (pages shuffled), page_table
    [N, W] (entries past a stream's pages: P, out of range), slot_lens [N] = keys, slot_ids = arange(N)."""
    import jax
    import jax.numpy as jnp
    need = -(-keys // ps)
    p = n * need
    rng = np.random.default_rng(seed)
    order = rng.permutation(p).astype(np.int32).reshape(n, need)
    pt = np.full((n, width), p, np.int32)
    pt[:, :need] = order
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    bf = jnp.bfloat16
    q = jax.random.normal(kq, (n, h, dh), jnp.float32).astype(bf)
    kp = jax.random.normal(kk, (p, ps, hkv, dh), jnp.float32).astype(bf)
    vp = jax.random.normal(kv, (p, ps, hkv, dh), jnp.float32).astype(bf)
    return (q, kp, vp, jnp.asarray(pt), jnp.full((n,), keys, jnp.int32), jnp.arange(n, dtype=jnp.int32)), need


def torch_sdpa_ms(args, need, keys, scale, reps):
    """torch SDPA on dense contiguous K/V gathered once on the device (jax -> torch through DLPack)."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, kp, vp, pt, _, _ = args
    n, h, dh = q.shape
    hkv = kp.shape[2]

    @jax.jit
    def dense(kp, vp, pt):
        def one(pool):
            x = pool[pt[:, :need]].reshape(n, need * kp.shape[1], hkv, dh)[:, :keys]
            return jnp.transpose(x, (0, 2, 1, 3))                              # [N, Hkv, keys, Dh]
        return one(kp), one(vp), q[:, :, None, :]                              # q [N, H, 1, Dh]
    dj = jax.block_until_ready(dense(kp, vp, pt))            # kept alive while torch reads it
    try:
        kd, vd, qd = (torch.from_dlpack(x).contiguous() for x in dj)
    except Exception:  # noqa: BLE001  (no DLPack exchange: through the host)
        kd, vd, qd = (torch.tensor(np.asarray(x.astype(jnp.float32)), device="cuda").to(torch.bfloat16)
                      for x in dj)

    def run():
        return F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        ms = timeit(run, lambda _: torch.cuda.synchronize(), **reps)
        o = run()
    o = np.asarray(o.float().cpu().numpy()).reshape(n, h, dh)
    return ms, o


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=95.0, help="seconds from start after which nothing new starts")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    gpu = jax.default_backend() == "gpu"
    from pallas_kernels.paged_attention import api, reference
    from pallas_kernels.paged_attention import triton as tr
    backend = "pallas" if gpu else "pallas_interpret"
    quick = a.quick or not gpu
    budget = a.budget
    log(f"jax {jax.__version__} {jax.devices()[0]} quick={quick} budget={budget}s")
    dims = dict(h=16, hkv=2, dh=32, ps=16) if quick else dict(h=16, hkv=2, dh=256, ps=16)
    cases = ([("64x4096", 4, 160, 10), ("256x1024", 8, 40, 3), ("model-64x1189", 4, 70, 16)] if quick else
             [("64x4096", 64, 4096, 256), ("256x1024", 256, 1024, 64), ("model-64x1189", 64, 1190, 256)])
    reps = dict(warmup=1, groups=2, per_group=1) if quick else dict(warmup=3, groups=7, per_group=20)
    scale = dims["dh"] ** -0.5
    RESULT.update(device=str(jax.devices()[0]), jax=jax.__version__, dims=dims, quick=quick)
    all_variants = variants(tr)
    if quick:
        all_variants = all_variants[:12]
    # time reserved for the model case (best 4 + baseline) and the layer profile
    reserve = 0.0 if quick else 28.0

    def run_case(name, n, keys, width, names):
        args, need = build(n, keys, width, **dims)
        nbytes = n * keys * dims["hkv"] * dims["dh"] * 2 * 2
        q, kp, vp, pt, sl, ids = args
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda q, kp, vp, pt, sl, ids: reference.paged_attention_decode_xla(
                q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), pt, sl, ids,
                scale=scale))(*args)
        ref = np.asarray(ref, np.float64)

        def rel(o):
            o = np.asarray(jnp.asarray(o).astype(jnp.float32), np.float64)
            return float(np.sqrt(np.mean((o - ref) ** 2) / np.mean(ref ** 2)))
        anchors = {"case": name, "N": n, "keys": keys, "W": width, "mbytes": nbytes / 1e6}
        live = jax.jit(lambda kp, vp: (jnp.max(kp), jnp.max(vp)))
        try:            # the read floor: both pools (= the live pages, + 0.8% of page tail at 1190) read once
            anchors["read_floor_ms"] = timeit(lambda: live(kp, vp), jax.block_until_ready, **reps)
        except Exception as err:  # noqa: BLE001
            anchors["read_floor_err"] = f"{type(err).__name__}: {str(err)[:200]}"
        if gpu:
            try:
                ms, o = torch_sdpa_ms(args, need, keys, scale, reps)
                anchors["torch_sdpa_ms"] = ms
                anchors["torch_sdpa_rel"] = rel(o)
            except Exception as err:  # noqa: BLE001
                anchors["torch_sdpa_err"] = f"{type(err).__name__}: {str(err)[:300]}"
        log("anchor", anchors)
        RESULT["anchors"].append(anchors)
        save()
        for vname, cfg in all_variants:
            if vname not in names:
                continue
            left = budget - reserve - elapsed() if not name.startswith("model") else budget - 12 - elapsed()
            if left < 2.5 and vname not in ("default", "s4", "dyn"):
                log(f"deadline: {name} {vname} skipped")
                RESULT["notes"].append(f"{name} {vname} skipped (deadline)")
                continue
            row = {"case": name, "variant": vname, "config": cfg.__dict__.copy(), "mbytes": nbytes / 1e6}
            t1 = time.time()
            try:
                fn = jax.jit(lambda *x, cfg=cfg: api.paged_attention_decode(*x, scale=scale, backend=backend,
                                                                            config=cfg))
                row["rel"] = rel(fn(*args))
                row["ok"] = row["rel"] <= 2e-2
                row["ms"] = timeit(lambda: fn(*args), jax.block_until_ready, **reps)
                row["gbps"] = nbytes / row["ms"] / 1e6
                row["pct_hbm"] = 100 * row["gbps"] * 1e9 / HBM
                if name == cases[0][0] and vname in ("default", "s4", "dyn"):   # kernel vs combine time
                    tk = trace_kernels(lambda: fn(*args), 5, f"op_{vname}")
                    row["kernels_ms"] = tk["kernels_ms"][:6]
                    row["kernels_sum_ms"] = tk["kernels_sum_ms"]
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            row["s"] = round(time.time() - t1, 2)
            log(row)
            RESULT["rows"].append(row)
            save()
        return [r for r in RESULT["rows"] if r["case"] == name and "ms" in r and r.get("ok")]

    names_all = [v for v, _ in all_variants]
    good = []
    for name, n, keys, width in cases[:2]:
        good += run_case(name, n, keys, width, names_all)
        if gpu:
            import torch
            torch.cuda.empty_cache()
    # the model's case: the baseline, the new default and the best 4 of the two issue cases (mean % of HBM)
    score = {}
    for r in good:
        score.setdefault(r["variant"], []).append(r["pct_hbm"])
    ranked = sorted((v for v in score if len(score[v]) == 2), key=lambda v: -np.mean(score[v]))
    RESULT["ranked_issue_cases"] = [(v, float(np.mean(score[v]))) for v in ranked]
    name, n, keys, width = cases[2]
    run_case(name, n, keys, width, ["default", "s4", "dyn"] + [v for v in ranked[:4] if v != "default"])
    # the layer: timed with the session-4 kernel, the best variant and the default, profiled with the default
    best = ranked[0] if ranked else "dyn"
    RESULT["best"] = best
    by_name = dict(all_variants)
    if elapsed() < budget or quick:
        layer_profile(quick, backend, {"s4": by_name["s4"], best: by_name[best], "default": by_name["default"]},
                      "default")
    if not quick and budget - elapsed() > 20:
        gpu_tests(budget - elapsed())
    table()
    log(f"total {elapsed():.0f} s")


def trace_kernels(call, calls, tag):
    """``calls`` calls of call() under jax.profiler.trace (Perfetto); GPU kernel ms per call by name (events on the
    GPU processes' "Stream" threads, as benchmarks/gpu/shard_x2.py parses them), sorted, with counts per call."""
    import jax
    from trace_events import gpu_events
    tdir = os.path.join(OUT, f"trace_{tag}")
    with jax.profiler.trace(tdir, create_perfetto_trace=True):
        y = None
        for _ in range(calls):
            y = call()
        jax.block_until_ready(y)
    events, proc_names = gpu_events(tdir)
    if not tag.startswith("layer"):                   # keep only the layer's trace under $OUT
        import shutil
        shutil.rmtree(tdir, ignore_errors=True)
    kernels, lines = {}, {}
    for proc, thread, name, ms in events:
        line = f"{proc[-16:]}/{thread[:30]}"
        lines[line] = lines.get(line, 0.0) + ms / calls
        if not thread.lower().startswith("stream"):
            continue
        k = kernels.setdefault(name[:80], [0.0, 0])
        k[0] += ms / calls
        k[1] += 1
    return {"gpu_lines_ms": {k: round(v, 4) for k, v in lines.items()},
            "trace_procs": proc_names[:12],
            "kernels_ms": [(k, round(v[0], 4), v[1] // calls) for k, v in
                           sorted(kernels.items(), key=lambda kv: -kv[1][0])],
            "kernels_sum_ms": round(sum(v[0] for v in kernels.values()), 4)}


def gpu_tests(seconds):
    """The decode gpu tests (float64 oracle, odd lengths, NaN pages) in a child process, if time is left."""
    import subprocess
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:randomly", "-p",
                            "no:cacheprovider", "-k", "gpu_decode", "tests/pallas_kernels/test_paged_attention.py"],
                           capture_output=True, text=True, timeout=max(5, seconds))
        tail = (r.stdout + r.stderr)[-1500:]
        RESULT["gpu_tests"] = {"rc": r.returncode, "tail": tail, "s": round(time.time() - t0, 1)}
    except subprocess.TimeoutExpired:
        RESULT["gpu_tests"] = {"rc": None, "tail": "timed out", "s": round(time.time() - t0, 1)}
    log("gpu tests", RESULT["gpu_tests"])
    save()


def layer_profile(small, backend, configs, best):
    """attention_layer(decode=True) at 80B dims on 64 streams x 1189 context: ms per call with each of
    ``configs`` ({name: DecodeConfig}, set as triton.DEFAULT_DECODE) and the GPU kernels with ``best``."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import api
    from pallas_kernels.paged_attention import triton as tr
    from jax_gdn.config import AttnDims
    from jax_gdn.layers import attention as A
    from jax_gdn.state import KvPages
    out = {}
    try:
        if small:
            adims = AttnDims(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32)
            n, ctx, width = 4, 70, 8
        else:
            adims = AttnDims(hidden_size=2048, num_heads=16, num_kv_heads=2, head_dim=256,
                             partial_rotary_factor=0.25, rope_theta=10_000_000.0)
            n, ctx, width = 64, 1189, 256
        d, h, hkv, dh = adims.hidden_size, adims.num_heads, adims.num_kv_heads, adims.head_dim
        ps = 16
        need = -(-(ctx + 1) // ps)
        p = n * need
        ak = jax.random.split(jax.random.PRNGKey(1), 8)
        bf = jnp.bfloat16

        def w(k, shape):
            return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(bf)
        params = {"q_proj": w(ak[0], (d, h * 2 * dh)), "k_proj": w(ak[1], (d, hkv * dh)),
                  "v_proj": w(ak[2], (d, hkv * dh)), "o_proj": w(ak[3], (h * dh, d)),
                  "q_norm": 0.1 * jax.random.normal(ak[4], (dh,)), "k_norm": 0.1 * jax.random.normal(ak[5], (dh,))}
        hidden = jax.random.normal(ak[6], (n, d), jnp.float32).astype(bf)
        kv = KvPages(k_pages=jax.random.normal(ak[7], (p, ps, hkv, dh), jnp.float32).astype(bf),
                     v_pages=jax.random.normal(ak[7], (p, ps, hkv, dh), jnp.float32).astype(bf))
        order = np.random.default_rng(0).permutation(p).astype(np.int32).reshape(n, need)
        pt = np.full((n, width), p, np.int32)
        pt[:, :need] = order
        pos = np.full((n,), ctx, np.int32)
        meta = dict(token_pos=jnp.asarray(pos), token_page=jnp.asarray(pt[np.arange(n), ctx // ps]),
                    token_offset=jnp.asarray(pos % ps), page_table=jnp.asarray(pt),
                    slot_lens=jnp.full((n,), ctx + 1, jnp.int32), cu_seqlens=jnp.arange(n + 1, dtype=jnp.int32),
                    slot_ids=jnp.arange(n, dtype=jnp.int32))
        kv_bytes = n * (ctx + 1) * hkv * dh * 2 * 2
        w_bytes = sum(int(np.prod(params[k].shape)) * 2 for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
        out.update(case=f"layer-decode-{n}x{ctx}", kv_mbytes=kv_bytes / 1e6, weight_mbytes=w_bytes / 1e6,
                   floor_ms=(kv_bytes + w_bytes) / HBM * 1e3)

        def step(params, hidden, kv, meta):
            return A.attention_layer(params, adims, hidden, kv, decode=True, backend=backend, **meta)
        state = {"kv": kv}
        out["ms_by_config"] = {}
        for cname in [c for c in configs if c != best] + [best]:          # the best last: it is profiled
            tr.DEFAULT_DECODE = configs[cname]
            api._decode_jit.clear_cache()
            fn = jax.jit(step, donate_argnums=(2,))

            def call():
                y, state["kv"] = fn(params, hidden, state["kv"], meta)
                return y
            jax.block_until_ready(call())
            out["ms_by_config"][cname] = timeit(call, jax.block_until_ready, **(
                dict(warmup=1, groups=2, per_group=1) if small else dict(warmup=3, groups=7, per_group=10)))
        out["ms"] = out["ms_by_config"][best]
        out["profiled_config"] = best
        hlo = fn.lower(params, hidden, state["kv"], meta).compile().as_text()
        import re
        ops = re.findall(r"^\s*(?:ROOT )?\S+ = \S+ (fusion|custom-call|copy|copy-start|scatter|gather|dynamic-update-"
                         r"slice|convolution|dot)\(.*?(?:kind=(\w+)|custom_call_target=\"([^\"]+)\"|$)", hlo, re.M)
        counts = {}
        for op, kind, target in ops:
            key = op + (f":{kind}" if kind else "") + (f":{target}" if target else "")
            counts[key] = counts.get(key, 0) + 1
        out["hlo_ops"] = counts
        with open(os.path.join(OUT, "layer_decode_hlo.txt"), "w") as f:
            f.write(hlo)
        log("layer", {k: v for k, v in out.items() if k != "hlo_ops"}, "hlo", counts)
        out.update(trace_kernels(call, 5, "layer_decode"))
        if not out["kernels_ms"]:
            out["note"] = "no GPU kernel events in the trace (CPU run, or no CUPTI): see hlo_ops"
    except Exception as err:  # noqa: BLE001
        out["error"] = f"{type(err).__name__}: {str(err)[:400]}"
    tr.DEFAULT_DECODE = None
    api._decode_jit.clear_cache()
    log("layer profile", out)
    RESULT["layer"] = out
    save()


def table():
    log("\n==== paged decode (median ms; GB/s and % of 4.8 TB/s on the K/V bytes; rel = RMS vs fp32 reference) ====")
    for an in RESULT["anchors"]:
        mb = an["mbytes"]
        log(f"-- {an['case']}: {mb:.1f} MB K/V, W={an['W']}")
        for key in ("torch_sdpa_ms", "read_floor_ms"):
            if key in an:
                ms = an[key]
                log(f"   {key[:-3]:14s} {ms:8.4f} ms {mb / ms:7.0f} GB/s {100 * mb / ms / 4800:5.1f}%"
                    + (f"  rel {an['torch_sdpa_rel']:.1e}" if key == "torch_sdpa_ms" and "torch_sdpa_rel" in an
                       else ""))
            elif key[:-3] + "_err" in an:
                log(f"   {key[:-3]:14s} {an[key[:-3] + '_err']}")
        for r in RESULT["rows"]:
            if r["case"] != an["case"]:
                continue
            if "ms" in r:
                log(f"   {r['variant']:14s} {r['ms']:8.4f} ms {r['gbps']:7.0f} GB/s {r['pct_hbm']:5.1f}%  rel "
                    f"{r['rel']:.1e}{'' if r['ok'] else '  FAIL'}")
                for k, ms, cnt in r.get("kernels_ms") or []:
                    log(f"   {'':14s}   kernel {ms:8.4f} ms x{cnt} {k}")
            else:
                log(f"   {r['variant']:14s} {r.get('error')}")
    lay = RESULT.get("layer") or {}
    if lay:
        log(f"-- {lay.get('case')}: layer ms by decode config {lay.get('ms_by_config')}; with "
            f"{lay.get('profiled_config')}: {lay.get('ms', float('nan')):.4f} ms, GPU kernels "
            f"{lay.get('kernels_sum_ms', float('nan'))} ms/call, floor {lay.get('floor_ms', float('nan')):.4f} ms "
            f"(weights {lay.get('weight_mbytes', 0):.1f} MB + K/V {lay.get('kv_mbytes', 0):.1f} MB at 4.8 TB/s)"
            + (f"  ERROR {lay['error']}" if "error" in lay else ""))
        for k, ms, cnt in (lay.get("kernels_ms") or [])[:14]:
            log(f"   {ms:8.4f} ms x{cnt:<2d} {k}")
        if not lay.get("kernels_ms"):
            log(f"   hlo ops: {lay.get('hlo_ops')}")
    if "gpu_tests" in RESULT:
        log(f"gpu decode tests: rc={RESULT['gpu_tests']['rc']} "
            f"{(RESULT['gpu_tests']['tail'].strip().splitlines() or ['?'])[-1]}")
    log(f"best (mean % of HBM over 64x4096 and 256x1024): {RESULT.get('ranked_issue_cases', [])[:5]}")
    for note in RESULT["notes"]:
        log("note:", note)


if __name__ == "__main__":
    sys.exit(main())
