"""The dense Mosaic GPU rows at or under jla (issue 14, session 8, helper S8; pallas_kernels/gated_delta_rule/
mosaic_gpu.py's MosaicConfig and split policy, NOTES.md "Session 8: dense Mosaic").

    python benchmarks/gpu/gdn_dense_s8.py [--quick] [--plan a|b] [--budget S] [--test-timeout S] [--no-tests]
                                          [--rows N,...] [--workers W]
    (writes $OUT/gdn_dense_s8.{json,log}; OUT=/tmp/out)

1. The 5 dense BENCH_CASES rows (bench inputs: bf16 q, k, v, beta, fp32 g and initial state, final state out). Per
   row: jla (``jax_gdn.bench._jla_impl``, the bench's column), our dense entry with ``mosaic_gpu.DEFAULT_CONFIG``
   ("default") and variants of it (MosaicConfig fields: ``kv`` state_kv, ``exp2``, ``pP`` pieces = P, ``p2.chain``
   P = 2 with split_chain), each a jitted ``mosaic_gpu.chunk_gated_delta_rule_fwd`` as ``op_fwd`` calls it; "api"
   is the bench's own mosaic_gpu column (``jax_gdn.bench._jax_impl``) on the first rows, to show it times as
   "default". Everything is compiled first,
   most informative first (a thread pool; what the deadline leaves uncompiled is skipped), then timed in 3
   interleaved rounds (the variant order rotated each round, so each variant runs in different positions), every
   cell with ``jax_gdn.bench.time_jax`` in this one process.
2. Numerics of every timed variant against the XLA backend in fp32 (matmul precision highest): o and final state
   relative RMS (bf16 bound 1e-2), o finite.
3. Per-stage times of the default where the budget allows: the glue + stage 1a (``_prepare_head_major``), stage 1a
   alone (``kkt_fwd``), the split's start states (map pass + scan) and the fused pass alone.
4. GPU tests of mosaic_gpu.py's dense path and the new state_kv (tests/pallas_kernels/test_gdn_mosaic_gpu.py) LAST,
   in a child process, killed at --test-timeout.
--plan b (after call 2 set the defaults): the new default against call 2's ("s7": exp2 and state_kv off), the best
unsplit on the split rows, P = 8 and the XLA serial scan (jla's) at Hk2-Hv8, and the GPU tests of the new defaults.
A table is printed last: each variant's median over the rounds, its ratio to jla, and in how many rounds it beat
the default and jla (same round). --quick: CPU, tiny rows, the jnp twins (impl="reference"), no jla.
"""
from __future__ import annotations

import time

import script_kit as kit

T_START = time.time()
log = kit.Log()
NAME = "gdn_dense_s8"
ROUNDS = 3
TEST_FILE = "tests/pallas_kernels/test_gdn_mosaic_gpu.py::"
TEST_IDS = ["test_gpu_state_kv_matches_f64[False]", "test_gpu_state_kv_matches_f64[True]",
            "test_gpu_kernel_k128_grouped_and_nan_row", "test_gpu_mosaic_stage1a_matches_f64[130-1]",
            "test_gpu_split_chain_matches_f64", "test_gpu_split_op_weak_decay_matches_f64[1000-8-True]",
            "test_gpu_split_k128_grouped[mosaic]"]
QUICK_TEST_IDS = ["test_config_state_kv_is_checked_and_passed_through", "test_reference_state_kv_is_the_same_op",
                  "test_split_chain_start_states_match_the_maps[True]"]

#: rows in priority order (the closest gaps to jla first), and per row the variants beside jla and the default,
#: in compile priority: name -> MosaicConfig overrides
ROW_ORDER = ["B16-T1024-Hk16-Hv32", "B1-T8192-Hk16-Hv32", "B1-T8192-Hk2-Hv8", "B4-T4096-Hk16-Hv32",
             "B1-T32768-Hk16-Hv32"]
