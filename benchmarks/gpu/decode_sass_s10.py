"""Session 10 (issue 14, decode at HBM speed): what the compiled decode kernels are, not how fast.

    python benchmarks/gpu/decode_sass_s10.py [--reps R] [--only LABELS] [--quick]

Builds at N256-Hk16-Hv32 (the bench's inputs, ``jax_gdn.bench_decode.make_inputs_np``) one jitted step per
implementation, each under its own function name so XLA's dump (``XLA_FLAGS=--xla_dump_to=...``, set by the
calling shell script) names its module: the XLA copy of the pool, the Pallas Triton copy with the kernel's launch
shape and the kernel's diagnostics (``gdn_decode_s9._pcopy_kernel``: loads, qknorm, nodep_nol2) and the decode kernel
(default config), and the Mosaic GPU kernel's direct transfer (``decode_mosaic``, rows / wgmma layouts, its
copy_only twin). Each runs ``--reps`` times (the shell script runs this under ncu with a few reps: every launch is
one kernel of interest). The PTX in the dump is assembled and disassembled by the shell script
(``decode_sass_s10.sh``). Prints one line per implementation: its first-call seconds and a wall-clock ms per call
(not a measurement of record: no groups, one sync per call).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--only", default="", help="comma-separated labels (default: all)")
ap.add_argument("--quick", action="store_true", help="tiny sizes in interpret mode on the CPU (a check of the script)")
args = ap.parse_args()
if args.quick:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax                                                                       # noqa: E402
import jax.numpy as jnp                                                          # noqa: E402

import gdn_decode_s9 as s9                                                       # noqa: E402
import script_kit as kit                                                         # noqa: E402
from jax_gdn import bench_decode                                                 # noqa: E402
from pallas_kernels.gated_delta_rule import decode                              # noqa: E402


def main():
    n = 4 if args.quick else 256
    case = bench_decode.Case(f"decode-N{n}", n, 1, 1 if args.quick else 16, 2 if args.quick else 32, 128, 128)
    host = bench_decode.make_inputs_np(case)
    xs = kit.bf16_inputs(host[:5])
    ids, has = jnp.asarray(host[6]), jnp.ones(host[6].shape, bool)

    def xla_copy(p, ids, has):
        return jnp.zeros((), jnp.float32), p * 1.0001

    def pcopy(mode):
        def f(p, ids, has):
            return s9.pcopy_call(xs, p, ids, has, spec=(64, 2, 128, 1, mode), interpret=args.quick)
        f.__name__ = f"pcopy_{mode}"
        return f

    def tri_default(p, ids, has):
        return decode.fused_recurrent_gated_delta_rule_slots_fwd(
            *xs, scale=None, ssm_state=p, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
            interpret=args.quick, config=decode.DecodeConfig())

    from pallas_kernels.gated_delta_rule import decode_mosaic as dm

    def mosaic(**kw):
        cfg = dm.MosaicDecodeConfig(transfer="direct", **kw)

        def f(p, ids, has):
            return dm.fused_recurrent_gated_delta_rule_slots_fwd(
                *xs, scale=None, ssm_state=p, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
                interpret=args.quick, config=cfg)
        return f

    impls = {"mosaic_rows64": mosaic(layout="rows"), "mosaic_rows128": mosaic(layout="rows", block_v=128),
             "mosaic_wgmma64": mosaic(layout="wgmma"), "mosaic_rows64_copy": mosaic(layout="rows", copy_only=True),
             "xla_copy": xla_copy, "pcopy_copy": pcopy("copy"), "pcopy_loads": pcopy("loads"),
             "pcopy_qknorm": pcopy("qknorm"), "pcopy_nodep_nol2": pcopy("nodep_nol2"), "tri_default": tri_default}
    only = [x for x in args.only.split(",") if x]
    rows = []
    for label, f in impls.items():
        if only and label not in only:
            continue
        fn = jax.jit(f, donate_argnums=0)
        pool = jnp.asarray(host[5])
        t = time.time()
        o, pool = fn(pool, ids, has)
        jax.block_until_ready(pool)
        first = time.time() - t
        t = time.time()
        for _ in range(args.reps):
            o, pool = fn(pool, ids, has)
        jax.block_until_ready(pool)
        rows.append((label, first, (time.time() - t) / max(args.reps, 1) * 1e3))
        print(f"  {label}: first call {first:.2f} s", flush=True)
    print("\nimpl                 first_s  wall_ms_per_call (one sync per call: not a measurement of record)")
    for label, first, ms in rows:
        print(f"{label:20s} {first:7.2f}  {ms:8.4f}")


if __name__ == "__main__":
    main()
