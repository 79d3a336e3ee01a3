"""Retention without `force`: what `release()` does when this client is the last complete
holder of a retained version (docs/design.md, "Retention"; docs/design-notes.md, "Retention
without force").

The hub refuses such a release (`RetentionViolation`). Instead of failing, or dropping the
version with `force=True`, the client spills it and keeps serving it, so the caller's memory
is free all the same:

- to host memory (the paper's "offload to CPU"): the tensors are copied once into CPU
  memory this client owns, checked chunk by chunk against their checksums, and swapped in as
  what the holder server serves (`HolderStore.replace`: no gap). The holder record stays as
  it is. At most `budget` bytes are held this way at once; past it the release raises
  `SpillBudgetExceeded` and nothing changes.
- to a safetensors file, when the caller names one (`release(spill=path)`).

A host spill is freed by a sweep at the start of every later release of this client: each
spilled version's record is released with `force=False`. The hub accepts that once the
version is no longer retained (retention deleted it, record and all) or another complete
holder stands in for it, and refuses it otherwise (the spill is kept). The sweep is one
ReleaseHolder per spilled version (a handful: the budget bounds them), oldest first, within
`SWEEP_DEADLINE`; what does not fit waits for the next release, and `close()` frees all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ros.client.holdings import Holdings
from ros.client.records import HolderRecords
from ros.client.spill import map_safetensors, write_safetensors
from ros.metrics import SDK_HOST_SPILL_BYTES, SDK_HOST_SPILLS
from tensorhub.errors import (
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    RetentionViolation,
    SpillBudgetExceeded,
    TensorHubError,
    VersionNotFound,
)
from transport.staging import StagingBuffer
from transport.store import HeldVersion, Key

log = logging.getLogger(__name__)

SPILL_FRACTION = 16  # the default budget: 1/16 of the memory this process may use
SWEEP_DEADLINE = 2.0  # the most one sweep of host spills takes (s)


def host_memory() -> int:
    """The memory this process may use: the machine's, or less where a cgroup limits it."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_spill_budget() -> int:
    """`host_memory() // SPILL_FRACTION` (why: docs/design-notes.md)."""
    return host_memory() // SPILL_FRACTION


@dataclass(frozen=True)
class SpillStats:
    """What `Hub.spills` reports: host spills made, versions and bytes held now, freed."""

    budget: int
    spills: int  # host spills made by this client (each one copy of a version)
    held_versions: int
    held_bytes: int
    freed: int  # host spills freed by a sweep
    file_spills: int


