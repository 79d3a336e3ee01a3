"""A vLLM worker that reads only its blocks of each version, and serves them.

At tensor-parallel size > 1 each worker consumes one block of most checkpoint tensors (its
rows of a column-parallel weight, its columns of a row-parallel one, its vocabulary rows,
whole norms and replicated KV heads). `BlockReceiver` learns those blocks from vLLM's own
loaders (`ros.integrations.vllm_plan.learn_blocks`, once per checkpoint signature), reads
exactly them as a reader in the worker's layout (`Hub.fetch_slices(layout=...)`): from the
workers of another instance that hold the same blocks first, only the rest from the
trainer's shards (a whole version is one shard), each byte checked against the publisher's
checksums, directly or through the checksums the first reader recorded. It then loads them
through vLLM's layerwise reload (`load_blocks`), and holds and serves them until the next
update.

Memory, per worker: its blocks, kept between updates (they are what it serves); during an
update the same memory is read into (its holding is released first, since a reader in a
layout never overwrites memory it serves), plus what the SDK touches of the trainer's
chunks that hold its blocks (`fetch_slices` stages a source shard per read and fills only
the chunks the blocks need, one group of at most `STAGING_BUDGET` at a time). No copy of
the whole checkpoint is made. The load then adds vLLM's own cost: its layerwise reload
materialises one layer at a time (the CPU build also repacks it), each freed once copied
into the model (docs/integrations.md has the figures). A fetch that fails
raises its named error before the model is touched: the model stays on its version (the
blocks' memory may then hold part of the new one, and serves nothing).

Deltas (`delta`, on unless the init info turns it off): the blocks are the base, no copy
is kept. A version published with a delta against the one the blocks hold moves only the
encoded changes of the trainer chunks that hold them, applied to the blocks in place and
checked (`fetch_slices(layout=..., delta=True)`, `ros.client.layout_delta`); what the delta
cannot give is read whole as above.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ros.client.delta_stats import DeltaStats, summed
from ros.client.hub import Hub
from ros.client.manifest import placement_of
from ros.client.slice import Slice
from ros.client.slice_fetch import SliceFetch
from ros.integrations.vllm_plan import TensorInfo, learn_blocks, load_blocks
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from transport.boxes import Box
from transport.layout import dtype_name, torch_dtype
from transport.outcome import FetchStats

log = logging.getLogger(__name__)


def layout_name(tp: int, pp: int = 1) -> str:
    """The layout of a vLLM instance's workers: its tensor- and pipeline-parallel sizes.
    Workers of the same rank in two such instances take the same blocks, so they share a
    block set under it (its id is the digest of the blocks)."""
    return f"vllm-tp{tp}" + (f"-pp{pp}" if pp > 1 else "")


def tensor_infos(resolved: pb.ResolveResponse) -> list[TensorInfo]:
    """Every global tensor of a resolved version (whole, or published as shards), with its
    global shape and dtype, in manifest order."""
    parts = list(resolved.shards) or [resolved.manifest]
    out: dict[str, TensorInfo] = {}
    for part in parts:
        for entry in part.tensors:
            if entry.name not in out:
                glob, _ = placement_of(entry)
                out[entry.name] = TensorInfo(entry.name, glob, torch_dtype(entry.dtype))
    return list(out.values())


class BlockReceiver:
    """Reads, loads and serves one vLLM worker's blocks of `model` (module docstring).
    Not thread-safe: one worker drives it, one update at a time."""

    def __init__(
        self,
        hub: Hub,
        model: str,
        *,
        layout: str,
        cover: Sequence[str] = (),
        serve: bool = True,
        delta: bool = False,
        timeout: float,
    ) -> None:
        self.hub = hub
        self.model = model
        self.layout = layout
        self.cover = tuple(cover)
        self.serve = serve
        self.delta = delta
        self.timeout = timeout
        self.version = 0  # the version last loaded (0: none yet)
        self._infos: list[TensorInfo] = []
        self._boxes: dict[str, Box] = {}
        self._blocks: dict[str, torch.Tensor] = {}
        self._holding: int | None = None  # the version whose blocks this worker serves
        self.last_stats: FetchStats | None = None
        self.last_fetch: SliceFetch | None = None
        self.last_delta: DeltaStats | None = None  # what its delta did (None: read whole)

    @property
    def held_bytes(self) -> int:
        """Bytes of blocks this worker holds and serves now."""
        return self.block_bytes if self._holding is not None else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of this worker's blocks (kept between updates)."""
        return sum(t.numel() * t.element_size() for t in self._blocks.values())

    @property
    def boxes(self) -> dict[str, Box]:
        """The block of each checkpoint tensor this worker consumes."""
        return dict(self._boxes)

    def declaration(self) -> dict[str, tuple[str, list[int], list[int], list[int]]]:
        """Each block this worker consumes as plain data, for `Hub.declare_layout` from the
        driver (`ros.integrations.vllm.declare_layout`): name -> (dtype, global shape,
        offsets, shape). Empty before the first update (the blocks are learned there)."""
        return {
            info.name: (dtype_name(info.dtype), list(info.shape), list(box.offsets),
                        list(box.shape))
            for info in self._infos
            if (box := self._boxes.get(info.name)) is not None
        }  # fmt: skip

    def receive(self, vllm_model: Any, version: int | str = "latest") -> int:
        """Read this worker's blocks of `version` (default: the latest) into its block
        memory, learning the blocks from `vllm_model`'s loaders first when the checkpoint's
        tensors are new. Raises the fetch's named error with the model untouched."""
        number = 0 if version == "latest" else int(version)
        resolved = self.hub.resolve(self.model, number, timeout=self.timeout)
        number = int(resolved.version)
        infos = tensor_infos(resolved)
        if infos != self._infos:
            self._learn(vllm_model, infos)
        self._release()
        slices = {
            name: Slice(self._blocks[name], self._boxes[name].offsets, info.shape)
            for info in self._infos
            if (name := info.name) in self._boxes
        }
        got = self.hub.fetch_slices(
            self.model, number, slices=slices, timeout=self.timeout,
            layout=self.layout, cover=self.cover, delta=self.delta,
        )  # fmt: skip
        self._holding = number if got.served else None
        self.last_fetch = got
        self.last_delta = summed(got.deltas)
        self.last_stats = FetchStats(
            bytes_per_source=dict(got.bytes_per_source), chunks=got.chunks,
            failed_sources=dict(got.failed_sources), slow_sources=dict(got.slow_sources),
        )  # fmt: skip
        return number

    def load(self, vllm_model: Any) -> None:
        """Load the blocks into `vllm_model` (inside the caller's layerwise reload)."""
        load_blocks(vllm_model, self._infos, self._blocks, self._boxes)

    def loaded(self, version: int) -> None:
        """The model runs `version`: keep serving its blocks, or stop (`serve=False`)."""
        self.version = version
        if not self.serve:
            self._release()

    def _learn(self, vllm_model: Any, infos: list[TensorInfo]) -> None:
        """Learn this worker's blocks from its loaders and allocate their memory."""
        self._release()
        boxes = learn_blocks(vllm_model, infos)
        if not boxes:
            raise InvalidArgument(f"{self.model}: the model's loaders took no tensor of it")
        by_name = {i.name: i for i in infos}
        self._blocks = {
            name: torch.empty(box.shape, dtype=by_name[name].dtype) for name, box in boxes.items()
        }
        self._infos, self._boxes = infos, boxes
        whole = sum(_volume(i.shape) * i.dtype.itemsize for i in infos)
        log.info(
            "%s: this worker consumes %d of %d checkpoint bytes (%d tensors, layout %s)",
            self.model, self.block_bytes, whole, len(boxes), self.layout,
        )  # fmt: skip

    def _release(self) -> None:
        """Stop serving the blocks held (the record first, then reads in flight)."""
        if self._holding is not None:
            self.hub.release_blocks(self.model, self._holding, timeout=self.timeout)
            self._holding = None

    def close(self) -> None:
        """Stop serving, free the blocks and close the hub connection."""
        try:
            self._release()
        finally:
            self._blocks = {}
            self.hub.close()


def _volume(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
