"""`Hub`: the SDK's connection to TensorHub (what `ros.connect` returns), and its whole
public API.

The control plane goes through the hub (gRPC); weight bytes go holder → reader directly over
the data plane (`transport`). Every client that holds a version serves it to others until
released. `Hub` checks its arguments, has `ros.client.parts` build and join its parts (which
helper gets which narrow handle: that module's docstring), keeps them, and answers each
call of its API through them.

No helper holds the `Hub` (nor a bound method of it), and none calls a private method of
another object.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from consistency.records import HolderRecord
from consistency.retry import DEFAULT_POLICY, RetryPolicy
from ros.client import fetching
from ros.client import slices as reshard
from ros.client.channel import parse_address
from ros.client.delta_fetch import DEFAULT_HOLD_BYTES
from ros.client.fetching import DEFAULT_FETCH_TIMEOUT
from ros.client.group_publish import ProcessGroup
from ros.client.handles import Held, Publication
from ros.client.hooks import PRODUCTION, ClientHooks
from ros.client.identity import DEFAULT_TIMEOUT, Identity, default_holder_name
from ros.client.layouts import release as release_layout
from ros.client.manifest import Placements
from ros.client.orchestrator import ProgressCallback
from ros.client.parts import assemble
from ros.client.publisher_sums import check_declaration
from ros.client.retention import SpillStats
from ros.client.session import RECOVERY_JOIN_TIMEOUT
from ros.client.slice import Slice
from ros.client.slice_fetch import SliceFetch
from ros.client.watch import HubWatch, holder_from_message
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.delta_rules import SUFFIX, is_companion
from tensorhub.endpoints import format_endpoint
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name
from tensorhub.view_rules import view_model
from transport.backend import enabled_transports
from transport.pace import DEFAULT_RATE_FLOOR
from transport.tls import TlsConfig
from transport.topology import Topology

__all__ = ["CLOSE_SESSION_TIMEOUT", "DEFAULT_FETCH_TIMEOUT", "DEFAULT_TIMEOUT", "Hub",
           "default_holder_name"]  # fmt: skip

log = logging.getLogger(__name__)

CLOSE_SESSION_TIMEOUT = 1.0  # the most close() waits for the hub to revoke the session


class Hub:
    """A connection to the hub for one tenant. Thread-safe. Close it (or use `with`)."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        tenant: str,
        token: str,
        topology: Mapping[str, str] | None = None,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        session_ttl: int = 10,
        tls: TlsConfig | None = None,
        hooks: ClientHooks = PRODUCTION,
        spill_budget: int | None = None,
        retry: RetryPolicy = DEFAULT_POLICY,
        transports: Sequence[str] | None = None,
        delta_hold_bytes: int = DEFAULT_HOLD_BYTES,
    ) -> None:
        if (
            isinstance(delta_hold_bytes, bool)
            or not isinstance(delta_hold_bytes, int)
            or (delta_hold_bytes < 0)
        ):
            raise InvalidArgument(f"delta_hold_bytes {delta_hold_bytes!r}: a byte count >= 0")
        me = Identity(
            tenant=validate_name(tenant, "tenant"),
            holder_name=validate_name(name or default_holder_name(), "holder"),
            topology=Topology(**dict(topology or {})),
            tls=tls,
            timeout=timeout,
        )
        listen_at = parse_address(listen, allow_zero=True)
        if advertise is not None:
            format_endpoint(advertise, 1)  # a host no reader could use fails here, not later
        parts = assemble(
            [endpoints] if isinstance(endpoints, str) else list(endpoints), me, token,
            listen_at=listen_at, advertise=advertise, session_ttl=session_ttl, hooks=hooks,
            spill_budget=spill_budget, retry=retry, delta_hold_bytes=delta_hold_bytes,
            # what it serves and reads over: TCP, and RDMA/IPC where the machine has them,
            # or the kinds named (here or in TENSORHUB_TRANSPORTS); NIXL only when named
            kinds=enabled_transports(transports),
        )  # fmt: skip
        self._me = me
        self.retry = retry  # how reads and watches are tried again (`consistency.retry`)
        self.floor = parts.floor  # invariant 3 (chaos may wrap it)
        self.holdings = parts.holdings  # what this client serves: the one owner of it
        self.session = parts.session
        self._metadata, self._channel, self._stub = parts.metadata, parts.channel, parts.stub
        self._rpc, self._reads, self._pins = parts.rpc, parts.reads, parts.pins
        self._serving, self._readers = parts.serving, parts.readers
        self._retention, self._handles = parts.retention, parts.handles
        self._publisher, self._fetches = parts.publisher, parts.fetches
        self._layouts, self._deltas = parts.layouts, parts.deltas
        self._closed = False

    # -- who this client is --------------------------------------------------------------

    @property
    def tenant(self) -> str:
        return self._me.tenant

    @property
    def holder_name(self) -> str:
        return self._me.holder_name

    @property
    def topology(self) -> Topology:
        return self._me.topology

    @property
    def timeout(self) -> float:
        """The default deadline of one hub call (s)."""
        return self._me.timeout

    # -- publish and fetch ---------------------------------------------------------------

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
        delta: bool = False,
        base_copy: str = "host",
        group: ProcessGroup | None = None,
        views: Sequence[str] = (),
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
        their own blocks with `fetch_slices`. A state dict of DTensors (FSDP2, tensor
        parallelism) says both itself: pass it as it is, on every rank, without `shard` or
        `placements` (`ros.client.dtensors`; a rank that owns no block publishes nothing).

        `group` (a `torch.distributed` process group; every rank of it calls publish for the
        same version): the ranks' shards go to the hub in one call, sent by the group's first
        rank after a gather of their requests over the group, instead of one call per rank.
        Each rank still serves its own memory under its own session, and gets its own
        shard's outcome (`ros.client.group_publish`).

        `checksum` is the algorithm of the per-chunk checksums in the manifest
        (`transport.checksums`): `"xxh3-64"`, or `"wsum64"`, computed where the tensors are
        (for tensors in GPU memory: kernels on the device, no copy of the model to the host).
        None (the default) picks `wsum64` for tensors on a GPU and `xxh3-64` otherwise.
        Readers verify either.

        `metadata`: string entries carried in the manifest (`Manifest.metadata`, bounded as
        the hub bounds them: `ros.manifest_check.check_metadata`), e.g. a model's config.

        `delta=True` (opt-in): keep a copy of these tensors (`base_copy`: "host" memory, or
        "device", the tensors' own), costing one more copy of the model, so that the next
        `delta=True` publish of this model (and shard) by this client is also published as
        a delta against this one: only what changed, encoded losslessly, for readers whose
        memory holds this version (docs/sdk.md, "Delta versions"). The version itself is
        published and served whole as always.

        `views` (formats: "fp8-block128", "mxfp8"): each view of these tensors, quantized
        here on their device, published as version `version` of `{model}.{format}` in the
        same transaction as this version (docs/views.md); `Publication.views` has their
        handles, released with it. A rank of a model-parallel version (`shard`, `group`,
        DTensors) publishes its shard of each view with its shard, made with the other
        ranks over their process group (`group`, else the default one): collective, every
        rank calls `publish` with the same views; visible with the version.
        """
        if is_companion(model):
            raise InvalidArgument(
                f"model {model!r}: names ending in {SUFFIX!r} are reserved for the encoded "
                "chunks of delta versions"
            )
        return self._publisher.publish(
            model, version, tensors, chunk_size=chunk_size, timeout=timeout, shard=shard,
            placements=placements, checksum=checksum, metadata=metadata, delta=delta,
            base_copy=base_copy, group=group, views=views,
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
        base: int | None = None,
        delta: bool = True,
        view: str | None = None,
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
        shows in `stats.slow_sources` (docs/transport.md, "Rate floor"). When only such
        holders are left, each gets one more round under a floor 4 times lower.

        `progress`, when given, is called with a `Progress` (chunks and bytes so far, of the
        total) after every chunk is verified, from the thread that received it.

        Delta versions (docs/sdk.md): when the version was published with a delta and `into`
        holds an earlier version (`base`, or known to this client: `into` is the memory of
        its own earlier fetch of the model), only the encoded changes are read, applied in
        place and verified; a chunk of `into` that is not exactly the base's is read whole.
        `Held.delta` says what the delta did. `delta=False` reads every chunk whole.

        `view` (a format: "fp8-block128", "mxfp8"): read that view of the version instead,
        version `version` of the model `{model}.{view}` (docs/views.md), and hold it.
        """
        if view is not None:
            model = view_model(model, view)
        return fetching.fetch(
            self._fetches, self.holdings, self._handles, model, version, into=into,
            timeout=timeout, shard=shard, rate_floor=rate_floor, progress=progress,
            deltas=self._deltas if delta else None, base=base,
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
        delta: bool = False,
        layout: str | None = None,
        cover: Sequence[str] = (),
    ) -> SliceFetch:
        """Fill every `Slice` with its block of `model@version`, read from the holders of the
        shards that hold it. Checks names, dtypes, global shapes and bounds before any byte
        moves (`InvalidArgument`); a block the shards do not cover exactly is refused too.
        An error after that (no holder left, the deadline) may leave the slices partly
        written. `timeout` bounds the whole call, every hub call inside it included (see
        `fetch`); an Unpin that does not fit is left to the session's lease, and logged.
        `rate_floor` is `fetch`'s; `progress` is `fetch`'s, per source shard read.

        `delta=True` (opt-in): keep each source shard's staging copy (memory for one copy of
        every source shard read, where the staging is: host, or the slices' GPU) as the
        base of the next `fetch_slices(delta=True)` of the model, which then reads only the
        encoded changes of the chunks it needs, applies and verifies them there, and copies
        the blocks out (`SliceFetch.deltas`). `Hub.drop_bases` frees the copies.

        `layout="name"`: this client becomes a holder of its blocks in that layout
        (docs/sdk.md, "Readers in another layout"): it reads them from the holders of the
        same blocks first, the rest from the trainer's shards, and serves them from the
        slices' memory (contiguous) until `release_blocks`. With `delta=True` too, no copy
        is kept: blocks that hold the version this client last served them at take the
        changes of the next version that fall inside them (`ros.client.layout_delta`).
        `cover=("tp2",)`: blocks that no holder of the same blocks gave are read from the
        holders of those layouts' block sets that cover them (a TP-1 reader from TP-2
        holders).
        """
        return reshard.fetch_slices(
            self._fetches, self._pins, self._me, model, version, slices=slices, timeout=timeout,
            rate_floor=rate_floor, progress=progress, deltas=self._deltas if delta else None,
            layout=layout, peers=self._layouts, cover=cover,
        )  # fmt: skip

    def declare_layout(
        self,
        model: str,
        layout: str,
        workers: Sequence[Mapping[str, Slice]],
        *,
        timeout: float | None = None,
    ) -> int:
        """Declare `layout` of `model` to the hub: `workers` are the slices of each worker of
        one instance (their tensors' dtypes and shapes, offsets and global shapes; their
        memory is not read). Every version of the model published from then on carries
        the publisher's checksums of each worker's blocks (a whole publish's, or its shards'
        parts of them, one call a rank or a group's one call), and the readers of those
        blocks in `layout` check every chunk a peer sends against them (docs/sdk.md,
        "Declared layouts"). Declaring it again replaces it. The model must have a version;
        at most `MAX_DECLARED_LAYOUTS` (4) layouts a model (`TooManyDeclaredLayouts`:
        `retire_layout` one first). The commit revision."""
        validate_name(model, "model")
        validate_name(layout, "layout")
        request = pb.DeclareLayoutRequest(
            model=model, layout=layout, block_sets=check_declaration(model, layout, workers)
        )
        return int(self._rpc("DeclareLayout", request, timeout).revision)

    def retire_layout(self, model: str, layout: str, *, timeout: float | None = None) -> bool:
        """Retire a declared layout: versions published from then on carry no checksums for
        it (those published before keep theirs, with their version). Whether it was
        declared."""
        validate_name(model, "model")
        validate_name(layout, "layout")
        request = pb.RetireLayoutRequest(model=model, layout=layout)
        return bool(self._rpc("RetireLayout", request, timeout).retired)

    def declared_layouts(self, model: str, *, timeout: float | None = None) -> dict[str, int]:
        """The layouts declared for `model`, each with its number of block sets."""
        validate_name(model, "model")
        answer = self._rpc("DeclaredLayouts", pb.DeclaredLayoutsRequest(model=model), timeout)
        return {d.layout: len(d.block_sets) for d in answer.layouts}

    def release_blocks(self, model: str, version: int, *, timeout: float = 5.0) -> bool:
        """Stop holding this client's blocks of model@version (`fetch_slices(layout=)`):
        its record goes first, then reads in flight get up to `timeout`; whether it held
        any. The slices' memory may change after this returns."""
        return release_layout(self._layouts, self._me, model, version, timeout)

    def drop_bases(self, model: str | None = None) -> None:
        """Free the copies kept for delta versions (of `model`, or of every model): the
        publisher's base copies (`publish(delta=True)`) and the staging copies of
        `fetch_slices(delta=True)`, with the encoded chunks served alongside them. The next
        publish or fetch of such a model moves the version whole."""
        if model is not None:
            validate_name(model, "model")
        self._publisher.drop_bases(model)
        self._deltas.staged.drop(model)
        self._deltas.layout_bases.drop(model)

    def delta_memory(self) -> dict[str, int]:
        """Bytes this client keeps now for delta versions: `base_copies` (its publishes'
        base copies, `publish(delta=True)`), `staged` (`fetch_slices(delta=True)`'s kept
        staging copies) and `held_deltas` (encoded chunks it serves, within
        `delta_hold_bytes`). What the integrations report as the cost of deltas."""
        return {
            "base_copies": self._publisher.base_bytes(),
            "staged": self._deltas.staged.nbytes(),
            "held_deltas": self._deltas.held_bytes(),
        }

    def latest(self, model: str, *, timeout: float | None = None) -> int:
        """The latest published version (0 if none); never older than what this client saw."""
        validate_name(model, "model")
        return int(self._reads.latest(model, timeout).version)

    def inspect(
        self, model: str, version: int = 0, *, timeout: float | None = None
    ) -> pb.InspectResponse:
        """Everything about one version (default: the latest), with every holder (the hub
        answers them in pages; this follows them)."""
        validate_name(model, "model")
        return self._reads.inspect(model, version, timeout)

    def resolve(
        self, model: str, version: int = 0, *, timeout: float | None = None
    ) -> pb.ResolveResponse:
        """Resolve `model@version` (0: the latest) as a fetch does: its manifest (of every
        shard, for a model-parallel version) and the holders this client would read from.
        The manifest is cached, so a fetch of the same version does not ask for it again."""
        validate_name(model, "model")
        return self._reads.resolve(model, version, timeout=timeout)

    def holders(self, model: str, version: int) -> list[HolderRecord]:
        return [holder_from_message(h) for h in self.inspect(model, version).holders]

    def list_models(self) -> list[pb.ModelSummary]:
        return list(self._rpc("ListModels", pb.ListModelsRequest()).models)

    def pin(self, model: str, version: int, pin_id: str, *, timeout: float | None = None) -> None:
        """Keep `model@version` from being retired until `unpin` (or this session's end),
        for a reader that is no holder and reads it in many calls. `pin_id` names the pin
        (one per reader: a retried Pin or Unpin is idempotent)."""
        validate_name(model, "model")
        self._pins.pin(model, version, pin_id, timeout)

    def unpin(self, model: str, version: int, pin_id: str, *, timeout: float | None = None) -> None:
        """Drop the pin `pin_id` of `model@version`."""
        validate_name(model, "model")
        self._pins.unpin(model, version, pin_id, timeout)

    def watch(
        self, model: str, *, since: int | None = None, versions_only: bool = False
    ) -> HubWatch:
        """New versions and holder changes of `model` from revision `since` (default: now).

        With `versions_only`, the hub sends only new versions (and resyncs): what a rollout
        waiting for weights needs, without one message per holder change of every reader.
        Iterate it, or call `get(timeout)`; close it (or use `with`) when done.
        """
        validate_name(model, "model")
        if since is None:
            since = int(self._rpc("Latest", pb.LatestRequest(model=model)).revision) + 1
        elif since <= 0:
            raise InvalidArgument("since must be a positive revision")
        return HubWatch(
            self._stub, self._metadata, model, since, self.floor, versions_only, self.retry
        )

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def spills(self) -> SpillStats:
        """Host spills made, held now (versions, bytes), freed; file spills; the budget."""
        return self._retention.stats

    def close(self) -> None:
        """Stop serving, end the session (its records vanish at once), close the channel.

        The hub is waited for at most `CLOSE_SESSION_TIMEOUT` (CloseSession; a stalled hub
        leaves the session to expire within its TTL), the keepalive thread at most 2 s, and a
        recovery in progress at most `RECOVERY_JOIN_TIMEOUT` (2 s; it is stopped first, and a
        session it opens after that is ended by it, never renewed); reads in flight from our
        holder server get up to 5 s per held version. The copies kept for delta versions
        (`delta_memory()`) are freed.
        """
        if self._closed:
            return
        self._closed = True
        self.session.close()  # no recovery installs a lease after this
        self.holdings.drop_all(5.0)
        self._publisher.drop_bases(None)  # delta versions' copies: freed with the client
        self._deltas.staged.drop(None)
        self.session.revoke(CLOSE_SESSION_TIMEOUT)
        self._serving.stop()
        self._readers.close()
        self._channel.close()  # also ends a recovery's call in flight
        if not self.session.join(RECOVERY_JOIN_TIMEOUT):
            log.warning("closing: the session recovery did not stop within %ss",
                        RECOVERY_JOIN_TIMEOUT)  # fmt: skip

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
