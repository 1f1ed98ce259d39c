"""Sections "model" and "model_35b": the whole hybrid model against HF transformers, same GPU, same run.

Model ("model"): Qwen3-Next-80B-A3B dims (hidden 2048, vocab 151936; GDN 16 key / 32 value heads x 128, conv 4;
attention 16 q / 2 kv heads x 256, partial RoPE 0.25; MoE 512 experts top-10, moe_intermediate 512, shared expert
512 with its sigmoid gate) at ``layers`` = 8 layers (2 x (3 GDN + 1 attention)), random bf16 weights made on the
device (``jax_gdn.model.init_params``), ``HybridModel(backend="auto")``.
"model_35b" (``--dims qwen3_5_35b_a3b``): Qwen3.5-35B-A3B at its full depth, 40 layers (30 GDN + 10 attention;
the same GDN and attention heads, 256 experts top-8, vocab 248320, separate GDN projections; 34.7B parameters,
65 GiB in bf16), HF's ``Qwen3_5MoeForCausalLM`` as the peer. Its HF child runs before our model is built (the two
models' weights do not fit the GPU together), and neither the 48-layer compile nor the parts run (``DIMS``).

Rows (``kind``, ``tokens``):
  prefill varlen16-T19027   the 16 streams of benchmarks.cases.VARLEN16_LENS, fresh, one packed call
  prefill B1-T32768         one fresh 32768-token stream
  decode  decode-N64-ctx1189  one decode step of 64 streams each holding 1189 tokens (the context is prefilled
                            as 4 calls of 16 x 1189 tokens, the varlen16 program's shape bucket)
Ours: ``model.prefill`` / ``model.decode`` (public API: host checks, bucket padding, one program); a prefill row
releases its slots before every call (release not timed). HF: ``Qwen3NextForCausalLM`` of the same config (torch
bf16, SDPA attention, its default experts implementation), ``use_cache=False, logits_to_keep=1``; varlen16 as a
left-padded [16, 4000] batch with its attention mask (HF takes no packed streams); decode through its cache after
a [64, 1189] prefill.
HF on its fast GDN path (``benchmarks.hf``): its four GDN callables pointed at FLA's kernels and its gated norm at
FLA's fused one, FLA on its plain Triton kernels (``FLA_FLASH_QLA=0``, column "hf"); where ``QLA_SITE`` names the
FlashQLA stack's folder, again in a second child on FLA's default path with FlashQLA (column "hf_qla", rows'
"speedup_qla"; an error wherever FlashQLA did not really run); ``info["hf_kernels"]`` names what the timed calls
ran and ``info["hf_kernels_resolved"]`` what transformers had picked by itself; ``python -m benchmarks.model
--hf-check`` checks that wiring against HF's own torch path on the GPU.
Timing, the same for both columns: wall clock of one call closed by a device sync (``jax.block_until_ready`` /
``torch.cuda.synchronize``), median of ``reps`` calls after one warm-up call (ours: the warm-up is the first call,
its time is ``first_call_s``: compile + run). HF's ``triton.testing.do_bench`` median is kept beside as
``hf_do_bench_ms`` (the anchor's method). Order: our rows first (JAX with XLA_PYTHON_CLIENT_PREALLOCATE=false,
set by the CLI before JAX starts), then HF in a child process (``--hf-only``: torch and JAX never share
a process, and HF's memory is gone when the child exits; a hang is cut by the stage's time budget), then the
compile measurement (a child process), then the parts.

parts_ms (varlen16, T padded to the model's token bucket): each part of the model jitted alone with the model's
own layer-0 parameters and backends, on random activations, timed three ways (``benchmarks.model_parts``); the state a part
advances (GDN slots: phases 1, 2 and gdn_decode; KV pages: attention) is donated and each call's (iteration's) new
state feeds the next, as in the model (``PARTS_TIMING`` says all of this in the JSON):
  ms_in_program  {part: ms}: the part R = ``LOOP_ITERS`` (10; decode 20) times inside ONE compiled program
               (``_in_program``: lax.fori_loop with a static trip count as the model's scan, the carry donated; x
               fed back as the next iteration's x, or for a part not returning the residual stream its outputs
               carried and every activation input nudged by one element read from them, so nothing is
               loop-invariant); (median t(2 programs queued, one sync) - median t(1 program, one sync)) / R over
               max(reps, 3) batches: the part's device time per layer as the model's one program runs it, no
               per-part dispatch, launch or sync. The compiled loop
               body is searched for copies of carried buffers (``loop_copies``; in_program[part]["copies"]).
  ms_pipelined R = ``PIPE_CALLS`` (10) separate calls queued back to back with no sync in between, then one
               ``block_until_ready`` of all their results; total / R, median of max(reps, 3) batches (each call pays
               its host dispatch, overlapped with the device's work on the calls before it: a part faster on the
               device than its dispatch, tens of us, reads the dispatch time: an upper bound).
  ms_blocking  each call closed by ``block_until_ready``, median of reps calls: the rows' method, which adds ~0.5
               ms of launch + sync per call on the H200 (docs/benchmarking.md). Decode parts: max(reps,
               5) calls and batches.
  <part> (ms)  the figure of record (``choose_figures``): ms_in_program when sound (measured, > 0, no carried-buffer
               copy in the loop, >= 0.6 x its roofline, <= 1.25 x the separate call), else ms_pipelined; ms_source
               says which, in_program_unsound why not; suspect flags a pipelined figure above 1.15 x its blocking
               one (an idle GPU cannot run queued calls slower than synced ones: another process on the GPU) and a part compiled more
               than once (compiles). floor_ratio, model_sum and other use it; floor_ratio_<timing>, model_sum_<timing>,
               other_<timing> the three timings beside.
The parts:
  gdn_phase1   input RMSNorm + in_proj + gates, varlen causal conv, q/k L2 norm (one GDN layer; gdn.phase1_varlen)
  gdn_phase2   the chunked gated delta rule over the slot pool (gdn_full_varlen)
  gdn_phase3   gated RMSNorm, out_proj, residual (no FFN)
  attention    input RMSNorm + attention_layer (projections, RoPE, K/V page writes, paged attention, gate, o_proj)
  moe          post RMSNorm + the sparse MoE (router, routed experts, shared expert) + residual
  embed_logits embedding gather [T] + final RMSNorm + lm_head on the N last tokens
  model_sum    layers x each part + embed_logits (GDN layers x phases 1-3, attention layers, MoE layers), of the
               figure of record; model_sum_<timing> of each timing
  model        the varlen16 row (ours, blocking: the user's latency); "other" = model - model_sum (scan, slicing
               of the stacked cache, ...)
  floor_ms, floor_ratio (part / floor), floor_basis, roofline: per part, ``prefill_floors`` (matmul FLOPs at 700
               TFLOP/s or bytes at 4.8 TB/s, whichever is larger; the GDN core at the kernel bench's fastest time
               and the attention core at the attention bench's torch SDPA time for this case, read from this
               device's results JSON when it has them: ``floor_source``); the formulas are in the docstrings
  decode       the decode row's step (64 streams x 1189 tokens), same layout: gdn_decode (the whole GDN mixer
               of one layer, gdn_layer_decode: norm, projections, conv, recurrent step, gated norm, out_proj,
               residual), attention_decode (input norm + attention_layer at decode against 1189 tokens of paged
               K/V), moe (post norm + MoE on 64 tokens + residual), embed_logits (64 tokens); the GDN slots and
               KV pages donated and carried between calls as in the model's step; floors: ``decode_floors``
               (bytes at 4.8 TB/s: weights read + states / K/V read and written)
row_floors (and each row's "row_floor_ms", "row_floor_roofline_ms", "hf_over_floor", "hf_over_roofline"): per row
  the sum over the model's parts of (layers running it) x (its floor) (``row_floor``: the parts' floors, and every
  term at its pure roofline), HF / floor the best speed-up over HF any implementation could reach at those floors.
compile_s_48_layers: the 48-layer config's prefill (varlen16 bucket), traced, lowered and compiled with abstract
parameters and cache (``jax.ShapeDtypeStruct``: no weights), in a fresh process (a first call: no in-process
caches), through the public ``HybridModel.prefill`` wrapped in ``jax.jit``.

    run_section(quick=False) -> {"layers", "config", "device", "rows": [{"case", "kind", "tokens", "ms": {"ours",
        "hf"}, "tokens_per_s": {"ours", "hf"}, "speedup", "first_call_s", "row_floor_ms", ...}], "parts_ms": {...},
        "row_floors": [...], "compile_s_48_layers", "compile": {"layers", "s"}, "errors": [...]}
``quick``: tiny dims on any device (a CPU smoke run of the code path, not a measurement; HF skipped unless
``hf=True``, then on torch's CPU fallbacks).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

from benchmarks.cases import cu_seqlens, model_cases
from benchmarks.configs import LAYERS, MODEL_DIMS, model_config, random_device_model, tiny_config
from benchmarks.floors import load_peers, row_floors
from benchmarks.model_parts import REPS, measure_parts, parts_markdown, print_parts
from benchmarks.tables import fmt, md_header
from benchmarks.timing import median_ms
from jax_gdn.timing import jax_sync

#: depth of the compile-time measurement (the full model)
COMPILE_LAYERS = 48
#: the section's results-JSON key
KEY = "model"
#: per dims (``benchmarks.configs.MODEL_DIMS``): the results key; whether HF runs before ours (a model of half the
#: GPU's memory: ours and HF's weights are never on it together, and JAX's allocator keeps what it once took, so
#: HF's child runs first and exits); the compile measurement's depth (0: none; the rows' first call is the
#: full-depth compile); whether the parts are timed; the speed-up over HF its rows aim for
DIMS = {"qwen3_next_80b": dict(key=KEY, hf_first=False, compile_layers=COMPILE_LAYERS, parts=True, target_x=3),
        "qwen3_5_35b_a3b": dict(key="model_35b", hf_first=True, compile_layers=0, parts=False, target_x=5)}
#: the CLI's sections of this module -> their dims
SECTION_DIMS = {spec["key"]: dims for dims, spec in DIMS.items()}


def shared_cache_kwargs(cases: dict, reps: int) -> dict:
    """The cache of the varlen and decode rows (and of the compile measurement): S = max(64, 16) slots, a pool for
    both, max_seq_len the longest of their streams rounded up to a power of two (4096 at 80B dims; the page
    table's width W bounds attention work per slot, so it is not sized for the 32768-token row)."""
    _, dn, dctx, _ = cases["decode"]
    lens = cases["varlen"][1]
    s = max(dn, len(lens))
    seq = 1 << (max(max(lens), dctx + reps + 8) - 1).bit_length()
    return dict(max_seqs=s, max_tokens=sum(lens) + dn * (dctx + reps + 8) + 2 * s * 16, page_size=16,
                max_seq_len=seq)


def our_rows(model, cases: dict, reps: int = REPS, seed: int = 0, log=None, keys=("long", "varlen", "decode")) -> dict:
    """{"varlen", "long", "decode": {"ms", "first_call_s"}} through the public API (``keys``: which of them). The
    varlen and decode rows share one cache (the decode context is prefilled with the varlen program's bucket); the
    long row has its own (1 slot, max_seq_len = its length)."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    n_long = cases["long"][1][0]
    caches = {"varlen": lambda: model.init_cache(**shared_cache_kwargs(cases, reps)),
              "long": lambda: model.init_cache(max_seqs=1, max_tokens=n_long + 16, page_size=16,
                                               max_seq_len=n_long)}
    out = {}
    state = {}

    for key in [k for k in ("long", "varlen") if k in keys]:     # varlen last: its cache goes on to the decode row
        state.pop("cache", None)
        state["cache"] = caches[key]()
        _, lens = cases[key]
        ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
        cu = cu_seqlens(lens)
        slots = np.arange(len(lens), dtype=np.int32)
        try:
            def call():
                logits, state["cache"] = model.prefill(state["cache"], ids, cu, slots)
                return logits

            def prepare():
                state["cache"] = jax_sync(model.release(state["cache"], slots))
            prepare()
            t0 = time.perf_counter()
            jax_sync(call())
            first = time.perf_counter() - t0
            ms = median_ms(call, jax_sync, reps, prepare)
            if hasattr(model, "check"):
                model.check(state["cache"])       # a refused step (out of pages) would have timed nothing
            prepare()
            out[key] = {"ms": ms, "first_call_s": first}
            if log is not None:
                log(f"ours {key}: {out[key]}")
        except Exception as err:
            out[key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            traceback.print_exc()

    try:
        if "decode" in keys:
            if "cache" not in state:
                state["cache"] = caches["varlen"]()
            out["decode"] = decode_row(model, cfg, cases, rng, reps, state)
    except Exception as err:
        out["decode"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        traceback.print_exc()
    out["compiled_programs"] = model.compiled_programs() if hasattr(model, "compiled_programs") else None
    del state
    return out


def decode_row(model, cfg, cases: dict, rng, reps: int, state: dict) -> dict:
    """The decode row: the context of cases["decode"] = (name, N, ctx, chunk) prefilled in calls of ``chunk``
    streams (slots 0..N-1 of state["cache"], which is replaced as the model returns it), then the median of
    max(reps, 5) one-token steps for the N streams after a first (compiling) step.
    Returns {"ms", "first_call_s", "context_fill_s"}; model.check(cache) after the steps (a refused step would
    have timed nothing)."""
    _, dn, dctx, dchunk = cases["decode"]
    slots = np.arange(dn, dtype=np.int32)
    t0 = time.perf_counter()
    for c in range(0, dn, dchunk):                                    # the context: calls of dchunk streams
        sl = slots[c:c + dchunk]
        ids = rng.integers(0, cfg.vocab_size, len(sl) * dctx).astype(np.int32)
        logits, state["cache"] = model.prefill(state["cache"], ids, cu_seqlens([dctx] * len(sl)), sl)
    jax_sync(logits)
    fill = time.perf_counter() - t0
    nxt = rng.integers(0, cfg.vocab_size, dn).astype(np.int32)

    def step():
        logits, state["cache"] = model.decode(state["cache"], nxt, slots)
        return logits
    t0 = time.perf_counter()
    jax_sync(step())
    first = time.perf_counter() - t0
    ms = median_ms(step, jax_sync, max(reps, 5))
    if hasattr(model, "check"):
        model.check(state["cache"])
    return {"ms": ms, "first_call_s": first, "context_fill_s": fill}


def compile_seconds(config, lens, dtype=None, backend: str = "auto", cache_kwargs: dict = None) -> dict:
    """Trace + lower + compile of ``HybridModel.prefill`` (wrapped in jax.jit, params and cache abstract) for
    ``config`` on one call of ``lens`` into a cache of ``init_cache(**cache_kwargs)``. Returns {"layers", "s",
    "lower_s", "compile_s"}."""
    import jax
    import jax.numpy as jnp
    from jax_gdn.model import HybridModel, init_params
    dtype = dtype or jnp.bfloat16
    aparams = jax.eval_shape(lambda k: init_params(config, k, dtype), jax.random.PRNGKey(0))
    shell = HybridModel(config, aparams, dtype=dtype, backend=backend)
    t = int(sum(lens))
    cache_kwargs = cache_kwargs or dict(max_seqs=len(lens), max_tokens=t + 16 * len(lens), page_size=16)
    acache = jax.eval_shape(lambda: shell.init_cache(**cache_kwargs))
    ids = np.zeros((t,), np.int32)
    cu = cu_seqlens(lens)
    slots = np.arange(len(lens), dtype=np.int32)

    def prefill(params, cache):
        m = HybridModel(config, params, dtype=dtype, backend=backend)
        return m.prefill(cache, ids, cu, slots)
    t0 = time.perf_counter()
    lowered = jax.jit(prefill).lower(aparams, acache)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"layers": config.num_hidden_layers, "s": t2 - t0, "lower_s": t1 - t0, "compile_s": t2 - t1}


def _compile_in_subprocess(layers: int, quick: bool, timeout: float = 300.0, dims: str = "qwen3_next_80b") -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "benchmarks.model", "--compile-only", "--layers", str(layers), "--dims", dims]
    if quick:
        cmd.append("--quick")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"compile subprocess rc={r.returncode}: {(r.stderr or r.stdout)[-600:]}")


def _rows(cases: dict, ours: dict, hf_res: dict, hf_qla_res: dict = None) -> list:
    """The section's rows; ``hf_qla_res`` (HF on FLA's default path, FlashQLA on) adds the "hf_qla" column and
    "speedup_qla" where it ran."""
    rows = []
    for key, kind in (("varlen", "prefill"), ("long", "prefill"), ("decode", "decode")):
        case = cases[key]
        tokens = int(sum(case[1])) if kind == "prefill" else case[1]
        o, h = ours.get(key, {}), hf_res.get(key, {})
        row = {"case": case[0], "kind": kind, "tokens": tokens,
               "ms": {"ours": o.get("ms"), "hf": h.get("ms")},
               "tokens_per_s": {"ours": tokens / o["ms"] * 1e3 if o.get("ms") else None,
                                "hf": tokens / h["ms"] * 1e3 if h.get("ms") else None}}
        row["speedup"] = h["ms"] / o["ms"] if o.get("ms") and h.get("ms") else None
        if hf_qla_res is not None:
            hq = hf_qla_res.get(key, {})
            row["ms"]["hf_qla"] = hq.get("ms")
            row["tokens_per_s"]["hf_qla"] = tokens / hq["ms"] * 1e3 if hq.get("ms") else None
            row["speedup_qla"] = hq["ms"] / o["ms"] if o.get("ms") and hq.get("ms") else None
            if "error" in hq:
                row.setdefault("errors", {})["hf_qla"] = hq["error"]
        if "first_call_s" in o:
            row["first_call_s"] = o["first_call_s"]
        if h.get("do_bench_ms") is not None:
            row["hf_do_bench_ms"] = h["do_bench_ms"]
        if kind == "decode":
            row["context"] = case[2]
        for who, res in (("ours", o), ("hf", h)):
            if "error" in res:
                row.setdefault("errors", {})[who] = res["error"]
        rows.append(row)
    return rows


def hf_child_env(flash_qla: bool, environ=None) -> dict:
    """The HF child's environment: FLA's plain Triton path (``FLA_FLASH_QLA=0``), or with ``flash_qla`` FLA's
    default path on Hopper (``FLA_FLASH_QLA=1``) with the FlashQLA stack's folder ``QLA_SITE`` first on PYTHONPATH
    (docs/benchmarking.md: that stack lives in no other process). ValueError naming QLA_SITE when it is unset."""
    env = dict(os.environ if environ is None else environ)
    env["FLA_FLASH_QLA"] = "1" if flash_qla else "0"
    if flash_qla:
        site = env.get("QLA_SITE")
        if not site:
            raise ValueError("hf_qla: QLA_SITE must name the folder the FlashQLA stack was installed into "
                             "(pip install --target; docs/benchmarking.md)")
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _hf_in_subprocess(reps: int, timeout: float, quick: bool = False, flash_qla: bool = False,
                      dims: str = "qwen3_next_80b") -> dict:
    """hf_rows in a child process (its torch memory is gone when it exits; a hang is cut at ``timeout``). The
    child's progress lines go to this process's stderr. ``flash_qla``: FLA's default path with FlashQLA
    (:func:`hf_child_env`); the child's rows become errors unless FlashQLA really ran (``info["flash_qla_ran"]``:
    FLA falls back to its Triton path where FlashQLA does not import)."""
    cmd = [sys.executable, "-m", "benchmarks.model", "--hf-only", "--reps", str(reps), "--dims", dims] + (
        ["--quick"] if quick else [])
    try:
        r = subprocess.run(cmd, env=hf_child_env(flash_qla), stdout=subprocess.PIPE, stderr=None, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"HF subprocess cut at its {timeout:.0f} s time limit") from None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return checked_flash_qla(json.loads(line)) if flash_qla else json.loads(line)
    raise RuntimeError(f"HF subprocess rc={r.returncode}, no result line: {r.stdout[-400:]}")


def checked_flash_qla(res: dict) -> dict:
    """``res`` of an HF child asked to run FlashQLA: unchanged where ``info["flash_qla_ran"]``, else every row an
    error saying FLA ran its Triton path instead (a figure under the wrong name is worse than none)."""
    if (res.get("info") or {}).get("flash_qla_ran"):
        return res
    why = "FlashQLA did not run in the HF child (FLA took its Triton path): " + str(
        (res.get("info") or {}).get("fla_error", "flash_qla was never imported"))[:200]
    return {k: ({"error": why} if isinstance(v, dict) and k != "info" else v) for k, v in res.items()}


def run_section(quick: bool = False, *, dims: str = "qwen3_next_80b", reps: int = REPS, hf: bool = None,
                compile_layers: int = None, subprocess_compile: bool = None, budget_s: float = None,
                on_update=None, hf_qla: bool = None, parts: bool = None) -> dict:
    """Measures the section (see the module docstring) at ``dims`` (a key of ``DIMS``: Qwen3-Next-80B at 8 layers,
    or Qwen3.5-35B-A3B at its full 40). Order: our rows, then HF (a child process: its torch memory never meets
    ours in one process), then the 48-layer compile (a child process), then the parts; where ``DIMS[dims]``
    says ``hf_first``, HF's child runs and exits before our model is built.
    ``hf`` (default: not quick) runs HF transformers; ``compile_layers`` (default ``DIMS[dims]``'s: 48 at 80B
    dims, 0 at 35B) the depth of the compile-time measurement (0: skip); ``parts`` (default ``DIMS[dims]``'s)
    times the model's parts. ``budget_s``: each stage after our rows gets at most what is left of this many seconds
    (a stage that would not fit is skipped and named in "errors"). ``on_update(section)`` is called after each
    stage (e.g. to save partial results). ``hf_qla`` (default: HF runs and ``QLA_SITE`` is set) times HF a
    second time in another child on FLA's default path with FlashQLA (the rows' "hf_qla" column)."""
    start = time.time()
    preallocating = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() not in ("false", "0")
    try:
        from jax._src import xla_bridge
        jax_up = xla_bridge.backends_are_initialized()
    except Exception:  # pragma: no cover - private API moved: assume the worst only when told to preallocate
        jax_up = False
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")     # HF runs beside us in a child process
    if dims not in DIMS:
        raise ValueError(f"dims must be one of {sorted(DIMS)}, got {dims!r}")
    spec = DIMS[dims]
    hf = (not quick) if hf is None else hf
    compile_layers = spec["compile_layers"] if compile_layers is None else compile_layers
    parts = spec["parts"] if parts is None else parts
    subprocess_compile = (not quick) if subprocess_compile is None else subprocess_compile

    def make_cfg(layers):
        return tiny_config(layers, dims) if quick else model_config(dims, layers)
    cfg = make_cfg(LAYERS if quick else MODEL_DIMS[dims])
    cases = model_cases(quick)
    section = {"dims": dims, "layers": cfg.num_hidden_layers, "quick": quick, "reps": reps, "rows": [],
               "parts_ms": {}, "errors": [],
               "config": {"hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "experts": cfg.num_experts,
                          "top_k": cfg.num_experts_per_tok, "layer_types": list(cfg.layer_types)},
               "timing": "rows: wall clock per call closed by a device sync, median of reps after a warm-up call; "
                         "parts_ms: each part in-program (ms_in_program: R iterations in one compiled loop, "
                         "per iteration), pipelined (ms_pipelined: calls queued back to back, one sync, total / "
                         "calls) and blocking (ms_blocking: the rows' method); see parts_ms['timing']"}

    if jax_up and preallocating and hf and not quick:
        section["errors"].append("JAX was initialised with memory preallocation before this section: the HF child "
                                 "process may run out of GPU memory; run with XLA_PYTHON_CLIENT_PREALLOCATE=false")

    def left() -> float:
        return float("inf") if budget_s is None else budget_s - (time.time() - start)

    def out_of_time(stage: str, need: float) -> bool:
        if left() < need:
            section["errors"].append(f"{stage}: skipped, {budget_s:.0f} s budget ({time.time() - start:.0f} s "
                                     f"used, ~{need:.0f} s needed)")
            return True
        return False

    def update(stage: str = None):
        if stage is not None and not quick:
            print(f"[model] {time.time() - start:6.0f} s  {stage}", file=sys.stderr, flush=True)
        if on_update is not None:
            on_update(section)

    import jax
    import jax.numpy as jnp
    dev = jax.devices()[0]
    section["device"] = str(getattr(dev, "device_kind", dev))
    ours, hf_res, hf_qla_res = {}, {}, None
    model = None
    if hf_qla is None:
        hf_qla = bool(hf) and bool(os.environ.get("QLA_SITE"))

    def run_hf():
        """HF's children: FLA's Triton path, then (``hf_qla``) FLA's default path with FlashQLA."""
        nonlocal hf_res, hf_qla_res
        if hf and not out_of_time("hf", 30):
            try:
                hf_res = _hf_in_subprocess(reps, timeout=min(left() - 5, 900.0), quick=quick, dims=dims)
                section["hf"] = hf_res.get("info")
            except Exception as err:
                section["errors"].append(f"hf: {type(err).__name__}: {str(err)[:300]}")
            section["rows"] = _rows(cases, ours, hf_res)
            update(f"hf rows done: {hf_res}")
        if hf_qla and not out_of_time("hf_qla", 30):
            try:
                hf_qla_res = _hf_in_subprocess(reps, timeout=min(left() - 5, 900.0), quick=quick, flash_qla=True,
                                               dims=dims)
                section["hf_qla"] = hf_qla_res.get("info")
            except Exception as err:
                hf_qla_res = {"varlen": {"error": f"{type(err).__name__}: {str(err)[:300]}"}}
                section["errors"].append(f"hf_qla: {type(err).__name__}: {str(err)[:300]}")
            section["rows"] = _rows(cases, ours, hf_res, hf_qla_res)
            update(f"hf (FlashQLA) rows done: {hf_qla_res}")
    if spec["hf_first"]:
        run_hf()
    try:
        t0 = time.time()
        if quick:   # host-made tiny weights (compiling the random generator costs more than the rest on a CPU)
            from jax_gdn.checkpoint import random_model
            model = random_model(cfg, seed=0, dtype=jnp.float32, backend="auto")
        else:
            model = random_device_model(cfg, jnp.bfloat16, "auto")
        jax_sync(model.params)
        section["init_s"] = round(time.time() - t0, 1)
        section["model"] = repr(model)
        update(f"model built: {section['model']}")
        ours = our_rows(model, cases, reps, log=None if quick else update)
    except Exception as err:
        section["errors"].append(f"ours: {type(err).__name__}: {str(err)[:300]}")
        traceback.print_exc()
    section["rows"] = _rows(cases, ours, hf_res, hf_qla_res)
    section["compiled_programs"] = ours.get("compiled_programs")
    update(f"our rows done: {ours}")
    if not spec["hf_first"]:
        run_hf()

    section["compile_s_48_layers"] = None
    if compile_layers and not out_of_time("compile", 10 if quick else 30):
        try:
            if subprocess_compile:
                c = _compile_in_subprocess(compile_layers, quick, timeout=min(left() - 5, 600.0), dims=dims)
            else:
                c = compile_seconds(make_cfg(compile_layers), cases["varlen"][1],
                                    jnp.float32 if quick else jnp.bfloat16, "auto",
                                    cache_kwargs=shared_cache_kwargs(cases, REPS))
            section["compile"] = c
            if c["layers"] == 48 and not quick:
                section["compile_s_48_layers"] = c["s"]
        except Exception as err:
            section["errors"].append(f"compile: {type(err).__name__}: {str(err)[:300]}")
            traceback.print_exc()
        update(f"compile done: {section.get('compile')}")

    peers = {} if quick else load_peers(section["device"])
    add_row_floors(section, cfg, cases, peers, jnp.dtype(jnp.float32 if quick else jnp.bfloat16).itemsize)
    if parts and model is not None and not out_of_time("parts", 10 if quick else 30):
        try:
            section["parts_ms"] = measure_parts(model, cases, reps, ours, peers,
                                                log=None if quick else update)
        except Exception as err:
            section["errors"].append(f"parts: {type(err).__name__}: {str(err)[:300]}")
            traceback.print_exc()
        update(f"parts done: {section.get('parts_ms')}")
    del model
    gc.collect()
    section["wall_s"] = round(time.time() - start, 1)
    update()
    return section


