"""Where the time goes, per GPU kernel (session 6's first probe): the 8-layer model at Qwen3-Next-80B dims, its
decode step (64 streams x 1189 context) and its varlen16 prefill, and one attention layer's varlen16 prefill, each
under jax.profiler (Perfetto trace, benchmarks/gpu/trace_events.py): wall ms per call (median of blocking calls)
beside the GPU kernels' ms per call by name with counts; the gap wall - kernels is launch / host time.

    python benchmarks/gpu/profile_s6.py [--budget 200] [--attention-backend auto] [--quick]

Writes $OUT/profile_s6.json (kernel tables) and prints the tables, a summary last. --quick: tiny dims on CPU (the
trace then has no GPU lines: the script's dry run).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT", "/tmp/out")
RES = {}


def log(*a):
    print(*a, flush=True)


def save():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "profile_s6.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def kernel_table(call, calls: int, tag: str, top: int = 30) -> dict:
    """Wall ms per blocking call (median of 5) and the GPU kernels of ``calls`` calls under the profiler."""
    import jax
    from trace_events import gpu_events
    jax.block_until_ready(call())
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        walls.append(1e3 * (time.perf_counter() - t0))
    tdir = os.path.join("/tmp", f"trace_{tag}")
    with jax.profiler.trace(tdir, create_perfetto_trace=True):
        y = None
        for _ in range(calls):
            y = call()
        jax.block_until_ready(y)
    try:
        events, _ = gpu_events(tdir)
    except Exception as err:  # noqa: BLE001 - CPU dry run: no GPU lines
        events = []
        log(f"  ({tag}: no trace: {type(err).__name__})")
    kernels = {}
    for _, thread, name, ms in events:
        if not thread.lower().startswith("stream"):
            continue
        k = kernels.setdefault(name[:90], [0.0, 0])
        k[0] += ms / calls
        k[1] += 1
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    res = {"wall_ms": round(float(np.median(walls)), 4), "kernels_sum_ms": round(sum(v[0] for v in kernels.values()), 4),
           "launches_per_call": sum(v[1] for v in kernels.values()) // max(calls, 1),
           "kernels": [(k, round(v[0], 4), v[1] // calls) for k, v in rows]}
    log(f"== {tag}: wall {res['wall_ms']:.3f} ms, kernels {res['kernels_sum_ms']:.3f} ms, "
        f"{res['launches_per_call']} launches per call")
    for k, ms, c in res["kernels"][:top]:
        log(f"   {ms:8.4f} ms x{c:<4d} {k}")
    return res


def model_profiles(quick: bool, budget_end: float, attention_backend: str):
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_model as bm
    cfg = bm.tiny_config(8) if quick else bm.qwen3_next_80b_config(8)
    cases = bm._cases(quick)
    model = bm.random_device_model(cfg, dtype=jnp.bfloat16, backend=attention_backend)
    cache = model.init_cache(**bm._shared_cache_kwargs(cases, 5))
    rng = np.random.default_rng(0)
    _, dn, dctx, dchunk = cases["decode"]
    slots = np.arange(dn, dtype=np.int32)
    st = {"cache": cache}
    for c in range(0, dn, dchunk):
        sl = slots[c:c + dchunk]
        ids = rng.integers(0, cfg.vocab_size, len(sl) * dctx).astype(np.int32)
        _, st["cache"] = model.prefill(st["cache"], ids, bm._cu([dctx] * len(sl)), sl)
    nxt = rng.integers(0, cfg.vocab_size, dn).astype(np.int32)

    def step():
        logits, st["cache"] = model.decode(st["cache"], nxt, slots)
        return logits
    RES["model_decode"] = kernel_table(step, 10, "model_decode", top=40)
    save()
    # host dispatch of one decode call (the time model.decode takes to return, device not waited for)
    jax.block_until_ready(step())
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        y = step()
        ts.append(1e3 * (time.perf_counter() - t0))
        jax.block_until_ready(y)
    RES["model_decode"]["dispatch_ms"] = round(float(np.median(ts)), 4)
    log(f"   decode dispatch (host, call returns) {RES['model_decode']['dispatch_ms']:.3f} ms")
    save()
    if time.time() > budget_end - 40:
        return
    st["cache"] = model.release(st["cache"], slots)
    _, lens = cases["varlen"]
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    sl = np.arange(len(lens), dtype=np.int32)

    def prefill():
        st["cache"] = model.release(st["cache"], sl)
        logits, st["cache"] = model.prefill(st["cache"], ids, bm._cu(lens), sl)
        return logits
    RES["model_prefill"] = kernel_table(prefill, 3, "model_prefill", top=40)
    save()


def attention_layer_profile(quick: bool, backend: str):
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_layers as bl
    from jax_gdn.layers.attention import attention_layer
    from jax_gdn.state import KvPages
    _, adims, lens = bl._dims(quick)
    t, n = sum(lens), len(lens)
    ps = 16
    pages_per = [-(-x // ps) for x in lens]
    num_pages = sum(pages_per)
    d, h, hkv, dh = adims.hidden_size, adims.num_heads, adims.num_kv_heads, adims.head_dim
    ks = jax.random.split(jax.random.PRNGKey(0), 7)

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(jnp.bfloat16)
    p = {"q_proj": w(ks[0], (d, h * 2 * dh)), "k_proj": w(ks[1], (d, hkv * dh)), "v_proj": w(ks[2], (d, hkv * dh)),
         "o_proj": w(ks[3], (h * dh, d)), "q_norm": 0.1 * jax.random.normal(ks[4], (dh,)),
         "k_norm": 0.1 * jax.random.normal(ks[5], (dh,))}
    x = jax.random.normal(ks[6], (t, d), jnp.float32).astype(jnp.bfloat16)
    first = np.cumsum([0] + pages_per[:-1])
    pt = np.zeros((n, max(pages_per)), np.int32)
    for i, (f, c) in enumerate(zip(first, pages_per)):
        pt[i, :c] = np.arange(f, f + c)
    tok_slot = np.concatenate([[i] * x_ for i, x_ in enumerate(lens)]).astype(np.int32)
    tok_pos = np.concatenate([np.arange(x_) for x_ in lens]).astype(np.int32)
    meta = tuple(jnp.asarray(a) for a in (tok_pos, pt[tok_slot, tok_pos // ps], tok_pos % ps, pt,
                                          np.asarray(lens, np.int32), np.cumsum([0] + list(lens)).astype(np.int32),
                                          np.arange(n, dtype=np.int32)))
    kv = KvPages.zeros(num_pages, ps, hkv, dh, jnp.bfloat16)

    @jax.jit
    def layer(p, x, kv, tp, tpg, tof, pt, sl, cu, ids):
        return attention_layer(p, adims, x, kv, token_pos=tp, token_page=tpg, token_offset=tof, page_table=pt,
                               slot_lens=sl, cu_seqlens=cu, slot_ids=ids, backend=backend)[0]
    RES[f"attention_layer_{backend}"] = kernel_table(lambda: layer(p, x, kv, *meta), 5, f"attn_layer_{backend}")
    save()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    a = ap.parse_args()
    t0 = time.time()
    end = t0 + a.budget
    import jax
    RES["jax"] = jax.__version__
    RES["device"] = str(jax.devices()[0])
    for be in (["cudnn_xla", "xla"] if a.quick else ["cudnn", "pallas"]):
        try:
            attention_layer_profile(a.quick, be)
        except Exception as err:  # noqa: BLE001
            RES[f"attention_layer_{be}"] = {"error": f"{type(err).__name__}: {err}"[:400]}
            log("attention layer", be, RES[f"attention_layer_{be}"])
    try:
        model_profiles(a.quick, end, a.attention_backend)
    except Exception as err:  # noqa: BLE001
        RES["model_error"] = f"{type(err).__name__}: {err}"[:600]
        log("model", RES["model_error"])
    save()
    log("== summary")
    for k, v in RES.items():
        if isinstance(v, dict) and "wall_ms" in v:
            log(f"{k:28s} wall {v['wall_ms']:8.3f} ms  kernels {v['kernels_sum_ms']:8.3f} ms  "
                f"launches {v['launches_per_call']}" + (f"  dispatch {v['dispatch_ms']:.3f}" if "dispatch_ms" in v
                                                         else ""))
    log(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
