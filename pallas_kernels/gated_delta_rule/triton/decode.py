"""Pallas (Triton lowering) decode kernel: the per-token gated delta rule over a state-slot pool, in place.

One program per (stream n, value head h, value block): it reads its [K, BV] block of the state from
``pool[slot_ids[n], h]`` (zeros when ``has_initial_state[n]`` is False or the id names no slot), runs the T tokens
of the stream (T = 1 for decode, a few for speculative decoding) with the state in registers, stores the outputs
and writes the block back to the same slot (the pool is aliased: donated, it is updated in place; an id outside
[0, S) drops the write). Per token, with value head h reading key head h // (Hv // Hk):

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t)

optionally with q_t, k_t L2-normalised in fp32 first (``x * rsqrt(sum x^2 + 1e-6)``). With
``DecodeConfig.fused_output`` (the default) it is computed from the loaded S as a = exp(g_t),
delta = beta_t (v_t - a S^T k_t), o_t = scale (a S^T q_t + (q_t . k_t) delta), S = a S + k_t delta^T: the same
numbers up to fp32 rounding, with two independent K reductions. The state bytes (read once, written once) are the
whole cost: 256 streams x 32 heads x 128 x 128 fp32 is 0.54 GB each way.

Where it runs: the op's dispatch table (``api.py``) picks, for "auto", ``gated_delta_rule/mosaic_gpu/decode.py``'s
direct kernel for a one-token call on a Hopper GPU, and this kernel for the rest (T > 1, other GPUs, other head
dims; backend "pallas" always, "pallas_interpret" in interpret mode). Why the Mosaic one is faster (ncu on the
H200): Triton lays the [128, 64] block out with 32 rows a thread, so each thread also holds 32 values of q and
of k; this kernel takes 249 registers a thread, 4 two-warp programs an SM, 0.298 ms at N256, where its copy twin
(138 registers, 6 programs) takes 0.274; Pallas Triton gives no handle on the layout. The
Mosaic kernel's layout holds 16 rows a thread and runs at its own copy's speed (0.278).

Shape legend: N streams, T tokens per stream, S slots, Hk / Hv key / value heads, K / V head dims (powers of two
>= 16: the entry point pads), BV value block.

    q, k [N, T, Hk, K]; v [N, T, Hv, V]; g, beta [N, T, Hv]; pool [S, Hv, K, V] fp32;
    slot_ids, has_initial_state [N] int32  ->  o [N, T, Hv, V] in v's dtype, pool (aliased)

With ``RawGates`` (the GDN layer's fused decode step) g and beta are made inside from the raw projections:
g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), a and b given in place of g and beta as [N, T, Hk, Ca].

``fused_recurrent_gated_delta_rule_slots_fwd`` (called by api.py after validation) pads head dims to the kernel's
sizes and guards against autodiff as the prefill entry points do. This module imports only jax (and its folder).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule.triton import chunk as _pt
from pallas_kernels.gated_delta_rule.reference import l2norm

L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel.

    block_v: the value block of one program (a power of two; min(block_v, V) must divide V).
    num_warps, num_stages: Triton's (one load per program: stages do not pipeline anything).
    v_fastest: grid (V / BV, Hv, N), the value block varying fastest in launch order, so the programs in flight
      together read neighbouring blocks of one slot (one contiguous [Hv, K, V] run of the pool); False: grid
      (N, Hv, V / BV), stream fastest.
    fused_output: o from the state as loaded, o = scale (a S^T q + (q . k) delta), so the two K reductions
      (S^T k, S^T q) are independent and the new state's store does not wait on the second; False: o = S_new^T
      (scale q) after the update (two reductions in a row).
    programs: 0, one program per (stream, head, value block); P > 0, a persistent grid of P programs, each
      running every P-th block with the next block's state load issued before the current block's store
      (v_fastest does not apply: blocks are numbered value block fastest). Compiles and is right on the H200,
      but slower at every P tried (N256-Hv32: 0.359 / 0.407 / 0.432 ms for BV 64 P 264, BV 64 P 396, BV 32 P 660
      against the default's 0.335 in the same run; NOTES.md): off.
    load_hint: how the state block is loaded and stored (``LOAD_HINTS``; the grid form only). H200, N256-Hv32
      (benchmarks/logs/s6/gdn_decode_s6_run1.log): "" 0.316 ms, "masked" 0.319, "evict_first" 0.347 (4 warps 0.318).
    row_block: 0, the block held whole in registers; R > 0 (dividing K; T = 1 only, other T run the default form):
      the two-pass form (``_decode_two_pass_kernel``: S^T k, S^T q over [R, BV] chunks, then each chunk re-read,
      updated and stored). Off: slower at every setting measured on the H200 (N256-Hv32: 0.365-0.453 ms against
      the default's 0.320; benchmarks/logs/s6/gdn_decode_s6_run2.log, NOTES.md).
    heads: value heads per program (a power of two dividing Hv / Hk, so they share one key head: q and k are loaded
      and normalised once, and the heads' [K, BV] blocks are loaded as one [heads, K, BV] block before any
      reduction); grid (V / BV, Hv / heads, N) or (N, Hv / heads, V / BV); the grid form only (programs 0,
      row_block 0; load_hint does not apply). Off (1): slower on the H200 (N256-Hv32: 2 heads BV 64 4 warps 0.312 ms,
      BV 32 2 warps 0.330, BV 128 8 warps 0.379, against the default's 0.298; NOTES.md "Session 9: decode at HBM
      speed", benchmarks/logs/s9/call2/gdn_decode_s9/gdn_decode_s9.log).
    row_split: 1, the block loaded as one [K, BV] tensor; R > 1 (dividing K; T = 1 and heads 1 only, other calls
      run the default form; load_hint does not apply): loaded as R [K / R, BV] row slices, every slice's load
      issued before the first partial K reduction, each slice updated and stored after delta. Off: slower
      (N256: R 2 0.313, R 4 0.316 ms).
    early_store: T = 1 only (other T as before): the new state is stored as soon as S^T k and delta are known, and
      S^T q (the second K reduction) and o come after the store in program order, so the store does not wait on the
      second reduction and o's store (the fused-output numbers; the plain, heads and row_split forms). Off: no
      faster (N256: 0.2998 against 0.2982; the store's wait is not the cost, see ``diag nodep`` in NOTES.md).
    prenorm: with use_qk_l2norm, q and k are L2-normalised in fp32 by XLA before the kernel (one small fusion over
      N Hk K elements; the kernel gets fp32 q, k and runs without its per-program norm reductions); the same
      numbers up to fp32 rounding. Applies to ``fused_recurrent_gated_delta_rule_slots_fwd`` (the entry point), not
      to ``fused_recurrent_slots``. Off: slower at N256 (0.3036 against 0.3006 ms: the norms cost the kernel
      nothing, the fusion ~0.003), 0.0005 faster at N64 (benchmarks/logs/s9/call3/gdn_decode_s9_2/).

    Defaults from one H200 sweep (NOTES.md, benchmarks/logs/decode_sweep_h200_run1.log, N256-Hk16-Hv32, the
    XLA copy of the same bytes 0.294 ms in that run): BV 64 / 2 warps / v_fastest / fused 0.314 ms; the previous
    default (BV 64 / 4 warps / stream fastest / unfused) 0.331; BV 128 / 8 warps 0.330; BV 32 0.34-0.36;
    BV 16 0.43-0.44; BV 8 / 1 warp (FLA's shape) 0.546. Qwen3.5-397B heads (N64-Hv64): 0.170 against 0.194.
    """
    block_v: int = 64
    num_warps: int = 2
    num_stages: int = 1
    v_fastest: bool = True
    fused_output: bool = True
    programs: int = 0
    load_hint: str = ""
    row_block: int = 0
    heads: int = 1
    row_split: int = 1
    early_store: bool = False
    prenorm: bool = False


