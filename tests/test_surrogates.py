"""decouple, and the baselines of score-function gradients, against brute-force recomputation."""

from __future__ import annotations

import pytest
import torch

import klest
from klest.sampled.baselines import BaselineEMA, group_baseline
from klest.sampled.groups import group_keys, group_sizes
from klest.testbeds import make_generator


def test_decouple_gives_exactly_the_value_and_exactly_the_surrogate_gradient():
    g = make_generator(2)
    a = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.exp(a) * 3.7
    surrogate = b**3 + a
    out = klest.decouple(value, surrogate)
    assert torch.equal(out, value.detach())
    out.sum().backward()
    assert torch.equal(a.grad, torch.ones(5, dtype=torch.float64))  # only through the surrogate
    assert torch.equal(b.grad, 3 * b.detach() ** 2)


def test_decouple_errors():
    with pytest.raises(ValueError, match="value has shape"):
        klest.decouple(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="surrogate is not finite"):
        klest.decouple(torch.zeros(1), torch.tensor([float("inf")]))
    with pytest.raises(TypeError, match=r"value must be a torch\.Tensor"):
        klest.decouple(1.0, torch.zeros(1))
    out = klest.decouple(torch.zeros(1), torch.tensor([float("inf")]), validate=False)
    assert torch.isnan(out).all()  # unchecked: inf - inf


def brute_group_baseline(targets, valid, group, kind):
    """For each valid position of each row: the mean, over the rows of the same group, of their
    value the same number of tokens after their first valid token (where valid there), leaving
    the row itself out for "loo"; 0 where there is no such row."""
    rows, t = targets.shape
    first = [next((j for j in range(t) if bool(valid[i, j])), 0) for i in range(rows)]
    out = torch.zeros_like(targets)
    for i in range(rows):
        for j in range(t):
            if not bool(valid[i, j]):
                continue
            offset = j - first[i]
            others = [
                float(targets[k, first[k] + offset])
                for k in range(rows)
                if group[k] == group[i]
                and first[k] + offset < t
                and bool(valid[k, first[k] + offset])
                and (kind == "mean" or k != i)
            ]
            out[i, j] = sum(others) / len(others) if others else 0.0
    return out


@pytest.mark.parametrize("kind", ["loo", "mean"])
def test_group_baseline_matches_brute_force_and_never_pools_groups(kind):
    g = make_generator(3)
    targets = torch.randn(7, 4, generator=g, dtype=torch.float64)
    valid = torch.rand(7, 4, generator=g) > 0.3
    group = torch.tensor([3, 3, 8, 3, 8, 1, 8])  # a group of one (id 1)
    valid[1, :2] = False  # a left-padded row: its positions count from its first token
    got = torch.where(valid, group_baseline(targets, valid, kind, group_keys(group)), 0.0)
    torch.testing.assert_close(got, brute_group_baseline(targets, valid, group, kind))
    # Ids are honoured, not their order or values: relabelling changes nothing.
    relabelled = group_baseline(
        targets, valid, kind, group_keys(torch.tensor([0, 0, 5, 0, 5, 9, 5]))
    )
    torch.testing.assert_close(torch.where(valid, relabelled, 0.0), got)


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


def brute_ema(batches, decay):
    """The baseline each batch gets: per position, the decayed mean of earlier batches' means
    over their valid rows, bias-corrected; positions never seen give 0."""
    t = max(b.shape[1] for b, _ in batches)
    sums, weights, out = [0.0] * t, [0.0] * t, []
    for targets, valid in batches:
        width = targets.shape[1]
        out.append(
            torch.tensor(
                [sums[j] / weights[j] if weights[j] > 0 else 0.0 for j in range(width)],
                dtype=torch.float64,
            )
        )
        for j in range(width):
            kept = [float(targets[i, j]) for i in range(targets.shape[0]) if bool(valid[i, j])]
            if kept:
                sums[j] = decay * sums[j] + (1 - decay) * sum(kept) / len(kept)
                weights[j] = decay * weights[j] + (1 - decay)
    return out


def test_baseline_ema_matches_brute_force_update_order_and_weights():
    g = make_generator(4)
    batches = []
    for width in (3, 5, 2, 5):  # sequences of growing and shrinking length
        targets = torch.randn(4, width, generator=g, dtype=torch.float64)
        valid = torch.rand(4, width, generator=g) > 0.4
        batches.append((targets, valid))
    ema = BaselineEMA(decay=0.7)
    want = brute_ema(batches, 0.7)
    for (targets, valid), expected in zip(batches, want, strict=True):
        got = ema(targets, valid)
        assert got.shape == targets.shape
        torch.testing.assert_close(got[0].double(), expected.double(), rtol=1e-12, atol=1e-15)
        assert torch.equal(got, got[:1].expand_as(got))  # one value per position


def test_baseline_ema_state_dict_round_trip_with_grown_buffers():
    g = make_generator(5)
    ema = BaselineEMA(decay=0.5)
    for width in (2, 6):
        ema(torch.randn(3, width, generator=g, dtype=torch.float64), torch.ones(3, width).bool())
    restored = BaselineEMA(decay=0.5)
    restored.load_state_dict(ema.state_dict())
    targets = torch.randn(3, 6, generator=g, dtype=torch.float64)
    valid = torch.ones(3, 6, dtype=torch.bool)
    torch.testing.assert_close(restored(targets, valid), ema(targets, valid))


def test_baselines_keep_the_targets_dtype():
    targets = torch.randn(4, 3, dtype=torch.float32)
    valid = torch.ones(4, 3, dtype=torch.bool)
    assert BaselineEMA()(targets, valid).dtype == torch.float32
    assert group_baseline(targets, valid, "loo", torch.zeros(4, dtype=torch.int64)).dtype == (
        torch.float32
    )


def test_ema_state_follows_its_inputs_to_another_device():
    """After a CPU batch, a batch on another device moves the state there (the "meta" device
    stands in for an accelerator: the same device logic, no data)."""
    ema = BaselineEMA()
    ema(torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool))
    t = torch.zeros(2, 4, dtype=torch.float64, device="meta")
    out = ema(t, torch.ones(2, 4, dtype=torch.bool, device="meta"))
    assert out.device.type == "meta"
    assert all(b.device.type == "meta" and b.dtype == torch.float64 for b in ema.buffers())
