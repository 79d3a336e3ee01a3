"""`Hub`: the SDK's connection to TensorHub (what `ros.connect` returns).

The control plane goes through the hub (gRPC); weight bytes go holder → reader directly over
the data plane (`transport`). Every client that holds a version runs a small holder server,
started on first use, so whatever it published or fetched is served to others until released.
The pieces: `ros.client.base` (channel, holder server), `ros.client.holdings` (what the
client holds: the one owner of it), `ros.client.recovery` (its session, recovered after a
loss), `ros.client.publishing`, `ros.client.fetching`, `ros.client.slices` (reading another
layout's blocks).
"""

from __future__ import annotations

from consistency.records import HolderRecord
from ros.client.base import DEFAULT_TIMEOUT, ClientBase, default_holder_name
from ros.client.fetching import DEFAULT_FETCH_TIMEOUT
from ros.client.publishing import PublishMixin
from ros.client.slices import SliceMixin
from ros.client.watch import holder_from_message
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.names import validate_name

__all__ = ["DEFAULT_FETCH_TIMEOUT", "DEFAULT_TIMEOUT", "ClientBase", "Hub", "default_holder_name"]


class Hub(PublishMixin, SliceMixin):
    """A connection to the hub for one tenant. Thread-safe. Close it (or use `with`)."""

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
