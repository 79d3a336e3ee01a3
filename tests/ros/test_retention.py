"""Retention without `force` (issue 13, item 4), against a real hub over a real etcd.

Leaving a `with` block releases with `force=False`; the last complete holder of a retained
version spills it to host memory (within `spill_budget`) and keeps serving it until it is no
longer retained; past the budget, `SpillBudgetExceeded` and nothing changes. The hub here
retains the newest 2 versions (the default).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ros
from tests.ros.helpers import make_model


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_leaving_a_with_block_as_the_only_holder_keeps_the_version_readable(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer = connect()
    weights = make_model(1)
    expected = {k: v.clone() for k, v in weights.items()}
    with trainer.publish("policy", 1, weights) as pub:
        assert pub.version == 1
    assert pub.released
    for tensor in weights.values():  # the trainer's memory is free: overwrite it (optimizer)
        tensor.zero_()
    reader = connect()  # old code: the record went with the block, VersionUnavailable here
    held = reader.fetch("policy", 1, timeout=30)
    assert same(held.tensors, expected)
    assert set(held.stats.bytes_per_source) == {trainer.holder_name}
    stats = trainer.spills
    assert (stats.spills, stats.held_versions, stats.held_bytes) == (1, 1, nbytes(expected))


def test_an_exception_leaving_the_block_is_not_masked_by_a_failed_release(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer = connect(spill_budget=0)  # the release on the way out is bound to fail
    weights = make_model(1)
    with (
        pytest.raises(ValueError, match="the step failed") as raised,
        trainer.publish("policy", 1, weights),
    ):
        raise ValueError("the step failed")
    notes = getattr(raised.value, "__notes__", [])
    assert any("SpillBudgetExceeded" in note and "still held" in note for note in notes), notes
    # the failed release changed nothing: the version is still served from the trainer
    assert connect().fetch("policy", 1, timeout=30).tensors.keys() == weights.keys()
    # without an exception in the block, the release error is the one raised
    with pytest.raises(ros.SpillBudgetExceeded), trainer.publish("policy", 2, make_model(2)):
        pass


def test_a_rollout_step_loop_keeps_the_previous_version_readable_from_its_spill(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, rollout = connect(), connect()
    v1, v2, v3 = make_model(1), make_model(2), make_model(3)
    policy = {k: torch.empty_like(t) for k, t in v1.items()}  # the rollout's own weights
    pub = trainer.publish("policy", 1, v1)
    held = rollout.fetch("policy", 1, into=policy, timeout=30)
    pub.release()  # the rollout stands in for the trainer
    pub = trainer.publish("policy", 2, v2)
    # the step: release v1 (retained: it is latest-1, and the rollout its last complete
    # holder; old code: RetentionViolation), then fetch v2 into the same tensors
    held.release()
    held = rollout.fetch("policy", 2, into=policy, timeout=30)
    assert same(policy, v2)
    assert (rollout.spills.spills, rollout.spills.held_versions) == (1, 1)
    checker = connect()
    old = checker.fetch("policy", 1, timeout=30)  # v1 is still readable, from the spill
    assert same(old.tensors, v1)
    assert set(old.stats.bytes_per_source) == {rollout.holder_name}
    checker.close()  # its copy goes: the rollout is again v1's only holder
    # v3 moves retention past v1 (the hub deletes it); the next release frees the spill
    pub.release()
    trainer.publish("policy", 3, v3)  # the trainer serves v3
    held.release()  # sweeps v1's spill first, then spills v2 (retained, last holder)
    stats = rollout.spills
    assert (stats.spills, stats.freed, stats.held_versions) == (2, 1, 1)
    assert stats.held_bytes == nbytes(v2)
    assert rollout.holdings.get((rollout.tenant, "policy", 1)) is None
    held = rollout.fetch("policy", 3, into=policy, timeout=30)  # the loop goes on in place
    assert same(policy, v3)
    assert same(connect().fetch("policy", 2, timeout=30).tensors, v2)


def test_a_spill_over_the_budget_raises_a_named_error_and_changes_nothing(
    connect: Callable[..., ros.Hub], tmp_path: Path
) -> None:
    weights = make_model(1)
    small = connect(spill_budget=nbytes(weights) - 1)
    pub = small.publish("policy", 1, weights)
    with pytest.raises(ros.SpillBudgetExceeded) as raised:
        pub.release()
    message = str(raised.value)
    assert isinstance(raised.value, ros.RetentionViolation)
    for advice in ("last complete holder", "spill_budget=", "spill=", "force=True"):
        assert advice in message, message
    assert not pub.released
    assert small.holder_name in [h.holder for h in small.holders("policy", 1)]
    served = small.holdings.get((small.tenant, "policy", 1))
    assert served is not None
    assert not served.released
    assert served.tensors["embed.weight"].data_ptr() == weights["embed.weight"].data_ptr()
    assert small.spills.spills == 0
    pub.release(spill=tmp_path / "policy-1.safetensors")  # one of the ways out it names
    assert small.spills.file_spills == 1
    assert same(connect().fetch("policy", 1, timeout=30).tensors, weights)


def test_the_budget_bounds_the_bytes_of_every_host_spill_held_at_once(
    connect: Callable[..., ros.Hub],
) -> None:
    v1, v2 = make_model(1), make_model(2)
    trainer = connect(spill_budget=nbytes(v1) + nbytes(v2) // 2)
    trainer.publish("policy", 1, v1).release()  # spilled: retained, and ours alone
    with pytest.raises(ros.SpillBudgetExceeded, match="1 version"):
        trainer.publish("policy", 2, v2).release()  # v1's spill is still needed
    assert trainer.spills.held_versions == 1
    with pytest.raises(ros.InvalidArgument, match="spill_budget"):
        connect(spill_budget=-1)


def test_a_spill_is_freed_once_another_complete_holder_stands_in(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    with trainer.publish("policy", 1, make_model(1)):
        pass  # spilled: no reader yet
    assert trainer.spills.held_versions == 1
    reader.fetch("policy", 1, timeout=30)  # a second complete holder of v1
    with trainer.publish("policy", 2, make_model(2)):
        pass  # the sweep frees v1's spill (the reader holds it), then v2 is spilled
    stats = trainer.spills
    assert (stats.spills, stats.freed, stats.held_versions) == (2, 1, 1)
    assert trainer.holder_name not in [h.holder for h in reader.holders("policy", 1)]
    assert same(connect().fetch("policy", 1, timeout=30).tensors, make_model(1))
