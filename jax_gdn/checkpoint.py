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

Errors are ValueError naming the file and the tensor or field, the same with or without a mesh, all raised before
any tensor is read: config.json missing, not JSON, an unknown model_type or a missing field; from the safetensors
headers (``scan_checkpoint``), an index that is not JSON, has no ``weight_map`` or names a shard that is missing,
a tensor stored in two files (never silently the last one), an integer or bool tensor (never cast to float
silently), a file safetensors cannot open; then (``check_tensors``, against ``hf_tensor_shapes``: the one place
the stored shapes are written) a missing or unexpected tensor, a stored shape not matching the config.

Shape legend: D hidden, Vocab vocabulary, E experts, I (moe_)intermediate, Hk/Hv GDN key/value heads, K/V GDN head
dims, H/Hkv attention heads, Dh attention head dim, C conv channels, Kc conv kernel.
"""
from __future__ import annotations

import dataclasses
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
    """The ``config.json`` of checkpoint directory ``path`` as a dict. Raises ValueError naming the file when it is
    missing, not JSON, or not a JSON object."""
    fn = os.path.join(path, "config.json")
    if not os.path.isfile(fn):
        raise ValueError(f"load_pretrained: {path!r} has no config.json")
    try:
        with open(fn) as f:
            data = json.load(f)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"load_pretrained: {fn!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"load_pretrained: {fn!r} holds a JSON {type(data).__name__}, expected an object")
    return data


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


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a checkpoint is and what its header says: ``file`` (relative to the directory), its
    ``path``, the stored ``shape`` and the safetensors ``dtype`` name (F32, BF16, F16, ...)."""

    file: str
    path: str
    shape: tuple
    dtype: str


def scan_checkpoint(path: str, keep: Callable[[str], bool] = lambda k: True) -> Dict[str, StoredTensor]:
    """name -> StoredTensor for every tensor ``keep(name)`` accepts, from the safetensors headers of checkpoint
    directory ``path`` (no tensor is read). Raises ValueError, naming the file(s) and the tensor, for a kept tensor
    stored in two files (never silently the last one) and for one that is not floating point (integer or bool:
    every parameter of the model is a float, and a quantized or foreign tensor is never cast silently); naming the
    file for one safetensors cannot open."""
    from safetensors import SafetensorError, safe_open

    found = {}
    for fn in _safetensor_files(path):
        full = os.path.join(path, fn)
        try:
            handle = safe_open(full, framework="np")
        except (SafetensorError, OSError) as err:
            raise ValueError(f"load_pretrained: {full!r} is not a readable safetensors file: {err}") from None
        with handle as f:
            for key in f.keys():
                if not keep(key):
                    continue
                if key in found:
                    raise ValueError(f"load_pretrained: tensor {key!r} is stored in two files of {path!r}: "
                                     f"{found[key].file!r} and {fn!r} (remove the stale one, or name each tensor's "
                                     f"file in {_INDEX})")
                sl = f.get_slice(key)
                stored = sl.get_dtype()
                if not stored.startswith(("F", "BF")):
                    raise ValueError(f"load_pretrained: tensor {key!r} in {full!r} is {stored}; the model's "
                                     f"parameters are floating point (a quantized checkpoint is not supported), "
                                     f"and it is not cast")
                found[key] = StoredTensor(fn, full, tuple(sl.get_shape()), stored)
    return found


def _read_tensors(path: str, stored: Dict[str, StoredTensor], progress: bool, dtype) -> dict:
    """Reads the tensors ``stored`` lists, file by file (tqdm bar over files when there are several)."""
    from safetensors import safe_open

    files = sorted({t.file for t in stored.values()})
    it = files
    if progress and len(files) > 1:
        try:
            from tqdm import tqdm
            it = tqdm(files, desc="loading shards", unit="shard")
        except ImportError:  # pragma: no cover
            pass
    out = {}
    for fn in it:
        with safe_open(os.path.join(path, fn), framework="np") as f:
            for key in f.keys():
                if key in stored and stored[key].file == fn:
                    x = f.get_tensor(key)
                    out[key] = x if dtype is None else jnp.asarray(x, _param_dtype(key, dtype))
    return out


def read_state_dict(path: str, keep: Callable[[str], bool] = lambda k: True, progress: bool = True,
                    dtype=None) -> dict:
    """name -> array for every tensor ``keep(name)`` accepts, over all files of the checkpoint directory ``path``
    (tqdm bar over shards).

    The headers of all files are checked before any tensor is read (``scan_checkpoint``: a tensor in two files,
    a non-float tensor, an unreadable file raise ValueError naming the file(s) and the tensor).

    dtype None: NumPy arrays as stored. Else each tensor goes to the device right after it is read, cast to
    ``dtype`` (norms, A_log, dt_bias to fp32), so the host never holds more than one tensor.
    """
    return _read_tensors(path, scan_checkpoint(path, keep), progress, dtype)


