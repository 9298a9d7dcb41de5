r"""A causal language model small enough to enumerate: exact sequence KLs and their gradients.

pi (the policy, trainable) and ref (fixed) are causal LMs (any model whose output has
``.logits``, e.g. ``transformers``' ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` built from a
config) over a vocabulary of V tokens, one of them the end token ``eos``. After a fixed prompt, a
completion :math:`y = (y_1, \dots, y_L)` has :math:`L \le H` tokens and ends at the first
``eos`` (or at the horizon H). The sequence KL is

.. math::
    KL(\pi\|ref) = \sum_{y} \pi(y) \log\frac{\pi(y)}{ref(y)}, \qquad
    \pi(y) = \prod_{t} \pi(y_t \mid \mathrm{prompt}, y_{<t}),

a finite sum over every completion of length at most H, and KL(ref||pi) the same with the roles
swapped. The gradient with respect to the policy's parameters is autodiff through that sum.

With a prompt, a horizon and an end token, an LM *is* a tabular autoregressive policy: its table
holds the LM's next-token logits after every prefix of fewer than H tokens. So
:class:`LanguageModelTestbed` is a :class:`~klest.testbeds.TabularAutoregressive` whose tables
are computed from the two models, by batched forward passes over every sequence of H - 1 tokens
(each pass gives the next-token logits after all of its prefixes). Its exact answers (KLs in both
directions, token-local KLs, exact expectations) are the tabular ones on those tables, with the
graph to the model's parameters. Samples are ancestral, token by token from the policy's
next-token distributions, stopping at ``eos``; they are scored by running both models on them,
as a trainer does. Used to audit KL gradient estimators on a real transformer ("On a few
pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi Munos, 2025,
https://arxiv.org/abs/2506.09477).

Needs nothing beyond torch; building the small models needs ``transformers`` (the ``klest[hf]``
extra): :meth:`LanguageModelTestbed.tiny`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from klest._checks import check_direction, check_positive_int
from klest.testbeds._tiny_lm import tiny_causal_lm
from klest.testbeds.autoregressive import MAX_ENUMERATED, TabularAutoregressive
from klest.testbeds.base import Sample

__all__ = ["LanguageModelTestbed"]


def _logits_of(model: Any, input_ids: Tensor, what: str) -> Tensor:
    out = model(input_ids=input_ids)
    logits = getattr(out, "logits", None)
    if not isinstance(logits, Tensor):
        raise TypeError(
            f"{what} must be a causal LM whose output has a .logits tensor [B, L, V], got an "
            f"output of type {type(out).__name__}"
        )
    return logits


class LanguageModelTestbed(TabularAutoregressive):
    r"""A policy LM against a reference LM, every completion of at most ``horizon`` tokens.

    .. math::
        KL(\pi\|ref) = E_{y\sim\pi}\Big[\sum_t \log\pi(y_t|x, y_{<t}) - \log ref(y_t|x, y_{<t})\Big]

    exactly, by enumerating the :math:`V^{H-1}` sequences of ``horizon - 1`` tokens after the
    prompt x in batched forward passes (see the module docstring); its gradient w.r.t. the
    policy's parameters by autodiff through them. Samples come from pi, ancestrally, and stop at
    ``eos`` (the positions after it are filled with ``eos`` and masked out).

    Both models are put in evaluation mode (no dropout: the exact answers assume deterministic
    models); the policy's parameters keep their gradients. The tables used for sampling and for
    values without gradient are cached while no parameter changes (a change of any parameter,
    e.g. an optimizer step, recomputes them).

    Args:
      policy: pi, a causal LM (``model(input_ids=ids).logits`` is ``[B, L, V]``).
      reference: ref, a causal LM with the same vocabulary.
      prompt: the token ids every completion follows (at least one).
      horizon: H, the longest completion.
      eos: the end token's id.
      chunk_size: sequences per forward pass when building the tables.

    Shapes: samples are ``[n, H]`` token ids; :attr:`Sample.logp` / ``logp_ref`` are ``[n, H]``
    per-token log-probabilities and ``logits`` / ``logits_ref`` the full next-token
    log-probabilities ``[n, H, V]`` (pi's with the graph to the policy's parameters).

    Example:
      >>> tb = LanguageModelTestbed.tiny(vocab_size=4, horizon=3, eos=1, seed=0)
      >>> s = tb.sample(8, generator=klest.testbeds.make_generator(0))
      >>> s.logp.shape, s.logits.shape
      (torch.Size([8, 3]), torch.Size([8, 3, 4]))
      >>> _, log_pi, _ = tb.sequence_log_probs()  # every completion, by enumeration
      >>> round(float(log_pi.exp().sum()), 12)
      1.0
      >>> grads = tb.exact_kl_grad("pi||ref")  # one tensor per parameter of the policy
    """

    name = "language-model"

    def __init__(
        self,
        policy: Any,
        reference: Any,
        *,
        prompt: Sequence[int] | Tensor,
        horizon: int,
        eos: int,
        chunk_size: int = 4096,
    ) -> None:
        check_positive_int("horizon", horizon, allow_none=False)
        check_positive_int("chunk_size", chunk_size, allow_none=False)
        if not callable(policy) or not callable(reference):
            raise TypeError(
                "policy and reference must be causal LMs (callables returning .logits), got "
                f"{type(policy).__name__} and {type(reference).__name__}"
            )
        params = [p for p in getattr(policy, "parameters", list)() if p.requires_grad]
        if not params:
            raise ValueError("policy has no parameter that requires grad: nothing to differentiate")
        first = params[0]
        ids = torch.as_tensor(prompt, dtype=torch.long, device=first.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError(
                "prompt must hold at least one token: the first completion token is predicted "
                "from the logits after the prompt's last token"
            )
        policy.eval()
        reference.eval()
        probe = torch.zeros(1, 1, dtype=torch.long, device=first.device)  # token 0 always exists
        with torch.no_grad():
            v = _logits_of(policy, probe, "policy").shape[-1]
            v_ref = _logits_of(reference, probe, "reference").shape[-1]
        if v != v_ref:
            raise ValueError(
                f"policy has a vocabulary of {v} tokens but reference has {v_ref}: the KL needs "
                "one vocabulary"
            )
        if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < v:
            raise ValueError(f"eos must be a token id in [0, {v}), got {eos}")
        if v**horizon > MAX_ENUMERATED:
            raise ValueError(
                f"V={v}, horizon={horizon}: {v**horizon} sequences is too many to enumerate "
                f"(limit {MAX_ENUMERATED}); use a smaller vocabulary or horizon"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"prompt must hold token ids in [0, {v}), got {ids.tolist()}")
        self.policy = policy
        self.reference = reference
        self.prompt = ids
        self.vocab_size = v
        self.horizon = horizon
        self.eos = eos
        self.markov = False
        self.chunk_size = chunk_size
        self._offsets = [sum(v**s for s in range(t)) for t in range(horizon)]
        self._params = params
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}
        self._grad_cache: dict[str, tuple[Tensor, list[Tensor]]] = {}

    @classmethod
    def tiny(
        cls,
        *,
        vocab_size: int = 5,
        horizon: int = 4,
        eos: int = 1,
        hidden_size: int = 16,
        num_layers: int = 2,
        num_heads: int = 2,
        scale: float = 1.0,
        mix: float = 1.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ) -> LanguageModelTestbed:
        r"""Two small Llama models built from a config (nothing downloaded), prompt ``[0]``.

        ref is a random initialization (seed ``seed``), pi is ref's weights moved a fraction
        ``mix`` of the way to a second random initialization (seed ``seed + 1``):
        :math:`\theta_\pi = \theta_{ref} + \mathrm{mix}\,(\theta_2 - \theta_{ref})` (0: pi = ref,
        1: independent). Every weight matrix of both is multiplied by ``scale`` (larger: more
        peaked next-token distributions that depend more on the prefix, so larger KLs).

        Args:
          vocab_size: V, with the end token among them.
          horizon: H.
          eos: the end token's id.
          hidden_size: the models' width.
          num_layers: decoder layers.
          num_heads: attention heads.
          scale: factor on every weight matrix (not on the norms).
          mix: how far pi is from ref, in [0, 1].
          seed: the initializations' seed.
          dtype: the models' dtype. In float64 the answers are exact to about 1e-7 relative:
            Llama's norms and rotary embeddings round through float32 (a float64 GPT-2 passed
            to the constructor is exact to float64 rounding).

        Example:
          >>> tb = LanguageModelTestbed.tiny(vocab_size=4, horizon=3, mix=0.0)
          >>> float(tb.exact_kl("pi||ref"))  # pi = ref
          0.0
        """
        kwargs = dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            max_positions=max(16, horizon + 1),
            pad_token_id=None,
            eos_token_id=eos,
        )
        reference = tiny_causal_lm(**kwargs, seed=seed).to(dtype)
        other = tiny_causal_lm(**kwargs, seed=seed + 1).to(dtype)
        policy = tiny_causal_lm(**kwargs, seed=seed).to(dtype)
        with torch.no_grad():
            for p, p_ref, p_other in zip(
                policy.parameters(), reference.parameters(), other.parameters(), strict=True
            ):
                p.copy_(p_ref + mix * (p_other - p_ref))
                if p.dim() >= 2:
                    p.mul_(scale)
                    p_ref.mul_(scale)
        reference.requires_grad_(False)
        return cls(policy, reference, prompt=[0], horizon=horizon, eos=eos)

    @classmethod
    def random(cls, *args: Any, **kwargs: Any) -> LanguageModelTestbed:
        """Not for language models: random tables are :meth:`TabularAutoregressive.random`'s;
        random small language models are :meth:`tiny`'s."""
        raise TypeError("LanguageModelTestbed.random does not exist: use LanguageModelTestbed.tiny")

    def parameters(self) -> list[Tensor]:
        return self._params

    # -- the tables: the LMs' next-token logits after every prefix -------------------------
    @staticmethod
    def _key(model: Any) -> Tensor:
        """The model's parameters, flattened: the tables are recomputed when any changes (by
        an optimizer step, through ``.data``, or replaced)."""
        with torch.no_grad():
            return torch.cat([p.reshape(-1).double() for p in model.parameters()])

    @staticmethod
    def _same(a: Tensor, b: Tensor) -> bool:
        return a.shape == b.shape and bool(torch.equal(a, b))

    def _table(self, model: Any, what: str) -> Tensor:
        """``[sum_{t<H} V^t, V]``: row ``offset[t] + code(prefix)`` is the logits after it."""
        v, h = self.vocab_size, self.horizon
        width = h - 1
        count = v**width
        # Every sequence of H - 1 tokens, in base-V order (the first token most significant).
        codes = torch.arange(count, device=self.prompt.device)
        digits = v ** torch.arange(width - 1, -1, -1, device=self.prompt.device)
        seqs = (codes[:, None] // digits) % v if width else codes[:, None][:, :0]
        ids = torch.cat([self.prompt.expand(count, -1), seqs], dim=1)
        p = self.prompt.numel()
        logits = torch.cat(
            [_logits_of(model, chunk, what)[:, p - 1 :] for chunk in ids.split(self.chunk_size)]
        )  # [count, H, V]: position t holds the logits after the first t tokens of each row
        rows = []
        for t in range(h):
            # The prefixes of length t are the rows whose last H - 1 - t digits are 0.
            rows.append(logits[:: v ** (width - t), t])
        return torch.cat(rows)

    def _cached_table(self, model: Any, what: str) -> Tensor:
        key = self._key(model)
        hit = self._cache.get(what)
        if hit is None or not self._same(hit[0], key):
            with torch.no_grad():
                hit = (key, self._table(model, what))
            self._cache[what] = hit
        return hit[1]

    @property
    def logits(self) -> Tensor:
        """pi's table of next-token logits after every prefix: with the graph to
        :meth:`parameters` when gradients are enabled, else cached."""
        if torch.is_grad_enabled():
            return self._table(self.policy, "policy")
        return self._cached_table(self.policy, "policy")

    @property
    def logits_ref(self) -> Tensor:
        """ref's table (cached, no graph)."""
        return self._cached_table(self.reference, "reference")

    # -- scoring samples ----------------------------------------------------------------------
    def evaluate(self, tokens: Tensor) -> Sample:
        """Score completions ``tokens`` ``[n, H]``: pi by running the policy on them (with the
        graph to :meth:`parameters`), ref by reading its table (the reference's outputs after
        every prefix, computed once: ref is fixed)."""
        if tokens.dim() != 2 or tokens.shape[1] != self.horizon:
            raise ValueError(
                f"tokens must be [n, horizon={self.horizon}], got shape {tuple(tokens.shape)}"
            )
        n = tokens.shape[0]
        ids = torch.cat([self.prompt.expand(n, -1), tokens[:, :-1]], dim=1)
        logits = _logits_of(self.policy, ids, "policy")[:, self.prompt.numel() - 1 :]
        log_pi = torch.log_softmax(logits, dim=-1)
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

    def exact_kl_grad(self, direction: str = "pi||ref") -> list[Tensor]:
        """The exact gradient of the KL w.r.t. :meth:`parameters`; cached while they are
        unchanged (an audit asks for it once per estimator)."""
        check_direction(direction)
        key = torch.cat([self._key(self.policy), self._key(self.reference)])
        hit = self._grad_cache.get(direction)
        if hit is None or not self._same(hit[0], key):
            hit = (key, super().exact_kl_grad(direction))
            self._grad_cache[direction] = hit
        return [g.clone() for g in hit[1]]
