"""Fresh reads: hub answers never older than this client's revision floor (invariant 3).

Every read (`Latest`, `Resolve`, `Inspect`) is tried on the client's `RetryPolicy` until its
deadline: a `StaleRead` from a lagging replica, or one unreachable or overloaded
(`consistency.retry`). Each try is one gRPC attempt (`HubRpc.once`): the policy is the only
retry layer of a read. `Resolve` answers are completed from a cache of manifests (they never
change), checked against the hub's digest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from consistency.floor import RevisionFloor
from consistency.retry import RetryPolicy
from ros.client.manifest_cache import CachedManifest, ManifestCache
from ros.client.rpc import Rpc
from ros.manifest_check import check_received
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from transport.topology import Topology

T = TypeVar("T")


class FreshReads:
    """The reads of one client: `latest`, `inspect` and `resolve`, each fresh."""

    def __init__(
        self,
        rpc: Rpc,
        floor: RevisionFloor,
        policy: RetryPolicy,
        *,
        timeout: float,
        holder_name: str,
        topology: Topology,
    ) -> None:
        self._rpc = rpc  # tried once per call: the policy retries
        self.floor = floor
        self._policy = policy
        self._timeout = timeout
        self._holder_name = holder_name
        self._topology = topology.labels()
        self.manifests = ManifestCache()  # by (model, version, shard): they never change

    def fresh(
        self, call: Callable[[float], T], revision_of: Callable[[T], int], timeout: float | None
    ) -> T:
        """`call(seconds left)` until its answer is not older than the floor, on the policy,
        within `timeout` (default: the client's)."""
        policy = self._policy
        deadline = policy.deadline(self._timeout if timeout is None else timeout)

        def read() -> T:
            answer = call(max(deadline - policy.clock(), 0.01))
            self.floor.accept(revision_of(answer))
            return answer

        return policy.call(read, deadline)

    def latest(self, model: str, timeout: float | None = None) -> pb.LatestResponse:
        request = pb.LatestRequest(model=model)
        return self.fresh(
            lambda t: self._rpc("Latest", request, t), lambda r: int(r.revision), timeout
        )

    def inspect(self, model: str, version: int, timeout: float | None = None) -> pb.InspectResponse:
        """`Inspect` with every holder: the pages followed (the first carries the manifest),
        each fresh; the revision is the last page's."""
        request = pb.InspectRequest(model=model, version=version)
        info: pb.InspectResponse = self.fresh(
            lambda t: self._rpc("Inspect", request, t), lambda r: int(r.revision), timeout
        )
        request.version, request.omit_manifest = info.version, True
        while info.next_page_token:
            request.page_token = info.next_page_token
            page: pb.InspectResponse = self.fresh(
                lambda t: self._rpc("Inspect", request, t), lambda r: int(r.revision), timeout
            )
            info.holders.extend(page.holders)
            info.next_page_token, info.revision = page.next_page_token, page.revision
            info.total_holders = page.total_holders
        return info

    def resolve(
        self,
        model: str,
        version: int,
        *,
        shard: int | None = None,
        fence: int = 0,
        timeout: float | None = None,
        manifest: bool = True,
        companion: bool = False,
    ) -> pb.ResolveResponse:
        """Resolve `model@version` (0: latest) for this client: its topology, fence and
        name (never among the candidates), fresh.

        The manifest is asked for only when `manifest` and not cached (by model, version,
        shard: it never changes); the answer then always carries it, from the hub or from
        the cache (checked against the hub's digest: a mismatch asks once more in full).
        `companion`: the hub also resolves the delta's companion, when the version has one
        (`answer.companion`, its manifest checked and cached like any).
        """
        cached = self.manifests.get((model, version, shard)) if version else None
        omit = cached is not None or not manifest
        request = pb.ResolveRequest(
            model=model, version=version, shard=shard, omit_manifest=omit,
            topology=self._topology, fence=fence, holder=self._holder_name,
            min_revision=self.floor.value, with_companion=companion,
        )  # fmt: skip
        answer: pb.ResolveResponse = self.fresh(
            lambda t: self._rpc("Resolve", request, t), lambda r: int(r.revision), timeout
        )
        if not manifest:
            return answer
        key = (model, int(answer.version), shard)
        if answer.manifest_omitted:
            cached = self.manifests.get(key)
            if cached is not None and cached.digest == bytes(answer.manifest_digest):
                cached.fill(answer)
                self._companion(answer, shard)
                return answer
            # evicted meanwhile, or not what the hub has: ask once more, with the manifest
            self.manifests.pop(key)
            request.version, request.omit_manifest = answer.version, False
            answer = self.fresh(
                lambda t: self._rpc("Resolve", request, t), lambda r: int(r.revision), timeout
            )
        check_received(answer, f"{model}@{answer.version}")  # before any use, or caching
        self.manifests.put(key, CachedManifest.of(answer))
        self._companion(answer, shard)
        return answer

    def _companion(self, answer: pb.ResolveResponse, shard: int | None) -> None:
        """Check and cache the companion's manifest that a Resolve answered with its
        version's, if it did (`InvalidManifest` before any use, as for any manifest)."""
        if not answer.HasField("companion"):
            return
        name, version = answer.manifest.delta.companion, int(answer.version)
        if not name:  # a companion of no delta: nothing to use it for
            answer.ClearField("companion")
            return
        check_received(answer.companion, f"{name}@{version}")
        self.manifests.put((name, version, shard), CachedManifest.of(answer.companion))
