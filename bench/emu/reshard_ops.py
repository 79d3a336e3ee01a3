"""A participant's commands for `tensorhub bench reshard`: a trainer rank publishes its shard
of the recorded Llama (`bench.reshard_layout`), Megatron-style, or a one-host trainer the
whole model; a rollout worker reads its blocks of a version (the ones vLLM's loaders give
its TP rank) with `fetch_slices`, in its layout (a holder of its blocks) or without one
(today's readers of slices, which hold nothing).

Timing is taken in the participant's own process: a publish from the call to its return
(the version visible), a read from the call to its return (every byte verified), and the
read's first round of chunk requests (`ReadStarts`: what the read spent before it, in hub
calls, is its start delay). The
model's bytes are drawn from a seed per version (`tensors`), so the orchestrator can
compute the digest each worker's blocks must have.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

import ros
from bench.emu.model import digest
from bench.reshard_layout import BenchModel, bench_model, load, trainer_placements
from ros.client.handles import Publication
from ros.client.hooks import RangeReader, RoundReader
from transport.boxes import Box
from transport.store import HeldVersion


def tensors(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """float32 tensors of `shapes` drawn from `seed` (the same on every host), by name."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randint(
            -(2**31), 2**31 - 1, shapes[name], generator=gen, dtype=torch.int32
        ).view(torch.float32)
        for name in sorted(shapes)
    }


def block_digest(model: Mapping[str, torch.Tensor], boxes: Mapping[str, Box]) -> str:
    """The digest of a worker's blocks cut out of the whole `model`, by name."""
    cut = {n: model[n][boxes[n].slices_in(Box((0,) * model[n].dim(), model[n].shape))]
           for n in sorted(boxes)}  # fmt: skip
    return digest(cut)


class ReadStarts:
    """When this participant's client first asked a holder for chunks of each version (its
    first read round, from a peer or the trainer's shards, after every hub call before
    it): the client's read hook (`ros.client.hooks.ClientHooks.read`)."""

    def __init__(self) -> None:
        self._first: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def hook(self, read: RoundReader) -> RoundReader:
        def timed(tenant: str, model: str, version: int, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._first.setdefault((model, version), time.monotonic())
            return read(tenant, model, version, *args, **kwargs)

        return timed

    def range_hook(self, read: RangeReader) -> RangeReader:
        """The same for a first reader's reads of byte ranges (`ClientHooks.ranges`)."""

        def timed(source: Any, dest: HeldVersion, *args: Any, **kwargs: Any) -> int:
            _, model, version = dest.key
            with self._lock:
                self._first.setdefault((model, version), time.monotonic())
            return int(read(source, dest, *args, **kwargs))

        return timed

    def take(self, model: str, version: int) -> float | None:
        with self._lock:
            return self._first.pop((model, version), None)


class ReshardRole:
    """One participant's part in `bench reshard`: a trainer rank or a rollout worker."""

    def __init__(self, hub: Callable[[], ros.Hub], starts: ReadStarts | None = None) -> None:
        self._hub = hub
        self._starts = starts or ReadStarts()
        self._model: BenchModel | None = None
        self._pubs: dict[int, Publication] = {}
        self._held: set[int] = set()

    def reshard_setup(self, tp: int, layers: int) -> Any:
        """Load the recorded layout at TP `tp` with `layers` layers; this client's holder."""
        self._model = bench_model(load(), tp, layers)
        return {"holder": self._hub().holder_name, "nbytes": self._model.nbytes}

    def _bench(self) -> BenchModel:
        if self._model is None:
            raise RuntimeError("reshard_setup first")
        return self._model

    def shard_publish(self, model: str, version: int, seed: int, chunk: int, rank: int,
                      ranks: int) -> Any:  # fmt: skip
        """Publish rank `rank` of `ranks` of version `version` (`ranks` 1: the whole model)."""
        whole = tensors(self._bench().shapes, seed + version)
        start = time.monotonic()
        if ranks == 1:
            pub = self._hub().publish(model, version, whole, chunk_size=chunk)
        else:
            boxes = trainer_placements(self._bench().shapes, rank, ranks)
            own, placements = {}, {}
            for name, (shape, box) in boxes.items():
                own[name] = whole[name][box.slices_in(Box((0,) * len(shape), shape))].contiguous()
                if box.shape != shape:
                    placements[name] = (shape, box.offsets)
            pub = self._hub().publish(model, version, own, shard=(rank, ranks),
                                      placements=placements, chunk_size=chunk)  # fmt: skip
        end = time.monotonic()
        self._pubs[version] = pub
        return {"t0": start, "t1": end}

    def reshard_declare(self, model: str, layout: str) -> Any:
        """Declare `layout` (every TP rank's blocks) to the hub, as a vLLM rollout does at
        start (`ros.integrations.vllm.declare_layout`): the versions published after it
        carry the publisher's checksums of each worker's blocks."""
        bench = self._bench()
        workers = [
            {
                n: ros.Slice(torch.empty(b.shape, dtype=torch.float32), b.offsets, bench.shapes[n])
                for n, b in sorted(boxes.items())
            }
            for boxes in bench.workers
        ]
        return {"revision": self._hub().declare_layout(model, layout, workers)}

    def read_blocks(self, model: str, version: int, rank: int, layout: str | None,
                    rate_floor: float, timeout: float = 120.0) -> Any:  # fmt: skip
        """Read TP rank `rank`'s blocks of `version` (in `layout`: holding them after)."""
        bench = self._bench()
        boxes = bench.workers[rank]
        slices = {
            n: ros.Slice(torch.empty(b.shape, dtype=torch.float32), b.offsets, bench.shapes[n])
            for n, b in sorted(boxes.items())
        }
        self._starts.take(model, version)
        start = time.monotonic()
        got = self._hub().fetch_slices(model, version, slices=slices, layout=layout,
                                       timeout=timeout, rate_floor=rate_floor)  # fmt: skip
        end = time.monotonic()
        first_read = self._starts.take(model, version)
        if layout is not None:
            self._held.add(version)
        return {
            "t0": start,
            "t1": end,
            "read_start": first_read,  # None: no chunk was asked for
            "digest": digest({n: slices[n].tensor for n in sorted(slices)}),
            "bytes_per_source": got.bytes_per_source,
            "from_trainer": sorted(got.from_trainer),
            "served": got.served,
            "block_bytes": bench.block_bytes(rank),
        }

    def reshard_release(self, model: str, version: int) -> Any:
        """Let go of `version`: the trainer's publication, a worker's blocks."""
        pub = self._pubs.pop(version, None)
        if pub is not None:
            pub.release(force=True)
        if version in self._held:
            self._held.discard(version)
            self._hub().release_blocks(model, version)
        return {}
