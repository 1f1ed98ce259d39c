"""Bad input raises ValueError naming the argument and the expected shape, before any state is touched;
value checks under jit through checkify."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jax_gdn.ops import (chunk_gated_delta_rule, chunk_gated_delta_rule_slots, recurrent_gated_delta_rule,
                         validation)

B, T, HK, HV, K, V = 1, 12, 2, 4, 8, 16


def inputs(b=B, t=T, hk=HK, hv=HV, dk=K, dv=V):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, hk, dk)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, hk, dk)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0, 1, (b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, t, hv)), jnp.float32)
    return q, k, v, g, beta


def replace(xs, i, new):
    xs = list(xs)
    xs[i] = new
    return xs


XS = inputs()
BAD_ARGS = [
    ("q", replace(XS, 0, XS[0][0]), r"q must have rank 4 with shape \[B, T, Hk, K\]"),
    ("k", replace(XS, 1, XS[1][..., :4]), r"k must have the shape of q \[B, T, Hk, K\]"),
    ("v", replace(XS, 2, XS[2][:, :5]), r"v must have shape \[B, T, Hv, V\]"),
    ("heads", replace(XS, 2, jnp.zeros((B, T, 3, V))), r"Hv \(3\) must be a multiple of .* Hk \(2\)"),
    ("g", replace(XS, 3, XS[3][..., :2]), r"g must have shape \[B, T, Hv\]"),
    ("beta", replace(XS, 4, XS[4][:, :, :, None]), r"beta must have shape \[B, T, Hv\]"),
    ("int_q", replace(XS, 0, XS[0].astype(jnp.int32)), r"q must be a floating dtype"),
    ("qk_dtype", replace(XS, 1, XS[1].astype(jnp.bfloat16)), r"q and k must share a dtype"),
]


@pytest.mark.parametrize("name,xs,match", BAD_ARGS, ids=[a[0] for a in BAD_ARGS])
def test_bad_shapes_and_dtypes(name, xs, match):
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match=match):
            fn(*xs)


@pytest.mark.parametrize("cu,match", [
    (jnp.asarray([[0, 12]], jnp.int32), r"cu_seqlens must have shape \[N \+ 1\]"),
    (jnp.asarray([0.0, 12.0]), r"cu_seqlens must be an integer array"),
    (jnp.asarray([1, 12], jnp.int32), r"cu_seqlens must start at 0"),
    (jnp.asarray([0, 8, 4, 12], jnp.int32), r"cu_seqlens must be non-decreasing"),
    (jnp.asarray([0, 4, 13], jnp.int32), r"cu_seqlens must end at or before the token count T = 12"),
    (np.asarray([0, 4, 13]), r"cu_seqlens must end at or before the token count T = 12"),
])
def test_bad_cu_seqlens(cu, match):
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match=match):
            fn(*XS, cu_seqlens=cu)


def test_cu_seqlens_needs_one_row():
    with pytest.raises(ValueError, match="B must be 1"):
        chunk_gated_delta_rule(*inputs(b=2), cu_seqlens=jnp.asarray([0, 5, 12], jnp.int32))


def test_bad_initial_state_and_backend_and_chunk_size():
    good = jnp.zeros((2, HV, K, V), jnp.float32)
    cu = jnp.asarray([0, 5, 12], jnp.int32)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, Hv, K, V\] = \(2, 4, 8, 16\)"):
        chunk_gated_delta_rule(*XS, cu_seqlens=cu, initial_state=good[:1])
    with pytest.raises(ValueError, match="initial_state must be float32"):
        recurrent_gated_delta_rule(*XS, cu_seqlens=cu, initial_state=good.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_gated_delta_rule(*XS, backend="triton")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunk_gated_delta_rule(*XS, chunk_size=0, backend="xla")


def test_bad_slots_arguments():
    pool = jnp.zeros((3, HV, K, V), jnp.float32)
    cu = jnp.asarray([0, 5, 12], jnp.int32)
    ok_ids, ok_has = jnp.asarray([2, 0], jnp.int32), jnp.asarray([True, False])

    def call(pool=pool, ids=ok_ids, has=ok_has):
        return chunk_gated_delta_rule_slots(*XS, ssm_state=pool, slot_ids=ids, has_initial_state=has, cu_seqlens=cu,
                                            backend="xla")

    with pytest.raises(ValueError, match=r"ssm_state must have shape \[S, Hv, K, V\] = \[S, 4, 8, 16\]"):
        call(pool=pool[:, :2])
    with pytest.raises(ValueError, match="ssm_state must be float32"):
        call(pool=pool.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"slot_ids must have shape \[N\] = \[2\]"):
        call(ids=jnp.asarray([0, 1, 2], jnp.int32))
    call(ids=jnp.asarray([3, 0], jnp.int32))     # padding contract: an id outside [0, S) names no slot
    call(ids=jnp.asarray([-1, -1], jnp.int32))   # and may repeat
    with pytest.raises(ValueError, match="slot_ids must not repeat"):
        call(ids=jnp.asarray([1, 1], jnp.int32))
    with pytest.raises(ValueError, match="slot_ids must be an integer array"):
        call(ids=jnp.asarray([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"has_initial_state must have shape \[N\] = \[2\]"):
        call(has=jnp.asarray([True]))
    with pytest.raises(ValueError, match="has_initial_state must be a bool array"):
        call(has=jnp.asarray([1, 0], jnp.int32))


def test_value_checks_are_skipped_under_jit_and_checkify_catches_them():
    cu_bad = jnp.asarray([0, 8, 4, 12], jnp.int32)

    def f(xs, cu):
        validation.checkify_cu_seqlens(cu, T)
        return chunk_gated_delta_rule(*xs, cu_seqlens=cu, backend="xla")[0]

    jax.jit(lambda xs, cu: chunk_gated_delta_rule(*xs, cu_seqlens=cu, backend="xla")[0])(XS, cu_bad)  # no raise
    checked = jax.jit(checkify.checkify(f))
    err, _ = checked(XS, cu_bad)
    with pytest.raises(checkify.JaxRuntimeError, match="non-decreasing"):
        err.throw()
    err, _ = checked(XS, jnp.asarray([0, 4, 8, 11], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="must end at the token count"):
        err.throw()
    err, _ = checked(XS, jnp.asarray([0, 4, 8, 12], jnp.int32))
    err.throw()   # good input: no error

    ids_check = jax.jit(checkify.checkify(lambda ids: validation.checkify_slot_ids(ids, 3)))
    for bad, match in (([0, 3], r"lie in \[0, 3\)"), ([2, 2], "must not repeat")):
        err, _ = ids_check(jnp.asarray(bad, jnp.int32))
        with pytest.raises(checkify.JaxRuntimeError, match=match):
            err.throw()
    ids_check(jnp.asarray([2, 0], jnp.int32))[0].throw()


def test_helpers_accept_concrete_and_traced_values():
    assert validation.check_cu_seqlens([0, 3, 12], 12) == 2
    validation.check_slot_ids(np.asarray([0, 2]), 3, 2)

    @jax.jit
    def traced(cu, ids):
        validation.check_cu_seqlens(cu, 12)      # value checks skipped under tracing
        validation.check_slot_ids(ids, 3, 2)
        return cu.sum() + ids.sum()

    traced(jnp.asarray([0, 13], jnp.int32), jnp.asarray([5, 5], jnp.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N \+ 1\]"):
        traced(jnp.asarray([0], jnp.int32), jnp.asarray([0, 1], jnp.int32))
