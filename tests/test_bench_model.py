"""The whole-model benchmark section (jax_gdn.bench_model) in its quick mode on CPU: tiny dims, HF skipped; the
rows, parts and the 48-layer compile measurement come out complete and consistent. Not a measurement."""
from __future__ import annotations

import json
import math

import pytest

from jax_gdn.bench_model import print_section, qwen3_next_80b_config, run_section


def test_80b_config_is_hf_qwen3_next_defaults():
    transformers = pytest.importorskip("transformers")
    from jax_gdn.config import HybridConfig
    ours = qwen3_next_80b_config(8)
    hf = transformers.Qwen3NextConfig(num_hidden_layers=8, layer_types=list(ours.layer_types))
    assert HybridConfig.from_hf(hf.to_dict()) == ours
    assert ours.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.shared_expert_intermediate_size) == (512, 10, 512)


def test_quick_section_runs_on_cpu(capsys):
    sec = run_section(quick=True, reps=1)
    assert sec["errors"] == [], sec["errors"]
    assert sec["layers"] == 8 and sec["quick"]
    json.dumps(sec)                                                       # the JSON key "model" is serialisable

    rows = {r["case"]: r for r in sec["rows"]}
    assert [r["kind"] for r in sec["rows"]] == ["prefill", "prefill", "decode"]
    assert rows["varlen4-T107"]["tokens"] == 107 and rows["B1-T200"]["tokens"] == 200
    assert rows["decode-N8-ctx26"]["tokens"] == 8
    for r in sec["rows"]:
        ms = r["ms"]["ours"]
        assert ms is not None and math.isfinite(ms) and ms > 0, r
        assert r["ms"]["hf"] is None and r["speedup"] is None              # quick: no HF
        assert r["tokens_per_s"]["ours"] == pytest.approx(r["tokens"] / ms * 1e3)
        assert r["first_call_s"] > 0
    # 2 prefill buckets + 1 decode + release programs; the decode context reuses the varlen program's bucket
    assert sec["compiled_programs"] <= 7

    p = sec["parts_ms"]
    assert p["layers"] == {"gdn": 6, "attention": 2, "moe": 8}
    for k in ("gdn_phase1", "gdn_phase2", "gdn_phase3", "attention", "moe", "embed_logits"):
        assert p[k] is not None and p[k] > 0, (k, p.get("errors"))
    assert p["padded_tokens"] >= p["tokens"] == 107
    assert p["model_sum"] == pytest.approx(sum(p["model_sum_split"].values()))
    assert p["model_sum_split"]["gdn"] == pytest.approx(6 * (p["gdn_phase1"] + p["gdn_phase2"] + p["gdn_phase3"]))
    assert p["other"] == pytest.approx(p["model"] - p["model_sum"])
    # both timings of every part: "<part>" pipelined (the floor ratio's), "ms_blocking" each call synced
    assert p["pipe_calls"] == 10 and "pipelined" in p["timing"] and "ms_blocking" in p["timing"]
    assert "parts_ms" in sec["timing"] and "pipelined" in sec["timing"]
    assert set(p["ms_blocking"]) == {"gdn_phase1", "gdn_phase2", "gdn_phase3", "attention", "moe", "embed_logits"}
    for k, b in p["ms_blocking"].items():
        assert b is not None and b > 0 and p["floor_ratio_blocking"][k] == pytest.approx(b / p["floor_ms"][k]), k
    assert p["model_sum_blocking"] == pytest.approx(
        6 * sum(p["ms_blocking"][f"gdn_phase{i}"] for i in (1, 2, 3)) + 2 * p["ms_blocking"]["attention"]
        + 8 * p["ms_blocking"]["moe"] + p["ms_blocking"]["embed_logits"])
    assert p["other_blocking"] == pytest.approx(p["model"] - p["model_sum_blocking"])
    # floors: one per part, the ratio is part / floor; quick: no peers (formula floors)
    assert set(p["floor_ms"]) == {"gdn_phase1", "gdn_phase2", "gdn_phase3", "attention", "moe", "embed_logits"}
    for k, fl in p["floor_ms"].items():
        assert fl > 0 and p["floor_ratio"][k] == pytest.approx(p[k] / fl), k
    assert p["floor_source"] is None and "no kernel bench row" in p["floor_basis"]["gdn_phase2"]
    # decode parts: one step of the decode row's 8 streams, each part timed, the sum over the 8 layers
    d = p["decode"]
    assert (d["case"], d["streams"], d["context"]) == ("decode-N8-ctx26", 8, 26)
    for k in ("gdn_decode", "attention_decode", "moe", "embed_logits"):
        assert d[k] is not None and d[k] > 0, (k, d.get("errors"))
        assert d["floor_ms"][k] > 0 and d["floor_ratio"][k] == pytest.approx(d[k] / d["floor_ms"][k])
    assert d["layers"] == {"gdn": 6, "attention": 2, "moe": 8}
    assert d["model_sum"] == pytest.approx(6 * d["gdn_decode"] + 2 * d["attention_decode"] + 8 * d["moe"]
                                           + d["embed_logits"])
    assert d["model"] == rows["decode-N8-ctx26"]["ms"]["ours"]
    assert set(d["ms_blocking"]) == {"gdn_decode", "attention_decode", "moe", "embed_logits"}
    assert all(v > 0 for v in d["ms_blocking"].values()) and d["model_sum_blocking"] > 0

    c = sec["compile"]
    assert c["layers"] == 48 and c["s"] > 0 and c["s"] == pytest.approx(c["lower_s"] + c["compile_s"])
    assert sec["compile_s_48_layers"] is None                             # only the real 80B config fills it

    print_section(sec)
    out = capsys.readouterr().out
    assert "varlen4-T107" in out and "decode-N8-ctx26" in out and "compile of the 48-layer" in out
    assert "parts, decode decode-N8-ctx26" in out and "attention_decode" in out and "x floor" in out
    assert "blocking" in out and "timing of the parts: ms: pipelined, 10 calls" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("gdn_phase1"))
    assert f"{p['gdn_phase1']:.3f}" in line and f"{p['ms_blocking']['gdn_phase1']:.3f}" in line


