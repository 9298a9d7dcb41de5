r"""Control variates where the ratio has heavy tails: fitted alpha vs k1 vs k3.

Samples from pi = N(0, 1); ref = N(0.5, s^2). The ratio r = ref/pi grows like
exp(x^2 (1 - 1/s^2) / 2) in the tails, so :math:`Var_\pi(r) = E_\pi[r^2] - 1` is finite only for
:math:`s^2 < 2`. k3 = k1 + (r - 1) inherits r's variance: beyond s = sqrt(2) its variance is
infinite and its sample standard deviation is erratic, while k1 (a polynomial in x) stays tame.
A fitted coefficient :math:`\alpha^* = -Cov(k_1, r)/Var(r)` shrinks toward 0 where r is wild.

Estimators (batches of 32, all via :func:`klest.audit_value`): k1, k3, and the control variate
k1 + alpha (r - 1) with alpha fitted leave-one-out, cross-fitted, by EMA over batches, and
in-sample (fitted on the samples it corrects, which biases the estimate). Exact KL(pi||ref) is
analytic.

A bias is flagged ("significant") when it exceeds ``z`` standard errors, ``z`` chosen so that
the whole table flags a correct estimator with probability at most 6.3e-5
(:func:`~klest.experiments.runner.table_threshold`: Bonferroni over its estimators x ref stds
comparisons, 4.74 for ``--quick``'s 30, 4.88 for the full 60). With a fixed 3 se, 11 of 120
``--quick`` runs (independent draws) flagged an unbiased estimator where Var(r) is finite; at
4.74, none. Where Var(r) is infinite the standard error itself is unreliable (the sample mean
is dominated by rare huge values), so flags there mean little: 29 of those 120 runs flag an
unbiased estimator there.

Full size (``klest run control-variates``, 4000 batches per cell): 14 s on a busy 2-core machine.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from klest._progress import progress_bar
from klest.audit import audit_value
from klest.experiments.runner import Experiment, Report, RunConfig, pyplot, table_threshold
from klest.sampled.estimators import cv
from klest.testbeds import GaussianTestbed, make_generator

ESTIMATORS = ("k1", "k3", "cv:loo", "cv:crossfit", "cv:ema", "cv:in-sample")
UNBIASED = ("k1", "k3", "cv:loo", "cv:crossfit", "cv:ema")  # in-sample fitting biases cv
BATCH = 32
MEAN_REF = 0.5


def _testbed(s: float) -> GaussianTestbed:
    return GaussianTestbed(mean=0.0, log_std=0.0, mean_ref=MEAN_REF, log_std_ref=math.log(s))


def _row(s: float, trials: int, seed: int, flag_z: float, progress: bool = False) -> dict:
    """Every estimator's bias and spread at ref std ``s``, and alpha* from a large sample; a bias
    beyond ``flag_z`` standard errors is flagged significant (``progress``: count each audit's
    trials, seconds each at full size)."""
    testbed = _testbed(s)
    with torch.no_grad():
        big = testbed.sample(200_000, generator=make_generator(seed + 1))
        _, details = cv(
            big.logp, big.logp_ref, alpha="in-sample", density=True, return_details=True
        )
        diag = details.diagnostics
    row = {
        "ref_std": s,
        "var_r_finite": s * s < 2,
        "exact_kl": float(testbed.exact_kl().detach()),
        "alpha_large_sample": diag.alpha,
        "estimators": {},
    }
    for e in ESTIMATORS:
        a = audit_value(
            e,
            testbed,
            batch_size=BATCH,
            n_trials=trials,
            seed=seed,
            z_threshold=flag_z,
            progress=progress,
        )
        row["estimators"][e] = {
            "bias": a.bias,
            "se_bias": a.se_bias,
            "z": a.z,
            "std": a.std,
            "se_std": a.se_std,
            "significant_bias": a.significant,
        }
    return row


def _table(rows: list[dict], trials: int, flag_z: float) -> str:
    lines = [
        f"Batch {BATCH}, {trials} batches per cell. Each cell: stdev of the batch estimate / KL"
        f" (bias/KL ± se); * = bias beyond {flag_z:.2f} se (false-alarm rate 6.3e-5 for the"
        f" table: Bonferroni over its {len(rows) * len(ESTIMATORS)} comparisons).\n",
        "| ref std s | Var(r) | KL(pi‖ref) | alpha* (large sample) | "
        + " | ".join(ESTIMATORS)
        + " |",
        "|---|---|---|---|" + "---|" * len(ESTIMATORS),
    ]
    for r in rows:
        cells = []
        for e in ESTIMATORS:
            x = r["estimators"][e]
            flag = "*" if x["significant_bias"] else ""
            cells.append(
                f"{x['std'] / r['exact_kl']:.3g} ({x['bias'] / r['exact_kl']:+.3f} ± "
                f"{x['se_bias'] / r['exact_kl']:.3f}){flag}"
            )
        lines.append(
            f"| {r['ref_std']} | {'finite' if r['var_r_finite'] else 'infinite'} | "
            f"{r['exact_kl']:.4f} | {r['alpha_large_sample']:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def _summary(rows: list[dict], flag_z: float) -> str:
    """Which unbiased estimators the audit flags, where Var(r) is finite and where it is not."""

    def flagged(finite: bool) -> str:
        names = sorted(
            {
                e
                for r in rows
                if r["var_r_finite"] == finite
                for e in UNBIASED
                if r["estimators"][e]["significant_bias"]
            }
        )
        return ", ".join(names) if names else "none"

    return (
        f"Unbiased estimators with a mean more than {flag_z:.2f} se from the KL (a table-wide "
        f"false-alarm rate of 6.3e-5): where Var(r) is finite: "
        f"{flagged(True)}; where it is infinite: {flagged(False)} (there the sample mean is "
        "dominated by rare huge values, typical runs fall short, and 'se' means little). The "
        "fitted coefficient moves toward 0 as the tails grow."
    )


def run(config: RunConfig) -> Report:
    scales = (
        (0.8, 1.0, 1.3, 1.6, 2.5)
        if config.quick
        else (0.8, 1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 2.0, 2.5, 3.0)
    )
    trials = 400 if config.quick else 4000
    flag_z = table_threshold(len(scales) * len(ESTIMATORS))
    bar = progress_bar(scales, desc="control-variates", enabled=config.progress)
    rows = [_row(s, trials, config.seed, flag_z, config.progress) for s in bar]
    return Report(
        results={
            "experiment": "control-variates",
            "quick": config.quick,
            "seed": config.seed,
            "batch": BATCH,
            "trials": trials,
            "mean_ref": MEAN_REF,
            "flag_z": flag_z,
            "rows": rows,
        },
        table=_table(rows, trials, flag_z),
        figures={"heavy_tails": _figure(rows)},
        summary=_summary(rows, flag_z),
    )


def _figure(rows: list[dict]):
    plt = pyplot()

    s = np.array([r["ref_std"] for r in rows])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), layout="constrained")
    cmap = plt.get_cmap("tab10")
    for i, e in enumerate(ESTIMATORS):
        kl = np.array([r["exact_kl"] for r in rows])
        std = np.array([r["estimators"][e]["std"] for r in rows]) / kl
        se_std = np.array([r["estimators"][e]["se_std"] for r in rows]) / kl
        bias = np.array([r["estimators"][e]["bias"] for r in rows]) / kl
        se = np.array([r["estimators"][e]["se_bias"] for r in rows]) / kl
        axes[0].errorbar(s, std, yerr=se_std, marker="o", ms=3, capsize=2, color=cmap(i), label=e)
        axes[1].errorbar(
            s + 0.01 * i, bias, yerr=se, marker="o", ms=3, capsize=2, color=cmap(i), label=e
        )
    axes[2].plot(s, [r["alpha_large_sample"] for r in rows], "ko-")
    for ax in axes:
        ax.axvline(math.sqrt(2), color="grey", ls=":", lw=1)
    axes[0].set(
        yscale="log",
        xlabel="ref std s",
        ylabel="stdev of batch estimate / KL",
        title="Spread (Var(r) infinite right of the dotted line)",
    )
    axes[1].set(xlabel="ref std s", ylabel="bias / KL", title="Bias ± se")
    axes[1].axhline(0, color="k", lw=0.5)
    axes[2].set(xlabel="ref std s", ylabel="alpha*", title="Fitted coefficient (large sample)")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncol=len(ESTIMATORS),
        fontsize=8,
    )
    return fig


EXPERIMENT = Experiment(
    name="control-variates",
    description="Fitted control-variate coefficient vs k1 vs k3 under heavy tails",
    run=run,
)

__all__ = ["EXPERIMENT", "run"]
