"""Carrying `config.json` and tokenizer files in a version's manifest metadata.

A fetched directory is loadable on its own (`from_pretrained(DIR)`) only if the model's
config travels with its weights. The manifest has a metadata map for that (strings, checked
by the hub: at most `MAX_METADATA_ENTRIES` entries and `MAX_METADATA_BYTES` of keys and
values, `ros.manifest_check`). Each carried file is one entry, `tensorhub.file:NAME`, its
bytes zlib-compressed and base64-encoded (JSON shrinks 3-10x, so more fits). Files are taken
in `CARRIED_FILES` order (config first) while they fit; those that do not, and those the
checkpoint left unread as too large (`ros.cli.checkpoint.MAX_CARRIED_FILE_BYTES`), are
named, with their sizes, in `tensorhub.files.left`, and `publish` and `fetch` both say so.
A real `tokenizer.json` (several MB) does not fit the 64 KiB the hub allows: it is left
behind, and the fetched directory then has the model's config but not that tokenizer file.

NAME is one of `CARRIED_FILES` (`ros.manifest_check`'s allow-list, which the hub enforces
too): `encode` and `decode` refuse any other with `InvalidManifest`, so a publisher cannot
make a fetch write a weights file, an index, `tensorhub.json`, a path or a name with a NUL
byte. `decode` also bounds what a publisher's entry may decompress to
(`MAX_CARRIED_FILE_BYTES` a file) and parses `tensorhub.files.left` within bounds.

They go through `Hub.publish(metadata=...)`, which puts them in the manifest before it is
checked and sent.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ros.cli.checkpoint import MAX_CARRIED_FILE_BYTES
from ros.cli.untrusted_json import Limits, load
from ros.client.handles import Publication
from ros.client.hub import Hub
from ros.client.manifest import Placements
from ros.manifest_check import (
    CARRIED_FILE_KEY,
    CARRIED_FILES,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    check_metadata,
)
from tensorhub.errors import InvalidManifest

FILE_KEY = CARRIED_FILE_KEY
LEFT_KEY = "tensorhub.files.left"
_ENCODING = "z64:"  # zlib, then base64
_RESERVED = 2048  # bytes kept for LEFT_KEY's own entry
# LEFT_KEY's value: one flat object of file names to sizes
_LEFT_LIMITS = Limits(
    max_bytes=MAX_METADATA_BYTES, max_depth=1, max_members=MAX_METADATA_ENTRIES,
    max_values=2 * MAX_METADATA_ENTRIES,
)  # fmt: skip


@dataclass
class Carried:
    """What travels (name -> bytes) and what was left behind (name -> size in bytes)."""

    files: dict[str, bytes] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)


def encode(
    files: Mapping[str, bytes], unread: Mapping[str, int] | None = None
) -> tuple[dict[str, str], Carried]:
    """The metadata entries carrying as many of `files` as fit, in their order; `unread`
    (name -> size) are left behind as well. `InvalidManifest` for a name not in
    `CARRIED_FILES`."""
    metadata: dict[str, str] = {}
    carried = Carried()
    used = 0
    for name in [*files, *(unread or {})]:
        _check_name(name)
    for name, data in files.items():
        key = FILE_KEY + name
        value = _ENCODING + base64.b64encode(zlib.compress(data, 9)).decode()
        size = len(key.encode()) + len(value)
        fits = used + size <= MAX_METADATA_BYTES - _RESERVED
        if fits and len(metadata) < MAX_METADATA_ENTRIES - 1:
            metadata[key] = value
            carried.files[name] = data
            used += size
        else:
            carried.left[name] = len(data)
    carried.left.update(unread or {})
    if carried.left:
        metadata[LEFT_KEY] = json.dumps(carried.left, sort_keys=True)
    check_metadata(metadata)
    return metadata, carried


def _check_name(name: str) -> None:
    if name not in CARRIED_FILES:
        raise InvalidManifest(
            f"manifest metadata {(FILE_KEY + name)[:96]!r}: a version carries only the files "
            f"{', '.join(CARRIED_FILES)}"
        )


def decode(metadata: Mapping[str, str]) -> Carried:
    """The files a manifest's metadata carries, and those its publisher left behind:
    `InvalidManifest` for a name not in `CARRIED_FILES`, an entry that does not decode or
    decodes to more than `MAX_CARRIED_FILE_BYTES`, or a `tensorhub.files.left` that is not
    an object of those names to sizes."""
    carried = Carried()
    for key, value in metadata.items():
        if not key.startswith(FILE_KEY):
            continue
        name = key[len(FILE_KEY) :]
        _check_name(name)
        if not value.startswith(_ENCODING):
            raise InvalidManifest(f"manifest metadata {key!r}: not a carried file")
        carried.files[name] = _inflate(key, value[len(_ENCODING) :])
    if LEFT_KEY in metadata:
        what = f"manifest metadata {LEFT_KEY!r}"
        left = load(metadata[LEFT_KEY].encode(), what, _LEFT_LIMITS, InvalidManifest)
        if not isinstance(left, dict) or not all(
            type(size) is int and size >= 0 for size in left.values()
        ):
            raise InvalidManifest(f"{what}: not an object of file names to sizes")
        for name in left:
            _check_name(name)
        carried.left = dict(left)
    return carried


def _inflate(key: str, text: str) -> bytes:
    """A carried file's bytes, at most `MAX_CARRIED_FILE_BYTES` of them decompressed."""
    try:
        packed = base64.b64decode(text, validate=True)
        inflater = zlib.decompressobj()
        data = inflater.decompress(packed, MAX_CARRIED_FILE_BYTES + 1)
    except (ValueError, zlib.error) as exc:
        raise InvalidManifest(f"manifest metadata {key!r} does not decode: {exc}") from None
    if len(data) > MAX_CARRIED_FILE_BYTES:
        raise InvalidManifest(
            f"manifest metadata {key!r} decodes to more than {MAX_CARRIED_FILE_BYTES} bytes"
        )
    if not inflater.eof:
        raise InvalidManifest(f"manifest metadata {key!r} does not decode: truncated")
    return data


def publish_carrying(
    hub: Hub,
    model: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    shard: tuple[int, int] | None = None,
    placements: Placements | None = None,
    timeout: float | None = None,
    views: Sequence[str] = (),
) -> Publication:
    """`hub.publish(...)` whose manifest carries `metadata` (see the module docstring);
    `views`: the view formats published with it (docs/views.md)."""
    check_metadata(metadata)
    return hub.publish(
        model, version, tensors, shard=shard, placements=placements, timeout=timeout,
        metadata=metadata, views=views,
    )  # fmt: skip
