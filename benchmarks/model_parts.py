"""The whole-model section's parts (``parts_ms`` of benchmarks.model's module doc): each part of the model jitted
alone with the model's layer-0 parameters and backends, timed three ways (in one compiled loop, pipelined,
blocking), the figure of record chosen by ``choose_figures``, and set against its floor (``benchmarks.floors``).
"""
from __future__ import annotations

import statistics
import time
import traceback

import numpy as np

from benchmarks.cases import cu_seqlens
from benchmarks.floors import decode_floors, prefill_floors, with_floors
from benchmarks.tables import fmt, md_header
from benchmarks.timing import PIPE_CALLS, median_ms, pipelined_ms
from jax_gdn.timing import jax_sync

#: blocking calls per median of the model section (its rows and parts)
REPS = 5


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
    """{"ms": pipelined (``pipelined_ms``: ``calls`` calls, one sync, median of ``max(reps, 3)`` batches),
    "ms_blocking": each call closed by a sync (``median_ms`` of ``reps`` calls: the rows' method)} of
    ``jax.jit(fn)(*args)``, or with ``state`` of ``fn(*args, state) -> (y, new_state)`` jitted with the state
    donated: every call's new state feeds the next call (both timings, as the model's step carries its slots and
    pages), starting from a copy of ``state`` (the caller's arrays are never donated). One warm-up call (compile)
    first; both timings run the same compiled function and differ only in where they sync. ``sync`` (default
    ``jax.block_until_ready``) gets the call's result (pipelined: the list of the batch's results) and, with
    ``state``, the current state beside it. "compiles": the jitted function's cache size after all calls (1: no
    call retraced; None where jax has no ``_cache_size``)."""
    import jax
    import jax.numpy as jnp
    sync_fn = sync or jax_sync
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
    blocking = median_ms(call, done, reps)
    out = {"ms": pipelined_ms(call, done, calls, max(reps, 3)), "ms_blocking": blocking}
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
    sync_fn = sync or jax_sync
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
    cu = jnp.asarray(cu_seqlens(lens))
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
    with_floors(out, prefill_floors(cfg, lens, nbytes, peers))
    choose_figures(out)
    with_floors(out, prefill_floors(cfg, lens, nbytes, peers))          # the ratios of the chosen figures
    _other(out)
    out["floor_source"] = ({"path": peers.get("path"), "date": peers.get("date")} if peers and peers.get("path")
                           else None)
    if log is not None:
        log(f"prefill parts: {out}")
    dname, dn, dctx, _ = cases["decode"]
    dec = decode_parts(model, dn, dctx, reps, calls=calls, iters=2 * iters, deadline=deadline)
    dec["case"] = dname
    dec["model"] = ours.get("decode", {}).get("ms")
    with_floors(dec, decode_floors(cfg, dn, dctx, nbytes))
    choose_figures(dec)
    with_floors(dec, decode_floors(cfg, dn, dctx, nbytes))
    _other(dec)
    out["decode"] = dec
    return out


def print_parts(p: dict, names) -> None:
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
    """Markdown lines of a parts_ms with floors (``python -m benchmarks --markdown``): one row per part of the prefill and
    of the decode step: the figure of record (ms) and which timing it is, the in-program, pipelined and blocking ms
    per layer, its floor, the ratio (figure of record / floor) and the floor's basis; then a line saying how each
    was timed; [] without floors. Older results: without "ms_pipelined" their "<part>" figure was the pipelined
    one (in-program "-"); without "ms_blocking" their one figure was blocking (pipelined "-", the ratio blocking)."""
    if not parts_ms or not parts_ms.get("floor_ms"):
        return []
    out = md_header(["part (ms per layer)", "step", "floor", "ms", "of", "in-program ms", "pipelined ms", "blocking ms",
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
            out.append(f"| {k} | {step} {q.get('case', '')} | {basis.get(k, '')} | {fmt(rec)} | {of} | "
                       f"{fmt(ip.get(k))} | {fmt(p_)} | {fmt(b)} | {fmt(fl)} | {fmt(ratio.get(k), '{:.2f}')} |")
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