def add_row_floors(section: dict, config, cases: dict, peers: dict = None, dtype_bytes: int = 2,
                   stored_rows: list = None) -> None:
    """section["row_floors"] = ``row_floors`` of the section's rows (HF and our ms from section["rows"]; where a row
    has no HF ms, from ``stored_rows`` (e.g. the results JSON's model rows, peers["model_rows"]) when given, the
    source named in "hf_source"), and each row of section["rows"] gets "row_floor_ms", "row_floor_roofline_ms",
    "hf_over_floor", "hf_over_roofline" (None without HF ms). ``config``: the rows' model (its layer counts)."""
    own = {r["case"]: r for r in section.get("rows") or []}
    stored = {r.get("case"): r for r in stored_rows or []}
    merged = []
    for key in ("varlen", "long", "decode"):
        name = cases[key][0]
        ms = dict((own.get(name) or {}).get("ms") or {})
        src = "this run" if ms.get("hf") else None
        if not ms.get("hf") and (stored.get(name) or {}).get("ms", {}).get("hf"):
            ms["hf"], src = stored[name]["ms"]["hf"], "stored"
            ms.setdefault("ours", None)
            if not ms.get("ours"):
                ms["ours"] = stored[name]["ms"].get("ours")
        merged.append({"case": name, "ms": ms, "hf_source": src})
    floors = row_floors(config, cases, merged, peers, dtype_bytes)
    for f, m in zip(floors, merged):
        f["hf_source"] = m["hf_source"]
    section["row_floors"] = floors
    for r in section.get("rows") or []:
        f = next((x for x in floors if x["case"] == r["case"]), None)
        if f is not None:
            r.update({k: f.get(k) for k in ("row_floor_ms", "row_floor_roofline_ms", "row_floor_hw_peak_ms",
                                            "hf_over_floor", "hf_over_roofline", "hf_over_hw_peak")})


