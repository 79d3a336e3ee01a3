"""The cross-dc seed comes from registration order: readers of one dc that start at once
read the version across the WAN once between them (docs/design-notes.md, "The cross-dc seed").

Real hub, real etcd, real holder servers: a trainer in dc1, readers in dc2 that all call
`fetch` at the same instant. Each reader's PARTIAL registration gets a distinct etcd
revision (its fence), and its RegisterHolder answer carries the dc2 readers registered
before it, so only the first of them reads from the trainer; the bytes each read from which
holder come from its `FetchStats`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

import ros
from tests.ros.helpers import make_model

READERS = 6
CHUNK = 256 * 1024


@pytest.mark.timeout(120)
def test_simultaneous_first_readers_of_a_dc_cross_the_wan_once(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer = connect(topology={"dc": "dc1", "host": "trainer"})
    weights = make_model(11, big=1 << 20)  # 4 MiB in 16+ chunks: readers chain chunk by chunk
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    trainer.publish("policy", 1, weights, chunk_size=CHUNK)
    readers = [connect(topology={"dc": "dc2", "host": f"rollout-{i}"}) for i in range(READERS)]
    start = threading.Barrier(READERS)
    held: dict[str, ros.Held] = {}
    errors: list[BaseException] = []

    def read(client: ros.Hub) -> None:
        try:
            start.wait(timeout=30)  # every reader registers at about the same moment
            held[client.holder_name] = client.fetch("policy", 1, timeout=60)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(r,)) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors, errors
    assert len(held) == READERS
    from_trainer = {
        name: h.stats.bytes_per_source.get(trainer.holder_name, 0) for name, h in held.items()
    }
    # one copy crossed dc1 -> dc2, read by one reader; every other byte stayed inside dc2
    assert sum(from_trainer.values()) == model_bytes, from_trainer
    assert sum(1 for n in from_trainer.values() if n) == 1, from_trainer
    dc2 = {r.holder_name for r in readers}
    for h in held.values():
        assert h.stats.total_bytes == model_bytes
        assert set(h.stats.bytes_per_source) <= dc2 | {trainer.holder_name}, h.stats
    for h in held.values():
        h.release()
