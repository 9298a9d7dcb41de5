"""TRL's options under klest's trainers: each option the TRL integration's documentation lists
(those that ``test_trl.py`` does not already train) is trained and its KL term checked.

Each case builds klest's ``GRPOTrainer``, ``RLOOTrainer`` or ``DistillationTrainer`` with one
setting on a tiny one-layer model, trains two optimizer steps on CPU (gradient accumulation 2),
and keeps every micro-batch with the parameters it was trained at and those that sampled it.
On every micro-batch the trainer trained (or evaluated) on, the term it adds to TRL's loss is
checked, value and gradient, against klest computed here from an independent forward pass: a
float32 replica of the model (no autocast wrapper, no gradient checkpointing) holding the
parameters of that moment. Where the sampling parameters differ from them (a generation batch
reused after an optimizer step), the replica with the sampler's parameters gives the behavior
log-probs; each case also says whether it reuses samples so, and the test checks that it does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import klest

pytest.importorskip("trl", reason="the klest[trl] extra (installed by make test)")
pytest.importorskip("datasets")

from trl import DistillationConfig, GRPOConfig, RLOOConfig

from klest.integrations.trl import (
    DistillationTrainer,
    GRPOTrainer,
    KLTerm,
    RLOOTrainer,
)
from tests.integrations._trl_helpers import (
    assert_divergence_value_close,
    assert_grads_close,
    assert_normwise_close,
    common_args,
    completion_logits,
    completion_logps,
    exact_distillation_kls,
    groups_by_hand,
    kl_added_to_the_loss,
    klest_term,
    perturbed,
    prompts,
    record_batches,
    reward,
    save_tiny_lm,
    sequence_level_by_hand,
    token_sizes,
    tokenizer,
    tolerance,
    trainable,
    vocabulary_sizes,
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One case: TRL config options (and the tokenizer's padding side), what to expect."""

    config: dict[str, Any]
    padding_side: str = "left"
    reuses_samples: bool = False
    """a generation batch is trained on after an optimizer step (off-policy samples)"""
    warns: str | None = None
    """the option(s) a KLGradientWarning must name at construction"""
    teacher: str = "teacher"
    bf16_arithmetic: bool | None = None
    """whether the checked loss is computed in bfloat16 (default: whether the config says so)"""

    @property
    def dtype(self) -> torch.dtype:
        """The arithmetic of the checked loss, whose rounding its tolerance follows."""
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def bf16(self) -> bool:
        if self.bf16_arithmetic is not None:
            return self.bf16_arithmetic
        dtypes = [
            self.config.get(k, {}).get("dtype")
            for k in ("model_init_kwargs", "teacher_model_init_kwargs")
        ]
        return bool(self.config.get("bf16")) or "bfloat16" in dtypes

    @property
    def evaluates(self) -> bool:
        return self.config.get("eval_strategy", "no") != "no"


def _case(*, id_: str | None = None, padding_side: str = "left", **config):
    """A pytest case whose id reads like the option: ``loss_type=dr_grpo``."""
    options = {k: v for k, v in config.items() if k in _SETTING_FIELDS}
    config = {k: v for k, v in config.items() if k not in _SETTING_FIELDS}
    words = [f"{k}={_short(v)}" for k, v in config.items()]
    if padding_side != "left":
        words.append(f"padding_side={padding_side}")
    return pytest.param(
        Setting(config, padding_side=padding_side, **options), id=id_ or ",".join(words)
    )


_SETTING_FIELDS = ("reuses_samples", "warns", "teacher", "bf16_arithmetic")


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}"
    return str(value).replace(" ", "")


_REUSED = {"reuses_samples": True}
_EVALUATED = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4}
_BF16_MODEL = {"model_init_kwargs": {"dtype": "bfloat16"}}

_RL_SETTINGS = [  # options that GRPO and RLOO share
    _case(steps_per_generation=4, **_REUSED),
    _case(generation_batch_size=16, **_REUSED),
    _case(gradient_accumulation_steps=1, num_iterations=2, **_REUSED),
    _case(num_generations=3, per_device_train_batch_size=3, gradient_accumulation_steps=3),
    _case(num_generations=4, per_device_train_batch_size=2),
    _case(per_device_train_batch_size=1),
    _case(num_generations_eval=1, **_EVALUATED),
    _case(num_iterations=2, **_EVALUATED, **_REUSED),
    _case(max_completion_length=1),
    _case(max_completion_length=1, mask_truncated_completions=True),
    _case(padding_side="right"),
    _case(pad_to_multiple_of=8),
    _case(beta=0.0),
    _case(beta=1.0),
    _case(temperature=0.7),
    _case(bf16=True),
    _case(**_BF16_MODEL),
    _case(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5),
    _case(disable_dropout=False),
    _case(gradient_checkpointing=True),
]

