"""Run the hub: a gRPC server with the TensorHub service, health checking and reflection."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from consistency import Etcd, Keys
from ros.hub.servicer import HubServicer
from ros.proto.tensorhub.v1 import hub_pb2, hub_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = hub_pb2.DESCRIPTOR.services_by_name["TensorHub"].full_name
MAX_MESSAGE_BYTES = 64 << 20


class HubServer:
    """One hub replica. Stateless: start as many as you like over the same etcd."""

    def __init__(
        self,
        etcd_endpoints: list[str],
        *,
        listen: str = "127.0.0.1:0",
        admin_token: str,
        keys: Keys | None = None,
        retain: int = 2,
        max_workers: int = 256,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.etcd = Etcd(etcd_endpoints)
        self.keys = keys or Keys()
        self.servicer = HubServicer(
            self.etcd, self.keys, admin_token=admin_token, default_retain=retain
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="hub"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
            maximum_concurrent_rpcs=max_workers * 4,
        )
        hub_pb2_grpc.add_TensorHubServicer_to_server(self.servicer, self._server)  # type: ignore[no-untyped-call]
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        if credentials is None:
            self.port = self._server.add_insecure_port(listen)
        else:
            self.port = self._server.add_secure_port(listen, credentials)
        self.host = listen.rsplit(":", 1)[0]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> HubServer:
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("hub serving on %s", self.address)
        return self

    def stop(self, grace: float = 1.0) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait(timeout=grace + 5)
        self.servicer.close()
        self.etcd.close()

    def wait(self) -> None:
        self._server.wait_for_termination()
