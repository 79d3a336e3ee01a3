"""The `tensorhub` backend through verl's own manager path on CPU: `CheckpointEngineManager`
(`update_weights`: prepare on every worker, `build_topology`, `init_process_group`, the
actor group's `update_weights` -> `send_weights` beside the rollout workers'
`update_weights` -> `receive_weights` -> server adapter, `finalize`), over a real local Ray
cluster, verl's `RayWorkerGroup` dispatch and verl's own `CheckpointEngineWorker` on the
rollout side, with a real etcd and hub. Stand-ins (workers.py) replace only what needs a GPU:
the FSDP actor, the vLLM/SGLang server adapter and the replica's inference server.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

import ros
from tests.engines.verl.conftest import Tenant
from tests.engines.verl.workers import RecordingAdapter, StandInReplica, TrainerWorker

ROOT = str(Path(__file__).resolve().parents[3])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(rank: int, world_size: int) -> dict[str, Any]:
    """What verl's worker groups put in a worker's environment (Worker.__init__ reads it)."""
    return {
        "env_vars": {
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_port()),
            "CUDA_VISIBLE_DEVICES": "",
        }
    }


@pytest.fixture
def ray_cluster() -> Iterator[None]:
    """A Ray cluster of this test's own (`address="local"`, its own temp dir): never one that
    another test run on this machine started, and never found by theirs."""
    temp = tempfile.mkdtemp(prefix="ray-verl-", dir="/tmp")  # short: Ray's socket paths
    ray.init(
        address="local", num_cpus=8, include_dashboard=False, object_store_memory=80 * 2**20,
        logging_level="WARNING", runtime_env=_env(0, 1), _temp_dir=temp,
    )  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(240)
def test_manager_updates_rollouts_through_the_hub(
    ray_cluster: None, tenant: Tenant, tmp_path: Path
) -> None:
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    config = CheckpointEngineConfig(
        backend="tensorhub",
        update_weights_bucket_megabytes=1,
        engine_kwargs={"tensorhub": tenant.kwargs(model="policy", timeout=60)},
        custom_backend_module="ros.integrations.verl",
    )
    trainer_cls = ray.remote(TrainerWorker)
    trainers = [
        trainer_cls.options(num_cpus=0, runtime_env=_env(rank, 2)).remote(config, seed=0)
        for rank in range(2)
    ]
    actor_wg = RayWorkerGroup(
        worker_handles=trainers, ray_cls_with_init=RayClassWithInitArgs(cls=trainer_cls)
    )
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config)
    rollout_cls = ray.remote(CheckpointEngineWorker)  # as RolloutReplica builds its workers
    records = [tmp_path / f"rollout-{i}.jsonl" for i in range(2)]
    rollouts = [
        rollout_cls.options(num_cpus=0, runtime_env=_env(0, 1)).remote(
            rollout_config, None, RecordingAdapter(str(path))
        )
        for path in records
    ]
    replicas = [StandInReplica([worker]) for worker in rollouts]  # two replicas of TP 1
    manager = CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=replicas)
    try:
        for step in range(1, 4):
            trained = ray.get([t.train_step.remote(step) for t in trainers], timeout=60)
            assert trained[0] == trained[1]
            metrics = manager.update_weights(global_steps=step)
            assert metrics["tensorhub/version"] == step
            # deltas by default: from the second step on, rank 0 also published the changes
            assert (metrics["tensorhub/delta_mb"] > 0) == (step > 1), metrics
            for path in records:
                last = json.loads(path.read_text().splitlines()[-1])
                assert last["global_steps"] == step
                assert last["digests"] == trained[0]
        assert [len(p.read_text().splitlines()) for p in records] == [3, 3]
        with ros.connect(tenant.hub, tenant=tenant.tenant, token=tenant.token) as observer:
            assert observer.latest("policy") == 3
            complete = [h for h in observer.holders("policy", 3) if h.complete]
            assert len(complete) == 3  # actor rank 0 and both rollouts serve it
    finally:
        ray.get(
            [w.execute_checkpoint_engine.remote("close") for w in [*trainers, *rollouts]],
            timeout=30,
        )
