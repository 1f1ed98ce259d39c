"""Qwen3-Next-80B dims split over two H200s (jax_gdn.sharding): one device run, one script.

Rows (random bf16 weights made on the devices, already split; the same timing for every row: median wall ms of
the public ``model.prefill`` / ``model.decode`` call closed by block_until_ready, after one first call that
includes the compile):
  * 48 layers (the full model: ~155 GB of weights, ~78 GB per device), mesh of 2: prefill of the varlen16 mix
    (jax_gdn.cases, 19027 tokens), prefill of one 32768-token stream, one decode step of 64 streams;
  * 12 layers at the same dims on one GPU and on two: varlen16 prefill and the 64-stream decode step (scaling).
Each (layers, devices) runs in its own subprocess (clean peak memory per device, nothing left over), longest
first; a deadline skips what would not fit. Writes ``$OUT/h200x2.json`` after every row ({"device", "jax", "date",
"rows": [{"case", "layers", "devices", "kind", "tokens", "ms", "mem_gb_per_device", "compile_s", ...}]}) and
prints a table last.

    python benchmarks/gpu/shard_x2.py [--deadline 170] [--reps 3]
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

PLAN = [(48, 2, "varlen,long,decode"), (12, 2, "varlen,decode"), (12, 1, "varlen,decode")]


def child(layers: int, devices: int, cases: str, reps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_gdn.bench_model import _cases, _cu, _jax_sync, _median_ms, _shared_cache_kwargs, qwen3_next_80b_config
    from jax_gdn.model import HybridModel

    def emit(**row):
        print("ROW " + json.dumps(row), flush=True)

    def mem():
        return [round(d.memory_stats().get("peak_bytes_in_use", 0) / 2**30, 2) for d in jax.devices()[:devices]]

    cfg = qwen3_next_80b_config(layers)
    mesh = jax.make_mesh((devices,), ("model",), devices=jax.devices()[:devices]) if devices > 1 else None
    t0 = time.perf_counter()
    model = HybridModel.random(cfg, 0, dtype=jnp.bfloat16, mesh=mesh)
    _jax_sync(model.params)
    emit(event="params", layers=layers, devices=devices, s=round(time.perf_counter() - t0, 1), mem=mem(),
         backends=repr(model.backends))
    cs = _cases(False)
    rng = np.random.default_rng(0)
    base = dict(layers=layers, devices=devices)
    for key in [c for c in cases.split(",") if c in ("long", "varlen")]:
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
            _jax_sync(call())
            first = time.perf_counter() - t1
            ms = _median_ms(call, _jax_sync, reps, prepare)
            model.check(st["cache"])
            emit(case=name, kind="prefill", tokens=int(sum(lens)), ms=round(ms, 2),
                 tokens_per_s=round(sum(lens) / ms * 1e3), compile_s=round(first, 1), mem_gb_per_device=mem(),
                 **base)
        except Exception as err:                      # noqa: BLE001 (reported in the row)
            emit(case=name, kind="prefill", error=f"{type(err).__name__}: {str(err)[:400]}", **base)
        del st
    if "decode" in cases:
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
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), int(args.child[1]), args.child[2], args.reps)
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
    for layers, devices, cases in PLAN:
        left = args.deadline - (time.time() - start)
        if left < 25:
            result["events"].append({"skipped": [layers, devices, cases], "left_s": round(left)})
            continue
        cmd = [sys.executable, __file__, "--child", str(layers), str(devices), cases, "--reps", str(args.reps)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            text, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = "TIMEOUT\n" + (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))
        log.write(f"==== {layers} layers, {devices} devices\n{text}\n{err[-8000:]}\n")
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
        one = [r for r in rows if r["layers"] == 12 and r["devices"] == 1 and r["kind"] == kind and "ms" in r]
        two = [r for r in rows if r["layers"] == 12 and r["devices"] == 2 and r["kind"] == kind and "ms" in r]
        if one and two:
            print(f"12-layer {kind} speedup 2 GPUs / 1 GPU: {one[0]['ms'] / two[0]['ms']:.2f}x")
    for e in result["events"]:
        print("event", json.dumps(e)[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
