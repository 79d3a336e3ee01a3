"""The pieces of `tensorhub publish` and `fetch` that need no hub: the safetensors format,
checkpoint reading, carried files, the output plan and its batches, and the progress lines.
Fast (no process, no etcd)."""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ros.cli.carry import FILE_KEY, LEFT_KEY, decode, encode
from ros.cli.checkpoint import open_checkpoint
from ros.cli.fetch import batch_budget, parse_size
from ros.cli.outplan import ChunkCost, batches, pieces, plan_files
from ros.cli.progress import Bar
from ros.cli.safetensors_io import DTYPES, Spec, file_order, header_bytes, map_file
from ros.client.manifest import manifest_of
from ros.manifest_check import MAX_METADATA_BYTES, check_metadata
from tensorhub.errors import InvalidArgument, InvalidManifest
from transport.layout import Layout
from transport.store import HeldVersion


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, dtype in DTYPES.items():
        raw = torch.randint(0, 255, (3, 5), generator=g, dtype=torch.uint8)
        wide = raw.repeat_interleave(dtype.itemsize, dim=1)  # bytes for 3 x 5 elements
        out[f"t_{name}"] = wide.view(dtype) if dtype != torch.bool else raw % 2 == 1
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 4)
    return out


def _raw(t: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    return tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A file as `ros.cli.fetchwrite` writes one: header, then the data in file order."""
    specs = file_order([Spec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    with open(path, "wb") as f:
        f.write(header_bytes(specs))
        for s in specs:
            f.write(tensors[s.name].reshape(-1).view(torch.uint8).numpy().tobytes())


def test_files_written_here_are_read_by_the_reference_and_mapped_back(tmp_path: Path) -> None:
    tensors = _every_dtype()
    path = tmp_path / "all.safetensors"
    _write(path, tensors)
    reference = load_file(path)  # the safetensors package reads every dtype back
    header, mapped = map_file(path)
    assert header.metadata == {"format": "pt"}
    for name, tensor in tensors.items():
        assert reference[name].dtype == tensor.dtype
        assert _raw(reference[name]) == _raw(tensor), name
        assert _raw(mapped[name]) == _raw(tensor), name
    # every tensor of a file written here starts aligned to its element size
    for e in header.entries:
        assert (header.data_start + e.start) % e.dtype.itemsize == 0


def test_a_reference_file_maps_without_a_copy(tmp_path: Path) -> None:
    path = tmp_path / "ref.safetensors"
    save_file({"w": torch.arange(1 << 16, dtype=torch.float32)}, path)
    header, mapped = map_file(path)
    assert torch.equal(mapped["w"], torch.arange(1 << 16, dtype=torch.float32))
    # a view of the file's pages, not a copy: a change to the file shows through (Linux
    # keeps a private mapping's untouched pages shared with the page cache)
    with open(path, "r+b") as f:
        f.seek(header.data_start)
        f.write(torch.tensor([-1.0]).numpy().tobytes())
    assert mapped["w"][0].item() == -1.0


_W = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"hello world, no weights here", "neither a safetensors file nor a torch state dict"),
        (struct.pack("<Q", 40) + b'{"w": {"dtype": "F32"}}', "not a safetensors file"),
        (struct.pack("<Q", 6) + b'{"w": ', "bad safetensors header: not JSON: "),
        (_W, "neither a safetensors file"),  # no length prefix
        (struct.pack("<Q", len(_W)) + _W + b"\0" * 8, "covers 16 data bytes, the file has 8"),
        (
            struct.pack("<Q", 54) + b'{"w":{"dtype":"Q9","shape":[4],"data_offsets":[0,16]}}',
            "unknown dtype",
        ),
    ],
)
def test_broken_files_are_named_before_anything_else(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(InvalidArgument, match=message):
        open_checkpoint(path)


def test_checkpoint_forms_and_their_refusals(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(4, 4), "b": torch.randn(3)}
    torch.save(tensors, tmp_path / "sd.pt")
    loaded = open_checkpoint(tmp_path / "sd.pt")
    assert loaded.kind == "torch"
    assert all(torch.equal(loaded.tensors[k], v) for k, v in tensors.items())
    torch.save({"step": 3, "model": tensors}, tmp_path / "nested.pt")
    with pytest.raises(InvalidArgument, match=r"its 'model' is one \(2 tensors\)"):
        open_checkpoint(tmp_path / "nested.pt")
    torch.save({"opt": io.BytesIO(b"x")}, tmp_path / "code.pt")
    with pytest.raises(InvalidArgument, match="weights_only"):
        open_checkpoint(tmp_path / "code.pt")
    (tmp_path / "dir").mkdir()
    with pytest.raises(InvalidArgument, match="not a save_pretrained directory"):
        open_checkpoint(tmp_path / "dir")
    save_file(tensors, tmp_path / "dir" / "model-1.safetensors")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (tmp_path / "dir" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidArgument, match=r"model-2\.safetensors', which does not exist"):
        open_checkpoint(tmp_path / "dir")
    index["weight_map"]["b"] = "model-1.safetensors"
    (tmp_path / "dir" / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "dir" / "config.json").write_text('{"model_type": "llama"}')
    found = open_checkpoint(tmp_path / "dir")
    assert found.kind == "save_pretrained"
    assert found.carried == {"config.json": b'{"model_type": "llama"}'}
    with pytest.raises(InvalidArgument, match="no such file"):
        open_checkpoint(tmp_path / "missing")


def test_carried_files_fit_the_metadata_bound_and_decode() -> None:
    config = json.dumps({"hidden_size": 32, "layers": list(range(200))}).encode()
    tokenizer = torch.randint(0, 255, (200_000,), dtype=torch.uint8).numpy().tobytes()
    metadata, carried = encode({"config.json": config, "tokenizer.json": tokenizer})
    check_metadata(metadata)  # the hub's own rule
    assert sum(len(k) + len(v) for k, v in metadata.items()) <= MAX_METADATA_BYTES
    assert set(carried.files) == {"config.json"}
    assert carried.left == {"tokenizer.json": len(tokenizer)}
    back = decode(metadata)
    assert back.files == {"config.json": config}
    assert back.left == {"tokenizer.json": len(tokenizer)}
    assert LEFT_KEY in metadata
    with pytest.raises(InvalidManifest):
        decode({FILE_KEY + "../etc/passwd": "z64:AAAA"})


def test_output_files_are_cut_as_save_pretrained_cuts_them() -> None:
    specs = [Spec(f"t{i}", torch.float32, (256,)) for i in range(10)]  # 1 KiB each
    assert [f.name for f in plan_files(specs, 1 << 20)] == ["model.safetensors"]
    files = plan_files(specs, 3000)  # two tensors fit, the third would not
    assert [len(f.specs) for f in files] == [2, 2, 2, 2, 2]
    assert files[0].name == "model-00001-of-00005.safetensors"
    big = plan_files([*specs[:2], Spec("huge", torch.float32, (4096,)), specs[2]], 3000)
    assert [[s.name for s in f.specs] for f in big] == [["t0", "t1"], ["huge"], ["t2"]]
    with pytest.raises(InvalidArgument):
        plan_files(specs, 0)


def test_pieces_cover_every_byte_once_in_file_order() -> None:
    specs = [Spec("w", torch.float32, (7, 3, 5)), Spec("v", torch.bfloat16, (11,))]
    files = plan_files(specs, 1 << 30)
    at = len(files[0].header)
    seen = {"w": 0, "v": 0}
    for piece in pieces(files, 24):  # smaller than one row of w: blocks within rows
        assert piece.at == at
        assert piece.nbytes <= 24 or piece.box.volume == 1
        at += piece.nbytes
        seen[piece.spec.name] += piece.box.volume
    assert at == files[0].nbytes
    assert seen == {"w": 7 * 3 * 5, "v": 11}


def test_batches_keep_their_staged_chunks_within_the_budget() -> None:
    tensors = {f"l{i}": torch.randn(64, 256) for i in range(8)}  # 64 KiB each
    layout = Layout.from_tensors(tensors, 16 << 10)
    manifest = manifest_of(HeldVersion.publisher("t", "m", 1, tensors, layout))
    files = plan_files([Spec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], 1 << 30)
    budget = 100 << 10
    plan = list(batches(list(pieces(files, budget // 2)), ChunkCost([manifest]), budget))
    assert all(b.staged <= budget for b in plan)
    assert sum(b.nbytes for b in plan) == sum(t.numel() * 4 for t in tensors.values())
    for b in plan:  # one block per tensor in a call
        assert len({p.spec.name for p in b.pieces}) == len(b.pieces)
    # chunks staged in all: at most one more per batch than the version has
    assert sum(b.staged for b in plan) <= (layout.num_chunks + len(plan)) * (16 << 10)


def test_sizes_and_budget() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("20KB") == 20_000
    assert parse_size("1234") == 1234
    with pytest.raises(InvalidArgument):
        parse_size("lots")
    assert batch_budget(10) == 8 << 20
    assert batch_budget(5 * 10**9) == 256 << 20
    for largest in (1 << 20, 12 << 20, 96 << 20, 1 << 30):  # 30 MiB of slack besides
        assert 3 * batch_budget(largest) + (30 << 20) <= largest + (64 << 20)


def test_progress_is_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Bar(4 << 20, "fetch m@1", stream=out, every=0.0) as bar:
        bar.advance(1 << 20)
        bar.reach(3 << 20)
        bar.reach(2 << 20)  # an older running total changes nothing
        bar.write("a note")
        bar.advance(1 << 20)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("fetch m@1:   0%")  # a log shows when it began
    assert lines[1].startswith("fetch m@1:  25%")
    assert "a note" in lines
    assert lines[-1].startswith("fetch m@1: 100%")
    assert "4.00M/4.00M" in lines[-1]
    assert math.isclose(bar.n, 4 << 20)
