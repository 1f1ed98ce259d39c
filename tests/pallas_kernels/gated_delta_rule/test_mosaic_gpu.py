"""The Mosaic GPU kernels of the gated delta rule (backend "mosaic_gpu", a Hopper GPU) on the shared checks, at
the real head dims (K = V = 128) and the one input dtype they take here (bfloat16; fp32 inputs and head dims outside
(64, 128) run Triton)."""
import jax.numpy as jnp
import pytest

from tests.pallas_kernels.gated_delta_rule.base import GatedDeltaRuleBackendTest


@pytest.mark.gpu
class TestMosaicGpu(GatedDeltaRuleBackendTest):
    backend = "mosaic_gpu"
    dtypes = (jnp.dtype(jnp.bfloat16),)
    head_k_dim = head_v_dim = 128
    padded_head_dims = None
    matmul_precision = "highest"