def _print_row_floors(floors: list, note: str = "") -> None:
    """The row floors (``row_floor``): per row its floor (parts' basis) and pure roofline, ours and HF against them,
    whether 3x HF lies above the floor; then each prefill row's terms (count x part floor)."""
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    if not floors:
        return
    print(f"row floors{note} (sum over parts of layers x floor; roofline: every term at max(FLOPs / 700 TFLOP/s, "
          f"bytes / 4.8 TB/s); hw peak: the same at 989 TFLOP/s):")
    print(f"  {'case':<22} {'ours ms':>8} {'HF ms':>8} {'floor ms':>9} {'roofline':>9} {'hw peak':>8} "
          f"{'ours/floor':>10} {'HF/floor':>9} {'HF/roofl':>9} {'HF/peak':>8}  3x HF within the floor?")
    for r in floors:
        ok = r.get("target_3x_within_floor")
        print(f"  {r['case']:<22} {f(r.get('ours_ms')):>8} {f(r.get('hf_ms')):>8} {f(r['row_floor_ms']):>9} "
              f"{f(r['row_floor_roofline_ms']):>9} {f(r.get('row_floor_hw_peak_ms')):>8} "
              f"{f(r.get('ours_over_floor')):>10} {f(r.get('hf_over_floor')):>9} {f(r.get('hf_over_roofline')):>9} "
              f"{f(r.get('hf_over_hw_peak')):>8}  "
              + ("-" if ok is None else "yes" if ok else "NO: 3x HF is beyond the floors")
              + (" (HF ms stored)" if r.get("hf_source") == "stored" else ""))
    for r in floors:
        if r["kind"] == "prefill":
            print(f"    {r['case']}: " + ", ".join(f"{k} {t['count']} x {t['floor_ms']:.3g} = {t['ms']:.2f}"
                                                     for k, t in r["terms"].items()))


