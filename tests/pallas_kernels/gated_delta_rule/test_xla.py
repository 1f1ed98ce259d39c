"""The "xla" backend of the gated delta rule (pallas_kernels/gated_delta_rule/reference.py) on the shared checks."""
from tests.pallas_kernels.gated_delta_rule.base import GatedDeltaRuleBackendTest


class TestXla(GatedDeltaRuleBackendTest):
    backend = "xla"
