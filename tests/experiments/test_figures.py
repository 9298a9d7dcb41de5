"""The figure check the experiments' runs go through (tests/_figures.py) on figures built to
have, or not have, each fault it names: overlapping tick labels, two legend entries drawn alike, a
legend over the data. Deterministic: each figure either has the fault or does not."""

from __future__ import annotations

import numpy as np
import pytest

from klest.experiments.runner import pyplot, series_styles
from tests._figures import assert_readable


@pytest.fixture
def plt():
    plt = pyplot()
    yield plt
    plt.close("all")


def _curves(ax, n: int = 3, **style) -> None:
    x = np.linspace(0, 1, 50)
    styles = series_styles([f"s{i}" for i in range(n)])
    for i in range(n):
        ax.plot(x, x + i, label=f"s{i}", **{**styles[f"s{i}"], **style})


def test_a_clean_figure_passes(plt):
    """Legend outside the axes, distinct styles, default ticks: no complaint."""
    fig, ax = plt.subplots(layout="constrained")
    _curves(ax)
    fig.legend(loc="outside right upper")
    assert_readable(fig, "clean")


def test_a_legend_off_the_data_inside_the_axes_passes(plt):
    """A legend inside the axes, in an empty corner, covers no data."""
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 0.1], label="low")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper right")
    assert_readable(fig, "corner")


def test_a_legend_over_the_data_fails(plt):
    """A line crossing the legend's box between two of its points still counts."""
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0.97, 0.97], label="high")  # two points, both outside the box
    ax.set_ylim(0, 1)
    ax.legend(loc="upper center")
    with pytest.raises(AssertionError, match="covers"):
        assert_readable(fig, "over")


def test_a_legend_over_error_bars_fails(plt):
    fig, ax = plt.subplots()
    ax.errorbar([0.5], [0.5], yerr=[0.5], fmt="none", label="bar")
    ax.set(xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="center")
    with pytest.raises(AssertionError, match="covers"):
        assert_readable(fig, "errorbar")


def test_two_entries_alike_fail_even_with_different_dashes(plt):
    """The same colour and marker, told apart only by dashes, is one look."""
    fig, ax = plt.subplots(layout="constrained")
    ax.plot([0, 1], [0, 1], "o-", color="tab:blue", label="a")
    ax.plot([0, 1], [1, 2], "o--", color="tab:blue", label="b")
    fig.legend(loc="outside right upper")
    with pytest.raises(AssertionError, match="'a' and 'b' are drawn alike"):
        assert_readable(fig, "alike")


def test_overlapping_tick_labels_fail(plt):
    """Matplotlib labels the minor ticks of a log axis spanning less than two decades (here
    2 to 64): in a narrow axes they run into each other."""
    fig, ax = plt.subplots(figsize=(2.5, 2.5))
    ax.plot([2, 64], [1, 2])
    ax.set_xscale("log")
    with pytest.raises(AssertionError, match="tick labels"):
        assert_readable(fig, "ticks")


def test_scatter_entries_differ_by_marker_or_colour(plt):
    """Grey markers of different shapes are different entries; the same shape is not."""
    fig, ax = plt.subplots(layout="constrained")
    for label, marker in (("circle", "o"), ("square", "s")):
        ax.scatter([], [], color="gray", marker=marker, label=label)
    fig.legend(loc="outside right upper")
    assert_readable(fig, "shapes")
    ax.scatter([], [], color="gray", marker="s", label="square again")
    fig.legend(loc="outside right lower")
    with pytest.raises(AssertionError, match="'square' and 'square again' are drawn alike"):
        assert_readable(fig, "same shape")
