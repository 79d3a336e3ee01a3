"""The SDK's one fetch orchestrator (ros/client/orchestrator.py), with a real hub over real
etcd and real holder ports: failover re-planned by the pipeline policy, a subset of chunks as
a first-class input, and progress reported per chunk."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from ros.client.orchestrator import Progress
from tests.ros.helpers import digest, make_model

MiB = 1 << 20


@pytest.mark.timeout(120)
def test_a_failed_predecessor_is_replanned_by_the_pipeline_policy_not_onto_every_holder(
    connect: Callable[..., ros.Hub],
) -> None:
    """Reader C's pipelined plan starts it on B (the newest COMPLETE holder); B sends bad
    bytes. The next round asks the hub again and plans with the same policy, less B: one
    predecessor (A, now the newest complete), not "every holder of the tier". Before the
    orchestrator, the second round read from the trainer and A both."""
    trainer = connect(topology={"host": "trainer"})
    weights = make_model(3, big=1 << 20)  # 4 MiB and a few small tensors
    trainer.publish("policy", 1, weights, chunk_size=MiB)
    a = connect(topology={"host": "rollout-a"})
    a.fetch("policy", 1, timeout=30)
    fault = Fault()  # B's holder port: well-behaved until switched
    b = connect(topology={"host": "rollout-b"}, hooks=ClientHooks(send=fault))
    got_b = b.fetch("policy", 1, timeout=30)
    assert set(got_b.stats.bytes_per_source) == {a.holder_name}  # the pipeline: one source
    fault.corrupt = True
    c = connect(topology={"host": "rollout-c"})
    got = c.fetch("policy", 1, timeout=60)
    assert digest(got.tensors) == digest(weights)
    assert "IntegrityError" in got.stats.failed_sources[b.holder_name]
    assert set(got.stats.bytes_per_source) == {a.holder_name}  # one predecessor again
    assert got.stats.rounds == 2


@pytest.mark.timeout(120)
def test_progress_counts_every_chunk_and_a_raising_callback_does_not_break_the_fetch(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer = connect()
    weights = make_model(4, big=1 << 20)
    trainer.publish("policy", 1, weights, chunk_size=256 * 1024)
    seen: list[Progress] = []

    def record(p: Progress) -> None:
        seen.append(p)
        if len(seen) == 2:
            raise RuntimeError("a buggy progress bar")

    got = connect().fetch("policy", 1, timeout=30, progress=record)
    assert digest(got.tensors) == digest(weights)
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    last = max(seen, key=lambda p: p.chunks)  # workers report concurrently: any order
    assert last == Progress(len(seen), len(seen), model_bytes, model_bytes)
    assert sorted(p.chunks for p in seen) == list(range(1, len(seen) + 1))
    assert len(seen) == got.stats.chunks > 2  # the call after the raise was made too
    assert last.fraction == 1.0


@pytest.mark.timeout(120)
def test_fetch_slices_reads_only_the_chunks_its_blocks_need(
    connect: Callable[..., ros.Hub],
) -> None:
    """A block of rows of one tensor: only its chunks are asked for (the others of the
    staging copy stay missing, never marked present), and progress counts just those."""
    trainer = connect()
    weight = torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256)  # 256 KiB
    other = torch.ones(64 * 1024, dtype=torch.float32)  # 256 KiB nobody asks for
    trainer.publish("policy", 1, {"w": weight, "other": other}, chunk_size=16 * 1024)
    rows = torch.empty(16, 256)  # rows 32..48: 16 KiB, one chunk
    seen: list[Progress] = []
    got = connect().fetch_slices(
        "policy", 1, slices={"w": ros.Slice(rows, (32, 0), (256, 256))}, timeout=30,
        progress=seen.append,
    )  # fmt: skip
    assert torch.equal(rows, weight[32:48])
    assert got.chunks == 1
    assert got.total_bytes == 16 * 1024
    assert seen == [Progress(1, 1, 16 * 1024, 16 * 1024)]