def print_section(section: dict, summary: bool = True) -> None:
    """A short table of the section; with ``summary`` the ``summary_lines`` last."""
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    print(f"model: {section.get('model', '?')} on {section.get('device', '?')}"
          f"{' (quick: tiny dims, not a measurement)' if section.get('quick') else ''}")
    print(f"{'case':<24} {'kind':<8} {'tokens':>7} | {'ours ms':>9} {'HF ms':>9} | {'ours tok/s':>11} "
          f"{'HF tok/s':>11} | {'x HF':>6} | {'1st call s':>10}")
    for r in section.get("rows", []):
        qla = (f" | HF (FlashQLA) {f(r['ms']['hf_qla'])} ms, x {f(r.get('speedup_qla'))}"
               if "hf_qla" in r["ms"] else "")
        print(f"{r['case']:<24} {r['kind']:<8} {r['tokens']:>7} | {f(r['ms']['ours']):>9} {f(r['ms']['hf']):>9} | "
              f"{f(r['tokens_per_s']['ours'], '{:.0f}'):>11} {f(r['tokens_per_s']['hf'], '{:.0f}'):>11} | "
              f"{f(r['speedup']):>6} | {f(r.get('first_call_s'), '{:.1f}'):>10}{qla}")
        for who, err in r.get("errors", {}).items():
            print(f"    {who}: {err[:160]}")
    hf = section.get("hf") or {}
    if hf:
        k = hf.get("hf_kernels") or {}
        print(f"HF: transformers {hf.get('transformers')}, torch {hf.get('torch')}, FLA {hf.get('fla', '-')}; its GDN "
              "layer ran: " + ", ".join(f"{n} -> {v.split(' (')[0]}" for n, v in k.items())
              + (f"; FLA error: {hf['fla_error']}" if hf.get("fla_error") else ""))
    p = section.get("parts_ms") or {}
    if p:
        lay = p.get("layers", {})
        print(f"parts, prefill {p.get('case')} (T={p.get('tokens')} padded to {p.get('padded_tokens')}; ms per layer, "
              f"x {lay.get('gdn')} GDN / {lay.get('attention')} attention / {lay.get('moe')} MoE layers):")
        print_parts(p, ("gdn_phase1", "gdn_phase2", "gdn_phase3", "attention", "moe", "mlp", "embed_logits"))
        d = p.get("decode") or {}
        if d:
            print(f"parts, decode {d.get('case')} ({d.get('streams')} streams x {d.get('context')} tokens; ms per "
                  f"layer):")
            print_parts(d, ("gdn_decode", "attention_decode", "moe", "mlp", "embed_logits"))
        if p.get("timing"):
            print(f"  timing of the parts: {p['timing']}")
        over = [f"{k} {v:.2f}" for q in (p, d) for k, v in (q.get("floor_ratio") or {}).items() if v and v > 2]
        if p.get("floor_ratio") and not section.get("quick"):
            print("targets: each part within 2x of its floor: "
                  + ("met" if not over else "NOT met: " + ", ".join(over)))
    _print_row_floors(section.get("row_floors"), f" of the {section.get('layers', '?')}-layer rows")
    c = section.get("compile") or {}
    if c:
        print(f"compile of the {c.get('layers')}-layer prefill (abstract weights, fresh process): "
              f"{f(c.get('s'), '{:.1f}')} s "
              f"(trace+lower {f(c.get('lower_s'), '{:.1f}')} s, compile {f(c.get('compile_s'), '{:.1f}')} s)")
    sp = [r["speedup"] for r in section.get("rows", []) if r.get("speedup")]
    if sp:
        x = DIMS.get(section.get("dims", "qwen3_next_80b"), DIMS["qwen3_next_80b"])["target_x"]
        print(f"targets: tokens/s >= {x}x HF on every row: {'met' if min(sp) >= x else 'NOT met'} "
              f"(x {', '.join(f'{x:.2f}' for x in sp)})", end="")
        c48 = section.get("compile_s_48_layers")
        print("" if c48 is None else f"; 48-layer compile <= 60 s: {'met' if c48 <= 60 else 'NOT met'} "
                                     f"({c48:.1f} s)")
    for e in section.get("errors", []):
        print(f"  error: {e[:200]}")
    if summary:
        for line in summary_lines(section):
            print(line)


