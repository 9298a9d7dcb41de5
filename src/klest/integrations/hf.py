r"""Response-aligned tensors from a Hugging Face causal LM's batch: completions, log-probs, masks,
and the group ids of the samples of each prompt.

A trainer runs a causal LM on ``input_ids [B, L]`` with ``attention_mask [B, L]``, each row a
prompt then a sampled completion, in one of two layouts::

    left padding (generate's output; prompt width P):   right padding (per-row prompt lengths):
      pad pad p0 p1 p2 | c0 c1 c2 pad                      p0 p1 c0 c1 c2 pad pad
      p0  p1  p2 p3 p4 | c0 pad pad pad                    p0 p1 p2 p3 p4 c0 pad

klest's losses want the completions only, *response-aligned*: ``[B, T]`` tensors with T the
longest completion, each row's first completion token in column 0, and a boolean mask.

The shift: a causal LM's output at column j is its distribution of the token at column j + 1.
So the completion token at column c of ``input_ids`` was sampled from the logits at column
c - 1, and

.. math::
    \log\pi(y_t \mid y_{<t}) = \mathrm{log\_softmax}(z_{c_t - 1} / \tau)[\,y_t\,],
    \qquad y_t = \mathrm{input\_ids}[c_t], \quad c_t = s + t,

with s the column of the row's first completion token and :math:`\tau` the sampling
temperature. :func:`completion_batch` does this from logits you already have;
:func:`completion_batch_from_model` runs the model (computing only the logits the completions
need, where the model can). The results feed :func:`klest.kl_penalty` (``mask=batch.mask``,
``group=group_ids(...)``), :func:`klest.kl_estimate`, :func:`klest.kl_from_logits` and
:func:`klest.kl_reward` directly.

For tests, examples and experiments that may not download anything,
:func:`klest.testbeds.tiny_causal_lm` and :func:`klest.testbeds.word_tokenizer` build a small
model and a tokenizer from a config.

``transformers`` is needed only by :func:`completion_batch_from_model` (the ``klest[hf]``
extra); the tensor functions need only torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_float_tensor,
    check_int_ids,
    check_mask,
    check_positive_int,
    check_tensor,
    first_bad,
    resolve_validate,
)
from klest.logits.sampled_log_probs import token_log_probs

__all__ = [
    "IGNORE_INDEX",
    "CompletionBatch",
    "completion_batch",
    "completion_batch_from_model",
    "generated_attention_mask",
    "group_ids",
    "group_ids_from_prompts",
]

IGNORE_INDEX = -100
"""The token id of padding in :attr:`CompletionBatch.tokens` (cross-entropy's ``ignore_index``
and :func:`klest.kl_from_logits`'s default, so ``labels=batch.tokens`` works as it is)."""


class CompletionBatch(NamedTuple):
    """The completions of a batch, response-aligned (column t = completion token t).

    Attributes:
      logits: ``[B, T, V]``, the model's raw logits (not divided by the temperature) that
        produced each completion token: ``logits[b, t]`` is the model's output at the column
        *before* token t's (the shift). A view of the model's output when every completion
        starts at the same column (generate's layout), else a gathered copy. Values at masked
        positions are unspecified.
      tokens: ``[B, T]`` the completion token ids; ``-100`` (:data:`IGNORE_INDEX`) at masked
        positions.
      log_probs: ``[B, T]`` ``log_softmax(logits / temperature)`` at ``tokens``, with the
        model's graph; 0 at masked positions. float32 (float64 for float64 logits).
      mask: ``[B, T]`` bool, True at completion tokens; a row of all False is an empty
        completion.
    """

    logits: Tensor
    tokens: Tensor
    log_probs: Tensor
    mask: Tensor


@dataclass(frozen=True)
class _Layout:
    """Where each row's completion lies in ``input_ids [B, L]``.

    ``start[b]`` is the column of row b's first completion token and ``length[b]`` the span
    from it to the row's last attended column (0: no completion); ``width`` is T, the longest
    span. ``first`` / ``last`` are the smallest and largest start over rows with a completion
    (equal: one column range serves every row).
    """

    attended: Tensor
    start: Tensor
    length: Tensor
    width: int
    first: int
    last: int


def _check_input_ids(input_ids: object) -> Tensor:
    ids = check_tensor("input_ids", input_ids)
    check_int_ids("input_ids", ids, ids.shape, ids.device, of="input_ids")
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(ids.shape)}")
    return ids


