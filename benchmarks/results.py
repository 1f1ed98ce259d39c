"""The results JSON of a device, benchmarks/results/<device>.json: where it lives, how a run merges into it, and the
stamp each section carries.

Layout: {"device", "jax", "date", "runs": {key: {"commit", "date", "command"[, "note"]}}, <section keys>...}: each
section sits under its own key (``benchmarks.sections``); "runs" says, per key, which commit, date and command
measured what is stored there. A run rewrites only the keys it measured (and, for a run over some cases, only their
rows); every other key is kept as it was.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_file_name(device_kind: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100_80gb_hbm3', 'cpu' -> 'cpu'."""
    name = device_kind.lower().replace("nvidia", "").strip()
    name = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    while "__" in name:
        name = name.replace("__", "_")
    return name or "device"


def device_kind() -> str:
    """The first JAX device's kind ("NVIDIA H200", "cpu")."""
    import jax
    dev = jax.devices()[0]
    return getattr(dev, "device_kind", dev.platform)


def default_path(kind: str, devices: int = 1) -> str:
    """benchmarks/results/<device>.json; for a section over ``devices`` > 1 GPUs <device>x<devices>.json (h200x2)."""
    suffix = f"x{devices}" if devices > 1 else ""
    return os.path.join(RESULTS_DIR, device_file_name(kind) + suffix + ".json")


def load(path: str) -> dict:
    """The JSON at ``path``, {} when there is none; a file that is not a JSON object is an error naming the path."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write(result: dict, path: str) -> None:
    """``result`` to ``path`` (indent 1), through a temporary file so that a crash never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def commit() -> str:
    """The short commit of the checkout these benchmarks run from, "+dirty" when tracked files differ from it;
    "unknown" outside a git checkout (pass ``--commit`` there)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def stamp(argv, commit_id: str) -> dict:
    """{"commit", "date", "command"}: the command as typed, ``python -m benchmarks`` + ``argv``."""
    return {"commit": commit_id, "date": now(), "command": "python -m benchmarks " + shlex.join(list(argv))}


def merge_rows(old_rows, new_rows, order=()) -> list:
    """``old_rows`` with ``new_rows`` put in by "case" (a re-measured row replaces the stored one, the others are
    kept), sorted by ``order`` (case names; names not in it last, in their order)."""
    by = {r["case"]: r for r in (old_rows or [])}
    by.update({r["case"]: r for r in new_rows})
    rank = {name: i for i, name in enumerate(order)}
    return sorted(by.values(), key=lambda r: rank.get(r["case"], len(rank)))


def merge_files(target: dict, sources) -> list:
    """Puts into ``target`` (a results JSON's content) every section of ``sources`` (results JSONs of the same
    device, e.g. the files several GPU calls brought back) whose stamp is newer than ``target``'s stamp of that key,
    with its stamp; the newest source's "device", "jax" and "date" come along. Returns the keys taken. Files of a
    several-GPU section (runs numbered, rows / events) are not merged here: that section writes one file per run."""
    taken = []
    for src in sources:
        for key, st in (src.get("runs") or {}).items():
            if str(key).isdigit() or key not in src:
                continue
            mine = (target.get("runs") or {}).get(key) or {}
            if st.get("date", "") > mine.get("date", ""):
                target[key] = src[key]
                target.setdefault("runs", {})[key] = st
                taken.append(key)
                if src.get("date", "") >= target.get("date", ""):
                    target.update({k: src[k] for k in ("device", "jax", "date") if k in src})
    return taken
