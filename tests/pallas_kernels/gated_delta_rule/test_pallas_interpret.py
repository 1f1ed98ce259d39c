"""The Pallas Triton kernels of the gated delta rule in interpret mode (backend "pallas_interpret", any platform)
on the shared checks. Gradients: the kernels' backward is the XLA form's VJP (tested on the whole matrix by
test_xla.py), so here one dense case through the in-op L2 norm and the short varlen case check the wiring."""
from tests.pallas_kernels.gated_delta_rule.base import GatedDeltaRuleBackendTest


class TestPallasInterpret(GatedDeltaRuleBackendTest):
    backend = "pallas_interpret"
    grad_dense_cases = ("b2-t64-h1-hv2-l2norm",)
    grad_varlen_cases = ("fla-0-15",)
