"""B1-T8192-Hk2-Hv8 at or under jla (issue 14, session 9, helper S9; pallas_kernels/gated_delta_rule/mosaic_gpu.py's
MosaicConfig split fields and mosaic_gpu_split.py's first piece from h0, NOTES.md "Session 9: the Hk2-Hv8 row").

    python benchmarks/gpu/gdn_dense_s9.py [--quick] [--plan 1|2] [--budget S] [--test-timeout S] [--no-tests]
                                          [--others] [--workers W] [--only K,...]
    (writes $OUT/gdn_dense_s9.{json,log}; OUT=/tmp/out)

0. GPU tests (tests/pallas_kernels/test_gdn_mosaic_gpu.py) start FIRST in a child process, while this process
   compiles; the timing waits for the child (--test-timeout from the start, then it is killed), so the GPU is
   quiet while timing. Plan 1: the map kernel from h0 against its twin, the op split with first="h0" / the XLA
   serial scan / P = 3, 5, 6 against float64 at weak decay; plan 2: op_fwd's new defaults (P = 4) and the split
   at P = 2 and 8 against float64 at weak decay, the split variants agree.
1. Plan 1 (run 1): B1-T8192-Hk2-Hv8 (bench inputs: bf16 q, k, v, beta, fp32 g and initial state, final state
   out): jla (``jax_gdn.bench._jla_impl``), our dense entry with ``mosaic_gpu.DEFAULT_CONFIG`` ("default") and
   variants (``pP`` pieces = P, ``.serial`` split_scan "serial" (jla's dense scan), ``.h0`` split_first "h0":
   piece 0 walked from h0, no identity blocks on it, one scan product less), each a jitted
   ``mosaic_gpu.chunk_gated_delta_rule_fwd`` as ``op_fwd`` calls it; --others adds the other four dense rows'
   default and jla. Plan 2 (run 2, after FIRST = "h0" and SCAN = "auto"): the three split rows (Hk2-Hv8 and the
   64-CTA rows at P = 2), jla, the new default and session 8's split ("s8": first piece mapped from [I | 0], Triton
   scan); --others adds the unsplit rows. Compiled in a thread pool (what the deadline leaves
   uncompiled is skipped), timed in 3 interleaved rounds (order rotated and reversed), every cell with
   ``jax_gdn.bench.time_jax`` in this one process.
2. Numerics of every timed variant against the XLA backend in fp32 (precision highest): o and final state relative
   RMS (bf16 bound 1e-2), o finite.
3. The launches of each compiled op (non-trivial instructions of the optimized HLO's entry computation: fusions,
   custom calls (the kernels), copies, ...), so the glue is counted.
4. Parts at P = 4 and 5 (plan 1) where the budget allows (separate jitted calls, so each carries a dispatch):
   prep (glue + kkt), the map pass from [I | 0] and from h0, the Triton / serial scans, the fused pass.
A table is printed last: each variant's median over the rounds, its ratio to jla, and in how many rounds it beat
the default and jla (same round). --quick: CPU, tiny rows, the jnp twins (impl="reference"), no jla.
"""
from __future__ import annotations

import re
import time

import script_kit as kit

T_START = time.time()
log = kit.Log()
NAME = "gdn_dense_s9"
ROUNDS = 3
ROW = "B1-T8192-Hk2-Hv8"
OTHERS = ["B16-T1024-Hk16-Hv32", "B1-T8192-Hk16-Hv32", "B4-T4096-Hk16-Hv32", "B1-T32768-Hk16-Hv32"]
TEST_FILE = "tests/pallas_kernels/test_gdn_mosaic_gpu.py::"
TEST_IDS = ["test_gpu_split_map_from_h0_matches_twin"] + [
    f"test_gpu_split_options_weak_decay_matches_f64[{i}]" for i in
    ("4-triton-h0-highest", "5-triton-h0-highest", "4-serial-h0-highest", "5-triton-map-highest",
     "5-triton-h0-default", "6-triton-h0-highest", "3-serial-map-highest")]
QUICK_TEST_IDS = ["test_config_split_fields_are_checked_and_passed_through",
                  "test_split_first_from_h0_matches_the_maps[4]", "test_piece_scan_first_end_skips_m0[4]"]

