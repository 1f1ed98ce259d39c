"""The benchmark tool's JSON handling on CPU (no timing is asserted: speed is measured on the GPU only)."""
import json
import shutil
from pathlib import Path

from jax_gdn import bench

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200.json"


def test_layers_only_merges_into_existing_results(tmp_path):
    out = tmp_path / "h200.json"
    shutil.copy(RESULTS, out)
    before = json.loads(out.read_text())
    assert bench.main(["--layers-only", "--layers-small", "--layer-backends", "xla", "--out", str(out)]) == 0
    after = json.loads(out.read_text())
    assert after["rows"] == before["rows"]                      # the kernel rows are kept as measured
    (entry,) = after["layers"]
    assert entry["backend"] == "xla" and entry["T"] == sum(entry["lens"])
    shares = entry["gdn"]["share"]
    assert abs(sum(shares.values()) - 1.0) < 1e-6
    assert entry["gdn"]["tokens_per_s"] > 0 and entry["attention"]["tokens_per_s"] > 0


def test_committed_results_have_every_case_and_anchor():
    from jax_gdn.cases import BENCH_CASES
    data = json.loads(RESULTS.read_text())
    assert [r["case"] for r in data["rows"]] == [c.name for c in BENCH_CASES]
    for r in data["rows"]:
        assert set(r["ms"]) == set(bench.IMPLS)
        assert r["ms"]["pallas"] is not None and r["ms"]["fla"] is not None


def test_results_file_is_named_from_the_device_kind():
    assert bench.device_file_name("NVIDIA H200") == "h200"
    assert bench.device_file_name("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert bench.device_file_name("cpu") == "cpu"


def test_a_failing_section_is_reported_and_the_others_still_run(monkeypatch, capsys):
    import types
    good = types.SimpleNamespace(run_section=lambda quick: {"rows": [{"case": "x"}]}, print_section=lambda s: None)

    def broken(quick):
        raise RuntimeError("no GPU here")
    bad = types.SimpleNamespace(run_section=broken, print_section=lambda s: None)
    modules = {"jax_gdn.bench_fake_good": good, "jax_gdn.bench_fake_bad": bad}
    monkeypatch.setattr(bench, "SECTIONS", {"bad": "jax_gdn.bench_fake_bad", "good": "jax_gdn.bench_fake_good"})
    monkeypatch.setattr("importlib.import_module", lambda name: modules[name])
    result = {}
    errors = bench.run_sections(result, ["bad", "good"], quick=True)
    assert result == {"good": {"rows": [{"case": "x"}]}}
    assert len(errors) == 1 and "section bad: RuntimeError: no GPU here" in errors[0]


def test_markdown_tables_cover_every_section_of_the_committed_results():
    data = json.loads(RESULTS.read_text())
    text = bench.markdown_tables(data)
    for heading in ("| case | pallas Triton (ours) | Mosaic GPU (ours)", "| backend | phase 1", "| MoE layer", "| attention |",
                    "| GDN decode step", "| model ("):
        assert heading in text, heading
    # one table row per measured row of each part
    for row in data["rows"]:
        assert f"\n| {row['case']} |" in text, row["case"]
    for row in data["moe"]["rows"]:
        assert f"| {row['case']} | {row['tokens']} |" in text


def test_kernel_rows_ratio_the_faster_of_our_backends(capsys):
    """The ratio columns divide the faster of pallas and mosaic_gpu ("ours") by the peer's time; a row where Mosaic
    did not run (null) uses pallas alone, and a row where neither ran prints '-'."""
    rows = [{"case": "dense", "ms": {"pallas": 0.44, "mosaic_gpu": 0.31, "xla": 9.0, "fla": 0.62, "jla": 0.31}},
            {"case": "varlen", "ms": {"pallas": 0.9, "mosaic_gpu": None, "xla": 9.0, "fla": 1.0, "jla": None}},
            {"case": "none", "ms": {"pallas": None, "mosaic_gpu": None, "xla": 9.0, "fla": 1.0, "jla": 1.0}}]
    text = bench.markdown_tables({"rows": rows})
    assert "| dense | 0.440 | 0.310 | 9.000 | 0.620 | 0.310 | 0.50 | 1.00 |" in text
    assert "| varlen | 0.900 | - | 9.000 | 1.000 | - | 0.90 | - |" in text
    assert "| none | - | - | 9.000 | 1.000 | 1.000 | - | - |" in text
    bench.print_table({"device": "x", "jax": "y", "date": "z", "rows": rows})
    assert "ours/jla" in capsys.readouterr().out
