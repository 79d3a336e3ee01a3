"""Holder records encode to the same bytes as they always did: a COMPLETE update compares
the stored PARTIAL record's value byte for byte, and records written by an earlier hub
are read and compared by this one."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from consistency import HolderRecord, HolderState


def _as_before(record: HolderRecord) -> bytes:
    """The encoding as `HolderRecord.encode` wrote it before it was built field by field."""
    data = asdict(record)
    data["state"] = record.state.value
    del data["revision"]
    if record.shard is None:
        del data["shard"]
    return json.dumps(data, sort_keys=True).encode()


@pytest.mark.parametrize(
    "record",
    [
        HolderRecord("reader-1", {"tcp": "10.0.0.1:9000"}),
        HolderRecord(
            "r",
            {"tcp": "h:1", "rdma": "h:2", "nixl": "h:3"},
            {"dc": "d", "rack": "r", "host": "h"},
            HolderState.COMPLETE,
            0x1234ABCD,
            revision=77,
            shard=3,
        ),
        HolderRecord("s", {}, {}, HolderState.PARTIAL, 5, shard=0),
    ],
)
def test_a_record_encodes_as_before_and_round_trips(record: HolderRecord) -> None:
    assert record.encode() == _as_before(record)
    back = HolderRecord.decode(record.encode(), record.revision)
    assert back == record
    assert back.with_state(HolderState.PARTIAL).encode() == _as_before(
        record.with_state(HolderState.PARTIAL)
    )
