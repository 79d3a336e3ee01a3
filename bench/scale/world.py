"""An etcd at stated limits, one or more hub replicas over it, and a tenant with raised quotas:
what the holders, manifest, shards, herd, reconnect and history parts run against. Always
torn down."""

from __future__ import annotations

import secrets
import subprocess
import sys
from dataclasses import dataclass
from types import TracebackType

from bench.scale.procs import (
    ProcStats,
    Server,
    ServerStartError,
    create_tenant,
    etcd_pid,
    etcd_status,
    hub_server,
)
from consistency.embedded import EtcdCluster


@dataclass(frozen=True)
class EtcdLimits:
    """The etcd request limits a part runs under, passed to etcd explicitly so the figures
    say what they were measured against. The defaults are etcd's own (3.4 and 3.5)."""

    max_txn_ops: int = 128
    max_request_bytes: int = 1_572_864  # 1.5 MiB

    def args(self) -> list[str]:
        return [f"--max-txn-ops={self.max_txn_ops}",
                f"--max-request-bytes={self.max_request_bytes}"]  # fmt: skip

    def describe(self) -> str:
        return f"--max-txn-ops {self.max_txn_ops} --max-request-bytes {self.max_request_bytes}"


class World:
    """`with World() as w:` — `w.address` (the first replica), `w.addresses` (every replica),
    `w.token`, `w.etcd_endpoint`, `w.hub` / `w.hubs` (Servers).

    `replicas` hub processes share one etcd (sessions are etcd leases, so any replica serves
    any session); `tree` runs another checkout's hub (`--hub-tree`); `metrics` starts each
    with a Prometheus port (`Server.metrics_port`)."""

    def __init__(
        self,
        hub_flags: list[str] | None = None,
        max_sessions: int = 4096,
        *,
        replicas: int = 1,
        tree: str | None = None,
        limits: EtcdLimits | None = None,
        metrics: bool = False,
    ) -> None:
        self._flags = hub_flags or []
        self._max_sessions = max_sessions
        self._replicas = replicas
        self._tree = tree
        self._metrics = metrics
        self.limits = limits or EtcdLimits()
        self.etcd = EtcdCluster(size=1, extra_args=self.limits.args())
        self.admin = secrets.token_urlsafe(16)
        self.hubs: list[Server] = []
        self.token = ""

    def __enter__(self) -> World:
        self.etcd.start()
        try:
            for _ in range(self._replicas):
                self.hubs.append(
                    hub_server(
                        self.etcd.endpoints, self.admin, tree=self._tree, extra=self._flags,
                        metrics=self._metrics,
                    ).start()
                )  # fmt: skip
            self.token = create_tenant(self.address, self.admin, self._max_sessions)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for hub in self.hubs:
            hub.stop()
        self.hubs = []
        self.etcd.stop()

    @property
    def hub(self) -> Server | None:
        return self.hubs[0] if self.hubs else None

    @property
    def address(self) -> str:
        if not self.hubs:
            raise ServerStartError("no hub: use the World inside `with`")
        return self.hubs[0].address

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hubs]

    @property
    def tenant(self) -> str:
        return self.token.split(".", 1)[0]

    @property
    def etcd_endpoint(self) -> str:
        return self.etcd.endpoints[0]

    def status(self) -> dict[str, int]:
        return etcd_status(self.etcd_endpoint)

    def hub_stats(self) -> ProcStats:
        return ProcStats(0.0, 0, 0.0) if self.hub is None else self.hub.stats()

    def etcd_stats(self) -> ProcStats:
        return ProcStats.of(etcd_pid(self.etcd_endpoint))


def serve_flags() -> str:
    """`tensorhub serve --help` of this checkout (to see which flags the hub has yet)."""
    done = subprocess.run(
        [sys.executable, "-m", "ros.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout
