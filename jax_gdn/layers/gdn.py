"""One Gated DeltaNet layer (Qwen3-Next / Qwen3.5) as the split-prefill protocol: pure functions + an NNX module.

Shape legend: T stacked tokens of all streams, N streams, S slots, D hidden size, Hk / Hv key / value heads
(r = Hv / Hk), K / V key / value head dims, Kc conv kernel, conv_dim = 2 Hk K + Hv V ([q | k | v] channels).

The protocol (names from the serving engine the design comes from)::

    hidden [T, D] --phase1_proj_batched--> mixed_qkv [T, conv_dim], z [T, Hv, V], beta, g [T, Hv] (fp32)
        input RMSNorm (1 + w), in_proj (fused + interleaved for qwen3_next, separate for qwen3_5),
        beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
    --phase1_conv1d_one / phase1_conv1d_varlen--> conv_out [T, conv_dim]   (causal depthwise conv + SiLU,
        conv state of each stream's slot advanced)
    --phase1_l2_batched--> q, k [T, Hk, K] (L2-normalised), v [T, Hv, V]
        (or both in one op, phase1_conv1d_l2_varlen: pallas_kernels/conv1d, reading qwen3_next's fused projection
        in place; the form is ``RuntimeOptions.phase1_conv``'s)
    --gdn_full / gdn_full_batched / gdn_full_varlen--> o [T, Hv, V]  (chunked gated delta rule over the slot pool)
    --phase3--> hidden + out_proj(w * rmsnorm(o) * silu(z)), then the FFN callable (if any)

The mixer is composed once from these pieces and takes already-normed hidden states (the decoder block,
jax_gdn.layers.block, owns the pre-norm, the residual add and the FFN)::

    gdn_mixer(x)        = gdn_output(gdn_full_varlen(phase1_conv_l2(phase1_in_proj(x))))   -> y [T, D]
    gdn_mixer_decode(x) = the same phases as one recurrent step per stream                 -> y [N, D]

``gdn_layer_prefill`` / ``gdn_layer_decode`` are the whole layer around them (input RMSNorm, mixer, residual,
FFN callable), ``phase3`` = ``gdn_output`` + residual + FFN callable for callers of the split protocol,
``gdn_layer_monolithic`` is an independent straight-line form of one stream used to check them.
``GatedDeltaNet`` (Flax NNX) holds the parameters and exposes the same functions as methods.

Parameters (a flat dict; HF's names with the ``model.layers.{i}.`` prefix and ``.weight`` suffix dropped; Linear
weights stored [in, out] so that ``y = x @ W``, like every other layer of the package: ``params_from_hf``
transposes torch's [out, in] once):

    input_layernorm  [D]                      <- model.layers.{i}.input_layernorm.weight (zero-centred, 1 + w)
    qwen3_next:
      in_proj_qkvz   [D, 2 Hk K + 2 Hv V]     <- linear_attn.in_proj_qkvz.weight.T  (per key head [q|k|v*r|z*r])
      in_proj_ba     [D, 2 Hv]                <- linear_attn.in_proj_ba.weight.T    (per key head [b*r|a*r])
    qwen3_5:
      in_proj_qkv    [D, 2 Hk K + Hv V]       <- linear_attn.in_proj_qkv.weight.T   ([q | k | v], no interleave)
      in_proj_z      [D, Hv V]                <- linear_attn.in_proj_z.weight.T
      in_proj_b      [D, Hv]                  <- linear_attn.in_proj_b.weight.T
      in_proj_a      [D, Hv]                  <- linear_attn.in_proj_a.weight.T
    conv1d           [conv_dim, Kc]           <- linear_attn.conv1d.weight [conv_dim, 1, Kc] (squeeze axis 1)
    A_log            [Hv]                     <- linear_attn.A_log
    dt_bias          [Hv]                     <- linear_attn.dt_bias
    norm             [V]                      <- linear_attn.norm.weight (plain weight, ones at init)
    out_proj         [Hv V, D]                <- linear_attn.out_proj.weight.T

State: ``GdnSlots`` (conv_state [S, conv_dim, Kc-1], ssm_state [S, Hv, K, V] fp32) and ``BatchMeta``
(jax_gdn/state.py). Every function returns new slots (functional ``.at[slot_ids].set``; donate them under jit);
slots not named by the call are returned unchanged, and a stream whose has_initial_state is False starts from
zeros whatever (stale, NaN) its slot holds. Bad shapes raise ValueError before any state is touched.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_gdn import ops as gdn_ops
from jax_gdn.config import GdnDims
from jax_gdn.ops import validation
from jax_gdn.ops.conv1d import causal_conv1d_one, causal_conv1d_varlen
from jax_gdn.ops.norms import gated_rms_norm, l2norm, rms_norm
from jax_gdn.options import GDN_DECODE_STEPS, PHASE1_CONVS, RuntimeOptions
from jax_gdn.state import BatchMeta, GdnSlots

__all__ = [
    "Phase1Proj",
    "param_shapes",
    "mixer_param_shapes",
    "init_params",
    "check_params",
    "params_from_hf",
    "phase1_proj_batched",
    "phase1_in_proj",
    "phase1_conv1d_one",
    "phase1_conv1d_varlen",
    "phase1_l2_batched",
    "phase1_conv1d_l2_varlen",
    "phase1_conv_l2",
    "phase1_varlen",
    "conv_l2_backend",
    "gdn_full",
    "gdn_full_batched",
    "gdn_full_varlen",
    "gdn_full_per_stream",
    "varlen_eligibility",
    "gdn_output",
    "phase3",
    "gdn_mixer",
    "gdn_mixer_decode",
    "gdn_layer_prefill",
    "gdn_layer_decode",
    "decode_step_backend",
    "gdn_layer_monolithic",
    "GatedDeltaNet",
]

FFN = Optional[Callable[[jax.Array], jax.Array]]


# ================================================================================================================
# Parameters
# ================================================================================================================
def param_shapes(dims: GdnDims) -> dict:
    """Name -> shape of every parameter of one layer (see the module docstring for the HF names)."""
    d, hv, v = dims.hidden_size, dims.num_v_heads, dims.head_v_dim
    shapes = {"input_layernorm": (d,)}
    if dims.layout == "qwen3_next":
        shapes["in_proj_qkvz"] = (d, 2 * dims.key_dim + 2 * dims.value_dim)
        shapes["in_proj_ba"] = (d, 2 * hv)
    else:
        shapes["in_proj_qkv"] = (d, dims.conv_dim)
        shapes["in_proj_z"] = (d, dims.value_dim)
        shapes["in_proj_b"] = (d, hv)
        shapes["in_proj_a"] = (d, hv)
    shapes.update(conv1d=(dims.conv_dim, dims.conv_kernel_size), A_log=(hv,), dt_bias=(hv,), norm=(v,),
                  out_proj=(dims.value_dim, d))
    return shapes


def mixer_param_shapes(dims: GdnDims) -> dict:
    """``param_shapes`` without ``input_layernorm``: the parameters of the mixer alone (the decoder block holds
    the input norm as its ``input_norm``)."""
    return {k: v for k, v in param_shapes(dims).items() if k != "input_layernorm"}


def init_params(dims: GdnDims, key: jax.Array, dtype=jnp.float32, *, randomize_norms: bool = False) -> dict:
    """Random parameters: Linear weights N(0, 1/fan_in), conv U(-1/sqrt(Kc), 1/sqrt(Kc)), A = U(0.5, 4),
    dt_bias ~ log(expm1(U(1e-3, 0.1))) (HF/Mamba inverse-softplus init); norms at their identity (zeros for the
    (1 + w) input norm, ones for the gated norm) unless ``randomize_norms`` (tests: catch a wrong convention)."""
    shapes = param_shapes(dims)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    params = {}
    for name, shape in shapes.items():
        k = keys[name]
        if name.startswith("in_proj") or name == "out_proj":
            params[name] = (jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype)
        elif name == "conv1d":
            bound = 1.0 / math.sqrt(dims.conv_kernel_size)
            params[name] = jax.random.uniform(k, shape, jnp.float32, -bound, bound).astype(dtype)
        elif name == "A_log":
            params[name] = jnp.log(jax.random.uniform(k, shape, jnp.float32, 0.5, 4.0))
        elif name == "dt_bias":
            dt = jax.random.uniform(k, shape, jnp.float32, 1e-3, 0.1)
            params[name] = dt + jnp.log(-jnp.expm1(-dt))
        elif name == "input_layernorm":
            params[name] = (0.1 * jax.random.normal(k, shape) if randomize_norms else jnp.zeros(shape)).astype(dtype)
        elif name == "norm":
            params[name] = (1.0 + 0.1 * jax.random.normal(k, shape) if randomize_norms
                            else jnp.ones(shape)).astype(dtype)
    return params


def check_params(params: dict, dims: GdnDims, *, input_norm: bool = True) -> None:
    """Raises ValueError naming a missing, extra or misshapen parameter. input_norm=False: the mixer's parameters
    (``mixer_param_shapes``; an ``input_layernorm`` entry is then ignored if present)."""
    shapes = param_shapes(dims) if input_norm else mixer_param_shapes(dims)
    missing = sorted(set(shapes) - set(params))
    extra = sorted(set(params) - set(shapes) - ({"input_layernorm"} if not input_norm else set()))
    if missing or extra:
        raise ValueError(f"GDN params for layout {dims.layout!r}: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        if tuple(jnp.shape(params[name])) != shape:
            raise ValueError(f"GDN param {name!r} must have shape {shape}, got {tuple(jnp.shape(params[name]))}")


def params_from_hf(linear_attn: dict, input_layernorm) -> dict:
    """Parameters from HF tensors of one layer: ``linear_attn`` maps the names under ``model.layers.{i}.linear_attn.``
    (``in_proj_qkvz.weight``, ``conv1d.weight``, ``A_log``, ``norm.weight``, ...) to arrays (NumPy, jax or torch
    converted with ``.numpy()``); ``input_layernorm`` is ``model.layers.{i}.input_layernorm.weight``.
    Drops the ``.weight`` suffix, squeezes conv1d [conv_dim, 1, Kc] -> [conv_dim, Kc] and transposes the Linear
    weights (in_proj_*, out_proj) to [in, out]; every other tensor keeps HF's layout."""
    params = {"input_layernorm": jnp.asarray(input_layernorm)}
    for name, value in linear_attn.items():
        key = name[:-len(".weight")] if name.endswith(".weight") else name
        value = jnp.asarray(value)
        if key == "conv1d" and value.ndim == 3:
            value = value[:, 0, :]
        elif key.startswith("in_proj") or key == "out_proj":
            value = value.T
        params[key] = value
    return params


