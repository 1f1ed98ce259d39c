"""The Mosaic GPU sequence split's start states at jla's speed (issue 14, session 7, helper S;
pallas_kernels/gated_delta_rule/mosaic_gpu_split.py, NOTES.md "Session 7: Mosaic split").

    python benchmarks/gpu/gdn_mosaic_split.py [--quick] [--budget S] [--test-timeout S]
    (writes $OUT/gdn_mosaic_split.{json,log}; OUT=/tmp/out)

1. The split's GPU tests (tests/pallas_kernels/test_gdn_mosaic_gpu.py: the map kernel, single and paired, against
   its jnp twin, the split with the scan on the tensor cores (tf32 / bf16 x 3) against float64 at weak decay,
   the map / scan variants against each other) in a child process, -v, started first; the main process compiles
   the timed variants meanwhile, most informative first (no kernel runs in it before the tests end), and waits
   for the child until --test-timeout s from the start (then kills it). A variant whose new kernel's GPU test did
   not pass is not timed (a hang there would cost the run).
2. B1-T8192-Hk2-Hv8 (the bench's inputs: bf16 q, k, v, beta, fp32 g and initial state, final state out), each
   timed as jax_gdn.bench's kernel section does (bench.time_jax: median of 15 groups of 10 back-to-back calls) in
   this one process: the op at P = 8 (defaults: the map kernel, the serial scan in IEEE fp32) and with the scan's
   products in tf32; the scan alone (serial in fp32 / bf16 x 3 / tf32, log in tf32, the Triton kernel in fp32 /
   tf32, on maps of the right shape); the map pass alone (single and paired); P = 8 with the Triton scan; jla
   (the bench's column); P = 4; B1-T8192-Hk16-Hv32 at P = 2; unsplit; B1-T8192-Hk16-Hv32 unsplit; B1-T32768 at
   P = 2 and 1; P = 8 with the paired map; P = 5 (the scans of the ops: tf32 unless named).
   Each op's o and final state against a named other (rel RMS; the float64 checks are the tests').
A deadline (--budget, default 80 s from start) skips what would not fit; every measurement is wrapped in
try/except. A table is printed last. --quick: CPU, a tiny case, the jnp twins (impl="reference"), no jla.
"""
from __future__ import annotations

import time

import script_kit as kit

T_START = time.time()
log = kit.Log()
rel = kit.relative_rms
NAME = "gdn_mosaic_split"
TEST_FILE = "tests/pallas_kernels/test_gdn_mosaic_gpu.py::"
TEST_IDS = ["test_gpu_split_map_pass_matches_twin[True-False]", "test_gpu_split_fast_scan_matches_f64[default]",
            "test_gpu_split_variants_agree", "test_gpu_split_map_pass_matches_twin[True-True]",
            "test_gpu_split_fast_scan_matches_f64[high]", "test_gpu_split_k128_grouped[mosaic]",
            "test_gpu_split_op_weak_decay_matches_f64[1000-4-True]"]
MAP_TEST = "test_gpu_split_map_pass_matches_twin[True-False]"
PAIRED_TEST = "test_gpu_split_map_pass_matches_twin[True-True]"


def start_tests(quick: bool) -> kit.ChildTests:
    """The split's GPU tests in a child process, started now (the main process compiles meanwhile)."""
    log(f"== GPU tests: {len(TEST_IDS)} split tests in a child process")
    args = ["-v", "-p", "no:randomly", "-p", "no:cacheprovider"] + [TEST_FILE + i for i in TEST_IDS]
    return kit.ChildTests.start(args, quick=quick)


def finish_tests(child: kit.ChildTests, timeout: float, result: dict):
    """Waits for the child (killed at the timeout); returns (map kernel test passed, paired test passed)."""
    child.wait(max(timeout, 1))
    verdicts = child.record(result, log)["verdicts"]
    return (any(MAP_TEST in v and "PASSED" in v for v in verdicts),
            any(PAIRED_TEST in v and "PASSED" in v for v in verdicts))


