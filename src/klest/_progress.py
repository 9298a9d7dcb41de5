"""Progress reports for long runs: a tqdm bar on a terminal, plain lines everywhere else.

On a terminal with tqdm installed (the ``klest[experiments]`` extra) a bar is a tqdm bar. Without
tqdm, or when standard error is not a terminal (a log file, a pipe, CI), a bar writes plain lines
to standard error instead: one when it starts (``pitfalls: 0/354``), then at most one every
:data:`LINE_INTERVAL` seconds while it advances (``pitfalls: 37/354 (10%), 12 s``, with the
innermost running bar's count appended: ``| audit k3/score: 120/500``), and one when it ends
(``pitfalls: 354/354 done in 137 s``). A bar made with ``leave=False`` (an audit inside an
experiment) writes no start or end line: it only adds its count to the periodic lines.

tqdm is imported here, lazily, and nowhere else, so ``import klest`` never loads it.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["LINE_INTERVAL", "progress_bar"]

LINE_INTERVAL = 3.0
"""Seconds between two progress lines (no terminal, or no tqdm); the environment variable
``KLEST_PROGRESS_INTERVAL`` overrides it (0: a line at every update)."""

# The plain-line bars now running, outermost first (weak references: a bar dropped unclosed
# leaves with its last reference), and when the last line was written: one clock for all of
# them, so nested bars write no more often than one.
_RUNNING: list[weakref.ref[_Lines]] = []
_LAST_LINE = [0.0]


def _interval() -> float:
    value = os.environ.get("KLEST_PROGRESS_INTERVAL")
    if value is None:
        return LINE_INTERVAL
    try:
        return max(float(value), 0.0)
    except ValueError:
        raise ValueError(
            f"KLEST_PROGRESS_INTERVAL must be a number of seconds, got {value!r}"
        ) from None


def _running() -> list[_Lines]:
    """The plain-line bars now running, outermost first."""
    bars = [ref() for ref in _RUNNING]
    return [bar for bar in bars if bar is not None and not bar._closed]


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    return f"{int(s // 60)} min {s % 60:02.0f} s"


class _NoBar:
    """What :func:`progress_bar` returns without a bar: iterates, updates, closes; shows nothing."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        if self._iterable is None:
            raise TypeError("progress_bar() was given no iterable to iterate over")
        return iter(self._iterable)

    def update(self, n: int = 1) -> None:
        """Nothing to advance."""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Nothing to label."""

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Lines(_NoBar):
    """A bar that writes plain lines to ``sys.stderr`` (looked up at each write, so redirections
    and pytest's capture see them)."""

    def __init__(
        self, iterable: Iterable[Any] | None, *, desc: str, total: int | None, leave: bool
    ) -> None:
        super().__init__(iterable)
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.desc, self.total, self.n, self.leave = desc, total, 0, leave
        self.postfix = ""
        self._interval = _interval()
        self._start = time.monotonic()
        self._closed = False
        if not _running():
            _LAST_LINE[0] = self._start  # the first periodic line comes one interval in
        _RUNNING.append(weakref.ref(self))
        if leave:
            self._write(self._count())

    def _count(self) -> str:
        if self.total is None:
            return f"{self.desc}: {self.n}"
        return f"{self.desc}: {self.n}/{self.total}"

    def _state(self) -> str:
        text = self._count()
        if self.total:
            text += f" ({100 * self.n / self.total:.0f}%)"
        text += f", {_seconds(time.monotonic() - self._start)}"
        return text + (f" [{self.postfix}]" if self.postfix else "")

    def _write(self, line: str) -> None:
        _LAST_LINE[0] = time.monotonic()
        print(line, file=sys.stderr, flush=True)

    def _report(self) -> None:
        """A periodic line: the outermost running bar's state, then the innermost's count."""
        if time.monotonic() - _LAST_LINE[0] < self._interval:
            return
        running = _running() or [self]
        outer, inner = running[0], running[-1]
        line = outer._state()
        if inner is not outer:
            line += f" | {inner._count()}"
        self._write(line)

    def __iter__(self) -> Iterator[Any]:
        iterator = super().__iter__()  # raises now when there is no iterable

        def counted() -> Iterator[Any]:
            try:
                for item in iterator:
                    yield item
                    self.update()
            finally:
                self.close()

        return counted()

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units; write a line if :data:`LINE_INTERVAL` has passed."""
        self.n += n
        self._report()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """What the bar is doing now (shown in its lines)."""
        self.postfix = s

    def close(self) -> None:
        """Write the end line (``leave=True``) and stop reporting."""
        if self._closed:
            return
        self._closed = True
        _RUNNING[:] = [ref for ref in _RUNNING if ref() is not None and ref() is not self]
        if self.leave:
            self._write(f"{self._count()} done in {_seconds(time.monotonic() - self._start)}")

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: int | None = None,
    leave: bool = True,
    enabled: bool = True,
) -> Any:
    """A progress report over ``iterable`` (or a manual one of ``total`` steps, advanced by
    ``update``).

    When ``enabled``: a tqdm bar if standard error is a terminal and tqdm imports, else plain
    lines on standard error (see the module docstring). When not: a stand-in with the same
    ``__iter__`` / ``update`` / ``set_postfix_str`` / ``close`` / context-manager surface that
    shows nothing.
    """
    if not enabled:
        return _NoBar(iterable)
    if _on_terminal():
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(iterable, desc=desc, total=total, leave=leave)
    return _Lines(iterable, desc=desc, total=total, leave=leave)
