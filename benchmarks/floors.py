"""Floors of the whole-model section: what each part of the model, and each row, would take at the GPU's peak
rates (``benchmarks.tables``: matmul FLOPs at 700 TFLOP/s, bytes at 4.8 TB/s), from the config and the token
counts; the formulas are in the docstrings. The README's floor columns are these numbers.
"""
from __future__ import annotations

import json
import os

from benchmarks.tables import HW_PEAK_TFLOPS, PEAK_TBPS, PEAK_TFLOPS

CHUNK = 64            # the chunked GDN rule's chunk (the formula's C)


def _roof(flop: float, nbytes: float) -> dict:
    """{"ms": max(flop at PEAK_TFLOPS, bytes at PEAK_TBPS), "flop", "bytes", "bound"}."""
    f_ms, b_ms = flop / (PEAK_TFLOPS * 1e9), nbytes / (PEAK_TBPS * 1e9)
    return {"ms": max(f_ms, b_ms), "flop": flop, "bytes": nbytes, "bound": "flop" if f_ms >= b_ms else "bytes"}


def _dims(config, dtype_bytes: int) -> dict:
    c, b = config, dtype_bytes
    g = c.gdn_dims
    nk, nv = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
    return dict(b=b, d=c.hidden_size, nk=nk, nv=nv, hv=g.num_v_heads, hk=g.num_k_heads, kd=g.head_k_dim,
                vd=g.head_v_dim, w=g.conv_kernel_size, conv=2 * nk + nv, hq=c.num_attention_heads,
                hkv=c.num_key_value_heads, dh=c.head_dim, e=c.num_experts, k=c.num_experts_per_tok,
                i=c.moe_intermediate_size, si=c.shared_expert_intermediate_size, vocab=c.vocab_size,
                ffn_i=c.intermediate_size)


def _ffn_roof(x: dict, t: int, moe: bool, weights_touched: float) -> dict:
    """MoE (router + top-k routed SwiGLU experts + shared expert and its gate; benchmarks.moe's FLOP formula) or MLP over
    t tokens; bytes: ``weights_touched`` routed experts' weights + router + shared expert + x in / out."""
    d, b = x["d"], x["b"]
    if not moe:
        return _roof(2.0 * t * 3 * d * x["ffn_i"], b * (3 * d * x["ffn_i"] + 2 * t * d))
    flop = 2.0 * t * (d * x["e"] + x["k"] * 3 * d * x["i"] + 3 * d * x["si"] + d)
    nbytes = b * (weights_touched * 3 * d * x["i"] + 3 * d * x["si"] + d * x["e"] + d + 2 * t * d)
    return _roof(flop, nbytes)


