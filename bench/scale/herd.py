"""Herd: N clients opening at once, against the hub and against the grpc.aio ceiling.

Every client of every worker process makes its channel first (`Clients.prepare`); then all
of them, at one CLOCK_MONOTONIC instant (the barrier), call OpenSession, start a KeepAlive
stream (renewing every ttl/3) and a versions-only Watch, with no gate, ramp or pacing: a
fleet of rollouts restarted at once. Client i talks to replica i mod R.

"All open and watching" is the later of: every OpenSession answered, every session's first
renewal answered (both seen by the clients), and the servers' open Watch streams reaching N
(their `tensorhub_hub_watches_active` gauge, summed over replicas, polled every 50 ms: a
Watch stream sends nothing until there is an event, so no client can see it begin). Then
every client stays for `hold` seconds and each session's longest time between renewals is
checked against its TTL: no session may expire while the others connect. A session that
expired is an error; the herd's time is still reported (all opened, and the others renewed
and watching), so a hub that loses a few sessions still shows how long the herd took.

The baseline of "N opens at once" is one open alone on the same server, in the same run
(OpenSession on a fresh channel, the median of a few). The ceiling server
(`bench.scale.ceiling`, R processes for R replicas) runs the same herd with the same client
processes, just before the hub.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.scale.clients import Fleet, WorkerLost
from bench.scale.procs import Server, ServerStartError, ceiling_server, gauge

Log = Callable[[str], None]
MODEL = "herd"
WATCHES = "tensorhub_hub_watches_active"
BARRIER_SECONDS = 1.0  # from the last worker's "prepared" to the barrier


@dataclass(frozen=True)
class HerdSpec:
    """One herd: its clients, the processes that hold them, and its deadlines."""

    clients: int = 2000
    workers: int = 4
    ttl: int = 10
    hold: float = 10.0  # seconds every client stays open after the last open
    connect_seconds: float = 120.0
    open_seconds: float = 10.0  # one OpenSession's deadline: the SDK's default timeout
    singles: int = 5  # opens alone, for the one-open baseline (median)
    poll: float = 0.05


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class _WatchCount:
    """A thread polling the servers' open-watch gauge until it reaches `expected`."""

    def __init__(self, servers: list[Server], expected: int, poll: float, until: float) -> None:
        self.reached_at: float | None = None
        self.last: float | None = None
        self.unavailable = False
        self._servers = servers
        self._expected = expected
        self._poll = poll
        self._until = until
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="herd-watch-count", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._until:
            counts = [gauge(s.metrics_port, WATCHES) for s in self._servers]
            now = time.monotonic()
            if any(c is None for c in counts):
                if all(s.alive for s in self._servers):
                    self.unavailable = True  # no such gauge (an older hub): not measured
                    return
            else:
                self.last = sum(c or 0.0 for c in counts)
                if self.last >= self._expected:
                    self.reached_at = now
                    return
            self._stop.wait(self._poll)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def herd_round(
    name: str, servers: list[Server], token: str, spec: HerdSpec, fleet: Fleet, log: Log
) -> dict[str, Any]:
    """One herd against `servers` (a ceiling or the hub's replicas) with `fleet`'s clients;
    never raises for a server that stopped answering (a `WorkerLost` marks the fleet
    `fleet_broken`: the caller replaces it)."""
    out: dict[str, Any] = {"server": name, "replicas": len(servers), "clients": spec.clients,
                           "open_seconds": spec.open_seconds}  # fmt: skip
    addresses = [s.address for s in servers]
    workers = fleet.workers
    try:
        single = fleet.call(
            "open_once",
            [{"target": addresses[0], "token": token, "ttl": spec.ttl, "times": spec.singles}],
            60.0,
            conns=workers[:1],
        )[0]
        out["one_open_ms"] = statistics.median(single["open_ms"]) if single.get("open_ms") else None
        out["one_open_errors"] = single.get("errors", {})
        counts = _split(spec.clients, len(workers))
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        each = [
            {"target": addresses, "token": token, "count": c, "model": MODEL, "ttl": spec.ttl,
             "connect_seconds": spec.connect_seconds, "first": f,
             "open_seconds": spec.open_seconds}
            for c, f in zip(counts, firsts, strict=True)
        ]  # fmt: skip
        fleet.call("prepare", each, 120.0)
        before = [s.stats() for s in servers]
        start_at = time.monotonic() + BARRIER_SECONDS
        counter = _WatchCount(servers, spec.clients, spec.poll, start_at + spec.connect_seconds)
        try:
            connected = fleet.call(
                "go", [{"start_at": start_at, "concurrency": None}] * len(workers),
                BARRIER_SECONDS + spec.connect_seconds + 60,
            )  # fmt: skip
            # the gauge may trail the last open by a poll or two
            deadline = time.monotonic() + 10.0
            while counter.reached_at is None and not counter.unavailable:
                if time.monotonic() > deadline:
                    break
                time.sleep(spec.poll)
        finally:
            counter.stop()
        opened = [t for r in connected for t in r.get("opened_at", [])]
        errors: Counter[str] = Counter()
        details: dict[str, str] = {}
        for r in connected:
            errors.update(r.get("errors", {}))
            details = {**r.get("error_details", {}), **details}
            if "failed" in r:
                errors[f"worker: {r['failed']}"] += 1
        sessions = sum(int(r.get("sessions", 0)) for r in connected)
        out.update(
            sessions=sessions,
            open_errors=dict(errors),
            error_details=details,
            # of the opens that succeeded: the figures use it only when every client opened
            last_open_s=(max(opened) - start_at) if opened else None,
            all_opened_s=(max(opened) - start_at) if sessions >= spec.clients else None,
            open_p50_s=(statistics.median(opened) - start_at) if opened else None,
            watches_counted=counter.last,
            watches_unavailable=counter.unavailable,
            all_watching_s=None if counter.reached_at is None else counter.reached_at - start_at,
        )
        log(f"  {name} x{len(servers)}: {sessions}/{spec.clients} sessions, the last opened at "
            f"{_s(out['last_open_s'])}, all watching {_s(out['all_watching_s'])}"
            + (f", errors {dict(errors)}: {details}" if errors else ""))  # fmt: skip
        time.sleep(spec.hold)
        reports = fleet.call("report", [{}] * len(workers), 60.0)
        after = [s.stats() for s in servers]
        renewed = [t for r in reports for t in r.get("renewed_at", [])]
        stream_errors: Counter[str] = Counter()
        for r in reports:
            stream_errors.update(r.get("errors", {}))
            out["error_details"] = {**r.get("error_details", {}), **out["error_details"]}
        stream_errors.update({k: v for k, v in errors.items() if k.startswith("worker:")})
        # the last first renewal of the sessions that were renewed at all: one never renewed
        # expired, which the errors and `expired` count (the time is still the herd's)
        all_renewed_s = (max(renewed) - start_at) if renewed else None
        parts = [out["all_opened_s"], all_renewed_s]
        if not counter.unavailable:
            parts.append(out["all_watching_s"])
        complete = sessions >= spec.clients and all(p is not None for p in parts)
        out.update(
            all_renewed_s=all_renewed_s,
            renewed_sessions=len(renewed),
            all_open_and_watching_s=max(p for p in parts if p is not None) if complete else None,
            errors=dict(stream_errors),  # open errors included (the clients count both)
            expired=sum(int(r.get("expired", 0)) for r in reports),
            max_renewal_gap_s=max((float(r.get("max_gap_s", 0)) for r in reports), default=0.0),
            keepalive_late=sum(int(r.get("keepalive_late", 0)) for r in reports),
            rss_mb=sum(s.rss_mb for s in after),
            threads=sum(s.threads for s in after),
            cpu_s=sum(a.cpu_s - b.cpu_s for a, b in zip(after, before, strict=True)),
        )
        fleet.call("close", [{}] * len(workers), 60.0)
    except WorkerLost as exc:
        out["failed"] = str(exc)
        out["fleet_broken"] = True
    out["servers_alive"] = all(s.alive for s in servers)
    return out


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def ceiling_herd(replicas: int, spec: HerdSpec, fleet: Fleet, log: Log) -> dict[str, Any]:
    """The herd on `replicas` fresh ceiling processes."""
    servers = [ceiling_server(metrics=True) for _ in range(replicas)]
    try:
        for s in servers:
            s.start()
    except ServerStartError as exc:
        for s in servers:
            s.stop()
        return {"server": "ceiling", "replicas": replicas, "failed": str(exc)}
    try:
        return herd_round("ceiling", servers, "ceiling.none", spec, fleet, log)
    finally:
        for s in servers:
            s.stop()


def summary(r: dict[str, Any]) -> str:
    """One human line per herd."""
    if "failed" in r and "sessions" not in r:
        return f"  {r['server']} x{r['replicas']}: FAILED {r['failed']}"
    return (
        f"  {r['server']} x{r['replicas']}: {r.get('sessions')}/{r['clients']} sessions; open "
        f"and watching {_s(r.get('all_open_and_watching_s'))} (opened "
        f"{_s(r.get('all_opened_s'))}, renewed {_s(r.get('all_renewed_s'))}, watching "
        f"{_s(r.get('all_watching_s'))}); one open {r.get('one_open_ms') or 0:.1f} ms; "
        f"expired {r.get('expired')}, longest renewal gap {r.get('max_renewal_gap_s') or 0:.2f}s,"
        f" late {r.get('keepalive_late')}; errors {r.get('errors')}"
        + (f", FAILED {r['failed']}" if "failed" in r else "")
    )
