"""Statistics helpers of the statistical tests, and the rule they follow.

A Monte Carlo mean is compared with an exact answer within ``Z`` standard errors, ``Z = 4``: a
two-sided false-fail rate of 6.3e-5 per comparison under the normal approximation. Every
statistical test draws through a fixed seed, so it is deterministic; the rate says how likely a
correct estimator is to fail at a seed chosen blindly.
"""

from __future__ import annotations

import math

import torch

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
