"""`tensorhub bench fanout --plot`: the PNG is a valid image with every series drawn.

The plot is drawn from a result's details (what a run records, and what `--json` writes),
so this needs no emulated hosts: a result with the shape `bench.fanout.run` makes is drawn,
read back as an image, and its embedded series compared with the figures. `bench delta
--plot`'s is tested in tests/bench/test_delta_bench.py.
"""

from __future__ import annotations

import argparse
import json
import struct
import zlib
from pathlib import Path

import pytest

from bench import fanout
from bench.cli import run as bench_run
from bench.report import Result
from tensorhub.errors import InvalidArgument

PNG = b"\x89PNG\r\n\x1a\n"


def chunks(data: bytes) -> dict[bytes, list[bytes]]:
    """The PNG's chunks by type, each CRC checked."""
    assert data.startswith(PNG)
    found: dict[bytes, list[bytes]] = {}
    at = len(PNG)
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        found.setdefault(kind, []).append(body)
        at += 12 + length
    return found


def result() -> Result:
    res = Result("fanout", "tensorhub bench fanout")
    res.details = {
        "tensorhub_T": {1: 1.4, 2: 1.5, 4: 1.6, 8: 1.7},
        "param_server_T": {1: 1.4, 2: 2.8, 4: 5.5, 8: 11.0},
        "gloo_T": {"1": 1.5, "2": 2.9, "4": 4.4, "8": 6.1},  # as read back from --json
        "bytes": 32 << 20,
    }
    return res


def test_the_fanout_plot_is_a_png_with_every_series(tmp_path: Path) -> None:
    path = tmp_path / "fanout.png"
    drawn = fanout.plot(result(), path)
    found = chunks(path.read_bytes())
    (ihdr,) = found[b"IHDR"]
    width, height = struct.unpack(">II", ihdr[:8])
    assert width > 300
    assert height > 200
    assert found[b"IEND"] == [b""]
    texts = dict(t.split(b"\0", 1) for t in found[b"tEXt"])
    embedded = json.loads(texts[b"tensorhub-series"])
    assert set(embedded) == {"TensorHub", "parameter server", "gloo broadcast"}
    assert embedded["parameter server"] == {"1": 1.4, "2": 2.8, "4": 5.5, "8": 11.0}
    assert drawn["gloo broadcast"] == {1: 1.5, 2: 2.9, 4: 4.4, 8: 6.1}
    import matplotlib.image

    pixels = matplotlib.image.imread(path)  # decodes: a real image, not only a header
    assert pixels.shape[:2] == (height, width)
    assert pixels[..., :3].std() > 0.05  # something is drawn on it


def test_plot_is_refused_before_a_run_that_could_not_write_it(tmp_path: Path) -> None:
    args = argparse.Namespace(name="fanout", rest=["--plot", str(tmp_path / "nodir" / "f.png")])
    with pytest.raises(InvalidArgument, match="is not a directory"):
        bench_run(args)
