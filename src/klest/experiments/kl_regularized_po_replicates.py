r"""Replicate studies of the KL-regularized PO frontier: the Rao-Blackwellized arm's share of the
reward-KL Pareto frontier, with a confidence interval.

One run of ``klest run kl-regularized-po --seed S`` is one study as the paper designed it (its own
reference model, 4 betas x 2 estimators x 5 seeds, :mod:`klest.experiments.kl_regularized_po`);
its frontier share is one number. The frontier's points are not independent draws (the share
of 13 points moves far less between studies than a binomial count of 13 would), so the
interval here is over *studies*: independent runs with disjoint seeds (``--seed 0, 5, 10, ...``),
their mean share and a Student-t 95% interval, to compare with the paper's 78% (95% for
KL < 5) and with an even split. The pooled frontier of every study's points is reported too.

Reference: "Better Estimation of the Kullback-Leibler Divergence Between Language Models" by
Afra Amini, Tim Vieira and Ryan Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from klest.experiments.kl_regularized_po import LOW_KL, PAPER_FRONTIER_SHARE, frontier_share
from klest.experiments.runner import Report, pyplot

__all__ = ["replicate_frontier", "t_quantile_975"]

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
_T975 += (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
_T975 += (2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile for ``df`` degrees of freedom (a table to 30, then the
    normal's 1.960 plus two terms of the Cornish-Fisher expansion, within 1e-3)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _interval(shares: Sequence[float]) -> dict[str, float]:
    x = np.asarray(shares, dtype=np.float64)
    n = len(x)
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "sd": math.nan, "low": math.nan, "high": math.nan, "studies": n}
    sd = float(x.std(ddof=1))
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "studies": n}


def replicate_frontier(results: Sequence[dict[str, Any]]) -> Report:
    """The RB arm's frontier share over replicate studies (module docstring).

    Args:
      results: each study's ``result.json`` of the full-size experiment (``quick`` False),
        with distinct seeds.

    Returns:
      A :class:`~klest.experiments.runner.Report`: per study and pooled shares, the mean and
      its 95% interval for the whole frontier and for KL < 5, whether each interval excludes
      0.5 and the paper's share; a markdown table; a figure of the studies' shares.
    """
    if not results:
        raise ValueError("results is empty: pass at least one study's result.json")
    results = sorted(results, key=lambda r: r["seed"])
    seeds = [r["seed"] for r in results]
    if len(set(seeds)) != len(seeds) or any(r["quick"] for r in results):
        raise ValueError(f"studies must be full-size runs with distinct seeds, got {seeds}")
    keys = ("all", f"kl<{LOW_KL:g}")
    studies = [{"seed": r["seed"], **{k: r["frontier"]["share"][k] for k in keys}} for r in results]
    points = [p for r in results for p in r["frontier"]["points"]]
    reward = np.array([p["reward"] for p in points])
    kl = np.array([p["kl"] for p in points])
    labels = [p["estimator"] for p in points]
    pooled = {
        keys[0]: frontier_share(reward, kl, labels),
        keys[1]: frontier_share(reward, kl, labels, kl_below=LOW_KL),
    }
    summary = {}
    for k in keys:
        iv = _interval([s[k]["rb"] for s in studies])
        paper = PAPER_FRONTIER_SHARE[k]["rb"]
        iv["excludes_half"] = not (iv["low"] <= 0.5 <= iv["high"])
        iv["excludes_paper"] = not (iv["low"] <= paper <= iv["high"])
        iv["paper"] = paper
        summary[k] = iv
    results_out = {"studies": studies, "pooled": pooled, "interval": summary}
    return Report(
        results_out,
        _table(studies, pooled, summary),
        {"frontier_shares": _figure(studies, summary)},
    )


def _table(studies: list[dict], pooled: dict, summary: dict) -> str:
    keys = list(summary)
    lines = [
        "| study seed | frontier points | RB share | points, KL < 5 | RB share, KL < 5 |",
        "|---|---|---|---|---|",
    ]
    for s in studies:
        a, b = (s[k] for k in keys)
        lines.append(
            f"| {s['seed']} | {a['points']} | {a['rb']:.3f} | {b['points']} | {b['rb']:.3f} |"
        )
    a, b = (pooled[k] for k in keys)
    lines.append(f"| pooled | {a['points']} | {a['rb']:.3f} | {b['points']} | {b['rb']:.3f} |")
    lines.append("")
    for k in keys:
        iv = summary[k]
        verdicts = [
            f"{'excludes' if iv['excludes_half'] else 'includes'} 0.5",
            f"{'excludes' if iv['excludes_paper'] else 'includes'} the paper's {iv['paper']:.2f}",
        ]
        lines.append(
            f"RB's share of the frontier ({k}) over {iv['studies']} studies: mean "
            f"{iv['mean']:.3f}, sd {iv['sd']:.3f}, 95% interval [{iv['low']:.3f}, "
            f"{iv['high']:.3f}]: {', '.join(verdicts)}."
        )
    return "\n".join(lines) + "\n"


def _figure(studies: list[dict], summary: dict) -> Any:
    plt = pyplot()
    keys = list(summary)
    fig, ax = plt.subplots(figsize=(6.5, 3.6), layout="constrained")
    for i, k in enumerate(keys):
        shares = [s[k]["rb"] for s in studies]
        jitter = np.linspace(-0.12, 0.12, len(shares))
        ax.plot(
            i + jitter,
            shares,
            "o",
            color="tab:blue",
            alpha=0.7,
            label="one study" if i == 0 else None,
        )
        iv = summary[k]
        ax.errorbar(
            i + 0.3,
            iv["mean"],
            yerr=[[iv["mean"] - iv["low"]], [iv["high"] - iv["mean"]]],
            fmt="s",
            color="black",
            capsize=4,
            label="mean, 95% interval" if i == 0 else None,
        )
        ax.hlines(
            iv["paper"],
            i - 0.3,
            i + 0.45,
            colors="tab:red",
            linestyles="--",
            label="paper" if i == 0 else None,
        )
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":", label="even split")
    ax.set(xticks=range(len(keys)), xticklabels=["whole frontier", "KL < 5"], ylim=(0, 1))
    ax.set(ylabel="RB's share of the frontier", title="KL-regularized PO: replicate studies")
    fig.legend(loc="outside right upper", fontsize=8)
    return fig
