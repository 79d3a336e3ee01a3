"""Errors keep their identity from the hub to the caller (issue 13, item 5).

Every error class is defined (and registered with its gRPC code) in `tensorhub.errors`; the
SDK rebuilds it from that registry, with its fields. A hub handler's bug is `INTERNAL` →
`InternalError` on unary and streaming calls; an UNKNOWN answer is an `OutcomeUnknown` only
after a write. A real hub servicer on loopback over the session's real etcd, with a few
handler bodies replaced by failing ones.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

import ros
import tensorhub.errors as errors_module
from consistency import Etcd, EtcdCluster, Keys
from ros.client.watch import _named as watch_error
from ros.errors import (
    ERROR_METADATA_KEY,
    FIELDS_METADATA_KEY,
    READ_METHODS,
    error_metadata,
    from_rpc_error,
    wire_name,
)
from ros.hub.call import AioContext, CallContext
from ros.hub.rpc import streaming, unary
from ros.hub.server import call_guard
from ros.hub.servicer import HubServicer
from ros.hub.tenants import TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import (
    InternalError,
    OutcomeUnknown,
    RevisionCompacted,
    SlowHolder,
    TensorHubError,
    VersionRetired,
)
from tests.ros.conftest import ADMIN

ROOT = Path(__file__).resolve().parents[2]
# Every method of the service that is not a read (ros.errors.READ_METHODS) is a write: a new
# method must be added to one list or the other.
WRITE_METHODS = frozenset({
    "OpenSession", "KeepAlive", "CloseSession", "Publish", "PublishShards", "RegisterHolder",
    "UpdateHolder", "ReleaseHolder", "Pin", "Unpin", "DeleteModel", "CreateTenant",
    "DeleteTenant", "RegisterLayoutHolder", "ReleaseLayoutHolder", "DeclareLayout",
    "RetireLayout",
})  # fmt: skip
PACKAGES = ("consistency", "transport", "ros", "tensorhub")


def _error_classes_defined_in(path: Path, names: set[str]) -> list[str]:
    """Classes in `path` whose base is one of `names` (the known error classes), by AST."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            bases = {
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            }
            if bases & names:
                found.append(node.name)
    return found


def test_every_error_class_is_defined_in_tensorhub_errors() -> None:
    names = set(errors_module.registered())
    outside = {
        f"{path.relative_to(ROOT)}: {name}"
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path != ROOT / "tensorhub" / "errors.py" and "proto" not in path.parts
        for name in _error_classes_defined_in(path, names)
    }
    assert not outside, f"error classes outside tensorhub/errors.py: {sorted(outside)}"


def test_every_class_of_the_tree_is_registered_with_a_grpc_code() -> None:
    codes = {code.name for code in grpc.StatusCode}
    defined = {
        obj
        for obj in vars(errors_module).values()
        if isinstance(obj, type) and issubclass(obj, TensorHubError)
    }
    assert defined == set(errors_module.registered().values())  # no decorator forgotten
    for cls in defined:
        assert cls.code in codes, cls
        for name in cls.fields:  # a field travels only with a typed class-level default
            assert isinstance(getattr(cls, name), int | float | str), (cls, name)


