"""What the GPU run scripts of benchmarks/gpu/ share: their log, their deadline, their outputs, the bench's inputs,
guarded steps and timed cells, and the GPU tests they run in a child process first.

Used by gdn_mosaic_s6.py and the session-7 scripts (gdn_mosaic_split.py, gdn_mosaic_varlen.py, gdn_decode_mosaic.py,
gdn_short_varlen.py). The older scripts (jla_probe.py, gdn_v5.py, gdn_decode_s6.py, attn_*.py, ...) keep their own
copies of these helpers: their logs under benchmarks/logs/ were written by that code, which stays as it ran.

The scripts run as ``python benchmarks/gpu/<name>.py``, so this folder is ``sys.path[0]`` and ``import script_kit``
finds this file. Nothing here imports jax at import time: a script starts its test child before it imports jax.

  arg_parser(doc, budget=..., test_timeout=..., quick_help=...)
                            the options the scripts share: --quick, --budget S (seconds from the start; later
                            steps are skipped) and, with ``test_timeout``, --test-timeout S and --no-tests.
  out_dir()                 $OUT (default /tmp/out), created.
  parse(ap, t0, cpu_quick)  ``(opts, out_dir(), Deadline(opts.budget, t0))`` of the parsed command line; with
                            ``cpu_quick`` and --quick, JAX_PLATFORMS defaults to "cpu" (call it before jax is
                            imported).
  Log()                     ``log(*parts)`` prints the parts joined by spaces at once (flushed) and keeps the line
                            in ``log.lines`` for the .log file.
  Deadline(budget, t0)      ``left()``: seconds left of ``budget`` counted from ``t0`` (the script's start);
                            ``left.elapsed()``: seconds since ``t0``.
  save(out_dir, name, result, lines)
                            writes ``<out_dir>/<name>.json`` (``result``, indent 1, ``default=str``) and
                            ``<out_dir>/<name>.log`` (the lines); called after every step, so a killed run keeps
                            what it measured.
  relative_rms(a, b)        ||a - b|| / ||b|| over all elements, in float64 (``b`` the reference).
  bf16_inputs(host)         the bench's device dtypes for host (q, k, v, g, beta[, h0, ...]): q, k, v and beta
                            (positions 0, 1, 2, 4) in bf16, g and the states as they are (fp32).
  bench_inputs(case, seed)  ``(host, bf16_inputs(host))`` of ``jax_gdn.bench.make_inputs_np(case, seed)``.
  config_name(cfg)          a dataclass config's fields that differ from their defaults, "name=value" joined by
                            commas, or "default".
  guarded(label, need, fn, ...)
                            one step of a run: skipped (label into ``res["skipped"]``) when fewer than ``need`` s
                            are left; an exception is reported (``res["errors"]``, the log, the traceback on
                            stderr) and gives None; the step's seconds are logged and ``save()`` called whatever
                            happened.
  Timed(timer, left, log, errors, ...)
                            ``timed(row, key, fn, args, min_left)``: one cell of a table: None (and ``key`` into
                            ``row["skipped"]``) when fewer than ``min_left`` s are left; else one call, then
                            ``row["ms"][key] = timer(fn, args)`` (4 decimals) and a line in the log; an exception
                            is recorded (``row["ms"][key] = None``, ``errors``, the log) and gives None; returns the
                            first call's result.
  ChildTests / run_tests    GPU tests in a child process (below); ``tally(tests)``: the closing line of a run's
                            table ("tests rc=...: P passed, F failed of N reported"); ``log_closing(log, result,
                            left)``: that line (when the tests ran) and "errors: E; wall W s (budget B s)".

The child-test runner's contract (``ChildTests.start(pytest_args, quick=...)``, then ``.wait(timeout)``;
``run_tests`` does both):
  * ``python -m pytest <pytest_args>`` runs in the repository root with ``PYTHONUNBUFFERED=1`` (pytest writes each
    line as it prints it), the repository on ``PYTHONPATH`` and, with ``quick``, ``JAX_PLATFORMS=cpu``; a kernel
    error or a hang in the child cannot cost the parent's measurements, and the parent may compile meanwhile.
  * Its stdout and stderr are one stream, read line by line as they come by a thread of the parent (and copied to
    ``log_path`` if given). Each line that names a test (``::``) and a verdict (PASSED, FAILED, SKIPPED, ERROR),
    as ``-v`` prints them, is kept in ``verdicts`` when it arrives; so are pytest's ``-ra`` summary lines
    "FAILED <id> - <message>" (a failure counts twice in ``tally``, as in the logs these scripts wrote before).
  * ``wait(timeout)`` returns the exit code, or "timeout" after killing the child at ``timeout`` s from the call;
    a timed-out child reports the verdicts and lines it printed before the kill (a buffered child lost them).
  * After the wait: ``lines`` (all of its output), ``text``, ``verdicts``, ``failures(n)`` (the first n lines
    starting "E  ", "FAILED" or "ERROR"), ``summary()`` (pytest's closing line, the last naming passed, failed or
    errors, as a list of 0 or 1), ``seconds`` (since the start), and ``record(result, log)``: the report the
    prefill scripts print (each verdict after its "::", the failure lines, "tests rc=... in ... s [summary]") and
    ``result["tests"] = {"rc", "seconds", "verdicts", "failures"}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERDICT_WORDS = ("PASSED", "FAILED", "SKIPPED", "ERROR")
FAILURE_STARTS = ("E  ", "FAILED", "ERROR")


def arg_parser(doc: str, *, budget: float, test_timeout: float | None = None,
               quick_help: str = "CPU smoke run at tiny sizes") -> argparse.ArgumentParser:
    """--quick, --budget and, with ``test_timeout``, --test-timeout and --no-tests; described by doc's first line."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--budget", type=float, default=budget, help="seconds from start; later steps are skipped")
    if test_timeout is not None:
        ap.add_argument("--test-timeout", type=float, default=test_timeout, help="seconds for the child's GPU tests")
        ap.add_argument("--no-tests", action="store_true")
    return ap


