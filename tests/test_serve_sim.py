"""The serving simulation (jax_gdn.serve_sim) on a tiny random model, CPU: every request is served with exactly
its tokens, the compile count stays bounded by the shape buckets, and nothing compiles after the warm-up; on the
LLM engine with shared prefixes the prefix cache hits and changes no output."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_gdn.checkpoint import random_model
from jax_gdn.config import HybridConfig
from jax_gdn.serve_sim import SimConfig, make_requests, simulate

# one GDN + one attention layer with a MoE (few and small programs: the test is about the loop, not the model)
CFG = HybridConfig(model_type="qwen3_next", vocab_size=61, hidden_size=32, num_hidden_layers=2,
                   layer_types=("linear_attention", "full_attention"), intermediate_size=24,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=8)
# S = 2 slots, 16 tokens per step: prompts up to 40 tokens are cut into chunks and mixed with decode tokens
SIM = SimConfig(num_requests=6, max_seqs=2, token_budget=16, prompt_len=(1, 40), gen_len=(1, 4), rate=1.0,
                page_size=8, seed=4)


def test_short_simulation_serves_every_request_without_recompiles():
    model = random_model(CFG, seed=0, dtype=jnp.float32, backend="xla")
    res = simulate(model, SIM, progress=False, verbose=False)
    want = make_requests(SIM, CFG.vocab_size, SIM.seed)

    # every request got exactly its generation length, its prompt entirely prefilled, a first-token time
    assert res["all_served"]
    assert [r["generated"] for r in res["per_request"]] == [r.gen_len for r in want]
    assert [r["prompt_len"] for r in res["per_request"]] == [r.prompt.shape[0] for r in want]
    assert res["tokens"] == {"prompt": sum(r.prompt.shape[0] for r in want), "generated": sum(r.gen_len for r in want)}
    assert all(r["ttft_steps"] >= 1 and math.isfinite(r["ttft_s"]) and r["ttft_s"] > 0 for r in res["per_request"])
    # a prompt longer than the budget needs several steps before its first token (chunked prefill happened)
    long = [r for r in res["per_request"] if r["prompt_len"] > SIM.token_budget]
    assert long and all(r["ttft_steps"] >= 2 for r in long)
    # mixed (prefill + decode) and decode-only steps both ran; every release freed its slots for later requests
    assert res["calls"]["prefill"] >= 1 and res["calls"]["decode"] >= 1 and res["calls"]["release"] >= 1
    assert res["steps"] == res["calls"]["prefill"] + res["calls"]["decode"]
    for key in ("prefill", "decode", "total"):
        assert res["tokens_per_s"][key] > 0
    for key in ("p50", "p90", "p99"):
        assert 0 < res["step_ms"][key] <= res["step_ms"]["max"]
    assert res["step_ms"]["p50"] <= res["step_ms"]["p90"] <= res["step_ms"]["p99"]

    # bounded compiles: with 2 slots and a 16-token budget the loop makes at most 2 stream buckets x (prefill,
    # decode, release) x a few token buckets; without buckets every new (T, N) would compile (tens here)
    c = res["compiles"]
    assert c["total"] == c["warmup"] + c["after_warmup"]
    assert c["model_programs"] is not None                 # HybridModel.compiled_programs()
    assert c["model_programs"] <= 3 * 2 * 2, c
    assert c["model_programs_after_warmup"] == 0, c
    assert c["after_warmup"] == 0, c      # no XLA compile at all in the measured run (eager slices included)


def test_llm_engine_with_shared_prefixes_serves_the_same_tokens_with_the_cache_on():
    """--engine llm on a shared-prefix workload (2 system prompts of 72 tokens, 64-token blocks), the prefix cache off
    and on: every request gets its gen_len tokens ("length"), the outputs are equal, later requests hit the cache,
    nothing compiles after LLM's warm-up, and each request's time to first token counts from its arrival."""
    from jax_gdn.serve_sim import simulate_engine
    model = random_model(CFG, seed=0, dtype=jnp.float32, backend="xla")
    sim = SimConfig(num_requests=6, max_seqs=2, token_budget=16, prompt_len=(1, 12), gen_len=(1, 4), rate=1.0,
                    page_size=8, seed=4, shared_prefixes=2, prefix_len=72)
    res = simulate_engine(model, sim, prefix_cache="both", progress=False, verbose=False)
    assert res["all_served"] and res["outputs_equal"]
    off, on = res["runs"]["off"], res["runs"]["on"]
    assert [len(t) for t in on["outputs"]] == [r.gen_len for r in make_requests(sim, CFG.vocab_size, sim.seed)]
    assert off["hit_rate"] is None and on["hit_rate"] > 0 and on["hit_tokens"] >= 64
    assert on["tokens"]["prompt"] == off["tokens"]["prompt"] == sum(
        r.prompt.shape[0] for r in make_requests(sim, CFG.vocab_size, sim.seed))
    assert off["compiled_after_warmup"] == 0 and on["compiled_after_warmup"] == 0
    assert all(0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] for r in (off, on))


def test_sim_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="token_budget .* must be >= max_seqs"):
        SimConfig(max_seqs=8, token_budget=4)
    with pytest.raises(ValueError, match="prompt_len must be"):
        SimConfig(prompt_len=(5, 2))
    with pytest.raises(ValueError, match="rate must be > 0"):
        SimConfig(rate=0.0)
    with pytest.raises(ValueError, match="num_requests must be a positive int"):
        SimConfig(num_requests=0)
    with pytest.raises(ValueError, match="shared_prefixes .* and prefix_len .* must both be 0"):
        SimConfig(shared_prefixes=2)


def test_requests_are_fixed_by_the_seed():
    a, b = make_requests(SIM, 61, 5), make_requests(SIM, 61, 5)
    assert [r.arrival_step for r in a] == [r.arrival_step for r in b]
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b))
    assert a[0].arrival_step == 0 and all(x.arrival_step <= y.arrival_step for x, y in zip(a, a[1:]))
    assert all(SIM.prompt_len[0] <= r.prompt.shape[0] <= SIM.prompt_len[1] for r in a)


def test_cli_lists_serve_sim():
    from jax_gdn.__main__ import COMMANDS, USAGE
    assert COMMANDS["serve-sim"] == "jax_gdn.serve_sim" and "serve-sim" in USAGE


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--json", "/no/such/dir/x.json"], ["--requests", "0"],
                                  ["--budget", "2", "--max-seqs", "4"], ["--prompt-len", "5,2"], ["--rate", "0"],
                                  ["--dims", "huge"], ["--model", "/no/such/dir"], ["--gen-len", "x"],
                                  ["--engine", "model", "--prefix-cache", "on"], ["--shared-prefixes", "2"],
                                  ["--prefix-cache", "sometimes"]])
def test_cli_refuses_bad_options_before_any_work(monkeypatch, capsys, argv):
    import jax_gdn.serve_sim as serve_sim

    def no_work(*_a, **_k):
        raise AssertionError("built a model before the options were checked")
    monkeypatch.setattr(serve_sim, "build_model", no_work)
    with pytest.raises(SystemExit) as exc:
        serve_sim.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_layers_and_json(monkeypatch, tmp_path):
    import json

    import jax_gdn.serve_sim as serve_sim
    seen = {}

    def fake_build(model_dir, dims, layers, dtype, backend, seed):
        seen.update(dims=dims, layers=layers, dtype=dtype)
        return "model"
    monkeypatch.setattr(serve_sim, "build_model", fake_build)
    monkeypatch.setattr(serve_sim, "simulate_engine",
                        lambda model, sim, prefix_cache, progress: {"all_served": True, "sim": sim.max_seqs})
    out = tmp_path / "res.json"
    assert serve_sim.main(["--layers", "3", "--max-seqs", "2", "--json", str(out)]) == 0
    assert seen == {"dims": "tiny", "layers": 3, "dtype": "float32"}
    assert json.loads(out.read_text()) == {"all_served": True, "sim": 2}
    serve_sim.main(["--dims", "qwen3_next_80b"])
    assert seen == {"dims": "qwen3_next_80b", "layers": 8, "dtype": "bfloat16"}


def test_summary_says_what_each_compile_count_holds(capsys):
    from jax_gdn.serve_sim import print_summary
    p = {"p50": 1.0, "p90": 1.0, "p99": 1.0, "max": 1.0, "mean": 1.0, "n": 1}
    print_summary({"model": "M", "device": "cpu", "requests": 1, "steps": 2, "sim": {"max_seqs": 4, "token_budget": 32},
                   "calls": {"prefill": 1, "decode": 1, "release": 1}, "tokens": {"prompt": 1, "generated": 1},
                   "compiles": {"total": 24, "warmup": 24, "after_warmup": 0, "compile_s": 1.0, "model_programs": 12,
                                "model_programs_after_warmup": 0},
                   "wall_s": 1.0, "tokens_per_s": {"prefill": 1, "decode": 1, "total": 2}, "ttft_s": p,
                   "ttft_steps": p, "step_ms": p, "step_ms_by_kind": {}, "all_served": True})
    out = capsys.readouterr().out
    assert "24 XLA programs in the process" in out
    assert "12 the model's own prefill / decode / release programs (model.compiled_programs()" in out
    assert "12 small eager programs outside those calls" in out
