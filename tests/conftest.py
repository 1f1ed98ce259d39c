import os

from tests import xla_env

xla_env.apply()          # before jax makes its first client (see tests/xla_env.py)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

if jax.default_backend() == "cpu":       # -O0 on CPU only (tests/xla_env.py); subprocesses inherit it
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0")


# The longest CPU tests (seconds on a 2-core machine, `pytest --durations` at 15aa4e3 and, the first two, at 3c88e80;
# 05_training at its 200 steps, fewer in CI since): they start first, so that pytest-xdist's workers end on short
# tests instead of one of them running a notebook while the other waits (the notebooks and test_train.py come last
# in the collection). The first two are the first tests of a module-scoped fixture's group (``--dist loadgroup``,
# pyproject.toml: the sharding subprocess, the LLM engine), which then run on one worker and build it once.
LONG_FIRST = (
    "tests/model/test_sharding.py::test_sharded_logits_equal_one_device[qwen3_next/mesh2]",                 # 122 (its subprocess)
    "tests/serving/test_llm.py::test_greedy_generate_equals_the_manual_loop_and_compiles_nothing",          # 35 (the engine)
    "tests/test_notebooks.py::test_notebook_executes[05_training]",                                          # 81
    "tests/test_notebooks.py::test_notebook_executes[04_checkpoint]",                                        # 41
    "tests/test_train.py::test_remat_layers_same_gradients_less_memory_cores_run_once",                      # 37
    "tests/test_notebooks.py::test_notebook_executes[02_numerics]",                                          # 31
    "tests/test_bench.py::test_ttft_probe_traces_one_more_hit",                                               # 26
    "tests/test_train.py::test_kernel_steps_match_xla_steps_and_the_loss_falls",                             # 25
    "tests/test_serve_sim.py::test_llm_engine_with_shared_prefixes_serves_the_same_tokens_with_the_cache_on",  # 24
    "tests/test_serve_sim.py::test_short_simulation_serves_every_request_without_recompiles",                 # 21
    "tests/test_notebooks.py::test_notebook_executes[01_split_prefill]",                                     # 20
)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a GPU is (the device tool); CI on CPU skips them with a stated reason. The
    ``LONG_FIRST`` tests are moved to the front (the others keep their order)."""
    rank = {nodeid: i for i, nodeid in enumerate(LONG_FIRST)}
    # (under --dist loadgroup xdist may have suffixed a grouped test's nodeid with "@<group>" already)
    items.sort(key=lambda item: rank.get(item.nodeid.split("@")[0], len(LONG_FIRST)))
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
