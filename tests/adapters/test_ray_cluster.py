"""The multi-node recipe of docs/ray.md, for real: raylets started with `ray start`.

A head and a worker node on this machine (two raylets, token authentication
as docs/ray.md sets it up), a RayPool across them in a driver process, a third
node added while the pool runs (it gets an agent), then the first worker node
killed whole (the pool's node and worker counts and its stats say so). Every
Ray process is started here with ``ray start --block``, so all of them are
descendants of this test, and the teardown stops them by pid (``ray stop``
would stop every Ray of this user on the machine, other sessions' too).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

ROOT = Path(__file__).resolve().parents[2]
T = 180  # every step of the test is bounded by this


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not given before in this process: two calls in a row can get
    the same one from the system (its socket closed), and Ray refuses one port for two
    of a node's components (a CI rehearsal: the client server's and the dashboard agent's)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def cluster_env() -> dict[str, str]:
    """What docs/ray.md exports before `ray start` and before the driver: one auth token."""
    return {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "PYTHONPATH": str(ROOT),  # mpexec and this test's functions, on every node
        "RAY_USAGE_STATS_ENABLED": "0",
        # A killed raylet is declared dead after ~3 s, not Ray's default ~15 s.
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }


class Cluster:
    """Raylets started with `ray start --block` (so that they stay our descendants)."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env = env
        self.tmp = tmp
        self.port = free_port()
        self.nodes: list[subprocess.Popen[bytes]] = []

    def start(self, *, head: bool) -> subprocess.Popen[bytes]:
        log = self.tmp / f"node{len(self.nodes)}.log"
        args = [
            "--block",
            "--num-cpus=1",
            f"--object-store-memory={80 << 20}",
            "--disable-usage-stats",
            f"--dashboard-agent-listen-port={free_port()}",  # 52365 for every node else
            f"--temp-dir={self.tmp / 'ray'}",  # logs and sockets: ours, removed at the end
        ]
        if head:
            args += [
                "--head",
                f"--port={self.port}",
                f"--ray-client-server-port={free_port()}",
                "--include-dashboard=false",
            ]
        else:
            args += [f"--address={self.address}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ray.scripts.scripts", "start", *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.nodes.append(proc)
        deadline = time.monotonic() + T
        while b"Ray runtime started" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"`ray start` did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        return proc

    @property
    def address(self) -> str:
        if not self.nodes:
            raise AssertionError("no head yet")
        text = (self.tmp / "node0.log").read_text()
        # `ray start --head` prints the address other nodes join with.
        line = next(ln for ln in text.splitlines() if "ray start --address=" in ln)
        return line.split("--address=", 1)[1].strip().strip("'\"")

    def node_id(self, proc: subprocess.Popen[bytes]) -> str:
        """The Ray node id of the raylet that ``proc`` started."""
        for child in psutil.Process(proc.pid).children(recursive=True):
            for arg in _cmdline(child):
                if arg.startswith("--node_id="):
                    return arg.split("=", 1)[1]
        raise AssertionError("no raylet under that `ray start`")


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and all its descendants, frozen first so that none can start more."""
    frozen: dict[int, psutil.Process] = {}
    try:
        todo = [psutil.Process(root)]
    except psutil.NoSuchProcess:
        return
    while todo:  # top-down: a stopped parent starts no child, so the set closes
        p = todo.pop()
        if p.pid in frozen:
            continue
        try:
            p.send_signal(signal.SIGSTOP)
            frozen[p.pid] = p
            todo += p.children()
        except psutil.NoSuchProcess:
            continue
    for p in frozen.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(list(frozen.values()), timeout=30)


class Driver:
    """The driver process (tests/adapters/_ray_cluster_driver.py): JSON lines out, words in."""

    def __init__(self, address: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.adapters._ray_cluster_driver", address],
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream: IO[str], out: bool) -> None:
        for line in stream:
            if out:
                self.lines.put(line)
            else:
                self.errors.append(line)
        if out:
            self.lines.put(None)

    def expect(self, step: str) -> dict[str, Any]:
        while True:
            try:
                line = self.lines.get(timeout=T)
            except queue.Empty:
                raise AssertionError(f"no {step!r} from the driver in {T} s") from None
            if line is None:
                self.proc.wait(30)
                raise AssertionError(
                    f"the driver exited ({self.proc.returncode}) before {step!r}:\n"
                    + "".join(self.errors)[-4000:]
                )
            if line.startswith("{"):
                msg: dict[str, Any] = json.loads(line)
                assert msg["step"] == step, (msg, "".join(self.errors)[-4000:])
                return msg

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """Stop the driver if it still runs; close its pipes."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.wait(30)
        for reader in self.readers:
            reader.join(30)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    tmp = Path(tempfile.mkdtemp(prefix="mpxray", dir="/tmp"))  # short: Ray's socket paths
    c = Cluster(cluster_env(), tmp)
    try:
        yield c
    finally:
        for proc in reversed(c.nodes):
            kill_tree(proc.pid)
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_raylets_grow_and_lose_a_node(cluster: Cluster) -> None:
    cluster.start(head=True)
    first_worker = cluster.start(head=False)
    driver = Driver(cluster.address, cluster.env)
    try:
        started = driver.expect("started")
        assert (started["nodes"], started["workers"]) == (2, 2), started
        assert "nodes=2 workers=2" in started["repr"]

        # A driver without the cluster's token is turned away, as docs/ray.md says.
        tokenless = {k: v for k, v in cluster.env.items() if not k.startswith("RAY_AUTH")}
        code = f"import ray; ray.init(address={cluster.address!r})"
        refused = subprocess.run(
            [sys.executable, "-c", code],
            env={**tokenless, "HOME": str(cluster.tmp)},  # no ~/.ray/auth_token either
            capture_output=True,
            text=True,
            timeout=T,
            check=False,
        )
        assert refused.returncode != 0
        assert "Authentication token is missing or incorrect" in refused.stderr, refused.stderr

        cluster.start(head=False)  # a node joins while the pool runs
        driver.tell("added")
        grown = driver.expect("grown")
        assert (grown["nodes"], grown["workers"], grown["joined"]) == (3, 3, 1), grown
        assert grown["new_agent_served"], grown  # calls went to the new node's agent

        lost_id = cluster.node_id(first_worker)
        assert lost_id in grown["live"]
        kill_tree(first_worker.pid)  # the node dies whole: raylet, object store, agent
        first_worker.wait(30)
        driver.tell("killed")
        lost = driver.expect("lost")
        assert (lost["nodes"], lost["workers"]) == (2, 2), lost
        assert lost["lost"] == [lost_id], lost
        assert lost_id not in lost["live"]
        assert "nodes=2 workers=2" in lost["repr"]
        assert "lost=1" in lost["repr"]
        assert lost["failed"] == 0, lost  # no call failed: the lost node's ran again

        driver.expect("done")
        assert driver.proc.wait(60) == 0, "".join(driver.errors)[-4000:]
    finally:
        driver.close()
