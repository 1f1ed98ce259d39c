"""Qwen3-Next-80B dims split over two H200s (jax_gdn.sharding): one device run, one script.

Rows (random bf16 weights; the same timing for every row: median wall ms of the public ``model.prefill`` /
``model.decode`` call closed by block_until_ready, after one first call that includes the compile):
  * 48 layers (the full model: ~155 GB of weights, ~78 GB per device), made split on the 2 devices
    (init_params(mesh=)): prefill of the varlen16 mix (jax_gdn.cases, 19027 tokens), one decode step of 64
    streams (context 1189 tokens each), prefill of one 32768-token stream;
  * 12 layers at the same dims: made on GPU 0 and measured there (varlen16 prefill, 64-stream decode), then the
    same weights placed on 2 GPUs (HybridModel(mesh=)) and measured the same way; the two runs' varlen logits are
    compared (event "logits_1gpu_vs_2gpu"). GPU 0's peak memory in the 2-GPU rows includes its one-GPU copy.
Each model size runs in its own subprocess (clean peak memory, nothing left over), the full model first; a
deadline skips what would not fit. Writes ``$OUT/h200x2.json`` after every model ({"device", "jax", "date",
"rows": [{"case", "layers", "devices", "kind", "tokens", "ms", "mem_gb_per_device", "compile_s", ...}]}) and
prints a table last.

    python benchmarks/gpu/shard_x2.py [--deadline 170] [--reps 3]
    python benchmarks/gpu/shard_x2.py --quick      (CPU dry run at tiny dims: set XLA_FLAGS=
        --xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu OUT=/tmp/x first)
    python benchmarks/gpu/shard_x2.py --child LAYERS DEVICES CASES   (one configuration; prints JSON lines)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

PLAN = [(48, "2", "varlen,decode,long"), (12, "1,2", "varlen,decode")]
QUICK_PLAN = [(8, "2", "varlen,decode,long"), (4, "1,2", "varlen,decode")]


def child(layers: int, devices: str, cases: str, reps: int, quick: bool) -> None:
    """One model size. devices "2": random weights made split on the 2 devices (init_params(mesh=)); "1,2": made
    on GPU 0, measured there, then the same weights placed on 2 devices (HybridModel(mesh=)) and measured again,
    and the two runs' varlen logits compared."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_gdn.bench_model import _cases, _jax_sync, qwen3_next_80b_config, tiny_config
    from jax_gdn.model import HybridModel, init_params

    def emit(**row):
        print("ROW " + json.dumps(row), flush=True)

    cfg = (tiny_config if quick else qwen3_next_80b_config)(layers)
    # CPU dry run: the GDN rule in Pallas interpret mode (XLA's chunked form calls LAPACK's batched triangular
    # solve on CPU, which deadlocks when several device programs run it at once)
    backend = "pallas_interpret" if quick else "auto"
    cs = _cases(quick)
    logits = {}
    params = None
    for n in [int(d) for d in devices.split(",")]:
        mesh = jax.make_mesh((n,), ("model",), devices=jax.devices()[:n]) if n > 1 else None
        t0 = time.perf_counter()
        if params is None and devices == "2":
            model = HybridModel.random(cfg, 0, dtype=jnp.bfloat16, mesh=mesh, backend=backend)
        else:
            if params is None:
                params = jax.jit(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))()
            model = HybridModel(cfg, params, dtype=jnp.bfloat16, mesh=mesh, backend=backend)
        _jax_sync(model.params)

        def mem():
            return [round((d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2)
                    for d in jax.devices()[:n]]
        emit(event="params", layers=layers, devices=n, s=round(time.perf_counter() - t0, 1), mem=mem(),
             backends=repr(model.backends))
        rng = np.random.default_rng(0)
        base = dict(layers=layers, devices=n)
        for key in cases.split(","):
            if key == "decode":
                decode(model, cfg, cs, rng, base, reps, emit, mem)
            else:
                out = prefill(model, cfg, cs, key, rng, base, reps, emit, mem)
                if key == "varlen" and out is not None:
                    logits[n] = out
        del model
    if len(logits) == 2:
        a, b = (np.asarray(logits[k], np.float64) for k in sorted(logits))
        emit(event="logits_1gpu_vs_2gpu", layers=layers, rel_max=float(np.max(np.abs(a - b)) / np.max(np.abs(a))),
             argmax_agree=float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))))


def prefill(model, cfg, cs, key, rng, base, reps, emit, mem):
    """A prefill row (varlen16 mix or one long stream); returns the first call's logits."""
    import numpy as np

    from jax_gdn.bench_model import _cu, _jax_sync, _median_ms, _shared_cache_kwargs
    name, lens = cs[key]
    kw = (dict(max_seqs=1, max_tokens=lens[0] + 16, page_size=16, max_seq_len=lens[0]) if key == "long"
          else _shared_cache_kwargs(cs, reps))
    st = {"cache": model.init_cache(**kw)}
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu, slots = _cu(lens), np.arange(len(lens), dtype=np.int32)

    def call():
        logits, st["cache"] = model.prefill(st["cache"], ids, cu, slots)
        return logits

    def prepare():
        st["cache"] = _jax_sync(model.release(st["cache"], slots))
    try:
        t1 = time.perf_counter()
        first_logits = np.asarray(_jax_sync(call()))
        first = time.perf_counter() - t1
        ms = _median_ms(call, _jax_sync, reps, prepare)
        model.check(st["cache"])
        emit(case=name, kind="prefill", tokens=int(sum(lens)), ms=round(ms, 2),
             tokens_per_s=round(sum(lens) / ms * 1e3), compile_s=round(first, 1), mem_gb_per_device=mem(), **base)
        return first_logits
    except Exception as err:                      # noqa: BLE001 (reported in the row)
        emit(case=name, kind="prefill", error=f"{type(err).__name__}: {str(err)[:400]}", **base)
        return None


