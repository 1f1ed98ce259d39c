"""Sharded vs one-device checks on tiny models, run by ``tests/model/test_sharding.py`` in ONE subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and ``JAX_PLATFORMS=cpu`` set before jax is imported (the
pytest process itself has one CPU device). By hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python tests/model/sharding_check.py

Prints one ``RESULT {json}`` line (every measured error and check, named); the test asserts on it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_gdn.config import HybridConfig  # noqa: E402
from jax_gdn.model import HybridModel, init_params  # noqa: E402
from jax_gdn.sharding import ShardRules  # noqa: E402

# Tiny configs whose counts divide a mesh of 4: GDN key heads 4 with value heads 8 (r = 2), attention heads 4 with
# kv heads 2 (a mesh of 4 keeps a copy of each kv head on two devices). Layers [GDN, attention] x 2: the scan over
# the period runs twice (stacked leaves [R=2, ...] are split too).
COMMON = dict(vocab_size=66, hidden_size=32, num_hidden_layers=4,
              layer_types=("linear_attention", "full_attention") * 2, intermediate_size=24,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=4,
              linear_conv_kernel_dim=4)
CONFIGS = {
    # fused in_proj_qkvz / in_proj_ba; dense MLP in the GDN layers, MoE (8 experts, I = 8, shared expert 12) in
    # the attention layers; untied LM head; vocab 66: split over 2 devices, replicated over 4
    "qwen3_next": HybridConfig(model_type="qwen3_next", num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=8, shared_expert_intermediate_size=12, decoder_sparse_step=2,
                               **COMMON),
    # separate in_proj_qkv (split q | k | v by heads, device-major) / z / b / a; tied embeddings split over the
    # vocabulary (64)
    "qwen3_5": HybridConfig(model_type="qwen3_5_text", tie_word_embeddings=True, **{**COMMON, "vocab_size": 64}),
}
MESHES = {"qwen3_next": (2, 4), "qwen3_5": (4,)}      # (a mesh of 1 was the unsharded program again: ~20 s of CI)
# meshes whose params' layout is checked but not their logits: qwen3_next on 4 devices runs whole in the expert-
# parallel check below (the same GDN / attention / embedding split; tensor-parallel experts run on the mesh of 2)
LAYOUT_ONLY = {("qwen3_next", 4)}
# Expert parallel (moe_sharding="expert"): the whole model on a mesh of 4 (2 of the 8 experts per device, top 2)
# against the same one-device run, XLA MoE; the MoE kernels' path (a trash expert for the other devices' copies,
# its skipped blocks' rows left unwritten: NaN in interpret mode) is checked layer by layer (check_moe_ep_layer)
EP_MESHES = {4: "xla"}
BUCKETS = (144,)        # every prefill of the script pads to one T bucket: one prefill program per model
# The GDN rule runs its Pallas kernel in interpret mode: XLA's chunked form calls LAPACK's batched triangular
# solve on CPU, whose parallel batch map deadlocks when several device programs run it at once (jaxlib 0.10).
# Attention and MoE take their XLA paths (smaller programs to compile).
BACKEND = {"gated_delta_rule": "pallas_interpret", "paged_attention": "xla", "moe": "xla"}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _mesh(n: int):
    return jax.make_mesh((n,), ("model",), devices=jax.devices()[:n])


def _run(model: HybridModel, seed: int) -> tuple:
    """(a) packed prefill of lengths 1, 5, 63, 65 in permuted slots; (b) chunked continuation of two streams with
    a fresh one joining; (c) three decode steps of five streams; (d) release two slots, prefill them fresh; (e) fork a
    slot into another and feed both the same tokens. Every prefill of (a)-(d) returns all logits. Returns (each
    step's logits (NumPy), the relative gap between (e)'s two streams)."""
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    cache = model.init_cache(max_seqs=6, max_tokens=512, page_size=8)
    out = []

    def prefill(cache, lens, slots):
        ids = rng.integers(0, v, sum(lens)).astype(np.int32)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        logits, cache = model.prefill(cache, ids, cu, np.array(slots, np.int32), return_all_logits=True)
        out.append(np.asarray(logits))
        return cache

    cache = prefill(cache, [1, 5, 63, 65], [3, 0, 5, 1])
    cache = prefill(cache, [7, 2, 9], [0, 5, 2])
    for _ in range(3):
        logits, cache = model.decode(cache, rng.integers(0, v, 5).astype(np.int32), np.array([2, 3, 0, 5, 1]))
        out.append(np.asarray(logits))
    cache = model.release(cache, np.array([0, 3], np.int32))
    cache = prefill(cache, [4, 5, 3], [3, 0, 4])
    # (e) fork slot 5 into slot 1 (the prefix cache's snapshot / restore), then the same 3 tokens into both (and
    # one into slot 2: three streams, so (d)'s compiled program serves this call)
    cache = model.fork(cache, np.array([5], np.int32), np.array([1], np.int32))
    ids = rng.integers(0, v, 3).astype(np.int32)
    logits, cache = model.prefill(cache, np.concatenate([ids, ids, ids[:1]]), np.array([0, 3, 6, 7], np.int32),
                                  np.array([1, 5, 2], np.int32))
    logits = np.asarray(logits)
    out.append(logits)
    model.check(cache)
    return out, _rel(logits[0], logits[1])          # the fork continues as its source does


def check_equal(res: dict) -> None:
    """Sharded prefill / continuation / decode == one device, per config and mesh."""
    for name, cfg in CONFIGS.items():
        params = init_params(cfg, jax.random.PRNGKey(7), jnp.float32, std=0.1)
        ref, _ = _run(HybridModel(cfg, params, dtype=jnp.float32, backend=BACKEND, token_buckets=BUCKETS), 1)
        for n in MESHES[name]:
            # tensor-parallel experts named explicitly: the default "auto" takes expert parallel where the mesh
            # divides the experts (checked below with EP_MESHES and in check_errors)
            model = HybridModel(cfg, params, dtype=jnp.float32, backend=BACKEND, token_buckets=BUCKETS,
                                mesh=_mesh(n), moe_sharding="tensor")
            if (name, n) not in LAYOUT_ONLY:
                got, res[f"fork_gap/{name}/mesh{n}"] = _run(model, 1)
                res[f"equal/{name}/mesh{n}"] = max(_rel(g, r) for g, r in zip(got, ref))
                print(name, n, res[f"equal/{name}/mesh{n}"], file=sys.stderr, flush=True)
            emb = model.params["embed"]
            res[f"embed_split/{name}/mesh{n}"] = (not emb.sharding.is_fully_replicated) or n == 1
            blk = model.params["period"][0]["mixer"]
            big = "in_proj_qkvz" if "in_proj_qkvz" in blk else "in_proj_qkv"
            res[f"gdn_local_cols/{name}/mesh{n}"] = [int(s.data.shape[2]) for s in blk[big].addressable_shards]
        if name != "qwen3_next":
            continue
        for n, moe in EP_MESHES.items():
            model = HybridModel(cfg, params, dtype=jnp.float32, backend=dict(BACKEND, moe=moe),
                                token_buckets=BUCKETS, mesh=_mesh(n), moe_sharding="expert")
            res[f"equal/{name}/ep_mesh{n}"] = max(_rel(g, r) for g, r in zip(_run(model, 1)[0], ref))
            print(name, "ep", n, res[f"equal/{name}/ep_mesh{n}"], file=sys.stderr, flush=True)
            ffn = model.params["period"][1]["ffn"]
            res[f"ep_local_experts/mesh{n}"] = [int(s.data.shape[1]) for s in ffn["experts_gate_up"].addressable_shards]
            res[f"ep_expert_width/mesh{n}"] = int(ffn["experts_gate_up"].shape[-1])


def check_moe_ep_layer(res: dict) -> None:
    """The expert-parallel MoE layer alone (jax_gdn.layers.moe_ep) in shard_map over meshes of 1, 2 and 4 against
    the one-device sparse_moe (fp32): 8 experts, top 3 (more than the 2 local experts of a mesh of 4); XLA at
    T = 1 and 130 tokens, the Pallas kernels in interpret mode at T = 65; the psum of the parts equals the
    one-device MoE."""
    from jax.sharding import PartitionSpec as P

    from jax_gdn.layers.ffn import sparse_moe
    from jax_gdn.layers.moe_ep import sparse_moe_expert_parallel
    d, e, i, si, k = 32, 8, 16, 12, 3
    rng = np.random.default_rng(5)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32)   # noqa: E731
    params = {"router": w(d, e), "experts_gate_up": w(e, d, 2 * i), "experts_down": w(e, i, d),
              "shared_expert": {"gate_proj": w(d, si), "up_proj": w(d, si), "down_proj": w(si, d)},
              "shared_expert_gate": w(d, 1)}
    errs = {}
    for n in (1, 2, 4):
        specs = {"router": P(), "experts_gate_up": P("model"), "experts_down": P("model"),
                 "shared_expert": {"gate_proj": P(None, "model"), "up_proj": P(None, "model"),
                                   "down_proj": P("model")}, "shared_expert_gate": P()}
        for backend in ("xla", "pallas_interpret"):
            def part(p, x, backend=backend):
                y = sparse_moe_expert_parallel(p, x, top_k=k, norm_topk_prob=True, axis_name="model",
                                               num_experts=e, backend=backend)
                return jax.lax.psum(y, "model")
            mesh = _mesh(n)
            fn = jax.jit(jax.shard_map(part, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False))
            placed = jax.tree.map(lambda a, sp: jax.device_put(a, jax.sharding.NamedSharding(mesh, sp)), params,
                                  specs)
            for t in ((1, 130) if backend == "xla" else (65,)):
                x = w(t, d)
                want = sparse_moe(params, x, top_k=k, norm_topk_prob=True, backend="xla")
                got = fn(placed, jax.device_put(x, jax.sharding.NamedSharding(mesh, P())))
                errs[f"{backend}/mesh{n}/T{t}"] = _rel(got, want)
    res["moe_ep_layer"] = errs


def check_random_params(res: dict) -> None:
    """init_params(mesh=) makes the sharded layout on the devices: accepted as is, equal to the placed one-device
    init on the leaves the layout does not reorder, replicated kv heads are copies."""
    cfg = CONFIGS["qwen3_next"]
    mesh = _mesh(4)
    rules = ShardRules(cfg, mesh)
    sharded = init_params(cfg, jax.random.PRNGKey(3), jnp.float32, mesh=mesh)
    src = jax.jit(lambda: init_params(cfg, jax.random.PRNGKey(3), jnp.float32))()
    placed = rules.place_params(src)                      # device arrays: reorder on device + device_put
    res["random/is_placed"] = rules.is_placed(sharded) and rules.is_placed(placed)
    host = rules.place_params(jax.tree.map(np.asarray, src))     # host arrays: each device's slice cut on the host
    res["random/host_path_equal"] = all(bool(np.array_equal(a, b)) for a, b in
                                        zip(jax.tree.leaves(host), jax.tree.leaves(placed)))
    attn = sharded["period"][1]["mixer"]
    res["random/q_proj_equal"] = bool(np.allclose(attn["q_proj"], placed["period"][1]["mixer"]["q_proj"],
                                                  rtol=1e-6, atol=1e-8))     # jit vs jit: XLA fusions may differ
    k = np.asarray(attn["k_proj"])                                         # [R, D, 4 * Dh]: heads 0, 0, 1, 1
    res["random/kv_copies"] = bool(np.array_equal(k[..., :8], k[..., 8:16]) and
                                   np.array_equal(k[..., 16:24], k[..., 24:]))
    model = HybridModel(cfg, sharded, dtype=jnp.float32, backend="xla", mesh=mesh)
    res["random/taken_as_is"] = model.params["period"][0]["mixer"]["in_proj_qkvz"] is \
        sharded["period"][0]["mixer"]["in_proj_qkvz"]


def check_errors(res: dict) -> None:
    """A mesh that does not divide the heads (or, expert parallel, the experts: 6 on 4 devices) and an unknown
    moe_sharding: ValueError naming the mesh size and the counts (or the argument), nothing placed; what the
    default moe_sharding "auto" resolves to with 8 and with 6 experts on 4 devices."""
    cfg = HybridConfig(model_type="qwen3_next", **{**COMMON, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
                                                   "num_attention_heads": 6, "num_key_value_heads": 3})
    try:
        HybridModel(cfg, {}, dtype=jnp.float32, backend="xla", mesh=_mesh(4))   # refused before params are read
        res["error/message"] = None
    except ValueError as err:
        res["error/message"] = str(err)
    try:
        ShardRules(cfg, jax.make_mesh((2, 2), ("a", "b")))
        res["error/two_axes"] = None
    except ValueError as err:
        res["error/two_axes"] = str(err)
    ep_cfg = dataclasses.replace(CONFIGS["qwen3_next"], num_experts=6)
    # "auto" (the default): expert parallel where the mesh divides the experts (8 on 4), tensor where not (6 on 4)
    res["auto/8_experts_mesh4"] = ShardRules(CONFIGS["qwen3_next"], _mesh(4)).moe_sharding
    res["auto/6_experts_mesh4"] = ShardRules(ep_cfg, _mesh(4)).moe_sharding
    for key, kw in (("error/ep_experts", dict(moe_sharding="expert")), ("error/moe_sharding", dict(moe_sharding="x"))):
        try:
            ShardRules(ep_cfg, _mesh(4), **kw)
            res[key] = None
        except ValueError as err:
            res[key] = str(err)


def check_hf(res: dict) -> None:
    """HF parity under a mesh of 2: a tiny random Qwen3-Next saved by transformers, loaded with
    load_pretrained(mesh=) (each device reads its slices), prefill + decode logits vs HF's forward."""
    try:
        import torch
        import transformers
    except ImportError:
        res["hf/skipped"] = "torch / transformers not installed"
        return
    from jax_gdn import load_pretrained
    hf_cfg = transformers.Qwen3NextConfig(
        vocab_size=98, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
        linear_value_head_dim=12, intermediate_size=40, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=20, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = transformers.Qwen3NextForCausalLM(hf_cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if pname.endswith("A_log"):
                p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=gen)))
            elif pname.endswith("dt_bias"):
                p.copy_(r * 0.5)
            elif "linear_attn.norm" in pname:
                p.copy_(1.0 + 0.2 * r)
            elif "norm" in pname:
                p.copy_(0.2 * r)
            else:
                p.copy_((0.5 if "embed_tokens" in pname else 0.15) * r)
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path, max_shard_size="40KB")          # several files + index, experts one by one
        model = load_pretrained(path, dtype=jnp.float32, backend=BACKEND, mesh=_mesh(2))
        res["hf/fused_experts_equal"] = _fused_experts_equal(path, model, hf_cfg.num_experts)
        # expert parallel: each device reads whole experts; the global arrays are the one-device layout
        ep = load_pretrained(path, dtype=jnp.float32, backend=BACKEND, mesh=_mesh(2), moe_sharding="expert")
        one = load_pretrained(path, dtype=jnp.float32, backend=BACKEND)
        moe_j = [j for j, kd in enumerate(one.plan.kinds[:one.plan.period]) if kd.moe][0]
        res["hf/ep_experts_equal"] = all(
            bool(np.array_equal(ep.params["period"][moe_j]["ffn"][nm], one.params["period"][moe_j]["ffn"][nm]))
            and [s.data.shape[1] for s in ep.params["period"][moe_j]["ffn"][nm].addressable_shards] == [3, 3]
            for nm in ("experts_gate_up", "experts_down"))
    rng = np.random.default_rng(0)
    lens = [1, 6, 37]
    seqs = [list(rng.integers(0, 98, n)) for n in lens]
    cache = model.init_cache(max_seqs=4, max_tokens=256, page_size=8)
    cu = np.cumsum([0] + lens).astype(np.int32)
    logits, cache = model.prefill(cache, np.concatenate(seqs).astype(np.int32), cu, np.array([2, 0, 3], np.int32))
    errs = []

    def hf_last(ids):
        with torch.no_grad():
            return hf(torch.tensor(np.asarray(ids, np.int64))[None]).logits[0, -1].float().numpy()
    for i, s in enumerate(seqs):
        errs.append(_rel(logits[i], hf_last(s)))
    nxt = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
    for i in range(3):
        seqs[i].append(int(nxt[i]))
    logits, cache = model.decode(cache, nxt, np.array([2, 0, 3], np.int32))
    for i, s in enumerate(seqs):
        errs.append(_rel(logits[i], hf_last(s)))
    res["hf/mesh2"] = max(errs)
    res["hf/in_proj_qkvz_shards"] = [list(s.data.shape) for s in
                                     model.params["period"][0]["mixer"]["in_proj_qkvz"].addressable_shards]


