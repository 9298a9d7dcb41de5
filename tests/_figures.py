"""What a reader trips on in a figure, checked on the drawn matplotlib figure (Agg, the
renderer ``write_report`` saves with): tick labels drawn over each other, two entries of one
legend drawn alike (same colour, marker and fill: dashes alone do not tell series apart), a
legend drawn over the data.

"Over the data" means a point of a data line, marker, band outline or bar edge, sampled every
pixel along each segment and inside its axes (clipped points are not drawn), lies strictly inside
the legend's box. Lines spanning the axes (``axhline``, ``axvline``: reference lines, not data)
are not data here. A pixel is the unit of every comparison: no threshold to tune.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import combinations
from typing import Any
from unittest import mock

import numpy as np
from matplotlib.collections import Collection, PathCollection
from matplotlib.colors import to_hex
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import Bbox


def _inside(points: np.ndarray, box: Bbox) -> np.ndarray:
    return (
        (points[:, 0] > box.x0)
        & (points[:, 0] < box.x1)
        & (points[:, 1] > box.y0)
        & (points[:, 1] < box.y1)
    )


def _along(points: np.ndarray) -> np.ndarray:
    """``points`` (display pixels, one polyline) with a point at least every pixel between
    consecutive ones, non-finite points dropped."""
    points = points[np.isfinite(points).all(1)]
    if len(points) < 2:
        return points
    steps = np.maximum(np.ceil(np.abs(np.diff(points, axis=0)).max(1)), 1).astype(int)
    t = np.concatenate([np.arange(n) / n for n in steps])
    start = np.repeat(points[:-1], steps, axis=0)
    delta = np.repeat(np.diff(points, axis=0), steps, axis=0)
    return np.concatenate([start + t[:, None] * delta, points[-1:]])


def _data_points(ax: Any) -> np.ndarray:
    """Every drawn data point of ``ax`` in display pixels, inside the axes."""
    polylines = []
    for line in ax.lines:
        if line.get_visible() and line.get_transform() is ax.transData:
            xy = line.get_transform().transform(line.get_xydata())
            polylines.append(_along(xy) if line.get_linestyle() not in ("None", "") else xy)
    for coll in ax.collections:
        if not isinstance(coll, Collection) or not coll.get_visible():
            continue
        if isinstance(coll, PathCollection):  # markers (scatter)
            polylines.append(coll.get_offset_transform().transform(coll.get_offsets()))
        else:  # bands, error bars: their outlines
            transform = coll.get_transform()
            polylines += [_along(transform.transform(p.vertices)) for p in coll.get_paths()]
    for patch in ax.patches:
        if patch.get_visible():
            polylines.append(_along(patch.get_verts()))
    if not polylines:
        return np.zeros((0, 2))
    points = np.concatenate([p for p in polylines if len(p)] or [np.zeros((0, 2))])
    return points[_inside(points, ax.get_window_extent())]


def _style(handle: Any) -> tuple:
    """How a legend entry is drawn."""
    if isinstance(handle, Line2D):
        marker = handle.get_marker()
        filled = to_hex(handle.get_markerfacecolor(), keep_alpha=True) != "#00000000"
        # Not the line style: two series told apart only by dashes are hard to follow.
        return (
            "line",
            to_hex(handle.get_color()),
            marker if marker not in ("", " ", "None", None) else "none",
            filled and marker not in ("", " ", "None", None),
        )
    if isinstance(handle, Patch):
        return (
            "patch",
            to_hex(handle.get_facecolor(), keep_alpha=True),
            to_hex(handle.get_edgecolor(), keep_alpha=True),
            handle.get_hatch(),
            handle.get_linestyle(),
        )
    if isinstance(handle, Collection):  # error bars; scatter markers, by their shape too
        return (
            "collection",
            tuple(to_hex(c, keep_alpha=True) for c in handle.get_facecolor()),
            tuple(to_hex(c, keep_alpha=True) for c in handle.get_edgecolor()),
            tuple(p.vertices.round(3).tobytes() for p in handle.get_paths()),
        )
    return (type(handle).__name__, id(handle))


def _legends(fig: Any) -> list:
    return [leg for ax in fig.axes if (leg := ax.get_legend())] + list(fig.legends)


def assert_readable(fig: Any, name: str) -> None:
    """No two tick labels of an axis overlap, no two entries of a legend look alike, and no
    legend covers a data point (see the module docstring). ``name`` labels the failure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible() or not ax.axison:
            continue
        for axis in (ax.xaxis, ax.yaxis):
            labels = [
                t
                for t in axis.get_majorticklabels() + axis.get_minorticklabels()
                if t.get_visible() and t.get_text()
            ]
            boxes = [t.get_window_extent(renderer) for t in labels]
            for (a, ta), (b, tb) in combinations(zip(boxes, labels, strict=True), 2):
                overlap = Bbox.intersection(a, b)
                assert overlap is None or min(overlap.width, overlap.height) <= 1, (
                    f"{name}: axes {i} ({ax.get_title()!r}): tick labels "
                    f"{ta.get_text()!r} and {tb.get_text()!r} overlap"
                )
    for legend in _legends(fig):
        entries = [t.get_text() for t in legend.get_texts()]
        styles = [_style(h) for h in legend.legend_handles]
        for (sa, ea), (sb, eb) in combinations(zip(styles, entries, strict=True), 2):
            assert sa != sb, f"{name}: legend entries {ea!r} and {eb!r} are drawn alike: {sa}"
        box = legend.get_window_extent(renderer)
        for i, ax in enumerate(fig.axes):
            if Bbox.intersection(box, ax.get_window_extent()) is None:
                continue
            covered = _inside(_data_points(ax), box)
            assert not covered.any(), (
                f"{name}: the legend ({', '.join(entries)}) covers {int(covered.sum())} pixels "
                f"of data in axes {i} ({ax.get_title()!r})"
            )


@contextmanager
def figures_checked():
    """In the block, each report ``klest run`` writes has its figures checked by
    :func:`assert_readable` first."""
    import klest.experiments

    write = klest.experiments.write_report

    def checked(report, out):
        for key, fig in report.figures.items():
            assert_readable(fig, f"{out.name}/{key}")
        return write(report, out)

    with mock.patch.object(klest.experiments, "write_report", checked):
        yield
