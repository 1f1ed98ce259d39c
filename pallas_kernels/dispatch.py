"""The shared base of every op's dispatch table: which implementation runs a call, and why not the others.

Each op's ``api.py`` holds one :class:`OpTable`: its implementations in the order ``"auto"`` tries them, each
stating what it supports (``supports(case) -> None`` or a sentence naming the limit: platform, call kind, dtype,
head dims) and which backend names a user passes to run it. The op's one public function builds the call's case
(a frozen dataclass of shapes, dtypes, call kind and platform: static, safe under ``jax.jit``), resolves it once
with :meth:`OpTable.resolve` and runs the implementation it gets. The model's ``repr`` and the README's table are
printed from the same tables (``pallas_kernels.registry``).

    table.resolve("auto", case)       -> the first implementation (table order) that "auto" may pick and that
                                         supports the case
    table.resolve("pallas", case)     -> the first implementation of backend "pallas" that supports the case;
                                         where none does: the table's fallback for that name (run with a warning
                                         naming the reason) or ValueError naming the argument and the reason

This module imports nothing from jax_gdn and no kernel (dependencies point pallas_kernels <- jax_gdn).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

__all__ = ["Implementation", "OpTable", "DocCase", "markdown_table", "DEVICE_BRANCH_MIN_TOKENS"]

#: The fewest tokens (static T) of a call in which a kernel wrapper picks between two ways of computing the same
#: result by a ``lax.cond`` on device values (the packed GDN forward's one-sequence dense route and its wide /
#: narrow choice, the cuDNN prefill's skip of the context call); smaller calls take the choice made from shapes.
#: Why: XLA's GPU runtime runs a cond it has not captured into a CUDA graph by copying the predicate to the host
#: and waiting there for the device (its ConditionalThunk), so each one drains the queue of launches. H200, 80B dims
#: at 8 layers, one request, jax 0.11.2: the 64-token step of a 4096-token prefix-cache hit (8 such conds) 14.20 ->
#: 11.34 ms of time to first token, host dispatch 5.57 -> 2.85 ms, the cold 4160-token prefill 33.2 -> 29.2 ms. The
#: branches pay off only on long calls (one 32768-token sequence: dense op 0.935 against the packed path's 1.105 ms
#: a layer; a 16k sequence among 63 short ones: narrow 0.774 against wide 0.908); where between 4096 and 19027
#: tokens the two cross is not measured.
DEVICE_BRANCH_MIN_TOKENS = 16384

Supports = Callable[[Any], Optional[str]]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op.

    name: what runs, unique in its table ("triton.chunk", "mosaic_gpu.decode", "xla", ...); backends: the backend
    names a user passes to run it (one implementation may serve several); summary: one line saying what runs;
    supports: ``case -> None`` when it runs the case, else why not (a sentence naming the limit); calls: the call
    kinds it serves (``case.call``; empty: every call kind); auto: whether "auto" may pick it (the interpret and
    stand-in forms may not); interpret: it runs a Pallas kernel in interpret mode; limits: one line of what it
    takes, for the docs."""

    name: str
    backends: tuple
    summary: str
    supports: Supports
    calls: tuple = ()
    auto: bool = True
    interpret: bool = False
    limits: str = ""

    def serves(self, call) -> bool:
        return not self.calls or call in self.calls

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"Implementation.name must be a non-empty str, got {self.name!r}")
        if isinstance(self.backends, str) or not self.backends or not all(isinstance(b, str) for b in self.backends):
            raise ValueError(f"Implementation {self.name!r}: backends must be a non-empty tuple of names, got "
                             f"{self.backends!r}")
        object.__setattr__(self, "backends", tuple(self.backends))
        if "auto" in self.backends:
            raise ValueError(f"Implementation {self.name!r}: 'auto' is not a backend name, it is the table's order")
        if not callable(self.supports):
            raise ValueError(f"Implementation {self.name!r}: supports must be callable")
        if isinstance(self.calls, str):
            raise ValueError(f"Implementation {self.name!r}: calls must be a tuple of call kinds, got {self.calls!r}")
        object.__setattr__(self, "calls", tuple(self.calls))


@dataclasses.dataclass(frozen=True)
class DocCase:
    """One cell of the docs' table: a platform label ("CPU", "Hopper GPU", ...), a call kind, and the case that
    stands for it (the op's case dataclass at representative dims)."""

    platform: str
    call: str
    case: Any


