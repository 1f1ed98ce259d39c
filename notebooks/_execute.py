"""Executes the notebooks of this folder from their jupytext sources and saves each paired .ipynb with its outputs.

Each notebook is a pair: ``NN_name.py`` (percent format, the readable source that diffs as a script) and
``NN_name.ipynb`` (the same cells, saved executed with outputs and figures). Edit either one (in Jupyter with
jupytext installed the pair stays in sync on save; ``jupytext --sync notebooks/NN_name.ipynb`` syncs by hand),
then regenerate the outputs from the .py source:

    python notebooks/_execute.py                   # all five, prints the time each took
    python notebooks/_execute.py 02_numerics       # only some (names without extension)

The saved outputs are kept small: figures are re-encoded as palette PNGs (about a third of matplotlib's RGBA
PNG, no visible change for line and bar plots), widget state and execution timestamps are not saved.
tests/test_notebooks.py checks that every .ipynb has the cells of its .py and executes the notebooks.
"""
from __future__ import annotations

import argparse
import base64
import io
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOKS = ["01_split_prefill", "02_numerics", "03_benchmarks", "04_checkpoint", "05_training"]
PNG_COLORS = 128


def small_png(b64: str) -> str:
    """A base64 PNG re-encoded with a palette of PNG_COLORS colours (returned unchanged if that is not smaller)."""
    from PIL import Image
    raw = base64.b64decode(b64)
    image = Image.open(io.BytesIO(raw))
    palette = image.convert("RGBA").quantize(PNG_COLORS, method=Image.Quantize.FASTOCTREE)
    buf = io.BytesIO()
    palette.save(buf, format="png", optimize=True)
    return base64.b64encode(buf.getvalue()).decode() + "\n" if buf.tell() < len(raw) else b64


def shrink_outputs(nb) -> None:
    """In place: palette PNGs, no widget views or widget state."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            data.pop("application/vnd.jupyter.widget-view+json", None)
            if "image/png" in data:
                data["image/png"] = small_png(data["image/png"])


def execute(name: str, timeout: int = 300) -> float:
    """Reads notebooks/<name>.py, executes it (cwd notebooks/), writes notebooks/<name>.ipynb; returns seconds.

    The kernel gets the repository root on PYTHONPATH, so that a notebook can read the results through the
    benchmark package (``benchmarks/``: not installed, it sits at the root); the library itself comes from the
    installed package."""
    import os

    import jupytext
    from nbclient import NotebookClient
    nb = jupytext.read(HERE / f"{name}.py")
    root = str(HERE.parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root if not old else f"{old}{os.pathsep}{root}"
    t0 = time.perf_counter()
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(HERE)}}).execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    secs = time.perf_counter() - t0
    shrink_outputs(nb)
    jupytext.write(nb, HERE / f"{name}.ipynb")
    return secs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"notebooks to execute (default all: {', '.join(NOTEBOOKS)})")
    a = p.parse_args(argv)
    for name in a.names or NOTEBOOKS:
        name = pathlib.Path(name).stem
        if name not in NOTEBOOKS:
            p.error(f"unknown notebook {name!r}; the notebooks are {', '.join(NOTEBOOKS)}")
        secs = execute(name)
        size = (HERE / f"{name}.ipynb").stat().st_size
        print(f"{name}: executed in {secs:.1f} s, wrote {name}.ipynb ({size / 1024:.0f} KiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
