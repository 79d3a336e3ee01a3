"""Raw hub RPCs for the parts that simulate many holders without moving bytes.

A simulated holder is a name, an endpoint nobody dials and a session; a simulated version is
a one-tensor manifest. The calls are the hub's own (RegisterHolder, Resolve, ...), made from
one asyncio loop with bounded concurrency, so the hub does the work a fleet would ask of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

T = TypeVar("T")
CALL_SECONDS = 30.0
OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


class Hub:
    """A grpc.aio channel to one hub with the tenant's token on every call."""

    def __init__(self, address: str, token: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, OPTIONS)
        self.stub = hub_pb2_grpc.TensorHubStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = (("authorization", f"Bearer {token}"),)

    async def call(self, method: str, request: Any, timeout: float = CALL_SECONDS) -> Any:
        return await getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)

    async def session(self, ttl: int = 300) -> int:
        opened = await self.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=ttl))
        return int(opened.session_id)

    async def close(self) -> None:
        await self.channel.close(0)


def tiny_manifest(nbytes: int = 64) -> pb.Manifest:
    """One float32 tensor of `nbytes` in a single 4 KiB chunk (the checksum is not checked by
    the hub: nobody reads these bytes)."""
    return pb.Manifest(
        tensors=[
            pb.TensorEntry(name="w", dtype="float32", shape=[nbytes // 4], offset=0, nbytes=nbytes)
        ],
        total_bytes=nbytes,
        chunk_size=4096,
        chunk_xxh3=[0],
    )


def holder(
    name: str,
    session: int,
    *,
    complete: bool,
    fence: int = 0,
    port: int = 1,
    topology: dict[str, str] | None = None,
    shard: int | None = None,
) -> pb.Holder:
    """A simulated holder record (its endpoint is never dialled)."""
    message = pb.Holder(
        name=name,
        endpoints={"tcp": f"127.0.0.1:{port}"},
        topology=topology or {},
        state=pb.COMPLETE if complete else pb.PARTIAL,
        session_id=session,
        fence=fence,
    )
    if shard is not None:
        message.shard = shard
    return message


async def bounded(
    calls: Iterable[Callable[[], Awaitable[T]]], limit: int
) -> list[T | BaseException]:
    """Run the calls with at most `limit` in flight; each result or the exception it raised."""
    gate = asyncio.Semaphore(limit)

    async def one(fn: Callable[[], Awaitable[T]]) -> T | BaseException:
        async with gate:
            try:
                return await fn()
            except Exception as exc:  # counted by the caller
                return exc

    return list(await asyncio.gather(*(one(fn) for fn in calls)))


async def timed(fn: Callable[[], Awaitable[Any]], count: int) -> list[float]:
    """`count` sequential calls of `fn`: each one's latency in ms."""
    out = []
    for _ in range(count):
        t0 = time.monotonic()
        await fn()
        out.append((time.monotonic() - t0) * 1000)
    return out


def failures(results: Iterable[object]) -> dict[str, int]:
    """How many results are exceptions, by gRPC code (or exception type)."""
    out: dict[str, int] = {}
    for r in results:
        if isinstance(r, BaseException):
            key = r.code().name if isinstance(r, grpc.aio.AioRpcError) else type(r).__name__
            out[key] = out.get(key, 0) + 1
    return out


def first_error(results: Iterable[object]) -> str:
    for r in results:
        if isinstance(r, grpc.aio.AioRpcError):
            return f"{r.code().name}: {r.details()}"
        if isinstance(r, BaseException):
            return f"{type(r).__name__}: {r}"
    return ""


def resolve_request(**fields: Any) -> pb.ResolveRequest:
    """A ResolveRequest with the caller's fields that this checkout's proto has (an older
    hub's checkout, run with `--hub-tree`, lacks topology and fence)."""
    known = pb.ResolveRequest.DESCRIPTOR.fields_by_name
    return pb.ResolveRequest(**{k: v for k, v in fields.items() if k in known})
