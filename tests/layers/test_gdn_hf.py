"""The GDN layer against HF transformers' Qwen3NextGatedDeltaNet and Qwen3_5GatedDeltaNet (fp32, torch fallback
path), same weights, random inputs: packed prefill of two streams, HF's cache path (prefill then one decode step),
the final recurrent and conv states."""
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.config import GdnDims
from jax_gdn.layers import gdn
from jax_gdn.state import BatchMeta, GdnSlots
from tests.numpy_reference import rel_rms

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, HK, HV, K, V, KC = 32, 2, 6, 8, 12, 4   # GVA ratio 3, K != V
T_PREFILL = 70                              # crosses a chunk boundary

prefill_jit = jax.jit(gdn.gdn_layer_prefill, static_argnames=("dims", "backend"))
decode_jit = jax.jit(gdn.gdn_layer_decode, static_argnames=("dims",))
monolithic_jit = jax.jit(gdn.gdn_layer_monolithic, static_argnames=("dims", "backend"))


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    """fp32 matmuls at full precision (GPUs default to TF32, ~1e-3 relative): the tolerances here are fp32's."""
    with jax.default_matmul_precision("highest"):
        yield


def _hf_layer(layout, k=K, v=V):
    common = dict(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=k,
                  linear_value_head_dim=v, linear_conv_kernel_dim=KC, num_hidden_layers=1,
                  layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  vocab_size=16, intermediate_size=16, rms_norm_eps=1e-6)
    if layout == "qwen3_next":
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet, Qwen3NextRMSNorm
        cfg = Qwen3NextConfig(num_experts=0, **common)
        layer, norm = Qwen3NextGatedDeltaNet(cfg, 0), Qwen3NextRMSNorm(D, eps=1e-6)
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5RMSNorm
        cfg = Qwen3_5TextConfig(**common)
        layer, norm = Qwen3_5GatedDeltaNet(cfg, 0), Qwen3_5RMSNorm(D, eps=1e-6)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():   # randomise everything, incl. A_log, dt_bias, conv, norm
            if name == "A_log":
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.3, 3.0)))
            elif name == "dt_bias":
                p.copy_(torch.randn_like(p) * 0.5)
            elif name == "norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name == "conv1d.weight":
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        norm.weight.copy_(0.3 * torch.randn_like(norm.weight))
    layer, norm = layer.float().eval(), norm.float().eval()
    sd = {n: p.detach().numpy() for n, p in layer.named_parameters()}
    params = gdn.params_from_hf(sd, norm.weight.detach().numpy())
    dims = GdnDims(D, HK, HV, k, v, KC, rms_norm_eps=1e-6, layout=layout)
    gdn.check_params(params, dims)
    return cfg, layer, norm, params, dims


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hf_case(request):
    return _hf_layer(request.param)


def _np(x):
    return np.asarray(x, np.float64)


def test_packed_prefill_matches_hf_batch(hf_case):
    """Two equal-length streams: HF as a [2, T] batch without cache; ours packed over cu_seqlens in one call."""
    cfg, layer, norm, params, dims = hf_case
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 40, D)).astype(np.float32)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        ref = layer(norm(xt)).numpy() + x                       # HF's decoder-layer half: x + gdn(norm(x))
    slots = GdnSlots.zeros(dims, 3)
    meta = BatchMeta.from_lengths([40, 40], slot_ids=[2, 0])
    out, _ = prefill_jit(
        params, dims, jnp.asarray(x.reshape(80, D)), slots, meta, backend="xla")
    assert rel_rms(_np(out) - x.reshape(80, D), (ref - x).reshape(80, D)) < 2e-5


