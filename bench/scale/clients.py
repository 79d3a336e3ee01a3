"""Thousands of hub clients from a few processes: asyncio clients on raw grpc.aio stubs.

Each client is what a rollout worker keeps open: its own channel (its own TCP connection),
an OpenSession, a KeepAlive stream renewing every ttl/3, and a versions-only Watch that
records when it saw each version (CLOCK_MONOTONIC, shared by every process on the machine).
One asyncio loop per worker process holds hundreds of them, which is how one 2-core machine
holds 2,000. A worker can instead be a prober that calls `Latest` in a loop.

The parent drives workers through a pipe (`Fleet`): every command and every wait on a reply
has a deadline, so a server that stops answering ends a round, never the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

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


class Clients:
    """`count` clients of one worker against `target`, opened with bounded concurrency."""

    def __init__(
        self, target: str, token: str, count: int, model: str, ttl: int, connect_seconds: float
    ) -> None:
        self.target = target
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

    async def connect(self) -> dict[str, Any]:
        """Open every client (bounded by `connect_seconds`); how many got a session."""
        start = time.monotonic()
        gate = asyncio.Semaphore(OPEN_CONCURRENCY)
        deadline = start + self.connect_seconds

        async def one(i: int) -> None:
            async with gate:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.errors["open: connect deadline"] += 1
                    return
                client = _Client(i, grpc.aio.insecure_channel(self.target, CHANNEL_OPTIONS))
                self.clients.append(client)
                stub = hub_pb2_grpc.TensorHubStub(client.channel)  # type: ignore[no-untyped-call]
                try:
                    opened = await stub.OpenSession(
                        pb.OpenSessionRequest(ttl_seconds=self.ttl),
                        metadata=self.metadata,
                        timeout=min(CALL_SECONDS, left),
                    )
                except (TimeoutError, grpc.aio.AioRpcError) as exc:
                    self.errors[f"open: {_code(exc)}"] += 1
                    return
                client.session = int(opened.session_id)
                client.tasks = [
                    asyncio.create_task(self._keepalive(client, stub)),
                    asyncio.create_task(self._watch(client, stub, int(opened.revision) + 1)),
                ]

        self.connecting = True
        await asyncio.gather(*(one(i) for i in range(self.count)))
        self.connecting = False
        return {
            "sessions": sum(1 for c in self.clients if c.session),
            "connect_s": time.monotonic() - start,
            "errors": dict(self.errors),
        }

    async def _keepalive(self, client: _Client, stub: hub_pb2_grpc.TensorHubStub) -> None:
        """Renew every ttl/3. A renewal answered later than that is counted as late; one not
        answered before the lease would expire (ttl after the last renewal) loses the
        session: an error, and this client stops renewing."""
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
                took = renewed - t0
                self.keepalive_ms.append(took * 1000)
                self.keepalive_late += took > period
                client.keepalives += 1
                await asyncio.sleep(max(0.0, period - took))
        except asyncio.CancelledError:
            call.cancel()
            raise
        except TimeoutError:
            when = " while the others connected" if self.connecting else ""
            self.errors[f"keepalive: session expired unrenewed{when}"] += 1
            call.cancel()
        except grpc.aio.AioRpcError as exc:
            self.errors[f"keepalive: {_code(exc)}"] += 1
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
            self.errors[f"watch: {_code(exc)}"] += 1

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


async def _serve(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    clients: Clients | None = None
    while True:
        command, kwargs = await loop.run_in_executor(None, conn.recv)
        reply: dict[str, Any] = {}
        try:
            if command == "connect":
                clients = Clients(**kwargs)
                reply = await clients.connect()
            elif command == "report" and clients is not None:
                reply = clients.report()
            elif command == "probe":
                reply = await probe(**kwargs)
            elif command == "close":
                if clients is not None:
                    await clients.close()
                clients = None
            elif command == "exit":
                if clients is not None:
                    await clients.close()
                conn.send({})
                return
        except Exception as exc:  # reported to the parent, which decides
            reply = {"failed": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)


def worker_main(conn: Connection) -> None:
    """Entry point of a worker process: serve commands from the parent until `exit`."""
    asyncio.run(_serve(conn))


class Fleet:
    """`workers` client processes plus one prober, driven over pipes with deadlines."""

    def __init__(self, workers: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # grpc does not survive fork
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for _ in range(workers + 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def workers(self) -> list[Connection]:
        return self._conns[:-1]

    @property
    def prober(self) -> Connection:
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
        """Ask every worker to exit; kill the ones that do not within a few seconds."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("exit", {}))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
