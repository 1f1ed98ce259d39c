"""The GDN layer's fused decode step (``gdn_layer_decode(step="fused")``: in_proj, the conv1d decode kernel, the decode
kernel with gates made inside, phase 3) against the unfused step (XLA phase 1 + XLA recurrent step), both
projection layouts, GVA ratios 2 and 3, odd slot patterns: permuted ids, padding streams (slot id == S), a fresh
stream over a NaN-stale slot, NaN-poisoned untouched slots, under jit, in Pallas interpret mode on CPU.

Tolerances (relative RMS against the unfused fp32 step): fp32 1e-5 (the same math in another order); bf16 2e-2 on
the output (the fused conv normalises the fp32 conv output, the unfused one its bf16 rounding: one bf16 rounding
of q / k, ~4e-3, amplified by the recurrent step and out_proj) and 1e-2 on the states.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.config import GdnDims
from jax_gdn.layers import gdn
from jax_gdn.options import RuntimeOptions
from jax_gdn.state import GdnSlots
from tests.numpy_reference import rel_rms

DIMS = {
    "next_r2": GdnDims(32, 2, 4, 16, 16, layout="qwen3_next"),
    "q35_r3": GdnDims(32, 1, 3, 16, 16, layout="qwen3_5"),
}


@functools.partial(jax.jit, static_argnames=("dims", "backend", "step"))
def _decode(params, dims, hidden, slots, slot_ids, has, backend, step):
    return gdn.gdn_layer_decode(params, dims, hidden, slots, slot_ids, has, backend=backend, step=step)


def _slots(dims, num_slots, live, dtype, seed=3):
    rng = np.random.default_rng(seed)
    conv = np.full((num_slots, dims.conv_dim, dims.conv_kernel_size - 1), np.nan, np.float32)
    ssm = np.full((num_slots, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim), np.nan, np.float32)
    for s in live:
        conv[s] = rng.standard_normal(conv.shape[1:])
        ssm[s] = rng.standard_normal(ssm.shape[1:]) * 0.3
    return GdnSlots(conv_state=jnp.asarray(conv, dtype), ssm_state=jnp.asarray(ssm))


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(DIMS))
def test_fused_decode_step_matches_unfused(name, dtype):
    dims = DIMS[name]
    s = 7
    params = gdn.init_params(dims, jax.random.PRNGKey(0), dtype, randomize_norms=True)
    params = dict(params, A_log=params["A_log"] + 0.5, dt_bias=params["dt_bias"] - 0.3)
    ids = jnp.asarray([4, s, 0, 6, s, 2], jnp.int32)     # permuted, two padding streams (id S)
    has = jnp.asarray([True, True, False, True, True, True])   # slot 0: stale NaN, read as zeros
    slots = _slots(dims, s, live=[2, 4, 6], dtype=dtype)
    slots = slots.replace(conv_state=slots.conv_state.at[0].set(jnp.nan))
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((6, dims.hidden_size)), dtype)
    ref_out, ref_slots = _decode(params, dims, hidden, slots, ids, has, "xla", "unfused")
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    if dtype == jnp.bfloat16:                             # the reference: the unfused step in fp32
        p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        s32 = GdnSlots(conv_state=slots.conv_state.astype(jnp.float32), ssm_state=slots.ssm_state)
        ref_out, ref_slots = _decode(p32, dims, hidden.astype(jnp.float32), s32, ids, has, "xla", "unfused")
    out, new = _decode(params, dims, hidden, slots, ids, has, "pallas_interpret", "fused")
    tol_o, tol_s = (1e-5, 1e-5) if dtype == jnp.float32 else (2e-2, 1e-2)
    real = [0, 2, 3, 5]                                   # the streams that name a slot
    written = [4, 0, 6, 2]
    assert np.isfinite(f32(out)).all()
    assert rel_rms(f32(out)[real], f32(ref_out)[real]) < tol_o
    assert rel_rms(f32(out)[[1, 4]], f32(ref_out)[[1, 4]]) < tol_o     # padding streams: from zero states
    assert rel_rms(f32(new.ssm_state)[written], f32(ref_slots.ssm_state)[written]) < tol_s
    assert rel_rms(f32(new.conv_state)[written], f32(ref_slots.conv_state)[written]) < tol_s
    for untouched in (1, 3, 5):                           # NaN slots no stream names (S did not clamp onto 6)
        assert np.isnan(f32(new.ssm_state)[untouched]).all() and np.isnan(f32(new.conv_state)[untouched]).all()


def test_decode_step_switch():
    dims = DIMS["next_r2"]
    assert RuntimeOptions().gdn_decode_step in gdn.DECODE_STEPS
    assert gdn.decode_step_backend("xla", dims, jnp.float32) is None
    assert gdn.decode_step_backend("pallas_interpret", dims, jnp.float32) == "pallas_interpret"
    assert gdn.decode_step_backend("pallas_interpret", GdnDims(32, 1, 3, 16, 8, layout="qwen3_5"),
                                   jnp.float32) is None                                                  # K != V
    assert gdn.decode_step_backend("pallas_interpret", GdnDims(32, 1, 3, 24, 24, layout="qwen3_5"),
                                   jnp.float32) is None                                    # K = 24 would be padded
    params = gdn.init_params(dims, jax.random.PRNGKey(0))
    slots = GdnSlots.zeros(dims, 2)
    with pytest.raises(ValueError, match="step must be one of"):
        gdn.gdn_layer_decode(params, dims, jnp.zeros((1, dims.hidden_size)), slots, jnp.zeros((1,), jnp.int32),
                             step="fast")


@pytest.mark.gpu
def test_gpu_fused_decode_step_80b_dims():
    """On the GPU at Qwen3-Next-80B GDN dims (Hk 16, Hv 32, K = V = 128, D 2048), 48 streams with padding ids: the
    fused step (compiled Triton kernels) against the unfused step with the XLA backend, fp32 (1e-5 on the output and
    the states) and bf16 (2e-2 / 1e-2 against the fp32 unfused step)."""
    from benchmarks import configs as bench_model
    dims = bench_model.qwen3_next_80b_config(4).gdn_dims
    n, s = 48, 56
    rng = np.random.default_rng(11)
    ids = rng.permutation(s)[:n].astype(np.int32)
    ids[[2, 40]] = s
    has = np.arange(n) % 7 != 3
    live = ids[ids < s]
    for dtype, tol_o, tol_s in ((jnp.float32, 1e-5, 1e-5), (jnp.bfloat16, 2e-2, 1e-2)):
        params = gdn.init_params(dims, jax.random.PRNGKey(1), dtype, randomize_norms=True)
        slots = _slots(dims, s, live=[int(i) for i in live], dtype=dtype)
        hidden = jnp.asarray(rng.standard_normal((n, dims.hidden_size)), dtype)
        p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        s32 = GdnSlots(conv_state=slots.conv_state.astype(jnp.float32), ssm_state=slots.ssm_state)
        ref_o, ref_s = _decode(p32, dims, hidden.astype(jnp.float32), s32, jnp.asarray(ids), jnp.asarray(has), "xla",
                               "unfused")
        o, new = _decode(params, dims, hidden, slots, jnp.asarray(ids), jnp.asarray(has), "pallas", "fused")
        f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
        real = np.nonzero(ids < s)[0]
        eo = rel_rms(f32(o)[real], f32(ref_o)[real])
        es = rel_rms(f32(new.ssm_state)[live], f32(ref_s.ssm_state)[live])
        ec = rel_rms(f32(new.conv_state)[live], f32(ref_s.conv_state)[live])
        print(f"FIGURE fused decode step {jnp.dtype(dtype).name} o {eo:.2e} ssm {es:.2e} conv {ec:.2e}")
        assert eo < tol_o and es < tol_s and ec < tol_s
        untouched = np.setdiff1d(np.arange(s), ids)
        assert np.isnan(f32(new.ssm_state)[untouched]).all()
