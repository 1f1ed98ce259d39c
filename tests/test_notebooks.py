"""The notebooks run top to bottom without an error (nbclient, kernel python3, cwd = notebooks/), and the committed
copies carry their outputs and embedded figures. notebooks/_build.py regenerates them."""
from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NB_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ["01_split_prefill", "02_numerics", "03_benchmarks", "04_checkpoint"]
CELL_TIMEOUT_S = 300


def _read(name: str):
    path = NB_DIR / f"{name}.ipynb"
    assert path.is_file(), f"{path} is missing (python notebooks/_build.py {name})"
    return nbformat.read(str(path), as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name):
    if name == "04_checkpoint":
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
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
    """Saved executed: every code cell ran in order, none errored, and figures are embedded as PNG."""
    nb = _read(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), f"{name}.ipynb was saved without running it"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{name}.ipynb was saved with an error"
    if name != "03_benchmarks":  # 03 has figures only when benchmark results exist
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}.ipynb has no embedded figure"
