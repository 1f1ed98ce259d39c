"""The whole-model benchmark section (jax_gdn.bench_model) in its quick mode on CPU: tiny dims, HF skipped; the
rows, parts and the 48-layer compile measurement come out complete and consistent. Not a measurement."""
from __future__ import annotations

import json
import math

import pytest

from jax_gdn.bench_model import print_section, qwen3_next_80b_config, run_section


def test_80b_config_is_hf_qwen3_next_defaults():
    transformers = pytest.importorskip("transformers")
    from jax_gdn.config import HybridConfig
    ours = qwen3_next_80b_config(8)
    hf = transformers.Qwen3NextConfig(num_hidden_layers=8, layer_types=list(ours.layer_types))
    assert HybridConfig.from_hf(hf.to_dict()) == ours
    assert ours.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.shared_expert_intermediate_size) == (512, 10, 512)


def test_quick_section_runs_on_cpu(capsys):
    sec = run_section(quick=True, reps=1)
    assert sec["errors"] == [], sec["errors"]
    assert sec["layers"] == 8 and sec["quick"]
    json.dumps(sec)                                                       # the JSON key "model" is serialisable

    rows = {r["case"]: r for r in sec["rows"]}
    assert [r["kind"] for r in sec["rows"]] == ["prefill", "prefill", "decode"]
    assert rows["varlen4-T107"]["tokens"] == 107 and rows["B1-T200"]["tokens"] == 200
    assert rows["decode-N8-ctx26"]["tokens"] == 8
    for r in sec["rows"]:
        ms = r["ms"]["ours"]
        assert ms is not None and math.isfinite(ms) and ms > 0, r
        assert r["ms"]["hf"] is None and r["speedup"] is None              # quick: no HF
        assert r["tokens_per_s"]["ours"] == pytest.approx(r["tokens"] / ms * 1e3)
        assert r["first_call_s"] > 0
    # 2 prefill buckets + 1 decode + release programs; the decode context reuses the varlen program's bucket
    assert sec["compiled_programs"] <= 7

    p = sec["parts_ms"]
    assert p["layers"] == {"gdn": 6, "attention": 2, "moe": 8}
    for k in ("gdn_phase1", "gdn_phase2", "gdn_phase3", "attention", "moe", "embed_logits"):
        assert p[k] is not None and p[k] > 0, (k, p.get("errors"))
    assert p["padded_tokens"] >= p["tokens"] == 107
    assert p["model_sum"] == pytest.approx(sum(p["model_sum_split"].values()))
    assert p["model_sum_split"]["gdn"] == pytest.approx(6 * (p["gdn_phase1"] + p["gdn_phase2"] + p["gdn_phase3"]))
    assert p["other"] == pytest.approx(p["model"] - p["model_sum"])

    c = sec["compile"]
    assert c["layers"] == 48 and c["s"] > 0 and c["s"] == pytest.approx(c["lower_s"] + c["compile_s"])
    assert sec["compile_s_48_layers"] is None                             # only the real 80B config fills it

    print_section(sec)
    out = capsys.readouterr().out
    assert "varlen4-T107" in out and "decode-N8-ctx26" in out and "compile of the 48-layer" in out
