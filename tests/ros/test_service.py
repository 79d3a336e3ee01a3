"""The gRPC surface: generated code is current, health and reflection are served."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ros.hub.server import SERVICE_NAME, HubServer
from ros.proto.tensorhub.v1 import hub_pb2
from tests.script_modules import load

_GENERATE = load("generate_proto")  # scripts/generate_proto.py
PROTO_DIR, ROOT, protos = _GENERATE.PROTO_DIR, _GENERATE.ROOT, _GENERATE.protos


def _compiled(proto: Path, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """`proto` as this environment's protoc parses it (any grpcio-tools: the descriptor does
    not depend on the generator's version, the generated code's floors do)."""
    out = tmp_path / "set.pb"
    args = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}",
        f"--descriptor_set_out={out}", str(proto.relative_to(ROOT)),
    ]  # fmt: skip
    subprocess.run(args, check=True, capture_output=True, timeout=120)
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert len(files) == 1
    _drop_json_names(files[0].message_type)  # protoc fills them in; generated code omits them
    return files[0]


def _drop_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_generated_code_is_current(tmp_path: Path) -> None:
    """The committed code describes hub.proto as it is: its descriptor equals the one protoc
    makes of the .proto, and its stubs route every method of the service (`make proto`
    regenerates both with the pinned generator; CI checks that byte for byte)."""
    assert [p.name for p in protos()] == ["hub.proto"]
    want = _compiled(protos()[0], tmp_path)
    have = descriptor_pb2.FileDescriptorProto.FromString(hub_pb2.DESCRIPTOR.serialized_pb)
    assert have == want, "ros/proto/tensorhub/v1/hub_pb2.py is stale: run `make proto`"
    stubs = (PROTO_DIR / "hub_pb2_grpc.py").read_text()
    routed = set(re.findall(r"'/tensorhub\.v1\.TensorHub/(\w+)'", stubs))
    assert routed == {m.name for m in want.service[0].method}, (
        "hub_pb2_grpc.py is stale: run `make proto`"
    )
    pyi = (PROTO_DIR / "hub_pb2.pyi").read_text()
    for message in want.message_type:
        assert f"class {message.name}(_message.Message)" in pyi, (
            f"hub_pb2.pyi lacks {message.name}: run `make proto`"
        )


def test_health_and_reflection(hub_server: HubServer) -> None:
    channel = grpc.insecure_channel(hub_server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = list(reflection.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in responses[0].list_services_response.service}
    assert SERVICE_NAME == "tensorhub.v1.TensorHub"
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    channel.close()