# ---- the parts' two timings: pipelined (R calls, one sync) and blocking (a sync per call) ----
def test_pipelined_timer_queues_r_calls_and_syncs_once(monkeypatch):
    """A fake clock: each call costs 2 ms of host time, each sync 5 ms. Pipelined: R calls then ONE sync of all R
    results per batch, ms = (2 R + 5) / R; blocking: a sync per call, ms = 7."""
    import types

    from jax_gdn import bench_model as bm
    clock, calls, syncs = [0.0], [], []
    monkeypatch.setattr(bm, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def call():
        clock[0] += 2e-3
        calls.append(1)
        return len(calls)

    def sync(x):
        clock[0] += 5e-3
        syncs.append(x)
        return x
    ms = bm._pipelined_ms(call, sync, calls=7, batches=3)
    assert len(calls) == 21 and len(syncs) == 3                          # R calls per batch, one sync per batch
    assert syncs == [list(range(1, 8)), list(range(8, 15)), list(range(15, 22))]   # each sync gets all R results
    assert ms == pytest.approx((2 * 7 + 5) / 7)
    calls.clear()
    syncs.clear()
    assert bm._median_ms(call, sync, 4) == pytest.approx(7.0)
    assert len(calls) == len(syncs) == 4


def test_time_part_carries_the_donated_state_through_both_timings():
    """_time_part with a state: every call's new state feeds the next (warm-up, blocking calls, pipelined batches),
    the caller's state is left alive (a copy is donated), and the pipelined sync gets one batch's R results."""
    import jax.numpy as jnp

    from jax_gdn.bench_model import _time_part
    seen = []

    def sync(x):
        seen.append(x)
        return x
    state = jnp.zeros((3,), jnp.float32)
    t = _time_part(lambda a, s: (s[0] * a, s + 1.0), (jnp.float32(2.0),), state, reps=2, calls=4, sync=sync)
    assert t["ms"] > 0 and t["ms_blocking"] > 0
    assert not state.is_deleted() and float(state.sum()) == 0.0
    # 1 warm-up + 2 blocking calls + max(2, 3) batches x 4 calls: the state counts the calls
    assert len(seen) == 1 + 2 + 3
    assert float(seen[-1][1][0]) == 1 + 2 + 3 * 4
    ys, _ = seen[-1]
    assert [float(y) for y in ys] == [2.0 * c for c in range(11, 15)]       # the calls ran in order on the chain
    # without a state: no state beside the results, the same counts
    seen.clear()
    t = _time_part(lambda a: a * 3.0, (jnp.float32(2.0),), reps=1, calls=2, sync=sync)
    assert len(seen) == 1 + 1 + 3 and [float(y) for y in seen[-1]] == [6.0, 6.0]


# ---- HF on FLA's kernels: the adapters and the patch, on CPU with stand-ins that follow FLA 0.6's contracts ----
def _fake_fla(calls: list):
    """FLA 0.6's five entry points in torch, with FLA's signatures and layouts (the real ones are Triton: GPU only).
    The GDN rules delegate to transformers' own torch functions (same maths as FLA's); the conv and the gated norm
    are written from FLA's kernels: x [B, T, D] for the conv, cache [N, D, W] shifted in place for the update."""
    import types

    import torch
    import torch.nn.functional as F
    import transformers.models.qwen3_next.modeling_qwen3_next as mq
    chunk_ref = mq.torch_chunk_gated_delta_rule.__wrapped__
    rec_ref = mq.torch_recurrent_gated_delta_rule.__wrapped__

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        assert not kwargs and cu_seqlens is None and use_qk_l2norm_in_kernel, kwargs
        calls.append("chunk")
        return chunk_ref(q, k, v, g=g, beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        assert not kwargs and initial_state is not None, kwargs
        calls.append("recurrent")
        return rec_ref(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, backend="triton", cu_seqlens=None, **kwargs):
        b, t, d = x.shape                                   # FLA's layout: [B, T, D]
        assert weight.shape[0] == d and initial_state is None and cu_seqlens is None
        calls.append("conv")
        w = weight.shape[1]
        y = F.conv1d(F.pad(x.transpose(1, 2).float(), (w - 1, 0)), weight.float().unsqueeze(1),
                     None if bias is None else bias.float(), groups=d)
        y = F.silu(y) if activation in ("silu", "swish") else y
        return y.transpose(1, 2).contiguous().to(x.dtype), None

    def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
        assert x.dim() == 2 and cache.shape == (x.shape[0], x.shape[1], weight.shape[1])   # [N, D], [N, D, W]
        calls.append("update")
        new = torch.cat([cache[:, :, 1:], x[:, :, None].to(cache.dtype)], -1)
        cache.copy_(new)                                    # in place, as FLA's kernel
        y = (new.float() * weight.float()).sum(-1) + (0 if bias is None else bias.float())
        y = F.silu(y) if activation in ("silu", "swish") else y
        return y.to(x.dtype), cache

    class FusedRMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, elementwise_affine=True, eps=1e-5, activation="swish", device=None,
                     dtype=None):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            self.eps, self.activation = eps, activation

        def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
            calls.append("norm")
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
            return (y * F.silu(g.float())).to(x.dtype)

    return types.SimpleNamespace(**{f.__name__: f for f in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                                             causal_conv1d, causal_conv1d_update)},
                                 FusedRMSNormGated=FusedRMSNormGated)


