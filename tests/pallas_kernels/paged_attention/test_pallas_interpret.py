"""The Pallas Triton paged attention kernels (triton.py) in interpret mode on the shared checks."""
from tests.pallas_kernels.paged_attention.base import PagedAttentionBackendTest


class TestPallasInterpret(PagedAttentionBackendTest):
    backend = "pallas_interpret"
