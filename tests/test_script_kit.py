"""benchmarks/gpu/script_kit.py's child-test runner on canned pytest output (no pytest child: a python child that
prints what ``pytest -v`` prints, through the runner's own Popen call, so its environment is the runner's)."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "script_kit.py"
_spec = importlib.util.spec_from_file_location("script_kit", _PATH)
kit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kit)

F = "tests/pallas_kernels/test_x.py::"
CANNED = [
    "============================= test session starts ==============================",
    f"{F}test_a PASSED                                                [ 33%]",
    f"{F}test_b[1-2] FAILED                                           [ 66%]",
    f"{F}test_c SKIPPED (needs a CUDA GPU)                            [100%]",
    "E   AssertionError: rel 3e-2 > 1e-2",
    f"FAILED {F}test_b[1-2] - AssertionError: rel 3e-2 > 1e-2",
    "==================== 1 failed, 1 passed, 1 skipped in 2.50s ====================",
]


def _child(monkeypatch, lines, *, rc=0, hang=False):
    """The runner's Popen call made on ``python -c`` printing ``lines`` (plain prints, no flush) and then
    exiting with ``rc`` or hanging."""
    seen = {}
    real = subprocess.Popen
    code = (f"import sys, time\nfor ln in {lines!r}:\n    print(ln)\n"
            + ("time.sleep(60)\n" if hang else f"sys.exit({rc})\n"))

    def popen(cmd, **kw):
        seen.update(cmd=cmd, **kw)
        return real([sys.executable, "-c", code], **kw)
    monkeypatch.setattr(kit.subprocess, "Popen", popen)
    return seen


def test_verdicts_and_report_of_a_finished_child(monkeypatch, tmp_path):
    seen = _child(monkeypatch, CANNED, rc=1)
    child = kit.run_tests(["-v", "x"], quick=True, timeout=20, log_path=str(tmp_path / "t.log"))
    assert seen["cmd"][1:] == ["-m", "pytest", "-v", "x"] and seen["cwd"] == kit.REPO
    assert seen["env"]["PYTHONUNBUFFERED"] == "1" and seen["env"]["JAX_PLATFORMS"] == "cpu"
    assert child.rc == 1 and child.lines == CANNED
    # the -v lines, and pytest's -ra summary line of the failure too (as the scripts have always counted it)
    assert child.verdicts == [ln.strip() for ln in CANNED[1:4]] + [CANNED[5]]
    assert child.failures() == CANNED[4:6] and child.summary() == CANNED[-1:]
    assert (tmp_path / "t.log").read_text() == child.text == "\n".join(CANNED) + "\n"
    log, result = kit.Log(), {}
    tests = child.record(result, log)
    assert log.lines[:3] == ["  test_a PASSED                                                [ 33%]",
                             "  test_b[1-2] FAILED                                           [ 66%]",
                             "  test_c SKIPPED (needs a CUDA GPU)                            [100%]"]
    assert log.lines[3] == "  test_b[1-2] - AssertionError: rel 3e-2 > 1e-2"
    assert log.lines[4:6] == ["  " + CANNED[4], "  " + CANNED[5]]
    assert log.lines[6].startswith("  tests rc=1 in ") and log.lines[6].endswith(f" {CANNED[-1:]}")
    assert set(tests) == {"rc", "seconds", "verdicts", "failures"} and result["tests"] is tests
    assert json.loads(json.dumps(result))["tests"]["verdicts"] == child.verdicts
    assert kit.tally(tests) == "tests rc=1: 1 passed, 2 failed of 4 reported"


def test_a_timed_out_child_reports_what_it_printed(monkeypatch):
    """Unbuffered: the verdicts printed before the kill are there (a buffered pytest child lost them)."""
    _child(monkeypatch, CANNED[:3], hang=True)
    child = kit.ChildTests.start(["-v"], quick=False)
    assert child.wait(1.0) == "timeout" and child.proc.returncode is not None
    assert child.verdicts == [ln.strip() for ln in CANNED[1:3]] and child.summary() == []
    assert child.seconds == pytest.approx(1.0, abs=0.9)
