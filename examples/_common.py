"""What every example shares: its command line and its ending (the convention of README.md)."""

from __future__ import annotations

import argparse
import sys


def parser(doc: str, *, quick: str) -> argparse.ArgumentParser:
    """A parser with ``--quick`` (``quick`` says what it runs) and ``--seed``, described by the
    first line of the example's docstring ``doc``."""
    p = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{quick} (under 30 s on 2 CPU cores)")
    p.add_argument("--seed", type=int, default=0, help="the seed of every random draw (default 0)")
    return p


def finish(result: str, failures: list[str]) -> int:
    """Each failure on stderr, then the last line, ``RESULT: as claimed: RESULT`` or
    ``RESULT: FAILED (n checks): RESULT``; the exit code (1 if anything failed)."""
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    verdict = f"FAILED ({len(failures)} checks)" if failures else "as claimed"
    print(f"RESULT: {verdict}: {result}")
    return 1 if failures else 0
