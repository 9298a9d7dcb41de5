"""Slow, obviously correct references for the peer drop-ins' tests (verl, OpenRLHF).

- :func:`surrogate_reference`: the per-sequence surrogates whose gradients klest's ``score`` and
  ``cumulative`` estimators are, by Python loops in float64, written from their math (Tang and
  Munos, "On a few pitfalls in KL divergence gradient estimation for RL", 2025), with masks,
  importance weights and a leave-one-out baseline.
- :func:`rb_surrogate_reference`: the same for ``rb`` from logits, on-policy.
- :func:`flat_grad`, :func:`exact_grads`: gradients as one vector, and the exact gradients of
  both KLs and of the token-local KLs of a tabular testbed (means that the peers' gradients have,
  by enumeration).
- :func:`real_module`, :func:`real_function`, :func:`real_source`: an installed peer's module,
  function, or source (parsed, not imported); where the peer does not import the test skips,
  or fails under ``KLEST_REQUIRE_PEERS=1`` (``make test``, which installs
  ``requirements/peers.txt``); :func:`stand_in_module`: a module of a peer's name holding given
  functions.
- :func:`two_leaves`: two independent leaf copies of a tensor, to compare two gradients.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import sys
import types
import warnings
from typing import NoReturn

import pytest
import torch

from klest.testbeds import TabularAutoregressive
from tests._reference import exact_token_level_gradient, logits_reference


def surrogate_reference(
    logp, logp_ref, mask, grad, *, logp_behavior=None, loo_group=None
) -> torch.Tensor:
    r"""Per-row surrogates ``[B]`` (float64) of klest's score-function estimators of
    :math:`\nabla KL(\pi\|ref)` for rows of tokens ``[B, T]``, by loops:

    - ``"score"``: :math:`W (\sum_t \log\pi_t)(\sum_u \rho_u - b)`, W the row's importance weight;
    - ``"cumulative"``: :math:`\sum_t \log\pi_t\,(\sum_{u\ge t} W_{\le u}\rho_u - W_{\le t} b_t)`;

    with :math:`\rho_u` the log-ratios, the coefficients detached, masked tokens skipped (and not
    counted in positions). ``loo_group``: group ids ``[B]`` for a leave-one-out baseline, the
    mean target of the other rows of the group (score: their sequence targets; cumulative: their
    targets at the same position, counted from each row's first valid token); on-policy only.
    """
    b_rows, t_len = logp.shape
    m = torch.ones(b_rows, t_len, dtype=torch.bool) if mask is None else mask.bool()
    lp = logp.double()
    d = (logp - logp_ref).detach().double().tolist()
    lw = None if logp_behavior is None else (logp - logp_behavior).detach().double().tolist()
    keep = m.tolist()
    # Each row's valid positions, and the target of each one (unweighted for a baseline).
    positions = [[t for t in range(t_len) if keep[i][t]] for i in range(b_rows)]
    targets, weights = [], []
    for i in range(b_rows):
        w, row_w, row_targets = 0.0, [], []
        for t in positions[i]:
            w += 0.0 if lw is None else lw[i][t]
            row_w.append(torch.tensor(w, dtype=torch.float64).exp().item())
        if grad == "score":
            row_w = [row_w[-1]] * len(positions[i]) if row_w else []  # the row's weight W
            total = sum(d[i][t] for t in positions[i])
            row_targets = [w * total for w in row_w]
        else:
            row_targets = [
                sum(row_w[k] * d[i][u] for k, u in enumerate(positions[i]) if k >= j)
                for j in range(len(positions[i]))
            ]
        targets.append(row_targets)
        weights.append(row_w)
    out = []
    for i in range(b_rows):
        total = torch.zeros((), dtype=torch.float64)
        for j, t in enumerate(positions[i]):
            coef = targets[i][j]
            if loo_group is not None:
                # score: one target per non-empty row; cumulative: per aligned position j.
                at = 0 if grad == "score" else j
                others = [
                    targets[k][at]
                    for k in range(b_rows)
                    if k != i and loo_group[k] == loo_group[i] and at < len(targets[k])
                ]
                coef -= weights[i][j] * (sum(others) / len(others) if others else 0.0)
            total = total + lp[i, t] * coef
        out.append(total)
    return torch.stack(out)


def rb_surrogate_reference(logits, logits_ref, labels, mask) -> torch.Tensor:
    r"""Per-row surrogates ``[B]`` of ``rb`` on-policy, float64:
    :math:`\sum_n KL_n + \sum_m \log\pi_m\,\mathrm{sg}(\sum_{n>m} KL_n)` over valid positions,
    with :math:`KL_n` the exact KL(pi_n||ref_n) from :func:`~tests._reference.logits_reference`."""
    ref = logits_reference(logits, logits_ref, labels=labels)
    kl, logp = ref["kl_pi_ref"], ref["logp_label"]
    kl_values = kl.detach()
    out = []
    for i in range(kl.shape[0]):
        valid = [t for t in range(kl.shape[1]) if bool(mask[i, t])]
        total = torch.zeros((), dtype=torch.float64)
        for j, t in enumerate(valid):
            future = sum(float(kl_values[i, u]) for u in valid[j + 1 :])
            total = total + kl[i, t] + logp[i, t] * future
        out.append(total)
    return torch.stack(out)


def flat_grad(loss, params, *, retain: bool = False) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=retain)
    return torch.cat([g.reshape(-1).double() for g in grads])


def exact_grads(testbed: TabularAutoregressive) -> dict[str, torch.Tensor]:
    """Exact flat gradients on a tabular testbed: of KL(pi||ref) and KL(ref||pi) of the
    sequences, and of the token-local sums :math:`\\sum_t E_{y_{<t}\\sim\\pi}KL_t` of each
    direction with the prefix distribution held fixed (``"token pi||ref"``, ``"token ref||pi"``),
    by enumeration."""
    out = {}
    for direction in ("pi||ref", "ref||pi"):
        out[direction] = torch.cat(
            [g.reshape(-1).double() for g in testbed.exact_kl_grad(direction)]
        )
        out[f"token {direction}"] = exact_token_level_gradient(testbed, direction)
    return out


REQUIRE_PEERS = os.environ.get("KLEST_REQUIRE_PEERS") == "1"
"""``make test`` sets ``KLEST_REQUIRE_PEERS=1`` (and installs ``requirements/peers.txt``): a peer
that does not import then fails the test instead of skipping it."""


def _unavailable(what: str, error: Exception) -> NoReturn:
    reason = f"{what} does not import here ({type(error).__name__}: {error})"
    if REQUIRE_PEERS:
        pytest.fail(f"{reason}; KLEST_REQUIRE_PEERS=1 (make test installs requirements/peers.txt)")
    pytest.skip(f"{reason}; pip install -r requirements/peers.txt runs it")


def peer_file(module: str) -> pathlib.Path:
    """The source file of an installed peer's module, found on ``sys.path`` without importing
    the module or its parent packages (and past a stand-in of :func:`stand_in_module`)."""
    top, *rest = module.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"no package {top}")
    base = pathlib.Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        raise ModuleNotFoundError(f"{top} has no module {module} ({path})")
    return path


@functools.cache
def _module_from_file(module: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(module, peer_file(module))
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def real_module(module: str, *, file_only: bool = False) -> types.ModuleType:
    """An installed peer's module, or skip (fail under ``KLEST_REQUIRE_PEERS=1``): the peers are
    not klest dependencies, and their modules import heavy packages (verl: Ray).

    ``file_only``: run the module's own file, not its parent packages' ``__init__`` (it is not
    put in ``sys.modules``). For ``openrlhf.models.utils``: the package ``openrlhf.models``
    imports OpenRLHF's model classes, which need flash-attn, which has no CPU build; the file
    itself needs deepspeed only, and holds the function OpenRLHF's trainers import.
    """
    try:
        with warnings.catch_warnings():  # the peers' own deprecations (deepspeed: torch.jit)
            warnings.simplefilter("ignore", DeprecationWarning)
            return _module_from_file(module) if file_only else importlib.import_module(module)
    except Exception as e:  # ImportError, or the peer's own import-time failures
        _unavailable(module, e)


def real_function(module: str, name: str, *, file_only: bool = False):
    """``module.name`` of an installed peer (see :func:`real_module`)."""
    return getattr(real_module(module, file_only=file_only), name)


def real_source(module: str) -> ast.Module:
    """The syntax tree of an installed peer's module, read without importing it (for modules
    whose imports need a GPU stack: OpenRLHF's actor imports vLLM), or skip / fail as
    :func:`real_module`."""
    try:
        path = peer_file(module)
    except ModuleNotFoundError as e:
        _unavailable(module, e)
    return ast.parse(path.read_text(), filename=str(path))


def stand_in_module(monkeypatch, dotted: str, **functions) -> types.ModuleType:
    """A module named ``dotted`` (and empty parent packages) in ``sys.modules`` for the test,
    holding ``functions``: what ``install()`` sees instead of the peer."""
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    module = types.ModuleType(dotted)
    for name, fn in functions.items():
        setattr(module, name, fn)
    monkeypatch.setitem(sys.modules, dotted, module)
    return module


def two_leaves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two leaf copies of ``x`` that require grad."""
    return x.clone().requires_grad_(True), x.clone().requires_grad_(True)
