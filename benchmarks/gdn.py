"""Section "gdn" (results key "rows"): the chunked gated delta rule forward, ours against its peers, one row per
named case of ``benchmarks.cases.BENCH_CASES`` (K = V = 128, Qwen3-Next head counts), every column in one run on
one GPU:
  pallas      jax_gdn.ops.chunk_gated_delta_rule(backend="pallas") (Pallas Triton)
  mosaic_gpu  jax_gdn.ops.chunk_gated_delta_rule(backend="mosaic_gpu") (Pallas Mosaic GPU; null where it would fall
              back to Triton: packed sequences, a non-Hopper device)
  xla         jax_gdn.ops.chunk_gated_delta_rule(backend="xla") (the pure-JAX chunked form; slow: measured only when
              ``--impls`` names it, null otherwise)
  fla         FLA's chunk_gated_delta_rule (torch, Triton), FLA_FLASH_QLA=0
  jla         jax-linear-attention's Mosaic GPU gated_delta_rule (dense cases only: it takes no cu_seqlens)
  qla         FlashQLA's chunk_gated_delta_rule (TileLang; FLA 0.6's default on Hopper), only when ``--impls`` names
              it, in a process with its own stack (``benchmarks.peers``)
  fi          FlashInfer's gdn_prefill.chunk_gated_delta_rule (CuTe DSL on SM90), the same way
where each is importable (a peer that cannot run a case gets null). A/B columns of our own switches, named in
``--impls`` only and kept in the row's "variants" (never in a ratio; ``VARIANTS``):
  mosaic_gpu_narrow / mosaic_gpu_wide  the Mosaic GPU kernels with ``MosaicConfig`` / ``VarlenConfig`` wide False /
              "auto" (the fused pass per 64 value columns, or per value head where the narrow one runs more than a
              wave, a choice from shapes only), whatever the defaults are (packed calls: "per_call", chosen on the
              device from cu_seqlens); narrow with the packed split off
  mosaic_gpu_split  the narrow pass, packed calls with ``VarlenConfig.split = 32`` (long sequences cut into pieces
              of >= 32 chunks walked side by side; the split runs with the narrow pass only)
Inputs: bf16 q, k (L2-normalised), v, beta; fp32 g (log-decay) and initial state; the final state is returned. Times
are medians in ms, every column timed the same way (``jax_gdn.timing``: warm-up, then groups of ~20 ms of
back-to-back calls, each closed by one sync; the median over the groups of the wall time per call); FLA's
triton.testing.do_bench median (GPU events, L2 flushed) is kept beside in the row as "fla_do_bench", never in a
ratio. The ratio columns divide "ours" = the faster of pallas and mosaic_gpu (what backend "auto" runs where both
can). A PNG bar plot of the rows is drawn beside the results JSON.
"""
from __future__ import annotations

import traceback

import numpy as np

from benchmarks.cases import BENCH_CASES, CPU_DENSE, CPU_VARLEN, Case
from benchmarks.tables import fmt, md_header

KEY = "rows"
IMPLS = ("pallas", "mosaic_gpu", "xla", "fla", "jla", "qla", "fi")
#: the columns measured unless --impls says otherwise (the XLA form is the slow reference)
DEFAULT_IMPLS = ("pallas", "mosaic_gpu", "fla", "jla")
OURS = ("pallas", "mosaic_gpu")
PEERS = ("fla", "jla", "qla", "fi")
CASES = BENCH_CASES
#: A/B columns (``--impls`` only; row["variants"]): the Mosaic GPU kernels with these MosaicConfig / VarlenConfig fields
VARIANTS = {"mosaic_gpu_narrow": {"wide": False, "varlen:split": 0}, "mosaic_gpu_wide": {"wide": "auto"},
            "mosaic_gpu_split": {"wide": False, "varlen:split": 32}}
QUICK_CASES = (CPU_DENSE[-1], CPU_VARLEN)


def ours_ms(ms: dict):
    """The faster of our GPU backends in a row's "ms" (None when neither ran)."""
    got = [ms[i] for i in OURS if ms.get(i) is not None]
    return min(got) if got else None


def best_peer_ms(ms: dict):
    """The fastest peer of a row's "ms" (None when none ran)."""
    got = [ms[i] for i in PEERS if ms.get(i) is not None]
    return min(got) if got else None


