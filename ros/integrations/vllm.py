"""vLLM: feed fetched versions to `model.load_weights`, around pause/resume hooks.

vLLM loads new weights through `model.load_weights(weights)`, which takes an iterable of
`(name, tensor)` in the checkpoint's naming and does the model's own mapping (fusing q/k/v
into `qkv_proj`, sharding for tensor parallelism). So the adapter does not write into vLLM's
parameters itself: it fetches the version into a staging copy that it owns (and serves to the
other rollouts), then streams that copy into `load_weights`.

Bytes move while the engine keeps generating; only `load_weights` runs between `pause()` and
`resume()` (e.g. `engine.pause_generation` / `resume_generation`, or `llm.sleep` / `wake_up`),
and `resume()` runs even if loading fails. vLLM is not a dependency: `load_weights`, `pause`
and `resume` are plain callables, so this is tested against a stand-in module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from ros.client.handles import Held
from ros.client.hub import DEFAULT_FETCH_TIMEOUT, Hub
from tensorhub.errors import InvalidArgument, RetentionViolation

log = logging.getLogger(__name__)

WeightLoader = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


def weights_iterator(
    held: Held, *, device: str | torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for every tensor of a fetched version, in manifest order — what
    vLLM's `model.load_weights` takes. With `device`, each tensor is copied there first."""
    for name, tensor in held.tensors.items():
        yield name, tensor if device is None else tensor.to(device, non_blocking=True)


class VLLMWeightUpdater:
    """Keeps one vLLM model in step with `model` on the hub: `update()` per new version.

    The staging copy of the last version stays served to other readers until the next
    update releases it (then it is reused in place). The last complete copy of a retained
    version is spilled to host memory by that release and served from there (the client's
    `spill_budget`); only past the budget (`SpillBudgetExceeded`, a `RetentionViolation`)
    is the copy kept serving from the staging memory and the new version fetched into fresh
    memory, the release being retried on the next update.
    """

    def __init__(
        self,
        hub: Hub,
        model: str,
        load_weights: WeightLoader,
        *,
        pause: Callable[[], object] | None = None,
        resume: Callable[[], object] | None = None,
        device: str | torch.device | None = None,
        timeout: float = DEFAULT_FETCH_TIMEOUT,
    ) -> None:
        self._hub = hub
        self.model = model
        self._load_weights = load_weights
        self._pause = pause
        self._resume = resume
        self._device = device
        self._timeout = timeout
        self.version = 0
        self.held: Held | None = None
        self._kept: list[Held] = []

    def update(self, version: int | str = "latest") -> int:
        """Fetch `version` (default: the latest) and load it; returns the version now loaded.
        A version not newer than the loaded one is a no-op."""
        wanted = self._hub.latest(self.model) if version == "latest" else int(version)
        if wanted <= self.version:
            return self.version
        self._retry_kept()
        staging = self._free_staging()
        try:
            held = self._hub.fetch(self.model, wanted, into=staging, timeout=self._timeout)
        except InvalidArgument:
            if staging is None:
                raise
            log.info("%s@%d has a new layout: fetching into fresh memory", self.model, wanted)
            held = self._hub.fetch(self.model, wanted, timeout=self._timeout)
        self.held = held
        if self._pause is not None:
            self._pause()
        try:
            self._load_weights(weights_iterator(held, device=self._device))
        finally:
            if self._resume is not None:
                self._resume()
        self.version = held.version
        return self.version

    def _free_staging(self) -> dict[str, torch.Tensor] | None:
        """Release the previous version and return its memory for reuse (None if kept)."""
        previous, self.held = self.held, None
        if previous is None:
            return None
        try:
            previous.release()
        except RetentionViolation:
            self._kept.append(previous)
            return None
        return previous.tensors

    def _retry_kept(self) -> None:
        still = []
        for held in self._kept:
            try:
                held.release()
            except RetentionViolation:
                still.append(held)
        self._kept = still

    def close(self) -> None:
        """Stop serving everything this updater holds (forced: the engine is going away)."""
        for held in [*self._kept, *([self.held] if self.held else [])]:
            held.release(force=True)
        self._kept, self.held = [], None
