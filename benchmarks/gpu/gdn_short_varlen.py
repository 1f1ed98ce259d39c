"""One device run (session 7, issue 14): the per-token varlen kernel (recurrent_varlen.py) on mixes of short
sequences, against the chunked Triton path and FLA, to pick api's routing bound MAX_MEAN_LEN (L).

    python benchmarks/gpu/gdn_short_varlen.py [--quick] [--budget SECONDS]     (results under $OUT, default /tmp/out)

Steps, each skipped when the deadline (--budget, default 70 s from start) would not fit it:
  tests      (background, from t = 0, killed after --tests-timeout s) a child `pytest -m gpu` of
             tests/pallas_kernels/test_gdn_recurrent_varlen.py (tiny64-like mix with a 130-token and an empty
             sequence, Qwen3-Next heads, bf16 and fp32, slots with -1 / S ids, the pool donated, against float64);
             waited for before the first timing, so that it never runs beside one.
  numerics   tiny64-T171-Hk16-Hv32 (bf16 q/k/v/beta, fp32 g and initial states; fp32 inputs too) through the public
             op with backend "pallas": the recurrent kernel (the route) and the chunked path (route off) against the
             XLA per-token form in fp32 (matmul precision highest) on the same rounded inputs: relative RMS of o
             and of the final states, padding-free o finite.
  compile    (while the child runs) every timed program, compiled ahead: per mix the public op routed to the
             recurrent kernel and with the route off (the chunked kernels); on tiny64 also launch variants of
             RecurrentVarlenConfig (called through recurrent_varlen_fwd).
  time       each compiled program timed as jax_gdn.bench does (bench.time_jax: median of 15 groups of 10
             back-to-back calls closed by one sync, after 3 warm-up calls), plain API, initial states in, final
             states out; the recurrent vs chunked o / final states compared on every mix.
  fla        FLA's chunk_gated_delta_rule on the same inputs (its first call autotunes, ~40 s: warmed once on
             tiny64, then each mix warmed and timed as bench._time_fla does (do_bench median), and by the same
             wall-clock groups as ours beside it).
Mixes: tiny64-T171 (jax_gdn.cases), then N = 256 and N = 64 sequences with lengths uniform in [1, 2m - 1]
(mean m = 2, 4, 8, 16, 32; seed 0), and N = 64 with one 449-token sequence among 63 one-token ones (T 512: the
worst case of a route at L = 8, its tokens serial); Hk 16, Hv 32, K = V = 128.
Writes $OUT/gdn_short_varlen.json and $OUT/gdn_short_varlen.log; prints the table last (ms, and per N the largest
m where the recurrent kernel is at or under the chunked path: the L it supports).
--plan a: run 1's jobs (above). --plan b (default, run 2, after the prefetch): numerics of the recurrent route only;
the recurrent route and RecurrentVarlenConfig variants (prefetch off = run 1's kernel, BV 32 on 1 or 2 warps, 4
warps, 2 stages, BV 16 on 1 warp) on tiny64 and N 256 mean 16 / 8 / 4 (whose chunked times run 1 has), then both routes on N 64 mean
16, the worst case (recurrent only), both on N 256 mean 32, N 64 mean 32 / 8; no FLA.
--quick: the same steps on CPU at tiny sizes in interpret mode, no FLA (a check of this script, not a measurement).
"""
from __future__ import annotations

import functools
import os
import sys
import time

import script_kit as kit

T0 = time.time()
log = kit.Log()
sys.path.insert(0, kit.REPO)


