"""The main job: ``python -m jax_gdn demo`` - a small random stack of GDN layers through the split-prefill protocol,
then the hybrid model, ending with PASS or FAIL.

On CPU in about a minute: builds ``--layers`` random Gated DeltaNet layers, packs requests of ``--lengths`` into
one batch (permuted slots in a pool with spare slots poisoned by NaN), runs them through the split protocol
(phase1_proj_batched -> phase1_conv1d_varlen -> phase1_l2_batched -> gdn_full_varlen -> phase3) layer by layer,
continues with ``--decode-steps`` one-token decode steps, and checks everything against the monolithic layer run
one stream at a time. Prints a table: phase, time (ms, warm: best of 3 after a compiling call), max abs error
against the monolithic path, its tolerance (``TOLERANCE``, by ``--precision``) and the check.

Sections: ``run_gdn_stack_demo(args)`` (the GDN layers alone), then the whole hybrid model through
``run_model_section(args)``: ``jax_gdn.model_demo.run_model_demo(options dict, verbose=False)`` runs with --model /
--model-lens / --dtype / --decode-steps / --backend / --seed (skip it with --skip-model); its dict of measurements
becomes table rows. Each section returns its table rows: dicts with keys phase, time_ms (or None), max_err (or
None), and for the checked rows tol (or None) and ok (bool). ``run(argv)`` returns the sections' rows and the
verdict; ``main(argv)`` its exit status (0 PASS, 1 FAIL, 2 a bad option, refused before any work).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_gdn.cli_types import existing_dir, nonnegative_int, positive_int, positive_int_list, positive_int_pair
from jax_gdn.config import GdnDims
from jax_gdn.layers import gdn
from jax_gdn.state import BatchMeta, GdnSlots

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency; degrade to a plain loop
    def tqdm(it, **_):
        return it


#: the GDN section's pass mark: max abs error against the monolithic path, by matmul precision. fp32 dots
#: ("highest") agree to a few 1e-6 (``python -m jax_gdn demo --skip-model`` on CPU: 2.9e-6 at most); TF32 /
#: bf16-pass dots ("default", "high" on a GPU) carry ~1e-3 relative error per dot.
TOLERANCE = {"highest": 1e-4, "high": 1e-2, "default": 1e-2}
#: the model section's pass mark: the prefill after releasing its slots against the first one, max abs difference
#: over max abs logit (the same program on the same input; a stale slot state would differ at O(1))
REPEAT_TOLERANCE = 1e-3


def _lengths_text(text: str) -> str:
    """Comma-separated positive ints, checked while parsing and kept as text (the model demo parses it)."""
    positive_int_list(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_gdn demo",
        description="Runs a small random stack of Gated DeltaNet layers through the split-prefill protocol on a "
                    "packed batch of variable-length requests, then a few decode steps, and checks both against "
                    "the monolithic layer (one stream at a time); then the hybrid model (the tiny preset, or "
                    "--model DIR) through prefill and greedy decode. Prints phase, time, max error and its "
                    "tolerance, and ends with PASS (exit 0) or FAIL (exit 1).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=2, help="number of GDN layers in the stack")
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden size D")
    p.add_argument("--heads", type=positive_int_pair, default=(2, 4),
                   help="key heads and value heads 'Hk,Hv' (Hv a multiple of Hk)")
    p.add_argument("--head-dims", type=positive_int_pair, default=(16, 32), help="key and value head dims 'K,V'")
    p.add_argument("--layout", choices=("qwen3_next", "qwen3_5"), default="qwen3_next",
                   help="projection layout (fused + interleaved, or separate projections)")
    p.add_argument("--lengths", type=positive_int_list, default=[1, 17, 64, 100],
                   help="comma-separated prompt lengths of the packed requests")
    p.add_argument("--decode-steps", type=nonnegative_int, default=3, help="one-token decode steps after the prefill")
    p.add_argument("--spare-slots", type=nonnegative_int, default=2,
                   help="unused (NaN-poisoned) slots in the state pool")
    p.add_argument("--seed", type=int, default=0, help="random seed for weights and inputs")
    p.add_argument("--backend", choices=("auto", "xla", "pallas", "pallas_interpret"), default="auto",
                   help="gated delta rule backend (auto: pallas on a GPU, xla elsewhere)")
    p.add_argument("--precision", choices=tuple(TOLERANCE), default="highest",
                   help="fp32 matmul precision of the GDN section (jax.default_matmul_precision); the pass mark "
                        "follows it: " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()))
    p.add_argument("--skip-model", action="store_true", help="run only the GDN-stack section")
    p.add_argument("--model", type=existing_dir, default=None, metavar="DIR",
                   help="model section: HF checkpoint directory (default: the tiny preset, random weights)")
    p.add_argument("--model-lens", type=_lengths_text, default=None,
                   help="model section: comma-separated prompt lengths (default: the model demo's own)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model section dtype")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    """Parses and checks ``argv`` before any work: option types and ranges (argparse), then the GDN dims the
    options make (exit 2 with the reason on either)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        gdn_dims(args)
    except ValueError as err:
        parser.error(f"--hidden / --heads / --head-dims: {err}")
    return args


