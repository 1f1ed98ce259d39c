"""Session 6 device run for paged-attention DECODE (issues 11 and 9): the 64 x 4096 row at >= 70% of HBM and the
attention decode layer within 2x of its floor. Budget ~110 s on a warm H200 (``--budget``; a deadline skips what
would not fit, the GPU tests keep their reserve).

    python benchmarks/gpu/attn_decode_s6.py [--quick] [--budget 110]
    --quick: CPU, interpret mode, tiny dims (tests this script end to end; numbers mean nothing)

1. Decode op (80B attention dims: H 16, Hkv 2, Dh 256, bf16, pages of 16 shuffled; the bench's own inputs,
   jax_gdn.bench_attention.build_case): 64x4096 (W 256), 256x1024 (W 64), model-64x1190 (W 75: decode_parts'
   table). Every DecodeConfig below: numerics against the XLA reference on fp32 copies (matmul precision
   highest; rel RMS, bf16 passes at 2e-2), then the bench's figure: jax_gdn.bench.time_jax with the bench's
   settings (15 groups of 10 back-to-back calls, one block_until_ready each, median), GB/s of the K/V bytes
   N keys Hkv Dh 2 2 and % of 4.8 TB/s. torch SDPA on dense K/V (flash / efficient) as the anchor.
2. Kernel alone and per-call time: ONE jax.profiler trace of 5 back-to-back calls of every config of 64x4096
   (2 ms apart, so the GPU timeline splits into one segment per config): GPU kernel us per call (sum, and by
   name) and the span per call; span - kernels = idle time between the kernels of consecutive calls.
3. Decode layer (attention_layer(decode=True) + input norm + residual, decode_parts' "attention_decode": 64 x
   1189 context, W 75, pool donated): in-program ms (jax_gdn.bench_model._in_program, 20 iterations in one
   program) for the unfused layer and the fused step (attention_decode_fused: kv write kernel, gated decode
   kernel) with three weights / qkv_proj, q prologue xla / kernel, combine pallas / fused; floor 0.0439 ms
   (54.5 MB weights + 156 MB K/V at 4.8 TB/s); a trace of one call of each (kernels, launches).
4. The decode gpu tests (-v: a hang names its test) in a child process with the time left.

Output: $OUT/attn_decode_s6.json (after every step), $OUT/attn_decode_s6.log (everything printed); table last.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "attn_decode_s6.log"), "w")
RESULT: dict = {"op": [], "anchors": {}, "op_trace": {}, "layer": [], "layer_trace": {}, "notes": []}
HBM = 4.8e12


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def save():
    with open(os.path.join(OUT, "attn_decode_s6.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def elapsed():
    return time.time() - T0


def op_configs(tr, case):
    """(name, DecodeConfig) per case, the op's default first (None: decode_config's pick; after run 1: power-of-two
    split counts, the Pallas combine). Run 1's figures: benchmarks/logs/attn_decode_s6_run1.log."""
    D = tr.DecodeConfig
    if case == "64x4096":      # session 7: repeated defaults (the run-of-record spread was 68-74%)
        return [("default", None), ("ns2-fused", D(num_splits=2, combine="fused")),
                ("bk32-s3-ns2-fused", D(block_k=32, num_stages=3, num_splits=2, combine="fused")),
                ("ns4-fused", D(num_splits=4, combine="fused")), ("default-again", None),
                ("bk32-s3-ns2", D(block_k=32, num_stages=3, num_splits=2)), ("ns2-fused-again", D(num_splits=2, combine="fused")),
                ("default-third", None)]
    if case == "256x1024":
        return [("default", None), ("ns2-fused", D(num_splits=2, combine="fused"))]
    return [("default", None), ("ns3-pallas", D(num_splits=3)), ("ns2-fused", D(num_splits=2, combine="fused")),
            ("bk32-ns3-fused", D(block_k=32, combine="fused")), ("ns4-pallas", D(num_splits=4)),
            ("ns1", D(num_splits=1))]


