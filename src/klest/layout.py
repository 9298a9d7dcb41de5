r"""How a batch's tokens are laid out: padded rows, or packed sequences with ``cu_seqlens``.

Every sampled-token function computes on *rows*: a ``[rows, T]`` tensor with one sequence per
row, positions past a sequence's end invalid. Two layouts of the caller's tensors map onto
rows:

- **padded** (the default): ``[..., T]``, every leading index one sequence; ``[N]`` holds N
  independent samples (one row each, ``T = 1``);
- **packed**: the sequences' tokens one after another, ``[total]`` (or ``[1, total]``, as
  padding-free trainers hand them over), with ``cu_seqlens`` ``[S + 1]``: the offsets where each
  of the S sequences starts, ``0 = cu[0] <= cu[1] <= ... <= cu[S] = total`` (the
  flash-attention ``varlen`` convention). Sequence s holds tokens ``cu[s]:cu[s + 1]``; empty
  sequences are allowed.

The same samples give the same values and gradients in either layout: sums from each token on,
prefix weights, first-token alignment, group baselines and reductions all respect the sequence
boundaries, and per-token outputs (``reduction="none"``) come back in the caller's layout.

Where engines keep the packed form: verl's ``use_remove_padding`` and TRL's ``padding_free``
give ``position_ids`` that restart at 0 for each sequence (:func:`cu_seqlens_from_position_ids`);
flash-attention's ``unpad_input`` returns ``cu_seqlens`` directly; OpenRLHF's packing marks each
token with its sample's index in the attention mask (:func:`cu_seqlens_from_sequence_ids`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from klest._checks import ValueChecks

__all__ = ["cu_seqlens_from_position_ids", "cu_seqlens_from_sequence_ids"]


def as_rows(x: Tensor) -> Tensor:
    """View ``x`` as ``[rows, T]`` under the padded convention (1-D -> ``[N, 1]``)."""
    if x.ndim <= 1:
        return x.reshape(-1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: T may be 0


@dataclass(frozen=True)
class PaddedLayout:
    """The padded layout of tensors shaped ``shape`` (``[..., T]`` sequences or ``[N]``
    samples)."""

    shape: torch.Size

    @property
    def samples(self) -> bool:
        """Whether the rows are independent samples (a 1-D input), not sequences."""
        return len(self.shape) < 2

    @property
    def sequences_shape(self) -> torch.Size:
        """The shape of one value per row: ``shape[:-1]`` for sequences, ``shape`` for samples."""
        return self.shape[:-1] if len(self.shape) >= 2 else self.shape

    def rows(self, x: Tensor) -> Tensor:
        """``x`` (this layout's shape, perhaps with trailing dimensions) as rows."""
        trailing = x.shape[len(self.shape) :]
        if self.samples:
            return x.reshape(-1, 1, *trailing)
        return x.reshape(math.prod(self.shape[:-1]), self.shape[-1], *trailing)

    def tokens(self, rows: Tensor) -> Tensor:
        """Rows ``[rows, T]`` back in this layout's shape."""
        return rows.reshape(self.shape)

    def per_row(self) -> PaddedLayout:
        """The layout of one value per row, ``[rows, 1]`` in rows."""
        if self.samples:
            return self
        return PaddedLayout(torch.Size((*self.shape[:-1], 1)))


@dataclass(frozen=True)
class PackedLayout:
    """Packed sequences: tokens ``[total]`` (``shape``: the caller's ``[total]`` or
    ``[1, total]``), sequence s at ``starts[s]:starts[s] + lengths[s]``, rows of ``max_len``."""

    shape: torch.Size
    starts: Tensor
    lengths: Tensor
    max_len: int

    samples = False

    @property
    def total(self) -> int:
        return self.shape[-1]

    @property
    def sequences_shape(self) -> torch.Size:
        return torch.Size((self.starts.numel(),))

    def _source(self) -> tuple[Tensor, Tensor]:
        """For each row and column, the flat token index (clamped into range) and whether the
        column is inside the sequence."""
        col = torch.arange(self.max_len, device=self.starts.device)
        inside = col < self.lengths.unsqueeze(-1)
        index = (self.starts.unsqueeze(-1) + col).clamp(0, max(self.total - 1, 0))
        return index, inside

    def rows(self, x: Tensor) -> Tensor:
        """Tokens ``x`` (this layout's shape, perhaps with trailing dimensions) as rows
        ``[S, max_len, ...]``, 0 (False) past each sequence's end."""
        flat = x.reshape(self.total, *x.shape[len(self.shape) :])
        index, inside = self._source()
        if self.total == 0:
            return flat.new_zeros((*index.shape, *flat.shape[1:]))
        taken = flat[index]
        inside = inside.reshape(*inside.shape, *([1] * (flat.ndim - 1)))
        return torch.where(inside, taken, torch.zeros((), dtype=x.dtype, device=x.device))

    def tokens(self, rows: Tensor) -> Tensor:
        """Rows ``[S, max_len]`` back as tokens in this layout's shape."""
        position = torch.arange(self.total, device=rows.device)
        ends = self.starts + self.lengths
        row = torch.searchsorted(ends, position, right=True)
        row = row.clamp(max=max(self.starts.numel() - 1, 0))
        col = (position - self.starts[row]).clamp(0, max(self.max_len - 1, 0))
        if rows.numel() == 0:
            return rows.new_zeros(self.shape)
        return rows.reshape(-1)[row * self.max_len + col].reshape(self.shape)

    def per_row(self) -> PaddedLayout:
        """The layout of one value per sequence, ``[S, 1]`` in rows."""
        return PaddedLayout(torch.Size((self.starts.numel(), 1)))


Layout = PaddedLayout | PackedLayout


def packed_layout(
    cu_seqlens: object,
    shape: torch.Size,
    device: torch.device,
    checks: ValueChecks,
    *,
    max_seqlen: int | None = None,
    of: str = "logp",
) -> PackedLayout:
    """The packed layout of per-token tensors shaped ``shape`` (``[total]`` or ``[1, total]``)
    with sequence offsets ``cu_seqlens``.

    Without ``max_seqlen`` the offsets are read on the host (one synchronisation, none for a CPU
    tensor) and checked there; with it they are checked with the call's other value checks.

    Raises:
      TypeError: ``cu_seqlens`` is not an integer tensor.
      ValueError: a shape that is not packed, offsets that do not start at 0, decrease, or do
        not end at the number of tokens, or a sequence longer than ``max_seqlen``.
    """
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must hold integer offsets, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D, [sequences + 1], got shape {tuple(cu_seqlens.shape)}"
        )
    if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
        raise ValueError(
            f"with cu_seqlens, {of} holds packed sequences: shape [total] or [1, total], got "
            f"{tuple(shape)} (a padded batch [B, T] takes no cu_seqlens)"
        )
    total = shape[-1]
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    if max_seqlen is None:
        offsets = cu_seqlens.tolist()
        _check_offsets(offsets, total)
        max_len = max((b - a for a, b in itertools.pairwise(offsets)), default=0)
        return PackedLayout(shape, starts, lengths, max_len)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    bad = torch.stack(
        [cu[0] != 0, cu[-1] != total, (lengths < 0).any(), (lengths > max_seqlen).any()]
    )
    checks.add(
        bad,
        lambda flags: (
            f"cu_seqlens must start at 0, never decrease, end at the {total} packed tokens of "
            f"{of}, and hold no sequence longer than max_seqlen={max_seqlen}; it fails "
            f"{['the start', 'the end', 'order', 'max_seqlen'][int(flags.int().argmax())]}"
        ),
    )
    return PackedLayout(shape, starts, lengths.clamp(min=0), max_seqlen)


