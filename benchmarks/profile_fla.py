"""Per-kernel CUDA times of FLA's chunk_gated_delta_rule forward (torch profiler), to budget our stages.

    FLA_FLASH_QLA=0 PYTHONPATH=$PWD python benchmarks/profile_fla.py [case,...]
"""
from __future__ import annotations

import sys

import torch

from jax_gdn.bench import fla_call, make_inputs_np
from jax_gdn.cases import BENCH_CASES


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["B1-T8192-Hk16-Hv32"]
    for case in [c for c in BENCH_CASES if c.name in names]:
        fn = fla_call(case, make_inputs_np(case))
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        reps = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        print(f"== {case.name}: FLA per-kernel CUDA time, mean of {reps} calls (ms)")
        rows = []
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "device_time_total", 0) > 0:
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                rows.append((t / reps / 1e3, e.count // reps, e.key[:90]))
        for t, n, key in sorted(rows, reverse=True)[:14]:
            print(f"  {t:8.4f}  x{n:<3d} {key}")
        print(f"  total {sum(r[0] for r in rows):.4f}")


if __name__ == "__main__":
    main()
