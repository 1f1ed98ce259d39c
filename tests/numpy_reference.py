"""Float64 NumPy per-token gated delta rule: the ground truth every implementation is tested against.

Shapes as the op: q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; initial_state [N, Hv, K, V];
cu_seqlens [N + 1] (then B == 1). Value head h reads key head h // (Hv // Hk). q, k are used as given
(apply any L2 norm before calling, or pass use_qk_l2norm=True).
"""
from __future__ import annotations

import numpy as np


def l2norm_f64(x, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def gated_delta_rule_f64(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                         use_qk_l2norm=False):
    """Returns (o [B, T, Hv, V] float64, final_state [N, Hv, K, V] float64)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm_f64(q), l2norm_f64(k)
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    scale = dk ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        segments = [(bi, 0, t) for bi in range(b)]
    else:
        cu = np.asarray(cu_seqlens)
        segments = [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]
    n_seq = len(segments)
    if initial_state is None:
        init = np.zeros((n_seq, hv, dk, dv))
    else:
        init = np.asarray(initial_state, np.float64)
    o = np.zeros((b, t, hv, dv))
    final = np.zeros((n_seq, hv, dk, dv))
    for n, (bi, s0, s1) in enumerate(segments):
        for h in range(hv):
            kh = h // r
            S = init[n, h].copy()
            for i in range(s0, s1):
                S = np.exp(g[bi, i, h]) * S
                kt = k[bi, i, kh]
                u = beta[bi, i, h] * (v[bi, i, h] - S.T @ kt)
                S = S + np.outer(kt, u)
                o[bi, i, h] = S.T @ (scale * q[bi, i, kh])
            final[n, h] = S
    return o, final


def rel_rms(x, ref):
    """Relative RMS error ||x - ref|| / ||ref|| in float64 (NaN propagates, so NaN never passes)."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.sqrt(((x - ref) ** 2).sum()) / max(np.sqrt((ref ** 2).sum()), 1e-30))
