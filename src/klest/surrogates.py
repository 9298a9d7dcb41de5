r"""Joining a value and a gradient, and baselines for score-function gradients.

:func:`decouple` is the one primitive every KL term in klest goes through: the forward pass
returns ``value`` and the backward pass the gradient of ``surrogate``,

.. math:: \mathrm{decouple}(v, s) = \mathrm{sg}(v) + s - \mathrm{sg}(s),

so a value estimator (k3, say) and a gradient estimator (k1's pathwise gradient, say: the
Chimera estimator) are chosen independently. A score-function surrogate
:math:`\log\pi(y)\,\mathrm{sg}(A)` may subtract a baseline :math:`b` from :math:`A` without
changing its expected gradient when :math:`b` does not depend on the sample it multiplies
(:math:`E[b\,\nabla\log\pi(y)] = E[b]\,E[\nabla\log\pi(y)] = 0`):

- ``"loo"``: the mean of the *other* samples of the same group (leave-one-out; unbiased). A
  sample alone in its group (gradient accumulation can split a prompt's samples) gets 0;
- ``"mean"``: the group mean *including* the sample itself: it scales the expected gradient by
  ``1 - 1/n`` (biased; offered because it is common);
- ``"loo-fitted"``: the leave-one-out baseline times a scale in [0, 1] cross-fitted on the
  other half of the batch (:mod:`klest.adaptive`; unbiased), so a baseline never costs much;
- :class:`BaselineEMA`: a moving average of earlier batches (unbiased);
- :class:`klest.LooScaleEMA`: the leave-one-out baseline times a per-position scale fitted on
  earlier batches (:mod:`klest.adaptive`; unbiased);
- ``"exact-kl"``: at each position t of a sequence, the exact
  :math:`KL_t(y_{<t}) = KL(\pi(\cdot|y_{<t})\|ref(\cdot|y_{<t})) = E[\rho_t|y_{<t}]` from the
  logits (it depends on the prefix only, so it is unbiased); ``"exact-kl+loo"`` adds the
  leave-one-out mean of the other samples' residual targets :math:`A_t - KL_t` (see
  :func:`exact_kl_baseline`).

Per-position baselines compare the t-th token of each completion: rows are aligned at their
first valid token, so left- and right-padded batches give the same result.

A baseline is not free: it adds the noise of its own estimate. See "On a few pitfalls in KL
divergence gradient estimation for RL" by Yunhao Tang and Rémi Munos (2025,
https://arxiv.org/abs/2506.09477) for leave-one-out baselines in KL gradients, and "The Chimera
Estimator" by Kirato Yoshihara (2026, https://kiratoyoshihara.github.io/essays/chimera-kl.html).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from klest._autodiff import transforms_active
from klest._checks import ValueChecks, check_decay, check_tensor, resolve_validate
from klest._masks import keep_valid_into
from klest._state import keep_float64
from klest.sequence import ShiftBuffer, first_token


def decouple(value: Tensor, surrogate: Tensor, *, validate: bool | None = None) -> Tensor:
    r"""``value`` in the forward pass, the gradient of ``surrogate`` in the backward pass.

    .. math:: \mathrm{sg}(value) + surrogate - \mathrm{sg}(surrogate)

    The forward result equals ``value`` exactly (``s - sg(s)`` is exactly 0 for finite ``s``);
    the gradient equals the gradient of ``surrogate`` exactly; ``value`` passes no gradient.

    Args:
      value: the reported value (any shape).
      surrogate: a tensor of the same shape whose gradient is the desired gradient; it must be
        finite (``inf - inf`` would put NaN in the value).
      validate: check that ``surrogate`` is finite (None: the global default).

    Returns:
      A tensor equal to ``value`` whose gradient is ``surrogate``'s.

    Example:
      >>> x = torch.tensor(2.0, requires_grad=True)
      >>> y = decouple(x**3, 5 * x)  # value 8, gradient 5
      >>> y.backward()
      >>> y.item(), x.grad.item()
      (8.0, 5.0)
    """
    check_tensor("value", value)
    check_tensor("surrogate", surrogate)
    if value.shape != surrogate.shape:
        raise ValueError(
            f"value has shape {tuple(value.shape)} but surrogate has shape "
            f"{tuple(surrogate.shape)}; they must match"
        )
    checks = ValueChecks(resolve_validate(validate))
    checks.add(
        ~torch.isfinite(surrogate),
        lambda _: (
            "surrogate is not finite (overflowing importance weights or log-ratios?); "
            "its gradient would be NaN"
        ),
    )
    checks.run()
    return join(value, surrogate)


def join(value: Tensor, surrogate: Tensor) -> Tensor:
    """:func:`decouple` without checks (for callers that validated already)."""
    return value.detach() + (surrogate - surrogate.detach())


class Float64EMAState(nn.Module):
    """Float64 buffers ``[T]`` (named by ``BUFFERS``) that grow with the longest sequence seen,
    follow ``.to(device)`` but stay float64 when a model is cast to bf16 / fp16, and are saved
    in ``state_dict`` (a resumed run keeps them): the state of the moving averages here and in
    :mod:`klest.adaptive`."""

    BUFFERS: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        for name in self.BUFFERS:
            self.register_buffer(name, torch.zeros(0, dtype=torch.float64))

    def _grow(self, t: int, device: torch.device) -> tuple[Tensor, ...]:
        """The buffers' first ``t`` entries (views), after growing them to ``t`` on ``device``."""
        first = getattr(self, self.BUFFERS[0])
        if first.device != device:
            self.to(device)
        for name in self.BUFFERS:
            buf = getattr(self, name)
            if buf.numel() < t:
                pad = torch.zeros(t - buf.numel(), dtype=torch.float64, device=device)
                setattr(self, name, torch.cat([buf, pad]))
        return tuple(getattr(self, name)[:t] for name in self.BUFFERS)

    def _apply(self, fn, recurse=True):
        # Follow .to(device), but keep float64 state (values too) when a model is cast.
        return super()._apply(keep_float64(fn), recurse)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args) -> None:
        # The buffers grow with the longest sequence seen; take the saved length.
        for name in self.BUFFERS:
            saved = state_dict.get(prefix + name)
            if isinstance(saved, Tensor):
                setattr(self, name, torch.zeros_like(saved, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args)


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


def group_baseline(
    targets: Tensor,
    valid: Tensor,
    kind: str,
    keys: Tensor,
    *,
    align: bool = True,
    bits: Tensor | None = None,
) -> Tensor:
    """Leave-one-out (``"loo"``) or mean baseline of ``targets`` ``[rows, T]`` within each group.

    ``keys`` ``[rows]`` are group keys (:func:`klest.aggregation.group_keys`). Positions are
    counted from each row's first valid token (left and right padding agree) and averaged over
    the rows of the group valid there; ``"loo"`` excludes the row's own value. Where no (other)
    row is valid at a position the baseline is 0, and before a row's first valid token it is 0.
    In ``targets``' dtype.

    ``align=False`` skips the alignment (its shifts cost several passes over ``[rows, T]``):
    for callers that know that no row's first valid token is after column 0 (:func:`starts_late`
    is False), where the result is the same, bit for bit. ``bits``: :func:`klest._masks.mask_bits`
    of ``valid`` for ``targets``' dtype, when the caller has it.
    """
    rows, t = targets.shape
    first = None
    if t > 1 and align:  # the t-th token of every completion in column t (shifted, zeros in)
        first = first_token(valid)
        values = ShiftBuffer(rows, t, like=targets)
        keep_valid_into(values.data, targets, valid, bits)
        flags = ShiftBuffer(rows, t, like=valid)
        flags.data.copy_(valid)
        valid = flags.shifted_left(first)
        del flags
    # Values and counts side by side ([rows, 2T]: one pooling for both). A bool is the byte 0 or
    # 1; counts are floats (index_add_ of integers is ~10x slower).
    both = targets.new_empty(rows, 2 * t)
    x, counted = both[:, :t], both[:, t:]
    if first is None:
        keep_valid_into(x, targets, valid, bits)
    else:
        values.shifted_left(first, out=x)  # zero where not valid already
    counted.copy_(valid.view(torch.uint8))
    # Per group, the sums over its rows: dense row additions (index_add_ along rows).
    pooled = torch.zeros_like(both).index_add_(0, keys, both).index_select(0, keys)
    if kind == "loo":
        # Without another valid row the group's sum is exactly this row's value: the baseline
        # is 0 / 1 = 0, with no select.
        pooled.sub_(both)
    sums, counts = pooled[:, :t], pooled[:, t:].clamp_(min=1)
    if first is None:
        return sums.div_(counts)
    if transforms_active():  # out= into a strided view: neither traced nor batched
        values.data.copy_(sums / counts)
    else:
        torch.div(sums, counts, out=values.data)  # the buffer's rows are free again: reuse them
    return values.shifted_right(first)


def starts_late(valid: Tensor) -> Tensor:
    """Whether some row of ``valid`` ``[rows, T]`` has its first valid token after column 0 (is
    left-padded), a bool scalar on ``valid``'s device: only then does :func:`group_baseline`'s
    alignment change anything."""
    if valid.shape[-1] == 0:
        return torch.zeros((), dtype=torch.bool, device=valid.device)
    # A bool is the byte 0 or 1: a row starts late when its largest byte exceeds its first
    # (byte reductions run many times faster than logical ones on the CPU).
    as_bytes = valid.view(torch.uint8)
    return (as_bytes.amax(-1) > as_bytes[..., 0]).any()


def exact_kl_baseline(
    targets: Tensor, valid: Tensor, kls: Tensor, kind: str, keys: Tensor, *, align: bool = True
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
    ``align``: as :func:`group_baseline`'s.

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
        b = b + group_baseline(targets - b, valid, "loo", keys, align=align)
    return b


def group_sizes(keys: Tensor) -> Tensor:
    """How many rows share each row's group, ``[rows]``."""
    ones = torch.ones_like(keys, dtype=torch.int64)
    return torch.zeros_like(ones).index_add_(0, keys, ones)[keys]
