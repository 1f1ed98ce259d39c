"""Benchmark of the chunked gated delta rule forward: `python -m jax_gdn.bench`.

For each named case of jax_gdn.cases.BENCH_CASES, times in one run on one GPU:
  pallas      jax_gdn.ops.chunk_gated_delta_rule(backend="pallas") (Pallas Triton)
  mosaic_gpu  jax_gdn.ops.chunk_gated_delta_rule(backend="mosaic_gpu") (Pallas Mosaic GPU; null where it would fall
              back to Triton: packed sequences, a non-Hopper device)
  xla         jax_gdn.ops.chunk_gated_delta_rule(backend="xla")
  fla     FLA's chunk_gated_delta_rule (torch, Triton), FLA_FLASH_QLA=0
  jla     jax-linear-attention's Mosaic GPU gated_delta_rule (dense cases only: it takes no cu_seqlens)
where each is importable (a peer that cannot run a case gets null). Inputs: bf16 q, k (L2-normalised), v, beta;
fp32 g (log-decay) and initial state; the final state is returned. Times are medians in ms, every column timed
the same way (``jax_gdn.timing``: warm-up, then groups of ~20 ms of back-to-back calls, each closed by one sync;
the median over the groups of the wall time per call); FLA's triton.testing.do_bench median (GPU events, L2
flushed: the tables' method before session 8) is kept beside in the row as "fla_do_bench", never in a ratio.

Writes benchmarks/results/<device>.json, named from the device kind ("NVIDIA H200" -> h200.json, a CPU run ->
cpu.json; ``--out`` overrides): {"device", "jax", "date", "rows": [{"case", "B", "T", "Hk", "Hv", "K", "V", "lens",
"ms": {"pallas", "mosaic_gpu", "xla", "fla", "jla"}}]}, plus a PNG bar plot beside it, and prints a table. The
ratio columns divide "ours" = the faster of pallas and mosaic_gpu (what backend "auto" runs where both can).

Sections, each measured in the same run and stored under its own key of the same JSON (one module each, with
``run_section(quick) -> dict`` and ``print_section(dict)``):
  --layers     "layers"     one GDN layer's split prefill and one attention layer at Qwen3-Next-80B dims
  --moe        "moe"        one MoE layer at 80B / Qwen3.5-35B-A3B dims (jax_gdn.bench_moe)
  --attention  "attention"  paged attention prefill / decode against torch SDPA and cuDNN (jax_gdn.bench_attention)
  --decode     "decode"     the one-token GDN step over the state pool against FLA (jax_gdn.bench_decode)
  --model      "model"      the whole model at 80B dims against HF transformers (jax_gdn.bench_model)
  --all        every section above
``--no-kernels`` skips the gated delta rule rows (``--merge`` then keeps those of the existing JSON at --out);
``--layers-only`` is ``--no-kernels --merge --layers``. ``--plot-only`` redraws the plot from the JSON;
``--markdown`` prints it as the README's tables.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import numpy as np

from jax_gdn.cases import BENCH_CASES, Case

IMPLS = ("pallas", "mosaic_gpu", "xla", "fla", "jla")
OURS = ("pallas", "mosaic_gpu")


def ours_ms(ms: dict):
    """The faster of our GPU backends in a row's "ms" (None when neither ran)."""
    got = [ms[i] for i in OURS if ms.get(i) is not None]
    return min(got) if got else None
RESULTS_DIR = os.path.join("benchmarks", "results")
#: JSON key -> module with run_section(quick) / print_section(section); "layers" is handled by run_layers
SECTIONS = {"moe": "jax_gdn.bench_moe", "attention": "jax_gdn.bench_attention", "decode": "jax_gdn.bench_decode",
            "model": "jax_gdn.bench_model"}


