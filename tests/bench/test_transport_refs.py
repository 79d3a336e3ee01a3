"""`tensorhub bench transport`'s C reference (`bench.iperf`): parsing iperf3's JSON report,
the skip path where iperf3 is missing, a real iperf3 run, and the bench's table either way."""

from __future__ import annotations

import json
import shutil

import pytest

from bench import iperf, transport
from tensorhub.errors import InvalidArgument

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


def test_the_bench_runs_without_iperf3_and_prints_its_target(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert transport.main(["--size-mb", "8", "--repeat", "1", "--parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert iperf.NOT_INSTALLED in out
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
