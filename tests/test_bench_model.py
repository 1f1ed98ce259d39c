"""The floors of the whole-model section (benchmarks.floors): the README's part / floor and row floor columns are
these numbers, so the formulas are checked at 80B dims against hand counts and the other sections' conventions."""
from __future__ import annotations

import pytest

from benchmarks.cases import VARLEN16_LENS, model_cases
from benchmarks.configs import qwen3_next_80b_config
from benchmarks.floors import decode_floors, prefill_floors, row_floor, row_floors
from benchmarks.tables import PEAK_TBPS, PEAK_TFLOPS


def test_prefill_floors_at_80b_dims():
    from benchmarks.moe import CASES
    cfg = qwen3_next_80b_config(8)
    t = sum(VARLEN16_LENS)
    f = prefill_floors(cfg, VARLEN16_LENS)
    # in_proj_qkvz (2048 -> 2 * 2048 + 2 * 4096) + in_proj_ba (2048 -> 64), bf16 matmul at 700 TFLOP/s
    assert f["gdn_phase1"]["ms"] == pytest.approx(2 * t * 2048 * 12352 / (PEAK_TFLOPS * 1e9))
    assert f["gdn_phase3"]["ms"] == pytest.approx(2 * t * 4096 * 2048 / (PEAK_TFLOPS * 1e9))
    moe = next(c for c in CASES if c.tokens == t and c.experts == 512)                  # the moe section's floor
    assert f["moe"]["ms"] == pytest.approx(moe.flops() / (PEAK_TFLOPS * 1e9))
    assert f["embed_logits"]["roofline"]["bound"] == "bytes"                           # lm_head 151936 x 2048
    assert "no kernel bench row" in f["gdn_phase2"]["basis"] and "no attention bench row" in f["attention"]["basis"]
    core = 4 * 16 * 256 * sum(n * (n + 1) / 2 for n in VARLEN16_LENS) / (PEAK_TFLOPS * 1e9)
    assert f["attention"]["ms"] > core

    # with the other sections' rows: the GDN core's floor is the kernel bench's fastest column for this exact
    # case, the attention core's the attention bench's torch SDPA; a row of other lengths is not used
    peers = {"rows": [{"case": "other", "lens": [5, 6], "Hk": 16, "Hv": 32, "K": 128, "V": 128, "ms": {"fla": 0.1}},
                      {"case": "varlen16", "lens": list(VARLEN16_LENS), "Hk": 16, "Hv": 32, "K": 128, "V": 128,
                       "ms": {"pallas": 0.98, "fla": 1.08, "xla": 15.0, "jla": None}}],
             "attention": {"rows": [{"case": "prefill-varlen16", "kind": "prefill", "lens": list(VARLEN16_LENS),
                                     "context": 0, "gflop": core * PEAK_TFLOPS, "ms": {"torch_sdpa": 1.85}}]}}
    g = prefill_floors(cfg, VARLEN16_LENS, peers=peers)
    assert g["gdn_phase2"]["ms"] == 0.98 and "pallas" in g["gdn_phase2"]["basis"]
    assert g["attention"]["ms"] == pytest.approx(f["attention"]["ms"] - core + 1.85)
    assert g["gdn_phase1"] == f["gdn_phase1"]


def test_decode_floors_at_80b_dims():
    cfg = qwen3_next_80b_config(8)
    f = decode_floors(cfg, 64, 1189)
    assert all(v["roofline"]["bound"] == "bytes" for v in f.values()), f
    gb = lambda v: v["ms"] * PEAK_TBPS * 1e9                                              # noqa: E731
    state = 64 * 32 * 128 * 128 * 4 * 2                                                 # fp32 states read + written
    assert gb(f["gdn_decode"]) == pytest.approx(state + 2 * (2048 * 12352 + 8192 * 4 + 4096 * 2048 + 2 * 64 * 2048)
                                                + 2 * 2 * 64 * 8192 * 3)
    assert gb(f["attention_decode"]) > 64 * 1190 * 2 * 256 * 2 * 2                     # K and V of the context
    touched = 512 * (1 - (1 - 10 / 512) ** 64)                                          # ~367 of 512 experts
    assert 360 < touched < 370 and gb(f["moe"]) > touched * 3 * 2048 * 512 * 2
    assert gb(decode_floors(cfg, 1, 1189)["moe"]) < gb(f["moe"]) / 20                  # 1 stream: 10 experts
    assert gb(f["embed_logits"]) > 151936 * 2048 * 2


