"""One device run for the cuDNN prefill backend of paged attention (pallas_kernels/paged_attention/cudnn.py):
numerics against the float64 oracle / the XLA reference, then the core and the attention layer timed against
the Pallas Triton kernel in the same process, the same way. Budget: 120 s (stages past the deadline are skipped
and say so). Each stage is appended to $OUT/attn_cudnn.json as it finishes; the log is $OUT/attn_cudnn.log; a
short table is printed last.

    python benchmarks/gpu/attn_cudnn.py [--quick] [--budget 120] [--stages probe,numerics,...]
    --quick: CPU, tiny dims, the XLA stand-in ("cudnn_xla") and Pallas interpret mode: the script end to end.

Stages (in this order; numerics (b), (c) run last):
  probe     jax / cuDNN versions, jax's kv-offset unit (1, or G before jax PR 39521), the LSE cuDNN returns on a
            tiny packed call against float64 (natural log expected; rows inside each segment expected, else
            the run switches cudnn.STATS_ROWS to "packed" and says so)
  numerics  (a) the test-file case (streams of 1, 63, 64, 65, 130, 257 tokens with 0-300 context, shuffled pages,
            NaN page tails, padding) at Dh 256 G 8 bf16 / fp16 and Dh 128 G 4 bf16 vs the float64 oracle
            (rel RMS <= 2e-2 per stream), the fresh-only switch; (b) 4 streams of varlen16 at 80B dims, fresh
            and continuing 2048 context, vs the XLA reference (matmul precision highest); (c) one 32768-token
            stream: cudnn vs pallas
  core      varlen16 (19027 tokens), varlen16 + 2k context, one 32768-token stream: pallas, cudnn (context
            call + merge), cudnn_fresh (CudnnConfig(context=False), fresh cases), cudnn_gather (the packing +
            K/V gather alone)
  layer     jax_gdn.bench_layers' attention layer at varlen16 (80B dims): pallas (fused gated kernel) vs cudnn
            (XLA q norm / RoPE, cuDNN core, gate fused by XLA into the merge), and the two outputs compared
  model, layer_grouped (not in the default list; run 2): the model with attention on cudnn vs pallas (4 layers,
            80B attention dims, chunked prefill + decode, logits compared); the layer timed in groups of calls
Timing: jax_gdn.bench.time_jax (groups of back-to-back calls closed by block_until_ready, median) for the core;
bench_layers' own harness (median of single calls) for the layer, as in the earlier runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

OUT = os.environ.get("OUT", "/tmp/out")
RESULT: dict = {}
TABLE: list = []
T0 = time.time()
_LOG = None


def log(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    if _LOG is not None:
        _LOG.write(msg + "\n")
        _LOG.flush()


def save(key, value):
    RESULT[key] = value
    with open(os.path.join(OUT, "attn_cudnn.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


class Ctx:
    def __init__(self, quick, budget):
        import jax
        self.quick = quick
        self.deadline = T0 + budget
        self.gpu = jax.default_backend() == "gpu"
        self.cudnn = "cudnn" if not quick else "cudnn_xla"
        self.pallas = "pallas" if not quick else "pallas_interpret"
        self.reps = dict(warmup=1, groups=3, per_group=1) if quick else dict(warmup=3, groups=10, per_group=5)

    def left(self):
        return self.deadline - time.time()

    def fits(self, need_s, what):
        if self.left() < need_s:
            log(f"SKIP {what}: {self.left():.0f} s left, needs ~{need_s} s")
            RESULT.setdefault("skipped", []).append(what)
            return False
        return True


def stage(fn):
    def run(ctx, *a):
        t = time.time()
        try:
            fn(ctx, *a)
        except Exception as err:  # noqa: BLE001 - report and go on
            log(f"STAGE {fn.__name__} FAILED: {type(err).__name__}: {str(err)[:1500]}")
            log(traceback.format_exc()[-3000:])
            save(f"{fn.__name__}_error", f"{type(err).__name__}: {str(err)[:3000]}")
        log(f"[{fn.__name__}: {time.time() - t:.1f} s, {time.time() - T0:.0f} s total]")
    return run


# ----------------------------------------------------------------------------------------------------------------
@stage
def probe(ctx):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import cudnn
    info = {"jax": jax.__version__, "device": str(jax.devices()[0]), "backend": jax.default_backend()}
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
        info["cudnn_version"] = fa.check_cudnn_version() if ctx.gpu else None
    except Exception as err:  # noqa: BLE001
        info["cudnn_version"] = f"{type(err).__name__}: {err}"
    info["kv_offset_unit_80b"] = cudnn.kv_offset_unit(16, 2, 256)
    info["supports_80b_bf16"] = cudnn.supports(platform=jax.default_backend(), dtype=jnp.bfloat16, head_dim=256,
                                               num_heads=16, num_kv_heads=2)
    # the LSE cuDNN returns: one tiny packed call, three segments, vs float64
    rng = np.random.default_rng(0)
    h, hkv, dh = 4, 2, 64
    lens, klen = [5, 9, 3], [7, 9, 12]
    t, kc = sum(lens) + 3, sum(klen) + 4
    q = rng.standard_normal((t, h, dh)).astype(np.float32)
    k = rng.standard_normal((kc, hkv, dh)).astype(np.float32)
    v = rng.standard_normal((kc, hkv, dh)).astype(np.float32)
    qo = np.concatenate([[0], np.cumsum(lens)])
    ko = np.concatenate([[0], np.cumsum(klen)])
    seg = cudnn.Segments(q_len=jnp.asarray([lens], jnp.int32), kv_len=jnp.asarray([klen], jnp.int32),
                         q_off=jnp.asarray([list(qo)], jnp.int32), kv_off=jnp.asarray([list(ko)], jnp.int32),
                         rank=jnp.arange(3, dtype=jnp.int32))
    dt = jnp.bfloat16
    qb, kb, vb = (jnp.asarray(x, dt) for x in (q, k, v))
    unit = cudnn.kv_offset_unit(h, hkv, dh)
    if unit > 1:   # the regions of this probe are not aligned to G: realign the keys
        info["probe_note"] = f"kv unit {unit}: probe keys re-laid at multiples of {unit}"
        ko2 = np.concatenate([[0], np.cumsum([-(-x // unit) * unit for x in klen])])
        k2 = np.zeros((ko2[-1] + unit, hkv, dh), np.float32)
        v2 = np.zeros_like(k2)
        for i in range(3):
            k2[ko2[i]:ko2[i] + klen[i]] = k[ko[i]:ko[i] + klen[i]]
            v2[ko2[i]:ko2[i] + klen[i]] = v[ko[i]:ko[i] + klen[i]]
        k, v, ko = k2, v2, ko2
        kb, vb = jnp.asarray(k, dt), jnp.asarray(v, dt)
        seg = seg._replace(kv_off=jnp.asarray([list(ko)], jnp.int32))
    scale = dh ** -0.5
    if ctx.quick:
        o, st = jax.jit(lambda a, b, c: cudnn.segments_xla(a, b, c, seg, causal=True, scale=scale))(qb, kb, vb)
    else:
        o, st = jax.jit(lambda a, b, c: cudnn.segments_cudnn(a, b, c, seg, causal=True, scale=scale,
                                                             unit=unit))(qb, kb, vb)
    o, st = np.asarray(o.astype(jnp.float32)), np.asarray(st)
    qr, kr, vr = (np.asarray(jnp.asarray(x, dt).astype(jnp.float32), np.float64) for x in (q, k, v))
    err_ln, err_l2, err_o, err_abs = 0.0, 0.0, 0.0, 0.0
    for i in range(3):
        qq = qr[qo[i]:qo[i] + lens[i]]
        kk = np.repeat(kr[ko[i]:ko[i] + klen[i]], h // hkv, axis=1)
        vv = np.repeat(vr[ko[i]:ko[i] + klen[i]], h // hkv, axis=1)
        s = np.einsum("qhd,khd->hqk", qq, kk) * scale
        s = np.where(np.arange(klen[i])[None, None] <= np.arange(lens[i])[None, :, None], s, -np.inf)
        mx = s.max(-1, keepdims=True)
        lse = (mx + np.log(np.exp(s - mx).sum(-1, keepdims=True)))[..., 0]           # [H, L]
        p = np.exp(s - lse[..., None])
        ref = np.einsum("hqk,khd->qhd", p, vv)
        def worst(x):      # NaN / garbage counts as infinitely wrong
            x = float(np.max(np.abs(x)))
            return x if np.isfinite(x) else float("inf")
        err_ln = max(err_ln, worst(st[i, :, :lens[i]] - lse))
        # the other layout a packed stats tensor could have: rows at the tokens' absolute (packed) index
        err_abs = max(err_abs, worst(st[i, :, qo[i]:qo[i] + lens[i]] - lse))
        err_l2 = max(err_l2, worst(st[i, :, :lens[i]] - lse / np.log(2)))
        err_o = max(err_o, worst(rel_rms(o[qo[i]:qo[i] + lens[i]], ref)))
    info["lse_max_abs_err_natural_log"] = err_ln
    info["lse_max_abs_err_log2"] = err_l2
    info["probe_out_rel_rms"] = err_o
    info["lse_max_abs_err_if_rows_absolute"] = err_abs
    if not err_ln < 5e-2 and err_abs < 5e-2:       # cuDNN keeps the LSE at the packed row: follow it for this run
        cudnn.STATS_ROWS = "packed"
    if not err_ln < 5e-2 and err_l2 < 5e-2:        # a log2 LSE: convert for this run
        cudnn.STATS_TO_LN = float(np.log(2))
    info["stats_rows_used"] = cudnn.STATS_ROWS
    info["stats_to_ln_used"] = cudnn.STATS_TO_LN
    log("probe:", json.dumps(info, default=str))
    save("probe", info)
    TABLE.append(f"probe: jax {info['jax']}, cuDNN {info.get('cudnn_version')}, kv unit {unit}, LSE err ln "
                 f"{err_ln:.2e} / log2 {err_l2:.2e} / rows absolute {err_abs:.2e}, out rel {err_o:.2e}")


# ----------------------------------------------------------------------------------------------------------------
@stage
def numerics(ctx):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import api
    from pallas_kernels.paged_attention.cudnn import CudnnConfig
    from tests.pallas_kernels.test_paged_attention import STREAMS_ODD, make_case, oracle
    jax.config.update("jax_default_matmul_precision", "highest")
    res = {}
    rng = np.random.default_rng(1)
    combos = [(256, 8, jnp.bfloat16), (256, 8, jnp.float16), (128, 4, jnp.bfloat16)]
    if ctx.quick:
        combos = [(32, 4, jnp.bfloat16)]
    for dh, group, dtype in combos:
        case = make_case(rng, streams=STREAMS_ODD + [(4, 300, 257)], hkv=2, group=group, dh=dh, num_slots=7,
                         dtype=dtype)
        out = np.asarray(api.paged_attention(*case.args(dtype), scale=dh ** -0.5, backend=ctx.cudnn)
                         .astype(jnp.float32))
        ref = oracle(case, dh ** -0.5)
        errs = [rel_rms(out[case.cu[i]:case.cu[i] + n], ref[case.cu[i]:case.cu[i] + n])
                for i, (s, o, n, _, _) in enumerate(case.streams) if s >= 0 and n]
        pad_zero = bool(np.all(out[case.cu[-1]:] == 0))
        key = f"oracle_dh{dh}_g{group}_{jnp.dtype(dtype).name}"
        res[key] = {"max_rel_rms": max(errs), "per_stream": errs, "finite": bool(np.all(np.isfinite(out))),
                    "padding_zero": pad_zero, "ok": max(errs) <= 2e-2 and pad_zero and bool(np.all(np.isfinite(out)))}
        log(key, res[key])
    case = make_case(rng, streams=[(0, 0, 1), (1, 0, 64), (2, 0, 130), (3, 0, 63)], hkv=2, group=8,
                     dh=256 if not ctx.quick else 32, dtype=jnp.bfloat16)
    dh = case.q.shape[2]
    out = np.asarray(api.paged_attention(*case.args(jnp.bfloat16), scale=dh ** -0.5, backend=ctx.cudnn,
                                         config=CudnnConfig(context=False)).astype(jnp.float32))
    ref = oracle(case, dh ** -0.5)
    e = rel_rms(out[:case.cu[-1]], ref[:case.cu[-1]])
    res["fresh_only_switch"] = {"rel_rms": e, "ok": e <= 2e-2 and bool(np.all(out[case.cu[-1]:] == 0))}
    log("fresh_only_switch", res["fresh_only_switch"])
    _numerics_done(res)


def _numerics_done(res):
    res["all_ok"] = all(v.get("ok", False) for v in res.values() if isinstance(v, dict))
    save("numerics", res)


@stage
def numerics_80b(ctx):
    """(b) varlen16 subset at 80B dims vs the XLA reference; (c) the 32k stream vs pallas."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import api
    jax.config.update("jax_default_matmul_precision", "highest")
    res = RESULT.get("numerics", {})
    if ctx.fits(25, "numerics_80b"):
        from jax_gdn.bench_attention import build_case
        dims = dict(h=16, hkv=2, dh=256) if not ctx.quick else dict(h=4, hkv=2, dh=32)
        lens = (1907, 64, 513, 130) if not ctx.quick else (70, 1, 33)
        for ctxlen in (0, 2048 if not ctx.quick else 40):
            args, _ = build_case(lens, ctxlen, dtype=jnp.bfloat16, seed=3, **dims)
            sc = dims["dh"] ** -0.5
            ours = np.asarray(api.paged_attention(*args, scale=sc, backend=ctx.cudnn).astype(jnp.float32))
            ref = np.asarray(api.paged_attention(*args, scale=sc, backend="xla").astype(jnp.float32))
            pal = np.asarray(api.paged_attention(*args, scale=sc, backend=ctx.pallas).astype(jnp.float32))
            cu = np.concatenate([[0], np.cumsum(lens)])
            errs = [rel_rms(ours[cu[i]:cu[i + 1]], ref[cu[i]:cu[i + 1]]) for i in range(len(lens))]
            perr = [rel_rms(pal[cu[i]:cu[i + 1]], ref[cu[i]:cu[i + 1]]) for i in range(len(lens))]
            key = f"varlen4_ctx{ctxlen}_vs_xla"
            res[key] = {"cudnn_max_rel_rms": max(errs), "pallas_max_rel_rms": max(perr), "ok": max(errs) <= 2e-2}
            log(key, res[key])
        save("numerics", res)
    if ctx.fits(30, "numerics_32k"):
        from jax_gdn.bench_attention import build_case
        dims = dict(h=16, hkv=2, dh=256) if not ctx.quick else dict(h=4, hkv=2, dh=32)
        n32 = 32768 if not ctx.quick else 300
        args, _ = build_case((n32,), 0, dtype=jnp.bfloat16, seed=4, **dims)
        sc = dims["dh"] ** -0.5
        ours = api.paged_attention(*args, scale=sc, backend=ctx.cudnn).astype(jnp.float32)
        pal = api.paged_attention(*args, scale=sc, backend=ctx.pallas).astype(jnp.float32)
        e = rel_rms(np.asarray(ours), np.asarray(pal))
        res["stream32k_cudnn_vs_pallas"] = {"rel_rms": e, "ok": e <= 2e-2}
        log("stream32k_cudnn_vs_pallas", res["stream32k_cudnn_vs_pallas"])
    _numerics_done(res)