def gdn_dims(args) -> GdnDims:
    """The GDN section's layer dims from the options."""
    (hk, hv), (dk, dv) = args.heads, args.head_dims
    return GdnDims(args.hidden, hk, hv, dk, dv, layout=args.layout)


def _max_err(x, ref) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(ref, np.float64)))) if np.size(ref) else 0.0


def _timed(fn, *args, repeats: int = 3, **kwargs):
    """Runs a jitted call once to compile, then ``repeats`` times. Returns (result, best time in ms)."""
    jax.block_until_ready(fn(*args, **kwargs))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        best = min(best, time.perf_counter() - t0)
    return out, best * 1e3


_STATIC = ("dims", "backend", "ffn", "chunk_size")
_jit_cache: dict = {}


def _jit(fn):
    if fn not in _jit_cache:
        import inspect
        names = tuple(n for n in _STATIC if n in inspect.signature(fn).parameters)
        _jit_cache[fn] = jax.jit(fn, static_argnames=names)
    return _jit_cache[fn]


def run_gdn_stack_demo(args, *, out=sys.stdout) -> list:
    """The GDN-stack section. Returns the table rows (dicts: phase, time_ms, max_err); prints nothing itself
    except progress bars (``main`` prints the table)."""
    dims = gdn_dims(args)
    hv, dk, dv = dims.num_v_heads, dims.head_k_dim, dims.head_v_dim
    lengths = list(args.lengths)
    n, t = len(lengths), sum(lengths)
    num_slots = n + args.spare_slots
    rng = np.random.default_rng(args.seed)
    keys = jax.random.split(jax.random.PRNGKey(args.seed), args.layers)
    params = [gdn.init_params(dims, keys[i], randomize_norms=True) for i in range(args.layers)]
    hidden = jnp.asarray(rng.standard_normal((t, dims.hidden_size)), jnp.float32)
    slot_ids = rng.permutation(num_slots)[:n].astype(np.int32)
    meta = BatchMeta.from_lengths(lengths, slot_ids=slot_ids)
    cu = np.asarray(meta.cu_seqlens)
    poison = GdnSlots(conv_state=jnp.full((num_slots, dims.conv_dim, dims.conv_kernel_size - 1), jnp.nan),
                      ssm_state=jnp.full((num_slots, hv, dk, dv), jnp.nan))
    backend = args.backend
    quiet = getattr(args, "no_progress", False)
    bar = dict(disable=quiet, leave=False, file=sys.stderr)

    phases = ["phase1_proj_batched", "phase1_conv1d_varlen", "phase1_l2_batched", "gdn_full_varlen", "phase3"]
    times = dict.fromkeys(phases, 0.0)

    @jax.jit
    def varlen_core(q, k, v, g, beta, slots, meta):
        o, slots, ok = gdn.gdn_full_varlen(q, k, v, g, beta, slots, meta, backend=backend)
        if not ok:
            raise ValueError(f"gdn_full_varlen is not eligible for backend {backend!r} with these dims: "
                             f"{gdn.varlen_eligibility(q, k, v, backend)[1]}")
        return o, slots

    # ---- split protocol, packed, layer by layer ----
    x = hidden
    split_slots = [poison] * args.layers
    for li in tqdm(range(args.layers), desc="prefill (split protocol)", **bar):
        p = params[li]
        p1, ms = _timed(_jit(gdn.phase1_proj_batched), p, dims, x)
        times["phase1_proj_batched"] += ms
        (conv_out, s), ms = _timed(_jit(gdn.phase1_conv1d_varlen), p, dims, p1.mixed_qkv, split_slots[li], meta)
        times["phase1_conv1d_varlen"] += ms
        (q, k, v), ms = _timed(_jit(gdn.phase1_l2_batched), dims, conv_out)
        times["phase1_l2_batched"] += ms
        (o, s), ms = _timed(varlen_core, q, k, v, p1.g, p1.beta, s, meta)
        times["gdn_full_varlen"] += ms
        x, ms = _timed(_jit(gdn.phase3), p, dims, o, p1.z, x)
        times["phase3"] += ms
        split_slots[li] = s
    split_out = x

    # ---- the same through the one-jit pure form ----
    def stack_prefill(params, x, slots, meta):
        new = []
        for p, s in zip(params, slots):
            x, s = gdn.gdn_layer_prefill(p, dims, x, s, meta, backend=backend)
            new.append(s)
        return x, new

    (pure_out, _), pure_ms = _timed(jax.jit(stack_prefill), params, hidden, [poison] * args.layers, meta)

    # ---- monolithic reference: one stream at a time, layer by layer ----
    mono = _jit(gdn.gdn_layer_monolithic)
    mono_slots = [poison] * args.layers
    mono_out = []
    t0 = time.perf_counter()
    for i in tqdm(range(n), desc="prefill (monolithic, per stream)", **bar):
        xi = hidden[cu[i]:cu[i + 1]]
        for li in range(args.layers):
            xi, mono_slots[li] = mono(params[li], dims, xi, mono_slots[li], jnp.int32(slot_ids[i]), jnp.bool_(False),
                                      backend=backend)
        mono_out.append(xi)
    mono_out = jax.block_until_ready(jnp.concatenate(mono_out))
    mono_ms = (time.perf_counter() - t0) * 1e3

    used = np.asarray(slot_ids)
    unused = np.setdiff1d(np.arange(num_slots), used)
    conv_err = max(_max_err(s.conv_state[used], m.conv_state[used]) for s, m in zip(split_slots, mono_slots))
    ssm_err = max(_max_err(s.ssm_state[used], m.ssm_state[used]) for s, m in zip(split_slots, mono_slots))
    untouched = all(bool(np.isnan(np.asarray(s.ssm_state)[unused]).all()) for s in split_slots)

    rows = [dict(phase=f"{name} (x{args.layers} layers)", time_ms=times[name], max_err=None) for name in phases]
    rows += [
        dict(phase=f"prefill split protocol: output, T={t} N={n}", time_ms=sum(times.values()),
             max_err=_max_err(split_out, mono_out)),
        dict(phase="prefill split protocol: conv states", time_ms=None, max_err=conv_err),
        dict(phase="prefill split protocol: ssm states", time_ms=None, max_err=ssm_err),
        dict(phase="prefill gdn_layer_prefill (one jit): output", time_ms=pure_ms,
             max_err=_max_err(pure_out, mono_out)),
        dict(phase="prefill monolithic (reference, per stream, incl. compile)", time_ms=mono_ms, max_err=0.0,
             ok=None),
        dict(phase=f"spare slots still NaN: {untouched}", time_ms=None, max_err=0.0 if untouched else float("nan"),
             ok=untouched),
    ]

    # ---- decode steps: all streams at once (recurrent) vs the monolithic layer on one more token ----
    decode = _jit(gdn.gdn_layer_decode)
    dec_slots, ref_slots = list(split_slots), list(mono_slots)
    last = split_out[cu[1:] - 1]
    sid = jnp.asarray(slot_ids)
    for step in tqdm(range(args.decode_steps), desc="decode steps", **bar):
        x_new = jnp.asarray(rng.standard_normal((n, dims.hidden_size)), jnp.float32) + 0.1 * last
        xd, ms = x_new, 0.0
        for li in range(args.layers):
            (xd, dec_slots[li]), m = _timed(decode, params[li], dims, xd, dec_slots[li], sid)
            ms += m
        ref = []
        for i in range(n):
            xi = x_new[i:i + 1]
            for li in range(args.layers):
                xi, ref_slots[li] = mono(params[li], dims, xi, ref_slots[li], jnp.int32(slot_ids[i]), jnp.bool_(True),
                                         backend=backend)
            ref.append(xi)
        ref = jnp.concatenate(ref)
        err = max(_max_err(xd, ref), max(_max_err(a.ssm_state[used], b.ssm_state[used])
                                         for a, b in zip(dec_slots, ref_slots)))
        rows.append(dict(phase=f"decode step {step + 1} (N={n}, output + states)", time_ms=ms, max_err=err))
        last = xd
    tol = TOLERANCE[getattr(args, "precision", "highest")]
    for r in rows:
        if r["max_err"] is not None and "ok" not in r:
            r["tol"], r["ok"] = tol, bool(r["max_err"] <= tol)      # NaN: False
    return rows