#: DecodeConfig.load_hint: "" (plain load, then a select for fresh streams), "masked" (masked load: no bytes for a
#: fresh stream), "evict_first" (masked load and store with Triton's evict_first: the state streams through L2
#: without displacing q/k/v). Session 6 sweep. (A "cg" cache modifier cannot be asked for: jax 0.10.2's Triton
#: lowering accepts ".cg" and then fails to look it up.)
LOAD_HINTS = ("", "masked", "evict_first")


def decode_config(n: int, hv: int, kdim: int, vdim: int) -> DecodeConfig:
    """The launch parameters for N streams x Hv heads x K x V (kernel dims), chosen at trace time: one config
    measured best or within noise at every size swept (N 1 / 64 / 256, Hv 32 / 64, K = V = 128); for V < 64 the
    value block is V (``fused_recurrent_slots`` clamps it)."""
    del n, hv, kdim, vdim
    return DecodeConfig()


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))          # jax.nn.softplus's form


def _read_gates(g_ref, beta_ref, gate_refs, *, n, t, h, group, heads: int = 1):
    """(g_t, beta_t) fp32 of stream n, token t, value head h (scalars; with ``heads`` > 1, [heads] vectors of the
    value heads h .. h + heads - 1 of one key head): read, or (``gate_refs`` = (A_log, dt_bias) refs [Hv]) made
    from the raw projections, g_ref = a and beta_ref = b [N, T, Hk, Ca] with value head h at column ``h % group``
    of key head h // group (see ``fused_recurrent_slots``'s ``raw_gates``)."""
    def at(i):
        return i if heads == 1 else pl.ds(i, heads)
    if gate_refs is None:
        return g_ref[n, t, at(h)].astype(jnp.float32), beta_ref[n, t, at(h)].astype(jnp.float32)
    alog_ref, dtb_ref, a_off, b_off = gate_refs
    hk, j = h // group, h % group
    a = g_ref[n, t, hk, at(a_off + j)].astype(jnp.float32)
    b = beta_ref[n, t, hk, at(b_off + j)].astype(jnp.float32)
    g = -jnp.exp(alog_ref[at(h)].astype(jnp.float32)) * _softplus(a + dtb_ref[at(h)].astype(jnp.float32))
    return g, jax.nn.sigmoid(b)


