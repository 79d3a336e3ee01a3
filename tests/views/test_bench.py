"""The harness of `python -m bench.views` on the tiny model (no figures asserted: times are
not tested): it makes each view, counts what it made, and reports against the targets."""

from __future__ import annotations

import pytest

from bench import views
from bench.emu import training


def test_the_bench_reports_each_format() -> None:
    args = views.parser().parse_args(["--tiny", "--no-emulation", "--repeat", "1"])
    res = views.run(args)
    assert res.command == "python -m bench.views --tiny --no-emulation"
    names = {f.name: f for f in res.figures}
    spec = training.TINY
    h, i = spec.hidden, spec.intermediate
    linear = spec.layers * (4 * h * h + 3 * h * i)  # the elements a view quantizes
    made = res.details["formats"]
    assert made["fp8-block128"]["view_bytes_made"] == linear + 4 * spec.layers * (
        4 * (h // 128) * (h // 128) + 3 * (i // 128) * (h // 128)
    )
    assert made["mxfp8"]["view_bytes_made"] == linear + linear // 32
    for fmt in ("fp8-block128", "mxfp8"):
        assert names[f"{fmt}: quantize / one transfer"].target == "<= 0.5"
        assert names[f"{fmt}: peak added memory / model"].target == "<= 0.5"
        assert names[f"{fmt}: quantize time"].value is not None
    transfer = res.details["one_transfer_s"]
    assert transfer == pytest.approx(spec.nbytes * 8 / 200e6, abs=1e-3)
    assert res.details["link"]["how"].startswith("computed")
