"""The compiled Pallas Triton kernels of the gated delta rule (backend "pallas") on the shared checks, at the
real head dims (K = V = 128); needs a CUDA GPU."""
import pytest

from tests.pallas_kernels.gated_delta_rule.base import GatedDeltaRuleBackendTest


@pytest.mark.gpu
class TestTritonGpu(GatedDeltaRuleBackendTest):
    backend = "pallas"
    head_k_dim = head_v_dim = 128
    matmul_precision = "highest"
