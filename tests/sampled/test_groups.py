"""Group ids as keys and sizes, against the first row of each group found by a loop."""

from __future__ import annotations

import torch

from klest.sampled.groups import group_keys, group_sizes
from klest.testbeds import make_generator


def test_group_keys_and_sizes():
    group = torch.tensor([7, 2, 7, 7, 4, 2])
    keys = group_keys(group)
    assert keys.tolist() == [0, 1, 0, 0, 4, 1]  # the first row of each group
    assert group_sizes(keys).tolist() == [3, 2, 3, 3, 1, 2]
    assert group_keys(torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_group_keys_of_small_and_large_batches_are_each_groups_first_row():
    """Up to 1024 rows the keys come from a table of equal ids, above it from a sort."""
    g = make_generator(3)
    for rows in (5, 1024, 1025, 3000):
        group = torch.randint(0, max(rows // 7, 1), (rows,), generator=g) * 3 - 11
        first_row = {}
        for r, gid in enumerate(group.tolist()):
            first_row.setdefault(gid, r)
        assert group_keys(group).tolist() == [first_row[gid] for gid in group.tolist()]
