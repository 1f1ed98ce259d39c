"""The model's GDN prefill on Mosaic GPU against Pallas Triton, at Qwen3-Next-80B dims on one H200 (session 9).

    python benchmarks/gpu/model_prefill_s9.py [--quick] [--budget S] [--layers L] [--no-tests]
    (writes $OUT/model_prefill_s9.{json,log}; OUT=/tmp/out)

Session 9 makes the layers pass the op's own "auto" to the slot op (``jax_gdn.layers.gdn.PREFILL_KERNEL = "auto"``),
so on a Hopper GPU the model's packed GDN prefill runs the Mosaic GPU varlen kernels; "pallas" keeps Triton. This
run, on one set of random bf16 weights made on the device (8 layers: 2 x (3 GDN + 1 attention), MoE 512 experts):
1. For each PREFILL_KERNEL ("pallas" first, then "auto", each a fresh ``HybridModel``, so a fresh trace): the
   bench's model rows through the public API (``jax_gdn.bench_model.our_rows``: varlen16 prefill, one
   32768-token stream, decode of 64 streams x 1189 after their context; wall ms per call closed by a sync, median
   of --reps after a first call), and the varlen16 prefill's last-token logits of each stream.
2. The logits of "auto" against "pallas" (bf16 relative RMS and the argmax agreement), every logit finite, the
   compiled program count (no recompiles when warm).
3. The GPU tests of the layer's switch (tests/layers/test_gdn_backends.py) and of the Mosaic dense slot route
   (test_gdn_mosaic_varlen.py::test_gpu_slots_api_dense_beside_xla) in a child process, last.
A third model, first, has its GDN prefill on XLA (``backend={"gated_delta_rule": "xla"}``, the other ops "auto"):
its logits only, so step 2 also gives each route's logits against the XLA one's (how far bf16 kernel differences
travel through 8 layers of random weights and top-10 routing). --logits-only: the logits without the rows.
A table is printed last. --quick: tiny dims on the CPU ("auto" and "pallas" then both run XLA: a dry run).
"""
from __future__ import annotations

import time

import script_kit as kit

T_START = time.time()
log = kit.Log()
NAME = "model_prefill_s9"
KERNELS = ("pallas", "auto")