def _tiny_hf(layers=2):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import dataclasses

    from jax_gdn.bench_model import hf_model, tiny_config
    cfg = dataclasses.replace(tiny_config(layers), layer_types=("linear_attention", "full_attention")[:layers])
    return hf_model(cfg, torch.float32, "cpu", seed=1)


def test_hf_on_fla_kernels_matches_hf_torch_path():
    """The patched HF (every GDN callable and the gated norm replaced by FLA-contract stand-ins through our
    adapters) gives HF's own torch-path logits: left-padded prefill (all positions) and 3 decode steps through the
    cache; every stand-in ran; the patch is undone after."""
    import transformers.models.qwen3_next.modeling_qwen3_next as mq

    from jax_gdn.bench_model import HF_GDN_CALLABLES, fla_kernels, hf_kernel_check
    model = _tiny_hf()
    before = {k: getattr(mq, k) for k in HF_GDN_CALLABLES}
    norm_before = model.model.layers[0].linear_attn.norm
    calls = []
    res = hf_kernel_check(model, fla_kernels(_fake_fla(calls)), lens=(5, 70), steps=3)
    assert {k: getattr(mq, k) for k in HF_GDN_CALLABLES} == before                      # undone
    assert model.model.layers[0].linear_attn.norm is norm_before
    for part in ("prefill", "decode"):
        assert res[part]["finite"] and res[part]["ref_max"] > 0
        assert res[part]["rel"] < 1e-5, res                                            # fp32: same maths
        assert res[part]["cos_min"] > 1 - 1e-6 and res[part]["top1_agree"] == 1.0
    assert res["prefill"]["positions"] == 75 and res["decode"]["positions"] == 6          # real tokens only
    assert calls.count("chunk") == 1 and calls.count("conv") == 1                      # prefill: 1 GDN layer
    assert calls.count("recurrent") == 3 and calls.count("update") == 3                # one per decode step
    assert calls.count("norm") == 4
    assert "_fake_fla.<locals>.causal_conv1d (adapted" in res["kernels"]["causal_conv1d_fn"]
    assert res["kernels"]["torch_chunk_gated_delta_rule"].endswith("chunk_gated_delta_rule")
    assert res["kernels"]["gated_norm"].endswith("FusedRMSNormGated")
    assert res["torch"]["causal_conv1d_fn"].endswith("modeling_qwen3_next.causal_conv1d_fn")


