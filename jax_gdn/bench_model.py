"""Benchmark section "model": the whole hybrid model at Qwen3-Next-80B dims against HF transformers, same GPU, same run.

Model: Qwen3-Next-80B-A3B dims (hidden 2048, vocab 151936; GDN 16 key / 32 value heads x 128, conv 4; attention
16 q / 2 kv heads x 256, partial RoPE 0.25; MoE 512 experts top-10, moe_intermediate 512, shared expert 512 with
its sigmoid gate) at ``layers`` = 8 layers (2 x (3 GDN + 1 attention)), random bf16 weights made on the device
(``jax_gdn.model.init_params``), ``HybridModel(backend="auto")``.

Rows (``kind``, ``tokens``):
  prefill varlen16-T19027   the 16 streams of jax_gdn.cases.VARLEN16_LENS, fresh, one packed call
  prefill B1-T32768         one fresh 32768-token stream
  decode  decode-N64-ctx1189  one decode step of 64 streams each holding 1189 tokens (the context is prefilled
                            as 4 calls of 16 x 1189 tokens, the varlen16 program's shape bucket)
Ours: ``model.prefill`` / ``model.decode`` (public API: host checks, bucket padding, one program); a prefill row
releases its slots before every call (release not timed). HF: ``Qwen3NextForCausalLM`` of the same config (torch
bf16, SDPA attention, its default experts implementation), ``use_cache=False, logits_to_keep=1``; varlen16 as a
left-padded [16, 4000] batch with its attention mask (HF takes no packed streams); decode through its cache after
a [64, 1189] prefill.
HF on its fast GDN path: transformers 5.17's qwen3_next module resolves, at import, each of its four GDN callables
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``: FLA's when ``fla`` imports;
``causal_conv1d_fn``, ``causal_conv1d_update``: the ``causal_conv1d`` package's, absent on the GPU machine, so
its torch conv) and has no fused gated norm (torch ``Qwen3NextRMSNormGated``). ``hf_rows`` therefore assigns all
four module attributes, which the GDN layer looks up at each call, to FLA 0.6's kernels (``fla_kernels``: FLA's
two gated delta rules as they are, kwargs filtered as transformers' wrapper does; FLA's Triton
``fla.modules.causal_conv1d.causal_conv1d`` / ``causal_conv1d_update`` adapted to causal_conv1d's signatures and
[B, D, T] layout) and swaps each GDN layer's gated norm for FLA's ``FusedRMSNormGated`` (``use_hf_kernels``).
``info["hf_kernels"]`` names what the timed calls ran and ``info["hf_kernels_resolved"]`` what transformers had
picked by itself (read from the wrappers' closures: their ``__module__`` is transformers' whatever runs). Checked
against HF's own torch path by ``hf_kernel_check`` (CPU tests with FLA-contract stand-ins; on the GPU
``benchmarks/gpu/model_bench.py --check``).
Timing, the same for both columns: wall clock of one call closed by a device sync (``jax.block_until_ready`` /
``torch.cuda.synchronize``), median of ``reps`` calls after one warm-up call (ours: the warm-up is the first call,
its time is ``first_call_s``: compile + run). HF's ``triton.testing.do_bench`` median is kept beside as
``hf_do_bench_ms`` (the anchor's method). Order: our rows first (JAX with XLA_PYTHON_CLIENT_PREALLOCATE=false,
set here when JAX is not yet initialised), then HF in a child process (``--hf-only``: torch and JAX never share
a process, and HF's memory is gone when the child exits; a hang is cut by the stage's time budget), then the
compile measurement (a child process), then the parts.

parts_ms (varlen16, T padded to the model's token bucket): each part of the model jitted alone with the model's
own layer-0 parameters and backends, on random activations, timed three ways (``_time_into``); the state a part
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
               ms of launch + sync per call on the H200 (jax_gdn/layers/NOTES_gdn_phases.md). Decode parts: max(reps,
               5) calls and batches.
  <part> (ms)  the figure of record (``choose_figures``): ms_in_program when sound (measured, > 0, no carried-buffer
               copy in the loop, >= 0.6 x its roofline, <= 1.25 x the separate call), else ms_pipelined; ms_source
               says which, in_program_unsound why not; suspect flags a pipelined figure above 1.15 x its blocking
               one (an idle GPU cannot run queued calls slower than synced ones: the first H200 check's attention
               read 7.67 vs 4.06 ms; that check ran HF's check beside the parts on the GPU) and a part compiled more
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
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

from jax_gdn.cases import VARLEN16_LENS

LAYERS = 8
COMPILE_LAYERS = 48
REPS = 5


# ================================================================================================================
# Configs and random models
# ================================================================================================================
def qwen3_next_80b_config(num_layers: int = LAYERS):
    """Qwen3-Next-80B-A3B dims (HF ``Qwen3NextConfig`` defaults) with ``num_layers`` layers of the 3 GDN + 1
    attention pattern."""
    from jax_gdn.config import HybridConfig
    pattern = ("linear_attention",) * 3 + ("full_attention",)
    return HybridConfig(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=num_layers,
        layer_types=tuple(pattern[i % 4] for i in range(num_layers)), intermediate_size=5632,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=10000.0, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True, rms_norm_eps=1e-6)


def tiny_config(num_layers: int = LAYERS):
    """The quick (CPU) stand-in: the same layer pattern and MoE structure at tiny dims."""
    import dataclasses
    return dataclasses.replace(
        qwen3_next_80b_config(num_layers), vocab_size=97, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16)


def _hf_kwargs(config) -> dict:
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                layer_types=list(config.layer_types), num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                linear_num_key_heads=config.linear_num_key_heads,
                linear_num_value_heads=config.linear_num_value_heads,
                linear_key_head_dim=config.linear_key_head_dim, linear_value_head_dim=config.linear_value_head_dim,
                linear_conv_kernel_dim=config.linear_conv_kernel_dim, num_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
                shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=False)


def random_device_model(config, dtype=None, backend="auto", seed: int = 0):
    """A HybridModel with random weights made on the default device (``init_params`` in one jitted program: no
    host copy, no per-leaf dispatch)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax_gdn.model import HybridModel, init_params
    dtype = dtype or jnp.bfloat16
    params = jax.jit(functools.partial(init_params, config, dtype=dtype))(jax.random.PRNGKey(seed))
    return HybridModel(config, params, dtype=dtype, backend=backend)


# ================================================================================================================
# Timing (the same for both columns)
# ================================================================================================================
def _median_ms(call, sync, reps: int, prepare=None) -> float:
    """Median wall ms of ``call()`` closed by ``sync(result)``; ``prepare()`` (untimed, synced) before each."""
    times = []
    for _ in range(max(1, reps)):
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        sync(call())
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _jax_sync(x):
    import jax
    return jax.block_until_ready(x)


PIPE_CALLS = 10   # R: the calls of one pipelined batch of a part (parts_ms "ms")


def _pipelined_ms(call, sync, calls: int = PIPE_CALLS, batches: int = 3) -> float:
    """Pipelined ms per call: ``calls`` calls of ``call()`` queued back to back with no sync in between, then ONE
    ``sync`` of the list of all their results; the wall time of the batch / ``calls``, median over ``batches``
    batches. No per-call launch + sync gap is paid, as inside the model's one compiled program (each call still
    pays its own host dispatch, overlapped with the device's work on the calls before it: a call whose device time
    is below its dispatch time reads the dispatch time, an upper bound of what the model spends on it). All R
    results are held until the sync (no reliance on one device queue's order); the batch's list is dropped before
    the next batch."""
    times = []
    for _ in range(max(1, batches)):
        t0 = time.perf_counter()
        outs = [call() for _ in range(max(1, calls))]
        sync(outs)
        times.append((time.perf_counter() - t0) * 1e3 / max(1, calls))
        del outs
    return float(statistics.median(times))


def _time_into(out: dict, name: str, fn, args: tuple, state, *, reps: int, calls: int, feed=(), iters: int = 0,
               deadline: float = None) -> None:
    """The three timings of fn(*args[, state]) into ``out``: ``_time_part`` (pipelined ms into
    out["ms_pipelined"][name] and, until ``choose_figures`` decides, out[name]; blocking into
    out["ms_blocking"][name]) and, with ``feed`` (the indices of the args the loop feeds back: x for a part that
    returns the residual stream) and ``iters`` > 0, ``_in_program`` (out["ms_in_program"][name], its details under
    out["in_program"][name]); skipped once ``time.time()`` passes ``deadline`` (said in out["errors"]). With
    ``state`` fn returns (y, new_state) and the state is donated. A failure records None and its error under
    out["errors"][name] (the other parts still run)."""
    for key in ("ms_pipelined", "ms_blocking", "ms_in_program", "in_program", "compiles"):
        out.setdefault(key, {})
    try:
        t = _time_part(fn, args, state, reps=reps, calls=calls)
        out[name] = out["ms_pipelined"][name] = t["ms"]
        out["ms_blocking"][name] = t["ms_blocking"]
        out["compiles"][name] = t["compiles"]
    except Exception as err:  # noqa: BLE001  (reported in the section)
        out[name] = out["ms_pipelined"][name] = out["ms_blocking"][name] = None
        out.setdefault("errors", {})[name] = f"{type(err).__name__}: {str(err)[:300]}"
        traceback.print_exc()
    out["ms_in_program"][name] = None
    if not feed or iters <= 0:
        return
    if deadline is not None and time.time() > deadline:
        out.setdefault("errors", {})[name + " (in-program)"] = "skipped: past the time budget"
        return
    try:
        r = _in_program(fn, args, state, feed, iters=iters, batches=max(reps, 3))
        out["ms_in_program"][name] = r["ms"]
        out["in_program"][name] = {k: r[k] for k in ("wall_ms", "iters", "carried_copies", "copies", "compile_s")}
    except Exception as err:  # noqa: BLE001
        out.setdefault("errors", {})[name + " (in-program)"] = f"{type(err).__name__}: {str(err)[:300]}"
        traceback.print_exc()


def _time_part(fn, args: tuple, state=None, *, reps: int = REPS, calls: int = PIPE_CALLS, sync=None) -> dict:
    """{"ms": pipelined (``_pipelined_ms``: ``calls`` calls, one sync, median of ``max(reps, 3)`` batches),
    "ms_blocking": each call closed by a sync (``_median_ms`` of ``reps`` calls: the rows' method)} of
    ``jax.jit(fn)(*args)``, or with ``state`` of ``fn(*args, state) -> (y, new_state)`` jitted with the state
    donated: every call's new state feeds the next call (both timings, as the model's step carries its slots and
    pages), starting from a copy of ``state`` (the caller's arrays are never donated). One warm-up call (compile)
    first; both timings run the same compiled function and differ only in where they sync. ``sync`` (default
    ``jax.block_until_ready``) gets the call's result (pipelined: the list of the batch's results) and, with
    ``state``, the current state beside it. "compiles": the jitted function's cache size after all calls (1: no
    call retraced; None where jax has no ``_cache_size``)."""
    import jax
    import jax.numpy as jnp
    sync_fn = sync or _jax_sync
    if state is None:
        f = jax.jit(fn)
        call = lambda: f(*args)                                               # noqa: E731
        done = sync_fn
    else:
        f = jax.jit(fn, donate_argnums=(len(args),))
        box = {"s": jax.tree.map(jnp.copy, state)}

        def call():
            y, box["s"] = f(*args, box["s"])
            return y

        def done(y):
            return sync_fn((y, box["s"]))
    done(call())
    blocking = _median_ms(call, done, reps)
    out = {"ms": _pipelined_ms(call, done, calls, max(reps, 3)), "ms_blocking": blocking}
    size = getattr(f, "_cache_size", None)
    out["compiles"] = size() if callable(size) else None     # 1: no call retraced (the carried state kept its type)
    return out


