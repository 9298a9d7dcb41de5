r"""On-policy distillation of a small teacher LM: token-local vs sequence-level KL gradients.

On-policy distillation trains a student pi on its own samples to minimize the sequence-level

.. math:: KL(\pi\|ref) = E_{x}\,E_{y\sim\pi(\cdot|x)}\Big[\sum_t
          \log\pi(y_t|x, y_{<t}) - \log ref(y_t|x, y_{<t})\Big]

toward a teacher ref. Trainers differ in the gradient they take. Each method below is one call of
:func:`klest.kl_penalty` (``estimator="k1"``; the value is only reported) or
:func:`klest.kl_from_logits`, with :math:`\rho_t = \log\pi(y_t|\cdot) - \log ref(y_t|\cdot)`,
:math:`s_t = \nabla\log\pi(y_t|\cdot)` and :math:`KL_t` the exact next-token KL(pi_t||ref_t)
from both models' logits:

- ``token``: :math:`\sum_t s_t\rho_t`, each token's advantage its own :math:`-\rho_t`
  (REINFORCE with per-token KL rewards and discount 0, what Tinker and slime do);
  ``grad="token"``. Its mean is the token-local gradient
  :math:`\sum_t E_{y_{<t}}[\nabla KL_t]` (prefix distribution held fixed): biased for the
  sequence KL;
- ``token+exact-kl``: :math:`\sum_t s_t(\rho_t - KL_t)`, vOPD's estimator (the exact KL as the
  control variate of each token's reward): ``grad="token", baseline="exact-kl"``; same mean as
  ``token``, lower variance;
- ``cumulative``: :math:`\sum_t s_t \sum_{u\ge t}\rho_u`, reward-to-go (the sequence-level score
  function gradient): unbiased;
- ``cumulative+loo``: minus the leave-one-out mean over the other K samples of the prompt
  (Tang and Munos's variance-reduced sequence-level gradient): unbiased;
- ``cumulative+exact-kl+loo``: :math:`\sum_t s_t(\sum_{u\ge t}\rho_u - KL_t - b_t)` with
  :math:`b_t` the other samples' mean residual: vOPD's control variate on the sequence-level
  gradient. Plain ``exact-kl`` leaves the future KLs :math:`\sum_{u>t}\rho_u` in every target (a
  large positive mean at high KL), which the leave-one-out term removes; so ``+loo``;
- ``rb``: :math:`\sum_n\nabla KL_n + \sum_m s_m\sum_{n>m} KL_n` (Rao-Blackwellized, exact
  next-token KLs along the sample plus the score of the future KLs): unbiased;
- ``rb+loo``: the same, the future-KL target minus its leave-one-out mean: unbiased;
- ``exact-token-kl``: autodiff of :math:`\sum_t KL_t` through the student's logits
  (:func:`klest.kl_from_logits`), the full-logit distillation loss; its mean is ``token``'s.
- ``cumulative gamma=0.9``, ``cumulative gamma=0.5``: reward-to-go discounted,
  :math:`\sum_t s_t \sum_{u\ge t}\gamma^{u-t}\rho_u` (``discount=``; GAE-OPD's discounted
  return, the Tinker cookbook's ``kl_discount_factor``): between ``token`` (0) and
  ``cumulative`` (1), the gradient of no divergence;
- ``token+iw-opd``: :math:`\sum_t s_t w_t\rho_t` with IW-OPD's token weights
  :math:`w_t = 1 + g(1 - \sum_{u<t}|\rho_u| / \sum_u|\rho_u|)`, :math:`g = 0.5` (TRL's
  default), which weight the early tokens up to :math:`1 + g` (``weights=``); the weights read
  the whole sequence, so its mean is neither gradient.

Models (:mod:`klest.experiments.small_lms`, cached under ``runs/_models``): the teacher is the
TEACHER GPT-2 (96 wide, 3 layers) trained on ENTHUSIAST reviews; the student is the STUDENT
GPT-2 (32 wide, 2 layers), from two starts: *high KL*, pre-trained on NEUTRAL reviews (about 4
nats of KL(pi||ref) from the teacher), and *low KL*, that student fine-tuned for 40 steps on
ENTHUSIAST (about 0.4 nats). Prompts are the teacher-style reviews' first two words after
``<bos>``; each step samples P prompts and K completions per prompt from the current student
(temperature 1, up to 23 tokens), and takes one Adam step with the same learning rate for every
method: 1e-3, a third of the pre-training rate, fixed before the runs and not tuned per method
(Adam's per-coordinate scaling keeps the step size comparable across estimators of different
variance; a noisier gradient shows as a slower or noisier descent, which is what is compared).
All methods start from the same student and draw each step's prompts and samples from the same
seeded generators.

Tracked on fresh held-out samples (new prompts, one completion each): KL(pi||ref) by the
Rao-Blackwellized estimate on student samples (:func:`klest.kl_estimate`, ``estimator="rb"``),
and KL(ref||pi), the teacher-to-student KL, by the same estimate on teacher samples (a fixed set
per seed: the teacher does not change), each with its standard error.

References: "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi
Munos (2025, https://arxiv.org/abs/2506.09477), whose on-policy distillation experiment reports
the sequence KL going from 7.7 (token-level) to 3.0 (sequence-level with variance reduction);
"KL for a KL: On-Policy Distillation with Control Variate Baseline" by Minjae Oh et al. (2026,
https://arxiv.org/abs/2605.07865), the exact-KL control variate; "Better Estimation of the
Kullback-Leibler Divergence Between Language Models" by Afra Amini, Tim Vieira and Ryan
Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637), the Rao-Blackwellized estimates.

Full size: ``klest run distill`` (3 seeds, 2 starts, 11 methods, 150 steps of 8 prompts x 8
completions, 192 held-out samples per evaluation every 10 steps): about 22 minutes on a busy
2-core machine with the models already trained (962 s measured for the first 8 methods; training
the models once takes about a minute more). ``--quick`` (smaller models trained in a temporary
folder, one seed, 6 steps at lr 3e-3) takes about 20 CPU-seconds.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.experiments.reviews import ENTHUSIAST, NEUTRAL, sample_reviews
from klest.experiments.runner import Experiment, Report, RunConfig, pyplot
from klest.experiments.small_lms import (
    STUDENT,
    TEACHER,
    Architecture,
    Batch,
    Training,
    completion_log_probs,
    sample_completions,
    small_lm_session,
    trained_gpt2,
)
from klest.logits import kl_from_logits
from klest.sampled.estimators import kl_estimate
from klest.sampled.penalty import KLGradientWarning, kl_penalty
from klest.sampled.token_weights import iw_opd_weights

PROMPT_WORDS = 2
"""Words of a teacher-style review after ``<bos>`` that make a prompt."""
PAPER = {"token-level": 7.7, "sequence-level": 3.0}
"""Tang and Munos's sequence KL at the end of on-policy distillation (their figure)."""


