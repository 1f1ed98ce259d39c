"""The "xla" backend of the fused conv1d (pallas_kernels/conv1d/reference.py) on the shared checks."""
from tests.pallas_kernels.conv1d.base import Conv1dBackendTest


class TestXla(Conv1dBackendTest):
    backend = "xla"
