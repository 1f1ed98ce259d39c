"""jax_gdn.train: packed next-token targets, the loss, and optimiser steps through the kernels.

A tiny hybrid (1 GDN + 1 attention layer, MoE in the attention block, dense MLP in the GDN block) on packed
documents of 1, 63, 65 and 20 tokens with padding after them. The kernel run (backend "pallas_interpret": the
Pallas GDN, conv, paged-attention and MoE kernels in interpret mode, their VJPs the XLA forms') takes the same
optimiser steps as backend "xla": losses within 1e-5 relative, parameters after 3 SGD steps within 1e-4 relative
RMS per leaf (fp32 model)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_gdn.config import preset
from jax_gdn.model import HybridModel
from jax_gdn.train import Trainer, next_token_targets, pack_documents
from tests.numpy_reference import rel_rms

T, N = 160, 6


def _config():
    return preset("tiny", num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                  mlp_only_layers=(0,), vocab_size=96, hidden_size=64)


def _docs(seed=0, vocab=96):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in (1, 63, 65, 20)]


def test_pack_documents_and_targets_stay_inside_each_document():
    docs = [[5, 6, 7], [8], [], [9, 10]]
    tokens, cu = pack_documents(docs, max_tokens=8, max_docs=5)
    np.testing.assert_array_equal(tokens, [5, 6, 7, 8, 0, 0, 0, 0])   # packing stops at the empty document
    np.testing.assert_array_equal(cu, [0, 3, 4, 4, 4, 4])
    tokens, cu = pack_documents([[5, 6, 7], [8], [9, 10]], max_tokens=8, max_docs=4)
    np.testing.assert_array_equal(cu, [0, 3, 4, 6, 6])
    targets, mask = next_token_targets(jnp.asarray(tokens), jnp.asarray(cu))
    np.testing.assert_array_equal(mask, [1, 1, 0, 0, 1, 0, 0, 0])      # no target across a boundary or padding
    np.testing.assert_array_equal(np.asarray(targets)[np.asarray(mask) > 0], [6, 7, 10])
    tokens, cu = pack_documents([list(range(1, 12))], max_tokens=8, max_docs=2)   # a long first one is cut
    np.testing.assert_array_equal(cu, [0, 8, 8])
    with pytest.raises(ValueError, match="docs is empty"):
        pack_documents([], max_tokens=8, max_docs=2)


def _train(backend, optimizer, steps):
    model = HybridModel.random(_config(), 0, dtype=jnp.float32, backend=backend)
    trainer = Trainer(model, optimizer, max_tokens=T, max_docs=N)
    state = trainer.init()
    tokens, cu = pack_documents(_docs(), max_tokens=T, max_docs=N)
    losses = []
    for _ in range(steps):
        state, metrics = trainer.step(state, tokens, cu)
        losses.append(float(metrics["loss"]))
        assert float(metrics["tokens"]) == 0 + 62 + 64 + 19     # documents of 1, 63, 65, 20: n - 1 targets each
        assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    return model, state, losses


def test_kernel_steps_match_xla_steps_and_the_loss_falls():
    _, st_x, loss_x = _train("xla", optax.sgd(0.5), 3)
    model_k, st_k, loss_k = _train("pallas_interpret", optax.sgd(0.5), 3)
    kernels = model_k.kernels
    assert kernels["gated_delta_rule"]["slots"].startswith("triton") and kernels["moe"]["experts"] != "xla"
    assert kernels["paged_attention"]["prefill"] != "xla"
    np.testing.assert_allclose(loss_k, loss_x, rtol=1e-5)
    assert loss_x[-1] < loss_x[0] - 0.1, loss_x
    errs = jax.tree.map(lambda a, b: rel_rms(np.asarray(b), np.asarray(a)), st_x.params, st_k.params)
    worst = max(jax.tree.leaves(errs))
    assert worst < 1e-4, worst
    # every parameter moved (each one has a gradient)
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), st_k.params,
                         jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), model_k.params))
    assert all(jax.tree.leaves(moved)), [k for k, v in jax.tree_util.tree_leaves_with_path(moved) if not v]


def test_trainer_checks_its_arguments_by_name():
    model = HybridModel.random(_config(), 0, dtype=jnp.float32, backend="xla")
    with pytest.raises(ValueError, match="max_tokens"):
        Trainer(model, optax.sgd(0.1), max_tokens=0, max_docs=2)
    with pytest.raises(ValueError, match="optimizer"):
        Trainer(model, object(), max_tokens=8, max_docs=2)
    trainer = Trainer(model, optax.sgd(0.1), max_tokens=8, max_docs=2)
    state = trainer.init()
    with pytest.raises(ValueError, match="tokens must be int"):
        trainer.step(state, np.zeros(9, np.int32), np.array([0, 8, 8]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        trainer.step(state, np.zeros(8, np.int32), np.array([0, 9, 8]))
    with pytest.raises(ValueError, match="vocab_size"):
        trainer.step(state, np.full(8, 96, np.int32), np.array([0, 8, 8]))


def _loss_and_grad(remat, backend):
    """value_and_grad of the next-token loss of a 4-layer hybrid (2 GDN, 2 attention) with RuntimeOptions(remat):
    (its function, its arguments)."""
    from jax_gdn.options import RuntimeOptions
    from jax_gdn.train import next_token_loss
    cfg = preset("tiny", num_hidden_layers=4, layer_types=("linear_attention", "full_attention") * 2,
                 mlp_only_layers=(0, 2), vocab_size=96, hidden_size=64)
    model = HybridModel.random(cfg, 0, dtype=jnp.float32, backend=backend, options=RuntimeOptions(remat=remat))
    cache = model.init_cache(max_seqs=N, max_tokens=T + N * 16, page_size=16, max_seq_len=T)
    tokens, cu = pack_documents(_docs(), max_tokens=T, max_docs=N)
    step_fn = model.step_fn(return_all_logits=True)
    fn = jax.value_and_grad(lambda p, c, x, u: next_token_loss(p, c, x, u, step_fn=step_fn), has_aux=True)
    return fn, (model.params, cache, jnp.asarray(tokens), jnp.asarray(cu))


def _live_kernels(fn, args) -> dict:
    """{kernel name: launches} of the pallas_calls left in fn's jaxpr after dead-code elimination."""
    import collections
    from jax._src.interpreters import partial_eval as pe
    from jax.extend import core as jex_core
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    dced, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    found = collections.Counter()

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info")
                found[getattr(info, "name", None) or str(eqn.params.get("name"))] += 1
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)
    walk(dced)
    return found