@dataclass(frozen=True)
class Rollout:
    """What a distillation loss reads: the student's (``logp``, ``logits``, with graph) and the
    teacher's log-probs of the sampled tokens ``[n, L]`` and next-token logits ``[n, L, V]``,
    the valid-token ``mask`` ``[n, L]`` and the prompt of each completion ``group`` ``[n]``."""

    logp: Tensor
    logp_ref: Tensor
    logits: Tensor
    logits_ref: Tensor
    mask: Tensor
    group: Tensor


@dataclass(frozen=True)
class Method:
    """One distillation gradient: a :func:`klest.kl_penalty` ``grad``/``baseline`` pair, or
    (``grad=None``) autodiff of the exact per-token KLs from logits.

    Attributes:
      name: the label in tables and figures.
      grad: ``kl_penalty``'s ``grad=`` (None: :func:`klest.kl_from_logits`).
      baseline: ``kl_penalty``'s ``baseline=``.
      sequence_level: its mean is the gradient of the sequence KL(pi||ref) (else the token-local
        gradient, prefixes held fixed, or with ``discount`` or ``iw_opd`` neither).
      discount: ``kl_penalty``'s ``discount=`` (``cumulative`` and ``rb``).
      iw_opd: IW-OPD's gain g of the token weights (:func:`klest.iw_opd_weights`), or None.
    """

    name: str
    grad: str | None
    baseline: str | None
    sequence_level: bool
    discount: float = 1.0
    iw_opd: float | None = None

    @property
    def token_local(self) -> bool:
        """Its mean is the token-local gradient (prefixes held fixed)."""
        return not self.sequence_level and self.discount == 1.0 and self.iw_opd is None

    def loss(self, r: Rollout) -> Tensor:
        """The scalar loss whose gradient is this method's (mean over sequences of the sum over
        tokens: the sequence KL's scale)."""
        if self.grad is None:
            return kl_from_logits(r.logits, r.logits_ref, mask=r.mask)
        weights = None
        if self.iw_opd is not None:
            weights = iw_opd_weights(r.logp, r.logp_ref, mask=r.mask, gain=self.iw_opd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KLGradientWarning)  # token's bias is the point
            return kl_penalty(
                r.logp,
                r.logp_ref,
                estimator="k1",
                grad=self.grad,  # type: ignore[arg-type]
                baseline=self.baseline,  # type: ignore[arg-type]
                mask=r.mask,
                group=r.group if self.baseline is not None else None,
                logits=r.logits,
                logits_ref=r.logits_ref,
                discount=self.discount,
                weights=weights,
            )


