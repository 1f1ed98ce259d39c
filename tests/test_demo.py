"""`python -m jax_gdn demo`: a small run whose printed errors are small, and the CLI wiring."""
import math
import subprocess
import sys

import pytest

from jax_gdn import demo


def test_demo_small_run_errors_small(capsys):
    results = demo.run(["--layers", "2", "--hidden", "16", "--heads", "1,3", "--head-dims", "8,16",
                         "--lengths", "1,66", "--decode-steps", "2", "--backend", "xla", "--layout", "qwen3_5",
                         "--skip-model", "--no-progress"])
    rows = results["gdn_stack"]
    printed = capsys.readouterr().out
    checked = [r for r in rows if r["max_err"] is not None]
    assert len(checked) >= 7  # outputs, conv/ssm states, one-jit form, NaN spare slots, 2 decode steps
    for r in checked:
        assert math.isfinite(r["max_err"]) and r["max_err"] < 1e-4, r
        assert r["phase"] in printed
    assert sum(r["phase"].startswith("decode step") for r in rows) == 2
    assert any("spare slots still NaN: True" in r["phase"] for r in rows)
    for name in ("phase1_proj_batched", "phase1_conv1d_varlen", "phase1_l2_batched", "gdn_full_varlen", "phase3"):
        assert any(r["phase"].startswith(name) and r["time_ms"] > 0 for r in rows), name


def test_demo_help_and_bad_args(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--layers", "--hidden", "--heads", "--lengths", "--decode-steps", "--seed", "--backend"):
        assert opt in out
    with pytest.raises(SystemExit):
        demo.main(["--lengths", "3,0"])


def test_module_dispatch():
    r = subprocess.run([sys.executable, "-m", "jax_gdn"], capture_output=True, text=True)
    assert r.returncode == 2 and "demo" in r.stdout
    r = subprocess.run([sys.executable, "-m", "jax_gdn", "demo", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--decode-steps" in r.stdout


def test_model_section_hook(monkeypatch):
    """The model section calls jax_gdn.model_demo.run_model_demo with the shared options and tabulates it."""
    import types

    seen = {}

    def fake_run(options, verbose=True):
        seen.update(options, verbose=verbose)
        return dict(streams=2, prompt_tokens=9, prefill_compile_s=1.0, prefill_s=0.5, prefill_tok_s=18.0,
                    decode_compile_s=0.2, decode_step_s=0.01, decode_tok_s=200.0, finite=True)

    monkeypatch.setattr(demo, "_model_hook", lambda: types.SimpleNamespace(run_model_demo=fake_run))
    args = demo.build_parser().parse_args(["--decode-steps", "4", "--backend", "xla", "--model-lens", "4,5"])
    rows = demo.run_model_section(args)
    assert seen["decode_steps"] == 4 and seen["backend"] == "xla" and seen["lens"] == "4,5"
    assert not seen["verbose"] and "model" not in seen
    assert [r["time_ms"] for r in rows[:4]] == [1000.0, 500.0, 200.0, 10.0]


def _no_work(*_a, **_k):
    raise AssertionError("ran work before the options were checked")


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--hidden", "-1"], ["--heads", "3,4"], ["--heads", "2"],
                                  ["--decode-steps", "-1"], ["--model", "/no/such/dir"], ["--model-lens", "3,x"],
                                  ["--precision", "fast"]])
def test_bad_options_refused_before_any_work(monkeypatch, capsys, argv):
    monkeypatch.setattr(demo, "run_gdn_stack_demo", _no_work)
    monkeypatch.setattr(demo, "run_model_section", _no_work)
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_verdict_pass_and_fail_set_the_exit_status(monkeypatch, capsys):
    tol = demo.TOLERANCE["highest"]
    rows = [dict(phase="output", time_ms=1.0, max_err=tol / 10, tol=tol, ok=True)]
    monkeypatch.setattr(demo, "run_gdn_stack_demo", lambda args: [dict(r) for r in rows])
    assert demo.main(["--skip-model"]) == 0
    out = capsys.readouterr().out
    assert "PASS: 1 checks within tolerance" in out and f"within {tol:g}" in out

    rows.append(dict(phase="decode step 1", time_ms=1.0, max_err=tol * 10, tol=tol, ok=False))
    assert demo.main(["--skip-model"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 1 of 2 checks: decode step 1" in out and out.splitlines()[-3].endswith("FAIL")


def test_module_dispatch_commands_and_unknown():
    from jax_gdn.__main__ import COMMANDS, main
    assert sorted(COMMANDS) == ["demo", "serve-sim"]
    assert main(["--help"]) == 0
    assert main(["bench"]) == 2
    r = subprocess.run([sys.executable, "-m", "jax_gdn", "no-such-command"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command 'no-such-command'" in r.stderr and "serve-sim" in r.stderr


def test_model_section_checks_finite_logits_and_the_repeat_prefill(monkeypatch):
    import types
    base = dict(streams=2, prompt_tokens=9, prefill_compile_s=1.0, prefill_s=0.5, prefill_tok_s=18.0,
                decode_compile_s=0.2, decode_step_s=0.01, decode_tok_s=200.0)
    args = demo.build_parser().parse_args([])
    for res, want in ((dict(base, finite=True, prefill_repeat_rel_err=0.0), [True, True]),
                      (dict(base, finite=False, prefill_repeat_rel_err=0.5), [False, False])):
        monkeypatch.setattr(demo, "_model_hook", lambda res=res: types.SimpleNamespace(
            run_model_demo=lambda options, verbose=True: res))
        rows = demo.run_model_section(args)
        assert [r["ok"] for r in rows if r.get("ok") is not None] == want
        assert demo.verdict({"model": rows})[0] == all(want)
