"""Every argument check of klest, with errors that name the argument and the shapes.

Two kinds of checks:

- *structural* (types, shapes, devices, dtypes, names): plain Python on tensor metadata, free,
  always on;
- *value* checks (NaN / inf, log-probs above 0, masks that are not 0/1, label ranges, logits rows
  with no distribution, non-finite gradient surrogates): each is a reduction on the device. They
  are collected in a :class:`ValueChecks` and read back together, so a call makes at most one
  host synchronisation for them, and none when validation is off (``validate=False``, or
  :func:`set_default_validate` ``(False)``, as ``torch.distributions`` does with
  ``validate_args``).

A failed value check raises a ``ValueError`` that names the argument, counts the bad positions
and gives the first one; only then are more synchronisations spent on the message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, get_args

import torch
from torch import Tensor

from klest._types import Direction

_default_validate = True


@dataclasses.dataclass(frozen=True)
class ArgumentNames:
    """The caller's names of the log-prob arguments and the mask, for messages and warnings.

    klest's own functions use the defaults; a drop-in for a trainer (verl, OpenRLHF) gives its
    peer's names, so an error says ``logprob`` where a verl user passed ``logprob``.
    ``density_option``: whether the caller takes ``density=True`` (a message suggests it only
    then).
    """

    logp: str = "logp"
    logp_ref: str = "logp_ref"
    logp_behavior: str = "logp_behavior"
    mask: str = "mask"
    density_option: bool = True


KLEST_NAMES = ArgumentNames()

_caller = threading.local()
"""Per thread, the names set by the innermost :func:`named_by_caller` (``names``)."""


@contextlib.contextmanager
def named_by_caller(names: ArgumentNames) -> Iterator[None]:
    """Within the block, :func:`klest.kl_penalty` names its arguments as ``names`` (a drop-in
    calls it with its peer's arguments), in this thread only."""
    outer = getattr(_caller, "names", KLEST_NAMES)
    _caller.names = names
    try:
        yield
    finally:
        _caller.names = outer


def caller_names() -> ArgumentNames:
    """The names set by the innermost :func:`named_by_caller` in this thread (klest's own by
    default)."""
    return getattr(_caller, "names", KLEST_NAMES)


def set_default_validate(value: bool) -> None:
    """Turn klest's value checks on (the default) or off for calls that pass ``validate=None``.

    Off, a call makes no host synchronisation for checks: bad input (NaN log-probs, say) gives
    NaN results instead of an error. Structural checks (shapes, dtypes, names) always run. The
    switch is global, as ``torch.distributions.Distribution.set_default_validate_args``.

    Args:
      value: True to run the value checks by default, False to skip them.

    Example:
      >>> klest.set_default_validate(False)
      >>> klest.get_default_validate()
      False
      >>> klest.set_default_validate(True)
    """
    global _default_validate
    if not isinstance(value, bool):
        raise TypeError(f"value must be a bool, got {type(value).__name__}")
    _default_validate = value


def get_default_validate() -> bool:
    """Whether calls with ``validate=None`` run the value checks (:func:`set_default_validate`).

    Returns:
      The global default, True unless :func:`set_default_validate` turned it off.
    """
    return _default_validate


def resolve_validate(validate: bool | None) -> bool:
    """A call's ``validate=`` argument, with ``None`` meaning the global default."""
    if validate is None:
        return _default_validate
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool or None, got {type(validate).__name__}")
    return validate


def _inside(frame: FrameType) -> bool:
    """Whether ``frame`` runs klest's code, or torch's (``nn.Module.__call__`` around a klest
    module's ``forward``), by its module's name (not its file: a .pyc-only or frozen install
    keeps the path the code was compiled at)."""
    module = frame.f_globals.get("__name__", "")
    return module.split(".", 1)[0] in ("klest", "torch")


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first frame outside klest (and outside torch's
    module call): the line of the user's code (or of the trainer's) that called into klest,
    however deep the call went inside it (a drop-in calling :func:`klest.kl_penalty`, a
    ``klest.nn`` module, a trainer hook...). Filter klest's warnings by category
    (:class:`klest.KLGradientWarning`), not by module."""
    frame, stacklevel = sys._getframe(1), 2
    while frame.f_back is not None and _inside(frame):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(message, category, stacklevel=stacklevel)


_WARNED_ONCE: set[str] = set()
"""The keys of the once-per-process warnings already given (:meth:`ValueChecks.warn_once`)."""


class ValueChecks:
    """Value checks collected during a call and read back with one host synchronisation.

    ``add(flags, message)`` registers a boolean tensor that must be all False and a function
    that builds the error message from it; :meth:`run` reads every ``flags.any()`` at once and
    raises for the first failed check, in the order they were added. ``add_read(values,
    failed, message)`` registers 0-dim tensors (reductions: a largest value, say) read back in
    the same synchronisation and judged on the host by ``failed(*floats)``, so that comparing
    them costs no device operation. ``warn_once(key, flags, message)`` registers a warning read
    in the same synchronisation, given (when no check failed) once per process per ``key``;
    once given, it is not registered again (``warn_once_read`` judges read values on the host,
    as ``add_read``; ``pending(key)`` says whether a warning would still be registered). When
    disabled, ``add``, ``add_read`` and the warnings record nothing and ``run`` does nothing.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._items: list[_Item] = []

    def add(self, flags: Tensor, message: Callable[[Tensor], str]) -> None:
        if self.enabled:
            self._items.append(_Item(flags.detach(), (), message))

    def add_read(
        self, values: tuple[Tensor, ...], failed: Callable[..., bool], message: Callable[[], str]
    ) -> None:
        """Queue 0-dim ``values``; the check fails when ``failed(*floats)`` is True on the
        host (NaN reads as ``nan``, which fails every comparison)."""
        if self.enabled:
            reads = tuple(v.detach() for v in values)
            self._items.append(_Item(None, reads, lambda _: message(), failed=failed))

    def warn_once(self, key: str, flags: Tensor, message: Callable[[Tensor], str]) -> None:
        if self.enabled and key not in _WARNED_ONCE:
            self._items.append(_Item(flags.detach(), (), message, key))

    def warn_once_read(
        self,
        key: str,
        values: tuple[Tensor, ...],
        failed: Callable[..., bool],
        message: Callable[..., str],
    ) -> None:
        """As :meth:`warn_once`, judged on the host by ``failed(*floats)`` from 0-dim
        ``values`` read in the same synchronisation; ``message(*floats)`` builds the text."""
        if self.enabled and key not in _WARNED_ONCE:
            reads = tuple(v.detach() for v in values)
            self._items.append(_Item(None, reads, lambda floats: message(*floats), key, failed))

    def pending(self, key: str) -> bool:
        """Whether a warning under ``key`` would still be registered (checks on, not given
        yet): what feeds only that warning need not be computed otherwise."""
        return self.enabled and key not in _WARNED_ONCE

    def run(self) -> None:
        """Read every check at once; raise for the first failed check, then give the warnings."""
        if not self._items:
            return
        items, self._items = self._items, []
        device = (items[0].flags if items[0].flags is not None else items[0].reads[0]).device
        with torch.no_grad():
            # Scalars (most checks reduce on the device first) need no any(); stack promotes
            # the flags and the read values to one dtype (bool widens exactly).
            per_item = [item.scalars() for item in items]
            read = iter(torch.stack([s.to(device) for ss in per_item for s in ss]).tolist())
        warned: dict[str, str] = {}
        for item, ss in zip(items, per_item, strict=True):
            values = [next(read) for _ in ss]
            failed = item.failed(*values) if item.failed is not None else bool(values[0])
            payload = item.flags if item.flags is not None else values
            if failed and item.key is None:
                raise ValueError(item.message(payload))
            elif failed and item.key not in _WARNED_ONCE and item.key not in warned:
                warned[item.key] = item.message(payload)
        for key, text in warned.items():
            _WARNED_ONCE.add(key)
            warn_at_caller(text, UserWarning)


