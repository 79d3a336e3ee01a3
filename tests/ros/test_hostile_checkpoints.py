"""Issue 38, rows 5-11: hostile publishers and checkpoint files against `tensorhub publish`
and `tensorhub fetch`, each attack run against a real hub and etcd, the CLI as a real
process (`python -m ros.cli`), asserting its exit code and the named error on stderr.

- Row 5: a publisher's metadata carries `tensorhub.file:model.safetensors` (and other names
  off the allow-list): refused by the SDK, by the hub (a raw Publish), and by `fetch` for a
  record already in etcd, before any byte is fetched.
- Row 6: a carried file name with a NUL byte, a `tensorhub.files.left` nested 30,000 deep,
  an index naming a file with a NUL byte: named errors, never a traceback.
- Row 7: a tensor named `__metadata__`: refused by the SDK, the hub, `publish` (a torch file
  may hold one) and `fetch`.
- Row 8: a checkpoint whose `config.json` (or weights) link out of the directory: refused
  before the hub is contacted; a link inside it is followed.
- Row 9: a sparse 1 GiB `tokenizer.json`: sized first and left behind unread (the
  publisher's own peak RSS (VmHWM) stays within 384 MiB of its baseline).
- Row 10: safetensors headers nested 100,000 deep, with a 5,000-digit integer, or of a
  million empty tensors (57 MiB): named errors before the parse, peak RSS bounded.
- Row 11: a model published straight from a Hugging Face cache snapshot (files linked into
  `../../blobs/`), fetched back byte for byte.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

import ros
from consistency import HolderRecord, HolderState, VersionRegistry
from ros.cli.carry import FILE_KEY, LEFT_KEY, decode, encode
from ros.cli.checkpoint import open_checkpoint
from ros.cli.outdir import partial_dirs
from ros.hub.server import HubServer
from ros.manifest_check import check_manifest
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import InvalidArgument, InvalidManifest
from tests.ros.helpers import make_model
from tests.ros.test_manifest_check import good

MiB = 1 << 20


def z64(data: bytes) -> str:
    """A carried file's metadata value, as `ros.cli.carry` encodes it."""
    return "z64:" + base64.b64encode(zlib.compress(data)).decode()


# `python -m ros.cli` (ros/cli/__main__.py) and, at exit, the process's own peak RSS
# (VmHWM) into the file $PEAK_FILE. Not wait4's ru_maxrss: Linux folds the high-water mark
# of the memory the child replaced at exec (the test process's, shared by vfork) into it.
_MEASURED = """\
import atexit, os, sys
from ros.cli import main
from ros.cli.rss import memory
atexit.register(lambda: open(os.environ["PEAK_FILE"], "w").write(str(memory().peak)))
sys.exit(main())
"""


@dataclass
class Ran:
    """A finished CLI process: exit code, output, and (measured runs) its own peak RSS."""

    rc: int
    out: str
    err: str
    peak_rss: int


class Cli:
    """`python -m ros.cli ARGS` as a child process with its output in files; with `measure`,
    the same `main()` run by `_MEASURED`, which reports the child's own peak RSS."""

    def __init__(self, env: dict[str, str], tmp: Path, *args: str, measure: bool = False) -> None:
        self.args = args
        stamp = time.monotonic_ns()
        self._out, self._err = tmp / f"cli-{stamp}.out", tmp / f"cli-{stamp}.err"
        self._peak = tmp / f"cli-{stamp}.peak"
        command = ["-c", _MEASURED] if measure else ["-m", "ros.cli"]
        with open(self._out, "wb") as out, open(self._err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *command, *args], stdout=out, stderr=err,
                env={**os.environ, **env, "PEAK_FILE": str(self._peak)},
            )  # fmt: skip

    def text(self) -> str:
        return self._out.read_text(errors="replace") + self._err.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert self.proc.poll() is None, f"{self.args} exited:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {text!r} from {self.args}:\n{self.text()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 90) -> Ran:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"{self.args} still running after {timeout}s:\n{self.text()}"
            ) from None
        peak = int(self._peak.read_text()) if self._peak.exists() else 0
        return Ran(rc, self._out.read_text(errors="replace"),
                   self._err.read_text(errors="replace"), peak)  # fmt: skip


def cli(env: dict[str, str], tmp: Path, *args: str, measure: bool = False) -> Ran:
    return Cli(env, tmp, *args, measure=measure).finish()


