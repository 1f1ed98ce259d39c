"""Every backend that runs a named case (tests/gdn_harness.backends_for) against the float64 oracle, through the
public op: varlen with empty and one-token sequences (fp32), grouped heads (bf16).
Tolerances from the harness (relative RMS: fp32 2e-4, bf16 1e-2)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cases
from tests.gdn_harness import backends_for, make_inputs, oracle, rel_rms, run, tol

# the interpret-mode kernel runs every shape of benchmarks.cases in tests/pallas_kernels; here each backend gets one
# varlen case in fp32 and one grouped-heads case in bf16 (interpret mode costs ~7 s a shape on CI's CPU)
PARAMS = ([(cases.CPU_VARLEN, b, jnp.float32) for b in backends_for(cases.CPU_VARLEN)]
          + [(cases.CPU_GVA[1], b, jnp.bfloat16) for b in backends_for(cases.CPU_GVA[1])])


@pytest.mark.parametrize("case,backend,dtype", PARAMS,
                         ids=[f"{c.name}-{b}-{jnp.dtype(d).name}" for c, b, d in PARAMS])
def test_backend_matches_f64(case, backend, dtype):
    q, k, v, g, beta, h0, cu = make_inputs(case, 3, dtype)
    o_ref, f_ref = oracle(q, k, v, g, beta, h0, cu)
    o, final = run(backend, q, k, v, g, beta, h0, cu, dtype=dtype)
    assert o.dtype == dtype and final.dtype == jnp.float32
    assert rel_rms(np.asarray(o, np.float64), o_ref) < tol(dtype)
    assert rel_rms(final, f_ref) < tol(dtype)
