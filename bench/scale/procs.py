"""The processes a scale run measures: etcd, a hub (`tensorhub serve`) or the ceiling server,
each its own process so its RSS, threads and CPU seconds can be read from /proc.

Every start and stop is bounded: a server that does not write its ready file in time is
killed and reported as `ServerStartError`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from consistency.embedded import free_port, stop_process
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import TensorHubError

TENANT = "scale"
START_SECONDS = 60.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class ServerStartError(TensorHubError):
    """A hub or ceiling process did not come up before its deadline."""

    code = "UNAVAILABLE"


@dataclass(frozen=True)
class ProcStats:
    """One process as /proc shows it: resident memory, thread count, CPU seconds used."""

    rss_mb: float
    threads: int
    cpu_s: float

    @staticmethod
    def of(pid: int) -> ProcStats:
        """Read /proc/PID (zeros if the process is gone)."""
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return ProcStats(0.0, 0, 0.0)
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss_kb = float(fields.get("VmRSS", "0 kB").split()[0])
        threads = int(fields.get("Threads", "0").strip())
        after = stat.rsplit(")", 1)[1].split()  # the fields after the command name
        cpu = (int(after[11]) + int(after[12])) / _CLK_TCK  # utime + stime
        return ProcStats(rss_kb / 1024, threads, cpu)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds each thread of process `pid` used so far, by thread id (empty if the
    process is gone): what shows which thread a process's CPU was spent on."""
    used: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return used
    for task in tasks:
        try:
            after = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        used[task.name] = (int(after[11]) + int(after[12])) / _CLK_TCK
    return used


def descendants(pid: int) -> list[int]:
    """The pids of the processes that process `pid` started, and theirs (from /proc: those
    alive now; none for a process gone)."""
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += children
            parents += children
    return found


def descendants_cpu(pid: int) -> float:
    """CPU seconds used so far by the processes that process `pid` started, and theirs
    (0 where there are none): a hub's checking processes, forked from its fork server
    (`ros.hub.manifest_processes`), whose CPU is not the hub's own."""
    return sum(ProcStats.of(child).cpu_s for child in descendants(pid))


