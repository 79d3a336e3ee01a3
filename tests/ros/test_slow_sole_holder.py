"""A sole holder slower than the rate floor (docs/design.md, "Failover"): the fetch reads it
under a quarter of the floor rather than failing with no holder left; a trickler far below
even that is still given up on. Real hub over real etcd; the holder's sender is slowed by the
chaos fault hook (`chaos.holder_faults.Fault.trickle`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ros
from chaos.holder_faults import Fault
from ros.client.fetch_plan import SLOW_ONLY_DIVISOR
from ros.client.hooks import ClientHooks
from tensorhub.errors import VersionUnavailable
from tests.ros.helpers import digest

FLOOR = 128 * 1024  # the readers' rate floor, bytes/s: a quarter of it is 32 KiB/s
CHUNK = 384 * 1024  # one chunk: over one 5 s stall window at either trickle below


def weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(CHUNK // 4, dtype=torch.float32)}


@pytest.mark.timeout(90)
def test_a_sole_holder_under_the_floor_is_read_under_a_lower_one(
    connect: Callable[..., ros.Hub],
) -> None:
    """64 KiB/s: under the 128 KiB/s floor (suspected after one window), over a quarter of
    it: the next round reads it whole from the same holder."""
    assert FLOOR / SLOW_ONLY_DIVISOR < 64 * 1024 < FLOOR
    fault = Fault(trickle=64 * 1024)
    trainer = connect(topology={"host": "trainer"}, hooks=ClientHooks(send=fault))
    trainer.publish("policy", 1, weights(), chunk_size=CHUNK)
    got = connect(topology={"host": "rollout"}).fetch("policy", 1, timeout=60, rate_floor=FLOOR)
    assert digest(got.tensors) == digest(weights())
    assert 0 < got.stats.slow_sources[trainer.holder_name] < FLOOR
    assert got.stats.rounds == 2, got.stats
    assert got.stats.bytes_per_source[trainer.holder_name] >= CHUNK


@pytest.mark.timeout(90)
def test_a_trickler_under_the_lower_floor_too_is_given_up_on(
    connect: Callable[..., ros.Hub],
) -> None:
    """16 KiB/s: under a quarter of the floor as well: its second round fails too, and the
    fetch fails with no holder left, long before its deadline."""
    fault = Fault(trickle=16 * 1024)
    trainer = connect(topology={"host": "trainer"}, hooks=ClientHooks(send=fault))
    trainer.publish("policy", 1, weights(), chunk_size=CHUNK)
    reader = connect(topology={"host": "rollout"})
    with pytest.raises(VersionUnavailable, match="no holder left"):
        reader.fetch("policy", 1, timeout=60, rate_floor=FLOOR)
