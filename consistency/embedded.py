"""Embedded etcd for development, tests and chaos runs: members on free loopback ports.

`EtcdCluster(size=1)` is the single embedded member the CLI starts when no endpoint is given;
`EtcdCluster(size=3)` is the loopback cluster for failover tests, with helpers to kill,
restart and find the leader. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from consistency.etcdbin import find_etcd_binary
from tensorhub.errors import DeadlineExceeded, TensorHubError


class EtcdStartError(TensorHubError):
    """An embedded etcd member did not become healthy in time."""

    code = "UNAVAILABLE"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller retries if it is taken in between)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Member:
    """One etcd member: its name, URLs, data directory and process (None while stopped)."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class EtcdCluster:
    """N etcd members on loopback in a temp dir; a context manager that always cleans up.

    Timings are tuned for a small, fast cluster (heartbeat 50 ms, election 500 ms), so that
    leader loss is noticed in about a second and the minimum lease TTL is 1 s.
    """

    def __init__(
        self,
        size: int = 1,
        *,
        data_root: str | None = None,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        start_timeout: float = 30.0,
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        """`extra_args` are passed to every member as they are (tests use them for small
        quotas, e.g. `["--quota-backend-bytes=4194304"]`). Auto-compaction stays off unless
        they turn it on: the hub's `consistency.compactor.Compactor` compacts instead, so
        one elected replica decides what history watches can still resume from."""
        if size < 1:
            raise ValueError("an etcd cluster needs at least one member")
        self._binary = binary or find_etcd_binary()
        self._own_root = data_root is None
        self.root = Path(data_root or tempfile.mkdtemp(prefix="tensorhub-etcd-"))
        self._heartbeat_ms = heartbeat_ms
        self._election_ms = election_ms
        self._start_timeout = start_timeout
        self._extra_args = list(extra_args or [])
        self.token = f"tensorhub-{os.getpid()}-{time.monotonic_ns()}"
        self.members = [
            Member(f"m{i}", free_port(), free_port(), self.root / f"m{i}") for i in range(size)
        ]

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> EtcdCluster:
        """Start every member and wait (bounded) until each reports healthy."""
        for member in self.members:
            self._spawn(member, initial_state="new")
        deadline = time.monotonic() + self._start_timeout
        for member in self.members:
            self._wait_healthy(member, deadline)
        return self

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL after 5 s) and remove the data dir we made.

        All members get SIGTERM at once: a member stopping alone can wait for peers that
        are about to go too.
        """
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                member.process.terminate()
        for member in self.members:
            self._terminate(member)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- addressing --------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """`host:port` of every member's client URL (what `consistency.etcd.Etcd` takes)."""
        return [m.endpoint for m in self.members]

    # -- fault helpers -----------------------------------------------------------------------

    def kill(self, index: int) -> None:
        """SIGKILL one member (its data dir stays, so `restart` brings it back as itself)."""
        member = self.members[index]
        if member.process is not None and member.process.poll() is None:
            member.process.send_signal(signal.SIGKILL)
            member.process.wait(timeout=10)
        member.process = None

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a killed member again from its data dir and wait until it is healthy."""
        member = self.members[index]
        if member.alive:
            return
        self._spawn(member, initial_state="existing")
        self._wait_healthy(member, time.monotonic() + timeout)

    def leader(self, timeout: float = 10.0) -> int:
        """Index of the current leader, waiting (bounded) through an election."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids: dict[int, int] = {}
            leader_id = 0
            for i, member in enumerate(self.members):
                if not member.alive:
                    continue
                status = _member_status(member)
                if status is None:
                    continue
                ids[status[0]] = i
                leader_id = leader_id or status[1]
            if leader_id in ids:
                return ids[leader_id]
            time.sleep(0.1)
        raise DeadlineExceeded(f"no etcd leader elected within {timeout:.1f}s")

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self, member: Member, initial_state: str) -> None:
        member.data_dir.mkdir(parents=True, exist_ok=True)
        initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        args = [
            self._binary,
            "--name", member.name,
            "--data-dir", str(member.data_dir / "data"),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", initial_state,
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(self._heartbeat_ms),
            "--election-timeout", str(self._election_ms),
            "--logger", "zap",
            "--log-level", "warn",
            *self._extra_args,
        ]  # fmt: skip
        log = open(member.data_dir / "etcd.log", "ab")  # noqa: SIM115  (owned by the child)
        try:
            member.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()

    def _wait_healthy(self, member: Member, deadline: float) -> None:
        while time.monotonic() < deadline:
            if member.process is None or member.process.poll() is not None:
                raise EtcdStartError(
                    f"etcd member {member.name} exited during start-up; "
                    f"see {member.data_dir / 'etcd.log'}:\n{_tail(member.data_dir / 'etcd.log')}"
                )
            if _healthy(member):
                return
            time.sleep(0.05)
        raise EtcdStartError(
            f"etcd member {member.name} not healthy before its deadline; "
            f"log tail:\n{_tail(member.data_dir / 'etcd.log')}"
        )

    @staticmethod
    def _terminate(member: Member) -> None:
        proc, member.process = member.process, None
        if proc is not None:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[Any], grace: float = 5.0) -> str:
    """SIGTERM, then SIGKILL if it has not exited after `grace` seconds (every wait bounded).

    Returns how it ended: "exited" (before we asked), "SIGTERM" or "SIGKILL".
    """
    if proc.poll() is not None:
        return "exited"
    proc.terminate()
    try:
        proc.wait(timeout=grace)
        return "SIGTERM"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
        return "SIGKILL"


def _healthy(member: Member) -> bool:
    try:
        with urllib.request.urlopen(member.client_url + "/health", timeout=1.0) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _member_status(member: Member) -> tuple[int, int] | None:
    """(member id, leader id) from the member's maintenance status, or None if unreachable."""
    from consistency.etcd import Etcd

    with contextlib.suppress(TensorHubError), Etcd([member.endpoint], timeout=1.0) as etcd:
        return etcd.status()
    return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