METHODS: tuple[Method, ...] = (
    Method("token", "token", None, False),
    Method("token+exact-kl", "token", "exact-kl", False),
    Method("cumulative", "cumulative", None, True),
    Method("cumulative+loo", "cumulative", "loo", True),
    Method("cumulative+exact-kl+loo", "cumulative", "exact-kl+loo", True),
    Method("rb", "rb", None, True),
    Method("rb+loo", "rb", "loo", True),
    Method("exact-token-kl", None, None, False),
    Method("cumulative gamma=0.9", "cumulative", None, False, discount=0.9),
    Method("cumulative gamma=0.5", "cumulative", None, False, discount=0.5),
    Method("token+iw-opd", "token", None, False, iw_opd=0.5),
)
"""The compared gradients (module docstring); ``token`` is the reference of the ratios."""
BY_NAME = {m.name: m for m in METHODS}


@dataclass(frozen=True)
class Start:
    """A starting student: the NEUTRAL-trained student, then ``finetune_steps`` on the
    teacher's style (0: none, several nats from the teacher)."""

    name: str
    finetune_steps: int


@dataclass(frozen=True)
class Sizes:
    """How big a run is."""

    teacher_arch: Architecture
    student_arch: Architecture
    teacher_steps: int
    student_steps: int
    starts: tuple[Start, ...]
    seeds: int
    steps: int
    prompts: int  # P per step
    samples: int  # K per prompt
    eval_every: int
    eval_samples: int
    lr: float = 1e-3


FULL = Sizes(
    TEACHER,
    STUDENT,
    600,
    300,
    (Start("high KL", 0), Start("low KL", 40)),
    seeds=3,
    steps=150,
    prompts=8,
    samples=8,
    eval_every=10,
    eval_samples=192,
)
QUICK = Sizes(
    STUDENT,
    Architecture(n_embd=16, n_layer=1, n_head=2),
    150,
    60,
    (Start("high KL", 0), Start("low KL", 20)),
    seeds=1,
    steps=6,
    prompts=4,
    samples=4,
    eval_every=3,
    eval_samples=256,
    lr=3e-3,
)


def prompts(n: int, *, generator: torch.Generator) -> Tensor:
    """``n`` prompts ``[n, 1 + PROMPT_WORDS]``: ``<bos>`` and the first words of teacher-style
    (ENTHUSIAST) reviews."""
    return sample_reviews(ENTHUSIAST, n, generator=generator)[:, : 1 + PROMPT_WORDS]


def rollout(student: Any, teacher: Any, batch: Batch, group: Tensor) -> Rollout:
    """Score a batch of student completions: the student with its graph, the teacher without."""
    logits, logp = completion_log_probs(student, batch)
    with torch.no_grad():
        logits_ref, logp_ref = completion_log_probs(teacher, batch)
    return Rollout(logp, logp_ref, logits, logits_ref, batch.mask, group)


