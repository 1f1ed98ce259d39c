"""HF transformers' Qwen3-Next (and Qwen3.5-MoE, ``HF_FAMILIES``) as the whole-model section's peer, on FLA's
kernels (its fast GDN path), and the check of that wiring against HF's own torch path. transformers 5.24's
qwen3_5_moe module calls the same four module-level GDN callables, so the wiring below applies to it; its FLA
adapters are checked against HF's torch path (``hf_kernel_check``; ``--hf-check --dims``) at either family's dims.

transformers' qwen3_next module resolves, at import, each of its four GDN callables (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``: FLA's when ``fla`` imports; ``causal_conv1d_fn``, ``causal_conv1d_update``:
the ``causal_conv1d`` package's when installed, else its torch conv) and has no fused gated norm (torch
``Qwen3NextRMSNormGated``). ``hf_rows`` therefore assigns all four module attributes, which the GDN layer looks up at
each call, to FLA's kernels (``fla_kernels``) and swaps each GDN layer's gated norm for FLA's ``FusedRMSNormGated``
(``use_hf_kernels``); ``hf_kernel_check`` compares the two paths (``python -m benchmarks.model --hf-check``).
"""
from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np

from benchmarks.configs import check_config
from benchmarks.model_parts import REPS
from benchmarks.timing import median_ms


#: model_type -> (transformers config class, causal-LM class, modeling module): the HF peers of our presets
HF_FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "transformers.models.qwen3_next.modeling_qwen3_next"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
}


def hf_family(config) -> tuple:
    """``HF_FAMILIES[config.model_type]``; ValueError naming the model types it has for any other."""
    fam = HF_FAMILIES.get(config.model_type)
    if fam is None:
        raise ValueError(f"no HF peer for model_type {config.model_type!r}; known: {sorted(HF_FAMILIES)}")
    return fam


def hf_module(model=None, config=None):
    """The transformers modeling module whose module-level GDN callables ``model`` (an HF model) or ``config`` (ours)
    uses (its layers look them up at each call)."""
    import importlib
    import sys
    if model is not None:
        return sys.modules[type(model).__module__]
    return importlib.import_module(hf_family(config)[2])


def _is_gdn(m) -> bool:
    return type(m).__name__.endswith("GatedDeltaNet")           # Qwen3NextGatedDeltaNet, Qwen3_5MoeGatedDeltaNet


def hf_kwargs(config) -> dict:
    """The transformers config fields of ``config`` (its family's: Qwen3.5-MoE has no dense FFN layers, no
    decoder_sparse_step, mlp_only_layers or norm_topk_prob)."""
    kw = _qwen3_next_kwargs(config)
    if config.model_type == "qwen3_5_moe_text":
        for k in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
            kw.pop(k)
    return kw


def _qwen3_next_kwargs(config) -> dict:
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                layer_types=list(config.layer_types), num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                linear_num_key_heads=config.linear_num_key_heads,
                linear_num_value_heads=config.linear_num_value_heads,
                linear_key_head_dim=config.linear_key_head_dim, linear_value_head_dim=config.linear_value_head_dim,
                linear_conv_kernel_dim=config.linear_conv_kernel_dim, num_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
                shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=False)


#: the module-level callables of transformers' qwen3_next modeling module that its GatedDeltaNet layer calls
#: (looked up at call time, so assigning the module attribute redirects every layer)
HF_GDN_CALLABLES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")


def _runs(fn) -> str:
    """What a callable of transformers' qwen3_next module really runs, as "module.name". transformers 5.x wraps
    each of them in ``use_kernel_func_from_hub_with_fallback``, which uses ``functools.wraps`` (so ``__module__`` is
    transformers' own whatever runs) and keeps the implementation it resolved at import in its closure; our
    adapters name what they call in ``_runs``."""
    if getattr(fn, "_runs", None):
        return fn._runs
    impl = fn
    try:
        import inspect
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
    except (TypeError, ValueError):
        pass
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', getattr(impl, '__name__', repr(impl)))}"


