r"""Baselines and fitted coefficients of the gradient estimators, each independent of the sample
it is applied to, so that every gradient stays unbiased.

A score-function surrogate :math:`\log\pi(y)\,\mathrm{sg}(A)` may subtract a baseline :math:`b`
from :math:`A` without changing its expected gradient when :math:`b` does not depend on the
sample it multiplies (:math:`E[b\,\nabla\log\pi(y)] = E[b]\,E[\nabla\log\pi(y)] = 0`):

- ``"loo"`` (:func:`group_baseline`): the mean of the *other* samples of the same group
  (leave-one-out; unbiased). A sample alone in its group (gradient accumulation can split a
  prompt's samples) gets 0;
- ``"mean"``: the group mean *including* the sample itself: it scales the expected gradient by
  ``1 - 1/n`` (biased; offered because it is common);
- ``"loo-fitted"``: the leave-one-out baseline times a scale in [0, 1] cross-fitted on the
  other half of the batch (:func:`baseline_scale`; unbiased), so a baseline never costs much;
- :class:`BaselineEMA`: a moving average of earlier batches (unbiased);
- :class:`LooScaleEMA`: the leave-one-out baseline times a per-position scale fitted on
  earlier batches (unbiased);
- ``"exact-kl"`` (:func:`exact_kl_baseline`): at each position t of a sequence, the exact
  :math:`KL_t(y_{<t}) = KL(\pi(\cdot|y_{<t})\|ref(\cdot|y_{<t})) = E[\rho_t|y_{<t}]` from the
  logits (it depends on the prefix only, so it is unbiased); ``"exact-kl+loo"`` adds the
  leave-one-out mean of the other samples' residual targets :math:`A_t - KL_t`.

Per-position baselines compare the t-th token of each completion: rows are aligned at their
first valid token (:func:`klest.sampled.sequence.align_left`), so left- and right-padded
batches give the same result. A baseline is not free: it adds the noise of its own estimate.

**Fitted coefficients** (:func:`mix_coefficient` of ``grad="adaptive"``, :func:`baseline_scale`
of ``baseline="loo-fitted"``, :class:`LooScaleEMA`) combine an unbiased gradient with a
zero-mean term, ``g_i + c_i z_i`` with :math:`E[z_i] = 0`, and choose :math:`c_i` to lower the
variance. The estimate stays unbiased when :math:`c_i` does not depend on sample i
(:math:`E[c_i z_i] = E[c_i] E[z_i] = 0`), so every
coefficient here is computed without the row it multiplies.

**The k1/k3 mix** (reparameterized samples). Per token, k1 and k3 are both functions of the
log-ratio :math:`\delta = \log\pi(x) - \log ref(x)`, so their pathwise gradients are multiples
of the same vector :math:`\nabla\delta`:

.. math::
    \nabla k_1 = a\,\nabla\delta, \quad \nabla(k_3 - k_1) = b\,\nabla\delta, \qquad
    (a, b) = (1, -r) \text{ for KL}(\pi\|ref), \quad (r(\delta - 1), r) \text{ for KL}(ref\|\pi)

with :math:`r = e^{-\delta}`. The surrogate :math:`k_1 + c\,(k_3 - k_1)` (c detached) has the
gradient :math:`(a + c b)\nabla\delta`: one backward pass can only scale each sample's gradient
vector, so c is one scalar per row (not per coordinate), and the best scalar minimizes
:math:`E[(a + cb)^2 \|\nabla\delta\|^2]`. Per-sample gradient norms are not available from a
loss, so klest fits :math:`c = -\sum ab / \sum b^2` over the other rows' valid tokens: the
variance-optimal c when :math:`\|\nabla\delta\|^2` is uncorrelated with the ratio (on a
Gaussian with ``N(mu, I)`` against ``N(0, I)`` it is :math:`e^{-\|\mu\|^2}` against the exact
optimum :math:`e^{-\|\mu\|^2}/(1 + \mu_d^2)`). For KL(pi||ref) this is
:math:`\sum r / \sum r^2`, whose denominator :math:`E_\pi[r^2]` is heavy-tailed: with few
samples it is underestimated and c too large, which in high dimensions makes the mix far worse
than k1. So for KL(pi||ref) c is the smaller of that and the log-normal fit
:math:`e^{-\hat\sigma^2}` (:math:`\hat\sigma^2` the other rows' variance of :math:`\delta`;
exact when the ratio is log-normal, as for Gaussians with equal covariances).

**The baseline scale**. A score-function coefficient ``A_i - lam * B_i`` with ``B_i`` the
leave-one-out mean of the m other targets of i's group has, for the i.i.d. samples of one group
(mean :math:`\mu`, variance :math:`\sigma^2`), the variance-optimal scale (ignoring the
correlation of the score's norm with ``A``)

.. math:: \lambda^* = \frac{E[AB]}{E[B^2]} = \frac{\mu^2}{\mu^2 + \sigma^2 / m} \in [0, 1]:

no baseline when the mean is small against its noise (low KL), the full baseline when it is
large. klest cross-fits the regression itself: the rows of each group are split into two folds
(alternating over its non-empty rows); on one fold, with ``B'_j`` the leave-one-out mean *within
the fold*, :math:`\lambda = \sum_j A_j B'_j / \sum_j B'^2_j` (over the positions where ``B'_j``
exists, pooled over groups), clipped to [0, 1], is applied to the other fold. ``B'`` averages
fewer rows than ``B`` (m' = m/2 - 1 or so), so this estimates :math:`\mu^2/(\mu^2 +
\sigma^2/m')`: smaller than :math:`\lambda^*`, on purpose. Corrected to m (the formula above)
it would overshoot the best fixed scale at low KL, because the score's norm and the correlations
between positions that the formula ignores pull the optimum down; the cross-fitted regression
undershoots instead, which at high KL costs a few percent against the full baseline and at low
KL saves most of what the full baseline loses. Nothing in it depends on the rows it is applied to.

References: the control-variate view of baselines and k3 in "Approximating KL Divergence" by
John Schulman (2020, http://joschu.net/blog/kl-approx.html); k1's pathwise gradient against
k3's in "The Chimera Estimator" by Kirato Yoshihara (2026,
https://kiratoyoshihara.github.io/essays/chimera-kl.html); leave-one-out baselines in KL
gradients in "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and
Rémi Munos (2025, https://arxiv.org/abs/2506.09477).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_choice,
    check_decay,
    check_flag,
    check_float_tensor,
    check_group,
    check_mask,
    resolve_validate,
)
from klest._state import Float64EMAState
from klest.layout import layout_of
from klest.sampled.groups import group_keys, position_in_group
from klest.sampled.sequence import align_left, first_token, unalign

__all__ = [
    "BaselineEMA",
    "LooScaleEMA",
    "baseline_scale",
    "exact_kl_baseline",
    "group_baseline",
    "group_baselines",
    "mix_coefficient",
    "mix_multipliers",
]

# Relative size below which a sum of squares is rounding noise (float64 sums).
_TINY = 1e-12

GroupKind = Literal["loo", "mean"]
"""The group baselines :func:`group_baselines` computes."""


def group_baseline(targets: Tensor, valid: Tensor, kind: str, keys: Tensor) -> Tensor:
    """Leave-one-out (``"loo"``) or mean baseline of ``targets`` ``[rows, T]`` within each group.

    ``keys`` ``[rows]`` are group keys (:func:`klest.sampled.groups.group_keys`). Positions are
    counted from each row's first valid token (left and right padding agree) and averaged over
    the rows of the group valid there; ``"loo"`` excludes the row's own value. Where no (other)
    row is valid at a position the baseline is 0, and before a row's first valid token it is 0.
    In ``targets``' dtype.
    """
    first = None
    if targets.shape[-1] > 1:  # the t-th token of every completion in column t
        first = first_token(valid)
        targets, valid = align_left(targets, valid, first)
    values = torch.where(valid, targets, 0.0)
    counts = valid.to(targets.dtype)
    sums = torch.zeros_like(values).index_add_(0, keys, values)[keys]
    n = torch.zeros_like(counts).index_add_(0, keys, counts)[keys]
    if kind == "loo":
        # Without another valid row the group's sum is exactly this row's value: 0 / 1 = 0.
        sums, n = sums - values, n - counts
    baseline = sums / n.clamp(min=1)
    return baseline if first is None else unalign(baseline, first)


def exact_kl_baseline(
    targets: Tensor, valid: Tensor, kls: Tensor, kind: str, keys: Tensor
) -> Tensor:
    r"""The ``"exact-kl"`` / ``"exact-kl+loo"`` baseline of per-position ``targets`` ``[rows, T]``.

    .. math::
        b_t = KL_t(y_{<t}) \quad\text{or}\quad
        b_t = KL_t(y_{<t}) + \frac{1}{n_t - 1} \sum_{j \ne i} \big(A^{(j)}_t - KL^{(j)}_t\big)

    where :math:`KL_t(y_{<t}) = E_{y_t \sim \pi}[\log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})]`
    is the exact per-position KL(pi||ref) (``kls``, detached here) and the sum runs over the
    other rows of the same group valid at the t-th token of their completion (as
    :func:`group_baseline` with ``"loo"``). Both depend only on the prefix :math:`y_{<t}` of the
    row they are subtracted in and on independent rows, so :math:`E[s_t b_t] = 0`.

    :math:`KL_t` is the value function of the per-token reward :math:`-\rho_t`, the closed-form
    baseline of "KL for a KL: On-Policy Distillation with Control Variate Baseline" by Minjae Oh,
    Sangjun Song, Gyubin Choi, Yunho Choi and Yohan Jo (2026, https://arxiv.org/abs/2605.07865);
    for a target that sums the log-ratios to go it is the first term of the value, and the
    leave-one-out mean estimates the rest. 0 where ``valid`` is False; in ``targets``' dtype.


    Example:
      >>> targets = torch.tensor([[3.0, 1.0], [5.0, 2.0]])
      >>> kls = torch.tensor([[0.5, 0.2], [0.7, 0.1]])
      >>> valid, keys = torch.ones(2, 2, dtype=torch.bool), torch.zeros(2, dtype=torch.int64)
      >>> exact_kl_baseline(targets, valid, kls, "exact-kl", keys)
      tensor([[0.5000, 0.2000],
              [0.7000, 0.1000]])
      >>> exact_kl_baseline(targets, valid, kls, "exact-kl+loo", keys)  # + the other row's A - KL
      tensor([[4.8000, 2.1000],
              [3.2000, 0.9000]])
    """
    b = torch.where(valid, kls.detach().to(targets.dtype), 0.0)
    if kind == "exact-kl+loo":
        b = b + group_baseline(targets - b, valid, "loo", keys)
    return b


class BaselineEMA(Float64EMAState):
    r"""A baseline from an exponential moving average of earlier batches' targets.

    .. math:: b_t^{(k)} = \frac{\sum_{j<k} \gamma^{k-1-j} (1-\gamma)\, \bar A_t^{(j)}}
                               {\sum_{j<k} \gamma^{k-1-j} (1-\gamma)}

    where :math:`\bar A_t^{(j)}` is batch j's mean target at position t (over the rows valid
    there), and batches without a valid row at t are skipped: they neither add to position t's
    average nor age it (j and k count only the batches that had a valid row at t). Per-sequence
    targets (the score function) keep one average; per-position targets (cumulative) one per
    position, counted from each completion's first token. Each call uses the average of
    *previous* batches (independent of the current samples, so the gradient stays unbiased),
    then folds the current batch in. Before any batch the baseline is 0.

    The averages live in float64 buffers (``sums``, ``weights``) on the tensors' device, so they
    move with ``.to()`` (staying float64 when a model is cast to bf16), are saved in
    ``state_dict`` (a resumed run keeps them) and cost no host copy. In ``eval()`` mode the
    averages are used but not updated. One average per position, over every group (``group``
    ids do not apply to it). Each process updates its own averages from the batches it sees
    (no collective call): under data parallelism they differ between processes, each unbiased.

    Args:
      decay: :math:`\gamma`, the weight of the past, in [0, 1).

    Example:
      >>> ema = BaselineEMA(decay=0.5)
      >>> valid = torch.ones(2, 1, dtype=torch.bool)
      >>> ema(torch.tensor([[1.0], [3.0]]), valid)  # no history yet
      tensor([[0.],
              [0.]])
      >>> ema(torch.tensor([[5.0], [7.0]]), valid)  # the mean of the first batch
      tensor([[2.],
              [2.]])
    """

    BUFFERS = ("sums", "weights")
    sums: Tensor
    weights: Tensor

    def __init__(self, *, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = check_decay(decay)

    def forward(self, targets: Tensor, valid: Tensor) -> Tensor:
        """The baseline for ``targets`` (``[rows, T]``, detached; ``valid`` bool), then update."""
        sums, weights = self._grow(targets.shape[-1], targets.device)
        mean = torch.where(weights > 0, sums / weights.clamp(min=1e-300), 0.0)
        baseline = mean.to(targets.dtype).expand_as(targets).clone()
        if not self.training:  # eval(): use the averages, do not update them
            return baseline
        with torch.no_grad():
            count = valid.sum(0).double()
            batch_mean = torch.where(valid, targets.detach().double(), 0.0).sum(0)
            batch_mean = batch_mean / count.clamp(min=1.0)
            seen = count > 0
            g = self.decay
            sums.copy_(torch.where(seen, g * sums + (1 - g) * batch_mean, sums))
            weights.copy_(torch.where(seen, g * weights + (1 - g), weights))
        return baseline

    def extra_repr(self) -> str:
        return f"decay={self.decay}"


def mix_multipliers(delta: Tensor, direction: str) -> tuple[Tensor, Tensor]:
    r"""``(a, b)``: :math:`d k_1/d\delta` and :math:`d(k_3 - k_1)/d\delta` at ``delta``.

    .. math::
        (a, b) = (1, -e^{-\delta}) \text{ (KL(pi||ref))}, \qquad
        (e^{-\delta}(\delta - 1), e^{-\delta}) \text{ (KL(ref||pi))}

    Args:
      delta: detached log-ratios ``log pi - log ref`` of samples from pi, any shape.
      direction: ``"pi||ref"`` or ``"ref||pi"``.

    Returns:
      Two tensors of ``delta``'s shape.

    Example:
      >>> a, b = mix_multipliers(torch.tensor([0.0, 1.0]), "pi||ref")
      >>> a.tolist(), [round(v, 4) for v in b.tolist()]
      ([1.0, 1.0], [-1.0, -0.3679])
    """
    r = torch.exp(-delta)
    if direction == "pi||ref":
        return torch.ones_like(delta), -r
    return r * (delta - 1), r


def _leave_one_out(per_row: Tensor) -> Tensor:
    """The sum over the other rows of per-row sums ``[rows]``."""
    return per_row.sum() - per_row


def mix_coefficient(delta: Tensor, valid: Tensor | None, direction: str) -> Tensor:
    r"""The k1/k3 mixing coefficient of each row, fitted on the other rows, ``[rows, 1]``.

    .. math::
        c_i = -\frac{\sum_{j \ne i} \sum_t a_{jt} b_{jt}}{\sum_{j \ne i} \sum_t b_{jt}^2}
        \quad (\text{KL}(\pi\|ref): \min(c_i, e^{-\hat\sigma^2_{-i}}))

    with ``(a, b)`` from :func:`mix_multipliers` and :math:`\hat\sigma^2_{-i}` the variance of
    the other rows' valid log-ratios (see the module docstring for what c is optimal for). A row
    with no other valid row gets 0 (k1's gradient). Samples come from pi (reparameterized).

    Args:
      delta: log-ratios ``log pi - log ref`` ``[rows, T]`` (detached here).
      valid: bool ``[rows, T]`` (None: every token counts).
      direction: ``"pi||ref"`` or ``"ref||pi"``.

    Returns:
      Detached coefficients ``[rows, 1]`` in ``delta``'s dtype.

    Example:
      >>> delta = torch.tensor([[0.1], [-0.2], [0.05], [0.3]], dtype=torch.float64)
      >>> c = mix_coefficient(delta, None, "pi||ref")
      >>> bool(((c > 0.9) & (c < 1.0)).all())  # near k3 when pi is close to ref
      True
    """
    d = delta.detach().double()
    keep = torch.isfinite(d) if valid is None else valid & torch.isfinite(d)
    d = torch.where(keep, d, 0.0)
    a, b = mix_multipliers(d, direction)
    a, b = torch.where(keep, a, 0.0), torch.where(keep, b, 0.0)
    ab, bb = _leave_one_out((a * b).sum(-1)), _leave_one_out((b * b).sum(-1))
    ok = bb > _TINY * bb.abs().max().clamp(min=1e-300)
    c = torch.where(ok, -ab / torch.where(ok, bb, 1.0), 0.0)
    if direction == "pi||ref":
        n = _leave_one_out(keep.sum(-1).double())
        s1, s2 = _leave_one_out(d.sum(-1)), _leave_one_out((d * d).sum(-1))
        mean = s1 / n.clamp(min=1.0)
        var = ((s2 - n * mean * mean) / (n - 1).clamp(min=1.0)).clamp(min=0.0)
        c = torch.where(n >= 2, torch.minimum(c, torch.exp(-var)), c)
    return c.to(delta.dtype).unsqueeze(-1)


def baseline_scale(targets: Tensor, valid: Tensor, keys: Tensor) -> Tensor:
    r"""The cross-fitted scale :math:`\lambda` of the leave-one-out baseline, ``[rows, 1]``.

    .. math:: \lambda_i = \mathrm{clip}_{[0, 1]}\Big(\frac{\sum_{j \in F'} \sum_t A_{jt} B'_{jt}}
              {\sum_{j \in F'} \sum_t B'^2_{jt}}\Big)

    where :math:`F'` is the fold i is not in and :math:`B'` the leave-one-out mean within a
    fold and group, at the positions (counted from each row's first valid token) where it
    exists (module docstring).

    Args:
      targets: detached score-function targets ``A`` ``[rows, T]`` (T = 1: per sequence) of
        samples from pi.
      valid: bool ``[rows, T]``.
      keys: group keys ``[rows]`` (:func:`klest.sampled.groups.group_keys`).

    Returns:
      Detached scales ``[rows, 1]`` in ``targets``' dtype; 0 where the other fold has no pair.

    Example:
      >>> keys = torch.zeros(64, dtype=torch.int64)
      >>> valid = torch.ones(64, 1, dtype=torch.bool)
      >>> big = baseline_scale(5.0 + 0.1 * torch.randn(64, 1), valid, keys)  # mean >> noise
      >>> small = baseline_scale(torch.randn(64, 1), valid, keys)  # mean 0: no baseline
      >>> bool((big > 0.99).all()), bool((small < 0.2).all())
      (True, True)
    """
    x = torch.where(valid, targets.detach().double(), 0.0)
    rows = x.shape[0]
    fold = position_in_group(keys, valid.any(-1)) % 2  # empty rows shift no other row's fold
    # Groups split by fold: keys + rows * fold < 2 rows, so pad with as many invalid rows.
    fold_keys = torch.cat([keys + rows * fold, keys])  # the padding rows' keys: never valid
    padded_valid = torch.cat([valid, torch.zeros_like(valid)])
    within = group_baseline(torch.cat([x, torch.zeros_like(x)]), padded_valid, "loo", fold_keys)
    # Where the row is valid and has a fold-mate valid at the same position.
    ones = padded_valid.double()
    paired = valid & (group_baseline(ones, padded_valid, "loo", fold_keys)[:rows] > 0)
    within = within[:rows]
    p_row = torch.where(paired, x * within, 0.0).sum(-1)
    q_row = torch.where(paired, within * within, 0.0).sum(-1)
    p = torch.zeros(2, dtype=x.dtype, device=x.device).index_add_(0, fold, p_row)[1 - fold]
    q = torch.zeros(2, dtype=x.dtype, device=x.device).index_add_(0, fold, q_row)[1 - fold]
    ok = q > _TINY * q.abs().max().clamp(min=1e-300)
    lam = torch.where(ok, p / torch.where(ok, q, 1.0), 0.0).clamp(0.0, 1.0)
    return lam.to(targets.dtype).unsqueeze(-1)


class LooScaleEMA(Float64EMAState):
    r"""The leave-one-out baseline times a scale fitted on *earlier* batches, per position.

    .. math::
        b^{(k)}_{it} = \lambda^{(k)}_t B_{it}, \qquad
        \lambda^{(k)}_t = \mathrm{clip}_{[0, 1]}\Big(
        \frac{\sum_{j<k} \gamma^{k-1-j} \sum_i A^{(j)}_{it} B^{(j)}_{it}}
             {\sum_{j<k} \gamma^{k-1-j} \sum_i (B^{(j)}_{it})^2}\Big)

    with :math:`A_{it}` the score-function target of row i at the t-th token of its completion
    (samples from pi, or the unweighted targets off-policy), :math:`B_{it}` the mean of the
    *other* rows of its group valid there (``"loo"``), and the sums over the rows that have such
    a mate. The scale of batch k uses batches before k only, so it is independent of the
    current samples and the gradient stays unbiased (as for :class:`klest.BaselineEMA`); the
    batch is folded in after. Before any batch (or at a position never seen) the scale is 0: no
    baseline. A batch with no row that has a mate at t is skipped there (it neither adds to nor
    ages position t's sums, so at decay 0 the last scale stays), and a position whose
    denominator is below 1e-12 times the largest position's gets scale 0.

    Against ``baseline="loo-fitted"`` (the same regression cross-fitted on half of the current
    batch, :func:`baseline_scale`): the regression here uses the full leave-one-out mean (the
    one that is subtracted), pools many batches, so its own noise vanishes, and is fitted per
    position (``per_position=True``), where the mean of the returns-to-go against their noise,
    and so the best scale, changes along the sequence. What it estimates is
    :math:`E[AB]/E[B^2] = \mu_t^2 / (\mu_t^2 + \sigma_t^2/m)` for i.i.d. rows
    (m others), the variance-optimal scale when the score's norm is uncorrelated with the target.

    Buffers as :class:`klest.BaselineEMA`'s (float64, saved in ``state_dict``, moved by
    ``.to()``; each process updates its own from the batches it sees); in ``eval()`` mode the
    scales are used, not updated. Pass it as
    ``kl_penalty(..., baseline=LooScaleEMA())`` for ``score``, ``cumulative`` and ``rb``
    (KL(pi||ref)), with ``group`` ids as for ``"loo"``.

    See "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and
    Rémi Munos (2025, https://arxiv.org/abs/2506.09477) for leave-one-out baselines in KL
    gradients.

    Args:
      decay: :math:`\gamma`, the weight of the past, in [0, 1).
      per_position: one scale per position (counted from each completion's first valid
        token); False pools the positions into one scale.

    Example:
      >>> fit = LooScaleEMA(decay=0.5)
      >>> valid, keys = torch.ones(4, 1, dtype=torch.bool), torch.zeros(4, dtype=torch.int64)
      >>> fit(torch.tensor([[5.0], [5.2], [4.8], [5.0]]), valid, keys).flatten()  # no history
      tensor([0., 0., 0., 0.])
      >>> b = fit(torch.tensor([[5.0], [5.0], [5.0], [5.0]]), valid, keys)
      >>> b.flatten()  # the scale fitted on the first batch (0.9996) times the leave-one-out
      tensor([4.9982, 4.9982, 4.9982, 4.9982])
    """

    BUFFERS = ("cross", "square")
    cross: Tensor
    square: Tensor

    def __init__(self, *, decay: float = 0.95, per_position: bool = True) -> None:
        super().__init__()
        self.decay = check_decay(decay)
        check_flag("per_position", per_position)
        self.per_position = per_position

    def scales(self, t: int, device: torch.device | None = None) -> Tensor:
        """The current scales of the first ``t`` positions (one, repeated, when pooled),
        float64 ``[t]`` on ``device`` (default: the buffers')."""
        device = self.cross.device if device is None else device
        cross, square = self._grow(t if self.per_position else 1, device)
        ok = square > _TINY * square.abs().max().clamp(min=1e-300)
        lam = torch.where(ok, cross / torch.where(ok, square, 1.0), 0.0).clamp(0.0, 1.0)
        return lam if self.per_position else lam.expand(t)

    def forward(self, targets: Tensor, valid: Tensor, keys: Tensor) -> Tensor:
        """The baseline for ``targets`` (``[rows, T]``, detached; ``valid`` bool; ``keys``
        group keys ``[rows]``), then the update with this batch."""
        x = torch.where(valid, targets.detach().double(), 0.0)
        loo = group_baseline(x, valid, "loo", keys)
        has_mate = valid & (group_baseline(valid.double(), valid, "loo", keys) > 0)
        first = first_token(valid)
        if x.shape[-1] > 1:  # the t-th token of every completion in column t
            (x, _), (loo, has_mate) = align_left(x, valid, first), align_left(loo, has_mate, first)
        lam = self.scales(x.shape[-1], targets.device)
        baseline = lam * loo
        if x.shape[-1] > 1:
            baseline = unalign(baseline, first)
        if self.training:
            self._update(torch.where(has_mate, x * loo, 0.0), torch.where(has_mate, loo * loo, 0.0))
        return baseline.to(targets.dtype)

    @torch.no_grad()
    def _update(self, cross_rows: Tensor, square_rows: Tensor) -> None:
        batch_cross, batch_square = cross_rows.sum(0), square_rows.sum(0)
        if not self.per_position:
            batch_cross, batch_square = batch_cross.sum(0, True), batch_square.sum(0, True)
        cross, square = self._grow(batch_cross.numel(), batch_cross.device)
        seen = batch_square > 0
        g = self.decay
        cross.copy_(torch.where(seen, g * cross + (1 - g) * batch_cross, cross))
        square.copy_(torch.where(seen, g * square + (1 - g) * batch_square, square))

    def extra_repr(self) -> str:
        return f"decay={self.decay}, per_position={self.per_position}"


def group_baselines(
    targets: Tensor,
    *,
    group: Tensor,
    mask: Tensor | None = None,
    kind: str = "loo",
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""Group baselines of a whole batch's targets, to hand to the pieces of a split loss.

    .. math:: b_{it} = \frac{1}{n_{it} - 1} \sum_{j \ne i,\ j \sim i} A_{jt} \quad
              (\texttt{"loo"}), \qquad
              b_{it} = \frac{1}{n_{it}} \sum_{j \sim i} A_{jt} \quad (\texttt{"mean"})

    over the samples j of i's group valid at the t-th token of their completion (positions
    counted from each completion's first valid token; :math:`n_{it}` of them, i included). A
    sample alone gets 0 (``"loo"``). ``"loo"`` excludes the sample itself, so a loss that
    subtracts it keeps an unbiased gradient; ``"mean"`` does not (it scales the expected
    gradient by ``1 - 1/n``). Compute them where the engine sees whole groups, from
    :func:`klest.penalty_targets`, and pass each piece's rows as ``kl_penalty(baseline=...)``.

    Args:
      targets: ``[..., T]`` per token (or ``[N]`` per sequence: the ``score`` estimator's),
        detached; packed with ``cu_seqlens`` as for :func:`klest.kl_penalty`.
      group: integer ids, one per sequence.
      mask: where a target counts (``penalty_targets``' mask); default: everywhere.
      kind: ``"loo"`` (leave-one-out) or ``"mean"``.
      cu_seqlens, max_seqlen: packed sequences (:mod:`klest.layout`).
      validate: run the value checks (None: the global default).

    Returns:
      The baselines, ``targets``' shape and dtype, detached, 0 where ``mask`` is False.

    Example:
      >>> targets = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]])
      >>> group_baselines(targets, group=torch.tensor([0, 0, 1]))  # the other row's, or 0
      tensor([[3., 4.],
              [1., 2.],
              [0., 0.]])
    """
    check_float_tensor("targets", targets)
    check_choice("kind", kind, GroupKind)
    checks = ValueChecks(resolve_validate(validate))
    layout = layout_of(
        targets.shape, targets.device, cu_seqlens, max_seqlen, checks, name="targets"
    )
    keep = torch.ones_like(targets, dtype=torch.bool)
    if mask is not None:
        keep = check_mask(mask, targets.shape, targets.device, checks, of="the targets")
    keys = group_keys(
        check_group(group, layout.sequences_shape, targets.device, of_shape=targets.shape)
    )
    checks.run()
    with torch.no_grad():
        valid = layout.rows(keep)
        rows = torch.where(valid, layout.rows(targets.detach()), 0.0)
        baseline = torch.where(valid, group_baseline(rows, valid, kind, keys), 0.0)
        return layout.tokens(baseline)