def _rb_values(sampler: Any, other: Any, batch: Batch) -> Tensor:
    """Per completion, :math:`\\sum_n KL(sampler_n\\|other_n)` along the sampler's completions:
    the Rao-Blackwellized estimate of the sequence KL(sampler||other)."""
    with torch.no_grad():
        logits, logp = completion_log_probs(sampler, batch)
        logits_other, logp_other = completion_log_probs(other, batch)
    return kl_estimate(
        logp,
        logp_other,
        estimator="rb",
        logits=logits,
        logits_ref=logits_other,
        mask=batch.mask,
        reduction="per-sequence",
    )


def _mean_se(values: Tensor) -> tuple[float, float]:
    v = values.double()
    return float(v.mean()), float(v.std() / math.sqrt(v.numel()))


def _seeded(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(np.random.SeedSequence(parts).generate_state(1)[0]))


def distill(
    start: Any,
    teacher: Any,
    method: Method,
    sizes: Sizes,
    *,
    seed: int,
    teacher_batch: Batch,
    bar: Any,
) -> dict[str, list[float]]:
    """One on-policy distillation run from a copy of ``start``; the held-out KL curves."""
    student = copy.deepcopy(start)
    student.eval()  # no dropout in these models; eval mode only fixes the flag
    optimizer = torch.optim.Adam(student.parameters(), lr=sizes.lr)
    group = torch.arange(sizes.prompts).repeat_interleave(sizes.samples)
    keys = ("step", "kl", "kl_se", "kl_rev", "kl_rev_se", "length")
    curves: dict[str, list[float]] = {k: [] for k in keys}
    for step in range(sizes.steps + 1):
        if step % sizes.eval_every == 0 or step == sizes.steps:
            gen = _seeded(seed, step, 1)
            held_out = sample_completions(
                student, prompts(sizes.eval_samples, generator=gen), generator=gen
            )
            for key, values in (
                ("kl", _rb_values(student, teacher, held_out)),
                ("kl_rev", _rb_values(teacher, student, teacher_batch)),
            ):
                mean, se = _mean_se(values)
                curves[key].append(mean)
                curves[f"{key}_se"].append(se)
            curves["length"].append(float(held_out.mask.sum(-1).double().mean()))
            curves["step"].append(step)
        if step == sizes.steps:
            break
        gen = _seeded(seed, step, 0)
        rows = prompts(sizes.prompts, generator=gen).repeat_interleave(sizes.samples, 0)
        batch = sample_completions(student, rows, generator=gen)
        loss = method.loss(rollout(student, teacher, batch, group))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.update(1)
    return curves


def _models(sizes: Sizes, seed: int, cache: Path, progress: bool) -> tuple[Any, dict[str, Any]]:
    teacher, _ = trained_gpt2(
        sizes.teacher_arch,
        Training(ENTHUSIAST, steps=sizes.teacher_steps, seed=seed),
        cache_dir=cache,
        progress=progress,
    )
    student, folder = trained_gpt2(
        sizes.student_arch,
        Training(NEUTRAL, steps=sizes.student_steps, seed=seed + 1),
        cache_dir=cache,
        progress=progress,
    )
    starts = {}
    for start in sizes.starts:
        if start.finetune_steps:
            starts[start.name] = trained_gpt2(
                sizes.student_arch,
                Training(ENTHUSIAST, steps=start.finetune_steps, seed=seed + 2),
                start_from=folder,
                cache_dir=cache,
                progress=progress,
            )[0]
        else:
            starts[start.name] = student
    teacher.requires_grad_(False)
    return teacher, starts


def run(config: RunConfig) -> Report:
    sizes = QUICK if config.quick else FULL
    with small_lm_session(config.quick) as cache:
        teacher, starts = _models(sizes, config.seed, cache, config.progress)
        return _run(teacher, starts, sizes, config)


