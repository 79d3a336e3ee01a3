"""A participant's commands for delta versions (`bench delta`, the delta row of `bench
crossdc`): the trainer trains a real model (`bench.emu.training`) and publishes every step
with `delta=True`; a reader fetches each version into the memory of its previous one.

Timing is taken in the participant's own process: a publish from the call to its return
(encoding included), a fetch from the call to its return (verified). `Codec` also adds up
the time spent inside the codec's functions (`transport.delta`) in this process, by
wrapping them: `encode` on the trainer; on a reader `apply` (decode, XOR in place) and
`chunk_checksum` (the base check before applying and the check of the result after).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch

import ros
from bench.emu.model import digest
from bench.emu.training import Spec, Training
from ros.client.handles import Held, Publication
from transport import delta as codec

F = TypeVar("F", bound=Callable[..., Any])


class Codec:
    """Seconds spent in `transport.delta`'s encode, apply (with decode_words and apply_words,
    which apply a reader's chunks together) and chunk_checksum in this process
    since the last `take()` (installed once per process: `install`)."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _seconds: ClassVar[dict[str, float]] = {"encode": 0.0, "apply": 0.0, "chunk_checksum": 0.0}
    _installed: ClassVar[bool] = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            codec.encode = cls._timed("encode", codec.encode)
            codec.apply = cls._timed("apply", codec.apply)
            codec.decode_words = cls._timed("apply", codec.decode_words)  # chunks together
            codec.apply_words = cls._timed("apply", codec.apply_words)
            codec.chunk_checksum = cls._timed("chunk_checksum", codec.chunk_checksum)
            cls._installed = True

    @classmethod
    def _timed(cls, name: str, fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                with cls._lock:
                    cls._seconds[name] += spent

        return timed  # type: ignore[return-value]

    @classmethod
    def take(cls) -> dict[str, float]:
        """The seconds so far, by function, and start again from zero."""
        with cls._lock:
            out = dict(cls._seconds)
            for name in cls._seconds:
                cls._seconds[name] = 0.0
        return out


class DeltaRole:
    """The delta commands of one participant; `hub()` is its connected client."""

    def __init__(self, hub: Callable[[], ros.Hub]) -> None:
        self._hub = hub
        self.training: Training | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.pubs: dict[str, Publication] = {}  # model -> the version this trainer serves
        self.helds: dict[str, Held] = {}  # model -> the version this reader holds
        Codec.install()

    # -- the trainer ---------------------------------------------------------------------

    def train_init(self, model: str, spec: dict[str, Any], lr: float, chunk: int) -> Any:
        """Build the model (`spec`, a `Spec`'s fields) and its optimizer at `lr`, and publish
        its initial weights as version 1 of `model` with `delta=True` (whole: no base yet)."""
        torch.set_num_threads(1)
        self.drop()
        self.training = Training(Spec(**spec), lr)
        self.weights = self.training.weights()
        return self._publish(model, 1, chunk, delta=True)

    def train_step(self, model: str, version: int, chunk: int) -> Any:
        """One training step (not timed with the publish), then publish its bf16 weights as
        `version` with `delta=True`."""
        if self.training is None:
            raise RuntimeError("train_step before train_init")
        start = time.monotonic()
        loss = self.training.step()
        self.weights = self.training.weights()
        train_s = time.monotonic() - start
        return {**self._publish(model, version, chunk, delta=True), "train_s": train_s,
                "loss": loss}  # fmt: skip

    def publish_plain(self, model: str, version: int, chunk: int) -> Any:
        """The last step's weights again, as `version` of `model` without a delta (the whole
        version a reader without deltas would fetch)."""
        return self._publish(model, version, chunk, delta=False)

    def _publish(self, model: str, version: int, chunk: int, delta: bool) -> Any:
        old = self.pubs.pop(model, None)
        if old is not None:  # its readers have it: they serve it, and its delta, themselves
            old.release(force=True)
        Codec.take()
        start = time.monotonic()
        pub = self._hub().publish(model, version, self.weights, chunk_size=chunk, delta=delta)
        end = time.monotonic()
        spent = Codec.take()
        self.pubs[model] = pub
        return {
            "t0": start,
            "t1": end,
            "digest": digest(self.weights),
            "nbytes": sum(t.numel() * t.element_size() for t in self.weights.values()),
            "encode_s": spent["encode"],
            "companion": pub.companion is not None,
        }

    # -- a reader ------------------------------------------------------------------------

    def fetch_into(
        self,
        model: str,
        version: int,
        delta: bool = True,
        timeout: float = 300,
        like: str | None = None,
    ) -> Any:
        """Fetch `version` of `model` into the memory of the version of it this reader holds
        (released first), or else into new memory: shaped as what it holds of `like` and
        written before the clock starts, if given (a whole fetch into memory that is mapped
        already, as a reader's own weights are: its first writes of new pages would
        otherwise count page faults, not the fetch), else allocated by the fetch;
        `delta=False` reads it whole."""
        prev = self.helds.pop(model, None)
        into = None
        if prev is not None:
            prev.release(force=True)
            into = prev.tensors
        elif like is not None and like in self.helds:
            into = {name: torch.zeros_like(t) for name, t in self.helds[like].tensors.items()}
        Codec.take()
        start = time.monotonic()
        held = self._hub().fetch(model, version, into=into, delta=delta, timeout=timeout)
        end = time.monotonic()
        spent = Codec.take()
        self.helds[model] = held
        return {
            "t0": start,
            "t1": end,
            "digest": digest(held.tensors),
            "delta": None if held.delta is None else dataclasses.asdict(held.delta),
            "apply_s": spent["apply"],
            "checksum_s": spent["chunk_checksum"],
            "bytes": held.stats.total_bytes,
        }

    def drop(self) -> Any:
        """Release everything this participant publishes or holds for the delta commands."""
        for handle in [*self.pubs.values(), *self.helds.values()]:
            handle.release(force=True)
        self.pubs, self.helds = {}, {}
        self.training, self.weights = None, {}
        return {}
