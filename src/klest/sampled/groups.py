"""Group ids of the rows (the samples of one prompt) as keys, sizes and positions.

Baselines and fitted coefficients pool the rows of a group. A group id per row becomes a *key*:
the index of the first row of its group, so ``index_add_`` into ``rows`` bins pools each group.
Everything here runs on the device with no host synchronisation (no ``torch.unique``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_keys", "group_sizes", "position_in_group"]


def group_keys(group: Tensor) -> Tensor:
    """For each row, the index of the first row of its group: ``[rows]`` keys in ``[0, rows)``.

    Rows with equal ids share a key. Computed by a stable sort: each run of equal ids in sorted
    order starts at a row whose original index is the group's first.
    """
    rows = group.numel()
    if rows == 0:
        return group.to(torch.int64)
    sorted_ids, order = torch.sort(group.reshape(-1), stable=True)
    starts = torch.ones(rows, dtype=torch.bool, device=group.device)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    positions = torch.arange(rows, device=group.device)
    start_of = torch.cummax(torch.where(starts, positions, 0), 0).values
    keys = torch.empty_like(order)
    keys[order] = order[start_of]
    return keys


def group_sizes(keys: Tensor) -> Tensor:
    """How many rows share each row's group, ``[rows]``."""
    ones = torch.ones_like(keys, dtype=torch.int64)
    return torch.zeros_like(ones).index_add_(0, keys, ones)[keys]


def position_in_group(keys: Tensor, counted: Tensor | None = None) -> Tensor:
    """0, 1, 2, ... for the rows of each group (rows sharing a key), in row order.

    ``counted`` (bool ``[rows]``): only these rows are numbered within their group; the others
    (empty rows) are numbered apart, so that a padding row changes no other row's number.
    """
    if counted is not None:
        keys = torch.where(counted, keys, keys + keys.numel())
    sorted_keys, order = torch.sort(keys, stable=True)
    first = torch.searchsorted(sorted_keys, sorted_keys, right=False)
    pos = torch.empty_like(keys)
    pos[order] = torch.arange(keys.numel(), device=keys.device) - first
    return pos
