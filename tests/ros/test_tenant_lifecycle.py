"""Tenant tokens and deletion (issue 12, item 11), against a real hub and etcd.

- A dotted tenant name (`team.x`) used to be created and then never authenticate (the token
  parser split at the first `.`); it now works end to end.
- A deleted tenant's name can be created again, and the new tenant accepts neither the old
  tenant's token nor a read token minted with the old tenant's read key (its epoch differs).
"""

from __future__ import annotations

import grpc
import pytest

import ros
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import issue_read_token, tenant_of
from tests.ros.conftest import ADMIN
from tests.ros.helpers import digest, make_model, read_policy_1
from tests.waiting import wait_until

ADMIN_METADATA = (("authorization", f"Bearer {ADMIN}"),)


def _stub(server: HubServer) -> hub_pb2_grpc.TensorHubStub:
    return hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(server.address))  # type: ignore[no-untyped-call]


def _create(server: HubServer, name: str) -> str:
    request = pb.CreateTenantRequest(name=name)
    return str(_stub(server).CreateTenant(request, metadata=ADMIN_METADATA, timeout=5).token)


def _delete(server: HubServer, name: str, metadata: tuple[tuple[str, str], ...]) -> None:
    _stub(server).DeleteTenant(pb.DeleteTenantRequest(name=name), metadata=metadata, timeout=5)


def test_the_tenant_is_everything_before_the_last_dot() -> None:
    assert tenant_of("team.x.abc_DEF-123") == "team.x"
    assert tenant_of("team-a.abc") == "team-a"  # tokens issued before the rule still parse
    with pytest.raises(ros.PermissionDenied):
        tenant_of("no-separator")
    with pytest.raises(ros.PermissionDenied):
        tenant_of("team.x.not a secret")


def test_a_dotted_tenant_name_works_end_to_end(hub_server: HubServer) -> None:
    token = _create(hub_server, "team.x")
    assert token.startswith("team.x.")
    weights = make_model(1)
    with ros.connect(hub_server.address, tenant="team.x", token=token) as trainer:
        trainer.publish("policy", 1, weights)
        with ros.connect(hub_server.address, tenant="team.x", token=token) as reader:
            got = reader.fetch("policy", 1, timeout=30)
            assert digest(got.tensors) == digest(weights)


def test_delete_then_create_again_refuses_the_old_tenants_tokens_and_read_tokens(
    hub_server: HubServer,
) -> None:
    old_token = _create(hub_server, "team-a")
    old = ros.connect(hub_server.address, tenant="team-a", token=old_token, session_ttl=3)
    old.publish("policy", 1, make_model(1))
    old_key = old.session.read_key
    with pytest.raises(grpc.RpcError) as refused:  # a tenant token is not the admin's
        _delete(hub_server, "team-a", (("authorization", f"Bearer {old_token}"),))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED

    _delete(hub_server, "team-a", ADMIN_METADATA)
    with pytest.raises(grpc.RpcError) as again:
        _delete(hub_server, "team-a", ADMIN_METADATA)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND
    # the old client's session is revoked: its holder stops serving at once
    wait_until("the deleted tenant's session is lost", old.session.lost.is_set)
    assert hub_server.etcd.count(hub_server.keys.tenant("team-a")) == 0  # nothing left

    new_token = _create(hub_server, "team-a")
    with pytest.raises(ros.PermissionDenied):
        ros.connect(hub_server.address, tenant="team-a", token=old_token)
    with ros.connect(hub_server.address, tenant="team-a", token=new_token) as new:
        assert new.latest("policy") == 0  # the old tenant's models went with it
        new.publish("policy", 1, make_model(1))
        assert new.session.read_key != old_key  # another epoch: other keys, every period
        stale, _ = issue_read_token(old_key, "team-a", "policy", 1)
        with pytest.raises(ros.PermissionDenied):
            read_policy_1(new, stale)
        fresh, _ = issue_read_token(new.session.read_key, "team-a", "policy", 1)
        read_policy_1(new, fresh)  # the control: the new tenant's own key reads
    old.close()
