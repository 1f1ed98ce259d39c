"""Checkpoint directories on disk (jax_gdn.checkpoint.read_state_dict / load_pretrained): which files are read (an
index's shards, else model.safetensors, else every *.safetensors), and the errors that name the file and the
tensor: a malformed index, a tensor stored in two files, an integer or bool tensor where the model has floats, a
config.json that is not JSON or misses a field; and the one shape check both loaders (one device, ``mesh=``) run
alike: a missing, unexpected or mis-shaped tensor (q_norm stored [Dh, 1], conv1d [C, 2, Kc]) named with its file
and the expected shape, before any tensor is read. Tiny safetensors files written to tmp_path."""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from safetensors.numpy import save_file

from jax_gdn import HybridConfig, load_pretrained
from jax_gdn.checkpoint import random_state_dict, read_state_dict

INDEX = "model.safetensors.index.json"
CFG = HybridConfig(model_type="qwen3_next", vocab_size=32, hidden_size=16, num_hidden_layers=2,
                   layer_types=("linear_attention", "full_attention"), intermediate_size=24,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5,
                   linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                   num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0)


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((3, 4)).astype(np.float32),
            "b.norm.weight": rng.standard_normal(4).astype(np.float32),
            "c.A_log": rng.standard_normal(2).astype(np.float16),
            "mtp.d.weight": rng.standard_normal((2, 2)).astype(np.float32)}


def _write_shards(d, shards, index=None):
    """shards: file name -> {tensor: array}; index: the index file's JSON (a dict or raw text), or None."""
    for fn, tensors in shards.items():
        save_file(tensors, str(d / fn))
    if index is not None:
        (d / INDEX).write_text(index if isinstance(index, str) else json.dumps(index))


def _split(sd):
    names = sorted(sd)
    return {"model-00001-of-00002.safetensors": {k: sd[k] for k in names[::2]},
            "model-00002-of-00002.safetensors": {k: sd[k] for k in names[1::2]}}


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


# ------------------------------------------------------------------------------------------------ what is read
def test_sharded_with_index_reads_every_shard(tmp_path):
    sd = _tensors()
    shards = _split(sd)
    _write_shards(tmp_path, shards, {"metadata": {}, "weight_map": {k: fn for fn, t in shards.items() for k in t}})
    save_file({"a.weight": np.zeros((3, 4), np.float32)}, str(tmp_path / "stale.safetensors"))  # not in the index
    got = read_state_dict(str(tmp_path), progress=False)
    _assert_same(got, sd)
    assert all(got[k].dtype == sd[k].dtype for k in sd)          # dtype None: as stored


