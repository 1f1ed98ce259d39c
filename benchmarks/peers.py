"""The peers the sections time beside ours, each built the same way as our column of the same row: FLA's chunked
and recurrent gated delta rules (torch, Triton), FlashQLA's and FlashInfer's chunked gated delta rules (torch;
TileLang / CuTe DSL), jax-linear-attention's Mosaic GPU gated delta rule, and torch's
scaled_dot_product_attention. Each builder returns a callable on the device; the section times it with
``benchmarks.timing`` (the one method of every column).

FlashQLA and FlashInfer each need their own software stack, importable in the process that times them and in no
other (docs/benchmarking.md: the two need different apache-tvm-ffi versions, and ``import fla`` breaks where
tilelang is importable without tvm_ffi): run ``python -m benchmarks gdn --impls qla`` (or ``fi``) in that process
with ``--out`` naming the results file; the section merges the column into the rows already there.
"""
from __future__ import annotations

import os

import numpy as np


def _fla_env() -> None:
    """FLA's own FLA_FLASH_QLA path off (its plain Triton kernels, as every FLA figure of the results was taken);
    benchmarks/gpu.sh sets it as well."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")


def jla_chunk(case, host):
    """(jitted fn, args) of jax-linear-attention's ``gated_delta_rule`` on a dense case's host inputs (bf16 q, k,
    v, beta; fp32 g and initial state; final state out). Raises NotImplementedError on a varlen case (jla takes no
    cu_seqlens)."""
    if case.lens is not None:
        raise NotImplementedError("jla takes no cu_seqlens")
    import jax
    import jax.numpy as jnp
    from jla.ops.mosaic_gpu.gated_delta_rule import gated_delta_rule
    q, k, v, g, beta, h0 = host
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
            jnp.asarray(beta, bf), jnp.asarray(h0))

    @jax.jit
    def fn(q, k, v, g, beta, h0):
        return gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    return fn, args


def _fla_inputs(case, host, requires_grad: bool = False):
    """(q, k, v, g, beta, h0 as CUDA tensors: bf16 q, k, v, beta; fp32 g, h0), cu_seqlens kwargs) of FLA's call."""
    import torch
    q, k, v, g, beta, h0 = host
    dev, bf = "cuda", torch.bfloat16
    dtypes = (bf, bf, bf, torch.float32, bf, torch.float32)
    ts = tuple(torch.from_numpy(x).to(dev, dt).requires_grad_(requires_grad)
               for x, dt in zip((q, k, v, g, beta, h0), dtypes))
    kw = {}
    if case.lens is not None:
        kw["cu_seqlens"] = torch.tensor(case.cu_seqlens(), dtype=torch.long, device=dev)
    return ts, kw


def _forward_call(chunk_gated_delta_rule, case, host):
    """A no-argument callable running an FLA-signature ``chunk_gated_delta_rule`` on the case's host inputs (torch,
    CUDA), bf16 q, k, v and beta, fp32 g and initial state, final state out."""
    (tq, tk, tv, tg, tb, th0), kw = _fla_inputs(case, host)

    def fn():
        return chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True, **kw)
    return fn


def _backward_call(chunk_gated_delta_rule, case, host, do, dht):
    """A no-argument callable running an FLA-signature ``chunk_gated_delta_rule`` forward and
    ``torch.autograd.backward`` of (o, ht) with the cotangents do (bf16) and dht (fp32), on ``_forward_call``'s
    inputs (leaves with gradients)."""
    import torch
    (tq, tk, tv, tg, tb, th0), kw = _fla_inputs(case, host, requires_grad=True)
    tdo, tdht = torch.from_numpy(do).to("cuda", torch.bfloat16), torch.from_numpy(dht).to("cuda")

    def fn():
        o, ht = chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True, **kw)
        torch.autograd.backward([o, ht], [tdo, tdht])
    return fn


def fla_chunk(case, host):
    """FLA's ``chunk_gated_delta_rule`` (``_forward_call``), its FlashQLA path off."""
    _fla_env()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return _forward_call(chunk_gated_delta_rule, case, host)


def fla_chunk_backward(case, host, do, dht):
    """FLA's forward and backward (``_backward_call``), its FlashQLA path off."""
    _fla_env()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return _backward_call(chunk_gated_delta_rule, case, host, do, dht)


def qla_chunk(case, host):
    """FlashQLA's ``chunk_gated_delta_rule`` (FLA's signature and layouts; its Hopper kernels are TileLang's,
    compiled on a shape's first call)."""
    from flash_qla import chunk_gated_delta_rule
    return _forward_call(chunk_gated_delta_rule, case, host)


def qla_chunk_backward(case, host, do, dht):
    """FlashQLA's forward and backward (``_backward_call``)."""
    from flash_qla import chunk_gated_delta_rule
    return _backward_call(chunk_gated_delta_rule, case, host, do, dht)


