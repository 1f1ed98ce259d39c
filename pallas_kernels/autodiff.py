"""Kernel forward, reference backward: the VJP of an op whose kernel has no backward pass of its own.

``reference_vjp(kernel, reference)`` returns a function of the same positional arguments (arrays, or pytrees of
them, ``None`` included) that runs ``kernel`` when called and when differentiated, and whose VJP is the one of
``reference`` (the op's XLA form), recomputed in the backward pass from the saved inputs:

    forward   out = kernel(*args)                          residuals: args (the inputs, nothing else)
    backward  _, vjp = jax.vjp(reference, *args); return vjp(cotangent)

so a model trains through the fast forward kernels at the cost of one reference forward and backward per step.
``kernel`` and ``reference`` take the same arguments and return the same output structure, shapes and dtypes
(the op's contract). Integer and bool arguments (``cu_seqlens``, ``slot_ids``) get float0 cotangents. Forward-mode
autodiff (``jax.jvp``) of the result raises, as for any ``jax.custom_vjp``. Static options are bound into both
functions (``functools.partial``) before the call.
"""
from __future__ import annotations

import jax

__all__ = ["reference_vjp"]


def reference_vjp(kernel, reference):
    """``kernel`` with the VJP of ``reference`` (see the module docstring)."""

    @jax.custom_vjp
    def op(*args):
        return kernel(*args)

    def fwd(*args):
        return kernel(*args), args

    def bwd(args, cotangent):
        _, vjp = jax.vjp(reference, *args)
        return vjp(cotangent)

    op.defvjp(fwd, bwd)
    return op
