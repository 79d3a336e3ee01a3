"""Planted bugs: test-only wrappers that break one safety check in a chaos run's clients, so
the run can prove that its checker notices (docs/chaos.md).

A bug is planted by handing the client `ClientHooks` (ros.client.hooks) that wrap one of its
real objects when it is built — never by a switch that production code reads. `chaos run
--planted-bug NAME` puts NAME in each worker's spec; the worker (chaos.worker) builds its
client with `hooks_for(NAME, ...)`. Known names:

- `no-revision-floor`: the client's revision floor, wrapped in `LaxFloor`, accepts answers
  older than the floor.
- `no-version-check`: the reader's rounds, wrapped by `unchecked`, accept chunks of the
  wrong version or with a bad checksum, and skip the check against the publisher's manifest
  checksums (`UNCHECKED`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from consistency.floor import RevisionFloor
from tensorhub.errors import InvalidArgument
from transport.checks import ChunkChecks

if TYPE_CHECKING:  # the SDK pulls in torch: `tensorhub chaos` imports KNOWN without it
    from ros.client.hooks import ClientHooks, RoundReader
    from transport.reader import Round
    from transport.server import ChunkSender

KNOWN = ("no-revision-floor", "no-version-check")

UNCHECKED = ChunkChecks(version=False, checksum=False, manifest=False)
"""The `no-version-check` bug: a reader that takes whatever bytes it is sent."""


class LaxFloor(RevisionFloor):
    """The `no-revision-floor` bug, wrapped around the client's real floor: every answer is
    accepted and becomes the floor, even one older than an answer already seen (a client
    that can go back in time). Facts (`observe`) still reach the real floor."""

    def __init__(self, inner: RevisionFloor | None = None) -> None:
        super().__init__()
        self._inner = inner or RevisionFloor()

    @property
    def value(self) -> int:
        with self._lock:
            return self._floor

    def accept(self, revision: int, what: str = "answer") -> int:
        with self._lock:
            self._floor = revision
        self._inner.observe(revision)
        return revision

    def observe(self, revision: int) -> None:
        self._inner.observe(revision)
        with self._lock:
            self._floor = max(self._floor, revision)


def unchecked(read: RoundReader) -> RoundReader:
    """The `no-version-check` bug, wrapped around the client's real round reader: every
    round runs with `UNCHECKED`."""

    def read_unchecked(*args: Any, **kwargs: Any) -> Round:
        return read(*args, **{**kwargs, "checks": UNCHECKED})

    return read_unchecked


def hooks_for(planted: str, send: ChunkSender | None = None) -> ClientHooks:
    """The hooks of a chaos client: production's with the bug `planted` ("" for none)
    and its holder sending through `send` (a `chaos.holder_faults.Fault` the run flips)."""
    from ros.client.hooks import PRODUCTION

    hooks = PRODUCTION if send is None else replace(PRODUCTION, send=send)
    if planted == "no-revision-floor":
        return replace(hooks, floor=LaxFloor)
    if planted == "no-version-check":
        return replace(hooks, read=unchecked)
    if planted:
        raise InvalidArgument(f"unknown planted bug {planted!r}; known: {KNOWN}")
    return hooks
