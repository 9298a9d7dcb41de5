"""The KL in the reward (PPO-style reward shaping) with ``klest.kl_reward``: a tiny Llama
learns to emit a target token, and a k1 KL reward keeps KL(pi||ref) far smaller than without it;
a k3 KL reward does not.

The same toy task as ``grpo_plain_pytorch.py`` (a tiny Llama built from a config, its frozen
copy as ref; 8 prompts x 4 completions of up to 8 tokens per step, sampled with
``model.generate`` from left-padded prompts; task reward: the number of target tokens over 8),
log-probs response-aligned by ``klest.integrations.hf.completion_batch_from_model``. The
per-token rewards are the task reward at each completion's last token minus ``beta * kl_t``;
a REINFORCE step (on-policy, so PPO's ratio is 1) weights each token's log-prob by its return
from that token on:

    returns = task_reward - beta * klest.kl_reward(logp, logp_ref, mask=mask,
                                                           reward_to_go=True)

(the task reward sits at the last token, so every token's return includes it), minus a
leave-one-out baseline of the task reward within each prompt's samples. With k1
(``kl_t = log pi - log ref``) and no discount, the KL part's expected gradient is exactly
-beta times the gradient of the sequence KL(pi||ref). Two comparisons from the same initial
model and seed: beta = 0, and the k3 value as the reward (``kl_reward`` warns): its score
gradient is grad KL(pi||ref) minus the per-position grad KL(ref_t||pi_t), which nearly cancel
near ref. The table prints each run's task reward and KL(pi||ref) (the exact per-position KLs
summed along the samples, ``klest.kl_from_logits``).

Measured (beta = 0.05; means over the last 20% of the steps):

- ``--quick`` (60 steps), seeds 0, 1, 2: k1 reward: KL 1.88, 4.59, 2.54 nats (task reward
  0.179, 0.299, 0.218); beta = 0 and the k3 reward alike: the policy emits only the target, KL
  29.30, 29.14, 28.04 nats.
- full (300 steps), seeds 0, 1, 2: k1: KL 3.15, 2.43, 3.13 nats; beta = 0 and k3: 28.0 to 29.3.
- At beta = 0.2 and 0.5 (60 steps, seed 0) the k1 reward holds KL at 0.11 and 0.05 nats; the
  k3 reward lets it reach 6.9 nats both times, with the task reward falling to 0.01.

Exits with code 1 unless the k1 reward's final KL is below half of beta = 0's and below the k3
reward's (deterministic for a seed; the margins above are wide).

Run: ``python examples/ppo_reward_shaping.py [--quick] [--steps N] [--seed S]``.
"""

from __future__ import annotations

import sys
import warnings

import torch

from _common import finish
from _tiny_lm import Clock, parse_args, print_table, tail_mean, train
from klest.sampled.penalty import KLGradientWarning
from klest.sampled.rewards import kl_reward

BETA = 0.05


def reinforce_loss(beta: float, estimator: str = "k1"):
    def loss(r, batch, ref_batch) -> torch.Tensor:
        mask = batch.mask
        with warnings.catch_warnings():  # k3 warns; this example measures why
            warnings.simplefilter("ignore", KLGradientWarning)
            kl_to_go = kl_reward(
                batch.log_probs, ref_batch.log_probs, mask=mask, estimator=estimator,
                reward_to_go=True,
            )  # fmt: skip
        reward = r.by_prompt(r.task_reward)
        g = r.num_generations
        baseline = (reward.sum(1, keepdim=True) - reward) / (g - 1)  # leave-one-out
        returns = (reward - baseline).view(-1, 1) - beta * kl_to_go  # [B, T], no graph
        return -(returns * batch.log_probs * mask).sum() / mask.shape[0]

    return loss


def main() -> int:
    args = parse_args(__doc__, quick_steps=60, full_steps=300)
    clock = Clock()
    losses = {
        "beta=0": reinforce_loss(0.0),
        f"k1 beta={BETA:g}": reinforce_loss(BETA),
        f"k3 beta={BETA:g}": reinforce_loss(BETA, "k3"),
    }
    runs = {name: train(fn, steps=args.steps, seed=args.seed) for name, fn in losses.items()}
    print(
        f"REINFORCE with the KL in the reward, tiny Llama (8 prompts x 4 samples), seed {args.seed}"
    )
    print_table(runs, stride=max(1, args.steps // 15))
    final = {name: (tail_mean(h.reward), tail_mean(h.kl)) for name, h in runs.items()}
    print(
        "final (mean over the last fifth of the steps): "
        + "; ".join(
            f"{name}: reward {rw:.3f}, KL {kl:.2f} nats" for name, (rw, kl) in final.items()
        )
        + f"; {clock}"
    )
    (_, kl_free), (reward_k1, kl_k1), (_, kl_k3) = final.values()
    failures = []
    if not kl_k1 < 0.5 * kl_free:
        failures.append(f"k1 reward: KL {kl_k1:.2f} is not below half of beta=0's {kl_free:.2f}")
    if not kl_k1 < kl_k3:
        failures.append(f"k1 reward: KL {kl_k1:.2f} is not below the k3 reward's {kl_k3:.2f}")
    return finish(
        f"the k1 KL reward kept KL(pi||ref) at {kl_k1:.2f} nats (reward {reward_k1:.3f}) against "
        f"{kl_free:.2f} with beta=0 and {kl_k3:.2f} with the k3 reward",
        failures,
    )


if __name__ == "__main__":
    sys.exit(main())