def _starts(attended: Tensor, prompt_lengths: object, checks: ValueChecks) -> Tensor:
    """Column of each row's first completion token, ``[B]``."""
    b, width = attended.shape
    if isinstance(prompt_lengths, int) and not isinstance(prompt_lengths, bool):
        if not 1 <= prompt_lengths <= width:
            raise ValueError(
                f"prompt_lengths={prompt_lengths} must be in [1, L] for input_ids of shape "
                f"{(b, width)}: the first completion token (column prompt_lengths) is predicted "
                "by the logits of the column before it"
            )
        return torch.full((b,), prompt_lengths, dtype=torch.long, device=attended.device)
    if not isinstance(prompt_lengths, Tensor):
        raise TypeError(
            "prompt_lengths must be an int (the common padded prompt width, generate's layout) or "
            f"an integer tensor [B] (attended prompt tokens per row), got "
            f"{type(prompt_lengths).__name__}"
        )
    n = check_int_ids(
        "prompt_lengths", prompt_lengths, attended.shape[:1], attended.device, of="input_ids' rows"
    ).long()
    counts = attended.sum(1)
    checks.add(
        (n < 1) | (n > counts),
        lambda f: (
            f"prompt_lengths must be in [1, attended tokens of the row] (a completion token is "
            f"predicted by the logits of the token before it); {first_bad(f)}: row "
            f"{int(f.nonzero()[0, 0])} has prompt_lengths {int(n[f][0])} and "
            f"{int(counts[f][0])} attended tokens"
        ),
    )
    # The (n + 1)-th attended token: the columns before it hold at most n attended tokens.
    return (attended.long().cumsum(1) <= n.unsqueeze(1)).sum(1)


def _layout(
    input_ids: Tensor, attention_mask: object, prompt_lengths: object, checks: ValueChecks
) -> _Layout:
    attended = check_mask(
        attention_mask,
        input_ids.shape,
        input_ids.device,
        checks,
        of="input_ids",
        name="attention_mask",
    )
    start = _starts(attended, prompt_lengths, checks)
    checks.run()
    b, width = attended.shape
    cols = torch.arange(width, device=attended.device)
    after = attended & (cols >= start.unsqueeze(1))
    last_col = torch.where(after, cols, -1).amax(1) if width else start.new_full((b,), -1)
    length = (last_col + 1 - start).clamp(min=0)
    if b == 0:
        return _Layout(attended, start, length, 0, 1, 1)
    some = length > 0
    big = torch.iinfo(torch.long).max
    t, first, last = torch.stack(
        [length.amax(), torch.where(some, start, big).amin(), torch.where(some, start, -1).amax()]
    ).tolist()  # the one read the shapes need
    if t == 0:
        first = last = 1
    return _Layout(attended, start, length, int(t), int(first), int(last))


def _aligned(
    logits: Tensor,
    input_ids: Tensor,
    layout: _Layout,
    *,
    temperature: float,
    validate: bool | None,
) -> CompletionBatch:
    b, width = input_ids.shape
    kept = logits.shape[1]
    offset = width - kept  # logits hold the last `kept` columns (HF's logits_to_keep)
    if layout.width and layout.first - 1 < offset:
        raise ValueError(
            f"logits has {kept} positions for input_ids of length {width}, so it holds columns "
            f"{offset}..{width - 1}; the earliest completion token (column {layout.first}) needs "
            f"the logits of column {layout.first - 1} (the shift): keep at least "
            f"{width - layout.first + 1} positions (logits_to_keep)"
        )
    steps = torch.arange(layout.width, device=input_ids.device)
    cols = layout.start.unsqueeze(1) + steps  # [B, T] columns of the completion tokens
    inside = cols < width
    cols_in = cols.clamp(max=max(width - 1, 0))
    mask = inside & (steps < layout.length.unsqueeze(1))
    if layout.width:
        mask = mask & layout.attended.gather(1, cols_in)
        tokens = torch.where(mask, input_ids.gather(1, cols_in), IGNORE_INDEX)
    else:
        tokens = torch.full((b, 0), IGNORE_INDEX, dtype=input_ids.dtype, device=input_ids.device)
    if layout.width == 0:
        aligned = logits[:, :0]
    elif layout.first == layout.last:  # one column range for every row: a view
        lo = layout.first - 1 - offset
        aligned = logits[:, lo : lo + layout.width]
    else:
        rows = torch.arange(b, device=logits.device).unsqueeze(1)
        aligned = logits[rows, (cols - 1 - offset).clamp(0, kept - 1)]
    log_probs = token_log_probs(
        aligned, tokens, temperature=temperature, ignore_index=IGNORE_INDEX, validate=validate
    )
    return CompletionBatch(aligned, tokens, log_probs, mask)


