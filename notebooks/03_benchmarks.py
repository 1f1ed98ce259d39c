# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 - Benchmarks: the Pallas kernels against FLA, jax-linear-attention and XLA
#
# This notebook only **reads** `benchmarks/results/h200.json`, written on an H200 by
#
# ```
# python -m benchmarks gdn         # (on the GPU machine: bash benchmarks/gpu.sh gdn)
# ```
#
# Per named case (`benchmarks.cases.BENCH_CASES`: K = V = 128, bf16 q/k/v/beta, fp32 g and state, the final state
# returned) it holds the median forward time in ms of
#
# * `pallas` - our Pallas (Triton lowering) kernel, `jax_gdn.ops.chunk_gated_delta_rule(backend="pallas")`,
# * `mosaic_gpu` - our Pallas Mosaic GPU kernels, `backend="mosaic_gpu"` (what "auto" runs on Hopper),
# * `fla` - FLA's Triton `chunk_gated_delta_rule` (torch), the reference implementation,
# * `jla` - jax-linear-attention's Mosaic GPU kernel (dense cases only: it takes no `cu_seqlens`),
# * `xla` - our pure-JAX chunked form, `backend="xla"`.
#
# Every column is timed the same way (`jax_gdn/timing.py`: groups of ~20 ms of back-to-back calls, one sync each,
# the median per call). A value the benchmark could not measure (or did not run: the slow `xla` column is
# measured only when asked for) is `null`; it is reported as missing here, never filled in.
# Set the environment variable `JAX_GDN_BENCH_JSON` to read another results file.

# %%
import time
NOTEBOOK_T0 = time.perf_counter()

