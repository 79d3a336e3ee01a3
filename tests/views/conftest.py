"""The hub fixtures of tests/ros (a real hub over the session's real etcd) for the view
tests that publish and fetch views."""

from tests.ros.conftest import connect, held, hub_server, make_tenant

__all__ = ["connect", "held", "hub_server", "make_tenant"]
