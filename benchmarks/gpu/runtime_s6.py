"""Why the model's decode step takes longer than its kernels (H200 run 1: wall 9.41 ms, kernels 6.62 ms, 469
launches, host dispatch of one call 2.21 ms): the 8-layer model at Qwen3-Next-80B dims, decode for 64 streams x
1189 context, with the XLA options and layer-scan unrolls that change how the step is launched:

  base        the defaults (rolled layer scan, XLA's default command buffers)
  cb_off      compiler_options xla_gpu_enable_command_buffer="" (no CUDA graphs: what the graphs buy)
  cb_while    command buffers with WHILE and CONDITIONAL too (the layer loop inside one graph)
  unroll      scan_unroll decode=True (no while loop in the decode program)
  unroll_cb   both

Per variant: compile s, wall ms (median of blocking calls), pipelined ms per call (10 calls, one block), host
dispatch ms (the call returning, device idle before), the compiled program's while loops (with / without a known
trip count) and conditionals. Then, for base and the best variant, the varlen16 prefill the same way. The cache is
filled once (base model) and handed from variant to variant (each decode step donates and returns it).

    python benchmarks/gpu/runtime_s6.py [--budget 240] [--quick]

Writes $OUT/runtime_s6.json; prints a table last. --quick: tiny dims on CPU (the GPU-only options are skipped).
"""
import argparse
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT", "/tmp/out")
RES = {"rows": []}
CB_ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def log(*a):
    print(*a, flush=True)


def save():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "runtime_s6.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def loops(compiled_text: str) -> dict:
    whiles = [ln for ln in compiled_text.splitlines() if re.search(r"\bwhile\(", ln)]
    known = sum("known_trip_count" in ln for ln in whiles)
    return {"while": len(whiles), "while_known_trip": known,
            "conditional": len(re.findall(r"\bconditional\(", compiled_text))}


def timings(call, sync, calls: int = 10) -> dict:
    sync(call())
    walls, disp = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        y = call()
        disp.append(time.perf_counter() - t0)
        sync(y)
        walls.append(time.perf_counter() - t0)
    pipes = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = call()
        sync(y)
        pipes.append((time.perf_counter() - t0) / calls)
    return {"wall_ms": round(1e3 * float(np.median(walls)), 4), "dispatch_ms": round(1e3 * float(np.median(disp)), 4),
            "pipelined_ms": round(1e3 * float(np.median(pipes)), 4)}


