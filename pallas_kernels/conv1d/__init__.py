"""Causal depthwise conv1d of the Gated DeltaNet layer: the varlen XLA reference (reference.py, also
jax_gdn.ops.conv1d's), and conv + SiLU + q/k L2 norm fused in one Pallas Triton kernel (triton.py: prefill, varlen;
decode.py: one token per stream, conv states advanced in place) behind api.py."""
from pallas_kernels.conv1d.api import (BACKENDS, causal_conv1d_l2_decode, causal_conv1d_l2_varlen,  # noqa: F401
                                       supports)
from pallas_kernels.conv1d.reference import (causal_conv1d_varlen, conv1d_l2_varlen,  # noqa: F401
                                             qkvz_block_cols)
