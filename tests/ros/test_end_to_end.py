"""Trainer → 3 readers through the SDK, readers in their own processes, bytes identical."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import ros
from ros.hub.server import HubServer
from tests.ros.helpers import digest, make_model

WORKER = Path(__file__).with_name("sdk_worker.py")


@pytest.mark.timeout(120)
def test_trainer_to_three_reader_processes(
    hub_server: HubServer, connect: Callable[..., ros.Hub], make_tenant: Callable[[str], str]
) -> None:
    token = make_tenant("rl")
    trainer = ros.connect(
        hub_server.address, tenant="rl", token=token, topology={"host": "trainer"}
    )
    try:
        weights = make_model(7, big=1 << 20)  # 4 MiB: several chunks
        pub = trainer.publish("policy", 1, weights, chunk_size=1 << 20)
        command = [sys.executable, str(WORKER), hub_server.address, "rl", token, "policy"]
        readers = [
            subprocess.Popen(
                [*command, "latest", "--hold", "3", "--host", f"rollout-{i}"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        assert pub.wait_replicated(1, timeout=60) >= 1
        reports = []
        for proc in readers:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, "a reader produced no report"
            reports.append(json.loads(line))
        for proc in readers:
            assert proc.wait(timeout=60) == 0
        expected = digest(weights)
        for report in reports:
            assert report["version"] == 1
            assert report["digest"] == expected
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        for report in reports:  # each reader received the model exactly once, from any holders
            assert sum(report["bytes"].values()) == model_bytes
    finally:
        trainer.close()


def test_wait_replicated_times_out_without_readers(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect()
    pub = trainer.publish("policy", 1, make_model(1))
    with pytest.raises(ros.DeadlineExceeded, match="0 of 1"):
        pub.wait_replicated(1, timeout=0.5)


def test_wait_replicated_counts_only_complete_other_holders(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    pub = trainer.publish("policy", 1, make_model(1))
    held = reader.fetch("policy", 1)
    assert pub.wait_replicated(1, timeout=10) == 1
    assert digest(held.tensors) == digest(make_model(1))