def make_inputs_np(case: Case, seed: int = 0):
    """Host inputs: q, k [B,T,Hk,K] (unit rows), v [B,T,Hv,V], g [B,T,Hv] (log-decay), beta [B,T,Hv], h0 [N,Hv,K,V]."""
    rng = np.random.default_rng(seed)
    b, t = case.B, case.T
    q = rng.standard_normal((b, t, case.Hk, case.K), np.float32)
    k = rng.standard_normal((b, t, case.Hk, case.K), np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, case.Hv, case.V), np.float32)
    g = np.log(rng.uniform(0.9, 0.999, (b, t, case.Hv))).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (b, t, case.Hv)).astype(np.float32)
    h0 = (0.1 * rng.standard_normal((case.num_seqs, case.Hv, case.K, case.V))).astype(np.float32)
    return q, k, v, g, beta, h0


def _device_args(host, mosaic: bool = False):
    """The host inputs on the device (bf16 q, k, v, beta; fp32 g, h0); ``mosaic``: NotImplementedError naming the
    reason where the Mosaic kernels cannot take them (such a column's row is theirs or null, never Triton's)."""
    import jax.numpy as jnp
    q, k, v, g, beta, h0 = host
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
            jnp.asarray(beta, bf), jnp.asarray(h0))
    if mosaic:
        from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mosaic_gpu
        why = mosaic_gpu.fallback_reason(*args[:3])
        if why is not None:
            raise NotImplementedError(why)
    return args


def jax_impl(case, host, backend):
    import jax
    import jax.numpy as jnp
    from jax_gdn import ops
    args = _device_args(host, mosaic=backend == "mosaic_gpu")
    cu = case.cu_seqlens()
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)

    @jax.jit
    def fn(q, k, v, g, beta, h0):
        return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu, backend=backend)
    return fn, args


