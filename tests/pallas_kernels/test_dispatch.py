"""The one dispatch point of each op: which kernel "auto" runs on every platform x call kind x dims / dtype.

The GDN picks are pinned black-box: every kernel entry point the op can reach is replaced by a stub that records
its name, the platform is faked (``jax.default_backend``, the Triton GPU probe, ``mosaic_gpu.is_hopper``) and the
public op is called; the stub's name is the pick. The tables (``pallas_kernels.dispatch``) must give the same
names, and the README table is printed from them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta_rule import api
from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mg
from pallas_kernels.gated_delta_rule.mosaic_gpu import decode as dm
from pallas_kernels.gated_delta_rule.mosaic_gpu import varlen as mv
from pallas_kernels.gated_delta_rule.triton import chunk as tc
from pallas_kernels.gated_delta_rule.triton import decode as td
from pallas_kernels.gated_delta_rule.triton import recurrent_varlen as rv

PLATFORMS = ("cpu", "other", "hopper")
DIMS = {"bf16-128": (jnp.bfloat16, 128), "fp32-128": (jnp.float32, 128), "bf16-96": (jnp.bfloat16, 96),
        "bf16-64": (jnp.bfloat16, 64), "bf16-256": (jnp.bfloat16, 256)}
CALLS = ("dense", "varlen", "slots", "short_mix", "decode")

#: what "auto" ran before the tables (the code of the four-layer dispatch), per platform, call kind and dims
AUTO_PICKS = {}
for _d in DIMS:
    for _c in CALLS:
        AUTO_PICKS["cpu", _c, _d] = "xla"
        triton = {"short_mix": "triton.recurrent_varlen", "decode": "triton.decode"}.get(_c, "triton.chunk")
        AUTO_PICKS["other", _c, _d] = "xla" if _d == "bf16-256" else triton
        if _d == "bf16-256":
            AUTO_PICKS["hopper", _c, _d] = "xla"
        elif _c == "short_mix":
            AUTO_PICKS["hopper", _c, _d] = "triton.recurrent_varlen"
        elif _c == "decode":       # the Mosaic decode kernel takes K, V in {64, 128}, any float dtype
            AUTO_PICKS["hopper", _c, _d] = "mosaic_gpu.decode" if _d != "bf16-96" else "triton.decode"
        elif _d in ("bf16-128", "bf16-64"):
            AUTO_PICKS["hopper", _c, _d] = "mosaic_gpu.varlen" if _c != "dense" else "mosaic_gpu.chunk"
        else:
            AUTO_PICKS["hopper", _c, _d] = "triton.chunk"


def _fake_platform(monkeypatch, platform: str):
    gpu = platform != "cpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu" if gpu else "cpu")
    monkeypatch.setattr(tc, "_has_gpu", lambda: gpu)
    monkeypatch.setattr(mg, "is_hopper", lambda: platform == "hopper")


def _stub_kernels(monkeypatch) -> list:
    ran = []

    def prefill(name):
        def fn(q, k, v, g, beta, **kw):
            ran.append(name)
            if "ssm_state" in kw:
                return jnp.zeros(v.shape, v.dtype), kw["ssm_state"]
            return jnp.zeros(v.shape, v.dtype), None
        return fn

    for mod, attr, name in [(rv, "recurrent_varlen_fwd", "triton.recurrent_varlen"),
                            (rv, "recurrent_varlen_slots_fwd", "triton.recurrent_varlen"),
                            (mg, "op_fwd", "mosaic_gpu.chunk"), (mv, "op_fwd", "mosaic_gpu.varlen"),
                            (mv, "op_fwd_slots", "mosaic_gpu.varlen"),
                            (tc, "chunk_gated_delta_rule_fwd", "triton.chunk"),
                            (tc, "chunk_gated_delta_rule_slots_fwd", "triton.chunk"),
                            (api, "chunk_gated_delta_rule_xla", "xla"),
                            (api, "chunk_gated_delta_rule_slots_xla", "xla"),
                            (api, "fused_recurrent_gated_delta_rule_slots_xla", "xla"),
                            (dm, "fused_recurrent_gated_delta_rule_slots_fwd", "mosaic_gpu.decode")]:
        monkeypatch.setattr(mod, attr, prefill(name))

    def triton_decode(q, k, v, g, beta, *, pool, **kw):
        ran.append("triton.decode")
        return jnp.zeros(v.shape, v.dtype), pool
    monkeypatch.setattr(td, "fused_recurrent_slots", triton_decode)
    return ran


def _inputs(call: str, dims: str):
    dtype, d = DIMS[dims]
    b, t, cu = {"dense": (2, 64, None), "varlen": (1, 128, [0, 64, 128]), "slots": (2, 64, None),
                "short_mix": (1, 16, [0, 8, 16]), "decode": (2, 1, None)}[call]
    q = jnp.ones((b, t, 2, d), dtype)
    v = jnp.ones((b, t, 4, d), dtype)
    g = jnp.full((b, t, 4), -0.1, jnp.float32)
    beta = jnp.full((b, t, 4), 0.5, dtype)
    return q, v, g, beta, (None if cu is None else np.asarray(cu, np.int32))


def run_op(call: str, dims: str, backend: str = "auto"):
    """The public op for one call kind (its kernels stubbed by the caller)."""
    q, v, g, beta, cu = _inputs(call, dims)
    d = q.shape[3]
    pool = jnp.zeros((4, 4, d, d), jnp.float32)
    if call == "decode":
        return api.fused_recurrent_gated_delta_rule_slots(q, q, v, g, beta, ssm_state=pool,
                                                          slot_ids=np.arange(q.shape[0], dtype=np.int32),
                                                          backend=backend)
    if call in ("slots", "short_mix"):
        n = q.shape[0] if cu is None else len(cu) - 1
        return api.chunk_gated_delta_rule_slots(q, q, v, g, beta, ssm_state=pool,
                                                slot_ids=np.arange(n, dtype=np.int32),
                                                has_initial_state=np.ones(n, bool), cu_seqlens=cu,
                                                backend=backend)
    return api.chunk_gated_delta_rule(q, q, v, g, beta, cu_seqlens=cu, output_final_state=True, backend=backend)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_auto_picks_pinned(monkeypatch, platform):
    _fake_platform(monkeypatch, platform)
    ran = _stub_kernels(monkeypatch)
    got = {}
    for dims in DIMS:
        for call in CALLS:
            del ran[:]
            run_op(call, dims)
            got[platform, call, dims] = ran[0] if len(ran) == 1 else tuple(ran)
    want = {key: AUTO_PICKS[key] for key in got}
    assert got == want
