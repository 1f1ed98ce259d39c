"""The named sections of ``python -m benchmarks``: what each measures, where it is stored, what it takes.

Each section is one module with ``run_section(quick, ...)``, ``print_section(value)`` and (except sharding)
``markdown(value) -> lines``; ``Section`` says how the CLI calls it.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional, Tuple


def _names(cases) -> tuple:
    return tuple(c.name if hasattr(c, "name") else c[0] for c in cases)


@dataclasses.dataclass(frozen=True)
class Section:
    """One section: ``module`` (under benchmarks), the results-JSON ``keys`` it writes, its one-line ``summary``;
    ``case_names(quick)`` (None: the section has no named cases, ``--cases`` does not apply), the GPUs it needs
    (``devices``: 2 writes <device>x2.json), and whether ``--all`` runs it."""

    name: str
    module: str
    keys: Tuple[str, ...]
    summary: str
    case_names: Optional[Callable[[bool], tuple]] = None
    devices: int = 1
    in_all: bool = True

    def load(self):
        return importlib.import_module(f"benchmarks.{self.module}")


def _gdn_cases(quick):
    from benchmarks import gdn
    return _names(gdn.QUICK_CASES if quick else gdn.CASES)


def _decode_cases(quick):
    from benchmarks import decode
    return _names(decode.QUICK_CASES if quick else decode.CASES)


def _attention_cases(quick):
    from benchmarks import attention
    return _names(attention.attention_cases(quick))


def _backward_cases(quick):
    from benchmarks import backward
    return _names(backward.QUICK_CASES if quick else backward.CASES)


def _moe_cases(quick):
    from benchmarks import moe
    return _names(moe.QUICK_CASES if quick else moe.CASES)


def _serving_parts(quick):
    from benchmarks import serving
    return serving.PARTS


#: in the order ``--all`` runs them: the kernel and attention rows before the model, whose floors read them
SECTIONS = {s.name: s for s in (
    Section("gdn", "gdn", ("rows",), "the chunked gated delta rule forward: pallas, mosaic_gpu, xla, FLA, jla",
            _gdn_cases),
    Section("backward", "backward", ("backward",), "forward + backward of the chunked gated delta rule: ours "
            "(kernel forward, XLA VJP), XLA autodiff, FLA, jla", _backward_cases),
    Section("decode", "decode", ("decode",), "one GDN decode token per stream over the state pool, against FLA",
            _decode_cases),
    Section("attention", "attention", ("attention",), "paged attention prefill / decode against torch SDPA and cuDNN",
            _attention_cases),
    Section("moe", "moe", ("moe",), "one sparse MoE layer at 80B / 35B-A3B dims, prefill and decode sizes", _moe_cases),
    Section("layers", "layers", ("layers",), "one GDN layer's phases 1-3 and one attention layer at 80B dims"),
    Section("model", "model", ("model",), "the whole model at 80B dims (8 layers) against HF transformers, each part "
            "against its floor, the 48-layer compile time"),
    Section("model_35b", "model", ("model_35b",), "Qwen3.5-35B-A3B at its full 40 layers against HF transformers "
            "(~6 min on an H200; not in --all)", in_all=False),
    Section("serving", "serving", ("serving",), "LLM.generate on a shared-prefix workload, prefix cache off and "
            "on: tokens/s, time to first token, time per output token, hit rate; TTFT cold vs a prefix hit; the "
            "sampler's share of the decode step", _serving_parts),
    Section("serving_35b", "serving", ("serving_35b",), "the serving section on Qwen3.5-35B-A3B at its full 40 layers "
            "(not in --all)", _serving_parts, in_all=False),
    Section("train", "train", ("train",), "one optimiser step of a ~1B-parameter hybrid on 4096 packed tokens: "
            "tokens/s, MFU, peak memory, with and without layer remat"),
    Section("sharding", "sharding", ("rows", "events"), "80B dims over 2 GPUs (12 and 48 layers), the 1 vs 2 GPU "
            "check; needs 2 GPUs", devices=2, in_all=False),
)}
