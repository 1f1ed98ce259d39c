"""Section "moe": one sparse MoE layer (routing + routed experts + gated shared expert), bf16.

Cases: Qwen3-Next-80B-A3B dims (hidden 2048, 512 experts top-10, moe_intermediate 512, shared expert 512) at 8192
and 19027 tokens, and Qwen3.5-35B-A3B dims (hidden 2048, 256 experts top-8, moe_intermediate 512, shared 512) at
19027 tokens (prefill); then the 80B layer at decode sizes, 1, 8, 64 and 256 tokens (the model's decode step of
N streams runs the MoE on N tokens). Random bf16 weights are made on the device. Columns:
``jax_gdn.layers.ffn.sparse_moe`` with backend "pallas" (the Triton grouped-GEMM kernels of pallas_kernels/moe,
launch config picked from the shapes) and "xla" (the XLA block path), each null where it cannot run. floor_ms:
prefill rows, the layer's FLOPs (router + T k routed SwiGLU experts + shared expert) at 700 TFLOP/s; decode rows
(``"floor": "bytes"``), the bytes the layer must read at 4.8 TB/s: the weights of the experts its routing hits
(``experts_hit``, counted from the case's own inputs) + router + shared expert + x in and out. Timing:
jax_gdn.timing.time_jax (warm-up, then the median of groups of back-to-back calls closed by block_until_ready).

    run_section(quick=False) -> {"rows": [{"case", "tokens", "experts", "top_k", "ms": {"pallas", "xla"},
                                           "floor_ms"[, "floor": "bytes", "experts_hit"]}]}
``quick``: tiny dims (a CPU smoke run of the code path, not a measurement).
"""
from __future__ import annotations

import dataclasses
import traceback

from benchmarks.tables import PEAK_TBPS, PEAK_TFLOPS, fmt, md_header

KEY = "moe"
IMPLS = ("pallas", "xla")


@dataclasses.dataclass(frozen=True)
class MoeCase:
    name: str
    tokens: int
    hidden: int
    experts: int
    top_k: int
    inter: int
    shared: int
    decode: bool = False          # floor by bytes (weights of the experts hit), not by FLOPs

    def flops(self) -> float:
        t, d = self.tokens, self.hidden
        return 2.0 * t * (d * self.experts + self.top_k * 3 * d * self.inter + 3 * d * self.shared + d)

    def bytes(self, experts_hit: int, itemsize: int = 2) -> float:
        """Bytes the layer must move: the hit experts' gate_up + down weights, router, shared expert (+ gate),
        x read and the output written."""
        d = self.hidden
        return itemsize * (experts_hit * 3 * d * self.inter + d * self.experts + 3 * d * self.shared + d
                           + 2 * self.tokens * d)


CASES = (
    MoeCase("qwen3_next_80b_t8192", 8192, 2048, 512, 10, 512, 512),
    MoeCase("qwen3_next_80b_t19027", 19027, 2048, 512, 10, 512, 512),
    MoeCase("qwen3_5_35b_a3b_t19027", 19027, 2048, 256, 8, 512, 512),
) + tuple(MoeCase(f"qwen3_next_80b_decode_t{t}", t, 2048, 512, 10, 512, 512, decode=True) for t in (1, 8, 64, 256))
QUICK_CASES = (MoeCase("tiny_t65", 65, 64, 16, 4, 32, 32), MoeCase("tiny_decode_t4", 4, 64, 16, 4, 32, 32, True))


def make_params(case: MoeCase, seed: int = 0, dtype=None):
    """Random weights on the default device (ffn.py's layout), scaled by fan-in; x [T, D]."""
    import jax
    import jax.numpy as jnp
    dtype = dtype or jnp.bfloat16
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    d, e, i, s = case.hidden, case.experts, case.inter, case.shared

    def w(k, shape, fan_in):
        return (jax.random.normal(k, shape, dtype) * fan_in ** -0.5).astype(dtype)
    params = {"router": w(ks[0], (d, e), d), "experts_gate_up": w(ks[1], (e, d, 2 * i), d),
              "experts_down": w(ks[2], (e, i, d), i),
              "shared_expert": {"gate_proj": w(ks[3], (d, s), d), "up_proj": w(ks[4], (d, s), d),
                                "down_proj": w(ks[5], (s, d), s)},
              "shared_expert_gate": w(ks[6], (d, 1), d)}
    x = jax.random.normal(ks[7], (case.tokens, d), dtype)
    return params, x