def fi_chunk(case, host):
    """A no-argument callable running FlashInfer's ``gdn_prefill.chunk_gated_delta_rule`` on the case's host inputs:
    its layouts are packed tokens only (q, k [B T, Hk, K], v [B T, Hv, V], cu_seqlens required: a dense case's B
    rows become B sequences of T), g the linear decay exp(g) in fp32, beta fp32, states [N, Hv, V, K] (ours
    transposed); bf16 q, k, v, fp32 initial state, final state out into a buffer made once."""
    import torch
    from flashinfer.gdn_prefill import chunk_gated_delta_rule
    q, k, v, g, beta, h0 = host
    dev, bf = "cuda", torch.bfloat16
    b, t = q.shape[:2]

    def packed(x, dt):
        return torch.from_numpy(np.ascontiguousarray(x.reshape((b * t,) + x.shape[2:]))).to(dev, dt)
    tq, tk, tv = packed(q, bf), packed(k, bf), packed(v, bf)
    tg = torch.exp(packed(g, torch.float32)).contiguous()
    tb = packed(beta, torch.float32)
    cu = case.cu_seqlens() if case.lens is not None else np.arange(b + 1) * t
    tcu = torch.tensor(np.asarray(cu), dtype=torch.int32, device=dev)
    th0 = torch.from_numpy(np.ascontiguousarray(np.swapaxes(h0, -1, -2))).to(dev, torch.float32)
    out_state = torch.empty_like(th0)

    def fn():
        return chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True,
                                      cu_seqlens=tcu, output_state=out_state)
    return fn


def warm(fn):
    """``fn`` after its first call (autotuning, TileLang / CuTe DSL compiles happen there), synced."""
    import torch
    fn()
    torch.cuda.synchronize()
    return fn


def fla_chunk_warm(case, host):
    """``fla_chunk`` after its first call (FLA autotunes there), synced."""
    return warm(fla_chunk(case, host))


def fla_recurrent_step(host):
    """(step, h0) of FLA's ``fused_recurrent_gated_delta_rule`` on decode host inputs (q, k, v [N, 1, H, K|V], g,
    beta [N, 1, Hv], pool [N, Hv, K, V]): ``step(h)`` is one token for every stream from the dense states ``h``
    (no slot indexing), q / k L2-normalised in the kernel, and returns the new states; warmed up and synced."""
    _fla_env()
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    q, k, v, g, beta, pool, _ = host
    dev, bf = "cuda", torch.bfloat16
    tq, tk, tv = (torch.from_numpy(x).to(dev, bf) for x in (q, k, v))
    tg = torch.from_numpy(g).to(dev)
    tb = torch.from_numpy(beta).to(dev, bf)
    th0 = torch.from_numpy(pool).to(dev)

    def step(h):
        return fused_recurrent_gated_delta_rule(tq, tk, tv, tg, beta=tb, initial_state=h, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)[1]
    step(th0)
    torch.cuda.synchronize()
    return step, th0


def torch_sdpa(q, dense, lens, ctx, decode, scale):
    """A no-argument callable of the SDPA calls of one attention case (one call per stream for prefill, lower-right
    causal mask when continuing ``ctx`` tokens; one batched call for decode), bf16 on CUDA, enable_gqa; the caller
    runs it under ``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``. ``q`` [T, H, Dh] and ``dense`` (per
    stream (K, V) [L, Hkv, Dh]) are host arrays."""
    import torch
    import torch.nn.functional as F
    dev, bf = "cuda", torch.bfloat16

    def tt(x):
        return torch.tensor(np.asarray(x, np.float32), device=dev).to(bf).contiguous()
    if decode:
        n = len(lens)
        qt = tt(q).reshape(n, 1, q.shape[1], q.shape[2]).transpose(1, 2).contiguous()     # [N, H, 1, Dh]
        kt = torch.stack([tt(k) for k, _ in dense]).transpose(1, 2).contiguous()          # [N, Hkv, ctx, Dh]
        vt = torch.stack([tt(v) for _, v in dense]).transpose(1, 2).contiguous()

        def run():
            F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)
        return run
    from torch.nn.attention.bias import causal_lower_right
    cu = np.concatenate([[0], np.cumsum(lens)])
    qs = [tt(q[cu[i]:cu[i] + x]).transpose(0, 1)[None].contiguous() for i, x in enumerate(lens)]  # [1, H, L, Dh]
    ks = [tt(k).transpose(0, 1)[None].contiguous() for k, _ in dense]
    vs = [tt(v).transpose(0, 1)[None].contiguous() for _, v in dense]
    masks = [None if ctx == 0 else causal_lower_right(x, x + ctx) for x in lens]

    def run():
        for a, b, c, m in zip(qs, ks, vs, masks):
            if m is None:
                F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale, enable_gqa=True)
            else:
                F.scaled_dot_product_attention(a, b, c, attn_mask=m, scale=scale, enable_gqa=True)
    return run