KV, KV_EXP2, EXP2 = ("kv", dict(state_kv=True)), ("kv.exp2", dict(state_kv=True, exp2=True)), ("exp2", dict(exp2=True))
P2, P2_CHAIN = ("p2", dict(pieces=2)), ("p2.chain", dict(pieces=2, split_chain=True))
HV32 = [KV, KV_EXP2, EXP2]
VARIANTS = {
    "B16-T1024-Hk16-Hv32": HV32,
    "B1-T8192-Hk16-Hv32": [P2, KV, P2_CHAIN, KV_EXP2, EXP2],
    "B1-T8192-Hk2-Hv8": [EXP2, ("p4", dict(pieces=4)), ("p4.exp2", dict(pieces=4, exp2=True))],
    "B4-T4096-Hk16-Hv32": HV32,
    "B1-T32768-Hk16-Hv32": [KV, P2, P2_CHAIN, KV_EXP2, EXP2],
}
API_ROWS = ("B16-T1024-Hk16-Hv32", "B1-T8192-Hk16-Hv32")
#: --plan b (after call 2 set the defaults: exp2, state_kv, P = 2 on 64-CTA rows, P = 4 at Hk2-Hv8): the new
#: default against call 2's (``s7``: exp2 and state_kv off, session 7's split policy is not reproduced: its pieces
#: are named), the best unsplit on the split rows, and the XLA serial scan (jla's dense scan) at Hk2-Hv8; overrides
#: of the *new* defaults. "scan" in an override: the split's scan composed by hand (not a MosaicConfig field).
S7 = dict(exp2=False, state_kv=False)
VARIANTS_B = {
    "B16-T1024-Hk16-Hv32": [("s7", S7)],
    "B1-T8192-Hk16-Hv32": [("p1", dict(pieces=1)), ("s7.p1", dict(S7, pieces=1)), ("p2.noexp2", dict(exp2=False))],
    "B1-T8192-Hk2-Hv8": [("p4.serial", dict(pieces=4, scan="serial")), ("p8", dict(pieces=8)),
                         ("s7.p8", dict(S7, pieces=8))],
    "B4-T4096-Hk16-Hv32": [("s7", S7)],
    "B1-T32768-Hk16-Hv32": [("p1", dict(pieces=1)), ("s7.p1", dict(S7, pieces=1))],
}
TEST_IDS_B = ["test_gpu_default_config_matches_f64[4000-2-4]", "test_gpu_default_config_matches_f64[130-3-1]",
              "test_gpu_split_op_weak_decay_matches_f64[1000-8-True]", "test_gpu_split_chain_matches_f64",
              "test_gpu_split_k128_grouped[mosaic]"]