# ================================================================================================================
# Argument checks (static shapes always; values when concrete) - run before any state is touched
# ================================================================================================================
def _check_hidden(hidden, dims: GdnDims, name: str = "hidden") -> int:
    if jnp.ndim(hidden) != 2 or jnp.shape(hidden)[1] != dims.hidden_size:
        raise ValueError(f"{name} must have shape [T, D] with D = hidden_size = {dims.hidden_size}, "
                         f"got {tuple(jnp.shape(hidden))}")
    return jnp.shape(hidden)[0]


def _check_slots(slots: GdnSlots, dims: GdnDims) -> int:
    s = validation.check_ssm_state_pool(slots.ssm_state, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim,
                                        "slots.ssm_state")
    want = (s, dims.conv_dim, dims.conv_kernel_size - 1)
    if tuple(slots.conv_state.shape) != want:
        raise ValueError(f"slots.conv_state must have shape [S, conv_dim, Kc-1] = {want}, "
                         f"got {tuple(slots.conv_state.shape)}")
    return s


def _check_meta(meta: BatchMeta, total_len: int, num_slots: int) -> int:
    n = validation.check_cu_seqlens(meta.cu_seqlens, total_len, "meta.cu_seqlens")
    validation.check_slot_ids(meta.slot_ids, num_slots, n, "meta.slot_ids")
    validation.check_has_initial_state(meta.has_initial_state, n, "meta.has_initial_state")
    return n


def _check_one_slot(slot, has_initial_state, num_slots: int):
    if jnp.ndim(slot) != 0 or not jnp.issubdtype(jnp.result_type(slot), jnp.integer):
        raise ValueError(f"slot must be a scalar int in [0, {num_slots}), got {slot!r}")
    value = validation.concrete_value(slot)
    if value is not None and not 0 <= int(value) < num_slots:
        raise ValueError(f"slot must lie in [0, {num_slots}) (S = {num_slots} slots), got {int(value)}")
    if jnp.ndim(has_initial_state) != 0:
        raise ValueError(f"has_initial_state must be a scalar bool, got shape {jnp.shape(has_initial_state)}")


def _check_qkvgb(q, k, v, g, beta):
    """q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]: checked through the ops' checks with B = 1."""
    for name, x, rank in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if jnp.ndim(x) != rank:
            expected = {"q": "[T, Hk, K]", "k": "[T, Hk, K]", "v": "[T, Hv, V]"}.get(name, "[T, Hv]")
            raise ValueError(f"{name} must have shape {expected}, got {tuple(jnp.shape(x))}")
    validation.check_qkvgb(q[None], k[None], v[None], g[None], beta[None])


