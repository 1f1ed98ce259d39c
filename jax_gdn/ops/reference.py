"""Re-export of ``pallas_kernels.gated_delta_rule.reference`` (the XLA chunked form and per-token recurrence)."""
from pallas_kernels.gated_delta_rule.reference import *  # noqa: F401,F403
from pallas_kernels.gated_delta_rule.reference import __all__  # noqa: F401
