"""The publisher's half of delta versions: the copy of what it last published, and the
encoding of the next version against it.

`Hub.publish(..., delta=True)` keeps a copy of the tensors it publishes (`BaseCopies`), on
the host (default) or on their own device: memory for one more copy of the model, opt-in.
The next `delta=True` publish of the same model (and shard) by this client, with the same
layout, encodes every chunk against that copy (`transport.delta`), on the tensors' device.
The encoded chunks become version v of the companion model `{model}.delta` (one uint8
tensor, "encoded": the encoded chunks back to back in chunk order, chunk i after the
sizes of those before it), published just before v and served like any version;
v's manifest says which chunks are encoded, their sizes and digests, and the base's chunk
checksums that a reader's memory must match before it applies one (docs/sdk.md); when v's
checksum is linear (wsum64), also the xxh3-64 of each of v's chunks, which every reader
checks (`result_xxh3`: a weighted sum alone would let a publisher give delta readers other
bytes than whole readers, docs/security.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import LINEAR, XXH3
from tensorhub.delta_rules import ENCODING, TENSOR, companion_of
from tensorhub.errors import InvalidArgument, OutOfMemory
from transport import delta as codec
from transport.store import HeldVersion

WHERE = ("host", "device")


@dataclass(frozen=True)
class _Copy:
    """What a publish left behind for the next: its version, a copy of its tensors (held
    in a `HeldVersion` only to address chunks: nothing serves it), and its chunk checksums
    and their kind."""

    version: int
    held: HeldVersion
    sums: tuple[int, ...]
    checksum: str


@dataclass(frozen=True)
class Encoded:
    """A version encoded against its base: the manifest's section, and the companion's
    tensors (the encoded chunks, host memory)."""

    section: pb.Delta
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


class BaseCopies:
    """Per (model, shard): the copy of the version this client last published with
    `delta=True`. Thread-safe."""

    def __init__(self, tenant: str) -> None:
        self._tenant = tenant
        self._copies: dict[tuple[str, int | None], _Copy] = {}
        # copies that an encode brought to the version it encoded, until that version's
        # publish ends (`keep` records them, `forget` drops them)
        self._advanced: dict[tuple[str, int | None], HeldVersion] = {}
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        """Bytes of every copy kept now (what `delta=True` costs this client)."""
        with self._lock:
            copies = [c.held for c in self._copies.values()] + list(self._advanced.values())
            return sum(held.layout.total_bytes for held in copies)

    def encode(
        self, model: str, shard: int | None, held: HeldVersion, manifest: pb.Manifest
    ) -> Encoded | None:
        """`held` (about to be published with `manifest`) encoded against the kept copy, or
        None: no copy, another layout or checksum kind, or no chunk worth encoding.

        Each chunk of the copy is brought to `held`'s as it is encoded (the changed words
        written, or the chunk copied: `codec.encode(advance=True)`), while both are in the
        cache, instead of a copy of the whole model after the publish: `keep` then records
        it, and a publish that fails drops it (`forget`; the next publish goes whole)."""
        key = (model, shard)
        with self._lock:
            base = self._copies.get(key)
            if (
                base is None
                or base.version >= held.key[2]
                or base.held.layout != held.layout
                or base.checksum != manifest.checksum
            ):
                return None
            del self._copies[key]  # changed from here on: it is the base of nothing else
        encoded = self._encode(model, base, held)  # raised: the copy, half brought, is dropped
        with self._lock:
            self._advanced[key] = base.held
        return encoded

    def _encode(self, model: str, base: _Copy, held: HeldVersion) -> Encoded | None:
        sizes: list[int] = []
        digests: list[int] = []
        # under a linear checksum, the xxh3-64 of every chunk of `held` too: what each
        # reader, delta or whole, checks its chunk against (docs/security.md, "Delta versions")
        results: list[int] | None = [] if base.checksum in LINEAR else None
        blob = bytearray()
        for index in range(held.layout.num_chunks):
            encoded = codec.encode(
                base.held.chunk_parts(index), held.chunk_parts(index), advance=True
            )
            if results is not None:
                results.append(_result_digest(base.held, held, index))
            if encoded is None:
                sizes.append(0)
                digests.append(0)
                continue
            sizes.append(len(encoded))
            digests.append(codec.digest(encoded))
            blob += encoded
        if not blob:
            return None
        tensors = {TENSOR: torch.frombuffer(blob, dtype=torch.uint8)}
        section = pb.Delta(
            base=base.version, encoding=ENCODING, encoded_bytes=sizes, encoded_xxh3=digests,
            base_checksum=base.sums, companion=companion_of(model), result_xxh3=results,
        )  # fmt: skip
        return Encoded(section, tensors)

    def keep(
        self,
        model: str,
        shard: int | None,
        held: HeldVersion,
        manifest: pb.Manifest,
        where: str,
    ) -> None:
        """Keep a copy of `held` (just published with `manifest`) for the next publish to
        encode against, replacing the copy of the version before: the copy its encode
        brought to `held` as it went, or else a copy made now (into the old copy's memory
        when the layout is the same). `OutOfMemory` if the copy does not fit."""
        if where not in WHERE:
            raise InvalidArgument(f"base_copy {where!r}: one of {', '.join(WHERE)}")
        key = (model, shard)
        with self._lock:
            advanced = self._advanced.pop(key, None)
            old = self._copies.pop(key, None)
        if (
            advanced is not None
            and advanced.layout == held.layout
            and _same_place(advanced, held, where)
        ):
            self._record(key, held.key[2], advanced, manifest)
            return
        advanced = None  # a copy elsewhere than asked now: freed
        try:
            if (
                old is not None
                and old.held.layout == held.layout
                and _same_place(old.held, held, where)
            ):
                tensors = old.held.tensors
                for name, t in held.tensors.items():
                    tensors[name].copy_(t)
            else:
                old = None  # its memory is freed with it
                tensors = {
                    name: t.detach().to("cpu" if where == "host" else t.device, copy=True)
                    for name, t in held.tensors.items()
                }
        except RuntimeError as exc:  # torch.OutOfMemoryError is one too
            raise OutOfMemory(
                f"the base copy of {model} for delta=True ({held.layout.total_bytes} bytes "
                f"on the {where}) does not fit: {exc}"
            ) from exc
        copy = HeldVersion.publisher(
            self._tenant, model, held.key[2], tensors, held.layout
        )  # fmt: skip
        self._record(key, held.key[2], copy, manifest)

    def _record(
        self, key: tuple[str, int | None], version: int, copy: HeldVersion, manifest: pb.Manifest
    ) -> None:
        """`copy` holds `version`, just published with `manifest`: the next one's base.
        (`copy.key` may name an earlier version: a copy only addresses chunks.)"""
        with self._lock:
            self._copies[key] = _Copy(version, copy, tuple(manifest.chunk_xxh3), manifest.checksum)

    def forget(self, model: str, shard: int | None) -> None:
        """The publish whose encode brought the copy of (`model`, `shard`) to its version
        failed: drop that copy (the next publish goes whole)."""
        with self._lock:
            self._advanced.pop((model, shard), None)

    def drop(self, model: str | None) -> None:
        """Free the copies of `model` (None: all): its next publish goes whole."""
        with self._lock:
            for kept in (self._copies, self._advanced):
                for key in [k for k in kept if model is None or k[0] == model]:
                    del kept[key]


def _result_digest(copy: HeldVersion, held: HeldVersion, index: int) -> int:
    """xxh3-64 of chunk `index` of `held`, just encoded: over `held`'s host memory (cached
    there: what its holder sends in each CHUNK header), else over the base copy that the
    encode has just brought to the same bytes (host memory by default, still in cache), and
    given to `held`'s cache, so that its holder does not hash the chunk again; a copy on
    the GPU too is copied to the host a chunk at a time."""
    if not held.on_cuda:
        return held.checksum(index)
    digest = codec.chunk_checksum(copy, index, XXH3)
    held.mark_present(index, digest)  # present already: this records its xxh3
    return digest


def _same_place(copy: HeldVersion, held: HeldVersion, where: str) -> bool:
    """Whether `copy` is where `base_copy=where` puts a copy of `held`."""
    want = "cpu" if where == "host" else next(iter(held.tensors.values())).device.type
    return all(t.device.type == want for t in copy.tensors.values())
