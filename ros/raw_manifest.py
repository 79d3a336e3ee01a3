"""Messages that read a manifest as the bytes it came in, for a hub that checks and stores
thousands of shard manifests a call (`PublishShards`: 4,096 shards of 200 tensors each).

A `pb.PublishRequest` parsed whole builds every tensor entry of its manifest as a message,
which the hub then serializes again to size, hash and store it: about 35 µs of parse and
20 µs of serialization a 200-tensor manifest, on the event loop. These views parse the same
wire bytes with two fields retyped as `bytes` (same numbers, no change to the wire's schema),
so the bytes pass through as they came:

- `RawPublishRequest`: `PublishRequest` whose `manifest` (field 3) is the manifest's bytes;
  its `shards` (field 8: the shards a message of a `PublishShards` stream carries) are
  `RawPublishRequest`s too, so a message of many shards parses in one call; every other
  field (the holder, the views) parses as `PublishRequest`'s does.
- `ManifestHead`: `Manifest` whose `tensors` (field 1) are each entry's bytes; its other
  fields (sizes, checksums, metadata, delta) parse as `Manifest`'s do, strings checked as
  UTF-8, so the manifest's rules read them (`ros.manifest_check.check_manifest_bytes`) and
  its tensor table is checked from the entries' bytes (`ros.tensor_table.split`).

What such a view parses is what `pb.Manifest` parses from the same bytes (every reader
parses them so), field for field; a `RawPublishRequest` serializes back to the bytes a
`pb.PublishRequest` parses as the request sent (`full_request`). The views are messages of
their own descriptor pool, which holds a copy of the hub's schema file for the types they
share (`Holder`, `PublishView`, `Delta`)."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidManifest

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "tensorhub.v1.raw"


def _views() -> dict[str, Any]:
    """`PublishRequest` and `Manifest` with `manifest` and `tensors` retyped as bytes
    (classes made at run time: `Any` to the type checker)."""
    schema = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(schema)
    views = descriptor_pb2.FileDescriptorProto(
        name="tensorhub/v1/raw_views.proto",
        package=_PACKAGE,
        syntax=schema.syntax,
        dependency=[schema.name],
    )
    retyped = {"PublishRequest": "manifest", "Manifest": "tensors"}
    for message in schema.message_type:
        if message.name not in retyped:
            continue
        view = views.message_type.add()
        view.CopyFrom(message)
        own = f".{schema.package}.{message.name}."
        for field in view.field:
            if field.name == retyped[message.name]:
                field.type = _F.TYPE_BYTES
                field.ClearField("type_name")
            elif field.type_name.startswith(own):  # a nested type (the metadata map's entry)
                field.type_name = f".{_PACKAGE}.{message.name}.{field.type_name[len(own) :]}"
            elif field.type_name == own[:-1]:  # the message itself (a request's `shards`)
                field.type_name = f".{_PACKAGE}.{message.name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    pool.Add(views)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
        for name in retyped
    }


_VIEWS = _views()
RawPublishRequest: Any = _VIEWS["PublishRequest"]
ManifestHead: Any = _VIEWS["Manifest"]


def full_request(raw: Any) -> pb.PublishRequest:
    """The `pb.PublishRequest` that `raw` (a `RawPublishRequest`) was sent as, its manifest
    parsed whole; `InvalidManifest` if the manifest does not parse as a `Manifest` (a string
    that is not UTF-8, a truncated field)."""
    try:
        return pb.PublishRequest.FromString(raw.SerializeToString())
    except DecodeError as exc:
        raise InvalidManifest(f"the manifest does not parse: {exc}") from None


def head(serialized: bytes) -> Any:
    """The `ManifestHead` of `serialized`, or None if the bytes do not parse as one."""
    try:
        return ManifestHead.FromString(serialized)
    except DecodeError:
        return None
