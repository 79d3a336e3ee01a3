"""The demo's settings, shared by the driver and its worker processes (as JSON in the env)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from tensorhub.errors import InvalidArgument

CONFIG_ENV = "TENSORHUB_DEMO_CONFIG"
MODEL = "policy"
TRAINER = "trainer"


def rollout_name(index: int) -> str:
    return f"rollout-{index}"


@dataclass(frozen=True)
class DemoConfig:
    """What one demo run does. `hub`, `tenant`, `token` and `driver_port` are filled in by
    the driver once the hub is up; the rest comes from the command line."""

    rollouts: int = 4
    steps: int = 10
    model_mb: float = 64.0
    batch: int = 256
    seed: int = 0
    kill_at: int = 0  # the step whose fetch one rollout is SIGKILLed in; 0 = never
    step_timeout: float = 120.0
    session_ttl: int = 5
    delta: bool = True  # publish delta versions and apply them (--no-delta: all whole)
    hub: str = ""
    tenant: str = ""
    token: str = ""
    driver_port: int = 0

    def __post_init__(self) -> None:
        if self.rollouts < 1:
            raise InvalidArgument("--rollouts must be at least 1")
        if self.steps < 1:
            raise InvalidArgument("--steps must be at least 1")
        if self.model_mb <= 0:
            raise InvalidArgument("--model-mb must be positive")
        if self.kill_at and not 1 <= self.kill_at <= self.steps:
            raise InvalidArgument(f"--kill-a-rollout-at must be a step in 1..{self.steps}")
        if self.kill_at and self.rollouts < 2:
            raise InvalidArgument("--kill-a-rollout-at needs at least 2 rollouts (one survives)")

    @property
    def victim(self) -> str:
        """The rollout that `--kill-a-rollout-at` kills (the last one), or "" for none."""
        return rollout_name(self.rollouts - 1) if self.kill_at else ""

    def to_env(self) -> dict[str, str]:
        return {**os.environ, CONFIG_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> DemoConfig:
        try:
            return cls(**json.loads(os.environ[CONFIG_ENV]))
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"worker started without a valid {CONFIG_ENV}: {exc}") from exc
