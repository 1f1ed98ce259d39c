"""The GDN layer through the Pallas kernels: interpret mode on CPU (wiring: slots, varlen, has_initial_state),
and the GPU kernels (marker ``gpu``) against the XLA backend on packed batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.config import GdnDims
from jax_gdn.layers import gdn
from jax_gdn.state import BatchMeta, GdnSlots
from tests.numpy_reference import rel_rms

prefill_jit = jax.jit(gdn.gdn_layer_prefill, static_argnames=("dims", "backend"))


def _case(dims, lengths, slot_ids, positions, num_slots, seed=0, dtype=jnp.float32):
    params = jax.tree.map(lambda x: x.astype(dtype) if x.ndim == 2 else x,
                          gdn.init_params(dims, jax.random.PRNGKey(seed), randomize_norms=True))
    meta = BatchMeta.from_lengths(lengths, slot_ids=slot_ids, positions=positions)
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((num_slots, dims.conv_dim, dims.conv_kernel_size - 1)).astype(np.float32)
    ssm = 0.3 * rng.standard_normal((num_slots, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim))
    fresh = np.asarray(slot_ids)[np.asarray(positions) == 0]
    conv[fresh], ssm[fresh] = np.nan, np.nan                  # stale NaN in the slots of fresh streams
    slots = GdnSlots(conv_state=jnp.asarray(conv, dtype), ssm_state=jnp.asarray(ssm, jnp.float32))
    hidden = jnp.asarray(rng.standard_normal((sum(lengths), dims.hidden_size)), dtype)
    return params, meta, slots, hidden


def test_layer_pallas_interpret_matches_xla():
    dims = GdnDims(24, 2, 6, 16, 16)
    params, meta, slots, h = _case(dims, [1, 65, 30], [3, 0, 1], [0, 5, 0], 4)
    out_p, s_p = prefill_jit(params, dims, h, slots, meta, backend="pallas_interpret")
    out_x, s_x = prefill_jit(params, dims, h, slots, meta, backend="xla")
    assert rel_rms(out_p, out_x) < 2e-4
    assert rel_rms(s_p.ssm_state, s_x.ssm_state) < 2e-4
    np.testing.assert_array_equal(s_p.conv_state, s_x.conv_state)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 1e-2)])
def test_layer_pallas_gpu_matches_xla(dtype, tol, monkeypatch):
    dims = GdnDims(512, 4, 8, 128, 128)
    lengths = [1, 63, 64, 65, 130, 1000]
    slot_ids = [7, 2, 0, 5, 3, 1]
    positions = [0, 10, 0, 3, 0, 100]
    params, meta, slots, h = _case(dims, lengths, slot_ids, positions, 9, dtype=dtype)
    out_p, s_p = prefill_jit(params, dims, h, slots, meta, backend="pallas")
    out_x, s_x = prefill_jit(params, dims, h, slots, meta, backend="xla")
    used = np.asarray(slot_ids)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    assert rel_rms(f32(out_p) - f32(h), f32(out_x) - f32(h)) < tol
    assert rel_rms(s_p.ssm_state[used], s_x.ssm_state[used]) < tol
    # the GDN op under "auto" runs what the op's table picks for this very call (recorded as the op resolves it)
    # and gives what that backend gives when named explicitly; both runs take the same conv ("two_step"), as the
    # layer pairs each GDN backend name with its own conv kernel (CONV_BACKEND_OF_GDN)
    from pallas_kernels import dispatch
    picks = []
    real_resolve = dispatch.OpTable.resolve

    def spy(table, backend, case, **kw):
        impl = real_resolve(table, backend, case, **kw)
        if backend == "auto" and kw.get("warn", True) and getattr(case, "form", None) == "slots":
            picks.append(impl)
        return impl

    monkeypatch.setattr(dispatch.OpTable, "resolve", spy)
    out_a, _ = jax.jit(gdn.gdn_layer_prefill, static_argnames=("dims", "backend", "conv"))(
        params, dims, h, slots, meta, backend="auto", conv="two_step")
    monkeypatch.setattr(dispatch.OpTable, "resolve", real_resolve)
    assert len(picks) == 1, picks
    picked = picks[0].backends[0]
    out_n, _ = jax.jit(gdn.gdn_layer_prefill, static_argnames=("dims", "backend", "conv"))(
        params, dims, h, slots, meta, backend=picked, conv="two_step")
    assert rel_rms(f32(out_a), f32(out_n)) < 1e-6
    assert rel_rms(f32(out_a) - f32(h), f32(out_x) - f32(h)) < tol
    # slot 4, 6, 8 (unused) untouched
    np.testing.assert_array_equal(s_p.ssm_state[np.array([4, 6, 8])], slots.ssm_state[np.array([4, 6, 8])])


def test_layer_passes_the_backend_name_to_the_op(monkeypatch):
    """The layer hands the user's backend name to the slot op unchanged (the op's table makes the per-call pick:
    Mosaic / Triton / the per-token kernel for "auto", Triton for "pallas"); an unknown name is refused by name."""
    seen = []
    real = gdn.gdn_ops.chunk_gated_delta_rule_slots

    def spy(*args, backend, **kw):
        seen.append(backend)
        return real(*args, backend="xla", **kw)
    monkeypatch.setattr(gdn.gdn_ops, "chunk_gated_delta_rule_slots", spy)
    dims = GdnDims(24, 2, 6, 16, 16)
    params, meta, slots, h = _case(dims, [3, 5], [1, 0], [0, 0], 2)
    q = jnp.zeros((8, 2, 16))
    v = jnp.zeros((8, 6, 16))
    g = jnp.zeros((8, 6))
    for name in ("xla", "pallas_interpret", "auto"):
        gdn.gdn_full_varlen(q, q, v, g, g, slots, meta, backend=name)
    assert seen == ["xla", "pallas_interpret", "auto"]
    with pytest.raises(ValueError, match="backend must be one of"):
        gdn.gdn_full_varlen(q, q, v, g, g, slots, meta, backend="mosaic")


def _custom_calls(hlo_text: str) -> set:
    """The custom-call targets of a lowered program's text (``mosaic_gpu_v2`` for a Mosaic GPU kernel)."""
    import re
    return set(re.findall(r"custom_call @([\w.$-]+)", hlo_text))


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "80b"])
def test_layer_prefill_kernel_gpu_matches_xla(size):
    """The layer's packed bf16 prefill through each backend against the XLA backend: "pallas" (Pallas Triton) and
    "auto" (on a Hopper GPU the Mosaic GPU varlen kernels, seen in the compiled program). "80b": the
    Qwen3-Next-80B GDN dims on the varlen16 lengths (19027 tokens, fresh streams over stale NaN slots). Each route
    within 1e-2 of XLA, and "auto" within 1.5x of Triton's own error (bf16 rounding of the kernels' inputs bounds
    both)."""
    from benchmarks.cases import VARLEN16_LENS
    if size == "small":
        dims = GdnDims(512, 4, 8, 128, 128)
        lengths, slot_ids, positions = [1, 63, 64, 65, 130, 1000], [7, 2, 0, 5, 3, 1], [0, 10, 0, 3, 0, 100]
    else:
        dims = GdnDims(2048, 16, 32, 128, 128)
        lengths = list(VARLEN16_LENS)
        slot_ids = list(range(15, -1, -1))
        positions = [0] * 12 + [7, 0, 300, 0]
    num_slots = max(slot_ids) + 3
    params, meta, slots, h = _case(dims, lengths, slot_ids, positions, num_slots, dtype=jnp.bfloat16)
    out_x, s_x = prefill_jit(params, dims, h, slots, meta, backend="xla")
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    used = np.asarray(slot_ids)
    unused = np.setdiff1d(np.arange(num_slots), used)
    err, mosaic, untouched = {}, {}, {}
    for kernel in ("pallas", "auto"):            # everything measured first, asserted after (one GPU run says all)
        run = prefill_jit
        out_p, s_p = run(params, dims, h, slots, meta, backend=kernel)
        err[kernel] = (rel_rms(f32(out_p) - f32(h), f32(out_x) - f32(h)), rel_rms(s_p.ssm_state[used],
                                                                                  s_x.ssm_state[used]))
        untouched[kernel] = bool(np.array_equal(np.asarray(s_p.ssm_state[unused]), np.asarray(
            slots.ssm_state[unused]), equal_nan=True))
        targets = _custom_calls(run.lower(params, dims, h, slots, meta, backend=kernel).as_text())
        mosaic[kernel] = sorted(t for t in targets if t.startswith("mosaic_gpu"))
    hopper = str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
    print(f"FIGURE layer prefill {size} (o, ssm) rel RMS against XLA: {err}; Mosaic custom calls: {mosaic}; "
          f"unused slots untouched: {untouched}")
    for kernel in ("pallas", "auto"):
        assert max(err[kernel]) < 1e-2, (kernel, err[kernel])
        assert untouched[kernel], kernel
        assert bool(mosaic[kernel]) == (kernel == "auto" and hopper), (kernel, mosaic[kernel])
    assert err["auto"][0] <= 1.5 * err["pallas"][0] + 1e-4
