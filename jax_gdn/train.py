"""Training on the serving kernels: next-token loss over packed documents and one optax step.

Shape legend: T tokens of a packed batch (documents back to back), N documents (streams), V vocabulary.

    tokens [T] int32 in [0, V)      cu_seqlens [N + 1] int32: document n is tokens[cu[n]:cu[n + 1]]; cu[N] <= T,
                                    later tokens are padding and carry no loss

The loss runs the model's own prefill step (``HybridModel.step_fn``) over an empty cache: each document is one
stream in its own slot, so the GDN recurrent and conv states and the attention context restart at every document
boundary. Target of token t: token t + 1 of the same document (the last token of each document has none). The
gradient reaches every parameter through the kernels the model picked: on Hopper the GDN op runs Mosaic GPU
backward kernels walking each document (``DispatchConfig.mosaic_backward_varlen``); the other Pallas / Mosaic / cuDNN
kernels run the forward and ``pallas_kernels.autodiff.reference_vjp`` gives them the XLA forms' VJPs (recomputed in
the backward).

Activation memory: the model's ``RuntimeOptions(remat="layers")`` recomputes each layer in the backward, the GDN
and attention cores' outputs saved (their kernels run once); the default keeps every residual.

Precision: :class:`Trainer` keeps fp32 master weights (``TrainState.params``) and the optimiser state; each step
casts the master to the model's own dtypes (``model.params``: bf16 matmul weights with fp32 norms and gates for a
bf16 model) for the forward and backward, and applies the fp32 gradients, clipped to ``clip_norm`` global norm,
to the fp32 master. A fp32 model trains in fp32 throughout.

    trainer = Trainer(model, optax.adamw(1e-3), max_tokens=4096, max_docs=16)
    state = trainer.init()
    tokens, cu_seqlens = pack_documents(docs, max_tokens=4096, max_docs=16)
    state, metrics = trainer.step(state, tokens, cu_seqlens)       # {"loss", "grad_norm", "tokens"}
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["next_token_targets", "next_token_loss", "pack_documents", "TrainState", "Trainer"]


def next_token_targets(tokens: jax.Array, cu_seqlens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(targets [T] int32, mask [T] fp32): token t's target is token t + 1 where both lie in the same document
    (mask 1), else 0 with mask 0 (a document's last token, padding past cu_seqlens[N])."""
    t = tokens.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    doc_end = cu_seqlens[jnp.clip(jnp.searchsorted(cu_seqlens, pos, side="right"), 1, cu_seqlens.shape[0] - 1)]
    mask = (pos + 1 < doc_end) & (pos < cu_seqlens[-1])
    targets = jnp.where(mask, jnp.roll(tokens, -1), 0)
    return targets.astype(jnp.int32), mask.astype(jnp.float32)


def next_token_loss(params, cache, tokens, cu_seqlens, *, step_fn) -> tuple[jax.Array, jax.Array]:
    """(mean next-token cross entropy over the masked tokens, their count). step_fn: ``model.step_fn(
    return_all_logits=True)``; cache: an empty cache with at least N slots and room for T tokens (read only: the
    step's new cache is dropped)."""
    n = cu_seqlens.shape[0] - 1
    logits, _ = step_fn(params, cache, tokens, cu_seqlens, jnp.arange(n, dtype=jnp.int32))      # [T, V] fp32
    targets, mask = next_token_targets(tokens, cu_seqlens)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    count = jnp.sum(mask)
    return jnp.sum(nll * mask) / jnp.maximum(count, 1.0), count