def summary_lines(section: dict, extra_floors: list = None) -> list:
    """At most 12 lines that say the section's essentials, printed last (a run whose output comes back as its last
    lines only keeps them): a header, one line per prefill part and per decode part ("P"/"D" name: in-program |
    pipelined | blocking | floor ms, figure of record / floor and its source; flags: S suspect, C carried copies in
    the loop, U in-program unsound), then one line of sums (model sum of each timing against the measured row) and
    row floors (HF / floor, HF / roofline, HF / hw peak per prefill row; ``extra_floors`` instead of the section's
    when given)."""
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)
    p = section.get("parts_ms") or {}
    out = []
    if p.get("ms_pipelined"):
        out.append("SUMMARY part ms/layer: in-program | pipelined | blocking | floor | record/floor (source) flags")
        for tag, q in (("P", p), ("D", p.get("decode") or {})):
            for k in (q.get("ms_pipelined") or {}):
                ip = (q.get("ms_in_program") or {}).get(k)
                flags = ("S" if k in (q.get("suspect") or {}) else "") + (
                    "C" if ((q.get("in_program") or {}).get(k) or {}).get("carried_copies") else "") + (
                    "U" if (q.get("in_program_unsound") or {}).get(k, "not measured") != "not measured" else "")
                out.append(f"{tag} {k:<16} {f(ip):>7} | {f(q['ms_pipelined'].get(k)):>7} | "
                           f"{f((q.get('ms_blocking') or {}).get(k)):>7} | {f((q.get('floor_ms') or {}).get(k)):>7} | "
                           f"{f((q.get('floor_ratio') or {}).get(k), '{:.2f}'):>5} "
                           f"({(q.get('ms_source') or {}).get(k, '-')[:4]}) {flags}")
    bits = []
    for tag, q in (("prefill", p), ("decode", p.get("decode") or {})):
        if q.get("model_sum") is not None:
            bits.append(f"{tag} sum in/pipe/blk {f(q.get('model_sum_in_program'), '{:.2f}')}/"
                        f"{f(q.get('model_sum_pipelined'), '{:.2f}')}/{f(q.get('model_sum_blocking'), '{:.2f}')} "
                        f"vs measured {f(q.get('model'), '{:.2f}')}")
    for r in extra_floors if extra_floors is not None else section.get("row_floors") or []:
        if r.get("kind") == "prefill" and r.get("hf_ms"):
            bits.append(f"{r['case']} floor {r['row_floor_ms']:.1f} ms HF/floor {r['hf_over_floor']:.2f} "
                        f"/roofl {r['hf_over_roofline']:.2f} /peak {r['hf_over_hw_peak']:.2f}")
    if bits:
        out.append("; ".join(bits))
    return out[:12]