# ---- in-program timing: the part R times inside one compiled program, as the model's scan runs its layers ----
LOOP_ITERS = 10   # R of a prefill part's in-program loop (decode parts: 2 R): one program of R iterations
#: which timing a part's figure of record (floor_ratio, model_sum) may be: "in_program" (when ``choose_figures``
#: finds it sound, else pipelined) or "pipelined" (always; the in-program figure still measured and shown beside)
FIGURE_OF_RECORD = "in_program"


def _nudge(a, s):
    """``a`` with its first element made to depend on the fp32 scalar ``s`` (a one-element in-place update, so the
    next iteration's work reads this iteration's outputs and nothing is loop-invariant): floats get s * 1e-6 added
    (a no-op in value at bf16, which XLA cannot know), integers (token ids) take a[0] or a[-1] by the sign of s (a
    valid id either way)."""
    import jax.numpy as jnp
    idx = (0,) * a.ndim
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a.at[idx].set(jnp.where(s > 0, a[idx], a[(-1,) * a.ndim]))
    return a.at[idx].add((s * 1e-6).astype(a.dtype))


def _hlo_shape(x) -> str:
    """The HLO spelling of an array's type, e.g. "bf16[19456,2048]"."""
    import jax.numpy as jnp
    names = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "int32": "s32",
             "int64": "s64", "int8": "s8", "uint8": "u8", "uint32": "u32", "bool": "pred"}
    dt = jnp.dtype(x.dtype).name
    return f"{names.get(dt, dt)}[{','.join(str(int(d)) for d in x.shape)}]"


_HLO_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "s64": 8, "s8": 1, "u8": 1, "u32": 4, "pred": 1}


def loop_copies(hlo_text: str, carried=(), min_bytes: int = 1 << 20) -> list:
    """Copies inside the while-loop bodies of a compiled module's HLO text (``compiled.as_text()``): every top-level
    ``copy`` / ``copy-start`` instruction of a computation some ``while`` names as its body (fusions' insides are not
    copies of buffers), of at least ``min_bytes``. Returns [{"shape", "bytes", "carried"}], "carried" when the
    copy's shape is one of ``carried`` (HLO spellings, ``_hlo_shape``): a carried buffer copied every iteration,
    time a model's scan would not spend on it unless it copies too."""
    import re
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    out, cur = [], None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            cur = head.group(1)
            continue
        if cur not in bodies or "=" not in line or not re.search(r"\bcopy(?:-start)?\(", line):
            continue
        m = re.search(r"([a-z]+\d*)\[([\d,]*)\]", line.split("=", 1)[1])
        if not m:
            continue
        n = 1
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        nbytes = n * _HLO_BYTES.get(m.group(1), 4)
        shape = f"{m.group(1)}[{m.group(2)}]"
        if nbytes >= min_bytes:
            out.append({"shape": shape, "bytes": nbytes, "carried": shape in set(carried)})
    return out


