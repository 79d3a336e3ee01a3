"""One trainer rank that publishes its DTensor state dict, for tests/ros/test_dtensor_publish.py.

Run from the repository root, one process per rank, with torch.distributed's environment
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), as
`python -m tests.ros.dtensor_rank_proc HUB TENANT TOKEN MODEL MODE OUT`. Every rank joins a
gloo process group (CPU) and builds the same tiny Llama (transformers' `LlamaForCausalLM`
from a `LlamaConfig`, seeded, nothing downloaded), then, by MODE:

- `fsdp`: FSDP2, `fully_shard` on each decoder layer and on the model, over a 1-D mesh;
- `tp`: tensor parallelism, `parallelize_module` with a column/row-wise plan (the norms stay
  plain tensors), over a 1-D mesh;
- `mesh`: no model: DTensors made with `distribute_tensor` on a 2 x 2 mesh, one per kind of
  placement (nested shards of one dimension, uneven and empty blocks, replica groups).

Then it publishes `model.state_dict()` (the DTensors as they are) as MODEL@1, and writes to
OUT: the full state dict (`get_model_state_dict(full_state_dict=True)`, rank 0 only) and the
tensors its publication serves (`shard-I.pt`, copies made after the publish, for the test to
compare). It prints one JSON line (rank, shard, whether each served tensor is the DTensor's
own local memory), then serves until its stdin closes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ros
from tests.gloo_ranks import leave, rank_session, say_and_serve

CONFIG: dict[str, Any] = {
    "vocab_size": 130,  # 4 ranks split it 33, 33, 33, 31: uneven last shards
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}

# (global shape, placements on a 2 x 2 mesh) of the `mesh` mode's DTensors
MESH_TENSORS = {
    "a.two_dims": ((6, 10), (Shard(0), Shard(1))),
    "b.nested_uneven": ((7, 3), (Shard(0), Shard(0))),
    "c.replica_groups": ((5, 4), (Replicate(), Shard(0))),
    "d.one_row_empty_blocks": ((1, 4), (Shard(0), Shard(0))),
    "e.replicated": ((8,), (Replicate(), Replicate())),
    "f.cols_then_replicas": ((3, 5), (Shard(1), Replicate())),
}


def llama(mode: str, world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tiny Llama sharded by `mode`: (its state dict, the full state dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    mesh = init_device_mesh("cpu", (world,))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan: dict[str, ColwiseParallel | RowwiseParallel] = {
            "model.embed_tokens": RowwiseParallel(),
            "lm_head": ColwiseParallel(),
        }
        for i in range(CONFIG["num_hidden_layers"]):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "mlp.gate_proj", "mlp.up_proj"):  # fmt: skip
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return dict(model.state_dict()), {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}


def meshed() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The `mesh` mode's DTensors on a 2 x 2 mesh: (them, the global tensors)."""
    mesh = init_device_mesh("cpu", (2, 2))
    full: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for i, (name, (shape, placements)) in enumerate(MESH_TENSORS.items()):
        full[name] = torch.arange(i * 1000, i * 1000 + torch.Size(shape).numel()).reshape(shape)
        out[name] = distribute_tensor(full[name].float(), mesh, list(placements))
        full[name] = full[name].float()
    full["g.plain"] = torch.arange(9.0).reshape(3, 3)
    out["g.plain"] = full["g.plain"].clone()
    return out, full


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("hub", "tenant", "token", "model", "mode", "out"):
        ap.add_argument(name)
    args = ap.parse_args()
    with rank_session() as (rank, world):
        out = Path(args.out)
        state, full = meshed() if args.mode == "mesh" else llama(args.mode, world)
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in full.items()}, out / "full.pt")
        hub = ros.connect(args.hub, tenant=args.tenant, token=args.token)
        try:
            publication = hub.publish(args.model, 1, state)
            own = {}
            for name, served in publication.tensors.items():
                value = state[name]
                local = value.to_local() if isinstance(value, DTensor) else value
                own[name] = served.data_ptr() == local.data_ptr()
            if publication.shard is not None:
                copies = {k: v.clone() for k, v in publication.tensors.items()}
                torch.save(copies, out / f"shard-{publication.shard}.pt")
            dtensors = sum(isinstance(v, DTensor) for v in state.values())
            say_and_serve(
                {"rank": rank, "shard": publication.shard, "own_memory": own, "dtensors": dtensors}
            )
        finally:
            hub.close()
    return 0


if __name__ == "__main__":
    leave(main())
