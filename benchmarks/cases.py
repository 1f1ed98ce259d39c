"""The one list of named shapes that the kernel tests and the benchmarks draw from.

Shape legend: B batch rows, T tokens per row (the packed total for varlen), Hk key heads, Hv value heads,
K / V head dims, lens the per-sequence lengths of a varlen case (then B == 1 and T == sum(lens)).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np

VARLEN16_LENS = (1907, 64, 513, 2048, 130, 777, 1, 4000, 63, 65, 1500, 3000, 260, 999, 2200, 1500)
# Serving mixes. Many short sequences: 256 lengths from a long-tailed law (log-normal, mean ~150),
#   numpy.random.default_rng(0).lognormal(log(150) - 0.5, 1.0, 256), rounded, clipped to [1, 2048]:
#   38567 tokens, 4 to 1952 per sequence, 97 of them <= 64, 732 chunks of 64 (the static bound T // 64 + N: 858).
SERVE256_LENS = (
    103, 80, 173, 101, 53, 131, 335, 235, 45, 26, 49, 95, 9, 73, 26, 44, 53, 66, 137, 258, 80, 357, 47, 129, 225,
    100, 43, 36, 58, 113, 33, 74, 78, 156, 113, 130, 47, 80, 199, 405, 26, 413, 350, 199, 119, 66, 391, 646, 551,
    339, 130, 27, 91, 175, 25, 135, 140, 182, 28, 47, 59, 28, 518, 55, 126, 70, 443, 341, 171, 10, 96, 180, 248, 49,
    563, 24, 47, 232, 96, 674, 110, 48, 62, 31, 25, 171, 163, 332, 43, 493, 68, 439, 59, 44, 117, 255, 107, 51, 24,
    22, 150, 245, 77, 31, 218, 25, 45, 169, 10, 134, 51, 101, 84, 111, 182, 43, 377, 188, 212, 292, 200, 212, 98,
    22, 79, 42, 22, 118, 52, 32, 32, 119, 130, 341, 90, 258, 370, 287, 9, 311, 128, 139, 132, 133, 125, 64, 14, 82,
    41, 268, 68, 99, 39, 55, 90, 21, 123, 82, 28, 8, 152, 68, 54, 72, 560, 87, 99, 21, 472, 228, 264, 95, 228, 132,
    168, 78, 21, 255, 13, 72, 74, 32, 168, 74, 59, 153, 56, 365, 129, 57, 13, 25, 270, 86, 69, 471, 25, 51, 57, 164,
    47, 49, 18, 189, 204, 57, 107, 25, 57, 361, 104, 917, 41, 163, 75, 160, 90, 52, 38, 1952, 84, 12, 48, 179, 55,
    355, 248, 78, 57, 33, 45, 21, 303, 446, 26, 28, 16, 35, 4, 29, 333, 64, 214, 56, 529, 111, 62, 1168, 66, 27,
    111, 88, 264, 36, 203, 213,
)
# Dozens of 1-4 token sequences (decode-like tails): default_rng(64).integers(1, 5, 64), 171 tokens.
TINY64_LENS = (
    3, 4, 4, 3, 1, 1, 1, 2, 3, 4, 4, 1, 2, 4, 4, 3, 4, 1, 3, 1, 3, 2, 2, 3, 4, 3, 2, 1, 2, 4, 1, 3, 3, 3, 3, 4, 1,
    3, 3, 3, 4, 3, 2, 4, 1, 4, 4, 1, 1, 4, 4, 1, 1, 2, 2, 1, 4, 4, 4, 1, 4, 4, 4, 1,
)
# One long sequence among many short ones (a long prompt joining a serving batch): 16384 tokens in the middle of
#   serve256's first 63 sequences, 25664 tokens (a multiple of 8: read in place).
LONG1_SHORT63_LENS = SERVE256_LENS[:32] + (16384,) + SERVE256_LENS[32:63]


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
    _varlen("serve256-T38567-Hk16-Hv32", SERVE256_LENS, 16, 32),
    _varlen("tiny64-T171-Hk16-Hv32", TINY64_LENS, 16, 32),
    _dense(1, 131072, 16, 32),
    _varlen("long16k-short63-T25664-Hk16-Hv32", LONG1_SHORT63_LENS, 16, 32),
    _varlen("packed1-T32768-Hk16-Hv32", (32768,), 16, 32),       # the model's long stream: one packed sequence
)

#: the backward section's rows: the GDN bench's first eight (dense rows of 80B dims and the packed mixes; the training
#: step's packed documents are the varlen rows)
BACKWARD_CASES = BENCH_CASES[:8]
CPU_BACKWARD = (Case("cpu-B1-T70-Hk1-Hv2-K16-V16", 1, 70, 1, 2, 16, 16),)

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


# ---- the whole-model rows (benchmarks.model, benchmarks.sharding) ----
def model_cases(quick: bool = False) -> dict:
    """{"varlen": (name, lens), "long": (name, (T,)), "decode": (name, N streams, context per stream, streams per
    context-filling prefill call)}: the varlen16 mix, one 32768-token stream, 64 streams x 1189 tokens (16 x 1189
    fits the varlen16 program's token bucket); ``quick``: tiny stand-ins (a CPU smoke run)."""
    if quick:
        lens = (37, 1, 64, 5)
        return {"varlen": ("varlen4-T107", lens), "long": ("B1-T200", (200,)),
                "decode": ("decode-N8-ctx26", 8, 26, 4)}          # 2 prefill calls of 4 x 26 tokens
    t = sum(VARLEN16_LENS)
    ctx = t // 16                                                  # 1189: 16 x 1189 fits varlen16's bucket
    return {"varlen": (f"varlen16-T{t}", VARLEN16_LENS), "long": ("B1-T32768", (32768,)),
            "decode": (f"decode-N64-ctx{ctx}", 64, ctx, 16)}


def cu_seqlens(lens) -> np.ndarray:
    """[N + 1] int32 offsets of streams of ``lens`` tokens packed back to back."""
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