def test_row_floor_of_the_32k_stream_term_by_term():
    """row_floor at 80B dims, 8 layers, one fresh 32768-token stream, every term by hand: GDN layers x (in_proj +
    ba at 700 TFLOP/s, the kernel bench's B1-T32768 row matched by B and T, out_proj), attention layers x
    (projections + the attention bench's 32k torch SDPA; roofline: its 4 H Dh L (L + 1) / 2 FLOPs), MoE layers x
    the moe section's FLOPs with all 32768 tokens, embed_logits once; HF / floor is the best speed-up over HF any
    implementation could reach at those floors. The varlen16 row's floor uses the same formulas."""
    cfg = qwen3_next_80b_config(8)
    L = 32768
    tf = PEAK_TFLOPS * 1e9
    core = 4 * 16 * 256 * L * (L + 1) / 2
    peers = {"rows": [{"case": "B1-T32768-Hk16-Hv32", "B": 1, "T": L, "Hk": 16, "Hv": 32, "K": 128, "V": 128,
                       "ms": {"pallas": 1.63, "fla": 1.93, "jla": 1.08}}],
             "attention": {"rows": [{"case": "prefill-32k", "kind": "prefill", "context": 0, "lens": [L],
                                     "gflop": core / 1e9, "ms": {"torch_sdpa": 27.4, "cudnn": 14.0}}]}}
    r = row_floor(cfg, "prefill", ("B1-T32768", (L,)), 2, peers, hf_ms=224.6, ours_ms=154.4)
    p1 = 2 * L * 2048 * (2 * 2048 + 2 * 4096 + 2 * 32) / tf
    p3 = 2 * L * 4096 * 2048 / tf
    proj = (2 * L * 2048 * (2 * 16 * 256 + 2 * 2 * 256) + 2 * L * 16 * 256 * 2048) / tf
    moe = 2 * L * (2048 * 512 + 10 * 3 * 2048 * 512 + 3 * 2048 * 512 + 2048) / tf
    t = r["terms"]
    assert {k: v["count"] for k, v in t.items()} == {"gdn_phase1": 6, "gdn_phase2": 6, "gdn_phase3": 6,
                                                     "attention": 2, "moe": 8, "embed_logits": 1}
    assert t["gdn_phase1"]["floor_ms"] == pytest.approx(p1) and t["gdn_phase3"]["floor_ms"] == pytest.approx(p3)
    assert t["gdn_phase2"]["floor_ms"] == 1.08 and "jla" in t["gdn_phase2"]["basis"]
    assert t["attention"]["floor_ms"] == pytest.approx(proj + 27.4)
    assert t["attention"]["roofline_ms"] == pytest.approx(proj + core / tf, rel=1e-6)
    assert t["moe"]["floor_ms"] == pytest.approx(moe)
    total = 6 * (p1 + 1.08 + p3) + 2 * (proj + 27.4) + 8 * moe + t["embed_logits"]["floor_ms"]
    assert r["row_floor_ms"] == pytest.approx(total) and 105 < total < 120
    assert r["hf_over_floor"] == pytest.approx(224.6 / total) and not r["target_3x_within_floor"]
    assert r["row_floor_roofline_ms"] < r["row_floor_ms"] and r["hf_over_roofline"] < 3     # even at the roofline
    flop = sum(x["flop"] for x in r["terms"].values())
    assert r["row_floor_hw_peak_ms"] == pytest.approx(flop / 989e9 + t["embed_logits"]["ms"]      # lm_head: bytes
                                                      - t["embed_logits"]["flop"] / 989e9, rel=1e-6)
    assert r["hf_over_hw_peak"] > 3                                     # the hardware's own bound is below HF / 3
    assert r["ours_over_floor"] == pytest.approx(154.4 / total)
    # the three rows together; the varlen16 row's attention core (no bench row here) at its FLOPs
    rows = [{"case": "varlen16-T19027", "ms": {"hf": 417.4, "ours": 61.2}}]
    v, lg, d = row_floors(cfg, model_cases(False), rows, peers)
    assert (v["case"], lg["case"], d["case"], d["kind"]) == ("varlen16-T19027", "B1-T32768", "decode-N64-ctx1189",
                                                             "decode")
    assert v["hf_over_floor"] == pytest.approx(417.4 / v["row_floor_ms"]) and lg.get("hf_ms") is None
    t = sum(VARLEN16_LENS)
    assert v["terms"]["gdn_phase1"]["floor_ms"] == pytest.approx(2 * t * 2048 * 12352 / tf)
    assert set(d["terms"]) == {"gdn_decode", "attention_decode", "moe", "embed_logits"}
    assert d["row_floor_ms"] == pytest.approx(sum(x["count"] * x["floor_ms"] for x in d["terms"].values()))