def layout_of(
    shape: torch.Size,
    device: torch.device,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    checks: ValueChecks,
    *,
    name: str = "logp",
) -> Layout:
    """The layout of per-token tensors of ``shape`` (on ``device``): packed with
    ``cu_seqlens``, padded without (``name``: the tensor's argument, for messages)."""
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen applies only with cu_seqlens (packed sequences)")
        return PaddedLayout(torch.Size(shape))
    return packed_layout(cu_seqlens, shape, device, checks, max_seqlen=max_seqlen, of=name)


def _check_offsets(offsets: list[int], total: int) -> None:
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
    if offsets[-1] != total:
        raise ValueError(
            f"cu_seqlens must end at the number of packed tokens, {total}, got {offsets[-1]}"
        )
    for s, (a, b) in enumerate(itertools.pairwise(offsets)):
        if b < a:
            raise ValueError(
                f"cu_seqlens must never decrease; it does at sequence {s}: {a} then {b}"
            )


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """``cu_seqlens`` ``[S + 1]`` of packed sequences whose ``position_ids`` restart at 0.

    Args:
      position_ids: ``[total]`` or ``[1, total]`` integer positions, 0 at each sequence's first
        token (verl's ``use_remove_padding``, TRL's ``padding_free`` and flash-attention's
        packed position ids).

    Returns:
      int64 offsets on ``position_ids``' device (one host read: the number of sequences).

    Example:
      >>> cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
      tensor([0, 3, 5, 6])
    """
    if not isinstance(position_ids, Tensor) or position_ids.is_floating_point():
        raise TypeError("position_ids must be an integer torch.Tensor")
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().reshape(-1)
    if flat.numel() and (starts.numel() == 0 or int(starts[0]) != 0):
        raise ValueError("position_ids must start each sequence at 0 (the first is not 0)")
    end = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, end]).to(torch.int64)


def cu_seqlens_from_sequence_ids(sequence_ids: Tensor) -> Tensor:
    """``cu_seqlens`` ``[S + 1]`` of packed sequences from each token's sequence id.

    Args:
      sequence_ids: ``[total]`` or ``[1, total]`` integer ids, equal within a sequence and
        changing at each new one (OpenRLHF's packed attention mask holds 1, 2, 3, ... with 0 at
        padding: mask the padding out, or drop it, before packing the log-probs).

    Returns:
      int64 offsets on ``sequence_ids``' device (one host read: the number of sequences).

    Example:
      >>> cu_seqlens_from_sequence_ids(torch.tensor([1, 1, 1, 2, 2, 3]))
      tensor([0, 3, 5, 6])
    """
    if not isinstance(sequence_ids, Tensor) or sequence_ids.is_floating_point():
        raise TypeError("sequence_ids must be an integer torch.Tensor")
    flat = sequence_ids.reshape(-1)
    change = torch.ones_like(flat, dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    starts = change.nonzero().reshape(-1)
    end = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, end]).to(torch.int64)
