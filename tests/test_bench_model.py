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
    # the third timing: each part in one compiled loop; the figure of record is it when sound, else pipelined
    for q in (p, p["decode"]):
        assert set(q["ms_in_program"]) == set(q["ms_pipelined"]) == set(q["ms_blocking"]), q.get("errors")
        for k, src in q["ms_source"].items():
            assert q[k] == q["ms_in_program" if src == "in_program" else "ms_pipelined"][k], k
            assert (src == "in_program") == (k not in q["in_program_unsound"]), k
            assert q["in_program"][k]["carried_copies"] == 0 and q["in_program"][k]["iters"] >= 10, k
        assert all(c == 1 for c in q["compiles"].values()), q["compiles"]      # no part retraced while timed
        assert q["model_sum_in_program"] is None or q["model_sum_in_program"] > 0
    # row floors of the three rows (quick: formula floors at tiny dims), merged into the rows
    assert [f["case"] for f in sec["row_floors"]] == [r["case"] for r in sec["rows"]]
    for f, r in zip(sec["row_floors"], sec["rows"]):
        assert r["row_floor_ms"] == f["row_floor_ms"] > 0 and r["hf_over_floor"] is None
        assert f["row_floor_ms"] == pytest.approx(sum(t["count"] * t["floor_ms"] for t in f["terms"].values()))
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
    assert "blocking" in out and "timing of the parts: three timings of each part" in out and "in-prog" in out
    assert "row floors of the 8-layer rows" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("gdn_phase1"))
    assert f"{p['gdn_phase1']:.3f}" in line and f"{p['ms_blocking']['gdn_phase1']:.3f}" in line
    # the summary comes last (a run returning only its output's last 12 lines keeps it): header, 6 + 4 parts, sums
    tail = out.strip().splitlines()[-12:]
    assert tail[0].startswith("SUMMARY part ms/layer") and len(tail) == 12
    assert [x.split()[:2] for x in tail[1:11]] == [["P", k] for k in p["ms_pipelined"]] + [
        ["D", k] for k in p["decode"]["ms_pipelined"]]
    assert f"{p['ms_blocking']['attention']:.3f}" in tail[4] and "prefill sum in/pipe/blk" in tail[11]


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
    assert ("| part (ms per layer) | step | floor | ms | of | in-program ms | pipelined ms | blocking ms | floor ms | "
            "part / floor |") in text
    assert "part / floor: the blocking ms (these results predate the pipelined timing)" in text
    assert "| gdn_phase2 | prefill varlen16-T19027 | kernel bench varlen16-T19027-Hk16-Hv32: pallas" in text
    lines = [x for x in text.splitlines() if x.startswith(("| gdn_", "| attention", "| moe", "| embed_logits"))]
    assert len(lines) == 10 and sum("| decode decode-N64-ctx1189 |" in x for x in lines) == 4
    r = parts["decode"]["floor_ratio"]["moe"]
    assert f"| {r:.2f} |" in next(x for x in lines if x.startswith("| moe | decode"))
    # the run predates the pipelined timing: its one figure is shown as blocking, the others "-"
    b = parts["gdn_phase1"]
    basis = parts["floor_basis"]["gdn_phase1"]
    assert f"| gdn_phase1 | prefill varlen16-T19027 | {basis} | - | - | - | - | {b:.3f} |" in text
    old = {k: v for k, v in parts.items() if not k.startswith("floor")}
    assert "part (ms per layer)" not in bench.markdown_tables({"model": {"layers": 2, "rows": [], "parts_ms": old}})

    # results with the pipelined and blocking timings only: "<part>" was the pipelined figure
    def both(q):
        q = dict(q, ms_blocking={k: q[k] for k in q["floor_ms"]})
        q.update({k: 0.5 * q[k] for k in q["floor_ms"]})
        q["floor_ratio"] = {k: q[k] / fl for k, fl in q["floor_ms"].items()}
        return q
    new = dict(both(parts), decode=both(parts["decode"]), pipe_calls=10)
    text = bench.markdown_tables({"model": {"layers": 2, "rows": [], "parts_ms": new}})
    row = next(x for x in text.splitlines() if x.startswith("| gdn_phase1 | prefill"))
    assert f"| {0.5 * b:.3f} | pipelined | - | {0.5 * b:.3f} | {b:.3f} | {parts['floor_ms']['gdn_phase1']:.3f} | " \
           f"{new['floor_ratio']['gdn_phase1']:.2f} |" in row
    assert "part / floor: the pipelined ms (these results predate the in-program timing)." in text

    # all three timings: the figure of record and its source, the three beside, the ratio of the record
    def three(q):
        q = both(q)
        q["ms_pipelined"] = {k: q[k] for k in q["floor_ms"]}
        q["ms_in_program"] = {k: 0.8 * q[k] for k in q["floor_ms"]}
        q["ms_source"] = {k: "in_program" for k in q["floor_ms"]}
        q.update({k: 0.8 * q[k] for k in q["floor_ms"]})
        q["floor_ratio"] = {k: q[k] / fl for k, fl in q["floor_ms"].items()}
        return q
    new = dict(three(parts), decode=three(parts["decode"]), pipe_calls=10, loop_iters=10)
    text = bench.markdown_tables({"model": {"layers": 2, "rows": [], "parts_ms": new}})
    row = next(x for x in text.splitlines() if x.startswith("| gdn_phase1 | prefill"))
    assert f"| {0.4 * b:.3f} | in_program | {0.4 * b:.3f} | {0.5 * b:.3f} | {b:.3f} |" in row
    assert "part / floor: ms, the figure of record." in text and "R = 10 times (decode 20)" in text


