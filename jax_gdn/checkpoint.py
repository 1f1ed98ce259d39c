"""HF checkpoint directories -> HybridModel: config.json + safetensors.

Files read: the shards that ``model.safetensors.index.json`` maps tensors to (its ``weight_map``), else
``model.safetensors``, else every ``*.safetensors`` of the directory (``read_state_dict``); each tensor goes to the
device, cast, right after it is read, so the host holds one tensor at a time. With ``load_pretrained(...,
mesh=)`` (``load_sharded_params``) each device reads only its slices of the files (rules of jax_gdn.sharding).

model_type: qwen3_next (fused ``in_proj_qkvz`` / ``in_proj_ba``; MoE experts either fused
``experts.gate_up_proj [E, 2I, D]`` / ``experts.down_proj [E, D, I]`` or per expert ``experts.{e}.gate_proj`` ...),
qwen3_5 / qwen3_5_moe (multimodal: the text part under ``model.language_model.*``, config under ``text_config``;
``model.visual.*`` skipped), qwen3_5_text / qwen3_5_moe_text (``model.*``). ``mtp.*`` is always skipped.

Parameters come out as one block dict per layer (jax_gdn.layers.block: input_norm, mixer, post_norm, ffn), every
Linear weight transposed once to [in, out] (torch stores [out, in]). The GDN mixer keeps HF's names, and the fused
Qwen3-Next projections stay fused (phase 1 of jax_gdn.layers.gdn splits them per key head); conv1d is squeezed to
[C, Kc]; MoE experts are stacked to [E, D, 2I] / [E, I, D]. Norms, A_log and dt_bias are fp32, every other weight
is in the model dtype.

Errors are ValueError naming the file, tensor or field. From the safetensors headers, before any tensor is read:
an index that is not JSON, has no ``weight_map`` or names a shard that is missing; a tensor stored in two files
(never silently the last one); an integer or bool tensor (never cast to float silently); a file safetensors cannot
open. Then: an unknown model_type or a missing config field, a missing or unexpected tensor, a shape not matching
the config.

Shape legend: D hidden, Vocab vocabulary, E experts, I (moe_)intermediate, Hk/Hv GDN key/value heads, K/V GDN head
dims, H/Hkv attention heads, Dh attention head dim, C conv channels, Kc conv kernel.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, Optional

import jax.numpy as jnp
import numpy as np

from jax_gdn.config import HybridConfig

_SKIP = (re.compile(r"^mtp\."), re.compile(r"^model\.visual\."), re.compile(r"^visual\."))
_INDEX = "model.safetensors.index.json"


# ================================================================================================================
# Reading
# ================================================================================================================
def read_hf_config(path: str) -> dict:
    fn = os.path.join(path, "config.json")
    if not os.path.isfile(fn):
        raise ValueError(f"load_pretrained: {path!r} has no config.json")
    with open(fn) as f:
        return json.load(f)


def _safetensor_files(path: str) -> list:
    """The safetensors files of a checkpoint directory (names relative to ``path``): the shards that
    ``model.safetensors.index.json`` maps tensors to (its ``weight_map``: tensor name -> file), else
    ``model.safetensors``, else every ``*.safetensors`` in the directory. Raises ValueError naming the index for an
    index that is not JSON, has no ``weight_map``, maps a tensor to something other than a file name, or names a
    shard that is not in the directory; and for a directory without safetensors."""
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                data = json.load(f)
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"load_pretrained: index {index!r} is not valid JSON: {err}") from None
        if not isinstance(data, dict) or "weight_map" not in data:
            raise ValueError(f"load_pretrained: index {index!r} has no 'weight_map' (tensor name -> shard file); "
                             f"top-level keys: {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"load_pretrained: 'weight_map' of index {index!r} must be a non-empty object "
                             f"(tensor name -> shard file), got {type(weight_map).__name__} {weight_map!r:.80}")
        bad = sorted(k for k, v in weight_map.items() if not isinstance(v, str) or not v.endswith(".safetensors"))
        if bad:
            raise ValueError(f"load_pretrained: 'weight_map' of index {index!r} maps {bad[0]!r} to "
                             f"{weight_map[bad[0]]!r}, not a .safetensors file name"
                             + (f" ({len(bad) - 1} more like it)" if len(bad) > 1 else ""))
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise ValueError(f"load_pretrained: index {index!r} names shard file(s) not in the directory: "
                             f"{missing[:4]}" + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
        return files
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"load_pretrained: no safetensors file in {path!r}")
    return files


def _param_dtype(name: str, dtype):
    """fp32 for norms, A_log and dt_bias (whatever the model dtype), ``dtype`` for everything else."""
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    return jnp.float32 if base.endswith(("norm", "A_log", "dt_bias")) else dtype


def read_state_dict(path: str, keep: Callable[[str], bool] = lambda k: True, progress: bool = True,
                    dtype=None) -> dict:
    """name -> array for every tensor ``keep(name)`` accepts, over all files of the checkpoint directory ``path``
    (tqdm bar over shards).

    The headers of all files are checked before any tensor is read; ValueError, naming the file(s) and the tensor,
    for a kept tensor stored in two files (never silently the last one read) and for one that is not floating
    point (integer or bool: every parameter of the model is a float, and a quantized or foreign tensor is never
    cast silently). A file safetensors cannot open raises ValueError naming it.

    dtype None: NumPy arrays as stored. Else each tensor goes to the device right after it is read, cast to
    ``dtype`` (norms, A_log, dt_bias to fp32), so the host never holds more than one tensor.
    """
    from safetensors import SafetensorError, safe_open

    def opened(fn):
        try:
            return safe_open(os.path.join(path, fn), framework="np")
        except (SafetensorError, OSError) as err:
            raise ValueError(f"load_pretrained: {os.path.join(path, fn)!r} is not a readable safetensors file: "
                             f"{err}") from None

    files = _safetensor_files(path)
    where = {}                                         # kept tensor -> the file holding it
    for fn in files:
        with opened(fn) as f:
            for key in f.keys():
                if not keep(key):
                    continue
                if key in where:
                    raise ValueError(f"load_pretrained: tensor {key!r} is stored in two files of {path!r}: "
                                     f"{where[key]!r} and {fn!r} (remove the stale one, or name each tensor's "
                                     f"file in {_INDEX})")
                stored = f.get_slice(key).get_dtype()      # safetensors names: F32, BF16, F16, I64, BOOL, ...
                if not stored.startswith(("F", "BF")):
                    raise ValueError(f"load_pretrained: tensor {key!r} in {os.path.join(path, fn)!r} is {stored}; "
                                     f"the model's parameters are floating point (a quantized checkpoint is not "
                                     f"supported), and it is not cast")
                where[key] = fn
    it = files
    if progress and len(files) > 1:
        try:
            from tqdm import tqdm
            it = tqdm(files, desc="loading shards", unit="shard")
        except ImportError:  # pragma: no cover
            pass
    out = {}
    for fn in it:
        with opened(fn) as f:
            for key in f.keys():
                if where.get(key) == fn:
                    x = f.get_tensor(key)
                    out[key] = x if dtype is None else jnp.asarray(x, _param_dtype(key, dtype))
    return out


# ================================================================================================================
# HF names -> model params
# ================================================================================================================
class _Tensors:
    """Pops tensors by HF name (so each is freed once converted), checking shapes; whatever is left at the end
    is an unexpected tensor."""

    def __init__(self, sd: dict, prefix: str):
        self.sd = sd
        self.prefix = prefix

    def has(self, name: str) -> bool:
        return self.prefix + name in self.sd

    def get(self, name: str, shape: tuple):
        key = self.prefix + name
        if key not in self.sd:
            raise ValueError(f"checkpoint: missing tensor {key!r} (expected shape {tuple(shape)})")
        x = self.sd[key]
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"checkpoint: tensor {key!r} has shape {tuple(x.shape)}, the config implies "
                             f"{tuple(shape)}")
        del self.sd[key]
        return x


def _gdn_params(t: _Tensors, p: str, c: HybridConfig) -> dict:
    """The GDN block's mixer: jax_gdn.layers.gdn params without ``input_layernorm`` (which is the block's
    input_norm); HF names, Linear weights transposed to [in, out], conv squeezed to [C, Kc]."""
    d = c.hidden_size
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    conv_dim = 2 * hk * dk + hv * dv
    out = {}
    if c.gdn_layout == "qwen3_next":
        out["in_proj_qkvz"] = t.get(p + "in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, d)).T
        out["in_proj_ba"] = t.get(p + "in_proj_ba.weight", (2 * hv, d)).T
    else:
        out["in_proj_qkv"] = t.get(p + "in_proj_qkv.weight", (conv_dim, d)).T
        out["in_proj_z"] = t.get(p + "in_proj_z.weight", (hv * dv, d)).T
        out["in_proj_b"] = t.get(p + "in_proj_b.weight", (hv, d)).T
        out["in_proj_a"] = t.get(p + "in_proj_a.weight", (hv, d)).T
    out["conv1d"] = t.get(p + "conv1d.weight", (conv_dim, 1, c.linear_conv_kernel_dim))[:, 0, :]
    out["dt_bias"] = t.get(p + "dt_bias", (hv,))
    out["A_log"] = t.get(p + "A_log", (hv,))
    out["norm"] = t.get(p + "norm.weight", (dv,))
    out["out_proj"] = t.get(p + "out_proj.weight", (d, hv * dv)).T
    return out


def _attn_params(t: _Tensors, p: str, c: HybridConfig) -> dict:
    d, h, hkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    return {
        "q_proj": t.get(p + "q_proj.weight", (h * 2 * dh, d)).T,
        "k_proj": t.get(p + "k_proj.weight", (hkv * dh, d)).T,
        "v_proj": t.get(p + "v_proj.weight", (hkv * dh, d)).T,
        "o_proj": t.get(p + "o_proj.weight", (d, h * dh)).T,
        "q_norm": t.get(p + "q_norm.weight", (dh,)),
        "k_norm": t.get(p + "k_norm.weight", (dh,)),
    }


def _mlp_params(t: _Tensors, p: str, d: int, inter: int) -> dict:
    return {"gate_proj": t.get(p + "gate_proj.weight", (inter, d)).T,
            "up_proj": t.get(p + "up_proj.weight", (inter, d)).T,
            "down_proj": t.get(p + "down_proj.weight", (d, inter)).T}


def _moe_params(t: _Tensors, p: str, c: HybridConfig) -> dict:
    d, e, inter = c.hidden_size, c.num_experts, c.moe_intermediate_size
    if t.has(p + "experts.gate_up_proj"):                     # fused (transformers >= 5 in-memory layout)
        gate_up = t.get(p + "experts.gate_up_proj", (e, 2 * inter, d))
        down = t.get(p + "experts.down_proj", (e, d, inter))
    else:                                                     # one tensor per expert (released checkpoints)
        gate_up = jnp.stack([jnp.concatenate([t.get(f"{p}experts.{j}.gate_proj.weight", (inter, d)),
                                              t.get(f"{p}experts.{j}.up_proj.weight", (inter, d))], axis=0)
                             for j in range(e)])
        down = jnp.stack([t.get(f"{p}experts.{j}.down_proj.weight", (d, inter)) for j in range(e)])
    out = {"router": t.get(p + "gate.weight", (e, d)).T,
           "experts_gate_up": jnp.transpose(gate_up, (0, 2, 1)),  # [E, D, 2I]
           "experts_down": jnp.transpose(down, (0, 2, 1))}        # [E, I, D]
    if c.shared_expert_intermediate_size:
        out["shared_expert"] = _mlp_params(t, p + "shared_expert.", d, c.shared_expert_intermediate_size)
        out["shared_expert_gate"] = t.get(p + "shared_expert_gate.weight", (1, d)).T
    return out


def _text_prefix(sd: dict, config: HybridConfig) -> str:
    if config.model_type in ("qwen3_5", "qwen3_5_moe") or any(k.startswith("model.language_model.") for k in sd):
        return "model.language_model."
    return "model."


def params_from_state_dict(config: HybridConfig, sd: Dict[str, np.ndarray], dtype=jnp.bfloat16) -> dict:
    """HF-named tensors -> {"embed", "final_norm", "lm_head"?, "layers": [block dict per layer]} (the block layout
    of jax_gdn.layers.block; HybridModel stacks the layers once) as jnp arrays: weights in ``dtype``, norms, A_log
    and dt_bias in fp32. Raises ValueError naming a missing, unexpected or mis-shaped tensor. ``sd`` is not modified
    (a shallow copy is consumed)."""
    sd = {k: v for k, v in sd.items() if not any(rx.match(k) for rx in _SKIP)}
    prefix = _text_prefix(sd, config)
    t = _Tensors(sd, "")
    c = config
    d, vocab = c.hidden_size, c.vocab_size
    params = {"embed": t.get(prefix + "embed_tokens.weight", (vocab, d)),
              "final_norm": t.get(prefix + "norm.weight", (d,))}
    if not c.tie_word_embeddings:
        params["lm_head"] = t.get("lm_head.weight", (vocab, d)).T
    elif t.has("lm_head.weight"):
        t.get("lm_head.weight", (vocab, d))                   # tied: a saved copy is accepted and ignored
    layers = []
    for i, kind in enumerate(c.layer_types):
        p = f"{prefix}layers.{i}."
        # one block layout for both mixers (jax_gdn.layers.block): the block owns both norms and residuals
        layer = {"input_norm": t.get(p + "input_layernorm.weight", (d,)),
                 "post_norm": t.get(p + "post_attention_layernorm.weight", (d,))}
        if kind == "linear_attention":
            layer["mixer"] = _gdn_params(t, p + "linear_attn.", c)
        else:
            layer["mixer"] = _attn_params(t, p + "self_attn.", c)
        if c.layer_is_moe(i):
            layer["ffn"] = _moe_params(t, p + "mlp.", c)
        else:
            layer["ffn"] = _mlp_params(t, p + "mlp.", d, c.intermediate_size)
        layers.append(layer)
    params["layers"] = layers
    extra = sorted(sd)
    if extra:
        raise ValueError(f"checkpoint: unexpected tensor(s) for {c.model_type} with this config: {extra[:8]}"
                         + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))

    def cast(path, x):
        name = path[-1].key if hasattr(path[-1], "key") else ""
        return jnp.asarray(x, _param_dtype(name, dtype))

    import jax
    return jax.tree_util.tree_map_with_path(cast, params)


def load_pretrained(path: str, dtype=jnp.bfloat16, *, backend: str = "auto", progress: bool = True, mesh=None,
                    moe_sharding: str = "auto"):
    """Loads a HF checkpoint directory (config.json + safetensors) into a :class:`jax_gdn.model.HybridModel`.

    mesh: a one-axis jax.sharding.Mesh; each device then reads only its slices of the files
    (``load_sharded_params``, rules of ``jax_gdn.sharding``) and the model runs split over the mesh;
    moe_sharding: "tensor" (expert columns split), "expert" (whole experts split) or "auto" (default: expert where
    the mesh divides the experts), as ``HybridModel``."""
    from jax_gdn.model import HybridModel
    if not os.path.isdir(path):
        raise ValueError(f"load_pretrained: {path!r} is not a directory")
    config = HybridConfig.from_hf(read_hf_config(path))
    if mesh is not None:
        from jax_gdn.sharding import ShardRules
        rules = ShardRules(config, mesh, moe_sharding)    # refuses a mesh that does not divide the heads first
        params = load_sharded_params(path, config, dtype, rules)
        return HybridModel(config, params, dtype=dtype, backend=backend, mesh=mesh, moe_sharding=moe_sharding)
    sd = read_state_dict(path, keep=lambda k: not any(rx.match(k) for rx in _SKIP), progress=progress,
                         dtype=dtype)
    params = params_from_state_dict(config, sd, dtype)
    del sd
    return HybridModel(config, params, dtype=dtype, backend=backend)


# ================================================================================================================
# Sharded loading: each device reads only its slices (safetensors get_slice), the host never holds the model
# ================================================================================================================
class _Src:
    """A model-layout view of one stored tensor: model axis j is stored axis ``axes[j]``; stored axes not in
    ``axes`` have size 1 and are squeezed (conv1d [C, 1, Kc] -> [C, Kc]). ``read(axis, a, b)`` reads only rows
    [a, b) of model axis ``axis`` (the whole tensor with axis None) through safetensors' ``get_slice``."""

    def __init__(self, files: dict, key: str, axes: tuple):
        self.files, self.key, self.axes = files, key, axes
        self.stored = tuple(files[key][1])
        self.shape = tuple(self.stored[a] for a in axes)

    def read(self, axis: Optional[int], a: int = 0, b: int = 0) -> np.ndarray:
        handle = self.files[self.key][0]
        cut = [slice(None)] * len(self.stored)
        if axis is not None:
            cut[self.axes[axis]] = slice(a, b)
        x = np.asarray(handle.get_slice(self.key)[tuple(cut)])
        x = np.squeeze(x, axis=tuple(i for i in range(x.ndim) if i not in self.axes))
        kept = sorted(self.axes)                                            # stored order of the kept axes
        return np.transpose(x, [kept.index(s) for s in self.axes])