def _exported(path: Path) -> set[str]:
    """The string names in `path`'s `__all__` list, by AST (none without one)."""
    for node in ast.parse(path.read_text()).body:
        named = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        )
        if named and isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple):
            return {
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
    return set()


def test_no_module_but_the_tree_and_the_sdk_exports_an_error_class() -> None:
    """Callers import an error from `tensorhub.errors` (or `ros`, the SDK's face), never from
    the module that raises it: one path per class."""
    names = set(errors_module.registered())
    exporters = {
        f"{path.relative_to(ROOT)}: {sorted(_exported(path) & names)}"
        for package in ("consistency", "transport", "ros")
        for path in (ROOT / package).rglob("*.py")
        if "proto" not in path.parts and _exported(path) & names
    }
    assert not exporters, f"error classes exported outside the tree: {sorted(exporters)}"


def test_every_method_is_classified_as_a_read_or_a_write() -> None:
    service = pb.DESCRIPTOR.services_by_name["TensorHub"]
    methods = {m.name for m in service.methods}
    assert methods == READ_METHODS | WRITE_METHODS
    assert not READ_METHODS & WRITE_METHODS


def test_a_subclass_defined_elsewhere_travels_as_its_registered_ancestor() -> None:
    class Local(InternalError):
        pass

    assert wire_name(Local("x")) == "InternalError"
    slow = SlowHolder("slow")
    slow.rate = 12.5
    assert dict(error_metadata(slow))[FIELDS_METADATA_KEY] == '{"rate":12.5}'


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"), ("tensorhub-tenant", "team-x"))


class _Broken(HubServicer):
    """The real servicer with some handler bodies failing: as a bug would (`unary`,
    `streaming`), with a named error carrying a field, and below the wrappers (gRPC's own
    UNKNOWN, as from a hub that predates them or a proxy)."""

    @unary
    def Latest(self, request: pb.LatestRequest, context: CallContext) -> pb.LatestResponse:  # noqa: N802
        raise ValueError("a bug, not a TensorHubError")

    @streaming
    async def Watch(  # noqa: N802
        self, request: pb.WatchRequest, context: AioContext
    ) -> AsyncGenerator[pb.WatchEvent, None]:
        raise KeyError("a bug in a stream")
        yield pb.WatchEvent()  # pragma: no cover  (makes this an async generator)

    @unary
    def Inspect(self, request: pb.InspectRequest, context: CallContext) -> pb.InspectResponse:  # noqa: N802
        raise RevisionCompacted("required revision has been compacted", 42)

    async def ListModels(self, request: Any, context: AioContext) -> Any:  # noqa: N802
        raise ValueError("unwrapped: gRPC answers UNKNOWN")

    async def Pin(self, request: Any, context: AioContext) -> Any:  # noqa: N802
        raise ValueError("unwrapped: gRPC answers UNKNOWN")

    async def Resolve(self, request: Any, context: AioContext) -> Any:  # noqa: N802
        # A hostile or broken hub: a known name with fields of the wrong type.
        context.set_trailing_metadata(
            (
                (ERROR_METADATA_KEY, "RevisionCompacted"),
                (FIELDS_METADATA_KEY, '{"compact_revision":"9"}'),
            )
        )
        await context.abort(grpc.StatusCode.OUT_OF_RANGE, "compacted")


async def _serve(etcd: Etcd, keys: Keys) -> tuple[grpc.aio.Server, _Broken, int]:
    servicer = _Broken(etcd, keys, admin_token=ADMIN)
    servicer.start()
    server = grpc.aio.server(interceptors=[call_guard(servicer)])
    hub_pb2_grpc.add_TensorHubServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, port


def test_failures_keep_their_identity_over_the_wire(etcd_cluster: EtcdCluster, keys: Keys) -> None:
    async def main() -> None:
        etcd = Etcd(etcd_cluster.endpoints)
        server, servicer, port = await _serve(etcd, keys)
        token = TenantStore(etcd, keys).create("team-x")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        meta = _meta(token)

        async def failure(call: Any) -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            return info.value

        try:
            watch = stub.Watch(pb.WatchRequest(model="m"), metadata=meta, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                async for _ in watch:
                    pass
            assert streamed.value.code() == grpc.StatusCode.INTERNAL  # not UNKNOWN
            assert isinstance(from_rpc_error(streamed.value, "Watch"), InternalError)

            compacted = from_rpc_error(
                await failure(stub.Inspect(pb.InspectRequest(model="m"), metadata=meta, timeout=5)),
                "Inspect",
            )
            assert isinstance(compacted, RevisionCompacted)
            assert compacted.compact_revision == 42

            hostile = from_rpc_error(
                await failure(stub.Resolve(pb.ResolveRequest(model="m"), metadata=meta, timeout=5)),
                "Resolve",
            )
            assert isinstance(hostile, RevisionCompacted)
            assert hostile.compact_revision == 0  # a string is not planted in an int field

            unknown = await failure(
                stub.ListModels(pb.ListModelsRequest(), metadata=meta, timeout=5)
            )
            assert unknown.code() == grpc.StatusCode.UNKNOWN
            assert isinstance(from_rpc_error(unknown, "ListModels"), InternalError)
            assert isinstance(from_rpc_error(unknown), OutcomeUnknown)  # method not known
            assert isinstance(watch_error(unknown), InternalError)  # how HubWatch ends
            lost = await failure(stub.Pin(pb.PinRequest(model="m"), metadata=meta, timeout=5))
            assert isinstance(from_rpc_error(lost, "Pin"), OutcomeUnknown)  # a write: may be
        finally:
            await channel.close(None)
            await server.stop(0)
            servicer.close()
            etcd.close()

    asyncio.run(main())


def test_the_sdk_raises_internal_error_for_reads(etcd_cluster: EtcdCluster, keys: Keys) -> None:
    """Through `ros.connect`: a hub bug in Latest, and gRPC's UNKNOWN on ListModels, are
    `InternalError`s, never `OutcomeUnknown` (a read has no outcome to be unknown)."""

    async def main() -> None:
        etcd = Etcd(etcd_cluster.endpoints)
        server, servicer, port = await _serve(etcd, keys)
        token = TenantStore(etcd, keys).create("team-x")

        def use_the_sdk() -> None:
            with ros.connect(f"127.0.0.1:{port}", tenant="team-x", token=token) as hub:
                with pytest.raises(InternalError, match="internal error in Latest"):
                    hub.latest("m", timeout=5)
                with pytest.raises(InternalError, match="ListModels was answered UNKNOWN"):
                    hub.list_models()
                with pytest.raises(RevisionCompacted) as info:
                    hub.inspect("m", 1)
                assert info.value.compact_revision == 42

        try:
            await asyncio.to_thread(use_the_sdk)
        finally:
            await server.stop(0)
            servicer.close()
            etcd.close()

    asyncio.run(main())


def test_version_retired_is_a_version_not_found() -> None:
    """Callers that catch `VersionNotFound` keep working; it is no `LeaseLost`."""
    assert issubclass(VersionRetired, errors_module.VersionNotFound)
    assert not issubclass(VersionRetired, errors_module.LeaseLost)
