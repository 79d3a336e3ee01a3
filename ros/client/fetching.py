"""The fetch side of the SDK: resolve, pin, register PARTIAL, pull, verify, COMPLETE."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ros.client.base import ClientBase
from ros.client.deadline import Deadline
from ros.client.handles import Held
from ros.client.manifest import layout_of
from ros.client.read_token import RenewingToken
from ros.metrics import SDK_BYTES_FETCHED, SDK_FETCH_SECONDS
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import DeadlineExceeded, InvalidArgument, TensorHubError, VersionUnavailable
from tensorhub.names import validate_name, validate_version
from transport.planner import Candidate, Source, pipeline_sources
from transport.reader import DEFAULT_RATE_FLOOR, FetchStats
from transport.reader import fetch as transport_fetch
from transport.selection import choose
from transport.store import HeldVersion
from transport.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT = 60.0


class FetchMixin(ClientBase):
    """`fetch` into new or existing tensors, becoming a holder as the bytes arrive."""

    def fetch(
        self,
        model: str,
        version: int | str = "latest",
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        timeout: float = DEFAULT_FETCH_TIMEOUT,
        shard: int | None = None,
        rate_floor: float = DEFAULT_RATE_FLOOR,
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
        """
        validate_name(model, "model")
        number = 0 if version == "latest" else validate_version(version)
        check_shard_arg(shard)
        start = time.monotonic()
        deadline = Deadline.after(timeout, f"fetch {model}@{version}")
        resolved = self._resolve(model, number, shard=shard, timeout=deadline.work(self.timeout))
        version = int(resolved.version)
        manifest = _pick_shard(model, version, resolved, shard)
        layout = layout_of(manifest)
        if into is not None:
            layout.check_tensors(into)
            self.holdings.check_free(into)
            tensors = {spec.name: into[spec.name] for spec in layout.tensors}
        else:
            tensors = layout.allocate()
        held = HeldVersion.reader(self.tenant, model, version, layout, tensors)
        self._holder_server()
        self.holdings.hold(held, shard)
        try:
            stats = self._fill(
                model, version, held, resolved, manifest, shard, deadline, rate_floor
            )
        except BaseException:
            self._abandon(model, version, held, deadline)
            raise
        for source, nbytes in stats.bytes_per_source.items():
            SDK_BYTES_FETCHED.labels(source).inc(nbytes)
        SDK_FETCH_SECONDS.observe(time.monotonic() - start)
        return Held(self, model, version, tensors, stats, shard)

    def _fill(
        self,
        model: str,
        version: int,
        held: HeldVersion,
        resolved: pb.ResolveResponse,
        manifest: pb.Manifest,
        shard: int | None,
        deadline: Deadline,
        rate_floor: float = DEFAULT_RATE_FLOOR,
    ) -> Any:
        # Our PARTIAL record also pins the version against retention (no Pin of our own),
        # and its answer carries the candidates for our fence: no second Resolve.
        registered = self._register_holder(
            model, version, complete=False, shard=shard, timeout=deadline.work(self.timeout)
        )
        fence = int(registered.fence)
        self.holdings.registered(model, version, fence)
        # Pipelined replication: now that we are registered (our fence orders us after
        # every earlier reader), read from one predecessor rather than all from the publisher.
        candidates = list(registered.candidates) or holders_of(resolved, shard)
        skipped: dict[str, str] = {}  # holders whose endpoint we cannot use: why
        gpu = held.on_cuda  # RDMA reads land in host memory: a GPU destination reads over TCP
        first = pipeline_sources(
            self.topology, fence, self._candidates(candidates, skipped, device_memory=gpu)
        )
        tokens = self._read_token(model, version, shard, deadline, resolved)
        stats = read_or_explain(
            skipped,
            lambda: transport_fetch(
                self.tenant, model, version, held.layout, held,
                first or self._sources(candidates, skipped, device_memory=gpu),
                token=tokens, deadline=deadline.work_end, me=self.topology,
                refresh_sources=self._refresher(
                    model, version, shard, deadline, skipped, tokens, device_memory=gpu
                ),
                expected=list(manifest.chunk_xxh3), tls=self._tls, rate_floor=rate_floor,
                checks=self._hooks.checks,
            ),
        )  # fmt: skip
        # a session lost meanwhile re-registered us under a new fence: complete that record
        fence = self.holdings.fence(model, version, fence)
        update = pb.UpdateHolderRequest(
            model=model, version=version, holder=self._holder_pb(True, fence, shard)
        )
        budget = deadline.finish(self.timeout)
        if budget is None:
            raise DeadlineExceeded(
                f"{deadline.what}: every byte arrived, but no time was left to mark it COMPLETE"
            )
        self._rpc("UpdateHolder", update, budget)  # also drops the pin our PARTIAL record held
        return stats

    def _refresher(
        self,
        model: str,
        version: int,
        shard: int | None,
        deadline: Deadline,
        skipped: dict[str, str],
        tokens: RenewingToken | None = None,
        *,
        device_memory: bool = False,
    ) -> Callable[[], list[Source]]:
        """What a fetch calls when a holder failed: ask again who holds (this shard of) it,
        as seen from our fence and topology, within the fetch's deadline; the manifest is
        not sent again. The answer's read token is offered to `tokens`."""

        def refresh() -> list[Source]:
            fence = self.holdings.fence(model, version)
            again = self._resolve(
                model, version, shard=shard, fence=fence, manifest=False,
                timeout=deadline.work(self.timeout),
            )  # fmt: skip
            if tokens is not None:
                tokens.offer(bytes(again.read_token), int(again.token_expiry_unix))
            return self._sources(holders_of(again, shard), skipped, device_memory=device_memory)

        return refresh

    def _read_token(
        self,
        model: str,
        version: int,
        shard: int | None,
        deadline: Deadline,
        resolved: pb.ResolveResponse,
    ) -> RenewingToken:
        """The fetch's read token from `resolved`, renewed before it expires by a Resolve
        without the manifest, within the fetch's deadline (ros.client.read_token)."""

        def renew() -> tuple[bytes, int]:
            fence = self.holdings.fence(model, version)
            again = self._resolve(
                model, version, shard=shard, fence=fence, manifest=False,
                timeout=deadline.work(self.timeout),
            )  # fmt: skip
            return bytes(again.read_token), int(again.token_expiry_unix)

        return RenewingToken(bytes(resolved.read_token), int(resolved.token_expiry_unix), renew)

    def _candidates(
        self, holders: Sequence[pb.Holder], skipped: dict[str, str], *, device_memory: bool
    ) -> list[Candidate]:
        by_name = {h.name: h for h in holders}
        return [
            Candidate(s, int(by_name[s.holder_id].fence), by_name[s.holder_id].state == pb.COMPLETE)
            for s in self._sources(holders, skipped, device_memory=device_memory)
        ]

    def _sources(
        self, holders: Sequence[pb.Holder], skipped: dict[str, str], *, device_memory: bool = False
    ) -> list[Source]:
        """The holders we can read from, each over the best transport both sides have
        (rdma → CUDA IPC, a later issue → tcp: `transport.selection`); why a better one
        was passed over is logged and travels in `Source.fallback` into the fetch's
        `stats.fallbacks`. One whose endpoints we cannot use (written by an older hub, or
        naming only a transport we lack) is skipped, not fatal: it goes into `skipped`
        with the reason, logged once per fetch, and the others are read."""
        sources = []
        for h in holders:
            if h.name == self.holder_name:
                continue
            try:
                route = choose(
                    h.endpoints, complete=h.state == pb.COMPLETE, tls=self._tls is not None,
                    device_memory=device_memory,
                )  # fmt: skip
            except InvalidArgument as exc:
                if h.name not in skipped:
                    log.warning("skipping holder %s: %s", h.name, exc)
                skipped[h.name] = f"skipped: {exc}"
                continue
            topology = Topology(
                **{k: v for k, v in h.topology.items() if k in ("dc", "rack", "host")}
            )
            if route.fallback:
                log.info("reading holder %s over %s: %s", h.name, route.kind.value, route.fallback)
            sources.append(
                Source(h.name, route.host, route.port, topology,
                       transport=route.kind, fallback=route.fallback)
            )  # fmt: skip
        return sources

    def _abandon(self, model: str, version: int, held: HeldVersion, deadline: Deadline) -> None:
        """Undo a failed fetch within its deadline: stop serving, delete our PARTIAL record
        (and the pin it held). What does not fit in time is left to the session's lease."""
        try:  # forgets its fence and shard too
            self.holdings.drop(held.key, min(1.0, max(deadline.end - time.monotonic(), 0.0)))
        except TensorHubError as exc:
            log.warning("abandoning %s@%d: %s", model, version, exc)
        request = pb.ReleaseHolderRequest(
            model=model, version=version, holder=self.holder_name, force=True,
            session_id=self.session.id,  # the hub checks that it owns the record
        )  # fmt: skip
        budget = deadline.finish(self.timeout)
        try:  # deletes our record and the pin it held
            if budget is None:
                raise DeadlineExceeded("no time left before the fetch's deadline")
            self._rpc("ReleaseHolder", request, budget)
        except TensorHubError as exc:  # the lease removes them anyway when we go
            log.warning(
                "cleanup of %s@%d not done (%s): our PARTIAL record and its pin are left to "
                "the session's lease (they go at close(), or when it expires)",
                model, version, exc,
            )  # fmt: skip


