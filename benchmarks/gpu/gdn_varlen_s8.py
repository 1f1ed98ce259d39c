"""GDN prefill of packed sequences on the Mosaic GPU backend, session 8 (issue 14: serve256 under 1.94 ms;
pallas_kernels/gated_delta_rule/mosaic_gpu_varlen.py, varlen_copy_triton.py, NOTES.md "Session 8: Mosaic varlen").

    python benchmarks/gpu/gdn_varlen_s8.py [--quick] [--budget S] [--test-timeout S] [--no-tests] [--no-fla]
    (writes $OUT/gdn_varlen_s8.{json,log} and $OUT/gdn_varlen_s8_tests.log; OUT=/tmp/out)

1. The GPU tests of the new code in a child process (timeout, -v, unbuffered; each verdict printed as it comes):
   the Triton copy kernels bitwise against the XLA gathers, the kernel path with copies="triton" + kkt_used
   against float64 (K = V = 128 and 64), the session-7 default beside it, the persistent walk (xfail, non-strict),
   the slots API beside XLA.
2. Per case (serve256, varlen16, tiny64 of jax_gdn.cases; bf16 q, k, v, beta, fp32 g and initial states, final
   states out), every JAX column timed by jax_gdn.bench.time_jax, in this one process, in rotated rounds (round 1:
   A B C, round 2: C A B ... ; the median over rounds is reported, every round's figure kept in the JSON):
     pallas      ops.chunk_gated_delta_rule(backend="pallas")  (Triton; tiny64: recurrent_varlen)
     m.old       the Mosaic varlen path, session 7's form (XLA gathers, kkt over every slot)
     m.new       VarlenConfig(copies="triton", kkt_used=True) (the default after call 2)
     m.copies    VarlenConfig(copies="triton") alone, serve256 only
     m.new.L-1   m.new with the persistent walk (lanes=-1; never ran on a GPU before), serve256 only, after the
                 other cases
     auto        ops.chunk_gated_delta_rule(backend="auto") with mosaic_gpu.AUTO_VARLEN on and m.new as the
                 varlen default (what turning the switch on would run; tiny64 must stay on recurrent_varlen)
     fla         FLA's chunk_gated_delta_rule timed as jax_gdn.bench._time_fla does, right after the case's JAX
                 rounds (its first call autotunes, ~40 s: made on serve256 while the child's tests run; --no-fla
                 skips it)
   numerics of m.old / m.new / pallas against the XLA backend in fp32 (matmul precision "highest") on the same
   bf16-rounded inputs (serve256, varlen16: relative RMS of o and the final states, o finite, padding rows zero,
   m.new bitwise equal to m.old: the copies move the same bits and kkt_used changes no used chunk);
   serve256's stages, each its own jitted call timed the same way, A/B rotated: maps (layout), repack xla /
   triton (512-byte tile rows, 4 warps; triton_1k: 1 KB rows, 8 warps), kkt (+ the gate cumsum) over all / used
   slots, fused (repacked inputs, kv states), unpack xla / triton.
A deadline (--budget, default 150 s from start) skips what would not fit; every measurement is wrapped in
try/except. A table is printed last.
--quick: CPU, one tiny case, Triton copies and kkt_solve in interpret mode, the jnp twins (impl="reference"), no
FLA: checks the script end to end.
"""
from __future__ import annotations

import statistics
import time

import script_kit as kit

T_START = time.time()
log = kit.Log()
rel = kit.relative_rms
NAME = "gdn_varlen_s8"

_V = "tests/pallas_kernels/test_gdn_mosaic_varlen.py::"
TEST_IDS = [_V + "test_gpu_triton_copies_match_xla_gather_bitwise",
            _V + "test_gpu_kernel_xla_copies_matches_f64",
            _V + "test_gpu_kernel_matches_f64[dims0-mosaic-repacked-kv-0]",
            _V + "test_gpu_slots_api_beside_xla",
            _V + "test_gpu_kernel_matches_f64[dims0-mosaic-repacked-vk-3]"]
CASES = ["serve256-T38567-Hk16-Hv32", "varlen16-T19027-Hk16-Hv32", "tiny64-T171-Hk16-Hv32"]
ROUNDS = 3


