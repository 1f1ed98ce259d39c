"""Smoke tests of the model demo (through ``--model DIR``) and of the layer benchmark's ``--small`` CPU mode."""
from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np

from benchmarks.layers import bench_layers
from jax_gdn.checkpoint import random_state_dict
from jax_gdn.config import preset
from jax_gdn.model_demo import run_model_demo


def test_model_demo_loads_a_checkpoint_dir_and_generates(tmp_path):
    from safetensors.numpy import save_file
    # the tiny preset cut to one GDN + one attention layer (fewer compiled ops)
    cfg = preset("tiny", num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), mlp_only_layers=(0,))
    save_file(random_state_dict(cfg, seed=3), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    res = run_model_demo({"model": str(tmp_path), "lens": "1,5,17", "decode_steps": 3, "dtype": "float32",
                          "backend": "xla"}, verbose=False)
    assert res["streams"] == 3 and res["prompt_tokens"] == 23 and res["finite"]
    assert [len(g) for g in res["generated"]] == [3, 3, 3]
    assert all(0 <= tok < cfg.vocab_size for g in res["generated"] for tok in g)
    for key in ("prefill_s", "prefill_tok_s", "decode_step_s", "decode_tok_s"):
        assert math.isfinite(res[key]) and res[key] > 0, key


def test_bench_layers_small_runs_on_cpu():
    res = bench_layers("xla", reps=1, small=True, dtype=jnp.float32)
    assert res["T"] == sum(res["lens"]) and res["N"] == len(res["lens"])
    g = res["gdn"]
    for key in ("phase1_ms", "phase2_ms", "phase3_ms", "layer_ms", "tokens_per_s"):
        assert math.isfinite(g[key]) and g[key] > 0, key
    np.testing.assert_allclose(sum(g["share"].values()), 1.0, rtol=1e-6)
    assert res["attention"]["ms"] > 0 and res["attention"]["tokens_per_s"] > 0
