"""vLLM's weight-transfer engine `tensorhub`: each worker fetches the version itself.

Registered with vLLM's `WeightTransferEngineFactory` by `register()`, which vLLM calls in
every process it starts (the `vllm.general_plugins` entry point `tensorhub` in
pyproject.toml), so worker processes have it too. A user builds the engine with
`LLM(..., weight_transfer_config={"backend": "tensorhub"})`, then:

    llm.init_weight_transfer_engine({"init_info": {"hub": "10.0.0.1:7600",
        "tenant": "team-a", "token": TOKEN, "model": "policy"}})
    ros.integrations.vllm.update_vllm(llm, version)   # start / update_weights / finish

Tensors never cross `collective_rpc` (memoryviews do not pickle to worker processes): the
init info names the hub, tenant, model and topology, and every worker connects and fetches
on its own. One update is one version:

- `start_weight_update`: nothing yet (the model stays as it is).
- `update_weights({"version": v})`: the whole version is fetched into host tensors first
  (`ros.integrations.vllm.VersionReceiver`); a failed fetch raises its named error with the
  model untouched. Only then does the layerwise reload begin, and `load_weights` reads from
  local memory.
- `finish_weight_update`: finalizes the layerwise reload (the model's kernels repack), and
  the fetched copy is released, or kept and served to other rollouts with `serve`.

Delta versions (`"delta": True` in the init info, the default): the released copy's host
memory is kept as the base of the next update, which is fetched into it, so a version the
trainer published with `delta=True` moves only its changes. It costs one host copy of the
checkpoint per worker between updates (none more with `serve`, whose served copy is the
base). A version published as shards is read with `fetch_slices(delta=True)`, whose staging
copies the SDK keeps as the base instead: one host copy of every source shard per worker
(no copy of the checkpoint then). `"delta": False` keeps nothing between updates and reads
every version whole; re-initialising the engine, or its shutdown, frees what was kept.

Blocks (`"slices"`, on by default when the tensor-parallel size is over 1): each worker
reads only the block of each checkpoint tensor its loaders consume, learned from vLLM's own
`load_weights` (`ros.integrations.vllm_blocks`), as a reader in the instance's layout
(`vllm-tp2`: the same rank of another instance reads them from it), loads them through the
layerwise reload and serves them until the next update. No host copy of the checkpoint;
with `"delta"` a version published with a delta against the blocks' version moves only
the changes inside them, applied to the blocks in place (they are the base: no copy).

vLLM is untyped where mypy runs (it is not installed there), so its base classes are Any.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import ros
from ros.integrations.vllm import DEFAULT_UPDATE_TIMEOUT, VersionReceiver
from ros.integrations.vllm_blocks import BlockReceiver, layout_name
from ros.integrations.vllm_memory import UpdateMemory
from ros.integrations.vllm_plan import load_weights
from tensorhub.errors import EngineNotReady, TensorHubError

log = logging.getLogger(__name__)

BACKEND = "tensorhub"


@dataclass
class TensorHubInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM's: Any here
    """What every worker needs to reach the hub: its address(es), the tenant and its token,
    the model, this worker's topology labels, whether to serve what it fetched, and whether
    to keep it as the next update's base (`delta`: one host copy of the checkpoint, or of
    every source shard of a version published as shards)."""

    hub: str | list[str]
    tenant: str
    token: str
    model: str
    topology: dict[str, str] = field(default_factory=dict)
    timeout: float = DEFAULT_UPDATE_TIMEOUT
    serve: bool = False  # keep the fetched checkpoint copy and serve it until the next update
    delta: bool = True  # keep that copy's memory (released) to fetch the next version into
    listen: str = "127.0.0.1:0"  # the worker's holder port (advertised to other readers)
    advertise: str | None = None
    # read only this worker's blocks, as a reader in the instance's layout, and serve them
    # (`ros.integrations.vllm_blocks`); None: when tensor-parallel size > 1
    slices: bool | None = None
    layout: str | None = None  # the layout's name (None: `vllm_blocks.layout_name`)
    cover: list[str] = field(default_factory=list)  # layouts whose holders cover the blocks


@dataclass
class TensorHubUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]  # vLLM's: Any here
    """One update: the version to move to ("latest": whatever the hub says now)."""

    version: int | str = "latest"


class TensorHubWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """The worker side (module docstring). One instance per vLLM worker."""

    init_info_cls = TensorHubInitInfo
    update_info_cls = TensorHubUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: VersionReceiver | BlockReceiver | None = None
        self._loading: int | None = None  # the version between receive and finish
        self._fetched: int | None = None  # blocks read, loaded at finish_weight_update
        # the last update's resident memory (`vllm_memory.UpdateMemory.figures`)
        self.last_update_memory: dict[str, int] | None = None
        self._memory = UpdateMemory()

    def init_transfer_engine(self, init_info: TensorHubInitInfo) -> None:
        """Connect this worker to the hub (a session of its own; its holder port opens on
        the first fetch)."""
        if self.receiver is not None:
            self.receiver.close()
        hub = ros.connect(
            init_info.hub, tenant=init_info.tenant, token=init_info.token,
            topology=init_info.topology or None, listen=init_info.listen,
            advertise=init_info.advertise,
        )  # fmt: skip
        tp = int(self.parallel_config.tensor_parallel_size)
        pp = int(self.parallel_config.pipeline_parallel_size)
        if init_info.slices if init_info.slices is not None else tp > 1:
            self.receiver = BlockReceiver(
                hub, init_info.model, layout=init_info.layout or layout_name(tp, pp),
                cover=init_info.cover, serve=True, delta=init_info.delta,
                timeout=init_info.timeout,
            )  # fmt: skip
            return
        self.receiver = VersionReceiver(
            hub, init_info.model, serve=init_info.serve, timeout=init_info.timeout,
            delta=init_info.delta,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        """Nothing to prepare: the model is left as it is until the version is here."""
        self._loading = self._fetched = None

    def receive_weights(self, update_info: TensorHubUpdateInfo) -> None:
        """Fetch the whole version and load it through the layerwise reload; or, with
        `slices`, fetch this worker's blocks only (loaded at `finish_weight_update`)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        receiver = self._receiver()
        if self._loading is not None or self._fetched is not None:
            raise EngineNotReady("one version per update: call finish_weight_update first")
        self._memory.start()
        try:
            if isinstance(receiver, BlockReceiver):  # this worker's blocks only
                # loaded at finish_weight_update, which vLLM calls only once every
                # worker's receive returned: a worker whose fetch failed leaves every
                # worker's model on its version, never ranks on different versions
                self._fetched = receiver.receive(self.model, update_info.version)
                self._memory.fetched()
                return
            version, weights = receiver.receive(update_info.version)  # model untouched
        except TensorHubError as exc:
            # vLLM's worker processes pass an error on by its text alone: lead with the class
            raise type(exc)(f"{type(exc).__name__}: {exc}") from exc
        self._memory.fetched()
        initialize_layerwise_reload(self.model)
        self._loading = version
        load_weights(self.model, weights)
        log.info("%s@%d loaded into the model", receiver.model, version)

    def finish_weight_update(self) -> None:
        """Load the blocks read (`slices`), finalize the reload (kernels repack), then
        release or keep serving the copy."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        receiver = self.receiver
        if self._fetched is not None and isinstance(receiver, BlockReceiver):
            initialize_layerwise_reload(self.model)
            self._loading, self._fetched = self._fetched, None
            receiver.load(self.model)
            log.info("%s@%d's blocks loaded into the model", receiver.model, self._loading)
        if self._loading is None:
            return  # no version arrived in this update: the model was never touched
        finalize_layerwise_reload(self.model, self.model_config)
        self._receiver().loaded(self._loading)
        self._loading = None
        self.last_update_memory = self._memory.loaded()

    def abort_weight_update(self) -> None:
        """End an update that failed on another worker without loading what this one read:
        its blocks (`slices`) are dropped unloaded, so the model stays on its version (they
        stay served: they hold that version's bytes). A whole version this worker already
        loaded in `receive_weights` is finalized instead, since its layers cannot be left
        half reloaded."""
        if self._loading is not None:
            self.finish_weight_update()
        self._fetched = None

    def shutdown(self) -> None:
        """Stop serving, free the bases kept (`delta`) and end the hub session."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    @property
    def version(self) -> int:
        """The version this worker's model runs (0: its initial weights)."""
        return 0 if self.receiver is None else self.receiver.version

    def _receiver(self) -> VersionReceiver | BlockReceiver:
        if self.receiver is None:
            raise EngineNotReady("init_weight_transfer_engine first: no hub to fetch from")
        return self.receiver


def register() -> None:
    """The `vllm.general_plugins` entry point: register the engine (once per process).

    vLLM loads its plugins in every process it starts, before its NixlConnector may import
    NIXL, so this is where the host libraries NIXL's UCX modules need are opened first
    (`transport.nixl.loader.pin_host_libraries`; without it a NIXL process on a host with
    `ibverbs-providers` dies with SIGSEGV at exit, docs/nixl.md). It loads no NIXL."""
    from transport.nixl.loader import pin_host_libraries

    pin_host_libraries()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, TensorHubWeightTransferEngine)
