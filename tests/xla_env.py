"""How the test suite's XLA compiles on the CPU, kept in one place for conftest.py and the tests that start
subprocesses (the sharding check, the two-device mesh checks).

The tests run tiny shapes, so compiling dominates running. Two settings cut the CPU suite by about half without
touching numerics (both are code-generation choices; neither allows fast math):
  * XLA's CPU fusion emitters off (its elemental emitters instead): ~30% off the interpret-mode kernel tests.
    An XLA flag, so it must be in XLA_FLAGS before jax makes its first client (:func:`apply`, at conftest import).
  * the backend optimisation off (``jax_disable_most_optimizations``: LLVM -O0, no expensive passes), CPU only;
    GPU runs keep XLA's defaults (conftest.py).
"""
import os

CPU_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def has_cuda_plugin() -> bool:
    """Whether jax's CUDA plugin is installed (found without importing jax: XLA_FLAGS must be set first)."""
    import importlib.util
    import pkgutil
    if any(importlib.util.find_spec(name) is not None for name in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
        return True
    try:
        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


def apply() -> None:
    """Adds CPU_FLAGS to this process's XLA_FLAGS (children inherit it); not where jax has its CUDA plugin (the GPU
    machine's XLA need not know the CPU backend's flags, and its runs keep XLA's defaults)."""
    if has_cuda_plugin():
        return
    if CPU_FLAGS not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_FLAGS).strip()


def subprocess_xla_flags(flags: str) -> str:
    """XLA_FLAGS for a test's subprocess: ``flags`` after the suite's own, so the child compiles the same way."""
    return (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
