"""``python -m jax_gdn <command> [options]``: ``demo`` (jax_gdn.demo) or ``serve-sim`` (jax_gdn.serve_sim); each
forwards the remaining arguments to that module's ``main(argv)``. The benchmarks are ``python -m benchmarks``."""
from __future__ import annotations

import importlib
import sys

USAGE = """usage: python -m jax_gdn {demo,serve-sim} [options]

commands:
  demo       small random GDN stack through the split-prefill protocol, checked against the monolithic layer,
             then the hybrid model; ends with PASS or FAIL against the printed tolerances (exit 1 on FAIL)
             (python -m jax_gdn demo --help)
  serve-sim  serving simulation: random arrivals, chunked prefill mixed with decode under a token budget,
             releases; prints compiles, tokens/s, time to first token, step latency (python -m jax_gdn
             serve-sim --help; the tiny preset on CPU by default, --model DIR, --dims qwen3_next_80b --layers 8)

The benchmarks are a separate CLI: python -m benchmarks --help"""

COMMANDS = {"demo": "jax_gdn.demo", "serve-sim": "jax_gdn.serve_sim"}


def main(argv=None) -> int:
    """Runs ``argv[0]``'s command with the rest of ``argv``. Returns the exit status: 0 (``--help``, or the command
    succeeded), 2 (no command, or an unknown one), else the command's own."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"python -m jax_gdn: unknown command {command!r} (choose from {', '.join(COMMANDS)})\n\n{USAGE}",
              file=sys.stderr)
        return 2
    rc = importlib.import_module(COMMANDS[command]).main(rest)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