def prefill_floors(config, lens, dtype_bytes: int = 2, peers: dict = None) -> dict:
    """Floor per part of one layer (and embed_logits) for a fresh prefill of ``lens`` (T = sum tokens, N streams),
    every formula a roofline max(FLOPs / 700 TFLOP/s, bytes / 4.8 TB/s) with b bytes per activation / weight,
    D hidden, nk = Hk K, nv = Hv V, Hq, Hkv, Dh attention heads, E experts, k top-k, I / Is expert / shared
    widths, Vocab:
      gdn_phase1   FLOP 2 T D (2 nk + 2 nv + 2 Hv) (in_proj_qkvz + in_proj_ba); bytes: those weights, the conv
                   weights, x in, q k v z out (b) and g, beta out (fp32): the conv and the L2 norms fused away
      gdn_phase2   the kernel bench's fastest time for this exact case (peers' "rows", same lens and heads) when
                   there is one; else FLOP T Hv (2 C (3 K + 2 V) + 6 K V) (chunked form, C = 64), bytes q k
                   (Hk), v, o (Hv), g, beta, the N states read + written (fp32)
      gdn_phase3   FLOP 2 T nv D (out_proj); bytes: out_proj weights, o and z in, x in and out
      attention    projections: FLOP 2 T D (2 Hq Dh + 2 Hkv Dh) (q with its gate, k, v) + 2 T Hq Dh D (o_proj),
                   bytes their weights + x in / out; plus the core: torch SDPA (flash attention) of the attention
                   bench for this case (peers' "attention" row prefill-varlen16, same lens and dims) when there is
                   one, else its FLOPs 4 Hq Dh sum_n L_n (L_n + 1) / 2 at 700 TFLOP/s
      moe          FLOP 2 T (D E + k 3 D I + 3 D Is + D) (benchmarks.moe's); bytes all E experts' weights + shared
      embed_logits FLOP 2 N D Vocab; bytes lm_head D Vocab, T embedding rows, N Vocab fp32 logits
    Returns {part: {"ms", "basis", "roofline": {"ms", "flop", "bytes", "bound"}}}."""
    x = _dims(config, dtype_bytes)
    b, d, nk, nv, hv = x["b"], x["d"], x["nk"], x["nv"], x["hv"]
    t, n = int(sum(lens)), len(lens)
    peers = peers or {}
    out = {}

    def put(name, roof, basis, ms=None):
        out[name] = {"ms": roof["ms"] if ms is None else ms, "basis": basis, "roofline": roof}

    proj = 2 * nk + 2 * nv + 2 * hv
    put("gdn_phase1", _roof(2.0 * t * d * proj, b * (d * proj + x["conv"] * x["w"] + t * d + t * (2 * nk + 2 * nv))
                            + 4 * t * 2 * hv), "matmul FLOPs at 700 TFLOP/s (roofline)")
    per_tok = 2 * CHUNK * (3 * x["kd"] + 2 * x["vd"]) + 6 * x["kd"] * x["vd"]
    roof2 = _roof(1.0 * t * hv * per_tok,
                  b * t * (2 * nk + 2 * nv) + 4 * t * 2 * hv + 4 * 2 * n * hv * x["kd"] * x["vd"])
    row = next((r for r in peers.get("rows", []) if _bench_lens(r) == [int(m) for m in lens]
                and (r["Hk"], r["Hv"], r["K"], r["V"]) == (x["hk"], hv, x["kd"], x["vd"])), None)
    best = min(((v, k) for k, v in (row or {}).get("ms", {}).items() if v), default=None)
    if best:
        put("gdn_phase2", roof2, f"kernel bench {row['case']}: {best[1]} (fastest column)", best[0])
    else:
        put("gdn_phase2", roof2, "chunked-rule FLOPs / bytes roofline (no kernel bench row for this case)")
    put("gdn_phase3", _roof(2.0 * t * nv * d, b * (nv * d + 2 * t * nv + 2 * t * d)), "matmul FLOPs at 700 TFLOP/s")
    qkv = 2 * x["hq"] * x["dh"] + 2 * x["hkv"] * x["dh"]
    proj_a = _roof(2.0 * t * d * qkv + 2.0 * t * x["hq"] * x["dh"] * d,
                   b * (d * qkv + x["hq"] * x["dh"] * d + 2 * t * d + t * qkv))
    core_flop = 4.0 * x["hq"] * x["dh"] * sum(m * (m + 1) / 2 for m in lens)
    arow = next((r for r in (peers.get("attention") or {}).get("rows", []) if r.get("kind") == "prefill"
                 and not r.get("context") and list(r.get("lens") or []) == list(lens)
                 and r.get("gflop") and abs(r["gflop"] * 1e9 - core_flop) < 1e-6 * core_flop), None)
    sdpa = (arow or {}).get("ms", {}).get("torch_sdpa")
    roof_a = _roof(proj_a["flop"] + core_flop, proj_a["bytes"])
    if sdpa:
        put("attention", roof_a, f"projections' roofline + torch SDPA of the attention bench ({arow['case']})",
            proj_a["ms"] + sdpa)
    else:
        put("attention", roof_a, "projections' roofline + causal core FLOPs at 700 TFLOP/s (no attention bench row)",
            proj_a["ms"] + core_flop / (PEAK_TFLOPS * 1e9))
    measured = {k: v for k, v in ((arow or {}).get("ms") or {}).items() if v}
    out["attention"].update(proj_ms=proj_a["ms"], core_flop=core_flop, core_ms=out["attention"]["ms"] - proj_a["ms"],
                            core_measured_ms=measured)
    moe = bool(config.num_experts)
    put("moe" if moe else "mlp", _ffn_roof(x, t, moe, x["e"]), "matmul FLOPs at 700 TFLOP/s (roofline)")
    put("embed_logits", _roof(2.0 * n * d * x["vocab"], b * (d * x["vocab"] + 2 * t * d) + 4 * n * x["vocab"]),
        "lm_head bytes at 4.8 TB/s (roofline)")
    return out


