r"""Stage 1 of the sampled-token path: validated inputs as per-row log-ratios.

Every sampled-token function starts here. The log-probs of the sampled tokens under pi, ref and
(off-policy) the behavior policy, and the mask, are checked (structure at once, values queued on
one :class:`~klest._checks.ValueChecks` read) and laid out as ``[rows, T]`` tensors in the
compute dtype (:mod:`klest.layout`), with the per-token log-ratio
``delta = logp - logp_ref`` and the log importance weight ``log_w = logp - logp_behavior``, both
0 at masked positions. :func:`at_sequence_level` sums them per row; :func:`exact_position_kls`
brings in the exact per-position KLs from the logits for the Rao-Blackwellized estimators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from klest._checks import (
    KLEST_NAMES,
    ArgumentNames,
    ValueChecks,
    check_choice,
    check_float_tensor,
    check_log_probs,
    check_mask,
    check_same_shape,
    compute_dtype,
    first_bad,
)
from klest._types import Level
from klest.aggregation import SEQUENCE_REDUCTIONS
from klest.layout import Layout, PackedLayout, layout_of
from klest.logits.dtensor import is_dtensor
from klest.logits.dtensor import position_kls as position_kls_from_logits

__all__ = [
    "LogRatios",
    "at_sequence_level",
    "check_level",
    "check_not_gathered",
    "exact_position_kls",
    "layout_of",
    "prepare_log_ratios",
]


@dataclass(frozen=True)
class LogRatios:
    """Validated inputs as ``[rows, T]`` tensors in the compute dtype.

    ``delta`` and ``log_w`` are 0 at masked positions (so masked inputs never reach a value or
    a gradient); ``valid`` is None when there is no mask and no packing (every position
    counts); ``layout`` is the caller's (:mod:`klest.layout`), which reductions restore.
    """

    delta: Tensor
    log_w: Tensor | None
    valid: Tensor | None
    layout: Layout
    # log pi per row and token, 0 at masked positions, with the caller's graph; None at the
    # sequence level (scores are per token: surrogates take the token-level LogRatios)
    logp: Tensor | None

    def valid_or_all(self) -> Tensor:
        """``valid`` as a tensor (all True without a mask)."""
        if self.valid is None:
            return torch.ones_like(self.delta, dtype=torch.bool)
        return self.valid


def prepare_log_ratios(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    logp_behavior: Tensor | None,
    mask: Tensor | None,
    checks: ValueChecks,
    density: bool = False,
    names: ArgumentNames = KLEST_NAMES,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> LogRatios:
    """Check log-probs and mask (value checks queued on ``checks``); per-row log-ratios.

    ``density``: the inputs are log-densities of continuous samples (they may exceed 0);
    ``names``: the caller's names of the arguments, and whether it takes ``density=True`` (the
    message for values above 0 suggests it only then); ``cu_seqlens`` (and ``max_seqlen``):
    the inputs are packed sequences (:mod:`klest.layout`).
    """
    name, name_ref, name_behavior = names.logp, names.logp_ref, names.logp_behavior
    density_hint = names.density_option
    check_float_tensor(name, logp)
    check_float_tensor(name_ref, logp_ref)
    if logp_behavior is not None:
        check_float_tensor(name_behavior, logp_behavior)
    check_same_shape(**{name: logp, name_ref: logp_ref, name_behavior: logp_behavior})
    check_not_gathered(name, logp)
    layout = layout_of(logp.shape, logp.device, cu_seqlens, max_seqlen, checks, name=name)
    keep = None
    if mask is not None:
        keep = check_mask(
            mask, logp.shape, logp.device, checks, of="the log-probs", name=names.mask
        )
    dtype = compute_dtype(logp, logp_ref, logp_behavior)
    valid = None
    if keep is not None or isinstance(layout, PackedLayout):
        valid = layout.rows(torch.ones_like(logp, dtype=torch.bool) if keep is None else keep)

    def rows(x: Tensor) -> Tensor:
        """``[rows, T]`` in the compute dtype, 0 under the mask (which may hold anything)."""
        x = layout.rows(x).to(dtype)
        return x if valid is None else torch.where(valid, x, 0.0)

    lp, lr = rows(logp), rows(logp_ref)
    # Checked on the masked tensors (a 0 there passes every check), in the caller's layout.
    sampler = "pi" if logp_behavior is None else "behavior"
    for arg, x, original, allow_neg_inf, role in (
        # Off-policy, pi may give a behavior sample probability 0.
        (name, lp, logp, logp_behavior is not None, "a sample pi cannot produce"),
        (name_ref, lr, logp_ref, True, ""),
    ):
        check_log_probs(
            arg,
            layout.tokens(x),
            checks,
            allow_neg_inf=allow_neg_inf,
            role=role,
            density=density,
            density_hint=density_hint,
            rounding_of=original.dtype,
        )
    delta = lp - lr
    log_w = None
    if logp_behavior is not None:
        lb = rows(logp_behavior)
        check_log_probs(
            name_behavior,
            layout.tokens(lb),
            checks,
            allow_neg_inf=False,
            role=f"a sample {sampler} cannot produce",
            density=density,
            density_hint=density_hint,
            rounding_of=logp_behavior.dtype,
        )
        log_w = lp - lb
        # A behavior sample that pi cannot produce has weight 0 and contributes 0 (its log-prob
        # is 0 for the score terms: it has no score).
        producible = lp > -math.inf
        delta = torch.where(producible, delta, 0.0)
        lp = torch.where(producible, lp, 0.0)
    return LogRatios(delta, log_w, valid, layout, lp)


def at_sequence_level(lr: LogRatios) -> LogRatios:
    """One log-ratio (and log-weight) per row: the sums over its tokens, ``[rows, 1]`` (no
    ``logp``: scores stay per token)."""
    if lr.layout.samples:
        return lr  # a 1-D input holds independent samples: each is its own sequence
    return LogRatios(
        lr.delta.sum(-1, keepdim=True),
        None if lr.log_w is None else lr.log_w.sum(-1, keepdim=True),
        None if lr.valid is None else lr.valid.any(-1, keepdim=True),
        lr.layout.per_row(),
        None,
    )


def check_not_gathered(name: str, x: Tensor) -> None:
    """Refuse ``[..., T, 1]``: the trailing 1 of ``gather(-1, index.unsqueeze(-1))`` left in
    place, which would read as ``B * T`` one-token sequences."""
    if x.ndim >= 3 and x.shape[-1] == 1:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}: a trailing dimension of 1 (the index dimension "
            f"of a gather?) would make every token its own sequence; pass {name}.squeeze(-1)"
        )


def check_level(level: object, reduction: str) -> None:
    check_choice("level", level, Level)
    if level == "sequence" and reduction not in SEQUENCE_REDUCTIONS:
        raise ValueError(
            f"reduction {reduction!r} needs per-token values; with level='sequence' use one of "
            f"{', '.join(map(repr, SEQUENCE_REDUCTIONS))}"
        )


def exact_position_kls(
    logits: Tensor | None,
    logits_ref: Tensor | None,
    logp: Tensor,
    lr: LogRatios,
    *,
    position_kls: Tensor | None = None,
    direction: str,
    checks: ValueChecks,
    why: str,
) -> Tensor:
    """The exact per-position KLs ``[rows, T]``: from logits ``logp.shape + (V,)``, or given.

    ``position_kls`` (``logp.shape``, e.g. from :func:`klest.kl_from_hidden` with
    ``reduction="none"``) keeps its graph only where gradients are being recorded.
    """
    if position_kls is not None:
        if logits is not None or logits_ref is not None:
            raise ValueError("pass either position_kls or logits and logits_ref, not both")
        check_float_tensor("position_kls", position_kls)
        check_same_shape(logp=logp, position_kls=position_kls)
        kls = position_kls if torch.is_grad_enabled() else position_kls.detach()
        kls = lr.layout.rows(kls).to(lr.delta.dtype)
        bad = ~torch.isfinite(kls)
        checks.add(
            bad if lr.valid is None else bad & lr.valid,
            lambda flags: f"position_kls is NaN or infinite at {first_bad(flags)}",
        )
        return kls if lr.valid is None else torch.where(lr.valid, kls, 0.0)
    if logits is None or logits_ref is None:
        raise ValueError(
            f"{why} needs the full next-token distributions: pass logits and logits_ref "
            f"(shape logp.shape + (V,) = {tuple(logp.shape)} + (V,)), or their exact "
            "per-position KLs as position_kls"
        )
    for name, t in (("logits", logits), ("logits_ref", logits_ref)):
        check_float_tensor(name, t, what="logits")
        if (t.to_local() if is_dtensor(t) else t).shape[:-1] != logp.shape:  # this rank's
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected logp's shape {tuple(logp.shape)} "
                "plus a vocabulary dimension"
            )
    keep = None if lr.valid is None else lr.layout.tokens(lr.valid)
    kls = position_kls_from_logits(
        logits, logits_ref, direction=direction, keep=keep, checks=checks
    )
    return lr.layout.rows(kls).to(lr.delta.dtype)