def main():
    ap = kit.arg_parser(__doc__, budget=150.0, test_timeout=40.0,
                        quick_help="CPU smoke run at tiny sizes (the jnp twins)")
    ap.add_argument("--rows", default="", help="comma-separated row-name prefixes (default: all five)")
    ap.add_argument("--workers", type=int, default=6, help="compile threads (1: serial)")
    ap.add_argument("--plan", default="a", choices=("a", "b"),
                    help="a: call 2's sweep (the variants of the defaults of then); b: the new defaults checked")
    opts, out_dir, left = kit.parse(ap, T_START, cpu_quick=True)
    quick = opts.quick
    result = {"quick": quick, "budget_s": opts.budget, "rows": [], "errors": [], "skipped": []}

    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import jax.numpy as jnp
    from jax_gdn import ops
    from jax_gdn.bench import time_jax
    from jax_gdn.cases import BENCH_CASES, Case
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    from pallas_kernels.gated_delta_rule import mosaic_gpu_split as ms

    save = lambda: kit.save(out_dir, NAME, result, log.lines)   # noqa: E731
    result.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  default=dataclasses.asdict(mg.DEFAULT_CONFIG), scan=ms.SCAN, paired=str(ms.PAIRED))
    log(f"device {result['device']} jax {jax.__version__}; default {mg.DEFAULT_CONFIG}; {left():.0f} s left")
    if quick:
        cases = {"B16-T1024-Hk16-Hv32": Case("quick-B2-T130-Hk1-Hv2-K16-V16", 2, 130, 1, 2, 16, 16),
                 "B1-T8192-Hk16-Hv32": Case("quick-B1-T520-Hk1-Hv2-K16-V16", 1, 520, 1, 2, 16, 16),
                 "B1-T8192-Hk2-Hv8": Case("quick-B1-T1024-Hk1-Hv2-K16-V16", 1, 1024, 1, 2, 16, 16)}
        timer = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)   # noqa: E731
        impl = "reference"
    else:
        cases = {n: next(c for c in BENCH_CASES if c.lens is None and c.name.startswith(n)) for n in ROW_ORDER}
        timer = lambda fn, args: time_jax(fn, args, groups=9)   # noqa: E731 (x 3 rounds: 27 groups)
        impl = "mosaic"
    kernel = impl == "mosaic"
    if opts.rows:
        want = opts.rows.split(",")
        cases = {n: c for n, c in cases.items() if any(n.startswith(w) for w in want)}

    def op(cfg, scan=None):
        """The dense entry as op_fwd runs it with ``cfg`` (impl="reference" under --quick); ``scan``: the split's
        start states with that scan, composed as the entry does."""
        if scan is not None:
            def fn(q, k, v, g, beta, h0):
                t, p = q.shape[1], cfg.pieces
                ops_ = mg._prepare_head_major(q, k, v, g.astype(jnp.float32), beta, h0, kernel=kernel, pieces=p,
                                              exp2=cfg.exp2)
                starts = ms.start_states(ops_, p, kernel=kernel, head_major=True, exp2=cfg.exp2, scan=scan)
                run = mg.fused_state_pass if kernel else mg.fused_state_pass_reference
                o, ht = run(*ops_[:6], starts, scale=float(q.shape[3]) ** -0.5, out_final=True, head_major=True,
                            pieces=p, exp2=cfg.exp2)
                ht = ht.reshape((q.shape[0], p) + ht.shape[1:])[:, -1]
                return o[:, :t].astype(v.dtype), jnp.swapaxes(ht, -1, -2)
            return jax.jit(fn)

        def fn(q, k, v, g, beta, h0):
            return mg.chunk_gated_delta_rule_fwd(q, k, v, g.astype(jnp.float32), beta, h0,
                                                 scale=float(q.shape[3]) ** -0.5, output_final_state=True,
                                                 impl=impl, stage1a=cfg.stage1a, pieces=cfg.pieces, exp2=cfg.exp2,
                                                 state_kv=cfg.state_kv, split_chain=cfg.split_chain)
        return jax.jit(fn)

    def xla_ref(q, k, v, g, beta, h0):
        f32 = [x.astype(jnp.float32) for x in (q, k, v, g, beta)]
        with jax.default_matmul_precision("highest"):
            return ops.chunk_gated_delta_rule(*f32, initial_state=h0, output_final_state=True, backend="xla")

    @jax.jit
    def rel(a, r):
        a, r = a.astype(jnp.float32), r.astype(jnp.float32)
        err = jnp.sqrt(jnp.mean((a - r) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(r ** 2)), 1e-30)
        return err, jnp.all(jnp.isfinite(a))

    # ---- the jobs: (row, key, jitted fn, args, tier) ------------------------------------------------------------
    rows, jobs, hosts = {}, [], {}
    for name, case in cases.items():
        host, args = kit.bench_inputs(case)
        hosts[name] = host
        row = {"case": case.name, "ms": {}, "rounds": {}, "numerics": {}, "configs": {}, "stages": {}}
        rows[name] = row
        result["rows"].append(row)
        pieces_default = mg.DEFAULT_CONFIG.pieces or mg.split_pieces(
            case.B, case.Hv, case.K, case.V, case.T + (-case.T) % mg.C, has_h0=True) if kernel else "-"
        row["default_pieces"] = pieces_default
        jobs.append((name, "xla_fp32", jax.jit(xla_ref), args, 0))
        if not quick:
            try:
                from jax_gdn.bench import _jla_impl
                fn, jargs = _jla_impl(case, host)
                jobs.append((name, "jla", fn, jargs, 0))
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"{case.name} jla: {type(e).__name__}: {str(e)[:300]}")
        jobs.append((name, "default", op(mg.DEFAULT_CONFIG), args, 0))
        row["configs"]["default"] = dataclasses.asdict(mg.DEFAULT_CONFIG)
        variants = VARIANTS.get(name, HV32) if opts.plan == "a" else VARIANTS_B.get(name, [])
        for tier, (key, over) in enumerate(variants, start=1):
            over = dict(over)
            scan = over.pop("scan", None)
            cfg = dataclasses.replace(mg.DEFAULT_CONFIG, **over)
            row["configs"][key] = dict(dataclasses.asdict(cfg), **({"scan": scan} if scan else {}))
            jobs.append((name, key, op(cfg, scan), args, tier))
        if not quick and name in API_ROWS and opts.plan == "a":
            from jax_gdn.bench import _jax_impl
            fn, aargs = _jax_impl(case, host, "mosaic_gpu")
            jobs.append((name, "api", fn, aargs, 2))
    # the order of compilation: tier by tier, rows in priority order within a tier
    jobs.sort(key=lambda j: (j[4], list(cases).index(j[0])))
    save()

    # ---- compile (a thread pool; the deadline cancels what has not started) --------------------------------------
    compiled, t_c = {}, time.time()
    compile_stop = 75.0 if not quick else 5.0        # seconds that must be left when a compile starts

    def compile_job(i):
        name, key, fn, a, _ = jobs[i]
        if left() < compile_stop:
            return i, None, "deadline"
        t = time.time()
        try:
            c = fn.lower(*a).compile()
            log(f"  compiled {name:22s} {key:10s} in {time.time() - t:5.1f} s ({left():.0f} s left)")
            return i, c, None
        except Exception as e:  # noqa: BLE001 - reported; the job is then not timed
            return i, None, f"{type(e).__name__}: {str(e)[:400]}"

    workers = max(1, opts.workers)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, c, err in pool.map(compile_job, range(len(jobs))):
            name, key = jobs[i][0], jobs[i][1]
            if c is not None:
                compiled[i] = c
            elif err == "deadline":
                rows[name].setdefault("skipped", []).append(f"{key} (not compiled: budget)")
            else:
                result["errors"].append(f"{name} {key} compile: {err}")
                log(f"  compile FAIL {name} {key}: {err}")
    log(f"compiled {len(compiled)} of {len(jobs)} jobs in {time.time() - t_c:.0f} s with {workers} threads "
        f"({left():.0f} s left)")
    save()

    # ---- numerics: each variant's first call against the fp32 XLA backend ---------------------------------------
    refs, timed = {}, {}
    for i, (name, key, fn, a, _) in enumerate(jobs):
        if i not in compiled or key != "xla_fp32":
            continue
        try:
            refs[name] = jax.block_until_ready(compiled[i](*a))
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"{name} xla_fp32: {type(e).__name__}: {str(e)[:300]}")
    for i, (name, key, fn, a, _) in enumerate(jobs):
        if i not in compiled or key == "xla_fp32" or left() < 30:
            continue
        row = rows[name]
        try:
            res = jax.block_until_ready(compiled[i](*a))
            timed.setdefault(name, []).append(i)
            if name in refs:
                eo, fin = rel(res[0], refs[name][0])
                es, _ = rel(res[1], refs[name][1])
                n = {"o": float(eo), "state": float(es), "o_finite": bool(fin)}
                row["numerics"][key] = n
                log(f"  {name:22s} {key:10s} numerics o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']}")
            del res
        except Exception as e:  # noqa: BLE001 - a variant that fails its first call is not timed
            result["errors"].append(f"{name} {key}: {type(e).__name__}: {str(e)[:400]}")
            log(f"  FAIL {name} {key}: {type(e).__name__}: {str(e)[:400]}")
    refs.clear()
    save()

    # ---- timing: interleaved rounds, the order rotated each round ------------------------------------------------
    round_need = 2.0 if quick else 0.6
    for rnd in range(ROUNDS):
        for name in cases:
            idx = timed.get(name, [])
            if not idx:
                continue
            shift = rnd * max(1, len(idx) // ROUNDS + 1)
            order = idx[shift % len(idx):] + idx[:shift % len(idx)]
            if rnd % 2:
                order = order[::-1]
            for i in order:
                key, a = jobs[i][1], jobs[i][3]
                if left() < 45 + round_need:   # leave the stages and the tests their time
                    rows[name].setdefault("skipped", []).append(f"{key} round {rnd}")
                    continue
                try:
                    ms_ = round(timer(compiled[i], a), 4)
                    rows[name]["rounds"].setdefault(key, []).append(ms_)
                except Exception as e:  # noqa: BLE001
                    result["errors"].append(f"{name} {key} round {rnd}: {type(e).__name__}: {str(e)[:300]}")
            got = {k: v[rnd] for k, v in rows[name]["rounds"].items() if len(v) > rnd}
            log(f"  round {rnd} {name:22s} " + " ".join(f"{jobs[i][1]}={got.get(jobs[i][1], '-')}" for i in order)
                + f"   ({left():.0f} s left)")
        save()
    for row in rows.values():
        for key, ts in row["rounds"].items():
            row["ms"][key] = sorted(ts)[len(ts) // 2]
    del compiled
    save()

    # ---- per-stage times of the default, where the budget allows ------------------------------------------------
    for name, case in cases.items():
        if left() < 40:
            result["skipped"].append(f"{name} stages")
            continue
        kit.guarded(f"{name} stages", 40, lambda: stages(name, case, rows[name]), left=left, log=log, res=result,
                    save=save)

    # ---- the GPU tests, last, in a child process ----------------------------------------------------------------
    if not opts.no_tests:
        ids = QUICK_TEST_IDS if quick else TEST_IDS if opts.plan == "a" else TEST_IDS_B
        timeout = min(opts.test_timeout, left() - 3)
        if timeout < 10:
            result["skipped"].append("tests")
            log(f"skip tests ({left():.0f} s left)")
        else:
            log(f"== GPU tests: {len(ids)} in a child process, timeout {timeout:.0f} s")
            args = ["-v", "-p", "no:randomly", "-p", "no:cacheprovider"] + [TEST_FILE + i for i in ids]
            kit.run_tests(args, quick=quick, timeout=timeout).record(result, log)
    finish(result, left)
    save()


def stages(name, case, row):
    """The default's parts, each a jitted call: glue + stage 1a, stage 1a alone, start states (split), fused."""
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench import time_jax
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    from pallas_kernels.gated_delta_rule import mosaic_gpu_split as ms
    quick = case.name.startswith("quick")
    kernel = not quick
    timer = (lambda fn, a: time_jax(fn, a, warmup=1, groups=1, per_group=1)) if quick else time_jax
    _, args = kit.bench_inputs(case)
    cfg = mg.DEFAULT_CONFIG
    pieces = cfg.pieces or mg.split_pieces(case.B, case.Hv, case.K, case.V, case.T + (-case.T) % mg.C, has_h0=True)
    prep = jax.jit(lambda *a: mg._prepare_head_major(*a[:3], a[3].astype(jnp.float32), *a[4:], kernel=kernel,
                                                     pieces=pieces, exp2=cfg.exp2))
    ops_ = jax.block_until_ready(prep(*args))
    row["stages"]["prep"] = round(timer(prep, args), 4)
    kkt = jax.jit(lambda k, b: (mg.kkt_fwd if kernel else mg.kkt_fwd_reference)(k, b, heads=case.Hv))
    row["stages"]["kkt"] = round(timer(kkt, (ops_[1], ops_[5])), 4)
    fused_fn = mg.fused_state_pass if kernel else mg.fused_state_pass_reference
    h0 = ops_[6]
    if pieces > 1:
        starts = jax.jit(lambda *o: ms.start_states(o, pieces, kernel=kernel, head_major=True, exp2=cfg.exp2))
        h0 = jax.block_until_ready(starts(*ops_))
        row["stages"]["starts"] = round(timer(starts, ops_), 4)
    fused = jax.jit(lambda *o: fused_fn(*o, scale=case.K ** -0.5, out_final=True, head_major=True, pieces=pieces,
                                        exp2=cfg.exp2))
    row["stages"]["fused"] = round(timer(fused, tuple(ops_[:6]) + (h0,)), 4)
    log(f"  {name:22s} stages (P = {pieces}): " + " ".join(f"{k}={v:.4f}" for k, v in row["stages"].items()))


def finish(result, left):
    log(f"\n==== {NAME}: median ms over {ROUNDS} interleaved rounds (xN/3: rounds won against the default / jla "
        f"in the same round) ====")
    for r in result["rows"]:
        rounds, ms_ = r["rounds"], r["ms"]
        jla = ms_.get("jla")
        log(f"{r['case']} (default P = {r.get('default_pieces')})")
        for key in ["jla", "default"] + [k for k in ms_ if k not in ("jla", "default")]:
            if key not in ms_:
                continue
            t = ms_[key]
            cells = [f"  {key:10s} {t:8.4f}"]
            if isinstance(jla, float) and key != "jla":
                cells.append(f"{t / jla:5.3f}x jla")
            for other in ("default", "jla"):
                if other != key and other in rounds and key in rounds:
                    n = sum(a < b for a, b in zip(rounds[key], rounds[other]))
                    cells.append(f"<{other} {n}/{min(len(rounds[key]), len(rounds[other]))}")
            n = r["numerics"].get(key)
            if n:
                cells.append(f"o {n['o']:.2e} state {n['state']:.2e}{'' if n['o_finite'] else ' NONFINITE'}")
            cells.append("rounds " + "/".join(f"{x:.4f}" for x in rounds.get(key, [])))
            log("  ".join(cells))
        if r["stages"]:
            log("  stages of the default: " + " ".join(f"{k}={v:.4f}" for k, v in r["stages"].items()))
        if r.get("skipped"):
            log(f"  skipped: {', '.join(r['skipped'][:8])}")
    for e in result["errors"][:12]:
        log("error: " + e[:300])
    kit.log_closing(log, result, left)


if __name__ == "__main__":
    main()