def device_file_name(device_kind: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100_80gb_hbm3', 'cpu' -> 'cpu'."""
    name = device_kind.lower().replace("nvidia", "").strip()
    name = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    while "__" in name:
        name = name.replace("__", "_")
    return name or "device"


def default_out_path() -> str:
    import jax
    dev = jax.devices()[0]
    return os.path.join(RESULTS_DIR, device_file_name(getattr(dev, "device_kind", dev.platform)) + ".json")


# ----------------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------------
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


def time_jax(fn, args, **kw):
    """Median ms per call of ``fn(*args)``: ``jax_gdn.timing.time_jax`` (the one method of every bench column; its
    keywords: warmup, groups, per_group (None: groups of ~20 ms), slow_ms)."""
    from jax_gdn.timing import time_jax as _time_jax
    return _time_jax(fn, args, **kw)


# ----------------------------------------------------------------------------------------------------------------
# implementations: each returns a zero-arg-style (fn, args) pair or raises
# ----------------------------------------------------------------------------------------------------------------
def _jax_impl(case, host, backend):
    import jax
    import jax.numpy as jnp
    from jax_gdn import ops
    q, k, v, g, beta, h0 = host
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
            jnp.asarray(beta, bf), jnp.asarray(h0))
    cu = case.cu_seqlens()
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    if backend == "mosaic_gpu":            # a row of this column is the Mosaic kernels' or null, never Triton's
        from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mosaic_gpu
        why = mosaic_gpu.fallback_reason(*args[:3])
        if why is not None:
            raise NotImplementedError(why)

    @jax.jit
    def fn(q, k, v, g, beta, h0):
        return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu, backend=backend)
    return fn, args


def _jla_impl(case, host):
    if case.lens is not None:
        raise NotImplementedError("jla takes no cu_seqlens")
    import jax
    import jax.numpy as jnp
    from jla.ops.mosaic_gpu.gated_delta_rule import gated_delta_rule
    q, k, v, g, beta, h0 = host
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
            jnp.asarray(beta, bf), jnp.asarray(h0))

    @jax.jit
    def fn(q, k, v, g, beta, h0):
        return gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    return fn, args


def fla_call(case, host):
    """A no-argument callable running FLA's chunk_gated_delta_rule on the case's inputs (torch, CUDA), bf16 q, k,
    v and beta, fp32 g and initial state, final state out (also used by benchmarks/profile_fla.py)."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    q, k, v, g, beta, h0 = host
    dev = "cuda"
    bf = torch.bfloat16
    tq, tk, tv = (torch.from_numpy(x).to(dev, bf) for x in (q, k, v))
    tg = torch.from_numpy(g).to(dev)
    tb = torch.from_numpy(beta).to(dev, bf)
    th0 = torch.from_numpy(h0).to(dev)
    kw = {}
    if case.lens is not None:
        kw["cu_seqlens"] = torch.tensor(case.cu_seqlens(), dtype=torch.long, device=dev)

    def fn():
        return chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True, **kw)
    return fn


def _fla_warm(case, host):
    """``fla_call`` after its first call (FLA autotunes there), synced."""
    import torch
    fn = fla_call(case, host)
    fn()
    torch.cuda.synchronize()
    return fn


def _time_fla(case, host):
    """FLA's median ms timed as the jax columns are (``jax_gdn.timing.time_torch``)."""
    from jax_gdn.timing import time_torch
    return time_torch(_fla_warm(case, host))


