r"""Gradient pitfalls of KL estimators on tabular autoregressive policies.

"On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi Munos
(2025, https://arxiv.org/abs/2506.09477) claims: autodiff of k1 has mean-zero gradient; autodiff
of the variance-reduced k3 descends the other KL; token-level losses miss the effect of early
tokens on later ones; the sequence-level ("cumulative") gradient with leave-one-out baselines is
right. ``+loo-fitted`` rows: the leave-one-out baseline times a scale cross-fitted on half of
the batch; ``+loo-ema`` rows: times a per-position scale fitted on earlier batches
(:class:`klest.LooScaleEMA`, one state per estimator, carried over the trials of part A and the
steps of B and C); both in :mod:`klest.sampled.baselines`, both meant never to do worse than
no baseline or the full one. On random tabular policies with
exact gradients (V = 3, T = 4, every sequence enumerable), three parts:

A. bias and MSE of each gradient estimator against the exact gradient of KL(pi||ref), as a
   function of the number of samples n, at low and high KL;
B. minimizing KL(pi||ref) with Adam from a random start: exact KL over steps;
C. maximizing E_pi[R] - beta KL(pi||ref) (the RLHF objective; the reward gradient is exact), whose
   optimum pi*(y) = ref(y) e^{R(y)/beta} / Z is known: exact KL(pi||pi*) over steps. An estimator
   that descends a different KL converges to a different policy here.

Beside the paper's estimators: ``k3/cumulative+exact-kl``, cumulative with each position's exact
KL as its baseline (vOPD's control variate, "KL for a KL: On-Policy Distillation with Control
Variate Baseline" by Minjae Oh et al., 2026, https://arxiv.org/abs/2605.07865).

Part A's verdicts test the mean gradient against the exact gradients of both KLs and against 0
(:func:`klest.audit_grad`) at a threshold Bonferroni-corrected over all of part A's tests for a
false-alarm rate of 6.3e-5 (:func:`~klest.experiments.runner.table_threshold`, one-sided: 5.26
at full size, 4.92 with ``--quick``); the table shows them at the largest n, where they have the
most power (``--quick``: n = 512, 100 batches). The statistic's null
(:func:`klest.audit.mean_shift_z`) is the weighted sum of chi-squares of the gradient
covariance's spectrum, right in its tail: simulated for these policies, its false-alarm rate at
these thresholds is within 2x of the nominal one (a normal approximation matched to two moments
was 70x too optimistic at 4.92, the few dominant directions making the tail heavy). The bias of
autodiff-k3 at high KL can stay within its noise (the ratio r = ref/pi has heavy tails): on some
random policies even 51200 samples do not tell its mean gradient from either KL's. Parts B and C
at ``--quick`` (60 steps, one seed) have not converged: part C's order is not reliable there.

Full size: 137 s on 2 shared CPU cores; ``--quick``: about 10 s.

The experiment only calls :func:`klest.kl_penalty` (via :class:`klest.audit.GradSpec`) and
:func:`klest.audit_grad`.
"""

from __future__ import annotations

import numpy as np
import torch

from klest._progress import progress_bar
from klest.audit import GradSpec, audit_grad
from klest.experiments.runner import (
    Experiment,
    Report,
    RunConfig,
    pyplot,
    series_styles,
    table_threshold,
)
from klest.testbeds import TabularAutoregressive, make_generator

VOCAB, HORIZON = 3, 4
ESTIMATORS = (
    "k1/autodiff",
    "k3/autodiff",
    "k3/token",
    "k3/score",
    "k3/score+loo",
    "k3/cumulative",
    "k3/cumulative+loo",
    "k3/cumulative+loo-fitted",
    "k3/cumulative+loo-ema",
    "rb/rb",
    "rb/rb+loo",
    "k3/cumulative+exact-kl",
)
TRAINERS = (
    "k1/autodiff",
    "k3/autodiff",
    "k3/token",
    "k3/score+loo",
    "k3/cumulative",
    "k3/cumulative+loo",
    "k3/cumulative+loo-fitted",
    "k3/cumulative+loo-ema",
    "rb/rb",
    "k3/cumulative+exact-kl",
)
REGIMES = {"low KL": 0.5, "high KL": 1.5}
BETA = 0.5