def read_or_explain(skipped: Mapping[str, str], read: Callable[[], FetchStats]) -> FetchStats:
    """Run one data-plane read; name the holders skipped for their endpoints in its stats,
    or, when no holder was left to read from, in its `VersionUnavailable`."""
    try:
        stats = read()
    except VersionUnavailable as exc:
        if not skipped:
            raise
        why = "; ".join(f"{name}: {reason}" for name, reason in sorted(skipped.items()))
        raise VersionUnavailable(f"{exc} (holders skipped: {why})") from exc
    for name, reason in skipped.items():
        stats.failed_sources.setdefault(name, reason)
    return stats


def holder_shard(holder: pb.Holder) -> int | None:
    """The shard a holder of a model-parallel version holds (None: the whole version)."""
    return holder.shard if holder.HasField("shard") else None


def holders_of(response: pb.ResolveResponse, shard: int | None) -> list[pb.Holder]:
    """The holders that have these bytes: of shard `shard`, or of the whole version (None)."""
    return [h for h in response.holders if holder_shard(h) == shard]


def _pick_shard(
    model: str, version: int, resolved: pb.ResolveResponse, shard: int | None
) -> pb.Manifest:
    """The manifest to read: the whole version's, or shard `shard`'s of a model-parallel one
    (a Resolve with `shard` answers only that shard's manifest, in `manifest`)."""
    count = resolved.shard_count or len(resolved.shards)
    if not count:
        if shard is not None:
            raise InvalidArgument(f"{model}@{version} is not model-parallel: omit shard")
        return resolved.manifest
    if shard is None:
        raise InvalidArgument(
            f"{model}@{version} is model-parallel ({count} shards): fetch one with shard=i "
            f"(0 <= i < {count}), or read blocks in another layout with fetch_slices"
        )
    if not 0 <= shard < count:
        raise InvalidArgument(f"shard {shard!r} out of range: {model}@{version} has {count}")
    manifest: pb.Manifest = resolved.shards[shard] if resolved.shards else resolved.manifest
    return manifest


def check_shard_arg(shard: int | None) -> None:
    """Refuse a shard that is no index before asking the hub (a bool is no index)."""
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or shard < 0):
        raise InvalidArgument(f"shard {shard!r} out of range: a shard is an integer >= 0")
