"""GPU run of the whole-model section (jax_gdn.bench_model) and, when time is left, a short serving simulation at
80B dims. Writes $OUT/model.json (partial results after every stage) and prints the table last.

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD FLA_FLASH_QLA=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
        python benchmarks/gpu/model_bench.py [--budget 200] [--reps 5] [--sim]
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
    p.add_argument("--budget", type=float, default=200.0, help="seconds for the model section's stages")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sim", action="store_true", help="then a short serve-sim at 80B dims (4 layers)")
    p.add_argument("--no-hf", action="store_true")
    a = p.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    path = os.path.join(out_dir, "model.json")

    def save(section):
        with open(path, "w") as f:
            json.dump(section, f, indent=1, default=str)

    from jax_gdn.bench_model import print_section, run_section
    t0 = time.time()
    section = run_section(False, reps=a.reps, hf=not a.no_hf, budget_s=a.budget, on_update=save)
    save(section)
    if a.sim:
        from jax_gdn.serve_sim import SimConfig, build_model, simulate
        try:
            model = build_model(None, "80b", 4, "bfloat16", "auto")
            res = simulate(model, SimConfig(num_requests=16, max_seqs=8, token_budget=2048, prompt_len=(16, 4000),
                                            gen_len=(1, 16), rate=0.5), progress=False)
            res.pop("per_request", None)
            with open(os.path.join(out_dir, "serve_sim.json"), "w") as f:
                json.dump(res, f, indent=1)
        except Exception as err:
            print(f"serve-sim failed: {type(err).__name__}: {err}")
    print(f"total {time.time() - t0:.0f} s")
    print_section(section)


if __name__ == "__main__":
    sys.exit(main())
