"""CpuMeter: our CPU time (this process and its descendants) apart from other processes'."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mpexec._cpuload import CpuLoad, CpuMeter
from tests.conftest import wait_until

#: Burns ``CPU`` seconds of CPU time, then writes how much it used to ``OUT``.
BURN = textwrap.dedent(
    """
    import sys, time
    cpu, out = float(sys.argv[1]), sys.argv[2]
    start = time.process_time()
    while time.process_time() - start < cpu:
        pass
    with open(out + ".tmp", "w") as f:
        f.write(str(time.process_time()))
    import os
    os.replace(out + ".tmp", out)
    """
)


def _burn_here(cpu_s: float) -> float:
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        pass
    return time.process_time() - start


def test_own_cpu_counts_this_process_and_live_children(tmp_path: Path) -> None:
    out = tmp_path / "child"
    meter = CpuMeter()
    child = subprocess.Popen([sys.executable, "-c", BURN, "0.3", str(out)])
    try:
        mine = _burn_here(0.2)
        wait_until(out.exists, 60, "the child to burn its CPU")
        theirs = float(out.read_text())
        load = meter.stop()  # the child may have exited but is not reaped yet: still ours
    finally:
        child.wait(timeout=60)
    assert load.own_cpu_s >= 0.9 * (mine + theirs), (load, mine, theirs)
    assert load.wall_s > 0
    assert 0.0 <= load.other_share <= 1.0


def test_other_processes_cpu_is_counted_as_theirs(tmp_path: Path) -> None:
    out = tmp_path / "orphan"
    meter = CpuMeter()
    # A grandchild whose parent exits at once: re-parented away, no descendant of ours.
    launcher = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {BURN!r}, '0.4', {str(out)!r}])\n"
    )
    subprocess.run([sys.executable, "-c", launcher], check=True, timeout=60)
    wait_until(out.exists, 60, "the other process to burn its CPU")
    theirs = float(out.read_text())
    load = meter.stop()
    assert load.other_cpu_s >= 0.9 * theirs, (load, theirs)
    assert load.other_share >= 0.9 * theirs / (load.wall_s * load.cpus)


def test_shares_of_a_measurement() -> None:
    load = CpuLoad(wall_s=2.0, cpus=2, own_cpu_s=1.0, other_cpu_s=3.0, steal_cpu_s=0.4)
    assert load.capacity_s == 4.0
    assert load.other_share == 0.75
    assert load.steal_share == 0.1
    assert CpuLoad(0.0, 2, 0.0, 0.0, 0.0).other_share == 0.0
    assert set(load.to_json()) >= {"other_share", "own_cpu_s", "wall_s", "cpus"}
