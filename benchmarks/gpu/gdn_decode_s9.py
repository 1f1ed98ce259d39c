"""One device run (session 9, issue 14, helper D9): the GDN decode kernel's ceilings and candidates together, every
column timed by the common method (``jax_gdn.timing.time_threaded``: groups of ~20 ms of back-to-back calls
threading the donated pool, one sync a group, the median per call).

    python benchmarks/gpu/gdn_decode_s9.py [--quick] [--budget SECONDS] [--no-tests] [--run 2|3]   (under $OUT)

--run 3 (session 10; outputs gdn_decode_s9_r3.*): the Mosaic GPU kernel's "direct" transfer (``decode_mosaic``,
``MosaicDecodeConfig(transfer="direct")``: one CTA per tile, global loads straight into a register layout, no ring)
beside the copies and the Triton default (``plan(run=3)``); kind "mosaic", labels "mcopy ..." its copy_only twins
(checked bitwise as the Pallas copies are); the layer step through ``decode.BACKEND = "mosaic"`` with the direct
kernel as ``decode_mosaic.DEFAULT_CONFIG`` (strided rows bv64, rows bv64 / bv128) against the Triton default; GPU tests: the Mosaic decode
file's direct and switch tests.
--run 1 (budget 240): the set below. --run 2 (budget 160; outputs gdn_decode_s9_r2.*): the gap between the Pallas
copy and the kernel taken apart (``plan(run=2)``), ``DecodeConfig.prenorm``, and each kernel's registers (its PTX,
kept by a hook on the Triton compile, through ptxas -v) with ``.maxnreg`` caps (``MAXNREG``) as a diagnostic.


Implementations (``plan()``), at N 256 (all), N 64 and N 1 (the XLA copies, the kernel's-shape Pallas copy and the
kernels), Hk 16, Hv 32, K = V = 128, bf16 q, k, v, beta, fp32 g and pool of S = N slots, ids shuffled
(``jax_gdn.bench_decode.make_inputs_np``):
  copy            the bench's XLA copy (``bench_decode.time_copy``: p * 1.0001 into a new buffer)
  copy donated    the same, the pool donated (XLA writes it in place)
  pcopy ...       Pallas Triton copies (this file's ``_pcopy_kernel``): the kernel's slot lookup and masks, no
                  arithmetic, one program per (value block, ``heads`` heads, stream, K / krows row block), launch
                  shapes BV x warps x krows (krows < K: the K rows split over programs, possible for a copy only)
  diag nodep      the kernel's loads, reductions and o, but the state stored as a S + k (beta v)^T: the store waits
                  on its own load only, not on the K reductions (wrong numbers: a diagnostic of what the
                  load -> reduce -> store dependency costs)
  tri ...         the decode kernel (``decode.fused_recurrent_gated_delta_rule_slots_fwd``) at a DecodeConfig: the
                  default, other launch shapes, ``heads`` 2 (two value heads of one key head per program, one
                  [2, K, BV] load), ``row_split`` (the block as R row slices, all loads first, partial reductions)
                  and ``early_store`` (the state stored before the second K reduction and o)
Steps (each skipped when the deadline would not fit it; a watchdog prints the table and exits at budget + 15 s):
  build     one jitted step per implementation and N, (pool, ids, has) -> (o, pool), pool donated, compiled by its
            first call (a failure is reported and the row left out)
  round 1   every implementation once per N, in order; then numerics; then rounds 2 and 3, the order rotated by a
            third each round ("wins": rounds in which a kernel beat the default kernel's time of that round)
  numerics  every timed executable on a poisoned call (ids 1 and 3 -> -1 and S, their slots untouched and NaN,
            stream 2 fresh over a NaN slot): kernels against the fp32 XLA step on the bf16-rounded inputs (o rel
            RMS < 1e-2, written slots < 1e-5), untouched slots bitwise, in place; copies: written slots bitwise
            as loaded (the fresh stream's slot zeros)
  layer     ``gdn_layer_decode`` (fused step: conv kernel, then the decode kernel with raw gates) at Qwen3-Next-80B
            GDN dims, N 64 over S 72, bf16, through ``decode.decode_config`` patched to each of the default and the
            two fastest N256 candidates (numbers against the default's step), then 3 rotated timing rounds
  tests     the GPU tests of tests/pallas_kernels/test_gdn_decode.py in a child (float64 checks of the variants)
Writes $OUT/gdn_decode_s9.json, .log, _tests.log; prints a table last. --quick: the same steps on the CPU at tiny
sizes in interpret mode (a check of this script, not a measurement).
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import threading
import time
import traceback

import script_kit as kit

T0 = time.time()
log = kit.Log()
sys.path.insert(0, kit.REPO)
NAME = "gdn_decode_s9"
HBM_GBPS = 4800.0
TEST_FILE = "tests/pallas_kernels/test_gdn_decode.py"
ROUNDS = 3
RESERVE_LAYER = 16.0          # seconds kept for the layer step by the steps before it
KEEP_TESTS = 25.0             # seconds the timing rounds leave for the layer + tests at least


#: run 2: the PTX of these labels gets a ``.maxnreg`` directive (registers per thread) before the driver compiles it,
#: where the hook engages (not on the H200's jax 0.11.2: its Pallas Triton lowering still hands the Triton IR to
#: XLA, so these rows ran uncapped there: repeats of their base configs, NOTES.md)
MAXNREG = {"tri default mx128": 128, "tri default mx160": 160, "tri bv64 w4 mx64": 64, "tri bv64 w4 mx80": 80,
           "tri prenorm mx128": 128}


def plan(DC, run: int = 1):
    """(label, kind, spec, Ns) of each implementation: kind "xla_copy" / "xla_copy_donated" / "pcopy" (spec
    (block_v, warps, krows, heads, mode)) / "tri" (spec a DecodeConfig) / "tri_nol2" (the kernel without its q / k
    norms: a diagnostic); Ns: the case sizes it runs at. Run 2: the gap between the Pallas copy and the kernel taken
    apart (diagnostics adding the kernel's pieces to the copy one at a time), the norms moved to XLA (prenorm), and
    the registers: each kernel's PTX through ptxas (registers, spills) and ``.maxnreg`` caps (``MAXNREG``)."""
    all_n, big = (256, 64, 1), (256,)
    if run == 3:
        from pallas_kernels.gated_delta_rule.decode_mosaic import MosaicDecodeConfig as MC
        mid = (256, 64)
        direct = lambda **kw: MC(transfer="direct", **kw)
        return [("copy", "xla_copy", None, all_n),
                ("pcopy bv64 w2", "pcopy", (64, 2, 128, 1, "copy"), mid),
                ("tri default", "tri", DC(), all_n),
                ("mosaic rows bv64", "mosaic", direct(layout="rows"), all_n),
                ("mosaic rows bv128", "mosaic", direct(layout="rows", block_v=128), all_n),
                ("mosaic strided bv64", "mosaic", direct(layout="strided_rows"), all_n),
                ("mcopy rows bv64", "mosaic", direct(layout="rows", copy_only=True), big),
                ("mcopy strided bv64", "mosaic", direct(layout="strided_rows", copy_only=True), big)]
    if run == 2:
        mid = (256, 64)
        rows = [("copy", "xla_copy", None, all_n),
                ("pcopy bv64 w2", "pcopy", (64, 2, 128, 1, "copy"), mid),
                ("diag loads", "pcopy", (64, 2, 128, 1, "loads"), big),
                ("diag qknorm", "pcopy", (64, 2, 128, 1, "qknorm"), big),
                ("diag nodep nol2", "pcopy", (64, 2, 128, 1, "nodep_nol2"), big),
                ("diag nodep", "pcopy", (64, 2, 128, 1, "nodep"), big),
                ("diag nol2", "tri_nol2", DC(), mid),
                ("tri default", "tri", DC(), all_n),
                ("tri bv64 w4", "tri", DC(num_warps=4), all_n),
                ("tri prenorm", "tri", DC(prenorm=True), all_n),
                ("tri prenorm bv64 w4", "tri", DC(prenorm=True, num_warps=4), mid)]
        rows += [(lb, "tri", DC(num_warps=4 if "w4" in lb else 2, prenorm="prenorm" in lb), mid if "128" in lb else big)
                 for lb in MAXNREG]
        return rows
    rows = [("copy", "xla_copy", None, all_n), ("copy donated", "xla_copy_donated", None, all_n)]
    pc = [((64, 2, 128, 1), all_n), ((32, 1, 128, 1), big), ((64, 4, 128, 1), big), ((128, 4, 128, 1), big),
          ((128, 8, 128, 1), big), ((64, 1, 64, 1), big), ((64, 2, 64, 1), big), ((128, 4, 64, 1), big),
          ((64, 8, 128, 1), big), ((64, 4, 128, 2), big)]
    for (bv, w, kr, hd), ns in pc:
        lb = f"pcopy bv{bv} w{w}" + (f" k{kr}" if kr != 128 else "") + (f" h{hd}" if hd > 1 else "")
        rows.append((lb, "pcopy", (bv, w, kr, hd, "copy"), ns))
    rows.append(("diag nodep", "pcopy", (64, 2, 128, 1, "nodep"), big))
    mid, n1 = (256, 64), all_n
    tri = [("tri default", DC(), all_n),
           ("tri early", DC(early_store=True), all_n),
           ("tri bv64 w4", DC(num_warps=4), mid),
           ("tri bv64 w8", DC(num_warps=8), big),
           ("tri bv32 w1", DC(block_v=32, num_warps=1), big),
           ("tri bv32 w2", DC(block_v=32, num_warps=2), big),
           ("tri bv128 w4", DC(block_v=128, num_warps=4), big),
           ("tri h2 bv64 w4", DC(heads=2, num_warps=4), n1),
           ("tri h2 bv64 w4 early", DC(heads=2, num_warps=4, early_store=True), n1),
           ("tri h2 bv32 w2", DC(heads=2, block_v=32, num_warps=2), mid),
           ("tri h2 bv128 w8", DC(heads=2, block_v=128, num_warps=8), big),
           ("tri rs2", DC(row_split=2), n1),
           ("tri rs4", DC(row_split=4), mid),
           ("tri rs4 early", DC(row_split=4, early_store=True), n1),
           ("tri rs4 bv128 w4", DC(row_split=4, block_v=128, num_warps=4), big)]
    rows += [(lb, "tri", c, ns) for lb, c, ns in tri]
    return rows


def insert_maxnreg(asm: str, regs: int) -> str:
    """The PTX with ``.maxnreg regs`` on its (first) kernel entry, before the body's opening brace."""
    at = asm.find(".entry")
    brace = asm.find("{", at)
    if at < 0 or brace < 0:
        raise ValueError("no .entry in the PTX")
    return asm[:brace] + f".maxnreg {regs}\n" + asm[brace:]


def install_ptx_hook(hook: dict) -> str:
    """Wraps the Triton compile of Pallas calls (jaxlib > 0.10.2: ``pallas_call_registration.triton.compile`` gives
    the PTX the runtime loads) so that each kernel's PTX is kept in ``hook["ptx"]`` as (label, ptx), with
    ``.maxnreg hook["maxnreg"]`` inserted when that is set. Returns what was done (nothing on jax 0.10.2: its
    lowering hands the Triton IR to XLA instead)."""
    import types
    try:
        from jax._src.pallas.triton import pallas_call_registration as pcr
    except Exception as e:                              # noqa: BLE001
        return f"no hook: {type(e).__name__}"
    real = getattr(pcr, "triton", None)
    if real is None or not hasattr(real, "compile"):
        return "no hook: no triton.compile"

    class Proxy:
        def __getattr__(self, name):
            return getattr(real, name)

        def compile(self, *a, **kw):
            r = real.compile(*a, **kw)
            asm = r.asm.decode() if isinstance(r.asm, bytes) else r.asm
            if hook.get("maxnreg"):
                asm = insert_maxnreg(asm, hook["maxnreg"])
                r = types.SimpleNamespace(asm=asm, smem_bytes=r.smem_bytes, hsaco_path=getattr(r, "hsaco_path", None))
            hook["ptx"].append((hook.get("label"), asm))
            return r
    pcr.triton = Proxy()
    return "hooked"


def ptxas_report(ptx_list, out_dir, log):
    """{label: {"regs", "spill_stores", "spill_loads", "entry"}} of ptxas -v on each kept PTX (the ptxas found on
    PATH, or triton's bundled one)."""
    import re
    import shutil
    import subprocess
    exe = shutil.which("ptxas")
    if exe is None:
        try:
            import triton
            cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
            exe = cand if os.path.exists(cand) else None
        except Exception:                               # noqa: BLE001
            exe = None
    if exe is None:
        log("  ptxas not found")
        return {"error": "ptxas not found"}
    out = {}
    pdir = os.path.join(out_dir, "ptx")
    os.makedirs(pdir, exist_ok=True)
    for i, (label, asm) in enumerate(ptx_list):
        entry = (re.search(r"\.entry\s+(\w+)", asm) or [None, "?"])[1]
        target = (re.search(r"\.target\s+(\w+)", asm) or [None, "sm_90a"])[1]
        key = f"{label} #{i} {entry}"
        path = os.path.join(pdir, f"k{i}.ptx")
        with open(path, "w") as f:
            f.write(asm)
        try:
            r = subprocess.run([exe, "-v", f"--gpu-name={target}", path, "-o", os.devnull], capture_output=True,
                               text=True, timeout=60)
            txt = r.stdout + r.stderr
            regs = re.findall(r"Used (\d+) registers", txt)
            st = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
            out[key] = {"regs": int(regs[-1]) if regs else None,
                        "spill_stores": int(st[-1][0]) if st else None, "spill_loads": int(st[-1][1]) if st else None,
                        "rc": r.returncode, "note": "" if regs else txt[-300:]}
        except Exception as e:                          # noqa: BLE001
            out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        log(f"  ptxas {key}: {out[key]}")
    return out


def _pcopy_kernel(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, o_ref, pool_out_ref, *,
                  block_v, krows, heads, mode, scale):
    """A Pallas Triton copy with the decode kernel's launch: grid (V / BV * K / krows, Hv / heads, N), the value
    block fastest; slot lookup, fresh-stream select and dropped writes as the kernel. mode "copy": the block stored
    as loaded (o not written); the diagnostics (wrong numbers on purpose) add the kernel's pieces one at a time:
    "loads" + q, k, v, g, beta loaded and an o stored (no reduction); "qknorm" + q / k norms and the state stored as
    a S + k (beta v)^T (k held for the update); "nodep" + the two K reductions and the kernel's o (the store waits
    on no reduction of the block); "nodep_nol2" the same without the norms."""
    from jax import lax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    kdim, vdim = pool_in_ref.shape[2], pool_in_ref.shape[3]
    nvb = vdim // block_v
    p0, hb, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vb, kb = p0 % nvb, p0 // nvb
    num_slots = pool_in_ref.shape[0]
    slot = slot_ref[n]
    in_pool = (slot >= 0) & (slot < num_slots)
    read_slot = jnp.clip(slot, 0, num_slots - 1)
    read = (has_ref[n] != 0) & in_pool
    vs, ks = pl.ds(vb * block_v, block_v), pl.ds(kb * krows, krows)
    if mode == "copy":
        hs = pl.ds(hb * heads, heads)
        s = jnp.where(read, pool_in_ref[read_slot, hs, ks, vs], 0.0)

        @pl.when(in_pool)
        def _():
            pool_out_ref[read_slot, hs, ks, vs] = s
        return
    h = hb
    hk = h // (v_ref.shape[2] // q_ref.shape[2])
    s = jnp.where(read, pool_in_ref[read_slot, h, :, vs], 0.0)
    q = q_ref[n, 0, hk, :].astype(jnp.float32)
    k = k_ref[n, 0, hk, :].astype(jnp.float32)
    v = v_ref[n, 0, h, vs].astype(jnp.float32)
    a, beta = jnp.exp(g_ref[n, 0, h].astype(jnp.float32)), beta_ref[n, 0, h].astype(jnp.float32)
    if mode == "loads":                                 # the copy + the kernel's small loads, no reduction
        o_ref[n, 0, h, vs] = (a * beta * v).astype(o_ref.dtype)

        @pl.when(in_pool)
        def _():
            pool_out_ref[read_slot, h, :, vs] = s
        return
    if mode != "nodep_nol2":
        q = q * lax.rsqrt(jnp.sum(q * q) + 1e-6)
        k = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
    if mode == "qknorm":                                # + the norms and k held for the update, no K reduction
        o_ref[n, 0, h, vs] = (a * beta * v * jnp.sum(q * k)).astype(o_ref.dtype)

        @pl.when(in_pool)
        def _():
            pool_out_ref[read_slot, h, :, vs] = a * s + k[:, None] * (beta * v)[None, :]
        return
    sk, sq = jnp.sum(k[:, None] * s, axis=0), jnp.sum(q[:, None] * s, axis=0)
    delta = beta * (v - a * sk)
    o_ref[n, 0, h, vs] = (scale * (a * sq + jnp.sum(q * k) * delta)).astype(o_ref.dtype)

    @pl.when(in_pool)
    def _():
        pool_out_ref[read_slot, h, :, vs] = a * s + k[:, None] * (beta * v)[None, :]


def pcopy_call(xs, pool, ids, has, *, spec, interpret):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    bv, warps, krows, heads, mode = spec
    q, k, v, g, beta = xs
    n, _, hv, vdim = v.shape
    kdim = q.shape[3]
    bv, krows = min(bv, vdim), min(krows, kdim)
    kern = functools.partial(_pcopy_kernel, block_v=bv, krows=krows, heads=heads, mode=mode, scale=kdim ** -0.5)
    return pl.pallas_call(
        kern, grid=((vdim // bv) * (kdim // krows), hv // heads, n),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(pool.shape, jnp.float32)),
        input_output_aliases={7: 1}, interpret=interpret, name="gdn_decode_pcopy",
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
    )(ids.astype(jnp.int32), has.astype(jnp.int32), q, k, v, g, beta, pool)


def main():
    ap = kit.arg_parser(__doc__, budget=240.0, test_timeout=40.0,
                        quick_help="CPU smoke run at tiny sizes (interpret mode)")
    ap.add_argument("--run", type=int, default=1, choices=(1, 2, 3), help="which set (see plan())")
    args, out, left = kit.parse(ap, T0, cpu_quick=True)
    quick = args.quick
    name = NAME if args.run == 1 else f"{NAME}_r{args.run}"
    res = {"quick": quick, "budget_s": args.budget, "configs": {}, "kernel": {}, "numerics": [], "layer": {},
           "compile_s": {}, "skipped": [], "errors": []}

    def save():
        kit.save(out, name, res, log.lines)

    def table():
        log(f"\n==== {name} (ms per call, common method: groups of ~20 ms threaded calls, median; 3 rotated rounds) ====")
        for case, rows in res["kernel"].items():
            copy = rows.get("copy", {}).get("median")
            dflt = rows.get("tri default", {}).get("rounds", [])
            log(f"{case}  (state {res['state_bytes'][case] / 1e9:.3f} GB; xc = / XLA copy; wins = rounds < tri default)")
            log(f"  {'impl':20s} {'r1':>7s} {'r2':>7s} {'r3':>7s} {'median':>7s} {'%HBM':>5s} {'xc':>5s} {'wins':>4s} "
                "numerics")
            for label, r in rows.items():
                ms = "".join(f"{t:7.4f} " if t is not None else "      - " for t in
                             (r["rounds"] + [None] * ROUNDS)[:ROUNDS])
                med = r.get("median")
                num = next((x for x in res["numerics"] if x["case"] == case and x["impl"] == label), None)
                ntxt = "" if num is None else (f"o {num['o_rel']:.1e} st {num['state_rel']:.1e} "
                                               f"{'ok' if num['ok'] else 'FAILED'}")
                if med is None:
                    log(f"  {label:20s} {ms}{'-':>7s}  {ntxt}")
                    continue
                pct = 100 * res["state_bytes"][case] / med / 1e6 / HBM_GBPS
                xc = f"{med / copy:5.3f}" if copy else "    -"
                wins = ""
                if label.startswith("tri") and label != "tri default" and dflt:
                    wins = f"{sum(m < t for m, t in zip(r['rounds'], dflt))}/{min(len(dflt), len(r['rounds']))}"
                    r["wins"] = wins
                log(f"  {label:20s} {ms}{med:7.4f} {pct:5.1f} {xc} {wins:>4s} {ntxt}")
        if isinstance(res.get("ptxas"), dict) and res["ptxas"]:
            log(f"registers per thread (ptxas -v on each kernel's PTX; hook: {res.get('ptx_hook')})")
            for key, v in res["ptxas"].items():
                log(f"  {key[:60]:60s} {v}")
        lay = res["layer"]
        if lay.get("variants"):
            log(f"layer (gdn_layer_decode fused, raw gates; N {lay.get('N')} over S {lay.get('S')}; ms per round; "
                "numerics against the default's step)")
            for label, v in lay["variants"].items():
                num = "" if "o_rel" not in v else (f"o {v['o_rel']:.1e} ssm {v['ssm_rel']:.1e} conv "
                                                   f"{v['conv_equal']} untouched {v['untouched_same']} cfg used "
                                                   f"{v['config_used']} ok {v['ok']}")
                log(f"  {label:20s} {str(v.get('ms')):28s} {num}")
        t = res.get("tests")
        if t:
            log(kit.tally(t))
        if res["skipped"]:
            log("skipped:", res["skipped"][:20])
        if res["errors"]:
            log(f"errors: {len(res['errors'])}")
            for e in res["errors"][:8]:
                log("  " + e[:250])
        log(f"total {time.time() - T0:.0f} s (budget {args.budget:.0f} s)")
        save()

    def watchdog():
        log(f"WATCHDOG: {time.time() - T0:.0f} s, past the budget: table so far, exit")
        res["errors"].append("watchdog: budget exceeded")
        table()
        os._exit(3)

    timer = threading.Timer(args.budget + 15, watchdog)
    timer.daemon = True
    timer.start()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_gdn import bench_decode
    from jax_gdn.cases import Case
    from pallas_kernels.gated_delta_rule import decode
    from pallas_kernels.gated_delta_rule.api import fused_recurrent_gated_delta_rule_slots

    dev = jax.devices()[0]
    res.update(device=str(getattr(dev, "device_kind", dev.platform)), jax=jax.__version__)
    log(f"device {res['device']} jax {jax.__version__} ({left.elapsed():.0f} s)")
    impls = plan(decode.DecodeConfig, args.run)
    res["run"] = args.run
    hook = {"ptx": []}
    res["ptx_hook"] = install_ptx_hook(hook) if args.run == 2 else "off"
    log(f"ptx hook: {res['ptx_hook']}")
    if quick and args.run == 2:
        impls = [x for x in impls if x[0] in ("copy", "pcopy bv64 w2", "diag loads", "diag qknorm", "diag nodep nol2",
                                               "diag nol2", "tri default", "tri prenorm", "tri default mx128")]
        cases = {256: Case("quick-N6-Hk1-Hv2", 6, 1, 1, 2, 128, 128), 64: Case("quick-N4-Hk1-Hv2", 4, 1, 1, 2, 128, 128),
                 1: Case("quick-N1-Hk1-Hv2", 1, 1, 1, 2, 128, 128)}
        timing = dict(warmup=1, groups=2, per_group=2)
    elif quick:
        keep = ("copy", "copy donated", "pcopy bv64 w2", "pcopy bv64 w2 k64", "pcopy bv64 w4 h2", "diag nodep",
                "tri default", "tri early", "tri h2 bv64 w4", "tri h2 bv64 w4 early", "tri rs4", "tri rs4 early")
        if args.run == 3:
            keep = ("copy", "pcopy bv64 w2", "tri default", "mosaic rows bv64", "mosaic strided bv64",
                    "mcopy strided bv64")
        impls = [x for x in impls if x[0] in keep]
        cases = {256: Case("quick-N6-Hk1-Hv2", 6, 1, 1, 2, 128, 128), 64: Case("quick-N4-Hk1-Hv2", 4, 1, 1, 2, 128, 128),
                 1: Case("quick-N1-Hk1-Hv2", 1, 1, 1, 2, 128, 128)}
        timing = dict(warmup=1, groups=2, per_group=2)
    else:
        cases = {nn: Case(f"decode-N{nn}-Hk16-Hv32", nn, 1, 16, 32, 128, 128) for nn in (256, 64, 1)}
        timing = {}
    res["configs"] = {lb: dict(kind=kind, spec=str(spec)) for lb, kind, spec, _ in impls}
    res["state_bytes"] = {c.name: bench_decode.state_bytes(c) for c in cases.values()}
    guarded = lambda label, need, fn: kit.guarded(label, need, fn, left=left, log=log, res=res, save=save)

    def step_fn(xs, kind, spec):
        """jit((pool, ids, has) -> (o, pool)), the pool donated; one executable for timing and numerics."""
        if kind == "xla_copy_donated":
            return jax.jit(lambda p, ids, has: (jnp.zeros((), jnp.float32), p * 1.0001), donate_argnums=0)
        if kind == "pcopy":
            return jax.jit(lambda p, ids, has: pcopy_call(xs, p, ids, has, spec=spec, interpret=quick),
                           donate_argnums=0)
        if kind == "mosaic":
            from pallas_kernels.gated_delta_rule import decode_mosaic
            return jax.jit(lambda p, ids, has: decode_mosaic.fused_recurrent_gated_delta_rule_slots_fwd(
                *xs, scale=None, ssm_state=p, slot_ids=ids, has_initial_state=has, use_qk_l2norm=True,
                interpret=quick, config=spec), donate_argnums=0)
        return jax.jit(lambda p, ids, has: decode.fused_recurrent_gated_delta_rule_slots_fwd(
            *xs, scale=None, ssm_state=p, slot_ids=ids, has_initial_state=has, use_qk_l2norm=kind == "tri",
            interpret=quick, config=spec), donate_argnums=0)

    state = {}

    def build(nn):
        case = cases[nn]
        t = time.time()
        host = bench_decode.make_inputs_np(case)
        xs = kit.bf16_inputs(host[:5])
        st = state[case.name] = dict(case=case, host=host, xs=xs, ids=jnp.asarray(host[6]),
                                     has=jnp.ones(host[6].shape, bool), pool=jnp.asarray(host[5]), fns={})
        res["kernel"][case.name] = {"copy": {"rounds": []}}
        log(f"{case.name}: inputs {time.time() - t:.1f} s")
        for label, kind, spec, ns in impls:
            if nn not in ns or kind == "xla_copy":
                continue
            if left() < RESERVE_LAYER + KEEP_TESTS + 10:
                res["skipped"].append(f"{case.name} build {label}")
                continue
            t = time.time()
            try:
                hook.update(label=f"{case.name} {label}", maxnreg=MAXNREG.get(label))
                fn = step_fn(st["xs"], kind, spec)
                jax.block_until_ready(fn(jnp.array(st["pool"], copy=True), st["ids"], st["has"]))
                st["fns"][label] = (kind, fn)
                res["kernel"][case.name][label] = {"rounds": []}
                res["compile_s"][f"{case.name} {label}"] = round(time.time() - t, 2)
                log(f"  built {case.name} {label} ({time.time() - t:.1f} s, {left():.0f} s left)")
            except Exception as e:                          # report and go on without it
                res["errors"].append(f"build {case.name} {label}: {type(e).__name__}: {str(e)[:800]}")
                log(f"  FAIL build {case.name} {label}: {type(e).__name__}: {str(e)[:600]}")
                traceback.print_exc()
            finally:
                hook.update(label=None, maxnreg=None)
        save()

    def one_round(r, case_name, need):
        st = state[case_name]
        labels = ["copy"] + list(st["fns"])
        shift = (r * len(labels)) // ROUNDS
        for label in labels[shift:] + labels[:shift]:
            if left() < need:
                res["skipped"].append(f"{case_name} round {r + 1} {label}")
                continue
            row = res["kernel"][case_name][label]
            try:
                if label == "copy":
                    ms = bench_decode.time_copy(st["case"], st["host"], **timing)
                else:
                    fn, ids, has = st["fns"][label][1], st["ids"], st["has"]
                    ms = bench_decode._time_threaded(lambda p: fn(p, ids, has)[1], jnp.array(st["pool"], copy=True),
                                                     **timing)
                row["rounds"].append(round(ms, 4))
                row["median"] = round(statistics.median(row["rounds"]), 4)
                log(f"  round {r + 1} {case_name} {label:20s} {ms:8.4f} ms ({left():.0f} s left)")
            except Exception as e:
                res["errors"].append(f"round {r + 1} {case_name} {label}: {type(e).__name__}: {str(e)[:400]}")
                log(f"  FAIL round {r + 1} {case_name} {label}: {type(e).__name__}: {str(e)[:400]}")
        save()

    def rel_dev(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.sqrt(jnp.sum((a - b) ** 2) / jnp.maximum(jnp.sum(b * b), 1e-30)))

    def numerics(case_name):
        st = state[case_name]
        case = st["case"]
        pool0, perm = st["host"][5], st["host"][6]
        n = s = case.B
        ids = perm.copy()
        has = np.ones(n, bool)
        pool = pool0.copy()
        if n >= 4:
            ids[1], ids[3] = -1, s
            has[2] = False
            pool[ids[2]] = np.nan                                # a fresh stream over a stale slot
        untouched = np.setdiff1d(np.arange(s), ids)
        pool[untouched] = np.nan
        written = ids[(ids >= 0) & (ids < s)]
        fresh = ids[~has & (ids >= 0) & (ids < s)]
        carried = ids[has & (ids >= 0) & (ids < s)]
        xs32 = tuple(x.astype(jnp.float32) for x in st["xs"])
        ids_d, has_d = jnp.asarray(ids), jnp.asarray(has)
        keep = jnp.asarray(pool)
        w_d, u_d, c_d, f_d = (jnp.asarray(x) for x in (written, untouched, carried, fresh))
        with jax.default_matmul_precision("highest"):
            o_ref, p_ref = jax.jit(lambda p, i, h: fused_recurrent_gated_delta_rule_slots(
                *xs32, ssm_state=p, slot_ids=i, has_initial_state=h, use_qk_l2norm=True, backend="xla"))(
                    jnp.asarray(pool), ids_d, has_d)
        p_ref_w = p_ref[w_d]
        del p_ref
        for label, (kind, fn) in st["fns"].items():
            if left() < RESERVE_LAYER + KEEP_TESTS:
                res["skipped"].append(f"numerics {case_name} {label}")
                continue
            try:
                pd = jnp.array(keep, copy=True)
                ptr = pd.unsafe_buffer_pointer()
                o, p = fn(pd, ids_d, has_d)
                in_place = bool(p.unsafe_buffer_pointer() == ptr)
                if kind == "xla_copy_donated":                 # every slot scaled: only in place is checked
                    row = {"case": case_name, "impl": label, "o_rel": 0.0, "state_rel": 0.0, "in_place": in_place,
                           "untouched_same": None, "ok": in_place}
                else:
                    untouched_same = bool(jnp.array_equal(p[u_d], keep[u_d], equal_nan=True))
                    if label.startswith(("pcopy", "mcopy")):
                        same = bool(jnp.array_equal(p[c_d], keep[c_d], equal_nan=True))
                        zeros = bool((p[f_d] == 0).all()) if len(fresh) else True
                        o_rel, state_rel = 0.0, 0.0 if (same and zeros) else 1.0
                        ok = state_rel == 0 and untouched_same and in_place
                    elif label.startswith("diag"):              # wrong numbers on purpose: where it writes only
                        o_rel, state_rel = rel_dev(o, o_ref), float("nan")
                        ok = untouched_same and in_place
                    else:
                        o_rel, state_rel = rel_dev(o, o_ref), rel_dev(p[w_d], p_ref_w)
                        finite = bool(jnp.isfinite(o.astype(jnp.float32)).all())
                        ok = o_rel < 1e-2 and state_rel < 1e-5 and untouched_same and finite and in_place
                    row = {"case": case_name, "impl": label, "o_rel": o_rel, "state_rel": state_rel,
                           "untouched_same": untouched_same, "in_place": in_place, "ok": bool(ok)}
                log(f"  numerics {case_name} {label:20s} o {row['o_rel']:.2e} state {row['state_rel']:.2e} untouched "
                    f"{row['untouched_same']} in place {row['in_place']} -> {'ok' if row['ok'] else 'FAILED'}")
                res["numerics"].append(row)
                del o, p
            except Exception as e:
                res["errors"].append(f"numerics {case_name} {label}: {type(e).__name__}: {str(e)[:600]}")
                log(f"  FAIL numerics {case_name} {label}: {type(e).__name__}: {str(e)[:600]}")
                traceback.print_exc()
        save()

    def candidates():
        """The two fastest kernel candidates at N256 by median with numerics ok (not the default)."""
        big = res["kernel"].get(cases[256].name, {})
        ok = {x["impl"] for x in res["numerics"] if x["case"] == cases[256].name and x["ok"]}
        cands = sorted((r["median"], lb) for lb, r in big.items()
                       if lb.startswith("tri ") and lb != "tri default" and r.get("median") and lb in ok)
        return [lb for _, lb in cands[:2]]

    def layer():
        from jax_gdn.config import GdnDims
        from jax_gdn.layers import gdn
        from jax_gdn.state import GdnSlots
        if quick:
            dims, n, s, dt, kb = GdnDims(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=128,
                                         head_v_dim=128), 3, 5, jnp.float32, "pallas_interpret"
        else:
            from jax_gdn.bench_model import qwen3_next_80b_config
            dims, n, s, dt, kb = qwen3_next_80b_config(4).gdn_dims, 64, 72, jnp.bfloat16, "pallas"
        lay = res["layer"]
        lay.update(dims=str(dims), N=n, S=s)
        cfg_of = {lb: spec for lb, kind, spec, _ in impls if kind in ("tri", "mosaic")}
        hook.update(label="layer", maxnreg=None)
        labels = ["tri default"] + (candidates() if args.run == 1 else ["tri bv64 w4"])
        if args.run == 3:           # the Mosaic direct kernels through decode.BACKEND = "mosaic" (raw gates inside)
            labels = ["tri default", "mosaic strided bv64", "mosaic rows bv64", "mosaic rows bv128"]
        if quick:
            labels = ["tri default", "tri h2 bv64 w4" if args.run == 1 else "tri prenorm"]
            if args.run == 3:
                labels = ["tri default", "mosaic rows bv64"]     # "mosaic": Mosaic GPU interpret mode here
        lay["labels"] = labels
        params = gdn.init_params(dims, jax.random.PRNGKey(0), dt, randomize_norms=True)
        rng = np.random.default_rng(3)
        ids = rng.permutation(s)[:n].astype(np.int32)
        ids[1] = s
        has = np.ones(n, bool)
        has[2] = False
        untouched = np.setdiff1d(np.arange(s), ids)
        ssm = (0.3 * rng.standard_normal((s, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim))).astype(np.float32)
        ssm[untouched] = np.nan
        slots = GdnSlots(conv_state=jnp.asarray(rng.standard_normal((s, dims.conv_dim, dims.conv_kernel_size - 1)),
                                                dt), ssm_state=jnp.asarray(ssm))
        hidden = jnp.asarray(rng.standard_normal((n, dims.hidden_size)), dt)
        ids_d, has_d = jnp.asarray(ids), jnp.asarray(has)
        from pallas_kernels.gated_delta_rule import decode_mosaic
        saved = decode.decode_config
        saved_mosaic = decode.BACKEND, decode_mosaic.DEFAULT_CONFIG
        lay["variants"] = {}
        fns = {}

        def fresh():
            return GdnSlots(conv_state=jnp.array(slots.conv_state), ssm_state=jnp.array(slots.ssm_state))
        try:
            w, u = jnp.asarray(ids[(ids >= 0) & (ids < s)]), jnp.asarray(untouched)
            ref = None
            for label in labels:
                cfg = cfg_of[label]
                used = []
                if label.startswith("mosaic"):          # read at trace time: the Mosaic route and its config
                    decode.BACKEND, decode_mosaic.DEFAULT_CONFIG = "mosaic", cfg
                    real = decode_mosaic.fused_recurrent_gated_delta_rule_slots_fwd
                    decode_mosaic.fused_recurrent_gated_delta_rule_slots_fwd = (
                        lambda *a, real=real, used=used, **kw: used.append(1) or real(*a, **kw))
                else:                                   # the Triton kernel, whatever decode.BACKEND ships as
                    decode.BACKEND, decode_mosaic.DEFAULT_CONFIG = "triton", saved_mosaic[1]
                    decode.decode_config = lambda *a, cfg=cfg, used=used: used.append(1) or cfg
                fns[label] = jax.jit(lambda p, x, sl, i, h: gdn.gdn_layer_decode(
                    p, dims, x, sl, i, h, backend=kb, step="fused"), donate_argnums=2)
                try:
                    o, sl = fns[label](params, hidden, fresh(), ids_d, has_d)
                finally:
                    if label.startswith("mosaic"):
                        decode_mosaic.fused_recurrent_gated_delta_rule_slots_fwd = real
                    decode.BACKEND, decode_mosaic.DEFAULT_CONFIG = saved_mosaic
                v = lay["variants"][label] = {"config": kit.config_name(cfg), "config_used": len(used)}
                if ref is None:
                    ref = (o, sl)
                    continue
                v["o_rel"] = rel_dev(o, ref[0])
                v["ssm_rel"] = rel_dev(sl.ssm_state[w], ref[1].ssm_state[w])
                v["conv_equal"] = bool(jnp.array_equal(sl.conv_state, ref[1].conv_state))
                v["untouched_same"] = bool(jnp.array_equal(sl.ssm_state[u], slots.ssm_state[u], equal_nan=True))
                v["ok"] = bool(v["o_rel"] < 2e-2 and v["ssm_rel"] < 1e-4 and v["conv_equal"] and v["untouched_same"]
                               and v["config_used"] > 0)
                log(f"  layer {label} vs default: o {v['o_rel']:.2e} ssm {v['ssm_rel']:.2e} conv {v['conv_equal']} "
                    f"untouched {v['untouched_same']} -> {'ok' if v['ok'] else 'FAILED'}")
            save()
            for rnd in range(ROUNDS):
                order = labels[rnd % len(labels):] + labels[:rnd % len(labels)]
                for label in order:
                    if left() < KEEP_TESTS - 10:
                        res["skipped"].append(f"layer timing {label} round {rnd + 1}")
                        continue
                    fn = fns[label]
                    ms = bench_decode._time_threaded(lambda sl: fn(params, hidden, sl, ids_d, has_d)[1], fresh(),
                                                     **timing)
                    lay["variants"][label].setdefault("ms", []).append(round(ms, 4))
                    log(f"  layer step {label} round {rnd + 1}: {ms:.4f} ms")
        finally:
            decode.decode_config = saved
            decode.BACKEND, decode_mosaic.DEFAULT_CONFIG = saved_mosaic

    # ---- the run ----
    for nn in (256, 64, 1):
        guarded(f"build N{nn}", RESERVE_LAYER + KEEP_TESTS + 12, lambda nn=nn: build(nn))
    need = RESERVE_LAYER + KEEP_TESTS
    names = [c.name for c in cases.values() if c.name in state]
    for c in names:
        guarded(f"round 1 {c}", need + 1, lambda c=c: one_round(0, c, need))
    for c in names:
        guarded(f"numerics {c}", need + 1, lambda c=c: numerics(c))
    for r in range(1, ROUNDS):
        for c in names:
            guarded(f"round {r + 1} {c}", need + 1, lambda r=r, c=c: one_round(r, c, need))
    if args.run == 2:
        def registers():
            res["ptxas"] = ptxas_report([x for x in hook["ptx"] if x[0] and "N256" in str(x[0]) or
                                         x[0] == "layer"], out, log)
        guarded("ptxas", 10, registers)
    guarded("layer", 12, layer)
    state.clear()
    if not args.no_tests:
        def tests():
            pytest_args = ["-v", "-s", "-m", "gpu", "-p", "no:randomly", "-p", "no:cacheprovider", TEST_FILE]
            if args.run == 2:                                   # run 1 passed the others
                pytest_args += ["-k", "prenorm or w4 or in_place"]
            if args.run == 3:
                pytest_args[-1:] = ["tests/pallas_kernels/test_gdn_decode_mosaic.py", "-k", "direct or switch or public"]
            t = max(min(args.test_timeout, left() - 3), 5)
            log(f"== GPU tests (timeout {t:.0f} s): -m pytest {' '.join(pytest_args)}")
            child = kit.run_tests(pytest_args, quick=quick, timeout=t, log_path=os.path.join(out, f"{name}_tests.log"))
            child.record(res, log)
            for ln in child.lines:
                if "FIGURE" in ln:
                    log("  " + ln.strip()[:300])
        guarded("tests", 6, tests)
    timer.cancel()
    table()


if __name__ == "__main__":
    main()
