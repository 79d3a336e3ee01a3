"""One lease granted by the hub, kept alive over a hub stream (a `Session` owns it).

The session id is the etcd lease id, so when the hub replica carrying the keepalive stream
dies, the stream is reopened (the channel fails over to the next replica in this client's
own shuffled order: `ros.client.channel`) and that replica renews the same lease: the
session, and every holder record on it, survive the replica. The reopening waits a
full-jitter backoff on the client's `RetryPolicy` (by default a uniform draw up to 50 ms,
the bound doubling to 1 s; never past half of what is left of the lease), so the clients
of a replica that died reach the others spread over that window, not in one instant.
If no renewal succeeds before the TTL runs out, the session is lost: `lost` is set and
`on_lost` runs, so the client stops serving at once and re-registers.

Every KeepAlive answer carries the tenant's current read keys (they rotate: `ros.tokens`);
`on_keys` hands them to the holder server's verifier, so a long-lived holder follows rotation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import grpc

from consistency.reopen import Broken, keep_open
from consistency.retry import DEFAULT_POLICY, RetryPolicy
from ros.client.backoff import is_overloaded
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import ReadKey
from tensorhub.errors import Overloaded

log = logging.getLogger(__name__)


def _reopen(exc: BaseException) -> bool:
    """What a lease's keepalive loop retries: a broken stream, or an `Overloaded` refusal."""
    return isinstance(exc, (Broken, Overloaded))


class Lease:
    """Keeps one hub lease alive in a background thread; `lost` says when it is gone."""

    def __init__(
        self,
        stub: hub_pb2_grpc.TensorHubStub,
        metadata: tuple[tuple[str, str], ...],
        opened: pb.OpenSessionResponse,
        on_lost: Callable[[Lease], None] | None = None,
        on_keys: Callable[[list[ReadKey]], None] | None = None,
        policy: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        self.id = int(opened.session_id)
        self.ttl = int(opened.ttl_seconds)
        self.read_keys = read_keys_of(opened.read_keys)
        self._on_keys = on_keys
        self._stub = stub
        self._metadata = metadata
        self._on_lost = on_lost
        # How a broken or refused stream is reopened (the client's `retry`): full-jitter
        # backoff (50 ms doubling to 1 s; refused as Overloaded: 0.2 s to 5 s), never past
        # half of what is left of the lease. Its sleep, when set, replaces the stop wait.
        self._policy = policy
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._call: Any = None  # the live KeepAlive call, cancelled by stop()
        self._expires_at = time.monotonic() + self.ttl
        self.renewals = 0  # renewals the hub confirmed (the first is sent at once)
        self.streams_opened = 0  # KeepAlive streams opened: 1, plus one per reopening
        self._thread = threading.Thread(
            target=self._run, name=f"hub-session-{self.id:x}", daemon=True
        )
        self._thread.start()

    @property
    def read_key(self) -> ReadKey:
        """The newest read key this session has learned."""
        return self.read_keys[0]

    @property
    def interval(self) -> float:
        return max(self.ttl / 3.0, 0.2)

    def _requests(self, stop: threading.Event) -> Iterator[pb.KeepAliveRequest]:
        while not stop.is_set() and not self._stop.is_set():
            yield pb.KeepAliveRequest(session_id=self.id)
            stop.wait(self.interval)
            if time.monotonic() >= self._expires_at and not self.lost.is_set():
                # The stream is open but silent (a hung replica): the lease is gone by now.
                self._lose("no renewal before the TTL ran out")
                return

    def _run(self) -> None:
        """Keep a KeepAlive stream open until the lease is stopped or lost, in the one
        reopen loop (`consistency.reopen.keep_open`) on the client's `RetryPolicy`. Each
        outage (the breaks since the last renewal) is one backoff schedule: a stream that
        broke after renewing is the first failure of a new one, so the backoff starts over
        after every renewal; one refused as `Overloaded` waits on the slower schedule; no
        wait is longer than half of what is left of the lease (a renewal must get through
        before it runs out), and its sleep, when the policy sets one, replaces the stop
        wait."""
        keep_open(
            self._stream,
            policy=replace(self._policy, retry_on=_reopen, tries=None),  # until stopped or lost
            stopped=self._over,
            wait=self._stop.wait,
            progress=lambda: self.renewals,
            until=lambda: self._expires_at,
            on_reopen=self._reopening,
        )
        if not self._stop.is_set() and time.monotonic() >= self._expires_at:
            self._lose("no renewal before the TTL ran out")

    def _stream(self) -> None:
        """One KeepAlive stream, read until it ends. Returns when the lease is stopped or
        lost; raises how the stream ended otherwise (`Broken`, or `Overloaded` when it was
        refused)."""
        stream_stop = threading.Event()
        failure: BaseException
        try:
            self.streams_opened += 1
            call = self._stub.KeepAlive(self._requests(stream_stop), metadata=self._metadata)
            self._call = call
            if self._stop.is_set():
                call.cancel()
            for response in call:
                if response.ttl_seconds <= 0:
                    self._lose("lease expired")
                    return
                self._expires_at = time.monotonic() + response.ttl_seconds
                if response.read_keys:
                    self.read_keys = read_keys_of(response.read_keys)
                    if self._on_keys is not None:
                        self._on_keys(self.read_keys)
                self.renewals += 1
                if self._stop.is_set():
                    call.cancel()
                    return
            failure = Broken("the hub ended the keepalive stream")
        except grpc.RpcError as exc:
            if is_overloaded(exc):
                failure = Overloaded("hub overloaded: the KeepAlive stream was refused")
            else:
                failure = Broken(f"keepalive stream broke ({exc})")
        finally:
            stream_stop.set()
        if self._over():
            return
        raise failure

    def _over(self) -> bool:
        """Whether to stop reopening: stopped, lost, or past the lease's TTL."""
        return self._stop.is_set() or self.lost.is_set() or time.monotonic() >= self._expires_at

    def _reopening(self, exc: BaseException, seconds: float) -> None:
        log.info("session %x: %s; reopening in %.2fs", self.id, exc, seconds)

    def expire(self, why: str) -> None:
        """Declare the session lost now (the hub said so); idempotent."""
        self._lose(why)

    def _lose(self, why: str) -> None:
        if self.lost.is_set():
            return
        log.warning("session %x lost: %s", self.id, why)
        self.lost.set()
        if self._on_lost is not None:
            self._on_lost(self)

    def stop(self) -> None:
        """Stop renewing (the lease then expires by itself unless the hub revokes it)."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=2)


def read_keys_of(keys: Iterable[pb.ReadKey]) -> list[ReadKey]:
    """Read keys from a hub answer, newest first."""
    return sorted((ReadKey(int(k.id), bytes(k.key)) for k in keys), key=lambda k: -k.id)