def main():
    ap = kit.arg_parser(__doc__, budget=70.0, test_timeout=48.0,
                        quick_help="CPU smoke run at tiny sizes (the jnp twins)")
    opts, out_dir, left = kit.parse(ap, T_START)
    quick = opts.quick

    result = {"quick": quick, "budget_s": opts.budget, "rows": [], "errors": []}
    child = None if opts.no_tests else start_tests(quick)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import ops
    from jax_gdn.bench import time_jax
    from jax_gdn.cases import BENCH_CASES, Case
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    from pallas_kernels.gated_delta_rule import mosaic_gpu_split as ms

    result.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__, map=ms.MAP, scan=ms.SCAN)
    if quick:
        cases = [Case("quick-B1-T1024-Hk1-Hv2-K16-V16", 1, 1024, 1, 2, 16, 16)]
        timer = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)  # noqa: E731
        impl = "reference"
    else:
        names = ["B1-T8192-Hk2-Hv8", "B1-T8192-Hk16-Hv32", "B1-T32768-Hk16-Hv32"]
        cases = [next(c for c in BENCH_CASES if c.lens is None and c.name.startswith(n)) for n in names]
        timer = time_jax
        impl = "mosaic"
    kernel = impl == "mosaic"
    log(f"device {result['device']} jax {jax.__version__}; {left():.0f} s left")

    def op(pieces, scan=None, map_impl="map", precision=None):
        if scan is None and map_impl == "map" and precision is None:     # the op as the backend runs it (defaults)
            return jax.jit(lambda q, k, v, g, beta, h0: mg.chunk_gated_delta_rule_fwd(
                q, k, v, g, beta, h0, output_final_state=True, impl=impl, stage1a="mosaic", pieces=pieces))

        def fn(q, k, v, g, beta, h0):   # the same composition with a chosen map / scan
            t = q.shape[1]
            ops_ = mg._prepare_head_major(q, k, v, g, beta, h0, kernel=kernel, pieces=pieces)
            starts = ms.start_states(ops_, pieces, kernel=kernel, head_major=True, map_impl=map_impl, scan=scan,
                                     precision=precision)
            run = mg.fused_state_pass if kernel else mg.fused_state_pass_reference
            o, ht = run(*ops_[:6], starts, scale=q.shape[3] ** -0.5, out_final=True, head_major=True, pieces=pieces)
            ht = ht.reshape((q.shape[0], pieces) + ht.shape[1:])[:, -1]
            return o[:, :t], jnp.swapaxes(ht, -1, -2)
        return jax.jit(fn)

    args_of = kit.bench_inputs

    # ---- the jobs, in the order they are compiled and timed: (row, key, jitted fn, args, needs, compare-to) -------
    # needs: "map" (the map kernel's GPU test must pass), "paired" (the paired kernel's), None (no new kernel);
    # compare-to: the key of a job whose (o, state) this one's are compared with (rel RMS)
    jobs = []
    rows = {}

    def row_of(case):
        if case.name not in rows:
            rows[case.name] = {"case": case.name, "ms": {}, "numerics": {}}
            result["rows"].append(rows[case.name])
        return rows[case.name]

    def add(case, key, fn, args, needs=None, cmp=None):
        jobs.append((row_of(case), key, fn, args, needs, cmp))

    case = cases[0]
    host, args = args_of(case)
    pp = 8 if not quick else 4
    fast = "default"                     # tf32 products in the scan (the candidate; "highest" is the default)
    add(case, f"p{pp}", op(pp), args, "map")
    add(case, f"p{pp}.tf32", op(pp, scan="serial", precision=fast), args, "map", f"p{pp}")
    prep = jax.jit(lambda *a: mg._prepare_head_major(*a, kernel=kernel, pieces=pp))
    ops_p = {pp: None}
    kd, vd, hv = case.K, case.V, case.Hv
    maps_shape = (case.B * (pp - 1), hv, kd + vd, kd)
    for scan, prec in (("serial", "highest"), ("serial", "high"), ("serial", "default"), ("log", "default"),
                       ("triton", "highest"), ("triton", "default")):
        add(case, f"scan{pp}.{scan}.{prec}", jax.jit(lambda m, h, scan=scan, prec=prec: ms.piece_scan(
            m.reshape((case.B, pp - 1) + m.shape[1:]), h, key_dim=kd, method=scan, precision=prec,
            interpret=not kernel)), ("maps", pp, maps_shape))
    map_fn = ms.state_map_pass if kernel else ms.state_map_pass_reference
    add(case, f"map{pp}", jax.jit(lambda *o: map_fn(*o[1:6], pieces=pp, need_first=True)), ("ops", pp), "map")
    if kernel:
        add(case, "map8.paired", jax.jit(lambda *o: ms.state_map_pass(*o[1:6], pieces=8, need_first=True,
                                                                        paired=True)), ("ops", 8), "paired")
    add(case, f"p{pp}.triton.tf32", op(pp, scan="triton", precision=fast), args, "map", f"p{pp}")
    if not quick:
        try:
            from jax_gdn.bench import _jla_impl
            add(case, "jla", *_jla_impl(case, host))
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"{case.name} jla: {type(e).__name__}: {str(e)[:300]}")
    add(case, "p4.tf32", op(4, scan="serial", precision=fast), args, "map", f"p{pp}")
    case_b_args = {}
    for case_b in cases[1:]:
        host_b, args_b = args_of(case_b)
        case_b_args[case_b.name] = (case_b, host_b, args_b)
    if len(cases) > 1:
        case_b, _, args_b = case_b_args[cases[1].name]
        add(case_b, "p2.tf32", op(2, scan="serial", precision=fast), args_b, "map")
    add(case, "p1", op(1), args, None, f"p{pp}")
    if len(cases) > 1:
        add(case_b, "p1", op(1), args_b, None, "p2.tf32")
    for case_b in cases[2:]:
        _, _, args_b = case_b_args[case_b.name]
        add(case_b, "p2.tf32", op(2, scan="serial", precision=fast), args_b, "map")
        add(case_b, "p1", op(1), args_b, None, "p2.tf32")
    if kernel:
        add(case, "p8.tf32.paired", op(8, scan="serial", precision=fast, map_impl="paired"), args, "paired", "p8")
        add(case, "p5.tf32", op(5, scan="serial", precision=fast), args, "map", "p8")

    # ---- compile everything while the tests run (no kernel executes before the tests say it may) ------------------
    def resolve(a):
        if isinstance(a, tuple) and a and a[0] == "ops":
            if ops_p.get(a[1]) is None:
                ops_p[a[1]] = jax.block_until_ready(prep(*args))
            return ops_p[a[1]]
        if isinstance(a, tuple) and a and a[0] == "maps":
            return (jnp.asarray(np.random.default_rng(1).standard_normal(a[2]) * 0.05, jnp.float32),
                    jnp.asarray(np.random.default_rng(2).standard_normal((case.B, case.Hv, case.V, case.K)) * 0.1,
                                jnp.float32))
        return a

    def abstract(a):
        if isinstance(a, tuple) and a and a[0] == "ops":
            return jax.eval_shape(prep, *args)
        if isinstance(a, tuple) and a and a[0] == "maps":
            return (jax.ShapeDtypeStruct(a[2], jnp.float32),
                    jax.ShapeDtypeStruct((case.B, case.Hv, case.V, case.K), jnp.float32))
        return a

    compiled = {}
    t_c = time.time()
    for i, (row, key, fn, a, needs, cmp) in enumerate(jobs):
        if left() < 14:
            break
        t_j = time.time()
        try:
            compiled[i] = fn.lower(*abstract(a)).compile()
            log(f"  compiled {row['case']} {key} in {time.time() - t_j:.1f} s ({left():.0f} s left)")
        except Exception as e:  # noqa: BLE001 - reported; the job is then not timed
            result["errors"].append(f"{row['case']} {key} compile: {type(e).__name__}: {str(e)[:300]}")
            log(f"  compile FAIL {row['case']} {key}: {type(e).__name__}: {str(e)[:300]}")
    log(f"compiled {len(compiled)} of {len(jobs)} jobs in {time.time() - t_c:.0f} s ({left():.0f} s left)")

    ok = {None: True, "map": True, "paired": True}
    if child is not None:
        map_ok, paired_ok = finish_tests(child, min(opts.test_timeout - left.elapsed(), left() - 10), result)
        ok["map"], ok["paired"] = (map_ok or quick), ((paired_ok and map_ok) or quick)
    result["timed"] = {k: v for k, v in ok.items() if k}
    log(f"timing: map kernel {ok['map']}, paired {ok['paired']}; {left():.0f} s left")

    outs = {}
    for i, (row, key, fn, a, needs, cmp) in enumerate(jobs):
        if i not in compiled:
            continue
        if not ok[needs]:
            row["ms"][key] = None
            row.setdefault("skipped", []).append(f"{key} (its kernel's GPU test did not pass)")
            continue
        if left() < 2:
            row.setdefault("skipped", []).append(f"{key} (budget)")
            continue
        f = compiled[i]
        try:
            a = resolve(a)
            res = jax.block_until_ready(f(*a))
            row["ms"][key] = round(timer(f, a), 4)
            log(f"  {row['case']:22s} {key:20s} {row['ms'][key]:8.4f} ms   ({left():.0f} s left)")
            if isinstance(res, tuple) and len(res) == 2 and getattr(res[0], "ndim", 0) == 4:
                outs[(row["case"], key)] = res
                base = outs.get((row["case"], cmp))
                if base is not None:
                    o, ob = (np.asarray(x.astype(jnp.float32)) for x in (res[0], base[0]))
                    n = {"vs": cmp, "o": rel(o, ob), "state": rel(res[1], base[1]),
                         "o_finite": bool(np.isfinite(o).all())}
                    row["numerics"][key] = n
                    log(f"    {key} vs {cmp}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']}")
            del res
        except Exception as e:  # noqa: BLE001 - report and go on
            row["ms"][key] = None
            msg = f"{row['case']} {key}: {type(e).__name__}: {str(e)[:400]}"
            result["errors"].append(msg)
            log("  FAIL " + msg)
        _write(out_dir, result)
    finish(result, opts, out_dir)


