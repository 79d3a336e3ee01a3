"""What a fetch reports: `FetchStats`, and the error it raises when no holder is left."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorhub.errors import (
    DeadlineExceeded,
    IntegrityError,
    PermissionDenied,
    TensorHubError,
    VersionUnavailable,
)
from transport.planner import ChunkScheduler


@dataclass
class FetchStats:
    """What one fetch moved, for tests and metrics. Bytes are payload bytes."""

    bytes_per_source: dict[str, int] = field(default_factory=dict)
    refetched_bytes: int = 0  # bytes of chunks received again after a failed attempt
    discarded_bytes: int = 0  # bytes received in failed attempts (partial or rejected)
    chunks: int = 0  # chunks received by this fetch
    duration: float = 0.0
    failed_sources: dict[str, str] = field(default_factory=dict)  # holder id -> why suspected
    slow_sources: dict[str, float] = field(default_factory=dict)  # of those: tricklers, B/s

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_source.values())


def final_error(sched: ChunkScheduler, what: str) -> TensorHubError:
    """The most telling reason a round failed, from why each holder was suspected."""
    reasons = list(sched.failures.values())
    summary = "; ".join(f"{h}: {e}" for h, e in sched.failures.items()) or "no sources"
    if any(isinstance(e, IntegrityError) for e in reasons):
        return IntegrityError(f"{what}: no holder had intact bytes ({summary})")
    if reasons and all(isinstance(e, PermissionDenied) for e in reasons):
        return PermissionDenied(f"{what}: every holder refused the read token ({summary})")
    if reasons and all(isinstance(e, DeadlineExceeded) for e in reasons):
        return DeadlineExceeded(f"{what}: deadline passed ({summary})")
    return VersionUnavailable(f"{what}: no holder left ({summary})")