def gpu_timeline(trace_dir):
    """[(ts_us, dur_us, name)] of the kernels (events on GPU "Stream" threads) of the newest Perfetto trace."""
    from trace_events import is_kernel, load_trace
    events, _ = load_trace(trace_dir)
    return [(float(e["ts"]), float(e["dur"]), e["name"]) for e in events if is_kernel(e)]


def segments(events, gap_us=1000.0):
    """The timeline cut where the GPU idles more than gap_us (one segment per traced config)."""
    segs, cur, end = [], [], 0.0
    for ts, dur, name in events:
        if cur and ts - end > gap_us:
            segs.append(cur)
            cur = []
        end = ts + dur if not cur else max(end, ts + dur)
        cur.append((ts, dur, name))
    if cur:
        segs.append(cur)
    return segs


def seg_stats(seg, calls):
    by = {}
    for _, dur, name in seg:
        k = by.setdefault(name[:60], [0.0, 0])
        k[0] += dur / calls
        k[1] += 1
    span = max(ts + d for ts, d, _ in seg) - seg[0][0]
    ksum = sum(d for _, d, _ in seg)
    return {"kernels_us": round(ksum / calls, 2), "span_us_per_call": round(span / calls, 2),
            "launches_per_call": round(len(seg) / calls, 2),
            "by_kernel": sorted(((k, round(v[0], 2), v[1] // calls) for k, v in by.items()), key=lambda x: -x[1])}


def trace_calls(calls_by_name, ncalls, tag):
    """One profiler trace: for each (name, call) ncalls back-to-back calls, a sync, 2 ms of idle; returns
    {name: seg_stats} (None for all when the segments do not match the configs)."""
    import jax
    tdir = os.path.join(OUT, f"trace_{tag}")
    with jax.profiler.trace(tdir, create_perfetto_trace=True):
        for _, call in calls_by_name:
            y = None
            for _ in range(ncalls):
                y = call()
            jax.block_until_ready(y)
            time.sleep(0.002)
    ev = gpu_timeline(tdir)
    shutil.rmtree(tdir, ignore_errors=True)
    segs = segments(ev)
    if len(segs) < len(calls_by_name):
        return {"error": f"{len(segs)} timeline segments for {len(calls_by_name)} configs", "events": len(ev)}
    out = {}
    if len(segs) > len(calls_by_name):     # stray events before the first config (profiler start): the last n
        out["note"] = f"{len(segs)} segments for {len(calls_by_name)} configs: the last {len(calls_by_name)} used"
        segs = segs[-len(calls_by_name):]
    out.update({name: seg_stats(seg, ncalls) for (name, _), seg in zip(calls_by_name, segs)})
    return out


def torch_sdpa_ms(args, keys, scale):
    """torch SDPA (flash / efficient) on dense contiguous K/V gathered once on the device, one batched call."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from jax_gdn.bench import time_jax  # noqa: F401  (same process; timing below is the same method)
    q, kp, vp, pt = args[:4]
    n, h, dh = q.shape
    hkv, ps = kp.shape[2], kp.shape[1]
    need = -(-keys // ps)

    @jax.jit
    def dense(kp, vp, pt):
        def one(pool):
            x = pool[pt[:, :need]].reshape(n, need * ps, hkv, dh)[:, :keys]
            return jnp.transpose(x, (0, 2, 1, 3))
        return one(kp), one(vp), q[:, :, None, :]
    dj = jax.block_until_ready(dense(kp, vp, pt))
    kd, vd, qd = (torch.from_dlpack(x).contiguous() for x in dj)

    def run():
        return F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)
    import statistics
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(10):
                run()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / 10 * 1e3)
    return statistics.median(times)


def run_op(quick, backend, gpu, deadline):
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench import time_jax
    from jax_gdn.bench_attention import build_case
    from pallas_kernels.paged_attention import api, reference
    from pallas_kernels.paged_attention import triton as tr
    dims = dict(h=16, hkv=2, dh=32) if quick else dict(h=16, hkv=2, dh=256)
    cases = ([("64x4096", 4, 160, None), ("256x1024", 8, 40, None), ("model-64x1190", 4, 70, 12)] if quick else
             [("64x4096", 64, 4096, None), ("256x1024", 256, 1024, None), ("model-64x1190", 64, 1190, 75)])
    reps = dict(warmup=1, groups=2, per_group=2) if quick else dict(warmup=3, groups=15, per_group=10)
    scale = dims["dh"] ** -0.5
    for case, n, keys, width in cases:
        args, _ = build_case((1,) * n, keys - 1, dtype=jnp.bfloat16, **dims)
        q, kp, vp, pt, sl, _, ids = args
        if width is not None and width > pt.shape[1]:           # the model's wider table: entries past = P
            pt = jnp.concatenate([pt, jnp.full((n, width - pt.shape[1]), kp.shape[0], jnp.int32)], axis=1)
        a = (q, kp, vp, pt, sl, ids)
        nbytes = n * keys * dims["hkv"] * dims["dh"] * 2 * 2
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda q, kp, vp, pt, sl, ids: reference.paged_attention_decode_xla(
                q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), pt, sl, ids,
                scale=scale))(*a)
        ref = np.asarray(ref, np.float64)
        calls = []
        for name, cfg in op_configs(tr, case):
            if elapsed() > deadline and name != "default":
                RESULT["notes"].append(f"{case} {name} skipped (deadline)")
                continue
            row = {"case": case, "variant": name, "mbytes": nbytes / 1e6, "W": int(pt.shape[1])}
            eff = cfg or tr.decode_config(jnp.bfloat16, dims["dh"])
            ns = eff.num_splits or tr._num_splits(n * dims["hkv"], int(pt.shape[1]) * 16, eff.block_k, eff.waves,
                                                   tr._sm_count())
            row["config"] = dict(eff.__dict__, resolved_num_splits=ns)
            t1 = time.time()
            try:
                fn = jax.jit(lambda *x, cfg=cfg: api.paged_attention_decode(*x, scale=scale, backend=backend,
                                                                            config=cfg))
                o = np.asarray(fn(*a).astype(jnp.float32), np.float64)
                row["rel"] = float(np.sqrt(np.mean((o - ref) ** 2) / np.mean(ref ** 2)))
                row["ok"] = bool(row["rel"] <= 2e-2)
                row["ms"] = time_jax(fn, a, **reps)
                row["gbps"] = nbytes / row["ms"] / 1e6
                row["pct_hbm"] = 100 * nbytes / row["ms"] / 1e-3 / HBM
                calls.append((name, lambda fn=fn: fn(*a)))
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            row["s"] = round(time.time() - t1, 1)
            log({k: v for k, v in row.items() if k != "config"}, "NS", ns)
            RESULT["op"].append(row)
            save()
        if case == "64x4096":       # the same op R times in ONE program (q fed back): no per-call dispatch
            from jax_gdn import bench_model
            for r in [r for r in RESULT["op"] if r["case"] == case and r["variant"] in ("default", "ns2-fused")]:
                if elapsed() > deadline + 6 or "ms" not in r:
                    continue
                cfg = dict(op_configs(tr, case))[r["variant"]]
                try:
                    ip = bench_model._in_program(lambda *x, cfg=cfg: api.paged_attention_decode(
                        *x, scale=scale, backend=backend, config=cfg), a, feed=(0,), iters=2 if quick else 10)
                    r["ms_in_program"] = ip["ms"]
                except Exception as err:  # noqa: BLE001
                    r["ms_in_program_err"] = f"{type(err).__name__}: {str(err)[:200]}"
                log("in-program", case, r["variant"], r.get("ms_in_program"), r.get("ms_in_program_err", ""))
        if gpu and case == "64x4096" and elapsed() < deadline + 8:
            try:
                RESULT["anchors"][case] = {"torch_sdpa_ms": torch_sdpa_ms(a, keys, scale)}
            except Exception as err:  # noqa: BLE001
                RESULT["anchors"][case] = {"torch_sdpa_err": f"{type(err).__name__}: {str(err)[:200]}"}
            log("anchor", case, RESULT["anchors"][case])
        if case != "256x1024" and calls and (elapsed() < deadline + 10 or quick):
            try:
                RESULT["op_trace"][case] = trace_calls(calls, 5, f"op_{case}")
            except Exception as err:  # noqa: BLE001
                RESULT["op_trace"][case] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            log("trace", case, {k: (v if not isinstance(v, dict) else {kk: v[kk] for kk in v if kk != "by_kernel"})
                                for k, v in RESULT["op_trace"][case].items()})
            save()


def run_layer(quick, backend, deadline):
    """decode_parts' attention_decode (input norm + attention_layer(decode=True) + residual) in one program."""
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_model
    from jax_gdn.config import AttnDims
    from jax_gdn.layers import attention as A
    from jax_gdn.ops.norms import rms_norm
    from jax_gdn.state import KvPages
    from pallas_kernels.paged_attention import api
    from pallas_kernels.paged_attention import triton as tr
    if quick:
        adims = AttnDims(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, partial_rotary_factor=0.25)
        n, ctx = 4, 70
    else:
        adims = AttnDims(hidden_size=2048, num_heads=16, num_kv_heads=2, head_dim=256, partial_rotary_factor=0.25,
                         rope_theta=10_000_000.0)
        n, ctx = 64, 1189
    d, h, hkv, dh = adims.hidden_size, adims.num_heads, adims.num_kv_heads, adims.head_dim
    ps = 16
    pp = -(-(ctx + 1) // ps)
    ak = jax.random.split(jax.random.PRNGKey(1), 8)
    bf = jnp.bfloat16

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(bf)
    params = {"q_proj": w(ak[0], (d, h * 2 * dh)), "k_proj": w(ak[1], (d, hkv * dh)), "v_proj": w(ak[2], (d, hkv * dh)),
              "o_proj": w(ak[3], (h * dh, d)), "q_norm": 0.1 * jax.random.normal(ak[4], (dh,)),
              "k_norm": 0.1 * jax.random.normal(ak[5], (dh,))}
    fused_params = A.fuse_qkv(params)
    norm = 0.1 * jax.random.normal(ak[6], (d,))
    x = jax.random.normal(ak[7], (n, d), jnp.float32).astype(bf)
    table = jnp.asarray(np.random.default_rng(0).permutation(n * pp).astype(np.int32).reshape(n, pp))
    tok_pos = jnp.full((n,), ctx, jnp.int32)
    meta = dict(token_pos=tok_pos, token_page=table[:, ctx // ps], token_offset=tok_pos % ps, page_table=table,
                slot_lens=jnp.full((n,), ctx + 1, jnp.int32), cu_seqlens=jnp.arange(n + 1, dtype=jnp.int32),
                slot_ids=jnp.arange(n, dtype=jnp.int32))
    kv0 = KvPages(k_pages=jax.random.normal(ak[0], (n * pp, ps, hkv, dh), jnp.float32).astype(bf),
                  v_pages=jax.random.normal(ak[1], (n * pp, ps, hkv, dh), jnp.float32).astype(bf))
    w_bytes = 2 * (d * h * 2 * dh + 2 * d * hkv * dh + h * dh * d)
    kv_bytes = n * (ctx + 1) * hkv * dh * 2 * 2
    RESULT["layer_floor_ms"] = (w_bytes + kv_bytes) / HBM * 1e3
    D = tr.DecodeConfig
    if os.environ.get("ATTN_AB"):     # session 7, call 3: the q prologue in the kernel against the default, interleaved
        qk = D(q_prologue="kernel")
        variants = [("fused-qkv", fused_params, True, None), ("fused-qkv-qkernel", fused_params, True, qk)] * 3
        variants = [(f"{n}-{i // 2}", p_, f_, c_) for i, (n, p_, f_, c_) in enumerate(variants)]
    else:
        # session 7's call-2 set also timed split-K of the decode GEMMs (sk2 / sk4 / sk8: slower, the switch was
        # removed; benchmarks/logs/s7/call2_attn_layer*.log, paged_attention/NOTES.md "Session 7: decode step")
        variants = [("unfused", params, False, None), ("fused-qkv", fused_params, True, None),
                    ("fused-qkv-qxla", fused_params, True, D(q_prologue="xla")),   # the default is "kernel" now
                    ("fused-qkv-ns4-cfused", fused_params, True, D(num_splits=4, combine="fused")),
                    ("fused-qkv-again", fused_params, True, None)]
    ref_out = None
    calls = []
    for name, p, fused, cfg in variants:
        if elapsed() > deadline and name != "unfused":
            RESULT["notes"].append(f"layer {name} skipped (deadline)")
            continue
        row = {"variant": name, "fused": fused, "qkv_proj": "qkv_proj" in p,
               "config": None if cfg is None else cfg.__dict__}
        t1 = time.time()
        tr.DEFAULT_DECODE = cfg
        api._decode_jit.clear_cache()
        api._decode_gated_jit.clear_cache()
        try:
            def attn(mp, norm, x, kv, fused=fused):
                hh = rms_norm(x, norm, 1e-6)
                hh, kv = A.attention_layer(mp, adims, hh, kv, decode=True, backend=backend, fused=fused, **meta)
                return x + hh, kv
            step = jax.jit(attn, donate_argnums=(3,))
            st = {"kv": jax.tree.map(jnp.copy, kv0)}

            def call(step=step, p=p, st=st):
                yy, st["kv"] = step(p, norm, x, st["kv"])
                return yy
            y = np.asarray(call().astype(jnp.float32), np.float64)          # the first step: numerics
            if ref_out is None:
                ref_out = y
            row["rel_vs_unfused"] = float(np.sqrt(np.mean((y - ref_out) ** 2) / np.mean((ref_out - np.asarray(
                x.astype(jnp.float32))) ** 2)))
            calls.append((name, call))
            r = bench_model._in_program(attn, (p, norm, x), state=kv0, feed=(2,), iters=4 if quick else 20,
                                          batches=int(os.environ.get("ATTN_BATCHES", "3")))
            row.update(ms=r["ms"], wall_ms=r["wall_ms"], carried_copies=r["carried_copies"],
                       compile_s=round(r["compile_s"], 1))
            row["x_floor"] = row["ms"] / RESULT["layer_floor_ms"] if row["ms"] else None
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        row["s"] = round(time.time() - t1, 1)
        log("layer", row)
        RESULT["layer"].append(row)
        save()
    tr.DEFAULT_DECODE = None
    if calls and (elapsed() < deadline + 8 or quick):
        try:
            RESULT["layer_trace"] = trace_calls(calls, 3, "layer")
        except Exception as err:  # noqa: BLE001
            RESULT["layer_trace"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        save()
    api._decode_jit.clear_cache()
    api._decode_gated_jit.clear_cache()


def gpu_tests(seconds):
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-v", "-x", "-m", "gpu", "-p", "no:randomly", "-p", "no:cacheprovider",
           "-k", "gpu_decode or gpu_kv_write", "tests/pallas_kernels/test_paged_attention.py"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10, seconds))
        out = r.stdout + r.stderr
        RESULT["gpu_tests"] = {"rc": r.returncode, "passed": out.count(" PASSED"), "failed": out.count(" FAILED"),
                               "tail": out[-2500:], "s": round(time.time() - t0, 1)}
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        RESULT["gpu_tests"] = {"rc": None, "tail": "timed out\n" + out[-2000:], "s": round(time.time() - t0, 1)}
    log("gpu tests", {k: v for k, v in RESULT["gpu_tests"].items() if k != "tail"})
    log(RESULT["gpu_tests"]["tail"][-1500:])
    save()


def table():
    log("\n==== attn_decode_s6: paged decode (bench figure: time_jax 15 x 10, median ms; GB/s and % of 4.8 TB/s on "
        "the K/V bytes; rel vs fp32 XLA) ====")
    for case in ("64x4096", "256x1024", "model-64x1190"):
        tr_ = RESULT["op_trace"].get(case) or {}
        an = RESULT["anchors"].get(case) or {}
        rows = [r for r in RESULT["op"] if r["case"] == case]
        if not rows:
            continue
        log(f"-- {case} (W {rows[0]['W']}, {rows[0]['mbytes']:.1f} MB)"
            + (f"  torch SDPA {an['torch_sdpa_ms']:.4f} ms ({rows[0]['mbytes'] / an['torch_sdpa_ms'] / 48:.1f}%)"
               if "torch_sdpa_ms" in an else ""))
        log(f"   {'config':20s} {'NS':>3s} {'ms':>8s} {'GB/s':>6s} {'%HBM':>5s} {'rel':>8s} | kernels us/call "
            f"(% HBM) span us/call launches")
        for r in rows:
            if "ms" not in r:
                log(f"   {r['variant']:20s} ERROR {r.get('error')}")
                continue
            t = tr_.get(r["variant"]) if isinstance(tr_.get(r["variant"]), dict) else {}
            kpct = (f"{t['kernels_us']:7.1f} ({100 * r['mbytes'] / t['kernels_us'] / 4.8:4.1f}%) "
                    f"{t['span_us_per_call']:7.1f} {t['launches_per_call']:4.1f}" if t.get("kernels_us") else "")
            ip = f"  in-program {r['ms_in_program']:.4f} ms" if r.get("ms_in_program") else ""
            log(f"   {r['variant']:20s} {r['config']['resolved_num_splits']:3d} {r['ms']:8.4f} {r['gbps']:6.0f} "
                f"{r['pct_hbm']:5.1f} {r['rel']:8.1e}{'' if r['ok'] else ' FAIL'} | {kpct}{ip}")
    if RESULT["layer"]:
        log(f"-- decode layer 64 x 1189 (W 75), in-program ms (20 iterations in one program); floor "
            f"{RESULT.get('layer_floor_ms', float('nan')):.4f} ms; target <= 2x")
        lt = RESULT.get("layer_trace") or {}
        for r in RESULT["layer"]:
            t = lt.get(r["variant"]) if isinstance(lt.get(r["variant"]), dict) else {}
            if "ms" in r and r["ms"]:
                log(f"   {r['variant']:26s} {r['ms']:8.4f} ms ({r['x_floor']:.2f}x floor) wall {r['wall_ms']:.4f} "
                    f"rel {r['rel_vs_unfused']:.1e} copies {r['carried_copies']}"
                    + (f" | kernels {t['kernels_us']:.1f} us, {t['launches_per_call']:.0f} launches" if t else ""))
            else:
                log(f"   {r['variant']:26s} {r.get('error') or r.get('ms')}")
        best = min((r for r in RESULT["layer"] if r.get("ms")), key=lambda r: r["ms"], default=None)
        t = lt.get(best["variant"]) if best and isinstance(lt.get(best["variant"]), dict) else {}
        for k, us, cnt in (t.get("by_kernel") or [])[:14]:
            log(f"      {us:7.2f} us x{cnt} {k}")
    if "gpu_tests" in RESULT:
        g = RESULT["gpu_tests"]
        log(f"gpu decode tests: rc={g['rc']} passed {g.get('passed')} failed {g.get('failed')} ({g['s']} s)")
    for note in RESULT["notes"]:
        log("note:", note)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=110.0)
    ap.add_argument("--steps", default="op,layer,tests")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import jax
    gpu = jax.default_backend() == "gpu"
    quick = a.quick or not gpu
    backend = "pallas" if gpu else "pallas_interpret"
    steps = a.steps.split(",")
    log(f"jax {jax.__version__} {jax.devices()[0]} quick={quick} budget={a.budget}s")
    RESULT.update(device=str(jax.devices()[0]), jax=jax.__version__, quick=quick, budget=a.budget)
    test_reserve = 0 if quick or "tests" not in steps else 30
    try:
        if "op" in steps:
            run_op(quick, backend, gpu, a.budget - test_reserve - 42 if "layer" in steps else a.budget - 10)
        if "layer" in steps:
            run_layer(quick, backend, a.budget - test_reserve - 8)
    except Exception as err:  # noqa: BLE001
        import traceback
        RESULT["notes"].append(f"ERROR {type(err).__name__}: {err}")
        log(traceback.format_exc())
    if "tests" in steps and not quick:
        gpu_tests(a.budget - elapsed())
    table()
    log(f"total {elapsed():.0f} s")
    save()


if __name__ == "__main__":
    sys.exit(main())
