"""`tensorhub fetch --view` and `inspect --view` (docs/views.md, docs/cli.md), in process,
against a real hub over a real etcd and a real publishing client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ros
from ros.cli import main
from ros.cli.carry import encode
from ros.views import META_CONFIG, make_view
from tests.views.test_publish_views import llama

CONFIG = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2}


@pytest.fixture
def cli(cli_as: Callable[[str], dict[str, str]]) -> dict[str, str]:
    """The CLI's hub, tenant and token in this process's environment."""
    return cli_as("views-cli")


def test_fetch_view_writes_what_an_fp8_loader_reads(
    cli: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = llama(3)
    metadata, _ = encode({"config.json": json.dumps(CONFIG).encode()})
    with ros.connect(cli["TENSORHUB_HUB"], tenant="views-cli", token=cli["TENSORHUB_TOKEN"]) as t:
        t.publish("policy", 1, weights, metadata=metadata, views=("fp8-block128", "mxfp8"))
        for fmt, scale in (("fp8-block128", "weight_scale_inv"), ("mxfp8", "weight_scale")):
            out = tmp_path / fmt
            assert main(["fetch", "policy@1", "--view", fmt, "-o", str(out)]) == 0
            expected, view_metadata = make_view(weights, fmt)
            with safe_open(str(out / "model.safetensors"), framework="pt") as f:
                got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            assert got.keys() == expected.keys()
            for name, tensor in expected.items():
                assert got[name].dtype == tensor.dtype, name
                assert got[name].shape == tensor.shape, name
                assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
            assert f"model.layers.1.mlp.down_proj.{scale}" in got
            config = json.loads((out / "config.json").read_text())
            assert config["model_type"] == "llama"  # the version's own config, kept
            assert config["quantization_config"] == json.loads(view_metadata[META_CONFIG])
            record = json.loads((out / "tensorhub.json").read_text())
            assert record["model"] == f"policy.{fmt}"
        capsys.readouterr()
        assert main(["inspect", "policy@1", "--view", "mxfp8", "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["model"] == "policy.mxfp8"
        assert shown["view"] == {"format": "mxfp8", "of": "policy", "quantized_modules": 14}
        assert main(["inspect", "policy@1"]) == 0
        assert "view" not in capsys.readouterr().out.split("holders:")[0]
        assert main(["ls"]) == 0
        listed = capsys.readouterr().out
        assert "policy.fp8-block128" in listed
        assert "policy.mxfp8" in listed


def test_fetch_of_a_view_without_a_config_writes_only_its_quantization_config(
    cli: dict[str, str], tmp_path: Path
) -> None:
    with ros.connect(cli["TENSORHUB_HUB"], tenant="views-cli", token=cli["TENSORHUB_TOKEN"]) as t:
        t.publish("bare", 1, llama(4), views=("fp8-block128",))
        assert main(["fetch", "bare@1", "--view", "fp8-block128", "-o", str(tmp_path / "o")]) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert list(config) == ["quantization_config"]
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_bad_views_in_the_cli_are_named_errors(
    cli: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ros.connect(cli["TENSORHUB_HUB"], tenant="views-cli", token=cli["TENSORHUB_TOKEN"]) as t:
        t.publish("policy", 1, llama(5))  # no views
        cases = {
            ("fetch", "policy@1", "--view", "fp9", "-o", str(tmp_path / "a")): "InvalidArgument",
            ("fetch", "policy@1", "--view", "mxfp8", "-o", str(tmp_path / "b")): "VersionNotFound",
            ("inspect", "policy@1", "--view", "int4"): "InvalidArgument",
        }
        for args, error in cases.items():
            capsys.readouterr()
            assert main(list(args)) == 1, args
            assert error in capsys.readouterr().err, args
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()


@pytest.mark.slow  # the publisher is a process of its own (torch starts: 5 s or more)
def test_publish_with_a_view_serves_it_visible_with_its_version(
    cli: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tensorhub publish MODEL@V PATH --view FMT`, as a user runs it (its own process):
    the view is version V of MODEL.FMT, visible with V, served by the publishing process,
    and `tensorhub fetch --view` writes it as `make_view` makes it."""
    weights = llama(6)
    saved = tmp_path / "ckpt"
    saved.mkdir()
    save_file(weights, str(saved / "model.safetensors"))
    (saved / "config.json").write_text(json.dumps(CONFIG))
    log = tmp_path / "publish.log"
    with open(log, "wb") as out:
        publisher = subprocess.Popen(
            [sys.executable, "-m", "ros.cli", "publish", "policy@1", str(saved),
             "--view", "fp8-block128", "--until-replicated", "1", "--wait-timeout", "60"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "readers holding it" not in log.read_text(errors="replace"):
            assert publisher.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        said = log.read_text()
        assert "view: policy.fp8-block128@1, visible with it" in said
        out_dir = tmp_path / "view"
        assert main(["fetch", "policy@1", "--view", "fp8-block128", "-o", str(out_dir)]) == 0
        expected, view_metadata = make_view(weights, "fp8-block128")
        with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
            got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
        config = json.loads((out_dir / "config.json").read_text())
        assert config["model_type"] == "llama"
        assert config["quantization_config"] == json.loads(view_metadata[META_CONFIG])
        capsys.readouterr()
        assert main(["inspect", "policy@1", "--json"]) == 0
        version_revision = json.loads(capsys.readouterr().out)["published_revision"]
        assert main(["inspect", "policy@1", "--view", "fp8-block128", "--json"]) == 0
        view_info = json.loads(capsys.readouterr().out)
        assert view_info["published_revision"] == version_revision  # one transaction
        with ros.connect(cli["TENSORHUB_HUB"], tenant="views-cli",
                         token=cli["TENSORHUB_TOKEN"]) as reader:  # fmt: skip
            held = reader.fetch("policy", 1, timeout=30)  # a holder of V: the wait ends
            assert publisher.wait(timeout=60) == 0, log.read_text()
            held.release(force=True)
    finally:
        if publisher.poll() is None:
            publisher.kill()
            publisher.wait(timeout=10)


def test_publish_view_flags_are_checked_before_the_hub(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "ckpt"
    saved.mkdir()
    save_file(llama(7), str(saved / "model.safetensors"))
    env = {"TENSORHUB_HUB": "127.0.0.1:1", "TENSORHUB_TENANT": "t", "TENSORHUB_TOKEN": "x"}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a hub nobody listens on: a refusal must come before it
    try:
        cases = {
            ("--view", "fp9"): "InvalidArgument",
            ("--view", "mxfp8", "--view", "mxfp8"): "InvalidArgument",
            ("--view", "mxfp8", "--shard", "0/2"): "process group",
        }
        for flags, error in cases.items():
            capsys.readouterr()
            assert main(["publish", "policy@1", str(saved), *flags]) == 1, flags
            assert error in capsys.readouterr().err, flags
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with pytest.raises(SystemExit):
        main(["publish", "--help"])
    assert "--view FMT" in capsys.readouterr().out
