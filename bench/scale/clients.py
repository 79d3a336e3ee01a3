"""Thousands of hub clients from a few processes: asyncio clients on raw grpc.aio stubs.

Each client is what a rollout worker keeps open: its own channel (its own TCP connection),
an OpenSession, a KeepAlive stream renewing every ttl/3, and a versions-only Watch that
records when it saw each version (CLOCK_MONOTONIC, shared by every process on the machine).
One asyncio loop per worker process holds hundreds of them, which is how one 2-core machine
holds 2,000. A worker can instead be a prober that calls `Latest` in a loop.

The parent drives workers through a pipe (`Fleet`): every command and every wait on a reply
has a deadline, so a server that stops answering ends a round, never the run. `serve_pipe`
is that loop for any `Handler`, so other parts (shards' ranks, the SDK clients of the
reconnect part) run their own workers on the same `Fleet`.

The herd part (`bench.scale.herd`) uses `prepare` and `go`: every worker makes its clients'
channels first, then all of them open at one CLOCK_MONOTONIC instant, with no gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

import grpc

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import TensorHubError

OPEN_CONCURRENCY = 16  # OpenSession calls in flight per worker while a round connects
CALL_SECONDS = 10.0
PROBE_TIMEOUT = 2.0
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # a TCP connection per client


class WorkerLost(TensorHubError):
    """A client worker process did not answer a command before its deadline."""

    code = "UNAVAILABLE"


def _code(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "TIMEOUT"
    return type(exc).__name__


@dataclass
class _Client:
    """One client's session, streams and what it saw."""

    index: int
    channel: grpc.aio.Channel
    session: int = 0
    seen: list[tuple[int, float]] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    keepalives: int = 0
    opened_at: float = 0.0  # OpenSession answered (CLOCK_MONOTONIC)
    renewed_at: float = 0.0  # its first renewal answered
    last_renewal: float = 0.0  # the lease's last renewal (OpenSession counts as one)
    max_gap: float = 0.0  # the longest time between two renewals of its lease
    expired: bool = False  # not renewed before its TTL ran out, or the server said so


