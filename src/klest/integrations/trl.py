"""klest's KL term inside TRL's trainers: change the import, name the KL you want.

TRL's ``GRPOTrainer`` adds ``beta * k3`` per token to its loss and differentiates it. With
``use_bias_correction_kl=True`` (its default) k3 is multiplied by the ratio pi/pi_old, and the
mean gradient is that of the *token-local* KL(pi||ref): each token's own KL with its prefix
held fixed, missing each token's effect on the later ones, so biased for the sequence KL. With
``use_bias_correction_kl=False`` it is the token-local gradient of KL(ref||pi), the other KL
(Tang and Munos, "On a few pitfalls in KL divergence gradient estimation for RL", 2025,
https://arxiv.org/abs/2506.09477). The trainers here are TRL's, with that one term replaced by
:func:`klest.kl_penalty` (value and gradient estimators chosen apart, a leave-one-out baseline
over the samples of each prompt)::

    from klest.integrations.trl import GRPOTrainer, KLTerm   # was: from trl import GRPOTrainer

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(beta=0.001, ...),
                          kl=KLTerm(estimator="k3", grad="cumulative", baseline="loo"))

- :class:`GRPOTrainer` and :class:`RLOOTrainer`: TRL's policy loss, unchanged, plus
  ``beta * kl_penalty(...)``. RLOO's own KL sits in the reward (k1 summed per sequence, an
  unbiased but noisy score-function gradient); here it moves into the loss.
- :class:`DistillationTrainer`: the exact per-position KL (or TRL's generalized JSD for
  ``0 < beta < 1``) between student and teacher from their hidden states
  (:func:`klest.jsd_from_hidden`, no ``[B, T, V]`` tensor), and with
  ``sequence_level=True`` the gradient of the sequence-level KL(student||teacher), which the
  per-token loss misses (each token's effect on the later positions' distributions).

These override TRL's loss internals (``_compute_loss``, and for RLOO the scoring step), which
TRL does not expose as an extension point: the supported TRL versions are the tested ones,
``trl>=1.16,<1.17`` (the ``klest[trl]`` extra).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

try:
    import trl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "klest.integrations.trl needs TRL: pip install 'klest[trl]' (trl>=1.16,<1.17)"
    ) from e

from klest._checks import check_choice, check_direction, warn_at_caller
from klest._types import Baseline, Direction, Estimator, Grad, Reduction
from klest.aggregation import WithDetails
from klest.integrations.hf import group_ids_from_prompts
from klest.logits import jsd_from_hidden
from klest.nn import in_forward_of
from klest.sampled.penalty import (
    EXACT_KL_BASELINES,
    GRADIENT_ESTIMATORS,
    KLGradientWarning,
    PenaltyDetails,
    kl_penalty,
)

__all__ = ["DistillationTrainer", "GRPOTrainer", "KLTerm", "RLOOTrainer"]

SUPPORTED_TRL = (1, 16)


def _check_trl_version() -> None:
    major_minor = tuple(int(p) for p in trl.__version__.split(".")[:2])
    if major_minor != SUPPORTED_TRL:
        raise ImportError(
            f"klest.integrations.trl supports TRL {SUPPORTED_TRL[0]}.{SUPPORTED_TRL[1]}.x (it "
            f"overrides the trainers' loss internals); found trl {trl.__version__}"
        )


_SAMPLING_NEUTRAL = {
    "top_p": (1.0, None),
    "top_k": (0, None),
    "min_p": (None, 0.0),
    "repetition_penalty": (1.0, None),
}
"""TRL's sampling options, and their values that leave generation at
``softmax(logits / temperature)``."""

_SAMPLING_KWARGS = ("typical_p", "epsilon_cutoff", "eta_cutoff", "num_beams")
"""``generation_kwargs`` that also change which distribution the completions come from."""


def _sampling_changes(args: Any) -> list[str]:
    """The options under which TRL samples completions from something other than
    ``softmax(logits / temperature)``, the distribution its log-probs are computed under."""
    changed = [
        f"{name}={getattr(args, name)!r}"
        for name, neutral in _SAMPLING_NEUTRAL.items()
        if getattr(args, name, None) not in neutral
    ]
    extra = getattr(args, "generation_kwargs", None) or {}
    changed += [
        f"generation_kwargs[{k!r}]={v!r}"
        for k, v in extra.items()
        if k in _SAMPLING_KWARGS or v not in _SAMPLING_NEUTRAL.get(k, (v,))
    ]
    return changed


_EXACT_KL_BASELINE_REFUSED = (
    "baseline={baseline!r} (vOPD's exact-KL baseline) needs the reference's logits at every "
    "position; {trainer} has only the reference's log-probs of the sampled tokens. The "
    "DistillationTrainer has both models' hidden states, and its loss already takes the exact "
    "per-position KL's gradient, which is the conditional expectation of vOPD's estimator "
    "(lower variance); for the sequence-level term use DistillationTrainer(sequence_level=True,"
    " baseline='loo')"
)
"""Why the exact-KL baselines are refused here (see the integration's docs)."""


@dataclass(frozen=True)
class KLTerm:
    r"""The KL term a trainer adds to its loss: ``beta * kl_penalty(logp, logp_ref, ...)``.

    .. math::
        \text{loss} = \text{TRL's policy loss} + \beta\,\Big(\mathrm{sg}(\widehat{KL}_{estimator})
        + S_{grad} - \mathrm{sg}(S_{grad})\Big), \qquad
        E[\nabla S_{grad}] = \nabla KL(\pi\|ref)

    over the completions y ~ pi the trainer sampled (``logp_behavior`` = the sampling policy's
    log-probs when TRL reuses a generation batch for several updates).

    Attributes:
      estimator: the value (logged as ``kl``): ``"k1"``, ``"k2"``, ``"k3"`` (TRL's), ``"abs"``.
      grad: the gradient estimator: ``"cumulative"`` (default: the sequence KL's score
        function with rewards-to-go), ``"score"``, ``"token"`` (the token-local gradient: TRL's
        own with ``use_bias_correction_kl=True``) or ``"autodiff"`` (autodiff of ``estimator``:
        TRL's own with ``"k3"`` and ``use_bias_correction_kl=False``); the last two are kept
        for comparison and warn.
      baseline: ``"loo"`` (default: over the samples of the same prompt in the micro-batch),
        ``"mean"`` or None. The exact-KL baselines (``"exact-kl"``, vOPD's) are refused with
        the reason: TRL's GRPO and RLOO losses hold the reference's log-probs of the sampled
        tokens only, not its logits.
      direction: ``"pi||ref"`` (the RLHF penalty) or ``"ref||pi"``.
      reduction: how the per-token terms become the loss, by :func:`klest.aggregate`'s rule.
        The default ``"seq-mean-token-sum"`` is the sequence KL, so ``beta`` weighs nats per
        completion; TRL's ``loss_type="grpo"`` weighs its k3 per token of each completion
        (``"seq-mean-token-mean"``): to keep the same strength, divide ``beta`` by a typical
        completion length, or pass ``reduction="seq-mean-token-mean"`` (not the gradient of a
        KL).

    See "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi
    Munos (2025, https://arxiv.org/abs/2506.09477).
    """

    estimator: Estimator = "k3"
    grad: Grad = "cumulative"
    baseline: Baseline | None = "loo"
    direction: Direction = "pi||ref"
    reduction: Reduction = "seq-mean-token-sum"

    def __post_init__(self) -> None:
        check_choice("estimator", self.estimator, ("k1", "k2", "k3", "abs"))
        check_choice("grad", self.grad, ("cumulative", "score", "token", "autodiff"))
        if self.baseline is not None:
            if self.baseline in EXACT_KL_BASELINES:
                raise ValueError(
                    _EXACT_KL_BASELINE_REFUSED.format(
                        baseline=self.baseline, trainer="TRL's GRPO / RLOO loss"
                    )
                )
            check_choice("baseline", self.baseline, ("loo", "mean"))
            if self.grad not in ("cumulative", "score"):
                raise ValueError(
                    f"baseline applies to grad 'cumulative' or 'score', not {self.grad!r}"
                )
        check_direction(self.direction)
        check_choice("reduction", self.reduction, Reduction)
        if self.reduction == "none" or self.reduction == "per-sequence":
            raise ValueError(
                f"a trainer's loss is a scalar: reduction {self.reduction!r} is not one"
            )
        assert self.grad in GRADIENT_ESTIMATORS

    def __call__(
        self,
        logp: Tensor,
        logp_ref: Tensor,
        *,
        mask: Tensor,
        group: Tensor,
        logp_behavior: Tensor | None,
    ) -> WithDetails[PenaltyDetails]:
        """The term for one micro-batch (``[B, T]`` log-probs of the completion tokens)."""
        return kl_penalty(
            logp,
            logp_ref,
            mask=mask,
            estimator=self.estimator,
            grad=self.grad,
            baseline=self.baseline,
            group=group if self.baseline is not None else None,
            direction=self.direction,
            reduction=self.reduction,
            logp_behavior=logp_behavior,
            return_details=True,
        )


class _KLTermInLoss:
    """TRL's policy loss with TRL's KL off, plus :class:`KLTerm` on the same log-probs.

    The policy's per-token log-probs (with graph) are captured from TRL's own forward pass
    (``_get_per_token_logps_and_entropies``), so nothing is computed twice.
    """

    # The trainer's gradient-accumulation scaling of its policy loss: GRPO divides by the number
    # of accumulation steps itself; RLOO leaves it to transformers' Trainer.
    _scales_for_accumulation: bool = True

    def _init_kl_term(self, kl: KLTerm | None) -> None:
        _check_trl_version()
        if kl is not None and not isinstance(kl, KLTerm):
            raise TypeError(f"kl must be a klest.integrations.trl.KLTerm, not {type(kl).__name__}")
        self.kl_term = kl if kl is not None else KLTerm()
        self._captured_logps: list[Tensor] | None = None
        if self.beta == 0.0:
            return
        if self.ref_model is None:
            raise NotImplementedError(
                "klest's KL term needs a separate reference model (a PEFT adapter's disabled "
                "base is not supported); pass a model that is not a PEFT model, or beta=0.0"
            )
        changed = _sampling_changes(self.args)
        if changed:
            warn_at_caller(
                f"the completions are sampled with {', '.join(changed)}, not from "
                "pi = softmax(logits / temperature), whose log-probs the KL term uses: its value "
                "and gradient are biased for KL(pi||ref) (TRL's own KL term too)",
                KLGradientWarning,
            )

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # Captured inside the loss only, with or without autograd: evaluation computes the same
        # loss under torch.no_grad().
        if self._captured_logps is not None:
            self._captured_logps.append(out[0])
        return out

    @contextlib.contextmanager
    def _without_trl_kl(self) -> Iterator[list[Tensor]]:
        beta, self.beta, self._captured_logps = self.beta, 0.0, []
        try:
            yield self._captured_logps
        finally:
            self.beta, self._captured_logps = beta, None

    def _ref_logps(self, inputs: dict[str, Any]) -> Tensor:
        return inputs["ref_per_token_logps"]

    def _compute_loss(self, model, inputs):
        if self.beta == 0.0:
            return super()._compute_loss(model, inputs)
        with self._without_trl_kl() as captured:
            loss = super()._compute_loss(model, inputs)
        logp = _computed_once(captured, "the policy's log-probs in its loss")
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        group = group_ids_from_prompts(inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"])
        kl, details = self.kl_term(
            logp,
            self._ref_logps(inputs).to(logp.dtype),
            mask=mask,
            group=group,
            logp_behavior=inputs.get("old_per_token_logps"),
        )
        mode = "train" if self.model.training else "eval"
        if self._scales_for_accumulation and mode == "train":
            kl = kl / self.current_gradient_accumulation_steps
        value = torch.as_tensor(details.diagnostics.mean, device=logp.device, dtype=torch.float32)
        self._metrics[mode]["kl"].append(self.accelerator.gather(value.reshape(1)).nanmean().item())
        return loss + self.beta * kl


class GRPOTrainer(_KLTermInLoss, trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with klest's KL term (:class:`KLTerm`) in place of TRL's k3.

    Everything else is TRL's (``GRPOConfig``, rewards, loss types, generation). ``beta`` from
    the config weighs the term; ``kl`` says which KL and which estimators.

    Every other argument is ``trl.GRPOTrainer``'s.

    Args:
      kl: the KL term (default ``KLTerm()``: k3's value, the cumulative score-function gradient
        of the sequence KL(pi||ref) with a leave-one-out baseline over each prompt's samples).

    Example (``examples/grpo_trl.py`` runs one end to end)::

        from klest.integrations.trl import GRPOTrainer, KLTerm
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=GRPOConfig(beta=0.01),
                              train_dataset=data, kl=KLTerm(grad="cumulative"))
    """

    def __init__(self, *args: Any, kl: KLTerm | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_kl_term(kl)


class RLOOTrainer(_KLTermInLoss, trl.RLOOTrainer):
    """TRL's ``RLOOTrainer`` with the KL moved from the reward into the loss (:class:`KLTerm`).

    TRL's RLOO subtracts ``beta * sum_t k1_t`` from each completion's reward; here the reward is
    the task reward alone and ``beta * kl_penalty(...)`` joins the loss, its gradient a
    cumulative (reward-to-go) score function with a leave-one-out baseline. The reference
    model's log-probs are computed once per generation batch, as TRL does; when TRL trains on a
    generation batch after an optimizer step (``num_iterations > 1``, ``steps_per_generation``),
    the sampler's per-token log-probs from TRL's scoring pass are the term's ``logp_behavior``.

    Every other argument is ``trl.RLOOTrainer``'s.

    Args:
      kl: the KL term (default ``KLTerm()``).
    """

    _scales_for_accumulation = False

    def __init__(self, *args: Any, kl: KLTerm | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_kl_term(kl)

    def _generate_and_score_completions(self, inputs):
        if self.beta == 0.0:
            return super()._generate_and_score_completions(inputs)
        with self._capturing_scoring_logps() as captured:
            output = super()._generate_and_score_completions(inputs)
        output["ref_per_token_logps"] = _computed_once(captured["ref"], "the reference log-probs")
        policy = _computed_once(captured["policy"], "the sampler's log-probs")
        if self.model.training and _reuses_samples_after_an_update(self.args, self.num_iterations):
            # TRL's RLOO keeps only the sampler's sequence log-probs (its ratio is per sequence);
            # the KL term's importance weights are per token, kept as GRPO keeps them.
            output["old_per_token_logps"] = policy
        return output

    @contextlib.contextmanager
    def _capturing_scoring_logps(self) -> Iterator[dict[str, list[Tensor]]]:
        """Score with TRL's reward KL off, keeping both of TRL's no-grad forward passes: the
        policy's (the sampler's per-token log-probs) and the reference's."""
        captured: dict[str, list[Tensor]] = {"policy": [], "ref": []}
        original = self._get_per_token_logps_and_entropies
        beta = self.beta

        def capture(model, *args, **kwargs):
            out = original(model, *args, **kwargs)
            is_ref = model is self.ref_model
            captured["ref" if is_ref else "policy"].append(out[0])
            if is_ref:
                # TRL's reward penalty reads beta after this forward pass: switch it off now.
                self.beta = 0.0
            return out

        self._get_per_token_logps_and_entropies = capture
        try:
            yield captured
        finally:
            del self._get_per_token_logps_and_entropies
            self.beta = beta


def _computed_once(captured: list[Tensor], what: str) -> Tensor:
    if len(captured) != 1:
        raise RuntimeError(
            f"expected TRL to compute {what} once, saw {len(captured)} times: this TRL version "
            f"({trl.__version__}) is not supported"
        )
    return captured[0]


def _reuses_samples_after_an_update(args: Any, num_iterations: int) -> bool:
    """Whether TRL trains on a generation batch after an optimizer step has changed the policy
    that sampled it: its buffer spans ``steps_per_generation * num_iterations`` micro-batches,
    which then do not tile the accumulation windows (TRL's own rule for keeping
    ``old_per_token_logps``)."""
    return args.gradient_accumulation_steps % (args.steps_per_generation * num_iterations) != 0


class DistillationTrainer(trl.DistillationTrainer):
    r"""TRL's on-policy ``DistillationTrainer`` with klest's exact KL from hidden states.

    .. math::
        \text{loss} = \frac{1}{N}\sum_{b,t} KL_{b,t}, \qquad
        KL_{b,t} = KL\big(\pi(\cdot\mid y_{<t}) \,\|\, ref(\cdot\mid y_{<t})\big)

    over the completions y ~ pi (the student) that TRL samples, with pi the student and ref the
    teacher, both ``softmax(W h / temperature)`` (:func:`klest.jsd_from_hidden`: chunked over
    the vocabulary, no ``[B, T, V]`` tensor). ``beta`` from the config picks the divergence as
    TRL does: ``1.0`` is KL(student||teacher) = KL(pi||ref), ``0.0`` is KL(teacher||student) =
    KL(ref||pi), and in between TRL's generalized JSD,
    :math:`\beta\,KL(ref\|m) + (1-\beta)\,KL(\pi\|m)` with
    :math:`m = \beta\,ref + (1-\beta)\,\pi`, in place of :math:`KL_{b,t}` above.

    The per-token loss's gradient holds each prefix fixed; the sequence-level
    KL(student||teacher) also depends on the prefixes the student samples. With
    ``sequence_level=True`` (KL(pi||ref) only) the loss adds the score-function term with the
    future positions' exact KLs (:func:`klest.kl_penalty` with ``grad="rb"`` and the KLs as
    ``position_kls``), so its gradient is unbiased for the gradient of the sequence KL; it
    assumes TRL samples from ``softmax(logits / temperature)`` (``top_p=1``, ``top_k=0``).

    See "Better Estimation of the Kullback-Leibler Divergence Between Language Models" by Afra
    Amini, Tim Vieira and Ryan Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637).

    Every other argument is ``trl.DistillationTrainer``'s.

    Args:
      sequence_level: add the future-KL score term (see above).
      baseline: for ``sequence_level``: ``"loo"`` (over equal prompts in the micro-batch),
        ``"mean"`` or None.
    """

    def __init__(
        self,
        *args: Any,
        sequence_level: bool = False,
        baseline: Baseline | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        _check_trl_version()
        if sequence_level and self.beta != 1.0:
            raise ValueError("sequence_level=True is for KL(student||teacher): set beta=1.0")
        changed = _sampling_changes(self.args) if sequence_level else []
        if changed:
            raise ValueError(
                f"sequence_level=True needs the completions sampled from the student's "
                f"softmax(logits / temperature); the config samples with {', '.join(changed)}: "
                "use the defaults (top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)"
            )
        if baseline is not None:
            if baseline in EXACT_KL_BASELINES:
                raise ValueError(
                    f"baseline={baseline!r} (vOPD's exact-KL baseline) does not apply: the "
                    "per-token loss already takes the exact per-position KL's gradient (the "
                    "conditional expectation of vOPD's estimator), and the sequence-level term's "
                    "targets are exact future KLs; use baseline='loo' with sequence_level=True"
                )
            check_choice("baseline", baseline, ("loo", "mean"))
            if not sequence_level:
                raise ValueError("baseline applies only with sequence_level=True")
        self.sequence_level = sequence_level
        self.baseline = baseline

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        keep = inputs["completion_ids"].size(1)
        h = self._get_last_hidden_state(unwrapped_student, input_ids, attention_mask, keep)
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            h_ref = self._forward_redirection(
                self.teacher_model,
                unwrapped_teacher,
                self._get_last_hidden_state,
                unwrapped_teacher,
                input_ids,
                attention_mask,
                keep,
            )
        head = _plain_lm_head(unwrapped_student, "student")
        head_ref = _plain_lm_head(unwrapped_teacher, "teacher")

        def divergence():  # the heads' weights read here: gathered when FSDP2 shards them
            return jsd_from_hidden(  # the KL at beta 0 and 1
                h,
                head.weight,
                h_ref.to(h.device),
                head_ref.weight,
                beta=self.beta,
                bias=head.bias,
                bias_ref=head_ref.bias,
                mask=mask,
                reduction="none",
                temperature=self.temperature,
                labels=inputs["completion_ids"] if self.sequence_level else None,
                return_details=True,
            )

        kls, details = in_forward_of((unwrapped_student, unwrapped_teacher), divergence)
        if self.sequence_level:
            group = group_ids_from_prompts(inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"])
            per_token = kl_penalty(
                details.logp,
                details.logp_ref,
                mask=mask,
                estimator="rb",
                grad="rb",
                position_kls=kls,
                baseline=self.baseline,
                group=group if self.baseline is not None else None,
                reduction="none",
            )
        else:
            per_token = kls
        n_valid = mask.sum()
        total = per_token.sum()
        if num_items_in_batch is None:
            loss = total / n_valid.clamp(min=1)
        else:
            loss = total / torch.as_tensor(num_items_in_batch, device=total.device)
        entropy_sum = (details.entropy * mask).sum()
        return loss, entropy_sum.detach(), n_valid


def _plain_lm_head(model: Any, which: str) -> torch.nn.Linear:
    """The model's output layer, refused where TRL applies a logit scale or soft-capping."""
    config = model.config.get_text_config()
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise NotImplementedError(
                f"the {which}'s config scales its logits ({name}); not supported"
            )
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise NotImplementedError(f"the {which}'s config soft-caps its logits; not supported")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(
            f"the {which}'s output layer is {type(head).__name__}, not a Linear"
        )
    return head
