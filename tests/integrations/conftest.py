"""The hub fixtures of tests/ros (a real hub over the session's real etcd), shared here."""

from tests.ros.conftest import connect, hub_server, make_tenant

__all__ = ["connect", "hub_server", "make_tenant"]
