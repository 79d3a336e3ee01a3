"""The `tensorhub` verl backend driven method by method, as `CheckpointEngineManager` drives
it (prepare -> build_topology -> init_process_group -> send/receive at once -> finalize),
against a real etcd and hub, with the class taken from verl's registry by name.

What verl's manager adds around these calls (Ray worker groups, the rollout server adapter)
is exercised in test_manager.py; here two actor ranks and two rollout workers are engines in
one process, each rollout with its own hub client (so they serve each other), and the
holder-death tests run the publisher in a subprocess and SIGKILL it mid-fetch.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import ros
from consistency.events import EventKind
from tests.engines.verl import tiny
from tests.engines.verl.conftest import Tenant

MODEL = "policy"


async def _collect(stream: AsyncIterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What a server adapter does with `receive_weights`: read every tensor (kept by
    reference, so memory reuse across versions can be checked)."""
    return {name: tensor async for name, tensor in stream}


def update(
    cls: type[Any], actors: list[Any], rollouts: list[Any], model: torch.nn.Module
) -> tuple[dict[str, float], list[dict[str, torch.Tensor]]]:
    """One weight update, step for step as `CheckpointEngineManager.update_weights` runs it."""
    metadata = [engine.prepare() for engine in [*actors, *rollouts]]
    actor_kwargs, rollout_kwargs = cls.build_topology(len(actors), len(rollouts), metadata)
    for group, kwargs in ((actors, actor_kwargs), (rollouts, rollout_kwargs)):
        for i, engine in enumerate(group):
            engine.init_process_group(**{key: values[i] for key, values in kwargs.items()})

    async def both() -> list[Any]:
        return await asyncio.gather(
            *[engine.send_weights(tiny.per_tensor(model), global_steps=1) for engine in actors],
            *[_collect(engine.receive_weights(global_steps=1)) for engine in rollouts],
        )

    results = asyncio.run(asyncio.wait_for(both(), timeout=60))
    for engine in [*actors, *rollouts]:
        engine.finalize()
    return results[0], results[len(actors) :]


def test_registered_under_its_name(engine_cls: type[Any]) -> None:
    from verl.checkpoint_engine import CheckpointEngine

    assert engine_cls.__name__ == "TensorHubCheckpointEngine"
    assert issubclass(engine_cls, CheckpointEngine)
    assert engine_cls.wire_format == "named_tensors"


def test_versions_arrive_byte_for_byte(engine_cls: type[Any], tenant: Tenant) -> None:
    """Three updates from two actor ranks (rank 0 publishes, rank 1 only walks its stream)
    to two rollout workers: each gets exactly the trainer's bytes of that step, versions go
    1, 2, 3, and each version is fetched into the memory of the one before (released first)."""
    actors = [
        engine_cls(bucket_size=1 << 20, is_master=rank == 0, **tenant.kwargs(timeout=30))
        for rank in range(2)
    ]
    rollouts = [engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=30)) for _ in range(2)]
    model = tiny.build(tiny.SMALL, seed=0)
    try:
        previous: list[dict[str, torch.Tensor]] = []
        for step in range(1, 4):
            tiny.step(model, seed=step)
            expected = tiny.digests(dict(tiny.per_tensor(model)))
            metrics, received = update(engine_cls, actors, rollouts, model)
            assert metrics["tensorhub/version"] == step
            assert actors[0].publication.version == step
            assert actors[1].publication is None  # rank 1 never publishes
            for engine, got in zip(rollouts, received, strict=True):
                assert tiny.digests(got) == expected
                assert engine.held.version == step
                assert all(t.device.type == "cpu" and t.is_contiguous() for t in got.values())
            for before, got in zip(previous or received, received, strict=True):
                assert all(got[n].data_ptr() == before[n].data_ptr() for n in got)
            previous = received
        with ros.connect(tenant.hub, tenant=tenant.tenant, token=tenant.token) as observer:
            assert observer.latest(MODEL) == 3
            holders = observer.holders(MODEL, 3)
            assert len([h for h in holders if h.complete]) == 3  # trainer and both rollouts
    finally:
        for engine in [*actors, *rollouts]:
            engine.close()


def test_a_new_run_on_the_same_tenant_goes_on_from_latest(
    engine_cls: type[Any], tenant: Tenant
) -> None:
    """A restarted run (new engines, same tenant and model) publishes latest()+1, never a
    version the hub would refuse as stale."""
    model = tiny.build(tiny.SMALL, seed=0)
    for run in range(2):
        actor = engine_cls(bucket_size=1 << 20, is_master=True, **tenant.kwargs(timeout=30))
        rollout = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=30))
        try:
            for step in range(2):
                tiny.step(model, seed=10 * run + step)
                metrics, (got,) = update(engine_cls, [actor], [rollout], model)
                assert metrics["tensorhub/version"] == 2 * run + step + 1
                assert tiny.digests(got) == tiny.digests(dict(tiny.per_tensor(model)))
        finally:
            actor.close()
            rollout.close()


