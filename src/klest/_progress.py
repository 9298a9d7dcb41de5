"""Progress bars: tqdm's when it is installed and asked for, else a silent stand-in.

tqdm is an optional dependency (the ``klest[experiments]`` extra): it is imported here, lazily,
and nowhere else, so ``import klest`` never loads it and a missing tqdm only means no bar.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


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

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: int | None = None,
    leave: bool = True,
    enabled: bool = True,
) -> Any:
    """A tqdm bar over ``iterable`` (or a manual one of ``total`` steps, advanced by ``update``).

    Shown only when ``enabled``, tqdm imports and the output is a terminal (tqdm's
    ``disable=None``); otherwise a stand-in with the same ``__iter__`` / ``update`` / ``close`` /
    context-manager surface that shows nothing.
    """
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(iterable, desc=desc, total=total, leave=leave, disable=None)
    return _NoBar(iterable)
