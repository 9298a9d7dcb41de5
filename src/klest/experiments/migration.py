r"""The migration table: every KL option of TRL, verl, OpenRLHF, NeMo-RL, slime and the Tinker
cookbook written as one klest call, with what its value estimates and what its gradient descends,
measured against exact answers.

Each option (:data:`OPTIONS`) is a :class:`KLCall`: a call of :func:`klest.kl_penalty` or
:func:`klest.kl_from_logits` that equals the framework's KL term, in value and in gradient, on
the same batch (``tests/test_migration.py`` checks each against the framework's formula written
out by hand). The experiment then measures, on a tabular autoregressive policy with exact
answers (:class:`~klest.testbeds.TabularAutoregressive`, V = 3 tokens, T <= 4 with an
end-of-sequence token, so token-local and sequence-level gradients differ):

- the gradient (:func:`klest.audit_grad`, batches of 8 sequences from 2 prompts), its mean
  against the exact gradients of the sequence-level :math:`KL(\pi\|ref)` and
  :math:`KL(ref\|\pi)`, and of their token-local versions
  :math:`\sum_t E_{y_{<t}\sim \mathrm{sg}(\pi)} KL(\pi_t\|ref_t)` (or
  :math:`KL(ref_t\|\pi_t)`) whose prefix distribution carries no gradient
  (:meth:`~klest.testbeds.TabularAutoregressive.token_local_kl`);
- the value (:func:`klest.audit_value`), its mean against the exact KL.

Each option's per-token terms are summed per sequence for the measurement (the framework's
aggregation, a separate choice, is in the call and in a second table: on sequences of unequal
length a per-sequence token mean weights each sequence by 1/length).

Sources (read for the formulas; versions: TRL 1.16, verl 0.9.1, OpenRLHF 0.11.2, and the
NVIDIA-NeMo/RL, THUDM/slime and thinking-machines-lab/tinker-cookbook repositories) are named
per option. Background: "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao
Tang and Rémi Munos (2025, https://arxiv.org/abs/2506.09477); "Approximating KL Divergence" by
John Schulman (2020, http://joschu.net/blog/kl-approx.html); "Better Estimation of the
Kullback-Leibler Divergence Between Language Models" by Afra Amini, Tim Vieira and Ryan
Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.audit import GradAudit, ValueAudit, audit_grad, audit_value
from klest.experiments.runner import (
    FALSE_ALARM,
    Experiment,
    Report,
    RunConfig,
    pyplot,
    table_threshold,
)
from klest.logits import kl_from_logits
from klest.sampled.penalty import KLGradientWarning, kl_penalty
from klest.testbeds import Sample, TabularAutoregressive

VOCAB, HORIZON, EOS, SCALE = 3, 4, 2, 1.0
BATCH, PROMPTS = 8, 2
VALUE_BATCH = 256  # per-sequence values are independent draws: many per call
SEPARATION = 1 / 3


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


@dataclass(frozen=True)
class KLCall:
    """One klest call on a :class:`Batch`: ``function`` (``"kl_penalty"`` or
    ``"kl_from_logits"``) with the keyword ``options`` other than tensors and the reduction.

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
                **kw,
            )

    def text(self, reduction: str = "seq-mean-token-sum") -> str:
        """The call as a user writes it."""
        kw = self.kwargs
        args = ["logits, logits_ref" if self.function == "kl_from_logits" else "logp, logp_ref"]
        args.append("mask=mask")
        args += [f'{k}="{v}"' for k, v in kw.items()]
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
        return name + ("" if self.direction == "pi||ref" else f", KL({self.direction})")

    def value_key(self) -> str:
        """Calls with the same key have the same value."""
        if self.function == "kl_from_logits":
            return f"exact per-position KL({self.direction})"
        est = self.kwargs["estimator"]
        return est if self.direction == "pi||ref" else f"{est}, KL({self.direction})"


def _penalty(estimator: str, grad: str, **options: str) -> KLCall:
    """A :func:`klest.kl_penalty` call."""
    return KLCall("kl_penalty", (("estimator", estimator), ("grad", grad), *options.items()))


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
RL_FIX_K1 = _penalty("k1", "cumulative", baseline="loo")
DISTILL_FIX = _penalty("rb", "rb")
DISTILL_FIX_REF = _penalty("rb", "rb", direction="ref||pi")
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
)
"""Every option in the table, in order."""

