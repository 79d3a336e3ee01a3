"""One round of the clients benchmark: N clients on one server, M versions fanned out to them.

The same round runs against the hub (versions published with the SDK) and against the
ceiling (`bench.scale.ceiling`, one raw Publish per version), with the same client processes
and the same client code. Per version, "all-visible" is from the start of its publish to the
moment its last watcher saw it; a version some watcher never saw counts as missing. A prober
calls `Latest` during the publishes. The server's RSS, threads and CPU come from /proc.
Every step has a deadline: a server that stops answering ends the round with what it saw.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from bench.scale.clients import Fleet, WorkerLost
from bench.scale.procs import ProcStats, Server
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

MODEL = "scale"
Publisher = Callable[[int], None]
"""Publishes version v (raises on failure) and returns once the server answered."""


@dataclass(frozen=True)
class RoundSpec:
    """How a round runs: clients, versions, the gap between publishes, and its deadlines."""

    clients: int
    versions: int = 20
    gap: float = 0.2
    workers: int = 4
    ttl: int = 10
    connect_seconds: float = 90.0
    seen_seconds: float = 15.0  # after the last publish, how long the stragglers may take
    max_failed_publishes: int = 3


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, round(q * (len(ranked) - 1)))]


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _merge_seen(reports: list[dict[str, Any]]) -> dict[int, list[float]]:
    seen: dict[int, list[float]] = {}
    for report in reports:
        for version, times in report.get("seen", {}).items():
            seen.setdefault(int(version), []).extend(times)
    return seen


def _wait_seen(
    fleet: Fleet, versions: list[int], expected: int, seconds: float, poll: float = 0.5
) -> list[dict[str, Any]]:
    """Poll the workers until every one of `versions` was seen `expected` times (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        reports = fleet.call("report", [{}] * len(fleet.workers), 30.0)
        seen = _merge_seen(reports)
        if all(len(seen.get(v, [])) >= expected for v in versions):
            return reports
        if time.monotonic() >= deadline:
            return reports
        time.sleep(poll)


def ceiling_publisher(address: str) -> tuple[Publisher, Callable[[], None]]:
    """One raw Publish per version to the ceiling server (it fans the event out)."""
    channel = grpc.insecure_channel(address)
    stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]

    def publish(version: int) -> None:
        stub.Publish(pb.PublishRequest(model=MODEL, version=version), timeout=10.0)

    return publish, channel.close


def run_round(
    server: Server,
    publish: Publisher,
    token: str,
    spec: RoundSpec,
    first_version: int,
    log: Callable[[str], None],
    fleet: Fleet | None = None,
) -> dict[str, Any]:
    """Connect `spec.clients` clients, publish a warm-up version and `spec.versions` more,
    and return what was measured (see the module docstring); never raises for a server
    that stopped answering, it reports that instead.

    With `fleet`, its client processes are used and left running with their clients closed
    (so the ceiling and the hub at one N are measured by the same processes); a fleet that
    stopped answering is reported as `fleet_broken` and must be replaced. Without one, the
    round starts and ends its own.
    """
    out: dict[str, Any] = {"clients": spec.clients, "server": server.name}
    own = fleet is None
    used = Fleet(spec.workers) if fleet is None else fleet
    try:
        _round(used, server, publish, token, spec, first_version, log, out)
        if not own:
            used.call("close", [{}] * len(used.workers), 60.0)
    except WorkerLost as exc:
        out["failed"] = str(exc)
        out["fleet_broken"] = True
    finally:
        if own:
            closer = threading.Thread(target=used.close, daemon=True)
            closer.start()
            closer.join(timeout=30)
    out["server_alive"] = server.alive
    return out


