"""Model handlers: `DeleteModel`, the way out for a stuck or abandoned model.

A tenant deletes its own models with its token (`tenant` empty, or its own name); the admin
token deletes a model of any tenant, named in `tenant`. Every key of the model goes in one
etcd transaction (`consistency.deletion`), so the model stops counting against the models
quota at once and can be published again from version 1.
"""

from __future__ import annotations

from consistency.deletion import delete_model
from ros.hub.rpc import CallContext, HubBase, bearer, same, unary
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.tokens import token_hash
from tensorhub.errors import InvalidArgument, PermissionDenied
from tensorhub.names import validate_name


class ModelRPCs(HubBase):
    """Model handlers: `DeleteModel`."""

    _admin_hash: str  # set by `HubServicer`: the hash of the hub's admin token

    @unary
    def DeleteModel(
        self, request: pb.DeleteModelRequest, context: CallContext
    ) -> pb.DeleteModelResponse:
        model = validate_name(request.model, "model")
        token = bearer(context)
        if token is not None and same(token_hash(token), self._admin_hash):
            if not request.tenant:
                raise InvalidArgument("DeleteModel with the admin token must name the tenant")
            tenant = validate_name(request.tenant, "tenant")
            writer = self.etcd  # the admin deletes whatever is there
        else:
            caller = self._tenant(context)
            tenant, writer = caller.name, self._etcd_for(caller)
            if request.tenant and request.tenant != tenant:
                raise PermissionDenied(
                    f"a tenant deletes only its own models: this token is {tenant}'s, "
                    f"not {request.tenant[:63]!r}'s"
                )
        deleted = delete_model(writer, self.keys, tenant, model, timeout=self._timeout(context))
        return pb.DeleteModelResponse(revision=deleted.revision, versions_deleted=deleted.versions)
