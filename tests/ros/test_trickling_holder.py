"""A trickling holder through the SDK (issue 12 item 5), with a real hub over real etcd.

Reader 2's pipelined plan starts it on reader 1 (the newest COMPLETE holder). Reader 1's
holder port then trickles (4 KiB/s, never silent for the 5 s stall window). Before the rate
floor, reader 2 stayed on it until its deadline; now it suspects reader 1 within a window or
two, re-resolves, and reads everything from the trainer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from tests.ros.helpers import digest, make_model
from transport.pace import DEFAULT_RATE_FLOOR


@pytest.mark.timeout(120)
def test_sdk_fetch_moves_off_a_trickling_holder(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect(topology={"host": "trainer"})
    weights = make_model(9, big=1 << 20)  # 4 MiB
    trainer.publish("policy", 1, weights, chunk_size=1 << 20)
    fault = Fault()  # its holder's sender: well-behaved until switched
    first = connect(topology={"host": "rollout-1"}, hooks=ClientHooks(send=fault))
    held = first.fetch("policy", 1, timeout=60)
    assert held.stats.failed_sources == {}
    fault.trickle = 4096  # its data port now trickles
    second = connect(topology={"host": "rollout-2"})
    got = second.fetch("policy", 1, timeout=40)
    assert digest(got.tensors) == digest(weights)
    slow = first.holder_name
    assert slow in got.stats.failed_sources
    assert 0 < got.stats.slow_sources[slow] < DEFAULT_RATE_FLOOR
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert got.stats.bytes_per_source.get(trainer.holder_name, 0) == model_bytes