def main():
    ap = kit.arg_parser(__doc__, budget=150.0, test_timeout=30.0,
                        quick_help="CPU smoke run at tiny sizes (interpret mode / jnp twins)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--plan", choices=("a", "b"), default="a",
                    help="a: call 2's plan; b: what call 2 could not fit (varlen16, tiny64, then serve256's "
                         "persistent walk, maps and unpack)")
    opts, out_dir, left = kit.parse(ap, T_START, cpu_quick=True)
    plan_b = opts.plan == "b"
    quick = opts.quick
    result = {"quick": quick, "budget_s": opts.budget, "rows": [], "errors": [], "skipped": []}
    child = None
    if not opts.no_tests:
        args = ["-v", "-p", "no:randomly", "-p", "no:cacheprovider", "-rfE"] + TEST_IDS
        log(f"== GPU tests (timeout {opts.test_timeout:.0f} s): pytest {' '.join(args)}")
        import os
        child = kit.ChildTests.start(args, quick=quick, log_path=os.path.join(out_dir, f"{NAME}_tests.log"))
    fla_warm = False
    if not quick and not opts.no_fla:     # FLA's autotuning first call (~40 s) while the child's tests compile
        fla_warm = _warm_fla(result)
    if child is not None:
        child.wait(max(opts.test_timeout - child_elapsed(child), 1.0))
        child.record(result, log, max_failures=40)
        _write(out_dir, result)

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import ops
    from jax_gdn.bench import time_jax
    from jax_gdn.cases import BENCH_CASES, Case
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    from pallas_kernels.gated_delta_rule import mosaic_gpu_varlen as mv

    old_cfg = mv.VarlenConfig(copies="xla", kkt_used=False)        # session 7's form
    new_cfg = mv.VarlenConfig(copies="triton", kkt_used=True)       # the default since call 2
    configs = {"m.old": old_cfg, "m.new": new_cfg, "m.new.L-1": dataclasses.replace(new_cfg, lanes=-1)}
    result.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  configs={k: dataclasses.asdict(c) for k, c in configs.items()},
                  default_config=dataclasses.asdict(mv.DEFAULT_CONFIG), auto_varlen=mg.AUTO_VARLEN)
    if quick:
        lens = (1, 63, 0, 64, 65, 130)
        cases = [Case("quick-varlen-T330-Hk1-Hv2-K16-V16", 1, sum(lens) + 7, 1, 2, 16, 16, lens)]
        timer = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)  # noqa: E731
        impl, triton_backend, rounds = "reference", "pallas_interpret", 2
    else:
        by_name = {c.name: c for c in BENCH_CASES}
        cases = [by_name[n] for n in (CASES[1:] + CASES[:1] if plan_b else CASES) if n in by_name]
        timer, impl, triton_backend, rounds = time_jax, "mosaic", "pallas", ROUNDS
    log(f"device {result['device']} jax {jax.__version__}; cases {[c.name for c in cases]}; {left():.0f} s left")

    def cell(row, key, fn, args, min_left=4.0):
        """One timing of ``fn`` into row["rounds"][key]; row["ms"][key] = the median of its rounds so far."""
        if left() < min_left:
            row.setdefault("skipped", []).append(key)
            return None
        try:
            res = jax.block_until_ready(fn(*args))
            ms = timer(fn, args)
            row["rounds"].setdefault(key, []).append(round(ms, 4))
            row["ms"][key] = round(statistics.median(row["rounds"][key]), 4)
            log(f"  {row['case'][:22]:22s} {key:16s} {ms:8.4f} ms   ({left():.0f} s left)")
            return res
        except Exception as e:  # noqa: BLE001 - report and go on
            row["ms"].setdefault(key, None)
            msg = f"{row['case']} {key}: {type(e).__name__}: {str(e)[:600]}"
            result["errors"].append(msg)
            log("  FAIL " + msg)
            return None

    def rotated(row, entries, n_rounds, min_left=4.0):
        """entries [(key, fn, args)] timed in ``n_rounds`` rounds, each round's order rotated by one; returns
        {key: first result}; an entry that failed once is not retried."""
        firsts, failed = {}, set()
        for r in range(n_rounds):
            order = entries[r % len(entries):] + entries[:r % len(entries)]
            for key, fn, args in order:
                if key in failed:
                    continue
                res = cell(row, key, fn, args, min_left)
                if res is None and row["ms"].get(key) is None:
                    failed.add(key)
                firsts.setdefault(key, res)
        return firsts

    def varlen_fn(cfg, cu):
        def fn(q, k, v, g, beta, h0):
            return mv.chunk_gated_delta_rule_varlen_fwd(
                q, k, v, g, beta, cu, h0, output_final_state=True, impl=impl, stage1a=cfg.stage1a, order=cfg.order,
                inputs=cfg.inputs, states=cfg.states, lanes=cfg.lanes, copies=cfg.copies, kkt_used=cfg.kkt_used)
        return jax.jit(fn)

    def op_fn(backend, cu):
        def fn(q, k, v, g, beta, h0):
            return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu, backend=backend)
        return jax.jit(fn)

    def numerics(row, outs, args, cu):
        if left() < 15:
            result["skipped"].append(f"{row['case']} numerics")
            log("  numerics skipped (budget)")
            return
        try:
            f32 = [x.astype(jnp.float32) for x in args]
            with jax.default_matmul_precision("highest"):
                ref = jax.block_until_ready(op_fn("xla", cu)(*f32))
            t_end = int(cu[-1])
            for name, res in outs.items():
                if res is None:
                    continue
                o = np.asarray(res[0].astype(jnp.float32))
                n = {"o": rel(o, ref[0]), "state": rel(res[1], ref[1]), "o_finite": bool(np.isfinite(o).all()),
                     "pad_zero": bool(np.all(o[0, t_end:] == 0))}
                if name != "m.old" and name.startswith("m.") and outs.get("m.old") is not None:
                    n["bitwise_old"] = bool(np.array_equal(np.asarray(res[0]).view(np.uint16),
                                                           np.asarray(outs["m.old"][0]).view(np.uint16))
                                            and np.array_equal(np.asarray(res[1]), np.asarray(outs["m.old"][1])))
                row["numerics"][name] = n
                log(f"  numerics {name:10s}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']} "
                    f"pad0 {n['pad_zero']} bitwise_old {n.get('bitwise_old', '-')} (rel RMS vs fp32 XLA; bf16 1e-2)")
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"{row['case']} numerics: {type(e).__name__}: {str(e)[:300]}")
            log(f"  numerics FAIL {type(e).__name__}: {str(e)[:300]}")

    def stages(row, args, cu):
        q, k, v, g, beta, h0 = args
        t, n = q.shape[1], cu.shape[0] - 1
        f32 = jnp.float32
        kern = impl == "mosaic"
        lay = jax.jit(lambda cu: mv.layout(cu, t))
        if plan_b:       # the maps the default path uses (the index arrays of the XLA copies are dead code there)
            def maps_used(cu):
                cm, src, _, _, _, walk = mv.layout(cu, t)
                return mv.chunk_rows(cm, src.shape[0] // mv.C), mv.used_chunks(cm), walk
            cell(row, "st.maps_used", jax.jit(maps_used), (cu,))
        else:
            cell(row, "st.maps", lay, (cu,))
        cm, src, keep, back, valid, walk = lay(cu)
        chunks = mv.chunk_rows(cm, src.shape[0] // mv.C)
        used = mv.used_chunks(cm)
        row["chunks"] = {"slots": int(src.shape[0] // mv.C), "used": int(used[0])}

        def repack_fn(copies):
            return jax.jit(lambda q, k, v, g, beta, src, keep, cs, cl: mv.repack_all(
                (q, k, v, g.astype(f32), beta.astype(f32)), src, keep, copies=copies, chunks=(cs, cl),
                interpret=not kern))
        rargs = (q, k, v, g, beta, src, keep) + tuple(chunks)
        from pallas_kernels.gated_delta_rule import varlen_copy_triton as vc

        def repack_wide(q, k, v, g, beta, cs, cl):     # 1 KB tile rows, 8 warps (a tile-size probe)
            t_ = q.shape[1]
            xs = (q, k, v, g.astype(f32), beta.astype(f32))
            return vc.repack_rows(tuple(x[0].reshape(t_, -1) for x in xs), cs, cl, interpret=not kern,
                                  tile_bytes=1024, num_warps=8)
        if plan_b:       # measured in call 2: computed once here, not timed
            firsts = {"st.repack_triton": repack_fn("triton")(*rargs)}
        else:
            firsts = rotated(row, [("st.repack_xla", repack_fn("xla"), rargs),
                                   ("st.repack_triton", repack_fn("triton"), rargs),
                                   ("st.repack_triton_1k", jax.jit(repack_wide),
                                    (q, k, v, g, beta) + tuple(chunks))], rounds)
        packed = firsts.get("st.repack_triton") or firsts.get("st.repack_xla")
        if packed is None:
            return
        q_r, k_r, v_r, g_r, b_r = packed

        def kkt_fn(use):
            return jax.jit(lambda k_r, g_r, b_r, used: mv.stage1a_operands(
                k_r, g_r, b_r, kernel=kern, stage1a="mosaic", vdim=v.shape[3], num_chunks=used if use else None))
        if plan_b:
            firsts = {"st.kkt_used": kkt_fn(True)(k_r, g_r, b_r, used)}
        else:
            firsts = rotated(row, [("st.kkt_all", kkt_fn(False), (k_r, g_r, b_r, used)),
                                   ("st.kkt_used", kkt_fn(True), (k_r, g_r, b_r, used))], rounds)
        ops1a = firsts.get("st.kkt_used") or firsts.get("st.kkt_all")
        if ops1a is None:
            return
        tmat, gcum, beta_hm, _ = ops1a
        scale = q.shape[3] ** -0.5

        def fused(q_r, k_r, v_r, tmat, gcum, beta_hm, h0, walk):
            kw = dict(num_states=n, scale=scale, out_final=True, head_major=True, state_kv=True)
            if kern:
                return mg.fused_state_pass(q_r, k_r, v_r, tmat, gcum, beta_hm, h0, walk=walk, **kw)
            return mv.fused_state_pass_walk_reference(q_r, k_r, v_r, tmat, gcum, beta_hm, h0, walk, **kw)
        res = cell(row, "st.fused", jax.jit(fused), (q_r, k_r, v_r, tmat, gcum, beta_hm, h0, walk))
        if res is None:
            return

        def unpack_fn(copies):
            return jax.jit(lambda o_r, back, valid, cs, cl, end: mv.unpack(
                o_r, back, valid, copies=copies, chunks=(cs, cl), end=end, total_len=t, interpret=not kern))
        uargs = (res[0], back, valid) + tuple(chunks) + (cu[-1:],)
        rotated(row, [("st.unpack_xla", unpack_fn("xla"), uargs), ("st.unpack_triton", unpack_fn("triton"), uargs)],
                rounds)

    fla = {"warm": fla_warm}

    def time_fla(row, case, host):
        """FLA timed as jax_gdn.bench does, right after the case's JAX rounds (8 s needed once warm, else 55)."""
        if quick or opts.no_fla:
            return
        need = 8.0 if fla["warm"] else 55.0
        if left() < need:
            row.setdefault("skipped", []).append("fla")
            log(f"  fla skipped for {row['case']} ({left():.0f} s left, needs {need:.0f})")
            return
        try:
            from jax_gdn.bench import _time_fla
            row["ms"]["fla"] = round(_time_fla(case, host), 4)
            fla["warm"] = True
            log(f"  {row['case'][:22]:22s} {'fla':16s} {row['ms']['fla']:8.4f} ms   ({left():.0f} s left)")
        except Exception as e:  # noqa: BLE001
            row["ms"]["fla"] = None
            result["errors"].append(f"{row['case']} fla: {type(e).__name__}: {str(e)[:300]}")
            log(f"  FAIL fla {type(e).__name__}: {str(e)[:300]}")

    host_of = {}
    for ci, case in enumerate(cases):
        if left() < 10:
            result["skipped"].append(case.name)
            log(f"skip {case.name}: {left():.0f} s left")
            continue
        host, args = kit.bench_inputs(case)
        host_of[case.name] = host
        cu = jnp.asarray(case.cu_seqlens(), jnp.int32)
        row = {"case": case.name, "N": len(case.lens), "T": case.T, "ms": {}, "rounds": {}, "numerics": {}}
        result["rows"].append(row)
        first = case.name == CASES[0] or (quick and ci == 0)
        entries = [("pallas", op_fn(triton_backend, cu), args), ("m.new", varlen_fn(new_cfg, cu), args)]
        if not (plan_b and first):
            entries.insert(1, ("m.old", varlen_fn(old_cfg, cu), args))
        if not quick and not (plan_b and first):
            entries.append(("auto", _auto_fn(op_fn, cu, mg, mv, new_cfg), args))
        if first and not plan_b:                    # the copies alone (in case kkt_used fails to build)
            entries.append(("m.copies", varlen_fn(dataclasses.replace(old_cfg, copies="triton"), cu), args))
        if first and plan_b and not quick:          # the persistent walk, A/B against the default
            entries.append(("m.new.L-1", varlen_fn(configs["m.new.L-1"], cu), args))
        outs = rotated(row, entries, rounds if case.name != CASES[2] else 2, min_left=6.0)
        time_fla(row, case, host)
        if plan_b and first:                        # serve256's numerics were call 2's: the walk bitwise only
            lanes = outs.get("m.new.L-1")
            if lanes is not None and outs.get("m.new") is not None:
                row["numerics"]["m.new.L-1"] = {"bitwise_new": bool(
                    np.array_equal(np.asarray(lanes[0]).view(np.uint16), np.asarray(outs["m.new"][0]).view(np.uint16))
                    and np.array_equal(np.asarray(lanes[1]), np.asarray(outs["m.new"][1])))}
                log(f"  numerics m.new.L-1: bitwise m.new {row['numerics']['m.new.L-1']['bitwise_new']}")
        elif case.name != CASES[2] or quick:
            numerics(row, {k: outs.get(k) for k in ("pallas", "m.old", "m.copies", "m.new") if k in outs}, args, cu)
        del outs
        if first:
            try:
                stages(row, args, cu)
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"stages: {type(e).__name__}: {str(e)[:300]}")
                log(f"  stages FAIL {type(e).__name__}: {str(e)[:300]}")
        _write(out_dir, result)

    if not quick and not plan_b and result["rows"] and result["rows"][0]["case"] == CASES[0] and CASES[0] in host_of:
        row, case = result["rows"][0], cases[0]         # the persistent walk, never run on a GPU before: last
        args = kit.bf16_inputs(host_of[case.name])
        cell(row, "m.new.L-1", varlen_fn(configs["m.new.L-1"], jnp.asarray(case.cu_seqlens(), jnp.int32)), args,
             min_left=15.0)
        del args

    finish(result, opts, out_dir)


def child_elapsed(child) -> float:
    return time.time() - child.t0


def _warm_fla(result) -> bool:
    """FLA's first call on serve256 (it autotunes its kernels, ~40 s; the varlen cases share the tuned configs),
    made while the child's GPU tests run (mostly compiling); FLA is timed later, alone. False if it failed."""
    t = time.time()
    try:
        import torch
        from jax_gdn.bench import fla_call, make_inputs_np
        from jax_gdn.cases import BENCH_CASES
        case = next(c for c in BENCH_CASES if c.name == CASES[0])
        fla_call(case, make_inputs_np(case, 0))()
        torch.cuda.synchronize()
        log(f"  fla warmed on {case.name} in {time.time() - t:.1f} s (beside the child's tests)")
        return True
    except Exception as e:  # noqa: BLE001
        result["errors"].append(f"fla warm-up: {type(e).__name__}: {str(e)[:300]}")
        log(f"  FAIL fla warm-up {type(e).__name__}: {str(e)[:300]}")
        return False


def _auto_fn(op_fn, cu, mg, mv, new_cfg):
    """backend="auto" as it would run with AUTO_VARLEN on and m.new the varlen default (set while tracing: the
    switches are read when the call is traced)."""
    inner = op_fn("auto", cu)

    def fn(*args):
        saved = mg.AUTO_VARLEN, mv.DEFAULT_CONFIG
        mg.AUTO_VARLEN, mv.DEFAULT_CONFIG = True, new_cfg
        try:
            return inner.lower(*args).compile()
        finally:
            mg.AUTO_VARLEN, mv.DEFAULT_CONFIG = saved
    compiled = {}

    def call(*args):
        if "c" not in compiled:
            compiled["c"] = fn(*args)
        return compiled["c"](*args)
    return call


def finish(result, opts, out_dir):
    keys = ["pallas", "m.old", "m.copies", "m.new", "m.new.L-1", "auto", "fla"]
    keys = [k for k in keys if any(k in r["ms"] for r in result["rows"])]
    log(f"\n==== {NAME} (plan {opts.plan}): median ms per call over rotated rounds (m.old = copies xla, every kkt "
        f"slot; m.new = copies triton + kkt_used) ====")
    log(f"{'case':26s} " + " ".join(f"{k:>10s}" for k in keys) + "  new/fla new/pallas new/old")

    def c(x):
        return f"{x:10.4f}" if isinstance(x, (int, float)) else f"{'-':>10s}"
    for r in result["rows"]:
        ms = r["ms"]

        def ratio(a, b):
            return f"{ms[a] / ms[b]:7.3f}" if ms.get(a) and ms.get(b) else f"{'-':>7s}"
        log(f"{r['case'][:26]:26s} " + " ".join(c(ms.get(k)) for k in keys)
            + f"  {ratio('m.new', 'fla')} {ratio('m.new', 'pallas')} {ratio('m.new', 'm.old')}")
    for r in result["rows"]:
        st = {k: v for k, v in r["ms"].items() if k.startswith("st.")}
        if st:
            log(f"stages {r['case']} ({r.get('chunks')}): " + ", ".join(f"{k[3:]} {v}" for k, v in st.items()))
        for name, n in r.get("numerics", {}).items():
            if "o" not in n:
                log(f"numerics {r['case'][:26]} {name}: {n}")
                continue
            log(f"numerics {r['case'][:26]} {name}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']} "
                f"pad0 {n['pad_zero']} bitwise_old {n.get('bitwise_old', '-')}")
    kit.log_closing(log, result, kit.Deadline(opts.budget, T_START))
    _write(out_dir, result)


def _write(out_dir, result):
    kit.save(out_dir, NAME, result, log.lines)


if __name__ == "__main__":
    main()
