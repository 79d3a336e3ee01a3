"""The SDK's unary hub calls, typed: `rpc("Latest", request)` is a `pb.LatestResponse` to
mypy, not `Any`.

The generated gRPC stub has no types; `Rpc` is the call's type (one overload per method:
its request and its answer), and `HubRpc` the one implementation: a deadline on every call,
the tenant's metadata, errors back as `TensorHubError`s, `SessionExpired` reported to the
session at once so that its recovery starts without waiting for the next renewal to fail,
and the client's one retry of a plain call (`UNARY_POLICY`; docs/design-notes.md, "One
retry layer").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol, overload

import grpc

from consistency.retry import UNARY_POLICY, RetryPolicy
from ros.errors import from_rpc_error
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import SessionExpired


class Rpc(Protocol):
    """A unary hub call by method name, typed by its request and answer."""

    @overload
    def __call__(
        self,
        method: Literal["OpenSession"],
        request: pb.OpenSessionRequest,
        timeout: float | None = None,
    ) -> pb.OpenSessionResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["CloseSession"],
        request: pb.CloseSessionRequest,
        timeout: float | None = None,
    ) -> pb.CloseSessionResponse: ...

    @overload
    def __call__(
        self, method: Literal["Publish"], request: pb.PublishRequest, timeout: float | None = None
    ) -> pb.PublishResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["PublishShards"],
        request: Iterator[pb.PublishRequest | bytes],  # bytes: `ros.client.shard_frames`
        timeout: float | None = None,
    ) -> pb.PublishShardsResponse: ...

    @overload
    def __call__(
        self, method: Literal["Latest"], request: pb.LatestRequest, timeout: float | None = None
    ) -> pb.LatestResponse: ...

    @overload
    def __call__(
        self, method: Literal["Resolve"], request: pb.ResolveRequest, timeout: float | None = None
    ) -> pb.ResolveResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["RegisterHolder"],
        request: pb.RegisterHolderRequest,
        timeout: float | None = None,
    ) -> pb.RegisterHolderResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["UpdateHolder"],
        request: pb.UpdateHolderRequest,
        timeout: float | None = None,
    ) -> pb.UpdateHolderResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["ReleaseHolder"],
        request: pb.ReleaseHolderRequest,
        timeout: float | None = None,
    ) -> pb.ReleaseHolderResponse: ...

    @overload
    def __call__(
        self, method: Literal["Pin"], request: pb.PinRequest, timeout: float | None = None
    ) -> pb.PinResponse: ...

    @overload
    def __call__(
        self, method: Literal["Unpin"], request: pb.UnpinRequest, timeout: float | None = None
    ) -> pb.UnpinResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["ListModels"],
        request: pb.ListModelsRequest,
        timeout: float | None = None,
    ) -> pb.ListModelsResponse: ...

    @overload
    def __call__(
        self, method: Literal["Inspect"], request: pb.InspectRequest, timeout: float | None = None
    ) -> pb.InspectResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["DeleteModel"],
        request: pb.DeleteModelRequest,
        timeout: float | None = None,
    ) -> pb.DeleteModelResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["RegisterLayoutHolder"],
        request: pb.RegisterLayoutHolderRequest,
        timeout: float | None = None,
    ) -> pb.RegisterLayoutHolderResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["ResolveLayout"],
        request: pb.ResolveLayoutRequest,
        timeout: float | None = None,
    ) -> pb.ResolveLayoutResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["ResolveLayoutCover"],
        request: pb.ResolveLayoutCoverRequest,
        timeout: float | None = None,
    ) -> pb.ResolveLayoutCoverResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["ReleaseLayoutHolder"],
        request: pb.ReleaseLayoutHolderRequest,
        timeout: float | None = None,
    ) -> pb.ReleaseLayoutHolderResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["DeclareLayout"],
        request: pb.DeclareLayoutRequest,
        timeout: float | None = None,
    ) -> pb.DeclareLayoutResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["RetireLayout"],
        request: pb.RetireLayoutRequest,
        timeout: float | None = None,
    ) -> pb.RetireLayoutResponse: ...

    @overload
    def __call__(
        self,
        method: Literal["DeclaredLayouts"],
        request: pb.DeclaredLayoutsRequest,
        timeout: float | None = None,
    ) -> pb.DeclaredLayoutsResponse: ...


class SessionExpiry(Protocol):
    """What a call needs of the lease it runs under: to declare it lost."""

    def expire(self, why: str) -> None: ...


Expirable = Callable[[], SessionExpiry | None]
"""The lease in use now (None while the first one opens)."""


# Methods safe to send again after UNAVAILABLE: each either reads, or writes under a key the
# hub makes idempotent (our holder record, our pin). `Publish` and `DeleteModel` are not:
# a lost reply is checked by reading back (`ros.client.publishing`), never resent blindly.
IDEMPOTENT = frozenset({
    "OpenSession", "CloseSession", "Latest", "Resolve", "RegisterHolder", "UpdateHolder",
    "ReleaseHolder", "Pin", "Unpin", "ListModels", "Inspect",
    "RegisterLayoutHolder", "ResolveLayout", "ResolveLayoutCover", "ReleaseLayoutHolder",
    "DeclareLayout", "RetireLayout", "DeclaredLayouts",
})  # fmt: skip


class HubRpc:
    """`Rpc` over one channel's stub, for one tenant: the client's every unary hub call.

    Calling it tries an idempotent method on `policy` (`UNARY_POLICY`); `once` is the same
    call tried exactly once, for callers that retry on a policy of their own.
    """

    def __init__(
        self,
        stub: Any,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
        session: Expirable,
        policy: RetryPolicy | None = UNARY_POLICY,
    ) -> None:
        self._stub = stub  # the generated stub: untyped, hence `Rpc`
        self._metadata = metadata
        self._timeout = timeout  # the client's default deadline
        self._session = session  # the lease in use (None while the first one opens)
        self._policy = policy

    @property
    def once(self) -> Rpc:
        """The same calls, each tried once."""
        return HubRpc(self._stub, self._metadata, self._timeout, self._session, None)

    def __call__(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Call `method` within `timeout` (default: the client's); errors come back as
        TensorHubErrors. An idempotent method refused as `Unavailable` is tried again on the
        policy, each try getting what is left of the deadline."""
        budget = self._timeout if timeout is None else timeout
        policy = self._policy
        if policy is None or method not in IDEMPOTENT:
            return self._attempt(method, request, budget)
        deadline = policy.deadline(budget)
        return policy.call(
            lambda: self._attempt(method, request, max(deadline - policy.clock(), 0.01)),
            deadline,
        )

    def _attempt(self, method: str, request: Any, timeout: float) -> Any:
        """One try. `SessionExpired` means the hub found our session gone: recovery (a new
        session, every held version re-registered) starts at once instead of when the next
        renewal fails. (Another `LeaseLost`, about one holder record, leaves the session
        alone.)"""
        session = self._session()  # the one the call runs under, not a later one
        call: grpc.UnaryUnaryMultiCallable[Any, Any] = getattr(self._stub, method)
        try:
            return call(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, method)  # UNKNOWN: OutcomeUnknown only for writes
            if isinstance(error, SessionExpired) and session is not None:
                session.expire(f"the hub answered {method} with: {error}")
            raise error from None
