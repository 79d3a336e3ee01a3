"""`fetch_slices` without deltas stages a source shard's chunks in groups of at most
`STAGING_BUDGET` bytes: with a budget under one tensor's chunks, each slice is staged and
read on its own, and every reader still gets its exact blocks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ros
from ros.client import slice_staging as slices_module
from tests.ros.test_reshard import global_model, publish_tp, read_tp


def test_blocks_staged_a_tensor_at_a_time_are_exact(
    connect: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_tp(connect, 2)
    staged: list[int] = []
    allocate = slices_module._allocate_staging

    def counting(*args: object, **kwargs: object) -> dict[str, torch.Tensor]:
        staged.append(1)
        return allocate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(slices_module, "STAGING_BUDGET", 1)  # every slice in a group alone
    monkeypatch.setattr(slices_module, "_allocate_staging", counting)
    full = global_model()
    reader = connect()
    got, fetched = read_tp(reader, 0, 1)  # the whole model, from both TP-2 shards
    for name, tensor in full.items():
        assert torch.equal(got[name], tensor), name
    # the split tensors from both shards, the replicated ones from one: one staging each
    assert len(staged) == 2 * 2 + 2
    assert fetched.chunks > 0
