"""GDN prefill on the Mosaic GPU backend beside Pallas Triton, jla and FLA on the dense bench rows (issue 14,
session 6; pallas_kernels/gated_delta_rule/mosaic_gpu.py, NOTES.md "Session 6: Mosaic").

    python benchmarks/gpu/gdn_mosaic_s6.py [--quick] [--budget S] [--test-timeout S]
    (writes $OUT/gdn_mosaic_s6.{json,log}; OUT=/tmp/out)

1. The new code's GPU tests (tests/pallas_kernels/test_gdn_mosaic_gpu.py: the Mosaic stage 1a against its jnp twin,
   the op with the Mosaic stage 1a and the sequence split against float64 at odd lengths, the public op's
   backend='mosaic_gpu'), in a child process with a timeout, -v (each verdict is printed as it comes).
2. Numerics at the first bench shape: o and final state of backend='mosaic_gpu' (and of Pallas Triton) against the
   XLA backend in fp32 (matmul precision "highest") on the same bf16-rounded inputs, relative RMS.
3. Every dense bench row (jax_gdn.cases.BENCH_CASES, bf16 q, k, v, beta, fp32 g and initial state, final state
   out), each implementation timed as jax_gdn.bench's kernel section does (JAX: bench.time_jax, the median of 15
   groups of 10 back-to-back calls; FLA: bench._time_fla, triton.testing.do_bench median) in this one process:
     triton   ops.chunk_gated_delta_rule(backend="pallas")       (the bench's "pallas" column)
     mosaic   ops.chunk_gated_delta_rule(backend="mosaic_gpu")   (mosaic_gpu.DEFAULT_CONFIG: Mosaic stage 1a,
              the split where split_pieces says so)
     jla      jla's gated_delta_rule (the bench's "jla" column)    fla  FLA's chunk_gated_delta_rule
   and per stage: mosaic.kkt (kkt_fwd alone), mosaic.fused (the fused pass alone on its operands); on
   B1-T8192-Hk16-Hv32 also mosaic.t1a (the session-5 port: Triton stage 1a + the fused pass); on the rows where
   the split may pay (B1-T8192-Hk2-Hv8, B1-T32768) the op at pieces = 1, 2, 4, 8 (mosaic.pP).
A deadline (--budget, default 120 s from start) skips what would not fit; every measurement is wrapped in
try/except (a failure prints its reason and the script goes on). A table is printed last.
--quick: CPU, a tiny case, Triton in interpret mode and the Mosaic kernels' jnp twins (impl="reference"), no jla
or FLA: checks the script end to end.
"""
from __future__ import annotations

import time

import script_kit as kit

T_START = time.time()
log = kit.Log()
rel = kit.relative_rms


TEST_IDS = ["test_gpu_mosaic_kkt_matches_its_twin", "test_gpu_mosaic_stage1a_matches_f64[1-1]",
            "test_gpu_mosaic_stage1a_matches_f64[65-1]", "test_gpu_mosaic_stage1a_matches_f64[130-2]",
            "test_gpu_split_k128_grouped[mosaic]", "test_gpu_public_op_mosaic_backend",
            "test_gpu_mosaic_stage1a_matches_f64[63-1]", "test_gpu_mosaic_stage1a_matches_f64[64-2]",
            "test_gpu_split_k128_grouped[triton]", "test_gpu_mosaic_stage1a_matches_f64[130-1]"]
# plan "b" (the second run): what run 1 (03:45 UTC) left out or must recheck: the split with weak decay (its state
# maps M matter), the public op's fallback, the odd lengths it did not reach
TEST_IDS_B = ["test_gpu_split_k128_grouped[mosaic]", "test_gpu_mosaic_stage1a_matches_f64[130-2]",
              "test_gpu_public_op_mosaic_backend", "test_gpu_mosaic_stage1a_matches_f64[64-2]",
              "test_gpu_mosaic_stage1a_matches_f64[63-1]", "test_gpu_split_k128_grouped[triton]",
              "test_gpu_mosaic_stage1a_matches_f64[130-1]"]


