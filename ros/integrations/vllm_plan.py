"""Which block of which checkpoint tensor a vLLM worker consumes, learned from vLLM's loaders.

A tensor-parallel worker's loaders cut its part out of each full checkpoint tensor
(`narrow`, `chunk`, `view`, ...), merge q/k/v and gate/up into one parameter, replicate KV
heads across ranks, and skip a tied `lm_head`. Rather than a table per model, `learn_blocks`
drives the model's own `load_weights` once, as vLLM's `sharded_rdt` engine does
(`vllm/distributed/weight_transfer/sharded_rdt_fake.py`): every checkpoint tensor is a
zero-storage `FakeRDTTensor` that records the view ops a loader applies to it, and whose
`copy_` into a parameter is caught by a sink. Here the sink keeps each copy's source view;
replayed on a meta tensor of the global shape, a view gives the box of the global tensor it
reads. A worker's block of a tensor is the bounding box of its views (the whole tensor for a
replicated one; a tensor no loader copies from is no block of this worker).

`BlockSource` then feeds `load_weights` from the blocks alone: the same fakes, whose `copy_`
copies the matching view of the block (`view_in_block`), so no full checkpoint tensor is
ever built. The parameters are on meta during the recording (`initialize_layerwise_reload`,
restored untouched afterwards, as `sharded_rdt` restores them).

vLLM is untyped where mypy runs (not installed there): its objects are Any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ros.cli.rss import give_back_freed
from tensorhub.errors import InvalidArgument
from transport.boxes import Box

OpChain = tuple[tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]], ...]


@dataclass(frozen=True)
class TensorInfo:
    """A checkpoint tensor as the publisher's manifest names it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Recorder:
    """The dry run's `copy_` sink: every (name, op chain) a loader copied from."""

    views: dict[str, set[OpChain]] = field(default_factory=dict)

    def accept_copy(self, dest: torch.Tensor, src: Any) -> torch.Tensor:
        self.views.setdefault(src._name, set()).add(src._ops)
        return _meta_copy(dest, src)


@dataclass
class BlockSource:
    """The update's `copy_` sink: each copy reads its view out of the worker's block of
    that tensor (`blocks[name]`, holding `boxes[name]` of a tensor of `shapes[name]`).

    At the first copy of each tensor it hands the memory freed since back to the system
    (`ros.cli.rss.give_back_freed`, about 0.2 ms): vLLM's layerwise reload materialises
    each layer afresh and frees it once copied into the kernel's tensors, and glibc would
    otherwise keep those pages resident and take new ones for the next layer."""

    blocks: Mapping[str, torch.Tensor]
    boxes: Mapping[str, Box]
    shapes: Mapping[str, tuple[int, ...]]
    last: str = ""  # the tensor copied last

    def accept_copy(self, dest: torch.Tensor, src: Any) -> torch.Tensor:
        if dest.is_meta:  # vLLM's layerwise reload counting what a loader copies
            return _meta_copy(dest, src)
        name = src._name
        if name != self.last:
            self.last = name
            give_back_freed()  # the layers vLLM processed since the last tensor
        view = view_in_block(self.blocks[name], self.boxes[name], self.shapes[name], src._ops)
        with torch._C.DisableTorchFunctionSubclass():
            return dest.copy_(view)


def _meta_copy(dest: torch.Tensor, src: Any) -> torch.Tensor:
    """`dest.copy_` from a zero-storage meta source of `src`'s geometry (vLLM's layerwise
    reload counts the elements copied into each layer); a real `dest` is left alone."""
    if not dest.is_meta:
        return dest
    meta = torch.empty(src.shape, dtype=src.dtype, device="meta")
    with torch._C.DisableTorchFunctionSubclass():
        return dest.copy_(meta)