def _bench_lens(r: dict):
    """The stream lengths of a kernel bench row: its "lens", or B streams of T tokens (rows like B1-T32768)."""
    if r.get("lens"):
        return [int(m) for m in r["lens"]]
    if r.get("B") and r.get("T"):
        return [int(r["T"])] * int(r["B"])
    return None


def decode_floors(config, n: int, ctx: int, dtype_bytes: int = 2) -> dict:
    """Floor per part of one decode step of ``n`` streams holding ``ctx`` tokens each (same notation as
    ``prefill_floors``; all bound by bytes at 4.8 TB/s):
      gdn_decode        weights in_proj_qkvz / ba, conv, out_proj; the N recurrent states read + written (fp32
                        N Hv K V 4 x 2); the conv states read + written (N conv_dim (Kc - 1) b x 2); x in / out
      attention_decode  weights q (with gate) / k / v / o_proj; the K and V of ctx + 1 tokens read (N (ctx + 1)
                        Hkv Dh 2 b); the new token's K / V written; x in / out
      moe               the routed experts a step touches: E (1 - (1 - k / E)^N) expected distinct experts under
                        uniform routing, 3 D I b each; router, shared expert; FLOPs as in prefill with T = N
      embed_logits      lm_head D Vocab b; N Vocab fp32 logits
    Returns {part: {"ms", "basis", "roofline"}}."""
    x = _dims(config, dtype_bytes)
    b, d, nk, nv, hv = x["b"], x["d"], x["nk"], x["nv"], x["hv"]
    proj = 2 * nk + 2 * nv + 2 * hv
    out = {}

    def put(name, roof, basis):
        out[name] = {"ms": roof["ms"], "basis": basis, "roofline": roof}
    put("gdn_decode", _roof(2.0 * n * d * (proj + nv) + 6.0 * n * hv * x["kd"] * x["vd"],
                            b * (d * proj + x["conv"] * x["w"] + nv * d + 2 * n * d)
                            + 2 * 4 * n * hv * x["kd"] * x["vd"] + 2 * b * n * x["conv"] * (x["w"] - 1)),
        "weights + recurrent / conv states read and written, at 4.8 TB/s")
    qkv = 2 * x["hq"] * x["dh"] + 2 * x["hkv"] * x["dh"]
    kv = 2 * x["hkv"] * x["dh"] * b
    put("attention_decode", _roof(2.0 * n * d * qkv + 2.0 * n * x["hq"] * x["dh"] * d
                                  + 4.0 * n * x["hq"] * x["dh"] * (ctx + 1),
                                  b * (d * qkv + x["hq"] * x["dh"] * d + 2 * n * d) + n * (ctx + 1) * kv + n * kv),
        "weights + K/V of the context read, at 4.8 TB/s")
    moe = bool(config.num_experts)
    touched = x["e"] * (1 - (1 - x["k"] / x["e"]) ** n) if moe else 0
    put("moe" if moe else "mlp", _ffn_roof(x, n, moe, touched),
        f"weights of ~{touched:.0f} experts touched (uniform routing) + shared, at 4.8 TB/s" if moe
        else "MLP weights at 4.8 TB/s")
    put("embed_logits", _roof(2.0 * n * d * x["vocab"], b * (d * x["vocab"] + 2 * n * d) + 4 * n * x["vocab"]),
        "lm_head bytes at 4.8 TB/s")
    return out