#: the Hk2-Hv8 variants beside jla and the default, in compile priority: name -> MosaicConfig overrides
VARIANTS = [
    ("p4.h0", dict(pieces=4, split_first="h0")),
    ("p4.serial", dict(pieces=4, split_scan="serial")),
    ("p5", dict(pieces=5)),
    ("p5.h0", dict(pieces=5, split_first="h0")),
    ("p4.h0.tf32", dict(pieces=4, split_first="h0", split_precision="default")),
    ("p4.h0.serial", dict(pieces=4, split_first="h0", split_scan="serial")),
    ("p6", dict(pieces=6)),
    ("p5.h0.serial", dict(pieces=5, split_first="h0", split_scan="serial")),
    ("p5.h0.tf32", dict(pieces=5, split_first="h0", split_precision="default")),
    ("p3", dict(pieces=3)),
    ("p6.h0", dict(pieces=6, split_first="h0")),
    ("p8", dict(pieces=8)),
]
#: --plan 2 (after run 1 set FIRST = "h0", SCAN = "auto"): per row, the variants beside jla and the new default;
#: "s8" is session 8's split (first piece mapped from [I | 0], the Triton scan at every P)
S8 = dict(split_first="map", split_scan="triton")
#: (the split rows only: B16-T1024 and B4-T4096 are not split, and no code they run changed; --others adds them)
VARIANTS_2 = {ROW: [("s8", S8)], "B1-T8192-Hk16-Hv32": [("s8", S8)], "B1-T32768-Hk16-Hv32": [("s8", S8)]}
TEST_IDS_2 = ["test_gpu_default_config_matches_f64[4000-2-4]"] + [
    f"test_gpu_split_op_weak_decay_matches_f64[{i}]" for i in ("1000-2-True", "1000-8-True")] + [
    "test_gpu_split_variants_agree"]
TRIVIAL = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant"}


