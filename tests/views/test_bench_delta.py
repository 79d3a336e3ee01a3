"""The harness of `tensorhub bench delta --view` on the tiny model (no figure asserted: the
outcome is a finding): what it counts, checked against the codec and the views directly."""

from __future__ import annotations

import torch

from bench import view_delta
from ros.views import make_view
from transport import delta as codec


def test_delta_bytes_are_the_codecs_encodings_or_the_chunks_whole() -> None:
    g = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(512, 256, generator=g).to(torch.bfloat16)}
    same = view_delta.delta_bytes(base, {"a": base["a"].clone()}, 64 << 10)
    assert 0 < same < 100  # 4 chunks of nothing changed: a few bytes each
    noise = {"a": torch.randn(512, 256, generator=g).to(torch.bfloat16)}
    assert view_delta.delta_bytes(base, noise, 64 << 10) == 512 * 256 * 2  # all whole
    moved = {"a": base["a"].clone()}
    moved["a"][0, :8] += 1.0  # one chunk changed in 8 words
    one = codec.encode([base["a"].view(torch.uint8).reshape(-1)[: 64 << 10]],
                       [moved["a"].view(torch.uint8).reshape(-1)[: 64 << 10]])  # fmt: skip
    assert one is not None
    assert view_delta.delta_bytes(base, moved, 64 << 10) == len(one) + 3 * (same // 4)


def test_changed_share_counts_scales_and_e4m3_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    w = {"m.q_proj.weight": (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)}
    before, _ = make_view(w, "fp8-block128")
    w2 = {"m.q_proj.weight": w["m.q_proj.weight"].clone()}
    w2["m.q_proj.weight"][0, 0] = 1.0  # a new amax in block (0, 0): its scale and its codes
    after, _ = make_view(w2, "fp8-block128")
    scales, elements = view_delta.changed_share(before, after, ".weight_scale_inv")
    assert scales == 1 / 4
    assert 0 < elements < 1 / 4 + 1e-9  # only block (0, 0)'s codes can have moved


def test_the_bench_reports_each_learning_rate() -> None:
    args = view_delta.parser().parse_args(
        ["--view", "mxfp8", "--tiny", "--steps", "1", "--lrs", "1e-4"]
    )
    res = view_delta.run(args)
    assert res.command == "tensorhub bench delta --view mxfp8 --steps 1 --tiny"
    names = {f.name for f in res.figures}
    assert "lr 0.0001: view delta / view whole" in names
    assert "lr 0.0001: scales changed per step" in names
    (step,) = res.details["runs"]["lr 0.0001"]["steps"]
    assert 0 < step["view_delta_bytes"] <= step["view_bytes"]
    assert 0 <= step["scales_changed"] <= 1