# ================================================================================================================
# Phase 1: projections, conv1d, L2 norm
# ================================================================================================================
class Phase1Proj(NamedTuple):
    """Output of phase1_proj_batched.

    mixed_qkv [T, conv_dim]  pre-conv [q | k | v] channels (q, k head-major [Hk, K]; v [Hv, V]), activation dtype
    z         [T, Hv, V]     output gate, activation dtype
    beta      [T, Hv]        sigmoid(b), fp32
    g         [T, Hv]        -exp(A_log) * softplus(a + dt_bias), fp32 log-decay (<= 0)
    qkvz      [T, 2 Hk K + 2 Hv V] or None: qwen3_next's fused projection as it comes out of the matmul (grouped per
              key head); mixed_qkv and z are views of it that ``phase1_conv1d_l2_varlen`` and ``phase3`` read in
              place under jit (mixed_qkv is then never materialised). None for qwen3_5.
    """

    mixed_qkv: jax.Array
    z: jax.Array
    beta: jax.Array
    g: jax.Array
    qkvz: Optional[jax.Array] = None


def _linear(x, w):  # x [T, in], w [in, out] -> [T, out]
    return x @ w.astype(x.dtype)


def _project(params: dict, dims: GdnDims, x: jax.Array):
    """Normed hidden x [T, D] -> (mixed_qkv [T, conv_dim], z [T, Hv, V], b [T, Hv], a [T, Hv], qkvz [T, 2 Hk K +
    2 Hv V] for qwen3_next else None)."""
    t = x.shape[0]
    hk, hv, dk, dv, r = dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim, dims.head_ratio
    if dims.layout == "qwen3_next":
        # per key head: [q (K) | k (K) | v (r V) | z (r V)] and [b (r) | a (r)]  (HF fix_query_key_value_ordering)
        qkvz_flat = _linear(x, params["in_proj_qkvz"])
        qkvz = qkvz_flat.reshape(t, hk, 2 * dk + 2 * r * dv)
        ba = _linear(x, params["in_proj_ba"]).reshape(t, hk, 2 * r)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
        b, a = ba[..., :r].reshape(t, hv), ba[..., r:].reshape(t, hv)
        mixed_qkv = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
        z = z.reshape(t, hv, dv)
    else:
        qkvz_flat = None
        mixed_qkv = _linear(x, params["in_proj_qkv"])
        z = _linear(x, params["in_proj_z"]).reshape(t, hv, dv)
        b, a = _linear(x, params["in_proj_b"]), _linear(x, params["in_proj_a"])
    return mixed_qkv, z, b, a, qkvz_flat


