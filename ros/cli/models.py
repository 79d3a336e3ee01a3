"""`tensorhub delete MODEL`: delete a model and every version of it, at once.

The way out for a stuck model (its latest at the top of the version range, or a record no
reader can use) or an abandoned one: afterwards it no longer counts against the tenant's
models quota and can be published again from version 1. A tenant deletes its own models
with its token; an operator deletes any tenant's with the admin token and `--tenant`.
"""

from __future__ import annotations

import argparse
import os

import grpc

from ros.cli.common import add_hub_flags, hub_stub, print_json, tenant_metadata
from ros.errors import from_rpc_error
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name

DESCRIPTION = """\
Delete MODEL and every version of it: its latest pointer, every version's manifest, shard,
holder and pin records, and its manifest pages, in one etcd transaction. Readers
and holders that still have a version in memory keep it until they release it, but no
reader is sent to them any more. The model stops counting against the models quota and
can be published again from version 1.

With a tenant token (--token, env TENSORHUB_TOKEN) a tenant deletes its own models
(--tenant, if given, must be the token's tenant). With the admin token (--admin-token, or
env TENSORHUB_ADMIN_TOKEN when no tenant token is given) --tenant names the tenant whose
model is deleted. NOT_FOUND if the model has nothing to delete.
"""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", metavar="MODEL", help="the model to delete")
    add_hub_flags(parser)
    parser.add_argument(
        "--admin-token",
        default=None,
        help="delete as the operator, with the hub's admin token (needs --tenant; env "
        "TENSORHUB_ADMIN_TOKEN is used when neither this nor a tenant token is given)",
    )


def run(args: argparse.Namespace) -> int:
    model = validate_name(args.model, "model")
    admin = args.admin_token
    if admin is None and not args.token:
        admin = os.environ.get("TENSORHUB_ADMIN_TOKEN")
    if admin:
        if not args.tenant:
            raise InvalidArgument("--tenant is needed with the admin token: whose model?")
        metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {admin}"),)
    else:
        metadata = tenant_metadata(args)
    request = pb.DeleteModelRequest(model=model, tenant=args.tenant or "")
    stub, channel = hub_stub(args)
    try:
        response = stub.DeleteModel(request, timeout=args.timeout, metadata=metadata)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        channel.close()
    whose = args.tenant or "this tenant"
    if args.json:
        print_json(
            {
                "model": model,
                "tenant": args.tenant or None,
                "versions_deleted": response.versions_deleted,
                "revision": response.revision,
            }
        )
    else:
        print(
            f"model {model} of {whose} deleted: {response.versions_deleted} version(s) "
            f"(revision {response.revision})"
        )
    return 0
