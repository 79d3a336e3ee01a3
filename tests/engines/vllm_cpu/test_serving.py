"""A vLLM rollout serves what it fetched (`serve`), a rollout reads from it, and a version
published by TP-2 trainer ranks is loaded whole (`fetch_slices`) into a TP-1 vLLM."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ros
from ros.hub.server import HubServer
from ros.integrations.vllm import update_vllm
from tests.engines.vllm_cpu import tiny
from tests.ros.helpers import digest

TENANT = "team-a"
MODEL = "policy"


def model_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.timeout(300)
def test_a_rollout_reads_from_a_vllm_rollout_and_tp2_shards_load_whole(
    hub_server: HubServer, make_tenant: Callable[[str], str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's worker in its own process
    token = make_tenant(TENANT)
    trainer = ros.connect(hub_server.address, tenant=TENANT, token=token, name="trainer")
    reader = ros.connect(hub_server.address, tenant=TENANT, token=token, name="reader")
    try:
        llm = tiny.start_llm(tiny.save(0, tmp_path / "v0"))
        llm.init_weight_transfer_engine(
            {"init_info": {"hub": hub_server.address, "tenant": TENANT, "token": token,
                           "model": MODEL, "serve": True}}
        )  # fmt: skip
        v1 = tiny.weights(1)
        published = trainer.publish(MODEL, 1, v1, chunk_size=64 * 1024)
        update_vllm(llm, 1)
        assert tiny.vllm_greedy(llm) == tiny.hf_greedy(1)
        worker = tiny.status(llm)  # asked by method name: nothing is pickled
        assert worker["pid"] != os.getpid(), "vLLM's worker ran in the test's process"
        cost = worker["held_bytes"]
        print(f"serve=True keeps {cost} bytes (the checkpoint: {model_bytes(v1)} bytes)")
        assert cost == model_bytes(v1)
        published.release()  # the trainer lets go: the vLLM rollout is v1's only holder
        got = reader.fetch(MODEL, 1, timeout=30)
        assert digest(got.tensors) == digest(v1)
        assert "trainer" not in got.stats.bytes_per_source
        assert sum(got.stats.bytes_per_source.values()) == model_bytes(v1)
        got.release()

        # v2 from two trainer ranks (TP 2), read whole into the TP-1 engine
        v2 = tiny.weights(2)
        ranks = [ros.connect(hub_server.address, tenant=TENANT, token=token) for _ in range(2)]
        try:
            for rank, client in enumerate(ranks):
                own, placements = tiny.tp2_halves(v2, rank)
                client.publish(MODEL, 2, own, shard=(rank, 2), placements=placements)
            update_vllm(llm, 2)
            assert tiny.vllm_greedy(llm) == tiny.hf_greedy(2) != tiny.hf_greedy(1)
        finally:
            for client in ranks:
                client.close()
        llm.shutdown_weight_transfer_engine()  # the engine's hub session ends with the test
    finally:
        reader.close()
        trainer.close()
