"""The Pallas Triton kernels of the gated delta rule in interpret mode (backend "pallas_interpret", any platform)
on the shared checks."""
from tests.pallas_kernels.gated_delta_rule.base import GatedDeltaRuleBackendTest


class TestPallasInterpret(GatedDeltaRuleBackendTest):
    backend = "pallas_interpret"
