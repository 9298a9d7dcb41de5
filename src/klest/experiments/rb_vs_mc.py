r"""Rao-Blackwellized vs Monte Carlo estimates of KL(pi||ref) between two small language models.

Reproduces, on GPT-2 models trained here, the value-estimation study of "Better Estimation of the
Kullback-Leibler Divergence Between Language Models" by Afra Amini, Tim Vieira and Ryan Cotterell
(NeurIPS 2025, https://arxiv.org/abs/2504.10637; code https://github.com/rycolab/kl-rb): for each
prompt, M in {1, 5, 10} completions y ~ pi(.|prompt) give estimates of

.. math:: KL(\pi(\cdot|x) \| ref(\cdot|x)) = E_{y\sim\pi(\cdot|x)}\Big[\sum_t
          \log\pi(y_t|x, y_{<t}) - \log ref(y_t|x, y_{<t})\Big]

by five estimators, each averaged over the M samples (the paper's estimators are means over M):

- ``mc``: the sequence log-ratio :math:`\delta(y) = \log\pi(y) - \log ref(y)`, i.e. k1 summed over
  the completion (``klest.kl_estimate(estimator="k1", reduction="per-sequence")``);
- ``cv1``: the paper's control-variate estimator :math:`\delta(y) + \alpha (R(y) - 1)` with the
  sequence ratio :math:`R = ref(y)/\pi(y)` and :math:`\alpha = 1` (Schulman's k3 applied to the
  whole completion): klest's ``cv`` with ``alpha=1.0, level="sequence"``;
- ``cv_fitted``: the same with the coefficient fitted leave-one-out on the *other* samples of the
  prompt's M (``alpha="loo"``, ``group`` = the M samples), which keeps it unbiased. At M = 1 there
  is no other sample: klest's coefficient is then 0 and ``cv_fitted`` is ``mc`` itself;
- ``cv_batch``: the same with the coefficient fitted leave-one-out on every other completion of
  the batch (all prompts of one prompt length, ``alpha="loo"`` without ``group``): still unbiased
  (:math:`E_\pi[R - 1] = 0` under every prompt), and fitted on far more samples; as in a trainer,
  a draw's estimate then depends on the other draws' samples through the coefficient;
- ``rb``: the Rao-Blackwellized estimator, the exact next-token KL at every position along the
  sample, from both models' logits (``estimator="rb"``);
- ``rb_cv``: ``rb`` plus :math:`\alpha (R(y) - 1)` with alpha fitted leave-one-out within the M
  samples (klest's :func:`~klest.sampled.control_variates.fit_alpha` on the ``rb`` values). The
  paper defines no such estimator; this is the natural one, added to see whether the sequence ratio
  still carries information once ``rb`` has removed the token-choice noise (at M = 1 it is
  ``rb``).

The reference ("truth") of each prompt is a high-M ``rb`` estimate from independent samples,
with its standard error. Reported for each M and estimator: the bias (mean over prompts of the
estimate minus the reference, with its standard error across prompts, which includes the
reference's own noise) and the spread sd (the standard deviation across independent draws of M
samples of one prompt, pooled over prompts as the root mean variance).

The gradient part compares, over repeated draws of one batch of prompts, the gradient with respect
to pi's parameters of the sequence KL term: Monte Carlo ``kl_penalty(..., estimator="k1",
grad="score")`` (the paper's MC gradient) and ``grad="cumulative"`` against ``grad="rb"``: the
variance of the gradient norm (the paper reports 59.90 for MC and 45.44 for RB) and the total
variance of the gradient vector (the sum over parameters of each coordinate's variance).

Models: ref is GPT-2 trained on the NEUTRAL review style; pi is ref fine-tuned on ENTHUSIAST
(:mod:`klest.experiments.reviews`, :mod:`klest.experiments.small_lms`; cached under
``runs/_models``). Prompts are NEUTRAL reviews cut 1 to 3 tokens after ``<bos>``; completions are
sampled from pi at temperature 1 without top-k or top-p truncation, up to the review length
(23 tokens), by a sampler loop over pi's logits driven by one seeded generator.

Full size: ``klest run rb-vs-mc`` (256 prompts, 500 completions per prompt for the M-sample
estimates, 200 for the reference, 100 gradient draws of 32 completions); about 30 minutes on a
busy 2-core machine (15 CPU-minutes), model training included. ``--quick`` (32 prompts, smaller
models trained in a temporary folder) takes 30 to 45 seconds.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.experiments.reviews import (
    BOS_ID,
    ENTHUSIAST,
    NEUTRAL,
    sample_reviews,
)
from klest.experiments.runner import Experiment, Report, RunConfig, pyplot, series_styles
from klest.experiments.small_lms import (
    MAX_LENGTH,
    REFERENCE,
    STUDENT,
    Architecture,
    Batch,
    Training,
    completion_log_probs,
    sample_completions,
    small_lm_session,
    trained_gpt2,
)
from klest.sampled.control_variates import fit_alpha
from klest.sampled.estimators import kl_estimate
from klest.sampled.groups import group_keys
from klest.sampled.penalty import kl_penalty
from klest.sampled.terms import control_term

MS = (1, 5, 10)
ESTIMATORS = ("mc", "cv1", "cv_fitted", "cv_batch", "rb", "rb_cv")
UNBIASED = ("mc", "cv_fitted", "cv_batch", "rb", "rb_cv")
"""The estimators whose expectation is the KL (cv1 is too, but its heavy tail makes a finite
sample's mean and standard error unreliable, which is the paper's point)."""
GRADIENTS = ("mc/score", "mc/cumulative", "rb/rb")
# The paper's gradient-norm variances (MC -> RB), for the table.
PAPER_GRAD_NORM_VARIANCE = {"mc/score": 59.90, "rb/rb": 45.44}
PROMPT_TOKENS = (1, 2, 3)
HORIZON = MAX_LENGTH  # both styles write reviews of up to 23 tokens


@dataclass(frozen=True)
class Sizes:
    """How big a run is: models, prompts and draws."""

    arch: Architecture
    ref_steps: int
    policy_steps: int
    prompts: int
    replicates: int  # independent groups of max(MS) completions per prompt
    reference_samples: int
    grad_prompts: int
    grad_samples: int
    grad_draws: int
    timing_repeats: int

    @property
    def completions(self) -> int:
        return self.replicates * max(MS)


FULL = Sizes(REFERENCE, 600, 200, 256, 50, 200, 8, 4, 100, 10)
QUICK = Sizes(STUDENT, 120, 60, 32, 8, 48, 4, 4, 30, 5)


def _groups(n_rows: int, m: int) -> Tensor:
    """Group ids of consecutive runs of ``m`` rows."""
    return torch.arange(n_rows) // m


def estimates(
    logp: Tensor, logp_ref: Tensor, logits: Tensor, logits_ref: Tensor, mask: Tensor, m: int
) -> dict[str, Tensor]:
    """Every estimator's value per group of ``m`` consecutive rows (one prompt's M samples)."""
    group = _groups(logp.shape[0], m)
    common = {"mask": mask, "reduction": "per-sequence"}
    with warnings.catch_warnings():
        # klest warns against fitting alpha within groups this small: measuring why is the point.
        warnings.simplefilter("ignore", UserWarning)
        cv_fitted = kl_estimate(
            logp, logp_ref, estimator="cv", alpha="loo", level="sequence", group=group, **common
        )
    per_seq = {
        "mc": kl_estimate(logp, logp_ref, estimator="k1", **common),
        "cv1": kl_estimate(logp, logp_ref, estimator="cv", alpha=1.0, level="sequence", **common),
        "cv_fitted": cv_fitted,
        "cv_batch": kl_estimate(
            logp, logp_ref, estimator="cv", alpha="loo", level="sequence", **common
        ),
        "rb": kl_estimate(
            logp, logp_ref, estimator="rb", logits=logits, logits_ref=logits_ref, **common
        ),
    }
    per_seq["rb_cv"] = rb_control_variate(per_seq["rb"], per_seq["mc"], group)
    return {name: v.reshape(-1, m).mean(-1) for name, v in per_seq.items()}


def rb_control_variate(rb: Tensor, delta: Tensor, group: Tensor) -> Tensor:
    r"""``rb + alpha (R - 1)`` per sequence, :math:`R = e^{-\delta}` the sequence ratio, alpha
    fitted leave-one-out within each group (klest's fit: 0 for a group of one)."""
    u = control_term(delta.unsqueeze(-1), "pi||ref")
    valid = torch.ones_like(u, dtype=torch.bool)
    alpha = fit_alpha(rb.unsqueeze(-1), u, valid, "loo", keys=group_keys(group))
    return rb + alpha.to(rb.dtype) * u[:, 0]


def _prompts(n: int, seed: int) -> list[Tensor]:
    """``n`` NEUTRAL review prefixes, 1 to 3 tokens after ``<bos>``, grouped by length."""
    reviews = sample_reviews(NEUTRAL, n, generator=torch.Generator().manual_seed(seed))
    lengths = torch.tensor([PROMPT_TOKENS[i % len(PROMPT_TOKENS)] for i in range(n)])
    assert bool((reviews[:, 0] == BOS_ID).all())
    return [reviews[lengths == k, : k + 1] for k in PROMPT_TOKENS if bool((lengths == k).any())]


def _models(sizes: Sizes, seed: int, cache_dir: Path, progress: bool) -> tuple[Any, Any]:
    ref, folder = trained_gpt2(
        sizes.arch,
        Training(NEUTRAL, steps=sizes.ref_steps, seed=seed),
        cache_dir=cache_dir,
        progress=progress,
    )
    policy, _ = trained_gpt2(
        sizes.arch,
        Training(ENTHUSIAST, steps=sizes.policy_steps, seed=seed + 1),
        start_from=folder,
        cache_dir=cache_dir,
        progress=progress,
    )
    return ref, policy


def _evaluate(policy: Any, ref: Any, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with torch.no_grad():
        logits, logp = completion_log_probs(policy, batch)
        logits_ref, logp_ref = completion_log_probs(ref, batch)
    return logp, logp_ref, logits, logits_ref


def _value_study(
    policy, ref, prompt_sets, sizes, gen, bar, progress: bool = False
) -> tuple[dict, dict, dict]:
    """Per-prompt reference, and per-prompt / per-draw estimates for each M (``progress``: count
    the positions of each sampling pass, minutes at full size)."""
    reference: dict[str, list] = {"mean": [], "se": []}
    values: dict[int, dict[str, list]] = {m: {e: [] for e in ESTIMATORS} for m in MS}
    timing: dict[str, list[float]] = {
        e: [] for e in ("mc", "cv1", "cv_fitted", "rb", "forward passes (both models)")
    }
    for prompts in prompt_sets:
        n_p = prompts.shape[0]
        # Reference: independent samples, rb per sequence.
        batch = sample_completions(
            policy,
            prompts.repeat_interleave(sizes.reference_samples, 0),
            generator=gen,
            progress=progress,
        )
        logp, logp_ref, logits, logits_ref = _evaluate(policy, ref, batch)
        rb = kl_estimate(
            logp,
            logp_ref,
            estimator="rb",
            logits=logits,
            logits_ref=logits_ref,
            mask=batch.mask,
            reduction="per-sequence",
        ).reshape(n_p, -1)
        reference["mean"].append(rb.mean(-1))
        reference["se"].append(rb.std(-1) / math.sqrt(rb.shape[1]))
        bar.update(1)
        # The M-sample estimates, from other samples.
        rows = prompts.repeat_interleave(sizes.completions, 0)
        batch = sample_completions(policy, rows, generator=gen, progress=progress)
        start = time.perf_counter()
        logp, logp_ref, logits, logits_ref = _evaluate(policy, ref, batch)
        timing["forward passes (both models)"].append((time.perf_counter() - start) / len(logp))
        for m in MS:
            for name, v in estimates(logp, logp_ref, logits, logits_ref, batch.mask, m).items():
                values[m][name].append(v.reshape(n_p, -1))  # [prompts, draws of M]
        _time_calls(timing, logp, logp_ref, logits, logits_ref, batch.mask, sizes.timing_repeats)
        bar.update(1)
    ref_out = {k: torch.cat(v) for k, v in reference.items()}
    vals = {m: {e: torch.cat(v) for e, v in d.items()} for m, d in values.items()}
    return ref_out, vals, {e: float(np.median(t)) for e, t in timing.items()}


def _time_calls(timing, logp, logp_ref, logits, logits_ref, mask, repeats: int) -> None:
    """Seconds per sequence of each klest estimator call (logits already computed)."""
    group = _groups(logp.shape[0], max(MS))
    calls: dict[str, Callable[[], Tensor]] = {
        "mc": lambda: kl_estimate(
            logp, logp_ref, estimator="k1", mask=mask, reduction="per-sequence"
        ),
        "cv1": lambda: kl_estimate(
            logp,
            logp_ref,
            estimator="cv",
            alpha=1.0,
            level="sequence",
            mask=mask,
            reduction="per-sequence",
        ),
        "cv_fitted": lambda: kl_estimate(
            logp,
            logp_ref,
            estimator="cv",
            alpha="loo",
            level="sequence",
            group=group,
            mask=mask,
            reduction="per-sequence",
        ),
        "rb": lambda: kl_estimate(
            logp,
            logp_ref,
            estimator="rb",
            logits=logits,
            logits_ref=logits_ref,
            mask=mask,
            reduction="per-sequence",
        ),
    }
    for name, call in calls.items():
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            timing[name].append((time.perf_counter() - start) / logp.shape[0])


def _summaries(reference: dict, values: dict) -> dict:
    """Bias (± se across prompts) and pooled sd across draws, per M and estimator."""
    out: dict = {}
    ref = reference["mean"].double()
    n_prompts = ref.shape[0]
    for m in MS:
        out[m] = {}
        for name, v in values[m].items():
            v = v.double()
            gap = v.mean(-1) - ref  # per prompt
            var = v.var(-1)  # per prompt, across independent draws of M
            out[m][name] = {
                "mean": float(v.mean()),
                "bias": float(gap.mean()),
                "bias_se": float(gap.std() / math.sqrt(n_prompts)),
                "median_error": float((v - ref.unsqueeze(-1)).median()),
                "sd": float(var.mean().sqrt()),
                "draws_per_prompt": int(v.shape[1]),
                "frac_negative": float((v < 0).double().mean()),
                "max": float(v.max()),
            }
    return out


def _gradient_study(policy, ref, prompts: Tensor, sizes: Sizes, gen, bar) -> dict:
    """Gradient of the sequence KL term over repeated draws: norms and total variance."""
    params = [p for p in policy.parameters() if p.requires_grad]
    rows = prompts.repeat_interleave(sizes.grad_samples, 0)
    norms: dict[str, list[float]] = {g: [] for g in GRADIENTS}
    sums = {g: [torch.zeros(()), None, None] for g in GRADIENTS}  # count, sum, sum of squares
    policy.train(False)
    for _ in range(sizes.grad_draws):
        batch = sample_completions(policy, rows, generator=gen)
        logits, logp = completion_log_probs(policy, batch)
        with torch.no_grad():
            logits_ref, logp_ref = completion_log_probs(ref, batch)
        losses = {
            "mc/score": kl_penalty(logp, logp_ref, estimator="k1", grad="score", mask=batch.mask),
            "mc/cumulative": kl_penalty(
                logp, logp_ref, estimator="k1", grad="cumulative", mask=batch.mask
            ),
            "rb/rb": kl_penalty(
                logp,
                logp_ref,
                estimator="rb",
                grad="rb",
                mask=batch.mask,
                logits=logits,
                logits_ref=logits_ref,
            ),
        }
        for i, (name, loss) in enumerate(losses.items()):
            grads = torch.autograd.grad(loss, params, retain_graph=i < len(losses) - 1)
            flat = torch.cat([g.reshape(-1) for g in grads]).double()
            norms[name].append(float(flat.norm()))
            s = sums[name]
            s[0] += 1
            s[1] = flat if s[1] is None else s[1] + flat
            s[2] = flat * flat if s[2] is None else s[2] + flat * flat
        bar.update(1)
    out = {}
    for name in GRADIENTS:
        n, total, squares = sums[name]
        coord_var = (squares - total * total / n) / (n - 1)
        x = np.array(norms[name])
        out[name] = {
            "norm_mean": float(x.mean()),
            "norm_variance": float(x.var(ddof=1)),
            "total_variance": float(coord_var.sum()),
            "mean_gradient_norm": float((total / n).norm()),
            "norms": x.tolist(),
        }
    out["draws"] = sizes.grad_draws
    out["batch"] = int(rows.shape[0])
    return out


def _table(summary: dict, grads: dict, timing: dict, kl: dict) -> str:
    lines = [
        f"KL(pi||ref) of completions: mean over prompts {kl['mean']:.3f} nats (range "
        f"{kl['min']:.2f} to {kl['max']:.2f}); reference per prompt: rb over "
        f"{kl['reference_samples']} samples, median se {kl['median_se']:.3f}.\n",
        "### Value: bias (estimate - reference, mean over prompts ± se) and sd across draws\n",
        "| M | estimator | bias ± se | sd | sd / sd(mc) | negative |",
        "|---|---|---|---|---|---|",
    ]
    for m in MS:
        mc_sd = summary[m]["mc"]["sd"]
        for e in ESTIMATORS:
            s = summary[m][e]
            lines.append(
                f"| {m} | {e} | {s['bias']:+.3f} ± {s['bias_se']:.3f} | {s['sd']:.3f} "
                f"| {s['sd'] / mc_sd:.2f} | {s['frac_negative']:.1%} |"
            )
    lines += [
        "",
        f"### Gradient of the KL term: {grads['draws']} draws of {grads['batch']} completions\n",
        "| gradient | variance of the norm | total variance | mean norm | paper (norm variance) |",
        "|---|---|---|---|---|",
    ]
    for g in GRADIENTS:
        s = grads[g]
        paper = PAPER_GRAD_NORM_VARIANCE.get(g)
        lines.append(
            f"| {g} | {s['norm_variance']:.4g} | {s['total_variance']:.4g} | "
            f"{s['norm_mean']:.4g} | {'' if paper is None else paper} |"
        )
    lines += [
        "",
        "### Cost: seconds per sequence of the klest call (logits already computed)\n",
        "| estimator | seconds / sequence |",
        "|---|---|",
    ]
    lines += [f"| {e} | {t:.3g} |" for e, t in timing.items()]
    return "\n".join(lines) + "\n"


def _figures(summary: dict) -> dict:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    # A colour and a marker each: mc and cv_batch coincide here, and both stay visible.
    styles = series_styles(ESTIMATORS)
    for e in ESTIMATORS:
        sd = [summary[m][e]["sd"] for m in MS]
        axes[0].plot(MS, sd, ms=6, mfc="none", label=e, **styles[e])
        bias = [summary[m][e]["bias"] for m in MS]
        se = [summary[m][e]["bias_se"] for m in MS]
        offset = 0.12 * (ESTIMATORS.index(e) - 2)
        axes[1].errorbar(
            np.array(MS) + offset, bias, yerr=se, ls="none", capsize=3, label=e, **styles[e]
        )
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="samples M",
        ylabel="sd across draws (nats)",
        title="Spread of the estimate of KL(pi||ref)",
    )
    axes[0].set_xticks(MS, [str(m) for m in MS])
    axes[1].axhline(0.0, color="k", lw=0.8)
    axes[1].set(
        xlabel="samples M",
        ylabel="estimate - reference (nats, symlog)",
        title="Bias ± se over prompts",
    )
    axes[1].set_yscale("symlog", linthresh=0.1)
    axes[1].set_xticks(MS, [str(m) for m in MS])
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    return {"sd_and_bias_vs_m": fig}


def _summary_sentence(summary: dict, grads: dict) -> str:
    """Where the paper's findings are reproduced and where not, from the numbers."""

    def ratio(e: str) -> str:
        return " / ".join(f"{summary[m][e]['sd'] / summary[m]['mc']['sd']:.2f}" for m in MS)

    def verdict(ok: bool) -> str:
        return "reproduced" if ok else "NOT reproduced"

    rb_lower = all(summary[m]["rb"]["sd"] < summary[m]["mc"]["sd"] for m in MS)
    cv1_wider = all(summary[m]["cv1"]["sd"] > summary[m]["mc"]["sd"] for m in MS)
    g_mc, g_rb = grads["mc/score"]["norm_variance"], grads["rb/rb"]["norm_variance"]
    ms = ", ".join(map(str, MS))
    return (
        f"sd relative to MC at M = {ms}: rb {ratio('rb')} ({verdict(rb_lower)}: RB below MC at "
        f"every M); cv1 (alpha = 1) {ratio('cv1')} ({verdict(cv1_wider)}: wider than MC); "
        f"cv_fitted within the M samples {ratio('cv_fitted')}, fitted on the batch "
        f"{ratio('cv_batch')}. Gradient-norm variance MC (score) {g_mc:.3g} -> RB {g_rb:.3g} "
        f"(paper 59.90 -> 45.44: {verdict(g_rb < g_mc)})."
    )


def run(config: RunConfig) -> Report:
    sizes = QUICK if config.quick else FULL
    with small_lm_session(config.quick) as cache:
        ref, policy = _models(sizes, config.seed, cache, config.progress)
        return _run(ref, policy, sizes, config)


def _run(ref: Any, policy: Any, sizes: Sizes, config: RunConfig) -> Report:
    gen = torch.Generator().manual_seed(config.seed + 2)
    prompt_sets = _prompts(sizes.prompts, config.seed + 3)
    total = 2 * len(prompt_sets) + sizes.grad_draws
    with progress_bar(total=total, desc="rb-vs-mc", enabled=config.progress) as bar:
        reference, values, timing = _value_study(
            policy, ref, prompt_sets, sizes, gen, bar, config.progress
        )
        grad_prompts = prompt_sets[0][: sizes.grad_prompts]
        grads = _gradient_study(policy, ref, grad_prompts, sizes, gen, bar)
    summary = _summaries(reference, values)
    kl = {
        "mean": float(reference["mean"].mean()),
        "min": float(reference["mean"].min()),
        "max": float(reference["mean"].max()),
        "median_se": float(reference["se"].median()),
        "mean_se": float(reference["mean"].std() / math.sqrt(reference["mean"].numel())),
        "reference_samples": sizes.reference_samples,
    }
    results = {
        "experiment": "rb-vs-mc",
        "quick": config.quick,
        "seed": config.seed,
        "sizes": {
            k: (v if not isinstance(v, Architecture) else vars(v)) for k, v in vars(sizes).items()
        },
        "kl_pi_ref": kl,
        "reference": {k: v.tolist() for k, v in reference.items()},
        "per_draw": {m: {e: v.tolist() for e, v in d.items()} for m, d in values.items()},
        **{m: summary[m] for m in MS},
        "gradient": grads,
        "seconds_per_sequence": timing,
        "paper_gradient_norm_variance": PAPER_GRAD_NORM_VARIANCE,
    }
    sentence = _summary_sentence(summary, grads)
    results["summary"] = sentence
    table = _table(summary, grads, timing, kl) + "\n" + sentence + "\n"
    return Report(results, table, _figures(summary), sentence)


EXPERIMENT = Experiment(
    name="rb-vs-mc",
    description="Rao-Blackwellized vs Monte Carlo KL(pi||ref) between small LMs: bias, sd vs M, "
    "gradient variance, cost",
    run=run,
)

__all__ = ["EXPERIMENT", "MS", "rb_control_variate", "run"]
