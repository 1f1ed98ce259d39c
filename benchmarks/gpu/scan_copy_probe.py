"""Does a lax.scan over stacked expert weights copy each layer's slice before the Pallas MoE kernel reads it?

Times the same 8 MoE layers (80B dims, bf16, 64 tokens = the decode step, and 8192 tokens) three ways in one run:
  list  : 8 separate weight arrays (no slicing at all)
  scan  : lax.scan over the stacked [L, ...] weights (the model's layout)
  loop  : a Python loop indexing the stacked weights with static indices
and counts the copy / dynamic-slice ops with >= 100 MB outputs in each compiled program. Then the same count for
the whole 8-layer model's decode program. Prints a table last.

    python benchmarks/gpu/scan_copy_probe.py
"""
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from jax_gdn.layers.ffn import sparse_moe  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
L, E, D, I, K = 8, 512, 2048, 512, 10


def big_ops(hlo: str, min_bytes=100e6):
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\{[^}]*\} (copy|dynamic-slice|copy-start|slice)\(", line)
        if m:
            dt, dims = m.group(3), [int(d) for d in m.group(4).split(",") if d]
            n = 1
            for d in dims:
                n *= d
            nbytes = n * {"bf16": 2, "f32": 4, "s32": 4, "f16": 2}.get(dt, 4)
            if nbytes >= min_bytes:
                found.append(f"{m.group(5)} {dt}{dims} {nbytes/1e9:.2f} GB")
    return found


def timeit(f, *args, reps=10):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main():
    key = jax.random.PRNGKey(0)
    ks = jax.random.split(key, 4)
    mk = jax.jit(lambda k: dict(
        router=jax.random.normal(k, (L, D, E), jnp.bfloat16) * 0.02,
        experts_gate_up=jax.random.normal(k, (L, E, D, 2 * I), jnp.bfloat16) * 0.02,
        experts_down=jax.random.normal(k, (L, E, I, D), jnp.bfloat16) * 0.02,
        shared_expert=dict(gate_proj=jax.random.normal(k, (L, D, I), jnp.bfloat16) * 0.02,
                           up_proj=jax.random.normal(k, (L, D, I), jnp.bfloat16) * 0.02,
                           down_proj=jax.random.normal(k, (L, I, D), jnp.bfloat16) * 0.02),
        shared_expert_gate=jax.random.normal(k, (L, D, 1), jnp.bfloat16) * 0.02))
    stacked = mk(ks[0])
    moe = lambda p, x: x + sparse_moe(p, x, top_k=K, norm_topk_prob=True, backend="pallas")  # noqa: E731

    @jax.jit
    def f_scan(st, x):
        return jax.lax.scan(lambda x, p: (moe(p, x), None), x, st)[0]

    @jax.jit
    def f_loop(st, x):
        for i in range(L):
            x = moe(jax.tree.map(lambda a: a[i], st), x)
        return x

    @jax.jit
    def f_list(lst, x):
        for p in lst:
            x = moe(p, x)
        return x

    rows = []
    for T in (64, 8192):
        x = jax.random.normal(ks[1], (T, D), jnp.bfloat16)
        for name, f, arg in (("scan", f_scan, stacked), ("loop", f_loop, stacked)):
            hlo = f.lower(arg, x).compile().as_text()
            open(f"{OUT}/moe_{name}_T{T}.hlo.txt", "w").write(hlo)
            rows.append((f"moe x{L} {name}", T, timeit(f, arg, x), big_ops(hlo)))
        lst = [jax.tree.map(lambda a: a[i], stacked) for i in range(L)]   # materialised separately
        lst = jax.block_until_ready(jax.tree.map(lambda a: a + 0, lst))
        hlo = f_list.lower(lst, x).compile().as_text()
        rows.append((f"moe x{L} list", T, timeit(f_list, lst, x), big_ops(hlo)))
        del lst
    del stacked

    # the whole model's decode program (8 layers at 80B dims)
    try:
        import numpy as np

        from jax_gdn.bench_model import _cu, _shared_cache_kwargs, _cases, qwen3_next_80b_config, random_device_model
        cfg = qwen3_next_80b_config(8)
        model = random_device_model(cfg)
        cs = _cases(False)
        _, dn, dctx, dchunk = cs["decode"]
        cache = model.init_cache(**_shared_cache_kwargs(cs, 3))
        slots = np.arange(dn, dtype=np.int32)
        rng = np.random.default_rng(0)
        for c in range(0, dn, dchunk):
            sl = slots[c:c + dchunk]
            _, cache = model.prefill(cache, rng.integers(0, cfg.vocab_size, len(sl) * dctx).astype(np.int32),
                                     _cu([dctx] * len(sl)), sl)
        nxt = rng.integers(0, cfg.vocab_size, dn).astype(np.int32)
        ids_p, cu_p, sl_p = model._padded(nxt, np.arange(dn + 1), slots, dn, dn, cache.num_slots)
        comp = model._decode_jit.lower(model.params, cache, ids_p, cu_p, sl_p).compile()
        hlo = comp.as_text()
        open(f"{OUT}/model_decode.hlo.txt", "w").write(hlo)
        st = {"c": cache}

        def stepf():
            lg, st["c"] = model.decode(st["c"], nxt, slots)
            return lg
        rows.append(("model decode 8 layers", dn, timeit(lambda: stepf(), reps=10), big_ops(hlo)))
    except Exception as e:  # noqa: BLE001
        rows.append(("model decode", 0, float("nan"), [f"{type(e).__name__}: {str(e)[:300]}"]))

    print(f"{'what':24s} {'T':>6s} {'ms':>9s}  big copies/slices (>=100 MB)")
    for name, t, ms, ops in rows:
        print(f"{name:24s} {t:6d} {ms:9.3f}  {len(ops)}: {'; '.join(sorted(set(ops)))[:300]}")


if __name__ == "__main__":
    main()
