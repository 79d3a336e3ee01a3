"""Exit 0 when the hub replica at ADDRESS (default 127.0.0.1:7600) reports SERVING.

The container health check of the hub image (deploy/compose/Dockerfile, docker-compose.yml):
one call of the standard gRPC health service, which the hub serves without a token. Exit 1
on any other status or on any error (nothing listening, a timeout), with the reason on stderr.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address = argv[1] if len(argv) > 1 else "127.0.0.1:7600"
    try:
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=3.0
            )
    except grpc.RpcError as exc:
        print(f"hub at {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        print(f"hub at {address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
