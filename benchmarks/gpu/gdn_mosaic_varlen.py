"""GDN prefill of packed sequences (cu_seqlens) on the Mosaic GPU backend beside Pallas Triton and FLA (issue 14,
session 7; pallas_kernels/gated_delta_rule/mosaic_gpu_varlen.py, NOTES.md "Session 7: Mosaic varlen").

    python benchmarks/gpu/gdn_mosaic_varlen.py [--quick] [--budget S] [--test-timeout S]
    (writes $OUT/gdn_mosaic_varlen.{json,log}; OUT=/tmp/out)

1. The GPU tests, most telling first (tests/pallas_kernels/test_gdn_mosaic_varlen.py: the walked kernels against
   float64 at odd lengths with an empty sequence and NaN padding, K = V = 128 and 64, both stage 1a, both input
   layouts, both state layouts, the persistent walk; many sequences beside Triton; the slots API beside XLA; and
   two dense tests of test_gdn_mosaic_gpu.py, whose fused pass was restructured) in a child process with a
   timeout, -v (each verdict printed as it comes; the child is cut at the timeout).
2. Per case (serve256, varlen16, tiny64 of jax_gdn.cases; bf16 q, k, v, beta, fp32 g and initial states, final
   states out), timed as jax_gdn.bench's kernel section does (JAX: bench.time_jax, median of 15 groups of 10
   back-to-back calls; FLA: bench._time_fla, triton.testing.do_bench median), all in this one process:
     pallas                     ops.chunk_gated_delta_rule(backend="pallas")   (the bench's "pallas" column)
     m.<1a>.<inputs>.<states>[.L<lanes>]   mosaic_gpu_varlen.chunk_gated_delta_rule_varlen_fwd per VarlenConfig
     fla                        FLA's chunk_gated_delta_rule (its first call autotunes, ~40 s: run only if the
                                budget still holds it)
   numerics of every variant and of pallas against the XLA backend in fp32 (matmul precision "highest") on the
   same bf16-rounded inputs (serve256, varlen16: relative RMS of o and the final states; o finite; padding rows
   zero); and on serve256 the stages alone: repack (q, k, v, g, beta gathered), repack_gb (k, g, beta: the packed
   variant's glue), kkt (Mosaic kkt_fwd on the repacked k), kkt_triton (kkt_solve on the packed row), the fused
   pass (packed inputs + kv states; the same as the persistent walk; repacked inputs + vk states), unpack.
A deadline (--budget, default 70 s from start) skips what would not fit; every measurement is wrapped in
try/except (a failure prints its reason and the script goes on). A table is printed last.
--quick: CPU, one tiny case, Triton in interpret mode and the jnp twins (impl="reference"), no FLA: checks the
script end to end.
"""
from __future__ import annotations

import time

import script_kit as kit

T_START = time.time()
log = kit.Log()
rel = kit.relative_rms
NAME = "gdn_mosaic_varlen"

# the tests, most telling first (the child is cut at its timeout; every verdict is printed as it comes)
_V = "tests/pallas_kernels/test_gdn_mosaic_varlen.py::"
_K = _V + "test_gpu_kernel_matches_f64"
_D = "tests/pallas_kernels/test_gdn_mosaic_gpu.py::"
# call 4 (after call 3: repacked + vk states passed its test and ran serve256 in 2.637 ms; kv states failed to trace,
# packed inputs failed their test): the new defaults first, with the odd lengths, NaN padding and the lanes
TEST_IDS = [f"{_K}[dims0-mosaic-packed-kv-2]", _V + "test_gpu_many_sequences_beside_pallas",
            _V + "test_gpu_slots_api_beside_xla", f"{_K}[dims1-mosaic-packed-kv-0]",
            f"{_K}[dims0-mosaic-repacked-kv-0]"]
