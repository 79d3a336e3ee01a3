"""Fixtures for the verl backend's tests: a real etcd and hub (tests/conftest.py and
tests/ros/conftest.py), and the `tensorhub` backend class as verl's registry hands it out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from ros.hub.server import HubServer
from tests.ros.conftest import connect, hub_server, make_tenant  # noqa: F401

verl_base = pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed")


@dataclass(frozen=True)
class Tenant:
    """Where the engines connect: what a verl config's engine_kwargs would carry."""

    hub: str
    tenant: str
    token: str

    def kwargs(self, **more: Any) -> dict[str, Any]:
        return {"hub": self.hub, "tenant": self.tenant, "token": self.token, **more}


@pytest.fixture
def tenant(hub_server: HubServer, make_tenant: Callable[[str], str]) -> Tenant:  # noqa: F811
    return Tenant(hub_server.address, "team-verl", make_tenant("team-verl"))


@pytest.fixture(scope="session")
def engine_cls() -> type[Any]:
    """The backend by name, as verl's manager and workers get it: the module named in
    `custom_backend_module` is imported, then `CheckpointEngineRegistry.get("tensorhub")`."""
    from verl.utils.import_utils import import_external_libs

    import_external_libs("ros.integrations.verl")
    cls: type[Any] = verl_base.CheckpointEngineRegistry.get("tensorhub")
    return cls
