"""The KL in the reward (PPO-style reward shaping) with ``klest.rewards.kl_reward``: a tiny Llama
learns to emit a target token, and the KL reward keeps KL(pi||ref) far smaller than without it.

Each step samples G = 4 completions for each of 8 prompts with ``model.generate`` (prompts
left-padded) and takes their log-probs response-aligned
(``klest.integrations.hf.completion_batch_from_model``). The per-token rewards are the task
reward at each completion's last token minus ``beta * kl_t``, with ``kl_t = log pi - log ref``
(k1); a REINFORCE step (on-policy, so PPO's ratio is 1) uses each token's return from it on:

    returns = task_reward - beta * klest.rewards.kl_reward(logp, logp_ref, mask=mask,
                                                           reward_to_go=True)

(the task reward sits at the last token, so every token's return includes it), minus a
leave-one-out baseline of the task reward within each prompt's samples. With k1 and no discount
the KL part's expected gradient is exactly -beta times the gradient of the sequence
KL(pi||ref). The same run with beta = 0 is the comparison, and a third run rewards with k3
instead of k1 (kl_reward warns): its reward gradient is grad KL(pi||ref) minus the per-token
grad KL(ref||pi), which nearly cancel near ref, so it restrains the policy much less.

The table prints each run's task reward and KL(pi||ref) (the exact per-position KLs summed along
the samples, ``klest.kl_from_logits``). The script exits with status 1 unless the k1 reward kept
the final KL below half of beta = 0's and below k3's.

Run:  python examples/ppo_reward_shaping.py [--quick] [--steps N] [--seed S]
      (--quick: 60 steps per run, well under 30 s on 2 CPU cores)
"""

from __future__ import annotations

import sys
import warnings

import torch
from _tiny_lm import Clock, parse_args, print_table, tail_mean, train

from klest.penalty import KLGradientWarning
from klest.rewards import kl_reward

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
    kl_free, kl_k1, kl_k3 = (kl for _, kl in final.values())
    if kl_k1 < 0.5 * kl_free and kl_k1 < kl_k3:
        print(
            "conclusion: the k1 KL reward kept KL(pi||ref) far below beta=0's; the k3 reward "
            "restrained it less"
        )
        return 0
    print("conclusion: FAILED: the k1 KL reward did not keep KL(pi||ref) smallest")
    return 1


if __name__ == "__main__":
    sys.exit(main())