def test_cache_path_prefill_then_decode_matches_hf(hf_case):
    """HF's cache path (prefill of T tokens then one decode step) against our prefill + decode, incl. states."""
    from transformers.cache_utils import DynamicCache

    cfg, layer, norm, params, dims = hf_case
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, T_PREFILL + 1, D)).astype(np.float32)
    # the cache keyword is `cache` from transformers 5.2x (`cache_params` before); the states' home moved too
    kw = "cache" if "cache" in inspect.signature(layer.forward).parameters else "cache_params"

    def states(cache):
        layer0 = getattr(cache, "layers", [None])[0]
        conv = getattr(layer0, "conv_states", None)
        if conv is None or conv[0] is None:
            pytest.skip(f"transformers {transformers.__version__}: cache states not at cache.layers[0]")
        return conv[0].numpy()[0].copy(), layer0.recurrent_states[0].numpy()[0].copy()

    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        xt = torch.from_numpy(x)
        ref_prefill = layer(norm(xt[:, :T_PREFILL]), **{kw: cache}).numpy()[0]
        hf_conv, hf_ssm = states(cache)              # [conv_dim, Kc] (HF keeps the last Kc inputs), [Hv, K, V]
        ref_decode = layer(norm(xt[:, T_PREFILL:]), **{kw: cache}).numpy()[0]
        hf_ssm2 = states(cache)[1]

    # poisoned pool: the stream's slot and an unused one hold NaN
    slots = GdnSlots(conv_state=jnp.full((2, dims.conv_dim, KC - 1), jnp.nan),
                     ssm_state=jnp.full((2, HV, K, V), jnp.nan))
    h = jnp.asarray(x[0])
    out, slots = prefill_jit(params, dims, h[:T_PREFILL], slots,
                             BatchMeta.from_lengths([T_PREFILL], slot_ids=[1]), backend="xla")
    assert rel_rms(_np(out) - x[0, :T_PREFILL], ref_prefill) < 2e-5
    assert rel_rms(slots.ssm_state[1], hf_ssm) < 2e-5
    assert rel_rms(slots.conv_state[1], hf_conv[:, 1:]) < 1e-6
    assert np.isnan(np.asarray(slots.ssm_state[0])).all()

    out_d, slots = decode_jit(params, dims, h[T_PREFILL:], slots, jnp.asarray([1], jnp.int32))
    assert rel_rms(_np(out_d) - x[0, T_PREFILL:], ref_decode) < 2e-5
    assert rel_rms(slots.ssm_state[1], hf_ssm2) < 2e-5


def test_monolithic_matches_hf(hf_case):
    cfg, layer, norm, params, dims = hf_case
    x = np.random.default_rng(3).standard_normal((1, 65, D)).astype(np.float32)
    with torch.no_grad():
        ref = layer(norm(torch.from_numpy(x))).numpy()[0]
    mod = gdn.GatedDeltaNet.from_params(dims, params, backend="xla")
    assert all(np.array_equal(mod.params()[n], params[n]) for n in params)
    out, _ = monolithic_jit(mod.params(), dims, jnp.asarray(x[0]), GdnSlots.zeros(dims, 1), 0, False, backend="xla")
    assert rel_rms(_np(out) - x[0], ref) < 2e-5


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_fused_conv_prefill_matches_hf(layout, backend="xla"):
    """K == V = 16 (the fused conv + SiLU + L2 op's case), phase 1's conv "fused" (RuntimeOptions.phase1_conv): HF's cache path for a fresh
    stream of 70 tokens, the output and the conv state. (The op's Pallas kernel equals its XLA form in
    tests/layers/test_gdn.py::test_phase1_fused_equals_two_step and tests/pallas_kernels/conv1d/test_prefill.py.)"""
    from transformers.cache_utils import DynamicCache

    cfg, layer, norm, params, dims = _hf_layer(layout, 16, 16)
    x = np.random.default_rng(4).standard_normal((1, T_PREFILL, D)).astype(np.float32)
    kw = "cache" if "cache" in inspect.signature(layer.forward).parameters else "cache_params"
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        ref = layer(norm(torch.from_numpy(x)), **{kw: cache}).numpy()[0]
        layer0 = getattr(cache, "layers", [None])[0]
        conv = getattr(layer0, "conv_states", None)
        hf_conv = None if conv is None or conv[0] is None else conv[0].numpy()[0]
    fn = jax.jit(functools.partial(gdn.gdn_layer_prefill, conv="fused"), static_argnames=("dims", "backend"))
    slots = GdnSlots(conv_state=jnp.full((2, dims.conv_dim, KC - 1), jnp.nan),
                     ssm_state=jnp.full((2, HV, 16, 16), jnp.nan))
    out, slots = fn(params, dims, jnp.asarray(x[0]), slots, BatchMeta.from_lengths([T_PREFILL], slot_ids=[1]),
                    backend=backend)
    assert rel_rms(_np(out) - x[0], ref) < 2e-5
    if hf_conv is not None:
        assert rel_rms(slots.conv_state[1], hf_conv[:, 1:]) < 1e-6
    assert np.isnan(np.asarray(slots.conv_state[0])).all()