def _do_bench(fn) -> float:
    """triton's do_bench median of ``fn`` (CUDA events, L2 flushed: the method of the tables before session 8, kept
    beside as "fla_do_bench", never in a ratio)."""
    import triton
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def run_layers(backends, reps=10, small=False):
    """Entries of jax_gdn.bench_layers for each backend (a backend that fails is reported and left out).
    ``small``: tiny dims, a CPU smoke run, not a measurement."""
    from jax_gdn.bench_layers import bench_layers, print_table as print_layers
    entries = []
    for backend in backends:
        try:
            entries.append(bench_layers(backend, reps, small=small))
        except Exception as e:                             # report and go on with the other backend
            print(f"layers {backend}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    print_layers(entries)
    return entries


def _write(result, out_path):
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def run_sections(result: dict, sections, *, layer_backends=("pallas", "xla"), quick: bool = False) -> list:
    """Runs each named section into ``result[name]``; a section that fails is reported, keeps no entry, and
    does not stop the others. Returns the error lines."""
    import importlib
    errors = []
    for name in sections:
        print(f"== section {name}", flush=True)
        try:
            if name == "layers":
                result["layers"] = run_layers(layer_backends, small=quick)
                continue
            module = importlib.import_module(SECTIONS[name])
            result[name] = module.run_section(quick=quick)
            module.print_section(result[name])
        except Exception as e:                             # report and go on with the other sections
            errors.append(f"section {name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            print("skipped:", errors[-1], flush=True)
            if os.environ.get("JAX_GDN_BENCH_TRACEBACK"):
                traceback.print_exc()
    return errors


def run_kernel_rows(cases, impls, seed=0):
    """The gated delta rule rows: (rows, error lines)."""
    try:
        from tqdm import tqdm
    except ImportError:                                    # the bar is cosmetic
        def tqdm(x, **_):
            return x
    rows = []
    errors = []
    todo = [(c, i) for c in cases for i in impls]
    bar = tqdm(todo, desc="bench", unit="run")
    host_cache = {}
    for case, impl in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{case.name} {impl}")
        host = host_cache.setdefault(case.name, make_inputs_np(case, seed))
        if not rows or rows[-1]["case"] != case.name:
            rows.append({"case": case.name, "B": case.B, "T": case.T, "Hk": case.Hk, "Hv": case.Hv,
                         "K": case.K, "V": case.V, "lens": list(case.lens) if case.lens else None,
                         "ms": {i: None for i in IMPLS}})
        try:
            if impl in ("pallas", "mosaic_gpu", "xla"):
                ms = time_jax(*_jax_impl(case, host, impl))
            elif impl == "jla":
                ms = time_jax(*_jla_impl(case, host))
            elif impl == "fla":
                from jax_gdn.timing import time_torch
                fla = _fla_warm(case, host)                # one set of FLA inputs for both figures
                ms = time_torch(fla)
                try:
                    rows[-1]["fla_do_bench"] = round(_do_bench(fla), 4)
                except Exception as e:                     # the reference figure only; the row keeps FLA's ms
                    errors.append(f"{case.name} fla do_bench: {type(e).__name__}: {str(e)[:200]}")
            else:
                raise ValueError(impl)
            rows[-1]["ms"][impl] = round(ms, 4)
        except Exception as e:                             # a peer that cannot run a case gets null
            errors.append(f"{case.name} {impl}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            if os.environ.get("JAX_GDN_BENCH_TRACEBACK"):
                traceback.print_exc()
    return rows, errors


def run(cases, impls, out_path, seed=0, layer_backends=(), sections=(), *, kernels=True, merge=False,
        quick=False):
    """One run: the kernel rows (unless ``kernels`` is False) and the named sections, written to ``out_path``.
    ``merge``: start from the JSON already at out_path (its rows and sections not re-measured are kept)."""
    import jax
    result = {}
    if merge and os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
    errors = []
    if kernels:
        result["rows"], errors = run_kernel_rows(cases, impls, seed)
    result.setdefault("rows", [])
    sections = list(sections)
    if layer_backends and "layers" not in sections:
        sections.insert(0, "layers")
    dev = jax.devices()[0]
    result.update({"device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    _write(result, out_path)                               # kernel rows are kept even if a section dies hard
    errors += run_sections(result, sections, layer_backends=layer_backends or ("pallas", "xla"), quick=quick)
    _write(result, out_path)
    if result["rows"]:
        print_table(result)
        plot(result, out_path[:-5] + ".png" if out_path.endswith(".json") else out_path + ".png")
    for e in errors:
        print("skipped:", e)
    return result


def print_table(result):
    head = f"{'case':30s}" + "".join(f"{i:>11s}" for i in IMPLS) + f"{'ours/fla':>9s}{'ours/jla':>9s}"
    print(f"device: {result['device']}  jax {result['jax']}  {result['date']}")
    print(head)
    for r in result["rows"]:
        ms = r["ms"]
        cells = "".join(f"{ms[i]:11.3f}" if ms.get(i) is not None else f"{'-':>11s}" for i in IMPLS)
        ours = ours_ms(ms)
        ratio = lambda b: (f"{ours / ms[b]:9.2f}" if ours and ms.get(b) else f"{'-':>9s}")
        print(f"{r['case']:30s}{cells}{ratio('fla')}{ratio('jla')}")


def plot(result, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (run `python -m jax_gdn.bench --plot-only` where it is installed)")
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


# ----------------------------------------------------------------------------------------------------------------
# markdown tables (the README's tables are printed from the committed JSON with --markdown)
# ----------------------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def _header(cols, text_cols: int = 1) -> list:
    """A markdown table's header and alignment lines: the first ``text_cols`` columns left, the rest right."""
    return ["| " + " | ".join(cols) + " |",
            "| " + " | ".join("---" if i < text_cols else "---:" for i in range(len(cols))) + " |"]


def markdown_tables(result: dict) -> str:
    """Markdown tables of every part of ``result`` (one JSON of this tool), in the README's layout."""
    out = []
    if result.get("rows"):
        out += _header(["case", "pallas Triton (ours)", "Mosaic GPU (ours)", "xla (ours)", "FLA",
                        "jax-linear-attention", "ours / FLA", "ours / jla", "FLA by do_bench (not in a ratio)"])
        for r in result["rows"]:
            ms = r["ms"]
            ours = ours_ms(ms)
            ratio = lambda b: _f(ours / ms[b], "{:.2f}") if ours and ms.get(b) else "-"
            out.append(f"| {r['case']} | " + " | ".join(_f(ms.get(i)) for i in IMPLS)
                       + f" | {ratio('fla')} | {ratio('jla')} | {_f(r.get('fla_do_bench'))} |")
        out.append("")
    if result.get("layers"):
        out += _header(["backend", "phase 1", "phase 2", "phase 3", "GDN layer", "GDN tokens/s", "attention layer",
                        "attention tokens/s"])
        for e in result["layers"]:
            g, a = e["gdn"], e["attention"]
            if g is None:                       # an attention-only backend (cudnn): the GDN layer is not timed
                gdn_cells = "- | - | - | - | -"
            else:
                sh = g["share"]
                gdn_cells = (f"{g['phase1_ms']:.2f} ms ({sh['phase1']:.0%}) | {g['phase2_ms']:.2f} ms "
                             f"({sh['phase2']:.0%}) | {g['phase3_ms']:.2f} ms ({sh['phase3']:.0%}) | "
                             f"{g['layer_ms']:.2f} ms | {g['tokens_per_s'] / 1e6:.2f} M")
            out.append(f"| {e['backend']} | {gdn_cells} | {a['ms']:.2f} ms | {a['tokens_per_s'] / 1e6:.2f} M |")
        out.append("")
    if result.get("moe"):
        out += _header(["MoE layer", "tokens", "experts", "top-k", "pallas", "xla",
                        "floor (FLOPs at 700 TFLOP/s; decode: bytes at 4.8 TB/s)", "pallas / floor"])
        for r in result["moe"]["rows"]:
            ms = r["ms"]
            out.append(f"| {r['case']} | {r['tokens']} | {r['experts']} | {r['top_k']} | {_f(ms.get('pallas'))} | "
                       f"{_f(ms.get('xla'))} | {_f(r['floor_ms'])} | "
                       f"{_f(ms['pallas'] / r['floor_ms'], '{:.2f}') if ms.get('pallas') else '-'} |")
        out.append("")
    if result.get("attention"):
        from jax_gdn.bench_model import PEAK_TBPS
        impls = ("pallas", "cudnn_packed", "xla", "torch_sdpa", "cudnn")
        rated = ("pallas", "cudnn_packed")

        def rate(r, i):
            return (f"{r['tflops'][i]:.0f} TFLOP/s" if (r.get("tflops") or {}).get(i)
                    else f"{r['gbps'][i]:.0f} GB/s ({r['gbps'][i] / (10 * PEAK_TBPS):.0f}% of HBM)" if (r.get("gbps") or {}).get(i)
                    else "-")
        out += _header(["attention", "kind", "context"] + [f"{i} ms" for i in impls] + [f"{i} rate" for i in rated],
                       text_cols=2)
        for r in result["attention"]["rows"]:
            ms = r["ms"]
            out.append(f"| {r['case']} | {r['kind']} | {r.get('context', '-')} | "
                       + " | ".join(_f(ms.get(i)) for i in impls) + " | "
                       + " | ".join(rate(r, i) for i in rated) + " |")
        out.append("")
    if result.get("decode"):
        impls = ("pallas", "triton", "xla", "fla", "copy")           # jax_gdn.bench_decode.IMPLS
        out += _header(["GDN decode step"] + [f"{i} ms (GB/s)" for i in impls])
        for r in result["decode"]["rows"]:
            cells = [f"{r['ms'][i]:.3f} ({r['gbps'][i]:.0f})" if r["ms"].get(i) else "-" for i in impls]
            out.append(f"| {r['case']} | " + " | ".join(cells) + " |")
        out.append("")
    if result.get("model"):
        m = result["model"]
        out += _header([f"model ({m['layers']} layers)", "kind", "tokens", "ours ms", "HF ms", "ours tokens/s",
                        "HF tokens/s", "ours / HF"], text_cols=2)
        for r in m["rows"]:
            ms, tps = r["ms"], r["tokens_per_s"]
            speed = _f(ms["hf"] / ms["ours"], "{:.2f}x") if ms.get("hf") and ms.get("ours") else "-"
            out.append(f"| {r['case']} | {r['kind']} | {r['tokens']} | {_f(ms.get('ours'), '{:.1f}')} | "
                       f"{_f(ms.get('hf'), '{:.1f}')} | {_f(tps.get('ours'), '{:,.0f}')} | "
                       f"{_f(tps.get('hf'), '{:,.0f}')} | {speed} |")
        out.append("")
        from jax_gdn.bench_model import parts_markdown   # each part against its floor (prefill and decode)
        out += parts_markdown(m.get("parts_ms"))
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>.json)")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the JSON at --out as the README's markdown tables")
    p.add_argument("--layers", action="store_true",
                   help="also time one GDN layer (phases 1-3) and one attention layer at 80B dims, key 'layers'")
    p.add_argument("--layers-only", action="store_true",
                   help="only the layer benchmark, merged into the existing JSON at --out")
    p.add_argument("--layer-backends", default="pallas,xla")
    p.add_argument("--layers-small", action="store_true", help="tiny layer dims (CPU smoke run, not a measurement)")
    for name in SECTIONS:
        p.add_argument(f"--{name}", action="store_true", help=f"also run the '{name}' section ({SECTIONS[name]})")
    p.add_argument("--all", action="store_true", help="every section (layers, " + ", ".join(SECTIONS) + ")")
    p.add_argument("--no-kernels", action="store_true", help="skip the gated delta rule rows")
    p.add_argument("--merge", action="store_true", help="keep what the JSON at --out has and is not re-measured")
    p.add_argument("--quick", action="store_true", help="sections at tiny sizes (CPU smoke run, not a measurement)")
    a = p.parse_args(argv)
    out = a.out or default_out_path()
    if a.markdown:
        with open(out) as f:
            print(markdown_tables(json.load(f)))
        return 0
    if a.plot_only:
        with open(out) as f:
            result = json.load(f)
        print_table(result)
        plot(result, out[:-5] + ".png")
        return 0
    want_layers = a.layers or a.layers_only or a.all
    layer_backends = [b for b in a.layer_backends.split(",") if b] if want_layers else []
    sections = [name for name in SECTIONS if getattr(a, name) or a.all]
    names = [s for s in a.cases.split(",") if s]
    cases = [c for c in BENCH_CASES if not names or c.name in names]
    kernels = not (a.no_kernels or a.layers_only)
    run(cases, [i for i in a.impls.split(",") if i], out, layer_backends=layer_backends, sections=sections,
        kernels=kernels, merge=a.merge or a.layers_only, quick=a.quick or a.layers_small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
