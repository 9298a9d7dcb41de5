r"""Sequences split over a context-parallel process group: each rank holds some of every
sequence's tokens.

Under context parallelism (Megatron, NeMo-RL, slime, verl-Megatron, torchtitan) the ranks of a
group hold the same sequences, each a part of every sequence's tokens:

- ``"zigzag"`` (Megatron's load balancing; torchtitan's head-tail balancer is the same layout,
  ``"head_tail"``): each sequence is cut into ``2C`` equal chunks and rank r holds chunks
  ``r`` and ``2C - 1 - r``, one after the other;
- ``"contiguous"`` (verl-FSDP's Ulysses, OpenRLHF's ring attention): rank r holds chunk r of C.

Packed sequences (``cu_seqlens``) are split document by document the same way (Megatron's
per-document zig-zag): each rank's packed tensor holds, per document, its part, and its
``cu_seqlens`` are the global ones divided by C.

The per-token values are local, but the coefficients of the sequence-level gradients are not:
the log-ratios from each token to its sequence's end, prefix weights and ratios, the exact KLs
after a position, and per-position baselines over the group all read tokens other ranks hold.
:func:`gather_rows` collects every rank's detached per-token inputs with one all-gather (a few
floats per token, no gradient) and lays them out as whole sequences; the local tokens keep
their graph inside them (:func:`with_local`), so the gradient of the whole sequence's surrogate
reaches exactly the local tokens, and :func:`local_columns` takes this rank's part back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from klest.layout import PackedLayout, PaddedLayout
from klest.sampled.log_ratios import LogRatios

__all__ = ["CPKind", "ContextParallel"]

CPKind = Literal["zigzag", "head_tail", "contiguous"]
"""How a sequence's tokens are split over the context-parallel ranks."""


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel split of every sequence over a process group.

    Args:
      group: the context-parallel process group (None: the default group).
      kind: ``"zigzag"`` / ``"head_tail"`` (rank r holds chunks r and 2C - 1 - r of 2C) or
        ``"contiguous"`` (rank r holds chunk r of C).

    Example:
      >>> cp = ContextParallel(group=None, kind="zigzag")  # inside an initialized process group
    """

    group: dist.ProcessGroup | None = None
    kind: CPKind = "zigzag"

    def __post_init__(self) -> None:
        if self.kind not in ("zigzag", "head_tail", "contiguous"):
            raise ValueError(
                f"kind must be 'zigzag', 'head_tail' or 'contiguous', got {self.kind!r}"
            )

    def world(self) -> tuple[int, int]:
        """``(rank, size)`` of this process in the group."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "context_parallel needs torch.distributed to be initialized (the ranks of a "
                "context-parallel group)"
            )
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def global_columns(self, lengths: Tensor, t_local: int, rank: int, size: int) -> Tensor:
        """The column in its whole sequence of each local column ``[rows, t_local]`` of rank
        ``rank`` (``lengths``: each row's local length; columns past it map to the sequence's
        padding, past ``size * lengths``)."""
        col = torch.arange(t_local, device=lengths.device).expand(lengths.numel(), -1)
        n = lengths.unsqueeze(-1)
        if self.kind == "contiguous":
            out = rank * n + col
        else:
            if bool(((lengths % 2) != 0).any()):
                raise ValueError(
                    "a zig-zag split needs each sequence's local length even (2 chunks a rank); "
                    f"got local lengths {lengths.tolist()}"
                )
            half = n // 2
            out = torch.where(
                col < half, rank * half + col, (2 * size - 1 - rank) * half + col - half
            )
        return torch.where(col < n, out, size * n + col - n)


def gather_rows(cp: ContextParallel, local: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """All ranks' detached ``local`` ``[k, rows, t_local]`` as whole sequences
    ``[k, rows, size * t_local]``, and this rank's columns in them ``[rows, t_local]``."""
    rank, size = cp.world()
    k, rows, t_local = local.shape
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=cp.group)
    out = local.new_zeros(k, rows, size * t_local)
    for r, part in enumerate(parts):
        columns = cp.global_columns(lengths, t_local, r, size)
        out.scatter_(2, columns.unsqueeze(0).expand(k, -1, -1), part)
    return out, cp.global_columns(lengths, t_local, rank, size)


def with_local(whole: Tensor, local: Tensor, columns: Tensor) -> Tensor:
    """``whole`` ``[rows, T]`` (detached) with this rank's ``columns`` replaced by ``local``,
    which keeps its graph there."""
    return whole.detach().scatter(1, columns, local)


def local_columns(whole: Tensor, columns: Tensor) -> Tensor:
    """This rank's ``columns`` ``[rows, t_local]`` of ``whole`` ``[rows, T]``."""
    return whole.gather(1, columns)


def whole_sequences(
    cp: ContextParallel, lr: LogRatios, kls: Tensor | None, weights: Tensor | None = None
) -> tuple[LogRatios, Tensor | None, Tensor, Tensor | None]:
    """This rank's validated log-ratios (and exact per-position KLs) as whole sequences, each
    rank's tokens gathered in place, this rank's keeping their graph; this rank's columns; and
    the objective's detached per-token ``weights`` rows (if given) as whole sequences.

    The whole sequences are rows of a padded layout (the caller's rows, ``size`` times as long);
    the sequence reductions run on the local columns (:func:`local_columns`).
    """
    rows, t_local = lr.delta.shape
    if isinstance(lr.layout, PackedLayout):
        lengths = lr.layout.lengths
    else:
        lengths = torch.full((rows,), t_local, dtype=torch.int64, device=lr.delta.device)
    valid = lr.valid_or_all()
    fields = [lr.delta, valid.to(lr.delta.dtype)]
    fields += [] if lr.log_w is None else [lr.log_w]
    fields += [] if kls is None else [kls]
    fields += [] if weights is None else [weights]
    gathered, columns = gather_rows(cp, torch.stack([f.detach() for f in fields]), lengths)
    parts = iter(gathered.unbind(0))
    delta = with_local(next(parts), lr.delta, columns)
    whole_valid = next(parts) != 0
    log_w = None if lr.log_w is None else with_local(next(parts), lr.log_w, columns)
    whole_kls = None if kls is None else with_local(next(parts), kls, columns)
    whole_weights = None if weights is None else next(parts)
    logp = None if lr.logp is None else with_local(torch.zeros_like(delta), lr.logp, columns)
    layout = PaddedLayout(torch.Size((rows, delta.shape[-1])))
    return LogRatios(delta, log_w, whole_valid, layout, logp), whole_kls, columns, whole_weights
