"""The Pallas Triton MoE kernels (triton.py: grouped GEMMs, routing_triton.py: the router) in interpret mode on
the shared checks."""
from tests.pallas_kernels.moe.base import MoeBackendTest


class TestPallasInterpret(MoeBackendTest):
    backend = "pallas_interpret"
