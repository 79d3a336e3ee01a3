"""What `tensorhub fetch` writes, and in which pieces it fills it.

A version is written as `save_pretrained` writes a model: its tensors, in the order they have
in the version, cut into files of at most `max_shard_bytes` (`model-00001-of-00003.
safetensors`, ..., a tensor larger than that alone in its file) with
`model.safetensors.index.json`, or one `model.safetensors` when one file holds them all.
A model-parallel version is written whole: each tensor with its global shape, assembled from
the shards' blocks (`global_tensors`).

The bytes are fetched in batches (`batches`) of pieces: a tensor, or a block of consecutive
rows of one (`pieces`), in file order. A batch is one `fetch_slices` call, which stages in
memory the chunks of the version that hold its pieces: a batch is closed before those chunks
exceed `budget` bytes, so the memory a fetch uses beyond its baseline is about twice the
budget (the staged chunks, and the pieces copied out of them) however large the model is.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ros.cli.safetensors_io import Spec, file_order, header_bytes
from ros.client.manifest import layout_of, placement_of
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from transport.boxes import Box, byte_span, chunks_for
from transport.layout import Layout, torch_dtype

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def global_tensors(parts: Sequence[pb.Manifest]) -> list[Spec]:
    """The version's tensors, whole, in the order of the version's flat space (shard 0's
    first); `InvalidArgument` where shards disagree on a tensor's dtype or global shape."""
    found: dict[str, Spec] = {}
    for index, manifest in enumerate(parts):
        for entry in sorted(manifest.tensors, key=lambda e: e.offset):
            glob, _ = placement_of(entry)
            spec = Spec(entry.name, torch_dtype(entry.dtype), glob)
            known = found.setdefault(entry.name, spec)
            if known != spec:
                raise InvalidArgument(
                    f"tensor {entry.name!r}: shard {index} has {spec.dtype} {list(glob)}, "
                    f"an earlier shard {known.dtype} {list(known.shape)}"
                )
    return list(found.values())


@dataclass
class OutFile:
    """One safetensors file of the output: its name, tensors in data order, header."""

    name: str
    specs: list[Spec]
    header: bytes = b""

    def __post_init__(self) -> None:
        self.specs = file_order(self.specs)
        self.header = header_bytes(self.specs)

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(s.nbytes for s in self.specs)

    def offsets(self) -> dict[str, int]:
        """Where each tensor's data begins in the file."""
        at, out = len(self.header), {}
        for s in self.specs:
            out[s.name] = at
            at += s.nbytes
        return out


def plan_files(specs: Sequence[Spec], max_shard_bytes: int) -> list[OutFile]:
    """`specs` cut into files as `save_pretrained(max_shard_size=...)` cuts a model: in
    order, a new file when the next tensor would pass the size; a larger tensor alone."""
    if max_shard_bytes <= 0:
        raise InvalidArgument(f"--max-shard-size must be positive, got {max_shard_bytes}")
    groups: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if groups[-1] and size + s.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    if len(groups) == 1:
        return [OutFile(SINGLE, groups[0])]
    n = len(groups)
    return [OutFile(f"model-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]


@dataclass(frozen=True)
class Piece:
    """A block of one tensor, contiguous in it (consecutive rows, or part of one row, ...),
    written to `file` at byte `at`."""

    file: int
    spec: Spec
    box: Box
    at: int

    @property
    def nbytes(self) -> int:
        return self.box.volume * self.spec.dtype.itemsize


def pieces(files: Sequence[OutFile], limit: int) -> Iterator[Piece]:
    """Every tensor of `files` in file order, as blocks of at most `limit` bytes where it
    is larger (split along its first dimension, then its next, ...)."""
    for number, out in enumerate(files):
        starts = out.offsets()
        for spec in out.specs:
            at = starts[spec.name]
            for box in _split(spec.shape, spec.dtype.itemsize, limit):
                piece = Piece(number, spec, box, at)
                at += piece.nbytes
                yield piece


def _split(shape: tuple[int, ...], itemsize: int, limit: int) -> Iterator[Box]:
    """Row-major contiguous blocks of a tensor of `shape`, each at most `limit` bytes when a
    single element allows, in memory order."""
    whole = Box((0,) * len(shape), shape)
    if not shape or whole.volume * itemsize <= limit:
        yield whole
        return
    yield from _split_from(shape, (), itemsize, limit)


def _split_from(
    shape: tuple[int, ...], prefix: tuple[int, ...], itemsize: int, limit: int
) -> Iterator[Box]:
    """Blocks of the sub-tensor at index `prefix` (its leading coordinates)."""
    dim = len(prefix)
    rest = shape[dim + 1 :]
    row = math.prod(rest) * itemsize  # bytes of one index along `dim`
    if row <= limit or not rest:
        step = max(1, limit // max(row, 1))
        for lo in range(0, shape[dim], step):
            n = min(step, shape[dim] - lo)
            yield Box((*prefix, lo, *(0,) * len(rest)), (*(1,) * dim, n, *rest))
        return
    for i in range(shape[dim]):
        yield from _split_from(shape, (*prefix, i), itemsize, limit)


@dataclass
class Batch:
    """Pieces fetched with one `fetch_slices` call, and the chunk bytes it stages."""

    pieces: list[Piece] = field(default_factory=list)
    staged: int = 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


class ChunkCost:
    """Which chunks of which source (the version, or each shard) a piece needs."""

    def __init__(self, parts: Sequence[pb.Manifest]) -> None:
        self._layouts: list[Layout] = [layout_of(m) for m in parts]
        self._specs = [{s.name: s for s in layout.tensors} for layout in self._layouts]
        self._held: list[dict[str, Box]] = [
            {e.name: placement_of(e)[1] for e in m.tensors} for m in parts
        ]

    def chunks(self, piece: Piece) -> set[tuple[int, int]]:
        """(source, chunk) pairs holding the piece's bytes (a whole tensor: one source)."""
        out: set[tuple[int, int]] = set()
        covered = 0
        for source, (layout, held) in enumerate(zip(self._layouts, self._held, strict=True)):
            box = held.get(piece.spec.name)
            common = None if box is None else box.intersect(piece.box)
            if box is None or common is None or common.volume == 0:
                continue
            spec = self._specs[source][piece.spec.name]
            first, end = byte_span(box, common, piece.spec.dtype.itemsize)
            out.update((source, c) for c in chunks_for(layout, spec, first, end))
            covered += common.volume
            if covered >= piece.box.volume:
                break
        return out

    def chunk_bytes(self, source: int) -> int:
        return self._layouts[source].chunk_size


def batches(all_pieces: Sequence[Piece], cost: ChunkCost, budget: int) -> Iterator[Batch]:
    """`all_pieces` in order, grouped so that the chunks a batch stages stay within
    `budget` bytes (a piece that alone needs more is a batch of its own), with one piece of
    each tensor at most."""
    batch = Batch()
    chunks: set[tuple[int, int]] = set()
    names: set[str] = set()
    for piece in all_pieces:
        new = cost.chunks(piece) - chunks
        more = sum(cost.chunk_bytes(s) for s, _ in new)
        # one `fetch_slices` call takes one block per tensor: a second block of the same
        # tensor starts the next batch
        if batch.pieces and (batch.staged + more > budget or piece.spec.name in names):
            yield batch
            batch, chunks, names = Batch(), set(), set()
            new = cost.chunks(piece)
            more = sum(cost.chunk_bytes(s) for s, _ in new)
        batch.pieces.append(piece)
        batch.staged += more
        chunks |= new
        names.add(piece.spec.name)
    if batch.pieces:
        yield batch
