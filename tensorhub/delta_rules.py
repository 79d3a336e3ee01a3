"""The rules of delta versions that the hub and the SDK share (torch-free: the hub runs the
same checks without importing torch). The codec is `transport.delta`; the manifest section
is `Manifest.delta` (ros/proto); docs/sdk.md, "Delta versions", says how they are used."""

from __future__ import annotations

ENCODING = "xor-adaptive-zstd1"  # each chunk: its changed words, or byte planes of the XOR
PLANES = "xor-shuffle-zstd1"  # every chunk byte planes of the XOR (the first encoding)
ENCODINGS = (ENCODING, PLANES)  # what readers can apply; a manifest naming another is refused
WHOLE_RATIO = 0.8  # a chunk whose encoding is larger than this share of it goes whole
SUFFIX = ".delta"  # `{model}.delta`@v serves the encoded chunks of `{model}`@v
TENSOR = "encoded"  # its one uint8 tensor: the encoded chunks back to back, in chunk order


def companion_of(model: str) -> str:
    """The model whose version v serves the encoded chunks of `model`@v."""
    return f"{model}{SUFFIX}"


def is_companion(model: str) -> bool:
    """Whether `model` is a companion model's name (reserved: no user publishes to one)."""
    return model.endswith(SUFFIX)
