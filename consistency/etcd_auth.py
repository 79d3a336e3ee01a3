"""etcd auth for `consistency.etcd.Etcd`: log in, resend once on a refused token, young streams.

With credentials that name a user (`consistency.credentials.EtcdCredentials`), a token
interceptor on every member's channel authenticates on first use and sends the token with
every call. A call that etcd refuses for its token (expired, or the auth store changed)
authenticates again and is sent once more (`Token.resend_refused`): etcd checks the token
before it applies anything, so the refused call had no effect. Streams (watch, lease
keepalive) cannot be re-sent from here, so a stream opens with a token younger than
`STREAM_TOKEN_AGE`, shorter than etcd's token TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import grpc
from etcd3 import etcdrpc

from consistency.credentials import EtcdCredentials
from consistency.retry import is_retryable
from tensorhub.errors import EtcdAuthFailed, TensorHubError

T = TypeVar("T")

# A stream opens with a token at most this old (`Etcd(stream_token_age=)`): etcd checks a
# watch's token at each create and cancels the watch if it expired, and a stream cannot be
# re-sent from here (its owner reopens it). Well under etcd's default token TTL (300 s).
STREAM_TOKEN_AGE = 60.0
_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"

# How etcd words a refused token: expired or unknown, issued before the auth store changed,
# or missing (auth is on and the call carried none).
_TOKEN_REFUSALS = ("invalid auth token", "auth store is old", "user name is empty")

log = logging.getLogger(__name__)


def token_refused(exc: grpc.RpcError) -> bool:
    """Whether etcd refused a call for its auth token (see `_TOKEN_REFUSALS`)."""
    details = exc.details() or ""
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or any(
        words in details for words in _TOKEN_REFUSALS
    )


class Token:
    """The etcd auth token one `Etcd` shares across its members (etcd replicates tokens).

    `refresh(stale)` authenticates again unless another thread already replaced `stale`, so
    a burst of calls refused together costs one Authenticate.
    """

    def __init__(self, credentials: EtcdCredentials, stream_age: float) -> None:
        self._credentials = credentials
        self.stream_age = stream_age
        self._lock = threading.Lock()
        self.value: str | None = None
        self.obtained_at = 0.0

    def refresh(self, stale: str | None, stub: Any, timeout: float) -> None:
        with self._lock:
            if self.value != stale:
                return
            request = etcdrpc.AuthenticateRequest(
                name=self._credentials.user, password=self._credentials.password
            )
            try:
                response = stub.Authenticate(request, timeout=timeout)
            except grpc.RpcError as exc:
                if is_retryable(exc):
                    raise  # a member that cannot answer now: `Etcd.call` tries another
                raise EtcdAuthFailed(
                    f"etcd refused to authenticate user {self._credentials.user!r}: "
                    f"{exc.details()} (check --etcd-user and --etcd-password-file)"
                ) from exc
            self.value = str(response.token)
            self.obtained_at = time.monotonic()

    def resend_refused(self, send: Callable[[], T], stub: Any, timeout: float) -> T:
        """`send()`; if etcd refused the call's auth token, authenticate and send again.

        etcd checks the token before it applies anything, so the refused call had no effect.
        """
        token = self.value
        try:
            return send()
        except grpc.RpcError as exc:
            if not token_refused(exc):
                raise
            log.info("etcd refused the auth token (%s); authenticating again", exc.details())
        self.refresh(token, stub, timeout)
        return send()


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


if TYPE_CHECKING:  # the stubs make the interceptor bases generic; grpc's classes are not
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnary = grpc.StreamUnaryClientInterceptor[Any, Any]
    _StreamStream = grpc.StreamStreamClientInterceptor[Any, Any]
else:
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.UnaryStreamClientInterceptor
    _StreamUnary = grpc.StreamUnaryClientInterceptor
    _StreamStream = grpc.StreamStreamClientInterceptor


class TokenInterceptor(_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream):
    """Adds `token: <etcd auth token>` to every call on one member's channel.

    It authenticates first when there is no token yet; before a stream it also renews a
    token older than `stream_age`. A failed renewal before a stream is logged, not
    raised: the stream then fails as etcd's refusal, which its owner already retries.
    `default_timeout` bounds an Authenticate, and stands in for a call without a deadline.
    """

    def __init__(self, token: Token, stub: Any, default_timeout: float) -> None:
        self._token = token
        self._stub = stub  # an Auth stub on the member's channel without this interceptor
        self._default_timeout = default_timeout

    def _details(self, details: Any, stream: bool) -> _CallDetails:
        default = self._default_timeout
        timeout = details.timeout if details.timeout is not None else default
        token = self._token.value
        stale = token is None or (
            stream and time.monotonic() - self._token.obtained_at > self._token.stream_age
        )
        if stale and details.method != _AUTHENTICATE:
            try:
                self._token.refresh(token, self._stub, min(timeout, default))
            except (grpc.RpcError, TensorHubError) as exc:
                if not stream:
                    raise
                log.warning("could not renew the etcd token before a stream: %s", exc)
        metadata = list(details.metadata or [])
        if self._token.value is not None and details.method != _AUTHENTICATE:
            metadata.append(("token", self._token.value))
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready, getattr(details, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, stream=False), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, stream=True), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details, stream=True), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details, stream=True), requests)
