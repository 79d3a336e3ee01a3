"""One verl actor rank on CPU: real FSDP2 over gloo, verl's own `update_weights` and FSDP
engine code, feeding the `tensorhub` checkpoint engine (tests/engines/verl/test_shards.py,
and the memory figures of `python -m tests.engines.verl.memory`).

usage: python -m tests.engines.verl.fsdp_rank_proc HUB TENANT TOKEN MODEL SIZE [TIMEOUT]
with torch.distributed's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`);
SIZE names a config of `SIZES`, TIMEOUT the seconds of one update (default 60). Every rank
joins a gloo group, builds the same transformers Llama from a config (seeded, nothing
downloaded) and shards it with FSDP2 (`fully_shard` on each decoder layer and on the model,
a 1-D CPU mesh). Then one JSON command a line on stdin,
one JSON answer a line on stdout, every rank in step:

- `{"op": "update", "step": S, "shards": bool, "group": bool}`: one weight update as verl
  runs it on the actor side: the manager's part (`prepare` on every rank, `build_topology`
  for these actor ranks and one rollout, `init_process_group` on each) and then verl's
  `ActorRolloutRefWorker.update_weights`, which asks the FSDP engine for
  `get_per_tensor_param()` and awaits `send_weights` on it; `finalize` last. Answers what
  the rank published, what it gathered (`full_tensor` calls), its memory, and its metrics.
- `{"op": "step", "seed": N, "check": bool}`: an RL-sized optimizer step on each rank's own
  shard (1 % of the elements change); with `check` (the default), rank 0 answers the
  digests of the full state dict after it (`get_model_state_dict(full_state_dict=True)`, a
  gather made for the test's check only; the memory figures run without it).

What is real: torch's FSDP2 and gloo, transformers' Llama, verl 0.9.1's
`ActorRolloutRefWorker.update_weights` and `FSDPEngine.get_per_tensor_param` (as hooked by
`ros.integrations.verl_shards`), verl's registry and `import_external_libs`, the backend, the
SDK, the hub. What stands in: the FSDP engine's constructor (it needs CUDA: the engine is
made without it and given the attributes `get_per_tensor_param` reads), verl's two CUDA-only
helpers in that module (`get_device_id`, which answers "cpu" here, and
`log_gpu_memory_usage`), the worker object around `update_weights` (its config, actor and
checkpoint engine: what its `init_model` would have set) and the Ray manager that sequences
the calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sys
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128},  # 0.4 MB
    "memory": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816},  # 0.5 GB
}
LAYERS = {"tiny": 2, "memory": 4}


def llama(size: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        **SIZES[size],
        num_hidden_layers=LAYERS[size],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def memory() -> dict[str, int]:
    """This process's resident and peak resident bytes (`/proc/self/status`)."""
    status = open("/proc/self/status").read()  # noqa: SIM115
    return {k: int(re.search(rf"{k}:\s+(\d+)", status).group(1)) * 1024  # type: ignore[union-attr]
            for k in ("VmRSS", "VmHWM")}  # fmt: skip


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak resident size
        f.write("5")


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode() + data).hexdigest()


class Rank:
    def __init__(
        self, hub: str, tenant: str, token: str, model: str, size: str, timeout: float
    ) -> None:
        import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs
        from verl.workers.engine_workers import ActorRolloutRefWorker

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # stand-ins for verl's CUDA-only helpers in the FSDP engine's module
        fsdp_impl.get_device_id = lambda: "cpu"
        fsdp_impl.log_gpu_memory_usage = lambda *a, **k: None
        self.model = llama(size)
        mesh = init_device_mesh("cpu", (self.world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        # the FSDP engine without its CUDA-bound constructor: what get_per_tensor_param reads
        engine = fsdp_impl.FSDPEngineWithLMHead.__new__(fsdp_impl.FSDPEngineWithLMHead)
        engine.module = self.model
        engine._uses_fsdp2_cpu_offload_policy = False
        engine._is_offload_param = False
        engine._qat_enabled = False
        engine.model_config = SimpleNamespace(lora={}, hf_config=self.model.config)
        # the checkpoint engine, built as ActorRolloutRefWorker.init_model builds it
        import_external_libs("ros.integrations.verl")
        kwargs = {"hub": hub, "tenant": tenant, "token": token, "model": model, "timeout": timeout}
        self.engine = CheckpointEngineRegistry.new(
            "tensorhub", is_master=self.rank == 0, bucket_size=1 << 20, **kwargs
        )
        checkpoint = SimpleNamespace(backend="tensorhub")
        self.worker = SimpleNamespace(  # what update_weights reads of its worker
            config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=checkpoint)),
            actor=SimpleNamespace(engine=engine),
            checkpoint_engine=self.engine,
        )
        self.update_weights = ActorRolloutRefWorker.update_weights
        self.gathers = 0
        gather = DTensor.full_tensor

        def counted(tensor: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.gathers += 1
            return gather(tensor, *args, **kwargs)

        DTensor.full_tensor = counted  # type: ignore[method-assign]

    def shard_bytes(self) -> int:
        """Bytes of this rank's own FSDP shards (the local tensors of its DTensors)."""
        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).nbytes
            for p in self.model.state_dict().values()
        )

    def update(self, step: int, shards: bool, group: bool) -> dict[str, Any]:
        engine = self.engine
        engine.shards, engine.group = shards, group
        # the manager's part: prepare everywhere, the topology, each worker's share
        metadata: list[Any] = [None] * self.world
        dist.all_gather_object(metadata, engine.prepare())
        actor, _ = type(engine).build_topology(self.world, 1, [*metadata, {"is_master": False}])
        engine.init_process_group(**{key: values[self.rank] for key, values in actor.items()})
        self.gathers = 0
        before = memory()
        reset_peak()
        metrics = asyncio.run(self.update_weights(self.worker, global_steps=step))
        after = memory()
        engine.finalize()
        publication = engine.publication
        served = {} if publication is None else publication.tensors
        live = {
            (p.to_local() if isinstance(p, DTensor) else p).data_ptr()
            for p in self.model.state_dict().values()
        }
        return {
            "rank": self.rank,
            "version": engine.last_version,
            "shard": None if publication is None else publication.shard,
            "served_bytes": sum(t.nbytes for t in served.values()),
            "served_live_memory": any(t.data_ptr() in live for t in served.values()),
            "shard_bytes": self.shard_bytes(),
            "model_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "base_bytes": engine.hub.delta_memory()["base_copies"],
            "spills": engine.hub.spills.spills,  # host copies made to release a version
            "gathers": self.gathers,
            "rss_growth": after["VmRSS"] - before["VmRSS"],
            "peak_growth": after["VmHWM"] - before["VmRSS"],
            "metrics": metrics,
        }

    def step(self, seed: int, check: bool = True) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(seed * 1000 + self.rank)
        with torch.no_grad():
            for param in self.model.parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                mask = torch.rand(local.shape, generator=generator) < 0.01
                local.copy_(torch.where(mask, local * 1.01, local))
        if not check:
            return {"rank": self.rank}
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        if self.rank != 0:
            return {"rank": self.rank}
        return {"rank": 0, "digests": {k: digest(v) for k, v in full.items()}}


def main() -> int:
    hub, tenant, token, model, size = sys.argv[1:6]
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    limit = timedelta(seconds=max(timeout, 60.0))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=limit)
    try:
        me = Rank(hub, tenant, token, model, size, timeout)
        print(json.dumps({"ready": rank}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            try:
                answer = getattr(me, op)(**command)
            except Exception as exc:
                answer = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)
        me.engine.close()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