def trace_calls(step, sync, calls: int = 3, top: int = 25) -> dict:
    """``calls`` blocking calls of step() under the profiler, each inside a TraceAnnotation "rt_call<i>": per call
    the host time inside the call (dispatch), the delay from the call's start to its first GPU kernel, the GPU span
    (first kernel start to last kernel end) and the GPU idle time inside that span; and the host events inside the
    call windows by total time (what the host does while dispatching)."""
    import jax
    from trace_events import is_gpu, is_kernel, load_trace
    tdir = "/tmp/trace_runtime"
    sync(step())
    with jax.profiler.trace(tdir, create_perfetto_trace=True):
        for i in range(calls):
            with jax.profiler.TraceAnnotation(f"rt_call{i}"):
                y = step()
            sync(y)
    xs, _ = load_trace(tdir)
    gpu = [e for e in xs if is_kernel(e)]
    out = {"calls": [], "host_events": []}
    host_tot = {}
    for i in range(calls):
        win = [e for e in xs if e["name"] == f"rt_call{i}"]
        if not win:
            continue
        w0, w1 = win[0]["ts"], win[0]["ts"] + win[0]["dur"]
        nxt = [e for e in xs if e["name"] == f"rt_call{i + 1}"]
        end = nxt[0]["ts"] if nxt else float("inf")
        k = [e for e in gpu if w0 <= e["ts"] < end]
        if k:
            span0, span1 = k[0]["ts"], max(e["ts"] + e["dur"] for e in k)
            busy = sum(e["dur"] for e in k)
            out["calls"].append({"dispatch_ms": round(win[0]["dur"] / 1e3, 4),
                                 "first_kernel_after_ms": round((span0 - w0) / 1e3, 4),
                                 "gpu_span_ms": round((span1 - span0) / 1e3, 4),
                                 "gpu_busy_ms": round(busy / 1e3, 4),
                                 "kernels_before_dispatch_end": sum(e["ts"] < w1 for e in k), "kernels": len(k)})
        for e in xs:
            if w0 <= e["ts"] < w1 and not is_gpu(e) and e["name"] != f"rt_call{i}":
                host_tot[e["name"][:80]] = host_tot.get(e["name"][:80], 0.0) + e["dur"] / 1e3 / calls
    out["host_events"] = sorted(((k, round(v, 4)) for k, v in host_tot.items()), key=lambda kv: -kv[1])[:top]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=240)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trace-only", action="store_true",
                    help="only the default model's decode calls under the profiler (trace_calls), no variants")
    a = ap.parse_args()
    t0 = time.time()

    def left():
        return a.budget - (time.time() - t0)
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_model as bm
    from jax_gdn.model import HybridModel
    RES.update(jax=jax.__version__, device=str(jax.devices()[0]))
    cfg = bm.tiny_config(8) if a.quick else bm.qwen3_next_80b_config(8)
    cases = bm._cases(a.quick)
    base = bm.random_device_model(cfg, dtype=jnp.bfloat16)
    params = base.params
    st = {"cache": base.init_cache(**bm._shared_cache_kwargs(cases, 5))}
    rng = np.random.default_rng(0)
    _, dn, dctx, dchunk = cases["decode"]
    slots = np.arange(dn, dtype=np.int32)
    for c in range(0, dn, dchunk):
        sl = slots[c:c + dchunk]
        ids = rng.integers(0, cfg.vocab_size, len(sl) * dctx).astype(np.int32)
        _, st["cache"] = base.prefill(st["cache"], ids, bm._cu([dctx] * len(sl)), sl)
    jax.block_until_ready(st["cache"])
    log(f"context filled: {time.time() - t0:.0f} s")
    nxt = rng.integers(0, cfg.vocab_size, dn).astype(np.int32)
    if a.trace_only:
        def step0():
            logits, st["cache"] = base.decode(st["cache"], nxt, slots)
            return logits
        RES["trace"] = tr = trace_calls(step0, jax.block_until_ready)
        save()
        log("== decode calls under the profiler (ms): dispatch, first kernel after, GPU span, GPU busy, kernels "
            "launched before the call returned / all")
        for c in tr["calls"]:
            log(f"   {c['dispatch_ms']:8.3f} {c['first_kernel_after_ms']:8.3f} {c['gpu_span_ms']:8.3f} "
                f"{c['gpu_busy_ms']:8.3f}  {c['kernels_before_dispatch_end']}/{c['kernels']}")
        log("== host events inside the calls (ms per call)")
        for k, v in tr["host_events"]:
            log(f"   {v:8.4f}  {k}")
        log(f"total {time.time() - t0:.0f} s")
        return
    variants = [("base", {}), ("unroll", dict(scan_unroll={"prefill": 1, "decode": True}))]
    if not a.quick:
        variants[1:1] = [("cb_off", dict(compiler_options={"xla_gpu_enable_command_buffer": ""})),
                         ("cb_while", dict(compiler_options={"xla_gpu_enable_command_buffer": CB_ALL}))]
        variants.append(("unroll_cb", dict(scan_unroll={"prefill": 1, "decode": True},
                                           compiler_options={"xla_gpu_enable_command_buffer": CB_ALL})))
    models = {}
    for name, kw in variants:
        if left() < 35:
            log(f"skip {name}: {left():.0f} s left")
            continue
        row = {"variant": name, "kind": "decode", "options": kw}
        try:
            m = base if name == "base" else HybridModel(cfg, params, dtype=jnp.bfloat16, **kw)
            models[name] = m
            ids_p, cu_p, sl_p = m._padded(nxt, np.arange(dn + 1), slots, dn, dn, st["cache"].num_slots)
            tc = time.time()
            comp = m._decode_jit.lower(m.params, st["cache"], ids_p, cu_p, sl_p).compile()
            row["compile_s"] = round(time.time() - tc, 1)
            text = comp.as_text()
            row.update(loops(text))
            if name == "base":                      # the program whose kernel table profile_s6 printed
                with open(os.path.join(OUT, "decode_base.hlo.txt"), "w") as f:
                    f.write(text)
                row["copies"] = len(re.findall(r"= [^=]* copy\(", text))
                row["copy_starts"] = len(re.findall(r"copy-start\(", text))

            def step():
                logits, st["cache"] = m.decode(st["cache"], nxt, slots)
                return logits
            row.update(timings(step, jax.block_until_ready))
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:500]
        RES["rows"].append(row)
        log(row)
        save()
    ok = [r for r in RES["rows"] if "wall_ms" in r]
    best = min(ok, key=lambda r: r["wall_ms"])["variant"] if ok else None
    _, lens = cases["varlen"]
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    sl = np.arange(len(lens), dtype=np.int32)
    for name in dict.fromkeys(["base", best]):
        if name is None or name not in models or left() < 60:
            continue
        m = models[name]
        row = {"variant": name, "kind": "prefill"}
        try:
            def prefill():
                st["cache"] = m.release(st["cache"], sl)
                logits, st["cache"] = m.prefill(st["cache"], ids, bm._cu(lens), sl)
                return logits
            row.update(timings(prefill, jax.block_until_ready, calls=5))
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:500]
        RES["rows"].append(row)
        log(row)
        save()
    log("\n== runtime_s6 (ms; dispatch = host time of one call with the device idle)")
    log(f"{'variant':10s} {'kind':8s} {'wall':>8s} {'pipelined':>9s} {'dispatch':>8s} {'compile_s':>9s} "
        f"{'while(known)':>12s} {'cond':>4s}")
    for r in RES["rows"]:
        if "error" in r:
            log(f"{r['variant']:10s} {r['kind']:8s} ERROR {r['error'][:150]}")
            continue
        log(f"{r['variant']:10s} {r['kind']:8s} {r['wall_ms']:8.3f} {r['pipelined_ms']:9.3f} {r['dispatch_ms']:8.3f} "
            f"{r.get('compile_s', '-'):>9} {str(r.get('while', '-')) + '(' + str(r.get('while_known_trip', '-')) + ')':>12s}"
            f" {r.get('conditional', '-'):>4}")
    log(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
