"""The compiled Pallas Triton conv1d kernels (backend "pallas") on the shared checks at the real head dim
(D = 128); needs a CUDA GPU."""
import pytest

from tests.pallas_kernels.conv1d.base import Conv1dBackendTest


@pytest.mark.gpu
class TestTritonGpu(Conv1dBackendTest):
    backend = "pallas"
    head_dim = 128