def test_remat_layers_same_gradients_less_memory_cores_run_once():
    """RuntimeOptions(remat="layers"): each layer under jax.checkpoint with the mixers' core outputs saved. Same
    loss and gradients as remat="none" (fp32, 1e-6); XLA's buffer assignment of the step needs fewer temporary
    bytes (the XLA path saves every residual otherwise); on the kernels, the GDN and attention cores' launches
    are as many as without remat (recomputing a layer re-runs its projections, conv and MoE, not its core)."""
    out, temp = {}, {}
    for remat in ("none", "layers"):
        fn, args = _loss_and_grad(remat, "xla")
        compiled = jax.jit(fn).lower(*args).compile()
        out[remat], temp[remat] = compiled(*args), compiled.memory_analysis().temp_size_in_bytes
    (l0, _), g0 = out["none"]
    (l1, _), g1 = out["layers"]
    assert abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert temp["layers"] < 0.75 * temp["none"], temp
    plain = _live_kernels(*_loss_and_grad("none", "pallas_interpret"))
    remat = _live_kernels(*_loss_and_grad("layers", "pallas_interpret"))
    cores = [k for k in plain if k.startswith("gdn_") or "attention" in k]
    assert cores, f"no GDN or attention kernel found among {dict(plain)}"
    for k in cores:
        assert remat[k] == plain[k], f"{k}: {remat[k]} launches under remat against {plain[k]}"


def test_remat_option_is_checked():
    from jax_gdn.options import RuntimeOptions
    with pytest.raises(ValueError, match="RuntimeOptions.remat must be one of"):
        RuntimeOptions(remat="full")


def test_head_logits_backward_runs_in_the_head_dtype():
    """model.head_logits: fp32 logits either way; in fp32 its VJP is autodiff's exactly; with a bf16 head both
    backward GEMMs take bf16 operands (the cotangent rounded once: no bf16 x fp32 promotion, which ran as tf32
    GEMMs) and stay within bf16 rounding of the fp32 gradients (relative RMS 1e-2)."""
    from jax_gdn.model import head_logits
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((37, 64)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((64, 300)) * 0.1, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((37, 300)), jnp.float32)
    got = jax.vjp(head_logits, x, head)[1](ct)
    want = jax.vjp(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32), x, head)[1](ct)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    xb, hb = x.astype(jnp.bfloat16), head.astype(jnp.bfloat16)
    out, vjp = jax.vjp(head_logits, xb, hb)
    assert out.dtype == jnp.float32
    dots = [e for e in jax.make_jaxpr(vjp)(ct).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), dots
    for a, b in zip(vjp(ct), want):
        assert a.dtype == jnp.bfloat16 and rel_rms(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 1e-2
