"""One timing method for every column of every benchmark table (JAX and torch alike).

    ms = time_jax(fn, args)                 # jitted JAX callable
    ms = time_calls(fn, sync)               # any callable, closed by sync(result), e.g. torch.cuda.synchronize
    ms = time_threaded(step, state, sync)   # state = step(state), e.g. a donated pool

The method: ``warmup`` calls, then ``groups`` groups of ``per_group`` back-to-back calls, each group closed by one
sync (``jax.block_until_ready``, or the sync the caller passes: benchmarks/timing.py passes torch's); the result is
the median over the groups of the wall time per call, in ms. No cache flush for anyone (a case whose inputs fit the 50 MB L2 of an H200 runs warm for every
column alike).

``per_group=None`` (the default) sizes the groups from one probe group of ``MIN_PER_GROUP`` calls so that a group
lasts about ``GROUP_MS`` (between ``MIN_PER_GROUP`` and ``MAX_PER_GROUP`` calls). Why: each group pays a fixed cost
that is not the op's, the first call's dispatch latency and the closing sync (~0.1-0.2 ms on the H200); in groups
of 10 calls of a 0.15 ms op that was 10-15% of the figure.
With groups of ~20 ms it is ~1%, and what is left per call is the op's own cost in a pipelined loop: its kernels,
the gaps between them, and its host dispatch where that is slower than the GPU (a host-bound caller pays that too).

triton's ``do_bench`` (CUDA events around each call, L2 flushed between calls) measures something else (GPU time
only, cold L2); the benchmarks keep its figure for torch anchors beside theirs as ``*_do_bench``, never in a ratio.
"""
from __future__ import annotations

import math
import statistics
import time

#: target wall time of one timed group (ms) when per_group is None
GROUP_MS = 20.0
MIN_PER_GROUP = 10
MAX_PER_GROUP = 1000


def group_size(probe_ms: float, group_ms: float = GROUP_MS) -> int:
    """Calls per group for an op of ``probe_ms`` per call: about ``group_ms`` of work, clamped to
    [MIN_PER_GROUP, MAX_PER_GROUP]."""
    if not probe_ms > 0:
        return MAX_PER_GROUP
    return int(min(MAX_PER_GROUP, max(MIN_PER_GROUP, math.ceil(group_ms / probe_ms))))


def time_calls(call, sync, *, warmup: int = 3, groups: int = 15, per_group: int | None = None,
               group_ms: float = GROUP_MS, slow_ms: float | None = None) -> float:
    """Median ms per call of ``call()`` (its result handed to ``sync`` at the end of each group).

    per_group: calls per group; None sizes it from a probe group (see the module doc). slow_ms: if one more call
    takes longer than this, time 5 single calls instead (slow reference paths)."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if per_group is not None and per_group < 1:
        raise ValueError(f"per_group must be None or >= 1, got {per_group}")
    for _ in range(warmup):
        sync(call())
    if slow_ms is not None:
        t0 = time.perf_counter()
        sync(call())
        if (time.perf_counter() - t0) * 1e3 > slow_ms:
            groups, per_group = min(groups, 5), 1

    def one_group(n):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = call()
        sync(out)
        return (time.perf_counter() - t0) / n * 1e3

    if per_group is None:
        per_group = group_size(one_group(MIN_PER_GROUP), group_ms)
    return statistics.median(one_group(per_group) for _ in range(groups))


def jax_sync(out):
    """``jax.block_until_ready(out)`` (returned): the sync of every JAX column."""
    import jax
    return jax.block_until_ready(out)


def time_jax(fn, args, **kw) -> float:
    """``time_calls`` of ``fn(*args)`` closed by ``jax.block_until_ready``."""
    return time_calls(lambda: fn(*args), jax_sync, **kw)


def time_threaded(step, state, sync="jax", **kw) -> float:
    """``time_calls`` of ``state = step(state)`` (each call's result feeds the next: a donated state pool); ``sync``
    is ``"jax"`` or a callable given the new state (e.g. one that calls ``torch.cuda.synchronize``)."""
    if sync == "jax":
        sync = jax_sync
    elif not callable(sync):
        raise ValueError(f"sync must be 'jax' or a callable, got {sync!r}")
    box = [state]

    def call():
        box[0] = step(box[0])
        return box[0]
    return time_calls(call, sync, **kw)
