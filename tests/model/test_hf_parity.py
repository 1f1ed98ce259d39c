"""Logits parity with HF transformers (CPU, fp32, eager attention, torch fallbacks) on tiny random checkpoints.

Every norm, A_log, dt_bias, conv, gate and router weight is randomised (HF's defaults - zeros / ones - hide bugs),
the model is saved with ``save_pretrained`` and read back with ``load_pretrained``. Per model one cache sees:
(a) one packed prefill of streams of 1, 5, 67, 130 tokens in permuted slots, (b) greedy decode steps, and
(c) a chunked continuation of two streams with a new stream joining in a fresh slot (all logits compared).
The reference for every stream is HF's forward over the stream's whole token history. Value heads per key head:
3 (qwen3_next), 2 (qwen3_5_text), 1 (qwen3_5_moe).
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax_gdn import load_pretrained  # noqa: E402

TOL = 2e-4
COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=12, intermediate_size=40, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 5000.0,
                                                                                 "partial_rotary_factor": 0.5})
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20)


def _randomise(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(r * 0.5)
            elif "linear_attn.norm" in name:           # plain weight (ones at init)
                p.copy_(1.0 + 0.2 * r)
            elif "norm" in name:                        # zero-centred (1 + w)
                p.copy_(0.2 * r)
            elif "embed_tokens" in name:
                p.copy_(0.5 * r)
            else:
                p.copy_(0.15 * r)


def _build(kind: str, seed: int):
    if kind == "qwen3_next":                     # grouped value heads Hv / Hk = 3 (fused, interleaved layout)
        cfg = transformers.Qwen3NextConfig(**{**COMMON, "linear_num_value_heads": 6}, **MOE, mlp_only_layers=[1])
        cls = transformers.Qwen3NextForCausalLM
    elif kind == "qwen3_5_text":
        cfg = transformers.Qwen3_5TextConfig(**COMMON, tie_word_embeddings=True)
        cls = transformers.Qwen3_5ForCausalLM
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**{**COMMON, "linear_num_value_heads": 2}, **MOE)   # Hv == Hk
        cls = transformers.Qwen3_5MoeForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    _randomise(model, seed)
    return model


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids, np.int64))[None]).logits[0].float().numpy()


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(ours))
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _to_multimodal_fused(src: str, dst: str):
    """Rewrites a Qwen3.5-MoE text checkpoint the way the multimodal release stores it: model_type qwen3_5_moe
    with text_config, ``model.language_model.*`` names, fused experts, plus vision and mtp tensors to skip."""
    from safetensors.numpy import load_file, save_file
    sd = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    e = text["num_experts"]
    out = {}
    for key, value in sd.items():
        if ".mlp.experts." in key:
            continue
        out[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key] = value
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = np.stack([np.concatenate([sd[f"{p}{j}.gate_proj.weight"], sd[f"{p}{j}.up_proj.weight"]])
                            for j in range(e)])
        down = np.stack([sd[f"{p}{j}.down_proj.weight"] for j in range(e)])
        q = f"model.language_model.layers.{i}.mlp.experts."
        out[q + "gate_up_proj"], out[q + "down_proj"] = gate_up, down
    out["model.visual.patch_embed.proj.weight"] = np.ones((4, 3), np.float32)
    out["mtp.fc.weight"] = np.ones((2, 2), np.float32)
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    text["model_type"] = "qwen3_5_moe_text"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 1},
                   "tie_word_embeddings": False}, f)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text"])
def pair(request, tmp_path_factory):
    kind = request.param
    hf = _build(kind, seed=1 if kind == "qwen3_next" else 2)
    path = str(tmp_path_factory.mktemp(kind))
    # qwen3_5_text goes through a sharded checkpoint (index json + several files)
    hf.save_pretrained(path, **({"max_shard_size": "40KB"} if kind == "qwen3_5_text" else {}))
    if kind == "qwen3_5_text":
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return hf, load_pretrained(path, dtype=jnp.float32, backend="xla")


def test_prefill_decode_chunked_match_hf(pair):
    hf, model = pair
    rng = np.random.default_rng(0)
    lens, slots = [1, 5, 67, 130], [3, 0, 5, 2]
    seqs = [list(rng.integers(0, 97, n)) for n in lens]
    cache = model.init_cache(max_seqs=6, max_tokens=640, page_size=16)

    # (a) one packed prefill, permuted slots
    cu = np.cumsum([0] + lens).astype(np.int32)
    logits, cache = model.prefill(cache, np.concatenate(seqs).astype(np.int32), cu, np.array(slots, np.int32))
    assert logits.shape == (4, 97) and logits.dtype == jnp.float32
    for i, s in enumerate(seqs):
        assert _rel(logits[i], _hf_logits(hf, s)[-1]) <= TOL, f"prefill stream {i} (len {lens[i]})"

    # (b) greedy decode steps
    for step in range(3):
        nxt = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
        for i in range(4):
            seqs[i].append(int(nxt[i]))
        logits, cache = model.decode(cache, nxt, np.array(slots, np.int32))
        assert logits.shape == (4, 97)
        for i, s in enumerate(seqs):
            assert _rel(logits[i], _hf_logits(hf, s)[-1]) <= TOL, f"decode step {step} stream {i}"

    # (c) chunked continuation of two streams (every logit) + a new stream joining in a fresh slot
    extra = [list(rng.integers(0, 97, n)) for n in (60, 5, 9)]
    cont_slots = [5, 3, 1]                      # the 67-stream, the 1-stream, a new one
    cu = np.cumsum([0] + [len(e) for e in extra]).astype(np.int32)
    logits, cache = model.prefill(cache, np.concatenate(extra).astype(np.int32), cu,
                                  np.array(cont_slots, np.int32), return_all_logits=True)
    assert logits.shape == (74, 97)
    histories = [seqs[2] + extra[0], seqs[0] + extra[1], extra[2]]
    for j, hist in enumerate(histories):
        ref = _hf_logits(hf, hist)[-len(extra[j]):]
        assert _rel(logits[cu[j]:cu[j + 1]], ref) <= TOL, f"continuation stream {j}"
    np.testing.assert_array_equal(np.asarray(cache.slot_lens), [8, 9, 133, 9, 0, 130])


def test_qwen3_5_moe_multimodal_fused_checkpoint(tmp_path):
    """qwen3_5_moe release layout (language_model prefix, fused experts, vision + mtp skipped) vs HF."""
    hf = _build("qwen3_5_moe_text", seed=3)
    hf.save_pretrained(str(tmp_path / "text"))
    _to_multimodal_fused(str(tmp_path / "text"), str(tmp_path / "mm"))
    model = load_pretrained(str(tmp_path / "mm"), dtype=jnp.float32, backend="xla")
    assert model.config.model_type == "qwen3_5_moe" and all(model.config.layer_is_moe(i) for i in range(4))
    rng = np.random.default_rng(1)
    lens, slots = [5, 67, 1], [2, 0, 1]
    seqs = [rng.integers(0, 97, n) for n in lens]
    cache = model.init_cache(max_seqs=3, max_tokens=128, page_size=8)
    cu = np.cumsum([0] + lens).astype(np.int32)
    logits, cache = model.prefill(cache, np.concatenate(seqs).astype(np.int32), cu, np.array(slots, np.int32))
    for i, s in enumerate(seqs):
        assert _rel(logits[i], _hf_logits(hf, s)[-1]) <= TOL, f"stream {i}"
