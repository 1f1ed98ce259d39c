"""The collectives XLA compiles into the sharded prefill / decode programs (issue 13: where 2-GPU prefill loses).

CPU, 2 forced host devices, compile only (nothing runs):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python benchmarks/shard_hlo.py

A Qwen3-Next-shaped model of 8 layers (2 x the period 3 GDN + 1 attention, every FFN a MoE; the period is the body
of the layer scan, so per-layer counts read straight off it) at small dims on a mesh of 2, tensor-parallel and
expert-parallel experts. For the compiled prefill (T = 256 bucket) and decode programs it lists every
all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute with its shape and whether it sits
inside the layer loop (a while body), and counts copies / transposes of [T, D]-sized values. Expected: per block
two all-reduces of [T, D] (mixer, FFN), one [T, D] all-reduce for the embedding lookup, none other.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_gdn.bench_model import tiny_config  # noqa: E402
from jax_gdn.model import HybridModel  # noqa: E402

CFG = dataclasses.replace(tiny_config(8), hidden_size=96, vocab_size=1000, num_experts=16, num_experts_per_tok=4,
                          moe_intermediate_size=32, shared_expert_intermediate_size=32)
T = 256
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def computations(text: str) -> dict:
    """name -> body text of every HLO computation in a module's text."""
    out, name, buf = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, buf = m.group(1), []
            continue
        if line.startswith("}") and name:
            out[name] = "\n".join(buf)
            name = None
            continue
        if name:
            buf.append(line)
    return out


def collectives(text: str) -> list:
    """(op, result shape, computation, in a while body) of every collective start / op."""
    comps = computations(text)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    # computations called from a while body (fusions, nested calls) count as inside it
    inside = set(bodies)
    changed = True
    while changed:
        changed = False
        for name in list(inside):
            for callee in re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)",
                                     comps.get(name, "")):
                if callee not in inside:
                    inside.add(callee)
                    changed = True
    rows = []
    for name, body in comps.items():
        for line in body.splitlines():
            for op in OPS:
                if re.search(rf"\b{op}(-start)?\(", line):
                    shape = re.search(r"=\s*(\(?[a-z0-9]+\[[^\]]*\][^ ]*)", line)
                    rows.append((op, shape.group(1) if shape else "?", name, name in inside))
    return rows


def report(label: str, model: HybridModel, decode: bool) -> dict:
    cache = model.init_cache(max_seqs=8, max_tokens=2048, page_size=16)
    if decode:
        n = 8
        args = (jnp.zeros((n,), jnp.int32), jnp.arange(n + 1, dtype=jnp.int32), jnp.arange(n, dtype=jnp.int32))
        lowered = model._decode_jit.lower(model.params, cache, *args)
    else:
        args = (jnp.zeros((T,), jnp.int32), jnp.asarray(np.linspace(0, T, 9).astype(np.int32)),
                jnp.arange(8, dtype=jnp.int32))
        lowered = model._prefill_jit.lower(model.params, cache, *args, return_all_logits=False)
    text = lowered.compile().as_text()
    rows = collectives(text)
    count = collections.Counter((op, shape, loop) for op, shape, _, loop in rows)
    print(f"== {label} {'decode (N=8)' if decode else f'prefill (T={T})'}: {len(rows)} collectives", flush=True)
    for (op, shape, loop), c in sorted(count.items()):
        print(f"   {c:3d} x {op:18s} {shape:40s} {'in the layer loop' if loop else 'outside'}", flush=True)
    return {"rows": rows}


def main() -> int:
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    backend = {"gated_delta_rule": "pallas_interpret", "paged_attention": "xla", "moe": "pallas_interpret"}
    print(f"config: 8 layers (scan of 2 x period 4: GDN, GDN, GDN, attention; every FFN a MoE), hidden "
          f"{CFG.hidden_size}, vocab {CFG.vocab_size}, experts {CFG.num_experts} top {CFG.num_experts_per_tok}; "
          f"[T, D] = [{T}, {CFG.hidden_size}]", flush=True)
    for mode in ("tensor", "expert"):
        model = HybridModel.random(CFG, 0, dtype=jnp.bfloat16, backend=backend, mesh=mesh, moe_sharding=mode,
                                   token_buckets=(T,))
        for decode in (False, True):
            report(f"mesh 2, moe_sharding={mode}", model, decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