def variant_impl(case, host, fields: dict):
    """(jitted fn, args) of the Mosaic GPU kernels on a case with ``fields`` set in both backend configs (the op's
    own entry points, ``chunk.op_fwd`` / ``varlen.op_fwd``, as backend "mosaic_gpu" calls them; a key "dense:f" or
    "varlen:f" sets field f of one of them only). Raises NotImplementedError naming the reason where the Mosaic
    kernels cannot run the case (e.g. no Hopper GPU)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mosaic_gpu, varlen as mosaic_varlen
    args = _device_args(host, mosaic=True)
    cu = case.cu_seqlens()
    scale = case.K ** -0.5
    kind = "dense" if cu is None else "varlen"
    fields = {f.split(":")[-1]: x for f, x in fields.items() if ":" not in f or f.startswith(kind + ":")}
    if cu is None:
        cfg = dataclasses.replace(mosaic_gpu.DEFAULT_CONFIG, **fields)
        run = lambda q, k, v, g, b, h0: mosaic_gpu.op_fwd(q, k, v, g, b, scale=scale, initial_state=h0,  # noqa: E731
                                                          output_final_state=True, config=cfg)
    else:
        cfg = dataclasses.replace(mosaic_varlen.DEFAULT_CONFIG, **fields)
        cu = jnp.asarray(cu, jnp.int32)
        run = lambda q, k, v, g, b, h0: mosaic_varlen.op_fwd(q, k, v, g, b, scale=scale, initial_state=h0,  # noqa
                                                             output_final_state=True, cu_seqlens=cu, config=cfg)
    return jax.jit(run), args


def run_section(quick: bool = False, cases=None, impls=DEFAULT_IMPLS, seed: int = 0, traceback_on_error=False):
    """The rows of ``cases`` (names; default every case) x ``impls``: [{"case", "B", "T", "Hk", "Hv", "K", "V",
    "lens", "ms": {impl: ms or None}, "fla_do_bench"}] (and "variants": {name: ms or None} for the ``VARIANTS``
    named in ``impls``); an implementation that fails on a case gets null (its error printed). ``quick``: tiny CPU
    cases and few calls (a smoke run of this code, not a measurement)."""
    from jax_gdn.timing import time_jax

    from benchmarks import peers
    from benchmarks.timing import do_bench, time_torch
    pool = QUICK_CASES if quick else CASES
    todo = [c for c in pool if cases is None or c.name in cases]
    timing = dict(warmup=1, groups=2, per_group=1) if quick else {}
    rows = []
    for case in todo:
        host = make_inputs_np(case, seed)
        row = {"case": case.name, "B": case.B, "T": case.T, "Hk": case.Hk, "Hv": case.Hv, "K": case.K, "V": case.V,
               "lens": list(case.lens) if case.lens else None, "ms": {i: None for i in IMPLS}}
        for impl in impls:
            print(f"gdn {case.name} {impl}", flush=True)
            if impl in VARIANTS:
                row.setdefault("variants", {})[impl] = None
            try:
                if impl in VARIANTS:
                    row["variants"][impl] = round(time_jax(*variant_impl(case, host, VARIANTS[impl]), **timing), 4)
                    continue
                if impl in ("pallas", "mosaic_gpu", "xla"):
                    ms = time_jax(*jax_impl(case, host, impl), **timing)
                elif impl == "jla":
                    ms = time_jax(*peers.jla_chunk(case, host), **timing)
                elif impl == "qla":
                    ms = time_torch(peers.warm(peers.qla_chunk(case, host)))
                elif impl == "fi":
                    ms = time_torch(peers.warm(peers.fi_chunk(case, host)))
                elif impl == "fla":
                    fla = peers.fla_chunk_warm(case, host)         # one set of FLA inputs for both figures
                    ms = time_torch(fla)
                    try:
                        row["fla_do_bench"] = round(do_bench(fla), 4)
                    except Exception as e:                     # the reference figure only; the row keeps FLA's ms
                        print(f"  {case.name} fla do_bench: {type(e).__name__}: {str(e)[:200]}")
                else:
                    raise ValueError(impl)
                row["ms"][impl] = round(ms, 4)
            except Exception as e:                             # a peer that cannot run a case gets null
                print(f"  {case.name} {impl}: null: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}")
                if traceback_on_error:
                    traceback.print_exc()
        rows.append(row)
    return rows


def print_section(rows, device: str = "") -> None:
    print_table({"device": device, "rows": rows})
    names = [n for n in VARIANTS if any(n in (r.get("variants") or {}) for r in rows)]
    if names:
        print("A/B of our switches, median ms:\n" + f"{'case':30s}" + "".join(f"{n:>19s}" for n in names))
        for r in rows:
            v = r.get("variants") or {}
            print(f"{r['case']:30s}" + "".join(f"{v[n]:19.4f}" if v.get(n) is not None else f"{'-':>19s}"
                                               for n in names))


def print_table(result):
    head = (f"{'case':30s}" + "".join(f"{i:>11s}" for i in IMPLS) + f"{'ours/fla':>9s}{'ours/jla':>9s}"
            f"{'ours/best':>10s}")
    print(f"gated delta rule forward, median ms ({result.get('device', '')})")
    print(head)
    for r in result["rows"]:
        ms = r["ms"]
        cells = "".join(f"{ms[i]:11.3f}" if ms.get(i) is not None else f"{'-':>11s}" for i in IMPLS)
        ours = ours_ms(ms)
        ratio = lambda b: (f"{ours / ms[b]:9.2f}" if ours and ms.get(b) else f"{'-':>9s}")
        best = best_peer_ms(ms)
        print(f"{r['case']:30s}{cells}{ratio('fla')}{ratio('jla')}"
              + (f"{ours / best:10.2f}" if ours and best else f"{'-':>10s}"))


def plot(result, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (`python -m benchmarks --plot` redraws it where it is installed)")
        return
    rows = result["rows"]
    x = np.arange(len(rows))
    width = 0.8 / len(IMPLS)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for j, impl in enumerate(IMPLS):
        vals = [r["ms"].get(impl) for r in rows]
        ax.bar(x + (j - (len(IMPLS) - 1) / 2) * width, [v if v is not None else 0 for v in vals], width, label=impl)
    ax.set_xticks(x, [r["case"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms (median, lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"chunked gated delta rule forward, {result['device']}, jax {result['jax']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print("plot:", png_path)


def markdown(rows) -> list:
    """The README's table of the kernel rows."""
    out = md_header(["case", "pallas Triton (ours)", "Mosaic GPU (ours)", "xla (ours)", "FLA", "jax-linear-attention",
                     "FlashQLA", "FlashInfer", "ours / FLA", "ours / jla", "ours / best peer",
                     "FLA by do_bench (not in a ratio)"])
    for r in rows:
        ms = r["ms"]
        ours = ours_ms(ms)
        ratio = lambda b: fmt(ours / ms[b], "{:.2f}") if ours and ms.get(b) else "-"        # noqa: E731
        best = best_peer_ms(ms)
        out.append(f"| {r['case']} | " + " | ".join(fmt(ms.get(i)) for i in IMPLS)
                   + f" | {ratio('fla')} | {ratio('jla')} | "
                   + (fmt(ours / best, "{:.2f}") if ours and best else "-") + f" | {fmt(r.get('fla_do_bench'))} |")
    return out
