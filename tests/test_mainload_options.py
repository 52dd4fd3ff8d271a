"""``python -m benchmarks mainload``'s options (issue 37's figures are taken with them)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import mainload_bench


def _options(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    mainload_bench.add_arguments(parser)
    return mainload_bench.options(parser.parse_args(list(argv)))


def test_kinds_both_is_light_and_heavy() -> None:
    # Its help says "light, heavy or both": "both" ran nothing (a KeyError at the first sample).
    assert _options("--kinds", "both")["kinds"] == ["light", "heavy"]
    assert _options("--kinds", "heavy")["kinds"] == ["heavy"]
    assert "kinds" not in _options()


def test_an_unknown_kind_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit, match="light, heavy"):
        _options("--kinds", "medium")
