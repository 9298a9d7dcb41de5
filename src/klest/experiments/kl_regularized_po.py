r"""KL-regularized policy optimization of a small LM: Monte Carlo vs Rao-Blackwellized KL.

Reproduces, on GPT-2 models trained here, the RLHF experiment of "Better Estimation of the
Kullback-Leibler Divergence Between Language Models" by Afra Amini, Tim Vieira and Ryan Cotterell
(NeurIPS 2025, https://arxiv.org/abs/2504.10637; code https://github.com/rycolab/kl-rb): a policy
pi, started at the reference ref, maximizes

.. math:: J(\pi) = E_{x}\, E_{y\sim\pi(\cdot|x)}[r(x, y)] - \beta\, KL(\pi(\cdot|x)\|ref(\cdot|x))

by RLOO (REINFORCE with a leave-one-out baseline): K completions :math:`y_1..y_K \sim \pi(\cdot|x)`
per prompt, advantage :math:`A_i = r_i - \frac{1}{K-1}\sum_{j\ne i} r_j`, and the loss

.. math:: L = -\frac{1}{N}\sum_i \mathrm{sg}(A_i) \sum_t \log\pi(y_{i,t}|x, y_{i,<t})
          + \beta\, \texttt{kl\_penalty}(\ldots)

whose reward part is the same in both arms. The arms differ only in the KL term:

- ``mc``: ``kl_penalty(estimator="k1", grad="score", baseline="loo", group=prompt ids)``: the
  sequence log-ratio :math:`\delta_i = \sum_t \log\pi(y_{i,t}) - \log ref(y_{i,t})` as the value,
  and as the gradient the sequence score times :math:`\delta_i` minus the leave-one-out mean of
  the other :math:`\delta_j`. This is *exactly* the common "KL in the reward" form (TRL's RLOO,
  which the paper trains with): RLOO on the reward :math:`r_i - \beta\delta_i`, since the
  leave-one-out advantage is linear in the reward (the tests check that the two gradients
  agree). It is the paper's MC estimator; klest's ``grad="cumulative"`` (each
  token's score times the log-ratios from it on) would be a better MC baseline, left out to keep
  the paper's comparison and the run time.
- ``rb``: ``kl_penalty(estimator="rb", grad="rb", baseline="loo", group=...)`` with both models'
  logits: the exact next-token KL at every position along the samples as the value, and the
  Rao-Blackwellized gradient :math:`\sum_n \nabla KL_n + \sum_m s_m(\sum_{n>m} KL_n - b_m)`.

Both gradients are unbiased for :math:`\nabla KL(\pi\|ref)`; RB's has lower variance. The two arms
use the same prompts and the same sampler seed at each step (the policies differ after the first
step, so the samples do too), the same optimizer (Adam), learning rate and batch. At the first
step pi = ref: both KL terms and their gradients are exactly 0, so every arm and every beta
takes the same first step.

Models: ref is GPT-2 (:data:`~klest.experiments.small_lms.STUDENT` shape) trained on NEUTRAL
reviews (:mod:`klest.experiments.reviews`); the policy starts as a copy of it. Prompts: NEUTRAL
reviews cut 2 tokens after ``<bos>`` (``the NOUN`` or ``i VERB``), fresh every step. Reward: the
:func:`~klest.experiments.reviews.sentiment` of the completion, in [-1, 1] (positive reviews
wanted). Tracked every few steps on *held-out* samples (fresh prompts and completions from their
own generator, not the training batch): the mean reward and KL(pi||ref) by the RB estimate
(the exact next-token KLs summed along each completion, averaged over completions), each with its
standard error (independent draws: sd / sqrt(n)); the MC (k1) estimate on the same samples is
kept too, as a check. The final point of a run is a larger held-out evaluation.

Reported: reward and KL curves per beta and estimator (mean and sd across seeds), the final
reward and KL, and the Pareto frontier of all final points (higher reward, lower KL; among all
betas, estimators and seeds): the share of it each estimator holds, overall and for KL < 5 (the
paper: RB 78% overall, 95% for KL < 5). And, to see where the estimators' difference goes, the
noise of the training gradient at the end of seed 0's runs: the total variance across batches of
the reward term's gradient, of beta times each KL term's, of each arm's whole gradient, and the
cross term Var(whole) - Var(reward) - Var(beta x KL), negative where the KL term's gradient
cancels the reward term's noise (MC's log-ratio does where the policy has learned to favour the
rewarded completions: it is then correlated with the reward).

Full size: ``klest run kl-regularized-po``: ref of the STUDENT shape trained 600 steps (cached
under ``runs/_models``, about 15 seconds); betas 0.01, 0.03, 0.1, 0.3 (final KL 1 to 4.5 nats);
5 seeds; 150 Adam steps (learning rate 1e-3) of 16 prompts x K = 4 completions; held-out
evaluation every 10 steps on 128 fresh prompts, 512 at the end; the gradient-noise study on 30
batches at the end of seed 0's runs. 7 to 10 minutes on 2 CPU cores (404 s on a quiet machine;
ref cached). ``--quick`` (ref trained 300 steps in a temporary folder, betas 0 and 1, 2 seeds, 24
steps of 8 x 4 at learning rate 2e-3) takes about 20 to 30 seconds.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.experiments.reviews import NEUTRAL, sample_reviews, sentiment
from klest.experiments.runner import Experiment, Report, RunConfig, pyplot
from klest.experiments.small_lms import (
    STUDENT,
    Architecture,
    Batch,
    Training,
    completion_log_probs,
    sample_completions,
    small_lm_session,
    trained_gpt2,
)
from klest.sampled.baselines import group_baseline
from klest.sampled.estimators import kl_estimate
from klest.sampled.groups import group_keys
from klest.sampled.penalty import kl_penalty

ESTIMATORS = ("mc", "rb")
KL_PENALTIES: dict[str, dict[str, str]] = {
    "mc": {"estimator": "k1", "grad": "score"},
    "rb": {"estimator": "rb", "grad": "rb"},
}
"""The KL term of each arm: ``kl_penalty``'s value and gradient estimators (both with the
leave-one-out baseline within each prompt's K completions)."""
PROMPT_TOKENS = 2
LOW_KL = 5.0
"""The paper's low-KL region of the Pareto frontier (KL < 5 nats)."""
PAPER_FRONTIER_SHARE = {"all": {"rb": 0.78, "mc": 0.22}, f"kl<{LOW_KL:g}": {"rb": 0.95, "mc": 0.05}}