def out_dir() -> str:
    """$OUT (default /tmp/out), created."""
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    return out


def parse(ap: argparse.ArgumentParser, t0: float, *, cpu_quick: bool = False):
    """``(opts, out_dir(), Deadline(opts.budget, t0))``; ``cpu_quick``: --quick runs on the CPU by default."""
    opts = ap.parse_args()
    if cpu_quick and opts.quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return opts, out_dir(), Deadline(opts.budget, t0)


class Log:
    """``log(*parts)``: prints the line at once and keeps it in ``lines``."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, *parts):
        line = " ".join(str(p) for p in parts)
        self.lines.append(line)
        print(line, flush=True)


class Deadline:
    """``left()``: seconds left of ``budget`` counted from ``t0``; ``elapsed()``: seconds since ``t0``."""

    def __init__(self, budget: float, t0: float | None = None):
        self.budget, self.t0 = budget, time.time() if t0 is None else t0

    def elapsed(self) -> float:
        return time.time() - self.t0

    def __call__(self) -> float:
        return self.budget - self.elapsed()


def save(out_dir: str, name: str, result: dict, lines: list[str]):
    """``<out_dir>/<name>.json`` and ``<out_dir>/<name>.log``."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"{name}.log"), "w") as f:
        f.write("\n".join(lines) + "\n")


def relative_rms(a, b) -> float:
    """||a - b|| / ||b|| in float64 (``b`` the reference)."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(float(np.sqrt(np.mean(b ** 2))), 1e-30))


def bf16_inputs(host) -> tuple:
    """q, k, v, beta (positions 0, 1, 2, 4) as bf16 device arrays, the others (g, states) as they are."""
    import jax.numpy as jnp
    return tuple(jnp.asarray(x, jnp.bfloat16) if i in (0, 1, 2, 4) else jnp.asarray(x) for i, x in enumerate(host))


def bench_inputs(case, seed: int = 0):
    """``(host, device)``: jax_gdn.bench's host inputs of ``case`` and their bench dtypes on the device."""
    from jax_gdn.bench import make_inputs_np
    host = make_inputs_np(case, seed)
    return host, bf16_inputs(host)


def config_name(cfg) -> str:
    """"name=value,..." of the fields of a dataclass ``cfg`` that differ from their defaults, or "default"."""
    import dataclasses
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != f.default) or "default"


def guarded(label, need, fn, *, left, log, res, save):
    """``fn()`` unless fewer than ``need`` s are left; exceptions reported; None when skipped or failed."""
    if left() < need:
        res["skipped"].append(label)
        log(f"skip {label} ({left():.0f} s left, needs ~{need:.0f})")
        return None
    t = time.time()
    try:
        return fn()
    except Exception as e:                                # report and go on
        res["errors"].append(f"{label}: {type(e).__name__}: {str(e)[:800]}")
        log(f"FAIL {label}: {type(e).__name__}: {str(e)[:800]}")
        traceback.print_exc()
        return None
    finally:
        log(f"  ({label}: {time.time() - t:.1f} s)")
        save()


