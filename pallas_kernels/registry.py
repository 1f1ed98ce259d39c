"""The index of the ops' dispatch tables: which implementation runs each accelerated op, from one place each.

Every op keeps its own table in its ``api.py`` (``pallas_kernels.dispatch.OpTable``: the implementations in the
order "auto" tries them, what each supports per call kind and why not); this module only indexes them:

    "gated_delta_rule"  pallas_kernels/gated_delta_rule/api.py  TABLE, case GdnCase  (dense, varlen, slots,
                        short_mix, decode)
    "paged_attention"   pallas_kernels/paged_attention/api.py   TABLE, case PagedCase (prefill, decode)
    "moe"               pallas_kernels/moe/api.py               TABLE, case MoeCase   (experts, routing)
    "conv1d"            pallas_kernels/conv1d/api.py            TABLE, case ConvCase  (prefill, decode)

``table(op)`` is the op's table; ``resolve(op, backend, **case)`` builds the op's case from keywords (dims and
dtype as the model knows them; ``call`` the call kind, default the op's first) and returns the implementation's
name; ``resolve_all`` does it for several ops; ``markdown()`` is the README's backend section (``python -m
pallas_kernels.registry`` prints it). This module imports nothing from jax_gdn.
"""
from __future__ import annotations

import importlib
from typing import Optional

from pallas_kernels.dispatch import OpTable, markdown_table

__all__ = ["OPS", "table", "implementations", "supports", "resolve", "resolve_all", "make_case", "markdown"]

#: op -> the module holding its TABLE
OPS = {
    "gated_delta_rule": "pallas_kernels.gated_delta_rule.api",
    "paged_attention": "pallas_kernels.paged_attention.api",
    "moe": "pallas_kernels.moe.api",
    "conv1d": "pallas_kernels.conv1d.api",
}


def _module(op: str):
    if op not in OPS:
        raise ValueError(f"registry: unknown op {op!r}; known: {sorted(OPS)}")
    return importlib.import_module(OPS[op])


def table(op: str) -> OpTable:
    """The dispatch table of ``op``."""
    return _module(op).TABLE


def implementations(op: str) -> tuple:
    """The implementation names of ``op``, in the order "auto" tries them."""
    return tuple(impl.name for impl in table(op).implementations)


def make_case(op: str, *, call: Optional[str] = None, platform: str, dtype, **dims):
    """The op's case from keywords: gated_delta_rule (head_k_dim, head_v_dim, num_k_heads, num_v_heads; hopper:
    None probes the device), paged_attention (head_dim, num_heads, num_kv_heads), moe (num_experts, hidden,
    inter), conv1d (head_k_dim, head_v_dim). ``call``: the call kind (None: the op's first)."""
    mod = _module(op)
    call = mod.TABLE.call_kinds[0] if call is None else call
    if op == "gated_delta_rule":
        hopper = dims.pop("hopper", None)
        if hopper is None:
            hopper = platform == "gpu" and mod.mosaic_gpu.is_hopper()
        return mod.GdnCase.example(call, platform=platform, hopper=hopper, dtype=dtype, **dims)
    if op == "paged_attention":
        return mod.PagedCase(call, platform, dtype, **dims)
    if op == "moe":
        return mod.MoeCase(call, platform, dtype, **dims)
    return mod.ConvCase(call, platform, dtype, **dims)


def supports(op: str, name: str, **case) -> Optional[str]:
    """None when the implementation or backend ``name`` of ``op`` runs the case (keywords as :func:`make_case`),
    else why not."""
    t = table(op)
    if name not in implementations(op) and name not in t.backends:
        return (f"{op} has no implementation {name!r} (nor a backend of that name); known: "
                f"{list(implementations(op))}, backends {list(t.backends)}")
    c = make_case(op, **case)
    if name in implementations(op):
        return t.implementation(name).supports(c)
    return t.why_not(name, c)


def resolve(op: str, backend: str, **case) -> str:
    """The implementation name of ``op`` that ``backend`` runs for the case (keywords as :func:`make_case`):
    "auto" -> the first that supports it; an explicit name -> its first implementation that does, its fallback,
    or ValueError naming why it cannot run."""
    return table(op).resolve(backend, make_case(op, **case), warn=False).name


def resolve_all(backends: dict, cases: dict) -> dict:
    """{op: implementation name} for every op of ``cases`` ({op: case keywords}); ``backends`` {op: name}
    ("auto" where missing)."""
    return {op: resolve(op, backends.get(op, "auto"), **case) for op, case in cases.items()}


def markdown() -> str:
    """The README's backend tables: per op, platform x call kind -> the implementation "auto" runs, then every
    implementation with its backend names, what runs and its limits (from the tables)."""
    return markdown_table([table(op) for op in OPS])


if __name__ == "__main__":
    print(markdown(), end="")