@dataclass(frozen=True)
class Sizes:
    """How big a run is: the reference model, the grid and the training of each run."""

    arch: Architecture
    ref_steps: int
    betas: tuple[float, ...]
    seeds: int
    steps: int
    prompts: int  # per step
    samples: int  # K completions per prompt
    lr: float
    eval_every: int
    eval_samples: int  # held-out completions (one per fresh prompt) at each evaluation
    final_samples: int  # the same at the end of a run
    noise_draws: int  # batches for the gradient-noise study at the end of seed 0's runs


FULL = Sizes(STUDENT, 600, (0.01, 0.03, 0.1, 0.3), 5, 150, 16, 4, 1e-3, 10, 128, 512, 30)
QUICK = Sizes(STUDENT, 300, (0.0, 1.0), 2, 24, 8, 4, 2e-3, 6, 128, 256, 8)


def rloo_advantages(rewards: Tensor, group: Tensor) -> Tensor:
    r"""RLOO advantages :math:`A_i = r_i - \frac{1}{K-1}\sum_{j\ne i, g_j = g_i} r_j`.

    ``rewards`` ``[N]``, ``group`` ``[N]`` integer prompt ids; a completion alone in its group
    gets its own reward (baseline 0). The baseline is klest's leave-one-out group baseline.
    """
    valid = torch.ones_like(rewards, dtype=torch.bool).unsqueeze(-1)
    baseline = group_baseline(rewards.unsqueeze(-1), valid, "loo", group_keys(group))
    return rewards - baseline[:, 0]


