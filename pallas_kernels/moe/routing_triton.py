"""Pallas (Triton lowering) MoE router: fp32 softmax over all experts, top-k, optional renormalisation, one kernel.

The reference is ``pallas_kernels.moe.reference.route_xla`` (HF ``Qwen3NextTopKRouter``: softmax in fp32,
``lax.top_k``, ``w / sum(w)`` when ``norm_topk_prob``). Why a kernel: on the H200 the XLA form's top-k over
[T, E] = [19456, 512] is not a cheap reduction (``python -m benchmarks moe`` times both); here
each program holds BT rows of logits in registers and takes the k largest by k rounds of max + first-index
argmax, so the logits are read once and only [T, k] is written.

Shape legend: T tokens, E experts (a power of two: 8 ... 1024), k experts per token (<= E), Kp the next power of
two >= k (the output tile; the wrapper slices it to k), BT rows per program (a power of two dividing T).

    logits [T, E] (any float dtype; upcast to fp32 in the kernel)
    -> weights [T, k] fp32 (renormalised when norm_topk_prob), ids [T, k] int32 in [0, E)

Ties: the lowest expert id among equal probabilities comes first (as ``lax.top_k``). A row with NaN logits gets
NaN weights and ids clamped into [0, E) (never an id out of range: the expert kernels index weights with them);
its rows spoil only that token.

This module imports only jax.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_EXPERTS = 1024   # a [BT, E] fp32 tile in registers: E up to 1024 at BT 8


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def supports(*, num_experts: int, top_k: int) -> str | None:
    """None when the kernel takes these sizes, else the reason."""
    e = int(num_experts)
    if e < 2 or e > MAX_EXPERTS or e & (e - 1):
        return f"the routing kernel needs num_experts a power of two in [2, {MAX_EXPERTS}]; got {e}"
    if not 1 <= int(top_k) <= e:
        return f"top_k must be in [1, num_experts={e}]; got {top_k}"
    return None


def rows_per_program(num_tokens: int, num_experts: int) -> int:
    """BT: the largest power of two <= 8192 / E (at most 16) that divides T (1 when T is odd)."""
    bt = max(1, min(16, 8192 // num_experts))
    while bt > 1 and num_tokens % bt:
        bt //= 2
    return bt


def _route_kernel(logits_ref, w_ref, i_ref, *, num_experts, top_k, kp, norm):
    x = logits_ref[...].astype(jnp.float32)                                   # [BT, E]
    bt = x.shape[0]
    m = jnp.max(x, axis=1, keepdims=True)
    p = jnp.exp(x - m)
    p = p / jnp.sum(p, axis=1, keepdims=True)
    iota = lax.broadcasted_iota(jnp.int32, p.shape, 1)
    col = lax.broadcasted_iota(jnp.int32, (bt, kp), 1)
    w_acc = jnp.zeros((bt, kp), jnp.float32)
    i_acc = jnp.zeros((bt, kp), jnp.int32)
    for j in range(top_k):                                                    # static: k rounds of max + argmax
        mj = jnp.max(p, axis=1, keepdims=True)                                # [BT, 1]
        ij = jnp.min(jnp.where(p == mj, iota, num_experts), axis=1, keepdims=True)
        ij = jnp.minimum(ij, num_experts - 1)                                 # NaN row: no match -> clamp
        w_acc = jnp.where(col == j, mj, w_acc)
        i_acc = jnp.where(col == j, ij, i_acc)
        p = jnp.where(iota == ij, -1.0, p)                                    # probabilities are >= 0
    if norm:
        w_acc = w_acc / jnp.sum(jnp.where(col < top_k, w_acc, 0.0), axis=1, keepdims=True)
    w_ref[...] = w_acc
    i_ref[...] = i_acc


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "interpret"))
def route(logits: jax.Array, *, top_k: int, norm_topk_prob: bool, interpret: bool = False):
    """logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32); see the module docstring. Checks the sizes
    (ValueError naming the argument)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, E]; got shape {logits.shape}")
    t, e = logits.shape
    why = supports(num_experts=e, top_k=top_k)
    if why is not None:
        raise ValueError(why)
    kp = _next_pow2(top_k)
    if t == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    bt = rows_per_program(t, e)
    kernel = functools.partial(_route_kernel, num_experts=e, top_k=top_k, kp=kp, norm=norm_topk_prob)
    w, i = pl.pallas_call(
        kernel,
        grid=(t // bt,),
        in_specs=[pl.BlockSpec((bt, e), lambda r: (r, 0))],
        out_specs=[pl.BlockSpec((bt, kp), lambda r: (r, 0)), pl.BlockSpec((bt, kp), lambda r: (r, 0))],
        out_shape=[jax.ShapeDtypeStruct((t, kp), jnp.float32), jax.ShapeDtypeStruct((t, kp), jnp.int32)],
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="moe_route_topk")(logits)
    return w[:, :top_k], i[:, :top_k]
