"""``python -m benchmarks [NAME ...] [--quick] [--out DIR]``: run benchmarks.

``python -m benchmarks compat SUITE PATH``: a peer's own test suite against our drop-in.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from benchmarks import BENCHMARKS
from benchmarks._common import RESULTS
from benchmarks.mainload_bench import add_arguments as add_mainload_arguments
from benchmarks.mainload_bench import options as mainload_options
from benchmarks.peers_bench import add_arguments as add_peers_arguments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compat"]:
        # A peer's own test suite against our drop-in: its own arguments (benchmarks/compat).
        from benchmarks.compat import main as compat_main

        return compat_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run mpexec benchmarks; print tables, write results as JSON and Markdown.",
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a shortened run for smoke tests (~20 s each; peers: minutes)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="where to write results (default: benchmarks/results)",
    )
    add_peers_arguments(parser)
    add_mainload_arguments(parser)
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    status = 0
    for name in args.names or list(BENCHMARKS):
        module = importlib.import_module(BENCHMARKS[name])
        extra = {}
        if name == "peers":
            extra = {"workloads": args.workloads, "systems": args.systems}
        elif name == "mainload":
            extra = mainload_options(args)
        result = module.run(quick=args.quick, out_dir=args.out, **extra)
        if result.get("errors"):
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