def _testbed(scale: float, seed: int) -> TabularAutoregressive:
    return TabularAutoregressive.random(VOCAB, HORIZON, scale=scale, seed=seed)


def _sizes(config: RunConfig) -> tuple[int, ...]:
    """Part A's batch sizes."""
    return (8, 512) if config.quick else (2, 4, 8, 16, 32, 64)


def _part_a(config: RunConfig, progress) -> dict:
    sizes = _sizes(config)
    policies = 1 if config.quick else 2
    trials = 100 if config.quick else 500
    # Three one-sided tests per audit (the claimed KL's gradient, the other's, zero).
    verdict_z = table_threshold(
        3 * len(REGIMES) * policies * len(ESTIMATORS) * len(sizes), two_sided=False
    )
    out: dict = {}
    for regime, scale in REGIMES.items():
        out[regime] = {"exact_kl": [], "estimators": {e: {} for e in ESTIMATORS}}
        for p in range(policies):
            testbed = _testbed(scale, config.seed + 100 * p)
            out[regime]["exact_kl"].append(float(testbed.exact_kl().detach()))
            for e in ESTIMATORS:
                for n in sizes:
                    a = audit_grad(
                        e,
                        testbed,
                        batch_size=n,
                        n_trials=trials,
                        seed=config.seed + n + 1000 * p,
                        z_threshold=verdict_z,
                    )
                    cell = out[regime]["estimators"][e].setdefault(str(n), [])
                    cell.append(
                        {
                            "rel_bias": a.rel_bias_debiased,
                            "rel_mse": a.mse / a.exact_norm**2,
                            "rel_variance": a.variance / a.exact_norm**2,
                            "z_target": a.z_target,
                            "z_other": a.z_other,
                            "z_zero": a.z_zero,
                            "verdict": a.verdict,
                        }
                    )
                    progress.update(1)
    out["sizes"] = list(sizes)
    out["verdict_z"] = verdict_z
    out["trials"] = trials
    out["policies"] = policies
    return out


def _train(
    testbed: TabularAutoregressive,
    spec: str | None,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    reward: torch.Tensor | None,
) -> list[float]:
    """Adam on pi's table; records exact KL(pi||ref) (B) or exact KL(pi||pi*) (C)."""
    opt = torch.optim.Adam(testbed.parameters(), lr=lr)
    gen = make_generator(seed)
    loss_fn = None if spec is None else GradSpec.parse(spec).build("pi||ref")
    log_opt = None
    if reward is not None:
        _, _, log_ref = testbed.sequence_log_probs()
        log_opt = torch.log_softmax(log_ref + reward / BETA, 0)
    curve = []
    for _ in range(steps):
        opt.zero_grad()
        # spec None: the exact gradient, for reference.
        kl = testbed.exact_kl() if spec is None else loss_fn(testbed.sample(batch, generator=gen))
        loss = kl if reward is None else BETA * kl
        if reward is not None:
            _, log_pi, _ = testbed.sequence_log_probs()
            loss = loss - (log_pi.exp() * reward).sum()
        loss.backward()
        opt.step()
        with torch.no_grad():
            if reward is None:
                curve.append(float(testbed.exact_kl()))
            else:
                _, log_pi, _ = testbed.sequence_log_probs()
                curve.append(float((log_pi.exp() * (log_pi - log_opt)).sum()))
    return curve


def _part_bc(config: RunConfig, progress, *, with_reward: bool) -> dict:
    steps = 60 if config.quick else 400
    seeds = 1 if config.quick else 3
    curves: dict = {}
    for spec in (None, *TRAINERS):
        name = "exact gradient" if spec is None else spec
        runs = []
        for s in range(seeds):
            testbed = _testbed(1.0, config.seed + 7 * s + 1)
            reward = None
            if with_reward:
                g = make_generator(config.seed + s)
                reward = torch.randn(VOCAB**HORIZON, generator=g, dtype=torch.float64)
            runs.append(
                _train(
                    testbed,
                    spec,
                    steps=steps,
                    lr=0.05,
                    batch=8,
                    seed=config.seed + s,
                    reward=reward,
                )
            )
            progress.update(1)
        curves[name] = runs
    return {"steps": steps, "seeds": seeds, "lr": 0.05, "batch": 8, "curves": curves}