def _run_tokens(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, *, n, h, hk, vs, scale, use_qk_l2norm, num_tokens,
                fused_output, o_mask=None, gate_refs=None, group=1):
    """The T tokens of stream n on value head h's [K, BV] state block ``s`` (columns ``vs``); stores o (masked by
    ``o_mask`` [BV] when given) and returns the new block."""

    def token(t, s):
        q = q_ref[n, t, hk, :].astype(jnp.float32)                              # [K]
        k = k_ref[n, t, hk, :].astype(jnp.float32)                              # [K]
        if use_qk_l2norm:
            q = q * lax.rsqrt(jnp.sum(q * q) + L2_EPS)
            k = k * lax.rsqrt(jnp.sum(k * k) + L2_EPS)
        v = v_ref[n, t, h, vs].astype(jnp.float32)                              # [BV]
        g, beta = _read_gates(g_ref, beta_ref, gate_refs, n=n, t=t, h=h, group=group)
        a = jnp.exp(g)
        if fused_output:
            sk = jnp.sum(k[:, None] * s, axis=0)                                # [BV]  S^T k
            sq = jnp.sum(q[:, None] * s, axis=0)                                # [BV]  S^T q
            delta = beta * (v - a * sk)
            o = scale * (a * sq + jnp.sum(q * k) * delta)
            s = a * s + k[:, None] * delta[None, :]
        else:
            s = a * s
            delta = beta * (v - jnp.sum(k[:, None] * s, axis=0))                # [BV]
            s = s + k[:, None] * delta[None, :]
            o = jnp.sum((scale * q)[:, None] * s, axis=0)
        if o_mask is None:
            o_ref[n, t, h, vs] = o.astype(o_ref.dtype)
        else:
            plgpu.store(o_ref.at[n, jnp.int32(t), h, vs], o.astype(o_ref.dtype), mask=o_mask)   # int: interpret
        return s

    if num_tokens == 1:
        return token(0, s)
    return lax.fori_loop(0, num_tokens, token, s)


def _split_refs(refs, gate_offsets):
    """(A_log, dt_bias) refs + offsets (or None), pool_in, o, pool_out from the refs after beta's."""
    if gate_offsets is None:
        return (None,) + tuple(refs)
    alog_ref, dtb_ref, pool_in_ref, o_ref, pool_out_ref = refs
    return (alog_ref, dtb_ref) + tuple(gate_offsets), pool_in_ref, o_ref, pool_out_ref


def _program_slot(slot_ref, pool_in_ref, *, v_fastest: bool, block_v: int):
    """The decode kernels' program coordinates: (stream n, value head h, value columns vs, in_pool, read_slot). The
    grid is (N, Hv, V / BV), or (V / BV, Hv, N) when v_fastest; an id outside [0, S) names no slot (in_pool False:
    zeros in, no write), read_slot its clipped id for the loads."""
    if v_fastest:
        vb, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:
        n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_slots = pool_in_ref.shape[0]
    slot = slot_ref[n]
    in_pool = (slot >= 0) & (slot < num_slots)
    return n, h, pl.ds(vb * block_v, block_v), in_pool, jnp.clip(slot, 0, num_slots - 1)


