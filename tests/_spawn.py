"""Run a function on ``world`` local gloo processes and collect what each rank returns.

``run_ranks(fn, world, directory, *args)`` spawns the processes, initializes a gloo process
group from a file in ``directory`` on each, calls ``fn(rank, world, *args)`` and returns the
list of their return values (anything ``torch.save`` can store). A rank's exception fails the
caller with that rank's traceback.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def run_ranks(fn: Callable, world: int, directory: Path, *args: Any) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each on its own process."""
    mp.spawn(_entry, args=(world, str(directory), fn, args), nprocs=world)
    results = []
    for rank in range(world):
        got = torch.load(directory / f"out.{rank}", weights_only=False)
        if "traceback" in got:
            raise AssertionError(f"rank {rank} failed:\n{got['traceback']}")
        results.append(got["value"])
    return results