class Timed:
    """``timed(row, key, fn, args, min_left)``: one timed cell of ``row`` (see the module docstring).

    ``key_width`` / ``case_chars``: the log line's key column and how much of the case name it shows (None: all);
    ``err_chars``: how much of an exception's message is kept; ``after``: called after each cell timed."""

    def __init__(self, timer, left, log, errors, *, min_left=3.0, key_width=14, case_chars=None, err_chars=400,
                 after=None):
        self.timer, self.left, self.log, self.errors = timer, left, log, errors
        self.min_left, self.key_width, self.case_chars, self.err_chars = min_left, key_width, case_chars, err_chars
        self.after = after

    def __call__(self, row, key, fn, args, min_left=None):
        import jax
        if self.left() < (self.min_left if min_left is None else min_left):
            row["ms"][key] = None
            row.setdefault("skipped", []).append(key)
            return None
        try:
            res = jax.block_until_ready(fn(*args))
            row["ms"][key] = round(self.timer(fn, args), 4)
            case = row["case"] if self.case_chars is None else row["case"][:self.case_chars]
            self.log(f"  {case:22s} {key:{self.key_width}s} {row['ms'][key]:8.4f} ms   ({self.left():.0f} s left)")
            if self.after is not None:
                self.after()
            return res
        except Exception as e:  # noqa: BLE001 - report and go on
            row["ms"][key] = None
            msg = f"{row['case']} {key}: {type(e).__name__}: {str(e)[:self.err_chars]}"
            self.errors.append(msg)
            self.log("  FAIL " + msg)
            return None


class ChildTests:
    """``python -m pytest <args>`` in a child process, its output read as it comes (the module docstring)."""

    def __init__(self, proc: subprocess.Popen, log_path: str | None = None):
        self.proc, self.t0 = proc, time.time()
        self.lines: list[str] = []
        self.verdicts: list[str] = []
        self.rc = None
        self._file = open(log_path, "w") if log_path else None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, pytest_args, *, quick: bool, log_path: str | None = None) -> "ChildTests":
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        if quick:
            env["JAX_PLATFORMS"] = "cpu"
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO, env=env, text=True,
                                errors="replace", bufsize=1, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return cls(proc, log_path)

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if "::" in line and any(w in line for w in VERDICT_WORDS):
                self.verdicts.append(line.strip())
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    def wait(self, timeout: float):
        """The child's exit code, or "timeout" (then it is killed); its output read to the end."""
        try:
            self.rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.rc = "timeout"
        self._reader.join(timeout=5)          # a grandchild holding the pipe cannot hold the run
        if self._file is not None:
            self._file.close()
        self.seconds = time.time() - self.t0
        return self.rc

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines else "")

    def failures(self, n: int = 30) -> list[str]:
        return [ln for ln in self.lines if ln.startswith(FAILURE_STARTS)][:n]

    def summary(self) -> list[str]:
        return [ln for ln in self.lines if " passed" in ln or " failed" in ln or " error" in ln][-1:]

    def record(self, result: dict, log, max_failures: int = 30) -> dict:
        """Logs the verdicts, the failure lines and the rc line; ``result["tests"]``."""
        fails = self.failures(max_failures)
        for ln in self.verdicts:
            log("  " + ln.split("::", 1)[1])
        for ln in fails:
            log("  " + ln[:300])
        log(f"  tests rc={self.rc} in {self.seconds:.0f} s {self.summary()}")
        result["tests"] = {"rc": self.rc, "seconds": round(self.seconds, 1), "verdicts": self.verdicts,
                           "failures": fails}
        return result["tests"]


def run_tests(pytest_args, *, quick: bool, timeout: float, log_path: str | None = None) -> ChildTests:
    """``ChildTests.start(...)`` and ``wait(timeout)``."""
    child = ChildTests.start(pytest_args, quick=quick, log_path=log_path)
    child.wait(timeout)
    return child


def tally(tests: dict) -> str:
    """"tests rc=...: P passed, F failed of N reported" of ``result["tests"]``."""
    npass = sum("PASSED" in v for v in tests["verdicts"])
    nfail = sum(("FAILED" in v or "ERROR" in v) for v in tests["verdicts"])
    return f"tests rc={tests['rc']}: {npass} passed, {nfail} failed of {len(tests['verdicts'])} reported"


def log_closing(log, result: dict, left: Deadline):
    """The tests' tally (when they ran) and "errors: E; wall W s (budget B s)"."""
    if "tests" in result:
        log(tally(result["tests"]))
    log(f"errors: {len(result['errors'])}; wall {left.elapsed():.0f} s (budget {left.budget:.0f} s)")
