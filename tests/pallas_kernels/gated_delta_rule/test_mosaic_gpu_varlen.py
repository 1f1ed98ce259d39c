"""Packed sequences (cu_seqlens) and the slot pool on the Mosaic GPU backend
(pallas_kernels/gated_delta_rule/mosaic_gpu/varlen.py).

CPU: the repack / walk table / unpack around the jnp twin of the walked fused pass (``impl="reference"``, both
stage 1a choices: kkt_fwd's twin on the repacked row, Pallas Triton kkt_solve in interpret mode on the packed row)
against the float64 per-token oracle at fp32 (2e-4 relative RMS): lengths 1, 63, 0, 64, 65, 130 packed together
(an empty sequence among them), padding tokens past cu_seqlens[N] poisoned with NaN, grouped heads, per-sequence
initial states; a NaN token stays in its own sequence; the slot-pool form with ids outside [0, S) and
has_initial_state False over NaN slots; the layout maps and the table; wide "per_call"'s choice on the bench
mixes and both of its sides in one program. GPU (`pytest -m gpu`, Hopper): the kernel
path at bf16 against the float64 oracle (1e-2), the same odd lengths and NaN padding, K = V = 128 and 64, and the
public op / slots API on backend='mosaic_gpu' beside 'pallas'.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.cases import Case
from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mg
from pallas_kernels.gated_delta_rule.mosaic_gpu import varlen as mv
from pallas_kernels.gated_delta_rule.triton import varlen_copy as vc
from tests.gdn_harness import cu_of, make_inputs, oracle, rel_rms

LENS = (1, 63, 0, 64, 65, 130)        # odd lengths, an empty sequence, chunk-exact ones
PAD = 7                               # padding tokens past cu_seqlens[N]
PAD_IN_PLACE = 5                      # T = 328, a multiple of 8: the in-place reads take it (330 is repacked)


def _inputs(lens=LENS, pad=PAD, *, hk=1, hv=2, kdim=16, vdim=8, seed=0, with_h0=True, poison_pad=True):
    t = sum(lens) + pad
    case = Case(f"cpu-varlen-T{t}", 1, t, hk, hv, kdim, vdim)
    q, k, v, g, beta, h0, _ = (None if x is None else np.array(x)
                               for x in make_inputs(case, seed, jnp.float32, with_h0=with_h0, lens=lens))
    cu = cu_of(lens)
    if poison_pad and pad:
        for x in (q, k, v, g, beta):
            x[0, cu[-1]:] = np.nan                   # padding tokens must reach nothing
    return q, k, v, g, beta, h0, cu


def _run(args, dtype=jnp.float32, impl="reference", stage1a="mosaic", order="longest_first", final=True,
         states="kv", lanes=0, copies="triton", kkt_used=True, reads="repacked", wide=False, solve=False, split=0):
    q, k, v, g, beta, h0, cu = args
    o, s = mv.chunk_gated_delta_rule_varlen_fwd(
        jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g),
        jnp.asarray(beta, dtype), jnp.asarray(cu), None if h0 is None else jnp.asarray(h0), impl=impl,
        stage1a=stage1a, order=order, output_final_state=final, states=states, lanes=lanes,
        copies=copies, kkt_used=kkt_used, reads=reads, wide=wide, solve=solve, split=split)
    return np.asarray(o.astype(jnp.float32)), (None if s is None else np.asarray(s))


def _oracle(args, dtype=jnp.float32):
    q, k, v, g, beta, h0, cu = args
    clean = [np.nan_to_num(x, nan=0.0) for x in (q, k, v, g, beta)]     # the oracle never reads padding
    beta_seen = np.asarray(jnp.asarray(clean[4], dtype).astype(jnp.float32))
    return oracle(*clean[:4], beta_seen, h0, cu)


@pytest.mark.parametrize("stage1a,states,lanes,copies,kkt_used", [
    ("mosaic", "vk", 0, "xla", False), ("triton", "kv", 0, "xla", False), ("mosaic", "kv", 2, "xla", False),
    ("triton", "vk", 4, "xla", False), ("mosaic", "kv", 0, "triton", True)])
def test_reference_matches_f64(stage1a, states, lanes, copies, kkt_used):
    """Odd lengths with an empty sequence, NaN padding past cu_seqlens[N], grouped heads (Hv = 2 Hk), initial
    states: o (padding rows exactly zero) and every final state (the empty sequence's is its initial state).
    ``lanes``: the persistent walk (each lane's sequences back to back); ``copies="triton"``: the repack and unpack
    by the Pallas Triton copy kernels (interpret mode); ``kkt_used``: T0 of the unused chunk slots is NaN in the
    twin (the kernel leaves it unset), so a read of it would show."""
    args = _inputs()
    o, s = _run(args, stage1a=stage1a, states=states, lanes=lanes, copies=copies, kkt_used=kkt_used)
    ro, rs = _oracle(args)
    cu = args[-1]
    assert np.isfinite(o).all() and np.isfinite(s).all()
    assert np.all(o[0, cu[-1]:] == 0)
    assert rel_rms(o, ro) < 2e-4, rel_rms(o, ro)
    assert rel_rms(s, rs) < 2e-4, rel_rms(s, rs)
    assert np.array_equal(s[2], args[5][2])                     # the empty sequence keeps its state exactly


@pytest.mark.parametrize("states,order,kkt_used", [("kv", "longest_first", True), ("vk", "index", False)])
def test_in_place_reference_matches_f64(states, order, kkt_used):
    """reads="in_place" (the packed row read where it lies, chunks on the grid of 8 rows, o stored in place with
    its edges merged): the same odd lengths, NaN padding, grouped heads and initial states as above at T = 328;
    sequence 1 starts at row 1 and sequence 5 at row 193, so their first chunks hold their neighbours' tokens."""
    args = _inputs(pad=PAD_IN_PLACE)
    cu = args[-1]
    assert mv.reads_in_place("in_place", "mosaic", 0, args[0].shape[1])
    assert not mv.reads_in_place("in_place", "mosaic", 0, args[0].shape[1] + 2)    # T % 8: repacked
    o, s = _run(args, reads="in_place", states=states, order=order, kkt_used=kkt_used)
    ro, rs = _oracle(args)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    assert np.all(o[0, cu[-1]:] == 0)
    assert rel_rms(o, ro) < 2e-4, rel_rms(o, ro)
    assert rel_rms(s, rs) < 2e-4, rel_rms(s, rs)
    assert np.array_equal(s[2], args[5][2])


def _nan_neighbours(run, args):
    """A NaN in the token just before sequence 1 (row 0, sequence 0's only token) and just before sequence 5
    (row 192, sequence 4's last): those rows sit in the first chunk of the next sequence on the grid of 8 rows.
    Every other sequence's rows and final state equal the clean run's bit for bit."""
    o_clean, s_clean = run(args)
    cu = args[-1]
    q, k, v = args[0].copy(), args[1].copy(), args[2].copy()
    for row in (0, cu[5] - 1):
        q[0, row] = k[0, row] = np.nan
        v[0, row, 1] = np.nan
    o_bad, s_bad = run((q, k, v) + args[3:])
    spoiled = [0, 4]
    others = np.ones(o_bad.shape[1], bool)
    for n in spoiled:
        others[cu[n]:cu[n + 1]] = False
        assert np.isnan(o_bad[0, cu[n]:cu[n + 1]]).any() and np.isnan(s_bad[n]).any()
    assert np.array_equal(o_bad[0, others], o_clean[0, others])
    assert np.array_equal(np.delete(s_bad, spoiled, 0), np.delete(s_clean, spoiled, 0))


def test_in_place_nan_stays_in_its_sequence():
    _nan_neighbours(lambda a: _run(a, reads="in_place"), _inputs(pad=PAD_IN_PLACE, seed=6))


SPLIT_LENS = (65, 1, 0, 700, 63, 130)     # sequence 3 (11 chunks) starts at row 66: its first chunk's rows 64, 65
SPLIT_PAD = 9                             # are its neighbours'; T = 968


@pytest.mark.parametrize("split,with_h0,states", [(2, True, "kv"), (3, False, "vk"), (4, True, "vk")])
def test_in_place_split_reference_matches_f64(split, with_h0, states):
    """The packed split (``split`` = the shortest piece in chunks; at Hv 2, V 8 one wave holds 66 CTA rows, so
    every sequence of more than ``split`` chunks is cut, up to 8 pieces): the map pass's twin over the packed
    row, the scan and the fused pass's twin over the pieces against the float64 oracle (2e-4), with and without
    initial states, the long sequence's first chunk holding its neighbours' rows; padding rows exactly zero, the
    empty sequence's state its initial state bit for bit; the split and unsplit paths agree to 1e-6."""
    args = _inputs(lens=SPLIT_LENS, pad=SPLIT_PAD, with_h0=with_h0, seed=4)
    cu = args[-1]
    o, s = _run(args, reads="in_place", states=states, split=split)
    o0, s0 = _run(args, reads="in_place", states=states)
    ro, rs = _oracle(args)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    assert np.all(o[0, cu[-1]:] == 0)
    assert rel_rms(o, ro) < 2e-4 and rel_rms(s, rs) < 2e-4, (rel_rms(o, ro), rel_rms(s, rs))
    assert np.abs(o - o0).max() < 1e-6 and np.abs(s - s0).max() < 1e-6
    if with_h0:
        assert np.array_equal(s[2], args[5][2])


def test_in_place_split_nan_stays_in_its_sequence():
    """A NaN in rows 64 and 65 (sequence 0's last token and sequence 1's only one), which lie in the first chunk
    of the split sequence 3: only sequences 0 and 1 are spoiled; every other row and final state equals the
    clean run's bit for bit (the map pass masks the leading rows by selects)."""
    args = _inputs(lens=SPLIT_LENS, pad=SPLIT_PAD, seed=5)
    cu = args[-1]
    run = lambda a: _run(a, reads="in_place", split=2)
    o_clean, s_clean = run(args)
    q, k, v = args[0].copy(), args[1].copy(), args[2].copy()
    for row in (64, 65):
        q[0, row] = k[0, row] = np.nan
        v[0, row, 1] = np.nan
    o_bad, s_bad = run((q, k, v) + args[3:])
    others = np.ones(o_bad.shape[1], bool)
    others[:cu[2]] = False
    assert np.isnan(s_bad[0]).any() and np.isnan(s_bad[1]).any()
    assert np.array_equal(o_bad[0, others], o_clean[0, others])
    assert np.array_equal(s_bad[2:], s_clean[2:])


def test_split_plan_covers_each_sequence_in_order():
    """The plan made on the device: each sequence's pieces cover its chunks once, in order, every piece but the
    last full and the last not empty; the mapped rows are the pieces but the last, in sequence order, and each
    later piece starts from the map of the piece before it; the fused pass's rows are longest first; the extra
    rows stay within the static bound; another packing of the same T and N reuses the program."""
    t, n_seqs = 968, len(SPLIT_LENS)
    slots = mv.in_place_layout(jnp.asarray(cu_of(SPLIT_LENS)), t)[0].tile0.shape[0]
    extra = mv.split_rows(n_seqs, slots, 2, 8, 2)

    @jax.jit
    def plan_of(cu):
        return mv.split_plan(mv.in_place_layout(cu, t)[0], cu, extra, heads=2, value_dim=8, min_chunks=2)

    for lens in (SPLIT_LENS, (3, 900, 0, 1, 40, 10), (959, 0, 0, 0, 0, 0)):
        cu = jnp.asarray(cu_of(lens))
        ac = mv.in_place_layout(cu, t)[0]
        plan = plan_of(cu)
        w, maps = np.asarray(plan.walk), np.asarray(plan.maps)
        assert (np.asarray(plan.piece_index) >= 1).any()          # each packing has a sequence to cut
        first, count = np.asarray(ac.seq_first_chunk), np.asarray(ac.seq_num_chunks)
        assert w.shape[0] == len(lens) + extra and np.all(np.diff(w[:, 1]) <= 0)
        seq_idx, pidx = np.asarray(plan.piece_seq), np.asarray(plan.piece_index)
        by_row = {r[2]: r for r in w}
        for n in range(len(lens)):
            rows = [by_row[i] for i in range(w.shape[0]) if seq_idx[i] == n and pidx[i] >= 0]
            assert [pidx[r[2]] for r in rows] == list(range(len(rows)))
            chunks = [c for r in rows for c in range(r[0], r[0] + r[1])]
            assert chunks == list(range(first[n], first[n] + count[n]))
            assert all(r[1] == rows[0][1] for r in rows[:-1]) and (count[n] == 0 or rows[-1][1] > 0)
            assert all(r[6] == n and r[7] == r[0] - first[n] for r in rows)
            assert np.asarray(plan.last_row)[n] == rows[-1][2]
            for r in rows[1:]:
                m = maps[np.asarray(plan.map_row)[r[2]]]
                assert m[5] == n and m[0] + m[1] == r[0] and m[4] == (pidx[r[2]] == 1)
        assert sum(int(r[1]) for r in maps) == sum(int(r[1]) for r in w if pidx[r[2]] >= 0
                                                    and r[2] != np.asarray(plan.last_row)[r[6]])
    assert plan_of._cache_size() == 1
    assert mv.split_rows(17, 1000, 2, 8, 2) == 0 and mv.split_rows(1, 1000, 2, 8, 0) == 0
    assert mv.split_rows(1, 512, 32, 128, 32) == 2           # Hv 32, V 128: 64 CTAs a row, two rows a wave


def test_wide_pays_on_the_measured_mixes():
    """wide "per_call"'s choice (``mv.wide_pays``; 132 SMs, Hv 32, V 128) on the bench's mixes: wide where the wide
    pass won (varlen16 0.6693 -> 0.6027 ms, serve256 1.9300 -> 1.6768 narrow -> wide, 3db21ee), narrow where it
    lost (long16k-short63 0.7714 narrow against 0.8963 wide, 8c8daaf); one program for every packing of an N."""
    from benchmarks.cases import LONG1_SHORT63_LENS, SERVE256_LENS, VARLEN16_LENS
    traces = []

    @jax.jit
    def pays(cu):
        traces.append(cu.shape)
        return mv.wide_pays(cu, 32, 128, sms=132)
    assert bool(pays(jnp.asarray(cu_of(VARLEN16_LENS))))
    assert bool(pays(jnp.asarray(cu_of(SERVE256_LENS))))
    assert not bool(pays(jnp.asarray(cu_of(LONG1_SHORT63_LENS))))
    assert bool(pays(jnp.asarray(cu_of((400,) * 64))))                        # the same N, lengths equal: wide
    assert not bool(pays(jnp.asarray(cu_of((8000,) + (1,) * 63))))             # one long sequence: narrow
    assert len(traces) == 3                                                    # N = 16, 256, 64


# wide "per_call" at Hk 1, Hv 2, K = V = 128, 40 sequences of the same T: a long one among short ones (narrow), equal
# ones (wide)
PER_CALL_MIXES = ((420,) + (20,) * 39, (30,) * 40)


def test_per_call_wide_reference_matches_f64():
    """wide "per_call" (the wide or the narrow pass chosen on the device by ``wide_pays``, both under one
    ``lax.cond``) in reference mode at K = V = 128 and 40 sequences (where "auto" would run wide): a long sequence
    among short ones (narrow) and 40 equal ones (wide), the same T and N, so one program serves both; o and the
    final states against the float64 oracle at 2e-4, padding rows exactly zero."""
    fwd = mv.chunk_gated_delta_rule_varlen_fwd
    assert mg.wide_pass("auto", 40, 2, 128)
    sides = [bool(mv.wide_pays(jnp.asarray(cu_of(lens)), 2, 128)) for lens in PER_CALL_MIXES]
    assert sides == [False, True]
    for i, lens in enumerate(PER_CALL_MIXES):
        args = _inputs(lens, pad=8, hk=1, hv=2, kdim=128, vdim=128, seed=11 + i)
        o, s = _run(args, reads="in_place", wide="per_call", split=mv.SPLIT_MIN_CHUNKS)
        ro, rs = _oracle(args)
        cu = args[-1]
        assert np.all(o[0, cu[-1]:] == 0)
        assert rel_rms(o, ro) < 2e-4 and rel_rms(s, rs) < 2e-4, (rel_rms(o, ro), rel_rms(s, rs))
        if i == 0:
            size = fwd._cache_size()
    assert fwd._cache_size() == size                                           # no recompile for the other side


@pytest.mark.parametrize("t,pad", [(130, 0), (130, 6), (64, 0)])
def test_one_sequence_over_the_row_runs_the_dense_op(t, pad, monkeypatch, request):
    """single_dense (the default): a packed call of one sequence has the dense op in its program beside the packed
    path (a ``lax.cond`` on cu_seqlens == [0, T]); covering the whole row it gives the dense op's result bit for bit,
    followed by NaN padding the packed path's, each against the float64 oracle at 2e-4 with and without h0. (In
    reference mode the two paths agree bit for bit on a whole row, so which one ran is checked by the trace.)"""
    dense_calls = []
    dense = mg.chunk_gated_delta_rule_fwd

    def spy(*a, **kw):
        dense_calls.append(1)
        return dense(*a, **kw)
    monkeypatch.setattr(mg, "chunk_gated_delta_rule_fwd", spy)
    mv.chunk_gated_delta_rule_varlen_fwd.clear_cache()                 # traced afresh, with the spy
    request.addfinalizer(mv.chunk_gated_delta_rule_varlen_fwd.clear_cache)
    for with_h0 in (True, False):
        args = _inputs((t,), pad=pad, hk=1, hv=2, kdim=16, vdim=16, seed=t + pad, with_h0=with_h0)
        q, k, v, g, beta, h0, cu = args
        traced = len(dense_calls)
        o, s = mv.chunk_gated_delta_rule_varlen_fwd(
            *(jnp.asarray(x) for x in (q, k, v, g, beta, cu)), None if h0 is None else jnp.asarray(h0),
            impl="reference", stage1a="mosaic", states="kv", copies="triton", kkt_used=True, reads="in_place",
            wide="per_call", split=mv.SPLIT_MIN_CHUNKS, single_dense=True)
        assert len(dense_calls) == traced + 1                          # the dense op is in the program
        o, s = np.asarray(o), np.asarray(s)
        ro, rs = _oracle(args)
        assert np.all(o[0, cu[-1]:] == 0) and np.isfinite(s).all()
        assert rel_rms(o, ro) < 2e-4 and rel_rms(s, rs) < 2e-4, (rel_rms(o, ro), rel_rms(s, rs))
        if pad:
            other = _run(args, reads="in_place", wide="per_call", split=mv.SPLIT_MIN_CHUNKS)
        else:
            other = dense(*(jnp.asarray(x) for x in (q, k, v, g, beta)), None if h0 is None else jnp.asarray(h0),
                          impl="reference", **mg.DEFAULT_CONFIG.options())
        assert np.array_equal(o, np.asarray(other[0])) and np.array_equal(s, np.asarray(other[1]))
    two = _inputs((40, 90), pad=pad, hk=1, hv=2, kdim=16, vdim=16, seed=1)
    traced = len(dense_calls)
    mv.chunk_gated_delta_rule_varlen_fwd(*(jnp.asarray(x) for x in two[:5] + (two[6],)), jnp.asarray(two[5]),
                                         impl="reference", single_dense=True)
    assert len(dense_calls) == traced                                  # two sequences: the packed path alone


def _holds_cond(fn, *args) -> bool:
    """Whether the program of ``fn(*args)`` holds an XLA-level ``lax.cond`` (searched through nested jaxprs, not
    into Pallas kernel bodies, whose ``pl.when`` is a branch inside the kernel on a GPU)."""
    def walk(jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "cond":
                return True
            if eqn.primitive.name == "pallas_call":
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns") and walk(inner):
                        return True
        return False
    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def test_short_calls_hold_no_device_branch():
    """cond_min_tokens: below it (static T) the packed forward makes its choices from shapes and holds no
    ``lax.cond`` (a host wait on a GPU): one sequence takes the packed path, wide "per_call" becomes "auto"; from
    it on both conds are there. The config's default is ``DEVICE_BRANCH_MIN_TOKENS``, and the op passes it on."""
    from pallas_kernels.dispatch import DEVICE_BRANCH_MIN_TOKENS
    assert mv.VarlenConfig().cond_min_tokens == DEVICE_BRANCH_MIN_TOKENS > 4096
    one = _inputs((64,), pad=0, hk=1, hv=2, kdim=16, vdim=16, seed=3)
    many = _inputs((30, 40, 50), pad=0, hk=1, hv=32, kdim=16, vdim=128, seed=4)       # "auto" runs these wide
    for args, n in ((one, 1), (many, 3)):
        q, k, v, g, beta, h0, cu = (None if x is None else jnp.asarray(x) for x in args)
        t = q.shape[1]
        for floor, held in ((t + 1, False), (t, True), (0, True)):
            def fwd(q, k, v, g, beta, h0, cu, floor=floor):
                return mv.chunk_gated_delta_rule_varlen_fwd(
                    q, k, v, g, beta, cu, h0, impl="reference", reads="in_place", copies="triton", kkt_used=True,
                    wide="per_call", split=mv.SPLIT_MIN_CHUNKS, single_dense=True, cond_min_tokens=floor)
            assert _holds_cond(fwd, q, k, v, g, beta, h0, cu) == held, (n, floor)
        if n == 1:
            def op(q, k, v, g, beta, h0, cu, cfg):
                return mv.op_fwd_slots(q, k, v, g, beta, scale=0.25, ssm_state=h0, slot_ids=jnp.zeros((1,), jnp.int32),
                                       has_initial_state=jnp.ones((1,), bool), cu_seqlens=cu, config=cfg,
                                       impl="reference")
            assert not _holds_cond(functools.partial(op, cfg=mv.VarlenConfig()), q, k, v, g, beta, h0, cu)
            assert _holds_cond(functools.partial(op, cfg=mv.VarlenConfig(cond_min_tokens=0)), q, k, v, g, beta, h0,
                               cu)
    with pytest.raises(ValueError, match="cond_min_tokens"):
        mv.VarlenConfig(cond_min_tokens=-1)


def test_in_place_layout_and_edges():
    """The in-place maps: every real token in exactly one chunk's own rows, chunks starting at multiples of 8 at
    or before their sequence, each sequence's chunk count minimal; the kernel's stores (their twin) plus
    :func:`merge_edges` put every chunk-slot row back on its packed row, padding zero."""
    lens = (5, 0, 3, 64, 130, 1, 9, 20)
    t = -(-(sum(lens) + 4) // 8) * 8
    cu = jnp.asarray(cu_of(lens))
    ac, walk, groups = mv.in_place_layout(cu, t)
    src, keep = np.asarray(ac.src), np.asarray(ac.keep)
    assert sorted(src[keep].tolist()) == list(range(sum(lens)))
    w = np.asarray(walk)
    cun = np.asarray(cu)
    for c0, cnt, n, start, length, row8 in w:
        row0 = 8 * row8
        assert start == cun[n] and length == lens[n] and row0 % 8 == 0 and start - 8 < row0 <= start
        assert cnt == (0 if length == 0 else -(-(start + length - row0) // mv.C))
        assert np.all(np.asarray(ac.tile0)[c0:c0 + cnt] == row0 + mv.C * np.arange(cnt))
    rng = np.random.default_rng(0)
    o_r = jnp.asarray(rng.standard_normal((1, src.shape[0], 2, 3)), jnp.float32)
    o, edges = mv.in_place_stores_reference(o_r, ac, walk, t)
    assert np.isnan(np.asarray(o)).any()                        # the partial groups are unset before the merge
    want = np.zeros((1, t, 2, 3), np.float32)
    want[0, src[keep]] = np.asarray(o_r)[0, keep]
    got = np.asarray(mv.merge_edges(o, edges, groups, cu[-1:], kernel=False))            # XLA scatter
    assert np.array_equal(got, want)
    got = np.asarray(mv.merge_edges(o, edges, groups, cu[-1:], interpret=True))           # the Triton launch
    assert np.array_equal(got, want)


def test_reference_no_initial_state_index_order_k32():
    """No initial state, no final state, the table in sequence order, Hk 2 / Hv 4, K = 32, V = 16."""
    args = _inputs(lens=(130, 3, 64, 0, 90), pad=0, hk=2, hv=4, kdim=32, vdim=16, seed=3, with_h0=False)
    o, s = _run(args, order="index", final=False)
    ro, _ = _oracle(args)
    assert s is None
    assert rel_rms(o, ro) < 2e-4, rel_rms(o, ro)


def test_nan_token_stays_in_its_sequence():
    """A NaN in the first token of sequence 3 (64 tokens) poisons only that sequence; every other sequence's rows
    and final state equal the clean run's bit for bit, also sequence 1 (63 tokens, then the empty sequence 2),
    whose one chunk would cover that token in the packed row."""
    args = _inputs(seed=5)
    o_clean, s_clean = _run(args)
    cu = args[-1]
    k, v = args[1].copy(), args[2].copy()
    k[0, cu[3]] = np.nan
    v[0, cu[3], 1] = np.nan
    o_bad, s_bad = _run(args[:1] + (k, v) + args[3:])
    others = np.ones(o_bad.shape[1], bool)
    others[cu[3]:cu[4]] = False
    assert np.isnan(o_bad[0, cu[3]:cu[4]]).any() and np.isnan(s_bad[3]).any()
    assert np.array_equal(o_bad[0, others], o_clean[0, others])
    assert np.array_equal(np.delete(s_bad, 3, 0), np.delete(s_clean, 3, 0))


@pytest.mark.parametrize("lens,pad", [(LENS, PAD), ((130, 0, 1, 65), 0), ((64,), 1)])
def test_triton_copies_match_xla_gather_bitwise(lens, pad, interpret=True):
    """varlen_copy_triton (interpret mode) against the XLA gathers it replaces (``mv.repack`` / ``gather_rows``),
    bit for bit: bf16 q-like [T, Hk K] and v-like [T, Hv V] and fp32 g-like [T, Hv] arrays in one repack launch,
    odd lengths with a 0-length sequence, padding tokens past cu_seqlens[N] and every source row past a chunk's end
    NaN or not; interpret mode starts every output as NaN, so a destination row the kernels do not write (the zero
    tails, the padding rows) fails the comparison; the repack leaves the unused chunk slots unset (NaN
    here), which the float64 test of the path with copies="triton" shows nothing reads."""
    t = sum(lens) + pad
    cu = jnp.asarray(cu_of(lens))
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((t, d)).astype(np.float32) for d in (2 * 16, 4 * 8, 4)]
    for x in xs:
        x[int(cu[-1]):] = np.nan
    xs = [jnp.asarray(xs[0], jnp.bfloat16), jnp.asarray(xs[1], jnp.bfloat16), jnp.asarray(xs[2])]
    cm, src, keep, back, valid, _ = mv.layout(cu, t)
    chunks = mv.chunk_rows(cm, src.shape[0] // mv.C)
    got = vc.repack_rows(tuple(xs), *chunks, interpret=interpret)
    want = mv.repack(tuple(x[None] for x in xs), src, keep)
    used = int(mv.used_chunks(cm)[0]) * mv.C          # the unused slots after them are left unset
    for a, b in zip(got, want):
        assert a.shape == b[0].shape and a.dtype == b.dtype
        assert np.array_equal(np.asarray(a[:used]).view(np.uint8), np.asarray(b[0, :used]).view(np.uint8))
        if interpret:                                 # (interpret mode's unset rows are NaN)
            assert np.isnan(np.asarray(a[used:], np.float32)).all()
    o_r = jnp.asarray(rng.standard_normal((src.shape[0], 4 * 8)), jnp.bfloat16)
    o_r = o_r.at[jnp.where(keep, src.shape[0], jnp.arange(src.shape[0]))].set(jnp.nan, mode="drop")  # unowned rows
    got = vc.unpack_rows(o_r, *chunks, cu[-1:], total_len=t, interpret=interpret)
    want = mv.gather_rows(o_r, back, valid)
    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert np.all(np.asarray(got[int(cu[-1]):], np.float32) == 0)


def test_layout_maps_and_walk_table():
    lens, t = (5, 0, 64, 130, 1), 210
    cu = jnp.asarray(cu_of(lens))
    cm, src, keep, back, valid, walk = mv.layout(cu, t)
    nc = -(-(t // mv.C + len(lens)) // 8) * 8
    assert src.shape == (nc * mv.C,) and back.shape == (t,)
    x = np.arange(t, dtype=np.float32) + 1
    rep = np.where(np.asarray(keep), x[np.asarray(src)], 0)
    assert np.array_equal(rep[np.asarray(back)][np.asarray(valid)], x[:sum(lens)])          # round trip
    assert int(np.asarray(keep).sum()) == sum(lens) and not np.asarray(valid)[sum(lens):].any()
    w = np.asarray(walk)
    assert w[:, 2].tolist() == [3, 0, 2, 4, 1]                   # longest first (ties in index order)
    assert w[:, 1].tolist() == [3, 1, 1, 1, 0]
    assert np.array_equal(w[:, 3], np.asarray(cu)[w[:, 2]]) and w[:, 4].tolist() == [130, 5, 64, 1, 0]
    starts = np.asarray(cm.seq_first_chunk)
    assert np.array_equal(w[:, 0], starts[w[:, 2]])
    for c0, cnt, n, _, _ in w:                                      # each sequence starts at its chunk's first row
        if cnt:
            assert int(np.asarray(src)[c0 * mv.C]) == int(cu[n])
    w_idx = np.asarray(mv.layout(cu, t, order="index")[-1])
    assert w_idx[:, 2].tolist() == list(range(len(lens)))


@pytest.mark.parametrize("lanes", [1, 3, 5])
def test_lane_table_deals_every_sequence_once(lanes):
    """The persistent walk's lanes: every sequence in exactly one lane row, rows of a lane a prefix, m0 the chunks
    its lane walks before it, the lanes' chunk totals within the longest sequence of each other (snake order)."""
    lens = (5, 0, 64, 130, 1, 300, 70, 64, 9)
    cu = jnp.asarray(cu_of(lens))
    walk = mv.layout(cu, sum(lens))[-1]
    table, rows = (np.asarray(x) for x in mv.lane_table(walk, lanes))
    seen = [table[p, j, 2] for p in range(lanes) for j in range(rows[p])]
    assert sorted(seen) == list(range(len(lens)))
    for p in range(lanes):
        cnt = table[p, :rows[p], 1]
        assert np.array_equal(table[p, :rows[p], 5], np.cumsum(cnt) - cnt)
        assert np.all(table[p, rows[p]:, 1] == 0)
    totals = [table[p, :rows[p], 1].sum() for p in range(lanes)]
    assert max(totals) - min(totals) <= np.asarray(walk)[:, 1].max()
    assert mv.num_lanes(-1, 256, 32, 128, sms=132) == 2 and mv.num_lanes(-1, 7, 32, 128, sms=132) == 0
    assert mv.num_lanes(3, 2, 32, 128) == 2


def test_walk_twin_uses_the_table():
    """A table row that walks one chunk too few must change that sequence's final state (the twin reads the
    table, so a wrong table in the kernel's layout would be caught by the tests above)."""
    args = _inputs(seed=2)
    q, k, v, g, beta, h0, cu = args
    q, k, v, g, beta = (jnp.asarray(np.nan_to_num(x)) for x in (q, k, v, g, beta))
    t = q.shape[1]
    cm, src, keep, back, valid, walk = mv.layout(jnp.asarray(cu), t)
    q_r, k_r, v_r, g_r, b_r = mv.repack((q, k, v, g, beta), src, keep)
    h0t = jnp.swapaxes(jnp.asarray(h0), -1, -2)
    *t1a, hm = mv.stage1a_operands(k_r, g_r, b_r, kernel=False, stage1a="mosaic", vdim=v.shape[3])
    run_ops = (q_r, k_r, v_r, *t1a, h0t)
    _, ht = mv.fused_state_pass_walk_reference(*run_ops, walk, num_states=len(cu) - 1, scale=0.25,
                                               out_final=True, head_major=hm)
    short = walk.at[0, 1].add(-1)                                # the longest sequence loses its last chunk
    _, ht2 = mv.fused_state_pass_walk_reference(*run_ops, short, num_states=len(cu) - 1, scale=0.25,
                                                out_final=True, head_major=hm)
    n0 = int(walk[0, 2])
    assert rel_rms(np.asarray(ht2[n0]), np.asarray(ht[n0])) > 1e-2
    assert np.array_equal(np.delete(np.asarray(ht2), n0, 0), np.delete(np.asarray(ht), n0, 0))


def test_slots_reference_matches_xla():
    """The slot-pool form: ids 3, -1 (no slot), 0, 5 = S (a padding stream), 1, 2 over a pool of 5 whose slot 4 is
    NaN and whose slot 1 is NaN but has_initial_state False there: o and the pool against the XLA backend; the
    ids outside [0, S) write nothing, slot 4 stays NaN."""
    from jax_gdn import ops
    args = _inputs(seed=4)
    q, k, v, g, beta, _, cu = args
    n = len(cu) - 1
    rng = np.random.default_rng(9)
    pool = rng.standard_normal((5, 2, 16, 8)).astype(np.float32)
    pool[4] = np.nan
    pool[1] = np.nan
    ids = np.array([3, -1, 0, 5, 1, 2], np.int32)
    has = np.array([True, True, False, True, False, True])
    assert len(ids) == n
    x = tuple(jnp.asarray(a) for a in (q, k, v, g, beta))
    o, new = mv.op_fwd_slots(*x, scale=0.25, ssm_state=jnp.asarray(pool), slot_ids=jnp.asarray(ids),
                             has_initial_state=jnp.asarray(has), cu_seqlens=jnp.asarray(cu), impl="reference")
    clean = tuple(jnp.asarray(np.nan_to_num(a)) for a in (q, k, v, g, beta))
    ro, rnew = ops.chunk_gated_delta_rule_slots(*clean, ssm_state=jnp.asarray(pool), slot_ids=jnp.asarray(ids),
                                                has_initial_state=jnp.asarray(has), cu_seqlens=jnp.asarray(cu),
                                                scale=0.25, backend="xla")
    o, new, ro, rnew = (np.asarray(a) for a in (o, new, ro, rnew))
    assert np.isfinite(o).all() and np.all(o[0, cu[-1]:] == 0)
    assert rel_rms(o, ro) < 2e-4
    assert np.isnan(new[4]).all()                                # untouched slot: still NaN
    written = [0, 1, 2, 3]
    assert rel_rms(new[written], rnew[written]) < 2e-4


def test_slots_reference_with_the_packed_split(monkeypatch):
    """The slot pool around the packed split (in place, pieces of 2 chunks; the plan is made, seen by a spy): the
    long sequence's pieces write one final state to its slot; ids -1 and S write nothing, NaN slot 4 stays NaN; o
    and the pool against the XLA backend (2e-4)."""
    from jax_gdn import ops
    plans = []
    real = mv.split_plan
    monkeypatch.setattr(mv, "split_plan", lambda *a, **k: plans.append(1) or real(*a, **k))
    args = _inputs(lens=SPLIT_LENS, pad=SPLIT_PAD, seed=7)
    q, k, v, g, beta, _, cu = args
    rng = np.random.default_rng(10)
    pool = rng.standard_normal((5, 2, 16, 8)).astype(np.float32)
    pool[4] = np.nan
    ids = np.array([3, -1, 0, 1, 5, 2], np.int32)                # sequence 3 (11 chunks) into slot 1
    has = np.array([True, True, False, True, True, True])
    x = tuple(jnp.asarray(a) for a in (q, k, v, g, beta))
    cfg = mv.VarlenConfig(reads="in_place", split=2, wide=False)
    o, new = mv.op_fwd_slots(*x, scale=0.25, ssm_state=jnp.asarray(pool), slot_ids=jnp.asarray(ids),
                             has_initial_state=jnp.asarray(has), cu_seqlens=jnp.asarray(cu), impl="reference",
                             config=cfg)
    clean = tuple(jnp.asarray(np.nan_to_num(a)) for a in (q, k, v, g, beta))
    ro, rnew = ops.chunk_gated_delta_rule_slots(*clean, ssm_state=jnp.asarray(pool), slot_ids=jnp.asarray(ids),
                                                has_initial_state=jnp.asarray(has), cu_seqlens=jnp.asarray(cu),
                                                scale=0.25, backend="xla")
    o, new, ro, rnew = (np.asarray(a) for a in (o, new, ro, rnew))
    assert plans
    assert np.isfinite(o).all() and np.all(o[0, cu[-1]:] == 0)
    assert rel_rms(o, ro) < 2e-4
    assert np.isnan(new[4]).all()
    written = [0, 1, 2, 3]
    assert rel_rms(new[written], rnew[written]) < 2e-4


def test_slots_reference_dense_rows():
    """Without cu_seqlens the slot form runs the dense Mosaic path (its twin) on N = B rows."""
    from jax_gdn import ops
    case = Case("cpu-B2-T65", 2, 65, 1, 2, 16, 8)
    q, k, v, g, beta, _, _ = make_inputs(case, 1, jnp.float32, with_h0=False)
    pool = np.random.default_rng(1).standard_normal((3, 2, 16, 8)).astype(np.float32)
    ids, has = jnp.asarray([2, 0], jnp.int32), jnp.asarray([True, False])
    x = tuple(jnp.asarray(a) for a in (q, k, v, g, beta))
    o, new = mv.op_fwd_slots(*x, scale=0.25, ssm_state=jnp.asarray(pool), slot_ids=ids, has_initial_state=has,
                             impl="reference")
    ro, rnew = ops.chunk_gated_delta_rule_slots(*x, ssm_state=jnp.asarray(pool), slot_ids=ids, has_initial_state=has,
                                                scale=0.25, backend="xla")
    assert rel_rms(np.asarray(o), np.asarray(ro)) < 2e-4 and rel_rms(np.asarray(new), np.asarray(rnew)) < 2e-4


def test_slots_dense_kernel_route_is_the_dense_op(monkeypatch):
    """Without cu_seqlens the kernel route (impl "mosaic") is the dense op itself (mosaic_gpu.op_fwd with its
    DEFAULT_CONFIG: exp2, state_kv, the split policy), called on the gathered start states; its final states go
    back to the pool by the slot ids (an id outside [0, S) writes nothing). A stand-in for op_fwd checks the
    plumbing on the CPU (the kernels need a Hopper GPU)."""
    from pallas_kernels.gated_delta_rule.mosaic_gpu import chunk as mg
    case = Case("cpu-B2-T65", 2, 65, 1, 2, 16, 8)
    q, k, v, g, beta, _, _ = make_inputs(case, 1, jnp.float32, with_h0=False)
    pool = np.random.default_rng(1).standard_normal((3, 2, 16, 8)).astype(np.float32)
    ids, has = jnp.asarray([2, 3], jnp.int32), jnp.asarray([True, True])
    seen = {}

    def fake_op_fwd(q, k, v, g, beta, *, scale, initial_state, output_final_state):
        seen.update(scale=scale, h0=np.asarray(initial_state), final=output_final_state)
        return jnp.zeros(v.shape, v.dtype), initial_state + 1.0
    monkeypatch.setattr(mg, "op_fwd", fake_op_fwd)
    x = tuple(jnp.asarray(a) for a in (q, k, v, g, beta))
    o, new = mv.op_fwd_slots(*x, scale=0.25, ssm_state=jnp.asarray(pool), slot_ids=ids, has_initial_state=has)
    assert seen["scale"] == 0.25 and seen["final"]
    np.testing.assert_array_equal(seen["h0"][0], pool[2])
    np.testing.assert_array_equal(seen["h0"][1], 0.0)          # id 3 = S: zeros in, its write dropped
    np.testing.assert_array_equal(np.asarray(new)[2], pool[2] + 1.0)
    np.testing.assert_array_equal(np.asarray(new)[:2], pool[:2])


def test_checks_name_the_argument():
    args = _inputs()
    q, k, v, g, beta, h0, cu = (jnp.asarray(x) for x in args)
    with pytest.raises(ValueError, match="stage1a"):
        mv.VarlenConfig(stage1a="cuda")
    with pytest.raises(ValueError, match="order"):
        mv.VarlenConfig(order="random")
    with pytest.raises(ValueError, match="states"):
        mv.VarlenConfig(states="kk")
    with pytest.raises(ValueError, match="lanes"):
        mv.VarlenConfig(lanes=-2)
    with pytest.raises(ValueError, match="wide"):
        mv.VarlenConfig(wide="sometimes")
    with pytest.raises(ValueError, match="wide"):
        mv.VarlenConfig(wide=1)
    assert mv.VarlenConfig(wide="per_call").wide == "per_call"
    with pytest.raises(ValueError, match="copies"):
        mv.VarlenConfig(copies="cuda")
    with pytest.raises(ValueError, match="kkt_used"):
        mv.VarlenConfig(kkt_used=1)
    with pytest.raises(ValueError, match="reads"):
        mv.VarlenConfig(reads="packed")
    with pytest.raises(ValueError, match="array 1"):
        vc.repack_rows((jnp.zeros((5, 4)), jnp.zeros((6, 4))), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="initial_state"):
        mv.chunk_gated_delta_rule_varlen_fwd(q, k, v, g, beta, cu, h0[:2], impl="reference")
    with pytest.raises(ValueError, match=r"one packed row"):
        mv.chunk_gated_delta_rule_varlen_fwd(*(jnp.concatenate([x, x]) for x in (q, k, v, g, beta)), cu,
                                             impl="reference")
    with pytest.raises(ValueError, match="impl"):
        mv.chunk_gated_delta_rule_varlen_fwd(q, k, v, g, beta, cu, impl="cuda")
    with pytest.raises(ValueError, match="bfloat16"):                 # the kernel path: 16-bit inputs only
        mv.chunk_gated_delta_rule_varlen_fwd(q, k, v, g, beta, cu, impl="mosaic")


# ---------------------------------------------------------------------------------------------------------------
# GPU (Hopper)
# ---------------------------------------------------------------------------------------------------------------
def _hopper() -> bool:
    return mg.is_hopper()


GPU_VARIANTS = [("mosaic", "kv", 0), ("mosaic", "vk", 0), ("triton", "kv", 0),
                ("mosaic", "vk", 3)]     # the persistent walk


def _check_kernel_f64(dims, pad=PAD, **run_kw):
    """The Mosaic varlen kernel path (``_run(..., **run_kw)``) at bf16 against the float64 oracle (1e-2) on
    ``_inputs``' odd lengths with an empty sequence, NaN padding tokens (rows exactly zero), grouped heads and
    initial states (the empty sequence's state passes through bitwise)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    hk, hv, kdim, vdim = dims
    args = _inputs(hk=hk, hv=hv, kdim=kdim, vdim=vdim, seed=11, pad=pad)
    bf = jnp.bfloat16
    q, k, v = (np.asarray(jnp.asarray(x, bf).astype(jnp.float32)) for x in args[:3])
    args = (q, k, v) + args[3:]
    o, s = _run(args, dtype=bf, impl="mosaic", **run_kw)
    ro, rs = _oracle(args, bf)
    cu = args[-1]
    assert np.isfinite(o).all() and np.isfinite(s).all()
    assert np.all(o[0, cu[-1]:] == 0)
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))
    assert np.array_equal(s[2], args[5][2])


@pytest.mark.gpu
@pytest.mark.parametrize("stage1a,states,lanes", GPU_VARIANTS)
@pytest.mark.parametrize("dims", [(1, 2, 128, 128), (2, 4, 64, 64)])
def test_gpu_kernel_matches_f64(stage1a, states, lanes, dims):
    """The walked Mosaic kernels at bf16 against the float64 oracle (1e-2): odd lengths with an empty sequence,
    NaN padding tokens (their rows exactly zero), grouped heads, initial states."""
    _check_kernel_f64(dims, stage1a=stage1a, states=states, lanes=lanes)


@pytest.mark.gpu
@pytest.mark.parametrize("states", ["kv", "vk"])
@pytest.mark.parametrize("dims", [(1, 2, 128, 128), (2, 4, 64, 64)])
def test_gpu_in_place_matches_f64(states, dims):
    """reads="in_place" on the H200 (kkt_fwd and the fused pass reading the packed row, o stored in place with
    its edges merged) at bf16 against the float64 oracle (1e-2): the odd lengths at T = 328, NaN padding rows
    exactly zero, grouped heads, initial states."""
    _check_kernel_f64(dims, pad=PAD_IN_PLACE, reads="in_place", states=states)


@pytest.mark.gpu
@pytest.mark.parametrize("reads", ["repacked", "in_place"])
@pytest.mark.parametrize("solve", [False, True])
@pytest.mark.parametrize("dims", [(1, 2, 128, 128), (2, 6, 64, 128)])
def test_gpu_wide_matches_f64(reads, solve, dims):
    """The wide fused pass (``wide=True``; ``solve``: T0 formed inside it) on packed sequences at bf16 against the
    float64 oracle (1e-2): the odd lengths with an empty sequence (its state passes through bitwise) and one-token
    and 1-chunk sequences (the two state halves take turns with the state tile), NaN padding rows exactly zero,
    grouped heads, K = 64 and 128, read repacked and in place."""
    _check_kernel_f64(dims, pad=PAD_IN_PLACE if reads == "in_place" else PAD, reads=reads, wide=True, solve=solve)


@pytest.mark.gpu
def test_gpu_per_call_wide_matches_f64():
    """wide "per_call" on the H200 (both fused passes in one program, the side chosen on the device) at bf16
    against the float64 oracle (1e-2): a long sequence among 39 short ones (narrow) and 40 equal ones (wide), in
    place, K = V = 128."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    bf = jnp.bfloat16
    for i, lens in enumerate(PER_CALL_MIXES):
        args = _inputs(lens, pad=8, hk=1, hv=2, kdim=128, vdim=128, seed=11 + i)
        q, k, v = (np.asarray(jnp.asarray(x, bf).astype(jnp.float32)) for x in args[:3])
        args = (q, k, v) + args[3:]
        o, s = _run(args, dtype=bf, impl="mosaic", reads="in_place", wide="per_call", split=mv.SPLIT_MIN_CHUNKS)
        ro, rs = _oracle(args, bf)
        assert np.all(o[0, args[-1][-1]:] == 0)
        assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (lens[0], rel_rms(o, ro), rel_rms(s, rs))


@pytest.mark.gpu
@pytest.mark.parametrize("t,pad", [(1, 0), (130, 0), (2053, 0), (2053, 3)])
def test_gpu_one_sequence_runs_the_dense_op(t, pad):
    """single_dense on the H200 at bf16, K = V = 128, Hk 2, Hv 4, h0: one sequence over the whole row equals the
    dense op's kernels bit for bit (2053 tokens: the dense split engages), one followed by NaN padding the packed
    path's; both against the float64 oracle (1e-2)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    bf = jnp.bfloat16
    args = _inputs((t,), pad=pad, hk=2, hv=4, kdim=128, vdim=128, seed=t + pad)
    q, k, v = (np.asarray(jnp.asarray(x, bf).astype(jnp.float32)) for x in args[:3])
    args = (q, k, v) + args[3:]
    ops = (*(jnp.asarray(x, bf) for x in args[:3]), jnp.asarray(args[3]), jnp.asarray(args[4], bf))
    common = dict(scale=128 ** -0.5, initial_state=jnp.asarray(args[5]), output_final_state=True)
    cfg = dataclasses.replace(mv.DEFAULT_CONFIG, cond_min_tokens=0)      # the dense route at any T
    o, s = mv.op_fwd(*ops, cu_seqlens=jnp.asarray(args[6]), config=cfg, **common)
    o, s = np.asarray(o.astype(jnp.float32)), np.asarray(s)
    ro, rs = _oracle(args, bf)
    assert np.all(o[0, args[-1][-1]:] == 0)
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))
    if pad:
        other = mv.op_fwd(*ops, cu_seqlens=jnp.asarray(args[6]), config=dataclasses.replace(cfg, single_dense=False),
                          **common)
    else:
        other = mg.op_fwd(*ops, **common)
    assert np.array_equal(o, np.asarray(other[0].astype(jnp.float32))) and np.array_equal(s, np.asarray(other[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("solve", [False, True])
def test_gpu_wide_no_initial_state_and_nan_neighbours(solve):
    """The wide pass without initial states (zeros) against the float64 oracle, and in place a NaN token next to a
    sequence reaches no other sequence (bit for bit)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    bf = jnp.bfloat16
    args = _inputs(pad=PAD_IN_PLACE, hk=1, hv=2, kdim=128, vdim=128, seed=8, with_h0=False)
    q, k, v = (np.asarray(jnp.asarray(x, bf).astype(jnp.float32)) for x in args[:3])
    args = (q, k, v) + args[3:]
    o, s = _run(args, dtype=bf, impl="mosaic", reads="in_place", wide=True, solve=solve)
    ro, rs = _oracle(args, bf)
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))
    args = _inputs(pad=PAD_IN_PLACE, hk=1, hv=2, kdim=128, vdim=128, seed=6)
    _nan_neighbours(lambda a: _run(a, dtype=bf, impl="mosaic", reads="in_place", wide=True, solve=solve), args)


@pytest.mark.gpu
@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("dims", [(1, 2, 128, 128), (2, 4, 64, 64)])
def test_gpu_in_place_split_matches_f64(with_h0, dims):
    """The packed split on the H200 (the map kernel over the packed row, the scan, the fused pass over the
    pieces) at bf16 against the float64 oracle (1e-2): the long sequence cut into pieces of 2 chunks, its first
    chunk holding its neighbours' rows, NaN padding rows exactly zero, grouped heads, with and without initial
    states; beside the unsplit kernel path (5e-3); a NaN in the neighbours' rows reaches no other sequence."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    hk, hv, kdim, vdim = dims
    bf = jnp.bfloat16
    args = _inputs(lens=SPLIT_LENS, pad=SPLIT_PAD, hk=hk, hv=hv, kdim=kdim, vdim=vdim, seed=12, with_h0=with_h0)
    q, k, v = (np.asarray(jnp.asarray(x, bf).astype(jnp.float32)) for x in args[:3])
    args = (q, k, v) + args[3:]
    cu = args[-1]
    run = lambda a, split=2: _run(a, dtype=bf, impl="mosaic", reads="in_place", split=split)
    o, s = run(args)
    o0, s0 = run(args, split=0)
    ro, rs = _oracle(args, bf)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    assert np.all(o[0, cu[-1]:] == 0)
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-2, (rel_rms(o, ro), rel_rms(s, rs))
    assert rel_rms(o, o0) < 5e-3 and rel_rms(s, s0) < 5e-3, (rel_rms(o, o0), rel_rms(s, s0))
    if with_h0:
        assert np.array_equal(s[2], args[5][2])
        q, k, v = args[0].copy(), args[1].copy(), args[2].copy()
        for row in (64, 65):
            q[0, row] = k[0, row] = np.nan
            v[0, row, 1] = np.nan
        o_bad, s_bad = run((q, k, v) + args[3:])
        assert np.array_equal(o_bad[0, cu[2]:], o[0, cu[2]:]) and np.array_equal(s_bad[2:], s[2:])


@pytest.mark.gpu
def test_gpu_in_place_nan_stays_in_its_sequence():
    """The kernels mask the neighbours' rows of a chunk by selects: a NaN token just before a sequence's first
    chunk reaches no other sequence (bit for bit, bf16 inputs, K = V = 128)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    args = _inputs(pad=PAD_IN_PLACE, hk=1, hv=2, kdim=128, vdim=128, seed=6)
    _nan_neighbours(lambda a: _run(a, dtype=jnp.bfloat16, impl="mosaic", reads="in_place"), args)


@pytest.mark.gpu
def test_gpu_in_place_beside_repacked():
    """48 sequences of 0..300 tokens at Hv 8, T a multiple of 8: the in-place reads against the repacked path on
    the same bf16 inputs (their chunk grids differ, so they agree to bf16 rounding, 5e-3)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    rng = np.random.default_rng(4)
    lens = tuple(int(x) for x in rng.integers(0, 300, 48))
    pad = (-sum(lens)) % 8 + 16
    args = _inputs(lens=lens, pad=pad, hk=4, hv=8, kdim=128, vdim=128, seed=14)
    o1, s1 = _run(args, dtype=jnp.bfloat16, impl="mosaic", reads="in_place")
    o2, s2 = _run(args, dtype=jnp.bfloat16, impl="mosaic")
    cu = args[-1]
    assert np.isfinite(o1).all() and np.all(o1[0, cu[-1]:] == 0)
    assert rel_rms(o1, o2) < 5e-3 and rel_rms(s1, s2) < 5e-3, (rel_rms(o1, o2), rel_rms(s1, s2))


@pytest.mark.gpu
@pytest.mark.parametrize("lens,pad", [(LENS, PAD), ((130, 0, 1, 65), 0), ((64,), 1)])
def test_gpu_triton_copies_match_xla_gather_bitwise(lens, pad):
    """The Triton copy kernels compiled for the GPU (masked loads / stores past the arrays' ends, which interpret
    mode cannot show) against the XLA gathers, bit for bit (the CPU test's body)."""
    test_triton_copies_match_xla_gather_bitwise(lens, pad, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(1, 2, 128, 128), (2, 4, 64, 64)])
def test_gpu_kernel_xla_copies_matches_f64(dims):
    """The kernel path with ``copies="xla"`` and every kkt slot (the defaults are "triton" and
    ``kkt_used``, which test_gpu_kernel_matches_f64 runs) at bf16 against the float64 oracle (1e-2): odd lengths,
    an empty sequence, NaN padding (rows exactly zero), grouped heads, initial states."""
    _check_kernel_f64(dims, copies="xla", kkt_used=False)


@pytest.mark.gpu
def test_gpu_many_sequences_beside_pallas():
    """48 sequences of 0..300 tokens (more CTA rows than SMs at Hv 8) with initial states: the Mosaic varlen op
    against Pallas Triton's varlen op on the same bf16 inputs (both ~bf16 rounding apart)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    from jax_gdn import ops
    rng = np.random.default_rng(3)
    lens = tuple(int(x) for x in rng.integers(0, 300, 48))
    args = _inputs(lens=lens, pad=33, hk=4, hv=8, kdim=128, vdim=128, seed=12)
    q, k, v, g, beta, h0, cu = args
    bf = jnp.bfloat16
    x = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), jnp.asarray(beta, bf))
    kw = dict(initial_state=jnp.asarray(h0), output_final_state=True, cu_seqlens=jnp.asarray(cu))
    om, sm = ops.chunk_gated_delta_rule(*x, backend="mosaic_gpu", **kw)
    op, sp = ops.chunk_gated_delta_rule(*x, backend="pallas", **kw)
    om, op = np.asarray(om.astype(jnp.float32)), np.asarray(op.astype(jnp.float32))
    assert np.isfinite(om).all() and np.all(om[0, cu[-1]:] == 0)
    assert rel_rms(om, op) < 1e-2 and rel_rms(np.asarray(sm), np.asarray(sp)) < 1e-2


@pytest.mark.gpu
def test_gpu_slots_api_beside_xla():
    """chunk_gated_delta_rule_slots(backend='mosaic_gpu') with ids outside [0, S) and a NaN slot nobody names:
    o and the pool against the XLA backend (fp32 inputs there, bf16 here: 1e-2)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    from jax_gdn import ops
    args = _inputs(hk=1, hv=2, kdim=128, vdim=128, seed=13)
    q, k, v, g, beta, _, cu = args
    bf = jnp.bfloat16
    q, k, v = (np.asarray(jnp.asarray(np.nan_to_num(a), bf).astype(jnp.float32)) for a in (q, k, v))
    g, beta = np.nan_to_num(g), np.asarray(jnp.asarray(np.nan_to_num(beta), bf).astype(jnp.float32))
    pool = np.random.default_rng(2).standard_normal((7, 2, 128, 128)).astype(np.float32)
    pool[6] = np.nan
    ids = jnp.asarray([3, -1, 0, 7, 1, 2], jnp.int32)
    has = jnp.asarray([True, True, False, True, True, True])
    kw = dict(ssm_state=jnp.asarray(pool), slot_ids=ids, has_initial_state=has, cu_seqlens=jnp.asarray(cu))
    om, pm = ops.chunk_gated_delta_rule_slots(*(jnp.asarray(a, bf) for a in (q, k, v)), jnp.asarray(g),
                                              jnp.asarray(beta, bf), backend="mosaic_gpu", **kw)
    with jax.default_matmul_precision("highest"):
        ox, px = ops.chunk_gated_delta_rule_slots(*(jnp.asarray(a) for a in (q, k, v, g, beta)), backend="xla", **kw)
    om, ox, pm, px = (np.asarray(jnp.asarray(a).astype(jnp.float32)) for a in (om, ox, pm, px))
    assert np.isnan(pm[6]).all() and np.isfinite(pm[:6]).all()
    assert rel_rms(om, ox) < 1e-2 and rel_rms(pm[:6], px[:6]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [130, 4000])
def test_gpu_slots_api_dense_beside_xla(t):
    """chunk_gated_delta_rule_slots(backend='mosaic_gpu') without cu_seqlens (the dense op's own route and
    defaults: exp2, state_kv; T 4000 at B 3, Hv 2 splits into pieces), ids -1 and S, a NaN slot nobody names: o and
    the pool against the XLA backend on the same bf16-rounded inputs (1e-2)."""
    if not _hopper():
        pytest.skip("the Mosaic GPU kernels need an sm_90 GPU")
    from jax_gdn import ops
    case = Case(f"gpu-B3-T{t}", 3, t, 1, 2, 128, 128)
    q, k, v, g, beta, _, _ = make_inputs(case, 5, jnp.float32, with_h0=False)
    bf = jnp.bfloat16
    q, k, v, beta = (np.asarray(jnp.asarray(a, bf).astype(jnp.float32)) for a in (q, k, v, beta))
    g = 0.02 * np.asarray(g)                          # weak decay: a wrong start state would show
    pool = np.random.default_rng(3).standard_normal((4, 2, 128, 128)).astype(np.float32)
    pool[3] = np.nan
    ids, has = jnp.asarray([2, -1, 4], jnp.int32), jnp.asarray([True, True, True])
    kw = dict(ssm_state=jnp.asarray(pool), slot_ids=ids, has_initial_state=has)
    om, pm = ops.chunk_gated_delta_rule_slots(*(jnp.asarray(a, bf) for a in (q, k, v)), jnp.asarray(g),
                                              jnp.asarray(beta, bf), backend="mosaic_gpu", **kw)
    with jax.default_matmul_precision("highest"):
        ox, px = ops.chunk_gated_delta_rule_slots(*(jnp.asarray(a) for a in (q, k, v, g, beta)), backend="xla", **kw)
    om, ox, pm, px = (np.asarray(jnp.asarray(a).astype(jnp.float32)) for a in (om, ox, pm, px))
    assert np.isnan(pm[3]).all() and np.isfinite(pm[:3]).all()
    np.testing.assert_array_equal(pm[:2], pool[:2])              # only slot 2 is written
    assert rel_rms(om, ox) < 1e-2 and rel_rms(pm[2], px[2]) < 1e-2
