"""FFN blocks: SwiGLU MLP and the sparse MoE (fp32 router, top-k, renormalisation, grouped experts, gated
shared expert) against a float64 NumPy loop over experts, and the MoE block against HF's Qwen3NextSparseMoeBlock
(each MoE backend). The kernels themselves are tested in tests/pallas_kernels/moe/test_experts.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.layers.ffn import resolve_moe_backend, sparse_moe, swiglu_mlp
from tests.numpy_reference import rel_rms


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mlp_f64(p, x):
    return (_silu(x @ p["gate_proj"]) * (x @ p["up_proj"])) @ p["down_proj"]


def _moe_f64(p, x, top_k, norm):
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    inter = p["experts_down"].shape[1]
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[:top_k]
        w = probs[t, top] / (probs[t, top].sum() if norm else 1.0)
        for e, we in zip(top, w):                       # the reference may loop; the code under test may not
            gu = x[t] @ p["experts_gate_up"][e]
            out[t] += we * ((_silu(gu[:inter]) * gu[inter:]) @ p["experts_down"][e])
    shared = _mlp_f64(p["shared_expert"], x)
    gate = 1.0 / (1.0 + np.exp(-(x @ p["shared_expert_gate"])))
    return out + gate * shared


def _params(rng, d, e, inter, si):
    def w(*s):
        return rng.standard_normal(s) * 0.3
    return {"router": w(d, e), "experts_gate_up": w(e, d, 2 * inter), "experts_down": w(e, inter, d),
            "shared_expert": {"gate_proj": w(d, si), "up_proj": w(d, si), "down_proj": w(si, d)},
            "shared_expert_gate": w(d, 1)}


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("top_k,norm", [(2, True), (3, False)])
def test_sparse_moe_matches_f64_loop(dtype, tol, top_k, norm):
    rng = np.random.default_rng(top_k)
    t, d, e, inter, si = 37, 16, 5, 12, 10
    p = _params(rng, d, e, inter, si)
    x = rng.standard_normal((t, d))
    pj = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), p)
    out = jax.jit(lambda p, x: sparse_moe(p, x, top_k=top_k, norm_topk_prob=norm))(pj, jnp.asarray(x, dtype))
    assert out.shape == (t, d) and out.dtype == dtype
    # reference on the same (rounded) inputs
    p64 = jax.tree_util.tree_map(lambda a: np.asarray(a.astype(jnp.float32), np.float64), pj)
    ref = _moe_f64(p64, np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64), top_k, norm)
    assert rel_rms(np.asarray(out.astype(jnp.float32)), ref) <= tol


def test_swiglu_mlp_matches_f64():
    rng = np.random.default_rng(0)
    p = {"gate_proj": rng.standard_normal((8, 20)), "up_proj": rng.standard_normal((8, 20)),
         "down_proj": rng.standard_normal((20, 8))}
    x = rng.standard_normal((65, 8))
    out = swiglu_mlp(jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), p), jnp.asarray(x, jnp.float32))
    assert rel_rms(np.asarray(out), _mlp_f64(p, x)) <= 2e-4


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret", "auto"])
def test_sparse_moe_matches_hf_block(backend):
    torch = pytest.importorskip("torch")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    cfg = Qwen3NextConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                          shared_expert_intermediate_size=10, norm_topk_prob=True)
    torch.manual_seed(0)
    blk = Qwen3NextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for prm in blk.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
    x = torch.randn(1, 23, 16)
    with torch.no_grad():
        ref = blk(x)[0].numpy()

    def lin(m):
        return jnp.asarray(m.weight.detach().numpy().T)
    se = blk.shared_expert
    params = {"router": jnp.asarray(blk.gate.weight.detach().numpy().T),
              "experts_gate_up": jnp.asarray(blk.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1)),
              "experts_down": jnp.asarray(blk.experts.down_proj.detach().numpy().transpose(0, 2, 1)),
              "shared_expert": {"gate_proj": lin(se.gate_proj), "up_proj": lin(se.up_proj),
                                "down_proj": lin(se.down_proj)},
              "shared_expert_gate": lin(blk.shared_expert_gate)}
    out = sparse_moe(params, jnp.asarray(x[0].numpy()), top_k=2, norm_topk_prob=True, backend=backend)
    assert rel_rms(np.asarray(out), ref) <= 2e-4


def test_auto_backend_resolution():
    """"auto" is pallas only where the Pallas MoE supports the platform and dims, else xla."""
    x = jnp.zeros((3, 32), jnp.bfloat16)
    w = jnp.zeros((4, 32, 64), jnp.bfloat16)
    want = "pallas" if jax.devices()[0].platform == "gpu" else "xla"
    assert resolve_moe_backend("auto", x, w) == want
    assert resolve_moe_backend("auto", x, jnp.zeros((4, 32, 48), jnp.bfloat16)) == "xla"    # I = 24
    assert resolve_moe_backend("pallas_interpret", x, w) == "pallas_interpret"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_moe_backend("mosaic", x, w)