GRPO_SETTINGS = [
    # loss_type="grpo" and "dapo", num_iterations=2, mask_truncated_completions,
    # use_bias_correction_kl=False and evaluation are trained in test_trl.py.
    *[_case(loss_type=t) for t in ("dr_grpo", "bnpo", "cispo", "sapo", "vespo")],
    _case(loss_type="luspo", importance_sampling_level="sequence"),
    _case(importance_sampling_level="sequence", loss_type="grpo"),
    _case(epsilon=0.1, epsilon_high=0.28, delta=1.5, num_iterations=2, **_REUSED),
    _case(off_policy_mask_threshold=0.5, num_iterations=2, **_REUSED),
    _case(top_entropy_quantile=0.2),
    _case(entropy_coef=0.01),
    _case(scale_rewards="none"),
    _case(scale_rewards="batch"),
    _case(gradient_accumulation_steps=4, steps_per_generation=2),
    _case(top_k=5, warns="top_k=5"),
    _case(min_p=0.1, warns="min_p=0.1"),
    _case(generation_kwargs={"typical_p": 0.9}, warns="generation_kwargs['typical_p']=0.9"),
    _case(cast_lm_head_to_fp32=True),
    *_RL_SETTINGS,
]

RLOO_SETTINGS = [
    # num_iterations=2, mask_truncated_completions and evaluation are trained in test_trl.py.
    _case(normalize_advantages=True, reward_clip_range=(-1.0, 1.0)),
    _case(epsilon=0.1, epsilon_high=0.28, num_iterations=2, **_REUSED),
    _case(top_p=0.9, repetition_penalty=1.2, warns="top_p=0.9, repetition_penalty=1.2"),
    _case(
        top_k=5,
        min_p=0.1,
        generation_kwargs={"typical_p": 0.9},
        warns="top_k=5, min_p=0.1, generation_kwargs['typical_p']=0.9",
    ),
    *_RL_SETTINGS,
]

DISTILLATION_SETTINGS = [
    # beta = 1, 0 and 0.3, and sequence_level=True without a baseline: test_trl.py.
    _case(sequence_level=True, baseline="loo"),
    _case(temperature=0.7),
    _case(temperature=0.7, sequence_level=True),
    _case(max_completion_length=1),
    _case(padding_side="right"),
    # TRL's distillation loss runs through its forward redirection, past accelerate's autocast
    # wrapper: under bf16=True the loss is float32, and checked as such.
    _case(bf16=True, bf16_arithmetic=False),
    _case(teacher_model_init_kwargs={"dtype": "bfloat16"}),
    _case(**_BF16_MODEL, teacher_model_init_kwargs={"dtype": "bfloat16"}),
    _case(id_="teacher_hidden_size=32", teacher="wider teacher"),
    _case(**_EVALUATED),
    _case(gradient_checkpointing=True),
    _case(top_k=5),  # the per-token loss takes exact KLs: no sampling assumption
]

_DISTILLATION_OPTIONS = ("sequence_level", "baseline")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The tiny models, saved once for the module: the policy (student), the reference
    (teacher) and a teacher twice as wide."""
    folder = tmp_path_factory.mktemp("models")
    return {
        "policy": save_tiny_lm(folder / "policy", seed=0),
        "teacher": save_tiny_lm(folder / "teacher", seed=1),
        "wider teacher": save_tiny_lm(folder / "wider", seed=1, hidden_size=32),
    }


@dataclasses.dataclass
class Step:
    """A micro-batch as the trainer computed its loss on it."""

    batch: dict
    parameters: dict[str, torch.Tensor]
    """the trained model's parameters at that moment"""
    sampler: dict[str, torch.Tensor] | None
    """the parameters that generated the batch's completions"""
    training: bool


def _parameters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _record_steps(trainer) -> list[Step]:
    """Keep every micro-batch with the parameters it was trained at and those that sampled it:
    the parameters as the last generation of the same mode (training or evaluation) started, as
    an evaluation between two uses of a training generation batch samples anew."""
    sampler: dict[bool, dict] = {}
    generate = trainer._generate_and_score_completions

    def generating(*args, **kwargs):
        sampler[trainer.model.training] = _parameters(trainer.model)
        return generate(*args, **kwargs)

    trainer._generate_and_score_completions = generating
    return record_batches(
        trainer,
        lambda batch: Step(
            batch,
            _parameters(trainer.model),
            sampler.get(trainer.model.training),
            trainer.model.training,
        ),
    )


