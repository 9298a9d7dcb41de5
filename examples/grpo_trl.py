"""GRPO in TRL with klest's KL term: the import line and one argument change.

A tiny Llama (built from a config, nothing downloaded) learns to write the letter "a" after
prompts of other letters, with TRL's ``GRPOTrainer`` as a TRL user runs it, except for

    from klest.integrations.trl import GRPOTrainer, KLTerm      # was: from trl import GRPOTrainer
    trainer = GRPOTrainer(..., kl=KLTerm(estimator="k3", grad="cumulative", baseline="loo"))

TRL's own KL term is k3 per token times the ratio pi/pi_old, differentiated: its mean gradient
is the token-local gradient of KL(pi||ref), each token's KL with its prefix held fixed, which
misses each token's effect on the later ones ("On a few pitfalls in KL divergence gradient
estimation for RL", Tang and Munos, 2025, https://arxiv.org/abs/2506.09477). With
klest the logged value is still k3, and the gradient is the sequence-level KL(pi||ref)'s (each
token's score times the log-ratios from it on, leave-one-out baseline over each prompt's
samples). The trainer logs the value as ``kl``; the table prints it with the task reward.

The run uses gradient accumulation 2 and ``mask_truncated_completions=True`` (completions that
hit the length limit are masked out, so some rows of a micro-batch are empty). It exits with
status 1 unless the reward rose and the logged KL stayed finite and non-negative.

Run:  python examples/grpo_trl.py [--quick] [--seed S]   (--quick: 30 steps, well under 30 s)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import datasets
import torch
from trl import GRPOConfig

from _common import finish, parser
from klest.integrations.trl import GRPOTrainer, KLTerm
from klest.testbeds import tiny_causal_lm, word_tokenizer

LETTERS = [chr(ord("a") + i) for i in range(12)]


def reward_a(completions: list[str], **_) -> list[float]:
    """The fraction of the completion's words that are the letter "a"."""
    return [c.split().count("a") / max(len(c.split()), 1) for c in completions]


def prompts(n: int, seed: int) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(1, 4, (), generator=g))
        picks = torch.randint(1, len(LETTERS), (length,), generator=g).tolist()
        rows.append(" ".join(LETTERS[i] for i in picks))
    return datasets.Dataset.from_dict({"prompt": rows})


def main() -> int:
    args = parser(__doc__, quick="30 steps").parse_args()
    steps = 30 if args.quick else 150
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        # TRL loads the reference model from the policy's folder: save the tiny model first.
        folder = Path(tmp) / "policy"
        tokenizer = word_tokenizer(LETTERS)
        tiny_causal_lm(vocab_size=len(tokenizer), hidden_size=32, seed=args.seed).save_pretrained(
            folder
        )
        tokenizer.save_pretrained(folder)
        config = GRPOConfig(
            output_dir=str(Path(tmp) / "out"),
            beta=0.02,
            num_generations=4,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            max_completion_length=8,
            mask_truncated_completions=True,
            learning_rate=3e-3,
            max_steps=steps,
            logging_steps=max(steps // 10, 1),
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=args.seed,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=str(folder),
            reward_funcs=reward_a,
            args=config,
            train_dataset=prompts(4 * steps, args.seed),
            processing_class=tokenizer,
            kl=KLTerm(estimator="k3", grad="cumulative", baseline="loo"),
        )
        trainer.train()

    logs = [h for h in trainer.state.log_history if "reward" in h and "kl" in h]
    print(f"{'step':>5} {'reward':>8} {'kl (k3, nats/completion)':>26}")
    for h in logs:
        print(f"{h['step']:>5} {h['reward']:>8.3f} {h['kl']:>26.4f}")
    first, last = logs[0]["reward"], logs[-1]["reward"]
    kls = [h["kl"] for h in logs]
    failures = []
    if not last > first:
        failures.append(f"the reward did not rise ({first:.3f} -> {last:.3f})")
    if not all(k == k and 0.0 <= k < float("inf") for k in kls):
        failures.append(f"a logged KL is not finite and non-negative: {kls}")
    return finish(
        f"reward {first:.3f} -> {last:.3f} with klest's KL term in TRL's GRPOTrainer "
        f"(logged KL(pi||ref) ends at {kls[-1]:.4f} nats per completion)",
        failures,
    )


if __name__ == "__main__":
    sys.exit(main())