class Clients:
    """`count` clients of one worker, opened with bounded concurrency (or, in a herd, all at
    once). `target` is one address or several replicas: the worker's client i talks to
    `targets[(first + i) % len(targets)]`, so clients alternate replicas across workers."""

    def __init__(
        self,
        target: str | Sequence[str],
        token: str,
        count: int,
        model: str,
        ttl: int,
        connect_seconds: float,
        first: int = 0,
        open_seconds: float = CALL_SECONDS,
    ) -> None:
        self.open_seconds = open_seconds  # one OpenSession's deadline
        self.targets = [target] if isinstance(target, str) else list(target)
        self.target = self.targets[0]
        self.first = first
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.count = count
        self.model = model
        self.ttl = ttl
        self.connect_seconds = connect_seconds
        self.clients: list[_Client] = []
        self.errors: Counter[str] = Counter()
        self.keepalive_ms: list[float] = []
        self.keepalive_late = 0
        self.connecting = False
        self._prepared = False
        self.error_details: dict[str, str] = {}  # the first of each kind, with its details

    def _error(self, kind: str, exc: BaseException, after: float | None = None) -> None:
        self.errors[kind] += 1
        if kind not in self.error_details:
            details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            when = "" if after is None else f" (after {after:.2f}s)"
            self.error_details[kind] = f"{details}{when}"[:200]

    def _client(self, i: int) -> _Client:
        target = self.targets[(self.first + i) % len(self.targets)]
        client = _Client(i, grpc.aio.insecure_channel(target, CHANNEL_OPTIONS))
        self.clients.append(client)
        return client

    def prepare(self) -> dict[str, Any]:
        """Make every client's channel now (no call yet: it connects on its first call), so
        a herd measures the opens, not this process building its objects."""
        for i in range(self.count):
            self._client(i)
        self._prepared = True
        return {"prepared": len(self.clients)}

    async def connect(
        self, start_at: float | None = None, concurrency: int | None = OPEN_CONCURRENCY
    ) -> dict[str, Any]:
        """Open every client (bounded by `connect_seconds`); how many got a session.

        `start_at` (CLOCK_MONOTONIC): wait until then, the barrier every worker of a herd
        shares. `concurrency` None: every OpenSession at once, no gate."""
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        start = time.monotonic() if start_at is None else start_at
        gate: asyncio.Semaphore | contextlib.nullcontext[None] = (
            contextlib.nullcontext() if concurrency is None else asyncio.Semaphore(concurrency)
        )
        deadline = start + self.connect_seconds
        clients = self.clients if self._prepared else [None] * self.count

        async def one(i: int, made: _Client | None) -> None:
            async with gate:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.errors["open: connect deadline"] += 1
                    return
                client = made or self._client(i)
                stub = hub_pb2_grpc.TensorHubStub(client.channel)  # type: ignore[no-untyped-call]
                try:
                    opened = await stub.OpenSession(
                        pb.OpenSessionRequest(ttl_seconds=self.ttl),
                        metadata=self.metadata,
                        timeout=min(self.open_seconds, left),
                    )
                except (TimeoutError, grpc.aio.AioRpcError) as exc:
                    self._error(f"open: {_code(exc)}", exc, time.monotonic() - start)
                    return
                client.opened_at = client.last_renewal = time.monotonic()
                client.session = int(opened.session_id)
                client.tasks = [
                    asyncio.create_task(self._keepalive(client, stub)),
                    asyncio.create_task(self._watch(client, stub, int(opened.revision) + 1)),
                ]

        self.connecting = True
        await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))
        self.connecting = False
        return {
            "sessions": sum(1 for c in self.clients if c.session),
            "connect_s": time.monotonic() - start,
            "opened_at": [c.opened_at for c in self.clients if c.session],
            "errors": dict(self.errors),
            "error_details": dict(self.error_details),
        }

    async def _keepalive(self, client: _Client, stub: hub_pb2_grpc.TensorHubStub) -> None:
        """Renew every ttl/3. A renewal answered later than that is counted as late; one not
        answered before the lease would expire (ttl after the last renewal) loses the
        session: an error, and this client stops renewing. So does an answer with a TTL of 0
        (the server says the lease is gone)."""
        period = self.ttl / 3.0
        call = stub.KeepAlive(metadata=self.metadata)
        renewed = time.monotonic()
        try:
            while True:
                t0 = time.monotonic()
                left = max(0.01, renewed + self.ttl - t0)
                await asyncio.wait_for(
                    call.write(pb.KeepAliveRequest(session_id=client.session)), left
                )
                reply = await asyncio.wait_for(call.read(), max(0.01, renewed + self.ttl - t0))
                if not isinstance(reply, pb.KeepAliveResponse):  # the stream ended
                    self.errors["keepalive: ended"] += 1
                    return
                renewed = time.monotonic()
                if reply.ttl_seconds <= 0:
                    client.expired = True
                    self.errors["keepalive: session expired (the server says)"] += 1
                    call.cancel()
                    return
                client.max_gap = max(client.max_gap, renewed - client.last_renewal)
                client.last_renewal = renewed
                client.renewed_at = client.renewed_at or renewed
                took = renewed - t0
                self.keepalive_ms.append(took * 1000)
                self.keepalive_late += took > period
                client.keepalives += 1
                await asyncio.sleep(max(0.0, period - took))
        except asyncio.CancelledError:
            call.cancel()
            raise
        except TimeoutError:
            client.expired = True
            when = " while the others connected" if self.connecting else ""
            self.errors[f"keepalive: session expired unrenewed{when}"] += 1
            call.cancel()
        except grpc.aio.AioRpcError as exc:
            self._error(f"keepalive: {_code(exc)}", exc)
            call.cancel()

    async def _watch(self, client: _Client, stub: hub_pb2_grpc.TensorHubStub, start: int) -> None:
        request = pb.WatchRequest(model=self.model, start_revision=start, versions_only=True)
        call = stub.Watch(request, metadata=self.metadata)
        try:
            async for event in call:
                if event.kind == pb.WatchEvent.VERSION_PUBLISHED:
                    client.seen.append((int(event.version), time.monotonic()))
            self.errors["watch: ended"] += 1
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            self._error(f"watch: {_code(exc)}", exc)

    def report(self) -> dict[str, Any]:
        """What every client saw: version -> the times it was seen (one per client)."""
        seen: dict[int, list[float]] = {}
        for client in self.clients:
            for version, t in client.seen:
                seen.setdefault(version, []).append(t)
        return {
            "seen": seen,
            "sessions": sum(1 for c in self.clients if c.session),
            "errors": dict(self.errors),
            "keepalive_ms": self.keepalive_ms[-2000:],
            "keepalives": sum(c.keepalives for c in self.clients),
            "keepalive_late": self.keepalive_late,
            "error_details": dict(self.error_details),
            "renewed_at": [c.renewed_at for c in self.clients if c.renewed_at],
            "max_gap_s": max((c.max_gap for c in self.clients), default=0.0),
            "expired": sum(1 for c in self.clients if c.expired),
        }

    async def close(self) -> None:
        for client in self.clients:
            for task in client.tasks:
                task.cancel()
        for client in self.clients:
            for task in client.tasks:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, 2.0)
        await asyncio.gather(*(c.channel.close(0) for c in self.clients), return_exceptions=True)


async def probe(
    target: str, token: str, model: str, seconds: float, gap: float, max_calls: int = 10_000
) -> dict[str, Any]:
    """`Latest` in a loop for `seconds` (at most `max_calls`): each call's latency (ms)."""
    metadata = (("authorization", f"Bearer {token}"),)
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(target, CHANNEL_OPTIONS) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        end = time.monotonic() + seconds
        for _ in range(max_calls):
            if time.monotonic() >= end:
                break
            t0 = time.monotonic()
            try:
                await stub.Latest(
                    pb.LatestRequest(model=model), metadata=metadata, timeout=PROBE_TIMEOUT
                )
                latencies.append((time.monotonic() - t0) * 1000)
            except grpc.aio.AioRpcError as exc:
                errors[_code(exc)] += 1
            await asyncio.sleep(gap)
    return {"latest_ms": latencies, "errors": dict(errors)}