def _time_impl(case: MoeCase, params, x, backend: str, quick: bool):
    import jax
    from jax_gdn.timing import time_jax
    from jax_gdn.layers.ffn import sparse_moe
    fn = jax.jit(lambda p, x: sparse_moe(p, x, top_k=case.top_k, norm_topk_prob=True, backend=backend))
    if quick:
        return time_jax(fn, (params, x), warmup=1, groups=2, per_group=1)
    return time_jax(fn, (params, x), warmup=3, groups=10, per_group=20 if case.decode else 5)


def experts_hit(case: MoeCase, params, x) -> int:
    """Distinct experts the case's routing selects (a host count, outside any timing)."""
    import jax
    import numpy as np
    from jax_gdn.layers.ffn import moe_route
    _, top_i = jax.jit(lambda r, x: moe_route(r, x, case.top_k, True))(params["router"], x)
    return int(np.unique(np.asarray(top_i)).size)


def floor_of(case: MoeCase, params, x) -> dict:
    """{"floor_ms"} by FLOPs (prefill) or {"floor_ms", "floor": "bytes", "experts_hit"} (decode)."""
    if not case.decode:
        return {"floor_ms": float(f"{case.flops() / (PEAK_TFLOPS * 1e12) * 1e3:.4g}")}
    hit = experts_hit(case, params, x)
    return {"floor_ms": float(f"{case.bytes(hit) / (PEAK_TBPS * 1e12) * 1e3:.4g}"), "floor": "bytes",
            "experts_hit": hit}


def run_section(quick: bool = False, cases=None) -> dict:
    """{"rows": [...]} of ``cases`` (names; default every case; ``quick``: QUICK_CASES)."""
    import jax
    from jax_gdn.layers.ffn import resolve_moe_backend
    rows = []
    for case in (QUICK_CASES if quick else CASES):
        if cases is not None and case.name not in cases:
            continue
        params, x = make_params(case)
        jax.block_until_ready((params, x))
        ms = {}
        for impl in IMPLS:
            try:
                if impl == "pallas" and resolve_moe_backend("auto", x, params["experts_gate_up"]) != "pallas":
                    ms[impl] = None                      # no GPU (or dims the kernel does not take)
                    continue
                ms[impl] = float(f"{_time_impl(case, params, x, impl, quick):.4g}")
            except Exception:                                                   # noqa: BLE001
                traceback.print_exc()
                ms[impl] = None
        rows.append({"case": case.name, "tokens": case.tokens, "experts": case.experts, "top_k": case.top_k,
                     "ms": ms, **floor_of(case, params, x)})
        del params, x
    return {"rows": rows}


def print_section(section: dict) -> None:
    print(f"\nMoE layer (routing + routed + shared expert), bf16, ms; floor = FLOPs at {PEAK_TFLOPS:.0f} TFLOP/s, "
          f"decode rows (*): bytes of the experts hit + router + shared at {PEAK_TBPS} TB/s")
    print(f"{'case':<30} {'tokens':>7} {'E':>4} {'k':>3} {'pallas':>9} {'xla':>9} {'floor':>9} {'pallas/floor':>13}")
    for r in section.get("rows", []):
        p, x = r["ms"].get("pallas"), r["ms"].get("xla")
        f = lambda v: "-" if v is None else f"{v:.3f}"                          # noqa: E731
        ratio = "-" if p is None else f"{p / r['floor_ms']:.2f}"
        star = "*" if r.get("floor") == "bytes" else " "
        print(f"{r['case']:<30} {r['tokens']:>7} {r['experts']:>4} {r['top_k']:>3} {f(p):>9} {f(x):>9} "
              f"{r['floor_ms']:>8.3f}{star} {ratio:>13}")


def markdown(section: dict) -> list:
    """The README's table of the MoE rows, each against its floor."""
    out = md_header(["MoE layer", "tokens", "experts", "top-k", "pallas", "xla",
                     "floor (FLOPs at 700 TFLOP/s; decode: bytes at 4.8 TB/s)", "pallas / floor"])
    for r in section["rows"]:
        ms = r["ms"]
        out.append(f"| {r['case']} | {r['tokens']} | {r['experts']} | {r['top_k']} | {fmt(ms.get('pallas'))} | "
                   f"{fmt(ms.get('xla'))} | {fmt(r['floor_ms'])} | "
                   f"{fmt(ms['pallas'] / r['floor_ms'], '{:.2f}') if ms.get('pallas') else '-'} |")
    return out