# ---- the in-program timing: the part R times in one compiled loop, fed back, state carried, nothing hoisted ----
def _computations(hlo: str) -> dict:
    """{computation name: its body lines} of an HLO module's text."""
    import re
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = "ENTRY" if m.group(1) else m.group(2)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    return comps


def _dot_placement(hlo: str) -> tuple:
    """(dots run by the ENTRY computation outside any loop, dots reachable from a while body)."""
    import re
    comps = _computations(hlo)

    def reach(names):
        seen, todo = set(), list(names)
        while todo:
            n = todo.pop()
            if n in seen or n not in comps:
                continue
            seen.add(n)
            for line in comps[n]:
                todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
        return seen
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    in_loop = reach(bodies)
    outside = reach(["ENTRY"]) - in_loop - bodies
    count = lambda names: sum(" dot(" in x for n in names for x in comps[n])        # noqa: E731
    return count(outside), count(in_loop)


def test_in_program_loop_feeds_back_carries_state_and_hoists_nothing():
    """_in_program's loop: the residual part's y is the next x (x_n = x_0 + n w-independent increments here), the
    state counts every iteration (warm-up R + batches x (one call + two calls) x R), a part whose output is not
    x-shaped carries its output and nudges its inputs; in both the matmul over loop-invariant weights stays inside
    the loop (a hand-written loop that does not feed x back has it hoisted out: the check can fail)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from jax_gdn.bench_model import _in_program, _loop_program
    w = jax.random.normal(jax.random.PRNGKey(0), (16, 16), jnp.float32) * 0.01
    x = jnp.ones((8, 16), jnp.float32)
    seen = []

    def part(w, x, s):                                     # residual part with a state: y = x + 1 + 0 * (x @ w)
        return x + 1.0 + 0.0 * jnp.tanh(x @ w), s + 1

    r = _in_program(part, (w, x), jnp.zeros((), jnp.int32), (1,), iters=3, batches=2, sync=seen.append)
    (x_end,), s_end, y_end = seen[-1]
    assert int(s_end) == 3 + 2 * (3 + 6) and y_end is None
    np.testing.assert_allclose(np.asarray(x_end), 1.0 + int(s_end))          # each iteration's y was the next x
    assert r["carried_copies"] == 0 and r["iters"] == 3 and np.isfinite(r["ms"]) and r["wall_ms"] > 0
    compiled, _, _ = _loop_program(part, (w, x), jnp.zeros((), jnp.int32), (1,), 3)
    assert _dot_placement(compiled.as_text()) [0] == 0 and _dot_placement(compiled.as_text())[1] >= 1

    # not x-shaped: y = (x @ w2, x.sum()) is carried whole, x nudged through one element; the dot stays in the loop
    w2 = jnp.ones((16, 4), jnp.float32)
    compiled, rest, carry = _loop_program(lambda w2, x: (x @ w2, jnp.sum(x)), (w2, x), None, (1,), 3)
    (xn,), st, (y0, y1) = compiled(rest, carry)
    assert st is None and y0.shape == (8, 4) and float(y1) == pytest.approx(float(jnp.sum(xn)), rel=1e-5)
    assert float(xn[0, 0]) > 1.0 and float(xn[0, 1]) == 1.0                   # one element nudged per iteration
    out_dots, loop_dots = _dot_placement(compiled.as_text())
    assert out_dots == 0 and loop_dots >= 1

    # the control: x not fed back (loop-invariant dot) is hoisted out of the loop by XLA
    def bad(w2, x, n):
        return lax.fori_loop(0, n, lambda i, acc: acc + x @ w2, jnp.zeros((8, 4), jnp.float32))
    text = jax.jit(bad).lower(w2, x, np.int32(3)).compile().as_text()
    assert _dot_placement(text)[0] >= 1


def test_loop_copies_finds_a_carried_buffer_copy():
    """loop_copies reads the copies of a while body from compiled HLO text: a loop that swaps two carried buffers
    copies one every iteration (reported, marked carried); the tiny model's attention part (KV pool carried and
    written in place, x fed back) has none."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from jax_gdn.bench_model import _hlo_shape, _loop_program, loop_copies
    a = jnp.ones((64, 64), jnp.float32)

    def swap(a, b, n):                                  # the new a is the old b and the new b reads the old a
        return lax.fori_loop(0, n, lambda i, c: (c[1] * 1.0001, c[0].at[0, 0].add(c[1][0, 0])), (a, b))
    text = jax.jit(swap, donate_argnums=(0, 1)).lower(a, a + 1, np.int32(3)).compile().as_text()
    found = loop_copies(text, {_hlo_shape(a)}, min_bytes=0)
    hand = [c for c in found if c["carried"]]
    assert hand and hand[0]["shape"] == "f32[64,64]" and hand[0]["bytes"] == 64 * 64 * 4
    assert loop_copies(text, {_hlo_shape(a)}, min_bytes=1 << 20) == []       # under the size threshold

    # the model's attention part as bench_model.parts times it
    from jax_gdn.bench_model import check_config
    from jax_gdn.checkpoint import random_model
    from jax_gdn.layers.attention import attention_layer
    from jax_gdn.ops.norms import rms_norm
    from jax_gdn.state import KvPages
    cfg = check_config(True)
    model = random_model(cfg, seed=0, dtype=jnp.float32, backend="auto")
    ap = jax.tree.map(lambda v: v[0], model.params["period"][1])
    t, ps = 40, 16
    kv = KvPages.zeros(3, ps, cfg.num_key_value_heads, cfg.head_dim, jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)

    def attn(mp, norm, x, kv):
        h, kv = attention_layer(mp, cfg.attn_dims, rms_norm(x, norm, cfg.rms_norm_eps), kv, token_pos=pos,
                                token_page=pos // ps, token_offset=pos % ps,
                                page_table=jnp.arange(3, dtype=jnp.int32)[None], slot_lens=jnp.array([t], jnp.int32),
                                cu_seqlens=jnp.array([0, t], jnp.int32), slot_ids=jnp.zeros((1,), jnp.int32),
                                backend="xla")
        return x + h, kv
    x = jax.random.normal(jax.random.PRNGKey(1), (t, cfg.hidden_size), jnp.float32)
    compiled, rest, carry = _loop_program(attn, (ap["mixer"], ap["input_norm"], x), kv, (2,), 3)
    shapes = {_hlo_shape(v) for v in jax.tree.leaves(carry)}
    assert [c for c in loop_copies(compiled.as_text(), shapes, min_bytes=0) if c["carried"]] == []
    (xn,), kvn, _ = compiled(rest, carry)
    assert bool(jnp.all(jnp.isfinite(xn))) and float(jnp.abs(kvn.k_pages).sum()) > 0   # K/V written in the loop


