"""Whether a chunk a reader received is the one published: the one chunk check every
reader backend runs before it commits a chunk (TCP, RDMA, same-host CUDA IPC).

A chunk passes when its bytes hash to what the holder claimed (`claimed`, the xxh3 of its
CHUNK header over TCP; a one-sided read has no claim) and to what the publisher's manifest
says (`expected`, by the manifest's algorithm: xxh3-64 or wsum64; a wsum64 version with a
delta also to the xxh3-64 its delta section records, `digests`). The bytes are where the
backend put them (`ChunkBytes`): host memory (`HostBytes`: received views, or a host
staging buffer) or device memory (`DeviceBytes`: wsum64 on the GPU, xxh3 after a copy to
the host). A chunk that fails is not committed; the caller counts it discarded
(`FetchState.discard`) and reports CORRUPT.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import xxhash

from tensorhub.errors import IntegrityError
from transport.checks import ChunkChecks
from transport.checksums import WSUM64, wsum64_of_views
from transport.store import HeldVersion


class ChunkBytes(Protocol):
    """A received chunk's bytes, wherever they are: their two checksums on demand."""

    def xxh3(self) -> int: ...

    def wsum64(self) -> int: ...


class HostBytes:
    """A chunk received into host memory (`views`); `xxh3` when hashed on the way in."""

    def __init__(self, views: Sequence[memoryview], xxh3: int | None = None) -> None:
        self._views, self._xxh3 = views, xxh3

    def xxh3(self) -> int:
        if self._xxh3 is None:
            hasher = xxhash.xxh3_64()
            for view in self._views:
                hasher.update(view)
            self._xxh3 = int(hasher.intdigest())
        return self._xxh3

    def wsum64(self) -> int:
        return wsum64_of_views(self._views)


class DeviceBytes:
    """Chunk `index` already in `dest`'s (GPU) memory: wsum64 by kernels where it is; an
    xxh3 costs a copy to the host. `known` is the xxh3 once computed (None before)."""

    def __init__(self, dest: HeldVersion, index: int) -> None:
        self._dest, self._index = dest, index
        self.known: int | None = None

    def xxh3(self) -> int:
        if self.known is None:
            h = xxhash.xxh3_64()
            for seg in self._dest.layout.segments(self._index):
                part = self._dest.flats[seg.tensor][seg.start : seg.start + seg.length].cpu()
                h.update(part.numpy().data)
            self.known = int(h.intdigest())
        return self.known

    def wsum64(self) -> int:
        return self._dest.wsum64(self._index)


class ChunkVerifier:
    """The checks of one fetch: `expected` (the manifest's checksums, by `algorithm`; None:
    no manifest), under `checks` (`transport.checks.STRICT` but in chaos runs). `digests`,
    given with a linear `algorithm` (wsum64) when the manifest records them (a delta
    version's `result_xxh3`), is the xxh3-64 of every chunk, checked too: what a delta
    reader's result is checked against, so that whole and delta readers accept the same
    bytes (docs/security.md, "Delta readers against a publisher of their tenant")."""

    def __init__(
        self,
        expected: Sequence[int] | None,
        algorithm: str,
        checks: ChunkChecks,
        digests: Sequence[int] | None = None,
    ) -> None:
        self.expected, self.algorithm, self.checks = expected, algorithm, checks
        self.digests = digests if algorithm == WSUM64 else None

    def published(self, index: int, got: ChunkBytes, claimed: int | None = None) -> bool:
        """Whether chunk `index` is what the manifest says: its wsum64 (and its xxh3 when
        `digests` are given), or its xxh3 (the holder's `claimed` one when given, already
        checked against the bytes). True without a manifest to check against."""
        if self.expected is None or not self.checks.manifest:
            return True
        if self.algorithm == WSUM64:
            if got.wsum64() != self.expected[index]:
                return False
            if self.digests is None:
                return True
            # over TCP the xxh3 is the claimed one, computed on the way in: no extra pass
            return (claimed if claimed is not None else got.xxh3()) == self.digests[index]
        return (claimed if claimed is not None else got.xxh3()) == self.expected[index]

    def check(
        self, index: int, got: ChunkBytes, claimed: int | None = None, *, via: str = ""
    ) -> IntegrityError | None:
        """Why chunk `index` must not be committed (None: it may). `via` names the path
        in the message ("copied through CUDA IPC")."""
        if claimed is not None and self.checks.checksum and got.xxh3() != claimed:
            return IntegrityError(f"chunk {index} failed its checksum")
        if not self.published(index, got, claimed):
            # intact on the wire but not what was published: the holder's memory changed
            what = f"chunk {index} {via} " if via else f"chunk {index} "
            return IntegrityError(what + "differs from the published version")
        return None