def _run(teacher: Any, starts: dict[str, Any], sizes: Sizes, config: RunConfig) -> Report:
    runs: dict = {s: {m.name: [] for m in METHODS} for s in starts}
    teacher_length = []
    total = len(starts) * len(METHODS) * sizes.seeds * sizes.steps
    with progress_bar(total=total, desc="distill", enabled=config.progress) as bar:
        for seed in range(config.seed, config.seed + sizes.seeds):
            gen = _seeded(seed, 0, 2)
            teacher_batch = sample_completions(
                teacher, prompts(sizes.eval_samples, generator=gen), generator=gen
            )
            teacher_length.append(float(teacher_batch.mask.sum(-1).double().mean()))
            for start_name, start in starts.items():
                for method in METHODS:
                    curves = distill(
                        start,
                        teacher,
                        method,
                        sizes,
                        seed=seed,
                        teacher_batch=teacher_batch,
                        bar=bar,
                    )
                    runs[start_name][method.name].append({"seed": seed, **curves})
    return _report(runs, float(np.mean(teacher_length)), sizes, config)


def _report(runs: dict, teacher_length: float, sizes: Sizes, config: RunConfig) -> Report:
    """The result, table and figure of the curves ``runs[start][method]`` (a list over seeds)."""
    finals = _finals(runs)
    results = {
        "experiment": "distill",
        "quick": config.quick,
        "seed": config.seed,
        "sizes": _jsonable_sizes(sizes),
        "methods": {
            m.name: {
                "grad": m.grad,
                "baseline": m.baseline,
                "sequence_level": m.sequence_level,
                "token_local": m.token_local,
                "discount": m.discount,
                "iw_opd": m.iw_opd,
            }
            for m in METHODS
        },
        "runs": runs,
        "final": finals,
        "teacher_length": teacher_length,
        "paper": PAPER,
    }
    sentence = _summary_sentence(finals, results["teacher_length"])
    results["summary"] = sentence
    table = _table(finals, sizes) + "\n" + sentence + "\n"
    return Report(results, table, _figures(runs), sentence)


def _jsonable_sizes(sizes: Sizes) -> dict:
    out: dict = {}
    for k, v in vars(sizes).items():
        if isinstance(v, Architecture):
            v = vars(v)
        elif k == "starts":
            v = [vars(s) for s in v]
        out[k] = v
    return out


def _finals(runs: dict) -> dict:
    """Per start and method: start and final KLs in both directions, mean and sd over seeds, and
    the final KL(pi||ref) relative to ``token``'s (seed by seed, then averaged)."""
    out: dict = {}
    for start, methods in runs.items():
        out[start] = {}
        token = np.array([r["kl"][-1] for r in methods["token"]])
        for name, seeds in methods.items():
            entry: dict = {}
            for key in ("kl", "kl_rev"):
                first = np.array([r[key][0] for r in seeds])
                last = np.array([r[key][-1] for r in seeds])
                entry[key] = {
                    "start": float(first.mean()),
                    "final": float(last.mean()),
                    "final_sd": float(last.std(ddof=1)) if len(last) > 1 else 0.0,
                    "final_se": float(np.mean([r[f"{key}_se"][-1] for r in seeds])),
                }
            length = np.mean([r["length"] for r in seeds], axis=0)
            entry["length"] = {
                "start": float(length[0]),
                "shortest": float(length.min()),
                "final": float(length[-1]),
            }
            ratio = np.array([r["kl"][-1] for r in seeds]) / token
            entry["ratio_to_token"] = float(ratio.mean())
            out[start][name] = entry
    return out