def loss_terms(
    policy: Any, ref: Any, batch: Batch, group: Tensor, *, estimators: tuple[str, ...] = ESTIMATORS
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """On one batch of completions: the REINFORCE term with RLOO advantages, each estimator's
    KL term (:data:`KL_PENALTIES`: value forward, gradient backward), and the rewards ``[N]``."""
    unknown = [e for e in estimators if e not in KL_PENALTIES]
    if unknown:
        raise ValueError(f"estimators must be among {sorted(KL_PENALTIES)}, got {unknown}")
    logits, logp = completion_log_probs(policy, batch)
    with torch.no_grad():
        logits_ref, logp_ref = completion_log_probs(ref, batch)
    rewards = sentiment(batch.tokens[:, batch.k :], batch.mask).double()
    reinforce, kls = rloo_kl_terms(
        logp, logp_ref, logits, logits_ref, batch.mask, rewards, group, estimators=estimators
    )
    return reinforce, kls, rewards


def rloo_kl_terms(
    logp: Tensor,
    logp_ref: Tensor,
    logits: Tensor,
    logits_ref: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group: Tensor,
    *,
    estimators: tuple[str, ...] = ESTIMATORS,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""The two parts of the training loss from any policy's scores: the REINFORCE term with
    RLOO advantages, :math:`-\frac{1}{N}\sum_i A_i\sum_t\log\pi(y_{i,t})`, and each
    estimator's KL term (:data:`KL_PENALTIES`, leave-one-out within ``group``). ``logp``,
    ``logp_ref``, ``mask`` ``[N, L]``, ``logits``, ``logits_ref`` ``[N, L, V]`` (pi's with its
    graph), ``rewards`` and ``group`` ``[N]``."""
    reinforce = -(rloo_advantages(rewards, group) * logp.sum(-1)).mean()
    kls = {
        est: kl_penalty(
            logp,
            logp_ref,
            **KL_PENALTIES[est],
            mask=mask,
            baseline="loo",
            group=group,
            logits=logits,
            logits_ref=logits_ref,
        )
        for est in estimators
    }
    return reinforce, kls


def policy_loss(
    policy: Any,
    ref: Any,
    batch: Batch,
    group: Tensor,
    *,
    beta: float,
    estimator: str,
) -> tuple[Tensor, dict[str, float]]:
    """The RLOO loss with ``beta`` times the arm's KL term, on one batch of completions.

    Returns the loss (with pi's graph) and the batch's mean reward and KL value estimate.
    """
    reinforce, kls, rewards = loss_terms(policy, ref, batch, group, estimators=(estimator,))
    kl = kls[estimator]
    stats = {"reward": float(rewards.mean()), "kl_estimate": float(kl.detach())}
    return reinforce + beta * kl, stats


def gradient_noise(
    policy: Any, ref: Any, *, beta: float, sizes: Sizes, seed: int, progress: bool = False
) -> dict[str, float]:
    """The total variance (the sum over pi's parameters of each coordinate's variance across
    ``sizes.noise_draws`` independent training batches) of the parts of the training gradient
    at ``policy``: the reward term's (``"reward"``), beta times each estimator's KL term's
    (``"kl/mc"``, ``"kl/rb"``), and each arm's whole gradient (``"total/mc"``, ``"total/rb"``),
    all from the same batches. ``progress``: count the batches (seconds each at full size)."""
    params = list(policy.parameters())
    group = torch.arange(sizes.prompts).repeat_interleave(sizes.samples)
    draws: dict[str, list[Tensor]] = {"reward": []}
    batches = progress_bar(
        range(sizes.noise_draws), desc="gradient noise", leave=False, enabled=progress
    )
    for d in batches:
        gen = _generator(seed, d, 2)
        rows = prompts(sizes.prompts, generator=gen).repeat_interleave(sizes.samples, 0)
        batch = sample_completions(policy, rows, generator=gen)
        reinforce, kls, _ = loss_terms(policy, ref, batch, group)

        def flat(loss: Tensor) -> Tensor:
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            return torch.cat([g.reshape(-1) for g in grads]).double()

        g_reward = flat(reinforce)
        draws["reward"].append(g_reward)
        for est, kl in kls.items():
            g_kl = beta * flat(kl)
            draws.setdefault(f"kl/{est}", []).append(g_kl)
            draws.setdefault(f"total/{est}", []).append(g_reward + g_kl)
    return with_cross_terms({name: float(torch.stack(v).var(0).sum()) for name, v in draws.items()})


def with_cross_terms(noise: dict[str, float]) -> dict[str, float]:
    """``noise`` with each arm's cross term ``"cross/EST"`` = Var(whole) - Var(reward term) -
    Var(beta x KL term), twice the summed covariance of the two parts: negative where the KL
    term's gradient cancels the reward term's noise."""
    out = dict(noise)
    for est in ESTIMATORS:
        if f"total/{est}" in noise:
            out[f"cross/{est}"] = noise[f"total/{est}"] - noise["reward"] - noise[f"kl/{est}"]
    return out


def prompts(n: int, *, generator: torch.Generator) -> Tensor:
    """``n`` NEUTRAL review prefixes: ``<bos>`` and the first :data:`PROMPT_TOKENS` tokens."""
    return sample_reviews(NEUTRAL, n, generator=generator)[:, : PROMPT_TOKENS + 1]


@torch.no_grad()
def held_out(policy: Any, ref: Any, n: int, *, generator: torch.Generator) -> dict[str, float]:
    """Mean reward and KL(pi||ref) (RB and MC estimates) over ``n`` fresh prompts, one
    completion each, with their standard errors (independent draws: sd / sqrt(n))."""
    batch = sample_completions(policy, prompts(n, generator=generator), generator=generator)
    logits, logp = completion_log_probs(policy, batch)
    logits_ref, logp_ref = completion_log_probs(ref, batch)
    common = {"mask": batch.mask, "reduction": "per-sequence"}
    per_sequence = {
        "reward": sentiment(batch.tokens[:, batch.k :], batch.mask).double(),
        "kl": kl_estimate(
            logp, logp_ref, estimator="rb", logits=logits, logits_ref=logits_ref, **common
        ),
        "kl_mc": kl_estimate(logp, logp_ref, estimator="k1", **common),
    }
    out = {}
    for name, v in per_sequence.items():
        out[name] = float(v.mean())
        out[f"{name}_se"] = float(v.std() / math.sqrt(n))
    out["kl_mc_minus_rb"] = float((per_sequence["kl_mc"] - per_sequence["kl"]).mean())
    out["kl_mc_minus_rb_se"] = float(
        (per_sequence["kl_mc"] - per_sequence["kl"]).std() / math.sqrt(n)
    )
    return out


def _generator(seed: int, step: int, stream: int) -> torch.Generator:
    """The generator of one step of one seed (streams: 0 training, 1 held out, 2 gradient
    noise); the same for every arm and beta."""
    return torch.Generator().manual_seed(1_000_003 * seed + 3 * step + stream)


def train(
    ref: Any, *, beta: float, estimator: str, seed: int, sizes: Sizes, bar: Any = None
) -> tuple[dict[str, Any], Any]:
    """One RLOO run from pi = ref: curves of the training batch and of held-out evaluations;
    and the trained policy."""
    policy = copy.deepcopy(ref).train(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=sizes.lr)
    group = torch.arange(sizes.prompts).repeat_interleave(sizes.samples)
    curves: dict[str, list[float]] = {"reward": [], "kl_estimate": []}
    evals: list[dict[str, float]] = []
    for step in range(sizes.steps + 1):
        if step % sizes.eval_every == 0 or step == sizes.steps:
            n = sizes.final_samples if step == sizes.steps else sizes.eval_samples
            measured = held_out(policy, ref, n, generator=_generator(seed, step, 1))
            evals.append({"step": step, **measured})
        if step == sizes.steps:
            break
        gen = _generator(seed, step, 0)
        rows = prompts(sizes.prompts, generator=gen).repeat_interleave(sizes.samples, 0)
        batch = sample_completions(policy, rows, generator=gen)
        loss, stats = policy_loss(policy, ref, batch, group, beta=beta, estimator=estimator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        for k, v in stats.items():
            curves[k].append(v)
        if bar is not None:
            bar.update(1)
    held = {k: [e[k] for e in evals] for k in evals[0]}
    return {"train": curves, "held_out": held, "final": evals[-1]}, policy


def pareto_front(reward: np.ndarray, kl: np.ndarray) -> np.ndarray:
    """Which points are on the Pareto frontier of (higher reward, lower KL): bool ``[n]``.

    A point is dominated when another has reward >= and KL <= with at least one strict; the
    frontier is the points no other dominates (exact duplicates both stay). One sort by KL
    (ties: highest reward first) and a sweep keeping the best reward at lower KL.
    """
    reward, kl = np.asarray(reward, dtype=np.float64), np.asarray(kl, dtype=np.float64)
    if reward.shape != kl.shape or reward.ndim != 1:
        raise ValueError(f"reward and kl must be 1-D of one shape, got {reward.shape}, {kl.shape}")
    if not (np.isfinite(reward).all() and np.isfinite(kl).all()):
        raise ValueError("reward and kl must be finite")
    order = np.lexsort((-reward, kl))
    front = np.zeros(reward.shape, dtype=bool)
    best = -np.inf  # the highest reward among points of strictly lower KL
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and kl[order[j]] == kl[order[i]]:
            j += 1
        top = reward[order[i]]  # the highest reward at this KL
        if top > best:
            tied = order[i:j]
            front[tied] = reward[tied] == top
            best = top
        i = j
    return front


def frontier_share(
    reward: np.ndarray, kl: np.ndarray, labels: list[str], *, kl_below: float | None = None
) -> dict[str, float | int]:
    """The share of the Pareto frontier's points that each label holds (and ``"points"``, how
    many there are); with ``kl_below``, only the frontier's points with KL below it (the same as
    the frontier of the points below it: a dominating point has no larger KL)."""
    front = pareto_front(reward, kl)
    if kl_below is not None:
        front &= np.asarray(kl) < kl_below
    n = int(front.sum())
    share: dict[str, float | int] = {
        label: float(sum(f and lab == label for f, lab in zip(front, labels, strict=True)) / n)
        if n
        else float("nan")
        for label in sorted(set(labels))
    }
    share["points"] = n
    return share


def _spread(runs: list[dict], key: str) -> float:
    """Mean over held-out evaluations after step 0 of the sd across seeds of ``key``."""
    curves = np.array([r["held_out"][key] for r in runs])[:, 1:]
    return float(curves.std(0, ddof=1).mean())


def _final_stats(runs: dict) -> dict:
    """Per beta and estimator: final reward and KL across seeds, and the curves' spread."""
    out: dict = {}
    for beta, by_est in runs.items():
        out[beta] = {}
        for est, seeds in by_est.items():
            rewards = np.array([r["final"]["reward"] for r in seeds])
            kls = np.array([r["final"]["kl"] for r in seeds])
            out[beta][est] = {
                "reward_mean": float(rewards.mean()),
                "reward_sd": float(rewards.std(ddof=1)),
                "kl_mean": float(kls.mean()),
                "kl_sd": float(kls.std(ddof=1)),
                "reward_curve_spread": _spread(seeds, "reward"),
                "kl_curve_spread": _spread(seeds, "kl"),
            }
    return out


def _frontier(runs: dict) -> dict:
    points = [
        {
            "beta": beta,
            "estimator": est,
            "seed": seed,
            **{k: r["final"][k] for k in ("reward", "kl")},
        }
        for beta, by_est in runs.items()
        for est, seeds in by_est.items()
        for seed, r in enumerate(seeds)
    ]
    reward = np.array([p["reward"] for p in points])
    kl = np.array([p["kl"] for p in points])
    labels = [p["estimator"] for p in points]
    for p, on in zip(points, pareto_front(reward, kl), strict=True):
        p["on_frontier"] = bool(on)
    return {
        "points": points,
        "share": {
            "all": frontier_share(reward, kl, labels),
            f"kl<{LOW_KL:g}": frontier_share(reward, kl, labels, kl_below=LOW_KL),
        },
    }


def _table(stats: dict, frontier: dict, noise: dict, sizes: Sizes) -> str:
    lines = [
        f"Final held-out reward and KL(pi||ref) (RB, {sizes.final_samples} fresh completions) "
        f"after {sizes.steps} steps; mean ± sd across {sizes.seeds} seeds. Curve spread: the "
        "sd across seeds averaged over the held-out evaluations.\n",
        "| beta | estimator | reward | KL (nats) | reward curve spread | KL curve spread |",
        "|---|---|---|---|---|---|",
    ]
    for beta, by_est in stats.items():
        for est, s in by_est.items():
            lines.append(
                f"| {beta:g} | {est} | {s['reward_mean']:.3f} ± {s['reward_sd']:.3f} "
                f"| {s['kl_mean']:.2f} ± {s['kl_sd']:.2f} | {s['reward_curve_spread']:.3f} "
                f"| {s['kl_curve_spread']:.2f} |"
            )
    lines += [
        "",
        "### Pareto frontier of the final points (higher reward, lower KL)\n",
        "| region | frontier points | rb share | mc share | paper (rb) |",
        "|---|---|---|---|---|",
    ]
    for region, share in frontier["share"].items():
        lines.append(
            f"| {region} | {share['points']} | {share.get('rb', 0.0):.0%} "
            f"| {share.get('mc', 0.0):.0%} | {PAPER_FRONTIER_SHARE[region]['rb']:.0%} |"
        )
    lines += [
        "",
        f"### Gradient noise at the end of seed {0}'s runs: total variance over "
        f"{sizes.noise_draws} batches\n",
        "| beta | trained with | reward term | beta x KL term, mc | beta x KL term, rb "
        "| whole gradient, mc | whole gradient, rb | cross term, mc | cross term, rb "
        "| rb / mc (whole) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for beta, by_policy in noise.items():
        for est, v in by_policy.items():
            lines.append(
                f"| {beta:g} | {est} | {v['reward']:.4g} | {v['kl/mc']:.4g} | {v['kl/rb']:.4g} "
                f"| {v['total/mc']:.4g} | {v['total/rb']:.4g} | {v['cross/mc']:.4g} "
                f"| {v['cross/rb']:.4g} | {_ratio(v['total/rb'], v['total/mc']):.3f} |"
            )
    lines.append(
        "\nCross term = Var(whole) - Var(reward term) - Var(beta x KL term): twice the summed "
        "covariance of the two parts; negative where the KL term's gradient cancels reward noise."
    )
    return "\n".join(lines) + "\n"


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _figures(runs: dict, frontier: dict) -> dict:
    plt = pyplot()
    betas = list(runs)
    colors = {"mc": "tab:orange", "rb": "tab:blue"}
    fig, axes = plt.subplots(2, len(betas), figsize=(3.2 * len(betas), 6), squeeze=False)
    for col, beta in enumerate(betas):
        for est, seeds in runs[beta].items():
            steps = np.array(seeds[0]["held_out"]["step"])
            for row, key in enumerate(("reward", "kl")):
                curves = np.array([r["held_out"][key] for r in seeds])
                mean, sd = curves.mean(0), curves.std(0, ddof=1)
                ax = axes[row, col]
                ax.plot(steps, mean, color=colors[est], label=est)
                ax.fill_between(steps, mean - sd, mean + sd, color=colors[est], alpha=0.25)
        axes[0, col].set(title=f"beta = {beta:g}", xlabel="step", ylabel="held-out reward")
        axes[1, col].set(xlabel="step", ylabel="KL(pi||ref), nats (RB, held out)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        title="KL estimator (mean ± sd over seeds)",
        fontsize=8,
        ncol=len(labels),
        loc="lower center",
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room below the panels for the legend

    pareto, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = dict(zip(betas, "osD^vP*X", strict=False))
    for p in frontier["points"]:
        ax.scatter(
            p["kl"],
            p["reward"],
            color=colors[p["estimator"]],
            marker=markers[p["beta"]],
            edgecolors="k" if p["on_frontier"] else "none",
            s=40,
        )
    front = sorted((p["kl"], p["reward"]) for p in frontier["points"] if p["on_frontier"])
    ax.step([f[0] for f in front], [f[1] for f in front], where="post", color="k", lw=1)
    ax.axvline(LOW_KL, color="gray", ls=":", lw=1)
    for est, c in colors.items():
        ax.scatter([], [], color=c, label=est)
    for beta, m in markers.items():
        ax.scatter([], [], color="gray", marker=m, label=f"beta = {beta:g}")
    ax.set(
        xlabel="final KL(pi||ref), nats",
        ylabel="final reward",
        title="Final points; frontier (black) and KL = 5",
    )
    ax.legend(fontsize=8)
    pareto.tight_layout()
    return {"curves": fig, "pareto": pareto}


def _summary_sentence(stats: dict, frontier: dict, noise: dict) -> str:
    share = frontier["share"]
    low = share[f"kl<{LOW_KL:g}"]
    steadier = [
        beta for beta, s in stats.items() if s["rb"]["kl_curve_spread"] < s["mc"]["kl_curve_spread"]
    ]
    spreads = "; ".join(
        f"beta {beta:g}: {s['mc']['kl_curve_spread']:.2f} (mc) vs {s['rb']['kl_curve_spread']:.2f} "
        f"(rb)"
        for beta, s in stats.items()
    )
    at_end = {b: by["rb"] for b, by in noise.items() if by["rb"]["kl/mc"] > 0}

    def listed(num: str, den: str) -> str:
        return ", ".join(f"{_ratio(v[num], v[den]):.2f}" for v in at_end.values())

    return (
        f"RB holds {share['all'].get('rb', 0.0):.0%} of the reward-KL Pareto frontier "
        f"({share['all']['points']} points; paper 78%) and {low.get('rb', 0.0):.0%} of it for "
        f"KL < {LOW_KL:g} ({low['points']} points; paper 95%). KL curves' spread across seeds: "
        f"{spreads}; RB is steadier at {len(steadier)} of {len(stats)} betas. Gradient noise at "
        f"the end of training (RB-trained policy, beta = {', '.join(f'{b:g}' for b in at_end)}): "
        f"RB's KL-term variance is {listed('kl/rb', 'kl/mc')} of MC's, the whole gradient's "
        f"{listed('total/rb', 'total/mc')} of MC's; the reward term alone is "
        f"{listed('reward', 'total/mc')} of MC's whole-gradient variance; the cross term "
        f"(Var(whole) - Var(reward) - Var(beta x KL)) over the reward term's variance is "
        f"{listed('cross/mc', 'reward')} for MC and {listed('cross/rb', 'reward')} for RB."
    )


def run(config: RunConfig) -> Report:
    sizes = QUICK if config.quick else FULL
    with small_lm_session(config.quick) as cache:
        training = Training(NEUTRAL, steps=sizes.ref_steps, seed=config.seed)
        ref, _ = trained_gpt2(sizes.arch, training, cache_dir=cache, progress=config.progress)
        return _run(ref, sizes, config)


def _run(ref: Any, sizes: Sizes, config: RunConfig) -> Report:
    total = len(sizes.betas) * len(ESTIMATORS) * sizes.seeds * sizes.steps
    runs: dict = {}
    noise: dict = {}
    with progress_bar(total=total, desc="kl-regularized-po", enabled=config.progress) as bar:
        for beta in sizes.betas:
            runs[beta], noise[beta] = {}, {}
            for est in ESTIMATORS:
                runs[beta][est] = []
                for s in range(sizes.seeds):
                    seed = config.seed + s
                    record, policy = train(
                        ref, beta=beta, estimator=est, seed=seed, sizes=sizes, bar=bar
                    )
                    runs[beta][est].append(record)
                    if s == 0:
                        noise[beta][est] = gradient_noise(
                            policy, ref, beta=beta, sizes=sizes, seed=seed, progress=config.progress
                        )
    stats = _final_stats(runs)
    frontier = _frontier(runs)
    sentence = _summary_sentence(stats, frontier, noise)
    results = {
        "experiment": "kl-regularized-po",
        "quick": config.quick,
        "seed": config.seed,
        "sizes": asdict(sizes),
        "kl_penalties": KL_PENALTIES,
        "runs": runs,
        "final": stats,
        "frontier": frontier,
        "gradient_noise": noise,
        "paper_frontier_share": PAPER_FRONTIER_SHARE,
        "summary": sentence,
    }
    table = _table(stats, frontier, noise, sizes) + "\n" + sentence + "\n"
    return Report(results, table, _figures(runs, frontier), sentence)


EXPERIMENT = Experiment(
    name="kl-regularized-po",
    description="KL-regularized RLOO on a small LM: Monte Carlo vs Rao-Blackwellized KL penalty; "
    "reward and KL across seeds, reward-KL Pareto frontier",
    run=run,
)

__all__ = [
    "EXPERIMENT",
    "LOW_KL",
    "QUICK",
    "frontier_share",
    "pareto_front",
    "policy_loss",
    "prompts",
    "rloo_advantages",
    "rloo_kl_terms",
    "run",
    "train",
    "with_cross_terms",
]
