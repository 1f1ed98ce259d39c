"""The "xla" backend of paged attention (pallas_kernels/paged_attention/reference.py) on the shared checks."""
from tests.pallas_kernels.paged_attention.base import PagedAttentionBackendTest


class TestXla(PagedAttentionBackendTest):
    backend = "xla"