def decode(model, cfg, cs, rng, base, reps, emit, mem):
    """The 64-stream decode row: the context prefilled in calls of 16 streams (the varlen program), then steps."""
    import numpy as np

    from jax_gdn.bench_model import _cu, _jax_sync, _median_ms, _shared_cache_kwargs
    name, dn, dctx, dchunk = cs["decode"]
    st = {"cache": model.init_cache(**_shared_cache_kwargs(cs, reps))}
    slots = np.arange(dn, dtype=np.int32)
    try:
        for c in range(0, dn, dchunk):
            sl = slots[c:c + dchunk]
            ids = rng.integers(0, cfg.vocab_size, len(sl) * dctx).astype(np.int32)
            logits, st["cache"] = model.prefill(st["cache"], ids, _cu([dctx] * len(sl)), sl)
        _jax_sync(logits)
        nxt = rng.integers(0, cfg.vocab_size, dn).astype(np.int32)

        def step():
            logits, st["cache"] = model.decode(st["cache"], nxt, slots)
            return logits
        t1 = time.perf_counter()
        _jax_sync(step())
        first = time.perf_counter() - t1
        ms = _median_ms(step, _jax_sync, max(reps, 5))
        model.check(st["cache"])
        emit(case=name, kind="decode", tokens=dn, ms=round(ms, 3), tokens_per_s=round(dn / ms * 1e3),
             compile_s=round(first, 1), mem_gb_per_device=mem(), **base)
    except Exception as err:                      # noqa: BLE001
        emit(case=name, kind="decode", error=f"{type(err).__name__}: {str(err)[:400]}", **base)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deadline", type=float, default=170.0, help="seconds for the whole script")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--quick", action="store_true", help="tiny dims (CPU dry run with 2 forced host devices)")
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.child[2], args.reps, args.quick)
        return 0
    import jax
    out_dir = os.environ.get("OUT", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    result = {"device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}", "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "method": "median wall ms of the public prefill / decode "
              "call (block_until_ready), first call (compile included) separate; random bf16 weights made "
              "sharded on the devices", "rows": [], "events": []}
    del jax
    start = time.time()
    log = open(os.path.join(out_dir, "shard_x2.log"), "w")
    for layers, devices, cases in (QUICK_PLAN if args.quick else PLAN):
        left = args.deadline - (time.time() - start)
        if left < 25:
            result["events"].append({"skipped": [layers, devices, cases], "left_s": round(left)})
            continue
        cmd = [sys.executable, __file__, "--child", str(layers), str(devices), cases, "--reps", str(args.reps)]
        cmd += ["--quick"] if args.quick else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            text, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = "TIMEOUT\n" + (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))
        log.write(f"==== {layers} layers, devices {devices}\n{text}\n{err[-8000:]}\n")
        log.flush()
        for line in text.splitlines():
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                (result["events"] if "event" in row else result["rows"]).append(row)
        if "TIMEOUT" in err[:10] or not text:
            result["events"].append({"failed": [layers, devices], "stderr_tail": err[-600:]})
        with open(os.path.join(out_dir, "h200x2.json"), "w") as f:
            json.dump(result, f, indent=1)
    rows = result["rows"]
    print(f"{'case':26s} {'L':>3s} {'dev':>3s} {'kind':8s} {'tokens':>6s} {'ms':>9s} {'tok/s':>9s} {'compile':>7s}"
          f" mem GB/dev")
    for r in rows:
        print(f"{r['case']:26s} {r['layers']:3d} {r['devices']:3d} {r['kind']:8s} {r.get('tokens', 0):6d} "
              f"{r.get('ms', float('nan')):9.2f} {r.get('tokens_per_s', 0):9d} {r.get('compile_s', 0):7.1f} "
              f"{r.get('mem_gb_per_device', r.get('error', ''))}")
    for kind in ("prefill", "decode"):
        small = (QUICK_PLAN if args.quick else PLAN)[-1][0]
        one = [r for r in rows if r["layers"] == small and r["devices"] == 1 and r["kind"] == kind and "ms" in r]
        two = [r for r in rows if r["layers"] == small and r["devices"] == 2 and r["kind"] == kind and "ms" in r]
        if one and two:
            print(f"{small}-layer {kind} speedup 2 GPUs / 1 GPU: {one[0]['ms'] / two[0]['ms']:.2f}x")
    for e in result["events"]:
        print("event", json.dumps(e)[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