def markdown(m: dict) -> list:
    """The README's tables of the section: the rows against HF, then each part against its floor."""
    qla = any("hf_qla" in r["ms"] for r in m["rows"])
    out = md_header([f"model ({m['layers']} layers, {m.get('dims', 'qwen3_next_80b')})", "kind", "tokens",
                     "ours ms", "HF ms", "ours tokens/s", "HF tokens/s", "ours / HF"]
                    + (["HF ms (FlashQLA)", "ours / HF (FlashQLA)"] if qla else []),
                    text_cols=2)
    for r in m["rows"]:
        ms, tps = r["ms"], r["tokens_per_s"]
        speed = fmt(ms["hf"] / ms["ours"], "{:.2f}x") if ms.get("hf") and ms.get("ours") else "-"
        extra = (f" {fmt(ms.get('hf_qla'), '{:.1f}')} | {fmt(r.get('speedup_qla'), '{:.2f}x')} |" if qla else "")
        out.append(f"| {r['case']} | {r['kind']} | {r['tokens']} | {fmt(ms.get('ours'), '{:.1f}')} | "
                   f"{fmt(ms.get('hf'), '{:.1f}')} | {fmt(tps.get('ours'), '{:,.0f}')} | "
                   f"{fmt(tps.get('hf'), '{:,.0f}')} | {speed} |{extra}")
    parts = parts_markdown(m.get("parts_ms"))
    return out + ([""] + parts[:-1] if parts else [])


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny dims (CPU smoke run)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--compile-only", action="store_true", help="print the compile-time JSON line and exit")
    p.add_argument("--layers", type=int, default=COMPILE_LAYERS, help="depth of --compile-only")
    p.add_argument("--dims", choices=sorted(DIMS), default="qwen3_next_80b",
                   help="the model's dims and depth (benchmarks.configs.MODEL_DIMS)")
    p.add_argument("--json", default=None)
    p.add_argument("--hf-only", action="store_true", help="print HF's rows as a JSON line and exit (a GPU)")
    p.add_argument("--hf-check", action="store_true",
                   help="print a JSON line: HF on FLA's kernels against HF's torch path, 2 layers (GDN + attention) "
                        "at --dims (--quick: tiny dims); needs FLA and a GPU")
    a = p.parse_args(argv)
    if a.hf_check:
        from benchmarks.hf import hf_check
        res = hf_check(a.quick, dims=a.dims)
        print(json.dumps(res), flush=True)
        return res
    if a.hf_only:
        from benchmarks.hf import hf_rows
        res = hf_rows(tiny_config(LAYERS, a.dims) if a.quick else model_config(a.dims), model_cases(a.quick), a.reps,
                      log=lambda m: print(f"[hf] {m}", file=sys.stderr, flush=True))
        print(json.dumps(res), flush=True)
        return res
    if a.compile_only:
        import jax.numpy as jnp
        cfg = tiny_config(a.layers, a.dims) if a.quick else model_config(a.dims, a.layers)
        cases = model_cases(a.quick)
        res = compile_seconds(cfg, cases["varlen"][1], jnp.float32 if a.quick else jnp.bfloat16, "auto",
                              cache_kwargs=shared_cache_kwargs(cases, REPS))
        print(json.dumps(res), flush=True)
        return res
    section = run_section(a.quick, dims=a.dims, reps=a.reps, hf=False if a.no_hf else None)
    print_section(section)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(section, fh, indent=1)
    return section


if __name__ == "__main__":
    main()
