"""The "xla" backend of the MoE routed experts and router (pallas_kernels/moe/reference.py) on the shared
checks."""
from tests.pallas_kernels.moe.base import MoeBackendTest


class TestXla(MoeBackendTest):
    backend = "xla"