def _kwargs_filter(fn, name: str):
    """``fn`` called with only the keyword arguments its signature names (what transformers' wrapper does: HF's
    GDN layer passes its attention kwargs down to every kernel)."""
    import functools
    import inspect
    params = inspect.signature(fn).parameters
    named = {k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in named})
    call._runs = name
    return call


def fla_kernels(fla=None) -> dict:
    """The callables HF's Qwen3-Next GDN layer needs for its fast path, made from FLA 0.6 (``fla``: a namespace
    with FLA's ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, ``causal_conv1d``,
    ``causal_conv1d_update`` and ``FusedRMSNormGated``; default: the installed FLA, whose Triton kernels need a
    GPU). Returns {HF's module-level name: callable} plus "gated_norm": a factory of the gated RMSNorm module.

    The GDN rule: FLA's functions have HF's signature (q, k, v [B, T, H, K|V], g, beta [B, T, H], initial_state
    [B, H, K, V] fp32, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens). The conv: HF calls the
    ``causal_conv1d`` package's ``causal_conv1d_fn(x [B, D, T], weight [D, W], bias, activation)`` ->
    [B, D, T] and ``causal_conv1d_update(x [B, D, T], conv_state [B, D, W], weight, bias, activation)`` -> [B, D, T]
    (conv_state advanced in place, holding the last W inputs); FLA's ``causal_conv1d(x [B, T, D], weight, bias,
    activation=)`` -> (y [B, T, D], None) and ``causal_conv1d_update(x [N, D], cache [N, D, W], weight=, bias=,
    activation=)`` -> (y [N, D], cache) (cache shifted by one column and the new input written last, in place;
    a copy when the cache is not contiguous) are adapted to those (transposes are views; the update runs token by
    token when T > 1). The gated norm: FLA's ``FusedRMSNormGated(V, eps=, activation="silu")`` (fp32 inside;
    HF's torch module rounds the normalised x to the input dtype before the weight: a bf16 rounding apart)."""
    if fla is None:
        import types

        from fla.modules import FusedRMSNormGated
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        fla = types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule,
                                    fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule,
                                    causal_conv1d=causal_conv1d, causal_conv1d_update=causal_conv1d_update,
                                    FusedRMSNormGated=FusedRMSNormGated)

    def name(f):
        return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', getattr(f, '__name__', '?'))}"
    conv, update = fla.causal_conv1d, fla.causal_conv1d_update

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None, **_):
        if seq_idx is not None or initial_states is not None or return_final_states or final_states_out is not None:
            raise NotImplementedError("the FLA adapter of causal_conv1d_fn takes no seq_idx / initial_states / "
                                      "final states (HF's Qwen3-Next passes none)")
        y, _ = conv(x.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        return y.transpose(1, 2)

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None, **_):
        if cache_seqlens is not None or conv_state_indices is not None:
            raise NotImplementedError("the FLA adapter of causal_conv1d_update takes no cache_seqlens / "
                                      "conv_state_indices (HF's Qwen3-Next passes none)")
        outs = []
        for t in range(x.shape[-1]):
            y, state = update(x[:, :, t], conv_state, weight=weight, bias=bias, activation=activation)
            if state is not None and state.data_ptr() != conv_state.data_ptr():
                conv_state.copy_(state)                       # FLA made the cache contiguous: write it back
            outs.append(y)
        return outs[0][:, :, None] if len(outs) == 1 else __import__("torch").stack(outs, dim=-1)

    causal_conv1d_fn._runs = name(conv) + " (adapted: x [B, D, T] <-> [B, T, D])"
    causal_conv1d_update._runs = name(update) + " (adapted: x [B, D, T] <-> [B, D] per token)"
    norm_cls = fla.FusedRMSNormGated

    def gated_norm(old):
        """FLA's fused gated RMSNorm with the weights and eps of HF's module ``old``."""
        import torch
        new = norm_cls(old.weight.shape[0], eps=old.variance_epsilon, activation=getattr(old, "activation", "silu"),
                       device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight)
        return new
    gated_norm._runs = name(norm_cls)
    return {"torch_chunk_gated_delta_rule": _kwargs_filter(fla.chunk_gated_delta_rule,
                                                           name(fla.chunk_gated_delta_rule)),
            "torch_recurrent_gated_delta_rule": _kwargs_filter(fla.fused_recurrent_gated_delta_rule,
                                                               name(fla.fused_recurrent_gated_delta_rule)),
            "causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update,
            "gated_norm": gated_norm}


