"""The library's layering as a contract: every import of every library module, read from the source (``ast``).

Rules (each test below checks one; a failure lists every offending import as ``file:line``):
  * ``pallas_kernels`` imports nothing from ``jax_gdn``;
  * inside ``jax_gdn`` dependencies point one way, down ``LAYERS`` (a module imports its own layer or a lower one);
  * every library module sits in a layer of ``LAYERS`` (a new module is placed there on purpose);
  * no import cycle among library modules, lazy imports inside functions included;
  * the library imports no ``torch``, ``fla`` or ``transformers``, and nothing from ``benchmarks`` or ``tests``;
  * no private name (``_x``) crosses a module boundary: neither ``from m import _x`` nor ``m._x``.

Every import statement counts wherever it stands (module level, inside a function, under ``try``), and so does a
module named by a string in a file that imports by name (``importlib.import_module``, ``__import__``). Importing
``a.b.c`` is an edge to ``a.b.c`` only (a package's ``__init__`` is not counted as imported by its submodules).
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
from typing import Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARIES = ("pallas_kernels", "jax_gdn")

#: bottom first. An entry names a module or a package (then all of its submodules); the root package ``jax_gdn``
#: names its ``__init__`` only. A module may import modules of its own layer and of the layers below it.
LAYERS = (
    ("kernels", ("pallas_kernels",)),
    ("data", ("jax_gdn.config", "jax_gdn.state", "jax_gdn.options", "jax_gdn.timing")),
    ("ops", ("jax_gdn.ops",)),
    ("layers", ("jax_gdn.layers",)),
    ("model", ("jax_gdn.model", "jax_gdn.checkpoint", "jax_gdn.sharding")),
    ("apps", ("jax_gdn.serving", "jax_gdn.training", "jax_gdn.train", "jax_gdn.cli", "jax_gdn.cli_types",
              "jax_gdn.demo", "jax_gdn.serve_sim", "jax_gdn.model_demo", "jax_gdn.__main__", "jax_gdn")),
)
#: top-level packages the library never imports
FOREIGN = ("torch", "fla", "transformers")
#: the trees outside the library that import it (never the other way)
OUTSIDE = ("benchmarks", "tests")


# ---------------------------------------------------------------------------------------------------------------
# Reading the imports
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Import:
    """One import found in a library module: ``target`` the dotted name imported (resolved to a module where one
    exists), ``name`` the name taken from it (``from target import name``; None for ``import target``)."""

    module: str
    path: pathlib.Path
    line: int
    target: str
    name: Optional[str] = None


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def library_modules(root: pathlib.Path = ROOT) -> dict:
    """{dotted module name: path} of every .py file of the libraries under ``root``."""
    out = {}
    for lib in LIBRARIES:
        for path in sorted((root / lib).rglob("*.py")):
            out[module_name(path, root)] = path
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def _dotted(node: ast.AST) -> Optional[str]:
    """``a.b.c`` for a Name / Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


_BY_NAME = ("importlib.import_module", "import_module", "__import__")


