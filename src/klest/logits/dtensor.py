r"""DTensor logits: the vocabulary-parallel KL (and JSD, skew KL, TV) over a device mesh, the
other placements kept.

torchtitan, NeMo-RL's DTensor policy and verl's torchtitan engine hold logits ``[..., V]`` as
DTensors on a device mesh. A mesh dimension whose placement shards the vocabulary (``Shard`` of
the last dimension) becomes the process group of :func:`klest.kl_from_logits_vocab_parallel`
(with DTensor's uneven chunks: each rank's shard size is gathered, not assumed); a mesh dimension
that shards a position dimension (``Shard(k)``, k before the last) holds local positions, on
which the KL is computed where they are; ``Replicate`` dimensions hold copies. The result is a
DTensor on the same mesh with the vocabulary dimension replicated and the other placements
kept: per position (``reduction="none"``) the position shards stay shards; a scalar reduction
over sharded positions is a ``Partial`` sum of the ranks' parts (``"sum"``, or a mean with the
step's ``counts``), and over unsharded positions it is replicated. A ``Partial`` placement of
the inputs is refused (a sum of pending parts is not a distribution's logits), as is a strided
shard of the vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor

from klest._checks import ValueChecks
from klest._types import DEFAULT_REDUCTION
from klest.logits import divergences
from klest.logits import vocab_parallel_divergences as shards
from klest.logits._sharded import is_dtensor
from klest.logits.from_hidden import kl_from_hidden as kl_from_plain_hidden
from klest.logits.from_logits import kl_from_logits as kl_from_plain_logits
from klest.logits.from_logits import position_kls as plain_position_kls
from klest.logits.vocab_parallel import kl_from_logits_vocab_parallel
from klest.logits.vocab_parallel_hidden import kl_from_hidden_vocab_parallel

__all__ = [
    "hidden_on_dtensors",
    "is_dtensor",
    "jsd_from_hidden",
    "jsd_from_logits",
    "kl_dtensor",
    "kl_from_hidden",
    "kl_from_logits",
    "kl_hidden_dtensor",
    "on_dtensors",
    "position_kls",
    "skew_kl_from_hidden",
    "skew_kl_from_logits",
    "tv_from_hidden",
    "tv_from_logits",
]


def _placements(logits: Any, logits_ref: Any, name: str) -> tuple[int | None, list[int]]:
    """``(mesh dim sharding the vocabulary or None, mesh dims sharding positions)``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not (is_dtensor(logits) and is_dtensor(logits_ref)):
        raise TypeError(
            f"{name}: logits and logits_ref must both be DTensors or both plain tensors, got "
            f"{type(logits).__name__} and {type(logits_ref).__name__}"
        )
    if logits.device_mesh != logits_ref.device_mesh or tuple(logits.placements) != tuple(
        logits_ref.placements
    ):
        raise ValueError(
            f"{name}: logits and logits_ref must share the device mesh and placements, got "
            f"{tuple(logits.placements)} and {tuple(logits_ref.placements)}"
        )
    last = logits.ndim - 1
    vocab_dim, position_dims = None, []
    for i, p in enumerate(logits.placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise ValueError(
                f"{name}: mesh dimension {i} holds the logits as {p} (pending partial sums); "
                "redistribute to Shard or Replicate first"
            )
        if type(p) is not Shard:
            raise ValueError(
                f"{name}: mesh dimension {i} has placement {p}, which klest cannot map to "
                "vocabulary shards or positions; redistribute to Shard(-1) or Replicate"
            )
        dim = p.dim % logits.ndim
        if dim == last:
            if vocab_dim is not None:
                raise ValueError(f"{name}: two mesh dimensions shard the vocabulary")
            vocab_dim = i
        else:
            position_dims.append(i)
    return vocab_dim, position_dims


def _local(x: Any) -> Any:
    return x.to_local() if is_dtensor(x) else x


def kl_dtensor(
    logits: Any,
    logits_ref: Any,
    *,
    single: Callable[..., Any],
    vocab_parallel: Callable[..., Any],
    reduction: str,
    counts: object,
    options: dict[str, Any],
    name: str = "kl_from_logits",
) -> Any:
    """The KL of DTensor logits: ``vocab_parallel`` over the vocabulary's mesh dimension (or
    ``single`` when the vocabulary is whole), on the local positions; the result as a DTensor
    (module docstring). ``options`` are passed on; DTensor ``mask``/``labels`` become local."""
    vocab_dim, position_dims = _placements(logits, logits_ref, name)
    mesh = logits.device_mesh
    local_options = {k: _local(v) for k, v in options.items()}
    local_options["reduction"] = reduction
    local_options["counts"] = counts
    scalar = reduction not in ("none", "per-sequence")
    if position_dims and scalar and reduction != "sum" and counts is None:
        raise ValueError(
            f"{name}: reduction={reduction!r} over positions sharded on mesh dimension(s) "
            f"{position_dims} needs counts= (the global token and sequence counts), or use "
            "reduction='sum' or 'none'; each rank's own mean would be of its part only"
        )
    z, y = logits.to_local(), logits_ref.to_local()
    if vocab_dim is None:
        out = single(z, y, **local_options)
    else:
        group = mesh.get_group(vocab_dim)
        out = vocab_parallel(z, y, group=group, vocab_size=logits.shape[-1], **local_options)
    return _as_dtensor(out, mesh, logits.placements, vocab_dim, logits.ndim)


def _as_dtensor(out: Any, mesh: Any, placements: Any, vocab_dim: int | None, ndim: int) -> Any:
    """A per-rank result (or ``(result, details)``) as a DTensor: the vocabulary's mesh
    dimension replicated, position shards kept, sums over sharded positions ``Partial``."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    value = out[0] if isinstance(out, tuple) else out
    result = []
    for i, p in enumerate(placements):
        if i == vocab_dim or p.is_replicate():
            result.append(Replicate())
        elif p.dim % ndim < value.ndim:  # a position dimension the result keeps
            result.append(p)
        else:  # summed over: each rank holds a part of the sum
            result.append(Partial())
    wrapped = DTensor.from_local(value, mesh, result, run_check=False)
    if isinstance(out, tuple):
        return type(out)(wrapped, out[1])
    return wrapped


def _head_vocab_dim(weight: Any, name: str) -> int:
    """The mesh dimension sharding an LM head's rows (``Shard(0)``); every other one replicated."""
    from torch.distributed.tensor import Replicate, Shard

    vocab_dim = None
    for i, p in enumerate(weight.placements):
        if type(p) is Shard and p.dim % weight.ndim == 0 and vocab_dim is None:
            vocab_dim = i
        elif not isinstance(p, Replicate):
            raise ValueError(
                f"{name}: mesh dimension {i} holds the head as {p}; klest maps one Shard(0) "
                "(the vocabulary, tensor parallelism) and Replicate elsewhere (an FSDP2 shard: "
                "use klest.nn.KLFromHidden(..., gather_with=model))"
            )
    if vocab_dim is None:
        raise ValueError(f"{name}: no mesh dimension shards the head's rows (Shard(0))")
    return vocab_dim


def kl_hidden_dtensor(
    hidden: Any,
    weight: Any,
    hidden_ref: Any,
    weight_ref: Any,
    *,
    vocab_parallel: Callable[..., Any],
    reduction: str,
    counts: object,
    options: dict[str, Any],
    name: str = "kl_from_hidden",
) -> Any:
    """The KL from DTensor hidden states and vocabulary-sharded DTensor heads: the heads' rows
    mesh dimension becomes ``vocab_parallel``'s group; the hidden states are replicated over it
    (redistributed if not), their local gradient a ``Partial`` sum there; positions sharded on
    other mesh dimensions stay local; the result as in :func:`kl_dtensor`."""
    from torch.distributed.tensor import Partial, Replicate

    if not all(is_dtensor(t) for t in (hidden, weight, hidden_ref, weight_ref)):
        raise TypeError(f"{name}: hidden, weight, hidden_ref and weight_ref must all be DTensors")
    vocab_dim = _head_vocab_dim(weight, "weight")
    if _head_vocab_dim(weight_ref, "weight_ref") != vocab_dim or weight.device_mesh != (
        mesh := hidden.device_mesh
    ):
        raise ValueError(f"{name}: both heads must shard their rows over one mesh dimension")

    def local_hidden(h: Any) -> Tensor:
        places = list(h.placements)
        if not places[vocab_dim].is_replicate():
            places[vocab_dim] = Replicate()
            h = h.redistribute(mesh, places)
        grads = [Partial() if i == vocab_dim else p for i, p in enumerate(places)]
        return h.to_local(grad_placements=grads)

    positions = [p for i, p in enumerate(hidden.placements) if i != vocab_dim]
    if any(isinstance(p, Partial) for p in positions):
        raise ValueError(f"{name}: Partial hidden states: redistribute them first")
    local_options = {k: _local(v) for k, v in options.items()}
    sharded = any(not p.is_replicate() for p in positions)
    if sharded and reduction not in ("none", "per-sequence", "sum") and counts is None:
        raise ValueError(
            f"{name}: reduction={reduction!r} over sharded positions needs counts=, or use "
            "reduction='sum' or 'none'"
        )
    out = vocab_parallel(
        local_hidden(hidden),
        weight.to_local(),
        local_hidden(hidden_ref),
        weight_ref.to_local(),
        group=mesh.get_group(vocab_dim),
        vocab_size=weight.shape[0],
        reduction=reduction,
        counts=counts,
        **local_options,
    )
    return _as_dtensor(out, mesh, hidden.placements, vocab_dim, hidden.ndim)


def on_dtensors(plain: Callable[..., Any], vocab_parallel: Callable[..., Any]) -> Callable:
    """``plain`` (a function of logits ``(logits, logits_ref, **options)``) taking DTensors too:
    through :func:`kl_dtensor`, with ``vocab_parallel`` where a mesh dimension shards the
    vocabulary. Plain tensors go to ``plain`` untouched."""

    @functools.wraps(plain)
    def call(logits: Tensor, logits_ref: Tensor, **options: Any) -> Any:
        if not (is_dtensor(logits) or is_dtensor(logits_ref)):
            return plain(logits, logits_ref, **options)
        reduction = options.pop("reduction", DEFAULT_REDUCTION)
        counts = options.pop("counts", None)
        return kl_dtensor(
            logits,
            logits_ref,
            single=plain,
            vocab_parallel=vocab_parallel,
            reduction=reduction,
            counts=counts,
            options=options,
            name=plain.__name__,
        )

    return call


def hidden_on_dtensors(plain: Callable[..., Any], vocab_parallel: Callable[..., Any]) -> Callable:
    """``plain`` (a function of hidden states and heads) taking DTensor hidden states with
    vocabulary-sharded DTensor heads too, through :func:`kl_hidden_dtensor` and
    ``vocab_parallel``. Anything else goes to ``plain`` (which refuses an FSDP2 shard alone)."""

    @functools.wraps(plain)
    def call(
        hidden: Tensor,
        weight: Tensor,
        hidden_ref: Tensor | None = None,
        weight_ref: Tensor | None = None,
        **options: Any,
    ) -> Any:
        if not (is_dtensor(hidden) and is_dtensor(weight)):
            return plain(hidden, weight, hidden_ref, weight_ref, **options)
        reduction = options.pop("reduction", DEFAULT_REDUCTION)
        counts = options.pop("counts", None)
        return kl_hidden_dtensor(
            hidden,
            weight,
            hidden_ref,
            weight_ref,
            vocab_parallel=vocab_parallel,
            reduction=reduction,
            counts=counts,
            options=options,
            name=plain.__name__,
        )

    return call


kl_from_logits = on_dtensors(kl_from_plain_logits, kl_from_logits_vocab_parallel)
kl_from_hidden = hidden_on_dtensors(kl_from_plain_hidden, kl_from_hidden_vocab_parallel)
jsd_from_logits = on_dtensors(divergences.jsd_from_logits, shards.jsd_from_logits_vocab_parallel)
jsd_from_hidden = hidden_on_dtensors(
    divergences.jsd_from_hidden, shards.jsd_from_hidden_vocab_parallel
)
skew_kl_from_logits = on_dtensors(
    divergences.skew_kl_from_logits, shards.skew_kl_from_logits_vocab_parallel
)
skew_kl_from_hidden = hidden_on_dtensors(
    divergences.skew_kl_from_hidden, shards.skew_kl_from_hidden_vocab_parallel
)
tv_from_logits = on_dtensors(divergences.tv_from_logits, shards.tv_from_logits_vocab_parallel)
tv_from_hidden = hidden_on_dtensors(
    divergences.tv_from_hidden, shards.tv_from_hidden_vocab_parallel
)


def position_kls(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    direction: str,
    keep: Tensor | None,
    checks: ValueChecks,
) -> Tensor:
    """Exact per-position KLs ``[...]`` for klest's estimators (0 where ``keep`` is False), as
    a plain tensor of this rank's positions: DTensor logits go through :func:`kl_dtensor` (the
    vocabulary-parallel path runs its own value checks)."""
    if not (is_dtensor(logits) or is_dtensor(logits_ref)):
        return plain_position_kls(logits, logits_ref, direction=direction, keep=keep, checks=checks)
    out = kl_dtensor(
        logits,
        logits_ref,
        single=kl_from_plain_logits,
        vocab_parallel=kl_from_logits_vocab_parallel,
        reduction="none",
        counts=None,
        options={"direction": direction, "mask": keep},
        name="kl_penalty",
    )
    return out.to_local()
