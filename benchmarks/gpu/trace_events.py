"""The events of a jax.profiler Perfetto trace, for the GPU scripts of this folder (shard_x2.py's profile case,
attn_decode*.py's kernel tables and timeline, runtime_s6.py's host / device split): one reader (``load_trace``),
each script sums the events its own way.

    from trace_events import gpu_events        # a script run as `python benchmarks/gpu/<name>.py` has this
    for proc, thread, name, ms in gpu_events(trace_dir)[0]:   # folder on sys.path
        ...
"""
from __future__ import annotations

import glob
import gzip
import json
import os


def load_trace(trace_dir: str):
    """The newest ``perfetto_trace.json.gz`` under ``trace_dir``: (its complete events ("ph" X with a duration), each
    tagged with "proc" (its process name) and "thread" (its thread name), sorted by start; the process names)."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    trace = json.load(gzip.open(sorted(files)[-1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events if e.get("ph") == "M"
               and e.get("name") == "thread_name"}
    xs = [dict(e, proc=procs.get(e["pid"], ""), thread=threads.get((e["pid"], e.get("tid")), ""))
          for e in events if e.get("ph") == "X" and "dur" in e]
    return sorted(xs, key=lambda e: e["ts"]), sorted(set(procs.values()))


def is_gpu(e) -> bool:
    """An event of ``load_trace`` on a GPU process."""
    return "gpu" in e["proc"].lower()


def is_kernel(e) -> bool:
    """A GPU kernel: an event on a GPU process's "Stream" thread."""
    return is_gpu(e) and e["thread"].lower().startswith("stream")


def gpu_events(trace_dir: str):
    """(process name, thread name, event name, duration ms) of every complete event on a GPU process of the newest
    trace under ``trace_dir``. Kernels are the events on threads whose name starts with "Stream"; the other GPU
    lines (memcpy, ...) are kept for a trace without them."""
    events, procs = load_trace(trace_dir)
    return [(e["proc"], e["thread"], e["name"], e["dur"] / 1e3) for e in events if is_gpu(e)], procs