# (stage1a, inputs, states, lanes), most informative first: the defaults, the persistent walk, the repacked
# fallback with the kv states
VARIANTS = [("mosaic", "packed", "kv", 0), ("mosaic", "packed", "kv", -1), ("mosaic", "repacked", "kv", 0)]
VARIANTS_SMALL = [("mosaic", "packed", "kv", 0)]
# Pallas Triton measured in call 3 (same inputs, same timer): serve256 2.4212 ms; timed here only on the smaller cases
PALLAS_CASES = ("varlen16-T19027-Hk16-Hv32", "tiny64-T171-Hk16-Hv32")


def vkey(variant) -> str:
    stage1a, inputs, states, lanes = variant
    return f"m.{stage1a}.{inputs}.{states}" + (f".L{lanes}" if lanes else "")


def run_tests(quick: bool, timeout: float, result: dict):
    """The new code's GPU tests in a child process (a CUDA error or a hang cannot cost the timings)."""
    args = ["-v", "-p", "no:randomly", "-p", "no:cacheprovider"] + TEST_IDS
    log(f"== GPU tests (timeout {timeout:.0f} s): -m pytest {' '.join(args)}")
    kit.run_tests(args, quick=quick, timeout=timeout).record(result, log, max_failures=40)


def main():
    ap = kit.arg_parser(__doc__, budget=70.0, test_timeout=20.0,
                        quick_help="CPU smoke run at tiny sizes (interpret mode / jnp twins)")
    ap.add_argument("--no-fla", action="store_true")
    opts, out_dir, left = kit.parse(ap, T_START)
    quick = opts.quick

    result = {"quick": quick, "budget_s": opts.budget, "rows": [], "errors": []}
    if not opts.no_tests:
        run_tests(quick, min(opts.test_timeout, max(left() - 60, 5)), result)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import ops
    from jax_gdn.bench import time_jax
    from jax_gdn.cases import BENCH_CASES
    from pallas_kernels.gated_delta_rule import mosaic_gpu as mg
    from pallas_kernels.gated_delta_rule import mosaic_gpu_varlen as mv

    import dataclasses
    result.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  default_config=dataclasses.asdict(mv.DEFAULT_CONFIG), varlen=mg.VARLEN, auto_varlen=mg.AUTO_VARLEN)
    if quick:
        from jax_gdn.cases import Case
        lens = (1, 63, 0, 64, 65, 130)
        cases = [Case("quick-varlen-T330-Hk1-Hv2-K16-V16", 1, sum(lens) + 7, 1, 2, 16, 16, lens)]
        timer = lambda fn, args: time_jax(fn, args, warmup=1, groups=1, per_group=1)  # noqa: E731
        impl, triton_backend = "reference", "pallas_interpret"
    else:
        want = ["serve256-T38567-Hk16-Hv32", "varlen16-T19027-Hk16-Hv32", "tiny64-T171-Hk16-Hv32"]
        by_name = {c.name: c for c in BENCH_CASES}
        cases = [by_name[n] for n in want if n in by_name]
        timer = time_jax
        impl, triton_backend = "mosaic", "pallas"
    log(f"device {result.get('device')} jax {jax.__version__}; cases {[c.name for c in cases]}; {left():.0f} s left")

    timed = kit.Timed(timer, left, log, result["errors"], min_left=4.0, key_width=22, case_chars=22, err_chars=600,
                      after=lambda: _write(out_dir, result))

    def case_args(case):
        return kit.bench_inputs(case) + (jnp.asarray(case.cu_seqlens(), jnp.int32),)

    def variant_fn(variant, cu):
        stage1a, inputs, states, lanes = variant

        def fn(q, k, v, g, beta, h0):
            return mv.chunk_gated_delta_rule_varlen_fwd(q, k, v, g, beta, cu, h0, output_final_state=True,
                                                        impl=impl, stage1a=stage1a, inputs=inputs, states=states,
                                                        lanes=lanes)
        return jax.jit(fn)

    def pallas_fn(cu):
        def fn(q, k, v, g, beta, h0):
            return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu, backend=triton_backend)
        return jax.jit(fn)

    def numerics(row, outs, args, cu):
        if left() < 10:
            log("  numerics skipped (budget)")
            return
        try:        # against fp32 XLA on the same bf16-rounded inputs
            f32 = [x.astype(jnp.float32) for x in args]
            with jax.default_matmul_precision("highest"):
                ref = jax.block_until_ready(jax.jit(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                    backend="xla"))(*f32))
            t_end = int(cu[-1])
            for name, res in outs.items():
                if res is None:
                    continue
                o = np.asarray(res[0].astype(jnp.float32))
                row["numerics"][name] = {"o": rel(o, ref[0]), "state": rel(res[1], ref[1]),
                                         "o_finite": bool(np.isfinite(o).all()),
                                         "pad_zero": bool(np.all(o[0, t_end:] == 0))}
                n = row["numerics"][name]
                log(f"  numerics {name:20s}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']} "
                    f"(rel RMS vs fp32 XLA; bf16 bound 1e-2)")
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"{row['case']} numerics: {type(e).__name__}: {str(e)[:300]}")
            log(f"  numerics FAIL {type(e).__name__}: {str(e)[:300]}")

    def stages(row, args, cu):
        """serve256's stages that call 3 did not measure (repack 0.552, repack_gb 0.174, kkt 0.378, kkt_triton
        0.612, fused with repacked inputs and vk states 1.052 ms there): the tail gather, the fused pass with packed
        inputs and kv states alone (one CTA row per sequence, and the persistent walk), unpack."""
        q, k, v, g, beta, h0 = args
        t = q.shape[1]
        n = cu.shape[0] - 1
        f32 = jnp.float32
        cm, src, keep, back, valid, walk = jax.block_until_ready(jax.jit(lambda cu: mv.layout(cu, t))(cu))
        tails = timed(row, "st.tails", jax.jit(lambda q, k, v, cu: mv.repack((q, k, v), *mv.tail_rows(cu))),
                      (q, k, v, cu))
        if tails is None:
            return
        k_r, g_r, b_r = jax.jit(lambda k, g, beta, src, keep: mv.repack((k, g.astype(f32), beta.astype(f32)),
                                                                         src, keep))(k, g, beta, src, keep)
        kern = impl == "mosaic"
        tmat, gcum, beta_hm, _ = jax.jit(lambda k_r, g_r, b_r: mv.stage1a_operands(
            k_r, g_r, b_r, kernel=kern, stage1a="mosaic", vdim=v.shape[3]))(k_r, g_r, b_r)
        scale = q.shape[3] ** -0.5

        def fused_fn(lanes):
            def fn(q, k, v, tmat, gcum, beta_hm, h0, walk, qt, kt, vt):
                rows = None
                if lanes:
                    walk, rows = mv.lane_table(walk, lanes)
                kw = dict(num_states=n, scale=scale, out_final=True, head_major=True, packed_qkv=True,
                          state_kv=True, lane_rows=rows, tails=(qt, kt, vt))
                if kern:
                    return mg.fused_state_pass(q, k, v, tmat, gcum, beta_hm, h0, walk=walk, **kw)
                return mv.fused_state_pass_walk_reference(q, k, v, tmat, gcum, beta_hm, h0, walk, **kw)
            return jax.jit(fn)
        fargs = (q, k, v, tmat, gcum, beta_hm, h0, walk) + tuple(tails)
        res = timed(row, "st.fused_packed_kv", fused_fn(0), fargs)
        if res is not None:
            timed(row, "st.unpack", jax.jit(lambda o_r, back, valid: mv._gather_rows(o_r[0], back, valid)[None]),
                  (res[0], back, valid))
        n_lanes = mv.num_lanes(-1, n, v.shape[2], v.shape[3]) or 2
        timed(row, f"st.fused_packed_kv_L{n_lanes}", fused_fn(n_lanes), fargs)

    def run_stages(row, args, cu):
        try:
            stages(row, args, cu)
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"stages: {type(e).__name__}: {str(e)[:300]}")
            log(f"  stages FAIL {type(e).__name__}: {str(e)[:300]}")

    fla_warm = False
    for ci, case in enumerate(cases):
        if left() < 8:
            log(f"skip {case.name}: {left():.0f} s left")
            result["errors"].append(f"{case.name}: skipped (budget)")
            continue
        host, args, cu = case_args(case)
        row = {"case": case.name, "N": len(case.lens), "T": case.T, "ms": {}, "numerics": {}}
        result["rows"].append(row)
        outs = {}
        variants = VARIANTS if ci == 0 or quick else VARIANTS_SMALL
        for variant in variants:
            key = vkey(variant)
            outs[key] = timed(row, key, variant_fn(variant, cu), args, min_left=12.0)
        if ci < 2:
            numerics(row, outs, args, cu)
        if quick or case.name in PALLAS_CASES:
            timed(row, "pallas", pallas_fn(cu), args)
        del outs
        if ci == 0 and (quick or left() > 30):
            run_stages(row, args, cu)
        if not quick and not opts.no_fla:
            need = 5.0 if fla_warm else 48.0          # FLA's first call autotunes (~40 s)
            if left() > need:
                try:
                    from jax_gdn.bench import _time_fla
                    row["ms"]["fla"] = round(_time_fla(case, host), 4)
                    fla_warm = True
                    log(f"  {case.name[:22]:22s} {'fla':22s} {row['ms']['fla']:8.4f} ms   ({left():.0f} s left)")
                except Exception as e:  # noqa: BLE001
                    row["ms"]["fla"] = None
                    result["errors"].append(f"{case.name} fla: {type(e).__name__}: {str(e)[:300]}")
                    log(f"  FAIL fla {type(e).__name__}: {str(e)[:300]}")
            else:
                row.setdefault("skipped", []).append("fla")
                log(f"  fla skipped ({left():.0f} s left, needs {need:.0f})")
        _write(out_dir, result)
    finish(result, opts, out_dir)