def _imports_by_name(tree: ast.AST) -> list:
    """The calls of ``importlib.import_module`` / ``__import__`` in a module."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and _dotted(node.func) in _BY_NAME]


def read_imports(module: str, path: pathlib.Path, modules: dict) -> tuple[list, list]:
    """(imports, private attribute uses) of one module. A private attribute use is an Import whose ``name`` is
    the private attribute read off a library module bound by an import (``m._x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    imports, private_uses = [], []
    bound = {}                                   # local name -> library module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports.append(Import(module, path, node.lineno, alias.name))
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                      else node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:                # ``from pkg import submodule``
                    imports.append(Import(module, path, node.lineno, sub))
                    bound[alias.asname or alias.name] = sub
                else:
                    imports.append(Import(module, path, node.lineno, target, alias.name))
    calls = _imports_by_name(tree)
    for call in calls:                           # import_module("a.b"): an import of a.b
        if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
            imports.append(Import(module, path, call.lineno, call.args[0].value))
    if calls:                                    # a file importing by name: the module names its strings hold
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if text in modules or ("." in text and text.split(".")[0] in OUTSIDE
                                       and text.replace(".", "").isidentifier()):
                    imports.append(Import(module, path, node.lineno, text))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = _dotted(node.value)
            if owner is None:
                continue
            head, _, rest = owner.partition(".")
            if head not in bound:
                continue
            full = bound[head] + ("." + rest if rest else "")
            if full in modules and full != module:
                private_uses.append(Import(module, path, node.lineno, full, node.attr))
    return imports, private_uses


@dataclasses.dataclass(frozen=True)
class Tree:
    """The library as read from the source: its modules, their imports and their private attribute uses."""

    modules: dict
    imports: list            # every Import of every library module
    private_uses: list

    @classmethod
    def read(cls, root: pathlib.Path = ROOT) -> "Tree":
        modules = library_modules(root)
        imports, private_uses = [], []
        for name, path in modules.items():
            i, p = read_imports(name, path, modules)
            imports += i
            private_uses += p
        return cls(modules, imports, private_uses)

    def library_edges(self) -> list:
        """The imports whose target is a library module (``from m import name`` resolved to m)."""
        return [imp for imp in self.imports if self.library_target(imp) is not None]

    def library_target(self, imp: Import) -> Optional[str]:
        target = imp.target
        while target and target not in self.modules:
            target = target.rpartition(".")[0]
        return target or None


def layer_of(module: str) -> Optional[int]:
    """Index in LAYERS of the layer holding ``module`` (its longest matching entry), None when none does."""
    best, best_len = None, -1
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            exact_only = entry == "jax_gdn"
            hit = module == entry or (not exact_only and module.startswith(entry + "."))
            if hit and len(entry) > best_len:
                best, best_len = i, len(entry)
    return best


def _where(imp: Import) -> str:
    return f"{imp.path.relative_to(ROOT) if imp.path.is_relative_to(ROOT) else imp.path}:{imp.line}"


# ---------------------------------------------------------------------------------------------------------------
# The rules: each returns the violations as lines "file:line: what (rule)"
# ---------------------------------------------------------------------------------------------------------------
def kernels_import_no_jax_gdn(tree: Tree) -> list:
    return [f"{_where(i)}: {i.module} imports {i.target} (rule: pallas_kernels imports nothing from jax_gdn)"
            for i in tree.imports
            if i.module.split(".")[0] == "pallas_kernels" and i.target.split(".")[0] == "jax_gdn"]


def modules_without_a_layer(tree: Tree) -> list:
    return [f"{tree.modules[m].relative_to(ROOT) if tree.modules[m].is_relative_to(ROOT) else tree.modules[m]}:1: "
            f"{m} sits in no layer of LAYERS (rule: every library module has a layer)"
            for m in tree.modules if layer_of(m) is None]


def upward_imports(tree: Tree) -> list:
    out = []
    for imp in tree.library_edges():
        target = tree.library_target(imp)
        src, dst = layer_of(imp.module), layer_of(target)
        if src is not None and dst is not None and dst > src:
            out.append(f"{_where(imp)}: {imp.module} ({LAYERS[src][0]}) imports {target} ({LAYERS[dst][0]}) "
                       f"(rule: modules never import upward; layers bottom first: "
                       f"{' <- '.join(name for name, _ in LAYERS)})")
    return out


def import_cycles(tree: Tree) -> list:
    """One line per cycle (a strongly connected component of the module graph), naming each edge inside it."""
    graph: dict = {m: {} for m in tree.modules}
    for imp in tree.library_edges():
        target = tree.library_target(imp)
        if target != imp.module:
            graph[imp.module].setdefault(target, imp)
    index, low, on_stack, stack, comps = {}, {}, set(), [], []

    def strongconnect(v):                        # Tarjan, iterative over each node's successors
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, succ = work[-1]
            for w in succ:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    out = []
    for comp in comps:
        members = set(comp)
        edges = [graph[a][b] for a in comp for b in graph[a] if b in members]
        out.append(f"{_where(edges[0])}: import cycle among {len(comp)} modules {comp}; edges: "
                   + "; ".join(f"{_where(e)} {e.module} -> {tree.library_target(e)}" for e in edges)
                   + " (rule: no import cycle among library modules)")
    return out


def foreign_and_outside_imports(tree: Tree) -> list:
    out = []
    for imp in tree.imports:
        head = imp.target.split(".")[0]
        if head in FOREIGN:
            out.append(f"{_where(imp)}: {imp.module} imports {imp.target} "
                       f"(rule: jax_gdn and pallas_kernels import no {', '.join(FOREIGN)})")
        elif head in OUTSIDE:
            out.append(f"{_where(imp)}: {imp.module} imports {imp.target} "
                       f"(rule: the library imports nothing from {' or '.join(OUTSIDE)})")
    return out


def private_names_across_modules(tree: Tree) -> list:
    out = []
    for imp in tree.imports:
        target = tree.library_target(imp)
        if target is None or target == imp.module:
            continue
        if imp.name is not None and _is_private(imp.name):
            out.append(f"{_where(imp)}: {imp.module} imports {imp.name} from {target} "
                       f"(rule: no private name imported across library modules)")
        elif imp.name is None and any(_is_private(p) for p in imp.target.split(".")):
            out.append(f"{_where(imp)}: {imp.module} imports the private module {imp.target} "
                       f"(rule: no private name imported across library modules)")
    for use in tree.private_uses:
        out.append(f"{_where(use)}: {use.module} uses {use.target}.{use.name} "
                   f"(rule: no private name used across library modules)")
    return out


def _file_line(violation: str) -> tuple:
    path, line, _ = violation.split(":", 2)
    return path, int(line)


RULES = {
    "pallas_kernels imports nothing from jax_gdn": kernels_import_no_jax_gdn,
    "every library module has a layer": modules_without_a_layer,
    "modules never import upward": upward_imports,
    "no import cycle": import_cycles,
    "no torch / fla / transformers, nothing from benchmarks or tests": foreign_and_outside_imports,
    "no private name across modules": private_names_across_modules,
}


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree.read(ROOT)


@pytest.mark.parametrize("rule", list(RULES))
def test_layering(tree, rule):
    violations = sorted(set(RULES[rule](tree)), key=_file_line)
    assert not violations, f"{len(violations)} violation(s) of '{rule}':\n" + "\n".join(violations)


# ---------------------------------------------------------------------------------------------------------------
# The checker itself, on a small made-up tree: each rule catches its violation, and a clean tree passes
# ---------------------------------------------------------------------------------------------------------------
FAKE_TREE = {
    "pallas_kernels/__init__.py": "",
    "pallas_kernels/k.py": "def f():\n    from jax_gdn.config import x\n",
    "jax_gdn/__init__.py": "import importlib\n_EXPORTS = {'M': 'jax_gdn.model'}\n",
    "jax_gdn/config.py": "",
    "jax_gdn/ops/__init__.py": "from pallas_kernels import k\nfrom jax_gdn.layers.a import y\n",
    "jax_gdn/layers/__init__.py": "",
    "jax_gdn/layers/a.py": "import jax_gdn.ops as o\nz = o._hidden\ny = 1\n",
    "jax_gdn/layers/b.py": "from jax_gdn.layers.a import _private\nimport torch\n",
    "jax_gdn/model.py": "from jax_gdn import config\n",
    "jax_gdn/odd.py": "from tests import helper\n",
}


def test_the_checker_finds_each_violation(tmp_path):
    for rel, text in FAKE_TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    fake = Tree.read(tmp_path)
    found = {rule: "\n".join(check(fake)) for rule, check in RULES.items()}
    assert "pallas_kernels/k.py:2" in found["pallas_kernels imports nothing from jax_gdn"]
    assert "jax_gdn.odd" in found["every library module has a layer"]
    assert "jax_gdn/ops/__init__.py:2: jax_gdn.ops (ops) imports jax_gdn.layers.a (layers)" in \
        found["modules never import upward"]
    assert "['jax_gdn.layers.a', 'jax_gdn.ops']" in found["no import cycle"]
    assert "pallas_kernels.k" not in found["no import cycle"]          # kernels -> config: no loop
    assert "jax_gdn/layers/b.py:2: jax_gdn.layers.b imports torch" in \
        found["no torch / fla / transformers, nothing from benchmarks or tests"]
    assert "jax_gdn/odd.py:1" in found["no torch / fla / transformers, nothing from benchmarks or tests"]
    assert "jax_gdn/layers/b.py:1: jax_gdn.layers.b imports _private" in found["no private name across modules"]
    assert "jax_gdn/layers/a.py:2: jax_gdn.layers.a uses jax_gdn.ops._hidden" in \
        found["no private name across modules"]
    assert "jax_gdn/model.py" not in found["modules never import upward"]        # model -> config: downward


def test_layers_cover_the_map():
    """The layer table names each package of the map once, bottom first."""
    names = [entry for _, entries in LAYERS for entry in entries]
    assert len(names) == len(set(names))
    assert layer_of("pallas_kernels.gated_delta_rule.api") == 0
    assert layer_of("jax_gdn.ops.conv1d") < layer_of("jax_gdn.layers.gdn") < layer_of("jax_gdn.model")
    assert layer_of("jax_gdn.model") < layer_of("jax_gdn.serving.llm") == layer_of("jax_gdn.__main__")
    assert layer_of("jax_gdn.bench") is None      # the root entry names the package's __init__ only
