"""``LooScaleEMA``: the leave-one-out baseline times a per-position scale fitted on earlier
batches.

A loop reference written here fixes what the scale and the baseline are; statistical tests
compare the mean gradient with the enumerated exact gradient of a tabular policy, and its MSE
with plain cumulative's and cumulative + loo's on the same batches, at the thresholds of
``tests/_stats.py`` (false-fail rate ``RATE`` per test).

The draws of one loss share the scale's state, so they are not independent; but each draw's
error has mean zero given every earlier batch (the scale is a function of those only), so the
errors are uncorrelated martingale differences and the mean's standard error is still
``sd / sqrt(n)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from klest import LooScaleEMA, kl_penalty
from klest.audit import GradSpec, mean_shift_z
from klest.testbeds import TabularAutoregressive
from tests._reference import left_padded
from tests._stats import RATE, z_for
from tests.sampled.test_baselines import _draws


def scale_ema_reference(batches, keys, decay, per_position=True):
    """Baselines for a list of ``(targets, valid)`` batches by loops: at the t-th valid token
    of row i, lam_t * (mean of the other rows of i's group valid at their t-th token), lam_t =
    clip(sum_j decay^(k-1-j) (1 - decay) sum_i A B / the same with B^2, 0, 1) over the earlier
    batches j that had a pair at t (0 without any); pooled: one lam over every position."""
    history: dict[int, list[tuple[float, float]]] = {}  # slot -> [(sum A B, sum B^2)]

    def lam(slot):
        num = den = 0.0
        seen = history.get(slot, [])
        for k, (c, q) in enumerate(seen):
            w = decay ** (len(seen) - 1 - k) * (1 - decay)
            num, den = num + w * c, den + w * q
        return min(max(num / den, 0.0), 1.0) if den > 0 else 0.0

    out = []
    for targets, valid in batches:
        rows = targets.shape[0]
        cols = [[t for t in range(targets.shape[1]) if valid[i, t]] for i in range(rows)]
        sums: dict[int, tuple[float, float]] = {}
        baseline = torch.zeros_like(targets, dtype=torch.float64)
        for i in range(rows):
            for pos, col in enumerate(cols[i]):
                mates = [
                    float(targets[k, cols[k][pos]])
                    for k in range(rows)
                    if k != i and keys[k] == keys[i] and pos < len(cols[k])
                ]
                if mates:
                    b = sum(mates) / len(mates)
                    slot = pos if per_position else 0
                    baseline[i, col] = lam(slot) * b
                    c, q = sums.get(slot, (0.0, 0.0))
                    sums[slot] = (c + float(targets[i, col]) * b, q + b * b)
        for slot, cq in sums.items():
            history.setdefault(slot, []).append(cq)
        out.append(baseline)
    return out


def _batches(n=4, rows=6, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        targets = 1.5 + torch.randn(rows, t, generator=g, dtype=torch.float64)
        lengths = torch.randint(1, t + 1, (rows,), generator=g)
        out.append((targets, torch.arange(t) < lengths.unsqueeze(-1)))
    return out


@pytest.mark.parametrize("per_position", [True, False])
def test_scales_and_baselines_match_the_loop_reference(per_position):
    keys = [0, 0, 1, 1, 1, 0]
    batches = _batches()
    fit = LooScaleEMA(decay=0.7, per_position=per_position)
    want = scale_ema_reference(batches, keys, 0.7, per_position)
    for (targets, valid), w in zip(batches, want, strict=True):
        got = fit(targets, valid, torch.tensor(keys))
        torch.testing.assert_close(torch.where(valid, got, 0.0), w, rtol=1e-12, atol=1e-12)
    assert bool((want[0] == 0).all()) and float(want[-1].abs().max()) > 0


def test_scale_does_not_depend_on_the_current_batch_and_eval_freezes_it():
    """Unbiasedness rests on the scale ignoring the batch it is applied to."""
    (a, valid), (b, _) = _batches(n=2)
    keys = torch.zeros(6, dtype=torch.int64)
    fit = LooScaleEMA()
    fit(a, valid, keys)
    before = fit.scales(5).clone()
    fit.eval()
    fit(b * 3 - 1, valid, keys)
    assert torch.equal(fit.scales(5), before)
    fit.train()
    fit(b, valid, keys)
    assert not torch.equal(fit.scales(5), before)


def test_padding_state_dict_and_dtype():
    """Left and right padding give the same baseline at valid tokens; the state survives a
    state_dict round trip and a cast to bf16 (float64 buffers)."""
    batches = _batches(n=3, seed=1)
    keys = torch.zeros(6, dtype=torch.int64)
    right, left = LooScaleEMA(decay=0.5), LooScaleEMA(decay=0.5)
    for targets, valid in batches:
        got_right = right(targets, valid, keys)
        valid_left = left_padded(valid, valid)
        got_left = left(left_padded(targets, valid), valid_left, keys)
        # At valid tokens (padding positions are masked by every caller).
        torch.testing.assert_close(
            got_left[valid_left], left_padded(got_right, valid)[valid_left], rtol=0, atol=0
        )
    restored = LooScaleEMA(decay=0.5)
    restored.load_state_dict(right.state_dict())
    torch.testing.assert_close(restored.scales(5), right.scales(5), rtol=0, atol=0)
    restored.to(torch.bfloat16)
    assert restored.cross.dtype == torch.float64


def test_kl_penalty_uses_it_as_a_baseline():
    """cumulative + LooScaleEMA: the gradient w.r.t. logp is the returns-to-go minus the
    reference baseline (second batch, so the scale is fitted)."""
    g = torch.Generator().manual_seed(2)
    keys = [0, 0, 0, 1, 1, 1]
    fit = LooScaleEMA(decay=0.6)
    targets_seen = []
    for _ in range(2):
        logp = (-torch.rand(6, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
        logp_ref = -torch.rand(6, 4, generator=g, dtype=torch.float64)
        mask = torch.arange(4) < torch.tensor([4, 3, 4, 2, 4, 1]).unsqueeze(-1)
        loss = kl_penalty(
            logp, logp_ref, mask=mask, grad="cumulative", baseline=fit,
            group=torch.tensor(keys), reduction="sum",
        )  # fmt: skip
        (got,) = torch.autograd.grad(loss, logp)
        delta = torch.where(mask, (logp - logp_ref).detach(), 0.0)
        togo = delta.flip(-1).cumsum(-1).flip(-1)
        targets_seen.append((togo, mask))
    want = togo - scale_ema_reference(targets_seen, keys, 0.6)[-1]
    torch.testing.assert_close(got, torch.where(mask, want, 0.0), rtol=1e-10, atol=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="decay"):
        LooScaleEMA(decay=1.0)
    with pytest.raises(TypeError, match="per_position"):
        LooScaleEMA(per_position=1)
    logp = -torch.rand(4, 3)
    with pytest.raises(ValueError, match="baseline"):
        kl_penalty(logp, logp - 0.1, grad="token", baseline=LooScaleEMA())
    assert GradSpec.parse("k3/cumulative+loo-ema").baseline == "loo-ema"


REGIMES = (0.5, 1.5)  # tabular policies at low KL (0.73 nats) and high KL (4.4 nats)


@pytest.mark.parametrize("scale", REGIMES)
@pytest.mark.parametrize("spec", ["k3/cumulative+loo-ema", "k3/score+loo-ema", "rb/rb+loo-ema"])
def test_unbiased_on_a_tabular_policy(scale, spec):
    """The mean gradient against the enumerated exact gradient by :func:`mean_shift_z`. z:
    one-sided Bonferroni at RATE over the 6 cases."""
    tb = TabularAutoregressive.random(3, 4, scale=scale, seed=0)
    draws = _draws(spec, tb, batch=8, trials=800, seed=41)
    exact = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad("pi||ref")])
    assert mean_shift_z(draws, exact) <= z_for(RATE, 6, two_sided=False)


@pytest.mark.parametrize("scale", REGIMES)
def test_mse_at_most_plain_and_loo(scale):
    """MSE against the exact gradient of cumulative + LooScaleEMA against plain cumulative and
    cumulative + loo on the same batches: the paired per-trial difference of squared errors
    has mean at most z standard errors (no allowance for fit noise). z: one-sided Bonferroni
    at RATE over 4 comparisons (2 regimes x 2 rivals). At low KL the full baseline is worse
    than none, at high KL better; measured (3000 batches of 8): 0.256 against 0.267 / 0.289
    at low KL, 1.73 against 2.46 / 1.83 at high KL."""
    tb = TabularAutoregressive.random(3, 4, scale=scale, seed=0)
    exact = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad("pi||ref")]).detach()
    trials = 1500
    fitted = _draws("k3/cumulative+loo-ema", tb, batch=8, trials=trials, seed=31)
    err = ((fitted - exact) ** 2).sum(1)
    z = z_for(RATE, 4, two_sided=False)
    for rival in ("k3/cumulative", "k3/cumulative+loo"):
        other = _draws(rival, tb, batch=8, trials=trials, seed=31)  # the same batches
        diff = err - ((other - exact) ** 2).sum(1)
        se = float(diff.std()) / math.sqrt(trials)
        assert float(diff.mean()) <= z * se, (rival, float(err.mean()), float(diff.mean()), se)
