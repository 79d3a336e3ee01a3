"""`Hub`: the SDK's connection to TensorHub (what `ros.connect` returns).

The control plane goes through the hub (gRPC); weight bytes go holder → reader directly over
the data plane (`transport`). Every client that holds a version runs a small holder server,
started on first use, so whatever it published or fetched is served to others until released.
The pieces, composed here: `ros.client.base` (channel, holder server),
`ros.client.holdings` (what the client holds: the one owner of it), `ros.client.recovery`
(its session, recovered after a loss), `ros.client.publishing` (`Publisher`),
`ros.client.orchestrator` (`Orchestrator`: every fetch's steps after its Resolve), with
`ros.client.fetching` and `ros.client.slices` (reading another layout's blocks) building
what it fills.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

import torch

from consistency.records import HolderRecord
from ros.client import fetching
from ros.client import slices as reshard
from ros.client.base import DEFAULT_TIMEOUT, ClientBase, default_holder_name
from ros.client.fetching import DEFAULT_FETCH_TIMEOUT
from ros.client.handles import Held, Publication
from ros.client.manifest import Placements
from ros.client.orchestrator import Orchestrator, ProgressCallback
from ros.client.publishing import Publisher
from ros.client.slices import Slice, SliceFetch
from ros.client.watch import holder_from_message
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.names import validate_name
from transport.pace import DEFAULT_RATE_FLOOR

__all__ = ["DEFAULT_FETCH_TIMEOUT", "DEFAULT_TIMEOUT", "ClientBase", "Hub", "default_holder_name"]


class Hub(ClientBase):
    """A connection to the hub for one tenant. Thread-safe. Close it (or use `with`)."""

    @cached_property
    def _publisher(self) -> Publisher:
        return Publisher(self)

    @cached_property
    def _fetches(self) -> Orchestrator:  # stateless: every run keeps its state on its stack
        return Orchestrator(self)

    def publish(
        self,
        model: str,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_size: int | None = None,
        timeout: float | None = None,
        shard: tuple[int, int] | None = None,
        placements: Placements | None = None,
        checksum: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Publication:
        """Publish `version` of `model`, served from these tensors' own memory.

        Raises `StaleVersion` if `version` is not newer than latest (nothing written), and
        `OutcomeUnknown` if the hub could not confirm the write (check `latest()`).
        Non-contiguous tensors are copied once into contiguous memory (and logged).

        Model-parallel trainers pass `shard=(rank, ranks)`: each rank publishes its own
        tensors, and the version becomes visible (`Publication.visible`) with the last rank's
        publish, never before every shard is there. `placements` maps a tensor name to
        (global shape, offsets): the block of the global tensor this rank holds (tensors
        without one are whole, e.g. replicated). With them, readers in another layout read
        their own blocks with `fetch_slices`.

        `checksum` is the algorithm of the per-chunk checksums in the manifest
        (`transport.checksums`): `"xxh3-64"`, or `"wsum64"`, computed where the tensors are
        (for tensors in GPU memory: kernels on the device, no copy of the model to the host).
        None (the default) picks `wsum64` for tensors on a GPU and `xxh3-64` otherwise.
        Readers verify either.

        `metadata`: string entries carried in the manifest (`Manifest.metadata`, bounded as
        the hub bounds them: `ros.manifest_check.check_metadata`), e.g. a model's config.
        """
        return self._publisher.publish(
            model, version, tensors, chunk_size=chunk_size, timeout=timeout, shard=shard,
            placements=placements, checksum=checksum, metadata=metadata,
        )  # fmt: skip

    def fetch(
        self,
        model: str,
        version: int | str = "latest",
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        timeout: float = DEFAULT_FETCH_TIMEOUT,
        shard: int | None = None,
        rate_floor: float = DEFAULT_RATE_FLOOR,
        progress: ProgressCallback | None = None,
    ) -> Held:
        """Read `model@version` from its holders, in place into `into` or into new tensors.

        With `into`, names, dtypes and shapes must match the manifest or `InvalidArgument`
        is raised before any byte is written. The fetched version is served to others until
        `release()`d. Raises `VersionUnavailable` if no holder is left, before the deadline.

        A model-parallel version (published with `shard=(rank, ranks)`) is fetched one shard
        at a time: `shard=i` reads rank i's tensors from the holders of shard i (its
        publisher and earlier readers of it), and this client then serves shard i. This is
        the layout-preserving case (reader rank i needs trainer rank i's tensors). Readers
        in another layout use `fetch_slices`.

        `timeout` bounds the whole call, every hub call inside it included (one `Deadline`
        passed down): it returns or raises (`DeadlineExceeded`) within `timeout`, plus the
        scheduling slack of a loaded machine, however the hub behaves. A holder whose
        endpoint this client cannot use is skipped, logged, and named in
        `stats.failed_sources` (or in the error, if no usable holder was left).

        `rate_floor` (bytes/s per connection, 0: off) suspects a holder that sends chunks it
        has slower than that for the stall window, and reads them elsewhere; such a holder
        shows in `stats.slow_sources` (docs/transport.md, "Rate floor").

        `progress`, when given, is called with a `Progress` (chunks and bytes so far, of the
        total) after every chunk is verified, from the thread that received it.
        """
        return fetching.fetch(
            self, self._fetches, model, version, into=into, timeout=timeout, shard=shard,
            rate_floor=rate_floor, progress=progress,
        )  # fmt: skip

    def fetch_slices(
        self,
        model: str,
        version: int | str = "latest",
        *,
        slices: Mapping[str, Slice],
        timeout: float = DEFAULT_FETCH_TIMEOUT,
        rate_floor: float = DEFAULT_RATE_FLOOR,
        progress: ProgressCallback | None = None,
    ) -> SliceFetch:
        """Fill every `Slice` with its block of `model@version`, read from the holders of the
        shards that hold it. Checks names, dtypes, global shapes and bounds before any byte
        moves (`InvalidArgument`); a block the shards do not cover exactly is refused too.
        An error after that (no holder left, the deadline) may leave the slices partly
        written. `timeout` bounds the whole call, every hub call inside it included (see
        `fetch`); an Unpin that does not fit is left to the session's lease, and logged.
        `rate_floor` is `fetch`'s; `progress` is `fetch`'s, per source shard read.
        """
        return reshard.fetch_slices(
            self, self._fetches, model, version, slices=slices, timeout=timeout,
            rate_floor=rate_floor, progress=progress,
        )  # fmt: skip

    def latest(self, model: str, *, timeout: float | None = None) -> int:
        """The latest published version (0 if none); never older than what this client saw."""
        validate_name(model, "model")
        response = self._fresh(
            lambda t: self._rpc("Latest", pb.LatestRequest(model=model), t),
            lambda r: int(r.revision),
            self.timeout if timeout is None else timeout,
        )
        return int(response.version)

    def inspect(
        self, model: str, version: int = 0, *, timeout: float | None = None
    ) -> pb.InspectResponse:
        """Everything about one version (default: the latest), with every holder (the hub
        answers them in pages; this follows them)."""
        validate_name(model, "model")
        return self._inspect(model, version, timeout)

    def holders(self, model: str, version: int) -> list[HolderRecord]:
        return [holder_from_message(h) for h in self.inspect(model, version).holders]

    def list_models(self) -> list[pb.ModelSummary]:
        return list(self._rpc("ListModels", pb.ListModelsRequest()).models)

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
