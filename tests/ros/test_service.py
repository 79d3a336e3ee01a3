"""The gRPC surface: generated code is current, health and reflection are served."""

from __future__ import annotations

import filecmp
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ros.hub.server import SERVICE_NAME, HubServer
from ros.proto.generate import PROTO_DIR, ROOT, generate


def test_generated_code_is_current(tmp_path: Path) -> None:
    generate(tmp_path)
    for generated in sorted((tmp_path / PROTO_DIR.relative_to(ROOT)).glob("*_pb2*.py*")):
        committed = PROTO_DIR / generated.name
        assert committed.exists(), f"{generated.name} is not committed: run `make proto`"
        assert filecmp.cmp(generated, committed, shallow=False), (
            f"{committed} is stale: run `make proto`"
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
