"""Ray workers for test_manager.py: what verl's `CheckpointEngineManager` drives, minus the
parts that need a GPU.

- `TrainerWorker` stands in for verl's `ActorRolloutRefWorker` (FSDP/Megatron need CUDA
  here): the same two registered methods the manager calls on the actor worker group, the
  engine built the way `engine_workers.py` builds it, and a tiny Llama whose
  `state_dict()` generator plays `get_per_tensor_param()`.
- The rollout side is verl's own `CheckpointEngineWorker`; only its server adapter (vLLM or
  SGLang, GPU-only) is `RecordingAdapter`, which loads what `receive_weights` yields into a
  tiny Llama of its own and writes the loaded weights' digests to a file per update.
- `StandInReplica` is what the manager needs of a `RolloutReplica`: its workers, and the
  abort / kv-cache / resume calls (nothing to abort without an inference server).
"""

from __future__ import annotations

import json
from typing import Any

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.utils import ensure_async_iterator

from tests.engines.verl import tiny


class TrainerWorker(Worker):
    """Actor rank `RANK` of `WORLD_SIZE` (Ray env), with a tiny Llama built from `seed`."""

    def __init__(self, config: CheckpointEngineConfig, seed: int) -> None:
        super().__init__()
        import_external_libs(config.custom_backend_module or None)
        self.model = tiny.build(tiny.SMALL, seed=seed)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            is_master=self.rank == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}),
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        weights = tiny.per_tensor(self.model)
        metrics = await self.checkpoint_engine.send_weights(weights, global_steps=global_steps)
        return metrics or {}

    def train_step(self, seed: int) -> dict[str, str]:
        """One deterministic RL-sized step (the same on every rank: 1 % of the elements
        change, so the next version is worth a delta); the new weights' digests."""
        tiny.nudge(self.model, seed)
        return tiny.digests(self.model.state_dict())


class RecordingAdapter:
    """A rollout server adapter (`BaseRollout.update_weights`'s contract) that loads the
    weights into a tiny Llama and appends `{global_steps, digests}` to `path` per update."""

    replica_rank = 0
    is_leader_rank = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.model: Any = None

    async def update_weights(
        self, weights: Any, global_steps: int | None = None, wire_format: str = "", **_: Any
    ) -> None:
        assert wire_format == "named_tensors", wire_format
        if self.model is None:
            self.model = tiny.build(tiny.SMALL, seed=99)  # other weights until loaded
        state = self.model.state_dict()
        loaded = set()
        async for name, tensor in ensure_async_iterator(weights):
            state[name].copy_(tensor)
            loaded.add(name)
        assert loaded == set(state), set(state) ^ loaded
        with open(self.path, "a") as out:
            out.write(json.dumps({"global_steps": global_steps, "digests": tiny.digests(state)}))
            out.write("\n")


class StandInReplica:
    """What `CheckpointEngineManager.update_weights` calls on each rollout replica."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        pass

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass

    async def resume_generation(self) -> None:
        pass
