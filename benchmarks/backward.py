"""Section "backward": forward + backward of the chunked gated delta rule, every column in one run on one GPU.

Cases: ``benchmarks.cases.BACKWARD_CASES`` (the GDN section's first eight rows: dense rows of 80B dims and the
packed mixes varlen16, serve256, tiny64; bf16 q, k, v, beta; fp32 g and initial state; final state out). Loss
sum(o * do) + sum(ht * dht) with fixed random cotangents; gradients of q, k, v, g, beta and h0. Columns (median ms; null where an implementation
cannot run, its reason in "errors"):
  fwd   ours, the forward alone (``jax_gdn.ops.chunk_gated_delta_rule``, backend "auto")
  ours  ours, forward + backward, backend "auto" (on a Hopper GPU: the Mosaic forward and backward kernels,
        ``mosaic_gpu/backward.py``, dense rows and packed ones alike; elsewhere the forward kernel with the XLA
        chunked form's VJP)
  ours_xla_vjp  ours, backend "auto" with ``DispatchConfig(mosaic_backward=False, mosaic_backward_varlen=False)``:
        the forward kernel and the XLA chunked form's VJP (``pallas_kernels.autodiff.reference_vjp``)
  xla   ours, forward + backward by XLA autodiff of the chunked form (backend "xla")
  fla   FLA's ``chunk_gated_delta_rule`` (torch, Triton) forward + ``torch.autograd.backward``; FLA 0.6.0 refuses
        its gated backward on Hopper with Triton >= 3.4, < 3.7.1 (the H200 machine has 3.6: null, its reason kept)
  qla   FlashQLA's ``chunk_gated_delta_rule`` the same way, where flash_qla is importable (its own process: see
        ``benchmarks.peers``)
  jla   jax-linear-attention's Mosaic GPU ``gated_delta_rule`` under ``jax.grad`` (dense rows only)
Timing: ``jax_gdn.timing`` for every column (``benchmarks.timing.time_torch`` for FLA): groups of back-to-back
calls closed by one sync, the median over the groups.
Peak memory ("peak_mb", MiB): the bytes live at the peak of one call, inputs and gradients included. JAX columns:
XLA's buffer assignment of the compiled call (``memory_analysis()``: arguments + outputs + temporaries - aliased;
the Mosaic kernels' outputs are XLA buffers, their shared memory is not HBM); torch columns: the CUDA caching
allocator's ``max_memory_allocated`` over one call after a reset, the inputs and gradient buffers already live.
"""
from __future__ import annotations

import numpy as np

from benchmarks.cases import BACKWARD_CASES, CPU_BACKWARD, Case

KEY = "backward"
IMPLS = ("fwd", "ours", "ours_xla_vjp", "xla", "fla", "qla", "jla")
#: the columns measured unless --impls says otherwise (qla needs a process of its own: benchmarks.peers)
DEFAULT_IMPLS = ("fwd", "ours", "ours_xla_vjp", "xla", "fla", "jla")
CASES = BACKWARD_CASES
QUICK_CASES = CPU_BACKWARD


def _inputs(case: Case):
    from benchmarks.gdn import make_inputs_np
    q, k, v, g, beta, h0 = make_inputs_np(case)
    rng = np.random.default_rng(1)
    do = rng.standard_normal((case.B, case.T, case.Hv, case.V)).astype(np.float32)
    dht = rng.standard_normal(h0.shape).astype(np.float32)
    return (q, k, v, g, beta, h0), do, dht


def _jax_columns(case: Case, host, do, dht, gpu: bool, timing: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from jax_gdn.ops import DEFAULT_DISPATCH, DispatchConfig, chunk_gated_delta_rule
    from jax_gdn.timing import time_jax
    q, k, v, g, beta, h0 = host
    dt = jnp.bfloat16 if gpu else jnp.float32
    args = (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(g), jnp.asarray(beta, dt),
            jnp.asarray(h0))
    cu = None if case.lens is None else jnp.asarray(case.cu_seqlens(), jnp.int32)
    do_, dht_ = jnp.asarray(do, dt), jnp.asarray(dht)
    kernel = "auto" if gpu else "pallas_interpret"
    XLA_VJP = DispatchConfig(mosaic_backward=False, mosaic_backward_varlen=False)

    def op(backend, dispatch=DEFAULT_DISPATCH):
        return lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend,
            dispatch=dispatch)

    def grad(fn):
        # the cotangents are arguments: closed over, XLA would fold them into the program as constants
        def loss(q, k, v, g, beta, h0, do, dht):
            o, ht = fn(q, k, v, g, beta, h0)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(ht * dht)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    with_ct = args + (do_, dht_)

    def measure(fn, a):
        return time_jax(fn, a, **timing), compiled_peak_mb(fn, a)
    return {"fwd": lambda: measure(jax.jit(op(kernel)), args),
            "ours": lambda: measure(grad(op(kernel)), with_ct),
            "ours_xla_vjp": lambda: measure(grad(op(kernel, XLA_VJP)), with_ct),
            "xla": lambda: measure(grad(op("xla")), with_ct),
            "jla": (None if not gpu or case.lens is not None else lambda: measure(grad(_jla(case, host)), with_ct))}


