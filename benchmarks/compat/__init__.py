"""``python -m benchmarks compat SUITE PATH [options]``: a peer's own tests against our drop-in.

The incumbents' own tests are the measure of "drop-in" (docs/design.md, "Drop-in
fidelity"). Each suite module here knows how to run one peer's test file twice in one
environment — once as shipped, once with the peer's names swapped for mpexec's in every
process — and prints the two outcomes side by side, test by test. The peer's test file
is read from ``PATH`` (a copy of the peer's source): it is never part of this
repository.
"""

from __future__ import annotations

import importlib
import sys

#: Suite name -> module; each module has ``main(argv: list[str]) -> int``.
SUITES: dict[str, str] = {
    "torch": "benchmarks.compat.torch_suite",
    "dali": "benchmarks.compat.dali_suite",
    "tf": "benchmarks.compat.tf_suite",
    "torchdata": "benchmarks.compat.torchdata_suite",
}


def main(argv: list[str]) -> int:
    """Run the suite named by ``argv[0]`` with the rest of ``argv``."""
    if not argv or argv[0] not in SUITES:
        print(
            f"usage: python -m benchmarks compat {{{','.join(SUITES)}}} PATH [options]",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(SUITES[argv[0]])
    status: int = module.main(argv[1:])
    return status


__all__ = ["SUITES", "main"]