def _float32_replica(model):
    """A float32 model of the same architecture, built from the config: the independent forward
    pass (float32 arithmetic even for a bfloat16 model, no autocast, no gradient checkpointing)."""
    replica = type(model)(model.config).float()
    replica.eval()  # the tiny Llama has no dropout; a model with dropout would fail the check
    return replica


def _load(replica, parameters: dict[str, torch.Tensor]):
    replica.load_state_dict({n: p.float() for n, p in parameters.items()})
    return replica


def _restore(model, parameters: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(parameters[n])


def _trainable_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _train(trainer, setting: Setting) -> list[Step]:
    steps = _record_steps(trainer)
    trainer.train()
    del trainer._compute_loss, trainer._generate_and_score_completions  # recording ends
    trained = [s for s in steps if s.training]
    args = trainer.args
    assert len(trained) == args.max_steps * args.gradient_accumulation_steps
    if setting.evaluates:
        assert any(not s.training for s in steps)
    return steps


@contextlib.contextmanager
def _kl_warnings(setting: Setting) -> Iterator[None]:
    """A KLGradientWarning naming the setting's sampling options where it must warn; else any
    KLGradientWarning is an error."""
    if setting.warns is not None:
        with pytest.warns(klest.KLGradientWarning, match=re.escape(setting.warns)):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", klest.KLGradientWarning)
            yield


def _rl_trainer(cls, config_cls, models, tmp_path, setting: Setting):
    args = config_cls(**{**common_args(tmp_path), "num_generations": 2, **setting.config})
    evaluation = {"eval_dataset": prompts()} if setting.evaluates else {}
    with _kl_warnings(setting):
        trainer = cls(
            model=models["policy"],
            reward_funcs=reward,
            args=args,
            train_dataset=prompts(),
            processing_class=tokenizer(setting.padding_side),
            **evaluation,
        )
    return perturbed(trainer)


def _check_rl(trainer, setting: Setting, *, scales_for_accumulation: bool) -> None:
    """Train, then on every micro-batch: the term added to TRL's loss against klest's."""
    with warnings.catch_warnings():
        if setting.warns is None:
            warnings.simplefilter("error", klest.KLGradientWarning)
        steps = _train(trainer, setting)
    args = trainer.args
    if args.beta == 0.0:  # no reference model and no term: TRL's loss alone
        assert trainer.ref_model is None
        assert all("ref_per_token_logps" not in s.batch for s in steps)
        return
    model = trainer.model
    replica = _float32_replica(model)
    names = _trainable_names(model)
    kl = KLTerm()  # the default the trainers were built with
    reused, nonzero = False, False
    for i, step in enumerate(steps):
        _restore(model, step.parameters)
        model.train(step.training)
        got = kl_added_to_the_loss(trainer, step.batch)

        behavior = None
        if any(not torch.equal(step.sampler[n], step.parameters[n]) for n in step.parameters):
            reused = True
            with torch.no_grad():
                behavior = completion_logps(
                    _load(replica, step.sampler), step.batch, temperature=args.temperature
                )
        logp = completion_logps(
            _load(replica, step.parameters), step.batch, temperature=args.temperature
        )
        scale = 1 / args.gradient_accumulation_steps
        scale = scale if scales_for_accumulation and step.training else 1.0
        term = klest_term(logp, step.batch, kl, beta=args.beta, scale=scale, logp_behavior=behavior)
        params = dict(replica.named_parameters())
        expected_grads = torch.autograd.grad(term, [params[n] for n in names], allow_unused=True)

        what = f"micro-batch {i} ({'training' if step.training else 'evaluation'})"
        assert torch.isfinite(got.value), what
        sizes = token_sizes(logp, step.batch["ref_per_token_logps"])
        tol = tolerance(*sizes, step.batch["completion_mask"], setting.dtype)
        assert_normwise_close(got.value, term, tol, scale=got.scale, what=f"{what}: value")
        assert_grads_close(got.grads, expected_grads, tol, scale=got.grad_scale, what=what)
        nonzero = nonzero or float(term.detach()) != 0.0
    assert reused == setting.reuses_samples
    assert nonzero  # the check has something to compare


@pytest.mark.parametrize("setting", GRPO_SETTINGS)
def test_grpo_option_keeps_klests_kl_term(models, tmp_path, setting):
    trainer = _rl_trainer(GRPOTrainer, GRPOConfig, models, tmp_path, setting)
    _check_rl(trainer, setting, scales_for_accumulation=True)


@pytest.mark.parametrize("setting", RLOO_SETTINGS)
def test_rloo_option_keeps_klests_kl_term(models, tmp_path, setting):
    trainer = _rl_trainer(RLOOTrainer, RLOOConfig, models, tmp_path, setting)
    _check_rl(trainer, setting, scales_for_accumulation=False)


def _distillation_trainer(models, tmp_path, setting: Setting):
    config = dict(setting.config)
    options = {k: config.pop(k) for k in _DISTILLATION_OPTIONS if k in config}
    args = DistillationConfig(**{**common_args(tmp_path), "beta": 1.0, **config})
    evaluation = {"eval_dataset": prompts()} if setting.evaluates else {}
    return DistillationTrainer(
        model=models["policy"],
        teacher_model=models[setting.teacher],
        args=args,
        train_dataset=prompts(),
        processing_class=tokenizer(setting.padding_side),
        **evaluation,
        **options,
    )


@pytest.mark.parametrize("setting", DISTILLATION_SETTINGS)
def test_distillation_option_keeps_the_exact_kl(models, tmp_path, setting):
    """The loss on every micro-batch against the exact KL(student || teacher) from float32
    replicas' materialized logits (sequence_level: plus the future KLs' score term, by hand, or
    through klest's kl_penalty with the leave-one-out baseline)."""
    trainer = _distillation_trainer(models, tmp_path, setting)
    steps = _train(trainer, setting)
    student, args = trainer.model, trainer.args
    replica = _float32_replica(student)
    teacher = _load(_float32_replica(trainer.teacher_model), _parameters(trainer.teacher_model))
    names = _trainable_names(student)
    sequence_level = setting.config.get("sequence_level", False)
    baseline = setting.config.get("baseline")
    for i, step in enumerate(steps):
        _restore(student, step.parameters)
        student.train(step.training)
        loss, _, n_valid = trainer._compute_loss(student, step.batch, None)
        got_grads = torch.autograd.grad(loss, trainable(student), allow_unused=True)

        batch, mask = step.batch, step.batch["completion_mask"].bool()
        logits = completion_logits(
            _load(replica, step.parameters), batch, temperature=args.temperature
        )
        with torch.no_grad():
            logits_t = completion_logits(teacher, batch, temperature=args.temperature)
        kls = torch.where(mask, exact_distillation_kls(logits, logits_t, args.beta), 0.0)
        tokens = batch["completion_ids"][..., None]
        logp = logits.log_softmax(-1).gather(-1, tokens)[..., 0]
        logp_t = logits_t.log_softmax(-1).gather(-1, tokens)[..., 0]
        if sequence_level and baseline is not None:
            kls = klest.kl_penalty(
                logp,
                logp_t,
                mask=mask,
                estimator="rb",
                grad="rb",
                position_kls=kls,
                baseline=baseline,
                group=groups_by_hand(batch),
                reduction="none",
            )
        elif sequence_level:
            kls = sequence_level_by_hand(kls, logp, mask)
        expected = kls.sum() / mask.sum().clamp(min=1)
        params = dict(replica.named_parameters())
        expected_grads = torch.autograd.grad(expected, [params[n] for n in names])

        what = f"micro-batch {i} ({'training' if step.training else 'evaluation'})"
        assert int(n_valid) == int(mask.sum()), what
        value = f"{what}: value"
        assert_divergence_value_close(loss, expected, logits, logits_t, mask, setting.dtype, value)
        tol = tolerance(*vocabulary_sizes(logits, logits_t), mask, setting.dtype)
        assert_grads_close(got_grads, expected_grads, tol, what=what)


@pytest.mark.parametrize(
    ("option", "named"),
    [({"min_p": 0.1}, "min_p=0.1"), ({"repetition_penalty": 1.2}, "repetition_penalty=1.2")],
    ids=["min_p=0.1", "repetition_penalty=1.2"],
)
def test_distillation_sequence_level_refuses_other_sampling_by_name(
    models, tmp_path, option, named
):
    """top_k and generation_kwargs: test_trl.py."""
    setting = Setting({**option, "sequence_level": True})
    with pytest.raises(ValueError, match=re.escape(f"samples with {named}")):
        _distillation_trainer(models, tmp_path, setting)