def refused_by_name(ran: Ran, error: str, *phrases: str) -> None:
    """Exit code 1, one `error: CLASS: ...` line naming the cause, and no traceback."""
    assert ran.rc == 1, (ran.rc, ran.err)
    assert "Traceback" not in ran.err, ran.err
    assert f"error: {error}: " in ran.err, ran.err
    for phrase in phrases:
        assert phrase in ran.err, (phrase, ran.err)


@pytest.fixture
def env(hub_server: HubServer, make_tenant: Callable[[str], str]) -> dict[str, str]:
    return {
        "TENSORHUB_HUB": hub_server.address,
        "TENSORHUB_TENANT": "team-a",
        "TENSORHUB_TOKEN": make_tenant("team-a"),
    }


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[ros.Hub]:
    with ros.connect(env["TENSORHUB_HUB"], tenant="team-a", token=env["TENSORHUB_TOKEN"]) as hub:
        yield hub


@pytest.fixture
def stub(hub_server: HubServer) -> Iterator[hub_pb2_grpc.TensorHubStub]:
    channel = grpc.insecure_channel(hub_server.address)
    yield hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    channel.close()


def raw_publish(
    stub: hub_pb2_grpc.TensorHubStub, client: ros.Hub, model: str, manifest: pb.Manifest
) -> grpc.RpcError | None:
    """A Publish straight to the hub (no SDK check): the error it got, or None."""
    holder = pb.Holder(name="trainer", endpoints={"tcp": "127.0.0.1:1"},
                       session_id=client.session.id)  # fmt: skip
    request = pb.PublishRequest(model=model, version=1, manifest=manifest, holder=holder)
    try:
        stub.Publish(request, metadata=client._metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


def assert_hub_refuses(error: grpc.RpcError | None, *phrases: str) -> None:
    assert error is not None, "the hub accepted it"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailing: Any = error.trailing_metadata()
    named = next((str(v) for k, v in trailing or () if k == "tensorhub-error"), "")
    assert named == "InvalidManifest", trailing
    for phrase in phrases:
        assert phrase in (error.details() or ""), error.details()


def plant(hub_server: HubServer, client: ros.Hub, model: str, manifest: pb.Manifest) -> None:
    """Version 1 of `model` written straight into etcd (no hub, no validation: a record of
    a hub that did not check, or written by hand), held by a holder never dialled."""
    record = HolderRecord(
        "planted", {"tcp": "127.0.0.1:1"}, state=HolderState.COMPLETE, session=client.session.id
    )
    VersionRegistry(hub_server.etcd, hub_server.keys).publish(
        client.tenant, model, 1, manifest.SerializeToString(), record, timeout=10
    )


def with_metadata(**metadata: str) -> pb.Manifest:
    manifest = good()
    manifest.metadata.update(metadata)
    return manifest


def fetch_refused(env: dict[str, str], tmp: Path, model: str, *phrases: str) -> None:
    """`tensorhub fetch MODEL@1` exits 1 with `InvalidManifest` naming the cause, and leaves
    no directory (nothing was fetched: the planted holder is never dialled)."""
    refused_fetch(start_fetch(env, tmp, model), *phrases)


def start_fetch(env: dict[str, str], tmp: Path, model: str) -> tuple[Cli, Path]:
    """`tensorhub fetch MODEL@1` started, to run beside other CLI processes (each imports
    torch: a second or two of CPU), and the directory it was told to write."""
    out = tmp / f"{model}-out"
    return Cli(env, tmp, "fetch", f"{model}@1", "-o", str(out), "--timeout", "5"), out


def refused_fetch(started: tuple[Cli, Path], *phrases: str) -> None:
    """The started fetch is refused as `fetch_refused` says."""
    fetch, out = started
    refused_by_name(fetch.finish(), "InvalidManifest", *phrases)
    assert not out.exists()
    assert partial_dirs(out) == []


def hub_has_no(client: ros.Hub, model: str) -> None:
    """Nothing of `model` reached the hub."""
    listed = client._rpc("ListModels", pb.ListModelsRequest())
    assert model not in [m.name for m in listed.models]


def safetensors_bytes(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


# -- row 5: carried file names come from an allow-list ---------------------------------


@pytest.mark.timeout(120)
def test_a_carried_file_cannot_replace_the_weights_or_the_record(
    env: dict[str, str],
    client: ros.Hub,
    stub: hub_pb2_grpc.TensorHubStub,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    """On 292ed20 the SDK and the hub took `tensorhub.file:model.safetensors`, and `fetch`
    exited 0 with the carried file written over the weights."""
    evil = z64(b"not the weights")
    hostile = ("model.safetensors", "tensorhub.json", "model.safetensors.index.json",
               "model-00001-of-00002.safetensors", "../x.json", ".bashrc", "notes.txt")  # fmt: skip
    for name in hostile:
        key = FILE_KEY + name
        with pytest.raises(InvalidManifest, match="a version carries only the files"):
            client.publish("policy", 1, make_model(1), metadata={key: evil})
        assert_hub_refuses(
            raw_publish(stub, client, "policy", with_metadata(**{key: evil})),
            "a version carries only the files",
            repr(key),
        )
        with pytest.raises(InvalidManifest):
            encode({name: b"{}"})
        with pytest.raises(InvalidManifest):
            decode({key: evil})
    hub_has_no(client, "policy")
    # a record the hub never checked (written before the rule, or by hand): the fetch
    # refuses it before fetching a byte
    plant(hub_server, client, "planted", with_metadata(**{FILE_KEY + "model.safetensors": evil}))
    fetch_refused(env, tmp_path, "planted", "'tensorhub.file:model.safetensors'")
    # every name of the allow-list is still carried
    from ros.manifest_check import CARRIED_FILES  # (imported here: 292ed20 has no list)

    allowed = {FILE_KEY + name: z64(b"{}") for name in CARRIED_FILES}
    check_manifest(with_metadata(**allowed))
    assert sorted(decode(allowed).files) == sorted(CARRIED_FILES)


# -- row 6: names and headers get named errors, never a traceback ------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hostile_names_and_left_entries_are_named_errors(
    env: dict[str, str],
    client: ros.Hub,
    stub: hub_pb2_grpc.TensorHubStub,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    """On 292ed20 a carried name with a NUL byte made `fetch` die with a raw ValueError
    traceback (rc 1); a `tensorhub.files.left` nested deep, with a RecursionError; an index
    naming a file with a NUL byte made `publish` die with a ValueError."""
    nul = FILE_KEY + "config.json\0x"
    assert_hub_refuses(raw_publish(stub, client, "nul", with_metadata(**{nul: z64(b"{}")})))
    plant(hub_server, client, "nul", with_metadata(**{nul: z64(b"{}")}))
    # tensorhub.files.left is informational, but a publisher writes it: nested 30,000 deep
    # (a RecursionError on 292ed20), with a 5,000-digit size, or naming a file off the list
    deep = "[" * 30_000 + "]" * 30_000  # within the 64 KiB of metadata
    plant(hub_server, client, "deep", with_metadata(**{LEFT_KEY: deep}))
    # a checkpoint's index naming a file with a NUL byte (JSON can say \u0000)
    ckpt = tmp_path / "nul-index"
    ckpt.mkdir()
    save_file({"w": torch.ones(4)}, ckpt / "model-1.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-1.safetensors\u0000.x"}})
    )
    # the three CLI runs are independent: at once
    fetch_nul, fetch_deep = start_fetch(env, tmp_path, "nul"), start_fetch(env, tmp_path, "deep")
    publish = Cli(env, tmp_path, "publish", "nulidx@1", str(ckpt))
    refused_fetch(fetch_nul, "config.json\\x00x")
    refused_fetch(fetch_deep, "'tensorhub.files.left': ")
    lefts = (('{"tokenizer.json": 1' + "0" * 5000 + "}", "an integer of 5001 digits"),
             ('{"../x": 1}', "a version carries only the files"),
             ('{"vocab.json": -1}', "not an object of file names to sizes"))  # fmt: skip
    for left, phrase in lefts:
        with pytest.raises(InvalidManifest, match=phrase):
            decode({LEFT_KEY: left})
    refused_by_name(publish.finish(), "InvalidArgument", "model.safetensors.index.json: names")
    hub_has_no(client, "nulidx")


