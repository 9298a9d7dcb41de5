"""``nn.Module`` forms of klest's losses, for models and training loops that hold their losses.

Each module fixes a function's options at construction and takes the tensors in ``forward``:

- :class:`KLPenalty`: :func:`klest.kl_penalty`, with moving-average state (an
  :class:`~klest.BaselineEMA`, an :class:`~klest.AlphaEMA`) as submodules, so their buffers follow
  ``.to()`` and are saved in ``state_dict``: a resumed run keeps its baselines;
- :class:`KLFromLogits`: :func:`klest.kl_from_logits`;
- :class:`KLFromHidden`: :func:`klest.kl_from_hidden`, holding references to the two LM heads
  (they stay your models' parameters; this module registers none).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

from torch import Tensor, nn

from klest._checks import check_choice, check_direction, check_flag
from klest._types import (
    DEFAULT_REDUCTION,
    Backend,
    Baseline,
    Direction,
    Estimator,
    Grad,
    Level,
    Reduction,
)
from klest.aggregation import GlobalCounts, WithDetails
from klest.logits import LogitsDetails, kl_from_hidden, kl_from_logits
from klest.sampled.baselines import BaselineEMA, LooScaleEMA
from klest.sampled.control_variates import Alpha, AlphaEMA
from klest.sampled.log_ratios import check_level
from klest.sampled.penalty import PenaltyDetails, kl_penalty

__all__ = ["KLFromHidden", "KLFromLogits", "KLPenalty", "in_forward_of"]

_STATE_BASELINES = {"ema": BaselineEMA, "loo-ema": LooScaleEMA}
"""Baselines that learn over batches: their state is a submodule (saved in ``state_dict``)."""


class KLPenalty(nn.Module):
    r"""The KL term of a loss as a module: :func:`klest.kl_penalty` with fixed options.

    .. math::
        \text{loss} = \beta\,\big(\mathrm{sg}(\widehat{KL}_{estimator}) + S_{grad}
            - \mathrm{sg}(S_{grad})\big)

    Samples, shapes and the estimators are those of :func:`klest.kl_penalty`.

    Args:
      estimator: the value estimator (default ``"k3"``).
      grad: the gradient estimator (default ``"cumulative"``).
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      reduction: as in :func:`klest.kl_penalty`.
      baseline: ``"loo"``, ``"mean"``, ``"loo-fitted"``, ``"exact-kl"``, ``"exact-kl+loo"``;
        ``"ema"`` (a :class:`~klest.BaselineEMA` submodule with ``baseline_decay``) or
        ``"loo-ema"`` (a :class:`~klest.LooScaleEMA` submodule with ``baseline_decay``: the
        leave-one-out baseline times a scale fitted on earlier batches); or a ``BaselineEMA``
        / ``LooScaleEMA`` to use.
      baseline_decay: decay of the ``"ema"`` / ``"loo-ema"`` state.
      alpha: for ``estimator="cv"``: a number, ``"loo"`` / ``"crossfit"`` / ``"in-sample"``,
        ``"ema"`` (an :class:`~klest.AlphaEMA` submodule) or an ``AlphaEMA``.
      alpha_decay: decay of the ``"ema"`` coefficient.
      level: ``"token"`` or ``"sequence"`` for the value.
      reparameterized: the samples are reparameterized (``pathwise`` / ``stl``).
      density: the inputs are log-densities of continuous samples (they may exceed 0).
      beta: the coefficient the KL term is multiplied by (the details describe the KL itself).
      validate: as in :func:`klest.kl_penalty`.

    Example:
      >>> penalty = KLPenalty(baseline="ema", beta=0.05)
      >>> logp = torch.randn(4, 6).clamp(max=0).requires_grad_()
      >>> loss = penalty(logp, torch.randn(4, 6).clamp(max=0))
      >>> loss.backward()
      >>> sorted(penalty.state_dict())  # the baseline's moving averages
      ['baseline_ema.sums', 'baseline_ema.weights']
    """

    def __init__(
        self,
        *,
        estimator: Estimator = "k3",
        grad: Grad = "cumulative",
        direction: Direction = "pi||ref",
        reduction: Reduction = DEFAULT_REDUCTION,
        baseline: Baseline | Literal["ema", "loo-ema"] | BaselineEMA | LooScaleEMA | None = None,
        baseline_decay: float = 0.9,
        alpha: Alpha | Literal["ema"] | None = None,
        alpha_decay: float = 0.9,
        level: Level = "token",
        reparameterized: bool = False,
        density: bool = False,
        beta: float = 1.0,
        validate: bool | None = None,
    ) -> None:
        super().__init__()
        check_direction(direction)
        self.estimator = check_choice("estimator", estimator, Estimator)
        self.grad = check_choice("grad", grad, Grad)
        self.direction = direction
        self.reduction = check_choice("reduction", reduction, Reduction)
        check_level(level, reduction)
        self.level = level
        if baseline is not None and not isinstance(baseline, BaselineEMA | LooScaleEMA):
            check_choice("baseline", baseline, (*get_args(Baseline), *_STATE_BASELINES))
        if alpha is not None and estimator != "cv":
            raise ValueError(f"alpha applies only to estimator='cv', not {estimator!r}")
        self.reparameterized = check_flag("reparameterized", reparameterized)
        self.density = check_flag("density", density)
        self.beta = float(beta)
        self.validate = validate
        # Moving-average states are submodules (their buffers are in state_dict); the other
        # choices are plain attributes.
        self.baseline_ema = (
            _STATE_BASELINES[baseline](decay=baseline_decay)
            if isinstance(baseline, str) and baseline in _STATE_BASELINES
            else None
        )
        if isinstance(baseline, BaselineEMA | LooScaleEMA):
            self.baseline_ema = baseline
        self.baseline_name = None if self.baseline_ema is not None else baseline
        self.alpha_ema = AlphaEMA(decay=alpha_decay) if alpha == "ema" else None
        if isinstance(alpha, AlphaEMA):
            self.alpha_ema = alpha
        self.alpha_value = None if self.alpha_ema is not None else alpha

    def forward(
        self,
        logp: Tensor,
        logp_ref: Tensor,
        *,
        mask: Tensor | None = None,
        group: Tensor | None = None,
        logp_behavior: Tensor | None = None,
        logits: Tensor | None = None,
        logits_ref: Tensor | None = None,
        logp_stl: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        counts: GlobalCounts | None = None,
        return_details: bool = False,
    ) -> Tensor | WithDetails[PenaltyDetails]:
        """``beta * kl_penalty(logp, logp_ref, ...)`` with this module's options (the batch's
        layout, ``cu_seqlens`` / ``max_seqlen``, and the step's ``counts`` per call)."""
        out = kl_penalty(
            logp,
            logp_ref,
            estimator=self.estimator,
            grad=self.grad,
            direction=self.direction,
            mask=mask,
            reduction=self.reduction,
            baseline=self.baseline_ema if self.baseline_ema is not None else self.baseline_name,
            group=group,
            reparameterized=self.reparameterized,
            level=self.level,
            alpha=self.alpha_ema if self.alpha_ema is not None else self.alpha_value,
            logp_behavior=logp_behavior,
            logits=logits,
            logits_ref=logits_ref,
            logp_stl=logp_stl,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            counts=counts,
            density=self.density,
            validate=self.validate,
            return_details=return_details,
        )
        if isinstance(out, WithDetails):
            return WithDetails(self.beta * out.value, out.details)
        return self.beta * out

    def extra_repr(self) -> str:
        return (
            f"estimator={self.estimator!r}, grad={self.grad!r}, direction={self.direction!r}, "
            f"reduction={self.reduction!r}, beta={self.beta}"
        )


