"""Section "sharding" (needs 2 GPUs; results ``<device>x2.json``, e.g. h200x2.json, keys "rows" and "events"):
Qwen3-Next-80B dims split over two GPUs (jax_gdn.sharding).

Rows (random bf16 weights; the same timing for every row: median wall ms of the public ``model.prefill`` /
``model.decode`` call closed by block_until_ready, after one first call that includes the compile, "compile_s"):
  * 12 layers at 80B dims: made on GPU 0 and measured there (varlen16 prefill, 64-stream decode), then the same
    weights placed on 2 GPUs with tensor-parallel experts (moe_sharding="tensor", setup "2t") and with expert
    parallel ("2e") and measured the same way; each 2-GPU run's varlen logits are compared with one GPU's (event
    "logits_1gpu_vs_2gpu"); one profiled prefill each (event "profile": GPU kernel time per device by kind). GPU 0's
    peak memory in the 2-GPU rows includes its one-GPU copy.
  * the check (events "check"; ``check``): 16 streams of 1 to 300 tokens (1483), 1 GPU against 2 GPUs "tensor" and
    "expert": the 4-layer model (3 GDN + 1 attention, MoE FFNs) in fp32 with jax_default_matmul_precision
    "highest", last-token logits within CHECK_TOL = 1e-4 relative (a wrong split, a missing or doubled reduction, a
    wrong slot or expert is O(1)); in bf16 the fraction of tokens whose top-k expert set differs in the first MoE
    layer (read through a probe model): the seed of the bf16 logits gap (docs/sharding.md).
  * 48 layers (the full model: ~155 GB of weights, ~78 GB per device), made split on the 2 devices
    (init_params(mesh=)), expert parallel then tensor parallel experts: prefill of the varlen16 mix, one decode step
    of 64 streams (context 1189 tokens each), prefill of one 32768-token stream.
Each model size runs in its own subprocess (``python -m benchmarks.sharding --child LAYERS SETUPS CASES``: clean
peak memory, nothing left over), the full model last; the deadline skips what would not fit (event "skipped").
Rows are keyed by (case, layers, devices, moe_sharding), events by their kind and setup: a run replaces the rows and
events it re-measures and keeps the others, each tagged with its run number (the file's "runs" say when and how).
``quick``: tiny dims on CPU (2 forced host devices: XLA_FLAGS=--xla_force_host_platform_device_count=2
JAX_PLATFORMS=cpu), a dry run of the code path.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

KEYS = ("rows", "events")
#: devices the section needs
DEVICES = 2
METHOD = ("median wall ms of the public prefill / decode call (block_until_ready), first call (compile included) "
          "separate; random bf16 weights made sharded on the devices")

#: (layers, setups, cases) of each child process, in order
PLAN = ((12, "1,2t,2e", "varlen,decode,profile"), (4, "1,2t,2e", "check"), (48, "2e,2t", "varlen,decode,long"))
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

    from benchmarks.cases import model_cases
    from benchmarks.configs import qwen3_next_80b_config, tiny_config
    from jax_gdn.model import HybridModel, init_params
    from jax_gdn.timing import jax_sync

    def emit(**row):
        print("ROW " + json.dumps(row), flush=True)

    cfg = (tiny_config if quick else qwen3_next_80b_config)(layers)
    # CPU dry run: the GDN rule in Pallas interpret mode (XLA's chunked form calls LAPACK's batched triangular
    # solve on CPU, which deadlocks when several device programs run it at once)
    backend = "pallas_interpret" if quick else "auto"
    if cases == "check":
        check(cfg, setups, backend, quick, emit)
        return
    cs = model_cases(quick)
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
        jax_sync(model.params)

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


def profile(model, cfg, cs, rng, base, emit) -> None:
    """Event "profile": one varlen prefill (already compiled) under jax.profiler with a Perfetto trace; the GPU
    kernels of each device (events on its "Stream" threads) summed by kind (collective, moe / gdn / attention
    kernels, sort, gemm, copy, xla fusion, other: ``benchmarks.profile.KINDS``) and the 8 costliest kernel names, in ms. The trace is
    written to a temporary folder and removed."""
    import shutil
    import tempfile

    import jax
    import numpy as np

    from benchmarks.cases import cu_seqlens
    from benchmarks.model import shared_cache_kwargs
    from benchmarks.profile import gpu_events, kind as kernel_kind
    from jax_gdn.timing import jax_sync
    name, lens = cs["varlen"]
    cache = model.init_cache(**shared_cache_kwargs(cs, 3))
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu, slots = cu_seqlens(lens), np.arange(len(lens), dtype=np.int32)
    out = tempfile.mkdtemp(prefix="sharding_trace_")
    try:
        logits, cache = model.prefill(cache, ids, cu, slots)           # warm (compiled by the varlen row)
        jax_sync(logits)
        cache = jax_sync(model.release(cache, slots))
        with jax.profiler.trace(out, create_perfetto_trace=True):
            t0 = time.perf_counter()
            logits, cache = model.prefill(cache, ids, cu, slots)
            jax_sync(logits)
            wall = (time.perf_counter() - t0) * 1e3                  # the traced step (profiler overhead in)
        per_dev, top, lines = {}, {}, {}
        for proc, thread, kname, ms in gpu_events(out):
            line = f"{proc[-12:]}/{thread[:30]}"                    # every GPU trace line, in case no "Stream"
            lines[line] = round(lines.get(line, 0.0) + ms, 3)
            if not thread.lower().startswith("stream"):
                continue
            dev = per_dev.setdefault(proc, {})
            kind = kernel_kind(kname)
            dev[kind] = dev.get(kind, 0.0) + ms
            top[kname[:60]] = top.get(kname[:60], 0.0) + ms
        per_dev = {p: {k: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}
                   for p, d in per_dev.items()}
        emit(event="profile", case=name, wall_ms=round(wall, 2), per_device_ms=per_dev, gpu_lines_ms=lines,
             top_kernels_ms=dict(sorted(((k, round(v, 3)) for k, v in top.items()), key=lambda kv: -kv[1])[:8]),
             **base)
    except Exception as err:                      # noqa: BLE001 (reported in the event)
        emit(event="profile", case=name, error=f"{type(err).__name__}: {str(err)[:300]}", **base)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def allreduce(cfg, cs, emit, loops: int = 20) -> None:
    """Event "allreduce": ms of one psum over the 2 devices of the [Tb, D] activation the blocks reduce (Tb the
    varlen bucket), bf16 and fp32: ``loops`` dependent psums in one program (each scaled by 0.5, fused), median
    of 5 calls / loops."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from benchmarks.timing import median_ms
    from jax_gdn.timing import jax_sync
    t = sum(cs["varlen"][1])
    tb = 1 << (t - 1).bit_length() if t <= 1024 else -(-t // 1024) * 1024
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])

    def body(a):
        return jax.lax.fori_loop(0, loops, lambda i, v: jax.lax.psum(v, "model") * 0.5, a)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.device_put(jnp.ones((tb, cfg.hidden_size), dtype), NamedSharding(mesh, P()))
        jax_sync(fn(x))
        ms = median_ms(lambda: fn(x), jax_sync, 5) / loops
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

    from benchmarks.cases import cu_seqlens
    from benchmarks.model import shared_cache_kwargs
    from benchmarks.timing import median_ms
    from jax_gdn.timing import jax_sync
    name, lens = cs[key]
    kw = (dict(max_seqs=1, max_tokens=lens[0] + 16, page_size=16, max_seq_len=lens[0]) if key == "long"
          else shared_cache_kwargs(cs, reps))
    st = {"cache": model.init_cache(**kw)}
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu, slots = cu_seqlens(lens), np.arange(len(lens), dtype=np.int32)

    def call():
        logits, st["cache"] = model.prefill(st["cache"], ids, cu, slots)
        return logits

    def prepare():
        st["cache"] = jax_sync(model.release(st["cache"], slots))
    try:
        t1 = time.perf_counter()
        first_logits = np.asarray(jax_sync(call()))
        first = time.perf_counter() - t1
        ms = median_ms(call, jax_sync, reps, prepare)
        model.check(st["cache"])
        emit(case=name, kind="prefill", tokens=int(sum(lens)), ms=round(ms, 2),
             tokens_per_s=round(sum(lens) / ms * 1e3), compile_s=round(first, 1), mem_gb_per_device=mem(), **base)
        return first_logits
    except Exception as err:                      # noqa: BLE001 (reported in the row)
        emit(case=name, kind="prefill", error=f"{type(err).__name__}: {str(err)[:400]}", **base)
        return None