def pack_documents(docs: Sequence[Sequence[int]], *, max_tokens: int, max_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents (lists of token ids) packed back to back into (tokens [max_tokens] int32, cu_seqlens
    [max_docs + 1] int32): as many whole documents as fit (a longer first document is cut to max_tokens), the
    rest of the row padding (zero-length documents fill cu_seqlens). ValueError when docs is empty."""
    if not docs:
        raise ValueError("pack_documents: docs is empty")
    tokens = np.zeros((max_tokens,), np.int32)
    cu = [0]
    for doc in docs:
        if len(cu) > max_docs:
            break
        doc = list(doc)[:max_tokens - cu[-1]]
        if not doc:
            break
        tokens[cu[-1]:cu[-1] + len(doc)] = doc
        cu.append(cu[-1] + len(doc))
    cu += [cu[-1]] * (max_docs + 1 - len(cu))
    return tokens, np.asarray(cu, np.int32)


class TrainState(NamedTuple):
    """params: the fp32 master weights (the model's tree); opt_state: the optimiser's; step: int32 scalar."""
    params: dict
    opt_state: object
    step: jax.Array


class Trainer:
    """One optimiser step of ``model`` on packed documents: fp32 master weights, gradient clipping, one compiled
    program per (max_tokens, max_docs).

    model: a ``HybridModel`` (its config, kernels and options; its params are the initial weights and give the
    compute dtypes); optimizer: an ``optax.GradientTransformation``; max_tokens / max_docs: T and N of every
    batch (pad with ``pack_documents``); clip_norm: the global-norm clip applied before ``optimizer`` (None:
    none); page_size: the KV page size of the loss's cache."""

    def __init__(self, model, optimizer, *, max_tokens: int, max_docs: int, clip_norm: float = 1.0,
                 page_size: int = 16):
        import optax
        for name, value in (("max_tokens", max_tokens), ("max_docs", max_docs), ("page_size", page_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Trainer: {name} must be a positive int, got {value!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"Trainer: clip_norm must be positive or None, got {clip_norm!r}")
        if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
            raise ValueError(f"Trainer: optimizer must be an optax.GradientTransformation, got {type(optimizer)}")
        self.model = model
        self.max_tokens, self.max_docs = int(max_tokens), int(max_docs)
        self.optimizer = optimizer if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm),
                                                                         optimizer)
        self.cache = model.init_cache(max_seqs=self.max_docs, max_tokens=self.max_tokens + self.max_docs * page_size,
                                      page_size=page_size, max_seq_len=self.max_tokens)
        self._dtypes = jax.tree.map(lambda x: x.dtype, model.params)
        self._loss = jax.value_and_grad(
            lambda p, c, x, cu: next_token_loss(p, c, x, cu, step_fn=model.step_fn(return_all_logits=True)),
            has_aux=True)
        self._step = jax.jit(self._step_impl, donate_argnums=(0,))

    def init(self) -> TrainState:
        """A copy of the model's weights as the fp32 master (the model keeps its own: steps donate the state) and a
        fresh optimiser state."""
        master = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), self.model.params)
        return TrainState(params=master, opt_state=self.optimizer.init(master), step=jnp.zeros((), jnp.int32))

    def compute_params(self, state: TrainState) -> dict:
        """The master weights in the model's dtypes (what the forward runs on)."""
        return jax.tree.map(lambda x, dt: x.astype(dt), state.params, self._dtypes)

    def _step_impl(self, state: TrainState, cache, tokens, cu_seqlens):
        import optax
        (loss, count), grads = self._loss(self.compute_params(state), cache, tokens, cu_seqlens)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": count}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    def step(self, state: TrainState, tokens, cu_seqlens) -> tuple[TrainState, dict]:
        """(new state, {"loss", "grad_norm" (before clipping), "tokens" (with a target)}); ``state`` is donated.
        tokens [max_tokens] int32 in [0, vocab), cu_seqlens [max_docs + 1] int32 (non-decreasing from 0, at most
        max_tokens): checked on the host when concrete."""
        tokens = np.asarray(tokens) if not isinstance(tokens, jax.Array) else tokens
        cu_seqlens = np.asarray(cu_seqlens) if not isinstance(cu_seqlens, jax.Array) else cu_seqlens
        if tokens.shape != (self.max_tokens,) or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be int [max_tokens] = [{self.max_tokens}], got {tokens.dtype} "
                             f"{list(tokens.shape)}")
        if cu_seqlens.shape != (self.max_docs + 1,) or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must be int [max_docs + 1] = [{self.max_docs + 1}], got "
                             f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}")
        if isinstance(cu_seqlens, np.ndarray):
            if cu_seqlens[0] != 0 or (np.diff(cu_seqlens) < 0).any() or cu_seqlens[-1] > self.max_tokens:
                raise ValueError(f"cu_seqlens must be non-decreasing from 0 to at most {self.max_tokens}, got "
                                 f"{cu_seqlens.tolist()}")
        if isinstance(tokens, np.ndarray):
            vocab = self.model.config.vocab_size
            if tokens.min() < 0 or tokens.max() >= vocab:
                raise ValueError(f"tokens must lie in [0, vocab_size = {vocab}), got [{tokens.min()}, "
                                 f"{tokens.max()}]")
        return self._step(state, self.cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(cu_seqlens, jnp.int32))
