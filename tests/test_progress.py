"""Progress reports (klest._progress): a tqdm bar on a terminal, plain lines on standard error
elsewhere, one per update when the interval is 0. No timing: the interval is 0 (a line at every
update) or larger than any test (only the start and end lines)."""

from __future__ import annotations

import io
import sys

import pytest

from klest import _progress
from klest._progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_lines_report_every_update_at_interval_zero(monkeypatch, capsys):
    """A bar of 4 units updated one at a time: a start line, one line per unit, an end line."""
    monkeypatch.setenv("KLEST_PROGRESS_INTERVAL", "0")
    with progress_bar(total=4, desc="work") as bar:
        for _ in range(4):
            bar.update()
    lines = _lines(capsys)
    assert lines[0] == "work: 0/4"
    assert [line.split(",")[0] for line in lines[1:5]] == [
        "work: 1/4 (25%)",
        "work: 2/4 (50%)",
        "work: 3/4 (75%)",
        "work: 4/4 (100%)",
    ]
    assert lines[5].startswith("work: 4/4 done in ") and len(lines) == 6


def test_an_inner_bar_adds_its_count_to_the_outer_bars_lines(monkeypatch, capsys):
    """An audit's bar (leave=False) inside an experiment's: no start or end line of its own; its
    count follows the outer bar's state, and the postfix says what runs."""
    monkeypatch.setenv("KLEST_PROGRESS_INTERVAL", "0")
    with progress_bar(total=2, desc="outer") as bar:
        bar.set_postfix_str("stage one")
        assert list(progress_bar(range(3), desc="inner", leave=False)) == [0, 1, 2]
        bar.update(2)
    lines = _lines(capsys)
    assert lines[0] == "outer: 0/2"
    assert [line.split(" | ")[-1] for line in lines[1:4]] == [
        "inner: 1/3",
        "inner: 2/3",
        "inner: 3/3",
    ]
    assert all(line.startswith("outer: 0/2 (0%)") for line in lines[1:4])
    assert "[stage one]" in lines[1] and lines[4].startswith("outer: 2/2 (100%)")
    assert lines[5].startswith("outer: 2/2 done in ") and len(lines) == 6


def test_lines_are_throttled_to_the_interval(monkeypatch, capsys):
    """With an interval longer than the test, only the start and end lines; an iterable bar
    counts its items."""
    monkeypatch.setenv("KLEST_PROGRESS_INTERVAL", "1e9")
    assert list(progress_bar(range(1000), desc="long")) == list(range(1000))
    lines = _lines(capsys)
    assert len(lines) == 2 and lines[0] == "long: 0/1000"
    assert lines[1].startswith("long: 1000/1000 done in ")


def test_a_short_inner_bar_alone_writes_nothing(capsys):
    """An audit run on its own (leave=False) finishing within the interval prints nothing."""
    assert list(progress_bar(range(3), desc="audit", leave=False)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_disabled_bars_write_nothing(monkeypatch, capsys):
    monkeypatch.setenv("KLEST_PROGRESS_INTERVAL", "0")
    with progress_bar(total=2, desc="x", enabled=False) as bar:
        bar.update(2)
        bar.set_postfix_str("y")
    assert list(progress_bar(range(2), desc="x", enabled=False)) == [0, 1]
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_tqdm_and_without_tqdm_lines(monkeypatch):
    tqdm = pytest.importorskip("tqdm.auto").tqdm
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = progress_bar(range(3), desc="x")
    assert isinstance(bar, tqdm) and list(bar) == [0, 1, 2]
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `from tqdm.auto import ...` now fails
    bar = progress_bar(range(3), desc="x")
    assert isinstance(bar, _progress._Lines) and list(bar) == [0, 1, 2]
    assert "x: 0/3\nx: 3/3 done in " in sys.stderr.getvalue()  # after the tqdm bar


def test_bad_interval_names_the_variable(monkeypatch):
    monkeypatch.setenv("KLEST_PROGRESS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="KLEST_PROGRESS_INTERVAL"):
        progress_bar(total=1, desc="x")
