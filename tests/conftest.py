import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_enable_x64", False)

# One compilation cache per test run, shared by the xdist workers (set by the first process that loads this file,
# the controller, before it starts them): a program compiled by several tests compiles once. Keyed by the
# program, its options and the devices, so it never hands one test another's program. The sharding check's
# subprocess inherits it too. A cache directory named in the environment is used as it is.
_OWN_CACHE = None                      # the directory this process made (removed when the run ends)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-gdn-tests-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a GPU is (the device tool); CI on CPU skips them with a stated reason."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