@dataclasses.dataclass
class _Item:
    """One queued check or warning: boolean ``flags`` (one must be True to fail), or 0-dim
    ``reads`` judged by ``failed``; ``key`` for a warning. ``message`` takes the flags, or the
    floats read."""

    flags: Tensor | None
    reads: tuple[Tensor, ...]
    message: Callable[[Any], str]
    key: str | None = None
    failed: Callable[..., bool] | None = None

    def scalars(self) -> tuple[Tensor, ...]:
        if self.flags is None:
            return self.reads
        f = self.flags
        return (f if f.dim() == 0 and f.dtype == torch.bool else f.any(),)


def first_bad(flags: Tensor) -> str:
    """``"N position(s) (first at index (i, j))"`` for a boolean tensor with a True."""
    first = tuple(flags.nonzero()[0].tolist())
    return f"{int(flags.sum())} position(s) (first at index {first})"


# -- names --------------------------------------------------------------------------------------


def check_choice(name: str, value: object, choices: Any) -> str:
    """``value`` if it is one of ``choices`` (a ``Literal`` alias or a tuple of names)."""
    allowed = _names(choices)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"unknown {name} {value!r}; expected one of {', '.join(map(repr, allowed))}"
        )
    return value


@functools.lru_cache(maxsize=64)
def _names(choices: Any) -> tuple[str, ...]:
    """The names of a ``Literal`` alias or a tuple of names (unpacked once: a few microseconds
    of every call otherwise)."""
    return get_args(choices) or tuple(choices)