def completion_batch(
    logits: Tensor,
    input_ids: Tensor,
    *,
    attention_mask: Tensor,
    prompt_lengths: int | Tensor,
    temperature: float = 1.0,
    validate: bool | None = None,
) -> CompletionBatch:
    r"""Completion logits, tokens, log-probs and mask, response-aligned, from a causal LM's
    output on prompt + completion rows.

    .. math::
        \text{log\_probs}[b, t] = \log\pi(y_{b,t} \mid y_{b,<t})
        = \mathrm{log\_softmax}(z_{b,\,s_b + t - 1} / \tau)[\,y_{b,t}\,],
        \quad y_{b,t} = \mathrm{input\_ids}[b,\,s_b + t]

    with :math:`s_b` the column of row b's first completion token: the shift (the model's
    output at column j predicts the token at column j + 1) is applied here, so
    ``logits[b, t]`` of the result is the distribution token ``tokens[b, t]`` was sampled from.

    Samples: the completion tokens, sampled from pi at temperature :math:`\tau` (``generate``
    with ``do_sample=True, temperature=tau``); the log-probs are pi's, with its graph.

    Layouts (``prompt_lengths``):

    - an int P: generate's output, the prompts left-padded to width P and completions from
      column P on (padding after short ones);
    - an int tensor ``[B]``: the number of *attended* prompt tokens of each row; the
      completion is the rest of the row's attended tokens. Any padding: left, right, or both.

    A row's completion spans from its first completion token to its last attended column
    (attention-mask zeros inside it are masked tokens); T is the longest span; a row with none
    is an empty completion (mask all False), and T = 0 is fine.

    Memory: the log-probs are computed block by block
    (:func:`klest.token_log_probs`: no float copy of the logits is kept for the
    backward). The result's logits are a view of ``logits`` when every completion starts at
    the same column, else a ``[B, T, V]`` gathered copy. The shapes need one host read (T);
    validation adds at most two.

    Args:
      logits: ``[B, L, V]``, the model's output on ``input_ids`` (with graph), or ``[B, K, V]``
        holding the last K columns only (``logits_to_keep=K`` in ``transformers``); the
        earliest completion token's preceding column must be among them.
      input_ids: ``[B, L]`` integer token ids, prompt then completion per row.
      attention_mask: ``[B, L]`` bool or 0/1: 1 at prompt and completion tokens, 0 at padding.
      prompt_lengths: an int (the common padded prompt width, generate's layout) or an integer
        tensor ``[B]`` (attended prompt tokens per row, each at least 1).
      temperature: :math:`\tau > 0`, the sampling temperature (divides the logits for
        ``log_probs``; the returned ``logits`` are not divided).
      validate: check masks, prompt lengths, token ids and logits values (None: the global
        default, :func:`klest.set_default_validate`).

    Returns:
      A :class:`CompletionBatch` ``(logits [B, T, V], tokens [B, T], log_probs [B, T],
      mask [B, T])``.

    Raises:
      TypeError: non-tensor, non-integer ids or prompt lengths, non-float logits.
      ValueError: shapes that do not match, prompt lengths outside a row, too few kept logits,
        token ids outside the vocabulary, NaN / ``+inf`` logits at completion positions.

    Example:
      >>> input_ids = torch.tensor([[0, 5, 6, 7, 8], [3, 4, 9, 0, 0]])  # right padding
      >>> attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
      >>> logits = torch.randn(2, 5, 10, requires_grad=True)
      >>> batch = completion_batch(logits, input_ids, attention_mask=attention_mask,
      ...                          prompt_lengths=torch.tensor([2, 2]))
      >>> batch.tokens  # response-aligned; -100 at padding
      tensor([[   6,    7,    8],
              [   9, -100, -100]])
      >>> batch.mask
      tensor([[ True,  True,  True],
              [ True, False, False]])
      >>> torch.allclose(batch.log_probs[0, 0], torch.log_softmax(logits[0, 1], -1)[6])  # shift
      True
    """
    ids = _check_input_ids(input_ids)
    z = check_float_tensor("logits", logits, what="logits")
    if z.dim() != 3 or z.shape[0] != ids.shape[0] or not 0 < z.shape[1] <= ids.shape[1]:
        raise ValueError(
            f"logits has shape {tuple(z.shape)} but input_ids has shape {tuple(ids.shape)}; "
            "logits must be [B, L, V] (or [B, K, V] with 0 < K <= L, the last K columns)"
        )
    if z.device != ids.device:
        raise ValueError(f"logits is on {z.device} but input_ids is on {ids.device}")
    checks = ValueChecks(resolve_validate(validate))
    layout = _layout(ids, attention_mask, prompt_lengths, checks)
    return _aligned(z, ids, layout, temperature=temperature, validate=validate)


