"""GPU run of the whole-model section (jax_gdn.bench_model): our rows, then HF transformers in a child process
(on FLA's kernels: jax_gdn.bench_model.fla_kernels), the 48-layer compile in a child process, then the parts
(prefill and decode, each against its floor). Writes $OUT/model.json after every stage (a run cut by its time
limit keeps what it measured) and prints the table last.

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD FLA_FLASH_QLA=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
    python benchmarks/gpu/model_bench.py --budget 380 2>&1 | tee $OUT/log.txt      # no grep in the pipe: it buffers

``--check`` (a short correctness run, not a measurement): HF on FLA's kernels against HF's torch path (a child
process: ``python -m jax_gdn.bench_model --hf-check``, 2 layers at 80B dims, bf16) while this process runs the
parts (prefill varlen16 and decode 64 x 1189, with floors) on a 2-layer model (one GDN, one attention layer) at
80B dims; writes $OUT/model_check.json. ``--check --quick``: the same at tiny dims (a CPU dry run of the script;
the HF check then reports that FLA's kernels need a GPU).
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("FLA_FLASH_QLA", "0")


def check(out_dir: str, reps: int, quick: bool = False) -> dict:
    t0 = time.time()
    hf = subprocess.Popen([sys.executable, "-m", "jax_gdn.bench_model", "--hf-check"] + (["--quick"] if quick else []),
                          stdout=subprocess.PIPE, stderr=None, text=True)
    res = {}
    try:
        import jax.numpy as jnp

        from jax_gdn.bench_model import (_cases, check_config, load_peers, measure_parts, print_section,
                                         random_device_model)
        model = random_device_model(check_config(quick), jnp.float32 if quick else jnp.bfloat16, "auto")
        import jax
        dev = str(jax.devices()[0].device_kind)
        res["model"] = repr(model)
        res["parts_ms"] = measure_parts(model, _cases(quick), reps, peers=load_peers(dev))
        res["parts_s"] = round(time.time() - t0, 1)
        print(f"[check] parts done at {time.time() - t0:.0f} s", flush=True)
    except Exception as err:
        import traceback
        traceback.print_exc()
        res["parts_error"] = f"{type(err).__name__}: {str(err)[:400]}"
    try:
        stdout, _ = hf.communicate(timeout=max(10.0, 300 - (time.time() - t0)))
        line = next((x for x in reversed(stdout.splitlines()) if x.startswith("{")), None)
        res["hf_check"] = json.loads(line) if line else {"error": f"rc={hf.returncode}: {stdout[-400:]}"}
    except subprocess.TimeoutExpired:
        hf.kill()
        res["hf_check"] = {"error": "HF check cut at its time limit"}
    res["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(out_dir, "model_check.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    if "parts_ms" in res:
        print_section({"model": res["model"], "device": dev, "rows": [], "parts_ms": res["parts_ms"], "quick": quick})
    h = res["hf_check"]
    print("HF check:", json.dumps({k: h.get(k) for k in ("prefill", "decode", "kernels", "s", "error")}, indent=1))
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=380.0, help="seconds for all stages (later ones are skipped)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--check", action="store_true", help="the short correctness run (see the docstring)")
    p.add_argument("--quick", action="store_true", help="--check at tiny dims (a CPU dry run of the script)")
    a = p.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    if a.check:
        check(out_dir, min(a.reps, 3), a.quick)
        return
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
