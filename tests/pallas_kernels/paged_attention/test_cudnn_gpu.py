"""cuDNN's packed fused attention for the prefill (backend "cudnn": bfloat16 on a Hopper GPU; its decode runs the
Pallas decode kernel) on the shared checks at a real head dim (Dh = 128)."""
import jax.numpy as jnp
import pytest

from tests.pallas_kernels.paged_attention.base import PagedAttentionBackendTest


@pytest.mark.gpu
class TestCudnnGpu(PagedAttentionBackendTest):
    backend = "cudnn"
    dtypes = (jnp.dtype(jnp.bfloat16),)
    head_dim = 128
    matmul_precision = "highest"
