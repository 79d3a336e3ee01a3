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

`links_since` is the check that the bytes crossed those links at all: the host links' byte
counters before and after a phase, against the model copies the phase moved. With
`transport="nixl"` each participant's client reads COMPLETE holders over NIXL, whose UCX
would pick cma (`process_vm_readv`) or shared memory between two namespaces of one kernel
and move the bytes past the shaped veths; so those participants start with `UCX_TLS=tcp`
and `UCX_NET_DEVICES=eth0` (UCX's TCP transport on the host's own veth, not `lo`), and a
phase whose bytes did not show up on the links raises `LinksBypassed`.
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

from bench.common import TRANSPORTS, LinksBypassed
from bench.emu.control import Participant, broadcast, gather
from bench.emu.netns import Emulation, Host
from consistency import EtcdCluster, Keys
from ros.hub.tenants import TenantStore
from tensorhub.errors import TensorHubError

SATURATED = 0.85
"""A plain-socket run must reach this fraction of the configured link rate (tbf counts
Ethernet framing too, so about 0.95 is the most TCP payload can get)."""

TENANT = "bench"

UCX_ON_LINKS = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
"""What a NIXL participant's UCX is given (module docstring): TCP only, over `eth0`."""

ON_LINKS = 0.95
"""A phase that moved k copies of the model must show at least this fraction of k model
sizes on the host links' counters (which count frames with their headers, so an honest
phase shows a little more than k: 1.003 k to 1.009 k measured here); below it, the bytes
went around the links (`LinksBypassed`)."""


def links_between(
    before: dict[str, tuple[int, int]],
    after: dict[str, tuple[int, int]],
    nbytes: int,
    copies: int,
    what: str,
) -> Links:
    """What the host links carried from `before` to `after` (`Emulation.link_bytes`) in a
    phase that moved `copies` copies of `nbytes`; `LinksBypassed` when less than `ON_LINKS`
    of that crossed them."""
    down = sum(after[h][0] - before[h][0] for h in after)
    up = sum(after[h][1] - before[h][1] for h in after)
    links = Links(down, up, copies, nbytes)
    if links.per_copy < ON_LINKS:
        raise LinksBypassed(
            f"{what}: the host links carried {down / nbytes:.2f} model sizes for {copies} "
            f"copies moved ({links.per_copy:.2f} per copy, < {ON_LINKS}): the bytes went "
            f"around the shaped links, so the time is not the links'"
        )
    return links


def participant_env(transport: str) -> dict[str, str]:
    """The environment a participant of a `transport` run starts with, on top of ours."""
    return dict(UCX_ON_LINKS) if transport == "nixl" else {}


@dataclass(frozen=True)
class Links:
    """Bytes the host links carried during one phase that moved `copies` copies of an
    `nbytes` model: `down` into the hosts, `up` out of them (frames included)."""

    down: int
    up: int
    copies: int
    nbytes: int

    @property
    def per_copy(self) -> float:
        """Bytes into the hosts / (copies x model): a little over 1 when every copy crossed
        a link (headers), near 0 when the bytes went around the links."""
        return self.down / (self.copies * self.nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "down_bytes": self.down,
            "up_bytes": self.up,
            "copies": self.copies,
            "link_bytes_per_model": round(self.down / self.nbytes, 3),
            "per_copy": round(self.per_copy, 3),
        }


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
        transport: str = "tcp",
        fair: bool = False,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: expected one of {TRANSPORTS}")
        self.emu = Emulation(hosts_per_dc, rate_mbit, wan_mbit, fair=fair)
        self.want_hub = hub
        self.transport = transport
        self.env = participant_env(transport)
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
                self.parts.append(Participant(self.emu, host, host.name, log, self.env))
            gather(self.parts, 120)  # each says {"ready": true} once imported
            if self.want_hub:
                for i, p in enumerate(self.parts):
                    where = self.hub_address(p.host.dc, i)
                    p.send("connect", hub=[where], tenant=TENANT, token=self.token,
                           topology=p.host.topology, transports=[self.transport])  # fmt: skip
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

    def ucx(self) -> dict[str, str]:
        """The `UCX_*` settings the participants started with (ours and inherited ones)."""
        env = {**os.environ, **self.env}
        return {k: v for k, v in sorted(env.items()) if k.startswith("UCX_")}

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """The host links' counters now (`Emulation.link_bytes`), for `links_since`."""
        return self.emu.link_bytes()

    def links_since(
        self, before: dict[str, tuple[int, int]], nbytes: int, copies: int, what: str
    ) -> Links:
        """What the host links carried since `before` (`link_bytes()`), for a phase that
        moved `copies` copies of `nbytes`; `LinksBypassed` when less than `ON_LINKS` of
        that crossed them."""
        how = f"transport {self.transport}, UCX settings {self.ucx()}"
        return links_between(before, self.emu.link_bytes(), nbytes, copies, f"{what} ({how})")

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
