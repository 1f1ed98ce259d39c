"""The GDN layer's split-prefill protocol: split phases == monolithic, varlen == each stream alone, batched ==
per stream, two chunks == one shot, decode == one more prefill token, float64 reference of the core, slot
hygiene (permuted, stale, NaN-poisoned), bad input, the NNX module. Every public function runs under jax.jit."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.config import GdnDims
from jax_gdn.layers import gdn
from jax_gdn.state import BatchMeta, GdnSlots
from tests.numpy_reference import gated_delta_rule_f64, rel_rms

TOL32 = 2e-4   # fp32 relative RMS
TOL16 = 1e-2   # bf16 relative RMS
LENGTHS = [1, 63, 64, 65, 130]

# GVA ratios 1, 2, 3; K != V; both projection layouts
DIMS = {
    "next_r1": GdnDims(24, 2, 2, 8, 16, layout="qwen3_next"),
    "q35_r2": GdnDims(24, 1, 2, 16, 8, layout="qwen3_5"),
    "next_r3": GdnDims(24, 2, 6, 8, 12, layout="qwen3_next"),
}



def jit(fn):
    """jax.jit with the static arguments this function has (dims, backend, ffn, chunk_size)."""
    import inspect
    names = set(inspect.signature(fn).parameters) & {"dims", "backend", "ffn", "chunk_size"}
    return jax.jit(fn, static_argnames=tuple(sorted(names)))


proj_jit = jit(gdn.phase1_proj_batched)
conv_one_jit = jit(gdn.phase1_conv1d_one)
conv_varlen_jit = jit(gdn.phase1_conv1d_varlen)
l2_jit = jit(gdn.phase1_l2_batched)
full_jit = jit(gdn.gdn_full)
full_batched_jit = jit(gdn.gdn_full_batched)
phase3_jit = jit(gdn.phase3)
prefill_jit = jit(gdn.gdn_layer_prefill)
decode_jit = jit(gdn.gdn_layer_decode)
mono_jit = jit(gdn.gdn_layer_monolithic)


@functools.partial(jax.jit, static_argnames=("backend",))
def full_varlen_jit(q, k, v, g, beta, slots, meta, backend="xla"):
    o, slots, ok = gdn.gdn_full_varlen(q, k, v, g, beta, slots, meta, backend=backend)
    assert ok  # static
    return o, slots


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    """fp32 matmuls at full precision (GPUs default to TF32, ~1e-3 relative): the tolerances here are fp32's."""
    with jax.default_matmul_precision("highest"):
        yield


def _params(dims, seed=0):
    return gdn.init_params(dims, jax.random.PRNGKey(seed), randomize_norms=True)


def _hidden(t, dims, seed=1, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((t, dims.hidden_size)), dtype)


def _poisoned_slots(dims, num_slots, live, seed=2, dtype=jnp.float32):
    """NaN everywhere except the slots in ``live``, which hold random states."""
    rng = np.random.default_rng(seed)
    conv = np.full((num_slots, dims.conv_dim, dims.conv_kernel_size - 1), np.nan, np.float32)
    ssm = np.full((num_slots, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim), np.nan, np.float32)
    for s in live:
        conv[s] = rng.standard_normal(conv.shape[1:])
        ssm[s] = rng.standard_normal(ssm.shape[1:]) * 0.3
    return GdnSlots(conv_state=jnp.asarray(conv, dtype), ssm_state=jnp.asarray(ssm))


def _packed_case(dims, lengths, num_slots=8):
    """Permuted slots; every other stream continues a stale-free state, the others start fresh over NaN slots."""
    n = len(lengths)
    slot_ids = np.random.default_rng(5).permutation(num_slots)[:n].astype(np.int32)
    has_init = np.array([i % 2 == 1 for i in range(n)])
    meta = BatchMeta(cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32),
                     slot_ids=jnp.asarray(slot_ids), has_initial_state=jnp.asarray(has_init),
                     positions=jnp.asarray(np.where(has_init, 7, 0), jnp.int32))
    slots = _poisoned_slots(dims, num_slots, live=slot_ids[has_init])
    return meta, slots, slot_ids, has_init


@pytest.mark.parametrize("name,lengths", [("next_r3", LENGTHS), ("next_r1", [64, 1, 130]),
                                          ("q35_r2", [65, 1, 63])])