class Server:
    """A server process (`argv`) that writes `{"address": ...}` to a ready file once serving."""

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        name: str = "server",
    ) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=f"thb-scale-{name}-"))
        self.ready_file = self._dir / "ready.json"
        self.log_path = self._dir / "log.txt"
        self._argv = [*argv, "--ready-file", str(self.ready_file)]
        self._cwd = cwd
        self._env = env
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.metrics_port = 0  # its Prometheus port, when it was started with one

    def start(self, timeout: float = START_SECONDS) -> Server:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._cwd,
                env=self._env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited at start-up: {self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                self.address = str(json.loads(self.ready_file.read_text())["address"])
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerStartError(f"{self.name} not serving within {timeout:.0f}s: {self.log_tail()}")

    @property
    def pid(self) -> int:
        return 0 if self.proc is None else self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stats(self) -> ProcStats:
        return ProcStats.of(self.pid)

    def log_tail(self, lines: int = 8) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def kill(self) -> None:
        """SIGKILL now (a replica that dies without a word), and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> str:
        """SIGTERM, then SIGKILL after a grace period; returns how it ended."""
        how = "not started" if self.proc is None else stop_process(self.proc, grace=5.0)
        self.proc = None
        return how

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def hub_server(
    etcd: list[str],
    admin_token: str,
    *,
    tree: str | None = None,
    extra: list[str] | None = None,
    metrics: bool = False,
) -> Server:
    """`tensorhub serve` over `etcd` on a free loopback port; `tree`: run the code of another
    checkout (its root goes first on PYTHONPATH, e.g. the BEFORE worktree); `metrics`: with
    `--metrics-port` on a free port (`Server.metrics_port`; see `gauge`)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    argv = [
        sys.executable,
        "-m",
        "ros.cli",
        "serve",
        "--etcd",
        ",".join(etcd),
        "--listen",
        "127.0.0.1:0",
        f"--admin-token={admin_token}",  # one glued argument: a token may begin with "-"
        *(extra or []),
    ]
    port = free_port() if metrics else 0
    if port:
        argv += ["--metrics-port", str(port)]
    server = Server(argv, cwd=tree, env=env, name="hub")
    server.metrics_port = port
    return server


def ceiling_server(metrics: bool = False) -> Server:
    """The minimal grpc.aio fan-out server (`bench.scale.ceiling`) on a free loopback port;
    `metrics`: it counts its streams on a Prometheus port as the hub does (`gauge`)."""
    argv = [sys.executable, "-m", "bench.scale.ceiling", "--listen", "127.0.0.1:0"]
    port = free_port() if metrics else 0
    if port:
        argv += ["--metrics-port", str(port)]
    server = Server(argv, name="ceiling")
    server.metrics_port = port
    return server


def gauge(port: int, name: str, timeout: float = 2.0) -> float | None:
    """A gauge of the Prometheus endpoint on 127.0.0.1:`port`, summed over its labels (None
    if the endpoint does not answer or has no such gauge: an older hub)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    ]
    return sum(values) if values else None


def create_tenant(address: str, admin_token: str, max_sessions: int, timeout: float = 30.0) -> str:
    """CreateTenant (`TENANT`) with its session quota raised to `max_sessions`; its token."""
    name = f"{TENANT}-{secrets.token_hex(3)}"
    with grpc.insecure_channel(address) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.CreateTenant(
            pb.CreateTenantRequest(
                name=name,
                # the history part publishes as fast as the hub answers: no rate quota
                quotas=pb.Quotas(max_sessions=max_sessions, max_publishes_per_minute=1 << 30),
            ),
            metadata=(("authorization", f"Bearer {admin_token}"),),
            timeout=timeout,
        )
    return str(reply.token)


def etcd_status(endpoint: str, timeout: float = 10.0) -> dict[str, int]:
    """etcd's maintenance status through its JSON gateway: dbSize, dbSizeInUse, revision.

    The gateway is used because the generated stubs we have predate `dbSizeInUse`.
    """
    req = urllib.request.Request(
        f"http://{endpoint}/v3/maintenance/status",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return {
        "db_size": int(data.get("dbSize", 0)),
        "db_size_in_use": int(data.get("dbSizeInUse", data.get("dbSize", 0))),
        "revision": int(data.get("header", {}).get("revision", 0)),
    }


def etcd_pid(endpoint: str) -> int:
    """The pid of the etcd listening on `endpoint` (0 if not found): its CPU is reported too."""
    port = endpoint.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if cmd and cmd[0].endswith(b"etcd") and any(f":{port}".encode() in c for c in cmd):
                return int(proc.name)
    return 0


def etcd_bytes_since(endpoint: str, revision: int, timeout: float = 60.0) -> tuple[int, int]:
    """(keys, bytes of key + value) of every key last written after `revision`: what a write
    (e.g. one publish) left in etcd, read through the JSON gateway."""
    body = json.dumps({"key": base64.b64encode(b"\0").decode(),
                       "range_end": base64.b64encode(b"\0").decode(),
                       "min_mod_revision": revision + 1}).encode()  # fmt: skip
    req = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    kvs = data.get("kvs", [])
    size = sum(len(base64.b64decode(kv.get("key", ""))) + len(base64.b64decode(kv.get("value", "")))
               for kv in kvs)  # fmt: skip
    return len(kvs), size


def etcd_key_count(endpoint: str, timeout: float = 30.0) -> int:
    """How many keys etcd holds (all prefixes): a leak shows here, not only in DB size."""
    body = json.dumps({"key": base64.b64encode(b"\0").decode(),
                       "range_end": base64.b64encode(b"\0").decode(),
                       "count_only": True}).encode()  # fmt: skip
    req = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return int(json.loads(resp.read()).get("count", 0))
