"""vLLM at tensor-parallel size 2 (CPU build, each worker a process pinned to one core):
each worker reads only the blocks its loaders consume, learned from vLLM's own
`load_weights` (`ros.integrations.vllm_blocks`), and serves them; a second TP-2 instance's
workers read every byte of theirs from the first's, and generate what Hugging Face (and a
TP-1 vLLM) generates from the same version. A version published as TP-2 shards is read the
same way, from the trainer's shards, and a TP-1 instance beside them reads all of it from
the TP-2 workers' blocks (`"cover": ["vllm-tp2"]`). An update in which one worker's fetch
fails raises a named error and leaves every worker's model on the previous version; one in
which a worker is killed ends the instance (vLLM's EngineDeadError) with no rank on the new
version, and the other instance keeps generating its own. Once the instance declares its
layout (`declare_layout`), a version published after it reaches its workers from peers with
every chunk checked against the trainer's checksums."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ros
from ros.hub.server import HubServer
from ros.integrations.vllm import declare_layout, update_vllm
from tensorhub.errors import EngineNotReady
from tests.engines.vllm_cpu import tiny
from tests.engines.vllm_cpu.test_delta import hf_greedy as hf_greedy_of
from tests.engines.vllm_cpu.test_delta import nudged

TENANT = "team-a"
MODEL = "policy"
CHUNK = 64 * 1024


def start(checkpoint: str, address: str, token: str) -> Any:
    """A TP-2 vLLM whose workers read their blocks from the hub at `address`."""
    llm = tiny.start_llm(checkpoint, tp=2)
    llm.init_weight_transfer_engine(
        {"init_info": {"hub": address, "tenant": TENANT, "token": token, "model": MODEL}}
    )
    return llm


def checkpoint_bytes(version: int) -> int:
    return sum(t.numel() * t.element_size() for t in tiny.weights(version).values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_workers_read_their_blocks_and_a_second_instance_reads_them_from_the_first(
    hub_server: HubServer, make_tenant: Callable[[str], str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    token = make_tenant(TENANT)
    trainer = ros.connect(hub_server.address, tenant=TENANT, token=token, name="trainer")
    first = second = None
    try:
        checkpoint = tiny.save(0, tmp_path / "v0")
        first = start(checkpoint, hub_server.address, token)
        with pytest.raises(EngineNotReady, match="before the first update"):
            declare_layout(first, trainer)  # the workers learn their blocks at the first
        whole = checkpoint_bytes(1)
        published = trainer.publish(MODEL, 1, tiny.weights(1), chunk_size=CHUNK)
        update_vllm(first, 1)
        assert tiny.vllm_greedy(first) == tiny.hf_greedy(1) != tiny.hf_greedy(0)
        workers = tiny.statuses(first)
        assert [w["layout"] for w in workers] == ["vllm-tp2", "vllm-tp2"]
        for rank, w in enumerate(workers):
            print(f"first instance, rank {rank}: {w['block_bytes']} of {whole} checkpoint "
                  f"bytes, read {w['last_fetch']['bytes_per_source']}, rss {w['rss']}, "
                  f"rss_peak {w['rss_peak']}")  # fmt: skip
            assert w["version"] == 1
            assert w["served"]
            assert w["held_bytes"] == w["block_bytes"]
            assert w["block_bytes"] < whole  # only its blocks
            q = w["boxes"]["model.layers.0.self_attn.q_proj.weight"]
            assert q == [[rank * 64, 0], [64, 128]]  # its heads' rows of the merged qkv
            down = w["boxes"]["model.layers.0.mlp.down_proj.weight"]
            assert down == [[0, rank * 128], [128, 128]]  # its columns of a row-parallel one
            assert w["boxes"]["model.norm.weight"] == [[0], [128]]  # replicated: whole
            assert sum(w["last_fetch"]["bytes_per_source"].values()) >= w["block_bytes"]
        published.release()  # the trainer lets go of v1: the first instance's workers serve it

        second = start(checkpoint, hub_server.address, token)
        update_vllm(second, 1)
        assert tiny.vllm_greedy(second) == tiny.hf_greedy(1)
        seconds = tiny.statuses(second)
        for rank, (mine, theirs) in enumerate(zip(seconds, workers, strict=True)):
            read = mine["last_fetch"]["bytes_per_source"]
            print(f"second instance, rank {rank}: read {read}, rss {mine['rss']}")
            assert mine["from_trainer"] == []
            assert "trainer" not in read
            assert sum(read.values()) == mine["block_bytes"] == theirs["block_bytes"]
            assert mine["publisher_checked"] == 0  # no layout declared: the record's sums
            assert mine["boxes"] == theirs["boxes"]

        # v2 from two trainer ranks (TP 2): each worker reads its blocks from their shards
        v2 = tiny.weights(2)
        ranks = [ros.connect(hub_server.address, tenant=TENANT, token=token) for _ in range(2)]
        try:
            for rank, client in enumerate(ranks):
                own, placements = tiny.tp2_halves(v2, rank)
                client.publish(MODEL, 2, own, shard=(rank, 2), placements=placements,
                               chunk_size=CHUNK)  # fmt: skip
            update_vllm(first, 2)
            assert tiny.vllm_greedy(first) == tiny.hf_greedy(2) != tiny.hf_greedy(1)
            served = tiny.statuses(first)
            for w in served:
                assert w["version"] == 2
                assert w["served"]
                assert sum(w["last_fetch"]["bytes_per_source"].values()) >= w["block_bytes"]

            # a TP-1 instance beside them, covered by the TP-2 workers' blocks
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            single = tiny.start_llm(checkpoint)
            single.init_weight_transfer_engine(
                {"init_info": {"hub": hub_server.address, "tenant": TENANT, "token": token,
                               "model": MODEL, "slices": True, "cover": ["vllm-tp2"]}}
            )  # fmt: skip
            try:
                update_vllm(single, 2)
                assert tiny.vllm_greedy(single) == tiny.vllm_greedy(first)
                [alone] = tiny.statuses(single)
                read = alone["last_fetch"]["bytes_per_source"]
                print(f"TP-1 instance: read {read} (the TP-2 workers: "
                      f"{[w['pid'] for w in served]})")  # fmt: skip
                assert alone["layout"] == "vllm-tp1"
                assert alone["block_bytes"] == whole
                assert alone["from_trainer"] == []
                workers = {f"vm-{w['pid']}-" for w in served}  # their holder names' prefix
                assert {source[: source.rindex("-") + 1] for source in read} == workers
                # every byte, each replicated norm once from each TP-2 rank's block set
                norms = sum(4 * 128 for name in alone["boxes"] if "norm" in name)
                assert sum(read.values()) == whole + norms
            finally:
                single.shutdown_weight_transfer_engine()

            # a worker whose fetch fails mid-update: v3's only holder left is a reader of
            # rank 1's blocks, so the second instance's rank 0 finds no byte of its own
            v3 = tiny.weights(3)
            for rank, client in enumerate(ranks):
                own, placements = tiny.tp2_halves(v3, rank)
                client.publish(MODEL, 3, own, shard=(rank, 2), placements=placements,
                               chunk_size=CHUNK)  # fmt: skip
            boxes = tiny.statuses(second)[1]["boxes"]
            holder = ros.connect(hub_server.address, tenant=TENANT, token=token, name="rank-1")
            try:
                held = {n: torch.empty(shape) for n, (_, shape) in boxes.items()}
                slices = {n: ros.Slice(held[n], boxes[n][0], tuple(v3[n].shape)) for n in boxes}
                holder.fetch_slices(MODEL, 3, slices=slices, layout="vllm-tp2", timeout=30)
                for client in ranks:
                    client.close()
                ranks.clear()
                with pytest.raises(Exception, match=r"Version(Unavailable|NotFound)") as failed:
                    update_vllm(second, 3)
                print("the update of v3 failed with:", repr(failed.value)[:300])
                # no rank loaded v3 (vLLM answers no status until an update finishes)
                assert tiny.vllm_greedy(second) == tiny.hf_greedy(1) != tiny.hf_greedy(3)
            finally:
                holder.close()
        finally:
            for client in ranks:
                client.close()

        # an update after a delta version: v4 and v5 published with delta=True, v5 as 1 % of
        # v4's elements changed (so with its delta); the first instance's workers read their
        # blocks of v4 whole (its delta, if any, is against no version they hold), then only
        # v5's changes inside their blocks, applied to them in place, and generate its tokens
        v4 = tiny.weights(4)
        v5 = nudged(v4, 5)
        trainer.publish(MODEL, 4, v4, chunk_size=CHUNK, delta=True)
        assert trainer.publish(MODEL, 5, v5, chunk_size=CHUNK, delta=True).companion
        update_vllm(first, 4)
        for w in tiny.statuses(first):
            assert w["version"] == 4
            assert sum(w["last_fetch"]["bytes_per_source"].values()) >= w["block_bytes"]
        update_vllm(first, 5)
        assert tiny.vllm_greedy(first) == hf_greedy_of(v5) != tiny.hf_greedy(2)
        for rank, w in enumerate(tiny.statuses(first)):
            moved = sum(w["last_fetch"]["bytes_per_source"].values())
            print(f"first instance, rank {rank}: v5 from v4's blocks moved {moved} B of its "
                  f"{w['block_bytes']} B of blocks, delta {w['last_delta']}")  # fmt: skip
            assert w["version"] == 5
            assert w["last_delta"] is not None
            assert w["last_delta"]["chunks"] > 0
            assert w["last_delta"]["base_mismatch"] == 0
            assert moved < w["block_bytes"] / 2
            assert w["served"]

        # a worker killed mid-update: v6 is served by a slow holder alone, and the second
        # instance's rank 1 is SIGKILLed once a few of its chunks went out. vLLM stops the
        # whole instance when one of its workers dies (its executor's monitor): the update
        # fails ("Executor failed."), every later call with EngineDeadError, and no rank
        # loads v6 (blocks are loaded at finish_weight_update, never called after a failed
        # update_weights)
        from vllm.v1.engine.exceptions import EngineDeadError

        published = trainer.publish(MODEL, 6, tiny.weights(6), chunk_size=CHUNK)
        slow = slow_holder(hub_server.address, token, 6)
        try:
            published.release()  # the slow holder is the only one left
            victim = seconds[1]["pid"]  # (no status answers after the failed update)
            killed: list[int] = []
            killer = threading.Thread(target=kill_after, args=(slow, victim, killed))
            killer.start()
            with pytest.raises(Exception, match=r"Executor failed|EngineDead") as dead:
                update_vllm(second, 6)
            print("the update of v6 with rank 1 killed failed with:", repr(dead.value)[:300])
            killer.join(5)
            assert killed == [victim]  # rank 1, killed while chunks were going out
            with pytest.raises(EngineDeadError):
                tiny.vllm_greedy(second)  # no rank of it generates anything, v6 least of all
            second = None
            assert tiny.vllm_greedy(first) == hf_greedy_of(v5)  # the other instance: as it was
        finally:
            slow.kill()
            slow.wait(10)

        # the first instance declares its layout: v7, published after it, carries the
        # trainer's checksums of each rank's blocks. Two plain readers of those blocks read
        # them from the trainer, which then lets go, so the workers read every chunk from
        # them, each checked against the trainer's checksums
        assert declare_layout(first, trainer) == "vllm-tp2"
        assert trainer.declared_layouts(MODEL) == {"vllm-tp2": 2}
        v7 = tiny.weights(7)
        published = trainer.publish(MODEL, 7, v7, chunk_size=CHUNK)
        peers = [
            ros.connect(hub_server.address, tenant=TENANT, token=token, name=f"peer-{rank}")
            for rank in range(2)
        ]
        try:
            for peer, w in zip(peers, tiny.statuses(first), strict=True):
                slices = {
                    n: ros.Slice(torch.empty(shape), offsets, tuple(v7[n].shape))
                    for n, (offsets, shape) in w["boxes"].items()
                }
                assert peer.fetch_slices(
                    MODEL, 7, slices=slices, layout="vllm-tp2", timeout=30
                ).served
            published.release()  # the peers are the only holders left
            update_vllm(first, 7)
            assert tiny.vllm_greedy(first) == tiny.hf_greedy(7) != hf_greedy_of(v5)
            for rank, w in enumerate(tiny.statuses(first)):
                read = w["last_fetch"]["bytes_per_source"]
                checked = w["publisher_checked"]
                print(f"first instance, rank {rank}: v7 read {read}, {checked} chunks "
                      "checked against the trainer's sums")  # fmt: skip
                assert w["version"] == 7
                assert w["from_trainer"] == []
                assert set(read) == {peers[rank].holder_name}
                assert w["publisher_checked"] == w["last_fetch"]["chunks"] > 0
        finally:
            for peer in peers:
                peer.close()
    finally:
        for llm in (first, second):
            if llm is not None:
                llm.shutdown_weight_transfer_engine()
        trainer.close()


def slow_holder(address: str, token: str, version: int) -> subprocess.Popen[str]:
    """A process holding `version` that serves it slowly and says `sent` per chunk."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engines.vllm_cpu.slow_holder", address, TENANT, token,
         MODEL, str(version), "0.2", "tell"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready"), "the slow holder did not start"
    return proc


def kill_after(slow: subprocess.Popen[str], pid: int, killed: list[int], chunks: int = 3) -> None:
    """SIGKILL `pid` once `slow` has sent `chunks` chunks (its readers are mid-fetch), and
    add it to `killed`."""
    assert slow.stdout is not None
    for _ in range(chunks):
        if slow.stdout.readline() != "sent\n":
            return  # the holder ended: no kill (`killed` stays empty)
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)