def test_choose_figures_takes_the_in_program_figure_only_when_sound(monkeypatch):
    """choose_figures: the in-program ms is the figure of record when measured, positive, copy-free, >= 0.6 x the
    roofline and <= 1.25 x the separate call; otherwise the pipelined ms with the reason; a pipelined figure above
    1.15 x blocking (the first H200 check's attention, timed while HF's check shared the GPU) or a retraced part is
    flagged; the sums follow the chosen figures."""
    from jax_gdn.bench_model import _with_floors, choose_figures
    names = ("gdn_phase1", "gdn_phase2", "gdn_phase3", "attention", "moe", "embed_logits")
    q = {"layers": {"gdn": 1, "attention": 1, "moe": 2},
         "ms_pipelined": dict(zip(names, (2.0, 1.0, 0.6, 7.67, 3.7, 0.17))),
         "ms_blocking": dict(zip(names, (2.4, 1.0, 0.9, 4.06, 4.0, 0.68))),
         "ms_in_program": dict(zip(names, (1.8, -0.01, 0.55, 3.6, 5.0, 0.09))),
         "in_program": {k: {"carried_copies": 0} for k in names}, "compiles": {k: 1 for k in names}}
    q["in_program"]["gdn_phase3"]["carried_copies"] = 1
    q["compiles"]["moe"] = 2
    floors = {k: {"ms": v, "basis": "", "roofline": {"ms": v}}
              for k, v in zip(names, (1.4, 0.98, 0.46, 3.3, 1.9, 0.164))}
    floors["gdn_phase2"]["roofline"]["ms"] = 0.157             # the kernel bench time is no lower bound: roofline
    _with_floors(q, floors)
    choose_figures(q)
    assert q["ms_source"] == {"gdn_phase1": "in_program", "gdn_phase2": "pipelined", "gdn_phase3": "pipelined",
                              "attention": "in_program", "moe": "pipelined", "embed_logits": "pipelined"}
    assert "<= 0" in q["in_program_unsound"]["gdn_phase2"] and "copies" in q["in_program_unsound"]["gdn_phase3"]
    assert "1.25" in q["in_program_unsound"]["moe"] and "roofline" in q["in_program_unsound"]["embed_logits"]
    assert q["gdn_phase1"] == 1.8 and q["attention"] == 3.6 and q["gdn_phase2"] == 1.0
    assert set(q["suspect"]) == {"attention", "moe"} and "compiled 2 times" in q["suspect"]["moe"]
    assert q["model_sum"] == pytest.approx(1.8 + 1.0 + 0.6 + 3.6 + 2 * 3.7 + 0.17)
    assert q["model_sum_pipelined"] == pytest.approx(2.0 + 1.0 + 0.6 + 7.67 + 2 * 3.7 + 0.17)
    assert q["model_sum_in_program"] is None         # a slope <= 0 (gdn_phase2's -0.01) makes no time to sum
    q["ms_in_program"]["gdn_phase2"] = 0.9
    choose_figures(q)
    assert q["model_sum_in_program"] == pytest.approx(1.8 + 0.9 + 0.55 + 3.6 + 2 * 5.0 + 0.09)
    # the switch: the pipelined figure always, the in-program one beside
    import jax_gdn.bench_model as bm
    monkeypatch.setattr(bm, "FIGURE_OF_RECORD", "pipelined")
    choose_figures(q)
    assert set(q["ms_source"].values()) == {"pipelined"} and q["attention"] == 7.67
    assert "FIGURE_OF_RECORD" in q["in_program_unsound"]["gdn_phase1"]


