"""Smoke tests of the model demo (through ``--model DIR``)."""
from __future__ import annotations

import dataclasses
import json
import math

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


