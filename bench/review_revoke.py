"""`tensorhub bench revoke [--tenant acme] [--hub-tree PATH] [--json PATH]`: a deleted
tenant's token against two hub replicas (issue 25, item 1), before and after.

What it guards against: at 35d0b56, after `tensorhub tenant delete acme` through replica 1,
the old token, still cached on replica 2, opened a session and published `ghost@1` (its
holder `127.0.0.1:9`, its metadata `planted-by: deleted tenant`); the tenant created again
under the same name listed `ghost` and resolved the planted holder, and the old token then
published `ghost2` into it. Delete and re-create is the documented way to revoke a leaked
token.

One run, against a fresh etcd and two hub replicas over it (`bench.scale.world.World`, the
hub of `--hub-tree` when given), over raw gRPC with this checkout's generated stubs (an older
hub ignores the fields it lacks), so the same client code runs against the old hub and the
new one:

1. the admin creates `--tenant` through replica 1; with its token, replica 2 opens a session
   and answers `ListModels` (so it has the token cached);
2. the admin deletes the tenant through replica 1; the clock starts when that answers;
3. at once, with the OLD token on replica 2: `OpenSession`, then `Publish ghost@1`;
4. the admin creates the tenant again (a new token); with it, through replica 1:
   `ListModels` and `Resolve ghost`;
5. the old token publishes `ghost2@1` on replica 2 (into the new tenant, if it can);
6. the new tenant's `ListModels` once more: what it inherited.

Each step's outcome (OK, or the TensorHub error class / gRPC status) and its time after the
delete are reported. Targets: old-token writes that landed (the open and the two publishes)
0, models the new tenant inherited 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from bench.report import Result, emit
from bench.scale.procs import ServerStartError
from bench.scale.world import World
from ros.errors import ERROR_METADATA_KEY
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

T = TypeVar("T")
CALL_SECONDS = 10.0  # every call of the bench is bounded by this (a big publish by its own)
PLANTED_ENDPOINT = "127.0.0.1:9"  # the discard port: a holder nobody can read from
PLANTED_METADATA = {"planted-by": "deleted tenant"}
MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tenant", default="acme", help="the tenant deleted and created again (acme)")
    ap.add_argument("--hub-tree", help="run the hub of another checkout (e.g. a worktree)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tensorhub bench revoke", description=__doc__)
    add_arguments(ap)
    return ap.parse_args(argv)


# -- raw gRPC, the same against every hub --------------------------------------------------


class Client:
    """One channel to one hub replica, every call with `token` (and `tenant`, when given, in
    the `tensorhub-tenant` metadata) and a deadline."""

    def __init__(self, address: str, token: str, tenant: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address, MESSAGE_OPTIONS)
        self.stub = hub_pb2_grpc.TensorHubStub(self.channel)  # type: ignore[no-untyped-call]
        metadata = [("authorization", f"Bearer {token}")]
        if tenant is not None:
            metadata.append(("tensorhub-tenant", tenant))
        self.metadata = tuple(metadata)

    def call(self, method: str, request: Any, timeout: float = CALL_SECONDS) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)

    def close(self) -> None:
        self.channel.close()


def error_name(exc: BaseException) -> str:
    """The TensorHub error class a call failed with (its `tensorhub-error` trailer), else
    its gRPC status name, else the exception's type."""
    if isinstance(exc, grpc.Call):  # what a failed call raises is a grpc.Call too
        trailers: Any = exc.trailing_metadata() or ()
        for key, value in trailers:
            if key == ERROR_METADATA_KEY:
                return str(value)
        return str(exc.code().name)
    return type(exc).__name__


def attempt(fn: Callable[[], T]) -> tuple[str, T | None]:
    """("OK", the answer), or (the error's name, None) for a failed gRPC call."""
    try:
        return "OK", fn()
    except grpc.RpcError as exc:
        return error_name(exc), None


