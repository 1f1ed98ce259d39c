"""Qwen3-Next-80B dims split over two H200s (jax_gdn.sharding): one device run, one script.

Rows (random bf16 weights; the same timing for every row: median wall ms of the public ``model.prefill`` /
``model.decode`` call closed by block_until_ready, after one first call that includes the compile):
  * 48 layers (the full model: ~155 GB of weights, ~78 GB per device), made split on the 2 devices
    (init_params(mesh=)): prefill of the varlen16 mix (jax_gdn.cases, 19027 tokens), one decode step of 64
    streams (context 1189 tokens each), prefill of one 32768-token stream;
  * 12 layers at the same dims: made on GPU 0 and measured there (varlen16 prefill, 64-stream decode), then the
    same weights placed on 2 GPUs with tensor-parallel experts (moe_sharding="tensor", setup "2t") and with
    expert parallel ("2e") and measured the same way; each 2-GPU run's varlen logits are compared with one GPU's
    (event "logits_1gpu_vs_2gpu"). GPU 0's peak memory in the 2-GPU rows includes its one-GPU copy.
  * the check (its own subprocess, events "check"; ``check``): at 80B dims, 16 streams of 1 to 300 tokens
    (1483), 1 GPU against 2 GPUs "tensor" and "expert": the 4-layer model (3 GDN + 1 attention, MoE FFNs) in
    fp32 with jax_default_matmul_precision "highest", last-token logits within CHECK_TOL = 1e-4 relative (a wrong
    split, a missing or doubled reduction, a wrong slot or expert is O(1)); in bf16 the fraction of tokens whose
    top-k expert set differs in the first MoE layer (read through a probe model): the seed of the bf16 logits gap
    (bf16 rounding amplified by top-k flips, see jax_gdn/SHARDING_NOTES.md).
Each model size runs in its own subprocess (clean peak memory, nothing left over), the full model last; a
deadline skips what would not fit. Writes ``$OUT/h200x2.json`` after every model ({"device", "jax", "date",
"rows": [{"case", "layers", "devices", "moe_sharding", "kind", "tokens", "ms", "mem_gb_per_device",
"compile_s", ...}], "events": [...]}) and prints a table last.

    python benchmarks/gpu/shard_x2.py [--deadline 240] [--reps 3] [--plan full|scaling|ep|check|profile]
        full (default): 12-layer scaling (1 GPU, 2t, 2e), the check, 48-layer rows (about 230 s on 2 H200s)
        scaling: the check, then the 12-layer 2t / 2e rows (weights made split); no 1-GPU or 48-layer rows
        ep: only the 12-layer 2t / 2e rows and the all-reduce timing (about 60 s: expert vs tensor parallel)
        check: only the check (about 70 s)
        both: as full, with the 48-layer rows for expert parallel and tensor parallel experts (about 330 s)
        profile: the 12-layer varlen rows (1 GPU, 2t, 2e) and one profiled prefill each: GPU kernel time per
        device by kind (event "profile": where 2-GPU prefill loses), about 90 s
    (estimates from run 1: ~14 s per prefill compile, ~6 s per decode compile, ~16 s for 12-layer weights)
    python benchmarks/gpu/shard_x2.py --quick      (CPU dry run at tiny dims: set XLA_FLAGS=
        --xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu OUT=/tmp/x first)
    python benchmarks/gpu/shard_x2.py --child LAYERS SETUPS CASES   (one configuration; prints JSON lines;
        SETUPS: comma list of 1 | 2t | 2e; CASES: comma list of varlen | decode | long | profile | check)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

PLANS = {"full": [(12, "1,2t,2e", "varlen,decode,profile"), (4, "1,2t,2e", "check"),
                  (48, "2t", "varlen,decode,long")],
         "scaling": [(4, "1,2t,2e", "check"), (12, "2t,2e", "varlen,decode,profile")],
         "ep": [(12, "2t,2e", "varlen,decode")],
         "profile": [(12, "1,2t,2e", "varlen,profile")],
         "check": [(4, "1,2t,2e", "check")],
         "both": [(12, "1,2t,2e", "varlen,decode,profile"), (4, "1,2t,2e", "check"),
                  (48, "2e,2t", "varlen,decode,long")]}
QUICK_PLAN = [(8, "2t", "varlen,decode,long"), (4, "1,2t,2e", "varlen,decode,profile"), (4, "1,2t,2e", "check")]
CHECK_TOL = 1e-4       # fp32 ("highest"), 4 layers: 2 GPUs vs 1 GPU, max |diff| / max |logit| of the last tokens
CHECK_LENS = (1, 63, 64, 65, 130, 7, 300, 2, 129, 31, 200, 5, 90, 250, 16, 130)     # 1483 tokens, 16 streams
QUICK_CHECK_LENS = (1, 63, 64, 65, 130, 7)


def _setup(tag: str):
    """"1" -> (1, None); "2t" -> (2, "tensor"); "2e" -> (2, "expert")."""
    n = int(tag[0])
    return n, (None if n == 1 else {"t": "tensor", "e": "expert"}[tag[1]])


def child(layers: int, setups: str, cases: str, reps: int, quick: bool) -> None:
    """One model size over the setups: with "1" among them the random weights are made on GPU 0, measured there,
    then placed on the 2 GPUs for each 2-GPU setup (HybridModel(mesh=, moe_sharding=)); without it each 2-GPU
    setup makes its weights split on the devices (init_params(mesh=, moe_sharding=)). cases "check": see
    ``check``."""
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
    if cases == "check":
        check(cfg, setups, backend, quick, emit)
        return
    cs = _cases(quick)
    logits = {}
    params = None
    tags = setups.split(",")
    for tag in tags:
        n, moe = _setup(tag)
        mesh = jax.make_mesh((n,), ("model",), devices=jax.devices()[:n]) if n > 1 else None
        t0 = time.perf_counter()
        if n > 1 and "1" not in tags:
            model = HybridModel.random(cfg, 0, dtype=jnp.bfloat16, mesh=mesh, moe_sharding=moe, backend=backend)
        else:
            if params is None:
                params = jax.jit(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))()
            model = HybridModel(cfg, params, dtype=jnp.bfloat16, mesh=mesh, backend=backend,
                                **({} if moe is None else {"moe_sharding": moe}))
        _jax_sync(model.params)

        def mem():
            return [round((d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2)
                    for d in jax.devices()[:n]]
        emit(event="params", layers=layers, devices=n, moe_sharding=moe, s=round(time.perf_counter() - t0, 1),
             mem=mem(), backends=repr(model.backends))
        rng = np.random.default_rng(0)
        base = dict(layers=layers, devices=n, moe_sharding=moe)
        for key in cases.split(","):
            if key == "decode":
                decode(model, cfg, cs, rng, base, reps, emit, mem)
            elif key == "profile":
                profile(model, cfg, cs, rng, base, emit)
            else:
                out = prefill(model, cfg, cs, key, rng, base, reps, emit, mem)
                if key == "varlen" and out is not None:
                    logits[tag] = out
        del model
    if any(_setup(tag)[0] == 2 for tag in tags) and "varlen" in cases:
        allreduce(cfg, cs, emit)
    if "1" in logits:
        a = np.asarray(logits["1"], np.float64)
        for tag in logits:
            if tag != "1":
                b = np.asarray(logits[tag], np.float64)
                emit(event="logits_1gpu_vs_2gpu", layers=layers, moe_sharding=_setup(tag)[1],
                     rel_max=float(np.max(np.abs(a - b)) / np.max(np.abs(a))),
                     argmax_agree=float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))))


PROFILE_KINDS = (("collective", ("nccl", "all-reduce", "allreduce", "all_reduce")),
                 ("moe kernels", ("moe_",)), ("gdn kernels", ("gdn_", "conv1d_silu")),
                 ("attention kernels", ("paged_attention",)), ("sort", ("sort", "radix")),
                 ("gemm", ("gemm", "cublas", "xmma", "cutlass", "matmul", "dot")), ("copy", ("memcpy", "copy")),
                 ("xla fusion", ("fusion", "loop_", "input_", "reduce", "scatter", "gather")))


def _kind(name: str) -> str:
    low = name.lower()
    for kind, keys in PROFILE_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile(model, cfg, cs, rng, base, emit) -> None:
    """Event "profile": one varlen prefill (already compiled) under jax.profiler with a Perfetto trace; the GPU
    kernels of each device (events on its "Stream" threads) summed by kind (collective, moe / gdn / attention
    kernels, sort, gemm, copy, xla fusion, other) and the 8 costliest kernel names, in ms. The trace itself is
    left in $OUT/trace_<layers>_<devices><moe>."""
    import jax
    import numpy as np
    from trace_events import gpu_events

    from jax_gdn.bench_model import _cu, _jax_sync, _shared_cache_kwargs
    name, lens = cs["varlen"]
    cache = model.init_cache(**_shared_cache_kwargs(cs, 3))
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu, slots = _cu(lens), np.arange(len(lens), dtype=np.int32)
    tag = f"{base['layers']}_{base['devices']}{(base.get('moe_sharding') or '')[:1]}"
    out = os.path.join(os.environ.get("OUT", "/tmp"), f"trace_{tag}")
    try:
        logits, cache = model.prefill(cache, ids, cu, slots)           # warm (compiled by the varlen row)
        _jax_sync(logits)
        cache = _jax_sync(model.release(cache, slots))
        with jax.profiler.trace(out, create_perfetto_trace=True):
            t0 = time.perf_counter()
            logits, cache = model.prefill(cache, ids, cu, slots)
            _jax_sync(logits)
            wall = (time.perf_counter() - t0) * 1e3                  # the traced step (profiler overhead in)
        per_dev, top, lines = {}, {}, {}
        for proc, thread, kname, ms in gpu_events(out)[0]:
            line = f"{proc[-12:]}/{thread[:30]}"                    # every GPU trace line, in case no "Stream"
            lines[line] = round(lines.get(line, 0.0) + ms, 3)
            if not thread.lower().startswith("stream"):
                continue
            dev = per_dev.setdefault(proc, {})
            kind = _kind(kname)
            dev[kind] = dev.get(kind, 0.0) + ms
            top[kname[:60]] = top.get(kname[:60], 0.0) + ms
        per_dev = {p: {k: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}
                   for p, d in per_dev.items()}
        emit(event="profile", case=name, wall_ms=round(wall, 2), per_device_ms=per_dev, gpu_lines_ms=lines,
             top_kernels_ms=dict(sorted(((k, round(v, 3)) for k, v in top.items()), key=lambda kv: -kv[1])[:8]),
             **base)
    except Exception as err:                      # noqa: BLE001 (reported in the event)
        emit(event="profile", case=name, error=f"{type(err).__name__}: {str(err)[:300]}", **base)


def allreduce(cfg, cs, emit, loops: int = 20) -> None:
    """Event "allreduce": ms of one psum over the 2 devices of the [Tb, D] activation the blocks reduce (Tb the
    varlen bucket), bf16 and fp32: ``loops`` dependent psums in one program (each scaled by 0.5, fused), median
    of 5 calls / loops."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_gdn.bench_model import _jax_sync, _median_ms
    t = sum(cs["varlen"][1])
    tb = 1 << (t - 1).bit_length() if t <= 1024 else -(-t // 1024) * 1024
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])

    def body(a):
        return jax.lax.fori_loop(0, loops, lambda i, v: jax.lax.psum(v, "model") * 0.5, a)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.device_put(jnp.ones((tb, cfg.hidden_size), dtype), NamedSharding(mesh, P()))
        _jax_sync(fn(x))
        ms = _median_ms(lambda: fn(x), _jax_sync, 5) / loops
        emit(event="allreduce", shape=[tb, cfg.hidden_size], dtype=jnp.dtype(dtype).name, ms=round(ms, 4),
             gb_per_s=round(tb * cfg.hidden_size * jnp.dtype(dtype).itemsize / ms / 1e6, 1))


