"""`tensorhub publish` and `tensorhub fetch` as a user runs them, against a real hub.

A tiny Llama built from a config (no download) and saved with sharding forced is published
by `tensorhub publish --until-replicated 1` in one process and fetched by `tensorhub fetch`
in another (and by `fetch --serve`, the holder that ends the publisher's wait); the fetched
directories load with `from_pretrained` and give the original's logits. Also: a
reader killed mid-fetch leaves nothing that looks complete, a wrong path or format fails
with a named error before anything reaches the hub, a model-parallel version (one rank
published by the CLI) is fetched whole, and the first Ctrl-C waits for readers in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ros
from chaos.holder_faults import Fault
from ros.cli import main
from ros.cli.outdir import partial_dirs
from ros.cli.serving import Interrupts, Readers, drain
from ros.client.hooks import ClientHooks
from ros.client.slice import Slice
from ros.hub.server import HubServer

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (it is in the dev extras)"
)

PROMPT = torch.tensor([[1, 5, 9, 2, 7, 3]])


def tensorhub(
    env: dict[str, str], *args: str, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ros.cli", *args],
        check=False, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
    )  # fmt: skip


def started(env: dict[str, str], *args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ros.cli", *args], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )  # fmt: skip


def wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"no {text!r} in:\n{log.read_text()}"
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture
def env(hub_server: HubServer, make_tenant: Callable[[str], str]) -> dict[str, str]:
    return {
        "TENSORHUB_HUB": hub_server.address,
        "TENSORHUB_TENANT": "team-a",
        "TENSORHUB_TOKEN": make_tenant("team-a"),
    }


@pytest.fixture
def cli_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """`env` in this process too, for the in-process runs of `ros.cli.main`."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tiny_llama(seed: int) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(PROMPT).logits
    return out