def compiled_peak_mb(jitted, args) -> float:
    """MiB live at the peak of one call of ``jitted`` on ``args`` by XLA's buffer assignment: arguments + outputs +
    temporaries, less what outputs alias."""
    m = jitted.lower(*args).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes) / 2 ** 20


def torch_peak_mb(run) -> float:
    """MiB the CUDA caching allocator held at the peak of one call of ``run`` (its inputs already allocated)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 20


def _jla(case: Case, host):
    """jla's gated delta rule (``benchmarks.peers.jla_chunk``: its jitted call) as a function of our arguments."""
    from benchmarks import peers
    fn, _ = peers.jla_chunk(case, host)
    return fn


def _fla(case: Case, host, do, dht) -> tuple:
    import torch
    from benchmarks import peers
    from benchmarks.timing import time_torch
    run = peers.fla_chunk_backward(case, host, do, dht)
    run()
    torch.cuda.synchronize()
    return time_torch(run), torch_peak_mb(run)


def _qla(case: Case, host, do, dht) -> tuple:
    from benchmarks import peers
    from benchmarks.timing import time_torch
    run = peers.warm(peers.qla_chunk_backward(case, host, do, dht))
    return time_torch(run), torch_peak_mb(run)


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def run_section(quick: bool = False, cases=None, impls=DEFAULT_IMPLS) -> dict:
    """{"rows": [{"case", "ms": {fwd, ours, ours_xla_vjp, xla, fla, qla, jla}, "peak_mb": {the same}, "errors":
    {impl: reason}}], "note"}; the columns not in ``impls`` are null. ``quick`` or no GPU: the tiny CPU case in
    fp32, the kernel in interpret mode, few calls (a smoke run, not a measurement)."""
    import jax
    gpu = any(d.platform == "gpu" for d in jax.devices())
    chosen = [c for c in (QUICK_CASES if quick or not gpu else CASES) if cases is None or c.name in cases]
    timing = dict(warmup=1, groups=2, per_group=1) if quick or not gpu else {}
    rows = []
    for case in chosen:
        host, do, dht = _inputs(case)
        cols = _jax_columns(case, host, do, dht, gpu, timing)
        cols["fla"] = (lambda: _fla(case, host, do, dht)) if gpu else None
        cols["qla"] = (lambda: _qla(case, host, do, dht)) if gpu and _importable("flash_qla") else None
        ms, peak, errors = {i: None for i in IMPLS}, {i: None for i in IMPLS}, {}
        for impl in IMPLS:
            if impl not in impls or cols.get(impl) is None:
                continue
            print(f"backward {case.name} {impl}", flush=True)
            try:
                ms[impl], peak[impl] = cols[impl]()
            except Exception as e:                         # a column that cannot run: null, its reason kept
                errors[impl] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"backward {case.name} {impl}: failed: {errors[impl]}")
        rows.append({"case": case.name, "ms": ms, "peak_mb": peak, "errors": errors})
    return {"rows": rows, "note": "median ms of forward + backward (fwd: ours, forward only); "
                                  + ("CPU smoke run, not a measurement" if quick or not gpu else "bf16")}


def print_section(section: dict) -> None:
    print("backward: forward + backward of the GDN op (median ms; fwd = ours, forward only)")
    print(f"  {'case':30s}" + "".join(f"{i:>13s}" for i in IMPLS))
    for r in section["rows"]:
        print(f"  {r['case']:30s}" + "".join("{:>13s}".format("-" if r["ms"][i] is None else f"{r['ms'][i]:.3f}")
                                            for i in IMPLS))
        peak = r.get("peak_mb") or {}
        print(f"  {'  peak MiB':30s}" + "".join("{:>13s}".format("-" if peak.get(i) is None else f"{peak[i]:.0f}")
                                               for i in IMPLS))


def markdown(section: dict) -> list:
    """The README's table of the backward rows."""
    from benchmarks.tables import md_header
    out = md_header(["GDN forward + backward"] + [f"{i} ms" for i in IMPLS])
    for r in section["rows"]:
        out.append(f"| {r['case']} | " + " | ".join("-" if r["ms"].get(i) is None else f"{r['ms'][i]:.3f}"
                                                     for i in IMPLS) + " |")
    with_peak = [r for r in section["rows"] if any(v is not None for v in (r.get("peak_mb") or {}).values())]
    if with_peak:
        out += [""] + md_header(["peak memory of one call"] + [f"{i} MiB" for i in IMPLS])
        for r in with_peak:
            out.append(f"| {r['case']} | " + " | ".join("-" if r["peak_mb"].get(i) is None else f"{r['peak_mb'][i]:.0f}"
                                                         for i in IMPLS) + " |")
    return out
