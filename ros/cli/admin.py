"""`tensorhub tenant create NAME`: an admin call that prints the new tenant's token once."""

from __future__ import annotations

import argparse
import os

import grpc

from ros.cli.common import add_hub_flags, hub_stub, print_json
from ros.errors import from_rpc_error
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = sub.add_parser("create", help="create a tenant and print its token (shown once)")
    create.add_argument("name", help="tenant name ([a-z0-9][a-z0-9._-]{0,62})")
    add_hub_flags(create, tenant=False)
    create.add_argument(
        "--admin-token",
        default=os.environ.get("TENSORHUB_ADMIN_TOKEN"),
        help="the hub's admin token (env TENSORHUB_ADMIN_TOKEN)",
    )
    create.add_argument("--max-models", type=int, default=0, help="quota (default 64)")
    create.add_argument("--max-retained-versions", type=int, default=0, help="quota (default 4)")
    create.add_argument("--max-sessions", type=int, default=0, help="quota (default 1024)")


def run(args: argparse.Namespace) -> int:
    if not args.admin_token:
        raise InvalidArgument("no admin token: pass --admin-token or set TENSORHUB_ADMIN_TOKEN")
    stub, channel = hub_stub(args)
    request = pb.CreateTenantRequest(
        name=args.name,
        quotas=pb.Quotas(
            max_models=args.max_models,
            max_retained_versions=args.max_retained_versions,
            max_sessions=args.max_sessions,
        ),
    )
    try:
        response = stub.CreateTenant(
            request,
            timeout=args.timeout,
            metadata=(("authorization", f"Bearer {args.admin_token}"),),
        )
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        channel.close()
    if args.json:
        print_json({"tenant": response.name, "token": response.token})
    else:
        print(f"tenant {response.name} created. Its token (shown only now, store it safely):")
        print(response.token)
    return 0
