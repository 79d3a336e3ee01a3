"""The ceiling for the clients benchmark: a minimal grpc.aio server with the hub's service.

It does the least a hub could: OpenSession hands out a number, KeepAlive echoes, Watch
streams wait on an in-memory queue, Publish puts one WatchEvent into every open stream's
queue, and Latest answers an empty reply. The same client processes, on the same stubs and
messages, run against it and against the hub in one run, so the hub's fan-out and unary
latencies are read as multiples of this floor on the same machine at the same moment.

`python -m bench.scale.ceiling --listen 127.0.0.1:0 --ready-file F` runs it until SIGTERM;
with `--metrics-port P` it counts its open Watch and KeepAlive streams on a Prometheus
endpoint under the hub's gauge names (`tensorhub_hub_watches_active`,
`tensorhub_hub_sessions_active`), so the herd part reads "every client is watching" from
both servers the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from ros.cli.serve import write_ready_file
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

QUEUE_LIMIT = 1024  # a stream further behind than this is cut off, as the hub does
# gRPC core cancels calls the application has not picked up once more than 1,000 wait (its
# default): a herd of 2,000 opens met that as CANCELLED. The hub raises both limits to its
# stream limit (ros/hub/server.py); the ceiling does the same, with the hub's default.
SERVER_OPTIONS = [
    ("grpc.server.max_pending_requests", 16384),
    ("grpc.server.max_pending_requests_hard_limit", 2 * 16384),
]
REGISTRY = CollectorRegistry()  # its own: only the two gauges, no process collectors
WATCHES = Gauge("tensorhub_hub_watches_active", "Watch streams open", registry=REGISTRY)
SESSIONS = Gauge("tensorhub_hub_sessions_active", "KeepAlive streams open", registry=REGISTRY)


class Ceiling(hub_pb2_grpc.TensorHubServicer):
    """The few TensorHub methods the clients benchmark calls, each doing no real work."""

    def __init__(self) -> None:
        self._streams: set[asyncio.Queue[pb.WatchEvent]] = set()
        self._ids = itertools.count(1)
        self._latest = 0

    async def OpenSession(  # noqa: N802
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.OpenSessionResponse:
        return pb.OpenSessionResponse(
            session_id=next(self._ids), ttl_seconds=request.ttl_seconds or 10, revision=1
        )

    async def KeepAlive(  # noqa: N802
        self,
        requests: AsyncIterator[pb.KeepAliveRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[pb.KeepAliveResponse]:
        SESSIONS.inc()
        try:
            async for request in requests:
                yield pb.KeepAliveResponse(session_id=request.session_id, ttl_seconds=10)
        finally:
            SESSIONS.dec()

    async def Watch(  # noqa: N802
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[pb.WatchEvent]:
        queue: asyncio.Queue[pb.WatchEvent] = asyncio.Queue(QUEUE_LIMIT)
        self._streams.add(queue)
        WATCHES.inc()
        try:
            while True:
                yield await queue.get()
        finally:
            WATCHES.dec()
            self._streams.discard(queue)

    async def Publish(  # noqa: N802
        self, request: pb.PublishRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.PublishResponse:
        """Fan one event out to every open stream (the one message the hub must send)."""
        self._latest = max(self._latest, request.version)
        event = pb.WatchEvent(
            kind=pb.WatchEvent.VERSION_PUBLISHED, version=request.version, revision=request.version
        )
        for queue in list(self._streams):
            if queue.full():
                self._streams.discard(queue)
            else:
                queue.put_nowait(event)
        return pb.PublishResponse(version=request.version, revision=request.version, visible=True)

    async def Latest(  # noqa: N802
        self, request: pb.LatestRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.LatestResponse:
        return pb.LatestResponse(version=self._latest, revision=self._latest)


async def serve(listen: str, ready_file: Path | None, metrics_port: int = 0) -> None:
    """Serve until SIGINT/SIGTERM; write the bound address to `ready_file` once serving."""
    if metrics_port:
        start_http_server(metrics_port, addr="127.0.0.1", registry=REGISTRY)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    hub_pb2_grpc.add_TensorHubServicer_to_server(Ceiling(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(listen)
    await server.start()
    host = listen.rsplit(":", 1)[0]
    if ready_file is not None:
        write_ready_file(ready_file, {"address": f"{host}:{port}"})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale.ceiling")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--ready-file", type=Path)
    ap.add_argument("--metrics-port", type=int, default=0, help="count streams here (0: off)")
    args = ap.parse_args(argv)
    asyncio.run(serve(args.listen, args.ready_file, args.metrics_port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
