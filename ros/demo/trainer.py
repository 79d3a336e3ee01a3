"""The demo's trainer process: REINFORCE on the bandit, one published version per step.

Per step: publish the policy's own memory as version `step` (no copy), wait until one rollout
holds it COMPLETE (the trainer stall), release it, wait for the rollouts' rewards on that
version, then step the optimizer — which overwrites the memory in place, so it must come
after the release (the mutability contract).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import ros
from ros.demo.channel import Link
from ros.demo.config import MODEL, TRAINER, DemoConfig
from ros.demo.policy import (
    LEARNING_RATE,
    Policy,
    build_policy,
    chunk_size_for,
    contexts,
    digest,
    reinforce_loss,
    rewards,
)
from ros.integrations.pytorch import publish_module


def train_on(
    policy: Policy, optimizer: torch.optim.Optimizer, items: list[dict[str, Any]], batch: int
) -> float:
    """One REINFORCE step on the rollouts' samples; the rewards are recomputed here from the
    contexts (rebuilt from their seeds) so a rollout cannot report a wrong reward."""
    ctx = torch.cat([contexts(int(i["seed"]), batch) for i in items])
    actions = torch.cat([torch.tensor(i["actions"], dtype=torch.int64) for i in items])
    loss = reinforce_loss(policy, ctx, actions, rewards(ctx, actions))
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.item())


def run_trainer(cfg: DemoConfig) -> int:
    torch.set_num_threads(1)
    link = Link(cfg.driver_port, TRAINER)
    policy = build_policy(cfg.model_mb, cfg.seed, initialise=True)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=LEARNING_RATE)
    total = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    chunk = chunk_size_for(total)
    hub = ros.connect(
        cfg.hub, tenant=cfg.tenant, token=cfg.token, name=TRAINER, session_ttl=cfg.session_ttl
    )
    try:
        link.send({"type": "ready", "bytes": total})
        if link.receive(cfg.step_timeout, ("start", "stop"))["type"] != "start":
            return 0
        for version in range(1, cfg.steps + 1):
            start = time.monotonic()
            expected = digest(policy.state_dict())
            pub = publish_module(hub, MODEL, version, policy, chunk_size=chunk)
            link.send(
                {"type": "published", "version": version, "digest": expected, "bytes": total,
                 "t": time.time(), "publish_s": time.monotonic() - start}
            )  # fmt: skip
            stalled = time.monotonic()
            pub.wait_replicated(1, timeout=cfg.step_timeout)
            pub.release(timeout=cfg.step_timeout)
            stall = time.monotonic() - stalled
            link.send({"type": "released", "version": version, "stall_s": stall})
            batch = link.receive(cfg.step_timeout, ("batch", "stop"))
            if batch["type"] != "batch":
                return 1
            loss = train_on(policy, optimizer, batch["items"], cfg.batch)
            link.send({"type": "trained", "version": version, "loss": loss})
        link.send({"type": "done"})
        return 0
    finally:
        hub.close()
        link.close()
