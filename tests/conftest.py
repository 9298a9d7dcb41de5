"""Shared test helpers.

Statistical tolerance rule used throughout: a Monte Carlo mean is compared with an exact answer
within ``Z`` standard errors, ``Z = 4`` (two-sided false-fail rate 6e-5 per comparison under the
normal approximation). Every statistical test draws through a fixed seed, so it is deterministic.
"""

from __future__ import annotations

import math

import torch

# Tests run as `pytest -n 2` on 2 cores: one intra-op thread per worker. More oversubscribes the
# cores, and OpenMP's spinning makes small ops ~1000x slower (measured: log_softmax on a
# [8, 4, 3] tensor took 8 ms with 2 threads under load, 9 us with 1).
torch.set_num_threads(1)

Z = 4.0


def assert_mean_close(draws: torch.Tensor, exact: float, *, z: float = Z, what: str = "") -> None:
    """Assert ``|mean(draws) - exact| <= z * std(draws) / sqrt(n)``."""
    draws = draws.detach().double().reshape(-1)
    n = draws.numel()
    mean = float(draws.mean())
    se = float(draws.std()) / math.sqrt(n)
    assert abs(mean - exact) <= z * se + 1e-12, (
        f"{what}: mean {mean:.6g} vs exact {exact:.6g}; |diff| = {abs(mean - exact):.3g} "
        f"> {z} se = {z * se:.3g} (n = {n})"
    )


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-300)).max())
