"""What a fetch reports: the typed outcome of each chunk request (`ChunkOutcome`), the
`FetchStats` of a whole fetch, and the error it raises when no holder is left."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tensorhub.errors import (
    DeadlineExceeded,
    IntegrityError,
    PermissionDenied,
    TensorHubError,
    VersionUnavailable,
)
from transport.wire import ErrorCode, Refusal


class ChunkStatus(enum.Enum):
    """How one chunk request to one holder ended. The reader acts on this, never on the
    text of an error: NOT_READY is retried on the same holder (it is still receiving the
    chunk), BUSY on the same holder after a backoff when the caller gave a retry policy
    for it (the SDK does: the holder is full, not faulty), every other status but DONE
    suspects the holder for this round."""

    DONE = "done"  # received, verified and committed
    NOT_READY = "not ready"  # a PARTIAL holder lacks the chunk yet (ErrorCode.NOT_READY)
    BUSY = "busy"  # the holder is at its connection bounds (ErrorCode.BUSY: HolderBusy)
    CORRUPT = "corrupt"  # bytes or header that fail verification (IntegrityError)
    DENIED = "denied"  # the holder refused the read token (ErrorCode.DENIED)
    RELEASED = "released"  # the holder no longer has the version (RELEASED, NOT_HELD)
    FAILED = "failed"  # anything else: I/O, timeout, protocol, a bug


_STATUS_OF_CODE = {
    ErrorCode.NOT_READY: ChunkStatus.NOT_READY,
    ErrorCode.BUSY: ChunkStatus.BUSY,
    ErrorCode.DENIED: ChunkStatus.DENIED,
    ErrorCode.RELEASED: ChunkStatus.RELEASED,
    ErrorCode.NOT_HELD: ChunkStatus.RELEASED,
}


@dataclass(frozen=True)
class ChunkOutcome:
    """The typed result of asking one holder for chunk `index`: its `status`, the error
    for any status but DONE (named, or the OSError as raised), and for DONE its payload
    bytes and whether the holder said it holds the whole version (FLAG_COMPLETE)."""

    index: int
    status: ChunkStatus
    error: BaseException | None = None
    nbytes: int = 0
    complete: bool = False

    @classmethod
    def refused(cls, index: int, refusal: Refusal) -> ChunkOutcome:
        """The outcome of an ERROR frame, by its code (an unknown code: FAILED)."""
        status = ChunkStatus.FAILED
        if refusal.code is not None:
            status = _STATUS_OF_CODE.get(refusal.code, ChunkStatus.FAILED)
        return cls(index, status, refusal.error())

    @classmethod
    def failed(cls, index: int, error: BaseException) -> ChunkOutcome:
        """The outcome of an exception raised while asking (I/O, timeout, rate floor...)."""
        if isinstance(error, IntegrityError):
            return cls(index, ChunkStatus.CORRUPT, error)
        if isinstance(error, PermissionDenied):
            return cls(index, ChunkStatus.DENIED, error)
        return cls(index, ChunkStatus.FAILED, error)


@dataclass
class FetchStats:
    """What one fetch moved, for tests and metrics. Bytes are payload bytes: whole chunks
    and, on a delta fetch, the encoded changes (`encoded_bytes` of them), by holder id."""

    bytes_per_source: dict[str, int] = field(default_factory=dict)
    encoded_bytes: int = 0  # of the bytes above: a delta's encoded chunks (its companions)
    refetched_bytes: int = 0  # bytes of chunks received again after a failed attempt
    discarded_bytes: int = 0  # bytes received in failed attempts (partial or rejected)
    chunks: int = 0  # chunks received by this fetch
    duration: float = 0.0
    failed_sources: dict[str, str] = field(default_factory=dict)  # holder id -> why suspected
    slow_sources: dict[str, float] = field(default_factory=dict)  # of those: tricklers, B/s
    read_tokens: int = 0  # distinct read tokens sent: more than 1 when renewed mid-fetch
    transports: dict[str, str] = field(default_factory=dict)  # holder id -> kind read over
    fallbacks: dict[str, str] = field(default_factory=dict)  # holder id -> why not a better one
    rounds: int = 0  # rounds run (more than 1 when a failed source was re-planned)
    touched: set[int] = field(default_factory=set, repr=False)  # chunks with bytes received
    # in a failed attempt: one received again counts in refetched_bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_source.values())


def final_error(failures: Mapping[str, BaseException], what: str) -> TensorHubError:
    """The most telling reason a round failed, from why each holder was given up on."""
    reasons = list(failures.values())
    summary = "; ".join(f"{h}: {e}" for h, e in failures.items()) or "no sources"
    if any(isinstance(e, IntegrityError) for e in reasons):
        return IntegrityError(f"{what}: no holder had intact bytes ({summary})")
    if reasons and all(isinstance(e, PermissionDenied) for e in reasons):
        return PermissionDenied(f"{what}: every holder refused the read token ({summary})")
    if reasons and all(isinstance(e, DeadlineExceeded) for e in reasons):
        return DeadlineExceeded(f"{what}: deadline passed ({summary})")
    return VersionUnavailable(f"{what}: no holder left ({summary})")


class Moved(Protocol):
    """What counts the bytes a read moved: a `FetchStats`, or a total over several reads
    (`ros.client.slice_fetch.SliceFetch`)."""

    bytes_per_source: dict[str, int]
    chunks: int
    failed_sources: dict[str, str]
    slow_sources: dict[str, float]


def add_moved(into: Moved, got: FetchStats) -> None:
    """Add what one read moved to `into`: bytes per holder, chunks, the holders given up
    on and the slow ones."""
    for source, nbytes in got.bytes_per_source.items():
        into.bytes_per_source[source] = into.bytes_per_source.get(source, 0) + nbytes
    into.chunks += got.chunks
    into.failed_sources.update(got.failed_sources)
    into.slow_sources.update(got.slow_sources)
