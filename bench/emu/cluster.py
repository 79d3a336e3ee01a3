"""One benchmark's world: emulated hosts, etcd, a hub replica per datacenter, a tenant,
and a participant process per host — all removed on exit, whatever happened.

etcd stays on loopback in the root namespace (only the hubs talk to it); each hub replica
listens on the root namespace's address on its dc's bridge, so participants reach the
replica of their own dc without crossing the inter-dc link.

`saturation` is the check every ratio depends on: the same participants move the same
number of bytes with a plain socket, all links busy at once (each host uploads to the next
and downloads from the previous one, as in a replication chain). If a link then delivers
less than `SATURATED` of its configured rate, the CPUs (not the links) were the limit and
the benchmark refuses to report its ratios.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.emu.control import Participant, broadcast, gather
from bench.emu.netns import Emulation, Host
from consistency import EtcdCluster, Keys
from ros.hub.tenants import TenantStore
from tensorhub.errors import TensorHubError

SATURATED = 0.85
"""A plain-socket run must reach this fraction of the configured link rate (tbf counts
Ethernet framing too, so about 0.95 is the most TCP payload can get)."""

TENANT = "bench"


class HubStartError(TensorHubError):
    """A hub replica did not come up."""

    code = "UNAVAILABLE"


@dataclass
class Saturation:
    """What a plain-socket run on the links achieved."""

    rate_mbit: float
    goodput_mbit: list[float]
    nbytes: int
    seconds: list[float] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """The median link's goodput over the configured rate (one stream of nine that
        starts late is noise; most links falling short means the CPUs were the limit)."""
        ranked = sorted(self.goodput_mbit)
        return ranked[len(ranked) // 2] / self.rate_mbit

    @property
    def saturated(self) -> bool:
        return self.fraction >= SATURATED

    @property
    def one_transfer(self) -> float:
        """Seconds for `nbytes` over one link, the median of the plain runs."""
        return sorted(self.seconds)[len(self.seconds) // 2]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate_mbit": self.rate_mbit,
            "min_goodput_mbit": round(min(self.goodput_mbit), 1),
            "median_fraction_of_rate": round(self.fraction, 3),
            "saturated": self.saturated,
            "one_transfer_s": round(self.one_transfer, 3),
        }


class Cluster:
    """`hosts_per_dc` emulated hosts with participants; `.parts[i]` runs on `.emu.hosts[i]`."""

    def __init__(
        self,
        hosts_per_dc: dict[int, int],
        rate_mbit: float,
        wan_mbit: float | None = None,
        *,
        hub: bool = True,
        replicas: int = 1,
    ) -> None:
        self.emu = Emulation(hosts_per_dc, rate_mbit, wan_mbit)
        self.want_hub = hub
        self.etcd: EtcdCluster | None = None
        self.replicas = replicas
        self.hubs: dict[int, list[tuple[subprocess.Popen[bytes], Path]]] = {}
        self.parts: list[Participant] = []
        self.token = ""
        self.logs = Path(tempfile.mkdtemp(prefix="tensorhub-bench-"))

    def __enter__(self) -> Cluster:
        self.emu.__enter__()
        try:
            if self.want_hub:
                self._start_hub()
            for host in self.emu.hosts:
                log = self.logs / f"{host.name}.log"
                self.parts.append(Participant(self.emu, host, host.name, log))
            gather(self.parts, 120)  # each says {"ready": true} once imported
            if self.want_hub:
                for i, p in enumerate(self.parts):
                    where = self.hub_address(p.host.dc, i)
                    p.send("connect", hub=[where], tenant=TENANT,
                           token=self.token, topology=p.host.topology)  # fmt: skip
                gather(self.parts, 60)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _start_hub(self) -> None:
        """etcd, then each replica as its own `tensorhub serve` process (as deployed: a
        replica per process, so replicas do not share one interpreter lock)."""
        self.etcd = EtcdCluster(size=1, auth=True).start()  # only the hubs can read it
        admin = secrets.token_urlsafe(16)
        etcd = ",".join(self.etcd.endpoints)
        password = self.etcd.password_file()
        for dc in self.emu.hosts_per_dc:
            for i in range(self.replicas):
                ready = self.logs / f"hub-{dc}-{i}.json"
                # The admin token in the environment, not on the command line (`ps`).
                argv = [sys.executable, "-m", "ros.cli", "serve", "--etcd", etcd,
                        "--listen", f"{self.emu.gateway(dc)}:0", "--ready-file", str(ready),
                        "--etcd-user", "root", "--etcd-password-file", str(password)]  # fmt: skip
                log = (self.logs / f"hub-{dc}-{i}.log").open("ab")
                env = {**os.environ, "TENSORHUB_ADMIN_TOKEN": admin}
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=log, start_new_session=True, env=env
                )
                self.hubs.setdefault(dc, []).append((proc, ready))
        client = self.etcd.client()
        try:
            self.token = TenantStore(client, Keys()).create(TENANT)
        finally:
            client.close()
        deadline = time.monotonic() + 60
        for proc, ready in (h for group in self.hubs.values() for h in group):
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise HubStartError(f"hub replica did not start; see {self.logs}")
                time.sleep(0.05)

    def hub_address(self, dc: int, index: int = 0) -> str:
        """Replica `index` (mod the replica count) of dc's hub."""
        replicas = self.hubs[dc]
        _, ready = replicas[index % len(replicas)]
        return str(json.loads(ready.read_text())["address"])

    def __exit__(
        self,
        kind: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        for p in self.parts:
            p.kill()
        for proc, _ in (h for group in self.hubs.values() for h in group):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if self.etcd is not None:
            self.etcd.stop()
        self.emu.__exit__(kind, exc, tb)
        self._drop_logs(failed=kind is not None)

    def _drop_logs(self, *, failed: bool) -> None:
        """Remove the run's log directory, so no run leaves its logs in /tmp. After a
        failed run the tail of each log is printed first; with TENSORHUB_BENCH_KEEP_LOGS set
        the directory is kept instead, and its path printed."""
        keep = bool(os.environ.get("TENSORHUB_BENCH_KEEP_LOGS"))
        if failed and keep:
            print(f"bench logs kept in {self.logs}", file=sys.stderr)
            return
        if failed:
            for path in sorted(self.logs.glob("*.log")):
                tail = path.read_bytes()[-2000:].decode(errors="replace")
                print(f"--- {path.name} (tail) ---\n{tail}", file=sys.stderr)
        shutil.rmtree(self.logs, ignore_errors=True)

    def host(self, i: int) -> Host:
        return self.emu.hosts[i]

    def saturation(self, parts: list[Participant], nbytes: int) -> Saturation:
        """Plain sockets around a ring of `parts` (>= 2), every link busy at once."""
        ports = [r["port"] for r in broadcast(parts, "plain_listen", 30, nbytes=nbytes)]
        n = len(parts)
        for i, p in enumerate(parts):
            j = (i + 1) % n
            p.send("plain_recv", host=parts[j].host.ip, port=ports[j], nbytes=nbytes)
        runs = gather(parts, 300)
        secs = [r["seconds"] for r in runs]
        return Saturation(self.emu.rate_mbit, [nbytes * 8 / s / 1e6 for s in secs], nbytes, secs)

    def wan_saturation(self, src: Participant, dst: Participant, nbytes: int) -> Saturation:
        """One plain transfer across the inter-dc link (it must be the bottleneck)."""
        port = src.call("plain_listen", nbytes=nbytes)["port"]
        secs = dst.call("plain_recv", 300, host=src.host.ip, port=port, nbytes=nbytes)["seconds"]
        rate = self.emu.wan_mbit or self.emu.rate_mbit
        return Saturation(rate, [nbytes * 8 / secs / 1e6], nbytes, [secs])


def settle(seconds: float = 0.3) -> None:
    """Let queues drain between phases, so one phase's tail does not slow the next."""
    time.sleep(seconds)
