r"""Vocab-parallel generalized JSD, skew KL and total variation, from logits or hidden states.

The divergences of :mod:`klest.logits.divergences` when each rank holds columns
``[o_r, o_r + V_r)`` of both models' logits (as :func:`klest.kl_from_logits_vocab_parallel`
does for the KL) or the same rows of both LM heads (as
:func:`klest.kl_from_hidden_vocab_parallel`). Unlike the KL, whose per-shard statistics merge
in one step, these divergences need the whole rows' log-normalizers before any term can be
summed (the mixture
:math:`m = w\,ref + (1-w)\,\pi` and :math:`|\pi_v - ref_v|` compare probabilities, not logits), so
each chunk of rows merges in two phases:

1. the shard's log-normalizers, entropy and label log-probs merge as the KL's do
   (:func:`klest.logits.vocab_parallel.merge_shards`: an ``all_reduce(MAX)`` of ``[2, n_c]`` and
   an ``all_reduce(SUM)`` of ``[7, n_c]`` floats);
2. with the whole rows' :math:`\log q = z/\tau - \mathrm{lse}_z` and
   :math:`\log p = y/\tau - \mathrm{lse}_y`, each shard sums its columns' terms and
   :math:`S_q = \langle q, G_q\rangle`, :math:`S_p = \langle p, G_p\rangle`
   (:mod:`klest.logits._divergence_rows`), and one ``all_reduce(SUM)`` of ``[3, n_c]`` floats
   adds the shards' parts.

A column's gradient :math:`\tfrac g\tau\,q_v(G_{q,v} - S_q)` then needs only its own logits and
the four merged numbers per row, so the backward has no collective: each rank's logits
gradient is its columns'; from hidden states, the heads' gradients are local and the hidden
states' gradients are this shard's part of the sum over the vocabulary (summed by the engine's
tensor-parallel region, or by ``reduce_hidden_grad=True``), as for the KL. Every rank takes the
same chunks of rows (planned for the widest shard), so the collectives pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from klest._checks import check_direction
from klest._types import DEFAULT_REDUCTION, Backend, Direction, Reduction
from klest.aggregation import GlobalCounts, WithDetails
from klest.logits._call import LogitsDetails, check_plan_options
from klest.logits._chunking import chunks, put, put_rows, take, work_dtype
from klest.logits._divergence_rows import (
    ROW_OUTPUTS,
    Divergence,
    divergence_part,
    divergence_part_grads,
)
from klest.logits._rows import chunk_rows, resolve_backend, row_stats, zeroed_rows_buffer
from klest.logits._stats import KLRowStats
from klest.logits.divergences import (
    TV,
    DivergencePlan,
    bytes_per_row,
    check_unit_interval,
    jsd_divergence,
    run_rows,
    skew_divergence,
)
from klest.logits.vocab_parallel import kl_from_logits_vocab_parallel, merge_shards, shard_logits
from klest.logits.vocab_parallel_hidden import (
    SHARD_OPTIONS,
    kl_from_hidden_vocab_parallel,
    run_sharded_hidden,
)

__all__ = [
    "jsd_from_hidden_vocab_parallel",
    "jsd_from_logits_vocab_parallel",
    "skew_kl_from_hidden_vocab_parallel",
    "skew_kl_from_logits_vocab_parallel",
    "tv_from_hidden_vocab_parallel",
    "tv_from_logits_vocab_parallel",
]

_WHOLE_ROWS = slice(4, 8)
"""The rows of the plan's statistics a shard's gradient reads: lse_z, lse_y, S_q, S_p."""


@dataclass(frozen=True)
class _ShardDivergencePlan(DivergencePlan):
    """A divergence's row plan on a vocabulary shard: each chunk's statistics merged over
    ``group`` in two phases (module docstring) before its gradient is made from them. The
    selected rows (``rows``: indices, or None for all) are taken in chunks of ``chunk``, the
    same on every rank (planned for the widest shard), so the collectives pair up."""

    group: Any = None
    reads_saved_stats = True  # the merged statistics: a shard cannot recompute them alone

    @staticmethod
    def _rows(rows: Tensor | None, keep: Tensor | None) -> Tensor | None:
        """The selected rows' indices (from the Triton engine's flags: one host read)."""
        return keep.nonzero().view(-1) if keep is not None else rows

    def _chunk_stats(self, z_c: Tensor, y_c: Tensor, labels: Tensor | None) -> Tensor:
        local = row_stats(
            z_c, y_c, inv_tau=self.inv_tau, labels=labels, rows=None,
            want_entropy=self.want_entropy, backend=self.backend, chunk=z_c.shape[0],
            want_kl_ref_pi=False, want_kl_pi_ref=False,
        )  # fmt: skip
        owner = None if labels is None else (labels >= 0) & (labels < z_c.shape[-1])
        whole = merge_shards(KLRowStats(*local), None, group=self.group, owner=owner)
        part = divergence_part(
            z_c, y_c, self.div, whole.lse_z, whole.lse_y, inv_tau=self.inv_tau,
            backend=self.backend,
        )  # fmt: skip
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group)
        value, s_q, s_p = part.to(whole.lse_z.dtype).unbind(0)
        return torch.stack(
            (value.clamp(min=0.0), whole.entropy, whole.logp_label, whole.logp_ref_label,
             whole.lse_z, whole.lse_y, s_q, s_p)
        )  # fmt: skip

    def _chunk_grads(self, z_c, y_c, out_c, coef_c, sel, into) -> None:
        """The chunk ``sel``'s gradients for the row coefficients ``coef_c``, from its merged
        statistics ``out_c``, written into ``into = (dz, dy)`` (None: not needed)."""
        d = divergence_part_grads(
            z_c, y_c, self.div, out_c[_WHOLE_ROWS], coef_c, inv_tau=self.inv_tau,
            need_z=into[0] is not None, need_y=into[1] is not None, backend=self.backend,
        )  # fmt: skip
        for target, d_c in zip(into, d, strict=True):
            if target is not None:
                put_rows(target, sel, d_c)

    def _run(self, z, y, labels, rows, grad_of, into) -> Tensor:
        """Every chunk's statistics and, for the upstream gradients ``grad_of`` (None: none),
        the gradients into ``into``."""
        out = torch.zeros(len(ROW_OUTPUTS), z.shape[0], dtype=work_dtype(z), device=z.device)
        for sel in chunks(z.shape[0], rows, self.chunk):
            z_c, y_c = take(z, sel), take(y, sel)
            out_c = self._chunk_stats(z_c, y_c, None if labels is None else take(labels, sel))
            put(out, sel, out_c)
            if grad_of is not None:
                self._chunk_grads(z_c, y_c, out_c, take(grad_of, sel), sel, into)
        return out

    def stats(self, z_c, y_c, labels, rows=None, keep=None) -> Tensor:
        rows = self._rows(rows, keep)
        return self._run(z_c, y_c, labels, rows, None, (None, None))

    def stats_grads(self, z_c, y_c, labels, coef, need_z, need_y, rows=None, keep=None,
                    overwrite=True):  # fmt: skip
        rows = self._rows(rows, keep)
        into = (
            zeroed_rows_buffer(z_c, rows, into=z_c if overwrite else None) if need_z else None,
            zeroed_rows_buffer(y_c, rows, into=y_c if overwrite else None) if need_y else None,
        )
        out = self._run(z_c, y_c, labels, rows, coef, into)
        return (out, *into)

    def grads(self, z_c, y_c, saved, grads, labels, need_z, need_y, rows=None, keep=None):
        if grads[0] is None:
            return None, None
        rows = self._rows(rows, keep)
        dz = zeroed_rows_buffer(z_c, rows) if need_z else None
        dy = zeroed_rows_buffer(y_c, rows) if need_y else None
        for sel in chunks(z_c.shape[0], rows, self.chunk):
            saved_c = take(saved.T, sel).T
            self._chunk_grads(
                take(z_c, sel), take(y_c, sel), saved_c, take(grads[0], sel), sel, (dz, dy)
            )
        return dz, dy


def _sharded(
    name: str, div: Divergence, hidden, weight, hidden_ref, weight_ref, **options
) -> Tensor | WithDetails[LogitsDetails]:
    """``div`` over vocabulary shards of both heads (``options``: ``SHARD_OPTIONS``)."""
    want_entropy, group = options["return_details"], options["group"]

    def make_plan(inv_tau: float, backend: str, chunk: int) -> _ShardDivergencePlan:
        return _ShardDivergencePlan(div, inv_tau, want_entropy, chunk, backend, group=group)

    return run_sharded_hidden(
        name,
        hidden,
        weight,
        hidden_ref,
        weight_ref,
        direction="pi||ref",  # the divergence is output 0, where finish() reads KL(pi||ref)
        make_plan=make_plan,
        workspace=bytes_per_row,
        **options,
    )


_LOGITS_SHARD_OPTIONS = (
    "group",
    "vocab_size",
    "vocab_start_index",
    "valid_vocab_size",
    "mask",
    "reduction",
    "temperature",
    "labels",
    "ignore_index",
    "memory_budget",
    "chunk_size",
    "backend",
    "cu_seqlens",
    "max_seqlen",
    "counts",
    "validate",
    "return_details",
)
"""The options of the vocab-parallel functions from logits (those of
:func:`klest.kl_from_logits_vocab_parallel`), passed on unchanged."""


def _sharded_logits(
    name: str,
    div: Divergence,
    logits: Tensor,
    logits_ref: Tensor,
    *,
    group: Any,
    vocab_size: int | None,
    vocab_start_index: int | None,
    valid_vocab_size: int | None,
    mask: Tensor | None,
    reduction: str,
    temperature: float,
    labels: Tensor | None,
    ignore_index: int,
    memory_budget: int | None,
    chunk_size: int | None,
    backend: str,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    counts: GlobalCounts | None,
    validate: bool | None,
    return_details: bool,
) -> Tensor | WithDetails[LogitsDetails]:
    """``div`` over vocabulary shards of both models' logits."""
    check_plan_options(backend, memory_budget, chunk_size)
    z, y, pos, tau, shard, local, checks = shard_logits(
        name, logits, logits_ref, group=group, vocab_size=vocab_size,
        vocab_start_index=vocab_start_index, valid_vocab_size=valid_vocab_size,
        direction="pi||ref",  # the divergence is output 0, where finish() reads KL(pi||ref)
        mask=mask, reduction=reduction, temperature=temperature, labels=labels,
        ignore_index=ignore_index, validate=validate, details=return_details,
    )  # fmt: skip
    plan = _ShardDivergencePlan(
        div=div,
        inv_tau=1.0 / tau,
        want_entropy=return_details,
        chunk=chunk_rows(bytes_per_row(shard.widest), z.device, memory_budget, chunk_size),
        backend=resolve_backend(backend, z),
        group=group,
    )
    return run_rows(
        z, y, local, pos, plan, checks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        counts=counts, scale=None, stash=None, overwrite_logits=False,
    )  # fmt: skip


