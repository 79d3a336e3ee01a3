"""Hub replicas as real `tensorhub serve` processes, for the fault tests of issue 25.

Each replica binds port 0 and reports its address in its ready file (no port chosen
beforehand that another process could take); its Prometheus port is chosen free and read
back over HTTP. Replicas start in parallel (a replica takes about a second to import), and
`stop_all` ends every one still running: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from consistency.embedded import stop_process

ADMIN = "review-admin"
START_TIMEOUT = 60.0  # a loaded two-core machine can take this long to import a hub


@dataclass
class Replica:
    """One hub process: its address once ready, its metrics port and its log."""

    process: subprocess.Popen[bytes]
    ready: Path
    log: Path
    metrics_port: int
    address: str = ""

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (kill -9) and reap it."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def metric(self, name: str) -> float:
        """The value of one unlabelled sample on the replica's /metrics (0 when absent)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(f"{name} "):
                    return float(line.split()[1])
        return 0.0

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_replicas(
    etcd: list[list[str]], prefix: str, root: Path, extra: list[str] | None = None
) -> list[Replica]:
    """One replica per entry of `etcd` (the endpoints that replica dials), all on `prefix`,
    started at once; returns when every one is ready (or raises with its log's tail)."""
    replicas = []
    for index, endpoints in enumerate(etcd):
        ready = root / f"hub{index}.ready"
        log = root / f"hub{index}.log"
        args = [
            sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
            "--etcd", ",".join(endpoints), f"--admin-token={ADMIN}", "--prefix", prefix,
            "--ready-file", str(ready), "--metrics-port", "0", *(extra or []),
        ]  # fmt: skip
        with log.open("ab") as out:
            process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        replicas.append(Replica(process, ready, log, 0))
    deadline = time.monotonic() + START_TIMEOUT
    try:
        for replica in replicas:
            while not (info := _ready(replica.ready)):
                if not replica.alive or time.monotonic() > deadline:
                    raise AssertionError(f"a hub replica did not start:\n{replica.tail()}")
                time.sleep(0.05)
            replica.address = str(info["address"])
            replica.metrics_port = int(str(info["metrics"]).rsplit(":", 1)[1])
    except BaseException:
        stop_all(replicas)
        raise
    return replicas


def _ready(ready: Path) -> dict[str, object]:
    """A ready file's content (the hub's address and metrics address), or {} while it is
    absent. The hub picks its metrics port itself (`--metrics-port 0`): a port picked here
    and passed in could be taken by another process in between."""
    try:
        info: dict[str, object] = json.loads(ready.read_text())
    except (OSError, ValueError):
        return {}
    return info


def stop_all(replicas: list[Replica]) -> None:
    """End every replica still running (SIGTERM, SIGKILL after 5 s)."""
    for replica in replicas:
        if replica.alive:
            stop_process(replica.process)
