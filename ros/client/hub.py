"""`Hub`: the SDK's connection to TensorHub (what `ros.connect` returns).

The control plane goes through the hub (gRPC); weight bytes go holder → reader directly over
the data plane (`transport`). Every client that holds a version runs a small holder server,
started on first use, so whatever it published or fetched is served to others until released.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import torch

from consistency.floor import RevisionFloor, StaleRead
from consistency.records import HolderRecord
from ros.client.channel import open_channel, parse_address
from ros.client.handles import DEFAULT_RELEASE_TIMEOUT, Held, Publication
from ros.client.manifest import layout_of, manifest_of
from ros.client.session import ClientSession
from ros.client.watch import HubWatch, holder_from_message
from ros.errors import from_rpc_error
from ros.metrics import (
    SDK_BYTES_FETCHED,
    SDK_BYTES_SERVED,
    SDK_FETCH_SECONDS,
    SDK_PUBLISH_SECONDS,
)
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import ReadTokenVerifier
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    OutcomeUnknown,
    TensorHubError,
    Unavailable,
    VersionNotFound,
)
from tensorhub.names import validate_name, validate_version
from transport.layout import Layout
from transport.planner import Candidate, Source, pipeline_sources
from transport.reader import fetch as transport_fetch
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.tls import TlsConfig
from transport.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
DEFAULT_FETCH_TIMEOUT = 60.0
T = TypeVar("T")


def default_holder_name() -> str:
    """`{host}-{pid}-{random}`, squeezed into the name pattern."""
    host = re.sub(r"[^a-z0-9._-]", "-", socket.gethostname().lower()).strip("-.")[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class Hub:
    """A connection to the hub for one tenant. Thread-safe. Close it (or use `with`)."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        tenant: str,
        token: str,
        topology: Mapping[str, str] | None = None,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        session_ttl: int = 10,
        tls: TlsConfig | None = None,
    ) -> None:
        addresses = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.tenant = validate_name(tenant, "tenant")
        self.holder_name = validate_name(name or default_holder_name(), "holder")
        self.topology = Topology(**dict(topology or {}))
        self.timeout = timeout
        self._listen = parse_address(listen, allow_zero=True)
        self._advertise = advertise
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._tls = tls
        self._channel = open_channel(addresses, tls=tls)
        self._stub = hub_pb2_grpc.TensorHubStub(self._channel)  # type: ignore[no-untyped-call]
        self.floor = RevisionFloor()
        self._lock = threading.RLock()
        self._store = HolderStore()
        self._server: HolderServer | None = None
        self._fences: dict[tuple[str, int], int] = {}
        self._session_ttl = session_ttl
        self._closed = False
        self.session = self._open_session()

    # -- plumbing --------------------------------------------------------------------------

    def _rpc(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Call a unary method with a deadline; errors come back as TensorHubErrors."""
        try:
            return getattr(self._stub, method)(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _fresh(
        self, call: Callable[[float], T], revision_of: Callable[[T], int], timeout: float
    ) -> T:
        """Repeat a read until its answer is not older than our revision floor (or the deadline)."""
        deadline = time.monotonic() + timeout
        while True:
            answer = call(max(deadline - time.monotonic(), 0.01))
            try:
                self.floor.accept(revision_of(answer))
                return answer
            except StaleRead:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _open_session(self) -> ClientSession:
        opened = self._rpc("OpenSession", pb.OpenSessionRequest(ttl_seconds=self._session_ttl))
        self.floor.observe(opened.revision)
        return ClientSession(self._stub, self._metadata, opened, on_lost=self._session_lost)

    def _session_lost(self, lost: ClientSession) -> None:
        """Stop serving at once, then re-register everything under a new session."""
        threading.Thread(target=self._recover, name="hub-session-recover", daemon=True).start()

    def _recover(self) -> None:
        if self._closed:
            return
        try:
            with self._lock:
                self.session = self._open_session()
                for key in self._store.keys():  # noqa: SIM118  (a method, not a dict)
                    held = self._store.get(key)
                    _, model, version = key
                    if held is None or held.released:
                        continue
                    fence = self._register(model, version, complete=held.complete)
                    self._fences[(model, version)] = fence
        except TensorHubError as exc:
            log.error("could not re-register after losing the session: %s", exc)

    def _verifier(self, tenant: str, model: str, version: int, token: bytes) -> bool:
        session = self.session
        if session.lost.is_set():
            return False  # a client that lost its session stops serving at once
        return ReadTokenVerifier(session.read_key, self.tenant)(tenant, model, version, token)

    def _holder_server(self) -> HolderServer:
        with self._lock:
            if self._server is None:
                host, port = self._listen
                self._server = HolderServer(
                    self._store, self._verifier, host, port, tls=self._tls,
                    on_served=SDK_BYTES_SERVED.inc,
                ).start()  # fmt: skip
            return self._server

    def _endpoint(self) -> str:
        host, port = self._holder_server().address
        if self._advertise:
            host = self._advertise
        elif host in ("0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{port}"

    def _holder_pb(self, complete: bool, fence: int = 0) -> pb.Holder:
        labels = {k: v for k, v in vars(self.topology).items() if v}
        return pb.Holder(
            name=self.holder_name,
            endpoints={"tcp": self._endpoint()},
            topology=labels,
            state=pb.COMPLETE if complete else pb.PARTIAL,
            session_id=self.session.id,
            fence=fence,
        )

    def _register(self, model: str, version: int, *, complete: bool) -> int:
        request = pb.RegisterHolderRequest(
            model=model, version=version, holder=self._holder_pb(complete)
        )
        response = self._rpc("RegisterHolder", request)
        self.floor.observe(response.revision)
        return int(response.fence)

    # -- publish ---------------------------------------------------------------------------

    def publish(
        self,
        model: str,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_size: int | None = None,
        timeout: float | None = None,
    ) -> Publication:
        """Publish `version` of `model`, served from these tensors' own memory.

        Raises `StaleVersion` if `version` is not newer than latest (nothing written), and
        `OutcomeUnknown` if the hub could not confirm the write (check `latest()`).
        Non-contiguous tensors are copied once into contiguous memory (and logged).
        """
        validate_name(model, "model")
        validate_version(version)
        start = time.monotonic()
        own = _contiguous(tensors)
        layout = (
            Layout.from_tensors(own) if chunk_size is None else Layout.from_tensors(own, chunk_size)
        )
        held = HeldVersion.publisher(self.tenant, model, version, own, layout)
        manifest = manifest_of(held)
        self._holder_server()
        self._store.add(held)
        request = pb.PublishRequest(
            model=model, version=version, manifest=manifest, holder=self._holder_pb(complete=True)
        )
        try:
            response = self._publish_rpc(request, timeout)
        except BaseException:
            self._store.release(held.key, 0.0)
            raise
        self.floor.observe(response.revision)
        SDK_PUBLISH_SECONDS.observe(time.monotonic() - start)
        return Publication(
            self, model, version, own, int(response.revision), bool(response.visible)
        )

    def _publish_rpc(self, request: pb.PublishRequest, timeout: float | None) -> pb.PublishResponse:
        """Publish once; if the reply is lost, find out from the hub whether it landed."""
        try:
            response: pb.PublishResponse = self._rpc("Publish", request, timeout)
            return response
        except (Unavailable, DeadlineExceeded, OutcomeUnknown) as exc:
            try:
                info = self._rpc(
                    "Inspect", pb.InspectRequest(model=request.model, version=request.version)
                )
            except VersionNotFound:
                raise OutcomeUnknown(
                    f"publish of {request.model}@{request.version} not confirmed ({exc}); "
                    "it did not land by the time of the check; publish again"
                ) from exc
            except TensorHubError as inner:
                raise OutcomeUnknown(
                    f"publish of {request.model}@{request.version}: {exc}; {inner}"
                ) from exc
            if any(
                h.name == self.holder_name and h.session_id == self.session.id for h in info.holders
            ):
                return pb.PublishResponse(
                    version=request.version, revision=info.published_revision, visible=True
                )
            raise OutcomeUnknown(f"publish of {request.model}@{request.version}: {exc}") from exc

    # -- read side -------------------------------------------------------------------------

    def latest(self, model: str, *, timeout: float | None = None) -> int:
        """The latest published version (0 if none); never older than what this client saw."""
        validate_name(model, "model")
        response = self._fresh(
            lambda t: self._rpc("Latest", pb.LatestRequest(model=model), t),
            lambda r: int(r.revision),
            self.timeout if timeout is None else timeout,
        )
        return int(response.version)

    def watch(self, model: str, *, since: int | None = None) -> HubWatch:
        """New versions and holder changes of `model` from revision `since` (default: now).

        Iterate it, or call `get(timeout)`; close it (or use `with`) when done.
        """
        validate_name(model, "model")
        if since is None:
            since = int(self._rpc("Latest", pb.LatestRequest(model=model)).revision) + 1
        elif since <= 0:
            raise InvalidArgument("since must be a positive revision")
        return HubWatch(self._stub, self._metadata, model, since, self.floor)

    def fetch(
        self,
        model: str,
        version: int | str = "latest",
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        timeout: float = DEFAULT_FETCH_TIMEOUT,
    ) -> Held:
        """Read `model@version` from its holders, in place into `into` or into new tensors.

        With `into`, names, dtypes and shapes must match the manifest or `InvalidArgument`
        is raised before any byte is written. The fetched version is served to others until
        `release()`d. Raises `VersionUnavailable` if no holder is left, before the deadline.
        """
        validate_name(model, "model")
        number = 0 if version == "latest" else validate_version(version)
        start = time.monotonic()
        deadline = start + timeout
        resolved = self._fresh(
            lambda t: self._rpc("Resolve", pb.ResolveRequest(model=model, version=number), t),
            lambda r: int(r.revision),
            min(timeout, self.timeout),
        )
        version = int(resolved.version)
        if resolved.shards:
            raise InvalidArgument(
                f"{model}@{version} is model-parallel ({len(resolved.shards)} shards); "
                "fetching sharded versions is not supported by this SDK yet"
            )
        layout = layout_of(resolved.manifest)
        if into is not None:
            layout.check_tensors(into)
            self._check_not_held(into)
            tensors = {spec.name: into[spec.name] for spec in layout.tensors}
        else:
            tensors = layout.allocate()
        held = HeldVersion.reader(self.tenant, model, version, layout, tensors)
        self._holder_server()
        self._store.add(held)
        try:
            stats = self._fill(model, version, held, resolved, deadline)
        except BaseException:
            self._abandon(model, version, held)
            raise
        for source, nbytes in stats.bytes_per_source.items():
            SDK_BYTES_FETCHED.labels(source).inc(nbytes)
        SDK_FETCH_SECONDS.observe(time.monotonic() - start)
        return Held(self, model, version, tensors, stats)

    def _fill(
        self,
        model: str,
        version: int,
        held: HeldVersion,
        resolved: pb.ResolveResponse,
        deadline: float,
    ) -> Any:
        pin = pb.PinRequest(
            model=model, version=version, pin_id=self.holder_name, session_id=self.session.id
        )
        self._rpc("Pin", pin)
        fence = self._register(model, version, complete=False)
        self._fences[(model, version)] = fence

        def refresh() -> list[Source]:
            again = self._rpc("Resolve", pb.ResolveRequest(model=model, version=version))
            return self._sources(again.holders)

        # Pipelined replication: now that we are registered (our fence orders us after
        # every earlier reader), read from one predecessor rather than all from the publisher.
        ordered = self._rpc("Resolve", pb.ResolveRequest(model=model, version=version))
        first = pipeline_sources(self.topology, fence, self._candidates(ordered.holders))
        stats = transport_fetch(
            self.tenant, model, version, held.layout, held,
            first or self._sources(resolved.holders),
            token=bytes(resolved.read_token), deadline=deadline, me=self.topology,
            refresh_sources=refresh, expected=list(resolved.manifest.chunk_xxh3), tls=self._tls,
        )  # fmt: skip
        update = pb.UpdateHolderRequest(
            model=model, version=version, holder=self._holder_pb(True, fence)
        )
        self._rpc("UpdateHolder", update)
        self._rpc("Unpin", pb.UnpinRequest(model=model, version=version, pin_id=self.holder_name))
        return stats

    def _candidates(self, holders: Sequence[pb.Holder]) -> list[Candidate]:
        by_name = {h.name: h for h in holders}
        return [
            Candidate(s, int(by_name[s.holder_id].fence), by_name[s.holder_id].state == pb.COMPLETE)
            for s in self._sources(holders)
        ]

    def _sources(self, holders: Sequence[pb.Holder]) -> list[Source]:
        sources = []
        for h in holders:
            if h.name == self.holder_name or "tcp" not in h.endpoints:
                continue
            host, port = parse_address(h.endpoints["tcp"])
            topology = Topology(
                **{k: v for k, v in h.topology.items() if k in ("dc", "rack", "host")}
            )
            sources.append(Source(h.name, host, port, topology))
        return sources

    def _check_not_held(self, into: Mapping[str, torch.Tensor]) -> None:
        """Refuse to fetch into memory that still serves another version (mutability contract)."""
        targets = {t.data_ptr() for t in into.values() if t.numel()}
        for key in self._store.keys():  # noqa: SIM118  (a method, not a dict)
            held = self._store.get(key)
            if held is None or held.released:
                continue
            if targets & {t.data_ptr() for t in held.tensors.values() if t.numel()}:
                raise InvalidArgument(
                    f"`into` still serves {key[1]}@{key[2]}: release it before overwriting it"
                )

    def _abandon(self, model: str, version: int, held: HeldVersion) -> None:
        try:
            self._store.release(held.key, 1.0)
        except TensorHubError as exc:
            log.warning("abandoning %s@%d: %s", model, version, exc)
        for method, request in (
            (
                "ReleaseHolder",
                pb.ReleaseHolderRequest(
                    model=model, version=version, holder=self.holder_name, force=True
                ),
            ),
            ("Unpin", pb.UnpinRequest(model=model, version=version, pin_id=self.holder_name)),
        ):
            try:
                self._rpc(method, request)
            except TensorHubError as exc:  # the lease removes them anyway when we go
                log.info("cleanup %s of %s@%d failed: %s", method, model, version, exc)
        self._fences.pop((model, version), None)

    # -- release ---------------------------------------------------------------------------

    def _release(
        self, model: str, version: int, *, force: bool, timeout: float = DEFAULT_RELEASE_TIMEOUT
    ) -> None:
        """Delete our holder record, then refuse new reads and wait for reads in flight."""
        request = pb.ReleaseHolderRequest(
            model=model, version=version, holder=self.holder_name, force=force
        )
        response = self._rpc("ReleaseHolder", request)
        self.floor.observe(response.revision)
        self._store.release((self.tenant, model, version), timeout)
        self._fences.pop((model, version), None)

    # -- listing ---------------------------------------------------------------------------

    def inspect(
        self, model: str, version: int = 0, *, timeout: float | None = None
    ) -> pb.InspectResponse:
        """Everything about one version (default: the latest)."""
        validate_name(model, "model")
        info: pb.InspectResponse = self._fresh(
            lambda t: self._rpc("Inspect", pb.InspectRequest(model=model, version=version), t),
            lambda r: int(r.revision),
            self.timeout if timeout is None else timeout,
        )
        return info

    def holders(self, model: str, version: int) -> list[HolderRecord]:
        return [holder_from_message(h) for h in self.inspect(model, version).holders]

    def list_models(self) -> list[pb.ModelSummary]:
        return list(self._rpc("ListModels", pb.ListModelsRequest()).models)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, end the session (its records vanish at once), close the channel."""
        if self._closed:
            return
        self._closed = True
        for key in self._store.keys():  # noqa: SIM118  (a method, not a dict)
            try:
                self._store.release(key, 5.0)
            except TensorHubError as exc:
                log.warning("closing: %s", exc)
        self.session.stop()
        try:
            self._rpc("CloseSession", pb.CloseSessionRequest(session_id=self.session.id), 5.0)
        except TensorHubError as exc:
            log.info("closing: session not revoked (%s); it expires within its TTL", exc)
        if self._server is not None:
            self._server.stop()
        self._channel.close()

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _contiguous(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    own: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(f"{name!r} is not a tensor")
        own[name] = tensor.detach()
        if not own[name].is_contiguous():
            log.info("tensor %r is not contiguous: publishing a contiguous copy", name)
            own[name] = own[name].contiguous()
    return own
