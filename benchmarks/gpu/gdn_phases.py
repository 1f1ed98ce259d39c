"""One device run (issue 9): where GDN phases 1 and 3 spend their time at Qwen3-Next-80B dims, old vs new.

    python benchmarks/gpu/gdn_phases.py OUT_DIR

varlen16 (jax_gdn.cases.VARLEN16_LENS, T = 19027 padded to the model's bucket 19456, N = 16), bf16, one GDN layer
(hidden 2048, 16 / 32 heads x 128, conv 4). Every variant and piece is jitted alone; its inputs are made before.
Two timings: ``med`` = median of 10 calls each closed by block_until_ready (the bench's method), ``pipe`` = 20
calls queued back to back then one block, divided by 20 (no per-call launch gap; used for the pieces).
Phase 1 variants return what phases 2 and 3 need (q, k, v, g, beta, z, slots):
  p1_old          proj + the row-gather conv + l2 (the two-step protocol functions, as the model ran them)
  p1_fused_xla    proj + phase1_conv1d_l2_varlen(backend="xla")  (reads p1.qkvz in place)
  p1_fused_pallas proj + phase1_conv1d_l2_varlen(backend="pallas") (Triton kernel, reads p1.qkvz in place)
  p1_split_*      the same with gdn.SPLIT_QKVZ_DOT (two matmuls over a per-call regrouped weight)
p13_*: phase 1 and phase 3 in one jit (v standing in for phase 2's o), z read as the model reads it.
Phase 3: phase3 as it is, and its pieces (gated norm, out_proj, out_proj + residual).
Also: numerics of the Pallas conv kernel against the XLA form at these dims (fp32 and bf16), a launch sweep, and
summaries of the compiled HLO (fusions, custom calls, copies, transposes, gathers) in OUT_DIR/*.hlo.txt.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/gdn_phases"
os.makedirs(OUT, exist_ok=True)
T_START = time.time()
SMALL = os.environ.get("GDN_PHASES_SMALL") == "1"
PALLAS = "pallas_interpret" if SMALL else "pallas"
RES = {"device": str(jax.devices()[0]), "jax": jax.__version__, "ms": {}, "numerics": {}, "hlo": {}, "sweep": {}}


def sync(x):
    jax.block_until_ready(x)


def med(fn, args, reps=10):
    sync(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sync(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def pipe(fn, args, reps=20):
    sync(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    sync(out)
    return 1e3 * (time.perf_counter() - t0) / reps


def hlo_summary(name, fn, args):
    try:
        text = fn.lower(*args).compile().as_text()
    except Exception as err:  # noqa: BLE001
        RES["hlo"][name] = f"error {type(err).__name__}: {err}"[:300]
        return
    with open(os.path.join(OUT, f"{name}.hlo.txt"), "w") as f:
        f.write(text)
    entry = text[text.find("ENTRY"):]
    s = {"fusions": len(re.findall(r"= \S+ fusion\(", entry)),
         "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', entry))),
         "n_custom_calls": len(re.findall(r"custom-call\(", entry)),
         "copies": len(re.findall(r"= \S+ copy\(", entry)), "transposes": len(re.findall(r" transpose\(", text)),
         "gathers": len(re.findall(r" gather\(", text)), "concats": len(re.findall(r" concatenate\(", text)),
         "kinds": sorted(set(re.findall(r"kind=(k\w+)", entry)))}
    RES["hlo"][name] = s


def timed(name, fn, args, both=False):
    try:
        f = jax.jit(fn)
        RES["ms"][name] = {"pipe": pipe(f, args)}
        if both:
            RES["ms"][name]["med"] = med(f, args)
        return f
    except Exception as err:  # noqa: BLE001
        RES["ms"][name] = f"error {type(err).__name__}: {str(err)[:400]}"
        print(name, RES["ms"][name], flush=True)
        return None


def old_gather_conv(x, w, pool, cu_seqlens, slot_ids, has_init):
    """The varlen conv as it was before this session's change (x read by a row gather per tap)."""
    from pallas_kernels.gated_delta_rule.chunk_map import gather_slots, scatter_slots, token_streams
    c, kc = w.shape
    t = x.shape[0]
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    prev = gather_slots(pool, slot_ids, has_init).astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    tok = jnp.arange(t, dtype=jnp.int32)
    tok_seq, rel = token_streams(cu, t)
    valid = tok < cu[n]
    w32 = w.astype(jnp.float32)
    y = w32[:, kc - 1] * x32
    for j in range(kc - 1):
        lag = kc - 1 - j
        inside = rel >= lag
        from_x = x32[jnp.maximum(tok - lag, 0)]
        col = jnp.clip(kc - 1 - lag + rel, 0, kc - 2)
        from_state = prev[tok_seq, :, col]
        y = y + w32[:, j] * jnp.where(inside[:, None], from_x, from_state)
    y = jnp.where(valid[:, None], jax.nn.silu(y), 0.0).astype(x.dtype)
    lens = cu[1:] - cu[:-1]
    p = jnp.arange(kc - 1, dtype=jnp.int32)
    v = lens[:, None] - (kc - 1) + p[None, :]
    from_x = jnp.swapaxes(x32[jnp.clip(cu[:-1, None] + v, 0, t - 1)], 1, 2)
    state_col = jnp.clip(p[None, :] + lens[:, None], 0, kc - 2)
    from_state = jnp.take_along_axis(prev, jnp.broadcast_to(state_col[:, None, :], prev.shape), axis=2)
    return y, scatter_slots(pool, slot_ids, jnp.where((v >= 0)[:, None, :], from_x, from_state))


