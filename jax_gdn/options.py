"""How the model runs its layers: the tuning choices that change speed and memory, never the math.

``RuntimeOptions`` is frozen and hashable: ``HybridModel(config, params, options=RuntimeOptions(...))`` holds one
and passes it down to the blocks as a static value (each distinct value compiles its own programs); the layer
functions take it (or the one field they read) as an argument. The defaults are the measured choices; every field
only picks between implementations of the same computation (the tests compare them).
"""
from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["RuntimeOptions", "PHASE1_CONVS", "GDN_DECODE_STEPS", "DEFAULT_OPTIONS"]

#: ``RuntimeOptions.phase1_conv`` values (see there).
PHASE1_CONVS = ("auto", "two_step", "fused")
#: ``RuntimeOptions.gdn_decode_step`` values (see there).
GDN_DECODE_STEPS = ("auto", "unfused", "fused")
#: ``RuntimeOptions.remat`` values
REMATS = ("none", "layers")
#: the names (``jax.ad_checkpoint.checkpoint_name``) of the mixers' core outputs, which remat="layers" saves
CORE_NAMES = ("gdn_core", "attention_core")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """Implementation choices of the layers and the model runtime (defaults: the measured choices).

    GDN layer (jax_gdn.layers.gdn):
      phase1_conv: how prefill runs the conv + SiLU + q/k L2 norm of phase 1: "two_step" (``phase1_conv1d_varlen``
        then ``phase1_l2_batched``), "fused" (``phase1_conv1d_l2_varlen``, the Pallas kernel of
        pallas_kernels/conv1d where it takes the dims, else its XLA form) or "auto" (fused where that is the
        compiled Pallas kernel, i.e. on a GPU; else two_step). On the H200 at 80B dims the fused kernel takes phase
        1 from 2.63 to 2.11 ms at varlen16 (benchmarks/results/h200.json, "layers" -> "gdn" -> "other_conv", made
        by the benchmark CLI's layers section).
      gdn_decode_step: how a decode step runs: "unfused" (phase 1 as prefill runs it, then the recurrent step),
        "fused" (in_proj, the conv1d decode kernel with the L2 norm, the decode kernel making g / beta from the raw
        a, b: three launches besides the projections; where ``decode_step_backend`` finds no Pallas backend for
        the dims, unfused) or "auto" (fused on a GPU where the kernels take the dims, else unfused). Fused is the
        faster step on the H200 (N 64 streams, 80B dims, bf16: fewer launches, the same error against the fp32
        XLA step).
    Attention layer (jax_gdn.layers.attention):
      hold_fused_qkv: the model (one device, no mesh) holds each attention layer's q_proj, k_proj, v_proj as one
        qkv_proj weight, concatenated once at construction (``fuse_qkv_tree``): one GEMM per call and no
        per-call concat. Under a mesh the three weights stay (jax_gdn.sharding splits each by heads).
      qkv_concat_min_tokens: from this many tokens (static T) a layer holding three weights concatenates them
        per call and runs one GEMM (the copy pays off at prefill sizes, not at decode sizes).
      cudnn_direct: prefill on the cuDNN backends hands the new K/V straight from the projection to
        ``paged_attention_gated`` (no gather back from the pages, no context call when no stream has context);
        False: the unfused path.
      kv_write_unique: ``write_kv_pages`` scatters rows of the flat [P Ps, Hkv Dh] pool with unique indices
        (XLA may store rows directly); False: the two-index (page, offset) scatter.
      attention_decode_fused: a decode step on a Pallas decode backend with qkv_proj held runs
        ``attention_decode_fused`` (one GEMM, one page-write kernel, the gated decode kernel, o_proj); False:
        the unfused path.
    Model runtime (jax_gdn.model):
      flat_pool_limit: the largest state leaf (elements) the layers address as one flat pool over all layers;
        a kind whose pool is larger runs per layer (dynamic slice / update). The Pallas kernels address their
        operands with int32 offsets, hence 2**31 - 1.
      scan_unroll_prefill, scan_unroll_decode: the ``unroll`` of the scan over the repeats of the layer period in
        each program (True, False or an int >= 1). Decode unrolls 2 repeats per iteration: a faster decode step
        on the H200 for at most twice the loop body's compile time; prefill gains nothing from unrolling.
      remat: what the backward of a differentiated step keeps (training; serving is not differentiated and runs
        the same either way): "none" (XLA's autodiff saves every residual of every layer) or "layers" (each layer
        under ``jax.checkpoint``: the backward recomputes the layer from its input, saving only the mixers' core
        outputs, ``CORE_NAMES``: the GDN op's o and attention's o, so that neither core runs twice; the
        projections, the conv, the norms and the MoE are recomputed).
    """

    phase1_conv: str = "auto"
    gdn_decode_step: str = "auto"
    hold_fused_qkv: bool = True
    qkv_concat_min_tokens: int = 8192
    cudnn_direct: bool = True
    kv_write_unique: bool = True
    attention_decode_fused: bool = True
    flat_pool_limit: int = 2 ** 31 - 1
    scan_unroll_prefill: int | bool = 1
    scan_unroll_decode: int | bool = 2
    remat: str = "none"

    def __post_init__(self):
        if self.phase1_conv not in PHASE1_CONVS:
            raise ValueError(f"RuntimeOptions.phase1_conv must be one of {PHASE1_CONVS}, got {self.phase1_conv!r}")
        if self.remat not in REMATS:
            raise ValueError(f"RuntimeOptions.remat must be one of {REMATS}, got {self.remat!r}")
        if self.gdn_decode_step not in GDN_DECODE_STEPS:
            raise ValueError(f"RuntimeOptions.gdn_decode_step must be one of {GDN_DECODE_STEPS}, "
                             f"got {self.gdn_decode_step!r}")
        for name in ("hold_fused_qkv", "cudnn_direct", "kv_write_unique", "attention_decode_fused"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RuntimeOptions.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("qkv_concat_min_tokens", "flat_pool_limit"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"RuntimeOptions.{name} must be an int >= 0, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("scan_unroll_prefill", "scan_unroll_decode"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (_is_int(value) and value >= 1)):
                raise ValueError(f"RuntimeOptions.{name} must be True, False or an int >= 1, got {value!r}")
            if not isinstance(value, bool):
                object.__setattr__(self, name, int(value))

    def scan_unroll(self, decode: bool) -> int | bool:
        """The layer scan's ``unroll`` of the decode (True) or the prefill (False) program."""
        return self.scan_unroll_decode if decode else self.scan_unroll_prefill


#: ``RuntimeOptions()``: what a layer function uses when it is given no options.
DEFAULT_OPTIONS = RuntimeOptions()