def _gates(params: dict, b, a):
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(params["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + params["dt_bias"].astype(jnp.float32))
    return beta, g


def phase1_proj_batched(params: dict, dims: GdnDims, hidden: jax.Array) -> Phase1Proj:
    """Input RMSNorm + in_proj of the stacked hidden states of all requests.

    hidden [T, D] -> Phase1Proj(mixed_qkv [T, conv_dim], z [T, Hv, V], beta [T, Hv] fp32, g [T, Hv] fp32).
    """
    _check_hidden(hidden, dims)
    return phase1_in_proj(params, dims, rms_norm(hidden, params["input_layernorm"], dims.rms_norm_eps))


def phase1_in_proj(params: dict, dims: GdnDims, x: jax.Array) -> Phase1Proj:
    """in_proj + gates of already-normed hidden states (``phase1_proj_batched`` without the input RMSNorm: the
    mixer's phase 1, the block owning the norm). x [T, D] -> Phase1Proj (as ``phase1_proj_batched``)."""
    _check_hidden(x, dims, "x")
    mixed_qkv, z, b, a, qkvz = _project(params, dims, x)
    beta, g = _gates(params, b, a)
    return Phase1Proj(mixed_qkv, z, beta, g, qkvz)


def phase1_conv1d_one(params: dict, dims: GdnDims, mixed_qkv: jax.Array, slots: GdnSlots, slot,
                      has_initial_state) -> tuple[jax.Array, GdnSlots]:
    """Causal conv1d + SiLU of ONE request, advancing the conv state of its slot.

    mixed_qkv [T, conv_dim]; slot: int scalar in [0, S); has_initial_state: bool scalar.
    Returns (conv_out [T, conv_dim], slots with conv_state[slot] advanced).
    """
    num_slots = _check_slots(slots, dims)
    _check_one_slot(slot, has_initial_state, num_slots)
    if jnp.ndim(mixed_qkv) != 2 or jnp.shape(mixed_qkv)[1] != dims.conv_dim:
        raise ValueError(f"mixed_qkv must have shape [T, conv_dim] with conv_dim = {dims.conv_dim}, "
                         f"got {tuple(jnp.shape(mixed_qkv))}")
    y, new_state = causal_conv1d_one(mixed_qkv, params["conv1d"], slots.conv_state[slot], has_initial_state)
    return y, slots.replace(conv_state=slots.conv_state.at[slot].set(new_state))


def phase1_conv1d_varlen(params: dict, dims: GdnDims, mixed_qkv: jax.Array, slots: GdnSlots,
                         meta: BatchMeta) -> tuple[jax.Array, GdnSlots]:
    """Causal conv1d + SiLU of all requests in one call over meta.cu_seqlens, each from its slot's conv state.

    mixed_qkv [T, conv_dim]; meta: cu_seqlens [N+1] (ends at T), slot_ids [N], has_initial_state [N].
    Returns (conv_out [T, conv_dim], slots with the N streams' conv states advanced).
    """
    num_slots = _check_slots(slots, dims)
    if jnp.ndim(mixed_qkv) != 2 or jnp.shape(mixed_qkv)[1] != dims.conv_dim:
        raise ValueError(f"mixed_qkv must have shape [T, conv_dim] with conv_dim = {dims.conv_dim}, "
                         f"got {tuple(jnp.shape(mixed_qkv))}")
    _check_meta(meta, mixed_qkv.shape[0], num_slots)
    y, pool = causal_conv1d_varlen(mixed_qkv, params["conv1d"], slots.conv_state, meta.cu_seqlens,
                                   meta.slot_ids, meta.has_initial_state)
    return y, slots.replace(conv_state=pool)


def phase1_l2_batched(dims: GdnDims, conv_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split [q | k | v] and L2-normalise q and k (fp32 math) over all stacked tokens.

    conv_out [T, conv_dim] -> (q [T, Hk, K], k [T, Hk, K], v [T, Hv, V]) in conv_out's dtype.
    """
    if jnp.ndim(conv_out) != 2 or jnp.shape(conv_out)[1] != dims.conv_dim:
        raise ValueError(f"conv_out must have shape [T, conv_dim] with conv_dim = {dims.conv_dim}, "
                         f"got {tuple(jnp.shape(conv_out))}")
    t, kd = conv_out.shape[0], dims.key_dim
    q = conv_out[:, :kd].reshape(t, dims.num_k_heads, dims.head_k_dim)
    k = conv_out[:, kd:2 * kd].reshape(t, dims.num_k_heads, dims.head_k_dim)
    v = conv_out[:, 2 * kd:].reshape(t, dims.num_v_heads, dims.head_v_dim)
    return l2norm(q), l2norm(k), v


#: The conv + L2 kernel's backend that goes with each GDN backend name (the conv op has no Mosaic form).
CONV_BACKEND_OF_GDN = {"auto": "auto", "pallas": "pallas", "pallas_interpret": "pallas_interpret",
                       "mosaic_gpu_interpret": "pallas_interpret", "mosaic_gpu": "xla", "xla": "xla"}


def conv_l2_backend(backend: str, dims: GdnDims, dtype) -> str:
    """The implementation of the fused conv + SiLU + L2 norm (``pallas_kernels.conv1d``) that goes with the GDN
    backend ``backend`` (``CONV_BACKEND_OF_GDN``), resolved by the conv op's table at these dims on this platform:
    "pallas" / "pallas_interpret" where its kernel takes them, else "xla". Static."""
    from pallas_kernels.conv1d import api as conv_api
    gdn_ops.resolve_backend(backend)                  # the GDN name, checked against the platform
    name = CONV_BACKEND_OF_GDN[backend]
    if name == "xla":
        return "xla"
    case = conv_api.ConvCase("prefill", jax.default_backend(), dtype, dims.head_k_dim, dims.head_v_dim)
    if conv_api.TABLE.why_not(name, case) is not None:
        return "xla"
    return conv_api.KERNEL[conv_api.TABLE.resolve(name, case, warn=False).name]


def phase1_conv1d_l2_varlen(params: dict, dims: GdnDims, p1: Phase1Proj, slots: GdnSlots, meta: BatchMeta, *,
                            backend: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array, GdnSlots]:
    """``phase1_conv1d_varlen`` then ``phase1_l2_batched`` in one pass: causal conv + SiLU of all requests from
    their slots' conv states, then the L2 norm of each q and k head taken of the fp32 conv output (the two-step
    form rounds the conv output to the activation dtype first).

    p1: phase1_proj_batched's output (qwen3_next with K == V: the fused projection ``p1.qkvz`` is read in place,
    no [T, conv_dim] reorder); meta: cu_seqlens [N+1], slot_ids [N], has_initial_state [N].
    backend: "xla", "pallas" (Triton kernel, GPU) or "pallas_interpret" (``conv_l2_backend`` maps a GDN backend to
    one of them). Returns (q [T, Hk, K], k [T, Hk, K], v [T, Hv, V] in the activation dtype, slots with the N
    streams' conv states advanced).
    """
    from pallas_kernels.conv1d import api as conv_api
    from pallas_kernels.conv1d.reference import qkvz_block_cols
    num_slots = _check_slots(slots, dims)
    if jnp.ndim(p1.mixed_qkv) != 2 or jnp.shape(p1.mixed_qkv)[1] != dims.conv_dim:
        raise ValueError(f"p1.mixed_qkv must have shape [T, conv_dim] with conv_dim = {dims.conv_dim}, "
                         f"got {tuple(jnp.shape(p1.mixed_qkv))}")
    t = p1.mixed_qkv.shape[0]
    _check_meta(meta, t, num_slots)
    hk, hv, dk, dv = dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim
    if dk != dv:   # the fused op works per head block of one size: the two-step form
        conv_out, slots = phase1_conv1d_varlen(params, dims, p1.mixed_qkv, slots, meta)
        q, k, v = phase1_l2_batched(dims, conv_out)
        return q, k, v, slots
    if p1.qkvz is not None:
        src, cols = p1.qkvz, qkvz_block_cols(hk, hv, dk)
    else:
        src, cols = p1.mixed_qkv, None
    q, k, v, pool = conv_api.causal_conv1d_l2_varlen(
        src, params["conv1d"], slots.conv_state, meta.cu_seqlens, meta.slot_ids, meta.has_initial_state,
        num_k_heads=hk, num_v_heads=hv, head_dim=dk, block_cols=cols, backend=backend)
    return q, k, v, slots.replace(conv_state=pool)


def phase1_conv_l2(params: dict, dims: GdnDims, p1: Phase1Proj, slots: GdnSlots, meta: BatchMeta, *,
                   backend: str = "xla", conv: Optional[str] = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array, GdnSlots]:
    """The conv + SiLU + q/k L2 norm of phase 1 for N packed streams, in the form ``conv`` names
    (``RuntimeOptions.phase1_conv``; None: its default "auto"): "two_step" (``phase1_conv1d_varlen`` then
    ``phase1_l2_batched``), "fused" (``phase1_conv1d_l2_varlen`` on the implementation ``conv_l2_backend`` pairs
    with the GDN backend ``backend``), "auto" (fused only where that is the compiled Pallas kernel, a GPU).
    p1: the phase's projections -> (q, k [T, Hk, K], v [T, Hv, V], slots with the streams' conv states advanced)."""
    conv = RuntimeOptions.phase1_conv if conv is None else conv
    if conv not in PHASE1_CONVS:
        raise ValueError(f"conv must be one of {PHASE1_CONVS}, got {conv!r}")
    dtype = p1.mixed_qkv.dtype
    if conv == "auto":
        conv = "fused" if conv_l2_backend(backend, dims, dtype) == "pallas" else "two_step"
    if conv == "two_step":
        conv_out, slots = phase1_conv1d_varlen(params, dims, p1.mixed_qkv, slots, meta)
        q, k, v = phase1_l2_batched(dims, conv_out)
        return q, k, v, slots
    return phase1_conv1d_l2_varlen(params, dims, p1, slots, meta, backend=conv_l2_backend(backend, dims, dtype))


def phase1_varlen(params: dict, dims: GdnDims, hidden: jax.Array, slots: GdnSlots, meta: BatchMeta, *,
                  backend: str = "xla", conv: Optional[str] = None
                  ) -> tuple[Phase1Proj, jax.Array, jax.Array, jax.Array, GdnSlots]:
    """All of phase 1 for N packed streams from the layer's input: ``phase1_proj_batched`` (input RMSNorm
    included), then ``phase1_conv_l2`` (``conv``: see there). hidden [T, D] -> (Phase1Proj (its z, beta, g feed
    phases 2 and 3), q, k [T, Hk, K], v [T, Hv, V], slots with the N streams' conv states advanced)."""
    p1 = phase1_proj_batched(params, dims, hidden)
    q, k, v, slots = phase1_conv_l2(params, dims, p1, slots, meta, backend=backend, conv=conv)
    return p1, q, k, v, slots


# ================================================================================================================
# Phase 2: the chunked gated delta rule over the slot pool
# ================================================================================================================
def gdn_full(q, k, v, g, beta, slots: GdnSlots, slot, has_initial_state, *, backend: str = "auto",
             chunk_size: int = 64) -> tuple[jax.Array, GdnSlots]:
    """Gated delta rule of ONE stream (q, k already L2-normalised), reading and writing ssm_state[slot].

    q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; slot: int scalar; has_initial_state: bool scalar.
    Returns (o [T, Hv, V], slots with ssm_state[slot] = the final state).
    """
    _check_qkvgb(q, k, v, g, beta)
    _check_one_slot(slot, has_initial_state, slots.ssm_state.shape[0])
    slot_ids = jnp.reshape(jnp.asarray(slot, jnp.int32), (1,))
    has_init = jnp.reshape(jnp.asarray(has_initial_state, bool), (1,))
    o, ssm = gdn_ops.chunk_gated_delta_rule_slots(
        q[None], k[None], v[None], g[None], beta[None], ssm_state=slots.ssm_state, slot_ids=slot_ids,
        has_initial_state=has_init, chunk_size=chunk_size, backend=backend)
    return o[0], slots.replace(ssm_state=ssm)


def gdn_full_batched(q, k, v, g, beta, slots: GdnSlots, slot_ids, has_initial_state, *, backend: str = "auto",
                     chunk_size: int = 64) -> tuple[jax.Array, GdnSlots]:
    """N streams of EQUAL length L stacked along T (T = N L), one state slot per stream (the JAX form of
    ``h_state_ptrs``): one dense [N, L] call of the slot op.

    q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; slot_ids [N] int32; has_initial_state [N] bool.
    Returns (o [T, Hv, V], slots with the N slots' ssm states replaced).
    """
    _check_qkvgb(q, k, v, g, beta)
    n = jnp.shape(slot_ids)[0] if jnp.ndim(slot_ids) == 1 else -1
    t = q.shape[0]
    if n < 1 or t % n:
        raise ValueError(f"slot_ids must have shape [N] with N >= 1 dividing T = {t} (equal lengths), "
                         f"got {tuple(jnp.shape(slot_ids))}")
    ln = t // n

    def split(x):
        return x.reshape((n, ln) + x.shape[1:])

    o, ssm = gdn_ops.chunk_gated_delta_rule_slots(
        split(q), split(k), split(v), split(g), split(beta), ssm_state=slots.ssm_state, slot_ids=slot_ids,
        has_initial_state=has_initial_state, chunk_size=chunk_size, backend=backend)
    return o.reshape((t,) + o.shape[2:]), slots.replace(ssm_state=ssm)


def varlen_eligibility(q, k, v, backend: str = "auto") -> tuple[bool, str]:
    """Whether ``gdn_full_varlen`` can run these inputs in one call, and why not.

    Asks the op's dispatch table (``pallas_kernels.gated_delta_rule.api.TABLE``) for a packed slot call of these
    head dims and dtypes: eligible where ``backend`` has an implementation that takes them ("xla" any dims;
    "auto" always, as it falls back to "xla"; the Pallas kernels K, V up to 128, other dims zero-padded).
    Not eligible: an explicit "pallas" / "pallas_interpret" whose kernel rejects the inputs (the seed's
    ``Ok(false)``); ``gdn_layer_prefill`` then runs ``gdn_full_varlen`` with the "xla" backend (traceable),
    and ``gdn_full_per_stream`` remains the eager per-stream form. An explicit "pallas" without a GPU raises.
    Static: decided from shapes, dtypes and the backend name only, so it is safe under jit.
    """
    from pallas_kernels.gated_delta_rule import api
    gdn_ops.resolve_backend(backend)                  # the name, checked against the platform
    case = api.GdnCase.of("slots", q[None], k[None], v[None])
    try:
        api.TABLE.resolve(backend, case, warn=False)
    except ValueError as err:
        return False, str(err)
    return True, ""


def gdn_full_varlen(q, k, v, g, beta, slots: GdnSlots, meta: BatchMeta, *, backend: str = "auto",
                    chunk_size: int = 64) -> tuple[Optional[jax.Array], GdnSlots, bool]:
    """All N streams packed over meta.cu_seqlens in ONE call of the slot op.

    q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; meta: cu_seqlens [N+1] (ends at T), slot_ids [N],
    has_initial_state [N]. Returns (o [T, Hv, V], new slots, True), or (None, slots unchanged, False) when the batch
    is not eligible (see ``varlen_eligibility``): then run it with backend "xla" (or ``gdn_full_per_stream`` eagerly).
    """
    _check_qkvgb(q, k, v, g, beta)
    _check_meta(meta, q.shape[0], slots.ssm_state.shape[0])
    ok, _ = varlen_eligibility(q, k, v, backend)
    if not ok:
        return None, slots, False
    o, ssm = gdn_ops.chunk_gated_delta_rule_slots(
        q[None], k[None], v[None], g[None], beta[None], ssm_state=slots.ssm_state, slot_ids=meta.slot_ids,
        has_initial_state=meta.has_initial_state, cu_seqlens=meta.cu_seqlens, chunk_size=chunk_size,
        backend=backend)
    return o[0], slots.replace(ssm_state=ssm), True


def gdn_full_per_stream(q, k, v, g, beta, slots: GdnSlots, meta: BatchMeta, *, backend: str = "xla",
                        chunk_size: int = 64) -> tuple[jax.Array, GdnSlots]:
    """The fallback of ``gdn_full_varlen``: ``gdn_full`` once per stream. Needs CONCRETE meta (host loop over
    cu_seqlens; raises ValueError under tracing). Shapes as ``gdn_full_varlen``."""
    _check_qkvgb(q, k, v, g, beta)
    _check_meta(meta, q.shape[0], slots.ssm_state.shape[0])
    cu = validation.concrete_value(meta.cu_seqlens)
    if cu is None:
        raise ValueError("gdn_full_per_stream needs concrete meta.cu_seqlens (it loops over streams on the host); "
                         "under jit use gdn_full_varlen with an eligible backend")
    outs = []
    for n in range(len(cu) - 1):
        s0, s1 = int(cu[n]), int(cu[n + 1])
        if s1 == s0:  # empty stream: its state is its initial state (zeros when fresh)
            sid = meta.slot_ids[n]
            kept = jnp.where(meta.has_initial_state[n], slots.ssm_state[sid], 0.0)
            slots = slots.replace(ssm_state=slots.ssm_state.at[sid].set(kept))
            continue
        o, slots = gdn_full(q[s0:s1], k[s0:s1], v[s0:s1], g[s0:s1], beta[s0:s1], slots, meta.slot_ids[n],
                            meta.has_initial_state[n], backend=backend, chunk_size=chunk_size)
        outs.append(o)
    o = jnp.concatenate(outs, axis=0) if outs else jnp.zeros(v.shape, v.dtype)
    return o, slots


# ================================================================================================================
# Phase 3: gated norm, out_proj (the mixer's output), then residual and FFN (the split protocol's last phase)
# ================================================================================================================
def _check_oz(o, z, dims: GdnDims, t: int):
    want = (t, dims.num_v_heads, dims.head_v_dim)
    for name, x in (("o", o), ("z", z)):
        if tuple(jnp.shape(x)) != want:
            raise ValueError(f"{name} must have shape [T, Hv, V] = {want}, got {tuple(jnp.shape(x))}")


def gdn_output(params: dict, dims: GdnDims, o: jax.Array, z: jax.Array, dtype) -> jax.Array:
    """The mixer's output: gated RMSNorm per head (``norm * rmsnorm(o) * silu(z)``, fp32), then out_proj.

    o, z [T, Hv, V] -> y [T, D] in ``dtype`` (the hidden states' dtype; the normed heads are cast to it before
    out_proj). Under tensor parallel (heads split, jax_gdn.sharding) y is this device's partial sum.
    """
    t = jnp.shape(o)[0]
    _check_oz(o, z, dims, t)
    y = gated_rms_norm(o, z.astype(o.dtype), params["norm"], dims.rms_norm_eps).reshape(t, dims.value_dim)
    return _linear(y.astype(dtype), params["out_proj"])


def phase3(params: dict, dims: GdnDims, o: jax.Array, z: jax.Array, residual: jax.Array, *,
           ffn: FFN = None, reduce: FFN = None) -> jax.Array:
    """Gated RMSNorm per head (``norm * rmsnorm(o) * silu(z)``, fp32), out_proj, residual add, then the FFN:
    ``residual + reduce(gdn_output(o, z))``, then ``ffn``.

    o, z [T, Hv, V]; residual [T, D] (the layer's input hidden states). ``ffn``: None (identity) or a callable
    [T, D] -> [T, D] applied to the post-residual hidden states and returning the layer's output (it owns its
    post_attention_layernorm and its own residual add). ``reduce``: None, or the sum of out_proj's partial
    results over the devices when the heads are split (tensor parallel, jax_gdn.sharding), applied before the
    residual add. Returns hidden [T, D] in residual's dtype.
    """
    t = _check_hidden(residual, dims, "residual")
    _check_oz(o, z, dims, t)
    out = gdn_output(params, dims, o, z, residual.dtype)
    h = residual + (out if reduce is None else reduce(out))
    return h if ffn is None else ffn(h)


# ================================================================================================================
# The mixer (normed x -> y, composed once) and the whole layer around it: prefill, decode, the monolithic check
# ================================================================================================================
def gdn_mixer(params: dict, dims: GdnDims, x: jax.Array, slots: GdnSlots, meta: BatchMeta, *,
              backend: str = "auto", chunk_size: int = 64, conv: Optional[str] = None
              ) -> tuple[jax.Array, GdnSlots]:
    """The GDN mixer over N packed streams: phase 1 (``phase1_in_proj``, ``phase1_conv_l2`` in the form
    ``conv`` names), phase 2 (``gdn_full_varlen``; where the requested backend is not eligible for these inputs,
    ``varlen_eligibility``, it runs again with the "xla" backend: traceable, any dims), then ``gdn_output``.

    x [T, D] already normed (the layer's input RMSNorm applied; stream n owns rows
    meta.cu_seqlens[n]:meta.cu_seqlens[n+1]); params: the mixer's (``mixer_param_shapes``; an input_layernorm
    entry is ignored); slots: GdnSlots [S, ...]; meta: BatchMeta. Returns (y [T, D] in x's dtype, no residual;
    slots with the N streams' conv and ssm states advanced). Pure: call it inside jax.jit with dims static.
    """
    check_params(params, dims, input_norm=False)
    t = _check_hidden(x, dims, "x")
    _check_meta(meta, t, _check_slots(slots, dims))
    p1 = phase1_in_proj(params, dims, x)
    q, k, v, slots = phase1_conv_l2(params, dims, p1, slots, meta, backend=backend, conv=conv)
    o, new_slots, ok = gdn_full_varlen(q, k, v, p1.g, p1.beta, slots, meta, backend=backend, chunk_size=chunk_size)
    if not ok:  # the kernel refuses these dims: the XLA chunked varlen path (traceable, any dims)
        o, new_slots, _ = gdn_full_varlen(q, k, v, p1.g, p1.beta, slots, meta, backend="xla",
                                          chunk_size=chunk_size)
    o = checkpoint_name(o, "gdn_core")             # what RuntimeOptions(remat="layers") keeps for the backward
    return gdn_output(params, dims, o, p1.z, x.dtype), new_slots


def gdn_layer_prefill(params: dict, dims: GdnDims, hidden: jax.Array, slots: GdnSlots, meta: BatchMeta, *,
                      backend: str = "auto", ffn: FFN = None, chunk_size: int = 64,
                      conv: Optional[str] = None) -> tuple[jax.Array, GdnSlots]:
    """Prefill of N packed streams through the split protocol (pure; call it inside jax.jit with dims static):
    ``hidden + gdn_mixer(rmsnorm(hidden, input_layernorm))``, then ``ffn``.

    hidden [T, D] (stream n owns rows meta.cu_seqlens[n]:meta.cu_seqlens[n+1]; cu_seqlens ends at T);
    slots: GdnSlots [S, ...]; meta: BatchMeta; ffn: as in ``phase3``; conv: ``RuntimeOptions.phase1_conv``
    (None: its default). Returns (hidden_out [T, D], slots with the N streams' conv and ssm states advanced).
    """
    check_params(params, dims)
    _check_hidden(hidden, dims)
    x = rms_norm(hidden, params["input_layernorm"], dims.rms_norm_eps)
    y, slots = gdn_mixer(params, dims, x, slots, meta, backend=backend, chunk_size=chunk_size, conv=conv)
    out = hidden + y
    return (out if ffn is None else ffn(out)), slots


#: ``gdn_layer_decode``'s ``step`` values (``RuntimeOptions.gdn_decode_step``).
DECODE_STEPS = GDN_DECODE_STEPS


def decode_step_backend(backend: str, dims: GdnDims, dtype) -> Optional[str]:
    """The conv kernel's backend of the fused decode step ("pallas" or "pallas_interpret") for the GDN backend
    ``backend``, or None where it cannot run (a name without a Pallas conv kernel, K != V, a head dim the kernels
    would pad, or the conv decode kernel refuses the dims / dtype). The recurrent step's kernel is the GDN
    table's "decode" pick for ``backend`` (``api.decode_slots_raw_gates``). Static."""
    from pallas_kernels.conv1d import api as conv_api
    from pallas_kernels.gated_delta_rule import api
    gdn_ops.resolve_backend(backend)                  # the name, checked against the platform
    name = CONV_BACKEND_OF_GDN[backend]
    d = dims.head_k_dim
    if (name == "xla" or d != dims.head_v_dim or d > api.MAX_HEAD_DIM or api.kernel_head_dim(d) != d
            or dims.conv_kernel_size < 2):
        return None
    case = conv_api.ConvCase("decode", jax.default_backend(), dtype, d, d)
    if conv_api.TABLE.why_not(name, case) is not None:
        return None
    kernel = conv_api.KERNEL[conv_api.TABLE.resolve(name, case, warn=False).name]
    return None if kernel == "xla" or conv_l2_backend(backend, dims, dtype) != kernel else kernel


def _decode_fused(params: dict, dims: GdnDims, x, slots: GdnSlots, slot_ids, has_initial_state, kb: str,
                  backend: str):
    """The fused decode step's phases 1-2 on normed x [N, D] (``RuntimeOptions.gdn_decode_step``): in_proj, the
    conv1d decode kernel (conv + SiLU + q/k L2 norm, conv states advanced in place), the decode kernel with g /
    beta made inside from the raw a, b. Returns (o [N, Hv, V], z [N, Hv, V], slots)."""
    from pallas_kernels.conv1d import api as conv_api
    from pallas_kernels.conv1d.reference import qkvz_block_cols
    from pallas_kernels.gated_delta_rule import api as gdn_api
    from pallas_kernels.gated_delta_rule.triton import decode as decode_kernel
    n = x.shape[0]
    hk, hv, d, r = dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_ratio
    if dims.layout == "qwen3_next":
        src = _linear(x, params["in_proj_qkvz"])                                # read in place by the conv kernel
        cols = qkvz_block_cols(hk, hv, d)
        z = src.reshape(n, hk, 2 * d + 2 * r * d)[..., 2 * d + r * d:].reshape(n, hv, d)
        a_src = b_src = _linear(x, params["in_proj_ba"]).reshape(n, 1, hk, 2 * r)   # [b (r) | a (r)] per key head
        a_off = r
    else:
        src, z, b, a, _ = _project(params, dims, x)
        cols, a_off = None, 0
        a_src, b_src = a.reshape(n, 1, hk, r), b.reshape(n, 1, hk, r)
    q, k, v, conv_pool = conv_api.causal_conv1d_l2_decode(
        src, params["conv1d"], slots.conv_state, slot_ids, has_initial_state, num_k_heads=hk, num_v_heads=hv,
        head_dim=d, block_cols=cols, backend=kb)
    gates = decode_kernel.RawGates(params["A_log"], params["dt_bias"], a_offset=a_off, b_offset=0)
    o, ssm = gdn_api.decode_slots_raw_gates(
        q[:, None], k[:, None], v[:, None], a_src, b_src, raw_gates=gates, scale=d ** -0.5, ssm_state=slots.ssm_state,
        slot_ids=slot_ids, has_initial_state=has_initial_state, backend=backend)
    return o[:, 0], z, slots.replace(conv_state=conv_pool, ssm_state=ssm)


def gdn_mixer_decode(params: dict, dims: GdnDims, x: jax.Array, slots: GdnSlots, slot_ids,
                     has_initial_state=None, *, backend: str = "auto", step: Optional[str] = None
                     ) -> tuple[jax.Array, GdnSlots]:
    """The GDN mixer's decode step: ONE token per stream, recurrent form, conv and ssm states of the N slots
    advanced; then ``gdn_output``.

    x [N, D] already normed (row n = the next token of the stream in slot_ids[n]); params: the mixer's (an
    input_layernorm entry is ignored); slot_ids [N] int32 (checked when concrete; under jit a padding stream's id
    S reads zeros and writes nothing); has_initial_state [N] bool (default all True). backend: the GDN backend of
    the recurrent step ("auto": the decode kernel on a GPU); step: ``RuntimeOptions.gdn_decode_step`` ("unfused",
    "fused" or "auto"; None: its default). Returns (y [N, D] in x's dtype, no residual; slots).
    """
    check_params(params, dims, input_norm=False)
    n = _check_hidden(x, dims, "x")
    num_slots = _check_slots(slots, dims)
    validation.check_slot_ids(slot_ids, num_slots, n)
    if has_initial_state is None:
        has_initial_state = jnp.ones((n,), bool)
    validation.check_has_initial_state(has_initial_state, n)
    step = RuntimeOptions.gdn_decode_step if step is None else step
    if step not in DECODE_STEPS:
        raise ValueError(f"step must be one of {DECODE_STEPS}, got {step!r}")
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    kb = decode_step_backend(backend, dims, x.dtype) if step != "unfused" else None
    if step == "auto" and kb == "pallas_interpret":
        kb = None                                       # "auto" fuses only where the kernels are compiled (a GPU)
    if kb is not None:
        o, z, slots = _decode_fused(params, dims, x, slots, slot_ids, has_initial_state, kb, backend)
        return gdn_output(params, dims, o, z, x.dtype), slots
    meta = BatchMeta(cu_seqlens=jnp.arange(n + 1, dtype=jnp.int32), slot_ids=slot_ids,
                     has_initial_state=has_initial_state, positions=jnp.zeros((n,), jnp.int32))
    p1 = phase1_in_proj(params, dims, x)
    conv_out, slots = phase1_conv1d_varlen(params, dims, p1.mixed_qkv, slots, meta)
    q, k, v = phase1_l2_batched(dims, conv_out)
    o, ssm = gdn_ops.fused_recurrent_gated_delta_rule_slots(
        q[:, None], k[:, None], v[:, None], p1.g[:, None], p1.beta[:, None], ssm_state=slots.ssm_state,
        slot_ids=slot_ids, has_initial_state=has_initial_state, backend=backend)   # the decode kernel on a GPU
    return gdn_output(params, dims, o[:, 0], p1.z, x.dtype), slots.replace(ssm_state=ssm)


def gdn_layer_decode(params: dict, dims: GdnDims, hidden: jax.Array, slots: GdnSlots, slot_ids,
                     has_initial_state=None, *, ffn: FFN = None, reduce: FFN = None, backend: str = "auto",
                     step: Optional[str] = None) -> tuple[jax.Array, GdnSlots]:
    """One decode step of the whole layer: ``hidden + reduce(gdn_mixer_decode(rmsnorm(hidden, input_layernorm)))``,
    then ``ffn`` (``ffn``, ``reduce``: see ``phase3``; the other arguments: ``gdn_mixer_decode``).

    hidden [N, D] (row n = the next token of the stream in slot_ids[n]). Returns (hidden_out [N, D], slots).
    """
    check_params(params, dims)
    _check_hidden(hidden, dims)
    x = rms_norm(hidden, params["input_layernorm"], dims.rms_norm_eps)
    y, slots = gdn_mixer_decode(params, dims, x, slots, slot_ids, has_initial_state, backend=backend, step=step)
    out = hidden + (y if reduce is None else reduce(y))
    return (out if ffn is None else ffn(out)), slots


def gdn_layer_monolithic(params: dict, dims: GdnDims, hidden: jax.Array, slots: GdnSlots, slot,
                         has_initial_state=False, *, backend: str = "auto", ffn: FFN = None,
                         chunk_size: int = 64) -> tuple[jax.Array, GdnSlots]:
    """ONE stream, straight-line (the check of the split protocol): its own conv (lax.conv over the state-prefixed
    input) and the non-slot ``chunk_gated_delta_rule`` with ``use_qk_l2norm=True``.

    hidden [T, D]; slot: int scalar; has_initial_state: bool scalar. Returns (hidden_out [T, D], slots).
    """
    check_params(params, dims)
    t = _check_hidden(hidden, dims)
    num_slots = _check_slots(slots, dims)
    _check_one_slot(slot, has_initial_state, num_slots)
    kc, c = dims.conv_kernel_size, dims.conv_dim
    has_init = jnp.asarray(has_initial_state, bool)

    x = rms_norm(hidden, params["input_layernorm"], dims.rms_norm_eps)
    mixed_qkv, z, b, a, _ = _project(params, dims, x)
    beta, g = _gates(params, b, a)

    # ---- causal depthwise conv: prefix the stream's last Kc-1 inputs, VALID conv, SiLU ----
    prev = jnp.where(has_init, slots.conv_state[slot].astype(jnp.float32), 0.0)            # [C, Kc-1]
    xs = jnp.concatenate([prev, mixed_qkv.astype(jnp.float32).T], axis=1)                    # [C, Kc-1+T]
    y = jax.lax.conv_general_dilated(xs[None], params["conv1d"].astype(jnp.float32)[:, None, :], (1,), "VALID",
                                     dimension_numbers=("NCH", "OIH", "NCH"), feature_group_count=c,
                                     precision=jax.lax.Precision.HIGHEST)[0]                 # [C, T]
    conv_out = jax.nn.silu(y).T.astype(mixed_qkv.dtype)
    new_conv = xs[:, t:].astype(slots.conv_state.dtype)

    # ---- gated delta rule from the slot's state (l2 norm inside the op) ----
    kd = dims.key_dim
    q = conv_out[:, :kd].reshape(1, t, dims.num_k_heads, dims.head_k_dim)
    k = conv_out[:, kd:2 * kd].reshape(1, t, dims.num_k_heads, dims.head_k_dim)
    v = conv_out[:, 2 * kd:].reshape(1, t, dims.num_v_heads, dims.head_v_dim)
    init = jnp.where(has_init, slots.ssm_state[slot], 0.0)[None]
    o, final = gdn_ops.chunk_gated_delta_rule(q, k, v, g[None], beta[None], initial_state=init,
                                              output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size,
                                              backend=backend)

    # ---- gated norm, out_proj, residual, FFN ----
    o32 = o[0].astype(jnp.float32)
    on = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, -1, keepdims=True) + dims.rms_norm_eps)
    y = (params["norm"].astype(jnp.float32) * on * jax.nn.silu(z.astype(jnp.float32))).astype(hidden.dtype)
    out = hidden + _linear(y.reshape(t, dims.value_dim), params["out_proj"])
    if ffn is not None:
        out = ffn(out)
    slots = slots.replace(conv_state=slots.conv_state.at[slot].set(new_conv),
                          ssm_state=slots.ssm_state.at[slot].set(final[0]))
    return out, slots