async def open_once(target: str, token: str, ttl: int, times: int) -> dict[str, Any]:
    """`times` opens, one at a time, each on a fresh channel (its connection included), as a
    herd's client opens: the baseline of one open alone. Latencies in ms."""
    metadata = (("authorization", f"Bearer {token}"),)
    out: list[float] = []
    errors: Counter[str] = Counter()
    for _ in range(times):
        async with grpc.aio.insecure_channel(target, CHANNEL_OPTIONS) as channel:
            stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
            t0 = time.monotonic()
            try:
                await stub.OpenSession(
                    pb.OpenSessionRequest(ttl_seconds=ttl), metadata=metadata, timeout=CALL_SECONDS
                )
                out.append((time.monotonic() - t0) * 1000)
            except grpc.aio.AioRpcError as exc:
                errors[_code(exc)] += 1
    return {"open_ms": out, "errors": dict(errors)}


class Handler(Protocol):
    """What a worker process does with each command of its `Fleet` (`serve_pipe`)."""

    async def handle(self, command: str, kwargs: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self) -> None: ...


async def serve_pipe(conn: Connection, handler: Handler) -> None:
    """Answer the parent's commands, one at a time, until `exit` (which closes `handler`).
    A command that raises is answered with `failed`: the parent decides."""
    loop = asyncio.get_running_loop()
    while True:
        command, kwargs = await loop.run_in_executor(None, conn.recv)
        if command == "exit":
            with contextlib.suppress(Exception):
                await handler.close()
            conn.send({})
            return
        try:
            reply = await handler.handle(command, kwargs)
        except Exception as exc:  # reported to the parent, which decides
            reply = {"failed": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)


class ClientsHandler:
    """The clients and herd parts' worker: `connect`, `prepare` + `go`, `report`, `probe`,
    `open_once`, `close`."""

    def __init__(self) -> None:
        self.clients: Clients | None = None

    async def handle(self, command: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        if command == "connect":
            self.clients = Clients(**kwargs)
            return await self.clients.connect()
        if command == "prepare":
            await self.close()
            self.clients = Clients(**kwargs)
            return self.clients.prepare()
        if command == "go" and self.clients is not None:
            return await self.clients.connect(kwargs["start_at"], kwargs.get("concurrency"))
        if command == "report" and self.clients is not None:
            return self.clients.report()
        if command == "probe":
            return await probe(**kwargs)
        if command == "open_once":
            return await open_once(**kwargs)
        if command == "close":
            await self.close()
            return {}
        return {}

    async def close(self) -> None:
        if self.clients is not None:
            await self.clients.close()
        self.clients = None


def worker_main(conn: Connection) -> None:
    """Entry point of a worker process: serve commands from the parent until `exit`."""
    asyncio.run(serve_pipe(conn, ClientsHandler()))


class Fleet:
    """`workers` client processes plus one prober, driven over pipes with deadlines.

    `target` is each process's entry point (`worker_main`, or another part's); `prober`
    False: no prober process."""

    def __init__(
        self,
        workers: int,
        target: Callable[[Connection], None] = worker_main,
        prober: bool = True,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # grpc does not survive fork
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._prober = prober
        for _ in range(workers + (1 if prober else 0)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def workers(self) -> list[Connection]:
        return self._conns[:-1] if self._prober else list(self._conns)

    @property
    def prober(self) -> Connection:
        if not self._prober:
            raise WorkerLost("this fleet has no prober")
        return self._conns[-1]

    @staticmethod
    def send(conns: Sequence[Connection], command: str, each: Sequence[dict[str, Any]]) -> None:
        for conn, kwargs in zip(conns, each, strict=True):
            conn.send((command, kwargs))

    @staticmethod
    def gather(conns: Sequence[Connection], timeout: float) -> list[dict[str, Any]]:
        """Every worker's reply to the last command, or `WorkerLost` after `timeout`."""
        deadline = time.monotonic() + timeout
        out = []
        for conn in conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise WorkerLost(f"a client worker did not answer within {timeout:.0f}s")
            try:
                out.append(conn.recv())
            except (EOFError, OSError) as exc:  # the worker process died
                raise WorkerLost(f"a client worker exited: {exc!r}") from exc
        return out

    def call(
        self,
        command: str,
        each: Sequence[dict[str, Any]],
        timeout: float,
        conns: Sequence[Connection] | None = None,
    ) -> list[dict[str, Any]]:
        targets = self.workers if conns is None else conns
        self.send(targets, command, each)
        return self.gather(targets, timeout)

    def close(self) -> None:
        """Ask every worker to exit; kill the ones that have not within 10 s in all."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("exit", {}))
        deadline = time.monotonic() + 10.0  # for all of them: a busy fleet is not waited on
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
