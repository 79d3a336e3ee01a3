"""Views of a model-parallel version (docs/views.md, "Views of model-parallel versions"):
trainer ranks in a real gloo process group (`shard_publish_proc.py`, one process each)
publish their shards with views against a real hub over a real etcd; a reader writes each
view whole (`tensorhub fetch --view -o DIR`, which assembles the shards' blocks), and it is
the view of the whole tensors that the tests' own quantizer (`tests/views/reference.py`,
written from docs/views.md) makes, bit for bit, with the metadata `make_view` gives the
whole state dict. A rank that fails mid-publish leaves neither the version nor a view."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ros
from ros.cli import main
from ros.hub.server import HubServer
from ros.views import META_CONFIG, META_QUANTIZED, make_view
from tensorhub.errors import VersionNotFound
from tests.gloo_ranks import launch
from tests.views import reference
from tests.views.shard_publish_proc import FORMATS, whole

pytestmark = pytest.mark.slow  # 2 or 4 torch processes start (about 10 s on 2 shared cores)

SCALES = {"fp8-block128": "weight_scale_inv", "mxfp8": "weight_scale"}


@contextmanager
def ranks(
    hub: HubServer, tenant: str, token: str, model: str, mode: str, world: int
) -> Iterator[list[dict[str, Any]]]:
    """`world` rank processes publishing MODEL@1 by MODE: what each said (in rank order),
    while they serve; they stop when the block ends."""
    with launch("tests.views.shard_publish_proc", [hub.address, tenant, token, model, mode],
                world) as said:  # fmt: skip
        yield said


def expected_view(fmt: str, version: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The view of the whole tensors: each quantized weight by the reference quantizer
    (raw bytes), every other tensor as it is; and `make_view`'s metadata of the whole."""
    tensors: dict[str, torch.Tensor] = {}
    quantize = {"fp8-block128": reference.quantize_fp8_block128,
                "mxfp8": reference.quantize_mxfp8}[fmt]  # fmt: skip
    ours, metadata = make_view(whole(version), fmt)  # which names it quantizes, its metadata
    for name, w in whole(version).items():
        scale_name = name.removesuffix(".weight") + "." + SCALES[fmt]
        if scale_name not in ours:
            tensors[name] = w
            continue
        codes, scale = quantize(w.float().numpy())
        tensors[name] = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn)
        tensors[scale_name] = torch.from_numpy(np.ascontiguousarray(scale))
    return tensors, metadata


def check_views(out: Path, model: str, version: int = 1) -> None:
    """Each view of MODEL@VERSION, written whole by `tensorhub fetch --view`, is the view of
    the whole tensors, with the whole state dict's quantization_config."""
    for fmt in FORMATS:
        target = out / fmt
        assert main(["fetch", f"{model}@{version}", "--view", fmt, "-o", str(target)]) == 0
        expected, metadata = expected_view(fmt, version)
        with safe_open(str(target / "model.safetensors"), framework="pt") as f:
            got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        assert sorted(got) == sorted(expected), fmt
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype, (fmt, name)
            assert got[name].shape == tensor.shape, (fmt, name)
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), (fmt, name)
        config = json.loads((target / "config.json").read_text())
        assert config["quantization_config"] == json.loads(metadata[META_CONFIG]), fmt


@pytest.fixture
def cli(cli_as: Callable[[str], dict[str, str]]) -> dict[str, str]:
    """The CLI's hub, tenant and token in this process's environment."""
    return cli_as("views-shards")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "world"), [("ranks", 2), ("group", 4), ("dtensor", 2)])
