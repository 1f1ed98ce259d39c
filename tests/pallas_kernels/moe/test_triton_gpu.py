"""The compiled Pallas Triton MoE kernels (backend "pallas") on the shared checks, D = 256 and I = 128 (multiples
of 16, several tiles); needs a CUDA GPU."""
import pytest

from tests.pallas_kernels.moe.base import MoeBackendTest


@pytest.mark.gpu
class TestTritonGpu(MoeBackendTest):
    backend = "pallas"
    hidden = 256
    inter = 128
