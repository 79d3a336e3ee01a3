"""The fetch side of the SDK: resolve, pin, register PARTIAL, pull, verify, COMPLETE."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ros.client.base import ClientBase
from ros.client.channel import parse_address
from ros.client.handles import Held
from ros.client.manifest import layout_of
from ros.metrics import SDK_BYTES_FETCHED, SDK_FETCH_SECONDS
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, TensorHubError
from tensorhub.names import validate_name, validate_version
from transport.planner import Candidate, Source, pipeline_sources
from transport.reader import fetch as transport_fetch
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
    ) -> Held:
        """Read `model@version` from its holders, in place into `into` or into new tensors.

        With `into`, names, dtypes and shapes must match the manifest or `InvalidArgument`
        is raised before any byte is written. The fetched version is served to others until
        `release()`d. Raises `VersionUnavailable` if no holder is left, before the deadline.
        """
        validate_name(model, "model")
        number = 0 if version == "latest" else validate_version(version)
        start = time.monotonic()
        deadline = start + timeout
        resolved = self._fresh(
            lambda t: self._rpc("Resolve", pb.ResolveRequest(model=model, version=number), t),
            lambda r: int(r.revision),
            min(timeout, self.timeout),
        )
        version = int(resolved.version)
        if resolved.shards:
            raise InvalidArgument(
                f"{model}@{version} is model-parallel ({len(resolved.shards)} shards); "
                "fetching sharded versions is not supported by this SDK yet"
            )
        layout = layout_of(resolved.manifest)
        if into is not None:
            layout.check_tensors(into)
            self._check_not_held(into)
            tensors = {spec.name: into[spec.name] for spec in layout.tensors}
        else:
            tensors = layout.allocate()
        held = HeldVersion.reader(self.tenant, model, version, layout, tensors)
        self._holder_server()
        self._store.add(held)
        try:
            stats = self._fill(model, version, held, resolved, deadline)
        except BaseException:
            self._abandon(model, version, held)
            raise
        for source, nbytes in stats.bytes_per_source.items():
            SDK_BYTES_FETCHED.labels(source).inc(nbytes)
        SDK_FETCH_SECONDS.observe(time.monotonic() - start)
        return Held(self, model, version, tensors, stats)

    def _fill(
        self,
        model: str,
        version: int,
        held: HeldVersion,
        resolved: pb.ResolveResponse,
        deadline: float,
    ) -> Any:
        pin = pb.PinRequest(
            model=model, version=version, pin_id=self.holder_name, session_id=self.session.id
        )
        self._rpc("Pin", pin)
        fence = self._register(model, version, complete=False)
        self._fences[(model, version)] = fence

        def refresh() -> list[Source]:
            again = self._rpc("Resolve", pb.ResolveRequest(model=model, version=version))
            return self._sources(again.holders)

        # Pipelined replication: now that we are registered (our fence orders us after
        # every earlier reader), read from one predecessor rather than all from the publisher.
        ordered = self._rpc("Resolve", pb.ResolveRequest(model=model, version=version))
        first = pipeline_sources(self.topology, fence, self._candidates(ordered.holders))
        stats = transport_fetch(
            self.tenant, model, version, held.layout, held,
            first or self._sources(resolved.holders),
            token=bytes(resolved.read_token), deadline=deadline, me=self.topology,
            refresh_sources=refresh, expected=list(resolved.manifest.chunk_xxh3), tls=self._tls,
        )  # fmt: skip
        update = pb.UpdateHolderRequest(
            model=model, version=version, holder=self._holder_pb(True, fence)
        )
        self._rpc("UpdateHolder", update)
        self._rpc("Unpin", pb.UnpinRequest(model=model, version=version, pin_id=self.holder_name))
        return stats

    def _candidates(self, holders: Sequence[pb.Holder]) -> list[Candidate]:
        by_name = {h.name: h for h in holders}
        return [
            Candidate(s, int(by_name[s.holder_id].fence), by_name[s.holder_id].state == pb.COMPLETE)
            for s in self._sources(holders)
        ]

    def _sources(self, holders: Sequence[pb.Holder]) -> list[Source]:
        sources = []
        for h in holders:
            if h.name == self.holder_name or "tcp" not in h.endpoints:
                continue
            host, port = parse_address(h.endpoints["tcp"])
            topology = Topology(
                **{k: v for k, v in h.topology.items() if k in ("dc", "rack", "host")}
            )
            sources.append(Source(h.name, host, port, topology))
        return sources

    def _check_not_held(self, into: Mapping[str, torch.Tensor]) -> None:
        """Refuse to fetch into memory that still serves another version (mutability contract)."""
        targets = {t.data_ptr() for t in into.values() if t.numel()}
        for key in self._store.keys():  # noqa: SIM118  (a method, not a dict)
            held = self._store.get(key)
            if held is None or held.released:
                continue
            if targets & {t.data_ptr() for t in held.tensors.values() if t.numel()}:
                raise InvalidArgument(
                    f"`into` still serves {key[1]}@{key[2]}: release it before overwriting it"
                )

    def _abandon(self, model: str, version: int, held: HeldVersion) -> None:
        try:
            self._store.release(held.key, 1.0)
        except TensorHubError as exc:
            log.warning("abandoning %s@%d: %s", model, version, exc)
        for method, request in (
            (
                "ReleaseHolder",
                pb.ReleaseHolderRequest(
                    model=model, version=version, holder=self.holder_name, force=True
                ),
            ),
            ("Unpin", pb.UnpinRequest(model=model, version=version, pin_id=self.holder_name)),
        ):
            try:
                self._rpc(method, request)
            except TensorHubError as exc:  # the lease removes them anyway when we go
                log.info("cleanup %s of %s@%d failed: %s", method, model, version, exc)
        self._fences.pop((model, version), None)