# ================================================================================================================
# HF names -> model params
# ================================================================================================================
def _text_prefix(names, config: HybridConfig) -> str:
    if config.model_type in ("qwen3_5", "qwen3_5_moe") or any(k.startswith("model.language_model.") for k in names):
        return "model.language_model."
    return "model."


def hf_tensor_shapes(config: HybridConfig, names) -> Dict[str, tuple]:
    """HF name -> stored shape of every tensor a checkpoint of ``config`` must hold, in the naming ``names`` (the
    checkpoint's tensor names) uses: the text prefix (``model.`` or ``model.language_model.``) and, per MoE layer,
    fused (``experts.gate_up_proj``) or per-expert weights. A tied model's ``lm_head.weight`` is not listed (a
    saved copy is accepted, see ``check_tensors``). The one place the stored shapes are written down: both
    loaders check against it."""
    c = config
    d, vocab = c.hidden_size, c.vocab_size
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    conv_dim = 2 * hk * dk + hv * dv
    h, hkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    prefix = _text_prefix(names, config)
    out = {prefix + "embed_tokens.weight": (vocab, d), prefix + "norm.weight": (d,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (vocab, d)

    def mlp(p, inter):
        out.update({p + "gate_proj.weight": (inter, d), p + "up_proj.weight": (inter, d),
                    p + "down_proj.weight": (d, inter)})

    for i, kind in enumerate(c.layer_types):
        p = f"{prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        if kind == "linear_attention":
            q = p + "linear_attn."
            if c.gdn_layout == "qwen3_next":
                out.update({q + "in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, d),
                            q + "in_proj_ba.weight": (2 * hv, d)})
            else:
                out.update({q + "in_proj_qkv.weight": (conv_dim, d), q + "in_proj_z.weight": (hv * dv, d),
                            q + "in_proj_b.weight": (hv, d), q + "in_proj_a.weight": (hv, d)})
            out.update({q + "conv1d.weight": (conv_dim, 1, c.linear_conv_kernel_dim), q + "dt_bias": (hv,),
                        q + "A_log": (hv,), q + "norm.weight": (dv,), q + "out_proj.weight": (d, hv * dv)})
        else:
            q = p + "self_attn."
            out.update({q + "q_proj.weight": (h * 2 * dh, d), q + "k_proj.weight": (hkv * dh, d),
                        q + "v_proj.weight": (hkv * dh, d), q + "o_proj.weight": (d, h * dh),
                        q + "q_norm.weight": (dh,), q + "k_norm.weight": (dh,)})
        m = p + "mlp."
        if c.layer_is_moe(i):
            e, inter = c.num_experts, c.moe_intermediate_size
            out[m + "gate.weight"] = (e, d)
            if m + "experts.gate_up_proj" in names:             # fused [E, 2I, D] / [E, D, I]
                out.update({m + "experts.gate_up_proj": (e, 2 * inter, d), m + "experts.down_proj": (e, d, inter)})
            else:                                               # one tensor per expert (released checkpoints)
                for j in range(e):
                    mlp(f"{m}experts.{j}.", inter)
            if c.shared_expert_intermediate_size:
                mlp(m + "shared_expert.", c.shared_expert_intermediate_size)
                out[m + "shared_expert_gate.weight"] = (1, d)
        else:
            mlp(m, c.intermediate_size)
    return out


def check_tensors(config: HybridConfig, shapes: Dict[str, tuple], where: Callable[[str], str],
                  source: str) -> None:
    """Checks a checkpoint's tensors (``shapes``: name -> stored shape, ``mtp.*`` / vision tensors already
    dropped) against ``hf_tensor_shapes(config, shapes)``: raises ValueError for a missing tensor (naming it and
    ``source``, the checkpoint), a tensor whose shape differs from the config's (naming it and ``where(name)``, its
    file) and unexpected tensors (each with its file). Both loaders run this one check before reading a tensor."""
    want = hf_tensor_shapes(config, shapes)
    missing = [k for k in want if k not in shapes]
    if missing:
        raise ValueError(f"checkpoint {source}: missing tensor {missing[0]!r} (expected shape {want[missing[0]]})"
                         + (f" and {len(missing) - 1} more: {missing[1:5]}" if len(missing) > 1 else ""))
    if config.tie_word_embeddings and "lm_head.weight" in shapes:
        want = dict(want, **{"lm_head.weight": (config.vocab_size, config.hidden_size)})  # tied: a copy is ignored
    for k, shape in want.items():
        if tuple(shapes[k]) != tuple(shape):
            raise ValueError(f"checkpoint: tensor {k!r} has shape {tuple(shapes[k])} in {where(k)}, the config "
                             f"implies {tuple(shape)}")
    extra = sorted(set(shapes) - set(want))
    if extra:
        raise ValueError(f"checkpoint: unexpected tensor(s) for {config.model_type} with this config: "
                         + ", ".join(f"{k!r} in {where(k)}" for k in extra[:8])
                         + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))


def _kept(name: str) -> bool:
    """False for the tensors the model never reads: multi-token prediction (``mtp.*``) and the vision tower."""
    return not any(rx.match(name) for rx in _SKIP)


def _gdn_params(sd: dict, p: str, c: HybridConfig) -> dict:
    """The GDN block's mixer: jax_gdn.layers.gdn params without ``input_layernorm`` (which is the block's
    input_norm); HF names, Linear weights transposed to [in, out], conv squeezed to [C, Kc]."""
    names = (("in_proj_qkvz", "in_proj_ba") if c.gdn_layout == "qwen3_next"
             else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    out = {n: sd.pop(p + n + ".weight").T for n in names}
    out["conv1d"] = sd.pop(p + "conv1d.weight")[:, 0, :]
    out["dt_bias"] = sd.pop(p + "dt_bias")
    out["A_log"] = sd.pop(p + "A_log")
    out["norm"] = sd.pop(p + "norm.weight")
    out["out_proj"] = sd.pop(p + "out_proj.weight").T
    return out


def _attn_params(sd: dict, p: str) -> dict:
    out = {n: sd.pop(p + n + ".weight").T for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    out.update(q_norm=sd.pop(p + "q_norm.weight"), k_norm=sd.pop(p + "k_norm.weight"))
    return out


def _mlp_params(sd: dict, p: str) -> dict:
    return {n: sd.pop(p + n + ".weight").T for n in ("gate_proj", "up_proj", "down_proj")}


def _moe_params(sd: dict, p: str, c: HybridConfig) -> dict:
    if p + "experts.gate_up_proj" in sd:                      # fused (transformers >= 5 in-memory layout)
        gate_up = sd.pop(p + "experts.gate_up_proj")
        down = sd.pop(p + "experts.down_proj")
    else:                                                     # one tensor per expert (released checkpoints)
        gate_up = jnp.stack([jnp.concatenate([sd.pop(f"{p}experts.{j}.gate_proj.weight"),
                                              sd.pop(f"{p}experts.{j}.up_proj.weight")], axis=0)
                             for j in range(c.num_experts)])
        down = jnp.stack([sd.pop(f"{p}experts.{j}.down_proj.weight") for j in range(c.num_experts)])
    out = {"router": sd.pop(p + "gate.weight").T,
           "experts_gate_up": jnp.transpose(gate_up, (0, 2, 1)),  # [E, D, 2I]
           "experts_down": jnp.transpose(down, (0, 2, 1))}        # [E, I, D]
    if c.shared_expert_intermediate_size:
        out["shared_expert"] = _mlp_params(sd, p + "shared_expert.")
        out["shared_expert_gate"] = sd.pop(p + "shared_expert_gate.weight").T
    return out


def params_from_state_dict(config: HybridConfig, sd: Dict[str, np.ndarray], dtype=jnp.bfloat16, *,
                           where: Optional[Callable[[str], str]] = None, source: str = "state dict") -> dict:
    """HF-named tensors -> {"embed", "final_norm", "lm_head"?, "layers": [block dict per layer]} (the block layout
    of jax_gdn.layers.block; HybridModel stacks the layers once) as jnp arrays: weights in ``dtype``, norms, A_log
    and dt_bias in fp32. Raises ValueError (``check_tensors``) naming a missing, unexpected or mis-shaped tensor
    and, through ``where(name)``, its file. ``sd`` is not modified (a shallow copy is consumed)."""
    sd = {k: v for k, v in sd.items() if _kept(k)}
    check_tensors(config, {k: tuple(v.shape) for k, v in sd.items()}, where or (lambda k: f"the {source}"), source)
    prefix = _text_prefix(sd, config)
    c = config
    params = {"embed": sd.pop(prefix + "embed_tokens.weight"), "final_norm": sd.pop(prefix + "norm.weight")}
    lm_head = sd.pop("lm_head.weight", None)                  # tied: a saved copy is accepted and ignored
    if not c.tie_word_embeddings:
        params["lm_head"] = lm_head.T
    layers = []
    for i, kind in enumerate(c.layer_types):
        p = f"{prefix}layers.{i}."
        # one block layout for both mixers (jax_gdn.layers.block): the block owns both norms and residuals
        layer = {"input_norm": sd.pop(p + "input_layernorm.weight"),
                 "post_norm": sd.pop(p + "post_attention_layernorm.weight")}
        if kind == "linear_attention":
            layer["mixer"] = _gdn_params(sd, p + "linear_attn.", c)
        else:
            layer["mixer"] = _attn_params(sd, p + "self_attn.")
        layer["ffn"] = _moe_params(sd, p + "mlp.", c) if c.layer_is_moe(i) else _mlp_params(sd, p + "mlp.")
        layers.append(layer)
    params["layers"] = layers

    def cast(path, x):
        name = path[-1].key if hasattr(path[-1], "key") else ""
        return jnp.asarray(x, _param_dtype(name, dtype))

    import jax
    return jax.tree_util.tree_map_with_path(cast, params)


def load_pretrained(path: str, dtype=jnp.bfloat16, *, backend: str = "auto", progress: bool = True, mesh=None,
                    moe_sharding: str = "auto"):
    """Loads a HF checkpoint directory (config.json + safetensors) into a :class:`jax_gdn.model.HybridModel`.

    Before any tensor is read: the config (``read_hf_config``, ``HybridConfig.from_hf``), the safetensors headers
    (``scan_checkpoint``) and every tensor's name and shape against the config (``check_tensors``), the same
    checks with or without a mesh; every error is a ValueError naming the file and the tensor or field.

    mesh: a one-axis jax.sharding.Mesh; each device then reads only its slices of the files
    (``load_sharded_params``, rules of ``jax_gdn.sharding``) and the model runs split over the mesh;
    moe_sharding: "tensor" (expert columns split), "expert" (whole experts split) or "auto" (default: expert where
    the mesh divides the experts), as ``HybridModel``."""
    from jax_gdn.model import HybridModel
    if not os.path.isdir(path):
        raise ValueError(f"load_pretrained: {path!r} is not a directory")
    try:
        config = HybridConfig.from_hf(read_hf_config(path))
    except ValueError as err:
        raise ValueError(f"load_pretrained: {os.path.join(path, 'config.json')!r}: {err}") from None
    stored = scan_checkpoint(path, keep=_kept)
    where = lambda k: repr(stored[k].path)  # noqa: E731
    check_tensors(config, {k: t.shape for k, t in stored.items()}, where, repr(path))
    if mesh is not None:
        from jax_gdn.sharding import ShardRules
        rules = ShardRules(config, mesh, moe_sharding)    # refuses a mesh that does not divide the heads first
        params = load_sharded_params(path, config, dtype, rules, stored=stored)
        return HybridModel(config, params, dtype=dtype, backend=backend, mesh=mesh, moe_sharding=moe_sharding)
    sd = _read_tensors(path, stored, progress, dtype)
    params = params_from_state_dict(config, sd, dtype, where=where, source=repr(path))
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


def load_sharded_params(path: str, config: HybridConfig, dtype, rules,
                        stored: Optional[Dict[str, StoredTensor]] = None) -> dict:
    """The model's stacked params placed on ``rules.mesh`` (a :class:`jax_gdn.sharding.ShardRules`) straight from
    the safetensors files: every device's slice is read with ``get_slice`` (only its rows / columns, cast on the
    host, sent to that device), so the host holds one slice of one leaf at a time, never the model.

    Before any tensor is read, the same checks as the one-device loader: ``scan_checkpoint`` (tensors stored in
    two files, non-float tensors, unreadable files) and ``check_tensors`` (missing, unexpected and mis-shaped
    tensors, each error naming the tensor and its file); ``stored``: that scan, when the caller made it."""
    import jax
    from jax.sharding import NamedSharding
    from safetensors import safe_open

    from jax_gdn.model import init_params, layer_plan
    from jax_gdn.sharding import gdn_hidden_axis

    if stored is None:
        stored = scan_checkpoint(path, keep=_kept)
        check_tensors(config, {k: t.shape for k, t in stored.items()}, lambda k: repr(stored[k].path), repr(path))
    handles = {fn: safe_open(os.path.join(path, fn), framework="np")
               for fn in sorted({t.file for t in stored.values()})}
    files = {k: (handles[t.file], t.shape) for k, t in stored.items()}      # tensor -> (handle, stored shape)
    prefix = _text_prefix(files, config)
    gdn_transposed = gdn_hidden_axis(config.gdn_layout).get("out_proj", 1) == 1   # model keeps [in, out]
    top, layers, _ = _sources(config, files, prefix, gdn_transposed)
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
        name, lead = rules.leaf_name(kp)
        cast = _param_dtype(name, dtype)
        split = rules.split(name, tuple(src.shape[lead:]))
        spec = rules.leaf_spec(name, src, lead)
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
