"""The benchmark CLI's own logic on CPU: names refused before anything runs, the results JSON merged (never a section
dropped that was not re-measured) and stamped, the README's tables from the committed results. No timing is
asserted: speed is measured on the GPU only."""
import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import __main__ as cli
from benchmarks import gdn, results, sharding
from benchmarks.cases import BENCH_CASES
from benchmarks.report import markdown_tables

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H200 = RESULTS / "h200.json"


@pytest.fixture
def stored(tmp_path):
    """A copy of the committed H200 results and its content."""
    out = tmp_path / "h200.json"
    shutil.copy(H200, out)
    return out, json.loads(out.read_text())


@pytest.mark.parametrize("argv, says", [
    (["gdn", "--cases", "no-such-case"], "unknown case(s) no-such-case; known: gdn: B1-T8192-Hk16-Hv32"),
    (["decode", "moe", "--cases", "decode-N64-Hk16-Hv32,nope"], "unknown case(s) nope"),
    (["no-such-section"], "unknown section(s) no-such-section; known: gdn, backward, decode"),
    ([], "name a section"),
    (["model", "--cases", "x"], "none of model has named cases"),
    (["gdn", "--impls", "pallas,cuda"], "--impls: unknown gdn column(s) cuda"),
    (["backward", "--impls", "pallas"], "--impls: unknown backward column(s) pallas"),
    (["gdn", "backward", "--impls", "fla"], "--impls applies to one section, gdn or backward"),
    (["moe", "--impls", "fla"], "--impls applies to one section, gdn or backward"),
    (["sharding", "decode"], "run it on its own"),
    (["model", "--budget", "0"], "--budget must be > 0"),
])
def test_unknown_names_are_refused_before_anything_runs(stored, capsys, monkeypatch, argv, says):
    out, before = stored
    monkeypatch.setattr(cli, "_run_one", lambda *a: pytest.fail("a section ran"))
    with pytest.raises(SystemExit) as err:
        cli.main(argv + ["--out", str(out)])
    assert err.value.code == 2
    assert says in capsys.readouterr().err
    assert json.loads(out.read_text()) == before


def test_sharding_refuses_with_fewer_than_two_devices(capsys, tmp_path):
    import jax
    if len(jax.devices()) >= 2:
        pytest.skip("this process has 2 devices")
    assert cli.main(["sharding", "--quick", "--out", str(tmp_path / "x2.json")]) == 2
    assert "sharding needs 2 devices" in capsys.readouterr().err
    assert not (tmp_path / "x2.json").exists()


def test_quick_run_merges_its_section_and_keeps_the_others(stored):
    """A --quick CPU smoke of the CLI: the moe section re-measured (tiny dims) replaces only "moe" and its stamp;
    every other key of the file is kept as it was."""
    out, before = stored
    assert cli.main(["moe", "--quick", "--out", str(out), "--commit", "abc1234"]) == 0
    after = json.loads(out.read_text())
    assert {k: v for k, v in after.items() if k not in ("moe", "runs", "date", "jax", "device")} == \
        {k: v for k, v in before.items() if k not in ("moe", "runs", "date", "jax", "device")}
    assert [r["case"] for r in after["moe"]["rows"]] == ["tiny_t65", "tiny_decode_t4"]
    stamp = after["runs"]["moe"]
    assert stamp["commit"] == "abc1234" and stamp["date"] == after["date"]
    assert stamp["command"] == f"python -m benchmarks moe --quick --out {out} --commit abc1234"
    assert {k: v for k, v in after["runs"].items() if k != "moe"} == \
        {k: v for k, v in before["runs"].items() if k != "moe"}


def test_a_failing_section_keeps_what_was_stored_and_the_run_exits_1(stored, monkeypatch, capsys):
    out, before = stored

    def run_one(name, *a):
        if name == "decode":
            raise RuntimeError("no GPU here")
        return {"moe": {"rows": [{"case": "x"}]}}
    monkeypatch.setattr(cli, "_run_one", run_one)
    assert cli.main(["decode", "moe", "--out", str(out)]) == 1
    after = json.loads(out.read_text())
    assert after["decode"] == before["decode"] and after["runs"]["decode"] == before["runs"]["decode"]
    assert after["moe"] == {"rows": [{"case": "x"}]}
    assert "decode" in capsys.readouterr().out.split("FAILED: RuntimeError: no GPU here")[0].splitlines()[-1]