# -- row 7: no tensor named __metadata__ -------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tensor_named_metadata_is_refused_everywhere(
    env: dict[str, str],
    client: ros.Hub,
    stub: hub_pb2_grpc.TensorHubStub,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    """On 292ed20 the hub took a tensor named `__metadata__`, and `fetch` wrote a file that
    safetensors cannot load (its header's metadata key holds a tensor)."""
    tensors = {"__metadata__": torch.ones(8), "w": torch.ones(4)}
    with pytest.raises(InvalidManifest, match="'__metadata__' is reserved"):
        client.publish("meta", 1, tensors)
    manifest = good()
    manifest.tensors[0].name = "__metadata__"
    assert_hub_refuses(raw_publish(stub, client, "meta", manifest), "'__metadata__' is reserved")
    # a torch state dict can hold the name: publish refuses it before the hub
    torch.save(tensors, tmp_path / "meta.pt")
    ran = cli(env, tmp_path, "publish", "meta@1", str(tmp_path / "meta.pt"))
    refused_by_name(ran, "InvalidManifest", "meta.pt: ", "'__metadata__' is reserved")
    hub_has_no(client, "meta")
    # a record the hub never checked
    plant(hub_server, client, "meta", manifest)
    fetch_refused(env, tmp_path, "meta", "manifest of meta@1", "'__metadata__' is reserved")


