"""What the benchmark scripts share: the command line, writing the JSON (every run kept), CUDA
timers.

The scripts in this folder are run as ``python benchmarks/NAME.py``, which puts this folder on
``sys.path``: they import this module as ``_common``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """``--quick`` and ``--out DIR`` (default ``benchmarks/results``), described by ``doc``."""
    ap = argparse.ArgumentParser(
        description=(doc or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument(
        "--out", type=Path, default=RESULTS, help=f"output directory (default {RESULTS})"
    )
    return ap


def write_report(name: str, report: dict, table: str, out: Path) -> Path:
    """Write ``out/NAME.json`` (this run) and append it as one line of ``out/NAME.runs.jsonl``
    (every run is kept, so ranges over runs can be recomputed from the files), each stamped with
    the commit measured and the time; print the table and the path written; return the path."""
    report.setdefault("commit", source_commit())
    report.setdefault("time", time.strftime("%Y-%m-%d %H:%M:%S"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2))
    with (out / f"{name}.runs.jsonl").open("a") as f:
        f.write(json.dumps(report) + "\n")
    print(table)
    print(f"\nwrote {path} (and appended the run to {name}.runs.jsonl)")
    return path


def time_cuda(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup``, timed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy (the roofline's rate)."""
    src = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def source_commit() -> str | None:
    """The git commit of the code being measured, with ``+dirty`` when the tree has changes
    outside ``benchmarks/results`` (None outside a git checkout): runs in a ``.runs.jsonl``
    file are then traceable."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return None
    return commit + (
        "+dirty"
        if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
        else ""
    )
