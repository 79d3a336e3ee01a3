"""`fetch_slices` without a layout or deltas reads its source shards at once
(`ros.client.slice_read.read_sources`): every shard's holders carry their part of the read from
its start, so readers that start together do not all queue on the first shard's holders.
A shard whose read fails fails the whole read, with that shard's error."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import ros
from ros.client import slice_read as slices_module
from tensorhub.errors import VersionUnavailable
from tests.ros.test_reshard import global_model, publish_tp, read_tp


def test_source_shards_are_read_at_once_and_the_blocks_are_exact(
    connect: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_tp(connect, 2)
    both = threading.Barrier(2, timeout=20)  # broken if the shards were read in turn
    read_part = slices_module._read_part
    shards: list[int | None] = []

    def meeting(*args: object, **kwargs: object) -> None:
        shards.append(args[1].shard)  # type: ignore[attr-defined]  # a SourceShard
        both.wait()
        read_part(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(slices_module, "_read_part", meeting)
    got, fetched = read_tp(connect(), 0, 1)  # the whole model, from both TP-2 shards
    assert sorted(s for s in shards if s is not None) == [0, 1]
    for name, tensor in global_model().items():
        assert torch.equal(got[name], tensor), name
    assert fetched.chunks > 0
    assert len(fetched.bytes_per_source) == 2


def test_a_shard_whose_read_fails_fails_the_read(
    connect: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_tp(connect, 2)
    read_part = slices_module._read_part

    def second_fails(*args: object, **kwargs: object) -> None:
        if args[1].shard == 1:  # type: ignore[attr-defined]  # a SourceShard
            raise VersionUnavailable("shard 1: no holder left")
        read_part(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(slices_module, "_read_part", second_fails)
    with pytest.raises(VersionUnavailable, match="shard 1"):
        read_tp(connect(), 0, 1)
