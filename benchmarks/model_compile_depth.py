"""Compile time of HybridModel.prefill (trace + lower, then XLA compile of the T=128, N=4 bucket) against depth (CPU, tiny dims): with the layers stacked
and scanned over the repeating period (3 GDN + 1 attention), compile time should not grow with depth.

    JAX_PLATFORMS=cpu python benchmarks/model_compile_depth.py [--layers 8 48]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_gdn import HybridConfig, HybridModel


def config(layers: int) -> HybridConfig:
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
    return HybridConfig(model_type="qwen3_next", vocab_size=128, hidden_size=64, num_hidden_layers=layers,
                        layer_types=types, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 48])
    args = ap.parse_args()
    rows = []
    for n in args.layers:
        model = HybridModel.random(config(n), 0, dtype=jnp.float32, backend="xla")
        cache = model.init_cache(max_seqs=4, max_tokens=1024, page_size=16)
        ids = jnp.asarray(np.arange(128, dtype=np.int32) % 128)
        cu, sl = jnp.asarray([0, 37, 100, 100, 100], jnp.int32), jnp.asarray([1, 0, 4, 4], jnp.int32)
        t0 = time.perf_counter()
        lowered = model._prefill_jit.lower(model.params, cache, ids, cu, sl, return_all_logits=False)
        t_lower = time.perf_counter() - t0
        t0 = time.perf_counter()
        lowered.compile()
        t_compile = time.perf_counter() - t0
        p = model.plan
        rows.append((n, f"scan {p.repeats} x {p.period} + tail {len(p.tail)}", t_lower, t_compile))
    print(f"{'layers':>6} {'trace+lower s':>14} {'XLA compile s':>14}  plan")
    for n, plan, a, b in rows:
        print(f"{n:6d} {a:14.2f} {b:14.2f}  {plan}")

if __name__ == "__main__":
    main()
