"""What a run is configured with, and what its actors and its driver report (the --json
summary is `Summary` as a dict)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Config:
    hub: tuple[str, ...]  # the hub's replicas, HOST:PORT each
    tenant: str
    token: str
    model: str = "policy"
    model_mb: float = 8.0
    session_ttl: int = 10
    delta: bool = True  # publish delta versions and apply them (False: every fetch whole)


@dataclass(frozen=True)
class TrainerReport:
    version: int
    digest: str
    seconds: float  # publish until released: the trainer's stall
    node: str


@dataclass(frozen=True)
class RolloutReport:
    name: str
    node: str
    version: int
    digest: str
    seconds: float  # waiting for the version, then fetching it
    fetch_s: float
    from_trainer: int  # bytes of chunks read whole from the trainer
    from_peers: int  # bytes of chunks read whole from other rollouts
    failed_sources: dict[str, str] = field(default_factory=dict)
    delta_bytes: int = 0  # bytes of encoded changes read (Held.delta.encoded_bytes)
    delta_chunks: int = 0  # chunks made from them (0: the version was read whole)

    @property
    def moved(self) -> int:
        """Bytes that crossed the network for this fetch: whole chunks plus the delta."""
        return self.from_trainer + self.from_peers + self.delta_bytes


@dataclass
class Step:
    step: int
    version: int
    trainer: TrainerReport
    rollouts: list[RolloutReport]
    killed: str | None = None  # the rollout killed after this step
    replacement: RolloutReport | None = None  # the one started instead: its catch-up
    replace_s: float = 0.0  # from the kill until the newcomer held the latest version

    @property
    def reports(self) -> list[RolloutReport]:
        """Every rollout's report of this step, the replacement's included."""
        return [*self.rollouts, *([self.replacement] if self.replacement else [])]

    @property
    def bytes_ok(self) -> bool:
        return all(r.digest == self.trainer.digest for r in self.reports)


@dataclass
class Summary:
    model: str
    first_version: int
    last_version: int
    nodes: list[str]
    trainer_node: str
    steps: list[Step] = field(default_factory=list)
    final: dict[str, RolloutReport] = field(default_factory=dict)  # live rollout -> its state
    wall_s: float = 0.0
    ok: bool = False
