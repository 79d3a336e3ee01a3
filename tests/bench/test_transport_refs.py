"""`tensorhub bench transport`'s references: the C one (`bench.iperf`: parsing iperf3's JSON
report, the skip path where iperf3 is missing, a real iperf3 run) and NIXL's
(`bench.transport_nixl`: its rows where NIXL is installed, the note where it is not, a
chunk that fails verification), and the bench's table either way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench import iperf, transport, transport_nixl
from tensorhub.errors import IntegrityError, InvalidArgument
from transport.layout import Layout
from transport.nixl.loader import unavailable_reason

_NIXL_WHY = unavailable_reason()
needs_nixl = pytest.mark.skipif(_NIXL_WHY is not None, reason=f"NIXL unavailable: {_NIXL_WHY}")
NIXL_ROWS = (
    "NIXL-tcp / plain socket (1 conn)",
    "NIXL-cma / memcpy",
    "NIXL-tcp (1 conn)",
    "NIXL-cma (1 conn)",
    "memcpy, one process, 1 thread",
)

REPORT = {
    "start": {"test_start": {"num_streams": 2, "zerocopy": 1, "blksize": 4194304}},
    "intervals": [],
    "end": {
        "sum_sent": {"seconds": 1.0, "bytes": 6_000_000_000, "bits_per_second": 4.8e10},
        "sum_received": {"seconds": 1.0, "bytes": 5_900_000_000, "bits_per_second": 4.72e10},
    },
}


def test_the_rate_is_the_receivers_bytes_per_second() -> None:
    assert iperf.parse_rate(json.dumps(REPORT)) == pytest.approx(5.9e9)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (json.dumps({"start": {}, "end": {}, "error": "unable to connect to server"}),
         "unable to connect"),
        (json.dumps({"start": {}, "end": {}}), "sum_received"),
        ("iperf3: error - unknown option", "no JSON report"),
        ("[]", "not a JSON object"),
    ],
)  # fmt: skip
def test_a_failed_or_odd_report_names_why(text: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        iperf.parse_rate(text)


def test_a_capped_block_size_is_read_from_iperf3s_refusal() -> None:
    refusal = "iperf3: parameter error - block size too large (maximum = 1048576 bytes)\n"
    assert iperf.max_block(refusal + "\nUsage: iperf3 [-s|-c host] [options]") == 1 << 20
    assert iperf.max_block(json.dumps(REPORT)) is None


def test_without_iperf3_the_reference_is_skipped_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with iperf.Iperf3() as ref:
        assert ref.measure(1) is None
    assert ref.note == iperf.NOT_INSTALLED


def test_the_bench_runs_without_iperf3_or_nixl_and_prints_its_target(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(transport_nixl, "unavailable_reason", lambda: "NIXL is not installed")
    assert transport.main(["--size-mb", "8", "--repeat", "1", "--parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert iperf.NOT_INSTALLED in out
    assert out.count("NIXL rows skipped") == 1
    assert "note: NIXL rows skipped: NIXL is not installed" in out
    assert not any(row in out for row in NIXL_ROWS)
    for conns in ("1 conn", "2 conns"):
        assert f"TensorHub / better reference ({conns})" in out
        assert f"TensorHub / iperf3 ({conns})" in out
    assert ">= 0.9" in out


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")
def test_a_real_iperf3_run_over_loopback() -> None:
    with iperf.Iperf3(seconds=1) as ref:
        one, two = ref.measure(1), ref.measure(2)
    assert ref.note == ""
    assert ref.block <= iperf.BLOCK  # clamped where the binary caps -l (Debian 12: 1 MiB)
    assert {flags for flags, _ in ref.rates} == {ref.flags(True), ref.flags(False)}
    assert one is not None
    assert two is not None
    assert min(one, two) > 1e8  # well above 100 MB/s on any loopback


@needs_nixl
def test_the_nixl_rows_are_measured_in_the_same_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no iperf3: a shorter run
    report = tmp_path / "transport.json"
    argv = ["--size-mb", "8", "--repeat", "1", "--parallel", "1", "--json", str(report)]
    assert transport.main(argv) == 0
    out = capsys.readouterr().out
    assert "NIXL rows skipped" not in out
    figures = {f["name"]: f for f in json.loads(report.read_text())["figures"]}
    for row in NIXL_ROWS:
        assert figures[row]["value"] > 0, row
        assert figures[row]["target"] == "", row  # figures, not targets
        assert figures[row]["ok"] is None, row
    details = json.loads(report.read_text())["details"]
    chunks = Layout.from_tensors(transport._model(8), chunk_size=4 * transport.MiB).num_chunks
    for mode in ("tcp", "cma"):
        assert details["nixl"][mode]["chunks_verified"] == 1 + chunks  # warm-up + one read
        assert details["nixl"][mode]["ucx"] == transport_nixl.UCX[mode]
    assert details["nixl_note"] == ""


@needs_nixl
def test_a_nixl_chunk_that_fails_verification_fails_the_bench(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The holder serves the model, but the manifest the reader checks it against says
    otherwise for one chunk: the read is CORRUPT, and the bench raises, naming it."""
    monkeypatch.setattr(transport_nixl, "UCX", {"cma": transport_nixl.UCX["cma"]})
    layout = Layout.from_tensors(transport._model(4), chunk_size=1 << 20)
    into = {k: t.zero_() for k, t in layout.allocate().items()}
    src = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    with transport_nixl.Nixl(transport._model, 4, layout, into, src) as nixl:
        nixl._modes[0].expected[1] ^= 1
        with pytest.raises(IntegrityError, match=r"NIXL-cma read \d+ chunks: corrupt 1, done 1"):
            nixl.measure()
