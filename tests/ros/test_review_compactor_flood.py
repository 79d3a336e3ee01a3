"""The compactor under a flood of leases (issue 25, "also untested"): thousands of sessions
opened through a real hub process and left to expire, while live clients hold a version.

Every flood session is a lease, a session mark written under it, and a delete when it
expires: about three revisions each, all landing within a few seconds. The hub replica runs
its compactor every second (`--compact-interval 1`). What must hold:

- the compactor keeps its schedule: etcd's own answer (a read at an old revision refused as
  compacted) shows every revision noted during the flood compacted within a bounded lag, and
  the replica counts about one compaction per interval;
- the live clients' sessions survive on the same leases, never declared lost, and their
  holder records are all still there;
- the hub stays responsive: every `Latest` a client sends during the flood is answered
  within its deadline (a deadline, not a timing ratio: the machine is shared and noisy),
  and a reader watching a model that a trainer publishes during the flood sees every new
  version once, in order (or a resync, never a version twice or going back);
- afterwards no flood session is left: the marks went with their leases.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ros
from consistency import Etcd, EtcdCluster, EventKind, Keys
from ros.hub.tenants import Quotas, TenantStore
from tensorhub.errors import RevisionCompacted
from tests.ros.helpers import digest, make_model
from tests.ros.review_hubs import Replica, start_replicas, stop_all
from tests.waiting import wait_until

INTERVAL = 1.0  # --compact-interval of the replica
FLOOD = 2000  # sessions, in 4 waves half a second apart, each expiring 2 s after it opened
# Every Latest during the flood is answered within the SDK's default deadline. Measured on
# two cores: p99 0.13-0.22 s quiet (idle 3 ms); 1.5-2.8 s with the machine at load 600
# (idle 60-200 ms); a hub stalled by the flood (the 25 s of issue 25 item 2) fails it.
LATEST_DEADLINE = 10.0
# A noted revision is compacted at most this long after: 1.6 s quiet, 3.8-5.3 s at load 600;
# a compactor that stopped during the flood would lag by the flood's whole length.
LAG_BOUND = INTERVAL + 9.0
STEPS = 4  # versions of another model published during the flood, watched by a reader


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Etcd, Replica, Keys]]:
    """A fresh etcd of its own (compacting it touches no other test) and one hub process
    on it compacting every second."""
    keys = Keys("/flood")
    with EtcdCluster(size=1) as etcd_cluster, Etcd(etcd_cluster.endpoints) as etcd:
        replicas = start_replicas(
            [etcd_cluster.endpoints], keys.prefix, tmp_path, ["--compact-interval", str(INTERVAL)]
        )
        try:
            yield etcd, replicas[0], keys
        finally:
            stop_all(replicas)


class CompactionMarks:
    """Every 0.2 s, notes etcd's current revision, and when each noted revision was found
    compacted: a read at it refused with `RevisionCompacted` (etcd's word, not the hub's)."""

    def __init__(self, etcd: Etcd, key: str) -> None:
        self._etcd = etcd
        self._key = key
        self.marks: list[tuple[float, int]] = []
        self.compacted_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CompactionMarks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            self.marks.append((now, self._etcd.get(self._key)[1]))
            for _, revision in self.marks:
                if revision in self.compacted_at:
                    continue
                try:
                    self._etcd.range(self._key, revision=revision)
                except RevisionCompacted:
                    self.compacted_at[revision] = now
                    continue
                break  # later marks are newer: not compacted either

    def lags(self, since: float, until: float) -> list[float]:
        """Seconds from noting to finding compacted, for the marks noted in [since, until]
        (a mark not yet compacted counts as infinitely late)."""
        return [
            self.compacted_at.get(revision, float("inf")) - when
            for when, revision in self.marks
            if since <= when <= until
        ]


@pytest.mark.timeout(120)
def test_the_compactor_keeps_its_schedule_and_live_sessions_under_a_lease_flood(
    cluster: tuple[Etcd, Replica, Keys], tmp_path: Path
) -> None:
    """2,000 sessions of a flooding tenant open in four waves and expire, 2 s each, while a
    publisher and two readers of another tenant hold policy@1 with 3 s sessions. Proves
    every point of the module docstring: compaction on schedule (bounded lag of etcd's own
    compacted revision, compactions counted per interval), the live sessions' leases and
    holder records intact, every Latest answered within its deadline, the steps published
    meanwhile each watched once and in order, no flood mark left."""
    etcd, replica, keys = cluster
    store = TenantStore(etcd, keys)
    live_token = store.create("live")
    flood_token = store.create("flood", Quotas(max_sessions=FLOOD + 100))
    clients = [
        ros.connect(replica.address, tenant="live", token=live_token, session_ttl=3)
        for _ in range(3)
    ]
    try:
        publisher, *readers = clients
        model = make_model(1)
        publisher.publish("policy", 1, model)
        for reader in readers:
            assert digest(reader.fetch("policy", 1, timeout=30).tensors) == digest(model)
        sessions = [c.session.id for c in clients]
        holders = {c.holder_name for c in clients}
        assert {h.holder for h in publisher.holders("policy", 1) if h.complete} == holders

        idle = [_timed_latest(publisher) for _ in range(30)]
        compactions_before = replica.metric("tensorhub_etcd_compactions_total")
        latencies: list[float] = []
        failures: list[str] = []
        stop = threading.Event()

        watch = readers[0].watch("steps", versions_only=True)  # a rollout waiting for steps
        stepped: list[int] = []

        def stepper() -> None:  # a trainer publishing steps while the flood runs
            previous = None
            for version in range(1, STEPS + 1):
                if stop.wait(0.6):
                    return
                publication = publisher.publish("steps", version, make_model(version))
                if previous is not None:
                    previous.release(force=True)
                previous = publication
                stepped.append(version)

        def probe() -> None:
            while not stop.is_set():
                try:
                    latencies.append(_timed_latest(publisher))
                except Exception as exc:  # a failure is the finding: named, listed
                    failures.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.02)

        with CompactionMarks(etcd, keys.hub_compactor()) as marks:
            thread = threading.Thread(target=probe, daemon=True)
            thread.start()
            trainer = threading.Thread(target=stepper, daemon=True)
            trainer.start()
            started = time.monotonic()
            flood = subprocess.run(
                [sys.executable, "-m", "tests.ros.lease_flood", replica.address, "flood",
                 flood_token, "--count", str(FLOOD), "--waves", "4", "--gap", "0.5",
                 "--ttl", "2"],
                check=False, capture_output=True, text=True, timeout=90,
                cwd=Path(__file__).parents[2],
            )  # fmt: skip
            assert flood.returncode == 0, flood.stderr[-3000:]
            flooded = time.monotonic()
            wait_until(
                "every flood session expired",
                lambda: etcd.count(keys.sessions("flood")) == 0,
                timeout=20,
            )
            ended = time.monotonic()
            # etcd refuses reads only *below* the compacted revision: with no write after the
            # flood, the last marks equal the current revision and could never be found
            # compacted. One write moves the store past them.
            etcd.put(f"{keys.prefix}/test/tick", b"after the flood")
            wait_until(  # the marks noted up to the end get their chance
                "every revision noted during the flood compacted",
                lambda: all(lag < float("inf") for lag in marks.lags(started, ended)),
                timeout=LAG_BOUND + 1,
            )
            trainer.join(timeout=60)
            stop.set()
            thread.join(timeout=LATEST_DEADLINE + 5)
            assert not thread.is_alive(), "a Latest outlived its deadline"
        assert stepped == list(range(1, STEPS + 1))
        seen: list[tuple[str, int]] = []
        deadline = time.monotonic() + 15
        while not seen or seen[-1][1] < STEPS:
            assert time.monotonic() < deadline, f"the watch stopped at {seen}"
            event = watch.get(timeout=1)
            if event is not None and event.kind in (EventKind.VERSION_PUBLISHED, EventKind.RESYNC):
                seen.append((event.kind.value, event.version))
        watch.close()
        versions = [v for _, v in seen]
        assert versions == sorted(set(versions)), seen  # never back, never twice
        if all(kind == EventKind.VERSION_PUBLISHED.value for kind, _ in seen):
            assert versions == list(range(1, STEPS + 1)), seen  # none missed
        report = json.loads(flood.stdout)
        compactions = replica.metric("tensorhub_etcd_compactions_total") - compactions_before
        elapsed = time.monotonic() - started
        lags = marks.lags(started, ended)
        p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))] if latencies else 0.0
        print(
            f"flood {report}; {len(latencies)} Latest, p99 {p99 * 1000:.0f} ms "
            f"(idle p99 {sorted(idle)[-1] * 1000:.0f} ms); {compactions:.0f} compactions in "
            f"{elapsed:.1f} s; compaction lag max {max(lags):.2f} s over {len(lags)} marks"
        )

        assert report["opened"] >= FLOOD * 0.9, report  # thousands really were opened
        assert not failures, failures[:5]
        assert latencies
        assert max(latencies) <= LATEST_DEADLINE
        assert lags
        assert max(lags) <= LAG_BOUND, lags
        assert compactions >= (elapsed / INTERVAL) / 2, (compactions, elapsed)
        assert flooded > started
        # the live clients: same leases, never lost, every holder record still there
        assert [c.session.id for c in clients] == sessions
        assert not any(c.session.lost.is_set() for c in clients)
        assert etcd.count(keys.sessions("live")) == len(clients)
        assert {h.holder for h in publisher.holders("policy", 1) if h.complete} == holders
        late = ros.connect(replica.address, tenant="live", token=live_token, session_ttl=3)
        clients.append(late)  # and the hub still serves a new client's fetch
        assert digest(late.fetch("policy", 1, timeout=30).tensors) == digest(model)
    finally:
        for client in clients:
            client.close()


def _timed_latest(client: ros.Hub) -> float:
    """Seconds one `Latest` took (it raises past its deadline)."""
    start = time.monotonic()
    assert client.latest("policy", timeout=LATEST_DEADLINE) == 1
    return time.monotonic() - start