def _loop_program(fn, args: tuple, state=None, feed=(0,), iters: int = LOOP_ITERS):
    """The compiled loop of ``_in_program`` (see there) and its inputs: (compiled, rest, carry), called as
    ``carry = compiled(rest, carry)`` for ``iters`` iterations (a static trip count, as the model's scan has: XLA's
    GPU while loop reads an unknown trip count's predicate back to the host every iteration); the carry donated.
    ``carry`` = (the fed args, a copy of the state, y or None) starts from copies (the caller's arrays are never
    donated)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    feed = tuple(feed)
    if not feed:
        raise ValueError("feed must name at least one argument to feed back (e.g. (index of x,))")
    has_state = state is not None
    y_spec = jax.eval_shape(fn, *(args + ((state,) if has_state else ())))
    if has_state:
        y_spec = y_spec[0]
    y_leaves = jax.tree.leaves(y_spec)
    residual = (len(feed) == 1 and len(y_leaves) == 1 and y_leaves[0].shape == args[feed[0]].shape
                and y_leaves[0].dtype == args[feed[0]].dtype)
    rest = tuple(None if i in feed else a for i, a in enumerate(args))
    n = int(max(1, iters))

    def loop(rest, carry):
        def body(_, c):
            fed, s, _y = c
            full = list(rest)
            for i, v in zip(feed, fed):
                full[i] = v
            r = fn(*full, s) if has_state else fn(*full)
            y, s = r if has_state else (r, None)
            if residual:
                return (jax.tree.leaves(y)[0],), s, None
            sc = sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in jax.tree.leaves(y))
            return tuple(_nudge(v, sc) for v in fed), s, y
        return lax.fori_loop(0, n, body, carry)

    y0 = None if residual else jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), y_spec)
    carry = (tuple(jnp.copy(args[i]) for i in feed), jax.tree.map(jnp.copy, state) if has_state else None, y0)
    compiled = jax.jit(loop, donate_argnums=(1,)).lower(rest, carry).compile()
    return compiled, rest, carry


def _in_program(fn, args: tuple, state=None, feed=(0,), *, iters: int = LOOP_ITERS, batches: int = 3,
                sync=None) -> dict:
    """The part ``fn(*args[, state]) -> y | (y, new_state)`` run R = ``iters`` times inside ONE jitted program
    (``_loop_program``: ``lax.fori_loop`` with a static trip count, as the model's scan), the carry donated:
      carry = (the args named by ``feed``, the state, y): each iteration's new state feeds the next; when y is one
      array shaped like the one fed arg (the residual stream x) y IS the next x (the model's own data flow);
      otherwise y is carried whole (it leaves the loop, so none of it is dead) and each fed arg gets one element
      nudged by a scalar read from every output leaf (``_nudge``), so no iteration's work is loop-invariant
      (nothing can be hoisted) and the iterations form one dependency chain (no overlap between them).
    Timing: per batch, one program call closed by a ``sync`` (default ``jax.block_until_ready``, given the carry),
    then two calls queued back to back (the second takes the first's carry) closed by one sync; ms = (median t(2
    calls) - median t(1 call)) / R over ``batches`` batches: the per-iteration device time (the second call's
    dispatch overlaps the first's R iterations; the launch + sync cost is paid once in both and cancels).
    "wall_ms" = median t(1 call) / R beside it (that cost not cancelled). The compiled HLO's while bodies are
    searched for copies (``loop_copies``, >= 1 MiB): "copies", and "carried_copies" the count of those with a
    carried leaf's shape (0 for a sound figure; a loop XLA unrolled has no body to search). Returns {"ms",
    "wall_ms", "iters", "copies", "carried_copies", "compile_s"}."""
    import jax
    sync_fn = sync or _jax_sync
    r = int(max(1, iters))
    t0 = time.perf_counter()
    compiled, rest, carry = _loop_program(fn, args, state, feed, r)
    compile_s = time.perf_counter() - t0
    shapes = {_hlo_shape(a) for a in jax.tree.leaves(carry)}
    try:
        copies = loop_copies(compiled.as_text(), shapes)
    except Exception as err:  # noqa: BLE001  (a text format we cannot read: say so, do not guess)
        copies = [{"error": f"{type(err).__name__}: {err}"}]
    carry = compiled(rest, carry)                                        # warm-up
    sync_fn(carry)
    one, two = [], []
    for _ in range(max(1, batches)):
        t0 = time.perf_counter()
        carry = compiled(rest, carry)
        sync_fn(carry)
        one.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        carry = compiled(rest, carry)
        carry = compiled(rest, carry)
        sync_fn(carry)
        two.append((time.perf_counter() - t0) * 1e3)
    lo, hi = statistics.median(one), statistics.median(two)
    del carry
    return {"ms": (hi - lo) / r, "wall_ms": lo / r, "iters": r, "copies": copies,
            "carried_copies": sum(1 for c in copies if c.get("carried")), "compile_s": compile_s}


# ================================================================================================================
# Floors: what each part would take at the GPU's peak (formulas from the config and the token counts)
# ================================================================================================================
PEAK_TFLOPS = 700.0   # dense bf16 matmul rate of the floors (as bench_moe's): H200 ~990 peak, ~700 reachable
PEAK_TBPS = 4.8       # H200 HBM bandwidth, TB/s
HW_PEAK_TFLOPS = 989.0  # H200 SXM dense bf16 tensor-core peak (the row floors' hardware bound beside the 700)
CHUNK = 64            # the chunked GDN rule's chunk (the formula's C)


def _roof(flop: float, nbytes: float) -> dict:
    """{"ms": max(flop at PEAK_TFLOPS, bytes at PEAK_TBPS), "flop", "bytes", "bound"}."""
    f_ms, b_ms = flop / (PEAK_TFLOPS * 1e9), nbytes / (PEAK_TBPS * 1e9)
    return {"ms": max(f_ms, b_ms), "flop": flop, "bytes": nbytes, "bound": "flop" if f_ms >= b_ms else "bytes"}


def _dims(config, dtype_bytes: int) -> dict:
    c, b = config, dtype_bytes
    g = c.gdn_dims
    nk, nv = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
    return dict(b=b, d=c.hidden_size, nk=nk, nv=nv, hv=g.num_v_heads, hk=g.num_k_heads, kd=g.head_k_dim,
                vd=g.head_v_dim, w=g.conv_kernel_size, conv=2 * nk + nv, hq=c.num_attention_heads,
                hkv=c.num_key_value_heads, dh=c.head_dim, e=c.num_experts, k=c.num_experts_per_tok,
                i=c.moe_intermediate_size, si=c.shared_expert_intermediate_size, vocab=c.vocab_size,
                ffn_i=c.intermediate_size)


def _ffn_roof(x: dict, t: int, moe: bool, weights_touched: float) -> dict:
    """MoE (router + top-k routed SwiGLU experts + shared expert and its gate; bench_moe's FLOP formula) or MLP over
    t tokens; bytes: ``weights_touched`` routed experts' weights + router + shared expert + x in / out."""
    d, b = x["d"], x["b"]
    if not moe:
        return _roof(2.0 * t * 3 * d * x["ffn_i"], b * (3 * d * x["ffn_i"] + 2 * t * d))
    flop = 2.0 * t * (d * x["e"] + x["k"] * 3 * d * x["i"] + 3 * d * x["si"] + d)
    nbytes = b * (weights_touched * 3 * d * x["i"] + 3 * d * x["si"] + d * x["e"] + d + 2 * t * d)
    return _roof(flop, nbytes)


def prefill_floors(config, lens, dtype_bytes: int = 2, peers: dict = None) -> dict:
    """Floor per part of one layer (and embed_logits) for a fresh prefill of ``lens`` (T = sum tokens, N streams),
    every formula a roofline max(FLOPs / 700 TFLOP/s, bytes / 4.8 TB/s) with b bytes per activation / weight,
    D hidden, nk = Hk K, nv = Hv V, Hq, Hkv, Dh attention heads, E experts, k top-k, I / Is expert / shared
    widths, Vocab:
      gdn_phase1   FLOP 2 T D (2 nk + 2 nv + 2 Hv) (in_proj_qkvz + in_proj_ba); bytes: those weights, the conv
                   weights, x in, q k v z out (b) and g, beta out (fp32): the conv and the L2 norms fused away
      gdn_phase2   the kernel bench's fastest time for this exact case (peers' "rows", same lens and heads) when
                   there is one; else FLOP T Hv (2 C (3 K + 2 V) + 6 K V) (chunked form, C = 64), bytes q k
                   (Hk), v, o (Hv), g, beta, the N states read + written (fp32)
      gdn_phase3   FLOP 2 T nv D (out_proj); bytes: out_proj weights, o and z in, x in and out
      attention    projections: FLOP 2 T D (2 Hq Dh + 2 Hkv Dh) (q with its gate, k, v) + 2 T Hq Dh D (o_proj),
                   bytes their weights + x in / out; plus the core: torch SDPA (flash attention) of the attention
                   bench for this case (peers' "attention" row prefill-varlen16, same lens and dims) when there is
                   one, else its FLOPs 4 Hq Dh sum_n L_n (L_n + 1) / 2 at 700 TFLOP/s
      moe          FLOP 2 T (D E + k 3 D I + 3 D Is + D) (bench_moe's); bytes all E experts' weights + shared
      embed_logits FLOP 2 N D Vocab; bytes lm_head D Vocab, T embedding rows, N Vocab fp32 logits
    Returns {part: {"ms", "basis", "roofline": {"ms", "flop", "bytes", "bound"}}}."""
    x = _dims(config, dtype_bytes)
    b, d, nk, nv, hv = x["b"], x["d"], x["nk"], x["nv"], x["hv"]
    t, n = int(sum(lens)), len(lens)
    peers = peers or {}
    out = {}

    def put(name, roof, basis, ms=None):
        out[name] = {"ms": roof["ms"] if ms is None else ms, "basis": basis, "roofline": roof}

    proj = 2 * nk + 2 * nv + 2 * hv
    put("gdn_phase1", _roof(2.0 * t * d * proj, b * (d * proj + x["conv"] * x["w"] + t * d + t * (2 * nk + 2 * nv))
                            + 4 * t * 2 * hv), "matmul FLOPs at 700 TFLOP/s (roofline)")
    per_tok = 2 * CHUNK * (3 * x["kd"] + 2 * x["vd"]) + 6 * x["kd"] * x["vd"]
    roof2 = _roof(1.0 * t * hv * per_tok,
                  b * t * (2 * nk + 2 * nv) + 4 * t * 2 * hv + 4 * 2 * n * hv * x["kd"] * x["vd"])
    row = next((r for r in peers.get("rows", []) if _bench_lens(r) == [int(m) for m in lens]
                and (r["Hk"], r["Hv"], r["K"], r["V"]) == (x["hk"], hv, x["kd"], x["vd"])), None)
    best = min(((v, k) for k, v in (row or {}).get("ms", {}).items() if v), default=None)
    if best:
        put("gdn_phase2", roof2, f"kernel bench {row['case']}: {best[1]} (fastest column)", best[0])
    else:
        put("gdn_phase2", roof2, "chunked-rule FLOPs / bytes roofline (no kernel bench row for this case)")
    put("gdn_phase3", _roof(2.0 * t * nv * d, b * (nv * d + 2 * t * nv + 2 * t * d)), "matmul FLOPs at 700 TFLOP/s")
    qkv = 2 * x["hq"] * x["dh"] + 2 * x["hkv"] * x["dh"]
    proj_a = _roof(2.0 * t * d * qkv + 2.0 * t * x["hq"] * x["dh"] * d,
                   b * (d * qkv + x["hq"] * x["dh"] * d + 2 * t * d + t * qkv))
    core_flop = 4.0 * x["hq"] * x["dh"] * sum(m * (m + 1) / 2 for m in lens)
    arow = next((r for r in (peers.get("attention") or {}).get("rows", []) if r.get("kind") == "prefill"
                 and not r.get("context") and list(r.get("lens") or []) == list(lens)
                 and r.get("gflop") and abs(r["gflop"] * 1e9 - core_flop) < 1e-6 * core_flop), None)
    sdpa = (arow or {}).get("ms", {}).get("torch_sdpa")
    roof_a = _roof(proj_a["flop"] + core_flop, proj_a["bytes"])
    if sdpa:
        put("attention", roof_a, f"projections' roofline + torch SDPA of the attention bench ({arow['case']})",
            proj_a["ms"] + sdpa)
    else:
        put("attention", roof_a, "projections' roofline + causal core FLOPs at 700 TFLOP/s (no attention bench row)",
            proj_a["ms"] + core_flop / (PEAK_TFLOPS * 1e9))
    measured = {k: v for k, v in ((arow or {}).get("ms") or {}).items() if v}
    out["attention"].update(proj_ms=proj_a["ms"], core_flop=core_flop, core_ms=out["attention"]["ms"] - proj_a["ms"],
                            core_measured_ms=measured)
    moe = bool(config.num_experts)
    put("moe" if moe else "mlp", _ffn_roof(x, t, moe, x["e"]), "matmul FLOPs at 700 TFLOP/s (roofline)")
    put("embed_logits", _roof(2.0 * n * d * x["vocab"], b * (d * x["vocab"] + 2 * t * d) + 4 * n * x["vocab"]),
        "lm_head bytes at 4.8 TB/s (roofline)")
    return out


def _bench_lens(r: dict):
    """The stream lengths of a kernel bench row: its "lens", or B streams of T tokens (rows like B1-T32768)."""
    if r.get("lens"):
        return [int(m) for m in r["lens"]]
    if r.get("B") and r.get("T"):
        return [int(r["T"])] * int(r["B"])
    return None


def decode_floors(config, n: int, ctx: int, dtype_bytes: int = 2) -> dict:
    """Floor per part of one decode step of ``n`` streams holding ``ctx`` tokens each (same notation as
    ``prefill_floors``; all bound by bytes at 4.8 TB/s):
      gdn_decode        weights in_proj_qkvz / ba, conv, out_proj; the N recurrent states read + written (fp32
                        N Hv K V 4 x 2); the conv states read + written (N conv_dim (Kc - 1) b x 2); x in / out
      attention_decode  weights q (with gate) / k / v / o_proj; the K and V of ctx + 1 tokens read (N (ctx + 1)
                        Hkv Dh 2 b); the new token's K / V written; x in / out
      moe               the routed experts a step touches: E (1 - (1 - k / E)^N) expected distinct experts under
                        uniform routing, 3 D I b each; router, shared expert; FLOPs as in prefill with T = N
      embed_logits      lm_head D Vocab b; N Vocab fp32 logits
    Returns {part: {"ms", "basis", "roofline"}}."""
    x = _dims(config, dtype_bytes)
    b, d, nk, nv, hv = x["b"], x["d"], x["nk"], x["nv"], x["hv"]
    proj = 2 * nk + 2 * nv + 2 * hv
    out = {}

    def put(name, roof, basis):
        out[name] = {"ms": roof["ms"], "basis": basis, "roofline": roof}
    put("gdn_decode", _roof(2.0 * n * d * (proj + nv) + 6.0 * n * hv * x["kd"] * x["vd"],
                            b * (d * proj + x["conv"] * x["w"] + nv * d + 2 * n * d)
                            + 2 * 4 * n * hv * x["kd"] * x["vd"] + 2 * b * n * x["conv"] * (x["w"] - 1)),
        "weights + recurrent / conv states read and written, at 4.8 TB/s")
    qkv = 2 * x["hq"] * x["dh"] + 2 * x["hkv"] * x["dh"]
    kv = 2 * x["hkv"] * x["dh"] * b
    put("attention_decode", _roof(2.0 * n * d * qkv + 2.0 * n * x["hq"] * x["dh"] * d
                                  + 4.0 * n * x["hq"] * x["dh"] * (ctx + 1),
                                  b * (d * qkv + x["hq"] * x["dh"] * d + 2 * n * d) + n * (ctx + 1) * kv + n * kv),
        "weights + K/V of the context read, at 4.8 TB/s")
    moe = bool(config.num_experts)
    touched = x["e"] * (1 - (1 - x["k"] / x["e"]) ** n) if moe else 0
    put("moe" if moe else "mlp", _ffn_roof(x, n, moe, touched),
        f"weights of ~{touched:.0f} experts touched (uniform routing) + shared, at 4.8 TB/s" if moe
        else "MLP weights at 4.8 TB/s")
    put("embed_logits", _roof(2.0 * n * d * x["vocab"], b * (d * x["vocab"] + 2 * n * d) + 4 * n * x["vocab"]),
        "lm_head bytes at 4.8 TB/s")
    return out


def _layer_counts(config) -> dict:
    """{"gdn", "attention", "moe", "mlp"}: how many layers of the config run each part (the FFN of a layer is MoE or
    MLP by ``config.layer_is_moe``)."""
    n = config.num_hidden_layers
    nm = sum(bool(config.num_experts) and config.layer_is_moe(i) for i in range(n))
    return {"gdn": len(config.gdn_layers), "attention": len(config.attn_layers), "moe": nm, "mlp": n - nm}


def row_floor(config, kind: str, case: tuple, dtype_bytes: int = 2, peers: dict = None, hf_ms: float = None,
              ours_ms: float = None) -> dict:
    """The floor of a whole row: the sum over the model's parts of (how many layers run it) x (its floor), i.e.
    what the row would take if every part ran at its floor and nothing else ran (no glue, no launch gaps).
    kind "prefill", case (name, lens): ``prefill_floors`` of lens, terms gdn_phase1/2/3 x GDN layers, attention x
    attention layers, moe (mlp) x MoE (MLP) layers, embed_logits once; kind "decode", case (name, N, ctx, _):
    ``decode_floors``, terms gdn_decode, attention_decode, moe, embed_logits. Two sums:
      row_floor_ms           each term at the parts' floor (the GDN core at the kernel bench's fastest column, the
                             attention core at the attention bench's torch SDPA, when ``peers`` has those rows;
                             matmuls at 700 TFLOP/s, bytes at 4.8 TB/s): the floor the parts' ratios use
      row_floor_roofline_ms  every term at its pure roofline max(FLOPs / 700 TFLOP/s, bytes / 4.8 TB/s), no
                             measured kernel in it (the GDN and attention cores at their FLOPs): a lower bound of
                             any implementation at those rates (issue 9's floor rates)
      row_floor_hw_peak_ms   the same at the H200's dense bf16 peak, max(FLOPs / 989 TFLOP/s, bytes / 4.8 TB/s):
                             the hardware's own bound (no implementation runs a whole row at it)
    With ``hf_ms``: "hf_over_floor" = hf_ms / row_floor_ms, "hf_over_roofline", "hf_over_hw_peak": the largest
    speed-up over HF any implementation could reach at those floors; "target_3x_within_floor": whether 3x HF
    (hf_ms / 3) is at or above the row floor. With ``ours_ms``: "ours_over_floor". Returns {"case", "kind",
    "tokens", "layers", "terms": {part: {"count", "floor_ms", "ms", "roofline_ms", "flop", "bytes", "basis"}},
    "row_floor_ms", "row_floor_roofline_ms", "row_floor_hw_peak_ms", ...}."""
    c = _layer_counts(config)
    if kind == "prefill":
        lens = case[1]
        f = prefill_floors(config, lens, dtype_bytes, peers)
        counts = {"gdn_phase1": c["gdn"], "gdn_phase2": c["gdn"], "gdn_phase3": c["gdn"],
                  "attention": c["attention"], "moe": c["moe"], "mlp": c["mlp"], "embed_logits": 1}
        tokens = int(sum(lens))
    else:
        _, n, ctx = case[:3]
        f = decode_floors(config, n, ctx, dtype_bytes)
        counts = {"gdn_decode": c["gdn"], "attention_decode": c["attention"], "moe": c["moe"], "mlp": c["mlp"],
                  "embed_logits": 1}
        tokens = int(n)
    terms = {k: {"count": m, "floor_ms": f[k]["ms"], "ms": m * f[k]["ms"], "roofline_ms": f[k]["roofline"]["ms"],
                 "flop": m * f[k]["roofline"]["flop"], "bytes": m * f[k]["roofline"]["bytes"], "basis": f[k]["basis"]}
             for k, m in counts.items() if m and k in f}
    out = {"case": case[0], "kind": kind, "tokens": tokens, "layers": config.num_hidden_layers, "terms": terms,
           "row_floor_ms": sum(t["ms"] for t in terms.values()),
           "row_floor_roofline_ms": sum(t["count"] * t["roofline_ms"] for t in terms.values()),
           "row_floor_hw_peak_ms": sum(max(t["flop"] / (HW_PEAK_TFLOPS * 1e9), t["bytes"] / (PEAK_TBPS * 1e9))
                                       for t in terms.values())}
    if hf_ms:
        out.update(hf_ms=hf_ms, hf_over_floor=hf_ms / out["row_floor_ms"],
                   hf_over_roofline=hf_ms / out["row_floor_roofline_ms"],
                   hf_over_hw_peak=hf_ms / out["row_floor_hw_peak_ms"],
                   target_3x_within_floor=hf_ms / 3 >= out["row_floor_ms"])
    if ours_ms:
        out.update(ours_ms=ours_ms, ours_over_floor=ours_ms / out["row_floor_ms"])
    return out


def row_floors(config, cases: dict, rows: list = (), peers: dict = None, dtype_bytes: int = 2) -> list:
    """``row_floor`` of the three rows of ``cases`` (varlen, long, decode), with the HF and our ms of ``rows`` (the
    section's rows, matched by case name) when they have them."""
    by = {r.get("case"): r for r in rows or ()}
    out = []
    for key, kind in (("varlen", "prefill"), ("long", "prefill"), ("decode", "decode")):
        ms = (by.get(cases[key][0]) or {}).get("ms") or {}
        out.append(row_floor(config, kind, cases[key], dtype_bytes, peers, hf_ms=ms.get("hf"),
                             ours_ms=ms.get("ours")))
    return out


def _with_floors(parts_ms: dict, floors: dict) -> None:
    """Adds "floor_ms", "floor_ratio" (part / floor: the figure of record ``parts_ms[part]``),
    "floor_ratio_<timing>" for each of "ms_pipelined", "ms_blocking", "ms_in_program" that ``parts_ms`` has, and
    "floor_basis" per part to ``parts_ms`` in place."""
    parts_ms["floor_ms"] = {k: f["ms"] for k, f in floors.items()}
    parts_ms["floor_ratio"] = {k: (parts_ms[k] / f["ms"] if parts_ms.get(k) and f["ms"] else None)
                               for k, f in floors.items()}
    for t in ("pipelined", "blocking", "in_program"):
        if f"ms_{t}" in parts_ms:
            ms = parts_ms[f"ms_{t}"]
            parts_ms[f"floor_ratio_{t}"] = {k: (ms[k] / f["ms"] if ms.get(k) and ms[k] > 0 and f["ms"] else None)
                                            for k, f in floors.items()}
    parts_ms["floor_basis"] = {k: f["basis"] for k, f in floors.items()}
    parts_ms["roofline"] = {k: f["roofline"] for k, f in floors.items()}


def load_peers(device_kind: str, path: str = None) -> dict:
    """The results JSON of this device (``jax_gdn.bench``'s default path, e.g. benchmarks/results/h200.json) when
    it exists and was measured on ``device_kind``: its kernel rows and attention section give the GDN core's and
    the attention core's floors; its model section's rows ("model_rows", of a "model_layers"-layer model) give
    HF's ms to a row floor when this run has none. {} otherwise."""
    try:
        from jax_gdn.bench import RESULTS_DIR, device_file_name
        path = path or os.path.join(RESULTS_DIR, device_file_name(device_kind) + ".json")
        with open(path) as f:
            res = json.load(f)
        if res.get("device") != device_kind:
            return {}
        return {"rows": res.get("rows") or [], "attention": res.get("attention") or {}, "path": path,
                "date": res.get("date"), "model_rows": (res.get("model") or {}).get("rows") or [],
                "model_layers": (res.get("model") or {}).get("layers")}
    except (OSError, ValueError, ImportError):
        return {}


# ================================================================================================================
# Cases
# ================================================================================================================
def _cases(quick: bool) -> dict:
    if quick:
        lens = (37, 1, 64, 5)
        return {"varlen": ("varlen4-T107", lens), "long": ("B1-T200", (200,)),
                "decode": ("decode-N8-ctx26", 8, 26, 4)}          # 2 prefill calls of 4 x 26 tokens
    t = sum(VARLEN16_LENS)
    ctx = t // 16                                                  # 1189: 16 x 1189 fits varlen16's bucket
    return {"varlen": (f"varlen16-T{t}", VARLEN16_LENS), "long": ("B1-T32768", (32768,)),
            "decode": (f"decode-N64-ctx{ctx}", 64, ctx, 16)}


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


# ================================================================================================================
# HF transformers on FLA's kernels (its "fast path")
# ================================================================================================================
#: the module-level callables of transformers' qwen3_next modeling module that its GatedDeltaNet layer calls
#: (looked up at call time, so assigning the module attribute redirects every layer)
HF_GDN_CALLABLES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")


def _runs(fn) -> str:
    """What a callable of transformers' qwen3_next module really runs, as "module.name". transformers 5.x wraps
    each of them in ``use_kernel_func_from_hub_with_fallback``, which uses ``functools.wraps`` (so ``__module__`` is
    transformers' own whatever runs) and keeps the implementation it resolved at import in its closure; our
    adapters name what they call in ``_runs``."""
    if getattr(fn, "_runs", None):
        return fn._runs
    impl = fn
    try:
        import inspect
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
    except (TypeError, ValueError):
        pass
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', getattr(impl, '__name__', repr(impl)))}"


def _kwargs_filter(fn, name: str):
    """``fn`` called with only the keyword arguments its signature names (what transformers' wrapper does: HF's
    GDN layer passes its attention kwargs down to every kernel)."""
    import functools
    import inspect
    params = inspect.signature(fn).parameters
    named = {k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in named})
    call._runs = name
    return call


def fla_kernels(fla=None) -> dict:
    """The callables HF's Qwen3-Next GDN layer needs for its fast path, made from FLA 0.6 (``fla``: a namespace
    with FLA's ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, ``causal_conv1d``,
    ``causal_conv1d_update`` and ``FusedRMSNormGated``; default: the installed FLA, whose Triton kernels need a
    GPU). Returns {HF's module-level name: callable} plus "gated_norm": a factory of the gated RMSNorm module.

    The GDN rule: FLA's functions have HF's signature (q, k, v [B, T, H, K|V], g, beta [B, T, H], initial_state
    [B, H, K, V] fp32, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens). The conv: HF calls the
    ``causal_conv1d`` package's ``causal_conv1d_fn(x [B, D, T], weight [D, W], bias, activation)`` ->
    [B, D, T] and ``causal_conv1d_update(x [B, D, T], conv_state [B, D, W], weight, bias, activation)`` -> [B, D, T]
    (conv_state advanced in place, holding the last W inputs); FLA's ``causal_conv1d(x [B, T, D], weight, bias,
    activation=)`` -> (y [B, T, D], None) and ``causal_conv1d_update(x [N, D], cache [N, D, W], weight=, bias=,
    activation=)`` -> (y [N, D], cache) (cache shifted by one column and the new input written last, in place;
    a copy when the cache is not contiguous) are adapted to those (transposes are views; the update runs token by
    token when T > 1). The gated norm: FLA's ``FusedRMSNormGated(V, eps=, activation="silu")`` (fp32 inside;
    HF's torch module rounds the normalised x to the input dtype before the weight: a bf16 rounding apart)."""
    if fla is None:
        import types

        from fla.modules import FusedRMSNormGated
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        fla = types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule,
                                    fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule,
                                    causal_conv1d=causal_conv1d, causal_conv1d_update=causal_conv1d_update,
                                    FusedRMSNormGated=FusedRMSNormGated)

    def name(f):
        return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', getattr(f, '__name__', '?'))}"
    conv, update = fla.causal_conv1d, fla.causal_conv1d_update

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None, **_):
        if seq_idx is not None or initial_states is not None or return_final_states or final_states_out is not None:
            raise NotImplementedError("the FLA adapter of causal_conv1d_fn takes no seq_idx / initial_states / "
                                      "final states (HF's Qwen3-Next passes none)")
        y, _ = conv(x.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        return y.transpose(1, 2)

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None, **_):
        if cache_seqlens is not None or conv_state_indices is not None:
            raise NotImplementedError("the FLA adapter of causal_conv1d_update takes no cache_seqlens / "
                                      "conv_state_indices (HF's Qwen3-Next passes none)")
        outs = []
        for t in range(x.shape[-1]):
            y, state = update(x[:, :, t], conv_state, weight=weight, bias=bias, activation=activation)
            if state is not None and state.data_ptr() != conv_state.data_ptr():
                conv_state.copy_(state)                       # FLA made the cache contiguous: write it back
            outs.append(y)
        return outs[0][:, :, None] if len(outs) == 1 else __import__("torch").stack(outs, dim=-1)

    causal_conv1d_fn._runs = name(conv) + " (adapted: x [B, D, T] <-> [B, T, D])"
    causal_conv1d_update._runs = name(update) + " (adapted: x [B, D, T] <-> [B, D] per token)"
    norm_cls = fla.FusedRMSNormGated

    def gated_norm(old):
        """FLA's fused gated RMSNorm with the weights and eps of HF's module ``old``."""
        import torch
        new = norm_cls(old.weight.shape[0], eps=old.variance_epsilon, activation=getattr(old, "activation", "silu"),
                       device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight)
        return new
    gated_norm._runs = name(norm_cls)
    return {"torch_chunk_gated_delta_rule": _kwargs_filter(fla.chunk_gated_delta_rule,
                                                           name(fla.chunk_gated_delta_rule)),
            "torch_recurrent_gated_delta_rule": _kwargs_filter(fla.fused_recurrent_gated_delta_rule,
                                                               name(fla.fused_recurrent_gated_delta_rule)),
            "causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update,
            "gated_norm": gated_norm}


