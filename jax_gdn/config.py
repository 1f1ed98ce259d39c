"""Frozen dimension dataclasses and named model presets: the one place where layer shapes are defined.

    from jax_gdn.config import preset
    config = preset("qwen3_next_80b", num_hidden_layers=8)    # 6 GDN + 2 attention layers at the real dims
    config = preset("tiny")                                   # a small random-test model for CPU

Shape legend used across the package:
  T   stacked tokens of all streams in one call     N   number of streams (sequences) in the call
  S   slots in a state pool (max concurrent streams) Hk  key heads     Hv  value heads (Hv % Hk == 0)
  K   key head dim                                   V   value head dim
  D   hidden size                                    Kc  conv kernel size
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GdnDims:
    """Dimensions of one Gated DeltaNet layer.

    layout: "qwen3_next" (fused in_proj_qkvz / in_proj_ba, per-key-head interleave) or
            "qwen3_5" (separate in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, no interleave).
    """

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-6
    layout: str = "qwen3_next"

    def __post_init__(self):
        for name in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                     "conv_kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GdnDims.{name} must be a positive int, got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"GdnDims: num_v_heads ({self.num_v_heads}) must be a multiple of "
                f"num_k_heads ({self.num_k_heads})")
        if self.layout not in ("qwen3_next", "qwen3_5"):
            raise ValueError(f"GdnDims.layout must be 'qwen3_next' or 'qwen3_5', got {self.layout!r}")

    @property
    def key_dim(self) -> int:  # Hk * K
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:  # Hv * V
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # channels of the causal conv: [q | k | v]
        return 2 * self.key_dim + self.value_dim

    @property
    def head_ratio(self) -> int:  # value heads per key head
        return self.num_v_heads // self.num_k_heads


@dataclasses.dataclass(frozen=True)
class AttnDims:
    """Dimensions of one gated (softmax) attention layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"AttnDims: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


# ----------------------------------------------------------------------------------------------------------------
# Whole hybrid model
# ----------------------------------------------------------------------------------------------------------------

#: model_type values load_pretrained understands, and the GDN projection layout each one uses.
SUPPORTED_MODEL_TYPES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
}


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """A hybrid Gated DeltaNet + gated attention decoder (Qwen3-Next / Qwen3.5 text model).

    layer_types[i] is "linear_attention" (GDN) or "full_attention"; layer i's FFN is the sparse MoE when
    ``layer_is_moe(i)`` (num_experts > 0, i not in mlp_only_layers, (i + 1) % decoder_sparse_step == 0), else a
    dense SwiGLU MLP of ``intermediate_size``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple
    intermediate_size: int
    # gated attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    attention_bias: bool = False
    # gated deltanet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # sparse MoE (num_experts == 0: dense everywhere)
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"HybridConfig.model_type {self.model_type!r} is not supported; expected one of "
                             f"{sorted(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HybridConfig.{name} must be a positive int, got {value!r}")
        for name in ("intermediate_size", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"HybridConfig.{name} must be an int >= 0, got {value!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"HybridConfig.layer_types has {len(self.layer_types)} entries, expected "
                             f"num_hidden_layers={self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in ("linear_attention", "full_attention"):
                raise ValueError(f"HybridConfig.layer_types[{i}] = {t!r}; expected 'linear_attention' or "
                                 f"'full_attention'")
        if self.hidden_act != "silu":
            raise ValueError(f"HybridConfig.hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias:
            raise ValueError("HybridConfig.attention_bias=True is not supported (Qwen3-Next / Qwen3.5 have none)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"HybridConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError("HybridConfig.moe_intermediate_size must be positive when num_experts > 0")
        dense = [i for i in range(self.num_hidden_layers) if not self.layer_is_moe(i)]
        if dense and self.intermediate_size < 1:
            raise ValueError(f"HybridConfig.intermediate_size must be positive: layers {dense[:4]} have a dense MLP")
        # validates the per-layer dims
        self.gdn_dims, self.attn_dims  # noqa: B018

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def gdn_layout(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def gdn_dims(self) -> GdnDims:
        return GdnDims(hidden_size=self.hidden_size, num_k_heads=self.linear_num_key_heads,
                       num_v_heads=self.linear_num_value_heads, head_k_dim=self.linear_key_head_dim,
                       head_v_dim=self.linear_value_head_dim, conv_kernel_size=self.linear_conv_kernel_dim,
                       rms_norm_eps=self.rms_norm_eps, layout=self.gdn_layout)

    @property
    def attn_dims(self) -> AttnDims:
        return AttnDims(hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
                        num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
                        partial_rotary_factor=self.partial_rotary_factor, rope_theta=self.rope_theta,
                        rms_norm_eps=self.rms_norm_eps)

    def layer_is_moe(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def gdn_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    # ---- HF config.json ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict) -> "HybridConfig":
        """Builds the config from a HF ``config.json`` dict (qwen3_next, qwen3_5[_moe] with ``text_config``,
        qwen3_5_text, qwen3_5_moe_text). Raises ValueError naming an unknown model_type or a missing field."""
        if not isinstance(config, dict):
            raise ValueError(f"HybridConfig.from_hf expects a dict (config.json), got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: unknown model_type {model_type!r}; supported: "
                             f"{sorted(SUPPORTED_MODEL_TYPES)}")
        text = config
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            if "text_config" not in config:
                raise ValueError(f"config.json: model_type {model_type!r} needs a 'text_config' field")
            text = dict(config["text_config"])
        is_moe = model_type in ("qwen3_5_moe", "qwen3_5_moe_text") or (
            model_type == "qwen3_next" and int(text.get("num_experts", 0) or 0) > 0)

        def need(name):
            if name not in text:
                raise ValueError(f"config.json ({model_type}): missing field {name!r}")
            return text[name]

        n_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"config.json: rope_parameters.rope_type {rope_type!r} is not supported "
                             f"(only default / mrope for text)")
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        hidden = int(need("hidden_size"))
        n_heads = int(need("num_attention_heads"))
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        kw = dict(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            intermediate_size=int(text.get("intermediate_size", 0) or 0),
            num_attention_heads=n_heads,
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(text.get("head_dim") or hidden // n_heads),
            partial_rotary_factor=float(prf),
            rope_theta=float(rope_theta),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            hidden_act=str(text.get("hidden_act", "silu")),
        )
        if is_moe:
            kw.update(
                num_experts=int(need("num_experts")),
                num_experts_per_tok=int(need("num_experts_per_tok")),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
                # Qwen3.5-MoE always renormalises the top-k weights
                norm_topk_prob=bool(text.get("norm_topk_prob", True)) if model_type == "qwen3_next" else True,
            )
            if model_type == "qwen3_next":  # Qwen3.5-MoE puts the sparse MoE in every layer
                kw.update(decoder_sparse_step=int(text.get("decoder_sparse_step", 1) or 1),
                          mlp_only_layers=tuple(int(i) for i in (text.get("mlp_only_layers") or ())))
        return cls(**kw)


# ----------------------------------------------------------------------------------------------------------------
# Named presets
# ----------------------------------------------------------------------------------------------------------------
def _every_fourth_attention(num_layers: int) -> tuple:
    """Qwen3-Next / Qwen3.5 layer pattern (HF ``full_attention_interval`` 4): 3 GDN layers, then one attention."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers))


