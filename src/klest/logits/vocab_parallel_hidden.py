r"""Vocab-parallel exact KL from hidden states: each rank holds its shard of both LM heads.

Under tensor parallelism (Megatron's ``ColumnParallelLinear`` output layer, torchtitan's
column-wise ``lm_head``) rank ``r`` holds rows ``[o_r, o_r + V_r)`` of each head ``W [V, H]``.
Here each rank makes its shard's logits chunk by chunk from the (replicated) hidden states,
reduces each chunk to per-row statistics and merges them over the group with the two
collectives of :func:`klest.kl_from_logits_vocab_parallel` (module
:mod:`klest.logits.vocab_parallel`), then writes the chunk's logits gradient and folds it into
``dh = G W_r`` and ``dW_r += G^T h`` (:func:`klest.kl_from_hidden`'s gradient in the forward
pass). No ``[N, V]`` tensor exists anywhere and the vocabulary is never gathered: per chunk of
``n_c`` rows, an ``all_reduce(MAX)`` of ``[2, n_c]`` and an ``all_reduce(SUM)`` of ``[7, n_c]``
floats, plus one ``all_gather`` of the shard sizes per call (none with ``vocab_start_index``).

Outputs (the KL, details) are replicated over the group. Each head's gradient is its own shard's.
The hidden states' gradient is this shard's part of the sum over the vocabulary: the engine's
tensor-parallel region sums it (Megatron's ``copy_to_tensor_model_parallel_region`` before the
output layer does, in its backward), or ``reduce_hidden_grad=True`` all-reduces it here.

The teacher's payload in on-policy distillation is then its final hidden states ``[N, H_ref]``
and its head shard, not ``[N, V]`` logits: :math:`V/H` times less to send and hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from klest._checks import check_linear
from klest._types import DEFAULT_REDUCTION, Backend, Direction, Reduction
from klest.aggregation import GlobalCounts, WithDetails
from klest.logits._call import LogitsDetails, check_valid_vocab_size, value_grads
from klest.logits._rows import row_grads, row_stats, workspace_bytes_per_row
from klest.logits._stats import KLRowStats
from klest.logits.from_hidden import _KLPlan, run_hidden
from klest.logits.vocab_parallel import (
    VocabShard,
    merge_shards,
    vocab_layout,
)

__all__ = ["SHARD_OPTIONS", "kl_from_hidden_vocab_parallel", "run_sharded_hidden"]


@dataclass(frozen=True)
class _ShardKLPlan(_KLPlan):
    """The exact KL's row plan on a vocabulary shard: each chunk's statistics merged over
    ``group`` before its gradient is made from them."""

    group: Any = None

    def stats(self, z_c: Tensor, y_c: Tensor, labels: Tensor | None) -> Tensor:
        local = KLRowStats(*row_stats(z_c, y_c, **self._options(z_c, labels)))
        owner = None if labels is None else (labels >= 0) & (labels < z_c.shape[-1])
        return torch.stack(merge_shards(local, None, group=self.group, owner=owner))

    def stats_grads(self, z_c, y_c, labels, coef, need_z, need_y):
        stats = self.stats(z_c, y_c, labels)
        dz, dy = row_grads(
            z_c,
            y_c,
            KLRowStats(*stats.unbind(0)),
            value_grads(coef, self.direction, self.ce_weight),
            inv_tau=self.inv_tau,
            labels=labels,
            rows=None,
            need_z=need_z,
            need_y=need_y,
            backend=self.backend,
            chunk=z_c.shape[0],
        )
        return stats, dz, dy


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _padding_row(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """A shard of padding only, as one vocabulary row whose logit is the dtype's lowest value
    for every position (zero weights, that bias): no mass, finite statistics, and a gradient of
    exactly 0 to the real head (the ``where``)."""
    never = torch.zeros_like(weight[:1], dtype=torch.bool)
    row = torch.where(never, weight[:1], 0.0)
    lowest = torch.full(
        (1,), torch.finfo(weight.dtype).min, dtype=weight.dtype, device=weight.device
    )
    if bias is not None:
        lowest = torch.where(torch.zeros_like(bias[:1], dtype=torch.bool), bias[:1], lowest)
    return row, lowest


def _cut_head(
    weight: Tensor | None, bias: Tensor | None, keep: int
) -> tuple[Tensor | None, Tensor | None]:
    """The head's first ``keep`` rows (the rest padding)."""
    if weight is None or keep >= weight.shape[0]:
        return weight, bias
    if keep > 0:
        return weight[:keep], None if bias is None else bias[:keep]
    return _padding_row(weight, bias)