def finish(result, opts, out_dir):
    log(f"\n==== {NAME}: median ms per call (pP: the op split in P pieces; mapP / scanP / startsP: its parts) ====")
    keys = []
    for r in result["rows"]:
        for k in r["ms"]:
            if k not in keys:
                keys.append(k)
    order = ["jla", "p1", "p2", "p4", "p8"]
    keys = [k for k in order if k in keys] + [k for k in keys if k not in order]
    for r in result["rows"]:
        ms_ = r["ms"]
        cells = [f"{k}={ms_[k]:.4f}" if isinstance(ms_.get(k), (int, float)) else f"{k}=-" for k in keys if k in ms_]
        log(f"{r['case']:22s} " + "  ".join(cells))
        best = min((v, k) for k, v in ms_.items() if k.startswith("p") and isinstance(v, (int, float))) \
            if any(k.startswith("p") and isinstance(v, (int, float)) for k, v in ms_.items()) else None
        if best and isinstance(ms_.get("jla"), (int, float)):
            log(f"{'':22s} best ours {best[1]} {best[0]:.4f} ms = {best[0] / ms_['jla']:.2f}x jla")
    for r in result["rows"]:
        for name, n in r.get("numerics", {}).items():
            log(f"numerics {r['case']} {name} vs {n.get('vs', 'fp32 XLA')}: o {n['o']:.2e} state {n['state']:.2e} "
                f"finite {n['o_finite']}")
    kit.log_closing(log, result, kit.Deadline(opts.budget, T_START))
    _write(out_dir, result)


def _write(out_dir, result):
    kit.save(out_dir, NAME, result, log.lines)


if __name__ == "__main__":
    main()