def _numerics_line():
    res = RESULT.get("numerics", {})
    if not res:
        return "numerics: not run"
    return (f"numerics: {'PASS' if res.get('all_ok') else 'FAIL'} ("
            + ", ".join(f"{k} {v.get('max_rel_rms', v.get('rel_rms', v.get('cudnn_max_rel_rms'))):.1e}"
                        for k, v in res.items() if isinstance(v, dict)) + ")")


# ----------------------------------------------------------------------------------------------------------------
@stage
def core(ctx):
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench import time_jax
    from jax_gdn.bench_attention import build_case, prefill_flop
    from jax_gdn.cases import VARLEN16_LENS
    from pallas_kernels.paged_attention import api, cudnn
    from pallas_kernels.paged_attention.cudnn import CudnnConfig
    jax.config.update("jax_default_matmul_precision", "default")
    dims = dict(h=16, hkv=2, dh=256) if not ctx.quick else dict(h=4, hkv=2, dh=32)
    cases = [("varlen16", tuple(VARLEN16_LENS), 2048 * 0), ("32k", (32768,), 0),
             ("varlen16_ctx2k", tuple(VARLEN16_LENS), 2048)]
    if ctx.quick:
        cases = [("varlen16", (70, 1, 33, 130), 0), ("32k", (257,), 0), ("varlen16_ctx2k", (70, 1, 33, 130), 40)]
    rows = RESULT.get("core", {})
    sc = dims["dh"] ** -0.5
    for name, lens, ctxlen in cases:
        need = 25 if name != "32k" else 30
        if not ctx.fits(need, f"core_{name}"):
            continue
        args, _ = build_case(lens, ctxlen, dtype=jnp.bfloat16, **dims)
        q, kp, vp, pt, sl, cu, ids = args
        flop = prefill_flop(lens, ctxlen, dims["h"], dims["dh"])
        impls = {"pallas": (ctx.pallas, None), "cudnn": (ctx.cudnn, None)}
        if ctxlen == 0:
            impls["cudnn_fresh"] = (ctx.cudnn, CudnnConfig(context=False))
        row = {"lens": len(lens), "tokens": int(sum(lens)), "context": ctxlen, "gflop": flop / 1e9, "ms": {},
               "errors": {}}
        reps = dict(ctx.reps)
        if name == "32k" and not ctx.quick:
            reps.update(groups=7, per_group=2)
        for impl, (backend, cfg) in impls.items():
            if not ctx.fits(8, f"core_{name}_{impl}"):
                continue
            try:
                fn = jax.jit(lambda *a, b=backend, c=cfg: api.paged_attention(*a, scale=sc, backend=b, config=c))
                row["ms"][impl] = time_jax(fn, args, **reps)
            except Exception as err:  # noqa: BLE001
                row["ms"][impl] = None
                row["errors"][impl] = f"{type(err).__name__}: {str(err)[:600]}"
            log(f"core {name} {impl}: {row['ms'].get(impl)} ms {row['errors'].get(impl, '')}")
        if ctx.fits(8, f"core_{name}_gather"):
            try:
                unit = cudnn.kv_offset_unit(dims["h"], dims["hkv"], dims["dh"]) if not ctx.quick else 1
                p_, ps_ = kp.shape[0], kp.shape[1]
                cap = cudnn.default_capacity(q.shape[0], ids.shape[0], p_, ps_, pt.shape[1], unit, True)

                def gather(q, kp, vp, pt, sl, cu, ids):
                    pk = cudnn.build_packing(pt, sl, cu, ids, num_pages=p_, page_size=ps_, capacity=cap,
                                             align=unit, context=True)
                    return cudnn.gather_kv(kp, vp, pk.rows)
                row["ms"]["cudnn_gather"] = time_jax(jax.jit(gather), args, **reps)
                row["kv_capacity"] = cap
            except Exception as err:  # noqa: BLE001
                row["errors"]["cudnn_gather"] = f"{type(err).__name__}: {str(err)[:600]}"
        row["tflops"] = {k: (flop / v / 1e9 if v else None) for k, v in row["ms"].items() if k != "cudnn_gather"}
        if not row["errors"]:
            del row["errors"]
        rows[name] = row
        save("core", rows)
        log(f"core {name}: {json.dumps(row, default=str)}")