def test_hf_fla_adapter_is_checked_against_a_wrong_kernel():
    """The check can fail: a conv stand-in that drops the activation is caught in both phases."""
    import types

    from jax_gdn.bench_model import fla_kernels, hf_kernel_check
    calls = []
    fake = _fake_fla(calls)
    conv, upd = fake.causal_conv1d, fake.causal_conv1d_update
    bad = types.SimpleNamespace(**vars(fake))
    bad.causal_conv1d = lambda x, **kw: conv(x, **dict(kw, activation=None))
    bad.causal_conv1d_update = lambda x, cache, **kw: upd(x, cache, **dict(kw, activation=None))
    model = _tiny_hf()
    res = hf_kernel_check(model, fla_kernels(bad), lens=(9,), steps=1)
    assert res["prefill"]["rel"] > 1e-3 and res["decode"]["rel"] > 1e-3
    # a conv update that leaves the state where it was: the prefill agrees, the second decode step does not
    stale = types.SimpleNamespace(**vars(fake))
    stale.causal_conv1d_update = lambda x, cache, **kw: (upd(x, cache.clone(), **kw)[0], cache)
    res = hf_kernel_check(model, fla_kernels(stale), lens=(9,), steps=2)
    assert res["prefill"]["rel"] < 1e-5 and res["decode"]["rel"] > 1e-3


def test_fla_conv_adapter_refuses_what_it_does_not_translate():
    torch = pytest.importorskip("torch")
    from jax_gdn.bench_model import fla_kernels
    k = fla_kernels(_fake_fla([]))
    x, w = torch.randn(1, 8, 5), torch.randn(8, 4)
    y = k["causal_conv1d_fn"](x, w, None, activation="silu", position_ids=None)          # HF's extra kwargs: ignored
    assert y.shape == (1, 8, 5)
    with pytest.raises(NotImplementedError, match="seq_idx"):
        k["causal_conv1d_fn"](x, w, None, seq_idx=torch.zeros(1, 5, dtype=torch.int32))
    st = torch.zeros(1, 8, 4)
    y = k["causal_conv1d_update"](x[:, :, :2], st, w, None, "silu")                    # 2 tokens: one by one
    assert y.shape == (1, 8, 2) and torch.equal(st[:, :, -2:], x[:, :, :2])


