"""Section "decode": one gated delta rule token per stream over the fp32 state pool, every column in one run on one
GPU.

Cases: ``benchmarks.cases.DECODE_CASES`` (N streams x Hv value heads x K x V fp32 state; bf16 q, k, v, beta; fp32 g;
q / k L2-normalised inside each implementation). Columns (median ms; null where an implementation cannot run):
  pallas  ``jax_gdn.ops.fused_recurrent_gated_delta_rule_slots(backend="auto")``: the op as shipped over a pool
          of S = N slots in a shuffled order, the pool donated (updated in place): on Hopper the Mosaic GPU kernel
          (the dispatch table's "mosaic_gpu.decode": ``decode_mosaic.DEFAULT_CONFIG``, the direct transfer),
          elsewhere the Pallas Triton kernel; the row names the kernel and its launch parameters as
          "pallas_kernel" / "pallas_config"
  triton  the Pallas Triton decode kernel (``decode.py``, ``decode.decode_config`` for the case) on the same pool,
          donated: what backend "pallas" runs everywhere and "auto" off Hopper
  xla     the same op, backend "xla" (gather the N states, lax.scan step, scatter back), pool donated
  fla     FLA's ``fused_recurrent_gated_delta_rule`` (torch, Triton) with initial_state [N, Hv, K, V] and
          output_final_state=True (dense states: no slot indexing), each call's final state the next call's initial
          state; its triton do_bench median (CUDA events, L2 flushed) beside as "fla_do_bench_ms"
  copy    an XLA read + write of the same state bytes (pool * 1, not donated): the practical floor
gbps: the state bytes a step must move, 2 N Hv K V 4 (read once, write once), over each time.
Timing, the same for every column (``jax_gdn.timing.time_threaded``): groups of ~20 ms of back-to-back calls, each
feeding its new state to the next (the pool donated in jax), closed by one sync (block_until_ready /
torch.cuda.synchronize); the median over the groups of the wall time per call.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks.cases import CPU_DECODE, DECODE_CASES, Case

KEY = "decode"
IMPLS = ("pallas", "triton", "xla", "fla", "copy")
CASES = DECODE_CASES
QUICK_CASES = CPU_DECODE


def state_bytes(case: Case) -> int:
    return 2 * case.B * case.Hv * case.K * case.V * 4


def make_inputs_np(case: Case, seed: int = 0):
    """q, k [N, 1, Hk, K], v [N, 1, Hv, V], g, beta [N, 1, Hv], pool [S = N, Hv, K, V], slot_ids [N] (shuffled)."""
    rng = np.random.default_rng(seed)
    n = case.B
    q = rng.standard_normal((n, 1, case.Hk, case.K), np.float32)
    k = rng.standard_normal((n, 1, case.Hk, case.K), np.float32)
    v = rng.standard_normal((n, 1, case.Hv, case.V), np.float32)
    g = np.log(rng.uniform(0.9, 0.999, (n, 1, case.Hv))).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (n, 1, case.Hv)).astype(np.float32)
    pool = (0.1 * rng.standard_normal((n, case.Hv, case.K, case.V))).astype(np.float32)
    return q, k, v, g, beta, pool, rng.permutation(n).astype(np.int32)


def _time_threaded(step, state, **timing):
    """Median ms of ``state = step(state)`` (the state is donated each call): ``jax_gdn.timing.time_threaded``."""
    from jax_gdn.timing import time_threaded
    return time_threaded(step, state, "jax", **timing)


def time_jax_decode(case: Case, backend: str, host, config=None, **timing) -> float:
    """Median ms of one decode step of ``backend`` ("pallas", "pallas_interpret", "xla"); ``config``: a
    DecodeConfig for the pallas kernel (default: the kernel's)."""
    import jax
    import jax.numpy as jnp
    from jax_gdn import ops
    q, k, v, g, beta, pool, ids = host
    bf = jnp.bfloat16
    xs = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf))
    ids = jnp.asarray(ids)
    if config is None:
        def run(pool):
            return ops.fused_recurrent_gated_delta_rule_slots(*xs, ssm_state=pool, slot_ids=ids, use_qk_l2norm=True,
                                                              backend=backend)
    else:
        from pallas_kernels.gated_delta_rule.triton import decode

        def run(pool):
            return decode.fused_recurrent_gated_delta_rule_slots_fwd(
                *xs, scale=None, ssm_state=pool, slot_ids=ids, has_initial_state=jnp.ones(ids.shape, bool),
                use_qk_l2norm=True, interpret=backend == "pallas_interpret", config=config)
    fn = jax.jit(lambda pool: run(pool)[1], donate_argnums=0)
    return _time_threaded(fn, jnp.asarray(pool), **timing)


def time_copy(case: Case, host, **timing) -> float:
    import jax
    import jax.numpy as jnp
    pool = jnp.asarray(host[5])
    fn = jax.jit(lambda p: p * 1.0001)
    return _time_threaded(lambda p: fn(p), pool, **timing)