def _decode_kernel(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, group, block_v, v_fastest,
                   gate_offsets, load_hint, row_split=1, early_store=False, **token_args):
    """One program per (stream, value head, value block). refs: [A_log, dt_bias (raw gates only),] pool_in, o,
    pool_out."""
    gate_refs, pool_in_ref, o_ref, pool_out_ref = _split_refs(refs, gate_offsets)
    n, h, vs, in_pool, read_slot = _program_slot(slot_ref, pool_in_ref, v_fastest=v_fastest, block_v=block_v)
    kdim = pool_in_ref.shape[2]
    read = (has_ref[n] != 0) & in_pool
    if row_split > 1:
        _row_split_step(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, pool_in_ref, pool_out_ref, n=n, h=h, vs=vs,
                        read=read, in_pool=in_pool, read_slot=read_slot, group=group, gate_refs=gate_refs,
                        row_split=row_split, early_store=early_store, **token_args)
        return
    if early_store and token_args["num_tokens"] == 1 and load_hint != "evict_first":
        if load_hint:
            s = plgpu.load(pool_in_ref.at[read_slot, h, :, vs], mask=jnp.broadcast_to(read, (kdim, block_v)),
                           other=0.0).astype(jnp.float32)
        else:
            s = jnp.where(read, pool_in_ref[read_slot, h, :, vs].astype(jnp.float32), 0.0)

        def store(s_new):
            pool_out_ref[read_slot, h, :, vs] = s_new.astype(pool_out_ref.dtype)
        _early_store_token(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, store, in_pool=in_pool, n=n, h=h,
                           hk=h // group, hs=h, vs=vs, gate_refs=gate_refs, group=group, **token_args)
        return
    if load_hint:                                       # masked load (no bytes for a fresh stream) with a hint
        hint = dict(evict_first=dict(eviction_policy="evict_first"), masked={})[load_hint]
        s = plgpu.load(pool_in_ref.at[read_slot, h, :, vs], mask=jnp.broadcast_to(read, (kdim, block_v)),
                       other=0.0, **hint).astype(jnp.float32)
    else:
        s = pool_in_ref[read_slot, h, :, vs].astype(jnp.float32)                # [K, BV]
        s = jnp.where(read, s, 0.0)                                             # select: a stale NaN never leaks
    s = _run_tokens(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, n=n, h=h, hk=h // group, vs=vs,
                    gate_refs=gate_refs, group=group, **token_args)

    @pl.when(in_pool)
    def _():
        if load_hint == "evict_first":
            plgpu.store(pool_out_ref.at[read_slot, h, :, vs], s.astype(pool_out_ref.dtype),
                        eviction_policy="evict_first")
        else:
            pool_out_ref[read_slot, h, :, vs] = s.astype(pool_out_ref.dtype)


def _early_store_token(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, store, *, in_pool, n, h, hk, hs, vs, gate_refs,
                       group, scale, use_qk_l2norm, num_tokens, fused_output, gates=None):
    """One token (T = 1, ``DecodeConfig.early_store``) on the loaded block ``s`` ([K, BV], or [H, K, BV] with
    ``gates`` giving the heads' (g, beta) [H]): S^T k, delta, the new state stored (``store``, when ``in_pool``),
    then S^T q of the loaded block and o (the fused-output form)."""
    del num_tokens, fused_output
    q = q_ref[n, 0, hk, :].astype(jnp.float32)                                  # [K]
    k = k_ref[n, 0, hk, :].astype(jnp.float32)
    if use_qk_l2norm:
        q = q * lax.rsqrt(jnp.sum(q * q) + L2_EPS)
        k = k * lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    v = v_ref[n, 0, hs, vs].astype(jnp.float32)                                 # [BV] or [H, BV]
    if gates is None:
        g, beta = _read_gates(g_ref, beta_ref, gate_refs, n=n, t=0, h=h, group=group)
        a = jnp.exp(g)
        kb, qb, axis, a_s, d_s = k[:, None], q[:, None], 0, a, lambda d: d[None, :]
    else:
        g, beta = gates
        a = jnp.exp(g)[:, None]                                                 # [H, 1]
        beta = beta[:, None]
        kb, qb, axis, a_s, d_s = k[None, :, None], q[None, :, None], 1, a[:, :, None], lambda d: d[:, None, :]
    sk = jnp.sum(kb * s, axis=axis)
    delta = beta * (v - a * sk)

    @pl.when(in_pool)
    def _():
        store(a_s * s + kb * d_s(delta))

    sq = jnp.sum(qb * s, axis=axis)
    o_ref[n, 0, hs, vs] = (scale * (a * sq + jnp.sum(q * k) * delta)).astype(o_ref.dtype)


def _row_split_step(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, pool_in_ref, pool_out_ref, *, n, h, vs, read, in_pool,
                    read_slot, group, gate_refs, row_split, scale, use_qk_l2norm, num_tokens, fused_output,
                    early_store=False):
    """One token (T = 1) on the [K, BV] block of (n, h, vs) loaded as ``row_split`` row slices (``DecodeConfig.
    row_split``): every slice's load issued first, partial S^T k and S^T q per slice, then delta and o, then each
    slice updated and stored (the fused-output form whatever ``fused_output`` says: the same numbers up to fp32
    rounding). ``early_store``: S^T q after the slices' stores (``DecodeConfig.early_store``)."""
    del num_tokens, fused_output
    hk = h // group
    kdim = pool_in_ref.shape[2]
    rows = kdim // row_split
    sl = [pl.ds(i * rows, rows) for i in range(row_split)]
    parts = [jnp.where(read, pool_in_ref[read_slot, h, r, vs].astype(jnp.float32), 0.0) for r in sl]   # [R, BV]
    q = q_ref[n, 0, hk, :].astype(jnp.float32)
    k = k_ref[n, 0, hk, :].astype(jnp.float32)
    qs = ks = jnp.float32(1.0)
    if use_qk_l2norm:
        qs, ks = lax.rsqrt(jnp.sum(q * q) + L2_EPS), lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    qk = jnp.sum(q * k) * qs * ks
    k_parts = [k_ref[n, 0, hk, r].astype(jnp.float32) * ks for r in sl]

    def reduce(vecs):
        out = None
        for part, x_r in zip(parts, vecs):
            p = jnp.sum(x_r[:, None] * part, axis=0)
            out = p if out is None else out + p
        return out

    q_parts = [q_ref[n, 0, hk, r].astype(jnp.float32) * qs for r in sl]
    sk = reduce(k_parts)
    sq = None if early_store else reduce(q_parts)
    g, beta = _read_gates(g_ref, beta_ref, gate_refs, n=n, t=0, h=h, group=group)
    a = jnp.exp(g)
    delta = beta * (v_ref[n, 0, h, vs].astype(jnp.float32) - a * sk)                # [BV]
    if not early_store:
        o_ref[n, 0, h, vs] = (scale * (a * sq + qk * delta)).astype(o_ref.dtype)

    @pl.when(in_pool)
    def _():
        for r, part, k_r in zip(sl, parts, k_parts):
            pool_out_ref[read_slot, h, r, vs] = (a * part + k_r[:, None] * delta[None, :]).astype(pool_out_ref.dtype)

    if early_store:
        o_ref[n, 0, h, vs] = (scale * (a * reduce(q_parts) + qk * delta)).astype(o_ref.dtype)


def _decode_heads_kernel(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, group, block_v, v_fastest,
                         gate_offsets, heads, scale, use_qk_l2norm, num_tokens, fused_output, early_store=False):
    """One program per (stream, ``heads`` value heads of one key head, value block) (``DecodeConfig.heads``): the
    heads' [heads, K, BV] state block loaded as one tensor, q and k read and normalised once, T tokens as
    ``_run_tokens`` with a head axis in front."""
    gate_refs, pool_in_ref, o_ref, pool_out_ref = _split_refs(refs, gate_offsets)
    n, hb, vs, in_pool, read_slot = _program_slot(slot_ref, pool_in_ref, v_fastest=v_fastest, block_v=block_v)
    h0 = hb * heads
    hs = pl.ds(h0, heads)
    hk = h0 // group
    read = (has_ref[n] != 0) & in_pool
    s = jnp.where(read, pool_in_ref[read_slot, hs, :, vs].astype(jnp.float32), 0.0)    # [H, K, BV]

    def gates(t):
        return _read_gates(g_ref, beta_ref, gate_refs, n=n, t=t, h=h0, group=group, heads=heads)

    def token(t, s):
        q = q_ref[n, t, hk, :].astype(jnp.float32)                              # [K]
        k = k_ref[n, t, hk, :].astype(jnp.float32)
        if use_qk_l2norm:
            q = q * lax.rsqrt(jnp.sum(q * q) + L2_EPS)
            k = k * lax.rsqrt(jnp.sum(k * k) + L2_EPS)
        v = v_ref[n, t, hs, vs].astype(jnp.float32)                             # [H, BV]
        g, beta = gates(t)                                                      # [H]
        a = jnp.exp(g)[:, None]                                                 # [H, 1]
        k3, q3 = k[None, :, None], q[None, :, None]
        if fused_output:
            sk, sq = jnp.sum(k3 * s, axis=1), jnp.sum(q3 * s, axis=1)           # [H, BV]
            delta = beta[:, None] * (v - a * sk)
            o = scale * (a * sq + jnp.sum(q * k) * delta)
            s = a[:, :, None] * s + k3 * delta[:, None, :]
        else:
            s = a[:, :, None] * s
            delta = beta[:, None] * (v - jnp.sum(k3 * s, axis=1))
            s = s + k3 * delta[:, None, :]
            o = scale * jnp.sum(q3 * s, axis=1)
        o_ref[n, t, hs, vs] = o.astype(o_ref.dtype)
        return s

    if early_store and num_tokens == 1:
        def store(s_new):
            pool_out_ref[read_slot, hs, :, vs] = s_new.astype(pool_out_ref.dtype)
        _early_store_token(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, store, in_pool=in_pool, n=n, h=h0,
                           hk=hk, hs=hs, vs=vs, gate_refs=None, group=group, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, num_tokens=1, fused_output=True, gates=gates(0))
        return
    s = token(0, s) if num_tokens == 1 else lax.fori_loop(0, num_tokens, token, s)

    @pl.when(in_pool)
    def _():
        pool_out_ref[read_slot, hs, :, vs] = s.astype(pool_out_ref.dtype)


def _decode_two_pass_kernel(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, group, block_v,
                            v_fastest, gate_offsets, row_block, scale, use_qk_l2norm, **_):
    """One token (T = 1), one program per (stream, value head, value block), the [K, BV] block streamed twice in
    [row_block, BV] chunks: pass 1 accumulates S^T k and S^T q, pass 2 re-reads each chunk (from L2, read moments
    before), updates it and stores it at once. Few registers (no whole block held), no store waiting on the whole
    block's reductions; the cost is the second read, an L2 hit if the block is still there."""
    gate_refs, pool_in_ref, o_ref, pool_out_ref = _split_refs(refs, gate_offsets)
    n, h, vs, in_pool, read_slot = _program_slot(slot_ref, pool_in_ref, v_fastest=v_fastest, block_v=block_v)
    kdim = pool_in_ref.shape[2]
    hk = h // group
    rmask = jnp.broadcast_to((has_ref[n] != 0) & in_pool, (row_block, block_v))   # masked: a stale NaN never leaks
    wmask = jnp.broadcast_to(in_pool, (row_block, block_v))
    q = q_ref[n, 0, hk, :].astype(jnp.float32)                                   # [K]
    k = k_ref[n, 0, hk, :].astype(jnp.float32)
    qs = ks = jnp.float32(1.0)
    if use_qk_l2norm:
        qs, ks = lax.rsqrt(jnp.sum(q * q) + L2_EPS), lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    qk = jnp.sum(q * k) * qs * ks

    def rows(r):
        return pl.ds(pl.multiple_of(r * row_block, row_block), row_block)

    def state_chunk(r):
        return plgpu.load(pool_in_ref.at[read_slot, h, rows(r), vs], mask=rmask, other=0.0).astype(jnp.float32)

    def pass1(r, carry):
        sk, sq = carry
        s_r = state_chunk(r)                                                     # [RB, BV]
        k_r = k_ref[n, 0, hk, rows(r)].astype(jnp.float32) * ks
        q_r = q_ref[n, 0, hk, rows(r)].astype(jnp.float32) * qs
        return sk + jnp.sum(k_r[:, None] * s_r, axis=0), sq + jnp.sum(q_r[:, None] * s_r, axis=0)

    zero = jnp.zeros((block_v,), jnp.float32)
    sk, sq = lax.fori_loop(0, kdim // row_block, pass1, (zero, zero))
    g, beta = _read_gates(g_ref, beta_ref, gate_refs, n=n, t=0, h=h, group=group)
    a = jnp.exp(g)
    delta = beta * (v_ref[n, 0, h, vs].astype(jnp.float32) - a * sk)             # [BV]
    o_ref[n, 0, h, vs] = (scale * (a * sq + qk * delta)).astype(o_ref.dtype)

    def pass2(r, carry):
        k_r = k_ref[n, 0, hk, rows(r)].astype(jnp.float32) * ks
        s_r = a * state_chunk(r) + k_r[:, None] * delta[None, :]
        plgpu.store(pool_out_ref.at[read_slot, h, rows(r), vs], s_r.astype(pool_out_ref.dtype), mask=wmask)
        return carry

    lax.fori_loop(0, kdim // row_block, pass2, 0)


def _decode_persistent_kernel(slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, group, block_v,
                              num_programs, trips, gate_offsets, **token_args):
    """P programs; program p runs blocks b = p, p + P, p + 2P, ... (b -> (n, h, vb), vb fastest) and loads block
    b + P's state before storing block b's, so one block's load is in flight while the previous one computes.
    Blocks past the last (b >= N Hv V / BV) are masked: no load, no store."""
    gate_refs, pool_in_ref, o_ref, pool_out_ref = _split_refs(refs, gate_offsets)
    _, _, hv, vdim = v_ref.shape
    num_slots, _, kdim, _ = pool_in_ref.shape
    nvb = vdim // block_v
    total = slot_ref.shape[0] * hv * nvb

    def locate(b):
        valid = b < total
        b = jnp.minimum(b, total - 1)
        n, h, vb = b // (nvb * hv), (b // nvb) % hv, b % nvb
        slot = slot_ref[n]
        in_pool = valid & (slot >= 0) & (slot < num_slots)
        return valid, n, h, pl.ds(vb * block_v, block_v), in_pool, jnp.clip(slot, 0, num_slots - 1)

    def load(b):
        _, n, h, vs, in_pool, read_slot = locate(b)
        read = in_pool & (has_ref[n] != 0)              # else masked: zeros, no bytes read, a stale NaN never leaks
        return plgpu.load(pool_in_ref.at[read_slot, h, :, vs], mask=jnp.broadcast_to(read, (kdim, block_v)),
                          other=0.0).astype(jnp.float32)

    pid = pl.program_id(0)                              # read outside the loop (interpret mode needs it there)

    def block(i, s):
        b = pid + i * num_programs
        s_next = load(b + num_programs)                                        # issued before this block's stores
        valid, n, h, vs, in_pool, read_slot = locate(b)
        s = _run_tokens(q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s, n=n, h=h, hk=h // group, vs=vs,
                        o_mask=jnp.broadcast_to(valid, (block_v,)), gate_refs=gate_refs, group=group, **token_args)
        plgpu.store(pool_out_ref.at[read_slot, h, :, vs], s.astype(pool_out_ref.dtype),
                    mask=jnp.broadcast_to(in_pool, (kdim, block_v)))
        return s_next

    lax.fori_loop(0, trips, block, load(pid))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["a_log", "dt_bias"],
                   meta_fields=["a_offset", "b_offset"])
@dataclasses.dataclass(frozen=True)
class RawGates:
    """The gates made inside the decode kernel from the raw projections (the layer's decode step, one launch less):
    g = -exp(A_log[h]) softplus(a + dt_bias[h]), beta = sigmoid(b) in fp32, with ``g`` and ``beta`` given as a and
    b, each [N, T, Hk, Ca] (value head h of key head h // r at column ``a_offset + h % r`` / ``b_offset + h % r``,
    r = Hv / Hk): Qwen3-Next's in_proj_ba output [N, T, Hk, 2 r] ([b (r) | a (r)] per key head) passed twice with
    a_offset r, b_offset 0; Qwen3.5's separate a, b [N, T, Hv] reshaped to [N, T, Hk, r], offsets 0.

    a_log, dt_bias: [Hv] (any float dtype; read as fp32). A pytree (the arrays are its leaves): it passes through
    jax.jit as an argument."""
    a_log: jax.Array
    dt_bias: jax.Array
    a_offset: int = 0
    b_offset: int = 0


def fused_recurrent_slots(q, k, v, g, beta, *, pool, slot_ids, has_initial_state, scale, use_qk_l2norm,
                          interpret, config: DecodeConfig | None = None, raw_gates: RawGates | None = None):
    """Runs the decode kernel (shapes in the module docstring; K, V powers of two >= 16, V % block_v == 0).
    config: None picks ``decode_config`` for the shapes. raw_gates: None (g, beta [N, T, Hv] as given) or
    ``RawGates`` (g, beta are the raw a, b projections [N, T, Hk, Ca]). Returns (o [N, T, Hv, V] in v's dtype, the
    updated pool [S, Hv, K, V] fp32, aliased to ``pool``)."""
    n, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    config = config or decode_config(n, hv, kdim, vdim)
    block_v = min(config.block_v, vdim)
    if vdim % block_v:
        raise ValueError(f"DecodeConfig.block_v ({config.block_v}) must divide V = {vdim}")
    if config.load_hint not in LOAD_HINTS:
        raise ValueError(f"DecodeConfig.load_hint must be one of {LOAD_HINTS}, got {config.load_hint!r}")
    if config.row_block < 0 or (config.row_block and kdim % config.row_block):
        raise ValueError(f"DecodeConfig.row_block ({config.row_block}) must be 0 or divide K = {kdim}")
    heads = config.heads
    if heads < 1 or heads & (heads - 1) or (hv // hk) % heads:
        raise ValueError(f"DecodeConfig.heads ({heads}) must be a power of two dividing Hv / Hk = {hv // hk}")
    if config.row_split < 1 or kdim % config.row_split:
        raise ValueError(f"DecodeConfig.row_split ({config.row_split}) must be >= 1 and divide K = {kdim}")
    operands = dict(slot_ids=slot_ids.astype(jnp.int32), has_initial_state=has_initial_state.astype(jnp.int32),
                    q=q, k=k, v=v, g=g, beta=beta)
    gate_offsets = None
    if raw_gates is not None:
        operands.update(a_log=raw_gates.a_log, dt_bias=raw_gates.dt_bias)
        gate_offsets = (int(raw_gates.a_offset), int(raw_gates.b_offset))
    operands["pool"] = pool
    nvb = vdim // block_v
    common = dict(group=hv // hk, block_v=block_v, scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm),
                  num_tokens=t, fused_output=config.fused_output, gate_offsets=gate_offsets)
    total = n * hv * nvb
    if config.programs:
        programs = min(config.programs, total)
        kernel = functools.partial(_decode_persistent_kernel, num_programs=programs, trips=-(-total // programs),
                                   **common)
        grid = (programs,)
    elif config.row_block and t == 1:
        kernel = functools.partial(_decode_two_pass_kernel, v_fastest=config.v_fastest, row_block=config.row_block,
                                   **common)
        grid = (nvb, hv, n) if config.v_fastest else (n, hv, nvb)
    elif heads > 1:
        kernel = functools.partial(_decode_heads_kernel, v_fastest=config.v_fastest, heads=heads,
                                   early_store=config.early_store, **common)
        grid = (nvb, hv // heads, n) if config.v_fastest else (n, hv // heads, nvb)
    else:
        kernel = functools.partial(_decode_kernel, v_fastest=config.v_fastest, load_hint=config.load_hint,
                                   row_split=config.row_split if t == 1 else 1, early_store=config.early_store,
                                   **common)
        grid = (nvb, hv, n) if config.v_fastest else (n, hv, nvb)
    call = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=(jax.ShapeDtypeStruct((n, t, hv, vdim), v.dtype),
                   jax.ShapeDtypeStruct(pool.shape, jnp.float32)),
        input_output_aliases={list(operands).index("pool"): 1},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_decode",
    )
    return call(*operands.values())


def fused_recurrent_gated_delta_rule_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state,
                                               use_qk_l2norm=False, interpret=False,
                                               config: DecodeConfig = None, raw_gates: RawGates | None = None):
    """Per-token gated delta rule of N streams over a state-slot pool, in place (the decode kernel).

    q, k [N, T, Hk, K]; v [N, T, Hv, V]; g, beta [N, T, Hv] (or, with ``raw_gates``, the raw a, b projections
    [N, T, Hk, Ca]: see ``RawGates``); ssm_state [S, Hv, K, V] fp32 (aliased: donate it); slot_ids [N] int32 (an id
    outside [0, S) reads zeros and drops its write), has_initial_state [N] bool.
    Returns (o [N, T, Hv, V] in v's dtype, new ssm_state). Head dims that are not one of GPU_HEAD_DIMS are
    zero-padded (then the pool is copied, not updated in place).
    """
    n, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    if scale is None:
        scale = kdim ** -0.5
    if n == 0 or t == 0:
        return jnp.zeros(v.shape, v.dtype), ssm_state
    kp, vp = _pt.kernel_head_dim(kdim), _pt.kernel_head_dim(vdim)
    q, k, v = _pt.pad_last(q, kp), _pt.pad_last(k, kp), _pt.pad_last(v, vp)
    pool = ssm_state
    padded = (kp, vp) != (kdim, vdim)
    if padded:
        pool = jnp.pad(pool, [(0, 0), (0, 0), (0, kp - kdim), (0, vp - vdim)])
    cfg = config or decode_config(n, hv, kp, vp)
    if use_qk_l2norm and cfg.prenorm:                  # one small XLA fusion; the kernel runs without the norms
        q, k = l2norm(q.astype(jnp.float32), eps=L2_EPS), l2norm(k.astype(jnp.float32), eps=L2_EPS)
        use_qk_l2norm = False

    gate_arrays = () if raw_gates is None else (raw_gates.a_log, raw_gates.dt_bias)

    def kernel(q, k, v, g, beta, pool, slot_ids, has, *gate_arrays):
        gates = None if raw_gates is None else dataclasses.replace(raw_gates, a_log=gate_arrays[0],
                                                                   dt_bias=gate_arrays[1])
        return fused_recurrent_slots(q, k, v, g, beta, pool=pool, slot_ids=slot_ids, has_initial_state=has,
                                     scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=interpret, config=cfg,
                                     raw_gates=gates)

    o, new_pool = _pt.no_autodiff(kernel)(q, k, v, g, beta, pool, slot_ids.astype(jnp.int32),
                                       has_initial_state.astype(jnp.int32), *gate_arrays)
    if padded:
        o, new_pool = o[..., :vdim], new_pool[:, :, :kdim, :vdim]
    return o, new_pool
