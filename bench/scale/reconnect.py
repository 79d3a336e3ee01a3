"""Reconnect: SIGKILL a hub replica under N SDK clients; every session must survive it.

N clients (2,000), each a real SDK client: `ros.connect([A, B], ...)`, its own channel to
both replicas (which one it uses first is the SDK's choice: the order given, or spread; the
part reports how many keepalive streams the killed replica carried), its session renewed
every ttl/3 by the SDK's own thread, and something held: it published its shard of one
model-parallel version (`publish(..., shard=(i, N))`), so it has a holder record under its
session's lease. The clients live in `Fleet` worker processes (8 by default: the SDK is
synchronous, a client is three or four threads, and fewer clients per process keep the
GIL from delaying renewals); a thread in each samples every client's confirmed renewals
(`session.renewals`) every 0.1 s. The setup is paced (8 clients connecting and publishing
at a time in all: the herd and shards parts measure bursts); a session lost before the kill
is counted apart, as `lost_before_kill`.

Then replica A is killed with SIGKILL. After `observe` seconds (ttl + 5 by default) each
client is checked: the same session (lease) as before the kill, never lost, no recovery (a
recovery means a new lease: the records were re-registered, not kept), and a renewal
confirmed after the kill within its TTL of its last one before it (to the 0.1 s of the
sampling). The holder records are read back through the SDK (`Hub.holders`, from an
observer client on B): every client's record must be there, under its original session.
Errors: a connect or publish that raised, a lost session, a recovery or a failed recovery
attempt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from bench.scale.clients import Fleet, WorkerLost, serve_pipe
from bench.scale.procs import gauge
from bench.scale.world import EtcdLimits, World

Log = Callable[[str], None]
MODEL = "reconnect"
SESSIONS = "tensorhub_hub_sessions_active"  # keepalive streams attached to a replica
SAMPLE_SECONDS = 0.1
CLOSE_THREADS = 16  # clients closed at once per worker process


class _Client:
    """One SDK client of a worker, what it held at connect, and its renewals as sampled."""

    def __init__(self, index: int, hub: Any, publication: Any) -> None:
        self.index = index
        self.hub = hub
        self.publication = publication
        self.session = hub.session.lease  # the original lease (a recovery opens another)
        self.session_id = int(hub.session.id)
        self.holder = str(hub.holder_name)
        self.renewals = int(self.session.renewals)
        self.renewed: list[float] = [time.monotonic()]  # sample times of new renewals
        self.lost_at = 0.0  # when its session was first seen lost (0: never)


class SdkClients:
    """A worker's SDK clients: `connect` (connect and publish a shard each), `report`
    (after the kill), `close`."""

    def __init__(self) -> None:
        self.clients: list[_Client] = []
        self.ttl = 10
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def connect(
        self,
        addresses: list[str],
        tenant: str,
        token: str,
        ttl: int,
        indices: list[int],
        count: int,
        model: str,
        timeout: float,
        concurrency: int,
    ) -> dict[str, Any]:
        """Connect and publish a shard each, `concurrency` at a time: the setup is paced (the
        herd and shards parts measure bursts), so what follows is about the kill alone."""
        import torch

        import ros

        self.ttl = ttl
        errors: Counter[str] = Counter()
        first = ""
        lock = threading.Lock()

        def one(i: int) -> None:
            nonlocal first
            hub = None
            try:
                hub = ros.connect(
                    addresses, tenant=tenant, token=token, session_ttl=ttl, timeout=timeout
                )
                pub = hub.publish(
                    model, 1, {"w": torch.full((16,), float(i))}, shard=(i, count),
                    timeout=timeout,
                )  # fmt: skip
                with lock:
                    self.clients.append(_Client(i, hub, pub))
            except Exception as exc:  # counted: every client must connect and publish
                with lock:
                    errors[f"{'publish' if hub else 'connect'}: {type(exc).__name__}"] += 1
                    first = first or f"{type(exc).__name__}: {exc}"[:300]
                if hub is not None:
                    hub.close()

        t0 = time.monotonic()
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            list(pool.map(one, indices))
        self.clients.sort(key=lambda c: c.index)
        self._sampler = threading.Thread(target=self._sample, name="renewals", daemon=True)
        self._sampler.start()
        return {
            "clients": len(self.clients),
            "visible": sum(1 for c in self.clients if c.publication.visible),
            "errors": dict(errors),
            "first_error": first,
            "seconds": time.monotonic() - t0,
        }

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            now = time.monotonic()
            for c in self.clients:
                n = int(c.session.renewals)
                if n != c.renewals:
                    c.renewals = n
                    c.renewed.append(now)
                if not c.lost_at and c.session.lost.is_set():
                    c.lost_at = now

    def report(self, kill_at: float) -> dict[str, Any]:
        """Each client after the kill: same lease, renewed within its TTL, no loss."""
        same = lost = lost_before = recovered = recovery_failures = within = 0
        gaps: list[float] = []
        back: list[float] = []
        for c in self.clients:
            current = c.hub.session.current
            lost += c.session.lost.is_set()
            lost_before += 0 < c.lost_at <= kill_at
            recovered += int(c.hub.session.recoveries)
            recovery_failures += int(c.hub.session.failures)
            same += bool(
                current is c.session and int(current.id) == c.session_id
                and not c.session.lost.is_set()
            )  # fmt: skip
            before = [t for t in c.renewed if t <= kill_at]
            after = [t for t in c.renewed if t > kill_at]
            if after:
                gap = min(after) - max(before, default=kill_at)
                gaps.append(gap)
                back.append(min(after) - kill_at)
                within += gap < self.ttl
        return {
            "clients": len(self.clients),
            "same_session": same,
            "lost": lost,
            "lost_before_kill": lost_before,
            "recoveries": recovered,
            "recovery_failures": recovery_failures,
            "renewed_within_ttl": within,
            "renewed_after_kill": len(back),
            "max_gap_s": max(gaps, default=None),
            "all_back_s": max(back, default=0.0) if len(back) == len(self.clients) else None,
            "holders": {c.holder: c.session_id for c in self.clients},
        }

    def close_all(self) -> None:
        """Close every client (its session revoked, its records gone) and stop sampling."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        with ThreadPoolExecutor(CLOSE_THREADS) as pool:
            list(pool.map(lambda c: c.hub.close(), self.clients))
        self.clients = []

    async def handle(self, command: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The SDK blocks: each command runs in a thread, off the pipe's event loop."""
        if command == "connect":
            return await asyncio.to_thread(lambda: self.connect(**kwargs))
        if command == "report":
            return await asyncio.to_thread(self.report, float(kwargs["kill_at"]))
        if command == "close":
            await self.close()
        return {}

    async def close(self) -> None:
        await asyncio.to_thread(self.close_all)


def sdk_worker(conn: Connection) -> None:
    """Entry point of a worker process of SDK clients (`Fleet(..., target=sdk_worker)`).
    The SDK's INFO lines (a stream reopened, per client) are left out: 2,000 clients would
    bury the run's own lines; a lost session is a WARNING and still shows."""
    logging.getLogger("ros").setLevel(logging.WARNING)
    asyncio.run(serve_pipe(conn, SdkClients()))


def run(
    clients: int = 2000,
    *,
    workers: int = 8,
    ttl: int = 10,
    observe: float | None = None,
    concurrency: int = 8,
    connect_seconds: float = 600.0,
    timeout: float = 120.0,
    tree: str | None = None,
    limits: EtcdLimits | None = None,
    log: Log = lambda _: None,
) -> dict[str, Any]:
    """The reconnect part on its own etcd and two replicas; see the module docstring."""
    import ros

    observe = ttl + 5.0 if observe is None else observe
    limits = limits or EtcdLimits()
    out: dict[str, Any] = {"clients": clients, "ttl": ttl, "observe_s": observe,
                           "limits": {"max_txn_ops": limits.max_txn_ops,
                                      "max_request_bytes": limits.max_request_bytes}}  # fmt: skip
    with World(max_sessions=2 * clients + 64, replicas=2, tree=tree, limits=limits,
               metrics=True) as world:  # fmt: skip
        a, b = world.hubs
        fleet = Fleet(workers, target=sdk_worker, prober=False)
        observer = None
        try:
            parts = [list(range(clients))[w::workers] for w in range(workers)]
            t0 = time.monotonic()
            connected = fleet.call(
                "connect",
                [{"addresses": world.addresses, "tenant": world.tenant, "token": world.token,
                  "ttl": ttl, "indices": part, "count": clients, "model": MODEL,
                  "timeout": timeout, "concurrency": max(1, concurrency // workers)}
                 for part in parts],
                connect_seconds,
            )  # fmt: skip
            errors: Counter[str] = Counter()
            for r in connected:
                errors.update(r.get("errors", {}))
                if "failed" in r:
                    errors[f"worker: {r['failed']}"] += 1
            out.update(
                connected=sum(int(r.get("clients", 0)) for r in connected),
                connect_s=time.monotonic() - t0,
                connect_errors=dict(errors),
                first_error=next(
                    (str(r["first_error"]) for r in connected if r.get("first_error")), ""
                ),
                visible_replies=sum(int(r.get("visible", 0)) for r in connected),
            )
            log(f"  {out['connected']}/{clients} SDK clients connected and published their "
                f"shard in {out['connect_s']:.1f}s, errors {dict(errors)}")  # fmt: skip
            observer = ros.connect(b.address, tenant=world.tenant, token=world.token,
                                   timeout=60.0)  # fmt: skip
            out["latest_before_kill"] = observer.latest(MODEL)
            out["streams_on_killed"] = gauge(a.metrics_port, SESSIONS)
            out["streams_on_other"] = gauge(b.metrics_port, SESSIONS)
            time.sleep(ttl / 3.0 + 1.0)  # every client renews at least once before the kill
            kill_at = time.monotonic()
            a.kill()
            log(f"  killed replica A (SIGKILL) under {out['streams_on_killed']} keepalive "
                f"streams; watching for {observe:.0f}s")  # fmt: skip
            time.sleep(observe)
            reports = fleet.call("report", [{"kill_at": kill_at}] * workers, 120.0)
            out["streams_on_other_after"] = gauge(b.metrics_port, SESSIONS)
            holders = {h.holder: h.session for h in observer.holders(MODEL, 1)}
            mine: dict[str, int] = {}
            for r in reports:
                mine.update(r.get("holders", {}))
            gaps = [float(r["max_gap_s"]) for r in reports if r.get("max_gap_s") is not None]
            backs = [r.get("all_back_s") for r in reports]
            all_back = None if not backs or None in backs else max(float(x or 0) for x in backs)
            out.update(
                same_session=sum(int(r.get("same_session", 0)) for r in reports),
                lost=sum(int(r.get("lost", 0)) for r in reports),
                lost_before_kill=sum(int(r.get("lost_before_kill", 0)) for r in reports),
                recoveries=sum(int(r.get("recoveries", 0)) for r in reports),
                recovery_failures=sum(int(r.get("recovery_failures", 0)) for r in reports),
                renewed_within_ttl=sum(int(r.get("renewed_within_ttl", 0)) for r in reports),
                renewed_after_kill=sum(int(r.get("renewed_after_kill", 0)) for r in reports),
                max_gap_s=max(gaps, default=None),
                all_back_s=all_back,
                holder_records=len(holders),
                holders_intact=sum(1 for name, sid in mine.items() if holders.get(name) == sid),
            )
            out["errors"] = (
                sum(errors.values()) + out["lost"] + out["recoveries"] + out["recovery_failures"]
            )
        except WorkerLost as exc:
            out["failed"] = str(exc)
        finally:
            if observer is not None:
                observer.close()
            fleet.close()
    return out


def summary(r: dict[str, Any]) -> str:
    return (
        f"  reconnect N={r['clients']}: connected {r.get('connected')}, same lease "
        f"{r.get('same_session')}, holder records intact {r.get('holders_intact')}, renewed "
        f"within the TTL {r.get('renewed_within_ttl')}, lost {r.get('lost')} (before the kill "
        f"{r.get('lost_before_kill')}), recoveries "
        f"{r.get('recoveries')}, longest gap {r.get('max_gap_s')}, errors {r.get('errors')}"
        + (f", FAILED {r['failed']}" if "failed" in r else "")
    )
