"""The demo's trainer process: REINFORCE on the bandit, one published version per step.

The policy's float32 masters are trained with Adam; what is published is a bf16 copy of them
(`published`, one host copy of the model, refreshed in place after each optimizer step), as
an RL trainer publishes the weights its rollouts run. Per step: publish that copy (no further
copy) with `delta=True` (unless `--no-delta`), so that the SDK also publishes the changes
against the previous step and keeps a copy of this one for the next (one more host copy of
the model); wait until one rollout holds it COMPLETE (the trainer stall), release it, wait for
the rollouts' rewards on that version, then step the optimizer and refresh the copy — which
overwrites its memory in place, so it must come after the release (the mutability contract).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import ros
from ros.demo.channel import Link
from ros.demo.config import MODEL, TRAINER, DemoConfig
from ros.demo.policy import (
    Policy,
    build_policy,
    chunk_size_for,
    contexts,
    digest,
    optimizer_for,
    published_copy,
    refresh,
    reinforce_loss,
    rewards,
)
from ros.integrations.pytorch import publish_state_dict


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
    policy = build_policy(cfg.model_mb, cfg.seed, initialise=True)  # the float32 masters
    optimizer = optimizer_for(policy)
    published = published_copy(policy)  # the bf16 copy the rollouts get
    refresh(published, policy)
    total = sum(t.numel() * t.element_size() for t in published.values())
    chunk = chunk_size_for(total)
    hub = ros.connect(
        cfg.hub, tenant=cfg.tenant, token=cfg.token, name=TRAINER, session_ttl=cfg.session_ttl
    )
    try:
        link.send({"type": "ready", "bytes": total})
        if link.receive(cfg.step_timeout, ("start", "stop"))["type"] != "start":
            return 0
        for version in range(1, cfg.steps + 1):
            expected = digest(published)
            start, started = time.monotonic(), time.time()
            pub = publish_state_dict(
                hub, MODEL, version, published, chunk_size=chunk, delta=cfg.delta
            )
            companion = pub.companion
            link.send(
                {"type": "published", "version": version, "digest": expected, "bytes": total,
                 # from the start: a delta publish returns after its base copy is taken,
                 # when rollouts may have read the version already
                 "t": started, "publish_s": time.monotonic() - start,
                 "delta_bytes": 0 if companion is None else sum(
                     t.nbytes for t in companion.tensors.values())}
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
            refresh(published, policy)  # released above: its memory may change now
            link.send({"type": "trained", "version": version, "loss": loss})
        link.send({"type": "done"})
        return 0
    finally:
        hub.close()
        link.close()
