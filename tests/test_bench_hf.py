"""benchmarks/hf.py, the whole-model section's HF peer, on the CPU at tiny dims: for each family it knows (Qwen3-Next,
Qwen3.5-MoE) ``hf_model`` builds transformers' model of the config, and ``use_hf_kernels`` redirects its GDN
layers' module-level callables and gated norms (every GDN layer calls what was put there) and ``undo`` puts back
exactly what was there; a model type without an HF peer is refused naming it."""
from __future__ import annotations

import collections

import pytest

from jax_gdn.config import preset

torch = pytest.importorskip("torch")

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32)


@pytest.mark.parametrize("name, cls", [("qwen3_next_80b", "Qwen3NextForCausalLM"),
                                       ("qwen3_5_35b_a3b", "Qwen3_5MoeForCausalLM")])
def test_hf_model_and_its_kernel_wiring(name, cls):
    from benchmarks.hf import HF_GDN_CALLABLES, _is_gdn, hf_model, hf_module, use_hf_kernels
    cfg = preset(name, **SMALL, **({"intermediate_size": 96} if name == "qwen3_next_80b" else {}))
    model = hf_model(cfg, torch.float32, "cpu")
    assert type(model).__name__ == cls
    mq = hf_module(model)
    assert mq is hf_module(config=cfg)
    gdn = [m for m in model.modules() if _is_gdn(m)]
    assert len(gdn) == 3                                            # 3 GDN + 1 attention layer
    calls = collections.Counter()

    def spy(k, f):
        def call(*a, **kw):
            calls[k] += 1
            return f(*a, **kw)
        return call
    before = {k: getattr(mq, k) for k in HF_GDN_CALLABLES}
    norms = [m.norm for m in gdn]

    def new_norm(old):
        import copy
        return copy.deepcopy(old)
    undo = use_hf_kernels(model, dict({k: spy(k, f) for k, f in before.items()}, gated_norm=new_norm))
    assert all(m.norm is not n for m, n in zip(gdn, norms))
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert calls["torch_chunk_gated_delta_rule"] == 3 and calls["causal_conv1d_fn"] == 3, calls
    undo()
    assert {k: getattr(mq, k) for k in HF_GDN_CALLABLES} == before
    assert all(m.norm is n for m, n in zip(gdn, norms))


def test_a_model_type_without_an_hf_peer_is_refused_naming_it():
    from benchmarks.hf import hf_family
    with pytest.raises(ValueError, match="no HF peer for model_type 'qwen3_5_text'"):
        hf_family(preset("tiny", model_type="qwen3_5_text"))
