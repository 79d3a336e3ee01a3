"""The publisher's half of delta versions: the copy of what it last published, and the
encoding of the next version against it.

`Hub.publish(..., delta=True)` keeps a copy of the tensors it publishes (`BaseCopies`), on
the host (default) or on their own device: memory for one more copy of the model, opt-in.
The next `delta=True` publish of the same model (and shard) by this client, with the same
layout, encodes every chunk against that copy (`transport.delta`), on the tensors' device.
The encoded chunks become version v of the companion model `{model}.delta` (one uint8
tensor "c{i}" per encoded chunk i), published just before v and served like any version;
v's manifest says which chunks are encoded, their sizes and digests, and the base's chunk
checksums that a reader's memory must match before it applies one (docs/sdk.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.delta_rules import ENCODING, companion_of
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
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        """Bytes of every copy kept now (what `delta=True` costs this client)."""
        with self._lock:
            return sum(c.held.layout.total_bytes for c in self._copies.values())

    def encode(
        self, model: str, shard: int | None, held: HeldVersion, manifest: pb.Manifest
    ) -> Encoded | None:
        """`held` (about to be published with `manifest`) encoded against the kept copy, or
        None: no copy, another layout or checksum kind, or no chunk worth encoding."""
        with self._lock:
            base = self._copies.get((model, shard))
        if (
            base is None
            or base.version >= held.key[2]
            or base.held.layout != held.layout
            or base.checksum != manifest.checksum
        ):
            return None
        sizes: list[int] = []
        digests: list[int] = []
        tensors: dict[str, torch.Tensor] = {}
        for index in range(held.layout.num_chunks):
            encoded = codec.encode(base.held.chunk_parts(index), held.chunk_parts(index))
            if encoded is None:
                sizes.append(0)
                digests.append(0)
                continue
            sizes.append(len(encoded))
            digests.append(codec.digest(encoded))
            tensors[f"c{index}"] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        if not tensors:
            return None
        section = pb.Delta(
            base=base.version, encoding=ENCODING, encoded_bytes=sizes, encoded_xxh3=digests,
            base_checksum=base.sums, companion=companion_of(model),
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
        """Copy `held` (just published with `manifest`) for the next publish to encode
        against, replacing the copy of the version before (its memory is reused when the
        layout is the same). `OutOfMemory` if the copy does not fit."""
        if where not in WHERE:
            raise InvalidArgument(f"base_copy {where!r}: one of {', '.join(WHERE)}")
        key = (model, shard)
        with self._lock:
            old = self._copies.pop(key, None)
        try:
            if old is not None and old.held.layout == held.layout and _same_place(old, held, where):
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
        with self._lock:
            self._copies[key] = _Copy(
                held.key[2], copy, tuple(manifest.chunk_xxh3), manifest.checksum
            )

    def drop(self, model: str | None) -> None:
        """Free the copies of `model` (None: all): its next publish goes whole."""
        with self._lock:
            for key in [k for k in self._copies if model is None or k[0] == model]:
                del self._copies[key]


def _same_place(old: _Copy, held: HeldVersion, where: str) -> bool:
    want = "cpu" if where == "host" else next(iter(held.tensors.values())).device.type
    return all(t.device.type == want for t in old.held.tensors.values())
