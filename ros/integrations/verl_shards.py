"""The hook into verl's FSDP actor that lets every actor rank publish its own shard.

verl 0.9.1's actor (`ActorRolloutRefWorker.update_weights`, on every actor rank) asks its
training engine for `get_per_tensor_param()` and hands the result to the checkpoint
engine's `send_weights`. For FSDP2 that is a lazy generator which all-gathers each DTensor
(`full_tensor()`, a collective over the actor ranks) as it is walked: a backend that only
sees the generator can publish nothing but full tensors. The DTensors themselves, each
rank's own shard of the model, stay inside the training engine.

`install()` wraps `FSDPEngine.get_per_tensor_param` (the class of verl's FSDP training
engines, looked up on the instance at every call, so the wrapper applies to engines built
before it too). Where the engine is FSDP2 with plain weights (no LoRA adapter, no QAT, no
packed MoE experts that verl splits on the way out), the wrapper returns `ShardedParams`:
verl's own generator, unchanged for whoever walks it (every other backend, the colocated
sync), which also carries the DTensor state dict it would have gathered, keys converted as
verl converts them. The `tensorhub` backend publishes that state dict's local shards and
closes the generator unwalked: nothing is gathered. Every other case returns verl's result
untouched, and the backend falls back to publishing the gathered stream from actor rank 0.

Surviving an upgrade: the wrapper depends on verl's internals (the method's name and
arguments, `self.module`, `_qat_enabled`, `convert_weight_keys`), so `install()` refuses
any verl but the versions it was checked against (`VERL_VERSIONS`) with `InvalidArgument`,
naming the way out (`shards=False`: the gathered path, which needs only verl's public
checkpoint-engine API), and refuses a verl whose `FSDPEngine` lacks the method it wraps.
The wrapper itself only adds: whatever it does not recognize goes through as verl made it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tensorhub.errors import InvalidArgument

log = logging.getLogger(__name__)

VERL_VERSIONS = frozenset({"0.9.1"})
"""The verl versions whose FSDP engine this hook was written and tested against."""

MARK = "__tensorhub_shards__"
"""Set on the wrapper, so that `install()` wraps verl's method once."""

PACKED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
"""Names verl's `unfuse_moe_params` splits into per-expert tensors on the way out: a state
dict with them is not what the gathered stream carries, so it is not offered as shards."""

_lock = threading.Lock()

Weights = Iterator[tuple[str, torch.Tensor]]


class ShardedParams(Iterator[tuple[str, torch.Tensor]]):
    """verl's per-tensor stream (`stream`, walked by anyone who iterates this) and the
    DTensor state dict behind it (`state()`: this rank's shards, no gather)."""

    def __init__(self, stream: Weights, state: Callable[[], dict[str, torch.Tensor]]) -> None:
        self._stream = stream
        self._state = state
        self.walked = False  # someone iterated the stream: its gathers have started

    def __iter__(self) -> ShardedParams:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        self.walked = True
        return next(self._stream)

    def state(self) -> dict[str, torch.Tensor]:
        """The state dict of DTensors the stream would gather, as verl names its keys."""
        if self.walked:
            raise InvalidArgument(
                "tensorhub checkpoint engine: the stream was walked (gathered) already"
            )
        return self._state()

    def close(self) -> None:
        """Drop the stream unwalked (a generator is closed: none of its gathers run)."""
        close = getattr(self._stream, "close", None)
        if callable(close):
            close()


def check_version(version: str) -> None:
    """`InvalidArgument` unless `version` is one the hook was checked against."""
    if version not in VERL_VERSIONS:
        raise InvalidArgument(
            f"tensorhub checkpoint engine: per-rank shards hook verl's FSDP engine, checked "
            f"against verl {', '.join(sorted(VERL_VERSIONS))}; verl {version} is installed. "
            "Pin a checked verl, or pass shards=False (actor rank 0 then publishes the "
            "gathered stream, through verl's public checkpoint-engine API only)"
        )


def install() -> None:
    """Wrap verl's `FSDPEngine.get_per_tensor_param` (module docstring), once per process.
    `InvalidArgument` for a verl the hook was not checked against."""
    import verl

    check_version(str(getattr(verl, "__version__", "unknown")))
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    with _lock:
        original = getattr(FSDPEngine, "get_per_tensor_param", None)
        if original is None or not callable(original):
            raise InvalidArgument(
                "tensorhub checkpoint engine: verl's FSDPEngine has no get_per_tensor_param "
                "to hook; pass shards=False"
            )
        if getattr(original, MARK, False):
            return
        FSDPEngine.get_per_tensor_param = _wrap(original)
        log.info("hooked verl's FSDPEngine.get_per_tensor_param: actor ranks publish shards")


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_per_tensor_param(self: Any, *args: Any, **kwargs: Any) -> Any:
        stream, peft = original(self, *args, **kwargs)
        if peft is not None or args or kwargs.get("base_sync_done") or not _plain(self):
            return stream, peft
        module = self.module
        inner = getattr(module, "_fsdp_wrapped_module", module)

        def state() -> dict[str, torch.Tensor]:
            from verl.utils.model import convert_weight_keys

            converted: dict[str, torch.Tensor] = convert_weight_keys(module.state_dict(), inner)
            return converted

        return ShardedParams(stream, state), peft

    setattr(get_per_tensor_param, MARK, True)
    return get_per_tensor_param


def _plain(engine: Any) -> bool:
    """Whether `engine`'s weights are FSDP2 DTensors whose state dict is exactly what the
    gathered stream carries: no adapter, no QAT, no packed experts."""
    from torch.distributed.fsdp import FSDPModule

    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module) or not isinstance(module, FSDPModule):
        return False
    if getattr(engine, "_qat_enabled", False):
        return False
    inner = getattr(module, "_fsdp_wrapped_module", module)
    if hasattr(inner, "peft_config"):
        return False
    names = (name for name, _ in module.named_parameters())
    return not any(name.endswith(PACKED_EXPERTS) for name in names)
