"""A raw client's Publish with views the SDK would never send (docs/security.md, "view
names"): each refused by the hub with a named error, nothing written. Shards of one version
that disagree on their views: each refused, the version and its views visible only with
shards that agree."""

from __future__ import annotations

from collections.abc import Callable

from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, InvalidManifest, InvalidName
from tests.ros.test_hostile_publishers import publish, raw_client, shard


def manifest(tag: int, metadata: dict[str, str] | None = None) -> pb.Manifest:
    return pb.Manifest(
        tensors=[pb.TensorEntry(name="w", dtype="float32", shape=[4], nbytes=16)],
        total_bytes=16, chunk_size=4096, chunk_xxh3=[tag], metadata=metadata or {},
    )  # fmt: skip


def whole(model: str, session: int, views: list[pb.PublishView]) -> pb.PublishRequest:
    return pb.PublishRequest(
        model=model, version=1, manifest=manifest(0), views=views,
        holder=pb.Holder(name="raw", endpoints={"tcp": "127.0.0.1:9"}, state=pb.COMPLETE,
                         session_id=session),
    )  # fmt: skip


def view(fmt: str, named: str | None = None) -> pb.PublishView:
    return pb.PublishView(format=fmt, manifest=manifest(1, {"tensorhub.view": named or fmt}))


def test_the_hub_refuses_views_the_sdk_would_never_send(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    with raw_client(hub_server, make_tenant("raw-views")) as (stub, metadata, session):
        cases = {
            "an unknown format": (whole("m", session, [view("fp4")]), InvalidArgument),
            "a format twice": (whole("m", session, [view("mxfp8"), view("mxfp8")]),
                               InvalidArgument),
            "no format named": (whole("m", session, [view("mxfp8", named="fp8-block128")]),
                                InvalidManifest),
            "a view's own name": (whole("m.mxfp8", session, []), InvalidName),
            "a view of a view": (whole("m.mxfp8", session, [view("fp8-block128")]), InvalidName),
        }  # fmt: skip
        for what, (request, error) in cases.items():
            got = publish(stub, request, metadata)
            assert type(got) is error, (what, got)
        listed = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10)  # type: ignore[attr-defined]
        assert list(listed.models) == []  # nothing was written
        assert publish(stub, whole("m", session, [view("mxfp8")]), metadata) is None
        listed = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10)  # type: ignore[attr-defined]
        assert sorted(m.name for m in listed.models) == ["m", "m.mxfp8"]


def test_every_shard_of_a_version_carries_the_same_views(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    """The shards of one version carry the same views (`consistency.shard_commit`): one
    that names other views, or none, is refused (`InvalidArgument`) and leaves nothing;
    the view is visible exactly when its version is, at the same revision."""
    with raw_client(hub_server, make_tenant("raw-view-shards")) as (stub, metadata, session):

        def sharded(index: int, *formats: str) -> pb.PublishRequest:
            request = shard("m", 1, index, 2, session)
            request.views.extend(view(fmt) for fmt in formats)
            return request

        def latest(model: str) -> pb.LatestResponse:
            return stub.Latest(pb.LatestRequest(model=model), metadata=metadata, timeout=10)  # type: ignore[attr-defined,no-any-return]

        assert publish(stub, sharded(0, "mxfp8"), metadata) is None
        assert latest("m").version == 0
        assert latest("m.mxfp8").version == 0  # a view waits for its version's last shard
        for other in ((), ("fp8-block128",), ("mxfp8", "fp8-block128")):
            got = publish(stub, sharded(1, *other), metadata)
            assert type(got) is InvalidArgument, (other, got)
            assert latest("m").version == 0, other
        assert publish(stub, sharded(1, "mxfp8"), metadata) is None
        version, view_of = latest("m"), latest("m.mxfp8")
        assert (version.version, view_of.version) == (1, 1)
        assert version.revision == view_of.revision  # one transaction
        assert latest("m.fp8-block128").version == 0
