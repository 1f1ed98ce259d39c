"""The compiled Pallas Triton paged attention kernels (backend "pallas") on the shared checks at a real head dim
(Dh = 128); needs a CUDA GPU."""
import pytest

from tests.pallas_kernels.paged_attention.base import PagedAttentionBackendTest


@pytest.mark.gpu
class TestTritonGpu(PagedAttentionBackendTest):
    backend = "pallas"
    head_dim = 128
    matmul_precision = "highest"