# ----------------------------------------------------------------------------------------------------------------
@stage
def layer(ctx):
    import jax
    import jax.numpy as jnp
    from jax_gdn import bench_layers
    res = RESULT.get("layer", {})
    for backend in (ctx.pallas, ctx.cudnn):
        if not ctx.fits(20, f"layer_{backend}"):
            continue
        try:
            r = bench_layers.bench_layers(backend, reps=20 if not ctx.quick else 2, small=ctx.quick,
                                          dtype=jnp.bfloat16, with_gdn=False)
            res[backend] = {"ms": r["attention"]["ms"], "tokens_per_s": r["attention"]["tokens_per_s"]}
        except Exception as err:  # noqa: BLE001
            res[backend] = {"ms": None, "error": f"{type(err).__name__}: {str(err)[:600]}"}
        log(f"layer {backend}: {res[backend]}")
        save("layer", res)
    if ctx.fits(20, "layer_outputs_compared"):
        from benchmarks.gpu.attn_run import _layer_inputs
        from jax_gdn.layers.attention import attention_layer
        adims, params, hidden, kv, meta, lens = _layer_inputs(ctx.quick)
        outs = {}
        for backend in (ctx.pallas, ctx.cudnn):
            def f(p, x, kv, tp, tpg, tof, pt, sl, cu, ids, b=backend):
                return attention_layer(p, adims, x, kv, token_pos=tp, token_page=tpg, token_offset=tof,
                                       page_table=pt, slot_lens=sl, cu_seqlens=cu, slot_ids=ids, backend=b)[0]
            outs[backend] = np.asarray(jax.jit(f)(params, hidden, kv, *meta).astype(jnp.float32))
        e = rel_rms(outs[ctx.cudnn], outs[ctx.pallas])
        res["outputs_rel_rms_cudnn_vs_pallas"] = e
        log("layer outputs cudnn vs pallas rel rms", e)
        save("layer", res)


