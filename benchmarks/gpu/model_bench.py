"""GPU run of the whole-model section (jax_gdn.bench_model): our rows, then HF transformers in a child process
(on FLA's kernels: jax_gdn.bench_model.fla_kernels), the 48-layer compile in a child process, then the parts
(prefill and decode, each against its floor). Writes $OUT/model.json after every stage (a run cut by its time
limit keeps what it measured) and prints the table last.

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD FLA_FLASH_QLA=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
    python benchmarks/gpu/model_bench.py --budget 380 2>&1 | tee $OUT/log.txt      # no grep in the pipe: it buffers

``--check`` (a short run, <= ``--budget`` s, default 130 with ``--check``): on a 2-layer model (one GDN, one
attention layer) at 80B dims, in order, nothing else on the GPU meanwhile:
  1. the 2-layer model's own varlen16 and decode rows (public API): "model measured" beside "model sum" (the parts
     x their layer counts) for each timing;
  2. the parts (prefill varlen16, decode 64 x 1189) each timed three ways (in-program loop, pipelined, blocking:
     jax_gdn.bench_model.PARTS_TIMING; no in-program timing starts in the budget's last 15 s), against their
     floors, with the copies found in each loop body;
  3. the row floors (jax_gdn.bench_model.row_floor) of the 8-layer bench rows (varlen16, B1-T32768, decode), HF's
     and our ms read from this device's results JSON (benchmarks/results/<device>.json, its "model" rows), and of
     the 2-layer rows just measured;
  4. unless ``--no-hf``: HF on FLA's kernels against HF's torch path (a child process AFTER the parts: the first
     check ran it beside the parts and its Triton autotuning shared the GPU with their timing).
Writes $OUT/model_check.json (after each stage) and $OUT/model_check.log (stdout), prints the tables, then a
summary of at most 12 lines last (``summary_lines``: a run that returns only its output's tail keeps it).
``--check --quick``: the same at tiny dims (a CPU dry run of the script; the HF check then reports that FLA's
kernels need a GPU).

    timeout 160 python benchmarks/gpu/model_bench.py --check --no-hf
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("FLA_FLASH_QLA", "0")


def check(out_dir: str, reps: int, quick: bool = False, hf: bool = True, budget: float = 130.0) -> dict:
    t0 = time.time()
    path = os.path.join(out_dir, "model_check.json")
    res = {"budget_s": budget, "stages": {}}

    def left() -> float:
        return budget - (time.time() - t0)

    def save():
        res["wall_s"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    def stage(name):
        res["stages"][name] = round(time.time() - t0, 1)
        print(f"[check] {time.time() - t0:5.0f} s  {name}", flush=True)
        save()

    import jax
    import jax.numpy as jnp

    from jax_gdn import bench_model as bm
    cases = bm._cases(quick)
    dev = str(jax.devices()[0].device_kind)
    res["device"] = dev
    peers = bm.load_peers(dev)
    dtype = jnp.float32 if quick else jnp.bfloat16
    nbytes = jnp.dtype(dtype).itemsize
    model = None
    try:
        model = bm.random_device_model(bm.check_config(quick), dtype, "auto")
        res["model"] = repr(model)
        stage("model built")
    except Exception as err:
        import traceback
        traceback.print_exc()
        res["model_error"] = f"{type(err).__name__}: {str(err)[:400]}"
    ours = {}
    if model is not None:
        # the 2-layer model's own rows first (~15 s on the H200): "model measured" beside the parts' sums
        try:
            ours = bm.our_rows(model, cases, reps, keys=("varlen", "decode"))
            res["rows"] = bm._rows(cases, ours, {})
            stage("2-layer rows done")
        except Exception as err:
            import traceback
            traceback.print_exc()
            res["rows_error"] = f"{type(err).__name__}: {str(err)[:400]}"
        try:
            # the parts, on an otherwise idle GPU; no in-program timing starts in the budget's last 15 s
            res["parts_ms"] = bm.measure_parts(model, cases, reps, ours=ours, peers=peers,
                                               deadline=t0 + budget - 15)
            stage("parts done")
        except Exception as err:
            import traceback
            traceback.print_exc()
            res["parts_error"] = f"{type(err).__name__}: {str(err)[:400]}"
    # row floors: the 8-layer bench rows (HF / ours from the results JSON) and the 2-layer rows just measured
    big = (bm.tiny_config if quick else bm.qwen3_next_80b_config)(bm.LAYERS)
    sec8 = {"rows": [], "layers": bm.LAYERS}
    bm.add_row_floors(sec8, big, cases, peers, nbytes, stored_rows=peers.get("model_rows"))
    res["row_floors"] = sec8["row_floors"]
    res["row_floors_source"] = {"path": peers.get("path"), "date": peers.get("date"),
                                "model_layers": peers.get("model_layers")} if peers else None
    sec2 = {"rows": res.get("rows") or [], "layers": 2}
    bm.add_row_floors(sec2, bm.check_config(quick), cases, peers, nbytes)
    res["row_floors_2_layers"] = sec2["row_floors"]
    del model
    stage("row floors done")
    if hf:
        # after the parts and rows: never beside them on the GPU
        try:
            r = subprocess.run([sys.executable, "-m", "jax_gdn.bench_model", "--hf-check"] + (["--quick"] if quick
                                                                                               else []),
                               stdout=subprocess.PIPE, stderr=None, text=True, timeout=max(30.0, left() + 60))
            line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
            res["hf_check"] = json.loads(line) if line else {"error": f"rc={r.returncode}: {r.stdout[-400:]}"}
        except subprocess.TimeoutExpired:
            res["hf_check"] = {"error": "HF check cut at its time limit"}
        stage("hf check done")
    save()
    sec = {"model": res.get("model"), "device": dev, "rows": res.get("rows") or [], "layers": 2,
           "parts_ms": res.get("parts_ms") or {}, "quick": quick, "row_floors": res["row_floors_2_layers"]}
    bm.print_section(sec, summary=False)
    src = res["row_floors_source"] or {}
    bm._print_row_floors(res["row_floors"], f" of the {bm.LAYERS}-layer bench rows (HF and ours: "
                                            f"{src.get('path') or 'none stored'} {src.get('date') or ''})")
    for k in ("model_error", "parts_error", "rows_error"):
        if k in res:
            print(f"  {k}: {res[k]}")
    if "hf_check" in res:
        h = res["hf_check"]
        print("HF check:", json.dumps({k: h.get(k) for k in ("prefill", "decode", "kernels", "s", "error")}, indent=1))
    print(f"check wall {time.time() - t0:.0f} s (budget {budget:.0f} s); the last lines: the summary")
    for line in bm.summary_lines(sec, extra_floors=res["row_floors"]):      # last: a run's tail keeps them
        print(line)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all stages, later ones skipped (default 380; with --check 130)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--check", action="store_true", help="the short correctness run (see the docstring)")
    p.add_argument("--quick", action="store_true", help="--check at tiny dims (a CPU dry run of the script)")
    a = p.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    if a.check:
        log = open(os.path.join(out_dir, "model_check.log"), "w")

        class Tee:                      # the printed tables also land in $OUT/model_check.log
            def write(self, x):
                log.write(x)
                log.flush()
                return sys.__stdout__.write(x)

            def flush(self):
                sys.__stdout__.flush()
        sys.stdout = Tee()
        check(out_dir, min(a.reps, 3), a.quick, hf=not a.no_hf, budget=a.budget or 130.0)
        return
    a.budget = a.budget or 380.0
    path = os.path.join(out_dir, "model.json")

    def save(section):
        with open(path, "w") as f:
            json.dump(section, f, indent=1, default=str)

    from jax_gdn.bench_model import print_section, run_section
    t0 = time.time()
    section = run_section(False, reps=a.reps, hf=not a.no_hf, compile_layers=0 if a.no_compile else None,
                          budget_s=a.budget, on_update=save)
    save(section)
    print(f"total {time.time() - t0:.0f} s")
    print_section(section)


if __name__ == "__main__":
    sys.exit(main())
