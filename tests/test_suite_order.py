"""The suite's own ordering (tests/conftest.py): every test that ``LONG_FIRST`` moves to the front exists, so a
renamed test cannot drop out of the list unseen."""
from __future__ import annotations

import importlib
import pathlib

from tests.conftest import LONG_FIRST

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_long_first_names_existing_tests():
    for nodeid in LONG_FIRST:
        path, name = nodeid.split("::")
        assert (ROOT / path).is_file(), nodeid
        module = importlib.import_module(path[:-3].replace("/", "."))
        assert callable(getattr(module, name.split("[")[0], None)), nodeid