def format_table(rows: list, title: str) -> str:
    """The rows as a table: phase, time (ms), max err, its tolerance, and "ok" / "FAIL" for the checked rows."""
    width = max([len(r["phase"]) for r in rows] + [len("phase")])
    lines = [title, f"{'phase':<{width}}  {'time (ms)':>10}  {'max err':>10}  {'tolerance':>10}  check",
             "-" * (width + 43)]
    for r in rows:
        tm = "" if r["time_ms"] is None else f"{r['time_ms']:10.2f}"
        er = "" if r["max_err"] is None else f"{r['max_err']:10.2e}"
        tl = "" if r.get("tol") is None else f"{r['tol']:10.0e}"
        ok = "" if r.get("ok") is None else ("ok" if r["ok"] else "FAIL")
        lines.append(f"{r['phase']:<{width}}  {tm:>10}  {er:>10}  {tl:>10}  {ok}".rstrip())
    return "\n".join(lines)


def verdict(results: dict) -> tuple:
    """(passed, the failed rows' phases) over every checked row (``ok`` not None) of every section."""
    failed = [r["phase"] for rows in results.values() for r in rows if r.get("ok") is False]
    checked = sum(r.get("ok") is not None for rows in results.values() for r in rows)
    return (not failed and checked > 0), failed


