"""An etcd at its default limits, one hub process over it, and a tenant with raised quotas:
what the holders, manifest, shards and history parts run against. Always torn down."""

from __future__ import annotations

import secrets
import subprocess
import sys
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


class World:
    """`with World() as w:` — `w.address`, `w.token`, `w.etcd_endpoint`, `w.hub` (a Server)."""

    def __init__(self, hub_flags: list[str] | None = None, max_sessions: int = 4096) -> None:
        self._flags = hub_flags or []
        self._max_sessions = max_sessions
        self.etcd = EtcdCluster(size=1)
        self.admin = secrets.token_urlsafe(16)
        self.hub: Server | None = None
        self.token = ""

    def __enter__(self) -> World:
        self.etcd.start()
        try:
            self.hub = hub_server(self.etcd.endpoints, self.admin, extra=self._flags).start()
            self.token = create_tenant(self.hub.address, self.admin, self._max_sessions)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self.hub is not None:
            self.hub.stop()
            self.hub = None
        self.etcd.stop()

    @property
    def address(self) -> str:
        if self.hub is None:
            raise ServerStartError("no hub: use the World inside `with`")
        return self.hub.address

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
