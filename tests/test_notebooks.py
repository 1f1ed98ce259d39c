"""The notebooks: each .ipynb holds the cells of its jupytext source (notebooks/NN_name.py, percent format, paired
through the notebook's jupytext metadata), runs top to bottom without an error (nbclient, kernel python3, cwd =
notebooks/), and is committed executed with embedded figures and small outputs.
`python notebooks/_execute.py [NAME]` re-executes a notebook from its .py source and saves the .ipynb."""
from __future__ import annotations

import difflib
import os
import pathlib

# the test extra installs these: a missing one fails here rather than skipping the notebook checks unseen
import ipykernel  # noqa: F401
import jupytext
import matplotlib  # noqa: F401
import nbclient
import nbformat

import pytest

NB_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ["01_split_prefill", "02_numerics", "03_benchmarks", "04_checkpoint", "05_training"]
CELL_TIMEOUT_S = 300
PAIRING = "ipynb,py:percent"
MAX_IPYNB_KIB = 250  # saved by _execute.py (palette PNGs) they are 50-115 KiB; with RGBA PNGs 150-300 KiB


def _read(name: str):
    path = NB_DIR / f"{name}.ipynb"
    assert path.is_file(), f"{path} is missing (python notebooks/_execute.py {name})"
    return nbformat.read(str(path), as_version=4)


def _cells(nb) -> list:
    return [(c.cell_type, c.source) for c in nb.cells]


def test_every_notebook_is_paired():
    """No notebook without its source and no source without its notebook (helpers start with '_')."""
    ipynb = sorted(p.stem for p in NB_DIR.glob("*.ipynb"))
    py = sorted(p.stem for p in NB_DIR.glob("*.py") if not p.name.startswith("_"))
    assert ipynb == py == NOTEBOOKS, f"notebooks/: .ipynb {ipynb}, .py sources {py}, listed {NOTEBOOKS}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_matches_its_source(name):
    """The .ipynb and its .py source have the same cells (type and text) and name each other as a pair."""
    nb = _read(name)
    src = jupytext.read(NB_DIR / f"{name}.py")
    for what, book in ((f"{name}.ipynb", nb), (f"{name}.py", src)):
        formats = book.metadata.get("jupytext", {}).get("formats")
        assert formats == PAIRING, f"{what}: jupytext formats {formats!r}, expected {PAIRING!r}"
    got, want = _cells(nb), _cells(src)
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        a, b = (got[i] if i < len(got) else ("-", "")), (want[i] if i < len(want) else ("-", ""))
        diff = "\n".join(difflib.unified_diff(a[1].splitlines(), b[1].splitlines(), f"{name}.ipynb ({a[0]})",
                                              f"{name}.py ({b[0]})", lineterm="", n=1))
        pytest.fail(f"{name}.ipynb ({len(got)} cells) differs from {name}.py ({len(want)} cells) from cell {i}:\n"
                    f"{diff}\nsync with `jupytext --sync notebooks/{name}.py` (the newer file wins) or "
                    f"`python notebooks/_execute.py {name}` (from the .py, with outputs)", pytrace=False)
    code = "\n".join(s for kind, s in want if kind == "code")
    assert "sys.path" not in code, f"{name}.py edits sys.path: the notebooks import the installed package"


# notebooks whose kernels spend more time running than compiling: XLA's backend optimisation stays on for them
# (tests/xla_env.py turns it off for the rest of the CPU suite). Measured alone on the 2-core machine: 05_training
# 139.5 s at -O0 against 67.8 s, 04_checkpoint 33.7 against 23.5; 01 and 02 are faster at -O0 (13.1 / 21.8 s
# against 20.6 / 23.6).
RUN_BOUND = ("04_checkpoint", "05_training")
# 05_training's loop in CI: 50 of its 200 steps (JAX_GDN_TRAIN_STEPS; every cell still runs, the committed notebook
# holds the full run): its 199 steps after the compiling one took 30.7 s of the suite's time
TRAIN_STEPS_IN_CI = "50"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
    if name == "04_checkpoint":
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    if name in RUN_BOUND:
        monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    if name == "05_training":
        monkeypatch.setenv("JAX_GDN_TRAIN_STEPS", TRAIN_STEPS_IN_CI)
    # as notebooks/_execute.py runs them: the repository root on the kernel's path (the benchmark package)
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(NB_DIR.parent) if not old else f"{old}{os.pathsep}{NB_DIR.parent}")
    nb = _read(name)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:  # the message holds the cell and its traceback
        pytest.fail(f"{name}.ipynb: a cell raised\n{err}", pytrace=False)
    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors, f"{name}.ipynb: {[(e['ename'], e['evalue']) for e in errors]}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_outputs(name):
    """Saved executed: every code cell ran in order, none errored, figures are embedded as PNG, and the outputs
    are small (no widget state, under MAX_IPYNB_KIB)."""
    nb = _read(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.get("execution_count") for c in code]
    assert code and all(counts), f"{name}.ipynb was saved without running it"
    assert counts == sorted(counts), f"{name}.ipynb was saved with cells run out of order: {counts}"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{name}.ipynb was saved with an error"
    if name != "03_benchmarks":  # 03 has figures only when benchmark results exist
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}.ipynb has no embedded figure"
    assert "widgets" not in nb.metadata, f"{name}.ipynb carries widget state (python notebooks/_execute.py {name})"
    kib = (NB_DIR / f"{name}.ipynb").stat().st_size / 1024
    assert kib <= MAX_IPYNB_KIB, (f"{name}.ipynb is {kib:.0f} KiB (> {MAX_IPYNB_KIB}): save it with "
                                  f"`python notebooks/_execute.py {name}` (palette PNGs, no widget state)")