import jax
import jax.numpy as jnp
import numpy as np
import matplotlib.pyplot as plt
# %matplotlib inline
plt.rcParams.update({"figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3})
print("jax", jax.__version__, "on", jax.devices())

# %%
import json, os, pathlib
import jax_gdn

# the repository the package is installed from (pip install -e .); JAX_GDN_BENCH_JSON names another file
ROOT = pathlib.Path(jax_gdn.__file__).resolve().parents[1]
IMPLS = ["pallas", "mosaic_gpu", "fla", "jla", "xla"]
COLORS = {"pallas": "C3", "mosaic_gpu": "C1", "fla": "C0", "jla": "C2", "xla": "C7"}
path = pathlib.Path(os.environ.get("JAX_GDN_BENCH_JSON", ROOT / "benchmarks" / "results" / "h200.json"))
if path.is_file():
    result = json.loads(path.read_text())
    rows = result.get("rows", [])
    print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: device {result.get('device')}, "
          f"jax {result.get('jax')}, date {result.get('date')}, {len(rows)} cases")
else:
    result, rows = {}, []
    print(f"MISSING: {path} does not exist yet - no benchmark has been recorded.\n"
          "Run `python -m benchmarks gdn` on a GPU machine and rerun this notebook; the cells below say what is "
          "missing instead of plotting.")


# %% [markdown]
# ## The table
#
# Medians in ms (lower is better), the ratio of each implementation to FLA (below 1: faster than FLA), and
# what is missing.

# %%
def ms(row, impl):
    value = (row.get("ms") or {}).get(impl)
    return None if value is None else float(value)

def tokens(row):
    return int(row["B"]) * int(row["T"])

missing = []
if rows:
    print(f"{'case':28s}{'tokens':>8s}" + "".join(f"{i:>11s}" for i in IMPLS)
          + "".join(f"{i + '/fla':>15s}" for i in IMPLS if i != "fla"))
    for r in rows:
        cells = "".join(f"{ms(r, i):11.3f}" if ms(r, i) is not None else f"{'-':>11s}" for i in IMPLS)
        ratios = "".join(f"{ms(r, i) / ms(r, 'fla'):15.2f}" if ms(r, i) and ms(r, "fla") else f"{'-':>15s}"
                         for i in IMPLS if i != "fla")
        print(f"{r['case']:28s}{tokens(r):8d}{cells}{ratios}")
        missing += [f"{r['case']} / {i}" for i in IMPLS if ms(r, i) is None]
    print("\nmissing values:", ", ".join(missing) if missing else "none")
    print("(jla takes no cu_seqlens, so it has no varlen case by construction)")
else:
    print("no rows: nothing to tabulate")


# %% [markdown]
# ## Time per case

# %%
def bars(ax, values, ylabel, title):
    """Grouped bars per case; a missing value is marked 'n/a' at the bottom instead of a bar."""
    x = np.arange(len(rows))
    impls = [i for i in values if any(v is not None for v in values[i])]
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        pos = x + (j - (len(impls) - 1) / 2) * width
        vals = values[impl]
        ax.bar([p for p, v in zip(pos, vals) if v is not None], [v for v in vals if v is not None], width,
               color=COLORS.get(impl), label=impl)
        for p, v in zip(pos, vals):
            if v is None:
                ax.annotate("n/a", (p, 0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                            textcoords="offset points", ha="center", fontsize=7, rotation=90)
    ax.set_xticks(x, [r["case"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)

if rows:
    fig, ax = plt.subplots(figsize=(12, 4.2))
    bars(ax, {i: [ms(r, i) for r in rows] for i in IMPLS}, "ms (median, lower is better)",
         f"chunked gated delta rule forward, {result.get('device')}")
    ax.set_yscale("log")
    fig.tight_layout()
    plt.show()
else:
    print("MISSING: no benchmark rows to plot")

# %% [markdown]
# ## Relative to FLA
#
# Time of each implementation divided by FLA's on the same case: 1 is parity, below 1 is faster than FLA.

# %%
if rows and any(ms(r, "fla") for r in rows):
    fig, ax = plt.subplots(figsize=(12, 4.2))
    others = [i for i in IMPLS if i != "fla"]
    bars(ax, {i: [ms(r, i) / ms(r, "fla") if ms(r, i) and ms(r, "fla") else None for r in rows]
              for i in others}, "time / FLA time (lower is better)", "relative to FLA")
    ax.axhline(1.0, color="k", lw=1)
    ax.set_yscale("log")
    fig.tight_layout()
    plt.show()
    pal = [ms(r, "pallas") / ms(r, "fla") for r in rows if ms(r, "pallas") and ms(r, "fla")]
    if pal:
        gm = float(np.exp(np.mean(np.log(pal))))
        print(f"pallas / fla: geometric mean {gm:.2f} over {len(pal)} cases "
              f"(best {min(pal):.2f}, worst {max(pal):.2f})")
else:
    print("MISSING: no FLA times, so no ratios")

# %% [markdown]
# ## Throughput
#
# Tokens per second: `B * T` tokens (the packed total for the varlen case) over the median time.

# %%
if rows:
    fig, ax = plt.subplots(figsize=(12, 4.2))
    bars(ax, {i: [tokens(r) / (ms(r, i) * 1e-3) / 1e6 if ms(r, i) else None for r in rows] for i in IMPLS},
         "million tokens / s (higher is better)", "throughput per case")
    ax.set_yscale("log")
    fig.tight_layout()
    plt.show()
else:
    print("MISSING: no benchmark rows to plot")

# %% [markdown]
# ## Other recorded runs
#
# Every other results file in `benchmarks/results/` (for instance a kernel variant that was measured and not
# kept). Peers are re-measured in every run, so the ratio to FLA *of the same run* is the comparable number;
# the spread of FLA's own time across runs shows the run-to-run noise of the machine.

# %%
runs = {}
if path.is_file():
    for f in sorted(path.parent.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("rows"):
            runs[f.stem + (" (main)" if f == path else "")] = data
if len(runs) < 2:
    print("no other results file next to", path.name if path.is_file() else path)
else:
    cases = [r["case"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    x = np.arange(len(cases))
    width = 0.8 / len(runs)
    for j, (name, data) in enumerate(runs.items()):
        by_case = {r["case"]: r for r in data["rows"]}
        ratio = [ms(by_case[c], "pallas") / ms(by_case[c], "fla") if c in by_case and ms(by_case[c], "pallas")
                 and ms(by_case[c], "fla") else np.nan for c in cases]
        fla = [ms(by_case[c], "fla") if c in by_case and ms(by_case[c], "fla") else np.nan for c in cases]
        label = f"{name}, {data.get('date', '?')[:16]}"
        axes[0].bar(x + (j - (len(runs) - 1) / 2) * width, ratio, width, label=label)
        axes[1].bar(x + (j - (len(runs) - 1) / 2) * width, fla, width, label=label)
    axes[0].axhline(1.0, color="k", lw=1)
    axes[0].set(ylabel="pallas / FLA (same run)", title="our kernel relative to FLA, per recorded run")
    axes[1].set(ylabel="FLA ms", title="FLA's own time across runs (machine noise)")
    for ax in axes:
        ax.set_xticks(x, cases, rotation=20, ha="right", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## One layer: where the time goes
#
# The `"layers"` entry of the results file (`python -m benchmarks layers`), if it was recorded: one GDN layer's
# split prefill at
# Qwen3-Next-80B dims on the 16-stream varlen case, per backend - phase 1 (input norm, in_proj, varlen conv,
# q/k L2 norm), phase 2 (the chunked gated delta rule over the slot pool), phase 3 (gated norm, out_proj,
# residual) - and one gated attention layer prefill on the same batch for scale.

# %%
layers, layers_src = result.get("layers"), f"{path.name}['layers']"
layers = [e for e in (layers or []) if isinstance(e, dict) and "gdn" in e]
if not layers:
    print("MISSING: no 'layers' entry in the results file (run `python -m benchmarks layers` on the GPU) - "
          "no layer split to plot")
else:
    print("layer results from", layers_src)
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
    names = [f"{e.get('backend', '?')} (T={e.get('T')}, N={e.get('N')})" for e in layers]
    y = np.arange(len(layers))
    left = np.zeros(len(layers))
    for j, ph in enumerate(("phase1", "phase2", "phase3")):
        vals = np.array([(e["gdn"] or {}).get(f"{ph}_ms", np.nan) for e in layers], float)
        axes[0].barh(y - 0.2, vals, 0.38, left=left, color=f"C{j}", label=ph)
        for yi, (l, v) in enumerate(zip(left, vals)):
            if np.isfinite(v):
                axes[0].text(l + v / 2, yi - 0.2, f"{v:.2f}", ha="center", va="center", fontsize=8, color="w")
        left += np.nan_to_num(vals)
    attn = np.array([(e.get("attention") or {}).get("ms", np.nan) for e in layers], float)
    axes[0].barh(y + 0.2, attn, 0.38, color="C4", label="attention layer")
    axes[0].set_yticks(y, names)
    axes[0].set(xlabel="ms (median)", title="GDN layer phases (stacked) and an attention layer")
    axes[0].legend(fontsize=8)
    tok = [(e["gdn"] or {}).get("tokens_per_s", np.nan) / 1e6 for e in layers]
    atok = [(e.get("attention") or {}).get("tokens_per_s", np.nan) / 1e6 for e in layers]
    axes[1].barh(y - 0.2, tok, 0.4, color="C3", label="GDN layer (one jit)")
    axes[1].barh(y + 0.2, atok, 0.4, color="C4", label="attention layer")
    axes[1].set_yticks(y, names)
    axes[1].set(xlabel="million tokens / s", title="layer throughput")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    for e, n in zip(layers, names):
        if not e["gdn"]:                     # an attention-only backend (cudnn): no GDN layer timed
            print(f"{n}: attention layer {(e.get('attention') or {}).get('ms', float('nan')):.2f} ms (GDN layer "
                  "not timed)")
            continue
        sh = e["gdn"].get("share", {})
        print(f"{n}: GDN layer {e['gdn'].get('layer_ms', float('nan')):.2f} ms, shares "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in sh.items()))

# %% [markdown]
# ## The other sections: MoE, attention, GDN decode, the whole model
#
# Sections measured by `python -m benchmarks --all` (or one section each) sit under their own keys of the same
# results file: `"moe"` (one MoE layer at 80B and Qwen3.5-35B-A3B dims), `"attention"` (paged attention prefill
# and decode against torch SDPA and cuDNN), `"decode"` (the one-token GDN step over the state pool against FLA)
# and `"model"` (the model at 80B dims, 8 layers, against HF transformers). The tables are
# `benchmarks.report.markdown_tables`, which also prints the README's (`python -m benchmarks --markdown`). The
# figure shows, per row, the time of the section's peer divided by ours (above 1: ours is faster).

# %%
from IPython.display import Markdown, display

from benchmarks.report import markdown_tables   # the repository root is on the kernel's path (notebooks/_execute.py)

SECTIONS = {"moe": ("pallas", "xla", "our XLA path"), "attention": ("pallas", "torch_sdpa", "torch SDPA"),
            "decode": ("pallas", "fla", "FLA"), "model": ("ours", "hf", "HF transformers")}
present = [name for name in SECTIONS if result.get(name)]
missing = [name for name in SECTIONS if name not in present]
if missing:
    print("MISSING sections (run `python -m benchmarks --all` on the GPU):", ", ".join(missing))
if present:
    display(Markdown(markdown_tables(result, present)))
    labels, speedup, colors = [], [], []
    for j, name in enumerate(present):
        ours, peer, peer_name = SECTIONS[name]
        for r in result[name].get("rows", []):
            t_ours, t_peer = (r.get("ms") or {}).get(ours), (r.get("ms") or {}).get(peer)
            labels.append(f"{name}: {r.get('case')} (vs {peer_name})")
            speedup.append(t_peer / t_ours if t_ours and t_peer else np.nan)
            colors.append(f"C{j}")
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(labels) + 1.2))
    y = np.arange(len(labels))[::-1]
    ax.barh(y, speedup, color=colors)
    for yi, v in zip(y, speedup):
        ax.text(v if np.isfinite(v) else 0, yi, f" {v:.2f}x" if np.isfinite(v) else " n/a", va="center", fontsize=8)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks([0.5, 1, 2, 4, 8], ["0.5", "1", "2", "4", "8"])
    ax.set(xlabel="peer time / our time (above 1: ours is faster)",
           title=f"the other sections, {result.get('device')}")
    fig.tight_layout()
    plt.show()

# %%
print(f"notebook ran in {time.perf_counter() - NOTEBOOK_T0:.1f} s")
