"""Replacing a function of a peer, in the peer's own module, by a klest one; reversibly.

verl and OpenRLHF call their KL function directly (no registry or config hook selects it), so
the drop-ins' ``install()`` rebinds the name that the peer's loss code looks up. Only that
module's name is rebound: other modules that imported the function keep the original.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_ORIGINAL = "__klest_replaces__"


@dataclass
class Installed:
    """A peer's function replaced by klest's (what ``install()`` returns).

    Attributes:
      module: the peer's module whose name was rebound.
      name: the rebound name.
      original: the peer's function.
      replacement: klest's function now bound to ``module.name``.

    ``uninstall()``, or leaving a ``with`` block, puts the original back.
    """

    module: ModuleType
    name: str
    original: Callable[..., Any]
    replacement: Callable[..., Any]

    def uninstall(self) -> None:
        """Bind ``module.name`` to the peer's original function again (if klest's is bound)."""
        if getattr(self.module, self.name, None) is self.replacement:
            setattr(self.module, self.name, self.original)

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def replace_function(
    module_name: str, name: str, replacement: Callable[..., Any], *, peer: str
) -> Installed:
    """Rebind ``module_name.name`` to ``replacement``; the peer's module is imported here.

    Installing twice replaces klest's earlier function and keeps the peer's original.
    """
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"klest.integrations.{peer}.install() replaces {module_name}.{name}, but "
            f"{module_name} does not import here ({e}); install() must run in the process "
            f"that trains, where {peer} is installed"
        ) from e
    current = getattr(module, name, None)
    if not callable(current):
        raise RuntimeError(
            f"{module_name} has no function {name}: this version of {peer} computes its KL "
            "elsewhere, so klest cannot be installed into it (call klest's function directly)"
        )
    original = getattr(current, _ORIGINAL, current)
    setattr(replacement, _ORIGINAL, original)
    setattr(module, name, replacement)
    return Installed(module, name, original, replacement)