def check_direction(direction: object) -> Direction:
    """A KL direction spelled by its arguments: ``"pi||ref"`` or ``"ref||pi"``."""
    return check_choice("direction", direction, Direction)  # type: ignore[return-value]


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_positive_int(name: str, value: object, *, allow_none: bool = True) -> int | None:
    """A positive int (or None when allowed), else a ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' (or None)' * allow_none}, got {value!r}")
    return value


def check_decay(decay: object) -> float:
    """A moving-average decay in ``[0, 1)``."""
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")
    return float(decay)


# The smallest temperature whose reciprocal, the factor on the logits, is finite in float32 (the
# lowest compute dtype): below it even zero logits would scale to 0 * inf = NaN.
_MIN_TEMPERATURE = 1.0 / torch.finfo(torch.float32).max


def check_temperature(temperature: object) -> float:
    """A finite temperature ``> 0`` (at least ``1 / float32 max``), as a float."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature >= _MIN_TEMPERATURE):
        raise ValueError(
            f"temperature must be finite and > 0 (at least 1 / float32's largest value, "
            f"{_MIN_TEMPERATURE:.4g}), got {temperature!r}"
        )
    return float(temperature)


# -- tensors: structure -------------------------------------------------------------------------


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float_tensor(
    name: str, x: object, *, what: str = "log-probabilities", dtypes: tuple | None = None
) -> Tensor:
    """A floating-point tensor (of one of ``dtypes`` when given), else a TypeError naming it."""
    x = check_tensor(name, x)
    if dtypes is None and not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype ({what}), got {x.dtype}")
    if dtypes is not None and x.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        allowed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise TypeError(f"{name} must be {allowed} ({what}), got {x.dtype}")
    return x


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise if the given tensors (``None`` skipped) differ in shape or device."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{first_name} has shape {tuple(first.shape)} but {name} has shape "
                f"{tuple(t.shape)}; they must match"
            )
        check_same_device(**{first_name: first, name: t})