# Aggregations of per-token terms (klest's reductions; dr_grpo's sum over T_max is a constant
# factor of the sequence sum), and who uses each by default or by option.
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


def _separated_testbed(start: int = 0) -> TabularAutoregressive:
    """The first random table from seed ``start`` on whose four exact gradients (sequence-level
    and token-local, both directions) differ pairwise by at least ``SEPARATION`` of the larger
    norm: where each verdict can tell the four apart."""
    for table_seed in itertools.count(start):
        tb = TabularAutoregressive.random(VOCAB, HORIZON, eos=EOS, scale=SCALE, seed=table_seed)
        grads = [_flat(tb.exact_kl_grad(d)) for d in ("pi||ref", "ref||pi")]
        grads += [_flat(tb.token_local().exact_kl_grad(d)) for d in ("pi||ref", "ref||pi")]
        gaps = [
            float((a - b).norm() / torch.maximum(a.norm(), b.norm()))
            for a, b in itertools.combinations(grads, 2)
        ]
        if min(gaps) >= SEPARATION:
            return tb
    raise AssertionError("unreachable")


def _flat(grads: list[Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def batch_of(sample: Sample) -> Batch:
    """A testbed sample as a trainer's batch: ``PROMPTS`` prompts of equal group size."""
    n = sample.logp.shape[0]
    group = torch.arange(n) * PROMPTS // n
    return Batch(sample.logp, sample.logp_ref, sample.mask, group, sample.logits, sample.logits_ref)


def _loss(call: KLCall, reduction: str = "seq-mean-token-sum") -> Callable[[Sample], Tensor]:
    def loss(sample: Sample) -> Tensor:
        return call(batch_of(sample), reduction=reduction)

    return loss


def _per_sequence(call: KLCall) -> Callable[[Sample], Tensor]:
    return _loss(call, "per-sequence")


def _z_for_kl(a: GradAudit, direction: str) -> float:
    """The audit's statistic for "the mean gradient is the exact gradient of KL(direction)"."""
    return a.z_target if a.direction == direction else a.z_other


def _gradient_verdict(seq: GradAudit, local: GradAudit, threshold: float) -> str:
    """Which KL the mean gradient descends, from the audit against the sequence-level KLs
    (``seq``) and against the token-local ones (``local``): a statistic above ``threshold``
    rejects its hypothesis."""
    ok = {
        (part, d): _z_for_kl(a, d) <= threshold
        for part, a in (("seq", seq), ("local", local))
        for d in ("pi||ref", "ref||pi")
    }
    if ok["seq", "pi||ref"] != ok["seq", "ref||pi"]:
        return "descends KL(pi‖ref)" if ok["seq", "pi||ref"] else "descends KL(ref‖pi)"
    if ok["seq", "pi||ref"]:
        return "indistinguishable here"
    if ok["local", "pi||ref"] != ok["local", "ref||pi"]:
        return f"descends KL({'pi‖ref' if ok['local', 'pi||ref'] else 'ref‖pi'}), token-local"
    if seq.z_zero <= threshold:
        return "zero in expectation"
    return "biased"


def _value_verdict(seq: ValueAudit, local: ValueAudit, threshold: float) -> str:
    """What the value estimates: the KL, the token-level KL(ref||pi), or neither, with the
    measured bias relative to the KL (± its standard error); ``|z|`` above ``threshold`` rejects."""
    arrow = seq.direction.replace("||", "‖")
    rel = f"{seq.bias / seq.exact:+.1%} ± {seq.se_bias / seq.exact:.1%}"
    if abs(seq.z) <= threshold:
        return f"KL({arrow}) (bias {rel})"
    if seq.direction == "ref||pi" and abs(local.z) <= threshold:
        return f"token-level KL(ref‖pi) ({rel} of KL(ref‖pi))"
    return f"biased ({rel} of KL({arrow}))"


def _measure(config: RunConfig, bar: Any) -> dict[str, Any]:
    testbed = _separated_testbed()
    local = testbed.token_local()
    # --quick: 600 batches keep the weakest rejection (score+mean against grad KL(pi||ref), z
    # about 9.6) 5 standard deviations above the verdict threshold; at 300 it was 2.7.
    trials = 600 if config.quick else 2000
    value_trials = 50 if config.quick else 500
    calls = [o.call for o in OPTIONS] + [o.intended for o in OPTIONS]
    grads = {c.gradient_key(): c for c in calls}
    values = {c.value_key(): c for c in calls}
    # One-sided tests of the gradients: 5 per gradient (the 2 sequence-level KLs, zero, the 2
    # token-local KLs) and 3 per aggregation; two-sided tests of the values, 2 per value. The
    # table's false-alarm rate, FALSE_ALARM, is Bonferroni-corrected over all of them.
    z_grad = table_threshold(5 * len(grads) + 3 * len(AGGREGATIONS), two_sided=False)
    z_value = table_threshold(2 * len(values))
    common = dict(batch_size=BATCH, n_trials=trials, seed=config.seed, z_threshold=z_grad)
    gradients: dict[str, dict[str, Any]] = {}
    for key, call in grads.items():
        seq = audit_grad(_loss(call), testbed, direction=call.direction, name=key, **common)
        tok = audit_grad(_loss(call), local, direction=call.direction, name=key, **common)
        gradients[key] = {
            "verdict": _gradient_verdict(seq, tok, z_grad),
            "sequence": _grad_summary(seq),
            "token_local": _grad_summary(tok),
        }
        bar.update(1)
    value_rows: dict[str, dict[str, Any]] = {}
    for key, call in values.items():
        vcommon = dict(
            direction=call.direction,
            batch_size=VALUE_BATCH,
            n_trials=value_trials,
            seed=config.seed,
            z_threshold=z_value,
            name=key,
        )
        seq_v = audit_value(_per_sequence(call), testbed, **vcommon)
        tok_v = audit_value(_per_sequence(call), local, **vcommon)
        value_rows[key] = {
            "verdict": _value_verdict(seq_v, tok_v, z_value),
            "sequence": seq_v.as_dict(),
            "token_local": tok_v.as_dict(),
        }
        bar.update(1)
    aggregations = {}
    for reduction, users in AGGREGATIONS:
        a = audit_grad(_loss(RL_FIX, reduction), testbed, name=reduction, **common)
        aggregations[reduction] = {"users": users, **_grad_summary(a)}
        bar.update(1)
    mean_length = float(testbed.expectation(torch.ones_like))
    return {
        "testbed": {
            "vocab": VOCAB,
            "horizon": HORIZON,
            "eos": EOS,
            "scale": SCALE,
            "exact_kl_pi_ref": float(testbed.exact_kl("pi||ref").detach()),
            "exact_kl_ref_pi": float(testbed.exact_kl("ref||pi").detach()),
            "token_level_kl_ref_pi": float(testbed.token_local_kl("ref||pi").detach()),
            "mean_length": mean_length,
        },
        "batch": BATCH,
        "value_batch": VALUE_BATCH,
        "prompts": PROMPTS,
        "gradient_trials": trials,
        "value_trials": value_trials,
        "z_gradient": z_grad,
        "z_value": z_value,
        "false_alarm": FALSE_ALARM,
        "gradients": gradients,
        "values": value_rows,
        "aggregations": aggregations,
    }


def _grad_summary(a: GradAudit) -> dict[str, Any]:
    keep = (
        "direction",
        "z_target",
        "z_other",
        "z_zero",
        "cos_pi_ref",
        "cos_ref_pi",
        "rel_bias",
        "rel_bias_debiased",
        "coef_pi_ref",
        "coef_pi_ref_se",
        "coef_ref_pi",
        "coef_ref_pi_se",
        "exact_norm",
        "variance",
        "verdict",
    )
    return {k: getattr(a, k) for k in keep}


def _row_z(g: dict[str, Any]) -> str:
    """The statistic behind the verdict: z against the gradient it descends (or against 0, or
    against both sequence-level KLs when it descends neither)."""
    verdict = g["verdict"]
    part = g["token_local"] if "token-local" in verdict else g["sequence"]
    z = {part["direction"]: part["z_target"], _other(part["direction"]): part["z_other"]}
    if "pi‖ref" in verdict:
        return f"{z['pi||ref']:.1f}"
    if "ref‖pi" in verdict:
        return f"{z['ref||pi']:.1f}"
    if verdict == "zero in expectation":
        return f"{g['sequence']['z_zero']:.1f} (vs 0)"
    return f"{z['pi||ref']:.0f} / {z['ref||pi']:.0f} (vs pi‖ref / ref‖pi)"


def _other(direction: str) -> str:
    return "ref||pi" if direction == "pi||ref" else "pi||ref"


def _measured(g: dict[str, Any]) -> str:
    """Verdict, z, cosines and relative error: the measured cells of a row."""
    s = g["sequence"]
    return (
        f"{g['verdict']} | {_row_z(g)} | {s['cos_pi_ref']:.2f} / {s['cos_ref_pi']:.2f} | "
        f"{s['rel_bias_debiased']:.2f}"
    )


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def _tables(m: dict[str, Any]) -> str:
    tb = m["testbed"]
    lines = [
        f"Tabular autoregressive policy: V = {tb['vocab']}, T <= {tb['horizon']} with an "
        f"end-of-sequence token (mean length {tb['mean_length']:.2f}); KL(pi‖ref) = "
        f"{tb['exact_kl_pi_ref']:.3f}, KL(ref‖pi) = {tb['exact_kl_ref_pi']:.3f}, token-level "
        f"KL(ref‖pi) = {tb['token_level_kl_ref_pi']:.3f}. Batches of {m['batch']} sequences "
        f"from {m['prompts']} prompts; {m['gradient_trials']} batches per gradient, "
        f"{m['value_trials']} batches of {m['value_batch']} per value; per-token terms summed "
        "per sequence. A verdict "
        f"rejects a hypothesis above z = {m['z_gradient']:.2f} (gradients) or "
        f"{m['z_value']:.2f} (values): a false-alarm rate of {m['false_alarm']:.1e} for the "
        "table. z: the statistic of the hypothesis the verdict accepts (about N(0, 1) when "
        "it holds). cos: of the mean gradient with the exact gradients of the sequence-level "
        "KL(pi‖ref) and KL(ref‖pi). rel. err: |mean gradient - exact gradient| / |exact "
        "gradient| for the KL the option names, Monte Carlo noise removed.",
        "",
        "| framework | option | value estimates | gradient descends (measured) | z | "
        "cos pi‖ref / ref‖pi | rel. err | klest call (same value and gradient) | klest call "
        "(intended gradient) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in OPTIONS:
        g = m["gradients"][o.call.gradient_key()]
        v = m["values"][o.call.value_key()]["verdict"]
        lines.append(
            f"| {o.framework} | {_esc(o.option)} | {v} | {_measured(g)} | "
            f"`{_esc(o.call.text(o.reduction))}` | `{_esc(o.intended.text())}` |"
        )
    lines += [
        "",
        "The intended calls, measured the same way (variance: the trace of the covariance of "
        "one batch's gradient):",
        "",
        "| klest call | value estimates | gradient descends (measured) | z | "
        "cos pi‖ref / ref‖pi | rel. err | variance |",
        "|---|---|---|---|---|---|---|",
    ]
    for call in dict.fromkeys(o.intended for o in OPTIONS):
        g = m["gradients"][call.gradient_key()]
        v = m["values"][call.value_key()]["verdict"]
        lines.append(
            f"| `{_esc(call.text())}` | {v} | {_measured(g)} | {g['sequence']['variance']:.3f} |"
        )
    lines += [
        "",
        f"Aggregations of the intended gradient (`{_esc(RL_FIX.text())}` with "
        f"`reduction=`): coefficients of a regression of the mean gradient on the exact "
        f"gradients of KL(pi‖ref) and KL(ref‖pi) (1/mean length = "
        f"{1 / tb['mean_length']:.3f}):",
        "",
        "| reduction | used by | coef on ∇KL(pi‖ref) | coef on ∇KL(ref‖pi) | cos pi‖ref |",
        "|---|---|---|---|---|",
    ]
    for reduction, a in m["aggregations"].items():
        lines.append(
            f"| `{reduction}` | {_esc(a['users'])} | {a['coef_pi_ref']:.3f} ± "
            f"{a['coef_pi_ref_se']:.3f} | {a['coef_ref_pi']:+.3f} ± {a['coef_ref_pi_se']:.3f} | "
            f"{a['cos_pi_ref']:.3f} |"
        )
    lines += ["", "Notes:", ""]
    lines += [f"- {o.framework}, {_esc(o.option)}: {o.note}." for o in OPTIONS if o.note]
    return "\n".join(lines) + "\n"


def _figure(m: dict[str, Any]) -> Any:
    plt = pyplot()
    keys = list(m["gradients"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.32 * len(keys) + 1.5), sharey=True)
    y = torch.arange(len(keys)).tolist()
    for ax, part, title in (
        (axes[0], "sequence", "sequence-level KLs"),
        (axes[1], "token_local", "token-local KLs"),
    ):
        kind = "" if part == "sequence" else "token-local "
        for offset, (coef, label) in enumerate((("pi_ref", "pi‖ref"), ("ref_pi", "ref‖pi"))):
            xs = [m["gradients"][k][part][f"coef_{coef}"] or 0.0 for k in keys]
            es = [m["gradients"][k][part][f"coef_{coef}_se"] or 0.0 for k in keys]
            ax.errorbar(
                xs,
                [v + 0.2 * offset - 0.1 for v in y],
                xerr=[2 * e for e in es],
                fmt="o",
                ms=4,
                label=f"coef on ∇ {kind}KL({label})",
            )
        ax.axvline(0, color="k", lw=0.5)
        ax.axvline(1, color="k", lw=0.5, ls="--")
        ax.set(title=f"mean gradient regressed on the {title}", xlabel="coefficient (± 2 se)")
        ax.legend(fontsize=8)
    axes[0].set_yticks(y, keys, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    return fig


def run(config: RunConfig) -> Report:
    torch.set_num_threads(1)  # thousands of tiny ops: threads only add overhead
    n_grads = len({c.gradient_key() for o in OPTIONS for c in (o.call, o.intended)})
    n_values = len({c.value_key() for o in OPTIONS for c in (o.call, o.intended)})
    total = n_grads + n_values + len(AGGREGATIONS)
    with progress_bar(total=total, desc="migration", enabled=config.progress) as bar:
        m = _measure(config, bar)
    rows = [
        {
            "key": o.key,
            "framework": o.framework,
            "option": o.option,
            "source": o.source,
            "call": o.call.text(o.reduction),
            "intended": o.intended.text(),
            "note": o.note,
            "value": m["values"][o.call.value_key()]["verdict"],
            "gradient": m["gradients"][o.call.gradient_key()]["verdict"],
            "gradient_key": o.call.gradient_key(),
            "intended_gradient_key": o.intended.gradient_key(),
            "value_key": o.call.value_key(),
        }
        for o in OPTIONS
    ]
    results = {"experiment": "migration", "quick": config.quick, "seed": config.seed}
    results |= {"rows": rows, **m}
    wrong = sorted({r["framework"] for r in rows if r["gradient"] != "descends KL(pi‖ref)"})
    summary = (
        f"{sum(r['gradient'] != 'descends KL(pi‖ref)' for r in rows)} of {len(rows)} options "
        f"do not descend the sequence-level KL(pi||ref) (frameworks: {', '.join(wrong)}); "
        "every intended call does."
        if all(
            m["gradients"][o.intended.gradient_key()]["verdict"].startswith("descends KL")
            and "token-local" not in m["gradients"][o.intended.gradient_key()]["verdict"]
            for o in OPTIONS
        )
        else "Some intended call does not descend its KL: see the table."
    )
    return Report(results, _tables(m), {"gradient_coefficients": _figure(m)}, summary)


EXPERIMENT = Experiment(
    name="migration",
    description="every KL option of TRL, verl, OpenRLHF, NeMo-RL, slime, Tinker: what it "
    "estimates and descends, measured",
    run=run,
)

__all__ = ["EXPERIMENT", "OPTIONS", "Batch", "KLCall", "PeerOption", "batch_of"]