def _round(
    fleet: Fleet,
    server: Server,
    publish: Publisher,
    token: str,
    spec: RoundSpec,
    first: int,
    log: Callable[[str], None],
    out: dict[str, Any],
) -> None:
    counts = _split(spec.clients, len(fleet.workers))
    each = [
        {
            "target": server.address,
            "token": token,
            "count": c,
            "model": MODEL,
            "ttl": spec.ttl,
            "connect_seconds": spec.connect_seconds,
        }
        for c in counts
    ]
    before = server.stats()
    connected = fleet.call("connect", each, spec.connect_seconds + 60)
    sessions = sum(int(r.get("sessions", 0)) for r in connected)
    errors: Counter[str] = Counter()
    for r in connected:
        errors.update(r.get("errors", {}))
    out.update(
        sessions=sessions,
        connect_s=max(float(r.get("connect_s", 0)) for r in connected),
        connect_errors=dict(errors),
    )
    log(
        f"  {server.name} N={spec.clients}: {sessions} sessions in {out['connect_s']:.1f}s"
        + (f", errors {dict(errors)}" if errors else "")
    )
    time.sleep(1.0)
    failures: Counter[str] = Counter()
    warm = first
    try:
        publish(warm)
    except Exception as exc:  # any failure is a figure of this round
        failures[type(exc).__name__] += 1
    _wait_seen(fleet, [warm], sessions, spec.seen_seconds)
    idle0, t_idle = server.stats(), time.monotonic()
    time.sleep(2.0)
    idle1 = server.stats()
    idle_cpu_per_s = (idle1.cpu_s - idle0.cpu_s) / (time.monotonic() - t_idle)
    probe_seconds = spec.versions * spec.gap + 2.0
    fleet.send(
        [fleet.prober],
        "probe",
        [
            {
                "target": server.address,
                "token": token,
                "model": MODEL,
                "seconds": probe_seconds,
                "gap": 0.02,
            }
        ],
    )
    started: dict[int, float] = {}
    publish_ms: list[float] = []
    consecutive = 0
    cpu0, t_pub = server.stats(), time.monotonic()
    for v in range(first + 1, first + 1 + spec.versions):
        t0 = time.monotonic()
        try:
            publish(v)
            started[v] = t0
            publish_ms.append((time.monotonic() - t0) * 1000)
            consecutive = 0
        except Exception as exc:
            failures[type(exc).__name__] += 1
            consecutive += 1
            if consecutive >= spec.max_failed_publishes:
                log(
                    f"  {server.name} N={spec.clients}: {consecutive} publishes failed in a "
                    f"row ({exc}); ending the round"
                )
                break
        time.sleep(max(0.0, spec.gap - (time.monotonic() - t0)))
    publish_window = time.monotonic() - t_pub
    cpu1 = server.stats()
    reports = _wait_seen(fleet, list(started), sessions, spec.seen_seconds)
    probe = Fleet.gather([fleet.prober], probe_seconds + 30)[0]
    after = server.stats()
    seen = _merge_seen(reports)
    all_visible: list[float] = []
    deliveries: list[float] = []
    missing = 0
    for v, t0 in started.items():
        times = seen.get(v, [])
        deliveries.extend((t - t0) * 1000 for t in times)
        if sessions and len(times) >= sessions:  # every open watch (failed opens are errors)
            all_visible.append((max(times) - t0) * 1000)
        else:
            missing += 1
    stream_errors: Counter[str] = Counter()
    for r in reports:
        stream_errors.update(r.get("errors", {}))
    keepalive_ms = [x for r in reports for x in r.get("keepalive_ms", [])]
    latest = list(probe.get("latest_ms", []))
    cpu_per_version = (cpu1.cpu_s - cpu0.cpu_s) / len(started) if started else None
    out.update(
        versions_asked=spec.versions,
        versions_published=len(started),
        publish_failures=dict(failures),
        versions_missing_somewhere=missing,
        all_visible_p50_ms=percentile(all_visible, 0.5),
        all_visible_p99_ms=percentile(all_visible, 0.99),
        all_visible_max_ms=max(all_visible) if all_visible else None,
        delivery_p50_ms=percentile(deliveries, 0.5),
        delivery_p99_ms=percentile(deliveries, 0.99),
        deliveries=len(deliveries),
        deliveries_expected=sessions * len(started),
        publish_p50_ms=percentile(publish_ms, 0.5),
        latest_p50_ms=percentile(latest, 0.5),
        latest_p99_ms=percentile(latest, 0.99),
        latest_calls=len(latest),
        latest_errors=probe.get("errors", {}),
        keepalive_p99_ms=percentile(keepalive_ms, 0.99),
        keepalives=sum(int(r.get("keepalives", 0)) for r in reports),
        keepalive_late=sum(int(r.get("keepalive_late", 0)) for r in reports),
        keepalive_max_ms=max(keepalive_ms) if keepalive_ms else None,
        stream_errors=dict(stream_errors),
        rss_mb=after.rss_mb,
        threads=after.threads,
        rss_mb_before=before.rss_mb,
        threads_before=before.threads,
        cpu_s_total=after.cpu_s - before.cpu_s,
        cpu_s_per_version=cpu_per_version,
        idle_cpu_s_per_s=idle_cpu_per_s,
        cpu_s_per_version_over_idle=None
        if cpu_per_version is None
        else cpu_per_version - idle_cpu_per_s * publish_window / len(started),
    )


def with_deadline(fn: Callable[[], None], seconds: float) -> bool:
    """Run `fn` in a daemon thread for at most `seconds`; False if it did not finish."""
    worker = threading.Thread(target=fn, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    return not worker.is_alive()


def stats_line(stats: ProcStats) -> str:
    return f"rss {stats.rss_mb:.0f} MB, {stats.threads} threads, {stats.cpu_s:.1f} cpu-s"


def quietly(fn: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):
        fn()
