"""Just enough protobuf wire format to read fields that the vendored etcd stubs do not declare.

python3-etcd3's stubs predate etcd 3.4's fields (`StatusResponse.dbSizeInUse`, `errors`);
protobuf keeps such fields as unknown fields, and `scan_fields` reads them back from the
serialized message (`consistency.etcd.Etcd.member_status`).
"""

from __future__ import annotations


def scan_fields(data: bytes) -> dict[int, list[int | bytes]]:
    """Top-level fields of a protobuf message by number: varints as ints, the rest as bytes.

    Enough wire format to read fields that the vendored stubs do not declare.
    """
    fields: dict[int, list[int | bytes]] = {}
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    try:
        while pos < len(data):
            tag = varint()
            number, wire = tag >> 3, tag & 7
            item: int | bytes
            if wire == 0:
                item = varint()
            elif wire == 2:
                length = varint()
                item, pos = data[pos : pos + length], pos + length
            elif wire == 1:
                item, pos = data[pos : pos + 8], pos + 8
            elif wire == 5:
                item, pos = data[pos : pos + 4], pos + 4
            else:
                break  # groups: not used by etcd
            fields.setdefault(number, []).append(item)
    except IndexError:
        pass  # a truncated message: keep what was read
    return fields
