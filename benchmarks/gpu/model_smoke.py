"""Smoke run of the model runtime at real size on one GPU: an 8-layer Qwen3-Next-80B-dims model (2 x (3 GDN + 1
attention), MoE 512 experts top-10 + shared, random bf16 weights made on the device by init_params), through the
public API: a varlen prefill (compile, then steady), a chunked continuation, decode steps, release, model.check,
and the compile count. Checks: finite logits, status 0, slot lengths as expected, zero recompiles when warm.

    PYTHONPATH=$PWD python benchmarks/gpu/model_smoke.py [--budget-s 90]

Prints a short table last; writes $OUT/model_smoke.json. Not a benchmark (single timings; see jax_gdn.bench_model).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="tiny dims (a CPU dry run of this script)")
    ap.add_argument("--budget-s", type=float, default=90.0, help="skip later steps past this wall time")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from jax_gdn.bench_model import qwen3_next_80b_config, tiny_config
    from jax_gdn.model import HybridModel, init_params

    rows, res = [], {"device": str(jax.devices()[0])}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        rows.append((name, dt))
        print(f"{name:<44} {dt:8.3f} s  (t={time.perf_counter() - t_start:.0f} s)", flush=True)
        return out

    # ---- padding on the GPU kernels: tiny dims, Pallas GDN (auto) vs XLA, T 25 -> 32 and N 3 -> 4 (slot id S) ----
    from jax_gdn.checkpoint import random_model
    tiny = tiny_config(4)
    lens_t, slots_t = [1, 5, 19], np.array([2, 0, 1], np.int32)
    ids_t = np.random.default_rng(1).integers(0, tiny.vocab_size, 25).astype(np.int32)
    outs = {}
    with jax.default_matmul_precision("highest"):
        for b in ("auto", "xla"):
            m = random_model(tiny, seed=0, dtype=jnp.float32, backend=b)
            c = m.init_cache(max_seqs=4, max_tokens=256, page_size=16)
            lg, c = m.prefill(c, ids_t, np.cumsum([0] + lens_t).astype(np.int32), slots_t, return_all_logits=True)
            dg, c = m.decode(c, ids_t[:3], slots_t)
            outs[b] = (np.asarray(lg), np.asarray(dg), repr(m.backends))
    err = max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in zip(outs["auto"][:2], outs["xla"][:2]))
    res["tiny_pallas_vs_xla_rel_err"] = err
    print(f"tiny padded prefill+decode, {outs['auto'][2]} vs xla: max rel err {err:.2e}", flush=True)
    rows.append((f"tiny pallas vs xla rel err {err:.1e}", time.perf_counter() - t_start))

    cfg = (tiny_config if args.tiny else qwen3_next_80b_config)(args.layers)
    dtype = jnp.bfloat16
    params = timed("init_params (jitted, on device)",
                   lambda: jax.jit(lambda k: init_params(cfg, k, dtype))(jax.random.PRNGKey(0)))
    model = HybridModel(cfg, params, dtype=dtype, backend="auto")
    print(model, flush=True)
    res["model"] = repr(model)
    cache = model.init_cache(max_seqs=16, max_tokens=65536, page_size=16, max_seq_len=16384)
    rng = np.random.default_rng(0)
    lens = [1, 63, 64, 65, 130, 1000, 2000, 2773]                          # 6096 tokens -> bucket 6144
    slots = np.array([5, 0, 7, 2, 9, 1, 3, 4], np.int32)
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu = np.cumsum([0] + lens).astype(np.int32)

    def prefill():
        nonlocal cache
        logits, cache = model.prefill(cache, ids, cu, slots)
        return logits

    logits = timed(f"prefill {sum(lens)} tokens / 8 streams, first call", prefill)
    ok = bool(np.all(np.isfinite(np.asarray(logits, np.float32))))
    cache = model.release(cache, slots)
    logits = timed("prefill again (warm)", prefill)
    ok &= bool(np.all(np.isfinite(np.asarray(logits, np.float32))))
    progs = model.compiled_programs()
    if time.perf_counter() - t_start < args.budget_s:
        nxt = np.asarray(jnp.argmax(logits, -1)).astype(np.int32)

        def decode():
            nonlocal cache
            out, cache = model.decode(cache, nxt, slots)
            return out

        timed("decode 8 streams, first call", decode)
        dec = [timed(f"decode step {i}", decode) for i in range(3)]
        ok &= bool(np.all(np.isfinite(np.asarray(dec[-1], np.float32))))
    if time.perf_counter() - t_start < args.budget_s:
        more = rng.integers(0, cfg.vocab_size, 300).astype(np.int32)

        def chunk():
            nonlocal cache
            out, cache = model.prefill(cache, more, np.array([0, 100, 300], np.int32), slots[:2])
            return out

        timed("chunked continuation 300 tokens / 2 streams", chunk)
    model.check(cache)
    warm = model.compiled_programs()
    res.update(ok=ok, compiled_programs=warm, programs_after_first_prefill_pair=progs,
               slot_lens=np.asarray(cache.slot_lens).tolist(), status=int(cache.status),
               rows=[{"step": n, "s": s} for n, s in rows],
               peak_bytes=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"))
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "model_smoke.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nfinite logits: {ok}; status {res['status']}; compiled programs {warm} "
          f"(after both prefills: {progs}); peak GiB {(res['peak_bytes'] or 0) / 2**30:.1f}")
    print(f"{'step':<44} {'s':>8}")
    for n, s in rows:
        print(f"{n:<44} {s:8.3f}")


if __name__ == "__main__":
    main()
