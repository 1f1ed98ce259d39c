"""jax_gdn.sharding on 4 CPU devices: the model split over meshes of 2 and 4 gives one device's logits.

The checks run in ONE subprocess (``tests/model/sharding_check.py``) that sets
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and ``JAX_PLATFORMS=cpu`` before importing jax (this pytest
process has one device); it prints every measured error and the test asserts on them:

* tiny Qwen3-Next (fused in_proj_qkvz, dense + MoE layers, untied head, vocab 66: split on 2 devices and
  replicated on 4; tensor-parallel experts) on a mesh of 2 (on 4 its layout only: its logits there are the
  expert-parallel run's) and tiny Qwen3.5 (separate in_proj_qkv, tied head split over the
  vocabulary) on 4; the GDN rule runs the Pallas kernel in interpret mode inside shard_map: packed prefill of
  1 / 5 / 63 / 65 tokens in permuted slots, chunked continuation with a fresh stream joining, three decode steps,
  release + fresh prefill: every logit within 1e-5 of the one-device model (fp32, max |diff| / max |logit|);
* each device holds only its slice (in_proj columns / n; embeddings split over the vocabulary);
* ``init_params(mesh=)`` is made on the devices in the sharded layout and taken as is, replicated kv heads are
  copies;
* HF parity under a mesh of 2: a tiny transformers Qwen3-Next saved in several safetensors files, loaded with
  ``load_pretrained(mesh=)`` (each device reads its slices), within 2e-4 of HF's logits; the same checkpoint with
  fused experts (``experts.gate_up_proj``) loads to the same sharded params;
* a mesh of 4 over 2 key heads / 6 attention heads / 3 kv heads: ValueError naming the mesh size and the counts;
* expert parallel (``moe_sharding="expert"``, jax_gdn.layers.moe_ep): the whole tiny Qwen3-Next on a mesh of 4
  (XLA MoE) against the same one-device run (1e-5), each device holding 2 of the 8 experts whole; the MoE layer
  alone in shard_map on meshes of 1, 2 and 4 (XLA at T 1 / 130, the kernels in interpret mode at T 65; top 3 of
  8 experts: more than a device's 2) against the one-device layer; a checkpoint loads whole experts per device;
  6 experts on 4 devices are refused naming num_experts; the default moe_sharding "auto" resolves to "expert"
  for 8 experts on 4 devices and to "tensor" for 6.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.xla_env import subprocess_xla_flags

#: every test of the module on one xdist worker (``--dist loadgroup``): the subprocess runs once
pytestmark = pytest.mark.xdist_group("sharding")

SCRIPT = os.path.join(os.path.dirname(__file__), "sharding_check.py")
TOL = 1e-5        # fp32: the same program split over devices (psum order differs from one matmul)
HF_TOL = 2e-4     # as tests/model/test_hf_parity.py


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags("--xla_force_host_platform_device_count=4"),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"sharding_check.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", ["qwen3_next/mesh2", "qwen3_5/mesh4"])
def test_sharded_logits_equal_one_device(result, case):
    assert result[f"equal/{case}"] <= TOL, result[f"equal/{case}"]
    assert result[f"fork_gap/{case}"] <= TOL, result[f"fork_gap/{case}"]    # a forked slot continues as its source


def test_each_device_holds_its_slice(result):
    # qwen3_next in_proj_qkvz [R, D, Hk (2K + 2rV)] = [2, 32, 4 * 32]: 128 / n columns per device
    for n in (2, 4):
        assert result[f"gdn_local_cols/qwen3_next/mesh{n}"] == [128 // n] * n
    # qwen3_5 in_proj_qkv [R, D, 2 Hk K + Hv V] = 96 columns ([q_i | k_i | v_i] per device)
    assert result["gdn_local_cols/qwen3_5/mesh4"] == [24] * 4
    assert result["embed_split/qwen3_next/mesh2"] and result["embed_split/qwen3_5/mesh4"]
    assert not result["embed_split/qwen3_next/mesh4"]        # vocab 66 is not a multiple of 4: replicated


def test_random_params_made_sharded(result):
    assert result["random/is_placed"]
    assert result["random/q_proj_equal"]
    assert result["random/kv_copies"]
    assert result["random/taken_as_is"]
    assert result["random/host_path_equal"]                  # host arrays sliced per device == device arrays moved


def test_expert_parallel_logits_equal_one_device(result):
    assert result["equal/qwen3_next/ep_mesh4"] <= TOL, result["equal/qwen3_next/ep_mesh4"]
    # experts_gate_up [R, E, D, 2I] = [2, 8, 32, 16]: E / n = 2 whole experts (full width 2I = 16) per device
    assert result["ep_local_experts/mesh4"] == [2] * 4
    assert result["ep_expert_width/mesh4"] == 16


def test_expert_parallel_moe_layer(result):
    errs = result["moe_ep_layer"]
    assert len(errs) == 9, sorted(errs)               # meshes 1, 2, 4 x (xla: T 1, 130; interpret: T 65)
    for key, err in errs.items():
        assert err <= TOL, (key, err)


def test_moe_sharding_checked_without_a_mesh():
    from jax_gdn.config import preset
    from jax_gdn.model import HybridModel
    with pytest.raises(ValueError, match="moe_sharding"):
        HybridModel(preset("tiny"), {}, moe_sharding="experts")     # refused before the params are read


def test_hf_parity_under_a_mesh_of_two(result):
    if "hf/skipped" in result:
        pytest.skip(result["hf/skipped"])
    assert result["hf/mesh2"] <= HF_TOL, result["hf/mesh2"]
    assert result["hf/fused_experts_equal"]          # fused experts.gate_up_proj / down_proj: the same slices
    assert result["hf/ep_experts_equal"]             # expert parallel: 3 of the 6 experts per device, unchanged
    # in_proj_qkvz [R=1, D, Hk (2K + 2rV)] = [1, 32, 2 * 88]: one key-head group per device
    assert result["hf/in_proj_qkvz_shards"] == [[1, 32, 88], [1, 32, 88]]


def test_mesh_that_does_not_divide_the_heads(result):
    msg = result["error/message"]
    assert msg is not None, "a mesh of 4 over 2 GDN key heads was accepted"
    for part in ("4 devices", "linear_num_key_heads=2", "num_attention_heads=6", "num_key_value_heads=3"):
        assert part in msg, msg
    assert result["error/two_axes"] is not None and "one axis" in result["error/two_axes"]
    assert result["error/ep_experts"] is not None and "num_experts=6" in result["error/ep_experts"]
    assert result["error/moe_sharding"] is not None and "moe_sharding" in result["error/moe_sharding"]
    assert result["auto/8_experts_mesh4"] == "expert"        # the default: expert parallel where n divides E
    assert result["auto/6_experts_mesh4"] == "tensor"
