r"""The Chimera estimator: gradient variance vs dimension, and training curves.

Reproduces "The Chimera Estimator" by Kirato Yoshihara (2026,
https://kiratoyoshihara.github.io/essays/chimera-kl.html).

pi = N(mu, I) in D dimensions (trainable mu, init 0.05 per coordinate), ref = N(0, I),
reparameterized samples x = mu + eps, batches of B = 32. Estimators, as value/gradient pairs of
:func:`klest.kl_penalty`:

- ``k1``: value k1, pathwise gradient (autodiff of k1);
- ``k3``: value k3 with Schulman's ratio r = ref/pi, autodiff of k3;
- ``k3 (essay code)``: the essay's code uses r = pi/ref inside k3 (biased value), autodiff;
- ``chimera``: value k3, gradient of k1 (``decouple(k3, k1)``);
- ``adaptive``: value k3, gradient of k1 + c (k3 - k1) with c fitted on the other samples
  (``grad="adaptive"``, :mod:`klest.sampled.baselines`): k3's gradient at small D, k1's at large D;
- ``chimera + stl``: value k3, k1's gradient with "sticking the landing" (pi's density
  parameters stopped; x = mu + eps still differentiable). Not in the essay: added because here its
  gradient is exactly mu, with zero variance at every D.

Closed forms of the per-coordinate variance of the batch gradient w.r.t. mu_d (with
m^2 = ||mu||^2), derived by Gaussian tilting,
E[e^{k a.eps} f(eps)] = e^{k^2|a|^2/2} E[f(eps + k a)]:

- k1 and chimera: grad = mu + eps, variance exactly 1/B (it does not vanish at the optimum:
  Adam then hovers at a noise floor, while k3's noise vanishes as r -> 1);
- chimera + stl: grad = mu exactly, variance 0;
- adaptive at a fixed c: grad = (1 - c r)(mu + eps): (1 - 2c + c^2 e^{m^2}(1 + mu_d^2)) / B,
  least at c = e^{-m^2} / (1 + mu_d^2); at klest's target c = e^{-m^2}
  (1 - e^{-m^2}(1 - mu_d^2)) / B, below both k1's and k3's at every D (the fitted c adds its
  noise: Monte Carlo);
- k3: grad = (1 - r)(mu + eps), r = e^{-mu.eps - m^2/2}: (e^{m^2}(1 + mu_d^2) - 1) / B;
- k3 (essay code): grad = (r' - 1)(mu + eps), r' = 1/r:
  (e^{3m^2}(9 mu_d^2 + 1) - 2 e^{m^2}(4 mu_d^2 + 1) + mu_d^2 + 1 - (2e^{m^2} - 1)^2 mu_d^2) / B.

So the essay's 1e14 at D = 5000 is its inverted ratio (e^{3 m^2}); with Schulman's ratio the
variance at D = 5000 is ~8e3: still exploding, about 11 orders of magnitude less (6e14 against
8e3). Monte Carlo with a few hundred trials underestimates heavy-tailed variances; both are
shown.

Full size, on a busy 2-core machine: ``klest run chimera-variance`` 20 s, ``klest run
chimera-training`` 172 s.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from klest._progress import progress_bar
from klest.audit import gradient_draws
from klest.experiments.runner import Experiment, Report, RunConfig, pyplot
from klest.sampled.penalty import KLGradientWarning, kl_penalty
from klest.testbeds import GaussianTestbed, make_generator
from klest.testbeds.base import Sample

BATCH = 32
MU0 = 0.05
ESTIMATORS = ("k1", "k3", "k3 (essay code)", "chimera", "chimera + stl", "adaptive")
COLORS = {
    "k1": "tab:red",
    "k3": "tab:green",
    "k3 (essay code)": "tab:olive",
    "chimera": "tab:blue",
    "chimera + stl": "tab:purple",
    "adaptive": "tab:orange",
}
# Variances are drawn on a log scale: an exact 0 is shown at this floor.
PLOT_FLOOR = 1e-6


def loss(estimator: str, sample: Sample) -> torch.Tensor:
    """The training loss of one estimator on one batch (mean over the batch)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)
        rep = {"reparameterized": True}
        if estimator == "k1":
            return kl_penalty(sample.logp, sample.logp_ref, estimator="k1", grad="pathwise", **rep)
        if estimator == "k3":
            return kl_penalty(sample.logp, sample.logp_ref, estimator="k3", grad="autodiff", **rep)
        if estimator == "chimera":
            return kl_penalty(sample.logp, sample.logp_ref, estimator="k3", grad="pathwise", **rep)
        if estimator == "adaptive":
            return kl_penalty(sample.logp, sample.logp_ref, estimator="k3", grad="adaptive", **rep)
        if estimator == "chimera + stl":
            return kl_penalty(
                sample.logp,
                sample.logp_ref,
                estimator="k3",
                grad="stl",
                logp_stl=sample.logp_stl,
                **rep,
            )
        # The essay's code: r = pi/ref inside k3, i.e. k3 with the arguments swapped.
        return kl_penalty(sample.logp_ref, sample.logp, estimator="k3", grad="autodiff", **rep)


