"""The hub's gRPC handlers: authenticate, confine to the tenant's prefix, call the registries.

Every handler runs under a deadline (the caller's, capped at `MAX_CALL_SECONDS`), maps errors
through `ros.errors`, and answers with the etcd revision it read or wrote at. The hub keeps
no state of its own beyond caches: any replica can serve any call.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from consistency import (
    Etcd,
    HolderRegistry,
    HolderState,
    Keys,
    Session,
    VersionRegistry,
)
from ros.errors import ERROR_METADATA_KEY, status_of
from ros.hub.convert import holder_from_pb, holder_to_pb
from ros.hub.fanout import WatchFanout
from ros.hub.tenants import Quotas, Tenant, TenantStore
from ros.metrics import (
    HUB_LATENCY,
    HUB_REQUESTS,
    HUB_SESSIONS,
    HUB_SESSIONS_OPENED,
    HUB_WATCHES,
)
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import issue_read_token, token_hash
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    TensorHubError,
    VersionNotFound,
)
from tensorhub.names import validate_name, validate_version

log = logging.getLogger(__name__)

MAX_CALL_SECONDS = 30.0
MAX_MANIFEST_BYTES = 16 << 20
MAX_SESSION_TTL = 300
F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, method: str, exc: TensorHubError) -> None:
    code = status_of(exc)
    HUB_REQUESTS.labels(method, code.name).inc()
    log.info("rpc %s failed: %s: %s", method, type(exc).__name__, exc)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
    context.abort(code, str(exc))


def unary(fn: F) -> F:
    """Wrap a unary handler: timing, status metrics, error mapping."""

    @functools.wraps(fn)
    def wrapper(self: HubServicer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.monotonic()
        try:
            response = fn(self, request, context)
        except TensorHubError as exc:
            _abort(context, fn.__name__, exc)
        HUB_REQUESTS.labels(fn.__name__, "OK").inc()
        HUB_LATENCY.labels(fn.__name__).observe(time.monotonic() - start)
        return response

    return wrapper  # type: ignore[return-value]


def streaming(fn: F) -> F:
    """Wrap a streaming handler (a generator) with the same error mapping."""

    @functools.wraps(fn)
    def wrapper(self: HubServicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(self, request, context)
        except TensorHubError as exc:
            _abort(context, fn.__name__, exc)

    return wrapper  # type: ignore[return-value]


class HubServicer(hub_pb2_grpc.TensorHubServicer):
    """Handlers of `tensorhub.v1.TensorHub`."""

    def __init__(
        self, etcd: Etcd, keys: Keys, *, admin_token: str, default_retain: int = 2
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.tenants = TenantStore(etcd, keys)
        self._admin_hash = token_hash(admin_token)
        self._default_retain = default_retain
        # Retention runs after a publish has answered, off the publisher's critical path.
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retention")
        self._fanout = WatchFanout(etcd, keys)
        self.tenants.hub_secret()  # create it at start-up, not in the first caller's deadline

    def close(self) -> None:
        """Stop the background retention worker (pending collections are dropped: the next
        publish of each model runs its retention again)."""
        self._collector.shutdown(wait=False, cancel_futures=True)
        self._fanout.close()

    # -- plumbing --------------------------------------------------------------------------

    def _tenant(self, context: grpc.ServicerContext) -> Tenant:
        token = _bearer(context)
        if token is None:
            raise PermissionDenied("no tenant token: send 'authorization: Bearer <token>'")
        return self.tenants.authenticate(token)

    @staticmethod
    def _timeout(context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            return MAX_CALL_SECONDS
        if remaining <= 0:
            raise DeadlineExceeded("the call's deadline passed before the hub could act")
        return min(remaining, MAX_CALL_SECONDS)

    def _versions(self, tenant: Tenant) -> VersionRegistry:
        retain = min(self._default_retain, tenant.quotas.max_retained_versions)
        return VersionRegistry(self.etcd, self.keys, retain=retain, collector=self._collector)

    def _holders(self, tenant: Tenant) -> HolderRegistry:
        return HolderRegistry(self._versions(tenant))

    def _own_session(self, tenant: Tenant, session_id: int, timeout: float) -> None:
        """Refuse to attach records to a lease that is not one of this tenant's sessions."""
        kv, _ = self.etcd.get(self.keys.session(tenant.name, session_id), timeout=timeout)
        if kv is None:
            raise PermissionDenied(f"session {session_id:x} is not an open session of this tenant")

    # -- sessions --------------------------------------------------------------------------

    @unary
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        ttl = request.ttl_seconds or 10
        if not 1 <= ttl <= MAX_SESSION_TTL:
            raise InvalidArgument(f"session TTL must be 1..{MAX_SESSION_TTL} s, got {ttl}")
        count = len(
            self.etcd.range(
                self.keys.sessions(tenant.name), prefix=True, keys_only=True, timeout=timeout
            ).kvs
        )
        if count >= tenant.quotas.max_sessions:
            raise QuotaExceeded(
                f"tenant {tenant.name} has {count} sessions (quota {tenant.quotas.max_sessions})"
            )
        session = Session(self.etcd, ttl=ttl, keepalive=False)
        revision = self.etcd.put(
            self.keys.session(tenant.name, session.id), b"", lease=session.id, timeout=timeout
        )
        HUB_SESSIONS_OPENED.inc()
        return pb.OpenSessionResponse(
            session_id=session.id,
            ttl_seconds=session.ttl,
            read_key=self.tenants.read_key(tenant.name),
            revision=revision,
        )

    @streaming
    def KeepAlive(
        self, requests: Iterator[pb.KeepAliveRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.KeepAliveResponse]:
        tenant = self._tenant(context)
        owned: set[int] = set()
        HUB_SESSIONS.inc()
        try:
            for request in requests:
                if request.session_id not in owned:
                    self._own_session(tenant, request.session_id, MAX_CALL_SECONDS)
                    owned.add(request.session_id)
                ttl = self.etcd.lease_keepalive(request.session_id, timeout=MAX_CALL_SECONDS)
                yield pb.KeepAliveResponse(session_id=request.session_id, ttl_seconds=ttl)
        finally:
            HUB_SESSIONS.dec()

    @unary
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        self._own_session(tenant, request.session_id, timeout)
        self.etcd.lease_revoke(request.session_id, timeout=timeout)
        return pb.CloseSessionResponse()

    # -- versions --------------------------------------------------------------------------

    @unary
    def Publish(
        self, request: pb.PublishRequest, context: grpc.ServicerContext
    ) -> pb.PublishResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        model = validate_name(request.model, "model")
        version = validate_version(request.version)
        manifest = request.manifest.SerializeToString()
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise InvalidArgument(
                f"manifest is {len(manifest)} bytes; the limit is {MAX_MANIFEST_BYTES}"
            )
        if not request.manifest.tensors:
            raise InvalidArgument("manifest lists no tensors")
        holder = holder_from_pb(request.holder, default_state=HolderState.COMPLETE)
        self._own_session(tenant, holder.session, timeout)
        versions = self._versions(tenant)
        self._check_model_quota(tenant, versions, model, timeout)
        if request.shard_count:
            published = versions.publish_shard(
                tenant.name,
                model,
                version,
                request.shard_index,
                request.shard_count,
                manifest,
                holder,
                timeout=timeout,
            )
        else:
            published = versions.publish(
                tenant.name, model, version, manifest, holder, timeout=timeout
            )
        return pb.PublishResponse(
            version=published.version, revision=published.revision, visible=published.visible
        )

    def _check_model_quota(
        self, tenant: Tenant, versions: VersionRegistry, model: str, timeout: float
    ) -> None:
        kv, _ = self.etcd.get(self.keys.latest(tenant.name, model), timeout=timeout)
        if kv is not None:
            return
        models = versions.models(tenant.name, timeout=timeout)
        if model not in models and len(models) >= tenant.quotas.max_models:
            raise QuotaExceeded(
                f"tenant {tenant.name} has {len(models)} models (quota {tenant.quotas.max_models})"
            )

    @unary
    def Latest(self, request: pb.LatestRequest, context: grpc.ServicerContext) -> pb.LatestResponse:
        tenant = self._tenant(context)
        version, revision = self._versions(tenant).latest(
            tenant.name, validate_name(request.model, "model"), timeout=self._timeout(context)
        )
        return pb.LatestResponse(version=version, revision=revision)

    @streaming
    def Watch(
        self, request: pb.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchEvent]:
        tenant = self._tenant(context)
        model = validate_name(request.model, "model")
        if request.start_revision <= 0:
            raise InvalidArgument("start_revision must be explicit and positive")
        HUB_WATCHES.inc()
        sub = self._fanout.subscribe(tenant.name, model, request.start_revision)
        try:
            while context.is_active():
                try:
                    message = sub.get(timeout=0.25)
                except Exception:
                    if context.is_active():
                        raise
                    return  # cancelled by a stopping server, whose etcd client may be closed
                if message is not None:
                    yield message
        finally:
            self._fanout.unsubscribe(tenant.name, model, sub)
            HUB_WATCHES.dec()

    @unary
    def Resolve(
        self, request: pb.ResolveRequest, context: grpc.ServicerContext
    ) -> pb.ResolveResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        model = validate_name(request.model, "model")
        versions = self._versions(tenant)
        version = request.version
        if version == 0:
            version, _ = versions.latest(tenant.name, model, timeout=timeout)
            if version == 0:
                raise VersionNotFound(f"{model} has no published version")
        info = versions.describe(tenant.name, model, validate_version(version), timeout=timeout)
        token, expiry = issue_read_token(
            self.tenants.read_key(tenant.name), tenant.name, model, version
        )
        response = pb.ResolveResponse(
            version=version,
            holders=[holder_to_pb(h) for h in info.holders],
            read_token=token,
            token_expiry_unix=expiry,
            revision=info.revision,
        )
        if info.shards:
            for shard in info.shards:
                response.shards.append(pb.Manifest.FromString(shard.manifest))
        else:
            response.manifest.ParseFromString(info.manifest)
        return response

    # -- holders ---------------------------------------------------------------------------

    @unary
    def RegisterHolder(
        self, request: pb.RegisterHolderRequest, context: grpc.ServicerContext
    ) -> pb.RegisterHolderResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        holder = holder_from_pb(request.holder)
        self._own_session(tenant, holder.session, timeout)
        fence = self._holders(tenant).register(
            tenant.name,
            validate_name(request.model, "model"),
            validate_version(request.version),
            holder,
            timeout=timeout,
        )
        return pb.RegisterHolderResponse(fence=fence, revision=fence)

    @unary
    def UpdateHolder(
        self, request: pb.UpdateHolderRequest, context: grpc.ServicerContext
    ) -> pb.UpdateHolderResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        holder = holder_from_pb(request.holder)
        self._own_session(tenant, holder.session, timeout)
        self._holders(tenant).update_state(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            holder, request.holder.fence, timeout=timeout,
        )  # fmt: skip
        return pb.UpdateHolderResponse()

    @unary
    def ReleaseHolder(
        self, request: pb.ReleaseHolderRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseHolderResponse:
        tenant = self._tenant(context)
        revision = self._holders(tenant).release(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            request.holder, force=request.force, timeout=self._timeout(context),
        )  # fmt: skip
        return pb.ReleaseHolderResponse(revision=revision)

    @unary
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        self._own_session(tenant, request.session_id, timeout)
        revision = self._holders(tenant).pin(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            request.pin_id, request.session_id, timeout=timeout,
        )  # fmt: skip
        return pb.PinResponse(revision=revision)

    @unary
    def Unpin(self, request: pb.UnpinRequest, context: grpc.ServicerContext) -> pb.UnpinResponse:
        tenant = self._tenant(context)
        revision = self._holders(tenant).unpin(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            request.pin_id, timeout=self._timeout(context),
        )  # fmt: skip
        return pb.UnpinResponse(revision=revision)

    @unary
    def ElectSeed(
        self, request: pb.ElectSeedRequest, context: grpc.ServicerContext
    ) -> pb.ElectSeedResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        self._own_session(tenant, request.session_id, timeout)
        claim = self._holders(tenant).elect_seed(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            request.dc, request.holder, request.session_id, timeout=timeout,
        )  # fmt: skip
        return pb.ElectSeedResponse(seed=claim.seed, is_seed=claim.is_seed, revision=claim.revision)

    # -- listing ---------------------------------------------------------------------------

    @unary
    def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        versions = self._versions(tenant)
        response = pb.ListModelsResponse()
        for model in versions.models(tenant.name, timeout=timeout):
            latest, revision = versions.latest(tenant.name, model, timeout=timeout)
            response.models.append(
                pb.ModelSummary(
                    name=model,
                    latest=latest,
                    versions=versions.versions(tenant.name, model, timeout=timeout),
                )
            )
            response.revision = max(response.revision, revision)
        if not response.revision:
            response.revision = self.etcd.get(self.keys.tenant(tenant.name), timeout=timeout)[1]
        return response

    @unary
    def Inspect(
        self, request: pb.InspectRequest, context: grpc.ServicerContext
    ) -> pb.InspectResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        model = validate_name(request.model, "model")
        versions = self._versions(tenant)
        latest, _ = versions.latest(tenant.name, model, timeout=timeout)
        version = request.version or latest
        info = versions.describe(tenant.name, model, validate_version(version), timeout=timeout)
        response = pb.InspectResponse(
            version=version,
            latest=latest,
            holders=[holder_to_pb(h) for h in info.holders],
            pins=info.pins,
            seeds=info.seeds,
            published_revision=info.published_revision,
            revision=info.revision,
            retained=version in versions.retained(tenant.name, model, timeout=timeout),
        )
        if not info.shards:
            response.manifest.ParseFromString(info.manifest)
        return response

    # -- admin -----------------------------------------------------------------------------

    @unary
    def CreateTenant(
        self, request: pb.CreateTenantRequest, context: grpc.ServicerContext
    ) -> pb.CreateTenantResponse:
        token = _bearer(context)
        if token is None or not _same(token_hash(token), self._admin_hash):
            raise PermissionDenied("CreateTenant needs the admin token")
        defaults = Quotas()
        quotas = Quotas(
            max_models=request.quotas.max_models or defaults.max_models,
            max_retained_versions=request.quotas.max_retained_versions
            or defaults.max_retained_versions,
            max_sessions=request.quotas.max_sessions or defaults.max_sessions,
        )
        tenant_token = self.tenants.create(request.name, quotas)
        return pb.CreateTenantResponse(name=request.name, token=tenant_token)


def _bearer(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode()
            if text.startswith("Bearer "):
                return text[len("Bearer ") :].strip()
    return None


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a, b)
