"""The toy RL task of the examples: a tiny Llama policy built from a config (no download), its
frozen copy as ref, prompts from a small vocabulary, and a reward for one target token.

A helper module of ``grpo_plain_pytorch.py`` and ``ppo_reward_shaping.py``: run those.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import LlamaForCausalLM

import klest
from _common import parser
from klest.integrations.hf import CompletionBatch, completion_batch_from_model, group_ids
from klest.testbeds import tiny_causal_lm

VOCAB = 32
PAD, BOS, EOS = 0, 1, 2
TARGET = 7  # the token the task rewards
FIRST_PROMPT_TOKEN = 3


def build_models(seed: int) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A randomly initialized tiny Llama (the policy, trainable) and a frozen copy (ref)."""
    policy = tiny_causal_lm(
        vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, seed=seed
    )
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    return policy, ref


@dataclass(frozen=True)
class Rollout:
    """G completions per prompt, in generate's layout (prompts left-padded to ``prompt_width``).

    ``input_ids`` / ``attention_mask`` ``[B, L]``; a completion ends with its first eos (kept)
    and is padded after it. ``task_reward`` ``[B]``: the number of ``TARGET`` tokens in the
    completion over ``max_new_tokens`` (so stopping early never pays). ``group`` ``[B]``: the
    prompt of each completion, whose ``num_generations`` samples are consecutive.
    """

    input_ids: Tensor
    attention_mask: Tensor
    prompt_width: int
    group: Tensor
    num_generations: int
    task_reward: Tensor

    def by_prompt(self, x: Tensor) -> Tensor:
        """``[B]`` -> ``[prompts, num_generations]``."""
        return x.view(-1, self.num_generations)


def rollout(
    policy: LlamaForCausalLM, *, n_prompts: int, num_generations: int, max_new_tokens: int
) -> Rollout:
    """Sample prompts (bos + 1-3 random tokens, never the target) and completions from pi."""
    lengths = torch.randint(1, 4, (n_prompts,))
    width = 1 + int(lengths.max())
    prompts = torch.full((n_prompts, width), PAD)
    for i, n in enumerate(lengths.tolist()):
        tokens = torch.randint(FIRST_PROMPT_TOKEN, VOCAB - 1, (n,))
        tokens = tokens + (tokens >= TARGET).long()  # skip the target token
        prompts[i, width - n - 1 :] = torch.cat([torch.tensor([BOS]), tokens])
    prompts = prompts.repeat_interleave(num_generations, 0)
    prompt_mask = (prompts != PAD).long()
    with torch.no_grad():
        out = policy.generate(
            input_ids=prompts,
            attention_mask=prompt_mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=1,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
    completion = out[:, width:]
    ended_before = (completion == EOS).long().cumsum(1) - (completion == EOS).long()
    completion_mask = (ended_before == 0).long()  # up to and including the first eos
    hits = ((completion == TARGET).long() * completion_mask).sum(1)
    return Rollout(
        input_ids=torch.cat([prompts, torch.where(completion_mask.bool(), completion, PAD)], 1),
        attention_mask=torch.cat([prompt_mask, completion_mask], 1),
        prompt_width=width,
        group=group_ids(len(prompts), num_generations=num_generations),
        num_generations=num_generations,
        task_reward=hits / max_new_tokens,
    )


@dataclass
class History:
    """Per step: the batch's mean task reward, and its estimate of the sequence KL(pi||ref):
    the exact per-position KLs summed along the samples (``klest.kl_from_logits``; unbiased,
    lower variance than a sampled-token estimate)."""

    reward: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)


LossFn = Callable[[Rollout, CompletionBatch, CompletionBatch], Tensor]


def train(
    loss_fn: LossFn,
    *,
    steps: int,
    seed: int,
    n_prompts: int = 8,
    num_generations: int = 4,
    max_new_tokens: int = 8,
    lr: float = 1e-2,
) -> History:
    """On-policy training from the same initial model and sampling stream for a given seed:
    each step a rollout, the completions of pi (with graph) and ref, one Adam step on
    ``loss_fn(rollout, batch, ref_batch)``."""
    policy, ref = build_models(seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    history = History()
    for _ in range(steps):
        r = rollout(
            policy,
            n_prompts=n_prompts,
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
        )
        where = {"attention_mask": r.attention_mask, "prompt_lengths": r.prompt_width}
        batch = completion_batch_from_model(policy, r.input_ids, **where)
        with torch.no_grad():
            ref_batch = completion_batch_from_model(ref, r.input_ids, **where)
        loss = loss_fn(r, batch, ref_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kl = klest.kl_from_logits(batch.logits.detach(), ref_batch.logits, mask=batch.mask)
        history.reward.append(float(r.task_reward.mean()))
        history.kl.append(float(kl))
    return history


def print_table(runs: dict[str, History], *, stride: int) -> None:
    """One row every ``stride`` steps (and the last): each run's reward and exact KL."""
    head = "".join(f"  {name + ' reward':>18} {'KL':>6}" for name in runs)
    print(f"{'step':>4}{head}")
    steps = len(next(iter(runs.values())).reward)
    for step in [*range(0, steps - 1, stride), steps - 1]:
        cells = "".join(f"  {h.reward[step]:>18.3f} {h.kl[step]:>6.2f}" for h in runs.values())
        print(f"{step:>4}{cells}")


def tail_mean(values: list[float], fraction: float = 0.2) -> float:
    """Mean of the last ``fraction`` of the values (at least one)."""
    k = max(1, int(len(values) * fraction))
    return sum(values[-k:]) / k


def head_mean(values: list[float], count: int = 3) -> float:
    """Mean of the first ``count`` values."""
    return sum(values[:count]) / len(values[:count])


def parse_args(doc: str, *, quick_steps: int, full_steps: int) -> argparse.Namespace:
    """``--quick`` / ``--seed S`` (``_common.parser``) and ``--steps N`` (training steps per
    run); ``args.steps`` is resolved."""
    p = parser(doc, quick=f"{quick_steps} steps per run")
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {full_steps})")
    args = p.parse_args()
    if args.steps is None:
        args.steps = quick_steps if args.quick else full_steps
    if args.steps < 2:
        p.error("--steps must be at least 2")
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    return args


class Clock:
    """Seconds since creation, for the closing line."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.start:.1f} s"


if __name__ == "__main__":
    print("helper module of the examples: run grpo_plain_pytorch.py or ppo_reward_shaping.py")