def layer_counts(config) -> dict:
    """{"gdn", "attention", "moe", "mlp"}: how many layers of the config run each part (the FFN of a layer is MoE or
    MLP by ``config.layer_is_moe``)."""
    n = config.num_hidden_layers
    nm = sum(bool(config.num_experts) and config.layer_is_moe(i) for i in range(n))
    return {"gdn": len(config.gdn_layers), "attention": len(config.attn_layers), "moe": nm, "mlp": n - nm}


def row_floor(config, kind: str, case: tuple, dtype_bytes: int = 2, peers: dict = None, hf_ms: float = None,
              ours_ms: float = None) -> dict:
    """The floor of a whole row: the sum over the model's parts of (how many layers run it) x (its floor), i.e.
    what the row would take if every part ran at its floor and nothing else ran (no glue, no launch gaps).
    kind "prefill", case (name, lens): ``prefill_floors`` of lens, terms gdn_phase1/2/3 x GDN layers, attention x
    attention layers, moe (mlp) x MoE (MLP) layers, embed_logits once; kind "decode", case (name, N, ctx, _):
    ``decode_floors``, terms gdn_decode, attention_decode, moe, embed_logits. Two sums:
      row_floor_ms           each term at the parts' floor (the GDN core at the kernel bench's fastest column, the
                             attention core at the attention bench's torch SDPA, when ``peers`` has those rows;
                             matmuls at 700 TFLOP/s, bytes at 4.8 TB/s): the floor the parts' ratios use
      row_floor_roofline_ms  every term at its pure roofline max(FLOPs / 700 TFLOP/s, bytes / 4.8 TB/s), no
                             measured kernel in it (the GDN and attention cores at their FLOPs): a lower bound of
                             any implementation at those rates
      row_floor_hw_peak_ms   the same at the H200's dense bf16 peak, max(FLOPs / 989 TFLOP/s, bytes / 4.8 TB/s):
                             the hardware's own bound (no implementation runs a whole row at it)
    With ``hf_ms``: "hf_over_floor" = hf_ms / row_floor_ms, "hf_over_roofline", "hf_over_hw_peak": the largest
    speed-up over HF any implementation could reach at those floors; "target_3x_within_floor": whether 3x HF
    (hf_ms / 3) is at or above the row floor. With ``ours_ms``: "ours_over_floor". Returns {"case", "kind",
    "tokens", "layers", "terms": {part: {"count", "floor_ms", "ms", "roofline_ms", "flop", "bytes", "basis"}},
    "row_floor_ms", "row_floor_roofline_ms", "row_floor_hw_peak_ms", ...}."""
    c = layer_counts(config)
    if kind == "prefill":
        lens = case[1]
        f = prefill_floors(config, lens, dtype_bytes, peers)
        counts = {"gdn_phase1": c["gdn"], "gdn_phase2": c["gdn"], "gdn_phase3": c["gdn"],
                  "attention": c["attention"], "moe": c["moe"], "mlp": c["mlp"], "embed_logits": 1}
        tokens = int(sum(lens))
    else:
        _, n, ctx = case[:3]
        f = decode_floors(config, n, ctx, dtype_bytes)
        counts = {"gdn_decode": c["gdn"], "attention_decode": c["attention"], "moe": c["moe"], "mlp": c["mlp"],
                  "embed_logits": 1}
        tokens = int(n)
    terms = {k: {"count": m, "floor_ms": f[k]["ms"], "ms": m * f[k]["ms"], "roofline_ms": f[k]["roofline"]["ms"],
                 "flop": m * f[k]["roofline"]["flop"], "bytes": m * f[k]["roofline"]["bytes"], "basis": f[k]["basis"]}
             for k, m in counts.items() if m and k in f}
    out = {"case": case[0], "kind": kind, "tokens": tokens, "layers": config.num_hidden_layers, "terms": terms,
           "row_floor_ms": sum(t["ms"] for t in terms.values()),
           "row_floor_roofline_ms": sum(t["count"] * t["roofline_ms"] for t in terms.values()),
           "row_floor_hw_peak_ms": sum(max(t["flop"] / (HW_PEAK_TFLOPS * 1e9), t["bytes"] / (PEAK_TBPS * 1e9))
                                       for t in terms.values())}
    if hf_ms:
        out.update(hf_ms=hf_ms, hf_over_floor=hf_ms / out["row_floor_ms"],
                   hf_over_roofline=hf_ms / out["row_floor_roofline_ms"],
                   hf_over_hw_peak=hf_ms / out["row_floor_hw_peak_ms"],
                   target_3x_within_floor=hf_ms / 3 >= out["row_floor_ms"])
    if ours_ms:
        out.update(ours_ms=ours_ms, ours_over_floor=ours_ms / out["row_floor_ms"])
    return out


