"""What publish and fetch return: handles on a version this client holds and serves.

Both obey the mutability contract: `release()` first deletes the holder record (so no new
reader is sent here), then refuses new reads on the data plane and waits (bounded) for reads
in flight, and only then says the memory is free to overwrite.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import torch

from consistency.events import EventKind
from ros.metrics import SDK_TRAINER_STALL
from tensorhub.errors import DeadlineExceeded
from transport.reader import FetchStats

if TYPE_CHECKING:
    from ros.client.delta_stats import DeltaStats
    from ros.client.watch import HubWatch

log = logging.getLogger(__name__)


def _release_into(handle: _Handle, timeout: float, failed: list[BaseException]) -> None:
    """Release `handle` (forced); what it raises goes into `failed`."""
    try:
        handle.release(force=True, timeout=timeout)
    except BaseException as exc:  # handed to the caller's thread, which raises it
        failed.append(exc)


OpenWatch = Callable[[str, int], "HubWatch"]
"""Open a watch of a model's changes from a revision (model, since): what
`Publication.wait_replicated` waits on (`ros.client.watch.HubWatch`)."""


class Releaser(Protocol):
    """How a handle releases its version (`ros.client.retention.Retention`)."""

    def release(
        self,
        model: str,
        version: int,
        *,
        force: bool,
        timeout: float,
        spill: str | os.PathLike[str] | None,
    ) -> None: ...


DEFAULT_RELEASE_TIMEOUT = 30.0


class _Handle:
    def __init__(
        self,
        releaser: Releaser,
        model: str,
        version: int,
        tensors: dict[str, torch.Tensor],
    ) -> None:
        self._releaser = releaser
        self.model = model
        self.version = version
        self.tensors = tensors
        self.released = False
        # the version of `{model}.delta` that serves this one's encoded chunks, when this
        # client publishes or holds it (delta versions): released with this one
        self.companion: _Handle | None = None
        # the views published with this version (format -> its handle): released with it
        self.views: dict[str, _Handle] = {}

    def release(
        self,
        *,
        force: bool = False,
        timeout: float = DEFAULT_RELEASE_TIMEOUT,
        spill: str | os.PathLike[str] | None = None,
    ) -> None:
        """Stop serving this version from its tensors; afterwards their memory may be overwritten.

        If this is the last complete holder of a retained version, the version is copied to
        host memory and served from there until it is no longer retained (within the client's
        `spill_budget`; past it `SpillBudgetExceeded`, a `RetentionViolation`, and nothing
        is changed), or, with `spill`, written to that safetensors file and served from it.
        `force=True` drops it instead.
        """
        for view in self.views.values():  # docs/views.md: served until their version is released
            view.release(force=force, timeout=timeout)
        companion = self.companion  # bytes saved, never needed for a version's data
        if companion is None or companion.released:
            self._release_own(force, timeout, spill)
            return
        # the two releases are independent hub calls: made at once, the caller waits for one
        # round trip, not two (an in-place delta update releases its version first)
        failed: list[BaseException] = []
        other = threading.Thread(
            target=_release_into, args=(companion, timeout, failed),
            name=f"release-{companion.model}@{companion.version}", daemon=True,
        )  # fmt: skip
        other.start()
        try:
            self._release_own(force, timeout, spill)
        finally:
            other.join()
        if failed:
            raise failed[0]

    def _release_own(
        self, force: bool, timeout: float, spill: str | os.PathLike[str] | None
    ) -> None:
        if not self.released:
            self._releaser.release(
                self.model, self.version, force=force, timeout=timeout, spill=spill
            )
            self.released = True

    def __enter__(self) -> _Handle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release with `force=False`: leaving a block keeps the retention rule (the last
        complete holder of a retained version spills it, `release()`). A release that fails
        while an exception leaves the block never masks it: the failure is logged and added
        to that exception as a note, and the exception goes on (the version stays held)."""
        if exc is None:
            self.release()
            return
        try:
            self.release()
        except Exception as error:
            log.warning(
                "leaving a with block of %s@%d by %s: release failed too: %r",
                self.model, self.version, type(exc).__name__, error,
            )  # fmt: skip
            exc.add_note(
                f"while leaving the with block, release() of {self.model}@{self.version} "
                f"failed too, and the version is still held: {type(error).__name__}: {error}"
            )


