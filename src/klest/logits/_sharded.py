"""Recognising sharded tensors (``torch.distributed.tensor.DTensor``) without importing them early,
and refusing a sharded head read outside its module's forward."""

from __future__ import annotations

__all__ = ["is_dtensor", "refuse_sharded_weight"]


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing it early)."""
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


def refuse_sharded_weight(weight: object, hidden: object, name: str) -> None:
    """A DTensor head weight with plain hidden states is an FSDP2 shard read outside the
    module's forward: refuse it with the module form that gathers it."""
    if is_dtensor(weight) and not is_dtensor(hidden):
        raise ValueError(
            f"{name} is a DTensor shard (a head sharded by FSDP2's fully_shard?) read outside its "
            "module's forward; use klest.nn.KLFromHidden(lm_head, ref_head, gather_with=model), "
            "which runs the KL as a forward method of the sharded model so that the weights are "
            "gathered, or pass the gathered weight"
        )
