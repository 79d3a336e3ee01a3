"""`tensorhub fetch` on a full disk: a named error (`DiskFull`), and the partial output gone.

Three ways to be full: a small tmpfs whose free space is known too small before anything is
fetched; a tmpfs with room for the bytes but not for the files (its inodes run out while
the fetch writes: a real ENOSPC from the file system, mid-fetch); and an ENOSPC injected
into the write of the second file. The tmpfs cases need root (mount); they are skipped,
with the reason, where mounting fails.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

import ros
from ros.cli import fetchwrite, main
from ros.cli.outdir import partial_dirs
from ros.hub.server import HubServer

MODEL = {f"layer.{i}": torch.randn(256, 256) for i in range(8)}  # 8 x 256 KiB


@pytest.fixture
def published(
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ros.Hub]:
    token = make_tenant("team-a")
    for name, value in {"TENSORHUB_HUB": hub_server.address, "TENSORHUB_TENANT": "team-a",
                        "TENSORHUB_TOKEN": token}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with ros.connect(hub_server.address, tenant="team-a", token=token) as trainer:
        trainer.publish("policy", 1, MODEL)
        yield trainer


def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from tmpfs(tmp_path / "small", "size=1m")  # the model is 2 MiB


@pytest.fixture
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    # room for the bytes; inodes for the root, the partial directory and two files
    yield from tmpfs(tmp_path / "inodes", "size=64m,nr_inodes=4")


def nothing_left(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert partial_dirs(out) == []
    assert [p.name for p in parent.iterdir()] == []


def fetch(out: Path) -> int:
    return main(["fetch", "policy@1", "-o", str(out), "--max-shard-size", "600KB"])


@pytest.mark.timeout(60)
@pytest.mark.root
def test_a_disk_too_small_is_refused_before_fetching(
    published: ros.Hub, small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = small_disk / "policy-1"
    assert fetch(out) == 1
    err = capsys.readouterr().err
    assert "DiskFull" in err
    assert "nothing was fetched" in err
    nothing_left(small_disk, out)


@pytest.mark.timeout(60)
@pytest.mark.root
def test_a_file_system_that_fills_mid_fetch_is_disk_full(
    published: ros.Hub, few_inodes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = few_inodes / "policy-1"
    assert fetch(out) == 1  # four files to write; the third cannot be created
    err = capsys.readouterr().err
    assert "DiskFull" in err
    assert "No space left on device" in err
    assert "the partial output was removed" in err
    nothing_left(few_inodes, out)


@pytest.mark.timeout(60)
def test_an_injected_enospc_is_disk_full_and_leaves_nothing(
    published: ros.Hub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written: list[int] = []
    real = fetchwrite._write

    def full_after_a_file(f: BinaryIO, data: memoryview) -> None:
        if written and sum(written) > 600_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(data))
        real(f, data)

    monkeypatch.setattr(fetchwrite, "_write", full_after_a_file)
    parent = tmp_path / "disk"
    parent.mkdir()
    out = parent / "policy-1"
    assert fetch(out) == 1
    err = capsys.readouterr().err
    assert "DiskFull" in err
    assert "the partial output was removed" in err
    assert sum(written) > 600_000  # it failed mid-fetch, after a file was written
    nothing_left(parent, out)
    monkeypatch.setattr(fetchwrite, "_write", real)
    assert fetch(out) == 0  # with room again, the same fetch completes
