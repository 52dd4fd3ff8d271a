"""pytest plugin of a compat run: records outcomes for the runner, ends a test past its time.

``MPEXEC_COMPAT_RESULTS``: a file that gets one JSON line per event (``collected``,
``start``, ``result``), written and flushed as it happens, so the runner knows
how far a run got even when it dies. ``MPEXEC_COMPAT_TEST_TIMEOUT``: seconds a
test may take; past them its stacks are dumped, a ``timeout`` line written and
the process ends (the runner goes on with the tests left, in a new process).

In the run against real DALI on a machine without a CUDA device, DALI refuses
a pipeline with a ``device_id`` (its tests all give ``device_id=0``): there
``MPEXEC_COMPAT_DALI_CPU=1`` makes DALI's ``Pipeline`` build with ``device_id=None``,
its CPU-only mode, so the CPU tests run as they would on a GPU machine (and
the GPU one fails, as it must).

nose's test generators (a ``test_*`` function that yields ``(function, *args)``
cases, as DALI's external_source tests do) are one test per case
(``test_x[0]``, ``test_x[1]``, ...): counted at collection, then run as nose
runs them, each case when its turn comes, between the ``setup``/``teardown``
that ``with_setup`` gave its function. pytest itself no longer runs yield tests.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import json
import os
import sys
import threading
from typing import Any

import pytest

_path = os.environ.get("MPEXEC_COMPAT_RESULTS", "")
_limit = float(os.environ.get("MPEXEC_COMPAT_TEST_TIMEOUT", "0") or 0)
_lock = threading.Lock()
_outcomes: dict[str, dict[str, Any]] = {}


def _write(record: dict[str, Any]) -> None:
    if not _path:
        return
    with _lock, open(_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("MPEXEC_COMPAT_DALI_CPU") == "1":
        _dali_cpu_only()


def _dali_cpu_only() -> None:
    """Real DALI without a CUDA device: every pipeline in its CPU-only mode."""
    from nvidia.dali import backend
    from nvidia.dali.pipeline import Pipeline

    if backend.GetCUDADeviceCount() > 0:
        return
    params = Pipeline._get_params  # what DALI builds its backend pipeline from

    def cpu_only_params(self: Any) -> Any:
        self._device_id = None
        return params(self)

    Pipeline._get_params = cpu_only_params  # type: ignore[method-assign]


class _NoseCase(pytest.Function):
    """One case a nose test generator yielded: ``function(*args)``."""


def _run_case(function: Any, args: tuple[Any, ...]) -> None:
    setup = getattr(function, "setup", None)
    teardown = getattr(function, "teardown", None)
    if setup is not None:
        setup()
    try:
        function(*args)
    finally:
        if teardown is not None:
            teardown()


class _Generator:
    """A test generator run as nose runs one: lazily, a case when its turn comes.

    The generator resumes (runs the code after its ``yield``, which may close
    what the case used) only when the next case is due. A case asked for out
    of order (a run restarted past a crash) starts a fresh generator and skips
    the cases before it without running them.
    """

    def __init__(self, function: Any) -> None:
        self.function = function
        self.generator: Any = None
        self.next = 0

    def run(self, index: int) -> None:
        if self.generator is None or self.next > index:
            setup = getattr(self.function, "setup", None)
            if setup is not None:
                setup()
            self.generator = iter(self.function())
            self.next = 0
        for case in self.generator:
            k, self.next = self.next, self.next + 1
            if k == index:
                function, *args = case if isinstance(case, tuple) else (case,)
                _run_case(function, tuple(args))
                return
        raise RuntimeError(f"{self.function.__name__} yielded no case {index} this time")


def _count_cases(function: Any) -> tuple[int, BaseException | None]:
    """How many cases the generator yields (it runs once, at collection, as nose2's
    does), and the error that stopped it, if one did (its next case then fails with it)."""
    setup = getattr(function, "setup", None)
    if setup is not None:
        setup()
    count = 0
    try:
        for _ in function():
            count += 1
    except Exception as exc:
        return count, exc
    finally:
        teardown = getattr(function, "teardown", None)
        if teardown is not None:
            # A leak check with nothing run yet fails: each case runs its own.
            with contextlib.suppress(AssertionError):
                teardown()
    return count, None


def pytest_pycollect_makeitem(collector: Any, name: str, obj: Any) -> Any:
    if not (name.startswith("test") and inspect.isgeneratorfunction(obj)):
        return None
    generator = _Generator(obj)
    items = []
    count, error = _count_cases(obj)
    for i in range(count):

        def call(i: int = i) -> None:
            generator.run(i)

        items.append(_NoseCase.from_parent(collector, name=f"{name}[{i}]", callobj=call))
    if error is not None:

        def fail(error: BaseException = error) -> None:
            raise error

        items.append(_NoseCase.from_parent(collector, name=f"{name}[{count}]", callobj=fail))
    return items


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"event": "collected", "ids": [item.nodeid for item in session.items]})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"event": "collect_error", "id": report.nodeid, "message": _message(report)})


class _Watchdog:
    def __init__(self, nodeid: str) -> None:
        self.done = threading.Event()
        self.nodeid = nodeid
        self.thread = threading.Thread(target=self._watch, daemon=True, name="compat-watchdog")
        self.thread.start()

    def _watch(self) -> None:
        if self.done.wait(_limit):
            return
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _write({"event": "timeout", "id": self.nodeid, "seconds": _limit})
        os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _write({"event": "start", "id": item.nodeid})
    watchdog = _Watchdog(item.nodeid) if _limit > 0 else None
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.done.set()
        outcome = _outcomes.pop(item.nodeid, {"outcome": "passed", "message": ""})
        _write({"event": "result", "id": item.nodeid, **outcome})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The first failure (setup, call or teardown) decides; a skip is a skip.
    if report.nodeid in _outcomes and _outcomes[report.nodeid]["outcome"] != "passed":
        return
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
        _outcomes[report.nodeid] = {"outcome": outcome, "message": _message(report)}
    elif report.skipped:
        _outcomes[report.nodeid] = {"outcome": "skipped", "message": _message(report)}


def _message(report: Any) -> str:
    """The exception's last line: what a table can show."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[2])
    text = str(report.longrepr or "").strip().splitlines()
    return text[-1] if text else ""
