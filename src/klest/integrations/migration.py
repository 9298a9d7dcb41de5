r"""Every KL option of TRL, verl, OpenRLHF, NeMo-RL, slime and the Tinker cookbook, written as one
klest call.

Each option (:data:`OPTIONS`, a :class:`PeerOption`) is a :class:`KLCall`: a call of
:func:`klest.kl_penalty` or :func:`klest.kl_from_logits` that equals the framework's KL term, in
value and in gradient, on the same batch (a :class:`Batch`), with the framework's default
aggregation of per-token terms; beside it, the call whose gradient is that of the KL the option
is meant to penalize. :data:`AGGREGATIONS` names who uses each aggregation. What each option's
value estimates and what its gradient descends, measured against exact answers, is the
``migration`` experiment (:mod:`klest.experiments.migration`).

Sources (read for the formulas; versions: TRL 1.16, verl 0.9.1, OpenRLHF 0.11.2, and the
NVIDIA-NeMo/RL, THUDM/slime and thinking-machines-lab/tinker-cookbook repositories) are named
per option. Background: "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao
Tang and Rémi Munos (2025, https://arxiv.org/abs/2506.09477); "Approximating KL Divergence" by
John Schulman (2020, http://joschu.net/blog/kl-approx.html); "Better Estimation of the
Kullback-Leibler Divergence Between Language Models" by Afra Amini, Tim Vieira and Ryan
Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from klest.logits import kl_from_logits
from klest.sampled.penalty import KLGradientWarning, kl_penalty
from klest.sampled.token_weights import iw_opd_weights

__all__ = [
    "AGGREGATIONS",
    "DISTILL_FIX",
    "DISTILL_FIX_REF",
    "IW_OPD_WEIGHTS",
    "OPTIONS",
    "RL_FIX",
    "RL_FIX_K1",
    "Batch",
    "KLCall",
    "PeerOption",
    "WeightRule",
]


class Batch(NamedTuple):
    """What a trainer holds for one batch of sampled sequences, ``[B, T]`` each.

    Attributes:
      logp: log pi of the sampled tokens (with graph).
      logp_ref: log ref of the same tokens.
      mask: True where a token counts.
      group: prompt id of each sequence ``[B]`` (baselines are taken within a prompt).
      logits: pi's next-token logits ``[B, T, V]`` (exact-KL options).
      logits_ref: ref's.
      logp_old: log-probs of the policy that sampled the tokens, when it is not pi.
    """

    logp: Tensor
    logp_ref: Tensor
    mask: Tensor | None = None
    group: Tensor | None = None
    logits: Tensor | None = None
    logits_ref: Tensor | None = None
    logp_old: Tensor | None = None


_WEIGHT_FUNCTIONS: dict[str, Callable[..., Tensor]] = {"iw_opd_weights": iw_opd_weights}
"""The klest functions a :class:`WeightRule` may name, by their public names."""


@dataclass(frozen=True)
class WeightRule:
    """How a call's per-token ``weights=`` are computed from the batch: the public klest
    function ``function`` (``"iw_opd_weights"``) of the batch's log-probs and mask, with the
    scalar keyword ``options``.

    Example:
      >>> rule = WeightRule("iw_opd_weights", (("gain", 0.5),))
      >>> rule.text()
      'iw_opd_weights(logp, logp_ref, mask=mask, gain=0.5)'
    """

    function: str
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.function not in _WEIGHT_FUNCTIONS:
            raise ValueError(
                f"function must be one of {sorted(_WEIGHT_FUNCTIONS)}, got {self.function!r}"
            )

    def __call__(self, batch: Batch) -> Tensor:
        """The weights ``[B, T]`` of ``batch`` (detached)."""
        compute = _WEIGHT_FUNCTIONS[self.function]
        return compute(batch.logp, batch.logp_ref, mask=batch.mask, **dict(self.options))

    def text(self) -> str:
        """The call as a user writes it, on the names of :meth:`KLCall.text`."""
        options = "".join(f", {k}={v!r}" for k, v in self.options)
        return f"{self.function}(logp, logp_ref, mask=mask{options})"

    def key(self) -> str:
        """The rule and its options, without the tensors."""
        return f"{self.function}({', '.join(f'{k}={v!r}' for k, v in self.options)})"


@dataclass(frozen=True)
class KLCall:
    """One klest call on a :class:`Batch`: ``function`` (``"kl_penalty"`` or
    ``"kl_from_logits"``) with the keyword ``options`` other than tensors and the reduction,
    and, for ``kl_penalty``, the rule that computes its per-token ``weights=`` from the batch
    (a :class:`WeightRule`; None: no weights).

    Example:
      >>> call = KLCall("kl_penalty", (("estimator", "k3"), ("grad", "autodiff")))
      >>> print(call.text("token-mean"))  # verl's default KL loss
      kl_penalty(logp, logp_ref, mask=mask, estimator="k3", grad="autodiff",
      reduction="token-mean")
      >>> call.gradient_key()
      'k3/autodiff'
    """

    function: str
    options: tuple[tuple[str, Any], ...]
    weights: WeightRule | None = None

    def __post_init__(self) -> None:
        if self.weights is not None and self.function != "kl_penalty":
            raise ValueError(f"weights= is a kl_penalty option, not {self.function}'s")

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def direction(self) -> str:
        return self.kwargs.get("direction", "pi||ref")

    def __call__(self, batch: Batch, *, reduction: str = "seq-mean-token-sum") -> Tensor:
        """The call's loss on ``batch`` (warnings about biased gradients silenced: the table
        measures what they warn about)."""
        kw = self.kwargs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KLGradientWarning)
            if self.function == "kl_from_logits":
                return kl_from_logits(
                    batch.logits, batch.logits_ref, mask=batch.mask, reduction=reduction, **kw
                )
            uses_logits = "rb" in (kw["estimator"], kw["grad"])
            return kl_penalty(
                batch.logp,
                batch.logp_ref,
                mask=batch.mask,
                reduction=reduction,
                group=batch.group if "baseline" in kw else None,
                logp_behavior=batch.logp_old,
                logits=batch.logits if uses_logits else None,
                logits_ref=batch.logits_ref if uses_logits else None,
                weights=None if self.weights is None else self.weights(batch),
                **kw,
            )

    def text(self, reduction: str = "seq-mean-token-sum") -> str:
        """The call as a user writes it."""
        kw = self.kwargs
        args = ["logits, logits_ref" if self.function == "kl_from_logits" else "logp, logp_ref"]
        args.append("mask=mask")
        args += [f'{k}="{v}"' if isinstance(v, str) else f"{k}={v!r}" for k, v in kw.items()]
        if self.weights is not None:
            args.append(f"weights={self.weights.text()}")
        if "baseline" in kw:
            args.append("group=prompt_ids")
        if self.function == "kl_penalty" and "rb" in (kw["estimator"], kw["grad"]):
            args.append("logits=logits, logits_ref=logits_ref")
        if reduction != "seq-mean-token-sum":
            args.append(f'reduction="{reduction}"')
        return f"{self.function}({', '.join(args)})"

    def gradient_key(self) -> str:
        """Calls with the same key have the same gradient (the value estimator matters to the
        gradient only under autodiff)."""
        kw = self.kwargs
        if self.function == "kl_from_logits":
            return f"exact per-position KL({self.direction}), autodiff"
        name = f"{kw['estimator']}/{kw['grad']}" if kw["grad"] == "autodiff" else kw["grad"]
        if "baseline" in kw:
            name += f"+{kw['baseline']}"
        for option in ("discount", "power"):  # they change the gradient
            if option in kw:
                name += f";{option}={kw[option]:g}"
        if self.weights is not None:
            name += f";weights={self.weights.key()}"
        return name + ("" if self.direction == "pi||ref" else f", KL({self.direction})")

    def value_key(self) -> str:
        """Calls with the same key have the same value."""
        if self.function == "kl_from_logits":
            return f"exact per-position KL({self.direction})"
        est = self.kwargs["estimator"]
        if self.weights is not None:  # the weights weight the value's terms too
            est += f";weights={self.weights.key()}"
        return est if self.direction == "pi||ref" else f"{est}, KL({self.direction})"


def _penalty(
    estimator: str, grad: str, *, weights: WeightRule | None = None, **options: str | float
) -> KLCall:
    """A :func:`klest.kl_penalty` call."""
    items = (("estimator", estimator), ("grad", grad), *options.items())
    return KLCall("kl_penalty", items, weights)


def _exact(direction: str) -> KLCall:
    """A :func:`klest.kl_from_logits` call (exact per-position KLs, autodiff)."""
    return KLCall("kl_from_logits", (("direction", direction),))


@dataclass(frozen=True)
class PeerOption:
    """A framework's KL option and the klest call equal to it.

    Attributes:
      key: a short identifier.
      framework: the framework.
      option: the configuration that selects it (exact keys and values).
      source: where its formula is (file, function).
      call: the klest call with the same value and gradient.
      reduction: the framework's default aggregation of per-token terms, in klest's names.
      intended: the klest call whose gradient is that of the KL the option is meant to penalize.
      note: what the call leaves out (clamps, scale factors).
    """

    key: str
    framework: str
    option: str
    source: str
    call: KLCall
    reduction: str
    intended: KLCall
    note: str = ""


RL_FIX = _penalty("k3", "cumulative", baseline="loo")
"""The intended call of the RL options on k3 values (``estimator="k3", grad="cumulative",
baseline="loo"``): its gradient is that of the sequence-level KL(pi||ref)."""
RL_FIX_K1 = _penalty("k1", "cumulative", baseline="loo")
"""The same on k1 values (``estimator="k1", grad="cumulative", baseline="loo"``)."""
DISTILL_FIX = _penalty("rb", "rb")
"""The intended call of the distillation options on KL(pi||ref) (``estimator="rb",
grad="rb"``, from both models' logits)."""
DISTILL_FIX_REF = _penalty("rb", "rb", direction="ref||pi")
"""The same for KL(ref||pi) (``direction="ref||pi"``)."""
IW_OPD_WEIGHTS = WeightRule("iw_opd_weights", (("gain", 0.5),))
"""IW-OPD's token weights with TRL's default gain (``iw_opd_gamma=0.5``):
:func:`klest.iw_opd_weights`."""
_VERL_KL = "verl/trainer/ppo/core_algos.py (kl_penalty)"
_OPENRLHF_KL = "openrlhf/models/utils.py (compute_approx_kl)"
_SLIME_KL = "slime/utils/ppo_utils.py (compute_approx_kl)"
_CLAMP = "clamps k3 (|log-ratio| <= 20, value <= 10), inactive here"

OPTIONS: tuple[PeerOption, ...] = (
    PeerOption(
        "trl-grpo",
        "TRL",
        "GRPOTrainer: beta > 0, use_bias_correction_kl=True (default)",
        "trl/trainer/grpo_trainer.py (GRPOTrainer._compute_loss)",
        _penalty("k3", "token"),
        "token-mean",
        RL_FIX,
        "k3 times the ratio pi/pi_old, differentiable (1 on-policy); loss_type='dapo' (default)",
    ),
    PeerOption(
        "trl-grpo-no-correction",
        "TRL",
        "GRPOTrainer: beta > 0, use_bias_correction_kl=False",
        "trl/trainer/grpo_trainer.py (GRPOTrainer._compute_loss)",
        _penalty("k3", "autodiff"),
        "token-mean",
        RL_FIX,
    ),
    PeerOption(
        "trl-rloo",
        "TRL",
        "RLOOTrainer: beta=0.05 (default)",
        "trl/trainer/rloo_trainer.py (k1 summed per sequence, in the reward)",
        _penalty("k1", "score", baseline="loo"),
        "seq-mean-token-sum",
        RL_FIX_K1,
        "leave-one-out baseline over the prompt's completions; normalize_advantages=False",
    ),
    PeerOption(
        "trl-distill",
        "TRL",
        "DistillationTrainer: beta=1.0 (default); GKDTrainer: beta=1.0",
        "trl/trainer/distillation_trainer.py; trl/experimental/gkd/gkd_trainer.py",
        _exact("pi||ref"),
        "token-mean",
        DISTILL_FIX,
        "on the student's samples (GKD: lmbda=1); GKD divides logits by temperature=0.9",
    ),
    PeerOption(
        "trl-distill-beta0",
        "TRL",
        "DistillationTrainer / GKDTrainer: beta=0.0",
        "trl/trainer/distillation_trainer.py; trl/experimental/gkd/gkd_trainer.py",
        _exact("ref||pi"),
        "token-mean",
        DISTILL_FIX_REF,
        "0 < beta < 1 is a generalized Jensen-Shannon divergence, not a KL",
    ),
    PeerOption(
        "trl-iw-opd",
        "TRL",
        "experimental IWOPDTrainer: distillation_objective='iw_opd', iw_opd_gamma=0.5 (defaults)",
        "trl/experimental/iw_opd/iw_opd_trainer.py (IWOPDTrainer._compute_iw_opd_loss)",
        _penalty("k1", "token", weights=IW_OPD_WEIGHTS),
        "token-mean",
        RL_FIX_K1,
        "advantage w_t (log ref - log pi) per token, with IW-OPD's weights w_t = 1 + 0.5 (1 - "
        "the share of the sequence's summed abs(log-ratio) before t): they read the later tokens; "
        "the value is the weighted k1 (TRL logs its negative, iw_opd/mean_advantage); lmbda=1.0, "
        "temperature=1.0",
    ),
    PeerOption(
        "verl-low-var-kl",
        "verl",
        "actor_rollout_ref.actor.use_kl_loss=True, kl_loss_type=low_var_kl (default) or k3",
        f"{_VERL_KL}; verl/workers/utils/losses.py",
        _penalty("k3", "autodiff"),
        "token-mean",
        RL_FIX,
        _CLAMP,
    ),
    PeerOption(
        "verl-k1",
        "verl",
        "use_kl_loss=True, kl_loss_type=kl or k1",
        _VERL_KL,
        _penalty("k1", "autodiff"),
        "token-mean",
        RL_FIX_K1,
    ),
    PeerOption(
        "verl-k2",
        "verl",
        "use_kl_loss=True, kl_loss_type=mse or k2 (also mse+, k2+)",
        _VERL_KL,
        _penalty("k2", "autodiff"),
        "token-mean",
        RL_FIX,
    ),
    PeerOption(
        "verl-abs",
        "verl",
        "use_kl_loss=True, kl_loss_type=abs",
        _VERL_KL,
        _penalty("abs", "autodiff"),
        "token-mean",
        RL_FIX,
    ),
    PeerOption(
        "verl-k3-plus",
        "verl",
        "use_kl_loss=True, kl_loss_type=low_var_kl+ or k3+",
        _VERL_KL,
        _penalty("k3", "token"),
        "token-mean",
        RL_FIX,
        "value of k3, gradient of k2 (straight-through); " + _CLAMP,
    ),
    PeerOption(
        "verl-k1-plus",
        "verl",
        "use_kl_loss=True, kl_loss_type=kl+ or k1+",
        _VERL_KL,
        _penalty("k1", "token"),
        "token-mean",
        RL_FIX_K1,
        "value of k1, gradient of k2 (straight-through)",
    ),
    PeerOption(
        "verl-reward-rloo",
        "verl",
        "algorithm.use_kl_in_reward=True, kl_penalty=kl, adv_estimator=rloo",
        "verl/trainer/ppo/ray_trainer.py (apply_kl_penalty); core_algos.py (rloo advantage)",
        _penalty("k1", "score", baseline="loo"),
        "token-mean",
        RL_FIX_K1,
    ),
    PeerOption(
        "verl-reward-grpo",
        "verl",
        "use_kl_in_reward=True, kl_penalty=kl, adv_estimator=grpo, norm_adv_by_std_in_grpo=False",
        "verl/trainer/ppo/ray_trainer.py (apply_kl_penalty); core_algos.py (grpo advantage)",
        _penalty("k1", "score", baseline="mean"),
        "token-mean",
        RL_FIX_K1,
        "the group mean includes the sample: gradient x (1 - 1/n); with the std division "
        "(default) the KL's weight depends on the rewards",
    ),
    PeerOption(
        "openrlhf-k3",
        "OpenRLHF",
        "--algo.kl.use_loss --algo.kl.estimator k3",
        _OPENRLHF_KL,
        _penalty("k3", "autodiff"),
        "token-mean",
        RL_FIX,
        "clamps the log-ratio at -10 and k3 at 10, inactive here",
    ),
    PeerOption(
        "openrlhf-k1",
        "OpenRLHF",
        "--algo.kl.use_loss (--algo.kl.estimator k1, the default)",
        _OPENRLHF_KL,
        _penalty("k1", "autodiff"),
        "token-mean",
        RL_FIX_K1,
    ),
    PeerOption(
        "openrlhf-k2",
        "OpenRLHF",
        "--algo.kl.use_loss --algo.kl.estimator k2",
        _OPENRLHF_KL,
        _penalty("k2", "autodiff"),
        "token-mean",
        RL_FIX,
    ),
    PeerOption(
        "openrlhf-unbiased",
        "OpenRLHF",
        "--algo.kl.use_loss --algo.kl.unbiased_gradient (estimator k3)",
        _OPENRLHF_KL,
        _penalty("k3", "token"),
        "token-mean",
        RL_FIX,
        "on-policy; off-policy its weight is clipped and its value unweighted",
    ),
    PeerOption(
        "openrlhf-reward",
        "OpenRLHF",
        "KL in the reward (no --algo.kl.use_loss), --algo.advantage.estimator rloo, "
        "group_norm or dr_grpo",
        "openrlhf/trainer/ppo_utils/experience_maker.py; openrlhf/models/utils.py (compute_reward)",
        _penalty("k1", "cumulative"),
        "token-mean",
        RL_FIX_K1,
        "returns to go of -beta k1; the baselines apply to the outcome reward only",
    ),
    PeerOption(
        "nemo-rl",
        "NeMo-RL",
        "loss_fn.reference_policy_kl_penalty=0.01, reference_policy_kl_type=k3 (defaults)",
        "nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn); nemo_rl/algorithms/utils.py",
        _penalty("k3", "token"),
        "token-mean",
        RL_FIX,
        "k3 times exp(logp - sg(logp)); " + _CLAMP,
    ),
    PeerOption(
        "slime-k1",
        "slime",
        "--use-kl-loss (--kl-loss-type k1, the default)",
        f"{_SLIME_KL}; slime/backends/megatron_utils/loss.py",
        _penalty("k1", "autodiff"),
        "seq-mean-token-mean",
        RL_FIX_K1,
        "slime sums the per-sample token means: B times seq-mean-token-mean",
    ),
    PeerOption(
        "slime-k3",
        "slime",
        "--use-kl-loss --kl-loss-type low_var_kl or k3",
        f"{_SLIME_KL}; slime/backends/megatron_utils/loss.py",
        _penalty("k3", "autodiff"),
        "seq-mean-token-mean",
        RL_FIX,
    ),
    PeerOption(
        "slime-unbiased",
        "slime",
        "--use-kl-loss --use-unbiased-kl --kl-loss-type low_var_kl",
        f"{_SLIME_KL}; slime/backends/megatron_utils/loss.py",
        _penalty("k3", "token"),
        "seq-mean-token-mean",
        RL_FIX,
        "k3 times the ratio pi/pi_old, differentiable",
    ),
    PeerOption(
        "slime-reward-rpp",
        "slime",
        "--kl-coef > 0 --advantage-estimator reinforce_plus_plus (--kl-loss-type k1)",
        "slime/utils/ppo_utils.py (get_reinforce_plus_plus_returns)",
        _penalty("k1", "cumulative"),
        "seq-mean-token-mean",
        RL_FIX_K1,
        "returns to go of -beta k1 (gamma=1), unwhitened (--normalize-advantages off); with "
        "--advantage-estimator grpo (the default) the reward KL is computed but not used "
        "(get_grpo_returns)",
    ),
    PeerOption(
        "slime-reward-rpp-baseline",
        "slime",
        "--kl-coef > 0 --advantage-estimator reinforce_plus_plus_baseline (--kl-loss-type k1)",
        "slime/utils/ppo_utils.py (get_reinforce_plus_plus_baseline_advantages)",
        _penalty("k1", "token"),
        "seq-mean-token-mean",
        RL_FIX_K1,
        "each token's advantage has its own -beta k1 only",
    ),
    PeerOption(
        "tinker-distill",
        "Tinker cookbook",
        "on-policy distillation: kl_penalty_coef=1.0, kl_discount_factor=0.0 (defaults)",
        "tinker_cookbook/distillation/train_on_policy.py (incorporate_kl_penalty)",
        _penalty("k1", "token"),
        "sum",
        RL_FIX_K1,
        "advantage -beta k1 per token; the importance_sampling loss sums over tokens",
    ),
    PeerOption(
        "tinker-distill-discount1",
        "Tinker cookbook",
        "on-policy distillation: kl_discount_factor=1.0",
        "tinker_cookbook/distillation/train_on_policy.py (incorporate_kl_penalty)",
        _penalty("k1", "cumulative"),
        "sum",
        RL_FIX_K1,
        "the advantage is the sum of -beta k1 from the token on",
    ),
    PeerOption(
        "tinker-distill-discount",
        "Tinker cookbook",
        "on-policy distillation: kl_discount_factor=0.9",
        "tinker_cookbook/distillation/train_on_policy.py (incorporate_kl_penalty)",
        _penalty("k1", "cumulative", discount=0.9),
        "sum",
        RL_FIX_K1,
        "the advantage is the sum of -beta k1 from the token on, discounted by 0.9 per token "
        "(GAE-OPD's discounted return, arXiv 2606.22793, without its critic: no framework here "
        "ships GAE-OPD itself)",
    ),
    PeerOption(
        "power-opd",
        "PowerOPD (paper)",
        "per-token reward ((ref/pi)^alpha - 1)/alpha, alpha=0.5 (arXiv 2606.17199)",
        "PowerOPD, arXiv 2606.17199 (no framework here ships it)",
        _penalty("k1", "token", power=0.5),
        "token-mean",
        RL_FIX_K1,
        "the per-token advantage of on-policy distillation with the log-ratio replaced by its "
        "Box-Cox power transform, at most 1/alpha; the value is still k1; the aggregation is not "
        "the paper's (token-mean assumed)",
    ),
)
"""Every option in the table, in order."""

AGGREGATIONS: tuple[tuple[str, str], ...] = (
    ("seq-mean-token-sum", "TRL RLOOTrainer, loss_type='luspo'; verl 'seq-mean-token-sum'"),
    (
        "token-mean",
        "TRL loss_type='dapo' (default) and 'bnpo'; verl, OpenRLHF and NeMo-RL by default",
    ),
    (
        "seq-mean-token-mean",
        "TRL loss_type='grpo'; verl and OpenRLHF 'seq-mean-token-mean'; slime; NeMo-RL "
        "token_level_loss=False",
    ),
)
"""Aggregations of per-token terms, as ``(klest reduction, who uses it by default or by
option)`` (dr_grpo's sum over T_max is a constant factor of the sequence sum)."""
