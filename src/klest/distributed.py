r"""klest inside a data-parallel step: the global normalisers of a loss computed in pieces.

A trainer computes a step's loss in pieces: one per data-parallel rank and, on each rank, one per
gradient-accumulation micro-batch. Each piece's mean reduction must divide by the count of the
*whole step*, not by its own, and the engine's averaging of gradients over ranks must be undone,
for the pieces' gradients to add up to the gradient of the whole batch's loss
(:class:`~klest.GlobalCounts`). :func:`global_counts` counts once per step, with one
all-reduce and no gradient.

Engines that count already map onto :class:`~klest.GlobalCounts` directly:

=========================  ========================================================================
engine                     its counts
=========================  ========================================================================
verl                       ``agg_loss(..., dp_size, batch_num_tokens, global_batch_size)``:
                           ``GlobalCounts(batch_num_tokens, global_batch_size, dp_size)``
TRL                        ``num_items_in_batch`` (the step's tokens, gathered over processes):
                           ``GlobalCounts(num_items_in_batch, ..., accelerator.num_processes)``
Megatron                   ``calculate_per_token_loss``: return the local sum and count instead
torchtitan                 ``global_valid_tokens`` with gradient averaging off: ``scale=1``
OpenRLHF                   ``loss_batch_info`` counts, with DeepSpeed's 1/gas already compensated
=========================  ========================================================================

Never all-reduce a loss built this way: its pieces are already global.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from klest._checks import ValueChecks, check_choice, check_mask
from klest.aggregation import GlobalCounts
from klest.layout import layout_of

__all__ = ["global_counts"]

GradientReduce = Literal["mean", "sum"]
"""How the engine combines gradients over the ranks: averaged (DDP, FSDP) or summed."""


def global_counts(
    masks: Tensor | Sequence[Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    gradients: GradientReduce = "mean",
    cu_seqlens: Tensor | Sequence[Tensor | None] | None = None,
) -> GlobalCounts:
    r"""The step's valid tokens and non-empty sequences over the data-parallel group.

    .. math:: N_{tokens} = \sum_{\text{ranks}} \sum_{\text{micro-batches}} \sum_{b,t} m_{bt},
              \qquad N_{sequences} = \sum_{\text{ranks}} \sum_{\text{micro-batches}}
              |\{b : n_b > 0\}|

    Call it once per optimizer step, on every rank of ``group``, with the masks of all the
    micro-batches this rank will process in the step; pass the result as ``counts=`` to every
    reduction of the step (:func:`klest.kl_penalty`, :func:`klest.kl_estimate`,
    :func:`klest.kl_from_logits`, :func:`klest.aggregate`, ...).

    Args:
      masks: this rank's token masks ``[..., T]`` (True or 1 = the token counts), one per
        micro-batch (or one tensor); packed ones with ``cu_seqlens``.
      group: the data-parallel process group (None: the default group when
        ``torch.distributed`` is initialized, this process alone otherwise).
      gradients: how the engine combines the ranks' gradients: ``"mean"`` (DDP, FSDP: the
        loss is scaled by the group's size to undo it) or ``"sum"``.

    Returns:
      :class:`~klest.GlobalCounts` with 0-dim tensors on the masks' device.

    Example:
      >>> m = torch.tensor([[1, 1, 0], [0, 0, 0]])
      >>> c = global_counts([m, torch.ones(1, 3)])  # one process: two micro-batches' counts
      >>> float(c.tokens), float(c.sequences), c.scale
      (5.0, 2.0, 1.0)
    """
    check_choice("gradients", gradients, GradientReduce)
    if isinstance(masks, Tensor):
        masks = [masks]
    if cu_seqlens is None or isinstance(cu_seqlens, Tensor):
        cu_seqlens = [cu_seqlens] * len(masks)
    if not masks:
        raise ValueError("masks must hold at least one mask (one per micro-batch)")
    if len(cu_seqlens) != len(masks):
        raise ValueError(f"cu_seqlens has {len(cu_seqlens)} entries for {len(masks)} masks")
    checks = ValueChecks(True)
    device = masks[0].device
    with torch.no_grad():
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for i, (mask, cu) in enumerate(zip(masks, cu_seqlens, strict=True)):
            if not isinstance(mask, Tensor):
                raise TypeError(f"masks[{i}] must be a torch.Tensor, got {type(mask).__name__}")
            keep = check_mask(mask, mask.shape, device, checks, of=f"masks[{i}]", name="mask")
            rows = layout_of(keep.shape, device, cu, None, checks, name=f"masks[{i}]").rows(keep)
            totals += torch.stack([rows.sum(), rows.any(-1).sum()]).double()
        checks.run()
        world = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
            world = dist.get_world_size(group)
        elif group is not None:
            raise ValueError("group= needs torch.distributed to be initialized")
    return GlobalCounts(totals[0], totals[1], float(world) if gradients == "mean" else 1.0)
