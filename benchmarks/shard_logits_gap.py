"""Is the 1-GPU vs 2-GPU logits gap of shard_x2 (12 layers, bf16: rel_max 0.145, argmax agreement 0.625) a bug?

CPU, tiny dims, 2 forced host devices (issue 13):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python benchmarks/shard_logits_gap.py

A 12-layer Qwen3-Next-shaped model (3 GDN + 1 attention, every FFN a MoE with 64 experts, top 8, random weights
N(0, 0.02) as the GPU run) prefills a varlen mix (360 tokens) in fp32 and bf16 on one device, on a mesh of 2 with
tensor-parallel experts ("tensor") and with expert parallel ("expert"). Control: each bf16 run against the fp32
one-device run (the exact model), i.e. how far bf16 itself is from exact, with and without the split.
Printed per pair: the final logits' rel_max / argmax agreement, and for the MoE of layers 0 and 11 the relative
difference of its input and the fraction of tokens whose top-k expert SET differs; and how often the bf16 router's
k-th and (k+1)-th probabilities tie exactly. The MoE input is read through a probe model (the first l layers,
the last one's FFN zeroed, lm_head = [I | 0]: its logits are that MoE's input; a host callback inside shard_map
deadlocks XLA:CPU's multi-device runtime).
GDN: Pallas interpret; attention and MoE: XLA.
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_gdn.bench_model import tiny_config  # noqa: E402
from jax_gdn.layers.ffn import moe_route  # noqa: E402
from jax_gdn.model import HybridModel, _is_fp32, init_params  # noqa: E402

LAYERS = 12
CFG = dataclasses.replace(tiny_config(LAYERS), vocab_size=512, hidden_size=64, num_experts=64,
                          num_experts_per_tok=8, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                          linear_num_key_heads=2, linear_num_value_heads=4, num_attention_heads=4,
                          num_key_value_heads=2)
LENS = (37, 1, 64, 65, 130, 63)
PROBE_LAYERS = (1, 12)     # the MoE inputs of layers 0 and 11 (probe models of 1 and 12 layers)


def layer_list(dtype) -> dict:
    """The 12-layer random params as {"embed", "final_norm", "lm_head", "layers": [block dict per layer]}: made
    in fp32 and cast to ``dtype`` (norms, A_log, dt_bias stay fp32), so fp32 and bf16 runs share the weights."""
    p = init_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    p = jax.tree_util.tree_map_with_path(
        lambda path, a: a if _is_fp32(str(getattr(path[-1], "key", ""))) else a.astype(dtype), p)
    per = len(p["period"])
    layers = [jax.tree.map(lambda a: a[i // per], p["period"][i % per]) for i in range(per * len(
        p["period"][0]["input_norm"]))]
    return {"embed": p["embed"], "final_norm": p["final_norm"], "lm_head": p["lm_head"], "layers": layers}


def probe_params(full: dict, upto: int, dtype) -> tuple:
    """The first ``upto`` layers with the last one's FFN zeroed and lm_head = [I_D | 0]: the model's logits[:, :D]
    are then rms_norm(h) of that layer's post-mixer stream h with the final norm, which equals its post_norm
    (every norm weight is 0 in init_params: 1 + w = 1), i.e. exactly the input of its MoE (fp32 values of the
    activation dtype)."""
    cfg = dataclasses.replace(CFG, num_hidden_layers=upto, layer_types=CFG.layer_types[:upto])
    layers = list(full["layers"][:upto])
    last = dict(layers[-1])
    last["ffn"] = jax.tree.map(jnp.zeros_like, last["ffn"])
    layers[-1] = last
    d, v = CFG.hidden_size, CFG.vocab_size
    head = jnp.eye(d, v, dtype=dtype)
    return cfg, {"embed": full["embed"], "final_norm": full["final_norm"], "lm_head": head, "layers": layers}


def run(cfg, params, dtype, n: int, moe_sharding: str = "tensor", moe_backend: str = "xla") -> np.ndarray:
    """Prefill of LENS on 1 device or a mesh of n; returns every token's logits [T, Vocab] (fp64)."""
    backend = {"gated_delta_rule": "pallas_interpret", "paged_attention": "xla", "moe": moe_backend}
    mesh = jax.make_mesh((n,), ("model",), devices=jax.devices()[:n]) if n > 1 else None
    model = HybridModel(cfg, params, dtype=dtype, backend=backend, mesh=mesh, moe_sharding=moe_sharding,
                        token_buckets=(512,))
    cache = model.init_cache(max_seqs=8, max_tokens=1024, page_size=16)
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, sum(LENS)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    logits, _ = model.prefill(cache, ids, cu, np.arange(len(LENS), dtype=np.int32), return_all_logits=True)
    return np.asarray(logits, np.float64)


