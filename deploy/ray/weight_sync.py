"""Weight sync on Ray with TensorHub: one trainer actor, N rollout actors, one replaced mid-run.

The trainer actor updates its weights in place and publishes each version from its own memory
(`hub.publish`), waits until one rollout holds a complete copy, and releases it before the next
update. Every rollout actor waits (a `versions_only` watch, under a deadline) for the version,
releases the one it held, fetches the new one in place into its model's own tensors
(`hub.fetch(..., into=...)`) and serves it to the other rollouts until the next one, so the
trainer serves only part of each step's copies (a table row shows how many MB came from
the trainer and how many from peers). After every step the driver checks each rollout's
bytes against the trainer's digest (sha256 over every tensor).

Delta versions, on by default (`--no-delta` turns them off): the trainer keeps float32
masters and publishes bf16 copies with `delta=True`, which costs it one more host copy of
the published weights, and each next version is also published as its changes; a rollout
whose tensors hold the version before reads only those (the table's "MB delta"; "MB moved"
is everything that crossed the network: whole chunks from the trainer and peers, plus the
delta). The stand-in step moves every master weight a little, which changes about 2 % of
the bf16 words, as an RL step does.

Mid-run (`--kill-at STEP`, after that step), one rollout actor is killed with `ray.kill`
while it holds the latest version complete and serves it, and a new one is started on the
same node: it catches up to the latest version, then follows the run like the others. The
run ends with every live rollout on the final version, with the trainer's bytes (exit status
0), or exits 1 naming the error: `WeightSyncError` (bytes differ), `DeadlineExceeded` (a
step's deadline passed) or another of the SDK's (e.g. `PermissionDenied` for a refused
token).

Version numbers: a run continues the model's versions, from `latest() + 1`. A model's
versions are one monotonic sequence in the hub (a publish that is not newer than the latest
fails with `StaleVersion`), so a trainer restarted on the same model, or a second run on the
same tenant, publishes after what is there; and the rollouts wait for *this run's* versions,
which the trainer names, never for `latest() >= N`, which a previous run's versions would
satisfy at once. Readers that follow "latest" keep working across runs, and the previous
run's versions age out by retention. A model name per run would work too, but would leave
every old run's model behind in the tenant (its quota) and make every reader learn the new
name; pass `--model` to start a separate line of versions when that is what you want.
Run one trainer per model at a time.

Each actor's holder port binds to its Ray node's IP (`ray.util.get_node_ip_address()`) and
is advertised there, with the node as its topology `host`, so readers on the same node are
preferred as sources.

The parts are in `ray_sync/` beside this script (model, reports, actors, driver, table).
Ray ships them to its workers by value, as it ships a script's own classes; the workers
import the `ros` SDK, so install this project on every node. Usage:

    ray start --head                                     # or any existing Ray cluster
    python deploy/ray/weight_sync.py --ray-address auto --hub 10.0.0.1:7600 \\
        --tenant team-a --token "$TENSORHUB_TOKEN" --rollouts 4 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

import ray
import ray.cloudpickle
import ray_sync  # beside this script (sys.path[0] when run as one)
from ray.exceptions import RayError
from ray_sync.driver import run
from ray_sync.reports import Config

import ros

# Workers cannot import ray_sync (it is not installed): its classes and functions travel by
# value, as a script's own would.
ray.cloudpickle.register_pickle_by_value(ray_sync)  # type: ignore[no-untyped-call]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="weight_sync.py",
        description="A trainer actor publishes N versions through a TensorHub hub; rollout "
        "actors fetch each in place and serve it to each other; one rollout is killed and "
        "replaced mid-run. Ends with every live rollout on the final version, bytes checked "
        "against the trainer's. Exit status 0 when that holds, 1 when it does not.",
        epilog="A run continues the model's versions from latest()+1, so repeated runs on one "
        "tenant work. The hub, tenant and token default to $TENSORHUB_HUB, $TENSORHUB_TENANT "
        "and $TENSORHUB_TOKEN (a token on the command line is visible to other users of the "
        "machine).",
    )
    env = os.environ.get
    ap.add_argument(
        "--hub",
        default=env("TENSORHUB_HUB"),
        help="hub address HOST:PORT (several: comma-separated replicas)",
    )
    ap.add_argument("--tenant", default=env("TENSORHUB_TENANT"), help="the tenant to run in")
    ap.add_argument("--token", default=env("TENSORHUB_TOKEN"), help="the tenant's token")
    ap.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join: HOST:PORT of its head, or 'auto' (default: $RAY_ADDRESS, "
        "else a new local single-node Ray)",
    )
    ap.add_argument("--model", default="policy", help="model name (default: policy)")
    ap.add_argument("--rollouts", type=int, default=4, help="rollout actors (default: 4)")
    ap.add_argument("--steps", type=int, default=10, help="versions to publish (default: 10)")
    ap.add_argument(
        "--model-mb", type=float, default=8.0, help="size of the weights in MiB (default: 8)"
    )
    ap.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="after this step, kill one rollout (holding that version) with ray.kill and "
        "start a new one that catches up; 0: none (default: the middle step)",
    )
    ap.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds each step's publish, wait and fetch may take (default: 120)",
    )
    ap.add_argument(
        "--no-delta",
        dest="delta",
        action="store_false",
        help="publish and fetch every version whole (default: the trainer publishes delta "
        "versions, keeping one more host copy of the weights, and rollouts read only the "
        "changes)",
    )
    ap.add_argument("--json", metavar="PATH", help="write the run's summary there as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    missing = [f"--{k}" for k in ("hub", "tenant", "token") if not getattr(args, k)]
    if missing:
        ap.error(f"{', '.join(missing)} required (or $TENSORHUB_HUB/_TENANT/_TOKEN)")
    kill_at = (args.steps + 1) // 2 if args.kill_at is None else args.kill_at
    if args.rollouts < 1 or args.steps < 1 or not 0 <= kill_at <= args.steps:
        ap.error("need --rollouts >= 1, --steps >= 1 and 0 <= --kill-at <= --steps")
    if args.model_mb <= 0 or args.step_timeout <= 0:
        ap.error("--model-mb and --step-timeout must be positive")
    hubs = [h.strip() for h in args.hub.split(",") if h.strip()]
    cfg = Config(tuple(hubs), args.tenant, args.token, args.model, args.model_mb, delta=args.delta)
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        summary = run(cfg, args.rollouts, args.steps, kill_at, args.step_timeout)
    except (ros.TensorHubError, RayError) as exc:
        cause = getattr(exc, "cause", None)  # an actor's exception: the SDK's own, not Ray's
        shown = cause if isinstance(cause, BaseException) else exc
        print(f"weight sync failed: {type(shown).__name__}: {shown}", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(asdict(summary), out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
