r"""Log-probabilities of given tokens under ``softmax(logits / T)``, memory-bounded.

For logits ``z`` ``[..., V]`` at temperature :math:`\tau` and a token id :math:`y` per position,

.. math::
    \log\pi(y) = z_y/\tau - \log\sum_v e^{z_v/\tau}, \qquad
    \frac{\partial \log\pi(y)}{\partial z} = \tfrac{1}{\tau}\,(e_y - \pi),

what a policy-gradient or KL loss needs per sampled token. The plain
``log_softmax(z / tau).gather(...)`` keeps a float copy of the logits (and, for bf16 logits, one
in float32) alive for its backward; here an ``autograd.Function`` walks blocks of positions,
computing ``logsumexp`` in float32 (float64 for float64 logits) on one block at a time, and saves
only the logits themselves and one normalizer per position. The backward recomputes
``softmax`` block by block and writes the gradient, in the logits' dtype, straight into its
buffer. A ``[B, T, V]`` view with strides (a slice of a model's output along T) is read in
place: no copy of it is made.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from klest._checks import (
    ValueChecks,
    check_float_tensor,
    check_labels,
    check_positive_int,
    check_temperature,
    first_bad,
    resolve_validate,
)
from klest.logits._rows import chunk_rows

__all__ = ["token_log_probs"]

# Float buffers of V entries that one position of a block holds at once (scaled logits, softmax).
_BUFFERS_PER_POSITION = 2

Block = tuple[slice, slice]


def _blocks(b: int, t: int, rows: int) -> Iterator[Block]:
    """``(batch slice, token slice)`` blocks of at most ``rows`` positions of a ``[b, t]`` grid:
    whole rows of t positions when they fit, else pieces of one row."""
    if b == 0 or t == 0:
        return
    if t <= rows:
        step = rows // t
        for i in range(0, b, step):
            yield slice(i, i + step), slice(None)
        return
    for i in range(b):
        for j in range(0, t, rows):
            yield slice(i, i + 1), slice(j, j + rows)


def _work_dtype(z: Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def _scaled(z: Tensor, inv_tau: float, dtype: torch.dtype) -> Tensor:
    """A block of logits divided by tau in the work dtype (a new tensor: never written back)."""
    a = z.to(dtype)
    return a * inv_tau if inv_tau != 1.0 else a


class _TokenLogProbs(torch.autograd.Function):
    """``(z [B, T, V], tokens [B, T], keep [B, T]) -> log pi(token) [B, T]`` (0 where not kept)."""

    @staticmethod
    def forward(ctx, z, tokens, keep, inv_tau: float, rows: int):
        dtype = _work_dtype(z)
        b, t, _ = z.shape
        lse = torch.zeros(b, t, dtype=dtype, device=z.device)
        for blk in _blocks(b, t, rows):
            lse[blk] = torch.logsumexp(_scaled(z[blk], inv_tau, dtype), -1)
        picked = _scaled(z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), inv_tau, dtype)
        ctx.save_for_backward(z, tokens, keep, lse)
        ctx.mark_non_differentiable(lse)
        ctx.inv_tau, ctx.rows = inv_tau, rows
        return torch.where(keep, picked - lse, 0.0), lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _grad_lse):
        z, tokens, keep, lse = ctx.saved_tensors
        inv_tau = ctx.inv_tau
        dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
        # Not kept: no gradient (their logits may be anything, NaN included).
        g = torch.where(keep, grad.to(lse.dtype), 0.0) * inv_tau
        for blk in _blocks(*z.shape[:2], ctx.rows):
            # A new buffer: _scaled may return the logits themselves.
            d = (_scaled(z[blk], inv_tau, lse.dtype) - lse[blk].unsqueeze(-1)).exp_()
            gb = g[blk].unsqueeze(-1)
            d.mul_(-gb).scatter_add_(-1, tokens[blk].unsqueeze(-1), gb)
            dz[blk] = d.masked_fill_(~keep[blk].unsqueeze(-1), 0.0)
        return dz, None, None, None, None


def token_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    memory_budget: int | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""``log_softmax(logits / temperature)`` at the given tokens, without a float copy of the
    logits.

    .. math::
        \log\pi_n(y_n) = z_{n,y_n}/\tau - \log\sum_v e^{z_{n,v}/\tau}

    for each position n, with gradient :math:`(e_{y_n} - \pi_n)/\tau` to the logits (written in
    their dtype during the backward, block by block).

    Samples: none; ``labels`` are whatever tokens were sampled (from pi at temperature :math:`\tau`
    when these are the policy's log-probs of its own completions).

    Shift: the logits at position n must be the distribution that produced ``labels[n]``. A
    causal LM's output at column j predicts the token at column j + 1, so for a model run on
    ``input_ids`` pass ``logits[:, :-1]`` and ``input_ids[:, 1:]`` (or use
    :func:`klest.integrations.hf.completion_batch`, which aligns completions).

    Memory: the logits are read in blocks of positions (at most ``memory_budget`` bytes of
    float32 workspace, default 32 MiB on the CPU and 1 GiB on a GPU); only they (not a copy)
    and one float per position are saved for the backward. Math in float32 for float32 / bf16
    / fp16 logits, float64 for float64.

    Args:
      logits: ``[..., V]`` (any float dtype), with the model's graph.
      labels: integer ``[...]``: the token at each position, or ``ignore_index`` where there is
        none (padding).
      temperature: :math:`\tau > 0`, dividing the logits (the sampling temperature).
      ignore_index: the token value of positions to leave out: their log-prob is 0 and they
        pass no gradient (their logits are not read for validity).
      memory_budget: bytes of float32 workspace per block.
      validate: check token ids (in ``[0, V)`` or ``ignore_index``) and that every position
        that counts has a distribution (no NaN / ``+inf`` logits, not all ``-inf``); None: the
        global default (:func:`klest.set_default_validate`).

    Returns:
      ``[...]`` log-probs in float32 (float64 for float64 logits), 0 at ignored positions.

    Raises:
      TypeError: non-float logits or non-integer labels.
      ValueError: shapes that do not match, token ids out of range, logits rows without a
        distribution at counted positions.

    Example:
      >>> logits = torch.randn(2, 3, 5, requires_grad=True)
      >>> labels = torch.tensor([[0, 4, 2], [1, -100, -100]])  # -100: padding
      >>> logp = token_log_probs(logits, labels, temperature=0.7)
      >>> ref = torch.log_softmax(logits / 0.7, -1)[0, 1, 4]
      >>> torch.allclose(logp[0, 1], ref), float(logp[1, 2].detach())
      (True, 0.0)
      >>> logp.sum().backward()
    """
    check_float_tensor("logits", logits, what="logits")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    inv_tau = 1.0 / check_temperature(temperature)
    check_positive_int("memory_budget", memory_budget)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    checks = ValueChecks(resolve_validate(validate))
    lead, v, device = logits.shape[:-1], logits.shape[-1], logits.device
    flat = check_labels(labels, lead, device, checks, vocab_size=v, ignore_index=ignore_index)
    keep = flat != ignore_index
    index = torch.where((flat >= 0) & (flat < v), flat, 0)  # in range (others are reported)
    # [B, T, V] without a copy: a view for every layout reshape can view (a slice along T too).
    shape3 = (math.prod(lead[:-1]), lead[-1]) if lead else (1, 1)
    z = logits.reshape(*shape3, v)
    rows = chunk_rows(_BUFFERS_PER_POSITION * 4 * v, logits.device, memory_budget, None)
    logp, lse = _TokenLogProbs.apply(z, index.view(shape3), keep.view(shape3), inv_tau, rows)
    checks.add(
        keep.view(shape3) & ~torch.isfinite(lse),
        lambda f: (
            "logits has no distribution (NaN or +inf entries, or every entry -inf) at "
            f"{first_bad(f.reshape(lead) if lead else f.reshape(1))} of the counted positions "
            f"(shape {tuple(lead)}); give those positions ignore_index"
        ),
    )
    checks.run()
    return logp.reshape(lead)