def _options(values: dict, names: tuple[str, ...] = SHARD_OPTIONS) -> dict:
    return {name: values[name] for name in names}


def jsd_from_hidden_vocab_parallel(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    beta: float,
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
    reduce_hidden_grad: bool = False,
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
    r"""Exact per-position generalized JSD from hidden states when both LM heads are sharded
    over the vocabulary.

    .. math::
        JSD_\beta(\pi_n, ref_n) = \beta\, KL(ref_n\|m_n) + (1-\beta)\, KL(\pi_n\|m_n), \quad
        m_n = \beta\, ref_n + (1-\beta)\,\pi_n, \\
        \pi_n = \mathrm{softmax}((W h_n + b)/T), \;
        ref_n = \mathrm{softmax}((W_{ref} h^{ref}_n + b_{ref})/T),

    over the whole vocabulary, where this rank holds rows ``[o_r, o_r + V_r)`` of ``W``,
    ``W_ref`` (and the biases), ranks in order. Equal to :func:`klest.jsd_from_hidden` with
    the whole heads (``beta`` as there: TRL's and Liger-Kernel's; :math:`KL(ref\|\pi)` at 0 and
    :math:`KL(\pi\|ref)` at 1, where this is :func:`klest.kl_from_hidden_vocab_parallel`).
    Every rank returns the same value and details, its heads' shard gradients and its part of
    the hidden states' gradients. No samples: the exact per-position term. Per chunk of rows:
    the KL's two collectives, then one ``all_reduce(SUM)`` of ``[3, n_c]`` floats (module
    docstring); none in the backward.

    See "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
    (Agarwal et al., ICLR 2024, https://arxiv.org/abs/2306.13649) for the generalized JSD.

    Args:
      hidden: pi's (the student's) final hidden states ``[..., H]``, the same on every rank
        (Megatron's ``[s, b, h]`` layout works as any ``[..., H]``).
      weight: this rank's shard of pi's LM head ``[V_r, H]``.
      hidden_ref: ref's (the teacher's) hidden states ``[..., H_ref]`` (same positions).
      weight_ref: this rank's shard of ref's head ``[V_r, H_ref]`` (the same rows).
      beta: ref's weight in the mixture, in ``[0, 1]``.
      bias: this rank's shard of pi's head bias ``[V_r]``, if any.
      bias_ref: ref's, if any.
      group: the tensor-parallel process group (default: the world).
      vocab_size: as in :func:`klest.kl_from_hidden_vocab_parallel`.
      vocab_start_index: as in :func:`klest.kl_from_hidden_vocab_parallel`.
      valid_vocab_size: as in :func:`klest.kl_from_hidden_vocab_parallel`.
      reduce_hidden_grad: as in :func:`klest.kl_from_hidden_vocab_parallel`.
      mask: bool ``[...]``, identical on every rank.
      reduction: as in :func:`klest.jsd_from_logits`.
      temperature: :math:`T > 0`.
      labels: *global* token ids ``[...]``, identical on every rank.
      ignore_index: the label of positions to leave out.
      memory_budget: as in :func:`klest.kl_from_hidden_vocab_parallel`.
      chunk_size: rows per chunk, overriding ``memory_budget``.
      backend: as in :func:`klest.jsd_from_logits`.
      stash: as in :func:`klest.kl_from_hidden`.
      scale: as in :func:`klest.jsd_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`klest.jsd_from_logits`.
      return_details: also return a :class:`~klest.LogitsDetails`.

    Returns:
      As :func:`klest.jsd_from_hidden`, replicated over the group.

    Example:
      One process holding the whole vocabulary (under ``torchrun`` each rank passes its shard):

      >>> import tempfile, torch.distributed as dist
      >>> store = tempfile.NamedTemporaryFile(delete=False).name
      >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
      >>> h, w = torch.randn(4, 8), torch.randn(50, 8)
      >>> h_ref, w_ref = torch.randn(4, 6), torch.randn(50, 6)
      >>> jsd = jsd_from_hidden_vocab_parallel(h, w, h_ref, w_ref, beta=0.5)
      >>> torch.allclose(jsd, klest.jsd_from_hidden(h, w, h_ref, w_ref, beta=0.5))
      True
      >>> dist.destroy_process_group()
    """
    beta = check_unit_interval("beta", beta, open_low=False, open_high=False)
    options = _options(locals())
    if beta in (0.0, 1.0):
        direction = "ref||pi" if beta == 0.0 else "pi||ref"
        return kl_from_hidden_vocab_parallel(
            hidden, weight, hidden_ref, weight_ref, direction=direction, **options
        )
    name = "jsd_from_hidden_vocab_parallel"
    return _sharded(name, jsd_divergence(beta), hidden, weight, hidden_ref, weight_ref, **options)


def skew_kl_from_hidden_vocab_parallel(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    alpha: float,
    direction: Direction = "pi||ref",
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
    reduce_hidden_grad: bool = False,
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
    r"""Exact per-position skew KL from hidden states when both LM heads are sharded over the
    vocabulary.

    .. math::
        KL(\pi_n\|\alpha\pi_n + (1-\alpha)\, ref_n) \quad (\text{``pi||ref''}), \qquad
        KL(ref_n\|\alpha\, ref_n + (1-\alpha)\,\pi_n) \quad (\text{``ref||pi''}),

    with :math:`\pi_n`, :math:`ref_n` from this rank's head shards as in
    :func:`jsd_from_hidden_vocab_parallel`, over the whole vocabulary, for
    :math:`0 \le \alpha < 1` (:math:`\alpha = 0`: the KL itself). Equal to
    :func:`klest.skew_kl_from_hidden` with the whole heads, replicated over the group; heads'
    gradients local, hidden states' gradients this shard's part. No samples.

    See L. Lee, "Measures of Distributional Similarity" (ACL 1999) for the skew divergence.

    Args:
      hidden: as in :func:`jsd_from_hidden_vocab_parallel`.
      weight: as in :func:`jsd_from_hidden_vocab_parallel`.
      hidden_ref: as in :func:`jsd_from_hidden_vocab_parallel`.
      weight_ref: as in :func:`jsd_from_hidden_vocab_parallel`.
      alpha: the first distribution's own weight in the mixture, in ``[0, 1)``.
      direction: ``"pi||ref"`` or ``"ref||pi"`` (which distribution is skewed towards the
        other).
      bias, bias_ref, group: as in :func:`jsd_from_hidden_vocab_parallel`.
      vocab_size, vocab_start_index: as in :func:`jsd_from_hidden_vocab_parallel`.
      valid_vocab_size, reduce_hidden_grad: as in :func:`jsd_from_hidden_vocab_parallel`.
      mask, reduction, temperature: as in :func:`jsd_from_hidden_vocab_parallel`.
      labels, ignore_index: as in :func:`jsd_from_hidden_vocab_parallel`.
      memory_budget, chunk_size, backend: as in :func:`jsd_from_hidden_vocab_parallel`.
      stash, scale: as in :func:`jsd_from_hidden_vocab_parallel`.
      cu_seqlens, max_seqlen, counts: as in :func:`jsd_from_hidden_vocab_parallel`.
      validate, return_details: as in :func:`jsd_from_hidden_vocab_parallel`.

    Returns:
      As :func:`klest.skew_kl_from_hidden`, replicated over the group.
    """
    check_direction(direction)
    alpha = check_unit_interval("alpha", alpha, open_low=False, open_high=True)
    options = _options(locals())
    if alpha == 0.0:
        return kl_from_hidden_vocab_parallel(
            hidden, weight, hidden_ref, weight_ref, direction=direction, **options
        )
    div = skew_divergence(alpha, direction)
    name = "skew_kl_from_hidden_vocab_parallel"
    return _sharded(name, div, hidden, weight, hidden_ref, weight_ref, **options)


def tv_from_hidden_vocab_parallel(
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
    r"""Exact per-position total variation from hidden states when both LM heads are sharded
    over the vocabulary.

    .. math::
        TV(\pi_n, ref_n) = \tfrac12 \textstyle\sum_{v=1}^{V} |\pi_{n,v} - ref_{n,v}|,

    with :math:`\pi_n`, :math:`ref_n` from this rank's head shards as in
    :func:`jsd_from_hidden_vocab_parallel`. Equal to :func:`klest.tv_from_hidden` with the
    whole heads (its subgradient 0 at :math:`\pi_v = ref_v` included), replicated over the
    group; heads' gradients local, hidden states' gradients this shard's part. No samples.

    See A. B. Tsybakov, "Introduction to Nonparametric Estimation" (Springer, 2009, Chapter 2)
    for the total variation distance.

    Args:
      hidden: as in :func:`jsd_from_hidden_vocab_parallel`.
      weight: as in :func:`jsd_from_hidden_vocab_parallel`.
      hidden_ref: as in :func:`jsd_from_hidden_vocab_parallel`.
      weight_ref: as in :func:`jsd_from_hidden_vocab_parallel`.
      bias, bias_ref, group: as in :func:`jsd_from_hidden_vocab_parallel`.
      vocab_size, vocab_start_index: as in :func:`jsd_from_hidden_vocab_parallel`.
      valid_vocab_size, reduce_hidden_grad: as in :func:`jsd_from_hidden_vocab_parallel`.
      mask, reduction, temperature: as in :func:`jsd_from_hidden_vocab_parallel`.
      labels, ignore_index: as in :func:`jsd_from_hidden_vocab_parallel`.
      memory_budget, chunk_size, backend: as in :func:`jsd_from_hidden_vocab_parallel`.
      stash, scale: as in :func:`jsd_from_hidden_vocab_parallel`.
      cu_seqlens, max_seqlen, counts: as in :func:`jsd_from_hidden_vocab_parallel`.
      validate, return_details: as in :func:`jsd_from_hidden_vocab_parallel`.

    Returns:
      As :func:`klest.tv_from_hidden`, replicated over the group.
    """
    options = _options(locals())
    name = "tv_from_hidden_vocab_parallel"
    return _sharded(name, TV, hidden, weight, hidden_ref, weight_ref, **options)


def jsd_from_logits_vocab_parallel(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    beta: float,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
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
    r"""Exact per-position generalized JSD when both models' logits are sharded over the
    vocabulary.

    .. math::
        JSD_\beta(\pi_n, ref_n) = \beta\, KL(ref_n\|m_n) + (1-\beta)\, KL(\pi_n\|m_n), \quad
        m_n = \beta\, ref_n + (1-\beta)\,\pi_n,

    :math:`\pi_n = \mathrm{softmax}(z_n/T)` and :math:`ref_n = \mathrm{softmax}(y_n/T)` over the
    whole vocabulary, where this rank holds the columns ``[o_r, o_r + V_r)`` of ``z`` and ``y``,
    ranks in order. Equal to :func:`klest.jsd_from_logits` on the whole logits (``beta`` as
    there: TRL's and Liger-Kernel's; :math:`KL(ref\|\pi)` at 0 and :math:`KL(\pi\|ref)` at 1,
    where this is :func:`klest.kl_from_logits_vocab_parallel`). Every rank returns the same
    value and details and the gradient of its own columns. No samples: the exact per-position
    term. Per chunk of rows, the KL's two collectives, then one ``all_reduce(SUM)`` of
    ``[3, n_c]`` floats (module docstring); none in the backward.

    See "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
    (Agarwal et al., ICLR 2024, https://arxiv.org/abs/2306.13649) for the generalized JSD.

    Args:
      logits: this rank's shard of pi's (the student's) logits ``[..., V_r]``.
      logits_ref: this rank's shard of ref's (the teacher's) logits, same shape.
      beta: ref's weight in the mixture, in ``[0, 1]``.
      group: the tensor-parallel process group (default: the world).
      vocab_size: as in :func:`klest.kl_from_logits_vocab_parallel`.
      vocab_start_index: as in :func:`klest.kl_from_logits_vocab_parallel`.
      valid_vocab_size: as in :func:`klest.kl_from_logits_vocab_parallel`.
      mask: bool ``[...]``, identical on every rank.
      reduction: as in :func:`klest.jsd_from_logits`.
      temperature: :math:`T > 0`.
      labels: *global* token ids ``[...]``, identical on every rank.
      ignore_index: the label of positions to leave out.
      memory_budget: bytes of chunk workspace, planned for the widest shard (every rank runs
        the same chunks and collectives).
      chunk_size: rows per chunk, overriding ``memory_budget``.
      backend: as in :func:`klest.jsd_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`klest.jsd_from_logits` (the checks run after the merge).
      return_details: also return a :class:`~klest.LogitsDetails`.

    Returns:
      As :func:`klest.jsd_from_logits`, replicated over the group.

    Example:
      One process holding the whole vocabulary (under ``torchrun`` each rank passes its shard):

      >>> import tempfile, torch.distributed as dist
      >>> store = tempfile.NamedTemporaryFile(delete=False).name
      >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
      >>> z, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
      >>> jsd = jsd_from_logits_vocab_parallel(z, y, beta=0.5)
      >>> torch.allclose(jsd, klest.jsd_from_logits(z, y, beta=0.5))
      True
      >>> dist.destroy_process_group()
    """
    beta = check_unit_interval("beta", beta, open_low=False, open_high=False)
    options = _options(locals(), _LOGITS_SHARD_OPTIONS)
    if beta in (0.0, 1.0):
        direction = "ref||pi" if beta == 0.0 else "pi||ref"
        return kl_from_logits_vocab_parallel(logits, logits_ref, direction=direction, **options)
    name = "jsd_from_logits_vocab_parallel"
    return _sharded_logits(name, jsd_divergence(beta), logits, logits_ref, **options)


def skew_kl_from_logits_vocab_parallel(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    alpha: float,
    direction: Direction = "pi||ref",
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
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
    r"""Exact per-position skew KL when both models' logits are sharded over the vocabulary.

    .. math::
        KL(\pi_n\|\alpha\pi_n + (1-\alpha)\, ref_n) \quad (\text{``pi||ref''}), \qquad
        KL(ref_n\|\alpha\, ref_n + (1-\alpha)\,\pi_n) \quad (\text{``ref||pi''}),

    with :math:`\pi_n`, :math:`ref_n` over the whole vocabulary from this rank's columns as in
    :func:`jsd_from_logits_vocab_parallel`, for :math:`0 \le \alpha < 1` (:math:`\alpha = 0`:
    the KL itself). Equal to :func:`klest.skew_kl_from_logits` on the whole logits, replicated
    over the group; each rank gets its own columns' gradient. No samples.

    See L. Lee, "Measures of Distributional Similarity" (ACL 1999) for the skew divergence.

    Args:
      logits: as in :func:`jsd_from_logits_vocab_parallel`.
      logits_ref: as in :func:`jsd_from_logits_vocab_parallel`.
      alpha: the first distribution's own weight in the mixture, in ``[0, 1)``.
      direction: ``"pi||ref"`` or ``"ref||pi"`` (which distribution is skewed towards the
        other).
      group, vocab_size: as in :func:`jsd_from_logits_vocab_parallel`.
      vocab_start_index, valid_vocab_size: as in :func:`jsd_from_logits_vocab_parallel`.
      mask, reduction, temperature: as in :func:`jsd_from_logits_vocab_parallel`.
      labels, ignore_index: as in :func:`jsd_from_logits_vocab_parallel`.
      memory_budget, chunk_size, backend: as in :func:`jsd_from_logits_vocab_parallel`.
      cu_seqlens, max_seqlen, counts: as in :func:`jsd_from_logits_vocab_parallel`.
      validate, return_details: as in :func:`jsd_from_logits_vocab_parallel`.

    Returns:
      As :func:`klest.skew_kl_from_logits`, replicated over the group.
    """
    check_direction(direction)
    alpha = check_unit_interval("alpha", alpha, open_low=False, open_high=True)
    options = _options(locals(), _LOGITS_SHARD_OPTIONS)
    if alpha == 0.0:
        return kl_from_logits_vocab_parallel(logits, logits_ref, direction=direction, **options)
    div = skew_divergence(alpha, direction)
    return _sharded_logits("skew_kl_from_logits_vocab_parallel", div, logits, logits_ref, **options)


def tv_from_logits_vocab_parallel(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
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
    r"""Exact per-position total variation when both models' logits are sharded over the
    vocabulary.

    .. math::
        TV(\pi_n, ref_n) = \tfrac12 \textstyle\sum_{v=1}^{V} |\pi_{n,v} - ref_{n,v}|,

    with :math:`\pi_n`, :math:`ref_n` over the whole vocabulary from this rank's columns as in
    :func:`jsd_from_logits_vocab_parallel`. Equal to :func:`klest.tv_from_logits` on the whole
    logits (its subgradient 0 at :math:`\pi_v = ref_v` included), replicated over the group;
    each rank gets its own columns' gradient. No samples.

    See A. B. Tsybakov, "Introduction to Nonparametric Estimation" (Springer, 2009, Chapter 2)
    for the total variation distance.

    Args:
      logits: as in :func:`jsd_from_logits_vocab_parallel`.
      logits_ref: as in :func:`jsd_from_logits_vocab_parallel`.
      group, vocab_size: as in :func:`jsd_from_logits_vocab_parallel`.
      vocab_start_index, valid_vocab_size: as in :func:`jsd_from_logits_vocab_parallel`.
      mask, reduction, temperature: as in :func:`jsd_from_logits_vocab_parallel`.
      labels, ignore_index: as in :func:`jsd_from_logits_vocab_parallel`.
      memory_budget, chunk_size, backend: as in :func:`jsd_from_logits_vocab_parallel`.
      cu_seqlens, max_seqlen, counts: as in :func:`jsd_from_logits_vocab_parallel`.
      validate, return_details: as in :func:`jsd_from_logits_vocab_parallel`.

    Returns:
      As :func:`klest.tv_from_logits`, replicated over the group.
    """
    options = _options(locals(), _LOGITS_SHARD_OPTIONS)
    return _sharded_logits("tv_from_logits_vocab_parallel", TV, logits, logits_ref, **options)
