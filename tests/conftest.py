import os

from tests import xla_env

xla_env.apply()          # before jax makes its first client (see tests/xla_env.py)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

if jax.default_backend() == "cpu":       # -O0 on CPU only (tests/xla_env.py); subprocesses inherit it
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0")


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a GPU is (the device tool); CI on CPU skips them with a stated reason."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
