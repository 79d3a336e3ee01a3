"""Run the hub: a `grpc.aio` server with the TensorHub service, health checking and reflection.

A replica must hold thousands of clients, each a session keepalive (a bidi stream) and a
versions-only watch (a server stream): docs/design.md's scale envelope asks for 2,000 on 2
cores. On gRPC's
synchronous server every open stream would pin a pool thread. So the server runs on its own
asyncio event loop in one dedicated thread: streams are coroutines (memory, not threads),
unary handler bodies run in one bounded worker pool (`ros.hub.rpc.unary`), session renewals
share one etcd keepalive stream (`consistency.keepalive`) and every hot model has one etcd
watch, on one multiplexed etcd stream, shared by its Watch streams and its holder index
(`ros.hub.model_feed`). The thread count is therefore fixed by configuration, not by load;
the stream counts are bounded by explicit limits (`ros.hub.limits`).

`HubServer` has a synchronous API (construct, `start()`, `stop(grace)`, `wait()`), so
tests, the chaos cluster, the demo and `tensorhub serve` run it in-process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AioHealthServicer
from grpc_reflection.v1alpha import reflection

from consistency import Etcd, Keys
from consistency.compactor import DEFAULT_INTERVAL as DEFAULT_COMPACT_INTERVAL
from consistency.compactor import Compactor
from consistency.credentials import EtcdCredentials
from ros.hub.guard import DEFAULT_FIRST_MESSAGE_SECONDS, DEFAULT_MAX_PENDING, CallGuard
from ros.hub.limits import (
    DEFAULT_CHECK_PROCESSES,
    DEFAULT_MAX_PRIVATE_WATCHES,
    DEFAULT_MAX_PRIVATE_WATCHES_PER_TENANT,
    DEFAULT_MAX_STREAMS,
    DEFAULT_MAX_STREAMS_PER_TENANT,
    DEFAULT_MAX_WATCHED_MODELS_PER_TENANT,
    DEFAULT_WORKERS,
    Limits,
)
from ros.hub.servicer import HubServicer
from ros.hub.state import DEFAULT_ETCD_QUOTA_BYTES
from ros.metrics import CompactorMetrics
from ros.proto.tensorhub.v1 import hub_pb2, hub_pb2_grpc
from ros.raw_manifest import RawPublishRequest
from ros.tokens import READ_KEY_PERIOD, READ_TOKEN_TTL
from tensorhub.errors import DeadlineExceeded

log = logging.getLogger(__name__)

SERVICE_NAME = hub_pb2.DESCRIPTOR.services_by_name["TensorHub"].full_name
# Health of writes alone: NOT_SERVING while etcd's NOSPACE alarm refuses every write (reads,
# watches and renewals still work, so the service itself stays SERVING for load balancers).
WRITES_HEALTH_NAME = f"{SERVICE_NAME}/writes"
MAX_MESSAGE_BYTES = 64 << 20
MAX_QUEUED_UNARY = 4096  # unary calls admitted beyond the stream limit (gRPC's own backstop)
# HTTP/2 streams one client connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS):
# more than any SDK process or bench client multiplexes on one channel, so it only stops one
# connection from taking the replica's whole call budget. A client past it queues, not fails.
DEFAULT_MAX_STREAMS_PER_CONNECTION = 4096
T = TypeVar("T")


def call_guard(
    servicer: HubServicer,
    first_message_seconds: float = DEFAULT_FIRST_MESSAGE_SECONDS,
    *,
    max_pending: int = DEFAULT_MAX_PENDING,
) -> CallGuard:
    """The guard every server of `servicer` runs behind (`HubServer` does): it authenticates
    each TensorHub call once, at call start, and hands the caller to the handler, which
    refuses a call it was not handed (`ros.hub.guard`)."""
    return CallGuard(
        f"/{SERVICE_NAME}/", servicer.hub.caller, first_message_seconds, max_pending=max_pending
    )


class HubServer:
    """One hub replica. Stateless: start as many as you like over the same etcd.

    `max_workers` threads run the unary handler bodies; `max_streams` and
    `max_streams_per_tenant` bound the KeepAlive and Watch streams open at once, and
    `max_private_watches` (`max_private_watches_per_tenant`) the watches replaying old
    revisions, `max_watched_models_per_tenant` the distinct models a tenant watches at once
    (see `ros.hub.limits`).
    `compact_interval`: seconds between etcd compactions by the one replica elected to do
    them (`consistency.compactor`; 0 turns this replica's compactor off).
    `etcd_credentials`: etcd user, password and TLS material (`consistency.credentials`).
    `read_key_period`: seconds between rotations of every tenant's read key (`ros.tokens`);
    every replica must use the same. `read_token_ttl`: seconds a read token issued at
    Resolve lives (`ros.tokens.READ_TOKEN_TTL`; tests shorten it to outlive one).
    """

    def __init__(
        self,
        etcd_endpoints: list[str],
        *,
        listen: str = "127.0.0.1:0",
        admin_token: str,
        keys: Keys | None = None,
        retain: int = 2,
        max_workers: int = DEFAULT_WORKERS,
        credentials: grpc.ServerCredentials | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
        max_streams_per_tenant: int = DEFAULT_MAX_STREAMS_PER_TENANT,
        max_private_watches: int = DEFAULT_MAX_PRIVATE_WATCHES,
        compact_interval: float = DEFAULT_COMPACT_INTERVAL,
        etcd_quota_bytes: int = DEFAULT_ETCD_QUOTA_BYTES,
        etcd_credentials: EtcdCredentials | None = None,
        read_key_period: float = READ_KEY_PERIOD,
        first_message_seconds: float = DEFAULT_FIRST_MESSAGE_SECONDS,
        max_streams_per_connection: int = DEFAULT_MAX_STREAMS_PER_CONNECTION,
        read_token_ttl: float = READ_TOKEN_TTL,
        max_private_watches_per_tenant: int = DEFAULT_MAX_PRIVATE_WATCHES_PER_TENANT,
        max_watched_models_per_tenant: int = DEFAULT_MAX_WATCHED_MODELS_PER_TENANT,
        check_processes: int = DEFAULT_CHECK_PROCESSES,
    ) -> None:
        self._first_message_seconds = first_message_seconds
        self._max_streams_per_connection = max_streams_per_connection
        self.limits = Limits(
            max_streams=max_streams,
            max_streams_per_tenant=max_streams_per_tenant,
            max_private_watches=max_private_watches,
            workers=max_workers,
            max_private_watches_per_tenant=max_private_watches_per_tenant,
            max_watched_models_per_tenant=max_watched_models_per_tenant,
            check_processes=check_processes,
        )
        self.etcd = Etcd(etcd_endpoints, credentials=etcd_credentials)
        self.keys = keys or Keys()
        self._stopped = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="hub-loop", daemon=True)
        try:
            self.servicer = HubServicer(
                self.etcd, self.keys, admin_token=admin_token, default_retain=retain,
                limits=self.limits, read_key_period=read_key_period,
                read_token_ttl=read_token_ttl, history_period=compact_interval,
                etcd_quota_bytes=etcd_quota_bytes,
            )  # fmt: skip
        except BaseException:
            self.etcd.close()
            raise
        try:
            self._thread.start()
            self.port = self._call(self._build(listen, credentials), timeout=30.0)
            self.compactor = Compactor(
                self.etcd, self.keys, interval=compact_interval,
                on_storage_full=self._storage_full_changed, on_tick=CompactorMetrics(),
            )  # fmt: skip
            # A call refused with NOSPACE turns the writes health NOT_SERVING at once.
            self.servicer.hub.on_storage_full = self.compactor.note_storage_full
        except BaseException:  # e.g. the port is taken: leave no thread or stream behind
            self._end_loop()
            self.servicer.close()
            self.etcd.close()
            raise
        self.host = listen.rsplit(":", 1)[0]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- the event loop thread -------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the hub's loop and wait for its result (from any other thread)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except TimeoutError as exc:
            future.cancel()
            raise DeadlineExceeded(f"the hub's event loop did not answer in {timeout}s") from exc

    def _end_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        elif not self._loop.is_closed():
            self._loop.close()

    async def _build(self, listen: str, credentials: grpc.ServerCredentials | None) -> int:
        """Create the aio server on the loop (it binds to the running loop) and its port."""
        guard = call_guard(
            self.servicer, self._first_message_seconds,
            max_pending=self.limits.max_streams_per_tenant,
        )  # fmt: skip
        self._server = grpc.aio.server(
            interceptors=[guard],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # C-core sheds calls that arrive faster than the loop accepts them once 1,000
                # wait (all of them past 3,000): a crowd of clients reconnecting at once would
                # lose streams that our own limits admit. Our limits decide instead.
                ("grpc.server.max_pending_requests", self.limits.max_streams),
                ("grpc.server.max_pending_requests_hard_limit", 2 * self.limits.max_streams),
                ("grpc.max_concurrent_streams", self._max_streams_per_connection),
            ],
            maximum_concurrent_rpcs=self.limits.max_streams + MAX_QUEUED_UNARY,
        )
        _add_servicer(self.servicer, self._server)
        self._health = AioHealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        if credentials is None:
            return self._server.add_insecure_port(listen)
        return self._server.add_secure_port(listen, credentials)

    async def _start(self) -> None:
        await self._server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(WRITES_HEALTH_NAME, health_pb2.HealthCheckResponse.SERVING)

    def _storage_full_changed(self, full: bool) -> None:
        """The compactor's thread saw the NOSPACE alarm raised or cleared: show it in health
        (it must neither block nor raise there)."""
        if self._stopped.is_set() or self._loop.is_closed():
            return
        state = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if full
            else health_pb2.HealthCheckResponse.SERVING
        )
        log.warning("etcd storage %s", "is full (NOSPACE): writes refused" if full else "ok")
        asyncio.run_coroutine_threadsafe(self._health.set(WRITES_HEALTH_NAME, state), self._loop)

    async def _shutdown(self, grace: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)

    # -- the synchronous API ---------------------------------------------------------------

    def start(self) -> HubServer:
        """Start serving (the servicer's first etcd I/O, then the port); returns self. A
        failure (etcd unreachable) releases everything, as `stop` does."""
        try:
            self.servicer.start()
            self._call(self._start(), timeout=30.0)
        except BaseException:
            self.stop(grace=0)
            raise
        self.compactor.start()
        log.info("hub serving on %s", self.address)
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Refuse new calls, give open ones `grace` seconds, cancel the rest, and release
        everything (workers, shared watches, the keepalive stream, the etcd client)."""
        if self._stopped.is_set():
            return
        try:
            self.compactor.stop()
            self._call(self._shutdown(grace), timeout=grace + 5)
        finally:
            self.servicer.close()
            self._end_loop()
            self.etcd.close()
            self._stopped.set()

    def wait(self) -> None:
        """Block until `stop` has run."""
        self._stopped.wait()


class _Handlers:
    """Stands in for the server while the generated code registers the servicer's
    methods: keeps the handlers it would register (`_add_servicer`)."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        """Registered from `handlers` below instead (the same methods)."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.service, self.handlers = service, dict(handlers)


def _add_servicer(servicer: HubServicer, server: grpc.aio.Server) -> None:
    """The generated registration of `servicer`, except that `PublishShards` reads each
    message as a `RawPublishRequest` (its manifest as the bytes it came,
    `ros.raw_manifest`): a group call's thousands of manifests are checked and stored from
    their bytes, never parsed whole and serialized again."""
    taken = _Handlers()
    hub_pb2_grpc.add_TensorHubServicer_to_server(servicer, taken)  # type: ignore[no-untyped-call]
    if "PublishShards" not in taken.handlers:
        raise RuntimeError("the generated code registered no PublishShards handler")
    taken.handlers["PublishShards"] = grpc.stream_unary_rpc_method_handler(
        servicer.PublishShards,
        request_deserializer=RawPublishRequest.FromString,
        response_serializer=hub_pb2.PublishShardsResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(taken.service, taken.handlers),)
    )
    server.add_registered_method_handlers(taken.service, taken.handlers)  # type: ignore[attr-defined]