def check_same_device(**tensors: Tensor | None) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    for name, t in named[1:]:
        if t.device != named[0][1].device:
            raise ValueError(
                f"{named[0][0]} is on {named[0][1].device} but {name} is on {t.device}; "
                "they must be on the same device"
            )


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype klest computes in: the promoted input dtype, never below float32."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_mask(
    mask: object,
    shape: torch.Size,
    device: torch.device,
    checks: ValueChecks,
    *,
    of: str,
    name: str = "mask",
) -> Tensor:
    """A boolean mask of ``shape`` (True = keep) from a bool or 0/1 numeric tensor (``name``:
    the caller's argument, for the messages)."""
    mask = check_tensor(name, mask)
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but {of} have shape {tuple(shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but {of} are on {device}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or 0/1 numeric, got {mask.dtype}")
    checks.add(
        (mask != 0) & (mask != 1),
        lambda flags: f"{name} must hold only 0 and 1 (or be a bool tensor); {first_bad(flags)}",
    )
    return mask != 0


def check_int_ids(
    name: str, ids: object, shape: torch.Size, device: torch.device, *, of: str
) -> Tensor:
    """An integer tensor of ``shape`` on ``device`` (``of`` says what each id belongs to)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer ids, got dtype {ids.dtype}")
    if ids.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(ids.shape)} but {of} have shape {tuple(shape)}; "
            "give one id per entry"
        )
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but {of} are on {device}")
    return ids


def check_group(
    group: object, rows_shape: torch.Size, device: torch.device, *, of_shape: torch.Size
) -> Tensor:
    """Integer group ids, one per sequence (``rows_shape``) of log-probs shaped ``of_shape``;
    returned flat ``[rows]``."""
    of = f"the rows (sequences) of the log-probs of shape {tuple(of_shape)}"
    return check_int_ids("group", group, rows_shape, device, of=of).reshape(-1)


# -- tensors: values ----------------------------------------------------------------------------

# Log-probs above these come from no distribution's rounding: float32 / float64 math rounds a
# log-prob near 0 by ~1e-7; bf16 / fp16 log-probs computed in their own precision can be off by a
# few ulps of the logits (2^-8 relative for bf16), i.e. up to ~0.06 for logits ~ 10.
_POSITIVE_LOGP_TOL = {torch.bfloat16: 2.0**-4, torch.float16: 2.0**-4}
_POSITIVE_LOGP_TOL_DEFAULT = 1e-3


def _what_was_passed(x: Tensor, keep: Tensor) -> str:
    kept = x[keep]
    if bool(((kept >= 0) & (kept <= 1)).all()):
        return "probabilities (every value in [0, 1])? Pass their log"
    if bool((kept >= 0).all()):
        return "negative log-likelihoods (every value >= 0)? Pass their negation"
    return "raw logits or scores? Pass log_softmax(logits) gathered at the sampled tokens"


def check_log_probs(
    name: str,
    x: Tensor,
    checks: ValueChecks,
    *,
    allow_neg_inf: bool,
    role: str = "",
    density: bool = False,
    density_hint: bool = True,
    rounding_of: torch.dtype | None = None,
) -> None:
    """Queue the checks of log-probs (masked positions already set to 0): no NaN, no +inf, none
    above 0 (beyond rounding; skipped for the log-densities of continuous samples, ``density``),
    and no -inf unless ``allow_neg_inf`` (``role`` says why it is impossible).
    ``density_hint``: the message for values above 0 mentions ``density=True`` (only where the
    caller takes that option).

    One reduction pass (``aminmax``, or ``amax`` when -inf is allowed; NaN propagates) decides;
    the detailed message is built only when a check fails. ``rounding_of``: the dtype the
    log-probs were computed in, whose rounding sets how far above 0 is tolerated (default
    ``x``'s).
    """
    if not checks.enabled or x.numel() == 0:
        return
    x = x.detach()
    rounding_of = x.dtype if rounding_of is None else rounding_of
    tol = math.inf if density else _POSITIVE_LOGP_TOL.get(rounding_of, _POSITIVE_LOGP_TOL_DEFAULT)
    # One reduction (NaN propagates to both ends): the largest value, and the smallest only when
    # -inf is an error (a max alone reads several times faster than aminmax on the CPU). They
    # are compared on the host, after the one read: NaN fails every comparison; +inf fails both
    # (with tol = inf only the strict one).
    if allow_neg_inf:
        reads: tuple[Tensor, ...] = (x.amax(),)
    else:
        reads = torch.aminmax(x)[::-1]  # (largest, smallest)

    def failed(hi: float, lo: float = 0.0) -> bool:
        return not ((hi < math.inf if tol == math.inf else hi <= tol) and lo > -math.inf)

    def message() -> str:
        # The message re-finds the failure with failed()'s own comparisons: against tol in
        # float64 (every float dtype's values are float64 values), not in x's dtype, where
        # tol rounds (float32(1e-3) > 1e-3 fails the check but not x > tol in float32).
        k = torch.ones_like(x, dtype=torch.bool)
        for flags, what in ((torch.isnan(x) & k, "NaN"), ((x == math.inf) & k, "+inf")):
            if bool(flags.any()):
                return f"{name} contains {what} at {first_bad(flags)}"
        above = (x.to(torch.float64) > tol) & k
        if bool(above.any()):
            hint = " (Log-densities of continuous samples may exceed 0: pass density=True.)"
            return (
                f"{name} has values above 0 at {first_bad(above)}, largest "
                f"{float(x[k].max()):.4g}: log-probabilities are <= 0. Were these "
                f"{_what_was_passed(x, k)}{hint if density_hint else ''}"
            )
        return (
            f"{name} is -inf at {first_bad((x == -math.inf) & k)}: {role}; mask such positions out"
        )

    checks.add_read(reads, failed, message)


def check_finite_surrogate(surrogate: Tensor, checks: ValueChecks, explain: Callable[[], str]):
    """Queue: the gradient surrogate is finite (else its gradient, and the loss, would be NaN)."""
    if not checks.enabled:
        return
    s = surrogate.detach()
    if s.dim() == 0:  # a reduced surrogate is read as it is and judged on the host
        checks.add_read((s,), lambda v: not math.isfinite(v), explain)
    else:
        checks.add((s - s).ne_(0.0), lambda _: explain())  # inf - inf and NaN - NaN are NaN


# -- logits -------------------------------------------------------------------------------------


def check_logits_pair(
    logits: object,
    logits_ref: object,
    *,
    names: tuple[str, str] = ("logits", "logits_ref"),
    dtypes: tuple | None = None,
    matrix: bool = False,
    what: str = "logits",
) -> tuple[Tensor, Tensor]:
    """Two float tensors ``[..., V]`` (``[N, V]`` when ``matrix``) of one shape and device."""
    for name, t in zip(names, (logits, logits_ref), strict=True):
        t = check_float_tensor(name, t, what=what, dtypes=dtypes)
        if t.dim() < 1 or t.shape[-1] == 0 or (matrix and t.dim() != 2):
            want = "[N, V]" if matrix else "[..., V]"
            raise ValueError(f"{name} must be {want} with V >= 1, got shape {tuple(t.shape)}")
    assert isinstance(logits, Tensor) and isinstance(logits_ref, Tensor)
    if logits.shape != logits_ref.shape:
        padded = logits.shape[:-1] == logits_ref.shape[:-1]
        raise ValueError(
            f"{names[0]} has shape {tuple(logits.shape)} but {names[1]} has shape "
            f"{tuple(logits_ref.shape)}; they must match (same positions, same vocabulary V)"
            + (
                "; two models whose vocabularies are padded to different sizes: pass "
                "valid_vocab_size=<the tokenizer's vocabulary size> to leave the padding out"
                if padded
                else ""
            )
        )
    check_same_device(**{names[0]: logits, names[1]: logits_ref})
    return logits, logits_ref


def check_labels(
    labels: object,
    lead: torch.Size,
    device: torch.device,
    checks: ValueChecks,
    *,
    vocab_size: int,
    ignore_index: int,
) -> Tensor:
    """Token ids, one per position, in ``[0, vocab_size)`` or ``ignore_index``; returned flat."""
    labels = check_int_ids("labels", labels, lead, device, of="the logits' positions")
    flat = labels.reshape(-1).to(torch.int64)
    checks.add(
        ((flat < 0) | (flat >= vocab_size)) & (flat != ignore_index),
        lambda f: (
            f"labels has {int(f.sum())} id(s) outside [0, {vocab_size}) that are not "
            f"ignore_index={ignore_index} (first: {int(flat[f][0])})"
        ),
    )
    return flat


def check_rows_have_distributions(
    lse_z: Tensor, lse_y: Tensor, keep: Tensor | None, checks: ValueChecks
) -> None:
    """Queue: every kept row of both logits has a distribution (a finite log-normalizer).

    A row with NaN or ``+inf`` entries, or with every entry ``-inf``, has none.
    """
    for name, lse in (("logits", lse_z), ("logits_ref", lse_y)):
        bad = ~torch.isfinite(lse)
        if keep is not None:
            bad = bad & keep

        def message(flags: Tensor, name: str = name) -> str:
            return (
                f"{name} has {int(flags.sum())} row(s) with NaN or +inf entries, or with every "
                f"entry -inf (no distribution); first at flat row "
                f"{int(flags.nonzero()[0, 0])}. Mask such rows out"
            )

        checks.add(bad, message)


def check_linear(suffix: str, hidden: object, weight: object, bias: object) -> None:
    """``hidden [..., H]``, ``weight [V, H]`` and an optional ``bias [V]`` of one LM head."""
    h = check_float_tensor(f"hidden{suffix}", hidden, what="hidden states")
    w = check_float_tensor(f"weight{suffix}", weight, what="LM-head weights")
    if w.dim() != 2:
        raise ValueError(f"weight{suffix} must be [V, H], got shape {tuple(w.shape)}")
    if h.dim() < 1 or h.shape[-1] != w.shape[1]:
        raise ValueError(
            f"hidden{suffix} has shape {tuple(h.shape)} but weight{suffix} has shape "
            f"{tuple(w.shape)}; hidden{suffix}'s last dim must equal weight{suffix}'s H"
        )
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (w.shape[0],)):
        raise ValueError(
            f"bias{suffix} must be a tensor of shape ({w.shape[0]},), got "
            f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}"
        )
    check_same_device(**{f"hidden{suffix}": h, f"weight{suffix}": w})


def check_row_vector(name: str, t: object, n: int, device: torch.device) -> Tensor:
    """A float ``[n]`` tensor on ``device``, returned contiguous float32 (kernel arguments)."""
    t = check_float_tensor(name, t, what="one value per row")
    if t.shape != (n,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({n},), one per row")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the logits are on {device}")
    return t.to(torch.float32).contiguous()
