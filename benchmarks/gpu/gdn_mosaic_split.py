"""The Mosaic GPU sequence split's start states at jla's speed (issue 14, session 7, helper S;
pallas_kernels/gated_delta_rule/mosaic_gpu_split.py, NOTES.md "Session 7: Mosaic split").

    python benchmarks/gpu/gdn_mosaic_split.py [--quick] [--budget S] [--test-timeout S]
    (writes $OUT/gdn_mosaic_split.{json,log}; OUT=/tmp/out)

1. The split's GPU tests (tests/pallas_kernels/test_gdn_mosaic_gpu.py: the map kernel against its jnp twin, the
   op split at P = 2, 4, 8 against float64 at weak decay, the map / scan variants against each other) in a child
   process with a timeout, -v. If the map kernel's test does not pass, the timings below leave the new kernel out
   (a hang there would cost the whole run) and time session 6's map (``map_impl="fused"``) instead.
2. B1-T8192-Hk2-Hv8 (the bench's inputs: bf16 q, k, v, beta, fp32 g and initial state, final state out), each
   timed as jax_gdn.bench's kernel section does (bench.time_jax: median of 15 groups of 10 back-to-back calls) in
   this one process: jla (the bench's column), our op unsplit and at P = 2, 4, 8 (``chunk_gated_delta_rule_fwd``,
   Mosaic stage 1a, the map kernel and the serial scan), and per part at P = 4, 8: the map pass alone, the scan
   alone (serial and log), the start states (map + scan; session 6's form: the fused kernel over [0 | v] + the
   log scan), the op with the log scan. Numerics of the split op against the fp32 XLA backend (rel RMS).
3. B1-T8192-Hk16-Hv32 and B1-T32768-Hk16-Hv32 at P = 1, 2 (does a split pay at 64 CTAs with the cheaper map?),
   jla beside them where the budget allows.
A deadline (--budget, default 80 s from start) skips what would not fit; every measurement is wrapped in
try/except. A table is printed last. --quick: CPU, a tiny case, the jnp twins (impl="reference"), no jla.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

T_START = time.time()
LOG_LINES: list[str] = []
NAME = "gdn_mosaic_split"
TEST_FILE = "tests/pallas_kernels/test_gdn_mosaic_gpu.py::"
TEST_IDS = ["test_gpu_split_map_pass_matches_twin[True]", "test_gpu_split_op_weak_decay_matches_f64[1000-4-True]",
            "test_gpu_split_op_weak_decay_matches_f64[1000-8-False]",
            "test_gpu_split_op_weak_decay_matches_f64[130-8-True]", "test_gpu_split_variants_agree",
            "test_gpu_split_map_pass_matches_twin[False]", "test_gpu_split_op_weak_decay_matches_f64[1000-2-True]",
            "test_gpu_split_op_weak_decay_matches_f64[130-2-False]",
            "test_gpu_split_op_weak_decay_matches_f64[1000-8-True]", "test_gpu_split_k128_grouped[mosaic]",
            "test_gpu_mosaic_stage1a_matches_f64[130-2]"]
MAP_TEST = "test_gpu_split_map_pass_matches_twin[True]"


def log(*parts):
    line = " ".join(str(p) for p in parts)
    LOG_LINES.append(line)
    print(line, flush=True)


def rel(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(float(np.sqrt(np.mean(b ** 2))), 1e-30))


def run_tests(quick: bool, timeout: float, result: dict):
    """The split's GPU tests in a child process (a CUDA error or a hang cannot cost the timings)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:randomly", "-p", "no:cacheprovider"]
    cmd += [TEST_FILE + i for i in TEST_IDS]
    log(f"== GPU tests (timeout {timeout:.0f} s): {len(TEST_IDS)} split tests")
    env = dict(os.environ)
    if quick:
        env["JAX_PLATFORMS"] = "cpu"
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    verdicts = [ln.strip() for ln in out.splitlines() if "::" in ln and any(
        w in ln for w in ("PASSED", "FAILED", "SKIPPED", "ERROR"))]
    fails = [ln for ln in out.splitlines() if ln.startswith(("E  ", "FAILED", "ERROR"))][:30]
    for ln in verdicts:
        log("  " + ln.split("::", 1)[1])
    for ln in fails:
        log("  " + ln[:300])
    summary = [ln for ln in out.splitlines() if " passed" in ln or " failed" in ln][-1:]
    log(f"  tests rc={rc} in {time.time() - t0:.0f} s {summary}")
    result["tests"] = {"rc": rc, "seconds": round(time.time() - t0, 1), "verdicts": verdicts, "failures": fails}
    return any(MAP_TEST in v and "PASSED" in v for v in verdicts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at tiny sizes (the jnp twins)")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds from start; later steps are skipped")
    ap.add_argument("--test-timeout", type=float, default=28.0, help="seconds for the child's GPU tests")
    ap.add_argument("--no-tests", action="store_true")
    opts = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    quick = opts.quick

    def left():
        return opts.budget - (time.time() - T_START)

    result = {"quick": quick, "budget_s": opts.budget, "rows": [], "errors": []}
    map_ok = True
    if not opts.no_tests:
        map_ok = run_tests(quick, min(opts.test_timeout, max(left() - 40, 5)), result) or quick
    result["map_kernel_timed"] = map_ok

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import ops
    from jax_gdn.bench import make_inputs_np, time_jax
    from jax_gdn.cases import BENCH_CASES, Case
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    from pallas_kernels.gated_delta_rule import mosaic_gpu_split as ms

    if not quick:
        jax.config.update("jax_default_matmul_precision", "highest")   # fp32 references; the kernels are bf16
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
    map_impl = "map" if map_ok else "fused"
    log(f"device {result['device']} jax {jax.__version__}; map kernel timed: {map_ok}; {left():.0f} s left")

    def timed(row, key, fn, args, min_left=4.0):
        if left() < min_left:
            row["ms"][key] = None
            row.setdefault("skipped", []).append(key)
            return None
        try:
            res = jax.block_until_ready(fn(*args))
            row["ms"][key] = round(timer(fn, args), 4)
            log(f"  {row['case']:22s} {key:16s} {row['ms'][key]:8.4f} ms   ({left():.0f} s left)")
            return res
        except Exception as e:  # noqa: BLE001 - report and go on
            row["ms"][key] = None
            msg = f"{row['case']} {key}: {type(e).__name__}: {str(e)[:400]}"
            result["errors"].append(msg)
            log("  FAIL " + msg)
            return None

    def op(pieces, scan=None):
        if scan is None and map_ok:     # the op as the backend runs it (MAP / SCAN defaults)
            return jax.jit(lambda q, k, v, g, beta, h0: mg.chunk_gated_delta_rule_fwd(
                q, k, v, g, beta, h0, output_final_state=True, impl=impl, stage1a="mosaic", pieces=pieces))

        def fn(q, k, v, g, beta, h0):   # the same composition with a chosen map / scan
            t = q.shape[1]
            ops_ = mg._prepare_head_major(q, k, v, g, beta, h0, kernel=kernel, pieces=pieces)
            starts = ms.start_states(ops_, pieces, kernel=kernel, head_major=True, map_impl=map_impl, scan=scan)
            run = mg.fused_state_pass if kernel else mg.fused_state_pass_reference
            o, ht = run(*ops_[:6], starts, scale=q.shape[3] ** -0.5, out_final=True, head_major=True, pieces=pieces)
            ht = ht.reshape((q.shape[0], pieces) + ht.shape[1:])[:, -1]
            return o[:, :t], jnp.swapaxes(ht, -1, -2)
        return jax.jit(fn)

    def args_of(case):
        host = make_inputs_np(case, 0)
        bf = jnp.bfloat16
        return host, (jnp.asarray(host[0], bf), jnp.asarray(host[1], bf), jnp.asarray(host[2], bf),
                      jnp.asarray(host[3]), jnp.asarray(host[4], bf), jnp.asarray(host[5]))

    def reference(args):
        f32 = [x.astype(jnp.float32) for x in args]
        return jax.block_until_ready(jax.jit(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="xla"))(*f32))

    def numerics(row, name, res, ref):
        if res is None or ref is None:
            return
        o = np.asarray(res[0].astype(jnp.float32))
        row["numerics"][name] = {"o": rel(o, ref[0]), "state": rel(res[1], ref[1]), "o_finite": bool(np.isfinite(o).all())}
        n = row["numerics"][name]
        log(f"  numerics {name}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']} (vs fp32 XLA; bf16 1e-2)")

    def jla(row, case, host):
        if quick:
            return
        try:
            from jax_gdn.bench import _jla_impl
            timed(row, "jla", *_jla_impl(case, host))
        except Exception as e:  # noqa: BLE001
            row["ms"]["jla"] = None
            result["errors"].append(f"{case.name} jla: {type(e).__name__}: {str(e)[:300]}")

    # ---- B1-T8192-Hk2-Hv8: the target row --------------------------------------------------------------------
    case = cases[0]
    host, args = args_of(case)
    row = {"case": case.name, "ms": {}, "numerics": {}}
    result["rows"].append(row)
    jla(row, case, host)
    ref = None
    try:
        ref = reference(args) if left() > 20 else None
    except Exception as e:  # noqa: BLE001
        result["errors"].append(f"reference: {type(e).__name__}: {str(e)[:300]}")
    pieces_list = (1, 2, 4, 8) if not quick else (1, 2, 4)
    for p in pieces_list:
        res = timed(row, f"p{p}", op(p), args)
        if p in (1, 4, 8) or quick:
            numerics(row, f"p{p}", res, ref)
        del res
        _write(out_dir, result)
    def parts(p):
        """The split's parts at P = p on row A: map pass, both scans, start states (and session 6's at P = 8)."""
        try:
            ops_ = jax.block_until_ready(jax.jit(lambda *a: mg._prepare_head_major(
                *a, kernel=kernel, pieces=p))(*args))
            need_first = ops_[6] is not None
            map_fn = ms.state_map_pass if (kernel and map_ok) else ms.state_map_pass_reference
            maps = timed(row, f"map{p}", jax.jit(lambda k, v, t, g, b: map_fn(
                k, v, t, g, b, pieces=p, need_first=need_first)), ops_[1:6])
            if maps is not None:
                b_, _, hv, vd = ops_[2].shape
                kd = ops_[1].shape[3]
                maps5 = maps.reshape(b_, p - 1, hv, kd + vd, kd)
                for scan in ms.SCANS:
                    timed(row, f"scan{p}.{scan}", jax.jit(lambda m, h, scan=scan: ms.piece_scan(
                        m, h, key_dim=kd, method=scan)), (maps5, ops_[6]))
            timed(row, f"starts{p}", jax.jit(lambda o: ms.start_states(
                o, p, kernel=kernel, head_major=True, map_impl=map_impl)), (ops_,))
            if p == 8 and kernel:
                timed(row, "starts8.s6", jax.jit(lambda o: ms.start_states(
                    o, 8, kernel=True, head_major=True, map_impl="fused", scan="log")), (ops_,), min_left=8)
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"{row['case']} parts P={p}: {type(e).__name__}: {str(e)[:300]}")
            log(f"  parts P={p} FAIL {type(e).__name__}: {str(e)[:300]}")
        _write(out_dir, result)

    parts(8 if not quick else 4)

    # ---- the Hv 32 rows at P = 1, 2 ----------------------------------------------------------------------------
    rows_b = []
    for case_b in cases[1:]:
        if left() < 10:
            log(f"skip {case_b.name}: {left():.0f} s left")
            continue
        host_b, args_b = args_of(case_b)
        row_b = {"case": case_b.name, "ms": {}, "numerics": {}}
        result["rows"].append(row_b)
        rows_b.append((case_b, host_b, row_b))
        for p in (1, 2):
            timed(row_b, f"p{p}", op(p), args_b, min_left=6)
        del args_b
        _write(out_dir, result)

    # ---- what is left of row A, then jla beside the Hv 32 rows ---------------------------------------------------
    if not quick and left() > 12:
        parts(4)
    for p in ((8, 4) if not quick else (4,)):
        res = timed(row, f"p{p}.log", op(p, scan="log"), args, min_left=10)
        numerics(row, f"p{p}.log", res, ref)
        del res
    for case_b, host_b, row_b in rows_b:
        if left() > 10:
            jla(row_b, case_b, host_b)
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
            log(f"numerics {r['case']} {name}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']}")
    if "tests" in result:
        t = result["tests"]
        npass = sum("PASSED" in v for v in t["verdicts"])
        nfail = sum(("FAILED" in v or "ERROR" in v) for v in t["verdicts"])
        log(f"tests rc={t['rc']}: {npass} passed, {nfail} failed of {len(t['verdicts'])} reported")
    log(f"errors: {len(result['errors'])}; wall {time.time() - T_START:.0f} s (budget {opts.budget:.0f} s)")
    _write(out_dir, result)


def _write(out_dir, result):
    with open(os.path.join(out_dir, f"{NAME}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"{NAME}.log"), "w") as f:
        f.write("\n".join(LOG_LINES) + "\n")


if __name__ == "__main__":
    main()
