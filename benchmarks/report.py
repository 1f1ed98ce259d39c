"""The README's markdown tables, printed from a results JSON (``python -m benchmarks --markdown``)."""
from __future__ import annotations

from benchmarks.sections import SECTIONS

#: the order of the tables (the README's)
ORDER = ("gdn", "backward", "layers", "moe", "attention", "decode", "model", "model_35b", "serving", "serving_35b", "train")


def markdown_tables(result: dict, sections=None) -> str:
    """Markdown tables of every section ``result`` holds (``sections``: only these names), each followed by the
    line saying which commit, date and command measured it."""
    out = []
    runs = result.get("runs") or {}
    for name in ORDER:
        sec = SECTIONS[name]
        key = sec.keys[0]
        if (sections is not None and name not in sections) or not result.get(key):
            continue
        out += sec.load().markdown(result[key])
        run = runs.get(key) or {}
        if run.get("command"):
            out += ["", f"{run.get('date', '?')}, commit {run.get('commit', '?')}: `{run['command']}`"]
        out.append("")
    return "\n".join(out)