def test_split_phases_equal_monolithic_and_f64(name, lengths):
    """Packed lengths (1, 63, 64, 65, 130) through the split phases (each jitted) == the monolithic layer run per
    stream; the core against the float64 loop; unused NaN slots untouched, used slots recomputed."""
    dims = DIMS[name]
    params = _params(dims)
    meta, slots, slot_ids, has_init = _packed_case(dims, lengths)
    cu = np.asarray(meta.cu_seqlens)
    hidden = _hidden(int(cu[-1]), dims)

    # ---- split protocol, phase by phase ----
    p1 = proj_jit(params, dims, hidden)
    conv_out, s1 = conv_varlen_jit(params, dims, p1.mixed_qkv, slots, meta)
    q, k, v = l2_jit(dims, conv_out)
    o, s2 = full_varlen_jit(q, k, v, p1.g, p1.beta, s1, meta)
    out = phase3_jit(params, dims, o, p1.z, hidden)

    # ---- core against float64, from the slots' initial states ----
    init = np.where(has_init[:, None, None, None], np.asarray(slots.ssm_state)[slot_ids], 0.0)
    o_ref, final_ref = gated_delta_rule_f64(q[None], k[None], v[None], p1.g[None], p1.beta[None],
                                            initial_state=init, cu_seqlens=cu)
    assert rel_rms(o, o_ref[0]) < TOL32
    assert rel_rms(np.asarray(s2.ssm_state)[slot_ids], final_ref) < TOL32

    # ---- monolithic, one stream at a time, from the same pool ----
    mono_slots = slots
    for i in range(len(lengths)):
        a, b = int(cu[i]), int(cu[i + 1])
        out_i, mono_slots = mono_jit(params, dims, hidden[a:b], mono_slots, jnp.int32(slot_ids[i]),
                                     jnp.bool_(has_init[i]), backend="xla")
        assert rel_rms(out[a:b], out_i) < TOL32, (i, lengths[i])
    used = np.asarray(slot_ids)
    assert rel_rms(np.asarray(s2.ssm_state)[used], np.asarray(mono_slots.ssm_state)[used]) < TOL32
    assert rel_rms(np.asarray(s2.conv_state)[used], np.asarray(mono_slots.conv_state)[used]) < 1e-6

    # ---- slot hygiene ----
    unused = np.setdiff1d(np.arange(slots.num_slots), used)
    assert np.isnan(np.asarray(s2.ssm_state)[unused]).all() and np.isnan(np.asarray(s2.conv_state)[unused]).all()
    assert np.isfinite(np.asarray(s2.ssm_state)[used]).all() and np.isfinite(np.asarray(s2.conv_state)[used]).all()
    assert np.isfinite(np.asarray(out)).all()

    # ---- the pure prefill (one jit) gives the same ----
    out_p, s_p = prefill_jit(params, dims, hidden, slots, meta, backend="xla")
    np.testing.assert_allclose(out_p, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s_p.ssm_state[used], s2.ssm_state[used], rtol=1e-5, atol=1e-6)


