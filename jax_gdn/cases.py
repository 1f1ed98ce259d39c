"""The one list of named shapes that the kernel tests and the benchmark draw from.

Shape legend: B batch rows, T tokens per row (the packed total for varlen), Hk key heads, Hv value heads,
K / V head dims, lens the per-sequence lengths of a varlen case (then B == 1 and T == sum(lens)).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

VARLEN16_LENS = (1907, 64, 513, 2048, 130, 777, 1, 4000, 63, 65, 1500, 3000, 260, 999, 2200, 1500)


@dataclasses.dataclass(frozen=True)
class Case:
    """One named problem shape."""

    name: str
    B: int
    T: int
    Hk: int
    Hv: int
    K: int
    V: int
    lens: Optional[Tuple[int, ...]] = None

    @property
    def num_seqs(self) -> int:
        return len(self.lens) if self.lens is not None else self.B

    def cu_seqlens(self):
        """Host list [N + 1] for varlen cases, None for dense ones."""
        if self.lens is None:
            return None
        out = [0]
        for n in self.lens:
            out.append(out[-1] + n)
        return out


def _dense(b, t, hk, hv, k=128, v=128):
    return Case(f"B{b}-T{t}-Hk{hk}-Hv{hv}", b, t, hk, hv, k, v)


def _varlen(name, lens, hk, hv, k=128, v=128):
    return Case(name, 1, sum(lens), hk, hv, k, v, tuple(lens))


# ---- benchmark (H200, K = V = 128, bf16 q/k/v, fp32 g and state) ----
BENCH_CASES = (
    _dense(1, 8192, 16, 32),
    _dense(4, 4096, 16, 32),
    _dense(1, 32768, 16, 32),
    _dense(16, 1024, 16, 32),
    _dense(1, 8192, 2, 8),
    _varlen("varlen16-T19027-Hk16-Hv32", VARLEN16_LENS, 16, 32),
)

# ---- GPU tests (K = V = 128; odd lengths, grouped heads, varlen with a zero-length and a one-token sequence) ----
GPU_TEST_CASES = (
    _dense(2, 1000, 2, 4),
    _dense(1, 130, 1, 3),
    _varlen("varlen6-Hk2-Hv6", (65, 1, 0, 200, 63, 130), 2, 6),
)

# ---- CPU interpret-mode tests (tiny dims, dk != dv) ----
CPU_ODD_LENGTHS = (1, 63, 64, 65, 130)
CPU_DENSE = tuple(Case(f"cpu-B2-T{t}-Hk2-Hv4-K16-V8", 2, t, 2, 4, 16, 8) for t in CPU_ODD_LENGTHS)
CPU_GVA = (
    Case("cpu-B1-T70-Hk2-Hv2-K8-V16", 1, 70, 2, 2, 8, 16),
    Case("cpu-B1-T70-Hk1-Hv3-K8-V16", 1, 70, 1, 3, 8, 16),
)
CPU_VARLEN = _varlen("cpu-varlen5-Hk1-Hv2-K16-V8", (5, 64, 0, 70, 1), 1, 2, 16, 8)
CPU_VARLEN_OTHER_LENS = (63, 2, 1, 10, 64)   # same T and N as CPU_VARLEN: must not recompile

# ---- decode (one token per stream over a state pool; T = 1, B = N streams; K = V = 128, Qwen3-Next heads) ----
DECODE_CASES = (
    Case("decode-N256-Hk16-Hv32", 256, 1, 16, 32, 128, 128),
    Case("decode-N64-Hk16-Hv32", 64, 1, 16, 32, 128, 128),
    Case("decode-N1-Hk16-Hv32", 1, 1, 16, 32, 128, 128),
)
CPU_DECODE = (Case("cpu-decode-N4-Hk1-Hv2-K16-V16", 4, 1, 1, 2, 16, 16),)

CASES = {c.name: c for c in (DECODE_CASES + CPU_DECODE + BENCH_CASES + GPU_TEST_CASES + CPU_DENSE + CPU_GVA
                             + (CPU_VARLEN,))}