class _Cat:
    """Model-layout concatenation of parts along ``axis`` (gate | up of one expert)."""

    def __init__(self, parts: list, axis: int):
        self.parts, self.axis = parts, axis
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        self.shape = tuple(shape)

    def read(self, axis: Optional[int], a: int = 0, b: int = 0) -> np.ndarray:
        if axis != self.axis:
            return np.concatenate([p.read(axis, a, b) for p in self.parts], axis=self.axis)
        out, off = [], 0
        for p in self.parts:
            size = p.shape[axis]
            lo, hi = max(a, off), min(b, off + size)
            if lo < hi:
                out.append(p.read(axis, lo - off, hi - off))
            off += size
        return np.concatenate(out, axis=axis)


class _Stack:
    """A new leading axis over parts (experts of one layer, layers of one stacked leaf)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (len(parts),) + tuple(parts[0].shape)

    def read(self, axis: Optional[int], a: int = 0, b: int = 0) -> np.ndarray:
        if axis == 0:
            return np.stack([p.read(None) for p in self.parts[a:b]])
        return np.stack([p.read(None if axis is None else axis - 1, a, b) for p in self.parts])


def _sources(config: HybridConfig, files: dict, prefix: str, gdn_transposed: bool) -> tuple:
    """The model's one-device parameter layout (layers unstacked) as _Src / _Cat / _Stack views of the stored
    tensors, and the set of tensor names they use. Raises ValueError naming a missing tensor."""
    used = set()
    c = config

    def t(key, axes=(0,)):
        if key not in files:
            raise ValueError(f"checkpoint: missing tensor {key!r}")
        used.add(key)
        return _Src(files, key, axes)

    def lin(key):                                        # torch Linear [out, in] -> [in, out]
        return t(key, (1, 0))

    def mlp(p):
        return {"gate_proj": lin(p + "gate_proj.weight"), "up_proj": lin(p + "up_proj.weight"),
                "down_proj": lin(p + "down_proj.weight")}

    params = {"embed": t(prefix + "embed_tokens.weight", (0, 1)), "final_norm": t(prefix + "norm.weight")}
    if not c.tie_word_embeddings:
        params["lm_head"] = lin("lm_head.weight")
    elif "lm_head.weight" in files:
        used.add("lm_head.weight")                       # tied: a saved copy is accepted and ignored
    layers = []
    for i, kind in enumerate(c.layer_types):
        p = f"{prefix}layers.{i}."
        layer = {"input_norm": t(p + "input_layernorm.weight"), "post_norm": t(p + "post_attention_layernorm.weight")}
        if kind == "linear_attention":
            q = p + "linear_attn."
            gl = lin if gdn_transposed else (lambda key: t(key, (0, 1)))
            names = ("in_proj_qkvz", "in_proj_ba") if c.gdn_layout == "qwen3_next" else (
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            mixer = {n: gl(q + n + ".weight") for n in names}
            mixer.update(conv1d=t(q + "conv1d.weight", (0, 2)), dt_bias=t(q + "dt_bias"), A_log=t(q + "A_log"),
                         norm=t(q + "norm.weight"), out_proj=gl(q + "out_proj.weight"))
        else:
            q = p + "self_attn."
            mixer = {n: lin(q + n + ".weight") for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
            mixer.update(q_norm=t(q + "q_norm.weight"), k_norm=t(q + "k_norm.weight"))
        layer["mixer"] = mixer
        m = p + "mlp."
        if c.layer_is_moe(i):
            if m + "experts.gate_up_proj" in files:       # fused [E, 2I, D] / [E, D, I]
                gate_up = t(m + "experts.gate_up_proj", (0, 2, 1))
                down = t(m + "experts.down_proj", (0, 2, 1))
            else:
                gate_up = _Stack([_Cat([lin(f"{m}experts.{e}.gate_proj.weight"),
                                        lin(f"{m}experts.{e}.up_proj.weight")], 1) for e in range(c.num_experts)])
                down = _Stack([lin(f"{m}experts.{e}.down_proj.weight") for e in range(c.num_experts)])
            ffn = {"router": lin(m + "gate.weight"), "experts_gate_up": gate_up, "experts_down": down}
            if c.shared_expert_intermediate_size:
                ffn["shared_expert"] = mlp(m + "shared_expert.")
                ffn["shared_expert_gate"] = lin(m + "shared_expert_gate.weight")
        else:
            ffn = mlp(m)
        layer["ffn"] = ffn
        layers.append(layer)
    return params, layers, used


def load_sharded_params(path: str, config: HybridConfig, dtype, rules) -> dict:
    """The model's stacked params placed on ``rules.mesh`` (a :class:`jax_gdn.sharding.ShardRules`) straight from
    the safetensors files: every device's slice is read with ``get_slice`` (only its rows / columns, cast on the
    host, sent to that device), so the host holds one slice of one leaf at a time, never the model. Shapes are
    checked against the config before any tensor is read (ValueError naming the tensor); so are tensors stored in
    two files, non-float tensors and tensors the model does not use."""
    import jax
    from jax.sharding import NamedSharding
    from safetensors import SafetensorError, safe_open

    from jax_gdn.model import init_params, layer_plan
    from jax_gdn.sharding import _gdn_hidden_axis

    files = {}                                             # tensor -> (handle, stored shape)
    file_of = {}                                           # tensor -> the file it was found in
    for fn in _safetensor_files(path):
        full = os.path.join(path, fn)
        try:
            handle = safe_open(full, framework="np")
        except (SafetensorError, OSError) as err:
            raise ValueError(f"load_pretrained: {full!r} is not a readable safetensors file: {err}") from None
        for key in handle.keys():
            if any(rx.match(key) for rx in _SKIP):
                continue
            if key in files:
                raise ValueError(f"load_pretrained: tensor {key!r} is stored in two files of {path!r}: "
                                 f"{file_of[key]!r} and {fn!r}")
            sl = handle.get_slice(key)
            if not sl.get_dtype().startswith(("F", "BF")):
                raise ValueError(f"load_pretrained: tensor {key!r} in {full!r} is {sl.get_dtype()}; the model's "
                                 f"parameters are floating point (a quantized checkpoint is not supported)")
            files[key] = (handle, tuple(sl.get_shape()))
            file_of[key] = fn
    prefix = _text_prefix(files, config)
    gdn_transposed = _gdn_hidden_axis(config.gdn_layout).get("out_proj", 1) == 1   # model keeps [in, out]
    top, layers, used = _sources(config, files, prefix, gdn_transposed)
    extra = sorted(set(files) - used)
    if extra:
        raise ValueError(f"checkpoint: unexpected tensor(s) for {config.model_type} with this config: {extra[:8]}"
                         + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))
    plan = layer_plan(config)
    p, r = plan.period, plan.repeats
    import jax.tree_util as jtu
    leaf = lambda x: isinstance(x, (_Src, _Cat, _Stack))  # noqa: E731
    period = tuple(jtu.tree_map(lambda *xs: _Stack(list(xs)), *[layers[k * p + j] for k in range(r)], is_leaf=leaf)
                   for j in range(p))
    sources = {**top, "period": period, "tail": tuple(layers[i] for i in plan.tail)}
    want = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), dtype))

    def check(kp, src, spec):
        if tuple(src.shape) != tuple(spec.shape):
            raise ValueError(f"checkpoint: parameter {jtu.keystr(kp)} reads shape {tuple(src.shape)} from the "
                             f"checkpoint, the config implies {tuple(spec.shape)}")
    jtu.tree_map_with_path(check, sources, want, is_leaf=leaf)

    def place(kp, src):
        name, lead = rules._leaf_name(kp)
        cast = _param_dtype(name, dtype)
        split = rules.split(name, tuple(src.shape[lead:]))
        spec = rules._spec(name, src, lead)
        sharding = NamedSharding(rules.mesh, spec)
        if split is None:
            return jax.make_array_from_callback(src.shape, sharding,
                                                lambda index: np.asarray(src.read(None), cast))
        ax = lead + split.axis
        shape = list(src.shape)
        shape[ax] = split.local_size * rules.n

        def piece(index):
            dev = (index[ax].start or 0) // split.local_size
            return np.concatenate([np.asarray(src.read(ax, a, b), cast) for a, b in split.ranges[dev]], axis=ax)
        return jax.make_array_from_callback(tuple(shape), sharding, piece)
    return jtu.tree_map_with_path(place, sources, is_leaf=leaf)


# ================================================================================================================
# Random HF-named weights (demo, benchmarks, tests): every norm, A_log, dt_bias, conv and gate randomised
# ================================================================================================================
def random_state_dict(config: HybridConfig, seed: int = 0, std: float = 0.05) -> Dict[str, np.ndarray]:
    """HF-named random fp32 tensors for ``config`` in the text-model naming (``model.*``, per-expert MoE)."""
    rng = np.random.default_rng(seed)
    c = config
    d, vocab = c.hidden_size, c.vocab_size
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    h, hkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def w(*shape, s=std):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def norm(n):
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    sd = {"model.embed_tokens.weight": w(vocab, d, s=0.5), "model.norm.weight": norm(d)}
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = w(vocab, d, s=0.2)
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(d)
        sd[p + "post_attention_layernorm.weight"] = norm(d)
        if kind == "linear_attention":
            q = p + "linear_attn."
            if c.gdn_layout == "qwen3_next":
                sd[q + "in_proj_qkvz.weight"] = w(2 * hk * dk + 2 * hv * dv, d, s=0.2)
                sd[q + "in_proj_ba.weight"] = w(2 * hv, d, s=0.2)
            else:
                sd[q + "in_proj_qkv.weight"] = w(2 * hk * dk + hv * dv, d, s=0.2)
                sd[q + "in_proj_z.weight"] = w(hv * dv, d, s=0.2)
                sd[q + "in_proj_b.weight"] = w(hv, d, s=0.2)
                sd[q + "in_proj_a.weight"] = w(hv, d, s=0.2)
            sd[q + "conv1d.weight"] = w(2 * hk * dk + hv * dv, 1, c.linear_conv_kernel_dim, s=0.3)
            sd[q + "dt_bias"] = (rng.standard_normal(hv) * 0.5).astype(np.float32)
            sd[q + "A_log"] = np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32)
            sd[q + "norm.weight"] = (1.0 + rng.standard_normal(dv) * 0.1).astype(np.float32)
            sd[q + "out_proj.weight"] = w(d, hv * dv)
        else:
            q = p + "self_attn."
            sd[q + "q_proj.weight"] = w(h * 2 * dh, d, s=0.2)
            sd[q + "k_proj.weight"] = w(hkv * dh, d, s=0.2)
            sd[q + "v_proj.weight"] = w(hkv * dh, d, s=0.2)
            sd[q + "o_proj.weight"] = w(d, h * dh)
            sd[q + "q_norm.weight"] = norm(dh)
            sd[q + "k_norm.weight"] = norm(dh)
        m = p + "mlp."
        if c.layer_is_moe(i):
            e, inter = c.num_experts, c.moe_intermediate_size
            sd[m + "gate.weight"] = w(e, d, s=0.5)
            for j in range(e):
                sd[f"{m}experts.{j}.gate_proj.weight"] = w(inter, d)
                sd[f"{m}experts.{j}.up_proj.weight"] = w(inter, d)
                sd[f"{m}experts.{j}.down_proj.weight"] = w(d, inter)
            if c.shared_expert_intermediate_size:
                si = c.shared_expert_intermediate_size
                sd[m + "shared_expert.gate_proj.weight"] = w(si, d)
                sd[m + "shared_expert.up_proj.weight"] = w(si, d)
                sd[m + "shared_expert.down_proj.weight"] = w(d, si)
                sd[m + "shared_expert_gate.weight"] = w(1, d, s=0.3)
        else:
            sd[m + "gate_proj.weight"] = w(c.intermediate_size, d)
            sd[m + "up_proj.weight"] = w(c.intermediate_size, d)
            sd[m + "down_proj.weight"] = w(d, c.intermediate_size)
    return sd


def random_model(config: HybridConfig, seed: int = 0, dtype=jnp.float32, backend: str = "auto"):
    """A HybridModel with random weights (through the same conversion as load_pretrained)."""
    from jax_gdn.model import HybridModel
    return HybridModel(config, params_from_state_dict(config, random_state_dict(config, seed), dtype),
                       dtype=dtype, backend=backend)
