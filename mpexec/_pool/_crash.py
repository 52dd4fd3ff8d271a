"""What a worker's death says: how it exited, the likely cause, OOM detection.

The messages are written for a person: what happened, to which worker, and
what to try (loky's crash messages are the model).
"""

from __future__ import annotations

import signal

from .._errors import BrokenPoolError, WorkerCrashedError, signal_name

#: The cgroup's OOM-kill count when the first pool started (None: unreadable).
_oom_baseline: int | None = None


def record_oom_baseline() -> None:
    """Remember the OOM-kill count now: a later rise names the OOM killer as the cause."""
    global _oom_baseline
    _oom_baseline = oom_kills()


def crash_error(index: int, pid: int, exitcode: int | None, running: bool) -> WorkerCrashedError:
    """The error for worker ``index`` (``pid``) that died with ``exitcode``."""
    cause = likely_cause(exitcode)
    doing = "while running a call" if running else "while idle (it had started no call)"
    return WorkerCrashedError(
        f"worker {index} (pid {pid}) died {doing}: {describe_exit(exitcode)}. {cause}",
        pid=pid,
        exitcode=exitcode,
        cause=cause,
    )


def as_broken(exc: BaseException) -> BrokenPoolError:
    """``exc`` as the error that breaks a pool (itself, if it is one already)."""
    if isinstance(exc, BrokenPoolError):
        return exc
    err = BrokenPoolError(f"the pool is broken: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal_name(-exitcode)}({exitcode})"
    return f"exited with code {exitcode}"


def oom_kills() -> int | None:
    """The cgroup's OOM-kill count (cgroup v2), or None where it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        with open(f"/sys/fs/cgroup{path}/memory.events") as f:
            for line in f:
                key, value = line.split()
                if key == "oom_kill":
                    return int(value)
    except (OSError, StopIteration, ValueError):
        return None
    return None


def likely_cause(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        kills = oom_kills()
        if kills is not None and _oom_baseline is not None and kills > _oom_baseline:
            return (
                "The kernel's OOM killer ended it (the cgroup's oom_kill count rose): the "
                "workers need more memory than this machine or container allows; use "
                "fewer workers or smaller inputs"
            )
        return (
            "SIGKILL comes from the kernel's OOM killer (see dmesg) or from someone's "
            "kill -9; if memory was short, use fewer workers or smaller inputs"
        )
    if exitcode in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL, -signal.SIGABRT):
        return (
            "A crash in native code: a C extension called by the function, or memory "
            "corrupted through ctypes or an unsafe buffer; run it with num_workers=0 "
            "under a debugger, or enable faulthandler in worker_init"
        )
    if exitcode is not None and exitcode >= 0:
        return (
            "The function (or a library it called) ended the process with os._exit() "
            "or a fatal error; exceptions, sys.exit() included, would have been reported"
        )
    return "It was stopped by a signal from outside the pool"
