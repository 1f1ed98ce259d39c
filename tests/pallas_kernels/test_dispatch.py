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


@pytest.mark.parametrize("platform", PLATFORMS)
def test_table_gives_the_pinned_picks(platform):
    """The GDN table, asked directly for each case, names the kernel the op ran (the pins above)."""
    for dims in DIMS:
        for call in CALLS:
            q, v, g, beta, cu = _inputs(call, dims)
            form = {"short_mix": "varlen"}.get(call, call)
            n = q.shape[0] if cu is None else len(cu) - 1
            case = api.GdnCase.of(form, q, q, v, num_seqs=n, platform="cpu" if platform == "cpu" else "gpu",
                                  hopper=platform == "hopper")
            assert case.call == call
            assert api.TABLE.resolve("auto", case).name == AUTO_PICKS[platform, call, dims], (platform, call, dims)


def test_explicit_names(monkeypatch):
    """Explicit names: "pallas" is Triton on every call kind (decode included, also on Hopper), "mosaic_gpu" runs
    Mosaic where it takes the call and "pallas" with a warning naming the reason elsewhere; a name that cannot
    run raises ValueError naming the argument and the reason."""
    _fake_platform(monkeypatch, "hopper")
    ran = _stub_kernels(monkeypatch)
    for call in CALLS:
        del ran[:]
        run_op(call, "bf16-128", backend="pallas")
        want = {"short_mix": "triton.recurrent_varlen", "decode": "triton.decode"}.get(call, "triton.chunk")
        assert ran == [want], call
    del ran[:]
    run_op("decode", "bf16-128", backend="mosaic_gpu")
    assert ran == ["mosaic_gpu.decode"]
    del ran[:]
    with pytest.warns(UserWarning, match=r"gated_delta_rule\(backend='mosaic_gpu'\) runs 'pallas': .*16-bit"):
        run_op("dense", "fp32-128", backend="mosaic_gpu")
    assert ran == ["triton.chunk"]
    with pytest.raises(ValueError, match=r"backend 'pallas' cannot run gated_delta_rule here \(dense call\): "
                                         r"pallas gated delta rule: head dims K \(got 256\)"):
        run_op("dense", "bf16-256", backend="pallas")
    with pytest.raises(ValueError, match="backend must be one of"):
        run_op("dense", "bf16-128", backend="triton")


def test_dispatch_config_and_case_checks():
    with pytest.raises(ValueError, match="short_mix_max_mean_len"):
        api.DispatchConfig(short_mix_max_mean_len=1.5)
    q = jax.ShapeDtypeStruct((1, 16, 2, 64), jnp.bfloat16)
    assert api.GdnCase.of("varlen", q, q, q, num_seqs=2, platform="gpu", hopper=False).call == "short_mix"
    off = api.DispatchConfig(short_mix_max_mean_len=0)
    assert api.GdnCase.of("varlen", q, q, q, num_seqs=2, dispatch=off, platform="gpu", hopper=False).call == "varlen"
    with pytest.raises(ValueError, match="call must be one of"):
        api.GdnCase("prefill", "dense", q, q, q, "gpu", False)


def test_op_table_base():
    from pallas_kernels.dispatch import Implementation, OpTable
    always = lambda case: None                                      # noqa: E731
    never = lambda case: "never here"                               # noqa: E731
    with pytest.raises(ValueError, match="unique"):
        OpTable("op", (Implementation("a", ("x",), "", always), Implementation("a", ("y",), "", always)))
    with pytest.raises(ValueError, match="'auto' is not a backend name"):
        Implementation("a", ("auto",), "", always)
    with pytest.raises(ValueError, match="backends must be a non-empty tuple"):
        Implementation("a", "x", "", always)
    with pytest.raises(ValueError, match="unknown backend"):
        OpTable("op", (Implementation("a", ("x",), "", always),), fallbacks=(("x", "z"),))
    with pytest.raises(ValueError, match="unknown call kinds"):
        OpTable("op", (Implementation("a", ("x",), "", always, calls=("c",)),), call_kinds=("d",))
    t = OpTable("op", (Implementation("fast", ("k",), "", never), Implementation("slow", ("s",), "", always),
                       Implementation("debug", ("d",), "", never, auto=False)))
    assert t.backends == ("auto", "k", "s", "d")
    assert t.resolve("auto", None).name == "slow"
    with pytest.raises(ValueError, match="impl 'k' cannot run op here: never here"):
        t.resolve("k", None, argument="impl")
    assert t.why_not("k", None) == "never here" and t.why_not("s", None) is None


def test_other_tables_and_registry():
    from pallas_kernels import registry
    from pallas_kernels.conv1d import api as conv_api
    from pallas_kernels.moe import api as moe_api
    from pallas_kernels.paged_attention import api as pa_api
    hopper = pa_api.PagedCase("prefill", "gpu", jnp.bfloat16, 256, 16, 2, hopper=True)
    assert pa_api.TABLE.resolve("auto", hopper).name == "cudnn"
    assert pa_api.TABLE.resolve("auto", pa_api.PagedCase("decode", "gpu", jnp.bfloat16, 256, 16, 2,
                                                         hopper=True)).name == "triton"
    assert pa_api.TABLE.resolve("auto", pa_api.PagedCase("prefill", "gpu", jnp.float32, 256, 16, 2,
                                                         hopper=True)).name == "triton"
    assert pa_api.TABLE.resolve("auto", pa_api.PagedCase("prefill", "gpu", jnp.bfloat16, 96, 16, 2,
                                                         hopper=False)).name == "xla"
    assert pa_api.TABLE.resolve("cudnn", pa_api.PagedCase("decode", "cpu", jnp.bfloat16, 256, 16, 2)).name == \
        "cudnn.decode.xla"
    assert moe_api.TABLE.resolve("auto", moe_api.MoeCase("experts", "gpu", jnp.bfloat16, 8, 32, 24)).name == "xla"
    assert moe_api.TABLE.resolve("auto", moe_api.MoeCase("experts", "gpu", jnp.bfloat16, 8, 32, 64)).name == "triton"
    assert moe_api.TABLE.resolve("pallas", moe_api.MoeCase("routing", "gpu", jnp.bfloat16, 6, 0, 0, 2)).name == \
        "xla.routing"
    assert conv_api.TABLE.resolve("auto", conv_api.ConvCase("decode", "gpu", jnp.bfloat16, 96, 96)).name == "xla"
    assert conv_api.TABLE.resolve("auto", conv_api.ConvCase("prefill", "gpu", jnp.bfloat16, 96, 96)).name == \
        "triton"
    text = registry.markdown()
    for op in registry.OPS:
        assert f"### {op}" in text
    assert "| Hopper GPU | `mosaic_gpu.chunk` | `mosaic_gpu.varlen` | `mosaic_gpu.varlen` | " \
           "`triton.recurrent_varlen` | `mosaic_gpu.decode` |" in text
    assert "| Hopper GPU, bf16 | `cudnn` | `triton` |" in text


def test_no_environment_reads_in_the_dispatch():
    """The dispatch reads no environment variable (at import or trace): the tables are data."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    files = ["pallas_kernels/dispatch.py", "pallas_kernels/registry.py", "pallas_kernels/gated_delta_rule/api.py",
             "pallas_kernels/paged_attention/api.py", "pallas_kernels/moe/api.py", "pallas_kernels/conv1d/api.py",
             "jax_gdn/layers/ffn.py"]
    for f in files:
        assert "environ" not in (root / f).read_text(), f