def hf_kernel_report(model=None, mq=None) -> dict:
    """{HF's name: what runs} for the GDN callables of transformers' qwen3_next module (and the gated norm class
    of ``model``'s GDN layers)."""
    if mq is None:
        import transformers.models.qwen3_next.modeling_qwen3_next as mq
    out = {k: _runs(getattr(mq, k)) for k in HF_GDN_CALLABLES if hasattr(mq, k)}
    if model is not None:
        for m in model.modules():
            if type(m).__name__ == "Qwen3NextGatedDeltaNet":
                out["gated_norm"] = f"{type(m.norm).__module__}.{type(m.norm).__qualname__}"
                break
    return out


def use_hf_kernels(model, kernels: dict, mq=None):
    """Points HF's Qwen3-Next at ``kernels`` (``fla_kernels()``): assigns the module-level callables of
    transformers' qwen3_next module (which its GDN layer looks up at every call) and swaps the gated norm module of
    each GDN layer of ``model`` (``kernels["gated_norm"](old) -> new``). Returns ``undo()``, which puts back what
    was there (the module's callables and the model's norms)."""
    if mq is None:
        import transformers.models.qwen3_next.modeling_qwen3_next as mq
    missing = [k for k in HF_GDN_CALLABLES if not hasattr(mq, k)]
    if missing:
        raise RuntimeError(f"transformers' qwen3_next module has no {missing}: this transformers version calls its "
                           f"GDN kernels by other names; read its modeling_qwen3_next.py")
    old_fns = {k: getattr(mq, k) for k in HF_GDN_CALLABLES}
    old_norms = []
    if kernels.get("gated_norm") is not None:
        for m in model.modules():
            if type(m).__name__ == "Qwen3NextGatedDeltaNet":
                old_norms.append((m, m.norm))
                m.norm = kernels["gated_norm"](m.norm)
    for k in HF_GDN_CALLABLES:
        setattr(mq, k, kernels[k])

    def undo():
        for k, f in old_fns.items():
            setattr(mq, k, f)
        for m, norm in old_norms:
            m.norm = norm
    return undo