#: name -> HybridConfig field values. Sources:
#:
#: * "tiny": a small random-test model for CPU (seconds to compile): 3 GDN + 1 attention layer, the sparse MoE
#:   with a shared expert in layers 0, 2, 3 and a dense SwiGLU MLP in layer 1 (``mlp_only_layers``), so every
#:   block kind runs. Head ratios follow the real models (Hv = 2 Hk, H = 2 Hkv).
#: * "qwen3_next_80b": Qwen3-Next-80B-A3B, the released ``config.json`` of Qwen/Qwen3-Next-80B-A3B-Instruct (48
#:   layers, hidden 2048; GDN 16 key / 32 value heads x 128, conv 4; attention 16 q / 2 kv heads x 256, rotary
#:   quarter of the head; 512 experts top-10, moe_intermediate 512, shared expert 512, in every layer; vocab
#:   151936; rope_theta 1e7; dense intermediate_size 5120, unused since every layer is MoE). transformers'
#:   ``Qwen3NextConfig()`` defaults carry the same dims except rope_theta 1e4 and intermediate_size 5632.
#: * "qwen3_5_35b_a3b": Qwen3.5-35B-A3B's text model, the defaults of transformers' ``Qwen3_5MoeTextConfig``
#:   (transformers 5.24; its docstring names Qwen/Qwen3.5-35B-A3B): 40 layers, hidden 2048, the same GDN and
#:   attention heads as Qwen3-Next, 256 experts top-8, moe_intermediate 512, shared expert 512, vocab 248320,
#:   rope_theta 1e4, separate GDN projections (layout "qwen3_5"); top-k weights always renormalised. The
#:   experts match the MoE benchmark's Qwen3.5-35B-A3B case (hidden 2048, 256 experts top-8, 512 / 512).
#:
#: ``load_pretrained`` reads a checkpoint's own config.json; the presets make random models and benchmarks.
PRESETS = {
    "tiny": dict(
        model_type="qwen3_next", vocab_size=1024, hidden_size=128, num_hidden_layers=4,
        layer_types=_every_fourth_attention(4), intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25, rope_theta=10000.0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=(1,), rms_norm_eps=1e-6),
    "qwen3_next_80b": dict(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        layer_types=_every_fourth_attention(48), intermediate_size=5120,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=10000000.0, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(), rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen3_5_35b_a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        layer_types=_every_fourth_attention(40), intermediate_size=0,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=10000.0, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(), rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def preset(name: str, **overrides) -> HybridConfig:
    """The HybridConfig of preset ``name`` (a key of :data:`PRESETS`) with ``overrides`` (HybridConfig fields)
    applied, validated like any HybridConfig.

    ``num_hidden_layers`` alone (without ``layer_types``) keeps the 3 GDN + 1 attention pattern at the new depth
    and drops the ``mlp_only_layers`` past it: ``preset("qwen3_next_80b", num_hidden_layers=8)`` is 6 GDN + 2
    attention layers at the real dims. Raises ValueError for an unknown name (listing the known ones) or an
    unknown field."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(HybridConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"preset({name!r}): unknown HybridConfig field(s) {unknown}")
    values = dict(PRESETS[name])
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"preset({name!r}): num_hidden_layers must be a positive int, got {n!r}")
        values["layer_types"] = _every_fourth_attention(n)
        if "mlp_only_layers" not in overrides:
            values["mlp_only_layers"] = tuple(i for i in values["mlp_only_layers"] if i < n)
    values.update(overrides)
    if isinstance(values.get("layer_types"), list):
        values["layer_types"] = tuple(values["layer_types"])
    if isinstance(values.get("mlp_only_layers"), list):
        values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
    return HybridConfig(**values)
