"""Re-export of ``pallas_kernels.gated_delta_rule.validation`` (argument checks shared by the ops, layers and
model: shapes and dtypes always, values when concrete, ``checkify_*`` under jit)."""
from pallas_kernels.gated_delta_rule.validation import *  # noqa: F401,F403
from pallas_kernels.gated_delta_rule.validation import __all__, concrete_value, is_concrete  # noqa: F401
