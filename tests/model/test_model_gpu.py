"""GPU-only checks of the whole model (run on the device machine with ``pytest -m gpu``; skipped on CPU):
the Pallas GDN path inside the jitted model against the XLA path, and the layer benchmark at small dims."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.bench_layers import bench_layers
from jax_gdn.checkpoint import random_model
from jax_gdn.model_demo import tiny_config


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 2e-2)])
def test_model_pallas_matches_xla_on_gpu(dtype, tol):
    cfg = tiny_config()
    lens, slots = [1, 63, 130, 257], np.array([2, 0, 3, 1], np.int32)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu = np.cumsum([0] + lens).astype(np.int32)
    out = {}
    with jax.default_matmul_precision("highest"):      # GPUs default to TF32 matmuls
        _run_both(cfg, dtype, ids, cu, slots, out)
    for a, b in zip(out["auto"], out["xla"]):
        assert np.all(np.isfinite(a))
        assert np.max(np.abs(a - b)) / np.max(np.abs(b)) <= tol


def _run_both(cfg, dtype, ids, cu, slots, out):
    for backend in ("xla", "auto"):       # auto: the Pallas kernel where it accepts the dims
        model = random_model(cfg, seed=0, dtype=dtype, backend=backend)
        cache = model.init_cache(max_seqs=4, max_tokens=1024, page_size=16)
        logits, cache = model.prefill(cache, ids, cu, slots, return_all_logits=True)
        dec, cache = model.decode(cache, ids[:len(slots)], slots)         # the same tokens for both backends
        out[backend] = (np.asarray(logits), np.asarray(dec))


@pytest.mark.gpu
def test_bench_layers_small_pallas_on_gpu():
    res = bench_layers("pallas", reps=2, small=True)
    assert res["gdn"]["tokens_per_s"] > 0 and res["attention"]["tokens_per_s"] > 0