def test_row_floor_of_the_32k_stream_term_by_term():
    """row_floor at 80B dims, 8 layers, one fresh 32768-token stream, every term by hand: GDN layers x (in_proj +
    ba at 700 TFLOP/s, the kernel bench's B1-T32768 row matched by B and T, out_proj), attention layers x
    (projections + the attention bench's 32k torch SDPA; roofline: its 4 H Dh L (L + 1) / 2 FLOPs), MoE layers x
    bench_moe's FLOPs with all 32768 tokens, embed_logits once; HF / floor is the best speed-up over HF any
    implementation could reach at those floors. The varlen16 row's floor uses the same formulas."""
    from jax_gdn.bench_model import PEAK_TFLOPS, _cases, qwen3_next_80b_config, row_floor, row_floors
    from jax_gdn.cases import VARLEN16_LENS
    cfg = qwen3_next_80b_config(8)
    L = 32768
    tf = PEAK_TFLOPS * 1e9
    core = 4 * 16 * 256 * L * (L + 1) / 2
    peers = {"rows": [{"case": "B1-T32768-Hk16-Hv32", "B": 1, "T": L, "Hk": 16, "Hv": 32, "K": 128, "V": 128,
                       "ms": {"pallas": 1.63, "fla": 1.93, "jla": 1.08}}],
             "attention": {"rows": [{"case": "prefill-32k", "kind": "prefill", "context": 0, "lens": [L],
                                     "gflop": core / 1e9, "ms": {"torch_sdpa": 27.4, "cudnn": 14.0}}]}}
    r = row_floor(cfg, "prefill", ("B1-T32768", (L,)), 2, peers, hf_ms=224.6, ours_ms=154.4)
    p1 = 2 * L * 2048 * (2 * 2048 + 2 * 4096 + 2 * 32) / tf
    p3 = 2 * L * 4096 * 2048 / tf
    proj = (2 * L * 2048 * (2 * 16 * 256 + 2 * 2 * 256) + 2 * L * 16 * 256 * 2048) / tf
    moe = 2 * L * (2048 * 512 + 10 * 3 * 2048 * 512 + 3 * 2048 * 512 + 2048) / tf
    t = r["terms"]
    assert {k: v["count"] for k, v in t.items()} == {"gdn_phase1": 6, "gdn_phase2": 6, "gdn_phase3": 6,
                                                     "attention": 2, "moe": 8, "embed_logits": 1}
    assert t["gdn_phase1"]["floor_ms"] == pytest.approx(p1) and t["gdn_phase3"]["floor_ms"] == pytest.approx(p3)
    assert t["gdn_phase2"]["floor_ms"] == 1.08 and "jla" in t["gdn_phase2"]["basis"]
    assert t["attention"]["floor_ms"] == pytest.approx(proj + 27.4)
    assert t["attention"]["roofline_ms"] == pytest.approx(proj + core / tf, rel=1e-6)
    assert t["moe"]["floor_ms"] == pytest.approx(moe)
    total = 6 * (p1 + 1.08 + p3) + 2 * (proj + 27.4) + 8 * moe + t["embed_logits"]["floor_ms"]
    assert r["row_floor_ms"] == pytest.approx(total) and 105 < total < 120
    assert r["hf_over_floor"] == pytest.approx(224.6 / total) and not r["target_3x_within_floor"]
    assert r["row_floor_roofline_ms"] < r["row_floor_ms"] and r["hf_over_roofline"] < 3     # even at the roofline
    flop = sum(x["flop"] for x in r["terms"].values())
    assert r["row_floor_hw_peak_ms"] == pytest.approx(flop / 989e9 + t["embed_logits"]["ms"]      # lm_head: bytes
                                                      - t["embed_logits"]["flop"] / 989e9, rel=1e-6)
    assert r["hf_over_hw_peak"] > 3                                     # the hardware's own bound is below HF / 3
    assert r["ours_over_floor"] == pytest.approx(154.4 / total)
    # the three rows together; the varlen16 row's attention core (no bench row here) at its FLOPs
    rows = [{"case": "varlen16-T19027", "ms": {"hf": 417.4, "ours": 61.2}}]
    v, lg, d = row_floors(cfg, _cases(False), rows, peers)
    assert (v["case"], lg["case"], d["case"], d["kind"]) == ("varlen16-T19027", "B1-T32768", "decode-N64-ctx1189",
                                                             "decode")
    assert v["hf_over_floor"] == pytest.approx(417.4 / v["row_floor_ms"]) and lg.get("hf_ms") is None
    t = sum(VARLEN16_LENS)
    assert v["terms"]["gdn_phase1"]["floor_ms"] == pytest.approx(2 * t * 2048 * 12352 / tf)
    assert set(d["terms"]) == {"gdn_decode", "attention_decode", "moe", "embed_logits"}
    assert d["row_floor_ms"] == pytest.approx(sum(x["count"] * x["floor_ms"] for x in d["terms"].values()))


