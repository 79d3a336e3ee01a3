"""Carrying `config.json` and tokenizer files in a version's manifest metadata.

A fetched directory is loadable on its own (`from_pretrained(DIR)`) only if the model's
config travels with its weights. The manifest has a metadata map for that (strings, checked
by the hub: at most `MAX_METADATA_ENTRIES` entries and `MAX_METADATA_BYTES` of keys and
values, `ros.manifest_check`). Each carried file is one entry, `tensorhub.file:NAME`, its
bytes zlib-compressed and base64-encoded (JSON shrinks 3-10x, so more fits). Files are taken
in `ros.cli.checkpoint.CARRIED` order (config first) while they fit; those that do not are
named, with their sizes, in `tensorhub.files.left`, and `publish` and `fetch` both say so.
A real `tokenizer.json` (several MB) does not fit the 64 KiB the hub allows: it is left
behind, and the fetched directory then has the model's config but not that tokenizer file.

They go through `Hub.publish(metadata=...)`, which puts them in the manifest before it is
checked and sent.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ros.client.handles import Publication
from ros.client.hub import Hub
from ros.client.manifest import Placements
from ros.manifest_check import MAX_METADATA_BYTES, MAX_METADATA_ENTRIES, check_metadata
from tensorhub.errors import InvalidManifest

FILE_KEY = "tensorhub.file:"
LEFT_KEY = "tensorhub.files.left"
_ENCODING = "z64:"  # zlib, then base64
_RESERVED = 2048  # bytes kept for LEFT_KEY's own entry


@dataclass
class Carried:
    """What travels (name -> bytes) and what was left behind (name -> size in bytes)."""

    files: dict[str, bytes] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)


def encode(files: Mapping[str, bytes]) -> tuple[dict[str, str], Carried]:
    """The metadata entries carrying as many of `files` as fit, in their order."""
    metadata: dict[str, str] = {}
    carried = Carried()
    used = 0
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
    if carried.left:
        metadata[LEFT_KEY] = json.dumps(carried.left, sort_keys=True)
    check_metadata(metadata)
    return metadata, carried


def decode(metadata: Mapping[str, str]) -> Carried:
    """The files a manifest's metadata carries (`InvalidManifest` for an entry that does not
    decode), and those its publisher left behind."""
    carried = Carried()
    for key, value in metadata.items():
        if not key.startswith(FILE_KEY):
            continue
        name = key[len(FILE_KEY) :]
        if not name or "/" in name or name.startswith(".") or not value.startswith(_ENCODING):
            raise InvalidManifest(f"manifest metadata {key!r}: not a carried file")
        try:
            carried.files[name] = zlib.decompress(base64.b64decode(value[len(_ENCODING) :]))
        except (ValueError, zlib.error) as exc:
            raise InvalidManifest(f"manifest metadata {key!r} does not decode: {exc}") from None
    if LEFT_KEY in metadata:
        try:
            left = json.loads(metadata[LEFT_KEY])
            carried.left = {str(k): int(v) for k, v in left.items()}
        except (ValueError, TypeError, AttributeError):
            carried.left = {}
    return carried


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
) -> Publication:
    """`hub.publish(...)` whose manifest carries `metadata` (see the module docstring)."""
    check_metadata(metadata)
    return hub.publish(
        model, version, tensors, shard=shard, placements=placements, timeout=timeout,
        metadata=metadata,
    )  # fmt: skip