class Publication(_Handle):
    """A version this client published: `version`, the commit `revision`, and `visible`."""

    def __init__(
        self,
        releaser: Releaser,
        model: str,
        version: int,
        tensors: dict[str, torch.Tensor],
        revision: int,
        visible: bool = True,
        shard: int | None = None,
        *,
        holder_name: str,
        watch: OpenWatch,
    ) -> None:
        super().__init__(releaser, model, version, tensors)
        self._holder_name = holder_name  # this client's, left out of the replicas counted
        self._watch = watch
        self.revision = revision
        self.visible = visible
        self.shard = shard  # model-parallel: the rank's shard

    def __repr__(self) -> str:
        return f"Publication({self.model}@{self.version}, revision={self.revision})"

    def wait_replicated(self, k: int, *, timeout: float = 60.0) -> int:
        """Block until `k` other holders are COMPLETE; returns how many are (trainer stall).

        For a shard of a model-parallel version, only holders of that shard count. Watches
        holder changes from the publish revision (never polls). Raises `DeadlineExceeded` at
        the deadline.
        """
        start = time.monotonic()
        deadline = start + timeout
        complete: set[str] = set()
        me = self._holder_name
        with self._watch(self.model, self.revision) as events:
            while len(complete) < k:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(
                        f"{self.model}@{self.version}: {len(complete)} of {k} replicas complete "
                        f"after {timeout:.1f}s"
                    )
                event = events.get(remaining)
                if event is None or event.version != self.version:
                    continue
                if event.kind is EventKind.HOLDER_UPDATED and event.holder is not None:
                    if event.holder.shard != self.shard:
                        continue
                    if event.holder.complete and event.holder.holder != me:
                        complete.add(event.holder.holder)
                elif event.kind is EventKind.HOLDER_REMOVED:
                    complete.discard(event.holder_name)
                elif event.kind is EventKind.RESYNC:
                    complete = {
                        h.holder
                        for h in event.holders.get(self.version, [])
                        if h.complete and h.holder != me and h.shard == self.shard
                    }
        SDK_TRAINER_STALL.observe(time.monotonic() - start)
        return len(complete)


class Held(_Handle):
    """A version this client fetched: `version`, `tensors`, and the fetch's `stats`."""

    def __init__(
        self,
        releaser: Releaser,
        model: str,
        version: int,
        tensors: dict[str, torch.Tensor],
        stats: FetchStats,
        shard: int | None = None,
    ) -> None:
        super().__init__(releaser, model, version, tensors)
        self.stats = stats
        self.shard = shard  # model-parallel: the one shard fetched
        self.delta: DeltaStats | None = None  # what deltas did, when the fetch used them

    def __repr__(self) -> str:
        return f"Held({self.model}@{self.version}, {len(self.tensors)} tensors)"


@dataclass(frozen=True)
class Handles:
    """Makes the handles of one client: how they release, the client's holder name, and
    how a publication watches its replicas (no handle holds the client itself)."""

    releaser: Releaser
    holder_name: str
    watch: OpenWatch

    def publication(
        self,
        model: str,
        version: int,
        tensors: dict[str, torch.Tensor],
        revision: int,
        visible: bool,
        shard: int | None,
    ) -> Publication:
        return Publication(
            self.releaser, model, version, tensors, revision, visible, shard,
            holder_name=self.holder_name, watch=self.watch,
        )  # fmt: skip

    def held(
        self,
        model: str,
        version: int,
        tensors: dict[str, torch.Tensor],
        stats: FetchStats,
        shard: int | None,
    ) -> Held:
        return Held(self.releaser, model, version, tensors, stats, shard)