def finish(result, opts, out_dir):
    log(f"\n==== {NAME}: median ms per call (m.<stage1a>.<inputs>.<states> = the Mosaic varlen path per "
        f"VarlenConfig) ====")
    keys = ["pallas"] + [vkey(x) for x in VARIANTS] + ["fla"]
    keys = [k for k in keys if any(k in r["ms"] for r in result["rows"])]
    log(f"{'case':26s} " + " ".join(f"{k:>23s}" for k in keys) + "   best_m/fla best_m/pallas")

    def cell(x):
        return f"{x:23.4f}" if isinstance(x, (int, float)) else f"{'-':>23s}"
    for r in result["rows"]:
        ms = r["ms"]
        best = min((v for k, v in ms.items() if k.startswith("m.") and isinstance(v, (int, float))), default=None)
        ratio = lambda d: f"{best / ms[d]:10.2f}" if best and ms.get(d) else f"{'-':>10s}"  # noqa: E731
        log(f"{r['case'][:26]:26s} " + " ".join(cell(ms.get(k)) for k in keys) + f"   {ratio('fla')}  "
            f"{ratio('pallas')}")
    for r in result["rows"]:
        st = {k: v for k, v in r["ms"].items() if k.startswith("st.")}
        if st:
            log(f"stages {r['case']}: " + ", ".join(f"{k[3:]} {v}" for k, v in st.items()))
        for name, n in r.get("numerics", {}).items():
            log(f"numerics {r['case'][:26]} {name}: o {n['o']:.2e} state {n['state']:.2e} finite {n['o_finite']} "
                f"pad0 {n['pad_zero']}")
    kit.log_closing(log, result, kit.Deadline(opts.budget, T_START))
    _write(out_dir, result)


def _write(out_dir, result):
    kit.save(out_dir, NAME, result, log.lines)


if __name__ == "__main__":
    main()