def test_the_ranks_view_shards_are_the_view_of_the_whole_version(
    hub_server: HubServer, cli: dict[str, str], tmp_path: Path, mode: str, world: int
) -> None:
    token = cli["TENSORHUB_TOKEN"]
    with ranks(hub_server, "views-shards", token, "policy", mode, world) as said:
        assert all("error" not in s and "exit" not in s for s in said), said
        assert any(s["visible"] for s in said), said  # the last shard made it visible
        check_views(tmp_path, "policy")
        with ros.connect(hub_server.address, tenant="views-shards", token=token) as reader:
            info = reader.inspect("policy", 1)
            for fmt in FORMATS:  # visible in the version's own transaction
                view = reader.inspect(f"policy.{fmt}", 1)
                assert view.published_revision == info.published_revision, fmt
                assert len(view.shards) == len(info.shards), fmt
                quantized = json.loads(view.shards[0].metadata[META_QUANTIZED])
                assert quantized == json.loads(make_view(whole(), fmt)[1][META_QUANTIZED])
                assert all(s.metadata == view.shards[0].metadata for s in view.shards)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["dies", "nan"])
def test_a_rank_failing_mid_publish_leaves_neither_version_nor_view(
    hub_server: HubServer, cli: dict[str, str], mode: str
) -> None:
    token = cli["TENSORHUB_TOKEN"]
    with ranks(hub_server, "views-shards", token, "failing", mode, 2) as said:
        if mode == "dies":  # rank 0's shard (and its view shards) landed, rank 1's never
            assert said[0].get("visible") is False, said
            assert said[1].get("exit") == 3, said
            for name in ("failing", *(f"failing.{fmt}" for fmt in FORMATS)):
                key = hub_server.keys.shard("views-shards", name, 1, 0)
                assert hub_server.etcd.get(key)[0] is not None, name
        else:  # the NaN is refused by both ranks, before either sends anything
            assert [s.get("error") for s in said] == ["InvalidArgument"] * 2, said
            assert "NaN" in said[1]["message"] or "nan" in said[1]["message"], said
        with ros.connect(hub_server.address, tenant="views-shards", token=token) as reader:
            for name in ("failing", *(f"failing.{fmt}" for fmt in FORMATS)):
                with pytest.raises(VersionNotFound):
                    reader.inspect(name, 1)
                assert reader.latest(name) == 0, name


@pytest.mark.timeout(240)
def test_view_shards_published_as_deltas_are_the_view_of_the_whole_version(
    hub_server: HubServer, cli: dict[str, str], tmp_path: Path
) -> None:
    """With `delta=True`, each rank's view shards of version 2 are published as deltas
    against its view shards of version 1 (each view's companion `{model}.{fmt}.delta`
    has a shard of each rank), what a reader assembles is still the view of the whole
    version 2, and a reader of a view's shard at version 1 reads version 2 by its delta."""
    token = cli["TENSORHUB_TOKEN"]
    with ranks(hub_server, "views-shards", token, "policy", "delta", 2) as said:
        assert all("error" not in s and "exit" not in s for s in said), said
        assert all(s["companions"] == dict.fromkeys(FORMATS, True) for s in said), said
        check_views(tmp_path, "policy", 2)
        with ros.connect(hub_server.address, tenant="views-shards", token=token) as reader:
            for fmt in FORMATS:
                companion = reader.inspect(f"policy.{fmt}.delta", 2)
                assert companion.shard_count == 2, fmt
                # a reader of a view's shard moves to the next version by its delta
                whole2 = reader.fetch("policy", 2, view=fmt, shard=1)
                expected = {n: t.clone() for n, t in whole2.tensors.items()}
                whole2.release()
                held = reader.fetch("policy", 1, view=fmt, shard=1)
                held.release()  # its memory stays the base the SDK knows
                got = reader.fetch("policy", 2, view=fmt, shard=1, into=held.tensors)
                assert got.delta is not None, fmt
                assert got.delta.chunks > 0, (fmt, got.delta)
                assert not got.delta.fallback, (fmt, got.delta)
                for name, tensor in expected.items():
                    assert torch.equal(
                        got.tensors[name].view(torch.uint8), tensor.view(torch.uint8)
                    ), (fmt, name)
                got.release()