def test_conv_one_chain_equals_varlen():
    dims = DIMS["next_r3"]
    params = _params(dims)
    lengths = [2, 65, 1]
    meta, slots, slot_ids, has_init = _packed_case(dims, lengths)
    cu = np.asarray(meta.cu_seqlens)
    x = proj_jit(params, dims, _hidden(int(cu[-1]), dims)).mixed_qkv
    y_all, s_all = conv_varlen_jit(params, dims, x, slots, meta)
    s = slots
    for i in range(len(lengths)):
        y, s = conv_one_jit(params, dims, x[cu[i]:cu[i + 1]], s, jnp.int32(slot_ids[i]), jnp.bool_(has_init[i]))
        np.testing.assert_allclose(y, y_all[cu[i]:cu[i + 1]], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(s.conv_state[slot_ids], s_all.conv_state[slot_ids])


def test_batched_equal_lengths_equals_per_stream():
    dims = DIMS["next_r3"]
    params = _params(dims)
    n, ln = 3, 65
    meta, slots, slot_ids, has_init = _packed_case(dims, [ln] * n)
    p1 = proj_jit(params, dims, _hidden(n * ln, dims, seed=3))
    conv_out, slots = conv_varlen_jit(params, dims, p1.mixed_qkv, slots, meta)
    q, k, v = l2_jit(dims, conv_out)
    o_b, s_b = full_batched_jit(q, k, v, p1.g, p1.beta, slots, jnp.asarray(slot_ids), jnp.asarray(has_init),
                                backend="xla")
    s = slots
    for i in range(n):
        sl = slice(i * ln, (i + 1) * ln)
        o_i, s = full_jit(q[sl], k[sl], v[sl], p1.g[sl], p1.beta[sl], s, jnp.int32(slot_ids[i]),
                          jnp.bool_(has_init[i]), backend="xla")
        assert rel_rms(o_b[sl], o_i) < 1e-5
    assert rel_rms(s_b.ssm_state[slot_ids], s.ssm_state[slot_ids]) < 1e-5


@pytest.mark.parametrize("cut", [1, 64, 100])
def test_two_chunks_with_state_equal_one_shot(cut):
    """A stream prefilled in two calls (state carried through its slot) == one call; the stream shares its
    batches with another stream in another slot."""
    dims = DIMS["q35_r2"]
    params = _params(dims)
    total = 130
    hidden = _hidden(total, dims, seed=4)
    other = _hidden(5, dims, seed=6)
    slots0 = _poisoned_slots(dims, 4, live=[])
    one, s_one = prefill_jit(params, dims, hidden, slots0, BatchMeta.from_lengths([total], slot_ids=[3]),
                             backend="xla")
    h1 = jnp.concatenate([other, hidden[:cut]])
    out1, s = prefill_jit(params, dims, h1, slots0, BatchMeta.from_lengths([5, cut], slot_ids=[0, 3]),
                          backend="xla")
    meta2 = BatchMeta.from_lengths([total - cut], slot_ids=[3], positions=[cut])
    out2, s = prefill_jit(params, dims, hidden[cut:], s, meta2, backend="xla")
    assert rel_rms(jnp.concatenate([out1[5:], out2]), one) < TOL32
    assert rel_rms(s.ssm_state[3], s_one.ssm_state[3]) < TOL32
    # conv state = projection outputs of the last Kc-1 tokens, from matmuls of 130 vs 105 rows (fp32 blocking
    # differs by ~1e-7 absolute)
    np.testing.assert_allclose(s.conv_state[3], s_one.conv_state[3], rtol=1e-5, atol=1e-6)


def test_decode_after_prefill_equals_prefill_of_one_more_token():
    dims = DIMS["next_r3"]
    params = _params(dims)
    lengths = [63, 1, 64]
    slot_ids = [5, 0, 2]
    full = [_hidden(n + 1, dims, seed=10 + i) for i, n in enumerate(lengths)]
    slots0 = _poisoned_slots(dims, 6, live=[])
    packed = jnp.concatenate([h[:-1] for h in full])
    _, s = prefill_jit(params, dims, packed, slots0, BatchMeta.from_lengths(lengths, slot_ids=slot_ids),
                       backend="xla")
    last = jnp.stack([h[-1] for h in full])
    out_d, s_d = decode_jit(params, dims, last, s, jnp.asarray(slot_ids, jnp.int32))
    ref, s_ref = prefill_jit(params, dims, jnp.concatenate(full), slots0,
                             BatchMeta.from_lengths([n + 1 for n in lengths], slot_ids=slot_ids), backend="xla")
    ends = np.cumsum([n + 1 for n in lengths]) - 1
    assert rel_rms(out_d, ref[ends]) < TOL32
    assert rel_rms(s_d.ssm_state[np.array(slot_ids)], s_ref.ssm_state[np.array(slot_ids)]) < TOL32
    np.testing.assert_allclose(s_d.conv_state[np.array(slot_ids)], s_ref.conv_state[np.array(slot_ids)],
                               rtol=1e-5, atol=1e-6)   # projections of 1 vs 131 rows: fp32 blocking ~1e-7
    assert np.isnan(np.asarray(s_d.ssm_state)[[1, 3, 4]]).all()


def test_conv_kernel_size_1_prefill_and_decode():
    """conv_kernel_size = 1: the conv state is 0 wide; the packed prefill (lengths 1, 3, 5) == the monolithic layer
    per stream, and a decode step == the prefill of one more token."""
    dims = GdnDims(16, 1, 2, 8, 8, conv_kernel_size=1, layout="qwen3_next")
    params = _params(dims)
    lengths, slot_ids = [1, 3, 5], [2, 0, 3]
    slots0 = GdnSlots.zeros(dims, 4)
    assert slots0.conv_state.shape == (4, dims.conv_dim, 0)
    full = [_hidden(n + 1, dims, seed=20 + i) for i, n in enumerate(lengths)]
    packed = jnp.concatenate([h[:-1] for h in full])
    out, s = prefill_jit(params, dims, packed, slots0, BatchMeta.from_lengths(lengths, slot_ids=slot_ids),
                         backend="xla")
    assert s.conv_state.shape == (4, dims.conv_dim, 0) and np.isfinite(np.asarray(out)).all()
    cu = np.concatenate([[0], np.cumsum(lengths)])
    mono_slots = slots0
    for i in range(len(lengths)):
        out_i, mono_slots = mono_jit(params, dims, packed[cu[i]:cu[i + 1]], mono_slots, jnp.int32(slot_ids[i]),
                                     jnp.bool_(False), backend="xla")
        assert rel_rms(out[cu[i]:cu[i + 1]], out_i) < TOL32, i
    out_d, s_d = decode_jit(params, dims, jnp.stack([h[-1] for h in full]), s, jnp.asarray(slot_ids, jnp.int32))
    ref, s_ref = prefill_jit(params, dims, jnp.concatenate(full), slots0,
                             BatchMeta.from_lengths([n + 1 for n in lengths], slot_ids=slot_ids), backend="xla")
    assert rel_rms(out_d, ref[np.cumsum([n + 1 for n in lengths]) - 1]) < TOL32
    assert rel_rms(s_d.ssm_state[np.array(slot_ids)], s_ref.ssm_state[np.array(slot_ids)]) < TOL32
    assert s_d.conv_state.shape == (4, dims.conv_dim, 0)


def test_phase3_ffn_and_bf16():
    dims = DIMS["q35_r2"]
    params = _params(dims)
    meta = BatchMeta.from_lengths([65, 7], slot_ids=[1, 0])
    h = _hidden(72, dims, seed=8)
    slots = GdnSlots.zeros(dims, 2)
    ffn = lambda x: 2.0 * x  # noqa: E731  any [T, D] -> [T, D] callable
    out, s32 = prefill_jit(params, dims, h, slots, meta, backend="xla")
    out_f, _ = prefill_jit(params, dims, h, slots, meta, backend="xla", ffn=ffn)
    np.testing.assert_allclose(out_f, 2 * out, rtol=1e-6)
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out16, s16 = prefill_jit(p16, dims, h.astype(jnp.bfloat16), GdnSlots.zeros(dims, 2, jnp.bfloat16), meta,
                             backend="xla")
    assert out16.dtype == jnp.bfloat16 and s16.ssm_state.dtype == jnp.float32
    assert rel_rms(np.asarray(out16, np.float32) - np.asarray(h), out - h) < 3 * TOL16
    assert rel_rms(s16.ssm_state, s32.ssm_state) < 3 * TOL16


def test_ineligible_varlen_falls_back_to_xla_varlen(monkeypatch):
    """When the Pallas kernel rejects the batch, gdn_full_varlen reports it (state untouched) and the prefill
    runs the XLA varlen path instead, eagerly and under jit (the old per-stream fallback could not trace)."""
    from pallas_kernels.gated_delta_rule import api

    def reject(q, k, v, *, interpret):
        raise ValueError("test: kernel rejects these dims")

    monkeypatch.setattr(api, "check_supported", reject)
    dims = DIMS["next_r1"]
    params = _params(dims)
    meta = BatchMeta.from_lengths([3, 0, 9], slot_ids=[2, 1, 0], positions=[0, 4, 0])
    slots = _poisoned_slots(dims, 3, live=[1])
    h = _hidden(12, dims)
    p1 = gdn.phase1_proj_batched(params, dims, h)
    q, k, v = gdn.phase1_l2_batched(dims, gdn.phase1_conv1d_varlen(params, dims, p1.mixed_qkv, slots, meta)[0])
    o, s_same, ok = gdn.gdn_full_varlen(q, k, v, p1.g, p1.beta, slots, meta, backend="pallas_interpret")
    assert not ok and o is None and s_same is slots
    assert not gdn.varlen_eligibility(q, k, v, "pallas_interpret")[0]
    assert gdn.varlen_eligibility(q, k, v, "xla")[0]
    out, s = gdn.gdn_layer_prefill(params, dims, h, slots, meta, backend="pallas_interpret")
    ref, s_ref = gdn.gdn_layer_prefill(params, dims, h, slots, meta, backend="xla")
    assert rel_rms(out, ref) < 1e-5
    assert rel_rms(s.ssm_state, s_ref.ssm_state) < 1e-5   # incl. the empty stream's kept state
    jitted = jax.jit(gdn.gdn_layer_prefill, static_argnames=("dims", "backend"))
    out_j, s_j = jitted(params, dims, h, slots, meta, backend="pallas_interpret")
    assert rel_rms(out_j, ref) < 1e-5 and rel_rms(s_j.ssm_state, s_ref.ssm_state) < 1e-5


def test_nnx_module_methods():
    from flax import nnx

    dims = DIMS["next_r1"]
    layer = gdn.GatedDeltaNet(dims, rngs=nnx.Rngs(0), backend="xla", randomize_norms=True)
    assert set(layer.params()) == set(gdn.param_shapes(dims))
    h = _hidden(9, dims)
    slots = layer.init_slots(2)
    meta = BatchMeta.from_lengths([9], slot_ids=[1])
    sid = jnp.asarray([1], jnp.int32)

    @nnx.jit
    def run(layer, h, slots, meta):
        out_p, s_p = layer.prefill(h, slots, meta)
        out_m, _ = layer(h, slots, 1, False)
        p1 = layer.phase1_proj_batched(h)
        y, s = layer.phase1_conv1d_one(p1.mixed_qkv, slots, 1, False)
        q, k, v = layer.phase1_l2_batched(y)
        o, s = layer.gdn_full(q, k, v, p1.g, p1.beta, s, 1, False)
        out_split = layer.phase3(o, p1.z, h)
        out_d, _ = layer.decode(h[:1], s_p, sid)
        return out_p, out_m, out_split, out_d, s_p

    out_p, out_m, out_split, out_d, s_p = run(layer, h, slots, meta)
    assert rel_rms(out_p, out_m) < TOL32
    assert rel_rms(out_split, out_p) < TOL32
    ref_d, _ = decode_jit(layer.params(), dims, h[:1], s_p, sid)
    np.testing.assert_allclose(out_d, ref_d, rtol=1e-6, atol=1e-6)
    # loading parameters by name
    new = gdn.init_params(dims, jax.random.PRNGKey(9))
    layer.in_proj_qkvz[...] = new["in_proj_qkvz"]
    assert np.array_equal(layer.params()["in_proj_qkvz"], new["in_proj_qkvz"])
    layer.load_params(new)
    assert all(np.array_equal(layer.params()[n], new[n]) for n in new)
    assert all(np.array_equal(gdn.GatedDeltaNet.from_params(dims, new).params()[n], new[n]) for n in new)
    with pytest.raises(ValueError, match="missing"):
        layer.load_params({n: x for n, x in new.items() if n != "A_log"})


def test_bad_input_raises_before_touching_state():
    dims = DIMS["next_r1"]
    params = _params(dims)
    slots = GdnSlots.zeros(dims, 3)
    h = _hidden(10, dims)
    meta = BatchMeta.from_lengths([4, 6], slot_ids=[0, 1])
    with pytest.raises(ValueError, match=r"hidden must have shape \[T, D\]"):
        gdn.gdn_layer_prefill(params, dims, h[:, :-1], slots, meta)
    with pytest.raises(ValueError, match=r"hidden must have shape \[T, D\]"):
        gdn.phase1_proj_batched(params, dims, h[None])
    with pytest.raises(ValueError, match="cu_seqlens must end at the token count"):
        gdn.gdn_layer_prefill(params, dims, h[:9], slots, meta)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, 3\)"):
        gdn.gdn_layer_prefill(params, dims, h, slots, BatchMeta.from_lengths([4, 6], slot_ids=[0, 3]))
    with pytest.raises(ValueError, match="slot_ids must not repeat"):
        gdn.gdn_layer_prefill(params, dims, h, slots, BatchMeta.from_lengths([4, 6], slot_ids=[1, 1]))
    with pytest.raises(ValueError, match="slot must lie in"):
        gdn.gdn_layer_monolithic(params, dims, h, slots, 5, False)
    with pytest.raises(ValueError, match="slots.conv_state must have shape"):
        gdn.gdn_layer_prefill(params, dims, h, GdnSlots(slots.conv_state[:, :-1], slots.ssm_state), meta)
    with pytest.raises(ValueError, match="in_proj_ba"):
        gdn.gdn_layer_prefill({**params, "in_proj_ba": params["in_proj_ba"][:-1]}, dims, h, slots, meta)
    with pytest.raises(ValueError, match=r"N >= 1 dividing T"):
        p1 = gdn.phase1_proj_batched(params, dims, h)
        q, k, v = gdn.phase1_l2_batched(dims, p1.mixed_qkv)
        gdn.gdn_full_batched(q, k, v, p1.g, p1.beta, slots, jnp.asarray([0, 1, 2]), jnp.ones(3, bool))


