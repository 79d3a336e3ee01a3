"""The rollout layout of `tensorhub bench reshard`: which block of each checkpoint tensor each
worker of a vLLM instance at TP 2 and TP 4 takes, as vLLM's own loaders give it.

`record` (run once, in the vLLM CPU build: `make test-engines` installs it) starts vLLM at
each tensor-parallel size on a tiny Llama written from `CONFIG` (merged `qkv_proj` and
`gate_up_proj`; one KV head, so every TP > 1 replicates it) and asks every worker, through
`collective_rpc`, for the blocks its loaders copy from
(`ros.integrations.vllm_plan.learn_blocks`, the plan `BlockReceiver` reads by). The result
is committed as `FIXTURE`, so the benchmark needs no vLLM:

    .venv-vllm-cpu/bin/python -m bench.reshard_layout --out bench/fixtures/vllm_llama_tp.json

`load` reads the fixture back and checks it (`check`): every worker's block of a tensor lies
inside it, and the workers of an instance together cover every tensor; the benchmark's
model (`layer_pattern`) repeats the recorded decoder layer, whose blocks are the same in
every layer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorhub.errors import InvalidArgument
from transport.boxes import Box

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_llama_tp.json"
SIZES = (2, 4)
CONFIG: dict[str, Any] = {
    # head_dim 64: vLLM's CPU attention refuses smaller heads; one KV head: replicated at TP > 1
    "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1024,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 64, "max_position_embeddings": 128, "tie_word_embeddings": False,
}  # fmt: skip
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Recorded:
    """The fixture: the config, each checkpoint tensor's shape, and per TP size the box of
    each tensor each worker takes (rank order)."""

    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    workers: dict[int, list[dict[str, Box]]]


def _worker_blocks(worker: Any, infos: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """Run in each vLLM worker (`collective_rpc`): its blocks, by its own loaders."""
    import torch

    from ros.integrations.vllm_plan import TensorInfo, learn_blocks

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    tensors = [TensorInfo(n, tuple(s), torch.float32) for n, s in infos]
    boxes = learn_blocks(model, tensors)
    return {n: [list(b.offsets), list(b.shape)] for n, b in sorted(boxes.items())}


def record(sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Start vLLM at each of `SIZES` on the tiny Llama and collect every worker's blocks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM

    # `collective_rpc` sends `_worker_blocks` to the workers by pickle (this process's own);
    # the machine is shared: no thread pinning. Restored afterwards (a test runs this).
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        shapes = {n: list(t.shape) for n, t in model.state_dict().items()}
        out: dict[str, Any] = {"config": CONFIG, "shapes": shapes, "layouts": {}}
        with tempfile.TemporaryDirectory() as where:
            model.save_pretrained(where)
            for tp in sizes:
                llm = LLM(
                    model=where, skip_tokenizer_init=True, dtype="float32", max_model_len=64,
                    enforce_eager=True, tensor_parallel_size=tp,
                    distributed_executor_backend="uni" if tp == 1 else "mp",
                )  # fmt: skip
                try:
                    answers = llm.collective_rpc(_worker_blocks, args=(sorted(shapes.items()),))
                finally:
                    del llm
                out["layouts"][f"vllm-tp{tp}"] = [dict(a) for a in answers]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def parse(data: Mapping[str, Any]) -> Recorded:
    """The fixture's JSON as `Recorded`, checked (`check`); `InvalidArgument` if malformed."""
    try:
        shapes = {str(n): tuple(int(d) for d in s) for n, s in data["shapes"].items()}
        workers: dict[int, list[dict[str, Box]]] = {}
        for name, ranks in data["layouts"].items():
            tp = int(str(name).removeprefix("vllm-tp"))
            workers[tp] = [
                {str(n): Box(tuple(b[0]), tuple(b[1])) for n, b in rank.items()} for rank in ranks
            ]
        recorded = Recorded(dict(data["config"]), shapes, workers)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"malformed layout fixture: {exc}") from exc
    check(recorded)
    return recorded


def check(recorded: Recorded) -> None:
    """Each TP size has that many workers; each worker's block of a tensor lies inside it;
    together they cover every tensor; and the layers' blocks repeat (`InvalidArgument`)."""
    for tp, ranks in recorded.workers.items():
        if len(ranks) != tp:
            raise InvalidArgument(f"TP {tp}: {len(ranks)} workers recorded")
        for name, shape in recorded.shapes.items():
            boxes = [r[name] for r in ranks if name in r]
            if any(not b.within(shape) for b in boxes):
                raise InvalidArgument(f"TP {tp}: a block of {name!r} lies outside {shape}")
            union = _union_volume(boxes)
            if union != Box((0,) * len(shape), shape).volume:
                raise InvalidArgument(f"TP {tp}: the workers cover {union} elements of {name!r}")
        for rank, blocks in enumerate(ranks):
            per_layer: dict[int, dict[str, Box]] = {}
            for name, box in blocks.items():
                m = LAYER.match(name)
                if m:
                    per_layer.setdefault(int(m.group(1)), {})[LAYER.sub("", name)] = box
            if any(p != per_layer.get(0) for p in per_layer.values()):
                raise InvalidArgument(f"TP {tp} rank {rank}: its layers' blocks differ")


