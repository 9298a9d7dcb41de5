"""Settings shared by the tests (helpers live in ``tests/_stats.py``, ``tests/_reference.py``
and ``tests/_testbeds.py``)."""

from __future__ import annotations

import gc

import torch
from hypothesis import settings

# Tests run as `pytest -n 2` on 2 cores: one intra-op thread per worker. More oversubscribes the
# cores, and OpenMP's spinning makes small ops ~1000x slower (measured: log_softmax on a
# [8, 4, 3] tensor took 8 ms with 2 threads under load, 9 us with 1).
torch.set_num_threads(1)

# Property tests draw their examples from a fixed seed, like every other test: a failure
# reproduces, and CI cannot pass or fail by the luck of the draw.
settings.register_profile("klest", derandomize=True, print_blob=True)
settings.load_profile("klest")


def pytest_collection_finish(session) -> None:
    """Move everything alive after collection (the imported modules: torch, transformers, TRL,
    verl, ...) out of the garbage collector's sight. ``gc.collect()`` then only walks what the
    tests create: TRL's and accelerate's trainers call it at every ``train()``, where walking
    the whole heap took most of a small training run's time."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config) -> None:
    """Hand the frozen objects back, so that the interpreter's exit frees them (extensions such
    as Triton's nanobind bindings report what is still alive then as leaks)."""
    gc.unfreeze()