class Retention:
    """One client's releases and spills: the budget, what is spilled to host memory now,
    and counts. It deletes records through `records` and stops serving through `holdings`."""

    def __init__(
        self, records: HolderRecords, holdings: Holdings, budget: int | None = None
    ) -> None:
        if budget is not None and (isinstance(budget, bool) or budget < 0):
            raise InvalidArgument(f"spill_budget must be a number of bytes >= 0, got {budget!r}")
        self.budget = default_spill_budget() if budget is None else int(budget)
        self._records = records
        self._holdings = holdings
        self._lock = threading.Lock()
        self._host: dict[Key, int] = {}  # host-spilled versions: their bytes
        self._copying: set[Key] = set()  # reserved, copy not swapped in yet: not swept
        self._spills = self._freed = self._file_spills = 0

    @property
    def stats(self) -> SpillStats:
        with self._lock:
            return SpillStats(
                self.budget, self._spills, len(self._host), sum(self._host.values()),
                self._freed, self._file_spills,
            )  # fmt: skip

    # -- release ---------------------------------------------------------------------------

    def release(
        self,
        model: str,
        version: int,
        *,
        force: bool,
        timeout: float,
        spill: str | os.PathLike[str] | None,
    ) -> None:
        """Release `model@version`: delete our record and stop serving it, or,
        where the hub refuses (the last complete holder of a retained version), spill it to
        host memory and keep serving it. With `spill`, write it to that file and serve it
        from there (the record stays)."""
        self.sweep()
        if spill is not None:
            self.to_file(model, version, spill, timeout)
            return
        try:
            self._records.release(model, version, force=force)
        except RetentionViolation as refused:
            self.to_host(model, version, timeout, refused)
            return
        self._holdings.drop((self._holdings.tenant, model, version), timeout)

    def to_host(
        self,
        model: str,
        version: int,
        timeout: float,
        refused: RetentionViolation,
    ) -> None:
        """Copy the held version into host memory and serve it from there, within the budget;
        `SpillBudgetExceeded` (nothing changed) past it."""
        key = (self._holdings.tenant, model, version)
        held = self._holdings.get(key)
        if held is None or not held.complete:
            raise refused
        nbytes = held.layout.total_bytes
        with self._lock:
            if key in self._host:
                return  # spilled by an earlier release that timed out on its reads in flight
            used = sum(self._host.values())
            if used + nbytes > self.budget:
                raise SpillBudgetExceeded(
                    f"{refused}. Spilling {model}@{version} to host memory needs {nbytes} "
                    f"bytes, but this client's spill budget has {max(self.budget - used, 0)} "
                    f"of {self.budget} left ({len(self._host)} version(s) spilled); nothing "
                    "was changed. Raise the budget (ros.connect(..., spill_budget=...)), "
                    "spill to a file (release(spill='path.safetensors')), or drop the version "
                    "knowingly (release(force=True))"
                ) from refused
            self._host[key] = nbytes  # reserved before the copy: racing releases see it
            self._copying.add(key)
        try:
            copy = host_copy(held)
        except BaseException:
            with self._lock:
                self._host.pop(key, None)
                self._copying.discard(key)
            raise
        with self._lock:
            self._spills += 1
        SDK_HOST_SPILLS.inc()
        SDK_HOST_SPILL_BYTES.inc(nbytes)
        try:  # swaps the copy in at once, then waits for reads in flight of the caller's memory
            self._holdings.replace(copy, timeout)
        finally:
            with self._lock:
                self._copying.discard(key)
        log.info(
            "%s@%d: last complete holder of a retained version; spilled %d bytes to host "
            "memory, serving it from there until it is no longer retained", model, version, nbytes,
        )  # fmt: skip

    def to_file(
        self,
        model: str,
        version: int,
        path: str | os.PathLike[str],
        timeout: float,
    ) -> None:
        """Write the held version to the safetensors file `path` and serve it from there."""
        key = (self._holdings.tenant, model, version)
        held = self._holdings.get(key)
        if held is None or not held.complete:
            raise InvalidArgument(f"{model}@{version} is not held complete here: nothing to spill")
        write_safetensors(path, held.tensors)
        mapped = HeldVersion.publisher(
            self._holdings.tenant, model, version, map_safetensors(path), held.layout
        )
        check_copy(held, mapped, f"spill of {model}@{version} to {path}")
        self._holdings.replace(mapped, timeout)
        with self._lock:
            self._file_spills += 1
        log.info("%s@%d spilled to %s; serving it from there", model, version, path)

    # -- freeing host spills ----------------------------------------------------------------

    def sweep(self, budget: float = SWEEP_DEADLINE) -> int:
        """Free the host spills the cluster no longer needs (see the module's docstring);
        returns how many were freed. Bounded: one ReleaseHolder per spilled version, oldest
        first, all within `budget` seconds; failures are logged and tried again next time."""
        with self._lock:
            keys = sorted(set(self._host) - self._copying, key=lambda k: (k[1], k[2]))
        end = time.monotonic() + budget
        freed = 0
        for key in keys:
            left = end - time.monotonic()
            if left <= 0:
                break
            _, model, version = key
            try:
                self._records.release(model, version, force=False, timeout=left)
            except RetentionViolation:
                continue  # still retained, and still ours alone: keep serving it
            except VersionNotFound:
                pass  # the version went, and our record with it
            except TensorHubError as exc:
                log.info("host spill of %s@%d kept for now: %s", model, version, exc)
                continue
            try:  # our memory: reads in flight keep their views alive, no need to wait long
                self._holdings.drop(key, min(left, 1.0))
            except DeadlineExceeded as exc:
                log.info("host spill of %s@%d: %s; freed at the next sweep", model, version, exc)
                continue
            with self._lock:
                nbytes = self._host.pop(key, 0)
                self._freed += 1
            SDK_HOST_SPILL_BYTES.dec(nbytes)
            freed += 1
        return freed


def host_copy(held: HeldVersion) -> HeldVersion:
    """A COMPLETE copy of `held` in CPU memory of its own, checked against `held`."""
    tensors = {name: t.detach().to("cpu", copy=True) for name, t in held.tensors.items()}
    _, model, version = held.key
    copy = HeldVersion.publisher(held.key[0], model, version, tensors, held.layout)
    check_copy(held, copy, f"host spill of {model}@{version}")
    return copy


def check_copy(held: HeldVersion, copy: HeldVersion, what: str) -> None:
    """Every chunk of `copy` has `held`'s checksum (the copy's are then cached for serving)."""
    staging = StagingBuffer(held.layout.chunk_size) if held.on_cuda else None
    copy.precompute_checksums()
    for index in range(held.layout.num_chunks):
        if copy.checksum(index) != held.checksum(index, staging):
            raise IntegrityError(
                f"{what}: chunk {index} differs from the version's checksum: the memory it "
                "was served from changed while held (keep the tensors unchanged until "
                "release())"
            )
