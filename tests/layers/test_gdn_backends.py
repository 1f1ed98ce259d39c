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
def test_layer_pallas_gpu_matches_xla(dtype, tol):
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
    # the "auto" backend picks the kernel on the GPU and gives the same
    out_a, _ = prefill_jit(params, dims, h, slots, meta, backend="auto")
    assert rel_rms(f32(out_a), f32(out_p)) < 1e-6
    # slot 4, 6, 8 (unused) untouched
    np.testing.assert_array_equal(s_p.ssm_state[np.array([4, 6, 8])], slots.ssm_state[np.array([4, 6, 8])])


def test_op_backend_prefill_kernel(monkeypatch):
    """The slot op's backend from the layer's: a resolved "pallas" whose kernel takes the inputs becomes the op's
    "auto" (its per-call Mosaic / Triton / recurrent pick) while PREFILL_KERNEL is "auto", stays "pallas" when it
    is "pallas"; "xla" / "pallas_interpret" pass through; a bad switch value is named."""
    q = jnp.zeros((5, 2, 16), jnp.bfloat16)
    v = jnp.zeros((5, 4, 16), jnp.bfloat16)
    assert gdn._op_backend("xla", q, q, v) == "xla"
    assert gdn._op_backend("pallas_interpret", q, q, v) == "pallas_interpret"
    monkeypatch.setattr(gdn, "_layer_backend", lambda backend, *a: "pallas")
    monkeypatch.setattr(gdn, "_pallas_support", lambda *a: (True, ""))
    assert gdn._op_backend("pallas", q, q, v) == "auto"
    monkeypatch.setattr(gdn, "PREFILL_KERNEL", "pallas")
    assert gdn._op_backend("pallas", q, q, v) == "pallas"
    monkeypatch.setattr(gdn, "PREFILL_KERNEL", "auto")
    monkeypatch.setattr(gdn, "_pallas_support", lambda *a: (False, "head dims"))
    assert gdn._op_backend("pallas", q, q, v) == "pallas"      # the explicit name's own refusal stays the op's
    monkeypatch.setattr(gdn, "PREFILL_KERNEL", "mosaic")
    with pytest.raises(ValueError, match="PREFILL_KERNEL"):
        gdn._op_backend("pallas", q, q, v)


def _custom_calls(hlo_text: str) -> set:
    """The custom-call targets of a lowered program's text (``mosaic_gpu_v2`` for a Mosaic GPU kernel)."""
    import re
    return set(re.findall(r"custom_call @([\w.$-]+)", hlo_text))


def _fresh_prefill():
    """A jit of its own function object: jit's trace cache is keyed on the function, and PREFILL_KERNEL is read
    while tracing, so a jit of gdn.gdn_layer_prefill itself would replay the first route's trace."""
    def prefill(params, dims, hidden, slots, meta, backend):
        return gdn.gdn_layer_prefill(params, dims, hidden, slots, meta, backend=backend)
    return jax.jit(prefill, static_argnames=("dims", "backend"))


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "80b"])
def test_layer_prefill_kernel_gpu_matches_xla(monkeypatch, size):
    """The layer's packed bf16 prefill through each PREFILL_KERNEL route against the XLA backend: "pallas" (Pallas
    Triton) and "auto" (on a Hopper GPU the Mosaic GPU varlen kernels, seen in the compiled program). "80b": the
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
        monkeypatch.setattr(gdn, "PREFILL_KERNEL", kernel)
        run = _fresh_prefill()
        out_p, s_p = run(params, dims, h, slots, meta, backend="pallas")
        err[kernel] = (rel_rms(f32(out_p) - f32(h), f32(out_x) - f32(h)), rel_rms(s_p.ssm_state[used],
                                                                                  s_x.ssm_state[used]))
        untouched[kernel] = bool(np.array_equal(np.asarray(s_p.ssm_state[unused]), np.asarray(
            slots.ssm_state[unused]), equal_nan=True))
        targets = _custom_calls(run.lower(params, dims, h, slots, meta, backend="pallas").as_text())
        mosaic[kernel] = sorted(t for t in targets if t.startswith("mosaic_gpu"))
    hopper = str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
    print(f"FIGURE layer prefill {size} (o, ssm) rel RMS against XLA: {err}; Mosaic custom calls: {mosaic}; "
          f"unused slots untouched: {untouched}")
    for kernel in ("pallas", "auto"):
        assert max(err[kernel]) < 1e-2, (kernel, err[kernel])
        assert untouched[kernel], kernel
        assert bool(mosaic[kernel]) == (kernel == "auto" and hopper), (kernel, mosaic[kernel])
    assert err["auto"][0] <= 1.5 * err["pallas"][0] + 1e-4