def _model_hook():
    """The model section's module (``jax_gdn.model_demo``), imported on first use (tests replace it)."""
    return importlib.import_module("jax_gdn.model_demo")


def run_model_section(args) -> list:
    """The hybrid-model section through ``jax_gdn.model_demo.run_model_demo``: its measurements as table rows."""
    hook = _model_hook()
    options = dict(model=args.model, lens=args.model_lens, decode_steps=args.decode_steps, dtype=args.dtype,
                   backend=args.backend, seed=args.seed)
    res = hook.run_model_demo({k: v for k, v in options.items() if v is not None}, verbose=False)
    if isinstance(res, list):
        return res
    n, tokens = res.get("streams"), res.get("prompt_tokens")
    rows = [
        dict(phase=f"model prefill, first call (compile), {n} streams / {tokens} tokens",
             time_ms=1e3 * res["prefill_compile_s"], max_err=None),
        dict(phase=f"model prefill ({res['prefill_tok_s']:.0f} tokens/s)", time_ms=1e3 * res["prefill_s"],
             max_err=None),
        dict(phase="model decode, first step (compile)", time_ms=1e3 * res["decode_compile_s"], max_err=None),
        dict(phase=f"model decode step, median ({res['decode_tok_s']:.0f} tokens/s)",
             time_ms=1e3 * res["decode_step_s"], max_err=None),
        dict(phase=f"model logits finite: {res.get('finite')}", time_ms=None, max_err=None,
             ok=bool(res.get("finite"))),
    ]
    if res.get("prefill_repeat_rel_err") is not None:
        err = res["prefill_repeat_rel_err"]
        rows.append(dict(phase="model prefill after release vs first prefill (relative)", time_ms=None,
                         max_err=err, tol=REPEAT_TOLERANCE, ok=bool(err <= REPEAT_TOLERANCE)))
    return rows


def run(argv: Optional[list] = None) -> dict:
    """Parses ``argv`` (``--help`` lists the options; a bad value exits 2 before any work), runs the sections,
    prints their tables and the verdict. Returns {section name: rows, ...} plus "passed" (bool) and "failed"
    (the failed rows' phases)."""
    args = parse_args(argv)
    tol = TOLERANCE[args.precision]
    print(f"jax-gdn demo on {jax.default_backend()} ({jax.devices()[0].device_kind}), backend={args.backend}, "
          f"layers={args.layers}, lengths={args.lengths}", flush=True)
    print(f"pass mark: every GDN-stack output and state within {tol:g} (max abs error against the monolithic "
          f"layer, precision {args.precision!r}), spare slots untouched (NaN); model logits finite and a prefill "
          f"after release within {REPEAT_TOLERANCE:g} (relative) of the first", flush=True)
    results = {}
    with jax.default_matmul_precision(args.precision):
        rows = run_gdn_stack_demo(args)
    results["gdn_stack"] = rows
    print(format_table(rows, f"\nGDN stack ({args.layout}): split protocol vs monolithic"), flush=True)
    if not args.skip_model:
        rows = run_model_section(args)
        results["model"] = rows
        print(format_table(rows, "\nHybrid model (jax_gdn.model_demo)"), flush=True)
    passed, failed = verdict(results)
    checked = sum(r.get("ok") is not None for rows in results.values() for r in rows)
    if passed:
        print(f"\nPASS: {checked} checks within tolerance", flush=True)
    else:
        print(f"\nFAIL: {len(failed)} of {checked} checks: " + "; ".join(failed), flush=True)
    return {**results, "passed": passed, "failed": failed}


def main(argv: Optional[list] = None) -> int:
    """``python -m jax_gdn demo``: exit status 0 on PASS, 1 on FAIL (2 for a bad option, from argparse)."""
    return 0 if run(argv)["passed"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
