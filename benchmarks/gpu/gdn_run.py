"""One device run for the GDN op (issue 14): GPU tests, decode rows + launch sweep, prefill rows vs h200.json.

    python benchmarks/gpu/gdn_run.py OUT_DIR [deadline_s] [tests,decode,prefill]

1. ``pytest -m gpu`` on tests/pallas_kernels/test_gated_delta_rule.py, test_gdn_decode.py and tests/ops (kernel
   numerics against float64 on the GPU); FIGURE lines and the summary go to OUT_DIR/gdn_tests.log.
2. ``jax_gdn.bench_decode.run_section()`` (pallas / xla / FLA fused_recurrent / copy), then the decode kernel's
   DecodeConfig variants at the largest case.
3. Prefill: ``chunk_gated_delta_rule(backend="pallas")`` on every jax_gdn.cases.BENCH_CASES row, timed as
   jax_gdn.bench does, beside the pallas column of benchmarks/results/h200.json (the run before this session's
   correctness fixes).
Everything lands in OUT_DIR/gdn_run.json; a short table is printed last. Sections past the deadline are skipped.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

T0 = time.time()


def left(deadline):
    return deadline - (time.time() - T0)


def run_tests(out, deadline):
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "-s",
           "tests/pallas_kernels/test_gated_delta_rule.py", "tests/pallas_kernels/test_gdn_decode.py", "tests/ops"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, left(deadline)))
        log = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out_ = e.stdout or b""
        log = (out_.decode() if isinstance(out_, bytes) else out_) + "\nTIMEOUT"
    with open(os.path.join(out, "gdn_tests.log"), "w") as f:
        f.write(log)
    lines = [l for l in log.splitlines() if l.startswith("FIGURE") or "passed" in l or "failed" in l
             or l.startswith("FAILED") or "Error" in l[:40]]
    return lines[-40:]


def run_decode(deadline):
    from jax_gdn import bench_decode
    from jax_gdn.cases import DECODE_CASES
    from pallas_kernels.gated_delta_rule.decode import DecodeConfig
    section = bench_decode.run_section()
    bench_decode.print_section(section)
    sweep = []
    case = DECODE_CASES[0]
    host = bench_decode.make_inputs_np(case)
    for bv in (32, 64, 128):
        for warps in (2, 4, 8):
            if left(deadline) < 40:
                break
            cfg = DecodeConfig(block_v=bv, num_warps=warps)
            try:
                ms = bench_decode.time_jax_decode(case, "pallas", host, config=cfg)
            except Exception as e:
                print(f"sweep {cfg}: {type(e).__name__} {str(e)[:200]}")
                ms = None
            sweep.append({"block_v": bv, "num_warps": warps, "ms": ms,
                          "gbps": None if ms is None else bench_decode.state_bytes(case) / ms / 1e6})
            print(f"sweep {case.name} block_v={bv} warps={warps}: {ms}")
    section["sweep"] = sweep
    return section


def run_prefill(deadline):
    from jax_gdn.bench import _jax_impl, make_inputs_np, time_jax
    from jax_gdn.cases import BENCH_CASES
    try:
        with open("benchmarks/results/h200.json") as f:
            before = {r["case"]: r["ms"].get("pallas") for r in json.load(f)["rows"]}
    except Exception:
        before = {}
    rows = []
    for case in BENCH_CASES:
        if left(deadline) < 15:
            break
        fn, args = _jax_impl(case, make_inputs_np(case, 0), "pallas")   # the bench's own inputs and call
        try:
            ms = time_jax(fn, args)
        except Exception as e:
            print(f"prefill {case.name}: {type(e).__name__} {str(e)[:300]}")
            ms = None
        rows.append({"case": case.name, "ms_now": ms, "ms_h200_json": before.get(case.name)})
        print(f"prefill {case.name}: {ms} (h200.json {before.get(case.name)})", flush=True)
    return rows


def main():
    out = sys.argv[1]
    deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else ["tests", "decode", "prefill"]
    result = {}
    result["tests"] = run_tests(out, deadline * 0.45 if len(only) > 1 else deadline) if "tests" in only else []
    print("\n".join(result["tests"]), flush=True)
    if "decode" not in only and "prefill" not in only:
        with open(os.path.join(out, "gdn_run.json"), "w") as f:
            json.dump(result, f, indent=1)
        return
    try:
        result["decode"] = run_decode(deadline * 0.7)
    except Exception as e:
        print(f"decode section failed: {type(e).__name__} {str(e)[:300]}")
    try:
        result["prefill"] = run_prefill(deadline)
    except Exception as e:
        print(f"prefill section failed: {type(e).__name__} {str(e)[:300]}")
    with open(os.path.join(out, "gdn_run.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n==== summary ====")
    for line in result["tests"][-6:]:
        print(line)
    for r in result.get("decode", {}).get("rows", []):
        print(r["case"], {k: (None if v is None else round(v, 4)) for k, v in r["ms"].items()},
              {k: (None if v is None else round(v)) for k, v in r["gbps"].items()})
    for r in result.get("decode", {}).get("sweep", []):
        print("sweep", r["block_v"], r["num_warps"], r["ms"])
    for r in result.get("prefill", []):
        print("prefill", r["case"], r["ms_now"], "before", r["ms_h200_json"])
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
