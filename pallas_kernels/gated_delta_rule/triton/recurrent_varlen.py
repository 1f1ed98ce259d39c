"""Pallas (Triton lowering) per-token gated delta rule over a cu_seqlens-packed batch: the kernel for mixes of
very short sequences (serving mixes of dozens of 1-4 token sequences).

One program per (sequence n, value head h, value block): it loads its [K, BV] fp32 block of n's start state
(``pool[slot_ids[n], h]``, zeros when ``has_initial_state[n]`` is 0 or the id names no slot), runs the tokens
``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` one at a time with the state in registers (a loop whose trip count is the
sequence's own length, read from ``cu_seqlens`` on the device: one compiled program serves any lengths with the
same T and N), stores each token's output row and writes the final block out. Per token, value head h reading key
head h // (Hv // Hk), with the decode kernel's fused output form (``triton/decode.py``):

    a = exp(g_t);  delta = beta_t (v_t - a S^T k_t);  o_t = scale (a S^T q_t + (q_t . k_t) delta);
    S = a S + k_t delta^T

(= S = exp(g_t) S; S = S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T (scale q_t) up to fp32 rounding), optionally
with q_t, k_t L2-normalised in fp32 first (``x * rsqrt(sum x^2 + 1e-6)``). All math is fp32; o takes v's dtype.

Against the chunked kernels (``triton/chunk.py``: chunk map, intra-chunk solve, state pass, zero tail: four to
five launches) this is one launch with no chunk map, and a sequence of L tokens costs L serial steps of a few
[K, BV] reductions instead of ceil(L / 64) chunk steps of [64, K] x [K, BV] dots plus the intra-chunk solve: it
wins where the state bytes and the launches are the cost (lengths of a few tokens), loses on long sequences (a
long sequence in such a batch is slower, never wrong). ``api.py`` routes a packed batch here by its shapes only
(the "short_mix" call kind of its dispatch table: T <= ``DispatchConfig.short_mix_max_mean_len`` * N).

Final states (``final``): "slot" to ``pool[slot_ids[n]]`` in place (the pool aliased; an id outside [0, S) drops
the write), "seq" to a fresh [N, Hv, K, V] (the plain API: its initial states are not donated), "none" nowhere.
Padding tokens (rows >= cu_seqlens[N]) get zero output rows: program (vb, h, i) of the i-th sequence position
zeroes rows cu_seqlens[N] + i, + i + N, ... of its columns (at most T / N - 1 rows each, no extra launch).

Shape legend: T packed tokens, N sequences, S slots (S = N for "seq"), Hk / Hv key / value heads, K / V head dims
(powers of two >= 16: the entry points pad), BV value block.

    q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; cu_seqlens [N + 1] int32; pool [S, Hv, K, V] fp32;
    slot_ids, has_initial_state [N] int32  ->  o [T, Hv, V] in v's dtype, final states

This module imports only jax (and its folder).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule.triton import chunk as triton_chunk

L2_EPS = 1e-6

@dataclasses.dataclass(frozen=True)
class RecurrentVarlenConfig:
    """Launch parameters. Defaults from two H200 runs (``python -m benchmarks gdn``; ms at tiny64 / N256 mean
    16): the default (BV 64, 2 warps,
    prefetch) 0.110 / 0.980; prefetch off 0.110 / 1.024 (mean 8: 0.620 against 0.598); BV 32 on 1 warp 0.108 /
    **0.876** (not the default: its numerics were not checked on the GPU, and it was not timed at the means the
    route takes, <= 8); BV 32 / 2 warps 0.112 / 1.051; 4 warps 0.112 / 1.155; BV 128 / 4 warps 0.116;
    2 stages - / 0.974; BV 16 / 1 warp - / 1.066. longest_first: the worst case (63 x 1 + 449 tokens)
    0.686 -> 0.571, not timed on uniform mixes (an argsort more per call): off.

    block_v: the value block of one program (min(block_v, V) must divide V); num_warps, num_stages: Triton's
      (stages > 1 let Triton prefetch the next token's q / k / v rows in the token loop).
    v_fastest: grid (V / BV, Hv, N), the value block fastest in launch order (the decode kernel's order: the
      programs in flight together read neighbouring blocks of one state); False: (N, Hv, V / BV).
    longest_first: the sequences launched by decreasing length (an argsort of the N lengths before the launch), so
      that a long sequence in the batch does not start last; False: in index order (no extra op).
    prefetch: the token loop loads token t + 1's q, k, v, g, beta before computing token t (carried to the next
      step), so that their load latency overlaps a step's reductions instead of opening each step; one row past a
      sequence's end is read and never used. False: each step loads its own token first.
    """
    block_v: int = 64
    num_warps: int = 2
    num_stages: int = 1
    v_fastest: bool = True
    longest_first: bool = False
    prefetch: bool = True


def _kernel(cu_ref, order_ref, slot_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, o_ref,
            pool_out_ref, *, group, block_v, v_fastest, scale, use_qk_l2norm, final, prefetch):
    """One program per (value block, value head, sequence position i); n = order[i]."""
    if v_fastest:
        vb, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:
        i, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = slot_ref.shape[0]
    total = q_ref.shape[0]
    kdim = q_ref.shape[-1]
    hk = h // group
    vs = pl.ds(vb * block_v, block_v)
    n = order_ref[i]
    start, end = cu_ref[n], cu_ref[n + 1]
    # an id outside [0, S): zeros in, no write (never clamped); a fresh sequence or a bad id reads no bytes
    s, in_pool, read_slot = triton_chunk.load_start_state(pool_in_ref, slot_ref, has_ref, n, h, vs, kdim=kdim,
                                                 block_v=block_v)                     # [K, BV] fp32

    def load(t):
        """Token t's (q [K], k [K], v [BV], g, beta) as stored; t is clamped to the last row (a prefetch past the
        end of the batch reads a real row, never used)."""
        t = jnp.minimum(t, total - 1)
        return q_ref[t, hk, :], k_ref[t, hk, :], v_ref[t, h, vs], g_ref[t, h], beta_ref[t, h]

    def token(t, s, x):
        q, k, v, g, beta = (y.astype(jnp.float32) for y in x)
        if use_qk_l2norm:
            q = q * lax.rsqrt(jnp.sum(q * q) + L2_EPS)
            k = k * lax.rsqrt(jnp.sum(k * k) + L2_EPS)
        a = jnp.exp(g)
        sk = jnp.sum(k[:, None] * s, axis=0)                                    # [BV]  S^T k
        sq = jnp.sum(q[:, None] * s, axis=0)                                    # [BV]  S^T q
        delta = beta * (v - a * sk)
        o_ref[t, h, vs] = (scale * (a * sq + jnp.sum(q * k) * delta)).astype(o_ref.dtype)
        return a * s + k[:, None] * delta[None, :]

    # the sequence's own length: a traced trip count
    if prefetch:
        def step(t, carry):
            s, x = carry
            x_next = load(t + 1)                          # issued before token t's reductions
            return token(t, s, x), x_next

        s, _ = lax.fori_loop(start, end, step, (s, load(start)))
    else:
        s = lax.fori_loop(start, end, lambda t, s: token(t, s, load(t)), s)

    triton_chunk.store_final_state(final, s, pool_out_ref, n, h, vs, in_pool=in_pool, read_slot=read_slot)

    # padding rows [cu[N], T): this program zeroes rows cu[N] + i + j N of its columns
    tail = cu_ref[num_seqs]
    trips = jnp.maximum(total - tail - i + num_seqs - 1, 0) // num_seqs

    def zero_row(j, carry):
        o_ref[tail + i + j * num_seqs, h, vs] = jnp.zeros((block_v,), o_ref.dtype)
        return carry

    lax.fori_loop(0, trips, zero_row, 0)


def recurrent_varlen(q, k, v, g, beta, *, cu_seqlens, pool, slot_ids, has_initial_state, scale, use_qk_l2norm,
                     final, interpret, config: RecurrentVarlenConfig | None = None):
    """Runs the kernel (shapes in the module docstring; K, V powers of two >= 16, V % block_v == 0 after the
    clamp to V). ``final``: "slot" (pool [S, ...] aliased and returned), "seq" (a fresh [N, Hv, K, V]; pool holds
    the start states, read where has_initial_state), "none" (no final state: None). Returns (o, final)."""
    t, hk, kdim = q.shape
    hv, vdim = v.shape[1], v.shape[2]
    n = slot_ids.shape[0]
    config = config or RecurrentVarlenConfig()
    block_v = min(config.block_v, vdim)
    if block_v < 1 or vdim % block_v:
        raise ValueError(f"RecurrentVarlenConfig.block_v ({config.block_v}) must divide V = {vdim}")
    if final not in ("slot", "seq", "none"):
        raise ValueError(f"final must be 'slot', 'seq' or 'none'; got {final!r}")
    cu = cu_seqlens.astype(jnp.int32)
    if config.longest_first:
        order = jnp.argsort(cu[:-1] - cu[1:], stable=True).astype(jnp.int32)
    else:
        order = jnp.arange(n, dtype=jnp.int32)
    operands = dict(cu_seqlens=cu, order=order, slot_ids=slot_ids.astype(jnp.int32),
                    has_initial_state=has_initial_state.astype(jnp.int32), q=q, k=k, v=v, g=g, beta=beta, pool=pool)
    final_shape = {"slot": pool.shape, "seq": (n,) + pool.shape[1:], "none": (1, 1, 1, 1)}[final]
    nvb = vdim // block_v
    kernel = functools.partial(_kernel, group=hv // hk, block_v=block_v, v_fastest=config.v_fastest,
                               scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm), final=final,
                               prefetch=config.prefetch)
    call = pl.pallas_call(
        kernel,
        grid=(nvb, hv, n) if config.v_fastest else (n, hv, nvb),
        out_shape=(jax.ShapeDtypeStruct((t, hv, vdim), v.dtype),
                   jax.ShapeDtypeStruct(final_shape, jnp.float32)),
        input_output_aliases={list(operands).index("pool"): 1} if final == "slot" else {},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_recurrent_varlen",
    )
    o, out = call(*operands.values())
    return o, (None if final == "none" else out)


def _packed(q, k, v, g, beta, cu_seqlens):
    """[B, T, ...] inputs as one packed row [B T, ...] and its cu_seqlens (dense rows: B sequences of T)."""
    b, t = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(b + 1, dtype=jnp.int32) * t
    flat = lambda x: x.reshape((b * t,) + x.shape[2:])
    return tuple(flat(x) for x in (q, k, v, g, beta)), jnp.asarray(cu_seqlens, jnp.int32)


def _run(q, k, v, g, beta, *, scale, cu_seqlens, pool, slot_ids, has_initial_state, use_qk_l2norm, final,
         interpret, config):
    """The entry points' common path: pack, pad head dims to the kernel's sizes, guard autodiff, run, unpad."""
    b, t, hk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    (qf, kf, vf, gf, bf), cu = _packed(q, k, v, g, beta, cu_seqlens)
    kp, vp = triton_chunk.kernel_head_dim(kdim), triton_chunk.kernel_head_dim(vdim)
    qf, kf, vf = triton_chunk.pad_last(qf, kp), triton_chunk.pad_last(kf, kp), triton_chunk.pad_last(vf, vp)
    padded = (kp, vp) != (kdim, vdim)
    if padded:
        pool = jnp.pad(pool, [(0, 0), (0, 0), (0, kp - kdim), (0, vp - vdim)])

    def kernel(qf, kf, vf, gf, bf, cu, pool, slot_ids, has):
        return recurrent_varlen(qf, kf, vf, gf.astype(jnp.float32), bf, cu_seqlens=cu, pool=pool,
                                slot_ids=slot_ids, has_initial_state=has, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                final=final, interpret=interpret, config=config)

    o, out = triton_chunk.no_autodiff(kernel)(qf, kf, vf, gf, bf, cu, pool, slot_ids.astype(jnp.int32),
                                     has_initial_state.astype(jnp.int32))
    o = o.reshape(b, t, hv, vp)[..., :vdim]
    if out is not None and padded:
        out = out[:, :, :kdim, :vdim]
    return o, out


def recurrent_varlen_fwd(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, output_final_state,
                         use_qk_l2norm=False, interpret=False, config: RecurrentVarlenConfig = None):
    """The plain API's form (``api.chunk_gated_delta_rule`` routes here). Returns (o [B, T, Hv, V] in v's dtype,
    final_state [N, Hv, K, V] fp32 or None).

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; initial_state [N, Hv, K, V] fp32 or None (zeros);
    cu_seqlens [N + 1] int32 (then B == 1) or None (B sequences of T). B T >= 1 and N >= 1."""
    b, t, _, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:           # a one-slot placeholder: has = 0 reads nothing
        pool, has = jnp.zeros((1, hv, kdim, vdim), jnp.float32), jnp.zeros((n,), jnp.int32)
    else:
        pool, has = initial_state.astype(jnp.float32), jnp.ones((n,), jnp.int32)
    return _run(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, pool=pool,
                slot_ids=jnp.arange(n, dtype=jnp.int32), has_initial_state=has, use_qk_l2norm=use_qk_l2norm,
                final="seq" if output_final_state else "none", interpret=interpret, config=config)


def recurrent_varlen_slots_fwd(q, k, v, g, beta, *, scale, ssm_state, slot_ids, has_initial_state, cu_seqlens,
                               use_qk_l2norm=False, interpret=False, config: RecurrentVarlenConfig = None):
    """The slots form (``api.chunk_gated_delta_rule_slots`` routes here). Returns (o [B, T, Hv, V] in v's dtype,
    new ssm_state [S, Hv, K, V] fp32, aliased to ``ssm_state``: donate it to update in place).

    Sequence n reads ssm_state[slot_ids[n]] (zeros where has_initial_state[n] is False or the id is outside
    [0, S)) and writes its final state back there (an id outside [0, S) drops the write); other slots keep their
    values. Shapes as ``recurrent_varlen_fwd``; ssm_state [S, Hv, K, V] fp32, slot_ids / has_initial_state [N]."""
    return _run(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, pool=ssm_state, slot_ids=slot_ids,
                has_initial_state=has_initial_state, use_qk_l2norm=use_qk_l2norm, final="slot",
                interpret=interpret, config=config)