# ================================================================================================================
# Flax NNX module
# ================================================================================================================
class GatedDeltaNet(nnx.Module):
    """One GDN layer (with its input RMSNorm) holding HF-named parameters as ``nnx.Param``.

    Parameters: ``param_shapes(dims)`` (names and HF mapping in the module docstring). Fill them with
    ``GatedDeltaNet.from_params(dims, params)``, ``layer.load_params(params)`` or ``layer.in_proj_qkvz[...] = w``;
    read them all with ``layer.params()`` (a dict for the pure functions). Methods are the protocol's functions with
    ``params`` and ``dims`` bound; ``__call__`` is the monolithic path of ONE stream and ``decode`` one step.
    """

    def __init__(self, dims: GdnDims, *, rngs: nnx.Rngs, dtype=jnp.float32, backend: str = "auto",
                 chunk_size: int = 64, randomize_norms: bool = False):
        self.dims = dims
        self.backend = backend
        self.chunk_size = chunk_size
        self._names = tuple(param_shapes(dims))
        for name, value in init_params(dims, rngs.params(), dtype, randomize_norms=randomize_norms).items():
            setattr(self, name, nnx.Param(value))

    @classmethod
    def from_params(cls, dims: GdnDims, params: dict, **kwargs) -> "GatedDeltaNet":
        layer = cls(dims, rngs=nnx.Rngs(0), **kwargs)
        layer.load_params(params)
        return layer

    def load_params(self, params: dict) -> None:
        check_params(params, self.dims)
        for name in self._names:
            getattr(self, name)[...] = jnp.asarray(params[name])

    def params(self) -> dict:
        return {name: getattr(self, name)[...] for name in self._names}

    # ---- the protocol ----
    def phase1_proj_batched(self, hidden):
        return phase1_proj_batched(self.params(), self.dims, hidden)

    def phase1_conv1d_one(self, mixed_qkv, slots, slot, has_initial_state):
        return phase1_conv1d_one(self.params(), self.dims, mixed_qkv, slots, slot, has_initial_state)

    def phase1_conv1d_varlen(self, mixed_qkv, slots, meta):
        return phase1_conv1d_varlen(self.params(), self.dims, mixed_qkv, slots, meta)

    def phase1_l2_batched(self, conv_out):
        return phase1_l2_batched(self.dims, conv_out)

    def gdn_full(self, q, k, v, g, beta, slots, slot, has_initial_state):
        return gdn_full(q, k, v, g, beta, slots, slot, has_initial_state, backend=self.backend,
                        chunk_size=self.chunk_size)

    def gdn_full_batched(self, q, k, v, g, beta, slots, slot_ids, has_initial_state):
        return gdn_full_batched(q, k, v, g, beta, slots, slot_ids, has_initial_state, backend=self.backend,
                                chunk_size=self.chunk_size)

    def gdn_full_varlen(self, q, k, v, g, beta, slots, meta):
        return gdn_full_varlen(q, k, v, g, beta, slots, meta, backend=self.backend, chunk_size=self.chunk_size)

    def phase3(self, o, z, residual, ffn: FFN = None):
        return phase3(self.params(), self.dims, o, z, residual, ffn=ffn)

    def mixer(self, x, slots, meta):
        return gdn_mixer(self.params(), self.dims, x, slots, meta, backend=self.backend, chunk_size=self.chunk_size)

    def mixer_decode(self, x, slots, slot_ids, has_initial_state=None):
        return gdn_mixer_decode(self.params(), self.dims, x, slots, slot_ids, has_initial_state,
                                backend=self.backend)

    def prefill(self, hidden, slots, meta, ffn: FFN = None):
        return gdn_layer_prefill(self.params(), self.dims, hidden, slots, meta, backend=self.backend, ffn=ffn,
                                 chunk_size=self.chunk_size)

    def decode(self, hidden, slots, slot_ids, has_initial_state=None, ffn: FFN = None):
        return gdn_layer_decode(self.params(), self.dims, hidden, slots, slot_ids, has_initial_state, ffn=ffn)

    def __call__(self, hidden, slots, slot, has_initial_state=False, ffn: FFN = None):
        return gdn_layer_monolithic(self.params(), self.dims, hidden, slots, slot, has_initial_state,
                                    backend=self.backend, ffn=ffn, chunk_size=self.chunk_size)

    def init_slots(self, num_slots: int, dtype=None) -> GdnSlots:
        """Zero slot pools for ``num_slots`` streams; conv_state in ``dtype`` (default: the weights' dtype)."""
        return GdnSlots.zeros(self.dims, num_slots, dtype or self.out_proj[...].dtype)
