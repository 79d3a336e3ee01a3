"""Clients per replica: at each N, a fresh hub round and a fresh ceiling round, one etcd.

A fresh hub process and a fresh ceiling process per N keep each N's RSS and thread count its
own. The hub's tenant has its session quota raised (CreateTenant, `quotas.max_sessions`) to
cover N clients plus the publisher, with room for the sessions of the round before, which
expire within their TTL. The hub round publishes with the SDK (`ros.connect(...).publish`,
a one-tensor manifest), so it measures the path a trainer takes.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from bench.scale.clients import Fleet
from bench.scale.load import (
    MODEL,
    Publisher,
    RoundSpec,
    ceiling_publisher,
    run_round,
    with_deadline,
)
from bench.scale.procs import Server, ServerStartError, ceiling_server, create_tenant, hub_server

Log = Callable[[str], None]


def hub_publisher(address: str, token: str) -> tuple[Publisher, Callable[[], None]]:
    """An SDK client that publishes small one-tensor versions, releasing all but the last two."""
    import torch

    import ros

    hub = ros.connect(address, tenant=token.split(".", 1)[0], token=token, timeout=10.0)
    held: dict[int, Any] = {}

    def publish(version: int) -> None:
        held[version] = hub.publish(
            MODEL, version, {"w": torch.full((16,), float(version))}, timeout=10.0
        )
        old = held.pop(version - 2, None)
        if old is not None:
            old.release(timeout=5.0)

    return publish, hub.close


def hub_round(
    etcd: list[str],
    spec: RoundSpec,
    log: Log,
    tree: str | None = None,
    extra: list[str] | None = None,
    fleet: Fleet | None = None,
) -> dict[str, Any]:
    """One round on a fresh hub (`tree`: another checkout's hub code), with `fleet`'s client
    processes if given (see `run_round`)."""
    admin = secrets.token_urlsafe(16)
    try:
        server = hub_server(etcd, admin, tree=tree, extra=extra).start()
    except ServerStartError as exc:
        return {"clients": spec.clients, "server": "hub", "failed": str(exc)}
    try:
        token = create_tenant(server.address, admin, max_sessions=2 * spec.clients + 64)
        try:
            publish, close = hub_publisher(server.address, token)
        except Exception as exc:  # reported as this round's failure
            return {"clients": spec.clients, "server": "hub", "failed": f"publisher: {exc}"}
        try:
            out = run_round(server, publish, token, spec, 1, log, fleet)
        finally:
            if not with_deadline(close, 20.0):
                log("  the publisher's close did not finish in 20 s (hub not answering)")
        out["hub_log_tail"] = server.log_tail(3)
        return out
    finally:
        server.stop()


def ceiling_round(spec: RoundSpec, log: Log, fleet: Fleet | None = None) -> dict[str, Any]:
    """The same round on a fresh ceiling server."""
    server: Server = ceiling_server()
    try:
        server.start()
    except ServerStartError as exc:
        return {"clients": spec.clients, "server": "ceiling", "failed": str(exc)}
    publish, close = ceiling_publisher(server.address)
    try:
        return run_round(server, publish, "ceiling.none", spec, 1, log, fleet)
    finally:
        close()
        server.stop()


def summary(r: dict[str, Any]) -> str:
    """One human line per round."""
    if "failed" in r and "sessions" not in r:
        return f"  {r['server']} N={r['clients']}: FAILED {r['failed']}"

    def ms(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else f"{v:.1f}"

    return (
        f"  {r['server']} N={r['clients']}: sessions {r.get('sessions')}, published "
        f"{r.get('versions_published')}/{r.get('versions_asked')}, missing "
        f"{r.get('versions_missing_somewhere')}, all-visible p50/p99 "
        f"{ms('all_visible_p50_ms')}/{ms('all_visible_p99_ms')} ms, latest p99 "
        f"{ms('latest_p99_ms')} ms ({r.get('latest_calls')} ok, errors "
        f"{r.get('latest_errors')}), rss {r.get('rss_mb', 0):.0f} MB, threads "
        f"{r.get('threads')}, cpu/version {r.get('cpu_s_per_version') or 0:.3f} s, stream "
        f"errors {r.get('stream_errors')}" + (f", FAILED {r['failed']}" if "failed" in r else "")
    )