def run_tests(quick: bool, timeout: float, result: dict, ids=None):
    """The new code's GPU tests in a child process (a CUDA error or a hang cannot cost the timings)."""
    f = "tests/pallas_kernels/test_gdn_mosaic_gpu.py::"
    ids = TEST_IDS if ids is None else ids
    args = ["-v", "-p", "no:randomly", "-p", "no:cacheprovider"] + [f + i for i in ids]
    log(f"== GPU tests (timeout {timeout:.0f} s): -m pytest {' '.join(args)}")
    kit.run_tests(args, quick=quick, timeout=timeout).record(result, log)


def main():
    ap = kit.arg_parser(__doc__, budget=120.0, test_timeout=35.0,
                        quick_help="CPU smoke run at tiny sizes (interpret mode)")
    ap.add_argument("--plan", choices=("a", "b", "c"), default="a",
                    help="a: tests, then every row's four columns, then extras (run 1); b: the rows run 1 left out "
                         "(no FLA until the end), the extras of the first two rows, FLA, then the tests; c: the two "
                         "rows where Mosaic trails jla, per stage, with the exp2 variant and the split's P")
    opts, out_dir, left = kit.parse(ap, T_START)
    quick = opts.quick

    result = {"quick": quick, "budget_s": opts.budget, "plan": opts.plan, "rows": [], "errors": []}
    plan_b = opts.plan == "b"
    if not opts.no_tests and opts.plan == "a":
        run_tests(quick, min(opts.test_timeout, max(left() - 50, 5)), result)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import ops
    from jax_gdn.bench import time_jax
    from jax_gdn.cases import BENCH_CASES, Case
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg

    result.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  config={"stage1a": mg.DEFAULT_CONFIG.stage1a, "pieces": mg.DEFAULT_CONFIG.pieces})
    if quick:
        cases = [Case("quick-B1-T512-Hk1-Hv2-K16-V16", 1, 512, 1, 2, 16, 16)]
        timer = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)  # noqa: E731
        impl, triton_backend = "reference", "pallas_interpret"
    else:
        dense = [c for c in BENCH_CASES if c.lens is None]
        order = ["B1-T8192-Hk16-Hv32", "B1-T8192-Hk2-Hv8", "B4-T4096-Hk16-Hv32", "B1-T32768-Hk16-Hv32",
                 "B16-T1024-Hk16-Hv32"]
        if plan_b:
            order = order[2:] + order[:2]
        cases = sorted(dense, key=lambda c: next((i for i, n in enumerate(order) if c.name.startswith(n)), 9))
        timer = time_jax
        impl, triton_backend = "mosaic", "pallas"
    log(f"device {result.get('device')} jax {jax.__version__}; cases {[c.name for c in cases]}; "
        f"{left():.0f} s left")

    timed = kit.Timed(timer, left, log, result["errors"])

    def mosaic_op(cfg):
        def fn(q, k, v, g, beta, h0):
            return mg.chunk_gated_delta_rule_fwd(q, k, v, g, beta, h0, output_final_state=True, impl=impl, **cfg)
        return jax.jit(fn)

    inputs = {}
    if opts.plan == "c":
        plan_c(result, cases, timed, mosaic_op, left, quick, out_dir)
        return finish(result, opts, out_dir)

    def case_args(case):
        if case.name not in inputs:
            inputs[case.name] = kit.bench_inputs(case)
        return inputs[case.name]

    def numerics(row, results, args):
        try:        # against fp32 XLA on the same bf16-rounded inputs
            f32 = [x.astype(jnp.float32) for x in args]
            with jax.default_matmul_precision("highest"):
                ref = jax.block_until_ready(jax.jit(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="xla"))(*f32))
            for name, res in results:
                if res is not None:
                    o = np.asarray(res[0].astype(jnp.float32))
                    row["numerics"][name] = {"o": rel(o, ref[0]), "state": rel(res[1], ref[1]),
                                             "o_finite": bool(np.isfinite(o).all())}
                    log(f"  numerics {name}: o {row['numerics'][name]['o']:.2e} state "
                        f"{row['numerics'][name]['state']:.2e} (rel RMS vs fp32 XLA; bf16 bound 1e-2)")
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"numerics: {type(e).__name__}: {str(e)[:300]}")
            log(f"  numerics FAIL {type(e).__name__}: {str(e)[:300]}")

    # pass 1: the four columns of every row (and numerics on the first row and the first split row)
    for ci, case in enumerate(cases):
        if left() < 6:
            log(f"skip {case.name}: {left():.0f} s left")
            result["errors"].append(f"{case.name}: skipped (budget)")
            continue
        host, args = case_args(case)
        row = {"case": case.name, "ms": {}, "numerics": {}}
        result["rows"].append(row)
        if quick:
            mos = mosaic_op({"stage1a": mg.DEFAULT_CONFIG.stage1a, "pieces": mg.DEFAULT_CONFIG.pieces})
        else:
            mos = jax.jit(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="mosaic_gpu"))
        tri = jax.jit(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=triton_backend))
        if plan_b and (case.name.startswith(("B1-T8192-Hk16", "B1-T8192-Hk2"))):
            if "Hk2" in case.name and left() > 30:      # run 1 ran out before this row's numerics
                numerics(row, [("mosaic", jax.block_until_ready(mos(*args)))], args)
            continue
        res_m = timed(row, "mosaic", mos, args)
        if res_m is None and "mosaic" not in row.get("skipped", []):   # the default failed: the session-5 form
            res_m = timed(row, "mosaic.t1a", mosaic_op({"stage1a": "triton", "pieces": 1}), args)
        res_t = timed(row, "triton", tri, args)
        if (ci == 0 or "Hk2-Hv8" in case.name or quick) and left() > 20:
            numerics(row, [("mosaic", res_m), ("triton", res_t)], args)
        del res_m, res_t
        if not quick:
            try:
                from jax_gdn.bench import _jla_impl
                timed(row, "jla", *_jla_impl(case, host))
            except Exception as e:  # noqa: BLE001
                row["ms"]["jla"] = None
                result["errors"].append(f"{case.name} jla: {type(e).__name__}: {str(e)[:300]}")
        if not quick and not plan_b and left() > 5:
            try:
                from jax_gdn.bench import _time_fla
                row["ms"]["fla"] = round(_time_fla(case, host), 4)
                log(f"  {case.name:22s} {'fla':14s} {row['ms']['fla']:8.4f} ms   ({left():.0f} s left)")
            except Exception as e:  # noqa: BLE001
                row["ms"]["fla"] = None
                result["errors"].append(f"{case.name} fla: {type(e).__name__}: {str(e)[:300]}")
        _write(out_dir, result)

    # pass 2: per stage and the split variants, where the budget allows (plan b: B1-T8192-Hk16-Hv32 and the
    # Hk2-Hv8 row only, B1-T32768's split variants skipped: the policy never splits it and run 1 had no time)
    rows2 = result["rows"]
    if plan_b:
        rows2 = sorted([r for r in rows2 if r["case"].startswith(("B1-T8192-Hk2", "B1-T8192-Hk16"))],
                       key=lambda r: "Hk16" in r["case"])
    for ci, row in enumerate(rows2):
        case = next(c for c in cases if c.name == row["case"])
        split_row = quick or case.name.startswith(("B1-T8192-Hk2-Hv8",) if plan_b else ("B1-T8192-Hk2-Hv8",
                                                                                       "B1-T32768"))
        first = case.name.startswith("B1-T8192-Hk16") if plan_b else ci == 0
        if not (first or split_row) or left() < 8:
            continue
        host, args = case_args(case)
        if first and "mosaic.t1a" not in row["ms"]:
            timed(row, "mosaic.t1a", mosaic_op({"stage1a": "triton", "pieces": 1}), args, min_left=8)
        if first and plan_b:      # does a split pay where the rows already use 64 SMs? (the map pass has no output)
            for p in (1, 2):
                timed(row, f"mosaic.p{p}", mosaic_op({"stage1a": "mosaic", "pieces": p}), args, min_left=8)
        if split_row:
            for p in ((1, 2, 4, 8) if case.T // 64 >= 64 or quick else (1, 2)):
                if case.T // 64 // p >= mg.MIN_PIECE_CHUNKS or quick:
                    timed(row, f"mosaic.p{p}", mosaic_op({"stage1a": "mosaic", "pieces": p}), args, min_left=6)
            if left() > 8:      # the split's start states alone (map pass + scan), at the policy's pick
                pp = mg.split_pieces(case.B, case.Hv, case.K, case.V, case.T) if not quick else 2
                if pp > 1:
                    try:
                        prep = jax.jit(lambda *a: mg._prepare_head_major(*a, kernel=not quick, pieces=pp))
                        ops_p = jax.block_until_ready(prep(*args))
                        timed(row, f"mosaic.starts{pp}", jax.jit(lambda *a: mg._split_start_states(
                            a, pp, kernel=not quick, head_major=True)), ops_p)
                        del ops_p
                    except Exception as e:  # noqa: BLE001
                        result["errors"].append(f"{case.name} starts: {type(e).__name__}: {str(e)[:300]}")
        if left() > 8:
            try:
                prep = jax.jit(lambda q, k, v, g, beta, h0: mg._prepare_head_major(
                    q, k, v, g, beta, h0, kernel=not quick, pieces=1))
                operands = jax.block_until_ready(prep(*args))
                hv = case.Hv
                kkt = jax.jit(lambda k, b: mg.kkt_fwd(k, b, heads=hv)) if not quick else jax.jit(
                    lambda k, b: mg.kkt_fwd_reference(k, b, heads=hv))
                timed(row, "mosaic.kkt", kkt, (operands[1], operands[5]))
                if plan_b and first and not quick:     # chunks per CTA of stage 1a (policy: 8 on this row)
                    for cpc in (4, 2):
                        timed(row, f"mosaic.kkt.c{cpc}", jax.jit(
                            lambda k, b, cpc=cpc: mg.kkt_fwd(k, b, heads=hv, chunks_per_cta=cpc)),
                            (operands[1], operands[5]), min_left=10)
                run = mg.fused_state_pass if not quick else mg.fused_state_pass_reference
                scale = case.K ** -0.5
                timed(row, "mosaic.fused", jax.jit(lambda *a: run(*a, scale=scale, out_final=True,
                                                                  head_major=True)), operands)
                del operands
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"{case.name} stages: {type(e).__name__}: {str(e)[:300]}")
                log(f"  stages FAIL {type(e).__name__}: {str(e)[:300]}")
        _write(out_dir, result)

    # plan b: FLA for the rows that lack it, then the tests
    if plan_b and not quick:
        for row in result["rows"]:
            if "fla" in row["ms"] or left() < 12 or row["case"].startswith(("B1-T8192-Hk16", "B1-T8192-Hk2")):
                continue
            case = next(c for c in cases if c.name == row["case"])
            try:
                from jax_gdn.bench import _time_fla
                row["ms"]["fla"] = round(_time_fla(case, case_args(case)[0]), 4)
                log(f"  {case.name:22s} {'fla':14s} {row['ms']['fla']:8.4f} ms   ({left():.0f} s left)")
            except Exception as e:  # noqa: BLE001
                row["ms"]["fla"] = None
                result["errors"].append(f"{case.name} fla: {type(e).__name__}: {str(e)[:300]}")
    if plan_b and not opts.no_tests and left() > 10:
        run_tests(quick, left() - 5, result, ids=TEST_IDS_B)

    finish(result, opts, out_dir)


