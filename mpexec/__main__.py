"""Command line: ``python -m mpexec <command>``.

Commands:

``demo``
    Run a CPU-bound image augmentation pipeline over generated images and
    compare its throughput with the same functions run serially in this
    process, with the share of the CPUs other processes used meanwhile; print
    the pipeline's per-op statistics (``--json`` for a summary).

``doctor``
    Report versions, CPUs, the start method, the shared-memory and GPU
    facilities of this machine, and the frameworks mpexec works with (their
    versions, and which extras are usable); ``--json`` for a machine-readable
    report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpexec import __version__


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="time an image augmentation pipeline against a serial loop",
        description=(
            "Generate synthetic encoded images, augment them (decode, random crop, flip, "
            "color jitter, normalize) in an mpexec pipeline and in a serial loop in this "
            "process (and, for the host's own ceiling, in as many plain processes as "
            "workers), and print the throughputs, the speed-up and per-op statistics."
        ),
    )
    demo.add_argument(
        "--images", type=_positive_int, default=256, metavar="N", help="images (default: 256)"
    )
    demo.add_argument(
        "--size",
        type=_positive_int,
        default=256,
        metavar="PX",
        help="typical image side; sides vary from 7/8 to 5/4 of it (default: 256)",
    )
    demo.add_argument(
        "--batch-size", type=_positive_int, default=32, metavar="N", help="batch size (default: 32)"
    )
    demo.add_argument(
        "--workers",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="worker processes; 0 runs inline (default: the CPUs this process may use)",
    )
    demo.add_argument(
        "--epochs",
        type=_positive_int,
        default=2,
        metavar="N",
        help="passes over the images in the pipeline; the serial loop makes one (default: 2)",
    )
    demo.add_argument(
        "--rounds",
        type=_positive_int,
        default=5,
        metavar="N",
        help="timed rounds, the serial loop and the pipeline in turn; medians (default: 5)",
    )
    demo.add_argument(
        "--seed", type=_non_negative_int, default=0, help="seed of images and pipeline (default: 0)"
    )
    demo.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else a line every 2 s)",
    )
    demo.add_argument(
        "--no-control",
        action="store_true",
        help="do not time the host's ceiling (as many plain processes as workers) each round",
    )
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpexec",
        description="mpexec: GIL-free, zero-copy python_function ops for data pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"mpexec {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_demo(commands)

    doctor = commands.add_parser(
        "doctor",
        help="report what this machine offers mpexec",
        description=(
            "Report versions, CPUs, start method, shared memory, GPU and the frameworks "
            "(installed versions, usable extras) of this machine."
        ),
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
    if args.command == "demo":
        return _run_demo(args)
    parser.print_help(sys.stderr)
    return 2


def _run_demo(args: argparse.Namespace) -> int:
    from mpexec import _demo  # lazy: keeps --help fast
    from mpexec._host import usable_cpus

    config = _demo.DemoConfig(
        images=int(args.images),
        size=int(args.size),
        batch_size=int(args.batch_size),
        workers=usable_cpus() if args.workers is None else int(args.workers),
        epochs=int(args.epochs),
        rounds=int(args.rounds),
        seed=int(args.seed),
        control=not args.no_control,
        progress=_demo.Progress.wanted(sys.stderr, disabled=bool(args.no_progress)),
    )
    try:
        return _demo.main(config, as_json=bool(args.json))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
