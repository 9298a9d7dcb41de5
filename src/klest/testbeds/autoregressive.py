r"""Tabular autoregressive policies: exact sequence-level KL and its gradient.

A policy emits tokens y_1..y_T from a vocabulary of V tokens; with an end-of-sequence token
``eos`` a sequence stops after emitting it (later positions are masked). The sequence KL is

.. math::
    KL(\pi\|ref) = E_{y\sim\pi}\Big[\sum_t \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})\Big]
                 = \sum_t E_{y_{<t}\sim\pi}\, KL\big(\pi(\cdot|y_{<t})\,\|\,ref(\cdot|y_{<t})\big),

and KL(ref||pi) the same with the roles (and the prefix distribution) swapped.

Two parameterizations:

- ``markov=False``: one logit vector per prefix (any dependence on the past), table
  ``[sum_{t<T} V^t, V]``; exact values by enumerating all sequences (small ``V^T``).
- ``markov=True``: the next token depends on the position and the last token only, table
  ``[T, V + 1, V]`` (state ``V`` is the start); exact values by dynamic programming over the
  last-token marginal, O(T V^2), so T can be large.

Exact gradients are autodiff of these exact computations. Used by the gradient-pitfalls experiments
("On a few pitfalls in KL divergence gradient estimation for RL", arXiv:2506.09477).

Token-local KLs (:meth:`TabularAutoregressive.token_local_kl`) hold the prefix distribution fixed:

.. math::
    \sum_t E_{y_{<t}\sim \mathrm{sg}(\pi)}\, KL\big(\pi(\cdot|y_{<t})\,\|\,ref(\cdot|y_{<t})\big)

(or :math:`KL(ref(\cdot|y_{<t})\|\pi(\cdot|y_{<t}))`, still with prefixes from pi), whose gradient
is the per-position part alone: what per-token losses descend on average.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from klest._checks import check_direction
from klest.testbeds.base import Sample, SampledTestbed

__all__ = ["MAX_ENUMERATED", "TabularAutoregressive", "TokenLocalKL"]

MAX_ENUMERATED = 2_000_000
"""The most sequences (``V^T``) a testbed enumerates for its exact answers."""


def _identity(x: Tensor) -> Tensor:
    return x


def _r_log_r(delta: Tensor) -> Tensor:
    """``r log r`` with ``r = e^{-delta}``: its mean under pi is KL(ref||pi)."""
    return torch.exp(-delta) * -delta


class TabularAutoregressive(SampledTestbed):
    """pi (trainable table of logits) against ref (fixed table), exact by enumeration or DP.

    Args:
      logits: pi's table, ``[sum_{t<T} V^t, V]`` or, with ``markov=True``, ``[T, V + 1, V]``.
      logits_ref: ref's table, same shape.
      horizon: T, the maximum length.
      eos: the end-of-sequence token id, or None for fixed-length sequences.
      markov: which parameterization the tables use (see the module docstring).

    Example:
      >>> pi = TabularAutoregressive.random(3, 4, eos=2, seed=0)  # V = 3 tokens, T <= 4
      >>> s = pi.sample(8, generator=klest.testbeds.make_generator(0))
      >>> s.logp.shape, s.logits.shape  # per token; full next-token log-probs along the samples
      (torch.Size([8, 4]), torch.Size([8, 4, 3]))
      >>> kl = pi.exact_kl("pi||ref")  # by enumeration, differentiable in pi's table
    """

    name = "tabular-autoregressive"

    def __init__(
        self,
        logits: Tensor,
        logits_ref: Tensor,
        *,
        horizon: int,
        eos: int | None = None,
        markov: bool = False,
    ) -> None:
        if logits.shape != logits_ref.shape:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)} but logits_ref has shape "
                f"{tuple(logits_ref.shape)}"
            )
        v = logits.shape[-1]
        expected = (horizon, v + 1, v) if markov else (sum(v**t for t in range(horizon)), v)
        if tuple(logits.shape) != expected:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)}; a {'markov' if markov else 'prefix'} "
                f"table for V={v}, T={horizon} has shape {expected}"
            )
        if eos is not None and not 0 <= eos < v:
            raise ValueError(f"eos must be a token id in [0, {v}), got {eos}")
        self.logits = logits.detach().clone().requires_grad_(True)
        self.logits_ref = logits_ref.detach().clone()
        self.vocab_size = v
        self.horizon = horizon
        self.eos = eos
        self.markov = markov
        # Offsets of each prefix length in the prefix table.
        self._offsets = [sum(v**s for s in range(t)) for t in range(horizon)]

    @classmethod
    def random(
        cls,
        vocab_size: int,
        horizon: int,
        *,
        eos: int | None = None,
        markov: bool = False,
        scale: float = 1.0,
        ref_scale: float | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ) -> TabularAutoregressive:
        """Tables with i.i.d. N(0, scale^2) logits for pi and N(0, ref_scale^2) for ref."""
        v, t = vocab_size, horizon
        shape = (t, v + 1, v) if markov else (sum(v**s for s in range(t)), v)
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(shape, generator=g, dtype=dtype) * scale
        y = torch.randn(shape, generator=g, dtype=dtype) * (
            scale if ref_scale is None else ref_scale
        )
        return cls(z, y, horizon=horizon, eos=eos, markov=markov)

    def parameters(self) -> list[Tensor]:
        return [self.logits]

    # -- next-token distributions along given sequences ------------------------------------
    def _rows(self, tokens: Tensor) -> Tensor:
        """Table rows of the prefix at every position of ``tokens`` ``[n, T]`` -> ``[n, T]``."""
        n, t_len = tokens.shape
        if self.markov:
            start = torch.full((n, 1), self.vocab_size, dtype=torch.long, device=tokens.device)
            return torch.cat([start, tokens[:, :-1]], dim=1)
        rows = torch.empty_like(tokens)
        code = torch.zeros(n, dtype=torch.long, device=tokens.device)
        for t in range(t_len):
            rows[:, t] = self._offsets[t] + code
            code = code * self.vocab_size + tokens[:, t]
        return rows

    def _next_logprobs(self, table: Tensor, tokens: Tensor) -> Tensor:
        """log-softmax of the table rows along ``tokens``: ``[n, T, V]``."""
        rows = self._rows(tokens)
        if self.markov:
            steps = torch.arange(tokens.shape[1], device=tokens.device)
            z = table[steps.expand_as(rows), rows]
        else:
            z = table[rows]
        return torch.log_softmax(z, dim=-1)

    def log_probs(self, tokens: Tensor, *, ref: bool = False) -> Tensor:
        """Per-token log-probabilities ``log pi(y_t | y_<t)`` (or ref's) along ``tokens``.

        Args:
          tokens: token ids ``[n, T]``.
          ref: ref's log-probabilities instead of pi's.

        Returns:
          ``[n, T]``; pi's carry the graph to :meth:`parameters`. Positions after an ``eos`` are
          scored too: mask them with :attr:`Sample.mask` (what :meth:`evaluate` returns).
        """
        table = self.logits_ref if ref else self.logits
        return self._next_logprobs(table, tokens).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def _valid(self, tokens: Tensor) -> Tensor | None:
        """True up to and including the first ``eos`` of each row (None without eos)."""
        if self.eos is None:
            return None
        ended = (tokens == self.eos).long().cumsum(1)
        before = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=1)
        return before == 0

    # -- sampling --------------------------------------------------------------------------
    def draw(self, n: int, *, generator: torch.Generator) -> Tensor:
        """Token sequences ``[n, T]`` from pi (positions after eos are filled with eos)."""
        tokens = torch.zeros(n, self.horizon, dtype=torch.long)
        with torch.no_grad():
            table = self.logits  # read once: a subclass may compute it (an LM checks its cache)
            alive = torch.ones(n, dtype=torch.bool)
            # The table row of each prefix, advanced token by token (as _rows computes it).
            prev = torch.full((n,), self.vocab_size, dtype=torch.long)
            code = torch.zeros(n, dtype=torch.long)
            for t in range(self.horizon):
                z = table[t, prev] if self.markov else table[self._offsets[t] + code]
                probs = torch.log_softmax(z, dim=-1).exp()
                tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                tokens[:, t] = torch.where(alive, tok, self.eos if self.eos is not None else 0)
                prev = tokens[:, t]
                code = code * self.vocab_size + prev
                if self.eos is not None:
                    alive = alive & (tok != self.eos)
        return tokens

    def evaluate(self, tokens: Tensor) -> Sample:
        """Per-token log-probs and next-token distributions of pi and ref along ``tokens``."""
        log_pi = self._next_logprobs(self.logits, tokens)
        log_ref = self._next_logprobs(self.logits_ref, tokens)
        idx = tokens.unsqueeze(-1)
        return Sample(
            logp=log_pi.gather(-1, idx).squeeze(-1),
            logp_ref=log_ref.gather(-1, idx).squeeze(-1),
            mask=self._valid(tokens),
            x=tokens,
            logits=log_pi,
            logits_ref=log_ref,
        )

    # -- exact computations ----------------------------------------------------------------
    def all_sequences(self) -> tuple[Tensor, Tensor | None]:
        """Every distinct sequence ``[S, T]`` (padded with eos after the first eos) and its mask."""
        count = self.vocab_size**self.horizon
        if count > MAX_ENUMERATED:
            raise ValueError(
                f"V^T = {count} sequences is too many to enumerate (limit {MAX_ENUMERATED}); "
                "use a markov=True testbed, whose exact values use dynamic programming"
            )
        tokens = torch.tensor(
            list(itertools.product(range(self.vocab_size), repeat=self.horizon)), dtype=torch.long
        )
        valid = self._valid(tokens)
        if valid is not None:
            # Keep one representative per sequence: everything after the first eos is eos.
            canonical = (valid | (tokens == self.eos)).all(1)
            tokens, valid = tokens[canonical], valid[canonical]
        return tokens, valid

    def _enumerated_token_logprobs(self, table_a: Tensor, table_b: Tensor):
        tokens, valid = self.all_sequences()
        idx = tokens.unsqueeze(-1)
        la = self._next_logprobs(table_a, tokens).gather(-1, idx).squeeze(-1)
        lb = self._next_logprobs(table_b, tokens).gather(-1, idx).squeeze(-1)
        if valid is not None:
            la = torch.where(valid, la, torch.zeros_like(la))
            lb = torch.where(valid, lb, torch.zeros_like(lb))
        return la, lb, valid

    def _expect_token_sum(
        self, table_a: Tensor, table_b: Tensor, fn, *, frozen_prefix: bool = False
    ) -> Tensor:
        """``E_{y~a}[sum_t fn(log a(y_t|y<t) - log b(y_t|y<t))]``, exactly.

        With ``frozen_prefix`` the value is the same but the probability of each prefix is a
        constant: the gradient flows only through each position's own next-token distribution.
        """
        if self.markov:
            return self._markov_dp(table_a, table_b, fn, frozen_prefix=frozen_prefix)
        la, lb, valid = self._enumerated_token_logprobs(table_a, table_b)
        per_token = fn(la - lb)
        if valid is not None:
            per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
        seq_prob = la.sum(-1, keepdim=True).exp()
        if not frozen_prefix:
            return (seq_prob * per_token).sum()
        # P(y) = P(y_<t) a(y_t|y_<t) P(y_>t|y_<=t): keep the graph of the middle factor only.
        return (seq_prob.detach() * torch.exp(la - la.detach()) * per_token).sum()

    def _markov_dp(self, table_a: Tensor, table_b: Tensor, fn, *, frozen_prefix: bool) -> Tensor:
        v = self.vocab_size
        la = torch.log_softmax(table_a, -1)  # [T, V+1, V]
        lb = torch.log_softmax(table_b, -1)
        mass = torch.zeros(v + 1, dtype=la.dtype)
        mass[v] = 1.0  # the start state
        total = torch.zeros((), dtype=la.dtype)
        keep = torch.ones(v, dtype=la.dtype)
        if self.eos is not None:
            keep[self.eos] = 0.0  # sequences end after emitting eos
        for t in range(self.horizon):
            pa = la[t].exp()
            weight = mass.detach() if frozen_prefix else mass
            total = total + (weight.unsqueeze(-1) * pa * fn(la[t] - lb[t])).sum()
            nxt = (mass.unsqueeze(-1) * pa).sum(0) * keep
            mass = torch.cat([nxt, torch.zeros(1, dtype=la.dtype)])
        return total

    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        check_direction(direction)
        if direction == "pi||ref":
            return self._expect_token_sum(self.logits, self.logits_ref, _identity)
        return self._expect_token_sum(self.logits_ref, self.logits, _identity)

    def token_local_kl(self, direction: str = "pi||ref") -> Tensor:
        r"""The sum over positions of the next-token KLs, with the prefix distribution fixed.

        .. math::
            \sum_t E_{y_{<t}\sim \mathrm{sg}(\pi)}\, KL\big(\pi_t \| ref_t\big)
            \quad\text{or}\quad
            \sum_t E_{y_{<t}\sim \mathrm{sg}(\pi)}\, KL\big(ref_t \| \pi_t\big),

        :math:`\pi_t = \pi(\cdot|y_{<t})`. The prefixes come from pi in both directions, and
        their probabilities carry no gradient: the gradient is what per-token losses descend on
        average (the mean of ``klest.kl_penalty(..., grad="token")`` for ``"pi||ref"``, of
        autodiff of k3 for ``"ref||pi"``). For ``"pi||ref"`` the value equals
        :meth:`exact_kl`; for ``"ref||pi"`` it is what per-token KL(ref||pi) estimates summed
        over a sequence estimate, not the sequence-level KL(ref||pi). See "On a few pitfalls in
        KL divergence gradient estimation for RL" by Yunhao Tang and Rémi Munos (2025,
        https://arxiv.org/abs/2506.09477).

        Args:
          direction: ``"pi||ref"`` or ``"ref||pi"``.

        Returns:
          A scalar tensor, differentiable w.r.t. :meth:`parameters`.

        Example:
          >>> pi = TabularAutoregressive.random(3, 4, eos=2, seed=0)
          >>> bool(torch.isclose(pi.token_local_kl("pi||ref"), pi.exact_kl("pi||ref")))
          True
          >>> bool(torch.isclose(pi.token_local_kl("ref||pi"), pi.exact_kl("ref||pi")))
          False
        """
        check_direction(direction)
        fn = _identity if direction == "pi||ref" else _r_log_r
        return self._expect_token_sum(self.logits, self.logits_ref, fn, frozen_prefix=True)

    def token_local(self) -> TokenLocalKL:
        """This testbed with :meth:`token_local_kl` as its exact answers (same samples).

        Example:
          >>> pi = TabularAutoregressive.random(3, 4, eos=2, seed=0)
          >>> local = pi.token_local()
          >>> local.parameters()[0] is pi.logits
          True
        """
        return TokenLocalKL(self)

    @torch.no_grad()
    def future_kl(self, tokens: Tensor) -> Tensor:
        r"""The expected KL(pi||ref) still to come from each position's prefix, exactly.

        .. math::
            V_t(y_{<t}) = E_{y_{\ge t}\sim\pi(\cdot|y_{<t})}\Big[\sum_{u\ge t}
            \log\frac{\pi(y_u|y_{<u})}{ref(y_u|y_{<u})}\Big],

        by backward recursion over the table (:math:`V_t = \sum_v \pi(v|y_{<t})(\rho_v +
        V_{t+1}(y_{<t}v))`, no continuation after eos). The value function of the per-token
        reward :math:`-\rho_u`: it reads the tokens before ``t`` only, so it is an unbiased
        baseline of the cumulative score-function estimator's target at ``t``; ``V_0`` is
        :meth:`exact_kl`.

        Args:
          tokens: token ids ``[n, T]``.

        Returns:
          ``[n, T]``, detached; 0 after a sequence's eos.
        """
        v, horizon = self.vocab_size, self.horizon
        la, lb = torch.log_softmax(self.logits, -1), torch.log_softmax(self.logits_ref, -1)
        cont = torch.ones(v, dtype=la.dtype)
        if self.eos is not None:
            cont[self.eos] = 0.0
        if self.markov:  # states: the last token (v: the start)
            later = torch.zeros(v + 1, dtype=la.dtype)
            values = []
            for t in reversed(range(horizon)):
                now = (la[t].exp() * (la[t] - lb[t] + cont * later[:v])).sum(-1)
                values.insert(0, now)
                later = now
            table = torch.stack(values)  # [T, V + 1]
            rows = self._rows(tokens)
            steps = torch.arange(tokens.shape[1]).expand_as(rows)
            out = table[steps, rows]
        else:
            values = torch.zeros(la.shape[0], dtype=la.dtype)
            for t in reversed(range(horizon)):
                lo = self._offsets[t]
                rows = slice(lo, lo + v**t)
                later = torch.zeros(v**t, v, dtype=la.dtype)
                if t + 1 < horizon:
                    hi = self._offsets[t + 1]
                    later = values[hi : hi + v ** (t + 1)].reshape(v**t, v)
                values[rows] = (la[rows].exp() * (la[rows] - lb[rows] + cont * later)).sum(-1)
            out = values[self._rows(tokens)]
        valid = self._valid(tokens)
        return out if valid is None else torch.where(valid, out, torch.zeros_like(out))

    def expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        with torch.no_grad():
            return self._expect_token_sum(self.logits, self.logits_ref, fn)

    def sequence_log_probs(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every sequence with its log-probability under pi (with graph) and under ref.

        Returns ``(tokens [S, T], log pi(y) [S], log ref(y) [S])`` by enumeration.
        """
        tokens, _ = self.all_sequences()
        la, lb, _ = self._enumerated_token_logprobs(self.logits, self.logits_ref)
        return tokens, la.sum(-1), lb.sum(-1)

    def sequence_expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """Exact ``E_{y~pi}[fn(sum_t delta_t)]`` of a function of the *sequence* log-ratio.

        By enumeration (``markov=False`` or small ``V^T``): the mean of estimators applied with
        ``level="sequence"``.
        """
        with torch.no_grad():
            la, lb, _ = self._enumerated_token_logprobs(self.logits, self.logits_ref)
            return (la.sum(-1).exp() * fn((la - lb).sum(-1))).sum()


class TokenLocalKL(SampledTestbed):
    """A tabular testbed's policies and samples, with its token-local KLs as the exact answers.

    ``exact_kl`` (and so ``exact_kl_grad``) is
    :meth:`TabularAutoregressive.token_local_kl`; everything else is the wrapped testbed's.
    Auditing a gradient estimator against it (:func:`klest.audit_grad`) asks whether the
    estimator descends a token-local KL instead of a sequence-level one.

    Args:
      testbed: the tabular testbed (shared, not copied: same parameters, same samples).

    Example:
      >>> pi = TabularAutoregressive.random(3, 4, eos=2, seed=0)
      >>> local = TokenLocalKL(pi)
      >>> bool(local.exact_kl("ref||pi") == pi.token_local_kl("ref||pi"))
      True
    """

    name = "tabular-autoregressive, token-local"

    def __init__(self, testbed: TabularAutoregressive) -> None:
        if not isinstance(testbed, TabularAutoregressive):
            raise TypeError(
                f"testbed must be a TabularAutoregressive, got {type(testbed).__name__}"
            )
        self.testbed = testbed

    def parameters(self) -> list[Tensor]:
        return self.testbed.parameters()

    def draw(self, n: int, *, generator: torch.Generator) -> Tensor:
        return self.testbed.draw(n, generator=generator)

    def evaluate(self, x: Tensor) -> Sample:
        return self.testbed.evaluate(x)

    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        return self.testbed.token_local_kl(direction)

    def expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return self.testbed.expectation(fn)