def _union_volume(boxes: list[Box]) -> int:
    """Elements covered by `boxes` (distinct boxes; equal ones, replicated, count once)."""
    distinct = list(dict.fromkeys((b.offsets, b.shape) for b in boxes))
    total = sum(Box(o, s).volume for o, s in distinct)
    for i, (o1, s1) in enumerate(distinct):
        for o2, s2 in distinct[i + 1 :]:
            common = Box(o1, s1).intersect(Box(o2, s2))
            if common is not None and common.volume:
                raise InvalidArgument(f"blocks {Box(o1, s1)} and {Box(o2, s2)} overlap in part")
    return total


def load(path: Path = FIXTURE) -> Recorded:
    """The committed fixture, checked."""
    return parse(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reshard_layout", description=__doc__)
    ap.add_argument("--out", type=Path, default=FIXTURE, help="where to write the fixture")
    ap.add_argument("--check", action="store_true",
                    help="record and compare with --out instead of writing it")  # fmt: skip
    args = ap.parse_args(argv)
    data = record()
    parse(data)
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if args.check:
        same = json.loads(args.out.read_text()) == json.loads(text)
        print(f"{args.out}: {'matches' if same else 'DIFFERS FROM'} vLLM's loaders")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- the benchmark's model, in the recorded layout -------------------------------------------

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class BenchModel:
    """The recorded Llama with `layers` decoder layers (each with the recorded layer 0's
    shapes and blocks): every tensor's shape, and per worker of a TP-`tp` instance its box
    of each tensor."""

    shapes: dict[str, tuple[int, ...]]
    workers: list[dict[str, Box]]
    tp: int

    @property
    def nbytes(self) -> int:
        """The model's bytes (float32)."""
        return sum(4 * Box((0,) * len(s), s).volume for s in self.shapes.values())

    def block_bytes(self, rank: int) -> int:
        """Worker `rank`'s blocks' bytes."""
        return sum(4 * b.volume for b in self.workers[rank].values())


def bench_model(recorded: Recorded, tp: int, layers: int) -> BenchModel:
    """The recorded model at TP `tp` with `layers` layers (`InvalidArgument`: no such TP)."""
    if tp not in recorded.workers:
        raise InvalidArgument(
            f"no vLLM layout recorded at TP {tp} (have {sorted(recorded.workers)})"
        )
    if layers < 1:
        raise InvalidArgument(f"layers: {layers}, at least 1")

    def expand(table: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in table.items():
            m = LAYER.match(name)
            if m is None:
                out[name] = value
            elif m.group(1) == "0":
                rest = LAYER.sub("", name)
                out.update({f"model.layers.{i}.{rest}": value for i in range(layers)})
        return out

    return BenchModel(expand(recorded.shapes), [expand(w) for w in recorded.workers[tp]], tp)


def layers_for(recorded: Recorded, nbytes: int) -> int:
    """How many layers make the model closest to `nbytes` (at least 1)."""
    one = bench_model(recorded, min(recorded.workers), 1).nbytes
    two = bench_model(recorded, min(recorded.workers), 2).nbytes
    return max(1, round((nbytes - (2 * one - two)) / (two - one)))


def trainer_placements(
    shapes: Mapping[str, tuple[int, ...]], rank: int, ranks: int
) -> dict[str, tuple[tuple[int, ...], Box]]:
    """A Megatron-style TP-`ranks` trainer rank's box of each tensor: column-parallel ones
    (and the vocabulary) split on dim 0, row-parallel ones on dim 1, norms whole; a tensor
    with fewer rows than ranks (the one KV head's k/v) whole on every rank, as Megatron
    replicates KV heads when TP exceeds their count."""
    out: dict[str, tuple[tuple[int, ...], Box]] = {}
    for name, shape in shapes.items():
        whole = Box((0,) * len(shape), shape)
        dim = None
        if len(shape) == 2 and any(k in name for k in COLUMN_PARALLEL):
            dim = 0
        elif len(shape) == 2 and any(k in name for k in ROW_PARALLEL):
            dim = 1
        if dim is None or shape[dim] % ranks or shape[dim] // ranks < 64:
            out[name] = (shape, whole)
            continue
        n = shape[dim] // ranks
        offsets = [0] * len(shape)
        offsets[dim] = rank * n
        size = list(shape)
        size[dim] = n
        out[name] = (shape, Box(tuple(offsets), tuple(size)))
    return out
