"""Model handlers: `DeleteModel`, the way out for a stuck or abandoned model.

A tenant deletes its own models with its token (`tenant` empty, or its own name); the admin
token deletes a model of any tenant, named in `tenant`. Every key of the model goes in one
etcd transaction (`consistency.deletion`), so the model stops counting against the models
quota at once and can be published again from version 1.

They depend on `ModelHub`, the part of the replica they use, not on the whole
`ros.hub.state.HubState`, which provides it.
"""

from __future__ import annotations

from typing import Protocol

from consistency import Etcd, Keys
from consistency.deletion import delete_model
from ros.hub.call import Admin, CallContext
from ros.hub.rpc import Runs, unary
from ros.hub.tenants import Tenant
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, PermissionDenied
from tensorhub.names import validate_name


class ModelHub(Runs, Protocol):
    """What the model handlers use of a replica, besides running calls (`Runs`): the key
    schema and etcd that `consistency.deletion` deletes a model in, unfenced for the admin
    and fenced on the caller's tenant record for a tenant (`etcd_for`)."""

    etcd: Etcd
    keys: Keys

    def timeout(self, context: CallContext) -> float: ...

    def etcd_for(self, tenant: Tenant) -> Etcd: ...


class ModelRPCs:
    """Model handlers: `DeleteModel`."""

    def __init__(self, hub: ModelHub) -> None:
        self.hub = hub

    @unary
    def DeleteModel(
        self, request: pb.DeleteModelRequest, context: CallContext
    ) -> pb.DeleteModelResponse:
        model = validate_name(request.model, "model")
        if isinstance(context.caller, Admin):
            if not request.tenant:
                raise InvalidArgument("DeleteModel with the admin token must name the tenant")
            tenant = validate_name(request.tenant, "tenant")
            writer = self.hub.etcd  # the admin deletes whatever is there
        else:
            caller = context.tenant()
            tenant, writer = caller.name, self.hub.etcd_for(caller)
            if request.tenant and request.tenant != tenant:
                raise PermissionDenied(
                    f"a tenant deletes only its own models: this token is {tenant}'s, "
                    f"not {request.tenant[:63]!r}'s"
                )
        deleted = delete_model(
            writer, self.hub.keys, tenant, model, timeout=self.hub.timeout(context)
        )
        return pb.DeleteModelResponse(revision=deleted.revision, versions_deleted=deleted.versions)
