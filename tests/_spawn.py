"""Run a function on ``world`` local gloo processes and collect what each rank returns.

``run_ranks(fn, world, directory, *args)`` spawns the processes, initializes a gloo process
group from a file in ``directory`` on each, calls ``fn(rank, world, *args)`` and returns the
list of their return values (anything ``torch.save`` can store). A rank's exception fails the
caller with that rank's traceback, and ranks still running after ``TIMEOUT`` seconds are killed
and fail it too.

The processes come from a fork server (where the platform has one): a single-threaded process
that imports torch and klest once and forks each rank from there, in milliseconds, where a
spawned rank imports them anew (about 1.5 CPU-seconds each). Forking the test's own process
would be as fast but copies its threads' locks (pytest-xdist's, torch's pools) in whatever
state they are: a fork server has none. Each rank builds its own gloo group.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 300.0
"""Seconds the ranks may take in all (the slowest run ranks finish in under 10)."""


def _entry(rank: int, world: int, directory: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{directory}/store", rank=rank, world_size=world
    )
    try:
        result: Any = {"value": fn(rank, world, *args)}
    except Exception:  # reported to the parent, which raises it
        result = {"traceback": traceback.format_exc()}
    torch.save(result, f"{directory}/out.{rank}")
    dist.destroy_process_group()


PRELOAD = ["torch", "torch.distributed", "klest"]
"""What the fork server imports once, before it forks any rank."""


def _start_method() -> str:
    """``"forkserver"`` where the platform has it (its server, single-threaded, imports
    ``PRELOAD`` once and forks the ranks from there), else ``"spawn"``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def start_ranks(entry: Callable, nprocs: int, args: tuple) -> None:
    """``entry(rank, *args)`` on ``nprocs`` processes (from the fork server, see above),
    joined; an error past ``TIMEOUT`` seconds."""
    context = mp.start_processes(
        entry, args=args, nprocs=nprocs, join=False, start_method=_start_method()
    )
    deadline = time.monotonic() + TIMEOUT
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"the {nprocs} ranks of {entry.__name__} ran past {TIMEOUT} s")


def run_ranks(fn: Callable, world: int, directory: Path, *args: Any) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each on its own process."""
    start_ranks(_entry, world, (world, str(directory), fn, args))
    results = []
    for rank in range(world):
        got = torch.load(directory / f"out.{rank}", weights_only=False)
        if "traceback" in got:
            raise AssertionError(f"rank {rank} failed:\n{got['traceback']}")
        results.append(got["value"])
    return results