def hf_model(config, dtype=None, device: str = "cpu", seed: int = 0):
    """HF ``Qwen3NextForCausalLM`` with ``config``'s dims and random weights (``dtype`` default bfloat16, SDPA
    attention, eval mode)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(**_hf_kwargs(config))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.bfloat16)
    try:
        with torch.device(device):
            return Qwen3NextForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)


def _past(res):
    """The cache of an HF output (``past_key_values`` in transformers 5.17, ``cache`` from about 5.2x)."""
    for k in ("past_key_values", "cache"):
        try:
            v = res[k]
        except (KeyError, TypeError):
            continue
        if v is not None:
            return v
    return None


def hf_kernel_check(model, kernels: dict, lens=(173, 300), steps: int = 3, seed: int = 0, mq=None) -> dict:
    """HF's logits on its own torch GDN path against the same model on ``kernels`` (``use_hf_kernels``): a
    left-padded prefill of ``lens`` (all positions' logits: the chunked rule, the conv, the gated norm, the padding
    mask) then ``steps`` decode steps through the cache (the recurrent rule, the conv update, the conv state
    written in place). Returns {"prefill": {"max_abs", "ref_max", "rel", "cos_min", "cos_median", "top1_agree",
    "positions"}, "decode": {...}, "kernels": report, "torch": report}: per position (real tokens only) the cosine of
    the two logit vectors and whether their argmax agrees. In bf16 a random model's max-based "rel" is large even
    for rounding-level differences (HF's torch gated norm rounds to bf16 where FLA's stays fp32: rel ~0.1-0.3 at
    80B dims, a near-tie of the top-10 router flips an expert); a layout error gives cosines near 0."""
    import torch
    if mq is None:
        import transformers.models.qwen3_next.modeling_qwen3_next as mq
    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    L, b = max(lens), len(lens)
    ids = torch.randint(0, vocab, (b, L), generator=g).to(dev)
    mask = torch.zeros(b, L, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, L - n:] = 1
    mask = mask.to(dev)
    nxt = torch.randint(0, vocab, (steps, b, 1), generator=g).to(dev)

    def run():
        with torch.no_grad():
            res = model(input_ids=ids, attention_mask=mask, use_cache=True)
            pre = res.logits.float() * mask[..., None]                    # padding rows: not compared
            pkv, m, dec = _past(res), mask, []
            for s in range(steps):
                m = torch.cat([m, torch.ones(b, 1, dtype=m.dtype, device=dev)], 1)
                res = model(input_ids=nxt[s], attention_mask=m, past_key_values=pkv, use_cache=True)
                pkv = _past(res)
                dec.append(res.logits[:, -1].float())
        return pre, torch.stack(dec, 1)

    torch_report = hf_kernel_report(model, mq)
    for k in HF_GDN_CALLABLES:            # the reference: transformers' own torch functions, whatever it resolved
        f = getattr(mq, k)
        torch_report[k] = _runs(getattr(f, "__wrapped__", f))
    torch_fns = {k: getattr(getattr(mq, k), "__wrapped__", getattr(mq, k)) for k in HF_GDN_CALLABLES}
    undo = use_hf_kernels(model, dict(torch_fns, gated_norm=None), mq)
    try:
        ref = run()
    finally:
        undo()
    undo = use_hf_kernels(model, kernels, mq)
    try:
        report = hf_kernel_report(model, mq)
        got = run()
    finally:
        undo()
    out = {"kernels": report, "torch": torch_report, "lens": list(lens), "steps": steps,
           "dtype": str(next(model.parameters()).dtype)}
    for key, r, o, keep in (("prefill", ref[0], got[0], mask.bool()), ("decode", ref[1], got[1], None)):
        err = (o - r).abs().max().item()
        top = r.abs().max().item()
        r2, o2 = (r[keep], o[keep]) if keep is not None else (r.flatten(0, 1), o.flatten(0, 1))   # [positions, V]
        cos = torch.nn.functional.cosine_similarity(o2, r2, dim=-1)
        out[key] = {"max_abs": err, "ref_max": top, "rel": err / max(top, 1e-30),
                    "cos_min": cos.min().item(), "cos_median": cos.median().item(),
                    "top1_agree": (o2.argmax(-1) == r2.argmax(-1)).float().mean().item(),
                    "positions": int(r2.shape[0]), "finite": bool(torch.isfinite(o).all().item())}
    return out


def hf_rows(config, cases: dict, reps: int = REPS, seed: int = 0, log=None, fla: bool = None) -> dict:
    """HF Qwen3NextForCausalLM with ``config``'s dims: {"varlen", "long", "decode": {"ms", "do_bench_ms"}, "info"}.
    ``fla`` (default: on a GPU) runs HF's GDN layers on FLA's kernels (``fla_kernels`` / ``use_hf_kernels``); off,
    or when FLA cannot be imported, HF runs its torch fallbacks and "info" says so. Frees the model and torch's
    cached GPU memory before returning."""
    import torch
    import transformers
    info = {"transformers": transformers.__version__, "torch": torch.__version__}
    dev = "cuda" if torch.cuda.is_available() else "cpu"        # cpu: a smoke run of this code (tests)
    info["device"] = dev
    fla = (dev == "cuda") if fla is None else fla
    t0 = time.time()
    hf = hf_model(config, torch.bfloat16, dev, seed)
    info["init_s"] = round(time.time() - t0, 1)
    log = log or (lambda m: None)
    info["hf_kernels_resolved"] = hf_kernel_report(hf)       # what transformers picked by itself at import
    undo = None
    if fla:
        try:
            import fla as fla_pkg
            info["fla"] = getattr(fla_pkg, "__version__", "importable")
            undo = use_hf_kernels(hf, fla_kernels())
        except Exception as err:  # pragma: no cover - reported, HF runs its torch fallbacks
            info["fla_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    info["hf_kernels"] = hf_kernel_report(hf)                   # what the timed calls run
    info["experts_implementation"] = str(getattr(hf.config, "_experts_implementation", None))
    info["attn_implementation"] = str(getattr(hf.config, "_attn_implementation", None))
    log(f"init {info}")
    rng = np.random.default_rng(seed)
    out = {"info": info}

    def sync(_):
        if dev == "cuda":
            torch.cuda.synchronize()

    def do_bench(fn):
        if dev != "cuda":
            return None
        try:
            import triton
            return float(triton.testing.do_bench(fn, warmup=1, rep=1, return_mode="median"))
        except Exception:  # pragma: no cover
            return None

    prefill = {}
    try:
        with torch.no_grad():
            # ---- prefill rows ----
            name, lens = cases["varlen"]
            L = max(lens)
            ids = torch.from_numpy(rng.integers(0, config.vocab_size, (len(lens), L))).to(dev)
            mask = torch.zeros(len(lens), L, dtype=torch.long, device=dev)
            for i, n in enumerate(lens):
                mask[i, L - n:] = 1                                                   # left padding, as HF generates
            prefill = {"varlen": lambda: hf(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)}
            _, (n1,) = cases["long"]
            ids1 = torch.from_numpy(rng.integers(0, config.vocab_size, (1, n1))).to(dev)
            prefill["long"] = lambda: hf(input_ids=ids1, use_cache=False, logits_to_keep=1)
            for key, fn in prefill.items():
                try:
                    t1 = time.time()
                    fn()
                    sync(None)
                    first = time.time() - t1
                    log(f"{key}: first call {first:.1f} s")
                    out[key] = {"ms": _median_ms(fn, sync, reps), "do_bench_ms": do_bench(fn), "first_call_s": first}
                except Exception as err:
                    out[key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                log(f"{key}: {out[key]}")
                if dev == "cuda":
                    torch.cuda.empty_cache()
            # ---- decode: prefill the context with a cache, then time one-token steps ----
            _, n, ctx, _ = cases["decode"]
            try:
                idsd = torch.from_numpy(rng.integers(0, config.vocab_size, (n, ctx))).to(dev)
                res = hf(input_ids=idsd, use_cache=True, logits_to_keep=1)
                pkv = _past(res)
                del res
                nxt = torch.from_numpy(rng.integers(0, config.vocab_size, (n, 1))).to(dev)
                step = lambda: hf(input_ids=nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1)  # noqa: E731
                step()
                sync(None)
                out["decode"] = {"ms": _median_ms(step, sync, max(reps, 5))}
                log(f"decode: {out['decode']}")
                del pkv
            except Exception as err:
                out["decode"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        if undo is not None:
            undo()
    del hf, prefill
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


# ================================================================================================================
# Ours
# ================================================================================================================
def _shared_cache_kwargs(cases: dict, reps: int) -> dict:
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
    caches = {"varlen": lambda: model.init_cache(**_shared_cache_kwargs(cases, reps)),
              "long": lambda: model.init_cache(max_seqs=1, max_tokens=n_long + 16, page_size=16,
                                               max_seq_len=n_long)}
    out = {}
    state = {}

    for key in [k for k in ("long", "varlen") if k in keys]:     # varlen last: its cache goes on to the decode row
        state.pop("cache", None)
        state["cache"] = caches[key]()
        _, lens = cases[key]
        ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
        cu = _cu(lens)
        slots = np.arange(len(lens), dtype=np.int32)
        try:
            def call():
                logits, state["cache"] = model.prefill(state["cache"], ids, cu, slots)
                return logits

            def prepare():
                state["cache"] = _jax_sync(model.release(state["cache"], slots))
            prepare()
            t0 = time.perf_counter()
            _jax_sync(call())
            first = time.perf_counter() - t0
            ms = _median_ms(call, _jax_sync, reps, prepare)
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
        logits, state["cache"] = model.prefill(state["cache"], ids, _cu([dctx] * len(sl)), sl)
    _jax_sync(logits)
    fill = time.perf_counter() - t0
    nxt = rng.integers(0, cfg.vocab_size, dn).astype(np.int32)

    def step():
        logits, state["cache"] = model.decode(state["cache"], nxt, slots)
        return logits
    t0 = time.perf_counter()
    _jax_sync(step())
    first = time.perf_counter() - t0
    ms = _median_ms(step, _jax_sync, max(reps, 5))
    if hasattr(model, "check"):
        model.check(state["cache"])
    return {"ms": ms, "first_call_s": first, "context_fill_s": fill}


def _block0(model, mixer: str):
    """Parameters of the first block whose mixer is ``mixer`` (its layer slice of the stacked params)."""
    import jax
    plan = model.plan
    for j in range(plan.period):
        if plan.kinds[j].mixer == mixer and plan.repeats:
            return jax.tree.map(lambda a: a[0], model.params["period"][j]), plan.kinds[j]
    for b, i in zip(model.params["tail"], plan.tail):
        if plan.kinds[i].mixer == mixer:
            return b, plan.kinds[i]
    return None, None


def _embed_logits(cfg):
    """The model's ends as one function: embedding gather [T] + final RMSNorm + lm_head on each stream's last token
    (cu [N + 1]) -> [N, Vocab] fp32."""
    import jax.numpy as jnp
    from jax_gdn.ops.norms import rms_norm

    def embed_logits(embed, final_norm, head, ids, cu):
        h = embed[ids]
        h = h[jnp.maximum(cu[1:] - 1, 0)]
        h = rms_norm(h, final_norm, cfg.rms_norm_eps)
        return jnp.matmul(h, head if head is not None else embed.T, preferred_element_type=jnp.float32)
    return embed_logits


def _sums(out: dict, split_of) -> None:
    """"model_sum" / "model_sum_split" from the figure of record (``out[part]``) and "model_sum_<timing>" from
    ``out["ms_<timing>"]`` (pipelined, blocking, in_program), in place; ``split_of(ms) -> {group: layers x part
    ms}`` (a part missing: None). An in-program sum with a part's slope <= 0 (timing noise above the part's time,
    e.g. on a loaded CPU) is None: it would not be a time."""
    for key, ms in (("model_sum", out),) + tuple((f"model_sum_{k}", out.get(f"ms_{k}") or {})
                                                  for k in ("pipelined", "blocking", "in_program")):
        if key == "model_sum_in_program" and any(v is not None and v <= 0 for v in ms.values()):
            out[key] = None
            continue
        try:
            split = split_of(ms)
            out[key] = sum(split.values())
            if key == "model_sum":
                out["model_sum_split"] = split
        except (KeyError, TypeError):
            out[key] = None


def _prefill_split(layers: dict):
    """split_of for ``_sums`` of the prefill parts: GDN layers x phases 1-3, attention layers, MoE (or MLP) layers,
    embed_logits once."""
    ng, na, nm = layers["gdn"], layers["attention"], layers["moe"]
    return lambda ms: {"gdn": ng * (ms["gdn_phase1"] + ms["gdn_phase2"] + ms["gdn_phase3"]) if ng else 0.0,
                       "attention": na * ms["attention"] if na else 0.0,
                       "moe": nm * (ms["moe"] if "moe" in ms else ms["mlp"]), "embed_logits": ms["embed_logits"]}


def _decode_split(layers: dict):
    """split_of for ``_sums`` of the decode parts."""
    ffn = "moe" if "moe" in layers else "mlp"
    return lambda ms: {"gdn": layers["gdn"] * ms["gdn_decode"] if layers["gdn"] else 0.0,
                       "attention": layers["attention"] * ms["attention_decode"] if layers["attention"] else 0.0,
                       ffn: layers[ffn] * ms[ffn], "embed_logits": ms["embed_logits"]}


def parts(model, lens, reps: int = REPS, seed: int = 0, calls: int = PIPE_CALLS, iters: int = LOOP_ITERS,
          deadline: float = None) -> dict:
    """Per-part ms of one varlen prefill (see the module docstring), each part jitted alone and timed three ways
    by ``_time_into``: "ms_pipelined" ({part: ms}, ``calls`` calls queued, one sync), "ms_blocking" (a sync per
    call), "ms_in_program" (a program of ``iters`` iterations, once and twice queued; 0: not timed); "<part>" the
    pipelined ms until ``choose_figures`` picks; the GDN slots (phases 1, 2) and the KV pages (attention) donated
    and carried from call to call and from iteration to iteration; in the loop x (or every activation input of a
    part that does not return the residual stream) is fed back."""
    import jax
    import jax.numpy as jnp
    from jax_gdn.layers import block as blk
    from jax_gdn.layers import gdn
    from jax_gdn.layers.attention import attention_layer
    from jax_gdn.ops.norms import rms_norm
    from jax_gdn.state import BatchMeta, GdnSlots, KvPages

    cfg, dt = model.config, model.dtype
    n, t = len(lens), int(sum(lens))
    tb = model.token_bucket(t) if hasattr(model, "token_bucket") else t
    s = n
    # padded batch (the padding contract): tokens past cu[N] belong to no stream
    cu = jnp.asarray(_cu(lens))
    slot_ids = jnp.arange(n, dtype=jnp.int32)
    meta = BatchMeta(cu_seqlens=cu, slot_ids=slot_ids, has_initial_state=jnp.zeros((n,), bool),
                     positions=jnp.zeros((n,), jnp.int32))
    key = jax.random.PRNGKey(seed)
    x = jax.random.normal(key, (tb, cfg.hidden_size), jnp.float32).astype(dt)
    be = model.backends
    out = {"tokens": t, "padded_tokens": tb, "backends": {"gated_delta_rule": be.gated_delta_rule,
                                                          "paged_attention": be.paged_attention, "moe": be.moe}}

    def timed(name, fn, *args, state=None, feed=()):
        _time_into(out, name, fn, args, state, reps=reps, calls=calls, feed=feed, iters=iters, deadline=deadline)

    # ---- GDN phases ----
    gp, gkind = _block0(model, "gdn")
    if gp is not None:
        dims = cfg.gdn_dims
        mixer = dict(gp["mixer"], input_layernorm=gp["input_norm"])
        slots = GdnSlots.zeros(dims, s, dt)

        def p1(mixer, x, meta, slots):   # as the GDN block runs it; returns only what phases 2 and 3 read
            a, q, k, v, slots = gdn.phase1_varlen(mixer, dims, x, slots, meta, backend=be.gated_delta_rule)
            return (a._replace(mixed_qkv=None, qkvz=None), (q, k, v)), slots

        def p2(q, k, v, g, b, meta, st):
            return gdn.gdn_full_varlen(q, k, v, g, b, st, meta, backend=be.gated_delta_rule)[:2]
        (a, (q, k, v)), slots1 = jax.jit(p1)(mixer, x, meta, slots)
        o, _ = jax.jit(p2)(q, k, v, a.g, a.beta, meta, slots1)
        timed("gdn_phase1", p1, mixer, x, meta, state=slots, feed=(1,))
        timed("gdn_phase2", p2, q, k, v, a.g, a.beta, meta, state=slots1, feed=(0, 1, 2, 3, 4))
        timed("gdn_phase3", lambda mixer, o, z, x: gdn.phase3(mixer, dims, o, z, x), mixer, o, a.z, x,
              feed=(1, 2, 3))
        del a, slots, slots1, q, k, v, o
    # ---- attention (fresh streams in a contiguous page layout) ----
    ap, akind = _block0(model, "attention")
    if ap is not None:
        ps = 16
        pages = [-(-m // ps) for m in lens]
        first = np.cumsum([0] + pages[:-1])
        npages = int(sum(pages))
        w = max(pages)
        tok_stream = np.repeat(np.arange(n), lens)
        tok_pos = np.concatenate([np.arange(m) for m in lens]).astype(np.int32)
        tok_page = (first[tok_stream] + tok_pos // ps).astype(np.int32)
        pad = tb - t
        tok_pos_p = jnp.asarray(np.concatenate([tok_pos, np.zeros(pad, np.int32)]))
        tok_page_p = jnp.asarray(np.concatenate([tok_page, np.full(pad, npages, np.int32)]))   # dropped
        table = np.zeros((s, w), np.int32)
        for i, (f, m) in enumerate(zip(first, pages)):
            table[i, :m] = np.arange(f, f + m)
        kv = KvPages.zeros(npages, ps, cfg.num_key_value_heads, cfg.head_dim, dt)
        slot_lens = jnp.asarray(np.asarray(lens, np.int32))
        table = jnp.asarray(table)

        def attn(mp, norm, x, tok_pos, tok_page, table, slot_lens, cu, slot_ids, kv):
            h = rms_norm(x, norm, cfg.rms_norm_eps)
            h, kv = attention_layer(mp, cfg.attn_dims, h, kv, token_pos=tok_pos, token_page=tok_page,
                                    token_offset=tok_pos % ps, page_table=table, slot_lens=slot_lens,
                                    cu_seqlens=cu, slot_ids=slot_ids, decode=False, backend=be.paged_attention)
            return x + h, kv
        timed("attention", attn, ap["mixer"], ap["input_norm"], x, tok_pos_p, tok_page_p, table, slot_lens,
              cu, slot_ids, state=kv, feed=(2,))
        del kv
    # ---- MoE (or MLP) of a block ----
    fp = gp if gp is not None else ap
    fkind = gkind if gp is not None else akind
    if fp is not None:
        timed("moe" if fkind.moe else "mlp", lambda f, norm, x: x + blk.ffn(
            f, rms_norm(x, norm, cfg.rms_norm_eps), config=cfg, moe=fkind.moe, backend=be.moe), fp["ffn"],
            fp["post_norm"], x, feed=(2,))
    # ---- embeddings + logits ----
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, tb).astype(np.int32))
    p = model.params
    timed("embed_logits", _embed_logits(cfg), p["embed"], p["final_norm"], p.get("lm_head"), ids, cu, feed=(3,))

    ng, na = len(cfg.gdn_layers), len(cfg.attn_layers)
    nm = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
    out["layers"] = {"gdn": ng, "attention": na, "moe": nm}
    _sums(out, _prefill_split(out["layers"]))
    return out


def decode_parts(model, n: int, ctx: int, reps: int = REPS, seed: int = 0, calls: int = PIPE_CALLS,
                 iters: int = 2 * LOOP_ITERS, deadline: float = None) -> dict:
    """Per-part ms of one decode step of ``n`` streams each holding ``ctx`` tokens (see the module docstring),
    each part jitted alone with the model's layer-0 parameters and backends; the state a part advances (GDN slots,
    KV pages) is donated and carried from call to call, as the model's step does. Timed by ``_time_into`` as in
    ``parts`` (blocking: median of max(reps, 5) calls; in-program: a loop of ``iters`` iterations, x fed
    back)."""
    import jax
    import jax.numpy as jnp
    from jax_gdn.layers import block as blk
    from jax_gdn.layers import gdn
    from jax_gdn.layers.attention import attention_layer
    from jax_gdn.ops.norms import rms_norm
    from jax_gdn.state import GdnSlots, KvPages

    cfg, dt = model.config, model.dtype
    be = model.backends
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (n, cfg.hidden_size), jnp.float32).astype(dt)
    slot_ids = jnp.arange(n, dtype=jnp.int32)
    cu = jnp.arange(n + 1, dtype=jnp.int32)
    out = {"streams": n, "context": ctx}

    def timed(name, fn, *args, state=None, feed=()):
        _time_into(out, name, fn, args, state, reps=max(reps, 5), calls=calls, feed=feed, iters=iters,
                   deadline=deadline)

    gp, gkind = _block0(model, "gdn")
    if gp is not None:
        dims = cfg.gdn_dims
        mixer = dict(gp["mixer"], input_layernorm=gp["input_norm"])
        timed("gdn_decode", lambda mixer, x, slots: gdn.gdn_layer_decode(
            mixer, dims, x, slots, slot_ids, jnp.ones((n,), bool)), mixer, x, state=GdnSlots.zeros(dims, n, dt),
            feed=(1,))
    ap, akind = _block0(model, "attention")
    if ap is not None:
        ps = 16
        pp = -(-(ctx + 1) // ps)                                              # pages per stream after the step
        table = jnp.arange(n * pp, dtype=jnp.int32).reshape(n, pp)
        tok_pos = jnp.full((n,), ctx, jnp.int32)
        tok_page = table[:, ctx // ps]
        slot_lens = jnp.full((n,), ctx + 1, jnp.int32)
        kv = KvPages.zeros(n * pp, ps, cfg.num_key_value_heads, cfg.head_dim, dt)

        def attn(mp, norm, x, kv):
            h = rms_norm(x, norm, cfg.rms_norm_eps)
            h, kv = attention_layer(mp, cfg.attn_dims, h, kv, token_pos=tok_pos, token_page=tok_page,
                                    token_offset=tok_pos % ps, page_table=table, slot_lens=slot_lens,
                                    cu_seqlens=cu, slot_ids=slot_ids, decode=True, backend=be.paged_attention)
            return x + h, kv
        timed("attention_decode", attn, ap["mixer"], ap["input_norm"], x, state=kv, feed=(2,))
        del kv
    fp = gp if gp is not None else ap
    fkind = gkind if gp is not None else akind
    ffn_name = "moe" if fkind is not None and fkind.moe else "mlp"
    if fp is not None:
        timed(ffn_name, lambda f, norm, x: x + blk.ffn(f, rms_norm(x, norm, cfg.rms_norm_eps), config=cfg,
                                                       moe=fkind.moe, backend=be.moe), fp["ffn"], fp["post_norm"], x,
              feed=(2,))
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32))
    p = model.params
    timed("embed_logits", _embed_logits(cfg), p["embed"], p["final_norm"], p.get("lm_head"), ids, cu, feed=(3,))

    ng, na = len(cfg.gdn_layers), len(cfg.attn_layers)
    nm = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
    nf = cfg.num_hidden_layers if ffn_name == "moe" else cfg.num_hidden_layers - nm
    out["layers"] = {"gdn": ng, "attention": na, ffn_name: nf}
    _sums(out, _decode_split(out["layers"]))
    return out


PARTS_TIMING = (
    "three timings of each part (jitted alone, layer-0 params, its state donated and carried): ms_in_program: the "
    "part R times inside ONE compiled program (lax.fori_loop, static trip count; x, or every activation input, fed "
    "back so nothing is hoisted; state carried), ms = (median wall of 2 programs queued + one sync - median wall of "
    "1 program + sync) / R, R = {iters} (decode {diters}): the device time per layer as the model's scan runs it, "
    "with no per-part dispatch, launch or sync; ms_pipelined: {calls} separate calls queued back to back, one "
    "block_until_ready, total / {calls}, median of batches (pays one host dispatch per call: a part shorter on the "
    "device than its dispatch reads the dispatch); ms_blocking: each call closed by block_until_ready, median of "
    "calls (the rows' method: adds ~0.5 ms launch + sync per call). '<part>' (the figure of record: floor_ratio, "
    "model_sum) is ms_in_program when sound (measured, > 0, no copy of a carried buffer in the loop body, >= 0.6 x "
    "its roofline, <= 1.25 x min(pipelined, blocking)), else ms_pipelined; ms_source says which and "
    "in_program_unsound why")


def choose_figures(q: dict) -> None:
    """In place: q[part] (the figure of record) := q["ms_in_program"][part] when it is sound (and
    ``FIGURE_OF_RECORD`` is "in_program"), else q["ms_pipelined"][part]; q["ms_source"] = {part: "in_program" | "pipelined"}, q["in_program_unsound"] = {part:
    why}; q["suspect"] = {part: why} for a pipelined figure above 1.15 x its blocking one (queued calls cannot be
    slower than synced ones on an idle GPU: another process on the GPU, or a bug) or a part compiled more than once
    (q["compiles"]: a retrace while timing). Sound: measured, > 0, no copy of a carried buffer in the loop body, at
    least 0.6 x its roofline (q["roofline"]: 700 TFLOP/s and 4.8 TB/s; the H200's dense bf16 peak, ~990 TFLOP/s,
    is 1.41x the first: below 0.6 x, work was elided) and at most 1.25 x the separately dispatched call. Then the
    sums (``_sums``) again from the chosen figures."""
    roof = {k: (v or {}).get("ms") for k, v in (q.get("roofline") or {}).items()}
    q["ms_source"], q["in_program_unsound"], q["suspect"] = {}, {}, {}
    for k, pipe in (q.get("ms_pipelined") or {}).items():
        ip = (q.get("ms_in_program") or {}).get(k)
        blk = (q.get("ms_blocking") or {}).get(k)
        info = (q.get("in_program") or {}).get(k) or {}
        fl = roof.get(k)
        sep = min(v for v in (pipe, blk, float("inf")) if v is not None)
        why = None
        if ip is None:
            why = "not measured"
        elif FIGURE_OF_RECORD != "in_program":
            why = f"FIGURE_OF_RECORD is {FIGURE_OF_RECORD!r}"
        elif ip <= 0:
            why = f"slope {ip:.4f} ms <= 0 (timing noise above the part's time)"
        elif info.get("carried_copies"):
            why = f"{info['carried_copies']} copies of carried buffers per iteration in the loop body"
        elif fl and ip < 0.6 * fl:
            why = f"{ip:.4f} ms is below 0.6 x its roofline {fl:.4f} ms (work elided?)"
        elif sep < float("inf") and ip > 1.25 * sep:
            why = f"{ip:.4f} ms is above 1.25 x the separately dispatched call ({sep:.4f} ms)"
        if why is None:
            q[k], q["ms_source"][k] = ip, "in_program"
        else:
            q[k], q["ms_source"][k] = pipe, "pipelined"
            q["in_program_unsound"][k] = why
        sus = []
        if pipe is not None and blk is not None and pipe > 1.15 * blk:
            sus.append(f"pipelined {pipe:.3f} ms > 1.15 x blocking {blk:.3f} ms: queued calls cannot be slower "
                       "than synced ones on an idle GPU (another process on the GPU?)")
        nc = (q.get("compiles") or {}).get(k)
        if nc is not None and nc > 1:
            sus.append(f"its jitted function compiled {nc} times: a call retraced (the carried state changed type)")
        if sus:
            q["suspect"][k] = "; ".join(sus)
    if "layers" in q:
        _sums(q, (_decode_split if "streams" in q else _prefill_split)(q["layers"]))


def _other(q: dict) -> None:
    """"other" = model - model_sum and "other_<timing>" = model - model_sum_<timing>, in place (when both exist)."""
    for key, total in (("other", "model_sum"), ("other_pipelined", "model_sum_pipelined"),
                       ("other_blocking", "model_sum_blocking"), ("other_in_program", "model_sum_in_program")):
        if q.get(total) and q.get("model"):
            q[key] = q["model"] - q[total]


def measure_parts(model, cases: dict, reps: int = REPS, ours: dict = None, peers: dict = None, log=None,
                  calls: int = PIPE_CALLS, iters: int = LOOP_ITERS, deadline: float = None) -> dict:
    """parts_ms of the section: the varlen prefill's parts (``parts``) with their floors (``prefill_floors``) and,
    under "decode", the decode step's parts (``decode_parts``) with theirs (``decode_floors``); "model" and
    "other" from ``ours`` (our rows) when given. ``peers``: ``load_peers``' kernel and attention rows. Each part
    three ways (``_time_into``; ``iters`` 0: no in-program timing; ``deadline``: in-program timings stop at that
    ``time.time()``), the figure of record picked by ``choose_figures``; "timing" says all this."""
    import jax.numpy as jnp
    ours = ours or {}
    cfg = model.config
    nbytes = jnp.dtype(model.dtype).itemsize
    name, lens = cases["varlen"]
    out = parts(model, lens, reps, calls=calls, iters=iters, deadline=deadline)
    out["case"] = name
    out["timing"] = PARTS_TIMING.format(calls=calls, iters=iters, diters=2 * iters)
    out["pipe_calls"] = calls
    out["loop_iters"] = iters
    out["model"] = ours.get("varlen", {}).get("ms")
    _with_floors(out, prefill_floors(cfg, lens, nbytes, peers))
    choose_figures(out)
    _with_floors(out, prefill_floors(cfg, lens, nbytes, peers))          # the ratios of the chosen figures
    _other(out)
    out["floor_source"] = ({"path": peers.get("path"), "date": peers.get("date")} if peers and peers.get("path")
                           else None)
    if log is not None:
        log(f"prefill parts: {out}")
    dname, dn, dctx, _ = cases["decode"]
    dec = decode_parts(model, dn, dctx, reps, calls=calls, iters=2 * iters, deadline=deadline)
    dec["case"] = dname
    dec["model"] = ours.get("decode", {}).get("ms")
    _with_floors(dec, decode_floors(cfg, dn, dctx, nbytes))
    choose_figures(dec)
    _with_floors(dec, decode_floors(cfg, dn, dctx, nbytes))
    _other(dec)
    out["decode"] = dec
    return out


# ================================================================================================================
# Compile time of the full-depth config (abstract weights)
# ================================================================================================================
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
    cu = _cu(lens)
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


def _compile_in_subprocess(layers: int, quick: bool, timeout: float = 300.0) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "jax_gdn.bench_model", "--compile-only", "--layers", str(layers)]
    if quick:
        cmd.append("--quick")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"compile subprocess rc={r.returncode}: {(r.stderr or r.stdout)[-600:]}")


# ================================================================================================================
# The section
# ================================================================================================================
def _rows(cases: dict, ours: dict, hf_res: dict) -> list:
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


def _hf_in_subprocess(reps: int, timeout: float, quick: bool = False) -> dict:
    """hf_rows in a child process (its torch memory is gone when it exits; a hang is cut at ``timeout``). The
    child's progress lines go to this process's stderr."""
    cmd = [sys.executable, "-m", "jax_gdn.bench_model", "--hf-only", "--reps", str(reps)] + (["--quick"] if quick
                                                                                            else [])
    try:
        r = subprocess.run(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=None, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"HF subprocess cut at its {timeout:.0f} s time limit") from None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"HF subprocess rc={r.returncode}, no result line: {r.stdout[-400:]}")


def run_section(quick: bool = False, *, reps: int = REPS, hf: bool = None, compile_layers: int = None,
                subprocess_compile: bool = None, budget_s: float = None, on_update=None) -> dict:
    """Measures the section (see the module docstring). Order: our rows, then HF (a child process: its torch
    memory never meets ours in one process), then the 48-layer compile (a child process), then the parts.
    ``hf`` (default: not quick) runs HF transformers; ``compile_layers`` (default 48) the depth of the compile-time
    measurement (0: skip). ``budget_s``: each stage after our rows gets at most what is left of this many seconds
    (a stage that would not fit is skipped and named in "errors"). ``on_update(section)`` is called after each
    stage (e.g. to save partial results)."""
    start = time.time()
    preallocating = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() not in ("false", "0")
    try:
        from jax._src import xla_bridge
        jax_up = xla_bridge.backends_are_initialized()
    except Exception:  # pragma: no cover - private API moved: assume the worst only when told to preallocate
        jax_up = False
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")     # HF runs beside us in a child process
    hf = (not quick) if hf is None else hf
    compile_layers = COMPILE_LAYERS if compile_layers is None else compile_layers
    subprocess_compile = (not quick) if subprocess_compile is None else subprocess_compile
    make_cfg = tiny_config if quick else qwen3_next_80b_config
    cfg = make_cfg(LAYERS)
    cases = _cases(quick)
    section = {"layers": LAYERS, "quick": quick, "reps": reps, "rows": [], "parts_ms": {}, "errors": [],
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
            print(f"[bench_model] {time.time() - start:6.0f} s  {stage}", file=sys.stderr, flush=True)
        if on_update is not None:
            on_update(section)

    import jax
    import jax.numpy as jnp
    dev = jax.devices()[0]
    section["device"] = str(getattr(dev, "device_kind", dev))
    ours, hf_res = {}, {}
    model = None
    try:
        t0 = time.time()
        if quick:   # host-made tiny weights (compiling the random generator costs more than the rest on a CPU)
            from jax_gdn.checkpoint import random_model
            model = random_model(cfg, seed=0, dtype=jnp.float32, backend="auto")
        else:
            model = random_device_model(cfg, jnp.bfloat16, "auto")
        _jax_sync(model.params)
        section["init_s"] = round(time.time() - t0, 1)
        section["model"] = repr(model)
        update(f"model built: {section['model']}")
        ours = our_rows(model, cases, reps, log=None if quick else update)
    except Exception as err:
        section["errors"].append(f"ours: {type(err).__name__}: {str(err)[:300]}")
        traceback.print_exc()
    section["rows"] = _rows(cases, ours, hf_res)
    section["compiled_programs"] = ours.get("compiled_programs")
    update(f"our rows done: {ours}")

    if hf and not out_of_time("hf", 30):
        try:
            hf_res = _hf_in_subprocess(reps, timeout=min(left() - 5, 900.0), quick=quick)
            section["hf"] = hf_res.get("info")
        except Exception as err:
            section["errors"].append(f"hf: {type(err).__name__}: {str(err)[:300]}")
        section["rows"] = _rows(cases, ours, hf_res)
        update(f"hf rows done: {hf_res}")

    section["compile_s_48_layers"] = None
    if compile_layers and not out_of_time("compile", 10 if quick else 30):
        try:
            if subprocess_compile:
                c = _compile_in_subprocess(compile_layers, quick, timeout=min(left() - 5, 600.0))
            else:
                c = compile_seconds(make_cfg(compile_layers), cases["varlen"][1],
                                    jnp.float32 if quick else jnp.bfloat16, "auto",
                                    cache_kwargs=_shared_cache_kwargs(cases, REPS))
            section["compile"] = c
            if c["layers"] == 48 and not quick:
                section["compile_s_48_layers"] = c["s"]
        except Exception as err:
            section["errors"].append(f"compile: {type(err).__name__}: {str(err)[:300]}")
            traceback.print_exc()
        update(f"compile done: {section.get('compile')}")

    peers = {} if quick else load_peers(section["device"])
    add_row_floors(section, cfg, cases, peers, jnp.dtype(jnp.float32 if quick else jnp.bfloat16).itemsize)
    if model is not None and not out_of_time("parts", 10 if quick else 30):
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


def _print_parts(p: dict, names) -> None:
    """One line per part: the figure of record (in-program when sound, else pipelined: its source), the three
    timings, floor ms, record / floor, the floor's basis; then the sums over the model's layers (each timing)
    against the model's measured row, the unsound in-program figures, the suspect pipelined ones and the carried
    copies found. Results older than the in-program timing show "-" there; older than the pipelined timing (no
    "ms_blocking"), their one figure as blocking."""
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)
    fl, ra, ba = p.get("floor_ms") or {}, p.get("floor_ratio") or {}, p.get("floor_basis") or {}
    new = "ms_blocking" in p
    blk = p["ms_blocking"] if new else {k: p.get(k) for k in names}
    pipe = p.get("ms_pipelined") or ({k: p.get(k) for k in names} if new else {})
    ip, src = p.get("ms_in_program") or {}, p.get("ms_source") or {}
    print(f"  {'part':<17} {'ms':>8} {'(of)':<4} {'in-prog':>8} {'pipelined':>9} {'blocking':>9} {'floor ms':>9} "
          f"{'x floor':>8}  floor basis")
    for k in names:
        if k in p:
            rec = p.get(k) if new else None
            print(f"  {k:<17} {f(rec):>8} {src.get(k, 'pipe' if new else '-')[:4]:<4} {f(ip.get(k)):>8} "
                  f"{f(pipe.get(k)):>9} {f(blk.get(k)):>9} {f(fl.get(k), '{:.3g}'):>9} {f(ra.get(k), '{:.2f}'):>8}  "
                  f"{ba.get(k, '')}")
    split = p.get("model_sum_split") or {}
    print(f"  model sum {f(p.get('model_sum'), '{:.2f}')} ms ("
          + ", ".join(f"{k} {f(v, '{:.2f}')}" for k, v in split.items()) + ")"
          + "".join(f"; {t.replace('_', '-')} {f(p.get('model_sum_' + t), '{:.2f}')}"
                    for t in ("in_program", "pipelined", "blocking") if ("model_sum_" + t) in p)
          + f" | model measured {f(p.get('model'), '{:.2f}')} ms; other {f(p.get('other'), '{:.2f}')} ms")
    for k, why in (p.get("in_program_unsound") or {}).items():
        if why != "not measured":
            print(f"    in-program {k} not used: {why}")
    for k, why in (p.get("suspect") or {}).items():
        print(f"    SUSPECT {k}: {why}")
    for k, info in (p.get("in_program") or {}).items():
        for c in info.get("copies") or []:
            print(f"    copy in {k}'s loop body: {c}")
    for k, v in (p.get("errors") or {}).items():
        print(f"    {k}: {v[:160]}")


def parts_markdown(parts_ms: dict) -> list:
    """Markdown lines of a parts_ms with floors (``jax_gdn.bench --markdown``): one row per part of the prefill and
    of the decode step: the figure of record (ms) and which timing it is, the in-program, pipelined and blocking ms
    per layer, its floor, the ratio (figure of record / floor) and the floor's basis; then a line saying how each
    was timed; [] without floors. Older results: without "ms_pipelined" their "<part>" figure was the pipelined
    one (in-program "-"); without "ms_blocking" their one figure was blocking (pipelined "-", the ratio blocking)."""
    from jax_gdn.bench import _f, _header
    if not parts_ms or not parts_ms.get("floor_ms"):
        return []
    out = _header(["part (ms per layer)", "step", "floor", "ms", "of", "in-program ms", "pipelined ms", "blocking ms",
                   "floor ms", "part / floor"], text_cols=3)
    eras = set()
    for q, step in ((parts_ms, "prefill"), (parts_ms.get("decode") or {}, "decode")):
        ratio, basis = q.get("floor_ratio") or {}, q.get("floor_basis") or {}
        blk, pipe, ip = q.get("ms_blocking"), q.get("ms_pipelined"), q.get("ms_in_program") or {}
        if q.get("floor_ms"):
            eras.add("blocking" if blk is None else "pipelined" if pipe is None else "new")
        for k, fl in (q.get("floor_ms") or {}).items():
            if blk is None:
                rec, of, p_, b = None, "-", None, q.get(k)
            elif pipe is None:
                rec, of, p_, b = q.get(k), "pipelined", q.get(k), blk.get(k)
            else:
                rec, of, p_, b = q.get(k), (q.get("ms_source") or {}).get(k, "-"), pipe.get(k), blk.get(k)
            out.append(f"| {k} | {step} {q.get('case', '')} | {basis.get(k, '')} | {_f(rec)} | {of} | "
                       f"{_f(ip.get(k))} | {_f(p_)} | {_f(b)} | {_f(fl)} | {_f(ratio.get(k), '{:.2f}')} |")
    out.append("")
    calls = parts_ms.get("pipe_calls") or PIPE_CALLS
    iters = parts_ms.get("loop_iters") or LOOP_ITERS
    ratio_of = ("the blocking ms (these results predate the pipelined timing)" if "blocking" in eras else
                "the pipelined ms (these results predate the in-program timing)" if "pipelined" in eras else
                "ms, the figure of record")
    out.append(f"in-program ms: the part R = {iters} times (decode {2 * iters}) inside one compiled loop, x fed "
               "back and state carried, (t(2 loops queued) - t(1 loop)) / R: the device time per layer as the "
               f"model's one program runs it; pipelined ms: {calls} calls of the part queued with no sync between, "
               f"one sync, total / {calls} (pays a host dispatch per call); blocking ms: each call closed by a sync "
               "(the rows' method); ms: the in-program figure when sound (no carried-buffer copy in the loop, "
               "between 0.6 x its roofline and 1.25 x the separate call), else the pipelined one (\"of\" says which); "
               f"part / floor: {ratio_of}.")
    out.append("")
    return out


def print_section(section: dict, summary: bool = True) -> None:
    """A short table of the section; with ``summary`` the ``summary_lines`` last."""
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    print(f"model: {section.get('model', '?')} on {section.get('device', '?')}"
          f"{' (quick: tiny dims, not a measurement)' if section.get('quick') else ''}")
    print(f"{'case':<24} {'kind':<8} {'tokens':>7} | {'ours ms':>9} {'HF ms':>9} | {'ours tok/s':>11} "
          f"{'HF tok/s':>11} | {'x HF':>6} | {'1st call s':>10}")
    for r in section.get("rows", []):
        print(f"{r['case']:<24} {r['kind']:<8} {r['tokens']:>7} | {f(r['ms']['ours']):>9} {f(r['ms']['hf']):>9} | "
              f"{f(r['tokens_per_s']['ours'], '{:.0f}'):>11} {f(r['tokens_per_s']['hf'], '{:.0f}'):>11} | "
              f"{f(r['speedup']):>6} | {f(r.get('first_call_s'), '{:.1f}'):>10}")
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
        _print_parts(p, ("gdn_phase1", "gdn_phase2", "gdn_phase3", "attention", "moe", "mlp", "embed_logits"))
        d = p.get("decode") or {}
        if d:
            print(f"parts, decode {d.get('case')} ({d.get('streams')} streams x {d.get('context')} tokens; ms per "
                  f"layer):")
            _print_parts(d, ("gdn_decode", "attention_decode", "moe", "mlp", "embed_logits"))
        if p.get("timing"):
            print(f"  timing of the parts: {p['timing']}")
        over = [f"{k} {v:.2f}" for q in (p, d) for k, v in (q.get("floor_ratio") or {}).items() if v and v > 2]
        if p.get("floor_ratio") and not section.get("quick"):
            print("targets (issue 9): each part within 2x of its floor: "
                  + ("met" if not over else "NOT met: " + ", ".join(over)))
    _print_row_floors(section.get("row_floors"), f" of the {section.get('layers', '?')}-layer rows")
    c = section.get("compile") or {}
    if c:
        print(f"compile of the {c.get('layers')}-layer prefill (abstract weights, fresh process): "
              f"{f(c.get('s'), '{:.1f}')} s "
              f"(trace+lower {f(c.get('lower_s'), '{:.1f}')} s, compile {f(c.get('compile_s'), '{:.1f}')} s)")
    sp = [r["speedup"] for r in section.get("rows", []) if r.get("speedup")]
    if sp:
        print(f"targets (issue 9): tokens/s >= 3x HF on every row: {'met' if min(sp) >= 3 else 'NOT met'} "
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


def check_config(quick: bool = False):
    """The GPU check's config: 2 layers, one GDN and one attention, at 80B dims (tiny dims when ``quick``)."""
    import dataclasses
    cfg = (tiny_config if quick else qwen3_next_80b_config)(2)
    return dataclasses.replace(cfg, layer_types=("linear_attention", "full_attention"))