# ---- floors: the formulas at 80B dims, checked against hand counts and the other sections' conventions ----
def test_prefill_floors_at_80b_dims():
    from jax_gdn.bench_model import PEAK_TFLOPS, prefill_floors, qwen3_next_80b_config
    from jax_gdn.bench_moe import CASES
    from jax_gdn.cases import VARLEN16_LENS
    cfg = qwen3_next_80b_config(8)
    t = sum(VARLEN16_LENS)
    f = prefill_floors(cfg, VARLEN16_LENS)
    # in_proj_qkvz (2048 -> 2 * 2048 + 2 * 4096) + in_proj_ba (2048 -> 64), bf16 matmul at 700 TFLOP/s
    assert f["gdn_phase1"]["ms"] == pytest.approx(2 * t * 2048 * 12352 / (PEAK_TFLOPS * 1e9))
    assert f["gdn_phase3"]["ms"] == pytest.approx(2 * t * 4096 * 2048 / (PEAK_TFLOPS * 1e9))
    moe = next(c for c in CASES if c.tokens == t and c.experts == 512)                  # bench_moe's floor
    assert f["moe"]["ms"] == pytest.approx(moe.flops() / (PEAK_TFLOPS * 1e9))
    assert f["embed_logits"]["roofline"]["bound"] == "bytes"                           # lm_head 151936 x 2048
    assert "no kernel bench row" in f["gdn_phase2"]["basis"] and "no attention bench row" in f["attention"]["basis"]
    core = 4 * 16 * 256 * sum(n * (n + 1) / 2 for n in VARLEN16_LENS) / (PEAK_TFLOPS * 1e9)
    assert f["attention"]["ms"] > core

    # with the other sections' rows: the GDN core's floor is the kernel bench's fastest column for this exact
    # case, the attention core's the attention bench's torch SDPA; a row of other lengths is not used
    peers = {"rows": [{"case": "other", "lens": [5, 6], "Hk": 16, "Hv": 32, "K": 128, "V": 128, "ms": {"fla": 0.1}},
                      {"case": "varlen16", "lens": list(VARLEN16_LENS), "Hk": 16, "Hv": 32, "K": 128, "V": 128,
                       "ms": {"pallas": 0.98, "fla": 1.08, "xla": 15.0, "jla": None}}],
             "attention": {"rows": [{"case": "prefill-varlen16", "kind": "prefill", "lens": list(VARLEN16_LENS),
                                     "context": 0, "gflop": core * PEAK_TFLOPS, "ms": {"torch_sdpa": 1.85}}]}}
    g = prefill_floors(cfg, VARLEN16_LENS, peers=peers)
    assert g["gdn_phase2"]["ms"] == 0.98 and "pallas" in g["gdn_phase2"]["basis"]
    assert g["attention"]["ms"] == pytest.approx(f["attention"]["ms"] - core + 1.85)
    assert g["gdn_phase1"] == f["gdn_phase1"]


def test_decode_floors_at_80b_dims():
    from jax_gdn.bench_model import PEAK_TBPS, decode_floors, qwen3_next_80b_config
    cfg = qwen3_next_80b_config(8)
    f = decode_floors(cfg, 64, 1189)
    assert all(v["roofline"]["bound"] == "bytes" for v in f.values()), f
    gb = lambda v: v["ms"] * PEAK_TBPS * 1e9                                              # noqa: E731
    state = 64 * 32 * 128 * 128 * 4 * 2                                                 # fp32 states read + written
    assert gb(f["gdn_decode"]) == pytest.approx(state + 2 * (2048 * 12352 + 8192 * 4 + 4096 * 2048 + 2 * 64 * 2048)
                                                + 2 * 2 * 64 * 8192 * 3)
    assert gb(f["attention_decode"]) > 64 * 1190 * 2 * 256 * 2 * 2                     # K and V of the context
    touched = 512 * (1 - (1 - 10 / 512) ** 64)                                          # ~367 of 512 experts
    assert 360 < touched < 370 and gb(f["moe"]) > touched * 3 * 2048 * 512 * 2
    assert gb(decode_floors(cfg, 1, 1189)["moe"]) < gb(f["moe"]) / 20                  # 1 stream: 10 experts
    assert gb(f["embed_logits"]) > 151936 * 2048 * 2


