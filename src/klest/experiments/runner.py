"""What every experiment shares: its configuration, its report, and writing the report out.

An experiment is a thin function ``run(config) -> Report`` that calls the library and plots; it
holds no estimator logic. ``write_report`` puts ``result.json`` (all numbers), ``table.md`` and
one PNG per figure in the output directory.

Plotting needs matplotlib, an optional dependency (the ``klest[experiments]`` extra): it is
imported only through :func:`pyplot`, which says how to install it when it is missing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from types import ModuleType
from typing import Any

MISSING_MATPLOTLIB = (
    "the experiments plot with matplotlib, which is not installed; install the experiments' "
    "dependencies with: pip install 'klest[experiments]'"
)


FALSE_ALARM = 2 * NormalDist().cdf(-4.0)
"""The false-alarm rate of a whole table of significance flags: that of one two-sided
comparison at 4 standard errors (6.3e-5)."""


def table_threshold(comparisons: int, *, two_sided: bool = True) -> float:
    """The z threshold of each of ``comparisons`` normal comparisons in one table such that the
    table as a whole flags a correct estimator with probability at most :data:`FALSE_ALARM`
    (Bonferroni: the normal quantile at ``FALSE_ALARM / comparisons``, split over both tails
    when ``two_sided``).

    Example:
      >>> round(table_threshold(1), 6)  # one two-sided comparison: 4 standard errors
      4.0
      >>> round(table_threshold(30), 2), round(table_threshold(144, two_sided=False), 2)
      (4.74, 4.92)
    """
    if comparisons < 1:
        raise ValueError(f"need comparisons >= 1, got {comparisons}")
    return -NormalDist().inv_cdf(FALSE_ALARM / comparisons / (2 if two_sided else 1))


@dataclass(frozen=True)
class RunConfig:
    """How to run an experiment: ``quick`` is the small size CI runs."""

    quick: bool = False
    seed: int = 0
    progress: bool = True


@dataclass
class Report:
    """An experiment's output: JSON-able ``results``, a markdown ``table``, matplotlib figures."""

    results: dict[str, Any]
    table: str
    figures: dict[str, Any] = field(default_factory=dict)
    summary: str = ""


@dataclass(frozen=True)
class Experiment:
    """A registered experiment: ``klest run NAME`` calls ``run``."""

    name: str
    description: str
    run: Callable[[RunConfig], Report]


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (figures go to files).

    Raises:
      ImportError: matplotlib is not installed (the message names the extra to install).
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(MISSING_MATPLOTLIB) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Series colours: tab10's ten, then four chosen to stand apart from them, from black (left for
# references) and from white (each at least 39 CIELAB units from all of those; tab10's closest
# pair is 28 apart).
SERIES_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
    "#8000ff",
    "#000080",
    "#ff00ff",
    "#a6761d",
)
SERIES_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p", "d", "8")


def series_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A colour and a marker for each of ``names``, as matplotlib keyword arguments, no two
    alike: the 14 colours of :data:`SERIES_COLORS` with a marker each, then the same pairs again
    with a dotted line.

    Example:
      >>> styles = series_styles([f"s{i}" for i in range(15)])
      >>> len({(s["color"], s["marker"], s.get("ls", "-")) for s in styles.values()})
      15
    """
    out = {}
    for i, name in enumerate(names):
        k = i % len(SERIES_COLORS)
        style = {"color": SERIES_COLORS[k], "marker": SERIES_MARKERS[k]}
        if i >= len(SERIES_COLORS):
            style["ls"] = ":"
        out[name] = style
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "tolist"):
        return _jsonable(x.tolist())
    return x


def write_report(report: Report, out: Path) -> list[Path]:
    """Write ``result.json``, ``table.md`` and the figures as PNG; return the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "result.json", out / "table.md"]
    paths[0].write_text(json.dumps(_jsonable(report.results), indent=2) + "\n")
    paths[1].write_text(report.table)
    for name, fig in report.figures.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    if report.figures:
        plt = pyplot()
        for fig in report.figures.values():
            plt.close(fig)
    return paths


__all__ = [
    "FALSE_ALARM",
    "Experiment",
    "Report",
    "RunConfig",
    "pyplot",
    "series_styles",
    "table_threshold",
    "write_report",
]