def test_hf_children_run_fla_triton_or_flash_qla_and_say_which():
    """The HF column's child runs FLA's Triton path; the hf_qla child FLA's default path with the FlashQLA stack
    first on its own PYTHONPATH, refused naming QLA_SITE when that is unset; an hf_qla child in which FlashQLA
    never loaded gives errors, not figures under its name."""
    from benchmarks import model as bm
    env = bm.hf_child_env(False, {"PYTHONPATH": "/a", "FLA_FLASH_QLA": "1"})
    assert env["FLA_FLASH_QLA"] == "0" and env["PYTHONPATH"] == "/a"
    env = bm.hf_child_env(True, {"PYTHONPATH": "/a", "QLA_SITE": "/qla"})
    assert env["FLA_FLASH_QLA"] == "1" and env["PYTHONPATH"].split(":") == ["/qla", "/a"]
    assert bm.hf_child_env(True, {"QLA_SITE": "/qla"})["PYTHONPATH"] == "/qla"
    with pytest.raises(ValueError, match="QLA_SITE"):
        bm.hf_child_env(True, {"PYTHONPATH": "/a"})
    ran = {"info": {"flash_qla_ran": True}, "varlen": {"ms": 100.0}}
    assert bm.checked_flash_qla(ran) == ran
    fell_back = bm.checked_flash_qla({"info": {"flash_qla_ran": False}, "varlen": {"ms": 100.0},
                                      "long": {"ms": 9.0}})
    assert fell_back["info"] == {"flash_qla_ran": False}
    assert set(fell_back["varlen"]) == {"error"} and "Triton" in fell_back["long"]["error"]


def test_rows_carry_the_flash_qla_column_beside_hf():
    from benchmarks import model as bm
    cases = model_cases(quick=False)
    ours = {"varlen": {"ms": 50.0}, "long": {"ms": 80.0}, "decode": {"ms": 7.0}}
    hf = {"varlen": {"ms": 400.0}, "long": {"ms": 600.0}, "decode": {"ms": 60.0}}
    rows = bm._rows(cases, ours, hf)
    assert all("hf_qla" not in r["ms"] for r in rows)
    rows = bm._rows(cases, ours, hf, {"varlen": {"ms": 350.0}, "long": {"error": "cut"}})
    by = {r["kind"] + r["case"]: r for r in rows}
    v = next(r for r in rows if r["case"] == cases["varlen"][0])
    assert v["ms"]["hf_qla"] == 350.0 and v["speedup_qla"] == pytest.approx(7.0) and v["speedup"] == 8.0
    assert v["tokens_per_s"]["hf_qla"] == pytest.approx(v["tokens"] / 0.35)
    long_row = next(r for r in rows if r["case"] == cases["long"][0])
    assert long_row["ms"]["hf_qla"] is None and long_row["errors"]["hf_qla"] == "cut"
    assert long_row["speedup_qla"] is None and len(by) == 3
    table = bm.markdown({"layers": 8, "rows": rows})
    assert "HF ms (FlashQLA)" in table[0] and "| 350.0 | 7.00x |" in table[2]