def row_floors(config, cases: dict, rows: list = (), peers: dict = None, dtype_bytes: int = 2) -> list:
    """``row_floor`` of the three rows of ``cases`` (varlen, long, decode), with the HF and our ms of ``rows`` (the
    section's rows, matched by case name) when they have them."""
    by = {r.get("case"): r for r in rows or ()}
    out = []
    for key, kind in (("varlen", "prefill"), ("long", "prefill"), ("decode", "decode")):
        ms = (by.get(cases[key][0]) or {}).get("ms") or {}
        out.append(row_floor(config, kind, cases[key], dtype_bytes, peers, hf_ms=ms.get("hf"),
                             ours_ms=ms.get("ours")))
    return out


def with_floors(parts_ms: dict, floors: dict) -> None:
    """Adds "floor_ms", "floor_ratio" (part / floor: the figure of record ``parts_ms[part]``),
    "floor_ratio_<timing>" for each of "ms_pipelined", "ms_blocking", "ms_in_program" that ``parts_ms`` has, and
    "floor_basis" per part to ``parts_ms`` in place."""
    parts_ms["floor_ms"] = {k: f["ms"] for k, f in floors.items()}
    parts_ms["floor_ratio"] = {k: (parts_ms[k] / f["ms"] if parts_ms.get(k) and f["ms"] else None)
                               for k, f in floors.items()}
    for t in ("pipelined", "blocking", "in_program"):
        if f"ms_{t}" in parts_ms:
            ms = parts_ms[f"ms_{t}"]
            parts_ms[f"floor_ratio_{t}"] = {k: (ms[k] / f["ms"] if ms.get(k) and ms[k] > 0 and f["ms"] else None)
                                            for k, f in floors.items()}
    parts_ms["floor_basis"] = {k: f["basis"] for k, f in floors.items()}
    parts_ms["roofline"] = {k: f["roofline"] for k, f in floors.items()}


def load_peers(device_kind: str, path: str = None) -> dict:
    """The results JSON of this device (``benchmarks.results.default_path``, e.g. benchmarks/results/h200.json) when
    it exists and was measured on ``device_kind``: its kernel rows and attention section give the GDN core's and
    the attention core's floors; its model section's rows ("model_rows", of a "model_layers"-layer model) give
    HF's ms to a row floor when this run has none. {} otherwise."""
    try:
        from benchmarks.results import RESULTS_DIR, device_file_name
        path = path or os.path.join(RESULTS_DIR, device_file_name(device_kind) + ".json")
        with open(path) as f:
            res = json.load(f)
        if res.get("device") != device_kind:
            return {}
        return {"rows": res.get("rows") or [], "attention": res.get("attention") or {}, "path": path,
                "date": res.get("date"), "model_rows": (res.get("model") or {}).get("rows") or [],
                "model_layers": (res.get("model") or {}).get("layers")}
    except (OSError, ValueError, ImportError):
        return {}