def main():
    from jax_gdn.cases import VARLEN16_LENS
    from jax_gdn.config import GdnDims
    from jax_gdn.layers import gdn
    from jax_gdn.ops.conv1d import causal_conv1d_varlen
    from jax_gdn.ops.norms import gated_rms_norm, rms_norm
    from jax_gdn.state import BatchMeta, GdnSlots
    from pallas_kernels.conv1d import api as conv_api
    from pallas_kernels.conv1d.reference import qkvz_block_cols
    from pallas_kernels.conv1d.triton import Conv1dConfig

    if SMALL:   # CPU dry run of the script itself (no measurement): tiny dims, interpret mode
        dims = GdnDims(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32)
        lens, t = [40, 1, 63, 64, 65], 240
    else:
        dims = GdnDims(hidden_size=2048, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
        lens, t = list(VARLEN16_LENS), 19456
    t_real, n = sum(lens), len(lens)
    dt = jnp.bfloat16
    key = jax.random.PRNGKey(0)
    params = gdn.init_params(dims, key, dt, randomize_norms=True)
    x = jax.random.normal(jax.random.PRNGKey(1), (t, dims.hidden_size), jnp.float32).astype(dt)
    slots = GdnSlots.zeros(dims, n, dt)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    meta = BatchMeta(cu_seqlens=cu, slot_ids=jnp.arange(n, dtype=jnp.int32), has_initial_state=jnp.zeros((n,), bool),
                     positions=jnp.zeros((n,), jnp.int32))
    RES.update(T=t_real, T_padded=t, N=n)
    hk, hv, d = dims.num_k_heads, dims.num_v_heads, dims.head_k_dim
    r, g = hv // hk, 2 * d + 2 * (hv // hk) * d
    cols = qkvz_block_cols(hk, hv, d)

    def ret(p1, q, k, v, s):
        return q, k, v, p1.g, p1.beta, p1.z, s

    def p1_old(p, x, s, m):
        a = gdn.phase1_proj_batched(p, dims, x)
        y, pool = old_gather_conv(a.mixed_qkv, p["conv1d"], s.conv_state, m.cu_seqlens, m.slot_ids,
                                  m.has_initial_state)
        return ret(a, *gdn.phase1_l2_batched(dims, y), s.replace(conv_state=pool))

    def p1_fused(backend, split=False):
        def f(p, x, s, m):
            gdn.SPLIT_QKVZ_DOT = split                       # read at trace time
            try:
                a = gdn.phase1_proj_batched(p, dims, x)
                q, k, v, s2 = gdn.phase1_conv1d_l2_varlen(p, dims, a, s, m, backend=backend)
            finally:
                gdn.SPLIT_QKVZ_DOT = False
            return ret(a, q, k, v, s2)
        return f

    def p13(p1fn):   # phases 1 and 3 in one jit, v standing in for phase 2's o (same shape): the model's view
        def f(p, x, s, m):
            q, k, v, g_, b_, z, s2 = p1fn(p, x, s, m)
            return gdn.phase3(p, dims, v, z, x), q, k, g_, b_, s2
        return f

    args = (params, x, slots, meta)
    variants = (("p1_old", p1_old), ("p1_fused_xla", p1_fused("xla")), ("p1_fused_pallas", p1_fused(PALLAS)),
                ("p1_split_pallas", p1_fused(PALLAS, True)), ("p1_split_xla", p1_fused("xla", True)))
    for name, fn in variants:
        f = timed(name, fn, args, both=True)
        if f is not None and name in ("p1_old", "p1_fused_pallas", "p1_fused_xla"):
            hlo_summary(name, f, args)
        print(name, RES["ms"][name], RES["hlo"].get(name), flush=True)
    for name, fn in variants[:4]:
        timed("p13" + name[2:], p13(fn), args, both=True)

    # ---- phase 1 pieces ----
    xn = jax.jit(lambda x, w: rms_norm(x, w, dims.rms_norm_eps))(x, params["input_layernorm"])
    a = jax.jit(lambda p, x: gdn.phase1_proj_batched(p, dims, x))(params, x)
    mixed = jax.jit(lambda a: a.mixed_qkv)(a)
    qkvz = a.qkvz
    timed("rmsnorm", lambda x, w: rms_norm(x, w, dims.rms_norm_eps), (x, params["input_layernorm"]))
    timed("dot_qkvz", lambda x, w: x @ w, (xn, params["in_proj_qkvz"]))
    timed("dot_qkv_z_split", lambda x, w: [x @ u for u in gdn.split_qkvz_weight(w, dims)],
          (xn, params["in_proj_qkvz"]))

    def ba_gates(p, x):
        ba = (x @ p["in_proj_ba"]).reshape(t, hk, 2 * r)
        return gdn._gates(p, ba[..., :r].reshape(t, hv), ba[..., r:].reshape(t, hv))
    timed("dot_ba_gates", ba_gates, (params, xn))
    timed("proj_raw", lambda p, x: (lambda a: (a.qkvz, a.beta, a.g))(gdn.phase1_proj_batched(p, dims, x)),
          (params, x))
    cargs = (mixed, params["conv1d"], slots.conv_state, cu, meta.slot_ids, meta.has_initial_state)
    timed("conv_old_gather", old_gather_conv, cargs)
    conv_out = jax.jit(causal_conv1d_varlen)(*cargs)[0]
    timed("l2_split", lambda c: gdn.phase1_l2_batched(dims, c), (conv_out,))
    for be in ("xla", PALLAS):
        timed(f"conv_l2_{be}_from_qkvz", lambda q, w, pool, cu, ids, hi, be=be: conv_api.causal_conv1d_l2_varlen(
            q, w, pool, cu, ids, hi, num_k_heads=hk, num_v_heads=hv, head_dim=d, block_cols=cols, backend=be),
            (qkvz,) + cargs[1:])
        timed(f"conv_l2_{be}_from_mixed", lambda q, w, pool, cu, ids, hi, be=be: conv_api.causal_conv1d_l2_varlen(
            q, w, pool, cu, ids, hi, num_k_heads=hk, num_v_heads=hv, head_dim=d, backend=be), cargs)
    for bt, nw in ((32, 4), (128, 4), (32, 8), (64, 8), (128, 8)):
        cfg = Conv1dConfig(block_t=bt, num_warps=nw)
        try:
            f = jax.jit(lambda q, w, pool, cu, ids, hi, cfg=cfg: conv_api.causal_conv1d_l2_varlen(
                q, w, pool, cu, ids, hi, num_k_heads=hk, num_v_heads=hv, head_dim=d, block_cols=cols,
                backend=PALLAS, config=cfg))
            RES["sweep"][f"bt{bt}_w{nw}"] = pipe(f, (qkvz,) + cargs[1:])
        except Exception as err:  # noqa: BLE001
            RES["sweep"][f"bt{bt}_w{nw}"] = f"error {type(err).__name__}: {str(err)[:200]}"
    print("sweep", RES["sweep"], flush=True)

    # ---- numerics of the kernel at these dims ----
    for dtn in ("float32", "bfloat16"):
        src = qkvz.astype(dtn)
        pool = jax.random.normal(jax.random.PRNGKey(3), slots.conv_state.shape, jnp.float32).astype(dtn)
        hi = jnp.asarray(np.arange(n) % 2 == 0)
        outs = {}
        for be in ("xla", PALLAS):
            outs[be] = jax.jit(lambda s, pool, be=be: conv_api.causal_conv1d_l2_varlen(
                s, params["conv1d"], pool, cu, meta.slot_ids, hi, num_k_heads=hk, num_v_heads=hv, head_dim=d,
                block_cols=cols, backend=be))(src, pool)
        diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                 for a, b in zip(outs["xla"], outs[PALLAS])]
        finite = all(bool(jnp.isfinite(a.astype(jnp.float32)).all()) for a in outs[PALLAS])
        RES["numerics"][dtn] = {"max_abs_q_k_v_pool": diffs, "finite": finite,
                                "pad_rows_zero": bool((outs[PALLAS][0][t_real:] == 0).all())}
    two = jax.jit(p1_old)(*args)
    for name in ("p1_fused_xla", "p1_fused_pallas"):
        fused = jax.jit(dict(variants)[name])(*args)
        RES["numerics"][name + "_vs_old_bf16"] = [float(jnp.max(jnp.abs(u.astype(jnp.float32) - w_.astype(jnp.float32))))
                                                   for u, w_ in zip(two[:3], fused[:3])]
    print("numerics", RES["numerics"], flush=True)

    # ---- phase 3 ----
    o = jax.random.normal(jax.random.PRNGKey(5), (t, hv, d), jnp.float32).astype(dt)
    z = a.z
    y = jax.jit(lambda o, z, w: gated_rms_norm(o, z, w, dims.rms_norm_eps))(o, z, params["norm"]).reshape(t, -1)

    def p3_f32out(p, o, z, r):
        yy = gated_rms_norm(o, z, p["norm"], dims.rms_norm_eps).reshape(t, -1)
        out = jnp.dot(yy, p["out_proj"], preferred_element_type=jnp.float32)
        return (r.astype(jnp.float32) + out).astype(r.dtype)

    def p3_from_qkvz(p, o, q, res):   # z read from the fused projection in place (as inside the model's jit)
        zz = q.reshape(t, hk, g)[..., 2 * d + r * d:].reshape(t, hv, d)
        return gdn.phase3(p, dims, o, zz, res)

    p3_args = (params, o, z, x)
    f3 = timed("p3", lambda p, o, z, r: gdn.phase3(p, dims, o, z, r), p3_args, both=True)
    if f3 is not None:
        hlo_summary("p3", f3, p3_args)
    timed("p3_from_qkvz", p3_from_qkvz, (params, o, qkvz, x), both=True)
    timed("gated_norm", lambda o, z, w: gated_rms_norm(o, z, w, dims.rms_norm_eps), (o, z, params["norm"]))
    timed("dot_out", lambda y, w: y @ w, (y, params["out_proj"]))
    timed("dot_out_residual", lambda y, w, r: r + y @ w, (y, params["out_proj"], x))

    RES["wall_s"] = time.time() - T_START
    with open(os.path.join(OUT, "gdn_phases.json"), "w") as f:
        json.dump(RES, f, indent=1)
    print(f"\n{'piece':<28} {'pipe ms':>9} {'med ms':>9}")
    for k_, v_ in RES["ms"].items():
        if isinstance(v_, dict):
            print(f"{k_:<28} {v_['pipe']:9.3f} {v_.get('med', float('nan')):9.3f}")
        else:
            print(f"{k_:<28} {v_}")
    dd, ncol = dims.hidden_size, 2 * dims.key_dim + 2 * dims.value_dim + 2 * hv
    print("floors at 700 TFLOP/s: in_proj_qkvz+ba %.3f ms, out_proj %.3f ms" % (
        2 * t * dd * ncol / 700e12 * 1e3, 2 * t * dims.value_dim * dd / 700e12 * 1e3))
    print("wall", round(RES["wall_s"], 1), "s")


if __name__ == "__main__":
    main()
