r"""What the verl and OpenRLHF drop-ins share: a peer's per-token value with klest's gradient.

Both peers compute a per-token KL value from the log-probs of the sampled tokens, and train with
the autodiff of that value. ``grad="peer"`` keeps that gradient. The other choices keep the
peer's value and take the gradient from :func:`klest.kl_penalty` with ``reduction="none"``:
per-token losses whose sum over a sequence has the gradient of that sequence's estimator, so a
peer's own loss aggregation reduces them. With a sum over tokens and a mean over sequences
(verl's ``"seq-mean-token-sum"``) the gradient is that of the sequence-level KL(pi||ref).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from klest._checks import ArgumentNames, ValueChecks, named_by_caller, resolve_validate
from klest._types import Baseline
from klest.sampled.baselines import BaselineEMA
from klest.sampled.log_ratios import prepare_log_ratios
from klest.sampled.penalty import kl_penalty
from klest.surrogates import join

PeerGrad = Literal["peer", "score", "cumulative", "rb"]
"""The gradient of a peer drop-in: ``"peer"`` (the peer's own: autodiff of its value, or its
straight-through surrogate), or a gradient estimator of :func:`klest.kl_penalty` for sampled
tokens, unbiased for the gradient of the sequence-level KL(pi||ref): ``"score"``,
``"cumulative"`` or ``"rb"`` (which needs the logits)."""


class PeerLogRatios(NamedTuple):
    """Checked log-ratios in the caller's shape and klest's compute dtype, 0 where masked.

    Attributes:
      delta: ``logp - logp_ref``, with the graph of ``logp``.
      log_w: ``logp - logp_behavior`` (None without ``logp_behavior``), with graph.
    """

    delta: Tensor
    log_w: Tensor | None


def peer_log_ratios(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    logp_behavior: Tensor | None = None,
    mask: Tensor | None,
    validate: bool | None,
    names: ArgumentNames,
) -> PeerLogRatios:
    """Check the log-probs (klest's rules: shapes, dtypes, no NaN / +inf / values above 0) and
    return their log-ratios (one host synchronisation for the value checks). ``names``: the
    peer's names of the three arguments, for the messages."""
    checks = ValueChecks(resolve_validate(validate))
    lr = prepare_log_ratios(
        logp,
        logp_ref,
        logp_behavior=logp_behavior,
        mask=mask,
        checks=checks,
        names=names,
    )
    checks.run()
    log_w = None if lr.log_w is None else lr.log_w.reshape(logp.shape)
    return PeerLogRatios(lr.delta.reshape(logp.shape), log_w)


@dataclasses.dataclass(frozen=True)
class KlestOptions:
    """The options of :func:`klest.kl_penalty` that a drop-in passes on (see its arguments)."""

    mask: Tensor | None = None
    baseline: Baseline | BaselineEMA | Tensor | None = None
    group: Tensor | None = None
    logp_behavior: Tensor | None = None
    logits: Tensor | None = None
    logits_ref: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None
    validate: bool | None = None

    def per_token(
        self,
        logp: Tensor,
        logp_ref: Tensor,
        *,
        grad: str,
        names: ArgumentNames,
        estimator: str = "k1",
    ) -> Tensor:
        """``klest.kl_penalty(..., reduction="none")``: per-token losses ``logp.shape``; its
        messages and warnings call the arguments ``names``."""
        with named_by_caller(names):
            penalty = kl_penalty(
                logp,
                logp_ref,
                estimator=estimator,  # type: ignore[arg-type]
                grad=grad,  # type: ignore[arg-type]
                reduction="none",
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            )
        assert isinstance(penalty, Tensor)
        return penalty

    def refuse_for_peer(self, **more: object) -> None:
        """Refuse the options of klest's gradients (all but ``mask`` and ``validate``, and
        ``more``) with ``grad="peer"``, which would ignore them."""
        options = {
            "baseline": self.baseline,
            "group": self.group,
            "logp_behavior": self.logp_behavior,
            "logits": self.logits,
            "logits_ref": self.logits_ref,
            **more,
        }
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to klest's "
                "gradients (grad='cumulative', 'score' or 'rb'), not to grad='peer'"
            )


def with_klest_gradient(
    value_of: Callable[[Tensor], Tensor],
    logp: Tensor,
    logp_ref: Tensor,
    *,
    grad: str,
    options: KlestOptions,
    names: ArgumentNames,
) -> Tensor:
    """``value_of(logp - logp_ref)`` forward (no gradient), the per-token losses of
    ``klest.kl_penalty(..., grad=grad, reduction="none")`` backward; 0 where masked. ``names``:
    the peer's names of the arguments, for the messages.

    :func:`klest.kl_penalty` checks the inputs, so the value's log-ratios are not checked twice.
    """
    # k1: the cheapest value, replaced by value_of's
    penalty = options.per_token(logp, logp_ref, grad=grad, names=names)
    with torch.no_grad():
        delta = peer_log_ratios(
            logp, logp_ref, mask=options.mask, validate=False, names=names
        ).delta
        value = value_of(delta)
    return join(value.to(penalty.dtype), penalty)
