"""Open files: what a pool costs in the calling process, checked before it starts.

Each worker costs the caller about :data:`FDS_PER_WORKER` open files: two
doorbells (eventfds) for each of its four rings, the rings' mappings (Python
before 3.13 keeps a duplicate fd for every ``mmap``), its process sentinel,
and mappings of its arena's segments. A soft ``RLIMIT_NOFILE`` of 1,024, still
the default in many shells and containers, then stops near 50 workers, in the
middle of starting them, with a bare ``EMFILE``. So before any worker starts,
the soft limit is raised toward the hard one when it is too low (as any
process may do), and where even the hard limit is too low the pool refuses at
once, naming the limit and the fix.
"""

from __future__ import annotations

import errno
import os
import sys

from ._errors import ResourceLimitError

#: Open files a worker costs the pool's process, results it holds mapped included
#: (measured: 14-16 with Python 3.11, of which 4 are duplicates kept by ``mmap``).
FDS_PER_WORKER = 16 if sys.version_info < (3, 13) else 12
#: Open files kept free for everything else the process does meanwhile.
HEADROOM = 64


def open_fds() -> int:
    """How many files this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir used
    except OSError:
        import psutil

        try:
            return int(psutil.Process().num_fds())
        except (AttributeError, psutil.Error):  # no such count here (Windows)
            return 0


def ensure_open_files(num_workers: int) -> None:
    """Make room for ``num_workers`` workers under ``RLIMIT_NOFILE``, or refuse.

    Raises the soft limit (to the hard limit where that is finite and higher)
    if it is too low; :class:`ResourceLimitError` if the hard limit is too low.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows: no such limit
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = open_fds()
    need = in_use + num_workers * FDS_PER_WORKER + HEADROOM
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or need <= soft:
        return
    if hard == unlimited or need <= hard:
        for target in (hard, need) if hard != unlimited else (max(need, 4 * soft), need):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):  # macOS refuses more than OPEN_MAX
                continue
            return
    most = max(0, (min(soft, hard) if hard != unlimited else soft) - in_use - HEADROOM)
    raise ResourceLimitError(
        errno.EMFILE,
        f"WorkerPool({num_workers}) needs about {need} open files in this process "
        f"({FDS_PER_WORKER} per worker, {in_use} open already), but its open-file limit "
        f"(RLIMIT_NOFILE) is {soft}, and its hard limit of {hard} only an administrator can "
        f"raise. Raise it before Python starts (`ulimit -n {need}` in the shell, "
        f"LimitNOFILE= in a systemd unit, `--ulimit nofile={need}` for docker run), or "
        f"use at most {most // FDS_PER_WORKER} workers",
    )