def _tail(run: list[float]) -> float:
    k = max(1, len(run) // 10)
    return float(np.mean(run[-k:]))


def _cell_summary(cells: list[dict], trials: int) -> tuple[float, float]:
    """(relative bias with the noise removed, the Monte Carlo noise of the mean gradient relative
    to the exact gradient's norm, sqrt(rel. variance / trials)) of one audit."""
    cell = cells[0]
    return cell["rel_bias"], float(np.sqrt(cell["rel_variance"] / trials))


def _tables(a: dict, b: dict, c: dict) -> str:
    lines = []
    n_mse = "8" if "8" in a["high KL"]["estimators"]["k3/score"] else str(a["sizes"][0])
    n_verdict = str(a["sizes"][-1])  # the most samples: the most power
    for regime in REGIMES:
        kl = np.mean(a[regime]["exact_kl"])
        lines += [
            f"### A. Gradient of KL(pi||ref), {regime} (mean exact KL {kl:.2f}), "
            f"{a['trials']} trials x {a['policies']} policies\n",
            f"Bias, its noise and the verdict: one audit, at n = {n_verdict} samples (the most "
            f"power), first policy; MSE at n = {n_mse}, mean over the policies.\n",
            f"| estimator | relative bias at n = {n_verdict} (noise removed) | noise of the mean "
            f"(1 se) | verdict at n = {n_verdict} | relative MSE at n = {n_mse} |",
            "|---|---|---|---|---|",
        ]
        for e in ESTIMATORS:
            cells = a[regime]["estimators"][e]
            bias, noise = _cell_summary(cells[n_verdict], a["trials"])
            lines.append(
                f"| {e} | {bias:.3f} | {noise:.3f} | {cells[n_verdict][0]['verdict']} | "
                f"{np.mean([x['rel_mse'] for x in cells[n_mse]]):.3f} |"
            )
        lines.append("")
    lines += [
        f"Verdicts: the mean gradient tested against the exact gradients of both KLs and 0 at "
        f"{a['verdict_z']:.2f} (Bonferroni over all of part A's tests for a false-alarm rate of "
        "6.3e-5; the statistic's null is exact in its tail: see klest.audit.mean_shift_z). "
        "A bias within a few times its noise is not told from 0.\n"
    ]
    for title, part, metric in (
        ("B. Minimizing KL(pi||ref)", b, "exact KL(pi||ref)"),
        (f"C. Maximizing E[R] - {BETA} KL(pi||ref)", c, "exact KL(pi||pi*)"),
    ):
        lines += [
            f"### {title}: {metric}, mean of the last 10% of {part['steps']} Adam steps, "
            f"{part['seeds']} seeds\n",
            "| estimator | start | end |",
            "|---|---|---|",
        ]
        for name, runs in part["curves"].items():
            lines.append(
                f"| {name} | {np.mean([r[0] for r in runs]):.4f} | "
                f"{np.mean([_tail(r) for r in runs]):.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def _figures(a: dict, b: dict, c: dict) -> dict:
    plt = pyplot()
    from matplotlib.ticker import NullLocator

    styles = series_styles(ESTIMATORS)  # a colour and a marker each, no two alike
    exact = {"color": "k", "lw": 2.5}  # the exact gradient's curve (parts B and C)

    def line(name: str) -> dict:
        # Dashed: the biased estimators (autodiff and token-level).
        dashed = name.endswith(("autodiff", "token"))
        return {**styles[name], "ls": "--" if dashed else "-", "label": name}

    sizes = np.array(a["sizes"])
    fig_a, axes = plt.subplots(2, 2, figsize=(12, 8), layout="constrained")
    for col, regime in enumerate(REGIMES):
        for e in ESTIMATORS:
            cells = a[regime]["estimators"][e]
            mse = [np.mean([x["rel_mse"] for x in cells[str(n)]]) for n in sizes]
            bias = [np.mean([x["rel_bias"] for x in cells[str(n)]]) for n in sizes]
            axes[0, col].plot(sizes, mse, ms=4, **line(e))
            # A bias within the noise is 0 once the noise is removed: not drawn on a log axis.
            shown = [v if v > 0 else np.nan for v in bias]
            axes[1, col].plot(sizes, shown, ms=4, **line(e))
        axes[0, col].set(ylabel="MSE / |grad KL|^2", title=f"{regime}: gradient MSE")
        axes[1, col].set(
            ylabel="|bias| / |grad KL|",
            title=f"{regime}: bias (Monte Carlo noise removed; 0 not drawn)",
        )
        for ax in axes[:, col]:
            ax.set(xscale="log", yscale="log", xlabel="samples n")
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.xaxis.set_minor_locator(NullLocator())
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig_a.legend(handles, labels, loc="outside right upper", fontsize=8)

    fig_bc, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    for ax, part, ylabel, title in (
        (axes[0], b, "exact KL(pi||ref)", "B. minimizing KL(pi||ref)"),
        (axes[1], c, "exact KL(pi||pi*)", f"C. maximizing E[R] - {BETA} KL(pi||ref)"),
    ):
        for name, runs in part["curves"].items():
            mean = np.mean(np.array(runs), 0)
            if name == "exact gradient":
                ax.plot(mean, label=name, **exact)
            else:
                every = max(1, len(mean) // 8)
                ax.plot(mean, lw=1.2, ms=4, markevery=every, **line(name))
        ax.set(yscale="log", xlabel="Adam step", ylabel=ylabel, title=title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig_bc.legend(handles, labels, loc="outside right upper", fontsize=8)
    return {"gradient_bias_mse_vs_samples": fig_a, "kl_minimization_curves": fig_bc}


def run(config: RunConfig) -> Report:
    torch.set_num_threads(1)  # thousands of tiny ops: threads only add overhead
    sizes = len(_sizes(config))
    policies = 1 if config.quick else 2
    seeds = 1 if config.quick else 3
    total = len(REGIMES) * policies * len(ESTIMATORS) * sizes + 2 * seeds * (len(TRAINERS) + 1)
    with progress_bar(total=total, desc="pitfalls", enabled=config.progress) as bar:
        a = _part_a(config, bar)
        b = _part_bc(config, bar, with_reward=False)
        c = _part_bc(config, bar, with_reward=True)
    final_c = {name: np.mean([_tail(r) for r in runs]) for name, runs in c["curves"].items()}
    results = {
        "experiment": "pitfalls",
        "quick": config.quick,
        "seed": config.seed,
        "vocab": VOCAB,
        "horizon": HORIZON,
        "regimes": REGIMES,
        "beta": BETA,
        "A_gradient_bias_mse": a,
        "B_kl_minimization": b,
        "C_reward_kl": c,
        "C_final_kl_to_optimum": final_c,
    }
    # Stochastic gradients leave Adam a noise floor: compare with the best unbiased one (rb).
    floor = final_c["rb/rb"]
    wrong = [n for n, v in final_c.items() if v > 3 * floor]
    summary = (
        f"Part C: estimators ending more than 3x farther from the optimum pi* than rb/rb "
        f"(KL(pi||pi*) = {floor:.3g}): {', '.join(wrong) if wrong else 'none'}."
    )
    if config.quick:
        summary += " (--quick: 60 steps and one seed, not converged: this list is not reliable.)"
    return Report(results, _tables(a, b, c), _figures(a, b, c), summary)


EXPERIMENT = Experiment(
    name="pitfalls",
    description="KL gradient pitfalls: bias/MSE vs samples, KL minimization and reward-KL curves",
    run=run,
)

__all__ = ["EXPERIMENT", "run"]