def main():
    ap = kit.arg_parser(__doc__, budget=70.0)
    ap.add_argument("--tests-timeout", type=float, default=30.0)
    ap.add_argument("--plan", default="b", choices=("a", "b"),
                    help="a: run 1's job list; b (run 2): the prefetch and launch variants on the longer mixes, the "
                    "crossover at N 64 and N 256 mean 32, the worst case; no chunked tiny64, no FLA")
    ap.add_argument("--time-reserve", type=float, default=14.0,
                    help="compiles stop when less than this is left (kept for timing what was compiled)")
    args, out, left = kit.parse(ap, T0, cpu_quick=True)
    quick = args.quick

    # ---- the GPU tests, in a child process from the start (it only competes with compiles and numerics) ----
    child = kit.ChildTests.start(["-q", "-s", "-m", "gpu", "-p", "no:randomly", "-p", "no:cacheprovider",
                                  "tests/pallas_kernels/test_gdn_recurrent_varlen.py"],
                                 quick=quick, log_path=os.path.join(out, "gdn_short_varlen_tests.log"))

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import bench
    from jax_gdn.cases import TINY64_LENS, Case
    from pallas_kernels.gated_delta_rule import api
    from pallas_kernels.gated_delta_rule import recurrent_varlen as rv

    dev = jax.devices()[0]
    res = {"device": str(getattr(dev, "device_kind", dev.platform)), "jax": jax.__version__, "quick": quick,
           "budget_s": args.budget, "tests": {}, "numerics": [], "rows": [], "skipped": [], "errors": []}
    log(f"device {res['device']} jax {jax.__version__}")
    backend = "pallas_interpret" if quick else "pallas"
    timing = dict(warmup=1, groups=2, per_group=2) if quick else dict(warmup=3, groups=15, per_group=10)
    RC = rv.RecurrentVarlenConfig

    rel = kit.relative_rms

    def save():
        kit.save(out, "gdn_short_varlen", res, log.lines)

    guarded = functools.partial(kit.guarded, left=left, log=log, res=res, save=save)

    # ---- mixes ----
    if quick:
        hk, hv, d = 1, 2, 16
        mix_ns, mix_ms = (8,), (2, 4)
        tiny = Case("quick-tiny8", 1, 0, hk, hv, d, d, TINY64_LENS[:8])
    else:
        hk, hv, d = 16, 32, 128
        mix_ns, mix_ms = (256, 64), (8, 16, 4, 32, 2)          # most informative first (the crossover)
        tiny = Case("tiny64-T171-Hk16-Hv32", 1, 0, hk, hv, d, d, TINY64_LENS)
    tiny = Case(tiny.name, 1, sum(tiny.lens), hk, hv, d, d, tiny.lens)
    cases = [tiny]
    for n in mix_ns:
        for m in mix_ms:
            lens = tuple(int(x) for x in np.random.default_rng(0).integers(1, 2 * m, n))
            cases.append(Case(f"N{n}-mean{m}-T{sum(lens)}", 1, sum(lens), hk, hv, d, d, lens))
    # the worst case of a route at mean 8: one long sequence among one-token ones (its tokens run serially)
    long_lens = (1,) * (mix_ns[-1] - 1) + (7 * mix_ns[-1] + 1,)
    cases.append(Case(f"N{mix_ns[-1]}-one-long-T{sum(long_lens)}", 1, sum(long_lens), hk, hv, d, d, long_lens))

    h0_by_n = {}

    def inputs(case):
        """(host inputs for FLA (a callable: built on demand), device inputs). tiny64: bench.make_inputs_np's
        exactly; the mixes: the same laws, with the initial states [N, Hv, K, V] drawn once per N on the device
        (N 256: 537 MB, too slow to draw on the host for every mix)."""
        if case is tiny:
            q, k, v, g, beta, h0 = bench.make_inputs_np(case)
            h0 = jnp.asarray(h0)
        else:
            rng = np.random.default_rng(case.T)
            q, k = (rng.standard_normal((1, case.T, hk, d), np.float32) for _ in range(2))
            q /= np.linalg.norm(q, axis=-1, keepdims=True)
            k /= np.linalg.norm(k, axis=-1, keepdims=True)
            v = rng.standard_normal((1, case.T, hv, d), np.float32)
            g = np.log(rng.uniform(0.9, 0.999, (1, case.T, hv))).astype(np.float32)
            beta = rng.uniform(0.05, 0.95, (1, case.T, hv)).astype(np.float32)
            n = case.num_seqs
            if n not in h0_by_n:
                h0_by_n[n] = 0.1 * jax.random.normal(jax.random.PRNGKey(n), (n, hv, d, d), jnp.float32)
            h0 = h0_by_n[n]
        xs = kit.bf16_inputs((q, k, v, g, beta, h0)) + (jnp.asarray(case.cu_seqlens(), jnp.int32),)
        return (lambda: (q, k, v, g, beta, np.asarray(h0))), xs

    def public(route: bool):
        """The public op as bench times it, traced with the route on (MAX_MEAN_LEN huge) or off (0)."""
        def fn(q, k, v, g, beta, h0, cu):
            return api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu, backend=backend)
        return fn, (10 ** 9 if route else 0)

    def variant(cfg):
        def fn(q, k, v, g, beta, h0, cu):
            return rv.recurrent_varlen_fwd(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                                           cu_seqlens=cu, output_final_state=True, interpret=quick, config=cfg)
        return fn, None

    cache = {}

    def compile_fn(fn_and_bound, xs, key=None):
        """jit(fn).lower(*xs).compile() with the route bound set while tracing; ``key``: reuse a program."""
        if key is not None and key in cache:
            return cache[key]
        fn, bound = fn_and_bound
        saved = rv.MAX_MEAN_LEN
        try:
            if bound is not None:
                rv.MAX_MEAN_LEN = bound
            compiled = jax.jit(fn).lower(*xs).compile()
        finally:
            rv.MAX_MEAN_LEN = saved
        if key is not None:
            cache[key] = compiled
        return compiled

    # ---- numerics on tiny64 ----
    @jax.jit
    def xla_ref(q, k, v, g, beta, h0, cu):
        return api.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu)

    def numerics():
        _, xs = inputs(tiny)
        # fp32 inputs on CPU only: the GPU child tests fp32 against float64
        for dname in ("bf16", "fp32") if quick else ("bf16",):
            if dname == "fp32":
                xs = tuple(x.astype(jnp.float32) for x in xs[:6]) + (xs[6],)
            x32 = tuple(x.astype(jnp.float32) for x in xs[:6]) + (xs[6],)
            with jax.default_matmul_precision("highest"):
                o_ref, f_ref = xla_ref(*x32)
            routes = (("recurrent", True), ("chunked", False)) if args.plan == "a" or quick else (("recurrent", True),)
            for label, route in routes:
                o, f = compile_fn(public(route), xs, key=(tiny.name, label, dname))(*xs)
                row = {"case": tiny.name, "dtype": dname, "impl": f"{label} vs xla fp32", "o_rel": rel(o, o_ref),
                       "state_rel": rel(f, f_ref), "finite": bool(np.isfinite(np.asarray(o, np.float32)).all())}
                log("numerics", row)
                res["numerics"].append(row)

    guarded("numerics tiny64", 10, numerics)

    # ---- compile everything while the child runs, in priority order (what picks L first, FLA last) ----
    progs = []                                     # (case, impl label, compiled, xs, host)

    cfg_name = kit.config_name

    both = lambda case: [(case, "recurrent", public(True)), (case, "chunked", public(False))]
    var = lambda case, cfgs: [(case, f"recurrent {cfg_name(c)}", variant(c)) for c in cfgs]
    if quick:
        jobs = both(tiny) + var(tiny, [RC(block_v=16), RC(longest_first=True)])
        jobs += [j for c in cases[1:] for j in both(c)]
    elif args.plan == "b":
        mix = lambda n, m: next(c for c in cases[1:] if c.name.startswith(f"N{n}-mean{m}-"))
        rec = lambda case: [(case, "recurrent", public(True))]
        jobs = rec(tiny) + var(tiny, [RC(prefetch=False), RC(block_v=32, num_warps=1), RC(block_v=32)])
        jobs += rec(mix(256, 16)) + var(mix(256, 16), [RC(prefetch=False), RC(block_v=32, num_warps=1),
                                                        RC(block_v=32), RC(num_warps=4), RC(num_stages=2),
                                                        RC(block_v=16, num_warps=1)])
        jobs += rec(mix(256, 8)) + var(mix(256, 8), [RC(prefetch=False)])
        jobs += rec(mix(256, 4)) + var(mix(256, 4), [RC(prefetch=False)])
        jobs += both(mix(64, 16)) + rec(cases[-1]) + var(cases[-1], [RC(longest_first=True)])
        jobs += both(mix(256, 32))
        jobs += both(mix(64, 32)) + both(mix(64, 8))
    else:
        mix = lambda n, m: next(c for c in cases[1:] if c.name.startswith(f"N{n}-mean{m}-"))
        jobs = both(tiny) + var(tiny, [RC(num_warps=4), RC(block_v=128, num_warps=4)])
        for n, m in ((256, 8), (256, 16), (256, 4), (256, 32), (64, 8), (64, 16)):
            jobs += both(mix(n, m))
        jobs += both(cases[-1]) + var(cases[-1], [RC(longest_first=True)])
        jobs += var(mix(256, 8), [RC(num_warps=4), RC(longest_first=True), RC(num_stages=2)])
        jobs += var(tiny, [RC(longest_first=True), RC(num_stages=2), RC(block_v=32, num_warps=1)])
        for n, m in ((256, 2), (64, 4), (64, 32), (64, 2)):
            jobs += both(mix(n, m))

    data = {}
    for case, label, spec in jobs:
        def comp(case=case, label=label, spec=spec):
            if case.name not in data:
                data[case.name] = inputs(case)
            host, xs = data[case.name]
            t = time.time()
            progs.append((case, label, compile_fn(spec, xs, key=(case.name, label, "bf16")), xs, host))
            log(f"compiled {case.name} {label} in {time.time() - t:.1f} s")
        guarded(f"compile {case.name} {label}", args.time_reserve, comp)

    # ---- wait for the tests ----
    def wait_child():
        rc = child.wait(max(1.0, args.tests_timeout - left.elapsed()))
        text = child.text
        res["tests"] = {"rc": rc, "tail": text[-1500:],
                        "figures": [ln for ln in text.splitlines() if ln.startswith("FIGURE")]}
        log(f"tests rc={rc}")
        for ln in res["tests"]["figures"] + text.strip().splitlines()[-2:]:
            log("  " + ln)

    guarded("tests (wait)", 0, wait_child)

    # ---- time ours ----
    results = {}

    def time_one(case, label, compiled, xs):
        ms = bench.time_jax(compiled, xs, **timing)
        results.setdefault(case.name, {})[label] = ms
        log(f"time {case.name:28s} {label:38s} {ms:.4f} ms")

    @jax.jit
    def rel_dev(a, b):                            # on the device: N 256's final states are 537 MB
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.sqrt(jnp.sum((a - b) ** 2)) / jnp.maximum(jnp.sqrt(jnp.sum(b * b)), 1e-30)

    outs = {}
    for case, label, compiled, xs, host in progs:
        guarded(f"time {case.name} {label}", 2, lambda: time_one(case, label, compiled, xs))
        if label in ("recurrent", "chunked") and left() > 1:
            outs[(case.name, label)] = compiled(*xs)
            other = outs.get((case.name, "chunked" if label == "recurrent" else "recurrent"))
            if other is not None:
                a, b = outs.pop((case.name, "recurrent")), outs.pop((case.name, "chunked"))
                res["numerics"].append({"case": case.name, "dtype": "bf16", "impl": "recurrent vs chunked",
                                        "o_rel": float(rel_dev(a[0], b[0])), "state_rel": float(rel_dev(a[1], b[1]))})
                log("numerics", res["numerics"][-1])
    outs.clear()
    save()

    # ---- FLA ----
    def fla_warm():
        import torch
        t = time.time()
        fn = bench.fla_call(tiny, data[tiny.name][0]())
        fn()
        torch.cuda.synchronize()
        res["fla_first_call_s"] = time.time() - t
        log(f"FLA first call (autotune) {res['fla_first_call_s']:.1f} s")

    def fla_time(case):
        import torch
        t = time.time()
        host = data[case.name][0]()
        fn = bench.fla_call(case, host)
        fn()
        torch.cuda.synchronize()
        first = time.time() - t
        ms = bench._time_fla(case, host)
        times = []
        for _ in range(timing["groups"]):
            t1 = time.perf_counter()
            for _ in range(timing["per_group"]):
                fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t1) / timing["per_group"] * 1e3)
        wall = float(np.median(times))
        results.setdefault(case.name, {}).update({"fla": ms, "fla wall": wall})
        log(f"time {case.name:28s} {'fla (do_bench / wall)':38s} {ms:.4f} / {wall:.4f} ms (first call {first:.1f} s)")
        return first

    if quick or args.plan == "b":
        res["skipped"].append("fla (quick: no GPU)" if quick else "fla (plan b)")
    elif tiny.name in data:
        guarded("fla warm", 40, fla_warm)           # ~40 s of autotuning: only if the rest left that much
        if "fla_first_call_s" in res:
            last_first = res["fla_first_call_s"]
            for case in cases:
                if case.name not in data:
                    continue
                need = 3 if last_first < 3 else last_first + 3      # a new autotune may start on a new shape
                r = guarded(f"fla {case.name}", need, lambda case=case: fla_time(case))
                if r is not None:
                    last_first = r

    # ---- table, L ----
    res["rows"] = [{"case": c.name, "N": c.num_seqs, "T": c.T, "mean_len": round(c.T / c.num_seqs, 2),
                    "ms": results.get(c.name, {})} for c in cases]
    lines = ["", "==== gdn_short_varlen (ms, plain API, bf16, initial states in, final states out) ===="]
    cols = ["recurrent", "chunked", "fla", "fla wall"]
    lines.append(f"{'case':30s}{'mean':>6s}" + "".join(f"{c:>11s}" for c in cols) + f"{'rec/chk':>9s}{'rec/fla':>9s}")
    for r in res["rows"]:
        ms = r["ms"]
        f = lambda c: f"{ms[c]:11.4f}" if c in ms else f"{'-':>11s}"
        ratio = lambda a, b: f"{ms[a] / ms[b]:9.2f}" if a in ms and b in ms else f"{'-':>9s}"
        lines.append(f"{r['case']:30s}{r['mean_len']:6.1f}" + "".join(f(c) for c in cols)
                     + ratio("recurrent", "chunked") + ratio("recurrent", "fla"))
    for c in cases:
        vs = {k: v for k, v in results.get(c.name, {}).items() if k.startswith("recurrent ")}
        if vs:
            lines.append(f"{c.name} launch variants (default {results[c.name].get('recurrent', float('nan')):.4f}): "
                         + ", ".join(f"{k[10:]} {v:.4f}" for k, v in vs.items()))
    picks = {}
    for n in mix_ns:
        wins = [c.T / c.num_seqs for c in cases[1:] if c.num_seqs == n and "-mean" in c.name
                and "recurrent" in results.get(c.name, {})
                and "chunked" in results[c.name] and results[c.name]["recurrent"] <= results[c.name]["chunked"]]
        picks[n] = max(wins) if wins else None
    res["largest_mean_len_where_recurrent_wins"] = picks
    lines.append(f"largest mean length where recurrent <= chunked, per N: {picks}")
    for row in res["numerics"]:
        lines.append(f"numerics {row['case']} {row['dtype']} {row['impl']}: o {row['o_rel']:.2e} "
                     f"state {row['state_rel']:.2e}")
    lines.append(f"tests: rc {res['tests'].get('rc')} {res['tests'].get('figures')}")
    lines.append(f"skipped: {res['skipped']}; errors: {len(res['errors'])}; total {time.time() - T0:.0f} s")
    for ln in lines:
        log(ln)
    save()


if __name__ == "__main__":
    main()
