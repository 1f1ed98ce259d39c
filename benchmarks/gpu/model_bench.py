"""GPU run of the whole-model section (jax_gdn.bench_model): our rows, then HF transformers in a child process,
the 48-layer compile in a child process, then the parts. Writes $OUT/model.json after every stage (a run cut by
its time limit keeps what it measured) and prints the table last.

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD FLA_FLASH_QLA=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
    python benchmarks/gpu/model_bench.py --budget 300 2>&1 | tee $OUT/log.txt      # no grep in the pipe: it buffers
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("FLA_FLASH_QLA", "0")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=300.0, help="seconds for all stages (later ones are skipped)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    path = os.path.join(os.environ.get("OUT", "/tmp"), "model.json")

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
