"""``python -m jax_gdn <command> [options]``: ``demo`` (jax_gdn.demo), ``bench`` (jax_gdn.bench), ``bench_layers``
(jax_gdn.bench_layers) or ``serve-sim`` (jax_gdn.serve_sim); each forwards the remaining arguments to that module's
``main(argv)``."""
from __future__ import annotations

import importlib
import sys

USAGE = """usage: python -m jax_gdn {demo,bench,bench_layers,serve-sim} [options]

  demo          small random GDN stack through the split-prefill protocol, checked against the monolithic
                layer, then the hybrid model (python -m jax_gdn demo --help)
  bench         gated delta rule benchmarks (the same as python -m jax_gdn.bench)
  bench_layers  one GDN / attention layer benchmark (the same as python -m jax_gdn.bench_layers)
  serve-sim     serving simulation: random arrivals, chunked prefill mixed with decode under a token budget,
                releases; prints compiles, tokens/s, time to first token, step latency (python -m jax_gdn
                serve-sim --help; tiny random model on CPU by default, --model DIR, --dims 80b --layers 8)"""

COMMANDS = {"demo": "jax_gdn.demo", "bench": "jax_gdn.bench", "bench_layers": "jax_gdn.bench_layers",
            "serve-sim": "jax_gdn.serve_sim"}


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
    rc = module.main(rest)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
