"""Command line: ``python -m mpexec <command>``.

Commands:

``doctor``
    Report versions, CPUs, the start method and the shared-memory and GPU
    facilities of this machine (``--json`` for a machine-readable report).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpexec import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpexec",
        description="mpexec: GIL-free, zero-copy python_function ops for data pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"mpexec {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor",
        help="report what this machine offers mpexec",
        description="Report versions, CPUs, start method, shared memory and GPU of this machine.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from mpexec._doctor import run_doctor  # lazy: keeps --help fast

        return run_doctor(as_json=bool(args.json))
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
