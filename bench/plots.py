"""One line chart of a bench's series, written as a PNG with the series in its text.

`bench fanout`, `bench reshard` and `bench delta --plot` draw the same kind of figure: one
line per series, x against y, with the numbers drawn also stored in the PNG's text (key
`tensorhub-series`, JSON) so that a test or a reader can check the figure without reading
pixels. matplotlib is imported here, on use, so a bench run without `--plot` never loads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

SERIES_KEY = "tensorhub-series"


def line_chart(
    path: Path,
    lines: Mapping[str, Mapping[int, float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    markers: str = "os^dv",
    log_y: bool = False,
    reference: tuple[float, str] | None = None,
    y_unit: float = 1.0,
) -> None:
    """Draw `lines` (label -> {x: y}) into a PNG at `path`, each y divided by `y_unit`, with
    `reference` as a dashed horizontal line (its y, already in that unit, and its label).
    The PNG's text stores `lines` as given, undivided."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (label, points), marker in zip(lines.items(), markers, strict=False):
        ax.plot(list(points), [y / y_unit for y in points.values()], marker=marker, label=label)
    if reference is not None:
        ax.axhline(reference[0], color="grey", linestyle="--", label=reference[1])
    if log_y:
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.set_xticks(sorted({x for points in lines.values() for x in points}))
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both" if log_y else "major")
    ax.legend()
    fig.tight_layout()
    text = json.dumps({label: {str(x): y for x, y in p.items()} for label, p in lines.items()})
    fig.savefig(path, format="png", metadata={SERIES_KEY: text})
    plt.close(fig)