class KLFromLogits(nn.Module):
    r"""Exact per-position KL between two models' next-token distributions, as a module.

    .. math:: KL(\pi\|ref)_n = \sum_v \pi_{n,v}(\log\pi_{n,v} - \log ref_{n,v})

    :func:`klest.kl_from_logits` with fixed options; ``forward(logits, logits_ref, mask=,
    labels=, return_details=)``.

    Args:
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      reduction: as in :func:`klest.kl_from_logits`.
      temperature: dividing both logits.
      ignore_index: the label of positions to leave out.
      backend: as in :func:`klest.kl_from_logits`.
      memory_budget: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`klest.kl_from_logits`.
      scale: multiplies the result (a loss coefficient such as beta), as in
        :func:`klest.kl_from_logits`: the gradient made in the forward pass then reaches the
        backward with nothing left to do.
      ce_weight: as in :func:`klest.kl_from_logits` (the labels' cross-entropy added, weighted).

    Example:
      >>> loss_fn = KLFromLogits(direction="pi||ref", reduction="token-mean")
      >>> student = torch.randn(2, 5, 32, requires_grad=True)
      >>> loss_fn(student, torch.randn(2, 5, 32)).backward()
    """

    def __init__(
        self,
        *,
        direction: Direction = "pi||ref",
        reduction: Reduction = DEFAULT_REDUCTION,
        temperature: float = 1.0,
        ignore_index: int = -100,
        backend: Backend = "auto",
        memory_budget: int | None = None,
        validate: bool | None = None,
        scale: float | None = None,
        ce_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.direction = check_direction(direction)
        self.reduction = check_choice("reduction", reduction, Reduction)
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.backend = backend
        self.memory_budget = memory_budget
        self.validate = validate
        self.scale = scale
        self.ce_weight = ce_weight

    def forward(
        self,
        logits: Tensor,
        logits_ref: Tensor,
        *,
        mask: Tensor | None = None,
        labels: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        counts: GlobalCounts | None = None,
        return_details: bool = False,
    ) -> Tensor | WithDetails[LogitsDetails]:
        """:func:`klest.kl_from_logits` with this module's options."""
        return kl_from_logits(
            logits,
            logits_ref,
            direction=self.direction,
            mask=mask,
            reduction=self.reduction,
            temperature=self.temperature,
            labels=labels,
            ignore_index=self.ignore_index,
            memory_budget=self.memory_budget,
            backend=self.backend,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            counts=counts,
            validate=self.validate,
            scale=self.scale,
            ce_weight=self.ce_weight,
            return_details=return_details,
        )

    def extra_repr(self) -> str:
        return f"direction={self.direction!r}, reduction={self.reduction!r}"


class KLFromHidden(nn.Module):
    r"""Exact per-position KL from hidden states, fused with the two LM heads, as a module.

    .. math:: \pi_n = \mathrm{softmax}(W h_n + b), \quad ref_n = \mathrm{softmax}(W_{ref}
              h^{ref}_n + b_{ref}), \quad KL(\pi\|ref)_n

    :func:`klest.kl_from_hidden` with the heads and options fixed: ``forward(hidden,
    hidden_ref=None, *, logits_ref=None, mask=, labels=, return_details=)``. The heads are held
    by reference, not registered: they remain parameters of the models they belong to (no
    duplicate in ``parameters()`` or ``state_dict``).

    Sharded heads (FSDP2's ``fully_shard``, whose parameters are DTensor shards between the
    model's forward passes): pass the sharded module(s) that own the heads' parameters as
    ``gather_with`` (typically the root model, and the teacher). The KL then runs as a forward
    method of each (``torch.distributed.fsdp.register_fsdp_forward_method``): the engine gathers
    the weights before it and reshards them after, as for the model's own forward, and again in
    the backward. DeepSpeed ZeRO-3: run the call inside
    ``deepspeed.zero.GatheredParameters([lm_head.weight, ref_head.weight])``.

    Args:
      lm_head: pi's output layer, an ``nn.Linear(H, V)``.
      ref_head: ref's output layer (omit it and pass ``logits_ref`` to ``forward``).
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      reduction: as in :func:`klest.kl_from_hidden`.
      temperature: dividing both models' logits.
      ignore_index: the label of positions to leave out.
      backend: as in :func:`klest.kl_from_hidden`.
      memory_budget: as in :func:`klest.kl_from_hidden`.
      validate: as in :func:`klest.kl_from_hidden`.
      gather_with: the FSDP2-sharded module(s) that own the heads' parameters (None: the
        heads' weights are plain tensors).
      scale: multiplies the result (a loss coefficient such as beta), as in
        :func:`klest.kl_from_hidden`: the gradient made in the forward pass then reaches the
        backward with nothing left to do.
      ce_weight: as in :func:`klest.kl_from_hidden` (the labels' cross-entropy added, weighted).

    Example:
      >>> student_head, teacher_head = torch.nn.Linear(8, 40), torch.nn.Linear(8, 40)
      >>> loss_fn = KLFromHidden(student_head, teacher_head.requires_grad_(False))
      >>> loss_fn(torch.randn(3, 4, 8), torch.randn(3, 4, 8)).backward()
      >>> student_head.weight.grad is not None, list(loss_fn.parameters())
      (True, [])
    """

    def __init__(
        self,
        lm_head: nn.Linear,
        ref_head: nn.Linear | None = None,
        *,
        direction: Direction = "pi||ref",
        reduction: Reduction = DEFAULT_REDUCTION,
        temperature: float = 1.0,
        ignore_index: int = -100,
        backend: Backend = "auto",
        memory_budget: int | None = None,
        validate: bool | None = None,
        gather_with: nn.Module | Sequence[nn.Module] | None = None,
        scale: float | None = None,
        ce_weight: float = 0.0,
    ) -> None:
        super().__init__()
        for name, head in (("lm_head", lm_head), ("ref_head", ref_head)):
            if head is not None and not isinstance(head, nn.Linear):
                raise TypeError(f"{name} must be an nn.Linear, got {type(head).__name__}")
        self._heads = (lm_head, ref_head)  # a tuple: not registered as submodules
        self.direction = check_direction(direction)
        self.reduction = check_choice("reduction", reduction, Reduction)
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.backend = backend
        self.memory_budget = memory_budget
        self.validate = validate
        owners = () if gather_with is None else gather_with
        self._owners = (owners,) if isinstance(owners, nn.Module) else tuple(owners)
        if self._owners:
            from torch.distributed.fsdp import FSDPModule  # at use: its import takes ~0.5 s
        for owner in self._owners:
            if not isinstance(owner, FSDPModule):
                raise TypeError(
                    "gather_with must hold modules sharded with torch.distributed.fsdp."
                    f"fully_shard (FSDP2), got {type(owner).__name__}"
                )
        self.scale = scale
        self.ce_weight = ce_weight

    def forward(
        self,
        hidden: Tensor,
        hidden_ref: Tensor | None = None,
        *,
        logits_ref: Tensor | None = None,
        mask: Tensor | None = None,
        labels: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        counts: GlobalCounts | None = None,
        return_details: bool = False,
    ) -> Tensor | WithDetails[LogitsDetails]:
        """:func:`klest.kl_from_hidden` with this module's heads and options (inside the forward
        methods of ``gather_with``'s modules, which gather the sharded weights)."""
        kwargs = {
            "logits_ref": logits_ref,
            "mask": mask,
            "labels": labels,
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max_seqlen,
            "counts": counts,
            "return_details": return_details,
        }
        return in_forward_of(self._owners, self._kl, hidden, hidden_ref, **kwargs)

    def _kl(
        self,
        hidden: Tensor,
        hidden_ref: Tensor | None,
        *,
        logits_ref: Tensor | None,
        mask: Tensor | None,
        labels: Tensor | None,
        cu_seqlens: Tensor | None,
        max_seqlen: int | None,
        counts: GlobalCounts | None,
        return_details: bool,
    ) -> Tensor | WithDetails[LogitsDetails]:
        lm_head, ref_head = self._heads
        if hidden_ref is not None and ref_head is None:
            raise ValueError(
                "hidden_ref needs a ref_head; construct KLFromHidden(lm_head, ref_head)"
            )
        return kl_from_hidden(
            hidden,
            lm_head.weight,
            hidden_ref,
            None if hidden_ref is None or ref_head is None else ref_head.weight,
            logits_ref=logits_ref,
            bias=lm_head.bias,
            bias_ref=None if hidden_ref is None or ref_head is None else ref_head.bias,
            direction=self.direction,
            mask=mask,
            reduction=self.reduction,
            temperature=self.temperature,
            labels=labels,
            ignore_index=self.ignore_index,
            memory_budget=self.memory_budget,
            backend=self.backend,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            counts=counts,
            validate=self.validate,
            scale=self.scale,
            ce_weight=self.ce_weight,
            return_details=return_details,
        )

    def extra_repr(self) -> str:
        return f"direction={self.direction!r}, reduction={self.reduction!r}"


_FORWARD_METHOD = "_klest_forward"
"""The method klest registers on an FSDP2 module to run a call inside its forward hooks."""


def _call(module: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def in_forward_of(
    modules: nn.Module | Sequence[nn.Module], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` run as a forward method of each FSDP2 module in ``modules``
    (nested; other modules are skipped), so that FSDP2 gathers their sharded parameters around
    it, and again in its backward, as for the modules' own forward.

    For code that reads a sharded model's weights outside its forward (an LM head's weight for a
    fused loss): read them *inside* ``fn``, where they are whole. Registers a method on each
    module (``torch.distributed.fsdp.register_fsdp_forward_method``) the first time.

    Args:
      modules: the modules that own the parameters ``fn`` reads (``fully_shard``-ed ones are
        gathered; plain ones need nothing).
      fn: the computation; its arguments follow.

    Returns:
      What ``fn`` returns.

    Example:
      >>> head = torch.nn.Linear(4, 7)
      >>> h, logits_ref = torch.randn(2, 4), torch.randn(2, 7)
      >>> kl = in_forward_of(head, lambda: kl_from_hidden(h, head.weight, logits_ref=logits_ref))
    """
    owners = [modules] if isinstance(modules, nn.Module) else list(modules)
    # A module is an FSDPModule only once torch.distributed.fsdp is imported: no import here.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    owners = [] if fsdp is None else [m for m in owners if isinstance(m, fsdp.FSDPModule)]
    if not owners:
        return fn(*args, **kwargs)
    from torch.distributed.fsdp import register_fsdp_forward_method

    owner, rest = owners[0], owners[1:]
    if _FORWARD_METHOD not in vars(owner):
        setattr(owner, _FORWARD_METHOD, types.MethodType(_call, owner))
        register_fsdp_forward_method(owner, _FORWARD_METHOD)
    return getattr(owner, _FORWARD_METHOD)(in_forward_of, rest, fn, *args, **kwargs)
