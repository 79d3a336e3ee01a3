"""The `tensorhub` CLI as a user runs it: serve, tenant create, ls, inspect, holders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ros
from consistency import EtcdCluster, Keys
from tests.ros.helpers import make_model

ADMIN = "cli-admin"


def tensorhub(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ros.cli", *args],
        check=False, capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture
def served(etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path) -> Iterator[str]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
         "--etcd", ",".join(etcd_cluster.endpoints), "--admin-token", ADMIN,
         "--prefix", keys.prefix, "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "serve exited"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield json.loads(ready.read_text())["address"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


@pytest.mark.timeout(120)
def test_cli_round_trip(served: str) -> None:
    created = tensorhub(
        "tenant", "create", "team-a", "--hub", served, "--admin-token", ADMIN, "--json"
    )
    assert created.returncode == 0, created.stderr
    token = json.loads(created.stdout)
    assert token["tenant"] == "team-a"
    env = {"TENSORHUB_HUB": served, "TENSORHUB_TENANT": "team-a", "TENSORHUB_TOKEN": token["token"]}
    empty = tensorhub("ls", env=env)
    assert empty.returncode == 0
    assert "no models" in empty.stdout
    with ros.connect(served, tenant="team-a", token=token["token"], name="trainer-0") as hub:
        hub.publish("policy", 3, make_model(3))
        listed = tensorhub("ls", "--json", env=env)
        assert json.loads(listed.stdout)["models"] == [
            {"model": "policy", "latest": 3, "versions": [3]}
        ]
        shown = tensorhub("inspect", "policy@3", env=env)
        assert shown.returncode == 0
        assert "policy@3  (latest 3, retained)" in shown.stdout
        assert "trainer-0" in shown.stdout
        holders = json.loads(tensorhub("holders", "policy", "--json", env=env).stdout)
        assert [h["name"] for h in holders["holders"]] == ["trainer-0"]
        assert holders["holders"][0]["state"] == "COMPLETE"
        with ros.connect(served, tenant="team-a", token=token["token"], name="rank-1") as rank:
            # a model-parallel version: the listing shows each holder's shard, and inspect
            # adds the shards up
            hub.publish("mp", 1, make_model(1), shard=(0, 2))
            rank.publish("mp", 1, make_model(2), shard=(1, 2))
            table = tensorhub("holders", "mp@1", env=env).stdout
            assert table.splitlines()[0].split()[:2] == ["HOLDER", "SHARD"]
            assert any(line.split()[:2] == ["rank-1", "1"] for line in table.splitlines())
            shown = json.loads(tensorhub("inspect", "mp@1", "--json", env=env).stdout)
            assert shown["shards"] == 2
            assert shown["tensors"] == 2 * len(make_model(1))
            assert "in 2 shards" in tensorhub("inspect", "mp@1", env=env).stdout
    missing = tensorhub("inspect", "policy@9", env=env)
    assert missing.returncode == 1
    assert "VersionNotFound" in missing.stderr
    bad = tensorhub("inspect", "../x@1", env=env)
    assert bad.returncode == 1
    assert "InvalidName" in bad.stderr
    denied = tensorhub("ls", env={**env, "TENSORHUB_TOKEN": "team-a.wrong"})
    assert denied.returncode == 1
    assert "PermissionDenied" in denied.stderr
    again = tensorhub("tenant", "create", "team-a", "--hub", served, "--admin-token", ADMIN)
    assert again.returncode == 1
    assert "AlreadyExists" in again.stderr


# `main(ARGV)` of `ros.cli` (what `python -m ros.cli ARGV` runs) for each ARGV of the JSON
# list in argv[1]; prints {"ARGV": [exit code, stdout]} as JSON.
_HELPS = """\
import contextlib, io, json, sys
from ros.cli import main
said = {}
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    said[" ".join(argv)] = [code, out.getvalue()]
print(json.dumps(said))
"""


def helps(*commands: str) -> dict[str, str]:
    """The `--help` text of each command (`""`: the top level), each exiting 0, printed by
    the CLI's `main()` in one child process: one interpreter and one torch import (publish
    and fetch load it) for all of them instead of one each."""
    argvs = [[*command.split(), "--help"] for command in commands]
    ran = subprocess.run(
        [sys.executable, "-c", _HELPS, json.dumps(argvs)],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    said = json.loads(ran.stdout)
    for argv in argvs:
        assert said[" ".join(argv)][0] == 0, (argv, said[" ".join(argv)], ran.stderr)
    return {command: said[" ".join(argv)][1] for command, argv in zip(commands, argvs, strict=True)}


def test_help_is_helpful() -> None:
    said = helps("", "serve", "tenant create", "publish", "fetch")
    for command in (
        "serve", "tenant", "ls", "inspect", "holders", "demo", "bench", "chaos", "publish", "fetch"
    ):  # fmt: skip
        assert command in said[""]
    serve = said["serve"]
    assert "--etcd" in serve
    assert "--admin-token" in serve
    assert "--etcd-quota-bytes" in serve
    assert "--max-history-bytes" in said["tenant create"]
    publish = said["publish"]
    assert "--until-replicated" in publish
    assert "--shard" in publish
    fetch = said["fetch"]
    assert "--serve" in fetch
    assert "--force" in fetch
    no_hub = tensorhub("ls", env={"TENSORHUB_HUB": "", "TENSORHUB_TOKEN": "x.y"})
    assert no_hub.returncode == 1
    assert "--hub" in no_hub.stderr


@pytest.mark.timeout(120)
def test_cli_tenant_delete(served: str) -> None:
    flags = ("--hub", served, "--admin-token", ADMIN)
    created = tensorhub("tenant", "create", "team.x", *flags, "--json")
    assert created.returncode == 0, created.stderr
    token = json.loads(created.stdout)["token"]
    env = {"TENSORHUB_HUB": served, "TENSORHUB_TENANT": "team.x", "TENSORHUB_TOKEN": token}
    assert tensorhub("ls", env=env).returncode == 0  # a dotted name authenticates
    deleted = tensorhub("tenant", "delete", "team.x", *flags)
    assert deleted.returncode == 0, deleted.stderr
    assert "tenant team.x deleted" in deleted.stdout
    gone = tensorhub("tenant", "delete", "team.x", *flags)
    assert gone.returncode == 1
    assert "TenantNotFound" in gone.stderr
    denied = tensorhub("ls", env=env)  # the deleted tenant's token
    assert denied.returncode == 1
    assert "PermissionDenied" in denied.stderr
    assert tensorhub("tenant", "create", "team.x", *flags).returncode == 0


@pytest.mark.timeout(120)
def test_inspect_and_holders_show_a_delta_and_who_serves_it(served: str) -> None:
    """Issue 22, item 3: a version published with a delta shows its base, what is encoded,
    and the holders of its companion; a reader that applied it is among them."""
    created = tensorhub(
        "tenant", "create", "team-d", "--hub", served, "--admin-token", ADMIN, "--json"
    )
    token = json.loads(created.stdout)["token"]
    env = {"TENSORHUB_HUB": served, "TENSORHUB_TENANT": "team-d", "TENSORHUB_TOKEN": token}
    with (
        ros.connect(served, tenant="team-d", token=token, name="trainer-0") as hub,
        ros.connect(served, tenant="team-d", token=token, name="rollout-0") as reader,
    ):
        weights = make_model(3)
        hub.publish("policy", 1, weights, chunk_size=4096, delta=True)
        held = reader.fetch("policy", 1)
        held.release()
        weights["embed.weight"][0, :4] += 1  # one chunk changes
        hub.publish("policy", 2, weights, chunk_size=4096, delta=True)
        again = reader.fetch("policy", 2, into=held.tensors)
        assert again.delta is not None
        shown = json.loads(tensorhub("inspect", "policy@2", "--json", env=env).stdout)
        delta = shown["delta"]
        assert delta["base"] == 1
        assert delta["companion"] == "policy.delta"
        assert delta["encoded_chunks"] >= 1
        assert 0 < delta["encoded_bytes"] < shown["bytes"]
        assert {h["name"] for h in delta["holders"]} == {"trainer-0", "rollout-0"}
        text = tensorhub("inspect", "policy@2", env=env).stdout
        assert "delta against 1 (xor-adaptive-zstd1)" in text
        assert "served as policy.delta@2 by 2 holders" in text
        table = tensorhub("holders", "policy@2", env=env).stdout
        assert "delta against 1: served by the holders of policy.delta@2" in table
        assert (
            json.loads(tensorhub("inspect", "policy@1", "--json", env=env).stdout)["delta"] is None
        )


def test_the_queries_and_admin_commands_start_without_torch() -> None:
    """`ls`, `inspect`, `holders`, `tenant` and `delete` only talk to the hub: loading torch
    (about 1.5 s a call) for them would make every query of a script that slow."""
    code = (
        "import sys\n"
        "from ros.cli import build_parser\n"
        "for name in ('ls', 'inspect', 'holders', 'tenant', 'delete'):\n"
        "    build_parser(name)\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
