"""verl publishes from every actor rank (issue 35, item 2): each actor rank publishes its own
shard of the FSDP state, nothing gathered, no full-model copy anywhere.

The per-rank path runs on CPU with two actor ranks in processes of their own
(tests/engines/verl/fsdp_rank_proc.py), in a gloo group, each with a real hub client, a
real etcd and hub in this process, and two rollout engines here reading each version.

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
and the rollouts' server adapter (this test reads what `receive_weights` yields).
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


def _receive(engines: list[Any], version: int, step: int) -> list[dict[str, torch.Tensor]]:
    """The rollouts' side of one update, all at once: each one's topology share,
    receive_weights, finalize."""
    for rank, engine in enumerate(engines):
        engine.init_process_group(role="rollout", rank=rank, version=version)

    async def every() -> list[dict[str, torch.Tensor]]:
        return await asyncio.gather(
            *[_collect(engine.receive_weights(global_steps=step)) for engine in engines]
        )

    got = asyncio.run(asyncio.wait_for(every(), 60))
    for engine in engines:
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


def test_the_hook_wraps_verls_method_once_and_only_fsdp2_engines_give_shards() -> None:
    """Installing twice leaves one wrapper around verl's own method; an engine whose module
    is no FSDP2 module (FSDP1, a plain module) is not offered as shards, so its stream
    goes through as verl made it."""
    from types import SimpleNamespace

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from ros.integrations import verl_shards

    verl_shards.install()
    verl_shards.install()
    hooked = FSDPEngine.get_per_tensor_param
    assert getattr(hooked, verl_shards.MARK)
    assert not getattr(hooked.__wrapped__, verl_shards.MARK, False)  # verl's, wrapped once
    assert not verl_shards._plain(SimpleNamespace(module=torch.nn.Linear(2, 2)))
    assert not verl_shards._plain(SimpleNamespace())


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
    the rollouts read only the changes of every shard. Two rollouts: each one's tensors are
    the full state dict (`get_model_state_dict(full_state_dict=True)`), in the same memory
    from one version to the next; rollout r holds shard r, fetched into the rows of its
    whole tensors, and reads the other's rows by slices; so every shard has a holder
    besides its rank, and no rank spills a copy to release the version before. With
    `shards=False`, rank 0 publishes the gathered stream whole, as a verl without the hook
    does."""
    ranks = ActorRanks(tenant.hub, tenant.tenant, tenant.token, MODEL, "tiny", 2)
    rollouts = [engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=60)) for _ in range(2)]
    observer = ros.connect(tenant.hub, tenant=tenant.tenant, token=tenant.token)
    try:
        assert [r["ready"] for r in ranks.collect(READY_SECONDS)] == [0, 1]
        previous: list[dict[str, int]] = [{}, {}]
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
                assert a["spills"] == 0, a  # its version before had another holder: released
                assert a["peak_growth"] <= 2 * a["shard_bytes"] + 64 * MiB, a
            assert _calls("PublishShards") - shards_calls == (1 if group else 0)
            companions = 2 if step > 1 else 0  # each rank's delta: one Publish of its own
            assert _calls("Publish") - publish_calls == (0 if group else 2) + companions
            metrics = answers[0]["metrics"]
            assert metrics["tensorhub/version"] == step
            assert metrics["tensorhub/shards"] == 2
            assert (metrics["tensorhub/delta_mb"] > 0) == (step > 1), metrics
            assert answers[1]["metrics"] == {}  # verl merges the ranks': rank 0's stand
            for rank, (rollout, got) in enumerate(
                zip(rollouts, _receive(rollouts, step, step), strict=True)
            ):
                assert tiny.digests(got) == full
                read = rollout.shards_read  # FSDP2's blocks are rows: rollout r holds shard r
                assert [h.shard for h in read.held] == [rank]
                (held,) = read.held
                for name, t in held.tensors.items():  # in the rows of the whole tensors
                    start = got[name].data_ptr()
                    assert start <= t.data_ptr() < start + max(got[name].nbytes, 1)
                (other,) = read.sliced  # the other shard's rows, by slices
                if step == 1:
                    assert other.chunks > 0, other
                else:  # only each shard's changes crossed, none of its chunks whole
                    assert held.delta.chunks > 0, held.delta
                    assert held.delta.whole_chunks == 0, held.delta
                    assert other.chunks == 0, other
                    assert [(i, d.chunks > 0) for i, d in other.deltas.items()] == [
                        (1 - rank, True)
                    ], other.deltas
                if previous[rank]:  # into the memory of the version before
                    assert all(got[n].data_ptr() == previous[rank][n] for n in got)
                previous[rank] = {n: t.data_ptr() for n, t in got.items()}
            holders = [h for h in observer.holders(MODEL, step) if h.complete]
            assert sorted(h.shard for h in holders) == [0, 0, 1, 1]  # ranks and rollouts
        full = ranks.all("step", seed=4)[0]["digests"]
        answers = ranks.all("update", step=4, shards=False, group=True)
        assert all(a["gathers"] > 0 for a in answers)  # the stream was walked: gathered
        assert answers[0]["shard"] is None
        assert answers[0]["served_bytes"] == answers[0]["model_bytes"]
        assert answers[1]["version"] == 3  # rank 1 only walked the stream: nothing new
        for rollout, got in zip(rollouts, _receive(rollouts, 4, 4), strict=True):
            assert tiny.digests(got) == full
            assert rollout.held is not None
            assert rollout.held.version == 4
    finally:
        observer.close()
        for rollout in rollouts:
            rollout.close()
        ranks.close()


def _entry(name: str, shape: list[int], glob: list[int], offsets: list[int]) -> Any:
    from ros.proto.tensorhub.v1 import hub_pb2 as pb

    return pb.TensorEntry(
        name=name, dtype="float32", shape=shape, global_shape=glob, global_offsets=offsets
    )


def test_a_rollout_holds_shards_of_rows_in_place_and_slices_any_other_layout() -> None:
    """FSDP2's blocks (runs of whole rows, uneven last ones, tensors published whole) are
    fetched as held shards into the rows of the whole tensors; a block that is no run of
    rows (tensor parallelism's column split) makes the version read by slices."""
    from ros.integrations.verl_read import rows_of, whole_tensors
    from ros.proto.tensorhub.v1 import hub_pb2 as pb

    rows = pb.ResolveResponse(shards=[
        pb.Manifest(tensors=[_entry("w", [3, 4], [5, 4], [0, 0]),
                             pb.TensorEntry(name="norm", dtype="float32", shape=[4])]),
        pb.Manifest(tensors=[_entry("w", [2, 4], [5, 4], [3, 0])]),
    ])  # fmt: skip
    assert rows_of(rows) == [{"w": (0, 3), "norm": None}, {"w": (3, 2)}]
    tensors = whole_tensors(rows, {})
    assert {n: tuple(t.shape) for n, t in tensors.items()} == {"w": (5, 4), "norm": (4,)}
    assert whole_tensors(rows, tensors)["w"] is tensors["w"]  # the version before's memory
    columns = pb.ResolveResponse(shards=[
        pb.Manifest(tensors=[_entry("w", [5, 2], [5, 4], [0, 0])]),
        pb.Manifest(tensors=[_entry("w", [5, 2], [5, 4], [0, 2])]),
    ])  # fmt: skip
    assert rows_of(columns) is None
