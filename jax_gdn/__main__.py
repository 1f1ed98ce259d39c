"""``python -m jax_gdn <command> [options]``: ``demo`` (jax_gdn.demo) or ``bench`` (jax_gdn.bench)."""
from __future__ import annotations

import importlib
import sys

USAGE = """usage: python -m jax_gdn {demo,bench} [options]

  demo    small random GDN stack through the split-prefill protocol, checked against the monolithic layer
          (python -m jax_gdn demo --help)
  bench   benchmarks (python -m jax_gdn bench --help; the same as python -m jax_gdn.bench)"""

COMMANDS = {"demo": "jax_gdn.demo", "bench": "jax_gdn.bench"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[command])
    except ModuleNotFoundError as err:
        if err.name != COMMANDS[command]:
            raise
        print(f"{command}: module {COMMANDS[command]} is not available in this checkout", file=sys.stderr)
        return 2
    module.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
