"""verl publishes from every actor rank (issue 35, item 2): each actor rank publishes its own
shard of the FSDP state, nothing gathered, no full-model copy anywhere.

The per-rank path runs on CPU with two actor ranks in processes of their own
(tests/engines/verl/fsdp_rank_proc.py), in a gloo group, each with a real hub client, a
real etcd and hub in this process, and a rollout engine here reading each version.

Real: torch's FSDP2 (`fully_shard`) and gloo; transformers' Llama (hidden 64, 2 layers,
built from a config); verl 0.9.1's `ActorRolloutRefWorker.update_weights`, which asks the
training engine for `get_per_tensor_param()` and awaits `send_weights` on it, and verl's own
`FSDPEngine.get_per_tensor_param`, hooked by `ros.integrations.verl_shards`; verl's registry
and `import_external_libs`; the `tensorhub` backend on both sides, the SDK, the hub.
Stands in: the FSDP engine's constructor (it needs CUDA: the rank sets the attributes
`get_per_tensor_param` reads), verl's CUDA-only `get_device_id` (answers "cpu") and
`log_gpu_memory_usage` (does nothing), the worker object around `update_weights` (config,
actor, checkpoint engine), the Ray manager that sequences prepare / build_topology /
init_process_group / update / finalize (each rank runs it, the topology shared over gloo),
and the rollout's server adapter (this test reads what `receive_weights` yields).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

import ros
from ros.metrics import HUB_REQUESTS
from tensorhub.errors import InvalidArgument
from tests.engines.verl import tiny
from tests.engines.verl.conftest import Tenant
from tests.engines.verl.ranks import ActorRanks

MODEL = "policy"
READY_SECONDS = 120.0  # two ranks importing verl, transformers and torch on a loaded machine
MiB = 1 << 20


def _calls(method: str) -> float:
    return float(HUB_REQUESTS.labels(method, "OK")._value.get())


async def _collect(stream: AsyncIterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: tensor async for name, tensor in stream}


def _receive(engine: Any, version: int, step: int) -> dict[str, torch.Tensor]:
    """The rollout's side of one update: its topology share, receive_weights, finalize."""
    engine.init_process_group(role="rollout", rank=0, version=version)
    got = asyncio.run(asyncio.wait_for(_collect(engine.receive_weights(global_steps=step)), 60))
    engine.finalize()
    return got


def test_an_unchecked_verl_version_fails_loudly(
    engine_cls: type[Any], tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook depends on verl's internals: an actor's engine on a verl it was not checked
    against is refused when it is built, naming the way out; `shards=False` and rollouts
    (which hook nothing) are built as before."""
    import verl

    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(InvalidArgument, match=r"verl 0\.9\.2 is installed.*shards=False"):
        engine_cls(bucket_size=1 << 20, is_master=True, **tenant.kwargs())
    engine_cls(bucket_size=1 << 20, is_master=True, shards=False, **tenant.kwargs()).close()
    engine_cls(bucket_size=1 << 20, **tenant.kwargs()).close()


def test_the_hooked_stream_is_verls_own_until_the_backend_takes_the_state() -> None:
    """`ShardedParams` walks verl's generator for anyone who iterates it (every other
    backend); once walked, its gathers ran and its state is refused; closing it unwalked
    closes the generator, so none of its gathers runs."""
    from ros.integrations.verl_shards import ShardedParams

    ran: list[str] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for name in ("a", "b"):
                ran.append(name)
                yield name, torch.zeros(1)
        finally:
            ran.append("closed")

    walked = ShardedParams(stream(), lambda: {"a": torch.ones(1)})
    assert [name for name, _ in walked] == ["a", "b"]
    with pytest.raises(InvalidArgument, match="walked"):
        walked.state()
    ran.clear()
    taken = ShardedParams(stream(), lambda: {"a": torch.ones(1)})
    assert set(taken.state()) == {"a"}
    taken.close()
    assert ran == []  # never started: not one tensor produced


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_actor_rank_publishes_its_own_fsdp2_shard(
    engine_cls: type[Any], tenant: Tenant
) -> None:
    """Three updates through verl's `update_weights` on two FSDP2 ranks, then one with
    `shards=False`. Per update with shards: no DTensor is gathered on any rank; each rank
    publishes and serves exactly its own shard (host copies, not the live parameters) as
    shard (rank, 2), and keeps one more copy of it (the delta base), nothing of the model;
    the ranks' shards reach the hub in one PublishShards call (`group`), or one Publish per
    rank (`group=False`); from the second update each rank publishes its shard's delta and
    the rollout reads only the changes of every shard; the rollout's tensors are the full
    state dict (`get_model_state_dict(full_state_dict=True)`). With `shards=False`, rank 0
    publishes the gathered stream whole, as a verl without the hook does."""
    ranks = ActorRanks(tenant.hub, tenant.tenant, tenant.token, MODEL, "tiny", 2)
    rollout = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=60))
    observer = ros.connect(tenant.hub, tenant=tenant.tenant, token=tenant.token)
    try:
        assert [r["ready"] for r in ranks.collect(READY_SECONDS)] == [0, 1]
        for step, group in ((1, True), (2, True), (3, False)):
            full = ranks.all("step", seed=step)[0]["digests"]
            shards_calls, publish_calls = _calls("PublishShards"), _calls("Publish")
            answers = ranks.all("update", step=step, shards=True, group=group)
            assert [a["version"] for a in answers] == [step, step]
            assert [a["shard"] for a in answers] == [0, 1]
            for a in answers:
                assert a["gathers"] == 0, a  # nothing gathered, on any rank
                assert a["served_bytes"] == a["shard_bytes"] < a["model_bytes"], a
                assert not a["served_live_memory"], a
                assert a["base_bytes"] == a["shard_bytes"], a  # its own delta base only
                assert a["peak_growth"] <= 2 * a["shard_bytes"] + 64 * MiB, a
            assert _calls("PublishShards") - shards_calls == (1 if group else 0)
            companions = 2 if step > 1 else 0  # each rank's delta: one Publish of its own
            assert _calls("Publish") - publish_calls == (0 if group else 2) + companions
            metrics = answers[0]["metrics"]
            assert metrics["tensorhub/version"] == step
            assert metrics["tensorhub/shards"] == 2
            assert (metrics["tensorhub/delta_mb"] > 0) == (step > 1), metrics
            assert answers[1]["metrics"] == {}  # verl merges the ranks': rank 0's stand
            got = _receive(rollout, step, step)
            assert tiny.digests(got) == full
            assert rollout.held is None  # read by slices: no holder of the actors' shards
            if step > 1:
                deltas = rollout.read.deltas
                assert set(deltas) == {0, 1}, deltas
                assert all(d.chunks > 0 and d.whole_chunks == 0 for d in deltas.values()), deltas
            holders = [h for h in observer.holders(MODEL, step) if h.complete]
            assert sorted(h.shard for h in holders) == [0, 1]  # the two ranks serve it
        full = ranks.all("step", seed=4)[0]["digests"]
        answers = ranks.all("update", step=4, shards=False, group=True)
        assert all(a["gathers"] > 0 for a in answers)  # the stream was walked: gathered
        assert answers[0]["shard"] is None
        assert answers[0]["served_bytes"] == answers[0]["model_bytes"]
        assert answers[1]["version"] == 3  # rank 1 only walked the stream: nothing new
        got = _receive(rollout, 4, 4)
        assert tiny.digests(got) == full
        assert rollout.held is not None
        assert rollout.held.version == 4
    finally:
        observer.close()
        rollout.close()
        ranks.close()
