"""Where the MoE's "sort" time goes on the GPU, and the routing kernel against XLA's softmax + top-k.

The 2xH200 profile of a 12-layer 80B varlen16 prefill (benchmarks/logs/shard_x2_run2.log) put 5.1 ms of one
GPU's 86 ms in kernels named sort / radix: 0.42 ms per MoE layer. Candidates: XLA's top-k over the router's
[T, E] = [19456, 512] probabilities, and moe_align's single-key radix sort of T k = 194560 copies. This times
each alone (jax_gdn.bench.time_jax: median of groups of back-to-back calls) at T 19456 and 64, and the Pallas
router kernel (pallas_kernels.moe.routing_triton) against the XLA router after checking the ids agree.

    export PYTHONPATH=$PWD; python benchmarks/gpu/route_probe.py            (~30 s on an H200)
    python benchmarks/gpu/route_probe.py --quick                            (CPU, interpret mode, tiny)
Writes $OUT/route_probe.json and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_gdn.bench import time_jax
from pallas_kernels.moe import api, reference


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    e, k = (64, 4) if args.quick else (512, 10)
    sizes = (130,) if args.quick else (19456, 64)
    be = "pallas_interpret" if args.quick else "pallas"
    kw = dict(warmup=1, groups=3, per_group=2) if args.quick else {}
    rows = []
    for t in sizes:
        rng = np.random.default_rng(t)
        logits = jnp.asarray(rng.standard_normal((t, e)) * 2, jnp.bfloat16)
        probs = jax.nn.softmax(logits.astype(jnp.float32), -1)
        flat_e = jnp.asarray(rng.integers(0, e, t * k), jnp.int32)
        top_w = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
        top_i = flat_e.reshape(t, k)
        fns = {
            "xla route (softmax + top_k + norm)": (jax.jit(lambda x: reference.route_xla(
                x, top_k=k, norm_topk_prob=True)), (logits,)),
            "pallas route kernel": (jax.jit(lambda x: api.route(x, top_k=k, norm_topk_prob=True, backend=be)),
                                    (logits,)),
            "lax.top_k alone [T, E] fp32": (jax.jit(lambda p: jax.lax.top_k(p, k)), (probs,)),
            "sort_by_expert (1 int32 key, T k)": (jax.jit(lambda f: reference.sort_by_expert(f, e)), (flat_e,)),
            "moe_align (block 128)": (jax.jit(lambda w, i: reference.moe_align(w, i, e, 128)), (top_w, top_i)),
        }
        res = {}
        for name, (f, a) in fns.items():
            try:
                res[name] = round(time_jax(f, a, **kw), 4)
            except Exception as err:  # noqa: BLE001
                res[name] = f"{type(err).__name__}: {str(err)[:200]}"
        wx, ix = jax.jit(lambda x: reference.route_xla(x, top_k=k, norm_topk_prob=True))(logits)
        wp, ip = jax.jit(lambda x: api.route(x, top_k=k, norm_topk_prob=True, backend=be))(logits)
        ix, ip = np.asarray(ix), np.asarray(ip)
        same_set = float(np.mean([set(a) == set(b) for a, b in zip(ix, ip)]))
        rows.append({"T": t, "E": e, "k": k, "ms": res, "ids_equal": float((ix == ip).all(1).mean()),
                     "id_sets_equal": same_set,
                     "w_max_abs_diff": float(np.abs(np.asarray(wx) - np.asarray(wp)).max())})
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    with open(os.path.join(out_dir, "route_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"T {r['T']} E {r['E']} k {r['k']}: ids equal {r['ids_equal']:.4f} (sets {r['id_sets_equal']:.4f}), "
              f"w max diff {r['w_max_abs_diff']:.2e}")
        for name, ms in r["ms"].items():
            print(f"  {name:40s} {ms if isinstance(ms, str) else f'{ms:9.4f} ms'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