def closed_form_variance(estimator: str, dim: int, mu: float = MU0, batch: int = BATCH) -> float:
    """Per-coordinate variance of the batch-mean gradient w.r.t. mu (see the module docstring)."""
    m2 = dim * mu * mu
    if estimator == "chimera + stl":
        return 0.0
    if estimator in ("k1", "chimera"):
        return 1.0 / batch
    if estimator == "adaptive":  # at the population coefficient c = e^{-m^2}
        return (1 - math.exp(-m2) * (1 - mu * mu)) / batch
    if estimator == "k3":
        return (math.exp(m2) * (1 + mu * mu) - 1) / batch
    second = (
        math.exp(3 * m2) * (9 * mu * mu + 1) - 2 * math.exp(m2) * (4 * mu * mu + 1) + mu * mu + 1
    )
    return (second - (2 * math.exp(m2) - 1) ** 2 * mu * mu) / batch


def _variance_run(config: RunConfig) -> Report:
    torch.set_num_threads(1)  # thousands of small batches: threads only add overhead
    dims = (1, 10, 100, 1000) if config.quick else (1, 10, 50, 100, 500, 1000, 2000, 5000)
    trials = 100 if config.quick else 300
    rows = []
    bar = progress_bar(
        total=len(dims) * len(ESTIMATORS), desc="chimera-variance", enabled=config.progress
    )
    for dim in dims:
        row = {"D": dim}
        bar.set_postfix_str(f"D = {dim}")
        for e in ESTIMATORS:
            testbed = GaussianTestbed.chimera(dim, MU0)
            draws = gradient_draws(
                lambda s, e=e: loss(e, s),
                testbed,
                batch_size=BATCH,
                n_trials=trials,
                seed=config.seed + dim,
                progress=config.progress,  # at D = 5000 one estimator's draws take seconds
                label=e,
            )
            per_coord = draws[:, :dim].var(0)  # gradients w.r.t. mu only
            row[e] = {
                "monte_carlo": float(per_coord.mean()),
                "closed_form": closed_form_variance(e, dim),
            }
            bar.update(1)
        rows.append(row)
    bar.close()
    table = [
        "| D | " + " | ".join(f"{e} MC | {e} closed form" for e in ESTIMATORS) + " |",
        "|---|" + "---|---|" * len(ESTIMATORS),
    ]
    for r in rows:
        cells = " | ".join(
            f"{r[e]['monte_carlo']:.3g} | {r[e]['closed_form']:.3g}" for e in ESTIMATORS
        )
        table.append(f"| {r['D']} | {cells} |")
    flat = all(abs(r[e]["monte_carlo"] * BATCH - 1) < 0.25 for r in rows for e in ("k1", "chimera"))
    # Adaptive against the better of k1 and k3 (closed forms), with 10% for Monte Carlo noise.
    adaptive_best = all(
        r["adaptive"]["monte_carlo"] <= 1.1 * min(r["k1"]["closed_form"], r["k3"]["closed_form"])
        for r in rows
    )
    summary = (
        f"k1 and chimera: per-coordinate variance {'flat at 1/B' if flat else 'NOT flat'} "
        f"(1/B = {1 / BATCH:.4f}); k3 grows like e^(D mu^2), the essay code's k3 like e^(3 D mu^2);"
        f" adaptive {'at most' if adaptive_best else 'NOT at most'} the better of k1 and k3."
    )
    return Report(
        results={
            "experiment": "chimera-variance",
            "quick": config.quick,
            "seed": config.seed,
            "batch": BATCH,
            "mu0": MU0,
            "trials": trials,
            "rows": rows,
            "k1_and_chimera_flat": flat,
            "adaptive_at_most_best": adaptive_best,
        },
        table="\n".join(table) + "\n",
        figures={"gradient_variance_vs_dimension": _variance_figure(rows)},
        summary=summary,
    )