def _table(finals: dict, sizes: Sizes) -> str:
    lines = [
        f"Final held-out KLs after {sizes.steps} steps of {sizes.prompts} prompts x "
        f"{sizes.samples} completions (Adam, lr {sizes.lr}); mean ± sd over {sizes.seeds} "
        f"seed(s); KL(pi||ref) = student-to-teacher (on student samples), KL(ref||pi) = "
        "teacher-to-student (on teacher samples); ratio = final KL(pi||ref) / token's, per seed; "
        "length = mean held-out completion length in tokens (start / shortest / final).\n",
        "| start | method | KL(pi‖ref) start | KL(pi‖ref) final | ratio to token | "
        "KL(ref‖pi) start | KL(ref‖pi) final | length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for start, methods in finals.items():
        for name, e in methods.items():
            kl, rev, n = e["kl"], e["kl_rev"], e["length"]
            lines.append(
                f"| {start} | {name} | {kl['start']:.2f} | {kl['final']:.2f} ± "
                f"{kl['final_sd']:.2f} | {e['ratio_to_token']:.2f} | {rev['start']:.2f} | "
                f"{rev['final']:.2f} ± {rev['final_sd']:.2f} | {n['start']:.1f} / "
                f"{n['shortest']:.1f} / {n['final']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _best(finals: dict, start: str, sequence_level: bool) -> tuple[str, float]:
    names = [m.name for m in METHODS if m.sequence_level == sequence_level and not _between(m)]
    name = min(names, key=lambda n: finals[start][n]["kl"]["final"])
    return name, finals[start][name]["kl"]["final"]


def _between(m: Method) -> bool:
    """Neither sequence-level nor token-local: discounted or IW-OPD-weighted."""
    return not m.sequence_level and not m.token_local


def _summary_sentence(finals: dict, teacher_length: float) -> str:
    parts = []
    for start, methods in finals.items():
        token = methods["token"]["kl"]
        seq_name, seq = _best(finals, start, True)
        loc_name, loc = _best(finals, start, False)
        parts.append(
            f"{start} (KL(pi||ref) {token['start']:.2f} at the start): token ends at "
            f"{token['final']:.2f}, the best sequence-level gradient ({seq_name}) at {seq:.2f} "
            f"({seq / token['final']:.2f}x token's), the best token-local one ({loc_name}) at "
            f"{loc:.2f}; completions go from {methods['token']['length']['start']:.1f} tokens "
            f"to {finals[start][seq_name]['length']['shortest']:.1f} at the shortest under "
            f"{seq_name}, {methods['token']['length']['shortest']:.1f} under token; "
            + ", ".join(
                f"{m.name} ends at {methods[m.name]['kl']['final']:.2f} (shortest "
                f"{methods[m.name]['length']['shortest']:.1f} tokens)"
                for m in METHODS
                if _between(m)
            )
        )
    paper = PAPER["sequence-level"] / PAPER["token-level"]
    return (
        "; ".join(parts) + f" (the teacher's: {teacher_length:.1f}). Tang and Munos: "
        f"7.7 -> 3.0 ({paper:.2f}x)."
    )


def _figures(runs: dict) -> dict:
    plt = pyplot()
    palette = [plt.get_cmap("tab10")(i) for i in range(10)] + ["black"]
    colors = {m.name: palette[i % len(palette)] for i, m in enumerate(METHODS)}
    fig, axes = plt.subplots(
        2, len(runs), figsize=(6 * len(runs) + 1.5, 8), squeeze=False, layout="constrained"
    )
    for col, (start, methods) in enumerate(runs.items()):
        for row, (key, title) in enumerate(
            (("kl", "KL(pi||ref), student samples"), ("kl_rev", "KL(ref||pi), teacher samples"))
        ):
            ax = axes[row, col]
            for m in METHODS:
                seeds = methods[m.name]
                steps = seeds[0]["step"]
                curve = np.mean([r[key] for r in seeds], axis=0)
                se = np.sqrt(np.mean([np.square(r[f"{key}_se"]) for r in seeds], axis=0))
                style = "-" if m.sequence_level else ":" if _between(m) else "--"
                ax.plot(steps, curve, style, color=colors[m.name], label=m.name)
                ax.fill_between(steps, curve - se, curve + se, color=colors[m.name], alpha=0.15)
            ax.set(xlabel="step", ylabel="nats", yscale="log", title=f"{start}: {title}")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    fig.suptitle("On-policy distillation: held-out KL over steps (mean over seeds)")
    return {"kl_curves": fig}


EXPERIMENT = Experiment(
    name="distill",
    description="on-policy distillation of a small LM: token-local vs sequence-level KL "
    "gradients, RB, the exact-KL control variate, the exact per-token KL loss, the discount, "
    "IW-OPD's token weights",
    run=run,
)

__all__ = [
    "BY_NAME",
    "EXPERIMENT",
    "METHODS",
    "Method",
    "Rollout",
    "distill",
    "prompts",
    "run",
]
