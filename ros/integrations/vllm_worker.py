"""A method TensorHub adds to every vLLM worker, so `llm.collective_rpc` can ask it by name.

`collective_rpc` with a function pickles the function to vLLM's engine process, which vLLM
refuses unless `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (unpickling from a socket runs code); a
method name travels as a plain string, in every mode. vLLM mixes this class into its worker
class when the `LLM` names it:

    llm = LLM(model=path, weight_transfer_config={"backend": "tensorhub"},
              worker_extension_cls=WORKER_EXTENSION)
    llm.collective_rpc(STATUS)   # one dict per worker
    llm.collective_rpc(DIGEST)   # what each worker's model was last loaded from
    llm.collective_rpc(BLOCKS)   # each worker's blocks (`vllm.declare_layout` declares them)

The answer is plain data (numbers, strings, dicts of them): vLLM hands a worker's result back
to its client without type information unless insecure serialization is on, so a dataclass
would arrive as a dict anyway.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from ros.integrations.vllm import ABORT, BLOCKS, VersionReceiver
from ros.integrations.vllm_blocks import BlockReceiver
from ros.integrations.vllm_engine import TensorHubWeightTransferEngine
from ros.integrations.vllm_memory import resident
from tensorhub.errors import EngineNotReady
from transport.outcome import FetchStats

WORKER_EXTENSION = f"{__name__}.TensorHubWorkerExtension"
STATUS = "tensorhub_status"  # the methods' names, for `collective_rpc`
DIGEST = "tensorhub_digest"
__all__ = ["ABORT", "BLOCKS", "DIGEST", "STATUS", "WORKER_EXTENSION", "TensorHubWorkerExtension"]


class TensorHubWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (`worker_extension_cls`): `self` is a worker.

    Its methods are prefixed, since vLLM refuses an extension whose names the worker has.
    """

    def tensorhub_status(self) -> dict[str, Any]:
        """This worker's TensorHub engine: the worker's process id (which process runs it),
        the version its model runs, the bytes of checkpoint copies it holds (`serve`) and of
        what it keeps as the next update's base (`delta`: the checkpoint copy, or the SDK's
        staging copies of the source shards of a version published as shards), what its last
        fetch read and from whom (`FetchStats` as a dict; None before one), and what that
        fetch's delta did (`DeltaStats` as a dict, summed over the source shards of a sharded
        version; None when it read the version whole).

        `EngineNotReady` if the worker's weight-transfer engine is not TensorHub's."""
        receiver = _receiver(self)
        memory = {"last_update_memory": _engine(self).last_update_memory}
        if isinstance(receiver, BlockReceiver):
            return {**_block_status(receiver), **memory}
        stats = None if receiver is None else receiver.last_stats
        delta = None if receiver is None else receiver.last_delta
        return {
            "pid": os.getpid(),
            "version": 0 if receiver is None else receiver.version,
            "held_bytes": 0 if receiver is None else receiver.held_bytes,
            "base_bytes": 0 if receiver is None else receiver.base_bytes,
            "last_fetch": None if stats is None else _plain(stats),
            "last_delta": None if delta is None else dataclasses.asdict(delta),
            **memory,
        }

    def tensorhub_abort_update(self) -> bool:
        """End this worker's update session after the update failed on another worker,
        without loading what it read (`TensorHubWeightTransferEngine.abort_weight_update`),
        so that the next update can start: vLLM ends the session only of the workers whose
        `update_weights` raised (`ros.integrations.vllm.update_vllm` calls this). True if
        this worker's session was open."""
        engine = _engine(self)
        active = bool(getattr(self, "_weight_update_active", False))
        engine.abort_weight_update()
        if active:
            engine.reset_weight_update_target()
            self._weight_update_active = False  # vLLM's worker: its session flag
        return active

    def tensorhub_blocks(self) -> dict[str, Any]:
        """What `ros.integrations.vllm.declare_layout` declares for this worker: its model,
        its layout (None when it reads whole versions, not blocks) and its blocks, name ->
        [dtype, global shape, offsets, shape] (empty before its first update, where it
        learns them; none for a worker whose engine was not initialised: model None)."""
        receiver = _receiver(self)
        if not isinstance(receiver, BlockReceiver):
            model = None if receiver is None else receiver.model
            return {"model": model, "layout": None, "blocks": {}}
        blocks = {name: list(row) for name, row in receiver.declaration().items()}
        return {"model": receiver.model, "layout": receiver.layout, "blocks": blocks}

    def tensorhub_digest(self) -> dict[str, Any]:
        """The version this worker's model runs and an xxh3-64 over the names and bytes of
        the host copy it was loaded from, in checkpoint order (None when no copy is left:
        `serve` and `delta` both off, or a version read as shards, whose checkpoint tensors
        are not kept), to compare with the trainer's `weights_digest`."""
        receiver = _receiver(self)
        if receiver is None:
            return {"version": 0, "digest": None}
        if isinstance(receiver, BlockReceiver):
            return {"version": receiver.version, "digest": None}
        tensors = receiver.loaded_copy()
        return {
            "version": receiver.version,
            "digest": None if tensors is None else weights_digest(tensors),
        }


def _block_status(receiver: BlockReceiver) -> dict[str, Any]:
    """`tensorhub_status` of a worker that reads its blocks only: the fields of the
    whole-version status (`base_bytes` 0: the blocks are the delta base, no copy), plus
    the layout, the bytes of its blocks, the box of each tensor it consumes ((offsets,
    shape)), the blocks its last fetch read from the trainer's shards, whether it
    serves them, how many chunks it read from peers were checked against the publisher's
    checksums (`publisher_checked`: a declared layout, `ros.integrations.vllm.declare_layout`),
    and its process's resident memory now and at its highest (bytes, from
    /proc)."""
    stats = receiver.last_stats
    got = receiver.last_fetch
    delta = receiver.last_delta
    return {
        "pid": os.getpid(),
        "version": receiver.version,
        "held_bytes": receiver.held_bytes,
        "base_bytes": 0,
        "last_fetch": None if stats is None else _plain(stats),
        "last_delta": None if delta is None else dataclasses.asdict(delta),
        "layout": receiver.layout,
        "block_bytes": receiver.block_bytes,
        "boxes": {n: (list(b.offsets), list(b.shape)) for n, b in receiver.boxes.items()},
        "from_trainer": None if got is None else sorted(got.from_trainer),
        "served": None if got is None else got.served,
        "publisher_checked": None if got is None else got.publisher_checked,
        **resident(),
    }


def _receiver(worker: Any) -> VersionReceiver | BlockReceiver | None:
    return _engine(worker).receiver


def _engine(worker: Any) -> TensorHubWeightTransferEngine:
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, TensorHubWeightTransferEngine):
        raise EngineNotReady(
            f"the worker's weight-transfer engine is {type(engine).__name__}, not "
            "tensorhub: start the LLM with weight_transfer_config={'backend': 'tensorhub'}"
        )
    return engine


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """xxh3-64 over every tensor's name and bytes, in the mapping's order (a trainer hashes
    the dict it published, in the same order)."""
    h = xxhash.xxh3_64()
    for name, tensor in tensors.items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _plain(stats: FetchStats) -> dict[str, Any]:
    """A `FetchStats` as the plain dict that crosses vLLM's processes (its `touched` set of
    chunk indices, bookkeeping of the fetch, left out)."""
    return {
        f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "touched"
    }
