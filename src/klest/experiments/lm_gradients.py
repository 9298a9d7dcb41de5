r"""KL gradient estimators on a transformer language model small enough to enumerate.

The tabular ``pitfalls`` experiment, on a real causal LM: pi and ref are small Llama models
(built from a config, nothing downloaded) over V = 5 tokens, one of them the end token, with
completions of at most H = 5 tokens after a one-token prompt
(:class:`klest.testbeds.LanguageModelTestbed`). Every completion can be enumerated, so the
sequence-level KL(pi||ref) and KL(ref||pi) and their gradients w.r.t. all of the policy's
parameters are exact. At a low and a high KL (pi is ref's weights moved part or all of the way
to another random initialization), each gradient estimator of :func:`klest.kl_penalty` is audited
with :func:`klest.audit_grad` against the exact gradient of the KL it claims, in both directions
where it is defined: its bias (a test of "mean = exact gradient", the relative bias with the
Monte Carlo noise removed, the cosine of its mean with the exact gradient) and its variance and
MSE per batch of 8 completions. A paired test then asks whether the Rao-Blackwellized gradient
(rb) has a lower MSE than the best of the other unbiased ones (score, cumulative).

The claims checked ("On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao
Tang and Rémi Munos, 2025, https://arxiv.org/abs/2506.09477; "Better Estimation of the
Kullback-Leibler Divergence Between Language Models" by Afra Amini, Tim Vieira and Ryan
Cotterell, NeurIPS 2025, https://arxiv.org/abs/2504.10637): autodiff of k1 has mean zero;
autodiff of k3 and the token-level gradient are biased; score, cumulative and rb are unbiased;
rb has the lowest MSE.

Full size: ``klest run lm-gradients`` (1000 batches per estimator and setting): about 3 minutes
on a busy 2-core machine (179 s measured).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from klest._progress import progress_bar
from klest.audit import GradSpec, audit_grad, gradient_draws
from klest.experiments.runner import Experiment, Report, RunConfig, pyplot
from klest.sampled.penalty import EXACT_KL_BASELINES, GRADIENT_ESTIMATORS
from klest.testbeds import LanguageModelTestbed

VOCAB, HORIZON, EOS, SCALE, BATCH = 5, 5, 1, 10.0, 8
DIRECTIONS = ("pi||ref", "ref||pi")
REGIMES = {"low KL": 0.3, "high KL": 1.0}
"""How far pi's weights are moved from ref's toward another initialization."""

ESTIMATORS: tuple[str, ...] = (
    "k1/autodiff",
    "k3/autodiff",
    "k3/token",
    "k3/score",
    "k3/score+loo",
    "k3/cumulative",
    "k3/cumulative+loo",
    "rb/rb",
    "rb/rb+loo",
)
"""The audited ``VALUE/GRAD[+BASELINE]`` specs (:class:`klest.audit.GradSpec`): the estimators
of Tang and Munos's comparison (append new ones here, and rerun the full size for the docs);
each is run in every direction its gradient estimator and baseline support."""


def estimators_for(direction: str) -> list[str]:
    """The specs of :data:`ESTIMATORS` that :func:`klest.kl_penalty` accepts for ``direction``.

    Example:
      >>> "rb/rb+loo" in estimators_for("ref||pi")  # rb takes a baseline for KL(pi||ref) only
      False
    """
    out = []
    for spec in ESTIMATORS:
        parsed = GradSpec.parse(spec)
        rules = GRADIENT_ESTIMATORS[parsed.grad]
        if direction not in rules.directions:
            continue
        if parsed.baseline is not None and direction not in rules.baseline_directions:
            continue
        if parsed.baseline in EXACT_KL_BASELINES and direction != "pi||ref":
            continue
        out.append(spec)
    return out


def _rb_specs(specs) -> list[str]:
    return [s for s in specs if GradSpec.parse(s).grad == "rb"]


def _unbiased_others(specs) -> list[str]:
    """The other estimators whose mean is the KL's gradient (by theory): score and cumulative,
    with or without a baseline."""
    return [s for s in specs if GradSpec.parse(s).grad in ("score", "cumulative")]


def _testbed(mix: float, seed: int) -> LanguageModelTestbed:
    return LanguageModelTestbed.tiny(
        vocab_size=VOCAB, horizon=HORIZON, eos=EOS, scale=SCALE, mix=mix, seed=seed
    )


def _paired_mse(
    testbed: LanguageModelTestbed, direction: str, a: str, b: str, *, trials: int, seed: int
) -> dict:
    """``MSE(b) - MSE(a)`` on the same batches, relative to ``|grad KL|^2``, with its standard
    error and z (> 0: a has the lower MSE)."""
    target = torch.cat([g.reshape(-1).double() for g in testbed.exact_kl_grad(direction)])
    errors = []
    for spec in (a, b):
        draws = gradient_draws(
            GradSpec.parse(spec).build(direction),
            testbed,
            batch_size=BATCH,
            n_trials=trials,
            seed=seed,
        )
        errors.append(((draws - target) ** 2).sum(1))
    diff = (errors[1] - errors[0]) / float(target.norm()) ** 2
    mean, se = float(diff.mean()), float(diff.std()) / math.sqrt(trials)
    return {"lower": a, "higher": b, "diff": mean, "se": se, "z": mean / se if se > 0 else 0.0}


def _audit(config: RunConfig, trials: int, bar) -> dict:
    out: dict = {}
    for regime, mix in REGIMES.items():
        testbed = _testbed(mix, config.seed)
        entry: dict = {}
        for direction in DIRECTIONS:
            exact_kl = float(testbed.exact_kl(direction).detach())
            rows = {}
            for spec in estimators_for(direction):
                a = audit_grad(
                    spec,
                    testbed,
                    direction=direction,
                    batch_size=BATCH,
                    n_trials=trials,
                    seed=config.seed,
                    progress=config.progress,  # an audit takes seconds: report its batches
                )
                norm2 = a.exact_norm**2
                rows[spec] = {
                    "verdict": a.verdict,
                    "z_target": a.z_target,
                    "z_other": a.z_other,
                    "z_zero": a.z_zero,
                    "rel_bias": a.rel_bias_debiased,
                    "cos": a.cos_pi_ref if direction == "pi||ref" else a.cos_ref_pi,
                    "rel_variance": a.variance / norm2,
                    "rel_mse": a.mse / norm2,
                }
                bar.update(1)
            rb = min(_rb_specs(rows), key=lambda spec: rows[spec]["rel_mse"])
            other = min(_unbiased_others(rows), key=lambda spec: rows[spec]["rel_mse"])
            entry[direction] = {
                "exact_kl": exact_kl,
                "exact_grad_norm": float(
                    torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad(direction)]).norm()
                ),
                "estimators": rows,
                "rb_vs_best_other": _paired_mse(
                    testbed, direction, rb, other, trials=trials, seed=config.seed
                ),
            }
            bar.update(1)
        out[regime] = entry
    return out


def _table(audits: dict, trials: int) -> str:
    lines = [
        f"Llama LMs, V = {VOCAB} tokens (end token {EOS}), completions of at most {HORIZON} "
        f"tokens, {sum(p.numel() for p in _testbed(0.0, 0).parameters())} parameters; "
        f"batches of {BATCH}, {trials} batches per estimator.\n"
    ]
    for regime in REGIMES:
        for direction in DIRECTIONS:
            e = audits[regime][direction]
            lines += [
                f"### {regime}: gradient of KL({direction}) = {e['exact_kl']:.3f}\n",
                "| estimator | verdict | z(mean = exact) | relative bias (noise removed) | "
                "cosine with exact | relative variance | relative MSE |",
                "|---|---|---|---|---|---|---|",
            ]
            for spec, r in e["estimators"].items():
                lines.append(
                    f"| {spec} | {r['verdict']} | {r['z_target']:.1f} | {r['rel_bias']:.3f} | "
                    f"{r['cos']:+.3f} | {r['rel_variance']:.3g} | {r['rel_mse']:.3g} |"
                )
            c = e["rb_vs_best_other"]
            lines += [
                "",
                f"Relative MSE of the best score/cumulative estimator minus rb's, on the same "
                f"batches: {c['higher']} − {c['lower']} = {c['diff']:.3g} ± {c['se']:.2g} "
                f"(z = {c['z']:.1f}).\n",
            ]
    return "\n".join(lines)


def _figure(audits: dict, trials: int):
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    panels = [(r, d) for r in REGIMES for d in DIRECTIONS]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for col, (regime, direction) in enumerate(panels):
        rows = audits[regime][direction]["estimators"]
        names = list(rows)
        y = np.arange(len(names))
        unbiased = set(_rb_specs(names)) | set(_unbiased_others(names))
        colors = ["tab:blue" if n in unbiased else "tab:red" for n in names]
        axes[0, col].barh(y, [r["rel_mse"] for r in rows.values()], color=colors)
        axes[0, col].set(xscale="log", xlabel="MSE / |∇KL|²", title=f"{regime}, KL({direction})")
        axes[0, col].xaxis.set_minor_formatter(NullFormatter())
        axes[1, col].barh(y, [r["rel_bias"] for r in rows.values()], color=colors)
        noise = [math.sqrt(r["rel_variance"] / trials) for r in rows.values()]
        axes[1, col].plot(noise, y, "k|", ms=12, label="Monte Carlo noise of the mean")
        axes[1, col].set(xlabel="|bias| / |∇KL| (noise removed)")
        for ax in axes[:, col]:
            ax.set_yticks(y, names if col == 0 else [""] * len(names), fontsize=8)
            ax.invert_yaxis()
    axes[1, 0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        "Gradient estimators on a small LM, batches of 8 "
        "(blue: unbiased in theory; red: autodiff and token-level)"
    )
    fig.tight_layout()
    return fig


def run(config: RunConfig) -> Report:
    torch.set_num_threads(1)  # many small forward passes: threads only add overhead
    trials = 150 if config.quick else 1000
    total = sum(len(estimators_for(d)) + 1 for d in DIRECTIONS) * len(REGIMES)
    with progress_bar(total=total, desc="lm-gradients", enabled=config.progress) as bar:
        audits = _audit(config, trials, bar)
    results = {
        "experiment": "lm-gradients",
        "quick": config.quick,
        "seed": config.seed,
        "vocab": VOCAB,
        "horizon": HORIZON,
        "eos": EOS,
        "scale": SCALE,
        "regimes": REGIMES,
        "batch": BATCH,
        "trials": trials,
        "audits": audits,
    }
    wins = [
        f"{r}, KL({d})"
        for r in REGIMES
        for d in DIRECTIONS
        if audits[r][d]["rb_vs_best_other"]["z"] > 4
    ]
    summary = (
        "rb's MSE below the best score/cumulative estimator's (paired z > 4): "
        f"{', '.join(wins) or 'none'}."
    )
    return Report(
        results, _table(audits, trials), {"mse_and_bias": _figure(audits, trials)}, summary
    )


EXPERIMENT = Experiment(
    name="lm-gradients",
    description="KL gradient estimators on an enumerable small LM: bias, variance, MSE",
    run=run,
)

__all__ = ["ESTIMATORS", "EXPERIMENT", "REGIMES", "estimators_for", "run"]