def main():
    ap = kit.arg_parser(__doc__, budget=240.0, test_timeout=60.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--logits-only", action="store_true")
    ap.add_argument("--rows-for", default=",".join(KERNELS), help="the routes whose rows are timed (others: logits)")
    opts, out, left = kit.parse(ap, T_START, cpu_quick=True)
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_gdn import bench_model as bm
    from jax_gdn.layers import gdn
    from jax_gdn.model import HybridModel, init_params

    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "layers": opts.layers, "rows": {},
           "errors": [], "skipped": []}
    cfg = (bm.tiny_config if opts.quick else bm.qwen3_next_80b_config)(opts.layers)
    cases = bm._cases(opts.quick)
    dtype = jnp.float32 if opts.quick else jnp.bfloat16
    params = jax.jit(functools.partial(init_params, cfg, dtype=dtype))(jax.random.PRNGKey(0))
    jax.block_until_ready(params)
    log(f"params made on the device: {left.elapsed():.0f} s")
    logits = {}
    _, lens = cases["varlen"]
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
    cu = bm._cu(lens)
    slots = np.arange(len(lens), dtype=np.int32)

    def phase2():
        """The layer's phase 2 alone as the model calls it (gdn_full_varlen over a 64-slot fp32 pool, donated and
        threaded through the calls, jax_gdn.timing), varlen16 at 80B GDN dims, fresh streams, per route."""
        from jax_gdn import timing
        from jax_gdn.config import GdnDims
        from jax_gdn.state import BatchMeta, GdnSlots
        d = GdnDims(16, 2, 2, 16, 16) if opts.quick else GdnDims(2048, 16, 32, 128, 128)
        t = int(sum(lens))
        r = np.random.default_rng(3)
        qk = [jnp.asarray(r.standard_normal((t, d.num_k_heads, d.head_k_dim)) / d.head_k_dim ** 0.5, dtype)
              for _ in range(2)]
        v = jnp.asarray(r.standard_normal((t, d.num_v_heads, d.head_v_dim)), dtype)
        g = jnp.asarray(-0.1 * r.random((t, d.num_v_heads)), jnp.float32)
        beta = jnp.asarray(r.random((t, d.num_v_heads)), dtype)
        meta = BatchMeta.from_lengths(list(lens), slot_ids=list(range(len(lens))), positions=[0] * len(lens))
        out = {}
        for kernel in KERNELS:
            gdn.PREFILL_KERNEL = kernel
            fn = jax.jit(lambda pool, q, k, v, g, beta, meta: gdn.gdn_full_varlen(
                q, k, v, g, beta, GdnSlots(conv_state=jnp.zeros((1,)), ssm_state=pool), meta,
                backend="xla" if opts.quick else "pallas"),
                donate_argnums=0)

            def step(pool, fn=fn):
                o, new, _ = fn(pool, *qk, v, g, beta, meta)
                return new.ssm_state
            pool = jnp.zeros((64, d.num_v_heads, d.head_k_dim, d.head_v_dim), jnp.float32)
            out[kernel] = round(timing.time_threaded(step, pool, "jax"), 4)
            log(f"phase 2 {kernel}: {out[kernel]} ms")
        gdn.PREFILL_KERNEL = "auto"
        res["phase2_ms"] = out
    kit.guarded("phase2", 20, phase2, res=res, log=log, save=lambda: kit.save(out, NAME, res, log.lines), left=left)

    kernels = ("xla",) + KERNELS
    for kernel in kernels:
        def step(kernel=kernel):
            gdn.PREFILL_KERNEL = "auto" if kernel == "xla" else kernel
            backend = {"gated_delta_rule": "xla"} if kernel == "xla" else "auto"
            model = HybridModel(cfg, params, dtype=dtype, backend=backend)
            log(f"{kernel}: {model}")
            cache = model.init_cache(**bm._shared_cache_kwargs(cases, opts.reps))
            lg, cache = model.prefill(cache, ids, cu, slots)
            logits[kernel] = np.asarray(jnp.asarray(lg, jnp.float32))
            model.check(cache)
            del cache
            if opts.logits_only or kernel not in opts.rows_for.split(","):
                return
            keys = ("varlen", "decode", "long") if left() > 120 else ("varlen", "decode")
            rows = bm.our_rows(model, cases, reps=opts.reps, log=log, keys=keys)
            res["rows"][kernel] = rows
            del model
        kit.guarded(f"rows {kernel}", 35 if opts.logits_only else 60, step, res=res, log=log, save=lambda: kit.save(out, NAME, res, log.lines),
                    left=left)
    gdn.PREFILL_KERNEL = "auto"

    if all(k in logits for k in KERNELS):
        a, p = logits["auto"], logits["pallas"]
        res["logits"] = {"rel_rms_auto_vs_pallas": kit.relative_rms(a, p),
                         "argmax_agree": float(np.mean(np.argmax(a, -1) == np.argmax(p, -1))),
                         "finite": bool(np.isfinite(a).all() and np.isfinite(p).all())}
        if "xla" in logits:
            x = logits["xla"]
            res["logits"].update({f"rel_rms_{k}_vs_xla": kit.relative_rms(logits[k], x) for k in KERNELS})
            res["logits"].update({f"argmax_agree_{k}_vs_xla": float(np.mean(np.argmax(logits[k], -1) ==
                                                                             np.argmax(x, -1))) for k in KERNELS})
        log(f"logits auto vs pallas: {res['logits']}")
    kit.save(out, NAME, res, log.lines)

    if not opts.no_tests and left() > 30:
        tests = kit.run_tests(["-q", "-rA", "-v", "-m", "gpu", "-p", "no:cacheprovider",
                               "tests/layers/test_gdn_backends.py",
                               "tests/pallas_kernels/test_gdn_mosaic_varlen.py::test_gpu_slots_api_dense_beside_xla"],
                              quick=opts.quick,
                              timeout=min(opts.test_timeout, left() - 5), log_path=f"{out}/{NAME}_tests.log")
        tests.record(res, log)
    kit.save(out, NAME, res, log.lines)

    log("")
    log(f"{'kernel':<8} {'row':<8} {'ms':>9} {'first s':>8}")
    for kernel, rows in res["rows"].items():
        for key in ("varlen", "long", "decode"):
            r = rows.get(key) or {}
            ms = r.get("ms")
            log(f"{kernel:<8} {key:<8} {ms if ms is None else round(ms, 3)!s:>9} "
                f"{round(r.get('first_call_s') or 0, 1):>8} {r.get('error', '')[:60]}")
        log(f"{kernel:<8} compiled programs {rows.get('compiled_programs')}")
    log(f"logits: {res.get('logits')}")
    log(f"phase 2 alone (ms): {res.get('phase2_ms')}")
    kit.log_closing(log, res, left)
    kit.save(out, NAME, res, log.lines)


if __name__ == "__main__":
    main()
