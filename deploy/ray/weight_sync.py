"""Weight sync on Ray with TensorHub: one trainer actor, N rollout actors (not run in CI).

Each actor connects to the hub with its own topology labels; the trainer publishes every
step and waits for one replica; rollouts fetch the latest version in place and keep serving
it to each other until the next one arrives.

    python deploy/ray/weight_sync.py --hub 10.0.0.1:7600 --tenant team-a --token ...
"""

from __future__ import annotations

import argparse
import socket
import time

import ray
import torch

import ros


def _connect(hub: str, tenant: str, token: str) -> ros.Hub:
    """This actor's connection: its holder port on every interface, advertised by its IP."""
    return ros.connect(
        hub,
        tenant=tenant,
        token=token,
        listen="0.0.0.0:0",
        advertise=socket.gethostbyname(socket.gethostname()),
        topology={"host": socket.gethostname()},
    )


@ray.remote
class Trainer:
    def __init__(self, hub: str, tenant: str, token: str) -> None:
        self.model = torch.nn.Linear(1024, 1024)
        self.hub = _connect(hub, tenant, token)

    def step(self, version: int) -> int:
        with torch.no_grad():
            self.model.weight.add_(0.01)
        pub = self.hub.publish("policy", version, self.model.state_dict())
        pub.wait_replicated(1, timeout=120)
        pub.release(force=True)
        return version


@ray.remote
class Rollout:
    def __init__(self, hub: str, tenant: str, token: str) -> None:
        self.model = torch.nn.Linear(1024, 1024)
        self.hub = _connect(hub, tenant, token)
        self.held: ros.Held | None = None

    def refresh(self, version: int) -> int:
        if self.held is not None:
            self.held.release(force=True)
        # fetch waits for no one: ask for the exact version, retrying until it is published
        for _ in range(600):
            if self.hub.latest("policy") >= version:
                break
            time.sleep(0.1)
        self.held = self.hub.fetch("policy", version, into=self.model.state_dict(), timeout=120)
        return self.held.version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hub", required=True)
    ap.add_argument("--tenant", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    ray.init()
    trainer = Trainer.remote(args.hub, args.tenant, args.token)
    rollouts = [Rollout.remote(args.hub, args.tenant, args.token) for _ in range(args.rollouts)]
    for version in range(1, args.steps + 1):
        published = trainer.step.remote(version)
        fetched = ray.get([r.refresh.remote(version) for r in rollouts])
        print("step", version, fetched, ray.get(published))


if __name__ == "__main__":
    main()
