"""TensorHub's `tensorhub` weight-transfer engine in a real vLLM (CPU build): in one
process, and with vLLM's engine core and worker in processes of their own.

A trainer publishes three versions of a tiny Llama; after each update vLLM's greedy tokens
equal Hugging Face's `generate` with the same weights. The holder serving an update is
SIGKILLed mid-update: with another holder left, the update fails over and ends on the new
version; with none, it raises a named error and the model keeps the previous version.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ros
from ros.hub.server import HubServer
from ros.integrations.vllm import update_vllm
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import VersionUnavailable
from tests.engines.vllm_cpu import tiny

TENANT = "team-a"
MODEL = "policy"
CHUNK = 64 * 1024  # the tiny model is ~1.6 MB: 25 chunks, so a kill lands mid-fetch
DELAY = 0.25  # seconds before each chunk the slow holder sends


@pytest.fixture
def token(make_tenant: Callable[[str], str]) -> str:
    """The tenant's token: the trainer, the engine and the holder processes all use it."""
    return make_tenant(TENANT)


@pytest.fixture
def trainer(hub_server: HubServer, token: str) -> Iterator[ros.Hub]:
    hub = ros.connect(hub_server.address, tenant=TENANT, token=token, name="trainer")
    yield hub
    hub.close()


def slow_holder(token: str, address: str, version: int) -> tuple[subprocess.Popen[str], str]:
    """A process that fetched `version` and now serves it slowly; (process, holder name)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engines.vllm_cpu.slow_holder", address, TENANT,
         token, MODEL, str(version), str(DELAY)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], f"slow holder did not start: {line}"
    return proc, line[1]


def kill_when_read(
    hub: ros.Hub, version: int, victim: subprocess.Popen[str], known: set[str]
) -> threading.Thread:
    """SIGKILL `victim` once a new reader's PARTIAL record of `version` shows (it is mid-fetch)."""

    def watch() -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            holders = hub.inspect(MODEL, version).holders
            if any(h.state == pb.PARTIAL and h.name not in known for h in holders):
                time.sleep(3 * DELAY)  # a few chunks in
                victim.send_signal(signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(params=["one-process", "worker-processes"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How vLLM runs: everything in this process, or its engine core and worker apart
    (then the engine is loaded in the worker by the `vllm.general_plugins` entry point)."""
    one = request.param == "one-process"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if one else "1")
    return str(request.param)


@pytest.mark.timeout(300)
def test_updates_match_hf_and_a_holder_killed_mid_update_never_mixes_weights(
    trainer: ros.Hub, token: str, hub_server: HubServer, tmp_path: Path, mode: str
) -> None:
    llm = tiny.start_llm(tiny.save(0, tmp_path / "v0"))
    llm.init_weight_transfer_engine(
        {"init_info": {"hub": hub_server.address, "tenant": TENANT,
                       "token": token, "model": MODEL}}
    )  # fmt: skip
    assert tiny.vllm_greedy(llm) == tiny.hf_greedy(0)
    in_this_process = tiny.status(llm)["pid"] == os.getpid()
    assert in_this_process == (mode == "one-process"), f"{mode}: vLLM's worker ran elsewhere"
    published = {}
    # v1: an ordinary update from the trainer
    published[1] = trainer.publish(MODEL, 1, tiny.weights(1), chunk_size=CHUNK)
    update_vllm(llm, 1)
    assert tiny.vllm_greedy(llm) == tiny.hf_greedy(1) != tiny.hf_greedy(0)

    # v2: served by a slow holder that is killed mid-update; a second holder is left
    published[2] = trainer.publish(MODEL, 2, tiny.weights(2), chunk_size=CHUNK)
    spare = ros.connect(hub_server.address, tenant=TENANT, token=token, name="spare")
    try:
        spare.fetch(MODEL, 2, timeout=30)
        slow, slow_name = slow_holder(token, hub_server.address, 2)  # newest: read first
        published[2].release()
        killer = kill_when_read(trainer, 2, slow, {"trainer", "spare", slow_name})
        update_vllm(llm, 2)
        killer.join(5)
        assert slow.wait(5) == -signal.SIGKILL  # it died while serving the update
        stats = tiny.status(llm)["last_fetch"]  # the worker's FetchStats, as a dict
        assert slow_name in stats["failed_sources"]  # read from it first, then failed over
        assert stats["bytes_per_source"].get("spare", 0) > 0
        assert tiny.vllm_greedy(llm) == tiny.hf_greedy(2) != tiny.hf_greedy(1)

        # v3: only the slow holder has it, and it is killed mid-update: a named error
        published[3] = trainer.publish(MODEL, 3, tiny.weights(3), chunk_size=CHUNK)
        slow, slow_name = slow_holder(token, hub_server.address, 3)
        published[3].release()
        killer = kill_when_read(trainer, 3, slow, {"trainer", "spare", slow_name})
        with pytest.raises(Exception, match="VersionUnavailable: fetch policy@3") as failed:
            update_vllm(llm, 3)
        if mode == "one-process":
            assert isinstance(failed.value, VersionUnavailable)
        killer.join(5)
        assert slow.wait(5) == -signal.SIGKILL
        print(f"{mode}: the update of v3 failed with:", repr(failed.value)[:300])
        assert tiny.vllm_greedy(llm) == tiny.hf_greedy(2)  # still v2, untouched
        # the trainer publishes v4; the engine moves on from v2 to it
        trainer.publish(MODEL, 4, tiny.weights(4), chunk_size=CHUNK)
        update_vllm(llm, 4)
        assert tiny.vllm_greedy(llm) == tiny.hf_greedy(4)
    finally:
        spare.close()
        llm.shutdown_weight_transfer_engine()  # the engine's hub sessions end with the test
