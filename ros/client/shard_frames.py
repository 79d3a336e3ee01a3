"""A process group's shard requests framed for one `PublishShards` call as they were
serialized, never parsed and serialized again.

Each rank serializes its own `PublishRequest` (its manifest of a few hundred tensors, a few
KB) and the group gathers those bytes to its leader (`ros.client.group_publish`). A
`PublishRequest` whose only field is `shards` (field 8, repeated `PublishRequest`) is, on the
wire, each shard's bytes behind the field's tag and its length: so the leader frames the
gathered bytes into messages of up to `FRAME_SHARDS` shards (and `FRAME_BYTES`, far below
the hub's 64 MiB message bound) with a join, where parsing each request and letting the
stub serialize it again costs about 50 us a 200-tensor shard (0.2 s at 4,096 shards) on the
leader, and one message a shard costs the hub's event loop a stream read a shard.

`publish_shards` is the channel's `PublishShards` call whose request serializer passes such
bytes through (and still serializes a `pb.PublishRequest` given as a message): what the SDK's
stub and the benchmark's client send with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument

FRAME_SHARDS = 32  # shards a message, at most
FRAME_BYTES = 1 << 20  # a message's shards' bytes, at most (a larger shard goes alone)
METHOD = "/tensorhub.v1.TensorHub/PublishShards"
_SHARDS_TAG = bytes([8 << 3 | 2])  # PublishRequest.shards: field 8, length-delimited


def frames(
    requests: Sequence[bytes], shards: int = FRAME_SHARDS, max_bytes: int = FRAME_BYTES
) -> Iterator[bytes]:
    """The serialized `PublishRequest`s `requests`, in order, as serialized PublishShards
    messages of at most `shards` each (and `max_bytes` of them, one at least): each a
    `PublishRequest` that carries them in `shards`. `shards` 1: one plain message each."""
    if shards < 1:
        raise InvalidArgument(f"a message carries one shard at least, not {shards}")
    if shards == 1:
        yield from requests
        return
    parts: list[bytes] = []
    count = size = 0
    for request in requests:
        if count and (count >= shards or size + len(request) > max_bytes):
            yield b"".join(parts)
            parts, count, size = [], 0, 0
        parts += (_SHARDS_TAG, _varint(len(request)), request)
        count += 1
        size += len(request)
    if count:
        yield b"".join(parts)


def _varint(value: int) -> bytes:
    """`value` (not negative) as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _serialize(message: bytes | pb.PublishRequest) -> bytes:
    """A PublishShards message on the wire: bytes framed by `frames` as they are, a message
    serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def publish_shards(channel: Any) -> Any:
    """`channel`'s PublishShards call (a `grpc.Channel`'s or a `grpc.aio.Channel`'s: both
    make it alike), taking messages as `frames` makes them or as `pb.PublishRequest`s."""
    return channel.stream_unary(
        METHOD,
        request_serializer=_serialize,
        response_deserializer=pb.PublishShardsResponse.FromString,
    )
