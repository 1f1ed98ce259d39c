"""GPU kernel time of one call, from a jax.profiler trace: summed by kind and by kernel name.

    wall_ms, kinds, top, calls = kernel_time(lambda: step(state, batch), jax_sync)

``gpu_events`` reads the newest Perfetto trace under a folder; ``kind`` names what a kernel is (``KINDS``: our
Pallas kernels by the names their ``pallas_call`` gives them, cuBLAS / cuDNN / XLA's own by the words their names
carry); ``kernel_time`` traces one call into a temporary folder (removed after) and sums its kernels. The wall
time of the traced call includes the profiler's overhead: it is a cross-check of the sum, not a figure of record.
"""
from __future__ import annotations

#: (kind, words any of which in a kernel's lower-cased name puts it there), the first match wins
KINDS = (("collective", ("nccl", "all-reduce", "allreduce", "all_reduce")),
         ("moe kernels", ("moe_",)),
         ("gdn backward kernels", ("gdn_mosaic_state_bwd", "gdn_mosaic_chunk_grads", "_bwd")),
         ("gdn kernels", ("gdn_", "conv1d_silu")),
         ("attention kernels", ("paged_attention", "paged_kv", "cudnn", "fmha", "flash")),
         ("sort", ("sort", "radix")),
         ("gemm", ("gemm", "cublas", "xmma", "cutlass", "matmul", "dot", "nvjet")),
         ("copy", ("memcpy", "memset", "copy")),
         ("xla fusion", ("fusion", "loop_", "input_", "reduce", "scatter", "gather", "transpose", "concatenate")))


def kind(name: str) -> str:
    """The ``KINDS`` entry of a kernel name ("other" if none)."""
    low = name.lower()
    for k, words in KINDS:
        if any(w in low for w in words):
            return k
    return "other"


def gpu_events(trace_dir: str) -> list:
    """(process name, thread name, event name, duration ms) of every complete event on a GPU process of the newest
    jax.profiler Perfetto trace under ``trace_dir``; kernels are the events on threads whose name starts with
    "Stream"."""
    import glob
    import gzip
    import json
    import os
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    trace = json.load(gzip.open(sorted(files)[-1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events if e.get("ph") == "M"
               and e.get("name") == "thread_name"}
    out = []
    for e in sorted((e for e in events if e.get("ph") == "X" and "dur" in e), key=lambda e: e["ts"]):
        proc = procs.get(e["pid"], "")
        if "gpu" in proc.lower():
            out.append((proc, threads.get((e["pid"], e.get("tid")), ""), e["name"], e["dur"] / 1e3))
    return out


def kernel_time(call, sync, top: int = 10) -> tuple:
    """(wall ms of the traced call, {kind: ms} costliest first, {kernel name (60 chars): ms} of the ``top``
    costliest, {the same names: launches}) for one ``call()`` closed by ``sync`` on its result. The call must be
    compiled already (a compile inside the trace would be timed too). Kernels are the events on the trace's
    "Stream" threads of every GPU."""
    import shutil
    import tempfile
    import time

    import jax
    out = tempfile.mkdtemp(prefix="kernel_trace_")
    try:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            t0 = time.perf_counter()
            sync(call())
            wall = (time.perf_counter() - t0) * 1e3
        kinds, names, calls = {}, {}, {}
        for _, thread, name, ms in gpu_events(out):
            if thread.lower().startswith("stream"):
                k = kind(name)
                kinds[k] = kinds.get(k, 0.0) + ms
                names[name[:60]] = names.get(name[:60], 0.0) + ms
                calls[name[:60]] = calls.get(name[:60], 0) + 1
    finally:
        shutil.rmtree(out, ignore_errors=True)
    kinds = {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    names = {k: round(v, 3) for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:top]}
    return round(wall, 2), kinds, names, {k: calls[k] for k in names}
