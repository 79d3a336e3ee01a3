"""The shards part's worker processes (`bench.scale.clients.Fleet`): each holds its share of
the ranks, a channel and a session each or one of each per replica (`Ranks.prepare`), and
sends every rank's shard Publish at the barrier's instant, at most K in flight
(`Ranks.go`), answering what came back: replies that said visible, the highest revision of
those that did not, failures by code.

Apart from the cases that drive them (`bench.scale.shard_bursts`) and the part's loop
(`bench.scale.shards`): what runs in the worker processes, so that no one client process
serializes a thousand ranks. `shard_request` is the one shard Publish every case sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

import grpc

from bench.scale.clients import serve_pipe
from bench.scale.rpc import OPTIONS, first_error, holder, tiny_manifest
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

SESSION_TTL = 300  # the ranks' sessions outlive the slowest burst without a KeepAlive
OPEN_CONCURRENCY = 16  # OpenSession calls in flight per worker while the ranks get ready
CHANNEL_OPTIONS = [*OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # a connection each


def shard_request(model: str, i: int, count: int, session: int) -> pb.PublishRequest:
    return pb.PublishRequest(
        model=model,
        version=1,
        manifest=tiny_manifest(),
        holder=holder(f"rank-{i:05d}", session, complete=True, shard=i),
        shard_index=i,
        shard_count=count,
    )


class Ranks:
    """A worker's share of the ranks (`prepare`), then their Publishes (`go`)."""

    def __init__(self) -> None:
        self.channels: list[grpc.aio.Channel] = []
        self.ranks: list[tuple[int, hub_pb2_grpc.TensorHubStub, int]] = []  # index, stub, session
        self.model = ""
        self.count = 0
        self.metadata: tuple[tuple[str, str], ...] = ()

    async def prepare(
        self,
        targets: list[str],
        token: str,
        indices: list[int],
        count: int,
        model: str,
        per_rank: bool,
    ) -> dict[str, Any]:
        """`per_rank`: every rank its own channel and session (to replica index mod R);
        else one channel per replica and one session for this worker's shards."""
        await self.close()
        self.model, self.count = model, count
        self.metadata = (("authorization", f"Bearer {token}"),)
        errors: Counter[str] = Counter()
        gate = asyncio.Semaphore(OPEN_CONCURRENCY)

        def channel(target: str) -> grpc.aio.Channel:
            made = grpc.aio.insecure_channel(target, CHANNEL_OPTIONS)
            self.channels.append(made)
            return made

        async def session(stub: hub_pb2_grpc.TensorHubStub) -> int:
            async with gate:
                opened = await stub.OpenSession(
                    pb.OpenSessionRequest(ttl_seconds=SESSION_TTL),
                    metadata=self.metadata,
                    timeout=60.0,
                )
            return int(opened.session_id)

        async def rank(i: int, stub: hub_pb2_grpc.TensorHubStub, shared: int) -> None:
            try:
                self.ranks.append((i, stub, shared or await session(stub)))
            except grpc.aio.AioRpcError as exc:
                errors[f"open: {exc.code().name}"] += 1

        if per_rank:
            stubs = [
                hub_pb2_grpc.TensorHubStub(channel(targets[i % len(targets)]))  # type: ignore[no-untyped-call]
                for i in indices
            ]
            await asyncio.gather(*(rank(i, s, 0) for i, s in zip(indices, stubs, strict=True)))
        else:
            per_target = [hub_pb2_grpc.TensorHubStub(channel(t)) for t in targets]  # type: ignore[no-untyped-call]
            shared = await session(per_target[0])
            for i in indices:
                await rank(i, per_target[i % len(targets)], shared)
        self.ranks.sort(key=lambda r: r[0])
        return {"ready": len(self.ranks), "errors": dict(errors)}

    async def go(self, start_at: float, inflight: int | None, timeout: float) -> dict[str, Any]:
        """At `start_at`, every rank's Publish (at most `inflight` at once; None: all)."""
        gate: asyncio.Semaphore | contextlib.nullcontext[None] = (
            contextlib.nullcontext() if inflight is None else asyncio.Semaphore(inflight)
        )
        visible: list[tuple[int, int, float]] = []  # index, revision, reply time
        revisions: list[int] = []
        results: list[object] = []

        async def one(i: int, stub: hub_pb2_grpc.TensorHubStub, session: int) -> None:
            async with gate:
                try:
                    reply = await stub.Publish(
                        shard_request(self.model, i, self.count, session),
                        metadata=self.metadata,
                        timeout=timeout,
                    )
                except grpc.aio.AioRpcError as exc:
                    results.append(exc)
                    return
            results.append(reply)
            if reply.visible:
                visible.append((i, int(reply.revision), time.monotonic()))
            else:
                revisions.append(int(reply.revision))

        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        await asyncio.gather(*(one(*r) for r in self.ranks))
        failed = [r for r in results if isinstance(r, BaseException)]
        codes = Counter(
            r.code().name if isinstance(r, grpc.aio.AioRpcError) else type(r).__name__
            for r in failed
        )
        return {
            "published": len(results) - len(failed),
            "failures": dict(codes),
            "first_error": first_error(failed),
            "visible": visible,
            "max_revision": max(revisions, default=0),  # of the shards that said not visible
            "last_reply_at": time.monotonic(),
        }

    async def handle(self, command: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        if command == "prepare":
            return await self.prepare(**kwargs)
        if command == "go":
            return await self.go(**kwargs)
        if command == "close":
            await self.close()
        return {}

    async def close(self) -> None:
        await asyncio.gather(*(c.close(0) for c in self.channels), return_exceptions=True)
        self.channels, self.ranks = [], []


def rank_worker(conn: Connection) -> None:
    """Entry point of a rank worker process (`Fleet(..., target=rank_worker)`)."""
    asyncio.run(serve_pipe(conn, Ranks()))
