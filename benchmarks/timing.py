"""Timing glue of the benchmarks: torch's side of ``jax_gdn.timing`` (the one method of every column), triton's
do_bench figure kept beside torch anchors, and the timings of the whole-model section (blocking medians, pipelined
batches); the in-program timing of the model's parts is in ``benchmarks.model_parts``.
"""
from __future__ import annotations

import statistics
import time

from jax_gdn.timing import time_calls, time_threaded


def torch_sync(_out=None):
    """``torch.cuda.synchronize()``: the sync of every torch column."""
    import torch
    torch.cuda.synchronize()


def time_torch(fn, **kw) -> float:
    """``jax_gdn.timing.time_calls`` of the torch callable ``fn()`` closed by ``torch.cuda.synchronize``."""
    return time_calls(fn, torch_sync, **kw)


def time_torch_threaded(step, state, **kw) -> float:
    """``jax_gdn.timing.time_threaded`` of ``state = step(state)`` on torch tensors (closed by torch's sync)."""
    return time_threaded(step, state, torch_sync, **kw)


def do_bench(fn, warmup: int = 50, rep: int = 300) -> float:
    """triton's ``do_bench`` median ms of ``fn`` (CUDA events, L2 flushed between calls): kept beside a torch
    anchor's figure as ``*_do_bench``, never in a ratio."""
    import triton
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def median_ms(call, sync, reps: int, prepare=None) -> float:
    """Median wall ms of ``call()`` closed by ``sync(result)``; ``prepare()`` (untimed, synced) before each."""
    times = []
    for _ in range(max(1, reps)):
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        sync(call())
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


PIPE_CALLS = 10   # R: the calls of one pipelined batch of a part (parts_ms "ms")


def pipelined_ms(call, sync, calls: int = PIPE_CALLS, batches: int = 3) -> float:
    """Pipelined ms per call: ``calls`` calls of ``call()`` queued back to back with no sync in between, then ONE
    ``sync`` of the list of all their results; the wall time of the batch / ``calls``, median over ``batches``
    batches. No per-call launch + sync gap is paid, as inside the model's one compiled program (each call still
    pays its own host dispatch, overlapped with the device's work on the calls before it: a call whose device time
    is below its dispatch time reads the dispatch time, an upper bound of what the model spends on it). All R
    results are held until the sync (no reliance on one device queue's order); the batch's list is dropped before
    the next batch."""
    times = []
    for _ in range(max(1, batches)):
        t0 = time.perf_counter()
        outs = [call() for _ in range(max(1, calls))]
        sync(outs)
        times.append((time.perf_counter() - t0) * 1e3 / max(1, calls))
        del outs
    return float(statistics.median(times))
