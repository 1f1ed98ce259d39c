"""Where jax-linear-attention's GDN forward spends its time, beside ours, stage by stage (issue 14, JLA_STUDY.md).

    python benchmarks/gpu/jla_probe.py [--quick] [--budget S]      (writes $OUT/jla_probe.{json,log}; OUT=/tmp/out)

Per case (B1-T8192-Hk16-Hv32, B4-T4096-Hk16-Hv32, then B1-T8192-Hk2-Hv8 if the budget allows; the inputs of
jax_gdn.bench: bf16 q, k, v, beta, fp32 g and initial state, final state out), every row timed with
jax_gdn.bench.time_jax (median of groups of back-to-back jitted calls, the bench's method) in one process:
  ours.op        jax_gdn.ops.chunk_gated_delta_rule(backend="pallas") (what the bench's "pallas" column times)
  ours.1a        pallas_triton.kkt_solve     (T = (I + A)^-1 with the gates, G)
  ours.1b        pallas_triton.wu_aqk        (w, u, Aqk to HBM)
  ours.2         pallas_triton.state_pass    (state pass + output, final states to a fresh array)
  jla.op         jla.ops.mosaic_gpu.gated_delta_rule.gated_delta_rule (what the bench's "jla" column times)
  jla.glue       the XLA prologue of scalar_gate._forward: time padding, chunk-local log2 gate cumsum, beta to
                 head-major [B, H, T], initial state transposed to [.., V, K]
  jla.kkt        gated_delta_rule_kernels.kkt_fwd   (gate-free T0 = (I + beta K K^T)^-1, one Mosaic GPU kernel)
  jla.split      scalar_gate._piece_starts (only where jla splits the sequence, cp > 1: the map pass + scan)
  jla.fused      scalar_gate_fused.fused_fwd_wy     (warp-specialised state pass + WY + output, one kernel)
  jla.op_cpN     scalar_gate.run(..., cp=N): jla with its sequence split forced to N pieces (N = 2, 4 where its
                 policy picks 1): does splitting the serial pass pay on our dense rows?
  mgpu.fwd       pallas_kernels.gated_delta_rule.mosaic_gpu (the session-5 form of our port: stage1a="triton"):
                 stage 1a (Triton) + the warp-specialised fused pass, checked against fp32 XLA and timed; mgpu.fused the
                 Mosaic kernel alone. Run after every other row of its case (a hang or a CUDA error in a new
                 kernel cannot cost the rows above; the first case's right after that case, the others' at the
                 end), then once on an odd length (B2-T130-Hk1-Hv3-K64-V64).
Numerics (first case only, and whatever the budget leaves): o and final state of ours and of jla against the XLA
backend in fp32 on the same bf16-rounded inputs (matmul precision "highest"), relative RMS.

--quick: CPU, a tiny case, our stages in interpret mode and jla's XLA glue only (its Mosaic GPU kernels need a
Hopper GPU, and jla's code targets jax 0.11's Pallas Mosaic GPU API): checks imports and argument plumbing.
Every measurement is wrapped in try/except; a failure prints its reason and the script goes on. A deadline
(--budget, default 60 s from start) skips what would not fit. A table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

T_START = time.time()
LOG_LINES: list[str] = []


def log(*parts):
    line = " ".join(str(p) for p in parts)
    LOG_LINES.append(line)
    print(line, flush=True)


def rel(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(float(np.sqrt(np.mean(b ** 2))), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at tiny sizes (interpret mode)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds from start; later steps are skipped")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: the probe's list)")
    opts = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    budget = opts.budget
    quick = opts.quick

    def left():
        return budget - (time.time() - T_START)

    import jax
    import jax.numpy as jnp
    from jax_gdn import ops
    from jax_gdn.bench import make_inputs_np, time_jax
    from jax_gdn.cases import CASES, Case
    from pallas_kernels.gated_delta_rule import pallas_triton as kt
    from pallas_kernels.gated_delta_rule.chunk_map import kernel_chunk_map

    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "quick": quick,
              "budget_s": budget, "cases": {}, "errors": []}
    try:
        import jla
        result["jla"] = getattr(jla, "__version__", "?")
        from jla.ops.mosaic_gpu import gated_delta_rule_kernels as jgdr
        from jla.ops.mosaic_gpu import scalar_gate as jsg
        from jla.ops.mosaic_gpu import scalar_gate_fused as jsf
        from jla.ops.mosaic_gpu._common import CHUNK as JCHUNK, chunk_log2_decay, head_major, pad_time
    except Exception as e:  # noqa: BLE001 - report and go on without the jla rows
        log(f"jla import FAIL {type(e).__name__}: {e}")
        result["errors"].append(f"jla import: {e}")
        jla = None
    try:
        from pallas_kernels.gated_delta_rule import mosaic_gpu as our_mgpu
    except Exception as e:  # noqa: BLE001 - the port is optional
        log(f"(no pallas_kernels.gated_delta_rule.mosaic_gpu: {type(e).__name__}: {str(e)[:200]})")
        our_mgpu = None
    log(f"device {result['device']}  jax {jax.__version__}  jla {result.get('jla')}  quick={quick}")

    if quick:
        plan = [Case("cpu-B1-T130-Hk1-Hv2-K64-V64", 1, 130, 1, 2, 64, 64)]   # jla takes K, V in {64, 128}
        timer = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)  # noqa: E731
    else:
        names = (opts.cases.split(",") if opts.cases else
                 ["B1-T8192-Hk16-Hv32", "B4-T4096-Hk16-Hv32", "B1-T8192-Hk2-Hv8"])
        plan = [CASES[n] for n in names]
        timer = time_jax                                       # the bench's defaults: 3 warm-up, 15 groups of 10
    hopper = jla is not None and not quick and jsg.is_hopper()

    core = 2 if not quick else 1          # the first two cases' core rows come before any case's optional rows
    kept = {}                             # case name -> (case, args, reference): our port's rows run last
    mgpu_done = set()

    def mgpu_rows(name):
        """Our Mosaic GPU port's rows on one case, after every other row of that case and with the JSON written
        first: a hang or a poisoned CUDA context in the new kernel cannot cost the rows already measured."""
        mgpu_done.add(name)
        if our_mgpu is None or not hasattr(our_mgpu, "probe_rows") or left() < 8:
            return
        _write(out_dir, result)
        case, args, reference = kept[name]
        log(f"== {name}: our Mosaic GPU port ({left():.0f} s left)")
        try:
            mrow = result["cases"][name]["mgpu"] = our_mgpu.probe_rows(case, args, timer, interpret=quick, log=log,
                                                                        reference=reference)
            for key, val in mrow.get("ms", {}).items():
                result["cases"][name]["ms"][f"mgpu.{key}"] = val
        except Exception as e:  # noqa: BLE001
            log(f"  mgpu FAIL {type(e).__name__}: {str(e)[:400]}")
            result["errors"].append(f"{name} mgpu: {e}")
        _write(out_dir, result)

    for ci, case in enumerate(plan):
        # seconds kept for the core rows of the cases still to come, and for our port's rows run last
        reserve = 22.0 * max(core - ci - 1, 0) + (15.0 if our_mgpu is not None and not quick else 0.0)
        # (case 0's port rows run at the end of case 0, the other cases' at the very end: 15 s kept for them)

        def extra_ok(need=10.0):
            """Whether an optional row (variants) fits before the deadline, keeping the reserve."""
            return left() - reserve > need

        if left() < 12:
            log(f"== {case.name}: skipped ({left():.0f} s left)")
            break
        rows = result["cases"][case.name] = {"ms": {}, "numerics": {}, "info": {}}
        ms, num, info = rows["ms"], rows["numerics"], rows["info"]
        log(f"== {case.name}  ({left():.0f} s left)")

        def timed(key, fn, args, min_left=4.0):
            """Time fn(*args) into ms[key]; returns one output (None on failure or when out of time)."""
            if left() < min_left:
                log(f"  {key:14s} skipped (deadline)")
                return None
            try:
                out = fn(*args)
                jax.block_until_ready(out)
                t = timer(fn, args)
                ms[key] = round(t, 4)
                log(f"  {key:14s} {t:8.4f} ms")
                return out
            except Exception as e:  # noqa: BLE001 - report and go on with the next row
                ms[key] = None
                msg = f"{type(e).__name__}: {str(e)[:400]}"
                log(f"  {key:14s} FAIL {msg}")
                result["errors"].append(f"{case.name} {key}: {msg}")
                if os.environ.get("JLA_PROBE_TRACEBACK"):
                    traceback.print_exc()
                return None

        host = make_inputs_np(case, 0)
        q, k, v, g, beta, h0 = host
        bf = jnp.bfloat16
        args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
                jnp.asarray(beta, bf), jnp.asarray(h0))
        qd, kd, vd, gd, bd, h0d = args
        scale = case.K ** -0.5

        ref_cache = []

        def reference():
            """(o, final state) of the XLA backend in fp32 on the same bf16-rounded inputs, computed once."""
            if not ref_cache:
                f32 = [x.astype(jnp.float32) for x in args]
                with jax.default_matmul_precision("highest"):
                    ref_cache.append(jax.block_until_ready(jax.jit(lambda q, k, v, g, b, h: ops.chunk_gated_delta_rule(
                        q, k, v, g, b, initial_state=h, output_final_state=True, backend="xla"))(*f32)))
            return ref_cache[0]

        # ---------------- jla: the op, its glue and each kernel ----------------
        jla_out = prep = None
        if jla is not None:
            try:
                reason = jsg.unsupported_reason(qd, kd, vd, (gd, bd), dict(initial_state=h0d,
                                                                          output_final_state=True), delta=True)
                info["jla_unsupported_reason"] = reason
                cp = jsg.pieces(case.B, case.Hv, case.V, case.T, delta=True)
                pad_n = (-case.T) % (JCHUNK * cp)
                info["jla_cp"] = cp
                info["jla_kkt_chunks_per_cta"] = (jgdr.kkt_chunks_per_cta(case.B, case.Hv, (case.T + pad_n) // 64)
                                                  if hopper else None)
                log(f"  jla: cp={cp} (sequence pieces), pad={pad_n}, unsupported_reason={reason!r}")

                # Only what the op's prologue computes: with T % 64 == 0 pad_time is the identity, and returning
                # q, k, v from a jit would time three copies the op never makes (H200 run 1: 0.11 ms that way).
                @jax.jit
                def glue(q, k, v, g, beta, h0):
                    padded = tuple(pad_time(x, pad_n) for x in (q, k, v)) if pad_n else ()
                    g2 = chunk_log2_decay(g, case.B, case.T, case.Hv, pad_n)
                    return padded + (g2, head_major(beta, pad_n), jnp.swapaxes(h0.astype(jnp.float32), -1, -2))
                prep = timed("jla.glue", glue, args)
                if prep is not None and not pad_n:
                    prep = (qd, kd, vd) + tuple(prep)
                if hopper:
                    from jla.ops.mosaic_gpu.gated_delta_rule import gated_delta_rule as jla_gdr

                    @jax.jit
                    def jla_op(q, k, v, g, beta, h0):
                        return jla_gdr(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                    jla_out = timed("jla.op", jla_op, args)
                    if prep is not None:
                        qp, kp, vp, g2, bt, h0t = prep
                        t0 = timed("jla.kkt", jax.jit(lambda k_, b_: jgdr.kkt_fwd(k_, b_)), (kp, bt))
                        starts = h0t
                        if t0 is not None and cp > 1:
                            cfg = jsg._Config(delta=True, gated=True, scale=float(scale), out_final=True,
                                              seq_len=case.T, pad=pad_n, cp=cp,
                                              dtypes=(qd.dtype, vd.dtype, gd.dtype, bd.dtype, h0d.dtype))
                            sp = timed("jla.split", jax.jit(lambda kp_, vp_, g2_, h_, t_, b_: jsg._piece_starts(
                                kp_, None, vp_, g2_, h_, None, cfg, t0=t_, beta=b_)[0]),
                                (kp, vp, g2, h0t, t0, bt))
                            starts = sp
                        if t0 is not None and starts is not None:
                            timed("jla.fused", jax.jit(lambda q_, k_, v_, t_, g_, b_, h_: jsf.fused_fwd_wy(
                                q_, k_, v_, t_, g_, b_, h_, scale=scale, out_final=True, out_dtype=bf, cp=cp)),
                                (qp, kp, vp, t0, g2, bt, starts))
                else:
                    log("  jla kernels: skipped (need a Hopper GPU; --quick checks the glue only)")
            except Exception as e:  # noqa: BLE001
                log(f"  jla FAIL {type(e).__name__}: {str(e)[:400]}")
                result["errors"].append(f"{case.name} jla: {e}")

        # ---------------- ours: the op, then each stage ----------------
        backend = "pallas_interpret" if quick else "pallas"

        @jax.jit
        def ours_op(q, k, v, g, beta, h0):
            return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              backend=backend)
        ours_out = timed("ours.op", ours_op, args)

        # ---------------- ours, stage by stage ----------------
        tt = case.B * case.T
        try:
            start, length, first, nchunks = kernel_chunk_map(case.B, case.T, None, 64)
            qf, kf = qd.reshape(tt, case.Hk, case.K), kd.reshape(tt, case.Hk, case.K)
            vf, gf, bff = vd.reshape(tt, case.Hv, case.V), gd.reshape(tt, case.Hv), bd.reshape(tt, case.Hv)
            if quick:     # interpret mode clamps the dynamic slices: pad C rows as pallas_triton._run does
                pad = lambda x: jnp.pad(x, [(0, 64)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
                qf, kf, vf, gf, bff = (pad(x) for x in (qf, kf, vf, gf, bff))
            n = case.num_seqs
            base = kt.launch_config(case.V, n * case.Hv, bf)
            info["ours_config"] = str(base)
            mp = dict(chunk_start=start, chunk_len=length, chunk=64, interpret=quick)
            tg = timed("ours.1a", jax.jit(lambda k_, g_, b_: kt.kkt_solve(
                k_, g_, b_, num_v_heads=case.Hv, config=base, **mp)), (kf, gf, bff))
            inter = None if tg is None else timed("ours.1b", jax.jit(lambda *a: kt.wu_aqk(
                *a, scale=scale, config=base, **mp)), (qf, kf, vf, bff) + tuple(tg))
            if inter is not None:
                w, u, aqk = inter
                slots = jnp.arange(n, dtype=jnp.int32)
                has = jnp.ones((n,), jnp.int32)
                timed("ours.2", jax.jit(lambda q_, k_, w_, u_, a_, g_, p_: kt.state_pass(
                    q_, k_, w_, u_, a_, g_, pool=p_, scale=scale, slot_ids=slots, has_initial_state=has,
                    seq_first_chunk=first, seq_num_chunks=nchunks, config=base, final="seq", **mp)),
                    (qf, kf, w, u, aqk, tg[1], h0d))
        except Exception as e:  # noqa: BLE001
            log(f"  ours stages FAIL {type(e).__name__}: {str(e)[:400]}")
            result["errors"].append(f"{case.name} ours stages: {e}")

        # ---------------- numerics against the fp32 XLA backend ----------------
        if (ci == 0 or extra_ok(15)) and left() > 10 and (ours_out is not None or jla_out is not None):
            try:
                ref = reference()
                for name, got in (("ours", ours_out), ("jla", jla_out)):
                    if got is not None:
                        num[name] = {"o": rel(got[0].astype(jnp.float32), ref[0]), "state": rel(got[1], ref[1])}
                        log(f"  numerics {name}: o {num[name]['o']:.2e}  state {num[name]['state']:.2e} "
                            "(rel RMS vs fp32 XLA)")
                if ours_out is not None and jla_out is not None:
                    num["ours_vs_jla_o"] = rel(ours_out[0].astype(jnp.float32), jla_out[0].astype(jnp.float32))
            except Exception as e:  # noqa: BLE001
                log(f"  numerics FAIL {type(e).__name__}: {str(e)[:300]}")

        # ---------------- optional rows (when the deadline leaves room): jla's launch variants ----------------
        if jla is not None and hopper:
            try:
                cp = info.get("jla_cp", 1)
                if prep is not None:                      # kkt_fwd with other chunks-per-CTA counts
                    kp_, bt_ = prep[1], prep[4]
                    for cpc in (1, 2, 8):
                        if info.get("jla_kkt_chunks_per_cta") != cpc and extra_ok():
                            timed(f"jla.kkt_cpc{cpc}", jax.jit(
                                lambda k_, b_, c=cpc: jgdr.kkt_fwd(k_, b_, chunks_per_cta=c)), (kp_, bt_))
                for cpf in (2, 4):                        # the sequence split forced on (its policy: cp = 1 above
                    if cpf != cp and extra_ok():          # 32 CTAs): would splitting pay on our dense rows?
                        timed(f"jla.op_cp{cpf}", jax.jit(lambda q_, k_, v_, g_, b_, h_, c=cpf: jsg.run(
                            q_, k_, v_, g_, b_, delta=True, scale=None, initial_state=h_,
                            output_final_state=True, cp=c)), args)
            except Exception as e:  # noqa: BLE001
                log(f"  jla variants FAIL {type(e).__name__}: {str(e)[:400]}")

        kept[case.name] = (case, args, reference)
        if ci == 0:              # the first case's port rows now (the JSON holds everything above first)
            mgpu_rows(case.name)
        # per-stage sums (what the op costs beyond its kernels: glue, launches)
        g_ = lambda key: ms.get(key) or 0.0  # noqa: E731
        if ms.get("ours.1a") and ms.get("ours.1b") and ms.get("ours.2"):
            rows["sums"] = {"ours_stages": round(g_("ours.1a") + g_("ours.1b") + g_("ours.2"), 4)}
        if ms.get("jla.kkt") and ms.get("jla.fused"):
            rows.setdefault("sums", {})["jla_stages"] = round(
                g_("jla.glue") + g_("jla.kkt") + g_("jla.split") + g_("jla.fused"), 4)
        _write(out_dir, result)

    # ---------------- our Mosaic GPU port on the other cases, last ----------------
    for name in kept:
        if name not in mgpu_done:
            mgpu_rows(name)

    # ---------------- our port on an odd length with grouped heads (zero-token padding inside), if time ----------
    dev = jax.devices()[0]
    if (our_mgpu is not None and not quick and getattr(dev, "compute_capability", None) == "9.0"
            and left() > 8):
        odd = Case("B2-T130-Hk1-Hv3-K64-V64", 2, 130, 1, 3, 64, 64)
        try:
            q, k, v, g, beta, h0 = make_inputs_np(odd, 1)
            bf = jnp.bfloat16
            a = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf),
                 jnp.asarray(h0))
            o, st = jax.block_until_ready(our_mgpu.chunk_gated_delta_rule_fwd(*a))
            with jax.default_matmul_precision("highest"):
                ro, rs = ops.chunk_gated_delta_rule(*[x.astype(jnp.float32) for x in a[:5]], initial_state=a[5],
                                                    output_final_state=True, backend="xla")
            result["mgpu_odd"] = {"case": odd.name, "o": rel(o.astype(jnp.float32), ro), "state": rel(st, rs)}
            log(f"mgpu {odd.name}: o {result['mgpu_odd']['o']:.2e} state {result['mgpu_odd']['state']:.2e} "
                "(rel RMS vs fp32 XLA; bf16 bound 1e-2)")
        except Exception as e:  # noqa: BLE001
            log(f"mgpu {odd.name} FAIL {type(e).__name__}: {str(e)[:400]}")
            result["errors"].append(f"mgpu odd: {e}")

    # ---------------- the table ----------------
    keys = []
    for r in result["cases"].values():
        keys += [k for k in r["ms"] if k not in keys]
    names = list(result["cases"])
    log("\n==== jla_probe: median ms per call (time_jax) ====")
    log(f"{'row':16s}" + "".join(f"{n[:22]:>24s}" for n in names))
    for key in keys:
        cells = []
        for n in names:
            val = result["cases"][n]["ms"].get(key)
            cells.append(f"{'-' if val is None else f'{val:.4f}':>24s}")
        log(f"{key:16s}" + "".join(cells))
    # The compact summary comes last (a device run may return only the last ~12 lines): two lines a case.
    log("==== jla_probe summary: ms (time_jax medians); numerics rel RMS vs fp32 XLA ====")

    def cells(r, keys):
        return "/".join("-" if r["ms"].get(k) is None else f"{r['ms'][k]:.3f}" for k in keys)
    for n in names:
        r = result["cases"][n]
        log(f"{n}: ours op/1a/1b/2 {cells(r, ['ours.op', 'ours.1a', 'ours.1b', 'ours.2'])} | jla op/glue/kkt/"
            f"split/fused {cells(r, ['jla.op', 'jla.glue', 'jla.kkt', 'jla.split', 'jla.fused'])} | mgpu fwd/fused "
            f"{cells(r, ['mgpu.fwd', 'mgpu.fused'])} | cp2/cp4 {cells(r, ['jla.op_cp2', 'jla.op_cp4'])}")
        nums = dict(r["numerics"])
        if r.get("mgpu", {}).get("numerics"):
            nums["mgpu"] = r["mgpu"]["numerics"]
        log(f"{n}: numerics " + "; ".join(
            f"{k} " + ("/".join(f"{x:.1e}" for x in v.values() if isinstance(x, float)) if isinstance(v, dict)
                       else f"{v:.1e}") for k, v in nums.items()))
    if "mgpu_odd" in result:
        log(f"mgpu odd {result['mgpu_odd']}")
    log(f"errors: {len(result['errors'])} {result['errors'][:2]}; total {time.time() - T_START:.0f} s")
    _write(out_dir, result)


def _write(out_dir, result):
    with open(os.path.join(out_dir, "jla_probe.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, "jla_probe.log"), "w") as f:
        f.write("\n".join(LOG_LINES) + "\n")


if __name__ == "__main__":
    main()