def fakes(infos: Sequence[TensorInfo], sink: Any) -> list[tuple[str, torch.Tensor]]:
    """One zero-storage `FakeRDTTensor` per checkpoint tensor, feeding `sink`."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import FakeRDTTensor

    out: list[tuple[str, torch.Tensor]] = []
    for info in infos:
        fake = FakeRDTTensor(
            name=info.name, shape=torch.Size(info.shape), dtype=info.dtype,
            device=torch.device("cpu"), sink=sink,
        )  # fmt: skip
        out.append((info.name, fake))
    return out


VIEW_OPS = frozenset(
    ("narrow", "view", "reshape", "__getitem__", "unsqueeze", "squeeze", "transpose", "t",
     "permute", "flatten", "contiguous", "chunk", "unbind")
)  # fmt: skip
"""The ops a `FakeRDTTensor` records (vLLM 0.32.0's `sharded_rdt_common.ALLOWED_OPS`)."""


def replay(tensor: torch.Tensor, ops: OpChain) -> torch.Tensor:
    """`ops` applied to `tensor` (only the ops of `VIEW_OPS`, `InvalidArgument` else)."""
    for op, args, kwargs in ops:
        if op not in VIEW_OPS:
            raise InvalidArgument(f"a vLLM loader applied {op!r}, which is no pure view")
        tensor = getattr(tensor, op)(*args, **dict(kwargs))
    return tensor


def _digits(flat: int, shape: Sequence[int]) -> list[int]:
    """The multi-index of flat offset `flat` in a contiguous tensor of `shape`, without
    carries into a dimension beyond the first (each digit may then exceed its size)."""
    out = [0] * len(shape)
    for d in range(len(shape) - 1, 0, -1):
        flat, out[d] = divmod(flat, shape[d])
    if shape:
        out[0] = flat
    return out


def view_box(shape: tuple[int, ...], dtype: torch.dtype, ops: OpChain) -> tuple[Box, bool]:
    """The smallest box of a global tensor of `shape` that holds what the view `ops`
    reads, and whether the view is a strided walk inside it that `view_in_block` can take
    out of a block (False: a view that wraps around a row, or a copy: the whole tensor is
    then its box)."""
    whole = Box((0,) * len(shape), shape)
    base = torch.empty(shape, dtype=dtype, device="meta")
    try:
        view = replay(base, ops)
    except (RuntimeError, IndexError, TypeError):
        return whole, False
    if view.dtype != dtype or any(s < 0 for s in view.stride()):
        return whole, False
    if view.numel() == 0:
        return Box((0,) * len(shape), (0,) * len(shape)), True
    first = _digits(int(view.storage_offset()), shape)
    last = list(first)
    for size, stride in zip(view.shape, view.stride(), strict=True):
        if size > 1:
            step = _digits(stride, shape)
            last = [a + (size - 1) * b for a, b in zip(last, step, strict=True)]
    if any(a < 0 or b >= s for a, b, s in zip(first, last, shape, strict=True)):
        return whole, False  # a walk that wraps around a row: no box of its own
    return Box(tuple(first), tuple(b - a + 1 for a, b in zip(first, last, strict=True))), True


def view_in_block(
    block: torch.Tensor, box: Box, shape: tuple[int, ...], ops: OpChain
) -> torch.Tensor:
    """The view `ops` of a global tensor of `shape`, read out of `block` (its box `box`,
    contiguous): the same strided walk, in the block's strides."""
    if tuple(box.shape) == tuple(shape):
        return replay(block, ops)  # the whole tensor: replay the ops themselves
    view = replay(torch.empty(shape, dtype=block.dtype, device="meta"), ops)
    mine, exact = view_box(shape, block.dtype, ops)
    if not exact or mine.intersect(box) != mine:
        raise InvalidArgument(f"a loader reads {mine} of a tensor whose block is {box}")
    bstride = block.stride()
    first = _digits(int(view.storage_offset()), shape)
    start = sum((a - o) * s for a, o, s in zip(first, box.offsets, bstride, strict=True))
    strides = []
    for size, stride in zip(view.shape, view.stride(), strict=True):
        step = _digits(stride, shape) if size > 1 else [0] * len(shape)
        strides.append(sum(a * s for a, s in zip(step, bstride, strict=True)))
    return block.as_strided(tuple(view.shape), tuple(strides), block.storage_offset() + start)


def learn_blocks(model: Any, infos: Sequence[TensorInfo]) -> dict[str, Box]:
    """Drive `model.load_weights` once over zero-storage fakes of `infos` and answer the
    block of each checkpoint tensor the model's loaders copy from (module docstring). The
    parameters are restored as they were; no weight changes."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
        _place_kernel_tensors,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    recorder = Recorder()
    initialize_layerwise_reload(model)
    wrapped: list[tuple[Any, Any]] = []
    try:
        # the parameters' own loaders, past the layerwise reload's buffering wrappers, so
        # the dry run loads nothing (the parameters are on meta)
        for module in model.modules():
            for tensor in get_layer_tensors(module).values():
                loader = getattr(tensor, "weight_loader", None)
                if loader is not None:
                    wrapped.append((tensor, loader))
                    tensor.weight_loader = _get_original_loader(tensor)
        load_weights(model, fakes(infos, recorder))
    finally:
        for tensor, loader in wrapped:
            tensor.weight_loader = loader
        for layer in model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    _place_kernel_tensors(layer, info)
                info.reset()
        for tensor, _ in wrapped:
            tensor.weight_loader = _get_original_loader(tensor)
    boxes: dict[str, Box] = {}
    by_name = {i.name: i for i in infos}
    for name, chains in recorder.views.items():
        info = by_name[name]
        views = [view_box(info.shape, info.dtype, ops)[0] for ops in chains]
        boxes[name] = _bounding(views)
    return boxes


def _bounding(boxes: Sequence[Box]) -> Box:
    """The smallest box that holds every one of `boxes`."""
    live = [b for b in boxes if b.volume] or list(boxes)
    lo = [min(b.offsets[d] for b in live) for d in range(len(live[0].offsets))]
    hi = [max(b.offsets[d] + b.shape[d] for b in live) for d in range(len(lo))]
    return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)))


def load_weights(model: Any, weights: list[Any]) -> None:
    """`model.load_weights`, without vLLM's multi-token-prediction completeness check where
    this vLLM has it (as its own IPC engine does: a checkpoint update may omit MTP heads).
    The one way this package calls vLLM's loaders, for blocks and whole versions alike."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        model.load_weights(weights)
        return
    with disable_mtp_completeness_check():
        model.load_weights(weights)


def load_blocks(
    model: Any,
    infos: Sequence[TensorInfo],
    blocks: Mapping[str, torch.Tensor],
    boxes: Mapping[str, Box],
) -> None:
    """Load the worker's blocks into `model` through its own `load_weights` (between
    `initialize_layerwise_reload` and `finalize_layerwise_reload`, which the caller runs):
    fakes of the checkpoint tensors this worker has blocks of, each copy read out of its
    block."""
    shapes = {i.name: i.shape for i in infos}
    sink = BlockSource(blocks, boxes, shapes)
    load_weights(model, fakes([i for i in infos if i.name in boxes], sink))
