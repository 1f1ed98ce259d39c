"""Formatting shared by the sections' tables, and the peak rates every floor is computed at."""
from __future__ import annotations

#: dense bf16 matmul rate of the floors, TFLOP/s (H200: ~990 peak, ~700 reachable)
PEAK_TFLOPS = 700.0
#: H200 HBM bandwidth, TB/s
PEAK_TBPS = 4.8
#: H200 SXM dense bf16 tensor-core peak, TFLOP/s (the row floors' hardware bound beside PEAK_TFLOPS)
HW_PEAK_TFLOPS = 989.0


def fmt(x, spec: str = "{:.3f}") -> str:
    """``spec.format(x)``, or "-" for a missing value."""
    return "-" if x is None else spec.format(x)


def md_header(cols, text_cols: int = 1) -> list:
    """A markdown table's header and alignment lines: the first ``text_cols`` columns left, the rest right."""
    return ["| " + " | ".join(cols) + " |",
            "| " + " | ".join("---" if i < text_cols else "---:" for i in range(len(cols))) + " |"]
