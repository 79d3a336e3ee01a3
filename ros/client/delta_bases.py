"""Which version a reader's memory holds, so that its next fetch can read a delta against it:
`BaseMemory` for `Hub.fetch(into=T)` (T is the memory of this client's own earlier fetch of
the model), `StagedBases` for `fetch_slices(delta=True)` (the staging copy of each source
shard that its last read left). Both are hints: every chunk is checked against the base's
checksum before a delta is applied to it (`ros.client.delta_chunks`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ros.client.handles import Held
from transport.layout import Layout


class BaseMemory:
    """Which version the memory of each of this client's fetches holds, by the identity of
    that memory (each tensor's data pointer and size): so that a fetch into the same tensors
    knows its base without the caller saying it. Only a hint: the base is checked chunk by
    chunk against checksums before anything is applied. Thread-safe."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int | None], tuple[int, tuple[object, ...]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _identity(tensors: Mapping[str, torch.Tensor]) -> tuple[object, ...]:
        return tuple(
            (name, t.device.type, t.data_ptr(), t.numel() * t.element_size())
            for name, t in sorted(tensors.items())
        )

    def remember(
        self, model: str, shard: int | None, version: int, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        with self._lock:
            self._seen[(model, shard)] = (version, self._identity(tensors))

    def version_in(
        self, model: str, shard: int | None, tensors: Mapping[str, torch.Tensor]
    ) -> int | None:
        """The version this client last fetched into exactly these tensors, if it did."""
        with self._lock:
            seen = self._seen.get((model, shard))
        if seen is None or seen[1] != self._identity(tensors):
            return None
        return seen[0]


@dataclass
class Staged:
    """A `fetch_slices` staging copy kept as the base of the next one (`delta=True`): the
    version it holds, its layout, its tensors, which chunks are filled, and the companion
    its delta came with (served until the copy is replaced or dropped)."""

    version: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    filled: frozenset[int]
    companion: Held | None = None

    def drop(self) -> None:
        if self.companion is not None:
            self.companion.release(force=True)


class StagedBases:
    """Per (model, source shard): the staging copy a `fetch_slices(delta=True)` left. A
    fetch takes it (so two at once never share one) and puts back what it ends with.
    Thread-safe."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int | None], Staged] = {}
        self._lock = threading.Lock()

    def take(self, model: str, shard: int | None) -> Staged | None:
        with self._lock:
            return self._kept.pop((model, shard), None)

    def put(self, model: str, shard: int | None, staged: Staged) -> None:
        with self._lock:
            old = self._kept.pop((model, shard), None)
            self._kept[(model, shard)] = staged
        if old is not None and old.companion is not staged.companion:
            old.drop()

    def drop(self, model: str | None) -> None:
        """Free the copies of `model` (None: all) and release their companions."""
        with self._lock:
            gone = [k for k in self._kept if model is None or k[0] == model]
            dropped = [self._kept.pop(k) for k in gone]
        for staged in dropped:
            staged.drop()

    def nbytes(self) -> int:
        """Host and device memory the kept copies take (what `delta=True` costs)."""
        with self._lock:
            return sum(k.layout.total_bytes for k in self._kept.values())