def test_without_index_reads_every_file_or_model_safetensors(tmp_path):
    sd = _tensors()
    _write_shards(tmp_path, _split(sd))
    _assert_same(read_state_dict(str(tmp_path), progress=False), sd)
    # a model.safetensors beside other files is the checkpoint (the others are not read)
    save_file({"z.weight": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    _assert_same(read_state_dict(str(tmp_path), progress=False), {"z.weight": np.ones(2, np.float32)})


def test_keep_and_dtype(tmp_path):
    sd = _tensors()
    _write_shards(tmp_path, _split(sd))
    got = read_state_dict(str(tmp_path), keep=lambda k: not k.startswith("mtp."), progress=False,
                          dtype=jnp.bfloat16)
    assert sorted(got) == ["a.weight", "b.norm.weight", "c.A_log"]
    assert got["a.weight"].dtype == jnp.bfloat16                 # weights in the model dtype
    assert got["b.norm.weight"].dtype == got["c.A_log"].dtype == jnp.float32  # norms, A_log, dt_bias fp32
    np.testing.assert_allclose(np.asarray(got["c.A_log"]), sd["c.A_log"].astype(np.float32))


# ------------------------------------------------------------------------------------------------ a bad index
BAD_INDEX = [
    ({"metadata": {"total_size": 1}}, r"has no 'weight_map'.*top-level keys: \['metadata'\]"),
    ([1, 2], r"has no 'weight_map'.*list"),
    ("{not json", "is not valid JSON"),
    ({"weight_map": {}}, "'weight_map' of index .* must be a non-empty object"),
    ({"weight_map": ["model.safetensors"]}, "'weight_map' of index .* must be a non-empty object.*list"),
    ({"weight_map": {"a.weight": 3}}, r"maps 'a\.weight' to 3, not a \.safetensors file name"),
    ({"weight_map": {"a.weight": "model-00009-of-00009.safetensors"}},
     r"names shard file\(s\) not in the directory: \['model-00009-of-00009\.safetensors'\]"),
]


@pytest.mark.parametrize("index,match", BAD_INDEX, ids=[m[:30] for _, m in BAD_INDEX])
def test_bad_index_names_the_index_file(tmp_path, index, match):
    _write_shards(tmp_path, {"model.safetensors": _tensors()}, index)
    with pytest.raises(ValueError, match=match) as err:
        read_state_dict(str(tmp_path), progress=False)
    assert str(tmp_path / INDEX) in str(err.value)


def test_no_safetensors_file(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no safetensors file in"):
        read_state_dict(str(tmp_path), progress=False)


def test_unreadable_file_is_named(tmp_path):
    _write_shards(tmp_path, {"model-00001-of-00002.safetensors": {"a.weight": np.ones(2, np.float32)}})
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors' is not a readable safetensors"):
        read_state_dict(str(tmp_path), progress=False)


# ------------------------------------------------------------------------------------------------ bad tensors
def _count_reads(monkeypatch):
    """Counts get_tensor calls (the check must come before any tensor is read or sent to the device)."""
    reads = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            reads.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    return reads


def test_tensor_in_two_files_names_both(tmp_path, monkeypatch):
    a = {"a.weight": np.ones((3, 4), np.float32), "b.weight": np.ones(2, np.float32)}
    b = {"a.weight": np.zeros((3, 4), np.float32), "c.weight": np.ones(2, np.float32)}
    _write_shards(tmp_path, {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b})
    reads = _count_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"tensor 'a\.weight' is stored in two files of .*"
                                         r"'model-00001-of-00002\.safetensors' and 'model-00002-of-00002"):
        read_state_dict(str(tmp_path), progress=False, dtype=jnp.float32)
    assert reads == []
    # a duplicate that keep() drops does not matter
    got = read_state_dict(str(tmp_path), keep=lambda k: k != "a.weight", progress=False)
    assert sorted(got) == ["b.weight", "c.weight"] and reads == ["b.weight", "c.weight"]


def test_tensor_in_two_shards_of_an_index(tmp_path):
    shards = {"model-00001-of-00002.safetensors": {"a.weight": np.ones(2, np.float32)},
              "model-00002-of-00002.safetensors": {"a.weight": np.zeros(2, np.float32),
                                                   "b.weight": np.ones(2, np.float32)}}
    _write_shards(tmp_path, shards, {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                                    "b.weight": "model-00002-of-00002.safetensors"}})
    with pytest.raises(ValueError, match=r"'a\.weight' is stored in two files"):
        read_state_dict(str(tmp_path), progress=False)


@pytest.mark.parametrize("bad", [np.arange(6, dtype=np.int64).reshape(2, 3), np.ones(4, np.int8),
                                 np.ones(4, np.uint8), np.ones(4, bool)], ids=["int64", "int8", "uint8", "bool"])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["as_stored", "bf16"])
def test_integer_tensor_is_an_error_not_a_cast(tmp_path, monkeypatch, bad, dtype):
    _write_shards(tmp_path, {"model-00001-of-00002.safetensors": {"a.weight": np.ones(2, np.float32)},
                             "model-00002-of-00002.safetensors": {"q.qweight": bad}})
    reads = _count_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"tensor 'q\.qweight' in '.*model-00002-of-00002\.safetensors' is "
                                         r"(I64|I8|U8|BOOL); the model's parameters are floating point"):
        read_state_dict(str(tmp_path), progress=False, dtype=dtype)
    assert reads == []                                            # nothing read before the error
    assert sorted(read_state_dict(str(tmp_path), keep=lambda k: k != "q.qweight", progress=False)) == ["a.weight"]


# ------------------------------------------------------------------------------------------------ load_pretrained
def _checkpoint(tmp_path, sd):
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(CFG)))
    _write_shards(tmp_path, _split(sd))


def test_load_pretrained_reads_an_unindexed_sharded_directory(tmp_path):
    sd = random_state_dict(CFG, seed=0)
    _checkpoint(tmp_path, sd)
    model = load_pretrained(str(tmp_path), dtype=jnp.float32, backend="xla", progress=False)
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), sd["model.embed_tokens.weight"])