@pytest.mark.timeout(240)
def test_llama_published_and_fetched_loads_with_from_pretrained(
    env: dict[str, str], tmp_path: Path
) -> None:
    model = tiny_llama(7)
    saved = tmp_path / "llama"
    model.save_pretrained(saved, max_shard_size="20KB")  # sharding forced: 7 files + index
    (saved / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    big = os.urandom(120_000).hex()  # no compression gets this under 64 KiB: left behind
    (saved / "tokenizer.json").write_text(json.dumps({"blob": big}))
    assert len(list(saved.glob("model-*.safetensors"))) > 1
    # it serves until one reader holds the version (a plain fetch holds nothing: not counted)
    publisher = started(env, "publish", "llama@1", str(saved), "--until-replicated", "1",
                        log=tmp_path / "publish.log")  # fmt: skip
    try:
        wait_for(tmp_path / "publish.log", "llama@1: readers holding it:   0%", publisher)
        published = (tmp_path / "publish.log").read_text()
        assert "carried in the manifest: config.json, generation_config.json" in published
        assert "left behind: tokenizer.json" in published
        out = tmp_path / "fetched"
        fetched = tensorhub(env, "fetch", "llama@latest", "-o", str(out),
                            "--max-shard-size", "20KB", "--json")  # fmt: skip
        assert fetched.returncode == 0, fetched.stderr
        report = json.loads(fetched.stdout)
        assert "fetch llama@1" in fetched.stderr  # the progress, plain lines (no terminal)
        served = tmp_path / "served"
        serving = started(env, "fetch", "llama", "-o", str(served), "--serve",
                          log=tmp_path / "serve.log")  # fmt: skip
        wait_for(tmp_path / "serve.log", "serving llama@1 from its files", serving)
        assert publisher.wait(timeout=60) == 0  # the --serve reader holds it: done
    finally:
        stop(publisher)
    log = (tmp_path / "publish.log").read_text()
    assert "llama@1: readers holding it: 100%| 1/1" in log
    assert "llama@1: 1 reader(s) hold it whole" in log
    assert "released llama@1; 1 other holder(s) still serve it" in log
    # the fetched directory loads on its own and computes what the original computes
    for directory in (out, served):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        assert torch.equal(logits(loaded), logits(model))
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == sorted(
        p.name for p in saved.glob("model-*.safetensors")
    )
    record = json.loads((out / "tensorhub.json").read_text())
    assert record["version"] == 1
    assert record["published_revision"] > 0
    assert record["carried"] == ["config.json", "generation_config.json", "tokenizer_config.json"]
    assert set(record["left_behind"]) == {"tokenizer.json"}
    for name, entry in record["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == entry["sha256"], name
    memory = report["memory"]
    assert 0 < memory["over_baseline"] <= memory["bound"], memory
    # the publisher is gone: the --serve fetcher serves the version, from its files
    with ros.connect(env["TENSORHUB_HUB"], tenant="team-a", token=env["TENSORHUB_TOKEN"]) as hub:
        held = hub.fetch("llama", 1, timeout=30)
        assert torch.equal(held.tensors["lm_head.weight"], model.lm_head.weight)
        held.release(force=True)
    # an existing directory is not replaced without --force
    again = tensorhub(env, "fetch", "llama", "-o", str(out))
    assert again.returncode == 1
    assert "AlreadyExists" in again.stderr
    assert json.loads((out / "tensorhub.json").read_text()) == record
    assert stop(serving) == 0
    assert "released llama@1" in (tmp_path / "serve.log").read_text()


@pytest.mark.timeout(180)
def test_a_reader_killed_mid_fetch_leaves_nothing_that_looks_complete(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    slow = Fault(chunk_delay=0.15)  # 4 MiB chunks, read one at a time: about 2 s
    tensors = {f"layer.{i}": torch.randn(1024, 1024) for i in range(12)}  # 48 MiB
    with ros.connect(cli_env["TENSORHUB_HUB"], tenant="team-a", token=cli_env["TENSORHUB_TOKEN"],
                     hooks=ClientHooks(send=slow)) as trainer:  # fmt: skip
        trainer.publish("policy", 1, tensors)
        out = tmp_path / "policy-1"
        reader = started(cli_env, "fetch", "policy@1", "-o", str(out), "--max-shard-size", "16MB",
                         log=tmp_path / "fetch.log")  # fmt: skip
        deadline = time.monotonic() + 60
        # kill it once a first file is written (16 MiB batches: two more to go)
        while not any(p.glob("*.safetensors") for p in partial_dirs(out)):
            assert reader.poll() is None, (tmp_path / "fetch.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reader.kill()
        reader.wait(timeout=10)
        assert not out.exists()  # nothing at the target
        (left,) = partial_dirs(out)  # hidden, named partial, and without what marks a fetch
        assert left.name.startswith(".policy-1.tensorhub-partial-")
        assert not (left / "tensorhub.json").exists()
        assert not (left / "model.safetensors.index.json").exists()
        # the next fetch removes what the killed one left, and completes
        slow.chunk_delay = 0.0
        assert main(["fetch", "policy@1", "-o", str(out), "--max-shard-size", "16MB"]) == 0
        assert partial_dirs(out) == []
        files = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        for name, tensor in tensors.items():
            assert torch.equal(load_file(out / files[name])[name], tensor)
        # --force replaces a directory an earlier fetch wrote, with the newer version whole
        newer = {name: tensor + 1 for name, tensor in tensors.items()}
        trainer.publish("policy", 2, newer)
        assert main(["fetch", "policy@latest", "-o", str(out), "--force"]) == 0
    assert partial_dirs(out) == []
    assert json.loads((out / "tensorhub.json").read_text())["version"] == 2
    # one file now (48 MiB, under the default shard size): nothing of the earlier fetch is left
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    got = load_file(out / "model.safetensors")
    for name, tensor in newer.items():
        assert torch.equal(got[name], tensor)


@pytest.mark.timeout(120)
def test_a_fetch_larger_than_its_memory_bound_stays_within_it(
    env: dict[str, str], tmp_path: Path
) -> None:
    """128 MiB fetched in files of 16 MB: the bound (the largest file, three 4 MiB tensors,
    + 64 MiB = 76 MiB) is less than the model, so a fetch that held the model would break it."""
    tensors = {f"layer.{i}": torch.randn(1024, 1024) for i in range(32)}  # 32 x 4 MiB
    with ros.connect(env["TENSORHUB_HUB"], tenant="team-a", token=env["TENSORHUB_TOKEN"]) as hub:
        hub.publish("big", 1, tensors)
        out = tmp_path / "big"
        fetched = tensorhub(env, "fetch", "big@1", "-o", str(out), "--max-shard-size", "16MB",
                            "--json")  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    memory = json.loads(fetched.stdout)["memory"]
    assert memory["bound"] < 128 << 20
    assert memory["over_baseline"] <= memory["bound"], memory
    files = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert torch.equal(load_file(out / files["layer.31"])["layer.31"], tensors["layer.31"])


def test_wrong_path_or_format_fails_before_the_hub(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # port 1 of loopback: a command that tried the hub would fail otherwise (Unavailable)
    for name, value in {"TENSORHUB_HUB": "127.0.0.1:1", "TENSORHUB_TENANT": "team-a",
                        "TENSORHUB_TOKEN": "team-a.x"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    (tmp_path / "notes.safetensors").write_text("not weights")
    (tmp_path / "empty").mkdir()
    torch.save({"step": 1, "model": {"w": torch.ones(2)}}, tmp_path / "trainer.pt")
    save_file({"w": torch.ones(2, 2)}, tmp_path / "w.safetensors")
    (tmp_path / "p.json").write_text('{"v": {"global_shape": [4, 2], "offsets": [0, 0]}}')
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep me")
    (tmp_path / "a-file").write_text("x")
    cases = {
        ("publish", "m@1", str(tmp_path / "missing")): "no such file or directory",
        ("publish", "m@1", str(tmp_path / "notes.safetensors")): "neither a safetensors file",
        ("publish", "m@1", str(tmp_path / "empty")): "not a save_pretrained directory",
        ("publish", "m@1", str(tmp_path / "trainer.pt")): "not a tensor",
        ("publish", "m@latest", str(tmp_path / "w.safetensors")): "MODEL@V with V a positive",
        ("publish", "m@1", str(tmp_path / "w.safetensors"), "--shard", "2/2"): "RANK/RANKS",
        ("publish", "m@1", str(tmp_path / "w.safetensors"), "--shard", "0/2",
         "--placements", str(tmp_path / "p.json")): "'v' is not a tensor of",
        ("fetch", "m@1", "-o", str(tmp_path / "taken")): "AlreadyExists",
        ("fetch", "m@1", "-o", str(tmp_path / "taken"), "--force"): "not written by tensorhub",
        ("fetch", "m@1", "-o", str(tmp_path / "a-file" / "out")): "cannot write the output",
        ("fetch", "m@1", "-o", str(tmp_path / "o"), "--max-shard-size", "big"): "max-shard-size",
    }  # fmt: skip
    for args, message in cases.items():
        capsys.readouterr()
        started_at = time.monotonic()
        assert main(list(args)) == 1, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
        assert "InvalidArgument" in err or "AlreadyExists" in err, err
        assert time.monotonic() - started_at < 5  # no connection attempt, no timeout
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".*tensorhub-partial*"))


@pytest.mark.timeout(180)
def test_a_model_parallel_version_is_fetched_whole(cli_env: dict[str, str], tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    full = {"w": torch.randn(8, 6, generator=g), "norm": torch.randn(6, generator=g)}
    rank1 = tmp_path / "rank1.safetensors"
    save_file({"w": full["w"][4:].contiguous(), "norm": full["norm"]}, rank1)
    (tmp_path / "p.json").write_text('{"w": {"global_shape": [8, 6], "offsets": [4, 0]}}')
    env = cli_env
    # the CLI's rank publishes first: its shard is not visible until rank 0's arrives
    publisher = started(env, "publish", "mp@1", str(rank1), "--shard", "1/2",
                        "--placements", str(tmp_path / "p.json"),
                        log=tmp_path / "rank1.log")  # fmt: skip
    try:
        wait_for(tmp_path / "rank1.log", "serving mp@1 shard 1/2", publisher)
        assert "(visible once every shard is published)" in (tmp_path / "rank1.log").read_text()
        with ros.connect(env["TENSORHUB_HUB"], tenant="team-a", token=env["TENSORHUB_TOKEN"]) as r0:
            r0.publish("mp", 1, {"w": full["w"][:4].contiguous(), "norm": full["norm"]},
                       shard=(0, 2), placements={"w": ((8, 6), (0, 0))})  # fmt: skip
            out = tmp_path / "whole"
            assert main(["fetch", "mp", "-o", str(out)]) == 0
            refused = main(["fetch", "mp", "-o", str(tmp_path / "x"), "--serve"])
    finally:
        assert stop(publisher) == 0
    assert refused == 1
    got = load_file(out / "model.safetensors")
    assert torch.equal(got["w"], full["w"])
    assert torch.equal(got["norm"], full["norm"])
    assert json.loads((out / "tensorhub.json").read_text())["shards"] == 2


@pytest.mark.timeout(120)
def test_the_first_ctrl_c_waits_for_readers_in_flight(
    connect: Callable[..., ros.Hub],
) -> None:
    slow = Fault(chunk_delay=0.2)
    trainer = connect(hooks=ClientHooks(send=slow))
    w = torch.randn(4 << 10)
    pub = trainer.publish("policy", 1, {"w": w}, chunk_size=4096)  # 4 chunks, 0.8 s to read
    holder, dumper = connect(), connect()  # one will hold it; one reads it and holds nothing
    block = torch.empty(4 << 10)
    done = [threading.Event(), threading.Event()]

    def fetch() -> None:
        holder.fetch("policy", 1, timeout=60)
        done[0].set()

    def dump() -> None:
        dumper.fetch_slices("policy", 1, slices={"w": Slice(block, (0,), (4 << 10,))})
        done[1].set()

    readers = Readers(trainer, "policy", 1, None)
    said: list[str] = []
    try:
        for target in (fetch, dump):
            threading.Thread(target=target, daemon=True).start()
        deadline = time.monotonic() + 30
        while len(readers.in_flight) < 2:  # a PARTIAL holder, and a pin
            assert time.monotonic() < deadline, readers.in_flight
            readers.poll(0.1)
            readers.refresh_pins()
        interrupts = Interrupts()
        interrupts.interrupt()  # Ctrl-C once
        assert drain(readers, interrupts, said.append, timeout=30)
        assert all(d.is_set() for d in done)  # both finished, from us: nobody else had it
        assert said[0].startswith("waiting for the readers in flight to finish")
        assert holder.holder_name in said[0]
        assert "slices-" in said[0]
        assert said[-1] == "no reader in flight any more"
        assert readers.complete == {holder.holder_name}
        assert torch.equal(block, w)
        # a second Ctrl-C does not wait
        interrupts.interrupt()
        assert not drain(readers, interrupts, said.append, timeout=30)
    finally:
        readers.close()
    pub.release(force=True)