def hf_kernel_report(model=None, mq=None) -> dict:
    """{HF's name: what runs} for the GDN callables of ``model``'s transformers module (default qwen3_next's; and
    the gated norm class of ``model``'s GDN layers)."""
    if mq is None:
        if model is not None:
            mq = hf_module(model)
        else:
            import transformers.models.qwen3_next.modeling_qwen3_next as mq
    out = {k: _runs(getattr(mq, k)) for k in HF_GDN_CALLABLES if hasattr(mq, k)}
    if model is not None:
        for m in model.modules():
            if _is_gdn(m):
                out["gated_norm"] = f"{type(m.norm).__module__}.{type(m.norm).__qualname__}"
                break
    return out


def use_hf_kernels(model, kernels: dict, mq=None):
    """Points HF's Qwen3-Next at ``kernels`` (``fla_kernels()``): assigns the module-level callables of
    transformers' qwen3_next module (which its GDN layer looks up at every call) and swaps the gated norm module of
    each GDN layer of ``model`` (``kernels["gated_norm"](old) -> new``). Returns ``undo()``, which puts back what
    was there (the module's callables and the model's norms)."""
    if mq is None:
        mq = hf_module(model)
    missing = [k for k in HF_GDN_CALLABLES if not hasattr(mq, k)]
    if missing:
        raise RuntimeError(f"transformers' {mq.__name__} has no {missing}: this transformers version calls its "
                           f"GDN kernels by other names; read that module")
    old_fns = {k: getattr(mq, k) for k in HF_GDN_CALLABLES}
    old_norms = []
    if kernels.get("gated_norm") is not None:
        for m in model.modules():
            if _is_gdn(m):
                old_norms.append((m, m.norm))
                m.norm = kernels["gated_norm"](m.norm)
    for k in HF_GDN_CALLABLES:
        setattr(mq, k, kernels[k])

    def undo():
        for k, f in old_fns.items():
            setattr(mq, k, f)
        for m, norm in old_norms:
            m.norm = norm
    return undo


def hf_model(config, dtype=None, device: str = "cpu", seed: int = 0):
    """HF's causal LM of ``config``'s family (``HF_FAMILIES``: ``Qwen3NextForCausalLM``, ``Qwen3_5MoeForCausalLM``)
    with ``config``'s dims and random weights (``dtype`` default bfloat16, SDPA attention, eval mode)."""
    import torch
    import transformers
    cfg_name, cls_name, _ = hf_family(config)
    cfg = getattr(transformers, cfg_name)(**hf_kwargs(config))
    model_cls = getattr(transformers, cls_name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.bfloat16)
    try:
        with torch.device(device):
            return model_cls(cfg).eval()
    finally:
        torch.set_default_dtype(old)


def _past(res):
    """The cache of an HF output (``past_key_values`` in transformers 5.17, ``cache`` from about 5.2x)."""
    for k in ("past_key_values", "cache"):
        try:
            v = res[k]
        except (KeyError, TypeError):
            continue
        if v is not None:
            return v
    return None