def time_fla(case: Case, host, do_bench: bool = False) -> float:
    """Median ms of FLA's step timed as the jax columns are (threaded groups: ``benchmarks.peers.fla_recurrent_step``);
    ``do_bench``: triton's do_bench median of one call from the same initial state instead."""
    from benchmarks import peers, timing
    step, th0 = peers.fla_recurrent_step(host)
    if do_bench:
        return timing.do_bench(lambda: step(th0))
    return timing.time_torch_threaded(step, th0)


def pallas_route(case: Case, gpu: bool) -> tuple[str, dict]:
    """("mosaic" or "triton", its launch parameters) of the "pallas" column at this case: the op's dispatch table
    for backend "auto" (GPU) / "pallas_interpret" (CPU), what the op decides at trace time."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.gated_delta_rule import api
    from pallas_kernels.gated_delta_rule.triton import decode
    from pallas_kernels.gated_delta_rule.mosaic_gpu import decode as decode_mosaic
    q = jax.ShapeDtypeStruct((case.B, 1, case.Hk, case.K), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((case.B, 1, case.Hv, case.V), jnp.bfloat16)
    impl = api.TABLE.resolve("auto" if gpu else "pallas_interpret", api.GdnCase.of("decode", q, q, v))
    if impl.name.startswith("mosaic_gpu"):
        return "mosaic", dataclasses.asdict(decode_mosaic.DEFAULT_CONFIG)
    return "triton", dataclasses.asdict(decode.decode_config(case.B, case.Hv, case.K, case.V))


def _has_gpu() -> bool:
    import jax
    return any(d.platform == "gpu" for d in jax.devices())


def run_section(quick: bool = False, cases=None) -> dict:
    """{"rows": [{"case", "N", "Hk", "Hv", "K", "V", "ms": {pallas, triton, xla, fla, copy}, "gbps": {...},
    "pallas_kernel", "pallas_config"}], "note"}.
    ``cases``: names (default every case). ``quick``: the tiny CPU case, pallas in interpret mode, few calls (a smoke
    run of this code, not a measurement); a run without a GPU is one too."""
    from pallas_kernels.gated_delta_rule.triton import decode
    gpu = _has_gpu()
    cases = [c for c in (QUICK_CASES if quick or not gpu else CASES) if cases is None or c.name in cases]
    timing = dict(warmup=1, groups=2, per_group=1) if quick or not gpu else {}
    rows = []
    for case in cases:
        host = make_inputs_np(case)
        ms = {}
        for impl in IMPLS:
            try:
                if impl == "pallas":
                    ms[impl] = time_jax_decode(case, "auto" if gpu else "pallas_interpret", host, **timing)
                elif impl == "triton":
                    cfg = decode.decode_config(case.B, case.Hv, case.K, case.V)
                    ms[impl] = time_jax_decode(case, "pallas" if gpu else "pallas_interpret", host, config=cfg,
                                               **timing)
                elif impl == "xla":
                    ms[impl] = time_jax_decode(case, "xla", host, **timing)
                elif impl == "copy":
                    ms[impl] = time_copy(case, host, **timing)
                else:
                    ms[impl] = time_fla(case, host) if gpu else None
            except Exception as e:                         # report and go on: a peer that cannot run gets null
                print(f"decode {case.name} {impl}: failed: {type(e).__name__}: {str(e)[:200]}")
                ms[impl] = None
        nbytes = state_bytes(case)
        kernel, launch = pallas_route(case, gpu)
        row = {"case": case.name, "N": case.B, "Hk": case.Hk, "Hv": case.Hv, "K": case.K, "V": case.V,
               "state_bytes": nbytes, "ms": ms, "pallas_kernel": kernel, "pallas_config": launch,
               "gbps": {k: (None if t is None else nbytes / t / 1e6) for k, t in ms.items()}}
        if gpu and ms.get("fla") is not None:
            try:
                row["fla_do_bench_ms"] = time_fla(case, host, do_bench=True)
            except Exception as e:                         # noqa: BLE001
                print(f"decode {case.name} fla do_bench: failed: {type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
    return {"rows": rows, "note": "gbps = state bytes read + written (2 N Hv K V 4) / time; "
                                  + ("CPU smoke run, not a measurement" if quick or not gpu else "")}


def print_section(section: dict) -> None:
    print("decode: one token per stream, fp32 state pool (median ms, GB/s of state bytes)")
    print(f"  {'case':26s}" + "".join(f"{i:>16s}" for i in IMPLS))
    for r in section["rows"]:
        cells = "".join("{:>16s}".format("-" if r["ms"][i] is None else f"{r['ms'][i]:.4f} ({r['gbps'][i]:.0f})")
                        for i in IMPLS)
        print(f"  {r['case']:26s}{cells}")


def markdown(section: dict) -> list:
    """The README's table of the decode rows."""
    from benchmarks.tables import md_header
    out = md_header(["GDN decode step"] + [f"{i} ms (GB/s)" for i in IMPLS])
    for r in section["rows"]:
        cells = [f"{r['ms'][i]:.3f} ({r['gbps'][i]:.0f})" if r["ms"].get(i) else "-" for i in IMPLS]
        out.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    return out
