"""cudnn.py's packing, segment offsets and LSE merge with the XLA stand-in for the cuDNN call (backend
"cudnn_xla", any platform; its decode runs the XLA path) on the shared checks."""
from tests.pallas_kernels.paged_attention.base import PagedAttentionBackendTest


class TestCudnnXla(PagedAttentionBackendTest):
    backend = "cudnn_xla"
