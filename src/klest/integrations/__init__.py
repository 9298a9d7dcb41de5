"""Drop-in use of klest from the trainers people run.

Each submodule imports its peer only when it is itself imported; ``import klest`` never needs
them:

- :mod:`klest.integrations.hf`: response-aligned log-probs, masks and group ids from a causal
  LM's outputs and its batch.
- :mod:`klest.integrations.trl`: klest's KL term inside TRL's trainers.
- :mod:`klest.integrations.verl`: verl's ``kl_penalty`` with its option names.
- :mod:`klest.integrations.openrlhf`: OpenRLHF's ``compute_approx_kl`` with its option names.
- :mod:`klest.integrations.migration`: every peer's KL option written as one klest call (the
  migration table); it imports no peer.
"""

__all__: list[str] = []  # the submodules are the public surface