def decode(model, cfg, cs, rng, base, reps, emit, mem):
    """The 64-stream decode row: the context prefilled in calls of 16 streams (the varlen program), then steps
    (benchmarks.model.decode_row, the one-GPU section's own decode row)."""
    from benchmarks.model import decode_row, shared_cache_kwargs
    name, dn, _, _ = cs["decode"]
    st = {"cache": model.init_cache(**shared_cache_kwargs(cs, reps))}
    try:
        r = decode_row(model, cfg, cs, rng, reps, st)
        ms = r["ms"]
        emit(case=name, kind="decode", tokens=dn, ms=round(ms, 3), tokens_per_s=round(dn / ms * 1e3),
             compile_s=round(r["first_call_s"], 1), mem_gb_per_device=mem(), **base)
    except Exception as err:                      # noqa: BLE001
        emit(case=name, kind="decode", error=f"{type(err).__name__}: {str(err)[:400]}", **base)


def run_section(quick: bool = False, deadline_s: float = 540.0, reps: int = 3) -> dict:
    """{"rows", "events", "method"}: each (layers, setups, cases) of PLAN (``quick``: QUICK_PLAN) in its own child
    process, while ``deadline_s`` seconds last (a child that would start with under 25 s left is skipped: event
    "skipped"; one cut at the deadline: event "failed")."""
    rows, events = [], []
    start = time.time()
    # each child may take 94% of its GPUs' memory (the 48-layer model needs ~78 GB per device)
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94"))
    for layers, setups, cases in (QUICK_PLAN if quick else PLAN):
        left = deadline_s - (time.time() - start)
        if left < 25:
            events.append({"event": "skipped", "what": [layers, setups, cases], "left_s": round(left)})
            continue
        cmd = [sys.executable, "-m", "benchmarks.sharding", "--child", str(layers), setups, cases, "--reps", str(reps)]
        cmd += ["--quick"] if quick else []
        t0 = time.time()
        print(f"sharding: {layers} layers, setups {setups}, cases {cases}", flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
            text, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = "TIMEOUT\n" + (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))
        print(f"  {time.time() - t0:.0f} s", flush=True)
        for line in text.splitlines():
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                (events if "event" in row else rows).append(row)
        if err.startswith("TIMEOUT") or not text:
            events.append({"event": "failed", "what": [layers, setups, cases], "stderr_tail": err[-600:]})
            print(err[-3000:], file=sys.stderr)
    return {"rows": rows, "events": events, "method": METHOD}


