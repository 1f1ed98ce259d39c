import os

import jax
import pytest

jax.config.update("jax_enable_x64", False)

# On CPU the tests run tiny shapes, so compiling dominates running: XLA's backend optimisation off (LLVM -O0, no
# expensive passes) cuts the CPU suite by about a third. Numerics are XLA's own either way (no fast math). Set in
# the environment as well, so subprocesses (the sharding check, the notebooks' kernels) run the same way. GPU runs
# keep XLA's defaults.
if jax.default_backend() == "cpu":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0")


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a GPU is (the device tool); CI on CPU skips them with a stated reason."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