def _variance_figure(rows: list[dict]):
    plt = pyplot()

    dims = np.array([r["D"] for r in rows])
    grid = np.geomspace(dims.min(), dims.max(), 200)
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    for e in ESTIMATORS:
        # k1 and chimera have identical gradients: k1 drawn as larger hollow markers.
        hollow = {"mfc": "none", "ms": 10} if e == "k1" else {"ms": 5}
        ax.plot(
            dims,
            [max(r[e]["monte_carlo"], PLOT_FLOOR) for r in rows],
            "o",
            color=COLORS[e],
            label=f"{e} (Monte Carlo)",
            **hollow,
        )
        ax.plot(
            grid,
            [max(closed_form_variance(e, round(d)), PLOT_FLOOR) for d in grid],
            "-",
            color=COLORS[e],
            alpha=0.7,
            label=f"{e} (closed form)",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="dimension D",
        ylabel="per-coordinate gradient variance",
        title=f"Gradient variance vs D (B={BATCH}, mu={MU0}; 0 drawn at {PLOT_FLOOR:g})",
    )
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=7)
    return fig


def _training_run(config: RunConfig) -> Report:
    torch.set_num_threads(1)
    dims = (10, 1000) if config.quick else (10, 100, 500, 1000, 2000, 5000)
    steps = 300 if config.quick else 2000
    every = max(1, steps // 100)
    curves = {}
    jobs = [(d, e) for d in dims for e in ESTIMATORS]
    # One unit per Adam step: a job at D = 5000 takes seconds.
    bar = progress_bar(total=len(jobs) * steps, desc="chimera-training", enabled=config.progress)
    for dim, e in jobs:
        bar.set_postfix_str(f"D = {dim}, {e}")
        testbed = GaussianTestbed.chimera(dim, MU0)
        opt = torch.optim.Adam([testbed.mean], lr=0.02)
        gen = make_generator(config.seed)
        kl, value = [], []
        for step in range(steps):
            opt.zero_grad()
            out = loss(e, testbed.sample(BATCH, generator=gen))
            out.backward()
            testbed.log_std.grad = None
            opt.step()
            if step % every == 0 or step == steps - 1:
                kl.append(float(testbed.exact_kl().detach()))
                value.append(float(out.detach()))
            bar.update(1)
        curves[f"{dim}/{e}"] = {
            "D": dim,
            "estimator": e,
            "exact_kl": kl,
            "loss": value,
            "initial_kl": dim * MU0 * MU0 / 2,
        }
    bar.close()
    table = [
        "| D | initial KL | " + " | ".join(f"final KL: {e}" for e in ESTIMATORS) + " |",
        "|---|---|" + "---|" * len(ESTIMATORS),
    ]
    for dim in dims:
        finals = " | ".join(f"{curves[f'{dim}/{e}']['exact_kl'][-1]:.3g}" for e in ESTIMATORS)
        table.append(f"| {dim} | {dim * MU0 * MU0 / 2:.3g} | {finals} |")
    return Report(
        results={
            "experiment": "chimera-training",
            "quick": config.quick,
            "seed": config.seed,
            "steps": steps,
            "record_every": every,
            "lr": 0.02,
            "batch": BATCH,
            "curves": curves,
        },
        table="\n".join(table) + "\n",
        figures={"training_curves": _training_figure(curves, dims, every)},
        summary="Exact KL(pi||ref) = ||mu||^2/2 after Adam (lr 0.02) with each estimator.",
    )


def _training_figure(curves: dict, dims: tuple[int, ...], every: int):
    plt = pyplot()

    cols = min(3, len(dims))
    rows = math.ceil(len(dims) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols + 1.5, 3.4 * rows), squeeze=False, layout="constrained"
    )
    for ax, dim in zip(axes.flat, dims, strict=False):
        for e in ESTIMATORS:
            kl = curves[f"{dim}/{e}"]["exact_kl"]
            # k1 and chimera share their gradient: k1 drawn wide and dashed beneath it.
            style = {"ls": "--", "lw": 3} if e == "k1" else {"lw": 1.3}
            ax.plot(np.arange(len(kl)) * every, kl, color=COLORS[e], label=e, **style)
        ax.set(yscale="log", title=f"D = {dim}", xlabel="step", ylabel="exact KL(pi||ref)")
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    for ax in list(axes.flat)[len(dims) :]:
        ax.axis("off")
    return fig


VARIANCE = Experiment(
    name="chimera-variance",
    description="Chimera estimator: per-coordinate gradient variance vs dimension, closed forms",
    run=_variance_run,
)
TRAINING = Experiment(
    name="chimera-training",
    description="Chimera estimator: Adam training curves of k1, k3, chimera across dimensions",
    run=_training_run,
)

__all__ = ["TRAINING", "VARIANCE", "closed_form_variance", "loss"]
