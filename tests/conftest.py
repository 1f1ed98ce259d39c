import jax
import pytest

jax.config.update("jax_enable_x64", False)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a GPU is (the device tool); CI on CPU skips them with a stated reason."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
