"""One device run: the GDN decode kernel's launch variants (DecodeConfig), checked and timed (issue 14, decode).

    PYTHONPATH=$PWD python benchmarks/gpu/decode_sweep.py OUT_DIR [deadline_s] [persistent]

("persistent": N256-Hv32 only, the default against DecodeConfig.programs > 0 launches; no in-place floor, no HLO.)

For each case (N streams x Hk / Hv heads x 128 x 128 fp32 state, bf16 q/k/v/beta, fp32 g, fused q/k L2 norm) and
each config: one call on a fresh copy of the pool checked against the op's XLA backend (fp32, matmul precision
highest: relative RMS of o and of the new pool), then the median ms of donated calls that thread the pool
(jax_gdn.bench_decode._time_threaded: the bench's method for every column). Floors: the bench's XLA copy of the
pool (p * 1.0001, not donated) and the same donated (in place). The compiled HLO of the default config is searched
for a copy of the pool. Order: every config at N256-Hv32 first, then the best three plus the old default at the
other cases; whatever passes the deadline is skipped. OUT_DIR/decode_sweep.json, a table printed last.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

T0 = time.time()


def main():
    out = sys.argv[1]
    deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 85.0
    import jax
    import jax.numpy as jnp
    import numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax_gdn import bench_decode, ops
    from jax_gdn.cases import Case
    from pallas_kernels.gated_delta_rule import decode

    def DC(block_v, num_warps, v_fastest=True, fused_output=True, programs=0):
        return decode.DecodeConfig(block_v=block_v, num_warps=num_warps, v_fastest=v_fastest,
                                   fused_output=fused_output, programs=programs)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))

    cases = [Case("decode-N256-Hk16-Hv32", 256, 1, 16, 32, 128, 128),
             Case("decode-N64-Hk16-Hv32", 64, 1, 16, 32, 128, 128),
             Case("decode-N64-Hk16-Hv64-q35", 64, 1, 16, 64, 128, 128),     # Qwen3.5-397B GDN heads
             Case("decode-N1-Hk16-Hv32", 1, 1, 16, 32, 128, 128)]
    gpu = any(d.platform == "gpu" for d in jax.devices())
    timing = {} if gpu else dict(warmup=1, groups=2, per_group=1)
    if not gpu:                                       # CPU dry run of this script: tiny cases, interpret mode
        cases = [Case("cpu-N4-Hk1-Hv2", 4, 1, 1, 2, 16, 16), Case("cpu-N2-Hk1-Hv2", 2, 1, 1, 2, 16, 16)]
    old = DC(64, 4, v_fastest=False, fused_output=False)
    main_configs = [old, DC(64, 4, v_fastest=True, fused_output=False), DC(64, 4),
                    DC(64, 4, False, True), DC(128, 8), DC(128, 4),
                    DC(32, 4), DC(32, 2), DC(32, 1),
                    DC(16, 1), DC(16, 2), DC(16, 4),
                    DC(64, 2), DC(64, 8), DC(8, 1)]
    persistent = len(sys.argv) > 3 and sys.argv[3] == "persistent"
    if persistent:                                    # second run: the persistent grid against the default only
        cases = cases[:1]
        main_configs = [decode.DecodeConfig(), DC(64, 4, programs=512), DC(64, 4, programs=1024),     # P divides
                        DC(32, 2, programs=1024), DC(128, 8, programs=256), DC(128, 8, programs=512)]  # the blocks
    result = {"rows": [], "hlo": None}

    def name(c):
        return (f"bv{c.block_v}-w{c.num_warps}-vf{int(c.v_fastest)}-fo{int(c.fused_output)}"
                + (f"-p{c.programs}" if c.programs else ""))

    def run_case(case, configs):
        host = bench_decode.make_inputs_np(case)
        q, k, v, g, beta, pool, ids = host
        bf = jnp.bfloat16
        xs = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf))
        ids_d = jnp.asarray(ids)
        has = jnp.ones(ids.shape, bool)
        o_ref, p_ref = jax.jit(lambda p: ops.fused_recurrent_gated_delta_rule_slots(
            *xs, ssm_state=p, slot_ids=ids_d, use_qk_l2norm=True, backend="xla"))(jnp.asarray(pool))
        o_ref, p_ref = np.asarray(o_ref, np.float32), np.asarray(p_ref)
        floors = {"copy": bench_decode.time_copy(case, host, **timing)}
        inplace = jax.jit(lambda p: p * 1.0001, donate_argnums=0)
        floors["copy_inplace"] = (float("nan") if persistent else
                                  bench_decode._time_threaded(inplace, jnp.asarray(pool), **timing))
        print(f"{case.name} floors {floors}", flush=True)
        for cfg in configs:
            if time.time() - T0 > deadline:
                print(f"deadline: {case.name} {name(cfg)} skipped", flush=True)
                continue
            fn = jax.jit(lambda p, cfg=cfg: decode.fused_recurrent_gated_delta_rule_slots_fwd(
                *xs, scale=None, ssm_state=p, slot_ids=ids_d, has_initial_state=has, use_qk_l2norm=True,
                interpret=not gpu, config=cfg), donate_argnums=0)
            row = {"case": case.name, "config": name(cfg), "N": case.B, "Hv": case.Hv, **floors}
            try:
                p0 = jnp.asarray(pool)
                default = decode.decode_config(case.B, case.Hv, case.K, case.V)
                if result["hlo"] is None and not persistent and cfg == default:
                    txt = fn.lower(p0).compile().as_text()
                    pool_copy = r"^.*= f32\[\d+,\d+,\d+,\d+\]\S* copy(?:-start)?\(.*$"     # a [S, Hv, K, V] copy
                    result["hlo"] = {"config": name(cfg), "copies": re.findall(pool_copy, txt, re.M)[:5]}
                    print("HLO copies:", result["hlo"], flush=True)
                ptr = p0.unsafe_buffer_pointer() if gpu else None
                o, p1 = fn(p0)
                row["in_place"] = gpu and p1.unsafe_buffer_pointer() == ptr
                row["o_rel"], row["pool_rel"] = rel(np.asarray(o, np.float32), o_ref), rel(p1, p_ref)
                row["ms"] = bench_decode._time_threaded(lambda st: fn(st)[1], p1, **timing)
                row["gbps"] = bench_decode.state_bytes(case) / row["ms"] / 1e6
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(row, flush=True)
            result["rows"].append(row)
        return [r for r in result["rows"] if r["case"] == case.name and "ms" in r]

    rows = run_case(cases[0], main_configs)
    best = [r["config"] for r in sorted(rows, key=lambda r: r["ms"])[:3]]
    if persistent:
        cases = cases[:1]
    by_name = {name(c): c for c in main_configs}
    others = [old] + [by_name[b] for b in best if by_name[b] != old]
    for case in cases[1:]:
        if time.time() - T0 > deadline:
            break
        run_case(case, others)
    with open(os.path.join(out, "decode_persistent.json" if persistent else "decode_sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n==== decode sweep (median ms, GB/s of state bytes; floors: XLA copy / in-place copy) ====")
    for r in result["rows"]:
        if "ms" in r:
            print(f"{r['case']:26s} {r['config']:20s} {r['ms']:.4f} ({r['gbps']:.0f})  copy {r['copy']:.4f} "
                  f"inplace {r['copy_inplace']:.4f}  o {r['o_rel']:.1e} pool {r['pool_rel']:.1e} "
                  f"inplace={r['in_place']}")
        else:
            print(f"{r['case']:26s} {r['config']:20s} {r.get('error')}")
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