def test_without_topology_the_engine_still_syncs(engine_cls: type[Any], tenant: Tenant) -> None:
    """verl's own engine tests call send/receive without build_topology: the publisher then
    takes latest()+1, and the receiver waits for a version newer than the last it got."""
    actor = engine_cls(bucket_size=1 << 20, is_master=True, **tenant.kwargs(timeout=30))
    rollout = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=30))
    model = tiny.build(tiny.SMALL, seed=3)
    try:
        for step in range(1, 3):
            tiny.step(model, seed=step)

            async def both() -> list[Any]:
                return await asyncio.gather(
                    actor.send_weights(tiny.per_tensor(model)),
                    _collect(rollout.receive_weights()),
                )

            _, got = asyncio.run(asyncio.wait_for(both(), timeout=60))
            assert rollout.held.version == step
            assert tiny.digests(got) == tiny.digests(dict(tiny.per_tensor(model)))
    finally:
        actor.close()
        rollout.close()


def test_a_version_never_published_is_a_deadline(engine_cls: type[Any], tenant: Tenant) -> None:
    rollout = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=1.5))
    try:
        rollout.init_process_group(role="rollout", rank=0, version=7)
        start = time.monotonic()
        with pytest.raises(ros.DeadlineExceeded, match="policy@7"):
            asyncio.run(_collect(rollout.receive_weights()))
        assert time.monotonic() - start < 10
    finally:
        rollout.close()


def test_misuse_is_a_named_error(
    engine_cls: type[Any], tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TENSORHUB_HUB", "TENSORHUB_TENANT", "TENSORHUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ros.InvalidArgument, match="TENSORHUB_HUB"):
        engine_cls(bucket_size=1)
    monkeypatch.setenv("TENSORHUB_HUB", tenant.hub)
    monkeypatch.setenv("TENSORHUB_TENANT", tenant.tenant)
    monkeypatch.setenv("TENSORHUB_TOKEN", tenant.token)
    engine = engine_cls(bucket_size=1)  # everything from the environment
    try:
        with pytest.raises(ros.InvalidArgument, match="is_master"):
            engine_cls.build_topology(1, 1, [{"is_master": False}, {"is_master": False}])
        engine.init_process_group(role="rollout", rank=0, version=1)
        with pytest.raises(ros.InvalidArgument, match="cannot send"):
            asyncio.run(engine.send_weights(iter([])))
    finally:
        engine.close()


# -- delta versions (on by default) ----------------------------------------------------------


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_the_second_update_moves_only_the_delta(engine_cls: type[Any], tenant: Tenant) -> None:
    """By default rank 0 publishes each next version also as its changes, and the rollout,
    fetching into the memory of the version before, reads only those: exact bytes, and far
    fewer of them than the model."""
    actor = engine_cls(bucket_size=1 << 20, is_master=True, **tenant.kwargs(timeout=30))
    rollout = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=30))
    model = tiny.build(tiny.SMALL, seed=0)
    full = model_bytes(model)
    try:
        metrics, (first,) = update(engine_cls, [actor], [rollout], model)
        assert metrics["tensorhub/delta_mb"] == 0  # nothing to encode against yet
        assert rollout.held.delta is None
        tiny.nudge(model, seed=1)
        metrics, (got,) = update(engine_cls, [actor], [rollout], model)
        assert tiny.digests(got) == tiny.digests(dict(tiny.per_tensor(model)))
        assert all(got[n].data_ptr() == first[n].data_ptr() for n in got)  # same memory
        delta = rollout.held.delta
        assert delta is not None
        assert delta.base == 1, delta
        assert delta.chunks > 0, delta
        assert delta.base_mismatch == 0, delta
        assert delta.encoded_bytes + rollout.held.stats.total_bytes < full / 2, delta
        assert 0 < metrics["tensorhub/delta_mb"] < full / 2**20 / 2
    finally:
        actor.close()
        rollout.close()


def test_delta_false_reads_whole(engine_cls: type[Any], tenant: Tenant) -> None:
    """The switch: no copy kept on rank 0, no delta published, the update read whole."""
    kwargs = tenant.kwargs(timeout=30, delta=False)
    actor = engine_cls(bucket_size=1 << 20, is_master=True, **kwargs)
    rollout = engine_cls(bucket_size=1 << 20, **kwargs)
    model = tiny.build(tiny.SMALL, seed=0)
    try:
        update(engine_cls, [actor], [rollout], model)
        tiny.nudge(model, seed=1)
        metrics, (got,) = update(engine_cls, [actor], [rollout], model)
        assert tiny.digests(got) == tiny.digests(dict(tiny.per_tensor(model)))
        assert metrics["tensorhub/delta_mb"] == 0
        assert actor.publication.companion is None
        assert rollout.held.delta is None
        assert rollout.held.stats.total_bytes == model_bytes(model)
    finally:
        actor.close()
        rollout.close()


# -- a holder dies mid-fetch ----------------------------------------------------------------