def test_some_cases_or_columns_replace_only_those(stored, monkeypatch):
    """gdn over one case and one column: that cell is new, the other columns of the row and every other row keep
    their stored figures."""
    out, before = stored
    name = BENCH_CASES[2].name

    def fake(quick, cases=None, impls=None):
        assert cases == [name] and impls == ["pallas"]
        return [{"case": name, "ms": {i: (0.5 if i == "pallas" else None) for i in gdn.IMPLS}}]
    monkeypatch.setattr(gdn, "run_section", fake)
    monkeypatch.setattr(gdn, "plot", lambda *a: None)
    assert cli.main(["gdn", "--cases", name, "--impls", "pallas", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == [c.name for c in BENCH_CASES]
    old = {r["case"]: r for r in before["rows"]}
    for r in rows:
        if r["case"] != name:
            assert r == old[r["case"]]
    row = next(r for r in rows if r["case"] == name)
    assert row["ms"]["pallas"] == 0.5 and row["ms"]["fla"] == old[name]["ms"]["fla"]
    assert row["fla_do_bench"] == old[name]["fla_do_bench"]


def test_a_column_run_keeps_the_rows_stored_variants(stored, monkeypatch):
    """gdn --impls over a peer's column (or one A/B variant) leaves the A/B figures it did not measure in place:
    a FlashQLA run once dropped every stored variant of the rows it re-measured."""
    out, before = stored
    name = BENCH_CASES[2].name
    data = json.loads(out.read_text())
    for r in data["rows"]:
        if r["case"] == name:
            r["variants"] = {"mosaic_gpu_narrow": 0.7, "mosaic_gpu_wide": 0.9}
    out.write_text(json.dumps(data))
    monkeypatch.setattr(gdn, "plot", lambda *a: None)

    def fake(quick, cases=None, impls=None):
        row = {"case": name, "ms": {i: (0.5 if i in impls else None) for i in gdn.IMPLS}}
        if "mosaic_gpu_wide" in impls:
            row["variants"] = {"mosaic_gpu_wide": 0.8}
        return [row]
    monkeypatch.setattr(gdn, "run_section", fake)
    assert cli.main(["gdn", "--cases", name, "--impls", "qla", "--out", str(out)]) == 0
    row = next(r for r in json.loads(out.read_text())["rows"] if r["case"] == name)
    assert row["ms"]["qla"] == 0.5 and row["variants"] == {"mosaic_gpu_narrow": 0.7, "mosaic_gpu_wide": 0.9}
    assert cli.main(["gdn", "--cases", name, "--impls", "mosaic_gpu_wide", "--out", str(out)]) == 0
    row = next(r for r in json.loads(out.read_text())["rows"] if r["case"] == name)
    assert row["variants"] == {"mosaic_gpu_narrow": 0.7, "mosaic_gpu_wide": 0.8} and row["ms"]["qla"] == 0.5


def test_merge_rows_by_case_in_the_cases_order():
    old = [{"case": "a", "v": 1}, {"case": "b", "v": 1}, {"case": "gone", "v": 1}]
    got = results.merge_rows(old, [{"case": "b", "v": 2}, {"case": "c", "v": 2}], order=("c", "b", "a"))
    assert got == [{"case": "c", "v": 2}, {"case": "b", "v": 2}, {"case": "a", "v": 1}, {"case": "gone", "v": 1}]


def test_sharding_merge_replaces_what_it_remeasured_and_tags_the_run():
    old = {"rows": [{"case": "v", "layers": 12, "devices": 2, "moe_sharding": "tensor", "ms": 1.0, "run": 1},
                    {"case": "long", "layers": 48, "devices": 2, "moe_sharding": "tensor", "ms": 9.0, "run": 1}],
           "events": [{"event": "allreduce", "dtype": "bfloat16", "ms": 0.4, "run": 1}]}
    new = {"rows": [{"case": "v", "layers": 12, "devices": 2, "moe_sharding": "tensor", "ms": 0.9}],
           "events": [{"event": "allreduce", "dtype": "bfloat16", "ms": 0.38},
                      {"event": "allreduce", "dtype": "float32", "ms": 0.7}]}
    got = sharding.merge(old, new, run=2)
    assert [(r["case"], r["ms"], r["run"]) for r in got["rows"]] == [("long", 9.0, 1), ("v", 0.9, 2)]
    assert [(e["dtype"], e["run"]) for e in got["events"]] == [("bfloat16", 2), ("float32", 2)]


def test_results_file_is_named_from_the_device_kind():
    assert results.device_file_name("NVIDIA H200") == "h200"
    assert results.device_file_name("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert results.device_file_name("cpu") == "cpu"
    assert Path(results.default_path("NVIDIA H200", 2)) == RESULTS / "h200x2.json"


def test_committed_results_are_stamped_and_tell_no_history():
    """Every section of every committed results file names the commit, date and command that measured it, and no
    text in them names development rounds, helpers, calls or deleted scripts and logs."""
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        stamped = data["runs"]
        keys = ({str(r["run"]) for r in data["rows"]} if path.stem.endswith("x2")
                else {k for k in ("rows", "layers", "moe", "attention", "decode", "model", "model_35b", "backward",
                                  "serving", "serving_35b", "train") if data.get(k)})
        for key in keys:
            assert {"commit", "date", "command"} <= set(stamped[key]), (path.name, key)
            assert stamped[key]["command"].startswith("python -m benchmarks "), (path.name, key)
        text = path.read_text()
        assert not re.search(r"(?i)session [0-9]|helper [A-Z]|call [0-9]|round [0-9]|benchmarks/(gpu|logs)/", text), \
            path.name
    data = json.loads(H200.read_text())
    assert [r["case"] for r in data["rows"]] == [c.name for c in BENCH_CASES]
    for r in data["rows"]:   # every default column; the peers timed in their own processes (qla, fi) may be absent
        assert set(gdn.DEFAULT_IMPLS) <= set(r["ms"]) <= set(gdn.IMPLS), r["case"]
        assert r["ms"]["pallas"] is not None and r["ms"]["fla"] is not None


def test_markdown_tables_cover_every_section_of_the_committed_results():
    data = json.loads(H200.read_text())
    text = markdown_tables(data)
    for heading in ("| case | pallas Triton (ours) | Mosaic GPU (ours)", "| backend | phase 1", "| MoE layer",
                    "| attention |", "| GDN decode step", "| model (", "| part (ms per layer) |",
                    "| prefix + tail tokens | TTFT cold ms", "| streams | greedy step ms"):
        assert heading in text, heading
    for row in data["rows"]:
        assert f"\n| {row['case']} |" in text, row["case"]
    for row in data["moe"]["rows"]:
        assert f"| {row['case']} | {row['tokens']} |" in text
    decode_run = data["runs"]["decode"]
    assert decode_run["command"].startswith("python -m benchmarks decode")
    assert f"commit {decode_run['commit']}: `{decode_run['command']}`" in text


def test_kernel_rows_ratio_the_faster_of_our_backends(capsys):
    """The ratio columns divide the faster of pallas and mosaic_gpu ("ours") by the peer's time, and by the fastest
    peer's (FLA, jla, FlashQLA, FlashInfer, where each ran); a row where Mosaic did not run (null) uses pallas
    alone, and a row where neither ran prints '-'."""
    rows = [{"case": "dense", "ms": {"pallas": 0.44, "mosaic_gpu": 0.31, "xla": 9.0, "fla": 0.62, "jla": 0.31,
                                     "qla": 0.40, "fi": 0.248}},
            {"case": "varlen", "ms": {"pallas": 0.9, "mosaic_gpu": None, "xla": 9.0, "fla": 1.0, "jla": None}},
            {"case": "none", "ms": {"pallas": None, "mosaic_gpu": None, "xla": 9.0, "fla": 1.0, "jla": 1.0}}]
    text = "\n".join(gdn.markdown(rows))
    assert "| dense | 0.440 | 0.310 | 9.000 | 0.620 | 0.310 | 0.400 | 0.248 | 0.50 | 1.00 | 1.25 |" in text
    assert "| varlen | 0.900 | - | 9.000 | 1.000 | - | - | - | 0.90 | - | 0.90 |" in text
    assert "| none | - | - | 9.000 | 1.000 | 1.000 | - | - | - | - | - |" in text
    gdn.print_section(rows)
    assert "ours/jla" in capsys.readouterr().out


def test_merge_from_takes_the_sections_stamped_later(stored, tmp_path, capsys):
    """The files of several GPU calls merged into one: each call's re-measured section (a later stamp) is taken,
    the sections it only carried along (stamps as old as the target's) are not."""
    out, before = stored
    one, two = dict(before), dict(before)
    one["decode"] = {"rows": [{"case": "d"}]}
    one["runs"] = dict(before["runs"], decode={"commit": "c1", "date": "2027-01-01T00:00:00+00:00",
                                               "command": "python -m benchmarks decode"})
    two["moe"] = {"rows": [{"case": "m"}]}
    two["runs"] = dict(before["runs"], moe={"commit": "c1", "date": "2027-01-01T00:05:00+00:00",
                                            "command": "python -m benchmarks moe"})
    paths = []
    for i, data in enumerate((one, two)):
        paths.append(tmp_path / f"call{i}.json")
        paths[-1].write_text(json.dumps(data))
    assert cli.main(["--merge-from", *map(str, paths), "--out", str(out)]) == 0
    after = json.loads(out.read_text())
    assert after["decode"] == one["decode"] and after["moe"] == two["moe"]
    assert after["rows"] == before["rows"] and after["model"] == before["model"]
    assert after["runs"]["moe"]["date"] == "2027-01-01T00:05:00+00:00"
    assert "took decode, moe" in capsys.readouterr().out


def test_backward_columns_replace_only_those(stored, monkeypatch):
    """backward over one column (the FlashQLA process's run): that column is new, the stored figures and errors of
    the other columns of each row are kept."""
    from benchmarks import backward
    out, _ = stored
    name = backward.CASES[0].name
    prior = {"rows": [{"case": name, "ms": {i: (1.0 if i != "qla" else None) for i in backward.IMPLS},
                       "errors": {"jla": "old reason"}}], "note": "bf16"}
    data = json.loads(out.read_text())
    data["backward"] = prior
    out.write_text(json.dumps(data))

    def fake(quick, cases=None, impls=None):
        assert impls == ["qla"]
        return {"rows": [{"case": name, "ms": {i: (0.5 if i == "qla" else None) for i in backward.IMPLS},
                          "errors": {}}], "note": "bf16"}
    monkeypatch.setattr(backward, "run_section", fake)
    assert cli.main(["backward", "--impls", "qla", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["backward"]["rows"][0]
    assert row["ms"]["qla"] == 0.5 and row["ms"]["ours"] == 1.0 and row["ms"]["fla"] == 1.0
    assert row["errors"] == {"jla": "old reason"}


def test_train_section_takes_optimiser_steps_on_packed_documents():
    """The train section's CPU smoke (tiny dims, one column): a step's figures are there and the first loss of a
    random model is near ln(vocab) (uniform predictions), so the loss is the next-token loss it claims to be."""
    import math

    from benchmarks import train
    value = train.run_section(quick=True, impls=("ours",))
    (row,) = value["rows"]
    assert row["impl"] == "ours" and row["ms"] > 0 and row["tokens_per_s"] > 0 and row["peak_mb"] > 0
    assert abs(row["loss"] - math.log(value["config"]["vocab"])) < 0.5, row
    assert value["params"] > value["params_no_embedding"] > 0 and value["tokens"] == 128 and value["docs"] == 4


def test_ab_variants_of_our_switches_are_kept_beside_the_columns(stored, monkeypatch, capsys):
    """--impls mosaic_gpu_narrow,mosaic_gpu_wide: the Mosaic kernels with wide False / "auto" in both backend
    configs, timed into the row's "variants" (the columns keep their stored figures; on this CPU they are null,
    no Hopper); the configs really reach the backend entry points."""
    out, before = stored
    name = BENCH_CASES[1].name

    def fake(quick, cases=None, impls=None):
        assert impls == ["mosaic_gpu_wide", "mosaic_gpu_narrow"]
        return [{"case": name, "ms": {i: None for i in gdn.IMPLS},
                 "variants": {"mosaic_gpu_wide": 0.25, "mosaic_gpu_narrow": 0.3}}]
    monkeypatch.setattr(gdn, "run_section", fake)
    monkeypatch.setattr(gdn, "plot", lambda *a: None)
    assert cli.main(["gdn", "--cases", name, "--impls", "mosaic_gpu_wide,mosaic_gpu_narrow",
                     "--out", str(out)]) == 0
    assert "A/B of our switches" in capsys.readouterr().out
    row = next(r for r in json.loads(out.read_text())["rows"] if r["case"] == name)
    old = next(r for r in before["rows"] if r["case"] == name)
    assert row["variants"] == {"mosaic_gpu_wide": 0.25, "mosaic_gpu_narrow": 0.3}
    assert all(row["ms"][i] == old["ms"].get(i) for i in gdn.IMPLS)


def test_variant_columns_on_cpu_and_the_configs_they_pass(monkeypatch):
    from benchmarks.cases import CASES
    rows = gdn.run_section(True, impls=["mosaic_gpu_wide"])
    assert rows and all(r["variants"] == {"mosaic_gpu_wide": None} for r in rows)       # no Hopper here
    from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk, varlen
    seen = []
    monkeypatch.setattr(chunk, "fallback_reason", lambda *a, **k: None)
    for mod in (chunk, varlen):
        monkeypatch.setattr(mod, "op_fwd", lambda q, *a, config=None, **k: (seen.append(config), q)[1])
    for variant in ("mosaic_gpu_wide", "mosaic_gpu_split", "mosaic_gpu_narrow"):
        for case_name in ("B1-T8192-Hk2-Hv8", "tiny64-T171-Hk16-Hv32"):
            case = CASES[case_name]
            small = type(case)(case.name, 1, 8, case.Hk, case.Hv, case.K, case.V,
                               None if case.lens is None else (3, 5))
            fn, args = gdn.variant_impl(small, gdn.make_inputs_np(small), gdn.VARIANTS[variant])
            fn(*args)
    assert isinstance(seen[0], chunk.MosaicConfig) and isinstance(seen[1], varlen.VarlenConfig)
    assert seen[0] == chunk.MosaicConfig(wide="auto") and seen[1] == varlen.VarlenConfig(wide="auto")
    # a "varlen:" field sets the packed calls' config only
    assert seen[2] == chunk.MosaicConfig(wide=False) and seen[3] == varlen.VarlenConfig(wide=False, split=32)
    # wide False in both (the default is "auto" now, so this is what shows the fields reach the entry points)
    assert seen[4] == chunk.MosaicConfig(wide=False) and seen[5] == varlen.VarlenConfig(wide=False, split=0)
    assert seen[4] != chunk.DEFAULT_CONFIG and seen[5] != varlen.DEFAULT_CONFIG


def test_ttft_probe_traces_one_more_hit():
    """The serving section's TTFT probe with ``trace``: one more request on the cached prefix, traced, its kernels
    summed by kind (none on the CPU) beside its wall time; the traced request did hit the cache."""
    from benchmarks import serving
    model = serving._model(dict(serving.QUICK))
    rows = serving.ttft_probe(model, prefixes=(32,), tail=8, token_budget=64, reps=1, block_size=16, trace=True)
    tr = rows[0]["hit_trace"]
    host = rows[0]["hit_host_ms"]                      # the hit's host time by phase, up to its token's copy
    assert {"admit", "plan", "dispatch", "wait", "tokens", "release"} <= set(host), host
    assert 0 < sum(host[k] for k in ("admit", "plan", "dispatch", "wait")) <= rows[0]["hit_s"] * 1e3
    assert set(tr) == {"wall_ms", "gpu_ms", "kinds", "top", "hit_tokens"}
    assert tr["hit_tokens"] == 32 and tr["wall_ms"] > 0
    assert tr["gpu_ms"] == round(sum(tr["kinds"].values()), 3)


def test_branch_ab_alternates_and_puts_the_defaults_back(monkeypatch):
    """The serving section's "branches" part: the TTFT probe in turn with the kernels' device-side choices in every
    call and as shipped, each turn tracing a model of its own under that turn's defaults (seen by a spy on the
    probe); the shipped defaults are back after, also when a turn raises; not in a run without --cases."""
    from benchmarks import serving
    from pallas_kernels.gated_delta_rule.mosaic_gpu import varlen
    from pallas_kernels.paged_attention import cudnn
    shipped = (varlen.DEFAULT_CONFIG, cudnn.FRESH)
    seen = []
    real = serving.ttft_probe

    def spy(m, **kw):
        seen.append((varlen.DEFAULT_CONFIG.cond_min_tokens, cudnn.FRESH, id(m)))
        return real(m, **kw)
    monkeypatch.setattr(serving, "ttft_probe", spy)
    model = serving._model(dict(serving.QUICK))
    rows = serving.branch_ab(model, prefix=32, tail=8, token_budget=64, reps=1, turns=1)
    assert [r["branches"] for r in rows] == ["every call", "shipped"]
    assert [s[:2] for s in seen] == [(0, "cond"), (shipped[0].cond_min_tokens, shipped[1])]
    assert len({s[2] for s in seen}) == 2 and all(r["hit_s"] > 0 for r in rows)
    assert (varlen.DEFAULT_CONFIG, cudnn.FRESH) == shipped

    def boom(m, **kw):
        raise RuntimeError("turn failed")
    monkeypatch.setattr(serving, "ttft_probe", boom)
    with pytest.raises(RuntimeError):
        serving.branch_ab(model, prefix=32, tail=8, token_budget=64, reps=1, turns=1)
    assert (varlen.DEFAULT_CONFIG, cudnn.FRESH) == shipped
    assert "branches" in serving.PARTS and "branches" not in serving.DEFAULT_PARTS