def hf_kernel_check(model, kernels: dict, lens=(173, 300), steps: int = 3, seed: int = 0, mq=None) -> dict:
    """HF's logits on its own torch GDN path against the same model on ``kernels`` (``use_hf_kernels``): a
    left-padded prefill of ``lens`` (all positions' logits: the chunked rule, the conv, the gated norm, the padding
    mask) then ``steps`` decode steps through the cache (the recurrent rule, the conv update, the conv state
    written in place). Returns {"prefill": {"max_abs", "ref_max", "rel", "cos_min", "cos_median", "top1_agree",
    "positions"}, "decode": {...}, "kernels": report, "torch": report}: per position (real tokens only) the cosine of
    the two logit vectors and whether their argmax agrees. In bf16 a random model's max-based "rel" is large even
    for rounding-level differences (HF's torch gated norm rounds to bf16 where FLA's stays fp32: rel ~0.1-0.3 at
    80B dims, a near-tie of the top-10 router flips an expert); a layout error gives cosines near 0."""
    import torch
    if mq is None:
        mq = hf_module(model)
    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    L, b = max(lens), len(lens)
    ids = torch.randint(0, vocab, (b, L), generator=g).to(dev)
    mask = torch.zeros(b, L, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, L - n:] = 1
    mask = mask.to(dev)
    nxt = torch.randint(0, vocab, (steps, b, 1), generator=g).to(dev)

    def run():
        with torch.no_grad():
            res = model(input_ids=ids, attention_mask=mask, use_cache=True)
            pre = res.logits.float() * mask[..., None]                    # padding rows: not compared
            pkv, m, dec = _past(res), mask, []
            for s in range(steps):
                m = torch.cat([m, torch.ones(b, 1, dtype=m.dtype, device=dev)], 1)
                res = model(input_ids=nxt[s], attention_mask=m, past_key_values=pkv, use_cache=True)
                pkv = _past(res)
                dec.append(res.logits[:, -1].float())
        return pre, torch.stack(dec, 1)

    torch_report = hf_kernel_report(model, mq)
    for k in HF_GDN_CALLABLES:            # the reference: transformers' own torch functions, whatever it resolved
        f = getattr(mq, k)
        torch_report[k] = _runs(getattr(f, "__wrapped__", f))
    torch_fns = {k: getattr(getattr(mq, k), "__wrapped__", getattr(mq, k)) for k in HF_GDN_CALLABLES}
    undo = use_hf_kernels(model, dict(torch_fns, gated_norm=None), mq)
    try:
        ref = run()
    finally:
        undo()
    undo = use_hf_kernels(model, kernels, mq)
    try:
        report = hf_kernel_report(model, mq)
        got = run()
    finally:
        undo()
    out = {"kernels": report, "torch": torch_report, "lens": list(lens), "steps": steps,
           "dtype": str(next(model.parameters()).dtype)}
    for key, r, o, keep in (("prefill", ref[0], got[0], mask.bool()), ("decode", ref[1], got[1], None)):
        err = (o - r).abs().max().item()
        top = r.abs().max().item()
        r2, o2 = (r[keep], o[keep]) if keep is not None else (r.flatten(0, 1), o.flatten(0, 1))   # [positions, V]
        cos = torch.nn.functional.cosine_similarity(o2, r2, dim=-1)
        out[key] = {"max_abs": err, "ref_max": top, "rel": err / max(top, 1e-30),
                    "cos_min": cos.min().item(), "cos_median": cos.median().item(),
                    "top1_agree": (o2.argmax(-1) == r2.argmax(-1)).float().mean().item(),
                    "positions": int(r2.shape[0]), "finite": bool(torch.isfinite(o).all().item())}
    return out