def hub_has_flag(tree: str | None, flag: str) -> bool:
    """Whether the hub to run (this checkout's, or `tree`'s) has `flag` (`serve --help`)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    done = subprocess.run(
        [sys.executable, "-m", "ros.cli", "serve", "--help"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tree, env=env,
    )  # fmt: skip
    return flag in done.stdout


def create_tenant(admin: Client, name: str, quotas: pb.Quotas) -> pb.CreateTenantResponse:
    reply: pb.CreateTenantResponse = admin.call(
        "CreateTenant", pb.CreateTenantRequest(name=name, quotas=quotas)
    )
    return reply


def planted(model: str, session: int) -> pb.PublishRequest:
    """`model@1`: one tiny tensor, its holder the discard port, its metadata saying who
    planted it (a field the hub at 35d0b56 has too)."""
    return pb.PublishRequest(
        model=model,
        version=1,
        manifest=pb.Manifest(
            tensors=[pb.TensorEntry(name="w", dtype="float32", shape=[4], nbytes=16)],
            total_bytes=16,
            chunk_size=4096,
            chunk_xxh3=[0],
            metadata=PLANTED_METADATA,
        ),
        holder=pb.Holder(
            name="planted",
            endpoints={"tcp": PLANTED_ENDPOINT},
            state=pb.COMPLETE,
            session_id=session,
        ),
    )


# -- the run -------------------------------------------------------------------------------


@dataclass
class Step:
    """One call of the sequence: who made it, its outcome, seconds after the delete, and
    what it showed (models listed, a holder resolved)."""

    what: str
    outcome: str
    at_s: float
    shows: str = ""

    def row(self) -> dict[str, Any]:
        return {"step": self.what, "outcome": self.outcome, "at_s": round(self.at_s, 3),
                "shows": self.shows}  # fmt: skip


class Timeline:
    """The steps, timed from `start()` (the delete's answer)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._t0 = time.monotonic()

    def run(self, what: str, fn: Callable[[], T]) -> tuple[Step, T | None]:
        outcome, answer = attempt(fn)
        step = Step(what, outcome, time.monotonic() - self._t0)
        self.steps.append(step)
        _log(f"+{step.at_s:.2f} s  {what}: {outcome}")
        return step, answer


def _models(reply: pb.ListModelsResponse | None) -> list[str]:
    return [] if reply is None else sorted(m.name for m in reply.models)


def sequence(hub_tree: str | None, tenant: str) -> tuple[list[Step], dict[str, Any]]:
    """The review's sequence on a fresh etcd and two replicas; the steps and the figures."""
    with World([], max_sessions=16, replicas=2, tree=hub_tree) as world:
        if len(world.hubs) != 2:
            raise ServerStartError("the bench's world did not start two hub replicas")
        first, second = world.addresses
        admin = Client(first, world.admin)
        quotas = pb.Quotas(max_sessions=16)
        old_token = create_tenant(admin, tenant, quotas).token
        old = Client(second, old_token, tenant)
        clients = [admin, old]
        try:
            before = old.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=60))
            old.call("ListModels", pb.ListModelsRequest())  # replica 2 has the token cached
            admin.call("DeleteTenant", pb.DeleteTenantRequest(name=tenant))
            seq = Timeline()
            seq.start()
            opened_step, opened = seq.run(
                "old token: OpenSession (replica 2)",
                lambda: old.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=60)),
            )
            session = int((opened or before).session_id)
            ghost_step, _ = seq.run(
                "old token: Publish ghost@1 (replica 2)",
                lambda: old.call("Publish", planted("ghost", session)),
            )
            _, created = seq.run(
                f"admin: CreateTenant {tenant} again (replica 1)",
                lambda: create_tenant(admin, tenant, quotas),
            )
            new = Client(first, created.token if created is not None else "none", tenant)
            clients.append(new)
            listed_step, listed = seq.run(
                "new token: ListModels (replica 1)",
                lambda: new.call("ListModels", pb.ListModelsRequest()),
            )
            listed_step.shows = ", ".join(_models(listed)) or "(none)"
            resolve_step, resolved = seq.run(
                "new token: Resolve ghost (replica 1)",
                lambda: new.call("Resolve", pb.ResolveRequest(model="ghost")),
            )
            holders = [] if resolved is None else [h.endpoints.get("tcp", "") for h in
                                                   resolved.holders]  # fmt: skip
            if resolved is not None:
                planted_by = dict(resolved.manifest.metadata).get("planted-by", "")
                resolve_step.shows = f"holders {holders}" + (
                    f", planted-by: {planted_by}" if planted_by else ""
                )
            ghost2_step, _ = seq.run(
                "old token: Publish ghost2@1 (replica 2)",
                lambda: old.call("Publish", planted("ghost2", session)),
            )
            final_step, final = seq.run(
                "new token: ListModels (replica 1)",
                lambda: new.call("ListModels", pb.ListModelsRequest()),
            )
            final_step.shows = ", ".join(_models(final)) or "(none)"
        finally:
            for client in clients:
                client.close()
    writes = [opened_step, ghost_step, ghost2_step]
    figures = {
        "landed": sum(s.outcome == "OK" for s in writes),
        "inherited": None if final is None else len(final.models),
        "planted_resolved": int(PLANTED_ENDPOINT in holders),
        "new_tenant_error": "" if final is not None else final_step.outcome,
    }
    return seq.steps, figures


def run(args: argparse.Namespace) -> Result:
    tree = f" --hub-tree {args.hub_tree}" if args.hub_tree else ""
    name = "" if args.tenant == "acme" else f" --tenant {args.tenant}"
    result = Result("revoke", f"tensorhub bench revoke{name}{tree}")
    started = time.monotonic()
    steps, figures = sequence(args.hub_tree, args.tenant)
    result.add("old-token writes that landed (open, ghost, ghost2)", figures["landed"], "<= 0")
    result.add("models the new tenant inherited", figures["inherited"], "<= 0")
    result.add("planted holder resolved by the new tenant", figures["planted_resolved"],
               unit="holders")  # fmt: skip
    for step in steps:
        result.add(f"{step.what}: {step.outcome}", step.at_s, unit="s after delete")
    if figures["new_tenant_error"]:
        result.note = f"the new tenant's ListModels failed: {figures['new_tenant_error']}"
    result.details = {"tenant": args.tenant, "hub_tree": args.hub_tree,
                      "steps": [s.row() for s in steps]}  # fmt: skip
    result.seconds = time.monotonic() - started
    return result


def steps_table(result: Result) -> str:
    """The steps as a Markdown table, one row per step."""
    out = ["| step | outcome | after the delete | shows |", "|---|---|---|---|"]
    for row in result.details.get("steps", []):
        out.append(f"| {row['step']} | {row['outcome']} | +{row['at_s']:.3f} s | "
                   f"{row['shows']} |")  # fmt: skip
    return "\n".join(out)


def _log(message: str) -> None:
    print(f"bench revoke: {message}", file=sys.stderr, flush=True)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (e.g. `timeout`): unwind, so the hubs and etcd are stopped."""
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    args = parse(argv)
    result = run(args)
    print(steps_table(result))
    return emit([result], args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