def _fused_experts_equal(path: str, model, num_experts: int) -> bool:
    """The same checkpoint with every layer's experts fused (``experts.gate_up_proj [E, 2I, D]``,
    ``experts.down_proj [E, D, I]``, transformers 5's layout) loads, sliced per device, to the same params."""
    import glob
    import shutil

    from safetensors.numpy import load_file, save_file

    from jax_gdn import load_pretrained
    sd = {}
    for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        sd.update(load_file(fn))
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in sd:
            continue
        sd[p + "gate_up_proj"] = np.stack([np.concatenate([sd.pop(f"{p}{j}.gate_proj.weight"),
                                                           sd.pop(f"{p}{j}.up_proj.weight")])
                                           for j in range(num_experts)])
        sd[p + "down_proj"] = np.stack([sd.pop(f"{p}{j}.down_proj.weight") for j in range(num_experts)])
    with tempfile.TemporaryDirectory() as dst:
        save_file(sd, os.path.join(dst, "model.safetensors"))
        shutil.copy(os.path.join(path, "config.json"), dst)
        fused = load_pretrained(dst, dtype=jnp.float32, backend=BACKEND, mesh=model.mesh)
    return all(bool(np.array_equal(a, b)) and a.sharding == b.sharding
               for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(fused.params)))


def main() -> int:
    res, times = {}, {}
    for fn in (check_errors, check_random_params, check_moe_ep_layer, check_equal, check_hf):
        t0 = time.time()
        fn(res)
        times[fn.__name__] = round(time.time() - t0, 1)
        print(fn.__name__, times[fn.__name__], "s", file=sys.stderr, flush=True)
    res["seconds"] = times
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