# -- row 8 and row 11: links out of the checkpoint; Hugging Face snapshots ---------------


def tiny_checkpoint(directory: Path, seed: int = 3) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {"embed": torch.randn(64, 16, generator=g), "head": torch.randn(16, generator=g)}
    save_file(tensors, directory / "model.safetensors")
    return tensors


@pytest.mark.timeout(120)
def test_links_out_of_the_checkpoint_are_refused_before_the_hub(
    env: dict[str, str], client: ros.Hub, tmp_path: Path
) -> None:
    """On 292ed20 a `config.json` linked to a file outside the directory was read and
    carried to every fetcher (here a "secret" beside the checkpoint)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the publisher's private file")
    ckpt = tmp_path / "ckpt"
    tiny_checkpoint(ckpt)
    (ckpt / "config.json").symlink_to(secret)
    # --until-replicated with a short wait: where the link was followed (292ed20) the
    # publish succeeds and gives up waiting (DeadlineExceeded), never hangs the test
    ran = cli(env, tmp_path, "publish", "linked@1", str(ckpt), "--until-replicated", "1",
              "--wait-timeout", "3")  # fmt: skip
    refused_by_name(ran, "InvalidArgument", "config.json leads to", "outside the checkpoint")
    assert str(secret.resolve()) in ran.err
    hub_has_no(client, "linked")
    # the weights too, and a link that climbs out with ../
    weights = tmp_path / "weights"
    tiny_checkpoint(weights)
    (tmp_path / "out-weights").mkdir()
    (tmp_path / "out-weights" / "model.safetensors").symlink_to(weights / "model.safetensors")
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to("../secret.txt")
    for path in (tmp_path / "out-weights", ckpt):
        with pytest.raises(InvalidArgument, match="outside the checkpoint"):
            open_checkpoint(path)
    # a link that stays inside the directory is followed; --no-files reads no config
    assert open_checkpoint(ckpt, carry=False).carried == {}
    (ckpt / "config.json").unlink()
    (ckpt / "configs").mkdir()
    (ckpt / "configs" / "llama.json").write_text('{"model_type": "llama"}')
    (ckpt / "config.json").symlink_to("configs/llama.json")
    assert open_checkpoint(ckpt).carried == {"config.json": b'{"model_type": "llama"}'}


def hf_snapshot(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """`files` laid out as the Hugging Face hub cache lays out a download:
    `models--ORG--NAME/blobs/HASH` holds the bytes, `refs/main` the commit, and
    `snapshots/COMMIT/NAME` is a relative link `../../blobs/HASH`."""
    root = cache / ("models--" + repo.replace("/", "--"))
    commit = sha256(repo.encode()).hexdigest()[:40]
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    return snapshot


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_hugging_face_cache_snapshot_is_published_and_fetched(
    env: dict[str, str], tmp_path: Path
) -> None:
    """On 292ed20 a snapshot of a sharded model was refused: its index names files that are
    links into `../../blobs/` ("outside its directory")."""
    source = tmp_path / "saved"
    source.mkdir()
    g = torch.Generator().manual_seed(11)
    parts = [{"a": torch.randn(32, 8, generator=g)}, {"b": torch.randn(8, generator=g)}]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, part in zip(names, parts, strict=True):
        save_file(part, source / name)
    index = {"metadata": {"total_size": 1056}, "weight_map": {"a": names[0], "b": names[1]}}
    files = {name: (source / name).read_bytes() for name in names}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["config.json"] = b'{"model_type": "llama", "hidden_size": 8}'
    cache = tmp_path / "hub-cache"
    snapshot = hf_snapshot(cache, "org/tiny", files)
    if importlib.util.find_spec("huggingface_hub") is not None:
        import huggingface_hub  # where it is installed, it reads the layout as its own

        found = huggingface_hub.try_to_load_from_cache("org/tiny", "config.json", cache_dir=cache)
        assert found == str(snapshot / "config.json")
        (repo,) = huggingface_hub.scan_cache_dir(cache).repos
        assert {f.file_name for f in next(iter(repo.revisions)).files} == set(files)
    publisher = Cli(env, tmp_path, "publish", "tiny@1", str(snapshot))
    try:
        publisher.wait_for("serving tiny@1")
        assert "carried in the manifest: config.json" in publisher.text()
        out = tmp_path / "fetched"
        ran = cli(env, tmp_path, "fetch", "tiny@1", "-o", str(out))
    finally:
        if publisher.proc.poll() is None:
            publisher.proc.send_signal(signal.SIGINT)
        stopped = publisher.finish()
    assert ran.rc == 0, ran.err
    assert stopped.rc == 0, stopped.err
    assert (out / "config.json").read_bytes() == files["config.json"]
    got = load_file(out / "model.safetensors")
    assert torch.equal(got["a"], parts[0]["a"])
    assert torch.equal(got["b"], parts[1]["b"])
    # a link into another repository's blobs is not accepted
    other = hf_snapshot(cache, "org/other", {"model.safetensors": files[names[0]]})
    (other / "config.json").symlink_to(
        os.path.relpath(next((snapshot.parent.parent / "blobs").iterdir()), other)
    )
    with pytest.raises(InvalidArgument, match="outside the checkpoint"):
        open_checkpoint(other)
    # a "snapshot" whose blobs/ is itself a link (as an archive may hold) grants nothing
    secrets = tmp_path / "home-ssh"
    secrets.mkdir()
    (secrets / "id_key").write_text("private")
    fake = tmp_path / "archive" / "models--org--fake"
    (fake / "snapshots" / "rev").mkdir(parents=True)
    (fake / "blobs").symlink_to(secrets)
    (fake / "snapshots" / "rev" / "model.safetensors").write_bytes(files[names[0]])
    (fake / "snapshots" / "rev" / "config.json").symlink_to("../../blobs/id_key")
    with pytest.raises(InvalidArgument, match="outside the checkpoint"):
        open_checkpoint(fake / "snapshots" / "rev")


# -- row 9: carried files are sized before they are read ---------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sparse_gigabyte_tokenizer_is_left_behind_unread(
    env: dict[str, str], tmp_path: Path
) -> None:
    """On 292ed20 the publisher read the 1 GiB file whole, compressed it, then found it too
    big: 1,270 MiB peak. It is sized by stat and skipped, said by both commands."""
    ckpt = tmp_path / "ckpt"
    tensors = tiny_checkpoint(ckpt)
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    with open(ckpt / "tokenizer.json", "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk blocks
    base = Cli(env, tmp_path, "publish", "base@1", str(tmp_path / "missing"), measure=True)
    publisher = Cli(env, tmp_path, "publish", "sparse@1", str(ckpt), measure=True)
    try:
        publisher.wait_for("serving sparse@1")
        out = tmp_path / "fetched"
        fetched = cli(env, tmp_path, "fetch", "sparse@1", "-o", str(out))
    finally:
        if publisher.proc.poll() is None:
            publisher.proc.send_signal(signal.SIGINT)
        ran = publisher.finish()
    assert ran.rc == 0, ran.err
    baseline = base.finish()
    refused_by_name(baseline, "InvalidArgument", "no such file")
    print(
        f"publisher peak RSS {ran.peak_rss / MiB:.0f} MiB, baseline {baseline.peak_rss / MiB:.0f}"
    )
    assert ran.peak_rss > 0
    assert ran.peak_rss - baseline.peak_rss < 384 * MiB, (ran.peak_rss, baseline)
    assert "carried in the manifest: config.json" in ran.out
    assert (
        f"left behind: tokenizer.json ({1 << 30} bytes; over the {1 << 20} bytes a carried "
        "file may be: not read" in ran.out
    ), ran.out
    assert fetched.rc == 0, fetched.err
    assert f"not carried by the publisher: tokenizer.json ({1 << 30} bytes)" in fetched.out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tensorhub.json",
    ]  # fmt: skip
    assert torch.equal(load_file(out / "model.safetensors")["embed"], tensors["embed"])


# -- row 10: safetensors headers are bounded before they are parsed ----------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hostile_safetensors_headers_are_named_errors_within_bounds(
    env: dict[str, str], client: ros.Hub, tmp_path: Path
) -> None:
    """On 292ed20: a RecursionError traceback, a ValueError traceback (Python's int digit
    limit), and 1,254 MiB and 17 s of parsing a million empty tensors before the hub."""
    deep = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    digits = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1' + b"0" * 4999 + b"]}}"
    million = b"{" + b",".join(
        b'"t%07d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % i for i in range(1_000_000)
    ) + b"}"  # fmt: skip
    assert len(million) > 57 * MiB
    index = b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    cases = {
        "deep": (safetensors_bytes(deep), "nested deeper than 3 levels"),
        "digits": (safetensors_bytes(digits), "an integer of 5000 digits"),
        "million": (safetensors_bytes(million), "values (at most"),
    }
    for name, (data, _) in cases.items():
        (tmp_path / f"{name}.safetensors").write_bytes(data)
    phrases = {name: phrase for name, (_, phrase) in cases.items()}
    del million, cases
    indexed = tmp_path / "indexed"
    tiny_checkpoint(indexed)
    (indexed / "model.safetensors.index.json").write_bytes(index)
    # the runs are independent: at once, each measuring its own peak
    base = Cli(env, tmp_path, "publish", "base@1", str(tmp_path / "missing"), measure=True)
    runs = {
        name: Cli(env, tmp_path, "publish", f"{name}@1", str(tmp_path / f"{name}.safetensors"),
                  "--until-replicated", "1", "--wait-timeout", "3", measure=True)
        for name in phrases
    }  # fmt: skip
    index_run = Cli(env, tmp_path, "publish", "indexed@1", str(indexed))
    baseline = base.finish()
    refused_by_name(baseline, "InvalidArgument", "no such file")
    for name, phrase in phrases.items():
        ran = runs[name].finish()
        refused_by_name(ran, "InvalidArgument", "bad safetensors header: ", phrase)
        print(
            f"{name}: peak RSS {ran.peak_rss / MiB:.0f} MiB, baseline {baseline.peak_rss / MiB:.0f}"
        )
        assert ran.peak_rss > 0
        assert ran.peak_rss - baseline.peak_rss < 256 * MiB, (name, ran.peak_rss, baseline)
        hub_has_no(client, name)
    refused_by_name(
        index_run.finish(), "InvalidArgument", "not a readable index: nested deeper than 4 levels"
    )


# -- the bounds themselves, in process ---------------------------------------------------


def test_untrusted_json_bounds() -> None:
    from ros.cli.untrusted_json import Limits, load  # (imported here: new since 292ed20)

    limits = Limits(max_bytes=4096, max_depth=3, max_members=8, max_values=32)
    assert load(b'{"a": {"b": [1, "[[{"]}}', "x", limits) == {"a": {"b": [1, "[[{"]}}
    assert load(b'{"q": "\\"[["}', "x", limits) == {"q": '"[['}
    for raw, phrase in [
        (b"[" * 4 + b"]" * 4, "nested deeper than 3"),
        (b'{"a": ' + b"1" * 21 + b"}", "an integer of 21 digits"),
        (b"[" + b"0," * 40 + b"0]", r"values \(at most"),
        (b'{"a": "x', "a string is not closed"),
        (b'{"a": [1}]', "do not pair"),
        (b'{"a": [1}', "do not balance"),
        (b"{" + b" " * 5000 + b"}", "bytes of JSON"),
    ]:
        with pytest.raises(InvalidArgument, match=phrase):
            load(raw, "x", limits)
    with pytest.raises(InvalidManifest):
        load(b"[[[[]]]]", "x", limits, InvalidManifest)


def test_a_carried_entry_is_bounded_when_decoded() -> None:
    """A publisher's entry that inflates past `MAX_CARRIED_FILE_BYTES` (a zlib bomb within
    the 64 KiB of metadata) is refused, not decompressed whole."""
    from ros.cli.checkpoint import MAX_CARRIED_FILE_BYTES  # (here: new since 292ed20)

    bomb = "z64:" + base64.b64encode(zlib.compress(b"\0" * (40 * MiB), 9)).decode()
    assert len(bomb) < 64 << 10
    with pytest.raises(InvalidManifest, match=f"decodes to more than {MAX_CARRIED_FILE_BYTES}"):
        decode({FILE_KEY + "tokenizer.json": bomb})
    truncated = z64(b"{}" * 100)[:-8]
    with pytest.raises(InvalidManifest, match="does not decode"):
        decode({FILE_KEY + "config.json": truncated})
    metadata, carried = encode({"config.json": b"{}"}, {"tokenizer.json": 1 << 30})
    assert carried.left == {"tokenizer.json": 1 << 30}
    assert decode(metadata).left == {"tokenizer.json": 1 << 30}