def hf_check(quick: bool = False, lens=(173, 300), steps: int = 3) -> dict:
    """``hf_kernel_check`` of FLA's kernels (``fla_kernels()``) on a bf16 HF model of ``check_config`` on the GPU:
    HF's torch path against HF on FLA, the same weights and inputs."""
    import torch
    t0 = time.time()
    model = hf_model(check_config(quick), torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu")
    res = hf_kernel_check(model, fla_kernels(), lens=lens, steps=steps)
    res["resolved_by_transformers"] = hf_kernel_report(model)
    res["s"] = round(time.time() - t0, 1)
    return res


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny dims (CPU smoke run)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--compile-only", action="store_true", help="print the compile-time JSON line and exit")
    p.add_argument("--layers", type=int, default=COMPILE_LAYERS, help="depth of --compile-only")
    p.add_argument("--json", default=None)
    p.add_argument("--hf-only", action="store_true", help="print HF's rows as a JSON line and exit (a GPU)")
    p.add_argument("--hf-check", action="store_true",
                   help="print a JSON line: HF on FLA's kernels against HF's torch path, 2 layers (GDN + attention) "
                        "at 80B dims (--quick: tiny dims); needs FLA and a GPU")
    a = p.parse_args(argv)
    if a.hf_check:
        res = hf_check(a.quick)
        print(json.dumps(res), flush=True)
        return res
    if a.hf_only:
        res = hf_rows(tiny_config(LAYERS) if a.quick else qwen3_next_80b_config(LAYERS), _cases(a.quick), a.reps,
                      log=lambda m: print(f"[hf] {m}", file=sys.stderr, flush=True))
        print(json.dumps(res), flush=True)
        return res
    if a.compile_only:
        import jax.numpy as jnp
        cfg = (tiny_config if a.quick else qwen3_next_80b_config)(a.layers)
        cases = _cases(a.quick)
        res = compile_seconds(cfg, cases["varlen"][1], jnp.float32 if a.quick else jnp.bfloat16, "auto",
                              cache_kwargs=_shared_cache_kwargs(cases, REPS))
        print(json.dumps(res), flush=True)
        return res
    section = run_section(a.quick, reps=a.reps, hf=False if a.no_hf else None)
    print_section(section)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(section, fh, indent=1)
    return section


if __name__ == "__main__":
    main()
