"""Reading the progress lines a run writes to standard error with KLEST_PROGRESS_INTERVAL=0
(a line at every update): did the bar named ``desc`` report each of its units?"""

from __future__ import annotations

import re


def assert_reports_every_unit(stderr: str, desc: str) -> int:
    """The bar ``desc`` started (``desc: 0/T``), wrote a line at each count 1..T (its lines,
    and those of audits nested in it, begin with its count) and ended (``desc: T/T done``).
    Returns T."""
    lines = [line for line in stderr.splitlines() if line.startswith(f"{desc}: ")]
    assert lines, f"no progress line of {desc!r} in:\n{stderr[-2000:]}"
    start = re.fullmatch(rf"{re.escape(desc)}: 0/(\d+)", lines[0])
    assert start, lines[0]
    total = int(start[1])
    counts = [int(m[1]) for line in lines[1:-1] if (m := re.match(rf".*?: (\d+)/{total} ", line))]
    assert len(counts) == len(lines) - 2, lines[:20]
    # Each count 1..T once at least (an audit nested in the bar adds lines at the same count,
    # 0 included), in order.
    missing = set(range(1, total + 1)) - set(counts)
    assert not missing and min(counts) >= 0, f"{desc}: no line at {sorted(missing)[:20]}"
    assert counts == sorted(counts), f"{desc}: counts out of order"
    assert lines[-1].startswith(f"{desc}: {total}/{total} done in "), lines[-1]
    return total
