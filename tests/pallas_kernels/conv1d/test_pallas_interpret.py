"""The Pallas Triton conv1d kernels (triton.py: prefill, decode.py: decode) in interpret mode on the shared
checks."""
from tests.pallas_kernels.conv1d.base import Conv1dBackendTest


class TestPallasInterpret(Conv1dBackendTest):
    backend = "pallas_interpret"
