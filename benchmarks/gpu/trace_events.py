"""The GPU kernel events of a jax.profiler Perfetto trace, for the GPU scripts of this folder (shard_x2.py's
profile case, attn_decode.py's kernel table): one reader, each script sums the events its own way.

    from trace_events import gpu_events        # a script run as `python benchmarks/gpu/<name>.py` has this
    for proc, thread, name, ms in gpu_events(trace_dir):   # folder on sys.path
        ...
"""
from __future__ import annotations

import glob
import gzip
import json
import os


def gpu_events(trace_dir: str):
    """(process name, thread name, event name, duration ms) of every complete event ("ph" X with a duration) on a
    GPU process of the newest ``perfetto_trace.json.gz`` under ``trace_dir``. Kernels are the events on threads
    whose name starts with "Stream"; the other GPU lines (memcpy, ...) are kept for a trace without them."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    trace = json.load(gzip.open(sorted(files)[-1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events if e.get("ph") == "M"
               and e.get("name") == "thread_name"}
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        proc = procs.get(e["pid"], "")
        if "gpu" in proc.lower():
            out.append((proc, threads.get((e["pid"], e.get("tid")), ""), e["name"], e["dur"] / 1e3))
    return out, sorted(set(procs.values()))