def plan_c(result, cases, timed, mosaic_op, left, quick, out_dir):
    """B1-T8192-Hk16-Hv32 and B1-T8192-Hk2-Hv8 (the rows where Mosaic trailed jla in runs 1 and 2), every
    column in this one process: the op at the default config and with exp2 gates (its output against the
    default's), jla, stage 1a (8 / 4 chunks per CTA), the fused pass; the split's P = 4 / 8 and its start states."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    names = ("quick",) if quick else ("B1-T8192-Hk16-Hv32", "B1-T8192-Hk2-Hv8")
    for name in names:
        case = next(c for c in cases if c.name.startswith(name))
        host, args = kit.bench_inputs(case)
        row = {"case": case.name, "ms": {}, "numerics": {}}
        result["rows"].append(row)
        split = mg.split_pieces(case.B, case.Hv, case.K, case.V, case.T) if not quick else 2
        res = timed(row, "mosaic", mosaic_op({"stage1a": "mosaic", "pieces": split}), args)
        if not quick:
            try:
                from jax_gdn.bench import _jla_impl
                timed(row, "jla", *_jla_impl(case, host))
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"{case.name} jla: {type(e).__name__}: {str(e)[:300]}")
        res2 = timed(row, "mosaic.exp2", mosaic_op({"stage1a": "mosaic", "pieces": split, "exp2": True}), args)
        if res is not None and res2 is not None:
            row["numerics"]["exp2_vs_default"] = {"o": rel(np.asarray(res2[0].astype(jnp.float32)),
                                                           np.asarray(res[0].astype(jnp.float32))),
                                                  "state": rel(res2[1], res[1]), "o_finite": True}
            log(f"  exp2 vs default: o {row['numerics']['exp2_vs_default']['o']:.2e} state "
                f"{row['numerics']['exp2_vs_default']['state']:.2e}")
        del res, res2
        try:
            operands = jax.block_until_ready(jax.jit(lambda *a: mg._prepare_head_major(
                *a, kernel=not quick, pieces=1))(*args))
            hv = case.Hv
            if not quick:
                timed(row, "mosaic.kkt", jax.jit(lambda k, b: mg.kkt_fwd(k, b, heads=hv)), (operands[1], operands[5]))
            run = mg.fused_state_pass if not quick else mg.fused_state_pass_reference
            scale = case.K ** -0.5
            timed(row, "mosaic.fused", jax.jit(lambda *a: run(*a, scale=scale, out_final=True, head_major=True)),
                  operands)
            if not quick and "Hk16" in case.name:
                timed(row, "mosaic.kkt.c4", jax.jit(lambda k, b: mg.kkt_fwd(k, b, heads=hv, chunks_per_cta=4)),
                      (operands[1], operands[5]), min_left=8)
            del operands
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"{case.name} stages: {type(e).__name__}: {str(e)[:300]}")
            log(f"  stages FAIL {type(e).__name__}: {str(e)[:300]}")
        if "Hk2" in case.name or quick:
            timed(row, "mosaic.p4", mosaic_op({"stage1a": "mosaic", "pieces": 4}), args, min_left=8)
            try:
                pp = split
                ops_p = jax.block_until_ready(jax.jit(lambda *a: mg._prepare_head_major(
                    *a, kernel=not quick, pieces=pp))(*args))
                timed(row, f"mosaic.starts{pp}", jax.jit(lambda *a: mg._split_start_states(
                    a, pp, kernel=not quick, head_major=True)), ops_p, min_left=8)
                del ops_p
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"{case.name} starts: {type(e).__name__}: {str(e)[:300]}")
        _write(out_dir, result)


def finish(result, opts, out_dir):
    # the table, last
    log("\n==== gdn_mosaic_s6: median ms per call; mosaic = backend 'mosaic_gpu' (DEFAULT_CONFIG) ====")
    keys = ["triton", "mosaic", "jla", "fla", "mosaic.exp2", "mosaic.kkt", "mosaic.fused", "mosaic.t1a", "mosaic.p1",
            "mosaic.p2", "mosaic.p4", "mosaic.p8"]
    keys += sorted({k for r in result["rows"] for k in r["ms"] if k.startswith(("mosaic.starts", "mosaic.kkt."))})
    keys = [k for k in keys if any(k in r["ms"] for r in result["rows"])]
    log(f"{'case':22s} " + " ".join(f"{k.replace('mosaic', 'm'):>8s}" for k in keys) + "   m/jla  m/fla")

    def cell(x):
        return f"{x:8.4f}" if isinstance(x, (int, float)) else f"{'-':>8s}"
    for r in result["rows"]:
        ms = r["ms"]
        ratio = lambda a, b: f"{ms[a] / ms[b]:6.2f}" if ms.get(a) and ms.get(b) else f"{'-':>6s}"  # noqa: E731
        log(f"{r['case']:22s} " + " ".join(cell(ms.get(k)) for k in keys) + f"  {ratio('mosaic', 'jla')} "
            f"{ratio('mosaic', 'fla')}")
    for r in result["rows"]:
        for name, n in r.get("numerics", {}).items():
            log(f"numerics {r['case']} {name}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']}")
    kit.log_closing(log, result, kit.Deadline(opts.budget, T_START))
    _write(out_dir, result)


def _write(out_dir, result):
    kit.save(out_dir, "gdn_mosaic_s6", result, log.lines)


if __name__ == "__main__":
    main()