class Publisher:
    """tests/engines/verl/publisher.py in a subprocess: actor rank 0 with a slowed holder."""

    def __init__(self, tenant: Tenant, host: str = "h1") -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engines.verl.publisher", tenant.hub, tenant.tenant,
             tenant.token, MODEL, host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
        )  # fmt: skip

    def publish(self, seed: int, delay: float) -> tuple[int, dict[str, str]]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"publish {seed} {delay}\n")
        self.proc.stdin.flush()
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(60)
        assert line, "the publisher said nothing within 60 s"
        assert line[0].startswith("published"), f"publisher said {line!r}"
        _, version, sent = line[0].split(" ", 2)
        return int(version), json.loads(sent)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def receive_in_thread(engine: Any, version: int) -> tuple[threading.Thread, dict[str, Any]]:
    """Start `receive_weights` of `version` in a thread; its outcome lands in the dict."""
    engine.init_process_group(role="rollout", rank=0, version=version)
    outcome: dict[str, Any] = {"yielded": 0}

    async def consume() -> dict[str, torch.Tensor]:
        got = {}
        async for name, tensor in engine.receive_weights():
            outcome["yielded"] += 1
            got[name] = tensor
        return got

    def run() -> None:
        try:
            outcome["tensors"] = asyncio.run(consume())
        except Exception as exc:  # the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def kill_mid_fetch(tenant: Tenant, publisher: Publisher, reader: Any, version: int) -> None:
    """SIGKILL the publisher once `reader` has registered as a PARTIAL holder of `version` and
    had time for about one slowed chunk (the fetch is then under way, far from done)."""
    with (
        ros.connect(tenant.hub, tenant=tenant.tenant, token=tenant.token) as observer,
        observer.watch(MODEL, since=1) as events,
    ):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            event = events.get(deadline - time.monotonic())
            if (
                event is not None
                and event.kind is EventKind.HOLDER_UPDATED
                and event.version == version
                and event.holder is not None
                and event.holder.holder == reader.hub.holder_name
            ):
                break
        else:
            pytest.fail("the reader never registered as a holder")
    time.sleep(0.6)
    publisher.kill()


def test_holder_dies_mid_fetch_another_holder_finishes_it(
    engine_cls: type[Any], tenant: Tenant
) -> None:
    """The publisher dies while rollout A reads from it (A's nearest holder: same host);
    rollout B, on another host, holds the same version and serves the rest: A gets exactly
    the published bytes, and its fetch names the dead publisher among its failed sources."""
    publisher = Publisher(tenant, host="h1")
    near = {"dc": "dc1", "rack": "r1", "host": "h1"}
    far = {"dc": "dc1", "rack": "r1", "host": "h2"}
    a = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=60, topology=near))
    b = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=60, topology=far))
    try:
        version, sent = publisher.publish(seed=1, delay=0.4)
        thread, outcome = receive_in_thread(b, version)  # slowly, from the publisher
        thread.join(60)
        assert tiny.digests(outcome["tensors"]) == sent
        thread, outcome = receive_in_thread(a, version)
        kill_mid_fetch(tenant, publisher, a, version)
        thread.join(60)
        assert not thread.is_alive()
        assert "error" not in outcome, outcome.get("error")
        assert tiny.digests(outcome["tensors"]) == sent
        assert a.held.version == version
        stats = a.held.stats
        assert stats.failed_sources, stats  # it was reading from the publisher when it died
        assert stats.bytes_per_source.get(b.hub.holder_name, 0) > 0, stats
    finally:
        publisher.kill()
        for engine in (a, b):
            engine.close()


def test_only_holder_dies_mid_fetch_named_error_and_old_weights_intact(
    engine_cls: type[Any], tenant: Tenant
) -> None:
    """The only holder of the new version dies mid-fetch: `receive_weights` raises a named
    error having yielded nothing, so what the rollout had loaded (the previous version) is
    untouched: never a mix of two versions."""
    publisher = Publisher(tenant)
    rollout = engine_cls(bucket_size=1 << 20, **tenant.kwargs(timeout=30))
    loaded: dict[str, torch.Tensor] = {}  # the inference engine's weights
    try:
        first, sent_first = publisher.publish(seed=1, delay=0.0)
        thread, outcome = receive_in_thread(rollout, first)
        thread.join(60)
        loaded = {name: t.clone() for name, t in outcome["tensors"].items()}
        assert tiny.digests(loaded) == sent_first
        second, sent_second = publisher.publish(seed=2, delay=0.4)
        assert second == first + 1
        assert sent_second != sent_first
        start = time.monotonic()
        thread, outcome = receive_in_thread(rollout, second)
        kill_mid_fetch(tenant, publisher, rollout, second)
        thread.join(40)
        assert not thread.is_alive()
        assert isinstance(outcome.get("error"), ros.TensorHubError), outcome
        assert outcome["yielded"] == 0
        assert time.monotonic() - start < 40
        assert tiny.digests(loaded) == sent_first
        assert rollout.held is None  # nothing half-fetched is served
    finally:
        publisher.kill()
        rollout.close()