# ---- phase 1 fused (conv + SiLU + L2 in one op, pallas_kernels/conv1d) against the two-step protocol ----------
DIMS_KV = {   # the fused op needs K == V; both projection layouts, GVA ratio 2
    "next_kv": GdnDims(24, 2, 4, 16, 16, layout="qwen3_next"),
    "q35_kv": GdnDims(24, 2, 4, 16, 16, layout="qwen3_5"),
}


@functools.partial(jax.jit, static_argnames=("dims", "backend", "conv"))
def _phase1_varlen_jit(params, dims, hidden, slots, meta, backend, conv):
    p1, q, k, v, slots = gdn.phase1_varlen(params, dims, hidden, slots, meta, backend=backend, conv=conv)
    return q, k, v, p1.z, p1.g, p1.beta, slots


@pytest.mark.parametrize("name", sorted(DIMS_KV))
@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_phase1_fused_equals_two_step(name, backend):
    """fp32: q, k, v within 1e-5 abs (the fused op normalises the fp32 conv output, the two-step form the same
    values rounded to fp32 once more); padding tokens (past cu[N], NaN hidden rows) give zero rows; a padding stream
    with slot id S and a stream with id -1 touch no slot; NaN-poisoned slots of fresh streams are never read."""
    dims = DIMS_KV[name]
    params = _params(dims)
    meta, slots, slot_ids, has_init = _packed_case(dims, LENGTHS)
    n, s_count, total = len(LENGTHS), slots.conv_state.shape[0], sum(LENGTHS)
    extra_ids = np.array([s_count, -1], np.int32)                     # a padding stream and a "no slot" stream
    cu = np.concatenate([np.asarray(meta.cu_seqlens), [total, total + 3]]).astype(np.int32)
    meta = BatchMeta(cu_seqlens=jnp.asarray(cu), slot_ids=jnp.asarray(np.concatenate([slot_ids, extra_ids])),
                     has_initial_state=jnp.asarray(np.concatenate([has_init, [False, True]])),
                     positions=jnp.zeros((n + 2,), jnp.int32))
    t = total + 3 + 6
    hidden = np.array(_hidden(t, dims))
    hidden[total + 3:] = np.nan                                       # padding tokens
    hidden = jnp.asarray(hidden)
    two = _phase1_varlen_jit(params, dims, hidden, slots, meta, backend, "two_step")
    fused = _phase1_varlen_jit(params, dims, hidden, slots, meta, backend, "fused")
    tv = total + 3
    for a, b in zip(two[:3], fused[:3]):
        np.testing.assert_allclose(np.asarray(b[:tv]), np.asarray(a[:tv]), atol=1e-5, rtol=0)
        assert not np.any(np.asarray(b[tv:])), "padding tokens give zero rows"
    np.testing.assert_array_equal(np.asarray(fused[-1].conv_state), np.asarray(two[-1].conv_state))
    untouched = sorted(set(range(s_count)) - set(slot_ids.tolist()))
    assert np.isnan(np.asarray(fused[-1].conv_state)[untouched]).all(), "slots not named keep their contents"


def test_layer_prefill_fused_conv_equals_two_step():
    dims = DIMS_KV["next_kv"]
    params = _params(dims)
    meta, slots, _, _ = _packed_case(dims, [65, 1, 63])
    hidden = _hidden(129, dims)
    want, want_slots = prefill_jit(params, dims, hidden, slots, meta, backend="xla")
    got, got_slots = jax.jit(gdn.gdn_layer_prefill, static_argnames=("dims", "backend", "conv"))(
        params, dims, hidden, slots, meta, backend="xla", conv="fused")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_slots.ssm_state), np.asarray(want_slots.ssm_state), atol=2e-5,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="conv must be one of"):
        gdn.phase1_varlen(params, dims, hidden, slots, meta, conv="fast")