@stage
def model(ctx):
    """The model with paged attention on cudnn vs pallas (same random weights): 4 layers (3 GDN + 1 attention) at
    the 80B attention / GDN dims, 8 experts, bf16; a chunked prefill of 3 streams (padding to buckets, a padding
    stream, the flat KV pool), a continuing chunk, a decode step; logits compared."""
    import dataclasses
    import jax
    import jax.numpy as jnp
    from jax_gdn import HybridModel
    from jax_gdn.bench_model import qwen3_next_80b_config, tiny_config
    if not ctx.fits(45, "model"):
        return
    cfg = tiny_config(4) if ctx.quick else dataclasses.replace(
        qwen3_next_80b_config(4), num_experts=8, vocab_size=1024)
    res = {}
    logits = {}
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 4000).astype(np.int32)
    for backend in (ctx.pallas, ctx.cudnn):
        t = time.time()
        m = HybridModel.random(cfg, 0, dtype=jnp.bfloat16, backend={"paged_attention": backend})
        cache = m.init_cache(max_seqs=4, max_tokens=8192, page_size=16, max_seq_len=4096)
        got = []
        lg, cache = m.prefill(cache, ids[:1001], np.array([0, 700, 701, 1001], np.int32), np.array([2, 0, 1]))
        got.append(np.asarray(lg, np.float32))
        lg, cache = m.prefill(cache, ids[1001:1694], np.array([0, 500, 564, 693], np.int32), np.array([2, 0, 1]))
        got.append(np.asarray(lg, np.float32))
        lg, cache = m.decode(cache, ids[1694:1697], np.array([2, 0, 1], np.int32))
        got.append(np.asarray(lg, np.float32))
        m.check(cache)
        logits[backend] = got
        res[f"{backend}_s"] = time.time() - t
        res[f"{backend}_backends"] = repr(m.backends)
    errs = [rel_rms(a, b) for a, b in zip(logits[ctx.cudnn], logits[ctx.pallas])]
    agree = [float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))) for a, b in zip(logits[ctx.cudnn],
                                                                                 logits[ctx.pallas])]
    res.update(rel_rms_per_step=errs, argmax_agree=agree,
               finite=all(bool(np.all(np.isfinite(x))) for x in logits[ctx.cudnn]),
               ok=max(errs) <= 5e-2 and all(bool(np.all(np.isfinite(x))) for x in logits[ctx.cudnn]))
    save("model", res)
    log("model cudnn vs pallas:", res)
    TABLE.append(f"model (4 layers, 80B attention dims) cudnn vs pallas logits rel rms {['%.1e' % e for e in errs]},"
                 f" argmax agree {agree}: {'PASS' if res['ok'] else 'FAIL'}")


