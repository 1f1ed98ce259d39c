"""Frozen dimension dataclasses: the one place where layer shapes are defined.

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
