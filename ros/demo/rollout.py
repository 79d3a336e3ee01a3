"""The demo's rollout process: watch for versions, fetch each in place, generate, report.

Per version: release the previous one (stop serving it from the policy's memory; the last
complete holder of a retained version spills it to host memory and serves it from there),
fetch the new one into the policy's own tensors (`into=`, no second copy), serve it to the
other rollouts until the next version, sample actions for a batch of contexts and send them
back with their rewards. The policy's tensors hold the version before, so when the trainer
published the new one with a delta only its changes are read (`Held.delta`), applied in
place after a check of each base chunk, and verified.
The rollout chosen by `--kill-a-rollout-at` freezes itself mid-fetch and tells the driver,
which SIGKILLs it: a holder dying with a PARTIAL version, for real. That one fetch reads the
version whole (`delta=False`): a delta fetch makes most chunks before the rounds whose
progress the freeze waits for.
"""

from __future__ import annotations

import os
import signal
import time

import torch

import ros
from consistency.events import EventKind
from ros.client.handles import Held
from ros.client.orchestrator import Progress, ProgressCallback
from ros.demo.channel import Link
from ros.demo.config import MODEL, DemoConfig, rollout_name
from ros.demo.policy import PUBLISHED, build_policy, contexts, digest, rewards, sample
from ros.integrations.pytorch import fetch_module
from tensorhub.errors import TensorHubError


def batch_seed(cfg: DemoConfig, version: int, index: int) -> int:
    return cfg.seed * 1_000_003 + version * 1_000 + index


def freeze_mid_fetch(link: Link, version: int) -> ProgressCallback:
    """A fetch progress callback that, at the first chunk of `version` committed while others
    are still missing, reports to the driver and SIGSTOPs this whole process from inside the
    fetch, so the driver's SIGKILL lands with a PARTIAL version, whatever the timing."""

    def at(progress: Progress) -> None:
        if 0 < progress.chunks < progress.total_chunks:
            link.send({"type": "mid_fetch", "version": version, "done": progress.fraction})
            os.kill(os.getpid(), signal.SIGSTOP)

    return at


def release_previous(held: Held | None, timeout: float) -> None:
    """Release the previous version before fetching the next into the same tensors. No
    `force`: if this rollout is the last complete holder of a version the hub still retains,
    the release spills it to host memory and keeps serving it from there (until it is no
    longer retained), so the in-place step loop keeps the retention promise."""
    if held is not None:
        held.release(timeout=timeout)


def run_rollout(cfg: DemoConfig, index: int) -> int:
    torch.set_num_threads(1)
    name = rollout_name(index)
    link = Link(cfg.driver_port, name)
    policy = build_policy(cfg.model_mb, cfg.seed, initialise=False, dtype=PUBLISHED)
    hub = ros.connect(
        cfg.hub, tenant=cfg.tenant, token=cfg.token, name=name, session_ttl=cfg.session_ttl
    )
    held: Held | None = None
    current = 0
    try:
        with hub.watch(MODEL, versions_only=True) as events:
            link.send({"type": "ready"})
            while True:
                if not link.inbox.empty() and link.inbox.get()["type"] in ("stop", "eof"):
                    break
                event = events.get(0.2)
                if event is None or event.kind is not EventKind.VERSION_PUBLISHED:
                    continue
                if event.version <= current:
                    continue
                version = current = event.version
                seen = time.time()
                release_previous(held, cfg.step_timeout)
                held = None
                link.send({"type": "fetching", "version": version})
                victim = name == cfg.victim and version == cfg.kill_at
                try:
                    held = fetch_module(
                        hub, MODEL, policy, version, timeout=cfg.step_timeout,
                        progress=freeze_mid_fetch(link, version) if victim else None,
                        delta=cfg.delta and not victim,
                    )  # fmt: skip
                except TensorHubError as exc:
                    link.send({"type": "fetch_failed", "version": version, "error": repr(exc)})
                    continue
                link.send(
                    {"type": "fetched", "version": version, "t_seen": seen, "t": time.time(),
                     "fetch_s": held.stats.duration, "sources": _whole(held),
                     "failed_sources": held.stats.failed_sources,
                     "refetched": held.stats.refetched_bytes,
                     "delta_bytes": held.delta.encoded_bytes if held.delta else 0,
                     "delta_chunks": held.delta.chunks if held.delta else 0,
                     "digest": digest(policy.state_dict())}
                )  # fmt: skip
                seed = batch_seed(cfg, version, index)
                ctx = contexts(seed, cfg.batch)
                actions = sample(policy, ctx, seed + 1)
                link.send(
                    {"type": "rewards", "version": version, "seed": seed,
                     "actions": actions.tolist(), "reward": float(rewards(ctx, actions).mean())}
                )  # fmt: skip
        return 0
    finally:
        hub.close()  # stops serving everything held (spills too); the session's records go
        link.close()


def _whole(held: ros.Held) -> dict[str, int]:
    """The bytes of whole chunks each holder sent (`Held.stats` counts the encoded changes
    too; the report shows those apart, as `delta_bytes`)."""
    encoded = held.delta.bytes_per_source if held.delta else {}
    whole = {s: n - encoded.get(s, 0) for s, n in held.stats.bytes_per_source.items()}
    return {s: n for s, n in whole.items() if n}
