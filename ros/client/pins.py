"""Pins: a version kept from being retired while a reader that is no holder reads it.

A pin lives on the client's session (its lease), so it goes when the process does; it is
named by the caller (`pin_id`), so a retried Pin or Unpin is idempotent.
"""

from __future__ import annotations

from ros.client.records import SessionId
from ros.client.rpc import Rpc
from ros.proto.tensorhub.v1 import hub_pb2 as pb


class Pins:
    """Pin and unpin versions under one client's session."""

    def __init__(self, rpc: Rpc, session: SessionId) -> None:
        self._rpc = rpc
        self._session = session

    def pin(self, model: str, version: int, pin_id: str, timeout: float | None = None) -> None:
        request = pb.PinRequest(
            model=model, version=version, pin_id=pin_id, session_id=self._session.id
        )
        self._rpc("Pin", request, timeout)

    def unpin(self, model: str, version: int, pin_id: str, timeout: float | None = None) -> None:
        request = pb.UnpinRequest(
            model=model, version=version, pin_id=pin_id, session_id=self._session.id
        )
        self._rpc("Unpin", request, timeout)