@dataclasses.dataclass(frozen=True)
class OpTable:
    """The implementations of one op, in the order "auto" tries them.

    op: the op's name; implementations: the "auto" order; fallbacks: (backend, backend it runs instead) pairs for
    an explicit name whose implementations all refuse the case (the call then runs the other name, with a warning
    naming the reason; names without a fallback raise ValueError); call_kinds: the call kinds the op's case
    names; doc_cases: the cells of the docs' table (``DocCase``)."""

    op: str
    implementations: tuple
    fallbacks: tuple = ()
    call_kinds: tuple = ()
    doc_cases: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "implementations", tuple(self.implementations))
        names = [impl.name for impl in self.implementations]
        if len(set(names)) != len(names):
            raise ValueError(f"OpTable {self.op!r}: implementation names must be unique, got {names}")
        if not any(impl.auto for impl in self.implementations):
            raise ValueError(f"OpTable {self.op!r}: no implementation that 'auto' may pick")
        object.__setattr__(self, "fallbacks", tuple(tuple(p) for p in self.fallbacks))
        object.__setattr__(self, "call_kinds", tuple(self.call_kinds))
        for impl in self.implementations:
            unknown = [c for c in impl.calls if c not in self.call_kinds]
            if unknown:
                raise ValueError(f"OpTable {self.op!r}: {impl.name!r} serves unknown call kinds {unknown}")
        for src, dst in self.fallbacks:
            if src not in self.backends or dst not in self.backends:
                raise ValueError(f"OpTable {self.op!r}: fallback {src!r} -> {dst!r} names an unknown backend")

    @property
    def backends(self) -> tuple:
        """Every name a user may pass: "auto" first, then the implementations' backend names in table order."""
        out = ["auto"]
        for impl in self.implementations:
            out += [b for b in impl.backends if b not in out]
        return tuple(out)

    def implementation(self, name: str) -> Implementation:
        for impl in self.implementations:
            if impl.name == name:
                return impl
        known = [i.name for i in self.implementations]
        raise ValueError(f"{self.op}: no implementation named {name!r}; known: {known}")

    def check_backend(self, backend, argument: str = "backend") -> str:
        """``backend`` when it is one of :attr:`backends`, else ValueError naming ``argument``."""
        if backend not in self.backends:
            raise ValueError(f"{argument} must be one of {self.backends}, got {backend!r}")
        return backend

    def candidates(self, backend: str, call=None) -> tuple:
        """The implementations ``backend`` may run for call kind ``call`` (None: any), in table order ("auto":
        those "auto" may pick)."""
        self.check_backend(backend)
        impls = [i for i in self.implementations if call is None or i.serves(call)]
        if backend == "auto":
            return tuple(i for i in impls if i.auto)
        return tuple(i for i in impls if backend in i.backends)

    def why_not(self, backend: str, case) -> Optional[str]:
        """None when ``backend`` has an implementation that runs ``case`` (no fallback), else why not: the reason
        of each of its implementations for the case's call kind, joined."""
        candidates = self.candidates(backend, getattr(case, "call", None))
        reasons = []
        for impl in candidates:
            why = impl.supports(case)
            if why is None:
                return None
            reasons.append(why if len(candidates) == 1 else f"{impl.name}: {why}")
        return "; ".join(reasons) or (f"backend {backend!r} has no {getattr(case, 'call', '')} implementation "
                                      f"of {self.op}")

    def resolve(self, backend: str, case, *, argument: str = "backend", warn: bool = True) -> Implementation:
        """The implementation that runs ``case`` for the user's ``backend`` (see the module docstring). ``warn``
        False: a fallback runs silently (the docs and the model's repr)."""
        for impl in self.candidates(backend, getattr(case, "call", None)):
            if impl.supports(case) is None:
                return impl
        why = self.why_not(backend, case)
        fallback = dict(self.fallbacks).get(backend)
        if fallback is not None:
            if warn:
                warnings.warn(f"{self.op}({argument}={backend!r}) runs {fallback!r}: {why}", stacklevel=3)
            return self.resolve(fallback, case, argument=argument, warn=warn)
        call = getattr(case, "call", None)
        where = "here" if call is None else f"here ({call} call)"
        raise ValueError(f"{argument} {backend!r} cannot run {self.op} {where}: {why}")

    def picks(self, backend: str = "auto") -> list:
        """[(platform label, call kind, implementation name or "refused: why")] for every docs cell."""
        rows = []
        for cell in self.doc_cases:
            try:
                rows.append((cell.platform, cell.call, self.resolve(backend, cell.case, warn=False).name))
            except ValueError as err:
                rows.append((cell.platform, cell.call, f"refused: {err}"))
        return rows


def markdown_table(tables) -> str:
    """The README's backend section from ``tables`` (OpTables): per op, platform x call kind -> the implementation
    "auto" picks at the docs' representative dims, then every implementation with its backend names, what runs
    and its limits."""
    out = []
    for table in tables:
        out.append(f"### {table.op}")
        out.append("")
        picks = table.picks("auto")
        platforms = list(dict.fromkeys(p for p, _, _ in picks))
        calls = list(dict.fromkeys(c for _, c, _ in picks))
        cell = {(p, c): name for p, c, name in picks}
        out.append("| \"auto\" on | " + " | ".join(calls) + " |")
        out.append("|---" * (len(calls) + 1) + "|")
        for p in platforms:
            out.append(f"| {p} | " + " | ".join(f"`{cell[p, c]}`" if (p, c) in cell else "" for c in calls) + " |")
        out.append("")
        out.append("| implementation | backend | auto | calls | what runs | limits |")
        out.append("|---|---|---|---|---|---|")
        for impl in table.implementations:
            names = ", ".join(f'"{b}"' for b in impl.backends)
            calls = ", ".join(impl.calls) if impl.calls else "all"
            out.append(f"| `{impl.name}` | {names} | {'yes' if impl.auto else 'no'} | {calls} | {impl.summary} | "
                       f"{impl.limits} |")
        if table.fallbacks:
            out.append("")
            out.append("Where every implementation of a name refuses the call: " + "; ".join(
                f'"{a}" runs "{b}" (with a warning naming the reason)' for a, b in table.fallbacks) + ".")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
