"""Merge a model-section run made without HF (``benchmarks/gpu/model_bench.py --no-hf --no-compile``: our rows,
parts and floors) into a results JSON whose "model" section holds HF's rows from an earlier run of HF's unchanged
code: HF's ms (and do_bench ms) per case are carried over with where they came from ("hf_from"), the ratios are
recomputed from the new rows (speedup = HF ms / ours, HF over each row floor), and the HF metadata and the 48-layer
compile figure are kept when the new run has none.

    python benchmarks/merge_model_section.py NEW_model.json RESULTS.json --hf-from "2026-11-30T23:30 run" \
        --note "..."            # writes RESULTS.json in place, runs["model"] = {date, note}
"""
from __future__ import annotations

import argparse
import datetime
import json


def merge(new: dict, old: dict, hf_from: str) -> dict:
    """The new model section with the old section's HF figures per case (and its HF / compile metadata)."""
    old_rows = {r["case"]: r for r in old.get("rows", [])}
    for row in new["rows"]:
        prev = old_rows.get(row["case"])
        if prev is None or prev["ms"].get("hf") is None:
            continue
        hf = prev["ms"]["hf"]
        row["ms"]["hf"] = hf
        row["tokens_per_s"]["hf"] = row["tokens"] / hf * 1e3
        row["speedup"] = hf / row["ms"]["ours"]
        for key, floor in (("hf_over_floor", "row_floor_ms"), ("hf_over_roofline", "row_floor_roofline_ms"),
                           ("hf_over_hw_peak", "row_floor_hw_peak_ms")):
            if row.get(floor):
                row[key] = hf / row[floor]
        row["hf_do_bench_ms"] = prev.get("hf_do_bench_ms")
        row["hf_from"] = prev.get("hf_from", hf_from)
    for key in ("hf", "compile"):
        if key in old and key not in new:
            new[key] = old[key]
    if new.get("compile_s_48_layers") is None:
        new["compile_s_48_layers"] = old.get("compile_s_48_layers")
    return new


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("new")
    p.add_argument("results")
    p.add_argument("--hf-from", default="an earlier run (HF's code and FLA's kernels unchanged)")
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    with open(a.new) as f:
        new = json.load(f)
    with open(a.results) as f:
        results = json.load(f)
    results["model"] = merge(new, results.get("model", {}), a.hf_from)
    results.setdefault("runs", {})["model"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "note": a.note}
    with open(a.results, "w") as f:
        json.dump(results, f, indent=1)
    for r in results["model"]["rows"]:
        print(r["case"], round(r["ms"]["ours"], 2), r["ms"].get("hf"), r.get("speedup"))


if __name__ == "__main__":
    main()
