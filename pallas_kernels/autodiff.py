"""Kernel forward, reference (or kernel) backward: the VJPs of ops whose forward is a kernel.

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

``kernel_vjp(kernel, backward)`` is the same with a backward pass of the op's own (its backward kernels):
``backward(args, cotangent)`` returns the cotangents of ``args`` (None for None and integer arguments); the
residuals are again the inputs alone.
"""
from __future__ import annotations

import jax

__all__ = ["kernel_vjp", "reference_vjp"]


def reference_vjp(kernel, reference):
    """``kernel`` with the VJP of ``reference`` (see the module docstring)."""

    def backward(args, cotangent):
        _, vjp = jax.vjp(reference, *args)
        return vjp(cotangent)
    return kernel_vjp(kernel, backward)


def kernel_vjp(kernel, backward):
    """``kernel`` with ``backward(args, cotangent) -> cotangents of args`` as its VJP (see the module docstring)."""

    @jax.custom_vjp
    def op(*args):
        return kernel(*args)

    def fwd(*args):
        return kernel(*args), args

    op.defvjp(fwd, backward)
    return op