def row_key(r: dict) -> tuple:
    """What a row measures: (case, layers, devices, moe_sharding)."""
    return (r.get("case"), r.get("layers"), r.get("devices"), r.get("moe_sharding"))


def event_key(e: dict) -> tuple:
    """What an event reports: its kind, the model size and setup, and the case / dtype / check it is of."""
    return tuple(json.dumps(e.get(k)) for k in ("event", "layers", "devices", "moe_sharding", "setup", "dtype",
                                                  "what", "case", "shape"))


def merge(old: dict, new: dict, run: int) -> dict:
    """``old``'s rows and events with ``new``'s put in, each new one tagged ``"run": run``: a row or event of the
    same key (``row_key`` / ``event_key``) is replaced, the others kept."""
    out = {}
    for key, ident in (("rows", row_key), ("events", event_key)):
        fresh = [dict(x, run=run) for x in new.get(key, [])]
        seen = {ident(x) for x in fresh}
        out[key] = [x for x in old.get(key, []) if ident(x) not in seen] + fresh
    return out


def print_section(result: dict) -> None:
    """The rows, the 1 -> 2 GPU speed-ups of the 12-layer model, then the events, as a table."""
    rows = result.get("rows", [])
    print(f"{'case':26s} {'L':>3s} {'dev':>3s} {'moe':6s} {'kind':8s} {'tokens':>6s} {'ms':>9s} {'tok/s':>9s} "
          f"{'compile':>7s} mem GB/dev")
    for r in rows:
        print(f"{r['case']:26s} {r['layers']:3d} {r['devices']:3d} {str(r.get('moe_sharding') or '-'):6s} "
              f"{r['kind']:8s} {r.get('tokens', 0):6d} {r.get('ms', float('nan')):9.2f} {r.get('tokens_per_s', 0):9d} "
              f"{r.get('compile_s', 0):7.1f} {r.get('mem_gb_per_device', r.get('error', ''))}")
    small = 12 if any(r.get("layers") == 12 for r in rows) else 4
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
    for e in result.get("events", []):
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


def main(argv=None) -> int:
    """The child process of ``run_section``: ``--child LAYERS SETUPS CASES`` prints its rows and events as JSON
    lines ("ROW {...}"); the section itself runs through ``python -m benchmarks sharding``."""
    ap = argparse.ArgumentParser(description="one child of the sharding section (python -m benchmarks sharding)")
    ap.add_argument("--child", nargs=3, required=True, metavar=("LAYERS", "SETUPS", "CASES"),
                    help="SETUPS: comma list of 1 | 2t | 2e; CASES: comma list of varlen | decode | long | profile | "
                         "check")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny dims (CPU dry run with 2 forced host devices)")
    args = ap.parse_args(argv)
    child(int(args.child[0]), args.child[1], args.child[2], args.reps, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