def launches(compiled) -> dict:
    """Opcode -> count of the non-trivial instructions in the optimized HLO's ENTRY computation (each fusion,
    custom call, copy, ... is a launch; a while loop or conditional counts once)."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001
        return {}
    m = re.search(r"^ENTRY .*?\{\n(.*?)^\}", text, re.S | re.M)
    if not m:
        return {}
    counts = {}
    for line in m.group(1).splitlines():
        op = re.search(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", line)
        if op and op.group(1) not in TRIVIAL:
            counts[op.group(1)] = counts.get(op.group(1), 0) + 1
    return counts


def main():
    ap = kit.arg_parser(__doc__, budget=200.0, test_timeout=100.0,
                        quick_help="CPU smoke run at tiny sizes (the jnp twins)")
    ap.add_argument("--others", action="store_true", help="also the other four dense rows' default and jla")
    ap.add_argument("--workers", type=int, default=8, help="compile threads (1: serial)")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--plan", default="2", choices=("1", "2"),
                    help="1: run 1's sweep at Hk2-Hv8; 2: the new defaults (FIRST h0, SCAN auto) on all five rows "
                         "against session 8's split")
    opts, out_dir, left = kit.parse(ap, T_START, cpu_quick=True)
    quick = opts.quick
    result = {"quick": quick, "budget_s": opts.budget, "rows": [], "errors": [], "skipped": []}

    # ---- the GPU tests start first, in a child (they compile while we compile) ---------------------------------
    child = None
    if not opts.no_tests:
        ids = QUICK_TEST_IDS if quick else TEST_IDS if opts.plan == "1" else TEST_IDS_2
        args = ["-v", "-p", "no:randomly", "-p", "no:cacheprovider"] + [TEST_FILE + i for i in ids]
        child = kit.ChildTests.start(args, quick=quick)
        log(f"== GPU tests: {len(ids)} started in a child process (killed at {opts.test_timeout:.0f} s from start)")

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
                  default=dataclasses.asdict(mg.DEFAULT_CONFIG), scan=ms.SCAN, first=ms.FIRST, paired=str(ms.PAIRED))
    log(f"device {result['device']} jax {jax.__version__}; default {mg.DEFAULT_CONFIG}; {left():.0f} s left")
    if quick:
        cases = {ROW: Case("quick-B1-T1024-Hk1-Hv2-K16-V16", 1, 1024, 1, 2, 16, 16)}
        if opts.others or opts.plan == "2":
            cases[OTHERS[0]] = Case("quick-B2-T130-Hk1-Hv2-K16-V16", 2, 130, 1, 2, 16, 16)
        timer = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)   # noqa: E731
        impl = "reference"
    else:
        names = [ROW] + (OTHERS if opts.others else [n for n in OTHERS if n in VARIANTS_2] if opts.plan == "2"
                         else [])
        cases = {n: next(c for c in BENCH_CASES if c.lens is None and c.name.startswith(n)) for n in names}
        timer = lambda fn, args: time_jax(fn, args, groups=9)   # noqa: E731 (x 3 rounds: 27 groups)
        impl = "mosaic"
    kernel = impl == "mosaic"
    quick_rows = {ROW: ROW, OTHERS[0]: "B1-T8192-Hk16-Hv32"}      # --quick: the split variants on both rows

    def row_variants(name):
        if opts.plan == "1":
            vs = VARIANTS if name == ROW else []
        else:
            vs = VARIANTS_2.get(quick_rows.get(name, name) if quick else name, [])
        return [v for v in vs if not opts.only or v[0] in opts.only.split(",")]

    def op(cfg):
        def fn(q, k, v, g, beta, h0):
            return mg.chunk_gated_delta_rule_fwd(q, k, v, g.astype(jnp.float32), beta, h0,
                                                 scale=float(q.shape[3]) ** -0.5, output_final_state=True,
                                                 impl=impl, stage1a=cfg.stage1a, pieces=cfg.pieces, exp2=cfg.exp2,
                                                 state_kv=cfg.state_kv, split_chain=cfg.split_chain,
                                                 split_scan=cfg.split_scan, split_first=cfg.split_first,
                                                 split_precision=cfg.split_precision)
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
        row = {"case": case.name, "ms": {}, "rounds": {}, "numerics": {}, "configs": {}, "launches": {},
               "parts": {}}
        rows[name] = row
        result["rows"].append(row)
        row["default_pieces"] = mg.DEFAULT_CONFIG.pieces or mg.split_pieces(
            case.B, case.Hv, case.K, case.V, case.T + (-case.T) % mg.C, has_h0=True) if kernel else "-"
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
        for tier, (key, over) in enumerate(row_variants(name), start=1):
            cfg = dataclasses.replace(mg.DEFAULT_CONFIG, **over)
            row["configs"][key] = dataclasses.asdict(cfg)
            jobs.append((name, key, op(cfg), args, tier))
    jobs.sort(key=lambda j: (j[4], list(cases).index(j[0])))
    save()

    # ---- compile (a thread pool; the deadline cancels what has not started) --------------------------------------
    compiled, t_c = {}, time.time()
    compile_stop = 80.0 if not quick else 5.0        # seconds that must be left when a compile starts

    def compile_job(i):
        name, key, fn, a, _ = jobs[i]
        if left() < compile_stop:
            return i, None, "deadline"
        t = time.time()
        try:
            c = fn.lower(*a).compile()
            log(f"  compiled {name:20s} {key:13s} in {time.time() - t:5.1f} s ({left():.0f} s left)")
            return i, c, None
        except Exception as e:  # noqa: BLE001 - reported; the job is then not timed
            return i, None, f"{type(e).__name__}: {str(e)[:400]}"

    workers = max(1, opts.workers)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, c, err in pool.map(compile_job, range(len(jobs))):
            name, key = jobs[i][0], jobs[i][1]
            if c is not None:
                compiled[i] = c
                if key not in ("xla_fp32",):
                    rows[name]["launches"][key] = launches(c)
            elif err == "deadline":
                rows[name].setdefault("skipped", []).append(f"{key} (not compiled: budget)")
            else:
                result["errors"].append(f"{name} {key} compile: {err}")
                log(f"  compile FAIL {name} {key}: {err}")
    log(f"compiled {len(compiled)} of {len(jobs)} jobs in {time.time() - t_c:.0f} s with {workers} threads "
        f"({left():.0f} s left)")
    for name, row in rows.items():
        for key, cnt in row["launches"].items():
            log(f"  launches {name:20s} {key:13s} {sum(cnt.values()):3d}: " +
                " ".join(f"{k}={v}" for k, v in sorted(cnt.items())))
    save()

    # ---- the child's tests end before anything is timed ----------------------------------------------------------
    def finish_tests():
        if child is None or child.rc is not None:
            return
        child.wait(max(1.0, opts.test_timeout - (time.time() - T_START)))
        child.record(result, log)
        save()

    # ---- numerics: each variant's first call against the fp32 XLA backend ---------------------------------------
    refs, timed = {}, {}
    finish_tests()
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
                log(f"  {name:20s} {key:13s} numerics o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']}")
            del res
        except Exception as e:  # noqa: BLE001 - a variant that fails its first call is not timed
            result["errors"].append(f"{name} {key}: {type(e).__name__}: {str(e)[:400]}")
            log(f"  FAIL {name} {key}: {type(e).__name__}: {str(e)[:400]}")
    refs.clear()
    save()

    # ---- timing: interleaved rounds, the order rotated each round ------------------------------------------------
    round_need = 2.0 if quick else 0.5
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
                if left() < 25 + round_need:   # leave the parts their time
                    rows[name].setdefault("skipped", []).append(f"{key} round {rnd}")
                    continue
                try:
                    ms_ = round(timer(compiled[i], a), 4)
                    rows[name]["rounds"].setdefault(key, []).append(ms_)
                except Exception as e:  # noqa: BLE001
                    result["errors"].append(f"{name} {key} round {rnd}: {type(e).__name__}: {str(e)[:300]}")
            got = {k: v[rnd] for k, v in rows[name]["rounds"].items() if len(v) > rnd}
            log(f"  round {rnd} {name:20s} " + " ".join(f"{jobs[i][1]}={got.get(jobs[i][1], '-')}" for i in order)
                + f"   ({left():.0f} s left)")
        save()
    for row in rows.values():
        for key, ts in row["rounds"].items():
            row["ms"][key] = sorted(ts)[len(ts) // 2]
    del compiled
    save()

    # ---- parts at P = 4 and 5 ------------------------------------------------------------------------------------
    for p in ((4, 5) if opts.plan == "1" else ()):
        kit.guarded(f"parts P={p}", 12, lambda p=p: parts(cases[ROW], rows[ROW], p, quick), left=left, log=log,
                    res=result, save=save)
    finish_tests()
    finish(result, left)
    save()


def parts(case, row, pieces, quick):
    """The split's parts at P pieces, each a jitted call: prep (glue + kkt), map pass from [I | 0] / from h0,
    Triton / serial scan (from each map), the fused pass."""
    import jax
    import jax.numpy as jnp
    from jax_gdn.bench import time_jax
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    from pallas_kernels.gated_delta_rule import mosaic_gpu_split as ms
    kernel = not quick
    timer = (lambda fn, a: time_jax(fn, a, warmup=1, groups=1, per_group=1)) if quick else time_jax
    _, args = kit.bench_inputs(case)
    cfg = mg.DEFAULT_CONFIG
    out = row["parts"].setdefault(f"p{pieces}", {})
    prep = jax.jit(lambda *a: mg._prepare_head_major(*a[:3], a[3].astype(jnp.float32), *a[4:], kernel=kernel,
                                                     pieces=pieces, exp2=cfg.exp2))
    ops_ = jax.block_until_ready(prep(*args))
    out["prep"] = round(timer(prep, args), 4)
    b, hv, kd, vd = case.B, case.Hv, case.K, case.V
    mapf = ms.state_map_pass if kernel else ms.state_map_pass_reference
    maps = {}
    for first in ("map", "h0"):
        fn = jax.jit(lambda *o, first=first: mapf(*o[1:6], pieces=pieces, exp2=cfg.exp2,
                                                  **(dict(h0t=o[6]) if first == "h0" else dict(need_first=True)))
                     .reshape(b, pieces - 1, hv, kd + vd, kd))
        maps[first] = jax.block_until_ready(fn(*ops_))
        out[f"map.{first}"] = round(timer(fn, ops_), 4)
    for method in ("triton", "serial"):
        for first in ("map", "h0"):
            fn = jax.jit(lambda m, h, method=method, first=first: ms.piece_scan(
                m, h, key_dim=kd, method=method, interpret=not kernel, first_end=first == "h0"))
            starts = jax.block_until_ready(fn(maps[first], ops_[6]))
            out[f"scan.{method}.{first}"] = round(timer(fn, (maps[first], ops_[6])), 4)
    fn = jax.jit(lambda m, h: ms.piece_scan(m, h, key_dim=kd, method="triton", precision="default",
                                            interpret=not kernel, first_end=True))
    jax.block_until_ready(fn(maps["h0"], ops_[6]))
    out["scan.triton.h0.tf32"] = round(timer(fn, (maps["h0"], ops_[6])), 4)
    starts = starts.reshape(b * pieces, hv, vd, kd)
    run = mg.fused_state_pass if kernel else mg.fused_state_pass_reference
    fused = jax.jit(lambda *o: run(*o, scale=kd ** -0.5, out_final=True, head_major=True, pieces=pieces,
                                   exp2=cfg.exp2))
    out["fused"] = round(timer(fused, tuple(ops_[:6]) + (starts,)), 4)
    log(f"  parts P = {pieces}: " + " ".join(f"{k}={v:.4f}" for k, v in out.items()))


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
            cells = [f"  {key:12s} {t:8.4f}"]
            if isinstance(jla, float) and key != "jla":
                cells.append(f"{t / jla:5.3f}x jla")
            for other in ("default", "jla"):
                if other != key and other in rounds and key in rounds:
                    n = sum(a < b for a, b in zip(rounds[key], rounds[other]))
                    cells.append(f"<{other} {n}/{min(len(rounds[key]), len(rounds[other]))}")
            n = r["numerics"].get(key)
            if n:
                cells.append(f"o {n['o']:.2e} s {n['state']:.2e}{'' if n['o_finite'] else ' NONFINITE'}")
            cnt = r["launches"].get(key)
            if cnt:
                cells.append(f"L{sum(cnt.values())}")
            cells.append("r " + "/".join(f"{x:.4f}" for x in rounds.get(key, [])))
            log(" ".join(cells))
        for p, d in r.get("parts", {}).items():
            log(f"  parts {p}: " + " ".join(f"{k}={v:.4f}" for k, v in d.items()))
        if r.get("skipped"):
            log(f"  skipped: {', '.join(r['skipped'][:8])}")
    for e in result["errors"][:10]:
        log("error: " + e[:300])
    kit.log_closing(log, result, left)


if __name__ == "__main__":
    main()