def test_hf_rows_on_cpu_torch_path():
    """HF's rows on CPU (torch fallbacks, no FLA patch off a GPU): every row measured, the kernels HF ran named,
    and merged with ours into rows with a speedup."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jax_gdn.bench_model import _cases, _rows, hf_rows, tiny_config
    cases = _cases(True)
    res = hf_rows(tiny_config(4), cases, reps=1)
    info = res["info"]
    assert info["device"] == "cpu" and "fla" not in info and "fla_error" not in info
    assert info["hf_kernels"]["causal_conv1d_fn"].endswith("causal_conv1d_fn")
    assert set(info["hf_kernels"]) >= {"torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                                       "causal_conv1d_update", "gated_norm"}
    for key in ("varlen", "long", "decode"):
        assert res[key].get("ms", 0) > 0, res[key]
    rows = _rows(cases, {k: {"ms": 1.0} for k in ("varlen", "long", "decode")}, res)
    assert all(r["speedup"] == pytest.approx(r["ms"]["hf"]) and "errors" not in r for r in rows)


def test_markdown_has_each_part_against_its_floor():
    """bench --markdown: the model section's parts (prefill and decode) with floor, ratio and basis, from the H200
    check run's parts; a parts_ms without floors (older results) adds no table."""
    import pathlib

    from jax_gdn import bench
    log = pathlib.Path(__file__).parent.parent / "benchmarks" / "logs" / "model_check_h200_run1.json"
    parts = json.loads(log.read_text())["parts_ms"]
    text = bench.markdown_tables({"model": {"layers": 2, "rows": [], "parts_ms": parts}})
    assert "| part (ms per layer) | step | floor | ms | blocking ms | floor ms | part / floor |" in text
    assert "part / floor: the blocking ms (these results predate the pipelined timing)" in text
    assert "| gdn_phase2 | prefill varlen16-T19027 | kernel bench varlen16-T19027-Hk16-Hv32: pallas" in text
    lines = [x for x in text.splitlines() if x.startswith(("| gdn_", "| attention", "| moe", "| embed_logits"))]
    assert len(lines) == 10 and sum("| decode decode-N64-ctx1189 |" in x for x in lines) == 4
    r = parts["decode"]["floor_ratio"]["moe"]
    assert f"| {r:.2f} |" in next(x for x in lines if x.startswith("| moe | decode"))
    # the run predates the pipelined timing: its one figure is shown as blocking, pipelined "-"
    b = parts["gdn_phase1"]
    assert f"| gdn_phase1 | prefill varlen16-T19027 | {parts['floor_basis']['gdn_phase1']} | - | {b:.3f} |" in text
    old = {k: v for k, v in parts.items() if not k.startswith("floor")}
    assert "part (ms per layer)" not in bench.markdown_tables({"model": {"layers": 2, "rows": [], "parts_ms": old}})
    # results with both timings: pipelined and blocking side by side, the ratio from the pipelined
    def both(q):
        q = dict(q, ms_blocking={k: q[k] for k in q["floor_ms"]})
        q.update({k: 0.5 * q[k] for k in q["floor_ms"]})
        q["floor_ratio"] = {k: q[k] / fl for k, fl in q["floor_ms"].items()}
        return q
    new = dict(both(parts), decode=both(parts["decode"]), pipe_calls=10)
    text = bench.markdown_tables({"model": {"layers": 2, "rows": [], "parts_ms": new}})
    row = next(x for x in text.splitlines() if x.startswith("| gdn_phase1 | prefill"))
    assert f"| {0.5 * b:.3f} | {b:.3f} | {parts['floor_ms']['gdn_phase1']:.3f} | " \
           f"{new['floor_ratio']['gdn_phase1']:.2f} |" in row
    assert "part / floor: the pipelined ms." in text and "10 calls of the part queued" in text
