"""What a demo run measured, per step: the figures of the final table, `--json` and `--plot`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ros.demo.config import TRAINER

MB = 1 << 20


@dataclass
class Fetch:
    """One rollout's fetch of one version."""

    sources: dict[str, int]  # holder name -> payload bytes read from it
    fetch_s: float
    stall_s: float  # the trainer's publish began -> this rollout had the new weights loaded
    verified: bool  # its bytes hash to the trainer's digest of the same version
    failed_sources: dict[str, str] = field(default_factory=dict)
    delta_bytes: int = 0  # encoded changes read (Held.delta.encoded_bytes; 0: read whole)
    delta_chunks: int = 0  # chunks made from them

    @property
    def moved(self) -> int:
        """Bytes that crossed the network for this fetch: the whole chunks read
        (`Held.stats.total_bytes`, by source) plus the encoded changes."""
        return sum(self.sources.values()) + self.delta_bytes


@dataclass
class Step:
    """One training step: one published version and what happened to it."""

    step: int
    version: int
    bytes: int
    digest: str
    t_publish: float
    publish_s: float = 0.0
    delta_published: int = 0  # bytes of the encoded changes the trainer published (0: none)
    trainer_stall_s: float = 0.0
    fetches: dict[str, Fetch] = field(default_factory=dict)
    fetch_failures: dict[str, str] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)
    loss: float = 0.0
    killed: str = ""  # the rollout SIGKILLed during this step's fetch
    killed_at_fraction: float | None = None  # how much of its fetch it had, when killed

    @property
    def from_trainer(self) -> int:
        return sum(f.sources.get(TRAINER, 0) for f in self.fetches.values())

    @property
    def from_peers(self) -> int:
        return sum(n for f in self.fetches.values() for s, n in f.sources.items() if s != TRAINER)

    @property
    def from_deltas(self) -> int:
        """Encoded changes the rollouts read (from the trainer and from each other)."""
        return sum(f.delta_bytes for f in self.fetches.values())

    @property
    def moved(self) -> int:
        """Everything that crossed the network to the rollouts this step: whole chunks
        (from the trainer and from peers) plus encoded changes."""
        return self.from_trainer + self.from_peers + self.from_deltas

    @property
    def rollout_stall_s(self) -> float:
        return max((f.stall_s for f in self.fetches.values()), default=0.0)

    @property
    def throughput_mbs(self) -> float:
        """All rollouts' bytes moved over the time from publish until the last had them."""
        return self.moved / MB / self.rollout_stall_s if self.rollout_stall_s > 0 else 0.0

    @property
    def reward(self) -> float:
        return sum(self.rewards.values()) / len(self.rewards) if self.rewards else 0.0

    @property
    def verified(self) -> bool:
        return bool(self.fetches) and all(f.verified for f in self.fetches.values())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("from_trainer", "from_peers", "from_deltas", "moved", "rollout_stall_s",
                     "throughput_mbs", "reward", "verified"):  # fmt: skip
            out[name] = getattr(self, name)
        return out


@dataclass
class Report:
    """The whole run."""

    config: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    wall_s: float = 0.0
    killed: str = ""
    killed_records_vanished_s: float | None = None  # SIGKILL -> its holder records gone
    errors: list[str] = field(default_factory=list)

    @property
    def all_verified(self) -> bool:
        return len(self.steps) == self.config["steps"] and all(s.verified for s in self.steps)

    @property
    def reward_rising(self) -> bool:
        if len(self.steps) < 2:
            return False
        half = max(1, len(self.steps) // 2)
        early = sum(s.reward for s in self.steps[:half]) / half
        late = sum(s.reward for s in self.steps[-half:]) / half
        return late > early

    @property
    def ok(self) -> bool:
        killed_ok = not self.killed or self.killed_records_vanished_s is not None
        return self.all_verified and killed_ok and not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "steps": [s.to_dict() for s in self.steps],
            "wall_s": self.wall_s,
            "killed": self.killed,
            "killed_records_vanished_s": self.killed_records_vanished_s,
            "errors": self.errors,
            "all_verified": self.all_verified,
            "reward_rising": self.reward_rising,
            "rewards": [s.reward for s in self.steps],
            "ok": self.ok,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