@stage
def layer_grouped(ctx):
    """The attention layer at varlen16 timed in groups of back-to-back calls (jax_gdn.bench.time_jax, as the core)
    for pallas and cudnn: without the single-call dispatch that bench_layers' harness includes."""
    import jax
    from benchmarks.gpu.attn_run import _layer_inputs
    from jax_gdn.bench import time_jax
    from jax_gdn.layers.attention import attention_layer
    adims, params, hidden, kv, meta, lens = _layer_inputs(ctx.quick)
    res = RESULT.get("layer", {})
    for backend in (ctx.pallas, ctx.cudnn):
        if not ctx.fits(15, f"layer_grouped_{backend}"):
            continue
        def f(p, x, kv, tp, tpg, tof, pt, sl, cu, ids, b=backend):
            return attention_layer(p, adims, x, kv, token_pos=tp, token_page=tpg, token_offset=tof,
                                   page_table=pt, slot_lens=sl, cu_seqlens=cu, slot_ids=ids, backend=b)
        res[f"{backend}_grouped_ms"] = time_jax(jax.jit(f), (params, hidden, kv) + tuple(meta), **ctx.reps)
        log(f"layer grouped {backend}: {res[f'{backend}_grouped_ms']:.3f} ms")
        save("layer", res)


def table():
    core = RESULT.get("core", {})
    lay = RESULT.get("layer", {})
    lines = ["", "=" * 100, "attn_cudnn: paged attention prefill, Pallas Triton vs cuDNN packed (median ms, TFLOP/s)"]
    lines += TABLE + [_numerics_line()]
    cols = ("pallas", "cudnn", "cudnn_fresh", "cudnn_gather")
    lines.append(f"{'core case':>16} | " + " ".join(f"{c:>14}" for c in cols))
    for name, r in core.items():
        cells = []
        for c in cols:
            ms = r["ms"].get(c)
            tf = r.get("tflops", {}).get(c)
            cells.append(f"{'-':>14}" if ms is None else (f"{ms:7.3f} ({tf:4.0f})" if tf else f"{ms:13.3f} "))
        lines.append(f"{name:>16} | " + " ".join(cells))
    for b, r in lay.items():
        if isinstance(r, dict):
            lines.append(f"layer varlen16 {b:>16}: {r.get('ms') if r.get('ms') is None else round(r['ms'], 3)} ms "
                         f"{r.get('error', '')}")
        else:
            lines.append(f"layer {b}: {r}")
    if RESULT.get("skipped"):
        lines.append(f"skipped: {RESULT['skipped']}")
    lines.append(f"total {time.time() - T0:.0f} s")
    for line in lines:
        log(line)


def main():
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--stages", default="probe,numerics,core,layer,numerics_80b",
                    help="comma list of probe, numerics, core, layer, numerics_80b, model, layer_grouped (run 2: "
                         "probe,model,layer_grouped,core)")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    _LOG = open(os.path.join(OUT, "attn_cudnn.log"), "w")
    if a.quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ctx = Ctx(a.quick, a.budget)
    stages = {"probe": probe, "numerics": numerics, "core": core, "layer": layer, "numerics_80b": numerics_80b,
              "model": model, "layer_grouped": layer_grouped}
    for name in a.stages.split(","):
        stages[name](ctx)
    table()


if __name__ == "__main__":
    main()