@pytest.mark.parametrize("what", ["duplicate", "integer"])
def test_load_pretrained_raises_naming_file_and_tensor(tmp_path, what):
    sd = random_state_dict(CFG, seed=0)
    name = "model.layers.0.linear_attn.A_log"
    if what == "integer":
        sd[name] = np.arange(2, dtype=np.int32)
        match = rf"tensor '{name}' in '.*\.safetensors' is I32"
    else:
        save_file({name: sd[name]}, str(tmp_path / "extra.safetensors"))
        match = rf"tensor '{name}' is stored in two files .*extra\.safetensors"
    _checkpoint(tmp_path, sd)
    with pytest.raises(ValueError, match=match):
        load_pretrained(str(tmp_path), dtype=jnp.float32, backend="xla", progress=False)


def test_sharded_load_names_both_files_of_a_duplicate_tensor(tmp_path):
    """The per-device loader (load_pretrained(mesh=...)) names the two files too (here a mesh of one device)."""
    import jax
    sd = random_state_dict(CFG, seed=0)
    name = "model.layers.0.linear_attn.A_log"
    save_file({name: sd[name]}, str(tmp_path / "extra.safetensors"))
    _checkpoint(tmp_path, sd)
    mesh = jax.make_mesh((1,), ("model",))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is stored in two files of .*: '.*' and '.*'"):
        load_pretrained(str(tmp_path), dtype=jnp.float32, backend="xla", progress=False, mesh=mesh)


# ------------------------------------------------------------------------------------------------ both loaders alike
def _mesh_of_one():
    import jax
    return jax.make_mesh((1,), ("model",))


@pytest.mark.parametrize("text,match", [("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list")])
def test_config_json_that_is_not_an_object_names_the_file(tmp_path, text, match):
    _checkpoint(tmp_path, random_state_dict(CFG, seed=0))
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_pretrained(str(tmp_path), dtype=jnp.float32, backend="xla", progress=False)
    assert str(tmp_path / "config.json") in str(err.value)


def test_config_field_error_names_the_file(tmp_path):
    _checkpoint(tmp_path, random_state_dict(CFG, seed=0))
    cfg = dataclasses.asdict(CFG)
    del cfg["linear_num_key_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*missing field 'linear_num_key_heads'") as err:
        load_pretrained(str(tmp_path), dtype=jnp.float32, backend="xla", progress=False)
    assert str(tmp_path / "config.json") in str(err.value)


# stored tensors the config does not imply: both loaders refuse each with the same message, naming the tensor, its
# file and the expected shape, before any tensor is read
CONV = "model.layers.0.linear_attn.conv1d.weight"          # [C, 1, Kc], C = 2 * 1 * 8 + 2 * 8 = 32, Kc = 4
Q_NORM = "model.layers.1.self_attn.q_norm.weight"          # [Dh] = [8]
BAD_TENSORS = {
    "q_norm [8, 1]": (lambda sd: sd.update({Q_NORM: sd[Q_NORM][:, None]}),
                      rf"tensor '{Q_NORM}' has shape \(8, 1\) in '.*\.safetensors', the config implies \(8,\)"),
    "conv1d [C, 2, Kc]": (lambda sd: sd.update({CONV: np.concatenate([sd[CONV]] * 2, axis=1)}),
                          rf"tensor '{CONV}' has shape \(32, 2, 4\) in '.*\.safetensors', the config implies "
                          rf"\(32, 1, 4\)"),
    "missing": (lambda sd: sd.pop(Q_NORM), rf"checkpoint '.*': missing tensor '{Q_NORM}' \(expected shape \(8,\)\)"),
    "unexpected": (lambda sd: sd.update({"model.layers.0.linear_attn.bogus": np.ones(3, np.float32)}),
                   r"unexpected tensor\(s\) .*'model\.layers\.0\.linear_attn\.bogus' in '.*\.safetensors'"),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "mesh"])
@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_both_loaders_refuse_a_bad_tensor_alike(tmp_path, monkeypatch, case, sharded):
    edit, match = BAD_TENSORS[case]
    sd = random_state_dict(CFG, seed=0)
    edit(sd)
    _checkpoint(tmp_path, sd)
    reads = _count_reads(monkeypatch)
    with pytest.raises(ValueError, match=match):
        load_pretrained(str(tmp_path), dtype=jnp.float32, backend="xla", progress=False,
                        mesh=_mesh_of_one() if sharded else None)
    assert reads == []


def test_mesh_loader_reads_a_good_checkpoint(tmp_path):
    sd = random_state_dict(CFG, seed=0)
    _checkpoint(tmp_path, sd)
    model = load_pretrained(str(tmp_path), dtype=jnp.float32, backend="xla", progress=False, mesh=_mesh_of_one())
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), sd["model.embed_tokens.weight"])