def logits_gap(a: np.ndarray, b: np.ndarray) -> tuple:
    return (float(np.max(np.abs(a - b)) / np.max(np.abs(a))),
            float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))))


def topk_sets(full: dict, layer: int, u: np.ndarray, dtype) -> np.ndarray:
    """The sorted top-k expert ids [T, k] the model's router (``moe_route``, in ``dtype``) picks for MoE input u."""
    router = full["layers"][layer]["ffn"]["router"]
    k = CFG.num_experts_per_tok
    route = jax.jit(lambda x: moe_route(router, x.astype(dtype), k, CFG.norm_topk_prob)[1])
    return np.sort(np.asarray(route(jnp.asarray(u, jnp.float32))), -1)


def tie_fraction(full: dict, layer: int, u: np.ndarray, dtype) -> float:
    """Fraction of tokens whose k-th and (k+1)-th router probabilities are exactly equal (router logits in
    ``dtype``, as HF: bf16 logits tie often)."""
    router = full["layers"][layer]["ffn"]["router"]
    k = CFG.num_experts_per_tok
    probs = np.asarray(jax.nn.softmax((jnp.asarray(u, jnp.float32).astype(dtype) @ router).astype(jnp.float32)))
    top = -np.sort(-probs, -1)
    return float(np.mean(top[:, k - 1] == top[:, k]))


def main() -> int:
    t = sum(LENS)
    d = CFG.hidden_size
    print(f"config: {LAYERS} layers, hidden {d}, experts {CFG.num_experts} top {CFG.num_experts_per_tok}, "
          f"T={t} {LENS}; GDN Pallas interpret, attention and MoE XLA", flush=True)
    setups = [("1 dev", 1, "tensor"), ("2 dev tensor", 2, "tensor"), ("2 dev expert", 2, "expert")]
    logits, inputs, fulls = {}, {}, {}
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        full = fulls[name] = layer_list(dtype)
        for lab, n, ms in setups:
            logits[name, lab] = run(CFG, full, dtype, n, ms)
            for upto in PROBE_LAYERS:
                cfg, pp = probe_params(full, upto, dtype)
                inputs[name, lab, upto] = run(cfg, pp, dtype, n, ms)[:t, :d]
    f1, b1 = ("float32", "1 dev"), ("bfloat16", "1 dev")
    pairs = [(f1, ("float32", "2 dev tensor")), (f1, ("float32", "2 dev expert")), (b1, ("bfloat16", "2 dev tensor")),
             (b1, ("bfloat16", "2 dev expert")), (f1, b1), (f1, ("bfloat16", "2 dev tensor")),
             (f1, ("bfloat16", "2 dev expert"))]
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    for a, b in pairs:
        rel, agree = logits_gap(logits[a], logits[b])
        line = f"{a[0]} {a[1]:12s} vs {b[0]} {b[1]:12s} | {LAYERS}-layer logits rel_max {rel:9.3g} argmax {agree:.3f}"
        for upto in PROBE_LAYERS:
            ua, ub = inputs[a + (upto,)], inputs[b + (upto,)]
            urel = float(np.max(np.abs(ua - ub)) / np.max(np.abs(ua)))
            sa = topk_sets(fulls[a[0]], upto - 1, ua, dt[a[0]])
            sb = topk_sets(fulls[b[0]], upto - 1, ub, dt[b[0]])
            line += (f" | MoE L{upto - 1}: input rel {urel:8.2g}, top-k set differs "
                     f"{float(np.mean(np.any(sa != sb, -1))):.3f}")
        print(line, flush=True)
    for upto in PROBE_LAYERS:
        print(f"bf16 router, MoE L{upto - 1}: tokens whose k-th and (k+1)-th probabilities tie exactly (1 dev): "
              f"{tie_fraction(fulls['bfloat16'], upto - 1, inputs['bfloat16', '1 dev', upto], jnp.bfloat16):.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