def test_model_dims_name_their_preset_and_depth():
    from benchmarks import model
    from benchmarks.configs import MODEL_DIMS, model_config
    assert set(model.DIMS) == set(MODEL_DIMS)
    assert model.SECTION_DIMS == {"model": "qwen3_next_80b", "model_35b": "qwen3_5_35b_a3b"}
    cfg = model_config("qwen3_5_35b_a3b")
    assert (cfg.num_hidden_layers, len(cfg.gdn_layers), cfg.gdn_dims.layout, cfg.num_experts) == (40, 30, "qwen3_5",
                                                                                                  256)
    with pytest.raises(ValueError, match="dims must be one of"):
        model_config("qwen3_next")
    with pytest.raises(ValueError, match="dims must be one of"):
        model.run_section(True, dims="qwen3_next")


@pytest.mark.parametrize("dims,order", [("qwen3_next_80b", ["build", "hf"]), ("qwen3_5_35b_a3b", ["hf", "build"])])
def test_the_hf_child_runs_first_where_the_two_models_do_not_fit_together(monkeypatch, dims, order):
    """At 35B dims HF's child runs (and exits) before our model is built, and is told the dims; at 80B after our
    rows. The model build is stubbed to fail at once: the order is what is checked."""
    import jax_gdn.checkpoint
    from benchmarks import model
    seen = []

    def fake_hf(reps, timeout, quick=False, flash_qla=False, dims="qwen3_next_80b"):
        seen.append("hf")
        assert dims == want and not flash_qla
        return {"info": {"fake": True}}

    def fake_build(*args, **kwargs):
        seen.append("build")
        raise RuntimeError("no model in this test")
    want = dims
    monkeypatch.setattr(model, "_hf_in_subprocess", fake_hf)
    monkeypatch.setattr(jax_gdn.checkpoint, "random_model", fake_build)
    s = model.run_section(True, dims=dims, hf=True, compile_layers=0, hf_qla=False)
    assert seen == order and s["dims"] == dims and s["hf"] == {"fake": True}
    assert any("no model in this test" in e for e in s["errors"])
    assert s["layers"] == 8 and s["config"]["experts"] == 8                           # the quick stand-in


def test_leafwise_random_weights_have_init_params_layout():
    """The leafwise init (one program per leaf, for models of half the GPU) makes the same tree, shapes and dtypes
    as ``init_params`` and each leaf kind's values: norms at their neutral value, weights of std 0.02."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from benchmarks.configs import check_config, random_device_model
    from jax_gdn.model import HybridModel, init_params
    cfg = check_config(True, "qwen3_5_35b_a3b")                     # 1 GDN + 1 attention layer, tiny dims
    one = HybridModel(cfg, jax.eval_shape(functools.partial(init_params, cfg, dtype=jnp.bfloat16),
                                          jax.random.PRNGKey(0)), dtype=jnp.bfloat16).params   # the model's layout
    each = random_device_model(cfg, leafwise=True).params
    assert jax.tree.structure(one) == jax.tree.structure(each)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), one) == jax.tree.map(lambda x: (x.shape, x.dtype), each)
    flat = {jax.tree_util.keystr(p): np.asarray(x.astype(jnp.float32))
            for p, x in jax.tree_util.tree_flatten_with_path(each)[0]}
    assert all((v == 0).all() for k, v in flat.items() if k.endswith("_norm']"))
    assert all((v == 1).all() for k, v in flat.items() if k.endswith("['norm']"))
    w = flat["['period'][0]['mixer']['in_proj_qkv']"]
    assert 0.018 < w.std() < 0.022
