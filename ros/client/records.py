"""This client's holder records: how one is built (name, endpoints, topology, state, the
session it lives on, its fence) and the calls that write it.

The record builder has no side effects: the endpoints it names are the ones `Serving`
already listens on (`Serving.start` comes first).
"""

from __future__ import annotations

from typing import Protocol

from consistency.floor import RevisionFloor
from ros.client.rpc import Rpc
from ros.client.serving import Serving
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from transport.topology import Topology


class SessionId(Protocol):
    """The session a record lives on (its lease: the record goes with it)."""

    @property
    def id(self) -> int: ...


class HolderRecords:
    """Build and write this client's holder records."""

    def __init__(
        self,
        rpc: Rpc,
        floor: RevisionFloor,
        serving: Serving,
        session: SessionId,
        *,
        holder_name: str,
        topology: Topology,
    ) -> None:
        self._rpc = rpc
        self._floor = floor
        self._serving = serving
        self._session = session
        self.holder_name = holder_name
        self._labels = topology.labels()

    @property
    def session_id(self) -> int:
        return self._session.id

    def record(self, complete: bool, fence: int = 0, shard: int | None = None) -> pb.Holder:
        """Our holder record: COMPLETE or PARTIAL, under the current session."""
        return pb.Holder(
            name=self.holder_name,
            endpoints=self._serving.endpoints(),  # tcp, and rdma/ipc where served here
            topology=self._labels,
            state=pb.COMPLETE if complete else pb.PARTIAL,
            session_id=self._session.id,
            fence=fence,
            shard=shard,
        )

    def register(
        self,
        model: str,
        version: int,
        *,
        complete: bool,
        shard: int | None = None,
        timeout: float | None = None,
        rpc: Rpc | None = None,
    ) -> pb.RegisterHolderResponse:
        """Register our record; a PARTIAL one's answer carries its `candidates`. `rpc`
        replaces the client's (a session recovery's, tried once: it has its own policy)."""
        request = pb.RegisterHolderRequest(
            model=model, version=version, holder=self.record(complete, shard=shard)
        )
        response = (rpc or self._rpc)("RegisterHolder", request, timeout)
        self._floor.observe(response.revision)
        return response

    def complete(
        self, model: str, version: int, fence: int, shard: int | None, timeout: float
    ) -> None:
        """Mark our record COMPLETE (which also drops the pin our PARTIAL one held)."""
        update = pb.UpdateHolderRequest(
            model=model, version=version, holder=self.record(True, fence, shard)
        )
        self._rpc("UpdateHolder", update, timeout)

    def release(
        self, model: str, version: int, *, force: bool, timeout: float | None = None
    ) -> None:
        """Delete our record of `model@version` (`RetentionViolation`: refused)."""
        request = pb.ReleaseHolderRequest(
            model=model, version=version, holder=self.holder_name, force=force,
            session_id=self._session.id,  # the hub checks that it owns the record
        )  # fmt: skip
        response = self._rpc("ReleaseHolder", request, timeout)
        self._floor.observe(response.revision)