def hf_rows(config, cases: dict, reps: int = REPS, seed: int = 0, log=None, fla: bool = None) -> dict:
    """HF Qwen3NextForCausalLM with ``config``'s dims: {"varlen", "long", "decode": {"ms", "do_bench_ms"}, "info"}.
    ``fla`` (default: on a GPU) runs HF's GDN layers on FLA's kernels (``fla_kernels`` / ``use_hf_kernels``); off,
    or when FLA cannot be imported, HF runs its torch fallbacks and "info" says so. Frees the model and torch's
    cached GPU memory before returning."""
    import torch
    import transformers
    info = {"transformers": transformers.__version__, "torch": torch.__version__}
    dev = "cuda" if torch.cuda.is_available() else "cpu"        # cpu: a smoke run of this code (tests)
    info["device"] = dev
    fla = (dev == "cuda") if fla is None else fla
    t0 = time.time()
    hf = hf_model(config, torch.bfloat16, dev, seed)
    info["init_s"] = round(time.time() - t0, 1)
    log = log or (lambda m: None)
    info["hf_kernels_resolved"] = hf_kernel_report(hf)       # what transformers picked by itself at import
    undo = None
    if fla:
        try:
            import fla as fla_pkg
            info["fla"] = getattr(fla_pkg, "__version__", "importable")
            undo = use_hf_kernels(hf, fla_kernels())
        except Exception as err:  # pragma: no cover - reported, HF runs its torch fallbacks
            info["fla_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    info["hf_kernels"] = hf_kernel_report(hf)                   # what the timed calls run
    info["experts_implementation"] = str(getattr(hf.config, "_experts_implementation", None))
    info["attn_implementation"] = str(getattr(hf.config, "_attn_implementation", None))
    log(f"init {info}")
    rng = np.random.default_rng(seed)
    out = {"info": info}

    def sync(_):
        if dev == "cuda":
            torch.cuda.synchronize()

    def do_bench(fn):
        if dev != "cuda":
            return None
        try:
            import triton
            return float(triton.testing.do_bench(fn, warmup=1, rep=1, return_mode="median"))
        except Exception:  # pragma: no cover
            return None

    prefill = {}
    try:
        with torch.no_grad():
            # ---- prefill rows ----
            name, lens = cases["varlen"]
            L = max(lens)
            ids = torch.from_numpy(rng.integers(0, config.vocab_size, (len(lens), L))).to(dev)
            mask = torch.zeros(len(lens), L, dtype=torch.long, device=dev)
            for i, n in enumerate(lens):
                mask[i, L - n:] = 1                                                   # left padding, as HF generates
            prefill = {"varlen": lambda: hf(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)}
            _, (n1,) = cases["long"]
            ids1 = torch.from_numpy(rng.integers(0, config.vocab_size, (1, n1))).to(dev)
            prefill["long"] = lambda: hf(input_ids=ids1, use_cache=False, logits_to_keep=1)
            for key, fn in prefill.items():
                try:
                    t1 = time.time()
                    fn()
                    sync(None)
                    first = time.time() - t1
                    log(f"{key}: first call {first:.1f} s")
                    out[key] = {"ms": median_ms(fn, sync, reps), "do_bench_ms": do_bench(fn), "first_call_s": first}
                except Exception as err:
                    out[key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                log(f"{key}: {out[key]}")
                if dev == "cuda":
                    torch.cuda.empty_cache()
            # which GDN kernels FLA dispatched to: FlashQLA's module loads only when its backend runs
            info["fla_flash_qla"] = os.environ.get("FLA_FLASH_QLA", "unset")
            info["flash_qla_ran"] = "flash_qla" in sys.modules
            # ---- decode: prefill the context with a cache, then time one-token steps ----
            _, n, ctx, _ = cases["decode"]
            try:
                idsd = torch.from_numpy(rng.integers(0, config.vocab_size, (n, ctx))).to(dev)
                res = hf(input_ids=idsd, use_cache=True, logits_to_keep=1)
                pkv = _past(res)
                del res
                nxt = torch.from_numpy(rng.integers(0, config.vocab_size, (n, 1))).to(dev)
                step = lambda: hf(input_ids=nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1)  # noqa: E731
                step()
                sync(None)
                out["decode"] = {"ms": median_ms(step, sync, max(reps, 5))}
                log(f"decode: {out['decode']}")
                del pkv
            except Exception as err:
                out["decode"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        if undo is not None:
            undo()
    del hf, prefill
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def hf_check(quick: bool = False, lens=(173, 300), steps: int = 3, dims: str = "qwen3_next_80b") -> dict:
    """``hf_kernel_check`` of FLA's kernels (``fla_kernels()``) on a bf16 HF model of ``check_config(quick, dims)``
    on the GPU: HF's torch path against HF on FLA, the same weights and inputs."""
    import torch
    t0 = time.time()
    model = hf_model(check_config(quick, dims), torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu")
    res = hf_kernel_check(model, fla_kernels(), lens=lens, steps=steps)
    res["resolved_by_transformers"] = hf_kernel_report(model)
    res["s"] = round(time.time() - t0, 1)
    return res