def check(cfg, setups: str, backend, quick: bool, emit) -> None:
    """The numerics check on the same random weights, one GPU (the first setup) against each 2-GPU setup, prefill
    of CHECK_LENS (16 streams):
      * fp32 with "highest" matmuls, the 4-layer model: last-token logits rel_max, ok = rel_max <= CHECK_TOL;
      * bf16, a probe of the first layer (its FFN zeroed, lm_head = [I_D | 0], every norm weight 0 so the final
        norm equals its post-norm): the probe's logits [:, :D] are exactly the input of layer 0's MoE, from which
        the top-k expert sets are recomputed on one GPU: the fraction of tokens whose set differs between 1 and 2
        GPUs (bf16 rounding of the mixer's split out_proj flipping near-tied experts) and the input's rel diff
        (the bf16 logits gap itself is the 12-layer rows' event "logits_1gpu_vs_2gpu").
    Emits event "check" per (dtype, model, setup). No host callbacks (they deadlock XLA:CPU multi-device runs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_gdn.layers.ffn import moe_route
    from jax_gdn.model import HybridModel, init_params

    lens = QUICK_CHECK_LENS if quick else CHECK_LENS
    t, d = sum(lens), cfg.hidden_size
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, t).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = np.arange(len(lens), dtype=np.int32)
    tags = setups.split(",")

    def layers_of(p):
        per, reps = len(p["period"]), p["period"][0]["input_norm"].shape[0]
        return [jax.tree.map(lambda a: a[i // per], p["period"][i % per]) for i in range(per * reps)]

    def prefill(c, params, dtype, tag, all_logits):
        n, moe = _setup(tag)
        mesh = jax.make_mesh((n,), ("model",), devices=jax.devices()[:n]) if n > 1 else None
        model = HybridModel(c, params, dtype=dtype, mesh=mesh, backend=backend, token_buckets=(2048,),
                            **({} if moe is None else {"moe_sharding": moe}))
        cache = model.init_cache(max_seqs=len(lens), max_tokens=t + 512, page_size=16)
        logits, _ = model.prefill(cache, ids, cu, slots, return_all_logits=all_logits)
        out = np.asarray(logits[:, :d] if all_logits else logits, np.float64)
        del model, cache, logits
        return out

    for dtype, what in ((jnp.float32, "model"), (jnp.bfloat16, "probe")):
        t0 = time.perf_counter()
        prec = "highest" if dtype == jnp.float32 else "default"
        with jax.default_matmul_precision(prec):
            params = jax.jit(lambda: init_params(cfg, jax.random.PRNGKey(1), dtype))()
            c = cfg
            if what == "probe":
                layers = layers_of(params)
                first = dict(layers[0], ffn=jax.tree.map(jnp.zeros_like, layers[0]["ffn"]))
                router = layers[0]["ffn"]["router"]
                c = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=cfg.layer_types[:1])
                params = {"embed": params["embed"], "final_norm": params["final_norm"],
                          "lm_head": jnp.eye(d, cfg.vocab_size, dtype=dtype), "layers": [first]}
            runs = {tag: prefill(c, params, dtype, tag, what == "probe") for tag in tags}
            ref = runs[tags[0]]
            if what == "probe":
                k = cfg.num_experts_per_tok
                route = jax.jit(lambda u: moe_route(router, u.astype(dtype), k, cfg.norm_topk_prob)[1])
                sets = {tag: np.sort(np.asarray(route(jnp.asarray(u, jnp.float32))), -1) for tag, u in runs.items()}
            del params
        for tag in tags[1:]:
            got = runs[tag]
            rel = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            row = dict(event="check", dtype=jnp.dtype(dtype).name, precision=prec, what=what,
                       layers=c.num_hidden_layers, tokens=t, setup=tag, moe_sharding=_setup(tag)[1],
                       s=round(time.perf_counter() - t0, 1))
            if what == "probe":
                row.update(moe0_input_rel=rel, moe0_topk_set_differs=float(np.mean(
                    np.any(sets[tag] != sets[tags[0]], -1))))
            else:
                row.update(logits_rel_max=rel, argmax_agree=float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1))),
                           ok=(rel <= CHECK_TOL) if dtype == jnp.float32 else None)
            emit(**row)


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
    """The 64-stream decode row: the context prefilled in calls of 16 streams (the varlen program), then steps
    (jax_gdn.bench_model.decode_row, the one-GPU bench's own decode row)."""
    from jax_gdn.bench_model import _shared_cache_kwargs, decode_row
    name, dn, _, _ = cs["decode"]
    st = {"cache": model.init_cache(**_shared_cache_kwargs(cs, reps))}
    try:
        r = decode_row(model, cfg, cs, rng, reps, st)
        ms = r["ms"]
        emit(case=name, kind="decode", tokens=dn, ms=round(ms, 3), tokens_per_s=round(dn / ms * 1e3),
             compile_s=round(r["first_call_s"], 1), mem_gb_per_device=mem(), **base)
    except Exception as err:                      # noqa: BLE001
        emit(case=name, kind="decode", error=f"{type(err).__name__}: {str(err)[:400]}", **base)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds for the whole script")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--plan", choices=sorted(PLANS), default="full")
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
              "call (block_until_ready), first call (compile included) separate; random bf16 weights",
              "plan": "quick" if args.quick else args.plan, "rows": [], "events": []}
    del jax
    start = time.time()
    log = open(os.path.join(out_dir, "shard_x2.log"), "w")
    plan = QUICK_PLAN if args.quick else PLANS[args.plan]
    for layers, setups, cases in plan:
        left = args.deadline - (time.time() - start)
        if left < 25:
            result["events"].append({"skipped": [layers, setups, cases], "left_s": round(left)})
            continue
        cmd = [sys.executable, __file__, "--child", str(layers), setups, cases, "--reps", str(args.reps)]
        cmd += ["--quick"] if args.quick else []
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            text, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = "TIMEOUT\n" + (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))
        log.write(f"==== {layers} layers, setups {setups}, cases {cases}: {time.time() - t0:.0f} s\n{text}\n"
                  f"{err[-8000:]}\n")
        log.flush()
        for line in text.splitlines():
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                (result["events"] if "event" in row else result["rows"]).append(row)
        if "TIMEOUT" in err[:10] or not text:
            result["events"].append({"failed": [layers, setups, cases], "stderr_tail": err[-600:]})
        with open(os.path.join(out_dir, "h200x2.json"), "w") as f:
            json.dump(result, f, indent=1)
    rows = result["rows"]
    print(f"{'case':26s} {'L':>3s} {'dev':>3s} {'moe':6s} {'kind':8s} {'tokens':>6s} {'ms':>9s} {'tok/s':>9s} "
          f"{'compile':>7s} mem GB/dev")
    for r in rows:
        print(f"{r['case']:26s} {r['layers']:3d} {r['devices']:3d} {str(r.get('moe_sharding') or '-'):6s} "
              f"{r['kind']:8s} {r.get('tokens', 0):6d} {r.get('ms', float('nan')):9.2f} {r.get('tokens_per_s', 0):9d} "
              f"{r.get('compile_s', 0):7.1f} {r.get('mem_gb_per_device', r.get('error', ''))}")
    small = 4 if args.quick else 12
    for kind in ("prefill", "decode"):
        one = [r for r in rows if r["layers"] == small and r["devices"] == 1 and r["kind"] == kind and "ms" in r]
        for moe in ("tensor", "expert"):
            two = [r for r in rows if r["layers"] == small and r["devices"] == 2 and r.get("moe_sharding") == moe
                   and r["kind"] == kind and "ms" in r]
            if one and two:
                print(f"{small}-layer {kind} speedup 2 GPUs ({moe}) / 1 GPU: {one[0]['ms'] / two[0]['ms']:.2f}x")
        t2 = [r for r in rows if r["layers"] == small and r["devices"] == 2 and r["kind"] == kind and "ms" in r]
        by = {r.get("moe_sharding"): r["ms"] for r in t2}
        if "tensor" in by and "expert" in by:
            print(f"{small}-layer {kind} 2 GPUs: expert / tensor time {by['expert'] / by['tensor']:.3f}")
    for e in result["events"]:
        if e.get("event") == "check" and e["what"] == "probe":
            print(f"check {e['dtype']:8s} {e['setup']:2s} layer-0 MoE input rel {e['moe0_input_rel']:.3g}, top-k "
                  f"expert set differs for {e['moe0_topk_set_differs']:.4f} of tokens")
        elif e.get("event") == "check":
            print(f"check {e['dtype']:8s} {e['setup']:2s} {e['layers']}-layer last-token logits rel_max "
                  f"{e['logits_rel_max']:.3g} argmax {e['argmax_agree']:.3f} ok {e['ok']}")
        elif e.get("event") == "profile" and "per_device_ms" in e:
            for dev, kinds in e["per_device_ms"].items():
                print(f"profile {e['layers']}L {e['devices']} dev {str(e.get('moe_sharding') or '-'):6s} {dev[-12:]}: "
                      f"busy {sum(kinds.values()):.1f} ms of {e['wall_ms']:.1f} wall | "
                      + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()))
        elif e.get("event") == "allreduce":
            print(f"all-reduce over 2 devices of {e['dtype']} {e['shape']}: {e['ms']:.3f} ms ({e['gb_per_s']} GB/s of "
                  f"the array)")
        else:
            print("event", json.dumps(e)[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
