"""The hub fixtures of tests/ros (a real hub over the session's real etcd) for the view
tests that publish and fetch views, and `cli_as`: the CLI of this process pointed at it."""

from collections.abc import Callable

import pytest

from ros.hub.server import HubServer
from tests.ros.conftest import connect, held, hub_server, make_tenant

__all__ = ["cli_as", "connect", "held", "hub_server", "make_tenant"]


@pytest.fixture
def cli_as(
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[str], dict[str, str]]:
    """Point the CLI run in this process at the hub, as a new tenant of the given name (its
    hub, tenant and token in the environment until the test ends); returns that env."""

    def point(tenant: str) -> dict[str, str]:
        env = {"TENSORHUB_HUB": hub_server.address, "TENSORHUB_TENANT": tenant,
               "TENSORHUB_TOKEN": make_tenant(tenant)}  # fmt: skip
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return env

    return point