def test_check_runs_the_hf_check_after_the_parts(monkeypatch, tmp_path):
    """benchmarks/gpu/model_bench.py --check: the first H200 check started HF's check (FLA's Triton autotuning)
    in a child process BEFORE timing the parts, so both shared the GPU (the pipelined attention read 1.9x its
    blocking figure). Now the 2-layer rows and the parts come first and the HF child only after them; --no-hf
    starts no child; the row floors of the 8-layer rows take HF's ms from the stored results."""
    import importlib.util
    import pathlib
    import subprocess
    import types

    from jax_gdn import bench_model as bm
    spec = importlib.util.spec_from_file_location(
        "model_bench_script", pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu" / "model_bench.py")
    mb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mb)
    order = []
    cfg = bm.check_config(True)
    fake_model = types.SimpleNamespace(config=cfg)
    monkeypatch.setattr(bm, "random_device_model", lambda *a, **k: order.append("model") or fake_model)
    monkeypatch.setattr(bm, "measure_parts", lambda *a, **k: order.append("parts") or {
        "decode": {}, "model": k["ours"]["varlen"]["ms"]})
    monkeypatch.setattr(bm, "our_rows", lambda *a, **k: order.append("rows") or {"varlen": {"ms": 2.0},
                                                                                 "decode": {"ms": 0.5}})
    stored = [{"case": "B1-T200", "ms": {"hf": 9.0, "ours": 6.0}}]
    monkeypatch.setattr(bm, "load_peers", lambda dev: {"path": "x.json", "date": "d", "model_rows": stored,
                                                       "model_layers": 8})
    monkeypatch.setattr(bm, "print_section", lambda *a, **k: None)

    def run(cmd, **kw):
        order.append("hf")
        assert "--hf-check" in cmd
        return types.SimpleNamespace(stdout='{"prefill": {}, "s": 1}\n', returncode=0)
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("no child beside the parts"))
    res = mb.check(str(tmp_path), 1, quick=True, hf=True, budget=100)
    assert order == ["model", "rows", "parts", "hf"]
    assert res["parts_ms"]["model"] == 2.0 and res["hf_check"]["s"] == 1
    lg = next(r for r in res["row_floors"] if r["case"] == "B1-T200")
    assert lg["hf_ms"] == 9.0 and lg["hf_source"] == "stored" and lg["hf_over_floor"] == pytest.approx(
        9.0 / lg["row_floor_ms"])
    assert json.loads((tmp_path / "model_check.json").read_text())["stages"]
    order.clear()
    mb.check(str(tmp_path), 1, quick=True, hf=False, budget=100)
    assert order == ["model", "rows", "parts"]
