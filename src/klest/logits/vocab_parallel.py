r"""Vocab-parallel exact KL: logits sharded over the vocabulary across a process group.

Under tensor parallelism each rank ``r`` holds columns ``[o_r, o_r + V_r)`` of both models'
logits. Each rank reduces its shard to per-row statistics (:mod:`klest.logits._rows`: local
log-normalizers :math:`\ell_r`, local KLs, entropy and label log-probs, as if its shard were the
whole vocabulary); two collectives merge them exactly. With :math:`M = \max_r \ell^a_r`,
:math:`S_r = e^{\ell^a_r - M}`, :math:`S = \sum_r S_r` (pi's side; :math:`U_r`, :math:`U` with
:math:`\ell^b_r` for ref's), and the shard weights :math:`w_r = S_r/S = \pi(\text{shard } r)`:

.. math::
    \mathrm{lse}_a = M + \log S, \quad
    KL(\pi\|ref) = \sum_r w_r\big(KL_r + \log w_r - \log u_r\big), \quad
    H(\pi) = \sum_r w_r (H_r - \log w_r),

:math:`KL(ref\|\pi)` symmetrically, and a label's log-prob is its owner's local one plus
:math:`\log w_r`. Collectives per call, forward: an ``all_gather`` of the shard sizes (a check),
an ``all_reduce(MAX)`` of ``[2, N]`` and an ``all_reduce(SUM)`` of ``[7, N]`` floats. Backward:
none, since each shard's gradient is exact given the merged statistics (module
:mod:`klest.logits._rows`). The same code runs over gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from klest._checks import ValueChecks, check_logits_pair, check_temperature, resolve_validate
from klest._types import DEFAULT_REDUCTION, Backend, Direction, Reduction
from klest.aggregation import GlobalCounts, WithDetails
from klest.logits._call import (
    LogitsDetails,
    Positions,
    check_valid_vocab_size,
    finish,
    in_sequences,
    plan_for,
    positions,
)
from klest.logits._stats import KLRowStats
from klest.logits.from_logits import rows_kl

__all__ = ["VocabShard", "kl_from_logits_vocab_parallel", "shard_logits"]


def shard_layout(n: int, v_local: int, group, device: torch.device) -> tuple[int, int, int]:
    """``(offset of this rank's shard, total V, widest shard)``, checking every rank has ``n``
    rows (one ``all_gather``)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([n, v_local], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [int(t[0]) for t in every]
    sizes = [int(t[1]) for t in every]
    if len(set(rows)) != 1:
        raise ValueError(f"every rank must hold the same positions: rows per rank {rows}")
    rank = dist.get_rank(group)
    return sum(sizes[:rank]), sum(sizes), max(sizes)


def vocab_layout(
    n: int,
    v_local: int,
    group,
    device: torch.device,
    vocab_size: int | None,
    vocab_start_index: int | None,
) -> tuple[int, int, int]:
    """``(offset, total V, widest shard)``: gathered over ``group`` (and checked against
    ``vocab_size``), or from ``vocab_start_index`` and ``vocab_size`` with no collective (the
    widest shard then taken as ``ceil(V / world)``, Megatron's equal split)."""
    if vocab_start_index is None:
        offset, v_total, widest = shard_layout(n, v_local, group, device)
        if vocab_size is not None and vocab_size != v_total:
            raise ValueError(
                f"the shard sizes add up to V = {v_total} over the group, but vocab_size = "
                f"{vocab_size}"
            )
        return offset, v_total, widest
    offset, v_total = given_layout(vocab_start_index, vocab_size, v_local)
    return offset, v_total, -(-v_total // dist.get_world_size(group))


def given_layout(start: object, vocab_size: object, v_local: int) -> tuple[int, int]:
    """``(offset, V)`` from ``vocab_start_index`` and ``vocab_size``, checked locally."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"vocab_start_index must be an int >= 0, got {start!r}")
    if vocab_size is None:
        raise ValueError("vocab_start_index= needs vocab_size= (the whole padded vocabulary)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if start + v_local > vocab_size:
        raise ValueError(
            f"vocab_start_index={start} + this shard's {v_local} columns exceeds "
            f"vocab_size={vocab_size}"
        )
    return start, vocab_size


def shard_logits(
    name: str,
    logits: Tensor,
    logits_ref: Tensor,
    *,
    group: Any,
    vocab_size: int | None,
    vocab_start_index: int | None,
    valid_vocab_size: int | None,
    direction: str,
    mask: Tensor | None,
    reduction: str,
    temperature: float,
    labels: Tensor | None,
    ignore_index: int,
    validate: bool | None,
    details: bool,
) -> tuple[Tensor, Tensor, Positions, float, VocabShard, Tensor | None, ValueChecks]:
    """Check a vocab-parallel call on logit shards ``[..., V_r]`` (``name``: the caller, for
    errors): ``(z, y, positions, T, shard, local labels, checks)``, with ``z``, ``y`` this
    rank's ``[N, V_r]`` columns (padding beyond ``valid_vocab_size`` cut) and the labels in
    the shard's convention (:meth:`VocabShard.local_labels`)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs an initialized torch.distributed")
    logits, logits_ref = check_logits_pair(logits, logits_ref)
    tau = check_temperature(temperature)
    checks = ValueChecks(resolve_validate(validate))
    v_local = logits.shape[-1]
    z, y = logits.reshape(-1, v_local), logits_ref.reshape(-1, v_local)
    offset, v_total, widest = vocab_layout(
        z.shape[0], v_local, group, z.device, vocab_size, vocab_start_index
    )
    if valid_vocab_size is not None:
        v_valid = check_valid_vocab_size(valid_vocab_size, (v_total,))
        z, y = _valid_columns(z, y, v_valid - offset)
        v_total = v_valid
    pos = positions(
        logits.shape[:-1],
        logits.device,
        direction=direction,
        reduction=reduction,
        mask=mask,
        labels=labels,
        vocab_size=v_total,
        ignore_index=ignore_index,
        details=details,
        checks=checks,
    )
    shard = VocabShard(offset, z.shape[-1], v_total, widest)
    local = None if pos.labels is None else shard.local_labels(pos.labels, ignore_index)
    return z, y, pos, tau, shard, local, checks


def _valid_columns(z: Tensor, y: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """This shard's first ``keep`` columns (the rest padding). A shard of padding only stands
    as one column at the dtype's lowest value in both models: its mass exp(lowest - lse)
    underflows to exactly 0, so the merge gives it weight 0, its statistics stay finite, and
    the ``where`` passes the padding a gradient of exactly 0."""
    if keep >= z.shape[-1]:
        return z, y
    if keep > 0:
        return z[:, :keep], y[:, :keep]
    never = torch.zeros_like(z[:, :1], dtype=torch.bool)
    lowest = torch.finfo(z.dtype).min
    return torch.where(never, z[:, :1], lowest), torch.where(never, y[:, :1], lowest)


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns ``[offset, offset + size)`` of a vocabulary of ``vocab_size`` split
    over ranks, the widest rank's ``widest`` columns."""

    offset: int
    size: int
    vocab_size: int
    widest: int

    def local_labels(self, labels: Tensor, ignore_index: int) -> Tensor:
        """Global ids in this shard's convention: its columns ``[0, size)``, ``-1`` ignored,
        ``size`` another shard's token."""
        mine = (labels >= self.offset) & (labels < self.offset + self.size)
        other = torch.where(labels == ignore_index, -1, self.size)
        return torch.where(mine, labels - self.offset, other)


def _owned(owner: Tensor | None, x: Tensor) -> Tensor:
    """``x`` on the rows whose label this shard holds, else 0."""
    return torch.zeros_like(x) if owner is None else torch.where(owner, x, 0.0)


def merge_shards(stats: KLRowStats, keep: Tensor | None, *, group, owner: Tensor | None):
    """Whole-row statistics from every rank's shard statistics (module docstring)."""
    lse = torch.stack([stats.lse_z, stats.lse_y])
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    rel = lse - top  # log S_r, log U_r (<= 0; -inf for a shard with no mass)
    weight = rel.exp()

    def weighted(w, x):
        return torch.where(w > 0, w * x, 0.0)

    parts = torch.stack(
        [
            weight[0],
            weight[1],
            weighted(weight[0], stats.kl_pi_ref + rel[0] - rel[1]),
            weighted(weight[1], stats.kl_ref_pi + rel[1] - rel[0]),
            weighted(weight[0], stats.entropy - rel[0]),
            _owned(owner, stats.logp_label + rel[0]),
            _owned(owner, stats.logp_ref_label + rel[1]),
        ]
    )
    dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=group)
    s_a, s_b, t_a, t_b, e_a, l_a, l_b = parts.unbind(0)
    log_s_a, log_s_b = s_a.log(), s_b.log()
    merged = KLRowStats(
        lse_z=top[0] + log_s_a,
        lse_y=top[1] + log_s_b,
        kl_pi_ref=(t_a / s_a - log_s_a + log_s_b).clamp(min=0.0),
        kl_ref_pi=(t_b / s_b - log_s_b + log_s_a).clamp(min=0.0),
        entropy=(e_a / s_a + log_s_a).clamp(min=0.0),
        logp_label=l_a - log_s_a,
        logp_ref_label=l_b - log_s_b,
    )
    if keep is None:
        return merged
    return KLRowStats(*(torch.where(keep, m, 0.0) for m in merged))


def kl_from_logits_vocab_parallel(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position KL when both models' logits are sharded over the vocabulary.

    .. math::
        KL(\pi\|ref)_n = \sum_{v=1}^{V} \pi_{n,v}(\log\pi_{n,v} - \log ref_{n,v}),\quad
        \pi_n = \mathrm{softmax}(z_n/T) \text{ over the whole vocabulary}

    (or :math:`KL(ref\|\pi)`), where this rank holds the columns ``[o_r, o_r + V_r)`` of ``z``
    and ``y``, ranks in order. Every rank returns the same (replicated) KL, entropy and label
    log-probs, and the gradient of its own shard. Collectives: module docstring.

    Args:
      logits: this rank's shard of pi's logits ``[..., V_r]``.
      logits_ref: this rank's shard of ref's logits, same shape.
      group: the tensor-parallel process group (default: the world).
      vocab_size: the full (padded) V, checked against the sum of the shard sizes when given.
      vocab_start_index: this rank's first global column :math:`o_r` (Megatron's
        ``vocab_start_index``, ``rank * V_r``), with ``vocab_size``: skips the ``all_gather`` of
        the shard sizes (and its check that every rank holds the same positions).
      valid_vocab_size: the real vocabulary :math:`V' \le V`: the columns ``[V', V)`` are
        padding (Megatron pads V to a multiple of the tensor-parallel size times 128) and are
        left out: the KL, entropy and label log-probs are those of the distributions over the
        first :math:`V'` tokens, and the padding's gradient is 0. A teacher and a student whose
        padded sizes differ: pad the smaller one's shards to the larger layout (any values)
        and pass the tokenizer's size here.
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      mask: bool ``[...]``, identical on every rank.
      reduction: as in :func:`klest.kl_from_logits`.
      temperature: :math:`T > 0`.
      labels: *global* token ids ``[...]``, identical on every rank.
      ignore_index: the label of positions to leave out.
      memory_budget: as in :func:`klest.kl_from_logits`.
      chunk_size: as in :func:`klest.kl_from_logits`.
      backend: as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`klest.kl_from_logits` (the checks run after the merge).
      return_details: also return a :class:`~klest.LogitsDetails`.

    Returns:
      As :func:`klest.kl_from_logits`.

    Example:
      One process holding the whole vocabulary (under ``torchrun`` each rank passes its shard):

      >>> import tempfile, torch.distributed as dist
      >>> store = tempfile.NamedTemporaryFile(delete=False).name
      >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
      >>> z, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
      >>> torch.allclose(kl_from_logits_vocab_parallel(z, y), klest.kl_from_logits(z, y))
      True
      >>> dist.destroy_process_group()
    """
    z, y, pos, tau, shard, local, checks = shard_logits(
        "kl_from_logits_vocab_parallel",
        logits,
        logits_ref,
        group=group,
        vocab_size=vocab_size,
        vocab_start_index=vocab_start_index,
        valid_vocab_size=valid_vocab_size,
        direction=direction,
        mask=mask,
        reduction=reduction,
        temperature=temperature,
        labels=labels,
        ignore_index=ignore_index,
        validate=validate,
        details=return_details,
    )
    owner = None if local is None else (local >= 0) & (local < shard.size)
    plan = plan_for(
        z,
        y,
        pos,
        temperature=tau,
        backend=backend,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        stash=False,
    )

    def merge(stats: KLRowStats, keep: Tensor | None) -> KLRowStats:
        return merge_shards(stats, keep, group=group, owner=owner)

    outputs = rows_kl(z, y, local, pos, replace(plan, merge=merge), checks)
    pos = in_sequences(pos, cu_seqlens, max_seqlen, counts, logits.device, checks)
    checks.run()
    return finish(outputs, pos)
