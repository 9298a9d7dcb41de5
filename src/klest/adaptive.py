r"""Coefficients fitted on *other* samples: the k1/k3 mix of ``grad="adaptive"`` and the scale
of ``baseline="loo-fitted"``.

Both combine an unbiased gradient with a zero-mean term, ``g_i + c_i z_i`` with
:math:`E[z_i] = 0`, and choose :math:`c_i` to lower the variance. The estimate stays unbiased
when :math:`c_i` does not depend on sample i (:math:`E[c_i z_i] = E[c_i] E[z_i] = 0`), so every
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
\sigma^2/m')`: smaller than :math:`\lambda^*`, on purpose. Correcting it to m (the formula
above) was measured to overshoot the best fixed scale at low KL (0.5 against 0.25 on a tabular
policy, batches of 8), because the score's norm and the correlations between positions that the
formula ignores pull the optimum down; the cross-fitted regression undershoots instead, which at
high KL costs a few percent against the full baseline and at low KL saves most of what the full
baseline loses. Nothing in it depends on the rows it is applied to.

References: the control-variate view of baselines and k3 in "Approximating KL Divergence" by
John Schulman (2020, http://joschu.net/blog/kl-approx.html); k1's pathwise gradient against
k3's in "The Chimera Estimator" by Kirato Yoshihara (2026,
https://kiratoyoshihara.github.io/essays/chimera-kl.html); leave-one-out baselines in KL
gradients in "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and
Rémi Munos (2025, https://arxiv.org/abs/2506.09477).
"""

from __future__ import annotations

import torch
from torch import Tensor

from klest._checks import check_decay, check_flag
from klest.control_variates import _position_in_group
from klest.sequence import align_left, first_token, unalign
from klest.surrogates import Float64EMAState, group_baseline

# Relative size below which a sum of squares is rounding noise (float64 sums).
_TINY = 1e-12


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


def baseline_scale(targets: Tensor, valid: Tensor, keys: Tensor, *, align: bool = True) -> Tensor:
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
      keys: group keys ``[rows]`` (:func:`klest.aggregation.group_keys`).
      align: False skips the first-token alignment of :func:`klest.surrogates.group_baseline`
        (the same result when no row starts after column 0).

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
    fold = _position_in_group(keys, valid.any(-1)) % 2  # empty rows shift no other row's fold
    # Groups split by fold: keys + rows * fold < 2 rows, so pad with as many invalid rows.
    fold_keys = torch.cat([keys + rows * fold, keys])  # the padding rows' keys: never valid
    padded_valid = torch.cat([valid, torch.zeros_like(valid)])
    within = group_baseline(
        torch.cat([x, torch.zeros_like(x)]), padded_valid, "loo", fold_keys, align=align
    )
    # Where the row is valid and has a fold-mate valid at the same position.
    ones = padded_valid.double()
    paired = valid & (group_baseline(ones, padded_valid, "loo", fold_keys, align=align)[:rows] > 0)
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