def kl_from_hidden_vocab_parallel(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
    reduce_hidden_grad: bool = False,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    stash: bool | None = None,
    scale: float | Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position KL from hidden states when both LM heads are sharded over the
    vocabulary.

    .. math::
        KL(\pi\|ref)_n = \sum_{v=1}^{V} \pi_{n,v}(\log\pi_{n,v} - \log ref_{n,v}),\quad
        \pi_n = \mathrm{softmax}((W h_n + b)/T),\;
        ref_n = \mathrm{softmax}((W_{ref} h^{ref}_n + b_{ref})/T)

    (or :math:`KL(ref\|\pi)`) over the whole vocabulary, where this rank holds rows
    ``[o_r, o_r + V_r)`` of ``W``, ``W_ref`` (and the biases), ranks in order. Equal to
    :func:`klest.kl_from_hidden` with the whole heads; every rank returns the same KL and
    details, its heads' shard gradients, and its part of the hidden states' gradients (module
    docstring). No samples: the exact per-position term.

    Args:
      hidden: pi's final hidden states ``[..., H]``, the same on every rank of the group
        (Megatron's ``[s, b, h]`` layout works as any ``[..., H]``).
      weight: this rank's shard of pi's LM head ``[V_r, H]``.
      hidden_ref: ref's hidden states ``[..., H_ref]`` (same positions).
      weight_ref: this rank's shard of ref's head ``[V_r, H_ref]`` (the same rows as
        ``weight``'s).
      bias: this rank's shard of pi's head bias ``[V_r]``, if any.
      bias_ref: ref's, if any.
      group: the tensor-parallel process group (default: the world).
      vocab_size: the whole (padded) V, checked against the shards when given.
      vocab_start_index: this rank's first row :math:`o_r`, with ``vocab_size``: skips the
        ``all_gather`` of the shard sizes.
      valid_vocab_size: the real vocabulary :math:`V' \le V`: rows ``[V', V)`` are padding and
        are left out (as in :func:`klest.kl_from_logits_vocab_parallel`).
      reduce_hidden_grad: all-reduce (sum) the hidden states' gradients over ``group`` here;
        leave False where the engine's tensor-parallel region does it.
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      mask: bool ``[...]``, identical on every rank.
      reduction: as in :func:`klest.kl_from_logits`.
      temperature: :math:`T > 0`.
      labels: *global* token ids ``[...]``, identical on every rank.
      ignore_index: the label of positions to leave out.
      memory_budget: bytes for one chunk (planned for the widest shard, so that every rank
        runs the same chunks and collectives).
      chunk_size: rows per chunk, overriding ``memory_budget``.
      backend: as in :func:`klest.kl_from_logits`.
      stash: as in :func:`klest.kl_from_hidden`.
      scale: as in :func:`klest.kl_from_hidden`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`klest.kl_from_logits`.
      return_details: also return a :class:`~klest.LogitsDetails`.

    Returns:
      As :func:`klest.kl_from_hidden`, replicated over the group.

    Example:
      One process holding the whole vocabulary (under ``torchrun`` each rank passes its shard):

      >>> import tempfile, torch.distributed as dist
      >>> store = tempfile.NamedTemporaryFile(delete=False).name
      >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
      >>> h, w = torch.randn(4, 8), torch.randn(50, 8)
      >>> h_ref, w_ref = torch.randn(4, 6), torch.randn(50, 6)
      >>> kl = kl_from_hidden_vocab_parallel(h, w, h_ref, w_ref)
      >>> torch.allclose(kl, klest.kl_from_hidden(h, w, h_ref, w_ref))
      True
      >>> dist.destroy_process_group()
    """
    options = {k: v for k, v in locals().items() if k in SHARD_OPTIONS}

    def make_plan(inv_tau: float, resolved: str, chunk: int) -> _ShardKLPlan:
        return _ShardKLPlan(inv_tau, return_details, resolved, chunk, direction, group=group)

    return run_sharded_hidden(
        "kl_from_hidden_vocab_parallel",
        hidden,
        weight,
        hidden_ref,
        weight_ref,
        direction=direction,
        make_plan=make_plan,
        workspace=workspace_bytes_per_row,
        **options,
    )


SHARD_OPTIONS = (
    "bias",
    "bias_ref",
    "group",
    "vocab_size",
    "vocab_start_index",
    "valid_vocab_size",
    "reduce_hidden_grad",
    "mask",
    "reduction",
    "temperature",
    "labels",
    "ignore_index",
    "memory_budget",
    "chunk_size",
    "backend",
    "stash",
    "scale",
    "cu_seqlens",
    "max_seqlen",
    "counts",
    "validate",
    "return_details",
)
"""The options of every vocab-parallel function from hidden states, passed on unchanged."""


def run_sharded_hidden(
    name: str,
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None,
    weight_ref: Tensor | None,
    *,
    bias: Tensor | None,
    bias_ref: Tensor | None,
    group: Any,
    vocab_size: int | None,
    vocab_start_index: int | None,
    valid_vocab_size: int | None,
    reduce_hidden_grad: bool,
    **options: Any,
) -> Tensor | WithDetails[LogitsDetails]:
    """Check the shards of both heads, find this rank's columns (``vocab_layout``), cut the
    padding rows, and run :func:`klest.logits.from_hidden.run_hidden` on the shard (the plan
    from ``options["make_plan"]`` merges each chunk over ``group``); ``name`` is the caller's,
    for errors."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs an initialized torch.distributed")
    if hidden_ref is None or weight_ref is None:
        raise ValueError("give ref's hidden states and its head shard: hidden_ref, weight_ref")
    check_linear("", hidden, weight, bias)
    check_linear("_ref", hidden_ref, weight_ref, bias_ref)
    if weight_ref.shape[0] != weight.shape[0]:
        raise ValueError(
            f"weight has {weight.shape[0]} rows but weight_ref {weight_ref.shape[0]}: both heads' "
            "shards must hold the same vocabulary rows"
        )
    v_local = weight.shape[0]
    n = math.prod(hidden.shape[:-1])
    offset, v_total, widest = vocab_layout(
        n, v_local, group, hidden.device, vocab_size, vocab_start_index
    )
    if valid_vocab_size is not None:
        v_total = check_valid_vocab_size(valid_vocab_size, (v_total,))
        keep = v_total - offset
        weight, bias = _cut_head(weight, bias, keep)
        weight_ref, bias_ref = _cut_head(weight_ref, bias_ref, keep)
    if reduce_hidden_grad:
        hidden = _SumGradOver.apply(hidden, group)
        hidden_ref = _SumGradOver.apply(hidden_ref, group)
    shard = VocabShard(offset, weight.shape[0], v_total, widest)
    return run_hidden(
        hidden,
        weight,
        hidden_ref,
        weight_ref,
        logits_ref=None,
        bias=bias,
        bias_ref=bias_ref,
        shard=shard,
        **options,
    )
