"""The SDK's unary hub calls, typed: `rpc("Latest", request)` is a `pb.LatestResponse` to
mypy, not `Any`.

The generated gRPC stub has no types, so the client's calls were `getattr(stub, name)(...)`
answering `Any`, and a wrong field of an answer went unnoticed until it ran. `Rpc` is the
call's type (one overload per method: its request and its answer), and `HubRpc` the one
implementation: a deadline on every call, the tenant's metadata, errors back as
`TensorHubError`s, and `SessionExpired` reported to the session at once so that its
recovery starts without waiting for the next renewal to fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, overload

import grpc

from ros.client.session import ClientSession
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


class HubRpc:
    """`Rpc` over one channel's stub, for one tenant: what `ClientBase._rpc` is."""

    def __init__(
        self,
        stub: Any,
        metadata: tuple[tuple[str, str], ...],
        timeout: Callable[[], float],
        session: Callable[[], ClientSession | None],
    ) -> None:
        self._stub = stub  # the generated stub: untyped, hence `Rpc`
        self._metadata = metadata
        self._timeout = timeout  # the client's default deadline
        self._session = session  # the session in use (None while the first one opens)

    def __call__(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Call `method` with a deadline; errors come back as TensorHubErrors.

        `SessionExpired` means the hub found our session gone: recovery (a new session,
        every held version re-registered) starts at once instead of when the next renewal
        fails. (Another `LeaseLost`, about one holder record, leaves the session alone.)
        """
        session = self._session()  # the one the call runs under, not a later one
        call: grpc.UnaryUnaryMultiCallable[Any, Any] = getattr(self._stub, method)
        try:
            return call(
                request,
                timeout=self._timeout() if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, method)  # UNKNOWN: OutcomeUnknown only for writes
            if isinstance(error, SessionExpired) and session is not None:
                session.expire(f"the hub answered {method} with: {error}")
            raise error from None
