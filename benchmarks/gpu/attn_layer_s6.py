"""Session 6, the attention LAYER prefill (issue 11: <= 3 ms on the H200 at varlen16): each change alone and all
together, against the layer as it was, in one process, timed the same way.

    python benchmarks/gpu/attn_layer_s6.py [--budget 100] [--quick]

Layer: jax_gdn.layers.attention.attention_layer at Qwen3-Next-80B attention dims (hidden 2048, H 16, Hkv 2, Dh 256,
partial RoPE 0.25, bf16), the varlen16 streams (19027 tokens, 16 streams), 16-token pages in a shuffled order;
cases "fresh" (every stream new) and "ctx2k" (each stream continues 2048 tokens of context already in its pages).
Jitted as bench_layers does it (returns the output and the new pages, pools not donated).

Variants (module switches read when the layer is traced):
  current       three q/k/v weights (concatenated per call from 8192 tokens), the unfused cuDNN path (q / gate
                sliced by XLA, every key gathered back from the pages, context call + LSE merge, gate after it)
  fused_w       + one qkv_proj weight held (attention.fuse_qkv, as HybridModel now holds it): no per-call concat
  direct_cond   three weights; cudnn.prefill_direct (new K/V straight from the projection, context keys alone
                gathered, gate in the merge pass), lax.cond skipping context call / stats / merge on a fresh batch
  direct_merge  the same without the cond (context call always, empty on a fresh batch)
  all_cond      fused_w + direct_cond (the new default)
  all_merge     fused_w + direct_merge
  (all_* also write the K/V pages with attention.KV_WRITE_UNIQUE: flat rows, unique indices; all_cond_kv2:
  all_cond with the old (page, offset) scatter; kv_rows: that change alone; *_qp: the q norm + RoPE as one
  Pallas kernel, cudnn.Q_PROLOGUE "pallas")
  pallas        the Pallas fused gated kernel (held qkv_proj), for reference
Numerics: relative RMS of each variant's output (and of the pages it wrote) against the XLA backend's layer
(three weights, bf16 inputs, fp32 softmax) and against "current" (all in bf16: no fp32 matmul precision switch,
it would change the GEMMs being timed). Timing: every variant compiled and checked first, then walls in
interleaved rounds (each variant ``--reps`` blocking calls per round, ``--rounds`` rounds; median and p10 / p90)
so that clock drift hits all alike; for the variants whose entry names the case, the kernel table of 5 calls
under jax.profiler (profile_s6.kernel_table: its own wall median of 5, kernel ms per call by name, launches).
Then, if 35 s are left, the ``gpu`` tests of prefill_direct, the q prologue and the cuDNN op (pytest
subprocess). ``--variants a,b``: only those, in that order. ``--prologue-sweep``: first the q norm + RoPE alone,
XLA against the Pallas kernel per (layout, block_t, num_warps), and the fastest right one for the layer rows. Writes $OUT/<tag>.json and $OUT/<tag>.log (--tag,
default attn_layer_s6); prints a table last. --quick: tiny dims on CPU ("cudnn_xla" stand-in,
"pallas_interpret").
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT", "/tmp/out")
RES = {"rows": []}
TAG = "attn_layer_s6"
_LOG = []

# name: (hold qkv_proj, CUDNN_DIRECT, cudnn.FRESH, KV_WRITE_UNIQUE, cudnn.Q_PROLOGUE, backend family,
#        kernel table in cases)
VARIANTS = {
    "current": (False, False, "cond", False, "xla", "cudnn", ("fresh", "ctx2k")),
    "all_cond": (True, True, "cond", True, "xla", "cudnn", ("fresh", "ctx2k")),
    "all_merge": (True, True, "merge", True, "xla", "cudnn", ("fresh",)),
    "all_cond_qp": (True, True, "cond", True, "pallas", "cudnn", ("fresh", "ctx2k")),
    "all_merge_qp": (True, True, "merge", True, "pallas", "cudnn", ("fresh",)),
    "all_cond_kv2": (True, True, "cond", False, "xla", "cudnn", ()),
    "fused_w": (True, False, "cond", False, "xla", "cudnn", ()),
    "direct_cond": (False, True, "cond", False, "xla", "cudnn", ()),
    "kv_rows": (False, False, "cond", True, "xla", "cudnn", ()),
    "direct_merge": (False, True, "merge", False, "xla", "cudnn", ()),
    "pallas": (True, False, "cond", True, "xla", "pallas", ()),
}


def log(*a):
    s = " ".join(str(x) for x in a)
    _LOG.append(s)
    print(s, flush=True)


def save():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, TAG + ".json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)
    with open(os.path.join(OUT, TAG + ".log"), "w") as f:
        f.write("\n".join(_LOG) + "\n")


def build_case(quick: bool, ctx: int, seed: int = 0):
    """(params with three weights, x [T, D], kv pool with each slot's context in place, metadata tuple)."""
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_layers as bl
    from jax_gdn.state import KvPages
    _, adims, lens = bl._dims(quick)
    t, n = sum(lens), len(lens)
    ps = 16
    pages_per = [-(-(ctx + x) // ps) for x in lens]
    num_pages = sum(pages_per)
    d, h, hkv, dh = adims.hidden_size, adims.num_heads, adims.num_kv_heads, adims.head_dim
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(jnp.bfloat16)
    p = {"q_proj": w(ks[0], (d, h * 2 * dh)), "k_proj": w(ks[1], (d, hkv * dh)), "v_proj": w(ks[2], (d, hkv * dh)),
         "o_proj": w(ks[3], (h * dh, d)), "q_norm": 0.1 * jax.random.normal(ks[4], (dh,)),
         "k_norm": 0.1 * jax.random.normal(ks[5], (dh,))}
    x = jax.random.normal(ks[6], (t, d), jnp.float32).astype(jnp.bfloat16)
    order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    first = np.cumsum([0] + pages_per[:-1])
    pt = np.zeros((n, max(pages_per)), np.int32)
    for i, (f, c) in enumerate(zip(first, pages_per)):
        pt[i, :c] = order[f:f + c]
    tok_slot = np.concatenate([[i] * x_ for i, x_ in enumerate(lens)]).astype(np.int32)
    tok_pos = np.concatenate([ctx + np.arange(x_) for x_ in lens]).astype(np.int32)
    meta = tuple(jnp.asarray(a) for a in (tok_pos, pt[tok_slot, tok_pos // ps], tok_pos % ps, pt,
                                          np.asarray(lens, np.int32) + ctx,
                                          np.cumsum([0] + list(lens)).astype(np.int32), np.arange(n, dtype=np.int32)))
    kv = KvPages.zeros(num_pages, ps, hkv, dh, jnp.bfloat16)
    if ctx:      # the context keys / values of every slot, in its pages (as an earlier call would have left them)
        rows = np.concatenate([pt[i, c // ps] * ps + c % ps for i in range(n) for c in [np.arange(ctx)]])
        kc = (0.5 * jax.random.normal(ks[7], (rows.size, hkv, dh), jnp.float32)).astype(jnp.bfloat16)
        vc = jax.random.normal(ks[8], (rows.size, hkv, dh), jnp.float32).astype(jnp.bfloat16)
        kp = kv.k_pages.reshape(num_pages * ps, hkv, dh).at[rows].set(kc).reshape(kv.k_pages.shape)
        vp = kv.v_pages.reshape(num_pages * ps, hkv, dh).at[rows].set(vc).reshape(kv.v_pages.shape)
        kv = KvPages(k_pages=kp, v_pages=vp)
    return adims, p, x, kv, meta, t


def make_layer(adims, backend: str):
    import jax
    from jax_gdn.layers.attention import attention_layer

    def layer(p, x, kv, tp, tpg, tof, pt, sl, cu, ids):
        return attention_layer(p, adims, x, kv, token_pos=tp, token_page=tpg, token_offset=tof, page_table=pt,
                               slot_lens=sl, cu_seqlens=cu, slot_ids=ids, backend=backend)
    return jax.jit(layer)


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


SWEEP = [("gather", 32, 4), ("gather", 64, 4), ("gather", 16, 2), ("gather", 32, 8), ("halves", 32, 4),
         ("halves", 64, 4), ("halves", 64, 8), ("halves", 16, 2), ("halves", 128, 8), ("halves", 8, 1)]


def prologue_sweep(quick: bool, end: float, rounds: int = 3, reps: int = 20) -> dict:
    """The q norm + RoPE alone at the layer's dims: XLA (``reference.gated_query``, q only) and the Pallas kernel
    per (layout, block_t, num_warps) of SWEEP, timed in interleaved rounds; numerics against XLA. Sets
    q_prologue's defaults to the fastest config that is numerically right; returns the rows."""
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_layers as bl
    from jax_gdn.layers.rope import rope_cos_sin
    from pallas_kernels.paged_attention import q_prologue as qp
    from pallas_kernels.paged_attention.reference import gated_query
    _, adims, lens = bl._dims(quick)
    t, h, dh = sum(lens), adims.num_heads, adims.head_dim
    c = h * 2 * dh + 2 * adims.num_kv_heads * dh
    ks = jax.random.split(jax.random.PRNGKey(3), 2)
    qg = jax.random.normal(ks[0], (t, c), jnp.float32).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(ks[1], (dh,))
    pos = jnp.asarray(np.concatenate([np.arange(x) for x in lens]), jnp.int32)
    cos, sin = rope_cos_sin(pos, adims.rotary_dim, adims.rope_theta)
    fns = {"xla": jax.jit(lambda a, b, cc, ss: gated_query(a, b, cc, ss, num_heads=h, head_dim=dh,
                                                            eps=1e-6)[0])}
    for lay, bt, nw in SWEEP:
        fns[f"{lay}/{bt}/{nw}"] = jax.jit(functools.partial(
            qp.gated_query_pallas, num_heads=h, head_dim=dh, eps=1e-6, interpret=quick, layout=lay, block_t=bt,
            num_warps=nw))
    args = (qg, w, cos, sin)
    ref = np.asarray(jax.block_until_ready(fns["xla"](*args)).astype(jnp.float32))
    rows, ok = {}, {}
    for name, fn in fns.items():
        if time.time() > end:
            break
        try:
            out = np.asarray(jax.block_until_ready(fn(*args)).astype(jnp.float32))
            rows[name] = {"rel_rms_vs_xla": rel_rms(out, ref)}
            ok[name] = fn
        except Exception as err:  # noqa: BLE001
            rows[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            log(f"prologue {name}: {rows[name]['error']}")
    times = {k: [] for k in ok}
    for _ in range(rounds):
        for name, fn in ok.items():
            for _ in range(reps):
                t1 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[name].append(1e3 * (time.perf_counter() - t1))
    for name in ok:
        rows[name]["ms"] = float(np.median(times[name]))
        log(f"prologue {name:16s} {rows[name]['ms']:.4f} ms  rel_rms vs xla {rows[name]['rel_rms_vs_xla']:.1e}")
    good = [k for k in ok if k != "xla" and rows[k]["rel_rms_vs_xla"] < 1e-2]
    if good:
        best = min(good, key=lambda k: rows[k]["ms"])
        lay, bt, nw = best.split("/")
        qp.LAYOUT, qp.BLOCK_T, qp.NUM_WARPS = lay, int(bt), int(nw)
        log(f"prologue: fastest {best} ({rows[best]['ms']:.4f} ms, XLA {rows['xla'].get('ms', float('nan')):.4f}); "
            f"the layer variants below use it")
        rows["best"] = best
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=100)
    ap.add_argument("--reps", type=int, default=10, help="calls per variant per round")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds")
    ap.add_argument("--variants", default=None, help="comma list of VARIANTS names (default: all, in order)")
    ap.add_argument("--tag", default="attn_layer_s6", help="name of the JSON / log under $OUT")
    ap.add_argument("--prologue-sweep", action="store_true",
                    help="first time the q prologue alone per kernel config (SWEEP) and use the fastest")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-tests", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    end = t0 + a.budget
    global TAG
    TAG = a.tag
    names = a.variants.split(",") if a.variants else list(VARIANTS)
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; known: {list(VARIANTS)}")
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_layers as bl
    from jax_gdn.layers import attention as attn_mod
    from jax_gdn.layers.attention import fuse_qkv
    from pallas_kernels.paged_attention import cudnn
    from profile_s6 import kernel_table
    RES.update(jax=jax.__version__, device=str(jax.devices()[0]), quick=a.quick, budget=a.budget)
    gpu = jax.default_backend() == "gpu" and not a.quick
    fam = {"cudnn": "cudnn" if gpu else "cudnn_xla", "pallas": "pallas" if gpu else "pallas_interpret"}
    saved = (attn_mod.CUDNN_DIRECT, cudnn.FRESH, attn_mod.KV_WRITE_UNIQUE, cudnn.Q_PROLOGUE)
    outs = {}
    if a.prologue_sweep:
        RES["prologue_sweep"] = prologue_sweep(a.quick, min(end - 40, time.time() + 30))
        save()
    for case, ctx in (("fresh", 0), ("ctx2k", 2048 if not a.quick else 40)):
        if time.time() > end - 15:
            log(f"skip case {case}: budget")
            break
        adims, p3, x, kv, meta, t = build_case(a.quick, ctx)
        pf = fuse_qkv(p3)
        # reference: the XLA backend (three weights, unfused)
        try:
            attn_mod.CUDNN_DIRECT, attn_mod.KV_WRITE_UNIQUE = False, False
            ref_out, ref_kv = jax.block_until_ready(make_layer(adims, "xla")(p3, x, kv, *meta))
            ref = (np.asarray(ref_out.astype(jnp.float32)), np.asarray(ref_kv.k_pages.astype(jnp.float32)))
            log(f"[{case}] xla reference done ({time.time() - t0:.0f} s)")
        except Exception as err:  # noqa: BLE001
            ref = None
            log(f"[{case}] xla reference failed: {type(err).__name__}: {str(err)[:300]}")
        finally:
            attn_mod.CUDNN_DIRECT, cudnn.FRESH, attn_mod.KV_WRITE_UNIQUE, cudnn.Q_PROLOGUE = saved
        ready = {}                          # name -> (row, fn, args): compiled and checked, timed below
        for name in names:
            hold, direct, fresh, kv_unique, qp, family, tables = VARIANTS[name]
            need = 14 if case in tables else 8
            if time.time() > end - need:
                log(f"[{case}] skip {name}: budget")
                continue
            row = {"case": case, "variant": name, "T": t, "context": ctx}
            try:
                (attn_mod.CUDNN_DIRECT, cudnn.FRESH, attn_mod.KV_WRITE_UNIQUE,
                 cudnn.Q_PROLOGUE) = direct, fresh, kv_unique, qp
                fn = make_layer(adims, fam[family])
                params = pf if hold else p3
                args = (params, x, kv) + meta
                out, kv_new = jax.block_until_ready(fn(*args))            # compile (switches read here)
                o = np.asarray(out.astype(jnp.float32))
                kp = np.asarray(kv_new.k_pages.astype(jnp.float32))
                row["finite"] = bool(np.all(np.isfinite(o)))
                if ref is not None:
                    row["rel_rms_vs_xla"] = rel_rms(o, ref[0])
                    row["pages_rel_rms_vs_xla"] = rel_rms(kp, ref[1])
                if "current" in outs.get(case, {}):
                    row["rel_rms_vs_current"] = rel_rms(o, outs[case]["current"])
                outs.setdefault(case, {})[name] = o
                ready[name] = (row, fn, args)
                log(f"[{case}] {name:13s} compiled, rel_rms vs xla {row.get('rel_rms_vs_xla', float('nan')):.2e} "
                    f"({time.time() - t0:.0f} s)")
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
                log(f"[{case}] {name} failed: {row['error']}")
                RES["rows"].append(row)
            finally:
                attn_mod.CUDNN_DIRECT, cudnn.FRESH, attn_mod.KV_WRITE_UNIQUE, cudnn.Q_PROLOGUE = saved
        # walls: interleaved rounds (every variant a.reps calls per round) so that clock drift hits all alike
        walls = {k: [] for k in ready}
        for _ in range(max(1, a.rounds)):
            for name, (row, fn, args) in ready.items():
                for _ in range(max(1, a.reps)):
                    t1 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    walls[name].append(1e3 * (time.perf_counter() - t1))
        for name, (row, fn, args) in ready.items():
            row["wall_ms"] = float(np.median(walls[name]))
            row["wall_p10_p90"] = [float(np.percentile(walls[name], 10)), float(np.percentile(walls[name], 90))]
            if case in VARIANTS[name][6] and time.time() < end - 6:
                kt = kernel_table(lambda: fn(*args), 5, f"attn_layer_{name}_{case}", top=25)
                row.update(kt_wall_ms=kt["wall_ms"], kernels_ms=kt["kernels_sum_ms"],
                           launches=kt["launches_per_call"], kernels=kt["kernels"][:25])
            log(f"[{case}] {name:13s} wall {row['wall_ms']:.3f} ms (p10 {row['wall_p10_p90'][0]:.3f}, p90 "
                f"{row['wall_p10_p90'][1]:.3f})  ({time.time() - t0:.0f} s)")
            RES["rows"].append(row)
            save()
        ready.clear()
        del kv, x, p3, pf
    if gpu and not a.no_tests and time.time() < end - 35:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-m", "gpu",
               "tests/pallas_kernels/test_paged_attention_cudnn.py", "-k", "direct or prologue or f64"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10, end - time.time() - 3))
            RES["gpu_tests"] = {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-1500:]}
        except subprocess.TimeoutExpired:
            RES["gpu_tests"] = {"rc": None, "tail": "timed out"}
        log("gpu tests rc", RES["gpu_tests"]["rc"], RES["gpu_tests"]["tail"][-400:])
    else:
        log(f"gpu tests not run (gpu={gpu}, no_tests={a.no_tests}, {end - time.time():.0f} s left, need 35)")
    save()
    log("== attention layer prefill, varlen16 at 80B dims (bf16)" + (" [QUICK: tiny dims, CPU]" if a.quick else ""))
    log(f"{'case':6s} {'variant':13s} {'wall ms':>8s} {'kt wall':>8s} {'kernels':>8s} {'launch':>6s} "
        f"{'vs xla':>8s} {'vs cur':>8s} {'pages':>8s}")

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    for r in RES["rows"]:
        if "error" in r:
            log(f"{r['case']:6s} {r['variant']:13s} ERROR {r['error'][:90]}")
            continue
        log(f"{r['case']:6s} {r['variant']:13s} {f(r.get('wall_ms'), '8.3f')} {f(r.get('kt_wall_ms'), '8.3f'):>8s} "
            f"{f(r.get('kernels_ms'), '8.3f'):>8s} {f(r.get('launches'), '6d'):>6s} "
            f"{f(r.get('rel_rms_vs_xla'), '8.1e'):>8s} {f(r.get('rel_rms_vs_current'), '8.1e'):>8s} "
            f"{f(r.get('pages_rel_rms_vs_xla'), '8.1e'):>8s}")
    log(f"total {time.time() - t0:.0f} s")
    save()


if __name__ == "__main__":
    main()
