"""argparse ``type=`` callables shared by the command lines (``python -m jax_gdn demo`` / ``serve-sim``): each
checks one option's value while the arguments are parsed, before any work, and raises
``argparse.ArgumentTypeError`` (argparse prints it with the option's name and exits 2)."""
from __future__ import annotations

import argparse
import os


def _int_at_least(text: str, low: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _int_at_least(text, 1, "a positive int")


def nonnegative_int(text: str) -> int:
    """An int >= 0."""
    return _int_at_least(text, 0, "an int >= 0")


def positive_float(text: str) -> float:
    """A finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def positive_int_list(text: str) -> list:
    """Comma-separated ints, at least one, each >= 1: ``"1,17,64"`` -> [1, 17, 64]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected at least one int, each >= 1, got {text!r}")
    return values


def positive_int_pair(text: str) -> tuple:
    """Two comma-separated ints, each >= 1: ``"2,4"`` -> (2, 4)."""
    values = positive_int_list(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected two comma-separated ints A,B, got {text!r}")
    return tuple(values)


def min_max_pair(text: str) -> tuple:
    """``"MIN,MAX"`` (or one int N for N,N), 1 <= MIN <= MAX -> (MIN, MAX)."""
    values = positive_int_list(text)
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return tuple(values)


def existing_dir(text: str) -> str:
    """A path to an existing directory."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def writable_file(text: str) -> str:
    """A file path that can be written: its directory exists and is writable, the path is not a directory, and an
    existing file there is writable."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text
