"""Repository-wide pytest set-up: the examples in klest's docstrings run as doctests.

``python -m pytest`` collects ``tests/`` and, with ``--doctest-modules``, every module under
``src/klest`` (``[tool.pytest.ini_options]`` in pyproject.toml). Each docstring example sees
``torch`` and ``klest`` (besides its own module's names) and starts from ``torch.manual_seed(0)``.
"""

from __future__ import annotations

import pytest
import torch
from _pytest.doctest import DoctestItem

import klest

# Modules that need an optional dependency at import time, and hold no examples: the Triton
# kernels themselves (``klest[gpu]``). Everything else under src/klest imports without extras.
collect_ignore = ["src/klest/logits/kernels/_kl_logits_triton.py"]


@pytest.fixture(autouse=True)
def _doctest_setup(request: pytest.FixtureRequest) -> None:
    """For docstring examples only: ``torch`` and ``klest`` in scope, the global seed at 0."""
    if not isinstance(request.node, DoctestItem):
        return
    namespace = request.getfixturevalue("doctest_namespace")
    namespace["torch"] = torch
    namespace["klest"] = klest
    torch.manual_seed(0)
