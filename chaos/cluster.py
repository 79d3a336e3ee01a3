"""The cluster under test: 3 etcd members, 2 hub replicas (processes), proxies, tenants.

Every address is on loopback, or on the veth of a namespace the run made. Clients reach
each hub replica through a `Proxy`, so a failpoint can blackhole or delay it. A hub binds
port 0 and reports the port it got in its ready file; its proxy forwards there, so a killed
hub restarts on whatever port is free and the clients' address lists (the proxies) stay
valid. `close()` stops everything this object started, and is safe after a partial start.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from chaos.proxy import Proxy
from consistency import Etcd, EtcdCluster, Keys
from consistency.embedded import stop_process
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tensorhub.errors import DeadlineExceeded, TensorHubError

HUB_START_TIMEOUT = 40.0


class HubProcess:
    """One `tensorhub serve` process, restartable after a kill.

    It listens on port 0 and `start()` reads the port it bound from its ready file, so no
    other process can take the port between choosing and binding it (a port chosen free
    beforehand could be, and the hub then exited at once with "Failed to bind").
    """

    def __init__(
        self,
        index: int,
        etcd: list[str],
        admin: str,
        prefix: str,
        root: Path,
        etcd_password_file: Path | None = None,
    ) -> None:
        """`etcd_password_file`: etcd root's password, for an etcd with auth on."""
        self.index, self.etcd = index, etcd
        self.admin, self.prefix, self.root = admin, prefix, root
        self.etcd_password_file = etcd_password_file
        self.port = 0  # the port the current (or last) incarnation bound
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / f"hub{self.index}.log"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def ready_path(self) -> Path:
        return self.root / f"hub{self.index}.ready"

    def start(self, timeout: float = HUB_START_TIMEOUT) -> HubProcess:
        """`spawn()` and `wait_ready()`."""
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        """Start the process (it binds, then writes its ready file; `wait_ready` reads it)."""
        ready = self.ready_path
        ready.unlink(missing_ok=True)
        # `--admin-token=VALUE`, not two words: a token may begin with "-" (token_urlsafe
        # does one time in 64), and argparse then takes it for an option and exits.
        args = [
            sys.executable, "-c", "import sys; from ros.cli import main; sys.exit(main())",
            "serve", "--etcd", ",".join(self.etcd), "--listen", "127.0.0.1:0",
            f"--admin-token={self.admin}", "--prefix", self.prefix, "--ready-file", str(ready),
        ]  # fmt: skip
        if self.etcd_password_file is not None:
            args += ["--etcd-user", "root", "--etcd-password-file", str(self.etcd_password_file)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def wait_ready(self, timeout: float = HUB_START_TIMEOUT) -> HubProcess:
        """Wait for the spawned process's ready file and take the port it bound; a process
        that exits or is not ready in `timeout` seconds is killed and named."""
        proc = self.process
        if proc is None:
            raise TensorHubError(f"hub {self.index} was not spawned")
        deadline = time.monotonic() + timeout
        while (port := _bound_port(self.ready_path)) is None:
            code = proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.kill()
                how = f"exited with {code}" if code is not None else f"not ready in {timeout:.0f}s"
                raise DeadlineExceeded(
                    f"hub {self.index} did not start ({how}); see {self.log_path}:\n"
                    f"{_tail(self.log_path)}"
                )
            time.sleep(0.05)
        self.port = port
        return self

    def kill(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            stop_process(proc)


class ChaosCluster:
    """3 etcd members, 2 hubs + one proxy per hub, with tenants `team-a` (victim) and `team-b`."""

    TENANT, INTRUDER = "team-a", "team-b"

    def __init__(self, root: Path, *, hubs: int = 2, etcd_members: int = 3) -> None:
        self.root = root
        self.prefix = f"/chaos/{root.name}"
        self.keys = Keys(self.prefix)
        self.admin = secrets.token_urlsafe(18)
        # auth on, as in production: the hubs and this object are etcd's only clients
        self.etcd = EtcdCluster(etcd_members, data_root=str(root / "etcd"), auth=True)
        self.hubs: list[HubProcess] = []
        self.hub_proxies: list[Proxy] = []
        self.tokens: dict[str, str] = {}
        self.client: Etcd | None = None
        self._n_hubs = hubs
        self._stale_etcd: EtcdCluster | None = None
        self._stale_hub: HubServer | None = None

    def start(self) -> ChaosCluster:
        self.etcd.start()
        self.client = self.etcd.client(timeout=5.0)
        tenants = TenantStore(self.client, self.keys)
        tenants.hub_secret()
        for name in (self.TENANT, self.INTRUDER):
            self.tokens[name] = tenants.create(name)
        for i in range(self._n_hubs):  # started at once: each takes a second to import
            hub = HubProcess(
                i, self.etcd.endpoints, self.admin, self.prefix, self.root,
                etcd_password_file=self.etcd.password_file(),
            )  # fmt: skip
            self.hubs.append(hub)
            hub.spawn()
        for hub in self.hubs:
            hub.wait_ready()
            self.hub_proxies.append(Proxy(("127.0.0.1", 0), ("127.0.0.1", hub.port)).start())
        return self

    def restart_hub(self, index: int) -> None:
        """Start a killed hub again (on a port it binds afresh) and point its proxy there."""
        hub = self.hubs[index]
        hub.start()
        self.hub_proxies[index].switch(("127.0.0.1", hub.port))

    @property
    def hub_addresses(self) -> list[str]:
        """What clients dial: the proxies in front of the replicas."""
        return [p.address for p in self.hub_proxies]

    def etcd_client(self) -> Etcd:
        if self.client is None:
            raise TensorHubError("the cluster is not started")
        return self.client

    def holder_leases(self, holder_prefix: str) -> set[int]:
        """The leases of every holder record whose holder name starts with `holder_prefix`."""
        model_prefix = f"{self.keys.tenant(self.TENANT)}m/"
        result = self.etcd_client().range(model_prefix, prefix=True, timeout=5.0)
        return {
            kv.lease for kv in result.kvs if f"/h/{holder_prefix}".encode() in kv.key and kv.lease
        }

    # -- a stale replica (split brain): a hub over a frozen copy of the data ----------------

    def prepare_stale(self) -> None:
        """Start the (empty) etcd member a stale replica will serve from, ahead of time."""
        if self._stale_etcd is None:
            stale = EtcdCluster(1, data_root=str(self.root / "stale-etcd"), auth=True)
            self._stale_etcd = stale.start()

    def start_stale_hub(self) -> str:
        """Copy every key into the stale etcd member and serve it by a third hub replica.

        The copy's revisions count from 1, so all of its answers are older than anything a
        client has seen from the real cluster: what a replica back from a long partition
        with old state would say. The replica runs in this process (it starts in a moment).
        """
        self.stop_stale_hub()
        self.prepare_stale()
        if self._stale_etcd is None:
            raise TensorHubError("stale etcd did not start")
        kvs = self.etcd_client().range(self.prefix + "/", prefix=True, timeout=5.0).kvs
        with self._stale_etcd.client(timeout=5.0) as copy:
            for kv in kvs:
                copy.put(kv.key, kv.value)
        self._stale_hub = HubServer(
            self._stale_etcd.endpoints, listen="127.0.0.1:0", admin_token=self.admin,
            keys=self.keys, etcd_credentials=self._stale_etcd.credentials,
        ).start()  # fmt: skip
        return self._stale_hub.address

    def stop_stale_hub(self) -> None:
        hub, self._stale_hub = self._stale_hub, None
        if hub is not None:
            hub.stop(grace=0.2)

    def close(self) -> None:
        self.stop_stale_hub()
        if self._stale_etcd is not None:
            self._stale_etcd.stop()
        for proxy in self.hub_proxies:
            with contextlib.suppress(OSError):
                proxy.stop()
        for hub in self.hubs:
            hub.stop()
        if self.client is not None:
            self.client.close()
        self.etcd.stop()

    def describe(self) -> dict[str, object]:
        return {
            "etcd": self.etcd.endpoints,
            "hubs": [h.address for h in self.hubs],
            "hub_proxies": self.hub_addresses,
            "prefix": self.prefix,
        }


def _bound_port(ready: Path) -> int | None:
    """The port a hub wrote to its ready file, or None while there is no (whole) file yet."""
    try:
        return int(json.loads(ready.read_text())["address"].rsplit(":", 1)[1])
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def write_start_file(path: Path, end: float) -> None:
    """Tell every worker (and every restarted one) when the run ends."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"end": end}))
    tmp.rename(path)