def _transformers(what: str) -> Any:
    """The ``transformers`` module, or an ImportError naming the extra that installs it."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError(
            f"klest.integrations.hf.{what} needs transformers: install the extra with "
            "pip install 'klest[hf]'"
        ) from err
    return transformers


def _forward_parameters(model: Any) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return set()


def completion_batch_from_model(
    model: Any,
    input_ids: Tensor,
    *,
    attention_mask: Tensor,
    prompt_lengths: int | Tensor,
    temperature: float = 1.0,
    validate: bool | None = None,
) -> CompletionBatch:
    r"""Run a causal LM on prompt + completion rows and return its completions response-aligned
    (:func:`completion_batch` on its logits).

    .. math::
        \text{log\_probs}[b, t] = \mathrm{log\_softmax}(z_{b,\,s_b + t - 1} / \tau)[\,y_{b,t}\,],
        \quad y_{b,t} = \mathrm{input\_ids}[b,\,s_b + t]

    (the shift: the model's output at column j predicts the token at column j + 1; :math:`s_b`
    is the column of row b's first completion token).

    Samples: completions sampled from the model (pi) at temperature :math:`\tau`. Call it with
    the policy in training (graph kept) or under ``torch.no_grad()`` for a reference model.

    What it passes the model, where its ``forward`` takes them: ``position_ids`` as
    ``generate`` builds them (cumulative sum of the attention mask, minus 1), so the log-probs
    are those of the distribution ``generate`` sampled from, left padding included;
    ``logits_to_keep`` = the columns from the one before the earliest completion token on, so
    the LM head runs on those only; ``use_cache=False``.

    Args:
      model: a ``transformers`` causal LM (or any module called as ``model(input_ids=...,
        attention_mask=...)`` returning ``.logits`` or a tuple whose first item is the logits).
      input_ids: ``[B, L]`` integer token ids, prompt then completion per row.
      attention_mask: ``[B, L]`` bool or 0/1: 1 at prompt and completion tokens.
      prompt_lengths: an int (generate's common padded prompt width) or an integer tensor
        ``[B]`` (attended prompt tokens per row); see :func:`completion_batch`.
      temperature: :math:`\tau > 0`, the sampling temperature.
      validate: check inputs and logits values (None: the global default).

    Returns:
      A :class:`CompletionBatch` ``(logits [B, T, V], tokens [B, T], log_probs [B, T],
      mask [B, T])``.

    Raises:
      ImportError: ``transformers`` is not installed (the ``klest[hf]`` extra).
      TypeError, ValueError: as :func:`completion_batch`.

    Example:
      >>> from transformers import LlamaConfig, LlamaForCausalLM
      >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8,
      ...     intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
      ...     num_key_value_heads=2))
      >>> input_ids = torch.tensor([[0, 3, 4, 5, 6], [2, 7, 8, 9, 0]])  # prompt width 2
      >>> attention_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
      >>> batch = completion_batch_from_model(model, input_ids, attention_mask=attention_mask,
      ...                                     prompt_lengths=2)
      >>> batch.log_probs.shape, batch.mask.sum(1)
      (torch.Size([2, 3]), tensor([3, 2]))
    """
    _transformers("completion_batch_from_model")
    ids = _check_input_ids(input_ids)
    checks = ValueChecks(resolve_validate(validate))
    layout = _layout(ids, attention_mask, prompt_lengths, checks)
    params = _forward_parameters(model)
    kwargs: dict[str, Any] = {"attention_mask": attention_mask}
    if "position_ids" in params:
        positions = layout.attended.long().cumsum(1) - 1
        kwargs["position_ids"] = positions.masked_fill(~layout.attended, 0)
    if "logits_to_keep" in params:  # no completion token at all: one column, for V
        kwargs["logits_to_keep"] = ids.shape[1] - layout.first + 1 if layout.width else 1
    if "use_cache" in params:
        kwargs["use_cache"] = False
    out = model(input_ids=ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    check_float_tensor("the model's logits", logits, what="logits")
    if logits.dim() != 3 or logits.shape[0] != ids.shape[0]:
        raise ValueError(
            f"the model returned logits of shape {tuple(logits.shape)} for input_ids of shape "
            f"{tuple(ids.shape)}; expected [B, L, V]"
        )
    return _aligned(logits, ids, layout, temperature=temperature, validate=validate)


def generated_attention_mask(
    sequences: Tensor, *, prompt_mask: Tensor, eos_token_id: int | Sequence[int]
) -> Tensor:
    r"""The attention mask of ``generate``'s output: each row's prompt mask, then its completion
    up to and including the first end-of-sequence token.

    .. math::
        m_{b,c} = \text{prompt\_mask}_{b,c} \ (c < P), \qquad
        m_{b,P+t} = 1 \iff y_{b,u} \notin \text{eos for every } u < t

    ``generate`` pads a finished row with ``pad_token_id`` after its eos. Masking ``sequences !=
    pad_token_id`` instead goes wrong in two common cases: where padding is eos (GPT-2's
    tokenizers, ``tokenizer.pad_token = tokenizer.eos_token``) it drops each completion's eos,
    the last token pi chose; and a pad token sampled inside a completion becomes a hole, so the
    later tokens' log-probs are no longer those ``generate`` sampled from.

    Samples: rows of ``model.generate(prompt_ids, attention_mask=prompt_mask, ...)``, prompts
    left-padded to width P (generate's layout); pass the result as ``attention_mask`` and P as
    ``prompt_lengths`` to :func:`completion_batch_from_model`.

    Args:
      sequences: ``[B, L]`` integer token ids, generate's output (``L >= P``).
      prompt_mask: ``[B, P]`` or ``[B / G, P]`` bool or 0/1, the attention mask of the prompts
        given to ``generate`` (with ``num_return_sequences=G``, each prompt's row is repeated G
        times, consecutively, as ``generate`` does).
      eos_token_id: the end-of-sequence id, or several (``generation_config.eos_token_id`` may
        be a list).

    Returns:
      int64 ``[B, L]``, 1 at attended tokens.

    Raises:
      TypeError: non-tensor or non-integer ``sequences``, a non-integer ``eos_token_id``.
      ValueError: ``prompt_mask`` whose shape does not fit ``sequences``, not 0/1, or no
        ``eos_token_id``.

    Example:
      >>> out = torch.tensor([[0, 5, 6, 1, 0, 0], [7, 8, 3, 6, 9, 9]])  # pad = eos = 0, P = 2
      >>> generated_attention_mask(out, prompt_mask=torch.tensor([[0, 1], [1, 1]]),
      ...                          eos_token_id=0)
      tensor([[0, 1, 1, 1, 1, 0],
              [1, 1, 1, 1, 1, 1]])
    """
    ids = check_tensor("sequences", sequences)
    if ids.dim() != 2:
        raise ValueError(f"sequences must be [B, L], got shape {tuple(ids.shape)}")
    check_int_ids("sequences", ids, ids.shape, ids.device, of="sequences")
    eos = eos_token_id if isinstance(eos_token_id, Sequence) else [eos_token_id]
    if any(isinstance(e, bool) or not isinstance(e, int) for e in eos):
        raise TypeError(f"eos_token_id must be an int or a sequence of ints, got {eos_token_id!r}")
    if not eos:
        raise ValueError("eos_token_id must name at least one id, got an empty sequence")
    pm = check_tensor("prompt_mask", prompt_mask)
    b, width = ids.shape
    rows = pm.shape[0] if pm.dim() == 2 else 0
    fits = (rows > 0 and b % rows == 0) or rows == b  # [B, P], or [B / G, P] repeated G times
    if pm.dim() != 2 or pm.shape[1] > width or not fits:
        raise ValueError(
            f"prompt_mask must be [B, P] or [B / G, P] with P <= L for sequences of shape "
            f"{tuple(ids.shape)}, got shape {tuple(pm.shape)}"
        )
    if rows and rows != b:
        pm = pm.repeat_interleave(b // rows, dim=0)
    checks = ValueChecks(resolve_validate(None))
    keep = check_mask(pm, pm.shape, ids.device, checks, of="the prompts", name="prompt_mask")
    checks.run()
    completion = ids[:, pm.shape[1] :]
    is_eos = torch.isin(completion, torch.tensor(eos, dtype=ids.dtype, device=ids.device))
    # Tokens before the first eos, and the eos itself: no eos strictly before them.
    eos_before = is_eos.long().cumsum(1) - is_eos.long()
    return torch.cat([keep.long(), (eos_before == 0).long()], 1)


def group_ids(
    batch_size: int,
    *,
    num_generations: int,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""Group ids of a batch whose samples of each prompt are consecutive (TRL's and verl's
    order: prompt 0's ``num_generations`` samples, then prompt 1's, ...).

    .. math:: \text{ids}[i] = \lfloor (\text{offset} + i) / G \rfloor

    Samples: the completions of one batch, G = ``num_generations`` per prompt; pass the ids as
    ``group=`` to :func:`klest.kl_penalty` (leave-one-out baselines within a prompt).

    A micro-batch of gradient accumulation may start inside a group: ``offset`` is the index of
    its first sample in the generation batch. Partial groups at either end are fine (a sample
    alone in its group gets leave-one-out baseline 0).

    Args:
      batch_size: the number of samples B (``>= 0``).
      num_generations: G, samples per prompt (``>= 1``).
      offset: index of the first sample in the whole generation batch (``>= 0``).
      device: the device of the result.

    Returns:
      int64 ``[B]``.

    Example:
      >>> group_ids(6, num_generations=3)
      tensor([0, 0, 0, 1, 1, 1])
      >>> group_ids(4, num_generations=3, offset=2)  # a micro-batch from sample 2 on
      tensor([0, 1, 1, 1])
    """
    for name, value in (("batch_size", batch_size), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    check_positive_int("num_generations", num_generations, allow_none=False)
    ids = torch.arange(offset, offset + batch_size, dtype=torch.long, device=device)
    return torch.div(ids, num_generations, rounding_mode="floor")


def group_ids_from_prompts(prompt_ids: Tensor, *, prompt_mask: Tensor | None = None) -> Tensor:
    r"""Group ids from the prompts themselves: equal prompts get equal ids, whatever the order
    of the batch and the padding.

    .. math:: \text{ids}[i] = \text{ids}[j] \iff \text{prompt}_i = \text{prompt}_j

    (a prompt being its attended tokens, in order). Ids are numbered 0, 1, ... in the order of
    each prompt's first appearance.

    Samples: the completions of one batch, each row carrying its prompt; pass the ids as
    ``group=`` to :func:`klest.kl_penalty`.

    Args:
      prompt_ids: ``[B, P]`` integer token ids of each row's prompt.
      prompt_mask: ``[B, P]`` bool or 0/1, 1 at prompt tokens (None: every position counts).
        Padded positions are ignored, so left- and right-padded copies of a prompt match.

    Returns:
      int64 ``[B]``.

    Example:
      >>> prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [5, 6, 0], [0, 5, 6]])
      >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 0], [0, 1, 1]])
      >>> group_ids_from_prompts(prompts, prompt_mask=mask)
      tensor([0, 1, 0, 0])
    """
    ids = check_tensor("prompt_ids", prompt_ids)
    check_int_ids("prompt_ids", ids, ids.shape, ids.device, of="prompt_ids")
    if ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [B, P], got shape {tuple(ids.shape)}")
    b, width = ids.shape
    checks = ValueChecks(resolve_validate(None))
    keep = (
        torch.ones_like(ids, dtype=torch.bool)
        if prompt_mask is None
        else check_mask(
            prompt_mask, ids.shape, ids.device, checks, of="prompt_ids", name="prompt_mask"
        )
    )
    checks.run()
    if b == 0 or width == 0:
        return torch.zeros(b, dtype=torch.long, device=ids.device)
    # Each row's attended tokens first, in order (a stable sort on "not attended"), then
    # (attended?, token) pairs as the row's key: padding neither collides with a token nor
    # depends on where it was.
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)
    kept = keep.gather(1, order)
    key = torch.cat([kept.long(), torch.where(kept, ids.gather(1, order), 0).long()], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    count = int(inverse.max()) + 1
    rows = torch.arange(b, device=ids.device)
    first = torch.full((count,), b, dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(count, device=ids.device)
    return rank[inverse]
