r"""On-policy distillation of a tiny student LM from a tiny teacher, with the exact KL as the loss.

Both models are ``transformers.LlamaForCausalLM`` built from a config (vocabulary 64; the
student has hidden size 32, the teacher 64), nothing downloaded. The teacher is first trained
for a few hundred steps on a synthetic language, which makes it peaky: after a start token,
sequences count up modulo 61 in steps of 1, 2 or 3 and stop (EOS) after 3 to 11 tokens. The
student, randomly initialized, then samples its own completions with ``model.generate`` and
minimizes, on them, the exact per-position KL between its next-token distribution and the
teacher's, from the two models' final hidden states and LM heads:

.. math::
    L = \frac1B \sum_{b=1}^{B} \sum_{t} \mathrm{KL}\big(\pi(\cdot|y^b_{<t})\,\|\,
        \mathrm{ref}(\cdot|y^b_{<t})\big), \qquad y^b \sim \pi,

computed by ``klest.kl_from_hidden(h_student, student.lm_head.weight, h_teacher,
teacher.lm_head.weight, mask=mask)``, which never holds a ``[B, T, V]`` tensor (the exact KL of
"Better Estimation of the Kullback-Leibler Divergence Between Language Models" by Afra Amini,
Tim Vieira and Ryan Cotterell, NeurIPS 2025, https://arxiv.org/abs/2504.10637). The hidden state
at position t predicts token t + 1; the mask keeps each completion up to and including its first
EOS (generate pads the rest). Its value is the sequence-level KL(student||teacher) of the batch,
so each printed step is that KL measured on fresh samples.

Its gradient is each position's own KL gradient with the prefixes held fixed: it misses how a
token changes which prefixes the later positions see. ``--sequence-level`` adds that term, the
score of each token times the exact KLs after it (``grad="rb"`` of ``klest.kl_penalty``, an
unbiased gradient of the sequence KL; "On a few pitfalls in KL divergence gradient estimation
for RL" by Yunhao Tang and Rémi Munos, 2025, https://arxiv.org/abs/2506.09477), from the
exact KLs that ``kl_from_hidden`` returns per position (``position_kls=``): this mode too never
holds a ``[B, T, V]`` tensor.

Measured, exact sequence KL on 256 fresh samples (completion lengths count the EOS):

- ``--quick`` (150 steps), seed 0: token-local 59.9 -> 3.6 nats, completion length 11.1 -> 6.4;
  ``--sequence-level`` 59.9 -> 7.0 nats, length 11.1 -> 2.0.
- full (600 steps), seeds 0, 1, 2: token-local 0.90, 0.66, 0.38 nats; ``--sequence-level`` 8.4,
  8.4, 6.6 nats, lengths 1.9 to 2.9

(the teacher's completions are 7.9 tokens long after 200 training steps, 9.3 after 400). The
unbiased gradient of the sequence KL does *worse* here: it rewards stopping early, since every
later position adds a KL, and the student settles on one- or two-token completions that pay
the KL of an early EOS (the teacher never stops before three tokens) instead of learning the
count. The token-local gradient, biased for the sequence KL, ignores that incentive and keeps
fitting each position.

``generate`` samples from the student only with ``top_k=0, top_p=1.0``: its default
``top_k=50`` keeps 50 of the 64 tokens, and the samples would not come from the student. The
script checks that generation left the logits untouched.

Exits with code 1 if the exact KL did not decrease (z of the decrease below 4).

Run: ``python examples/distillation_from_teacher.py [--quick] [--seed N] [--sequence-level]``.
"""

from __future__ import annotations

import math
import sys

import torch
import transformers
from torch import Tensor

import klest
from _common import finish, parser
from klest.testbeds import tiny_causal_lm

VOCAB = 64
MAX_NEW = 12  # completion length limit
BOS, EOS, PAD = 0, 1, 2
FIRST = 3  # the first ordinary token
EVAL_SAMPLES = 256
LM = transformers.LlamaForCausalLM
Loss = klest.WithDetails  # (loss, details): details.diagnostics has the mean and its stderr
Z_DECREASE = 4.0  # one-sided: a decrease this many standard errors is not chance


def llama(hidden: int) -> LM:
    """A tiny Llama drawn from the global generator (seeded once in ``main``)."""
    return tiny_causal_lm(
        vocab_size=VOCAB,
        hidden_size=hidden,
        max_positions=2 * MAX_NEW,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        seed=None,
    )


def language(n: int, generator: torch.Generator) -> Tensor:
    """``n`` teacher training sequences ``[n, 1 + MAX_NEW]``: BOS, a count modulo 61 from a
    random start in steps of 1, 2 or 3 for 3 to 11 tokens, EOS, PAD."""
    start = torch.randint(0, VOCAB - FIRST, (n, 1), generator=generator)
    step = torch.randint(1, 4, (n, 1), generator=generator)
    length = torch.randint(3, MAX_NEW, (n, 1), generator=generator)
    t = torch.arange(MAX_NEW)
    tokens = FIRST + (start + step * t) % (VOCAB - FIRST)
    tokens = torch.where(t < length, tokens, torch.where(t == length, EOS, PAD))
    return torch.cat([torch.full((n, 1), BOS), tokens], dim=1)


def train_teacher(steps: int, generator: torch.Generator) -> LM:
    teacher = llama(hidden=64)
    opt = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = language(64, generator)
        loss = teacher(ids, labels=ids.masked_fill(ids == PAD, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    teacher.eval().requires_grad_(False)
    _, mask = sample(teacher, EVAL_SAMPLES)
    print(
        f"teacher: cross-entropy {float(loss.detach()):.3f} nats/token after {steps} steps; its "
        f"completions: {float(mask.sum(1).float().mean()):.2f} tokens with EOS"
    )
    return teacher


@torch.no_grad()
def sample(model: LM, n: int) -> tuple[Tensor, Tensor]:
    """``n`` completions of BOS from ``model`` itself: ``(sequences [n, 1 + L], mask [n, L])``,
    the mask True up to and including each completion's first EOS."""
    out = model.generate(
        torch.full((n, 1), BOS),
        do_sample=True,
        top_k=0,  # the default keeps the 50 likeliest tokens only: not samples from the model
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=MAX_NEW,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    if not all(torch.equal(s, z) for s, z in zip(out.scores, out.logits, strict=True)):
        raise RuntimeError("generate changed the logits before sampling: not on-policy samples")
    completion = out.sequences[:, 1:]
    eos = completion == EOS
    after_eos = (eos.cumsum(dim=1) - eos.long()) > 0
    return out.sequences, ~after_eos


def final_hidden(model: LM, sequences: Tensor) -> Tensor:
    """The last layer's (normed) hidden states at the positions that predict the completion:
    position t predicts token t + 1, so the last position is dropped. Right padding needs no
    attention mask: causal attention keeps it out of the earlier positions."""
    return model.model(input_ids=sequences).last_hidden_state[:, :-1]


def token_local_loss(student: LM, teacher: LM, sequences: Tensor, mask: Tensor) -> Loss:
    """The exact per-position KLs, fused with both LM heads (no ``[B, T, V]`` tensor)."""
    h = final_hidden(student, sequences)
    with torch.no_grad():
        h_teacher = final_hidden(teacher, sequences)
    return klest.kl_from_hidden(
        h,
        student.lm_head.weight,
        h_teacher,
        teacher.lm_head.weight,
        mask=mask,
        return_details=True,
    )


def sequence_level_loss(student: LM, teacher: LM, sequences: Tensor, mask: Tensor) -> Loss:
    """The same value; the gradient of the sequence KL (``grad="rb"``): the exact KLs and the
    sampled tokens' log-probs from the fused LM heads, still no ``[B, T, V]`` tensor."""
    h = final_hidden(student, sequences)
    with torch.no_grad():
        h_teacher = final_hidden(teacher, sequences)
    kls, d = klest.kl_from_hidden(
        h,
        student.lm_head.weight,
        h_teacher,
        teacher.lm_head.weight,
        mask=mask,
        labels=sequences[:, 1:],
        reduction="none",
        return_details=True,
    )
    return klest.kl_penalty(
        d.logp,
        d.logp_ref,
        mask=mask,
        estimator="rb",
        grad="rb",
        baseline="loo",
        position_kls=kls,
        return_details=True,
    )


@torch.no_grad()
def evaluate(student: LM, teacher: LM) -> tuple[float, float, float]:
    """The exact sequence KL(student||teacher) on fresh samples: mean, standard error, and the
    completions' mean length."""
    sequences, mask = sample(student, EVAL_SAMPLES)
    _, details = token_local_loss(student, teacher, sequences, mask)
    d = details.diagnostics
    return d.mean, d.stderr, float(mask.sum(1).float().mean())


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__, quick="150 steps")
    cli.add_argument(
        "--sequence-level",
        action="store_true",
        help="add the score term of the later positions' KLs (kl_penalty grad='rb')",
    )
    cli.add_argument("--batch", type=int, default=32, help="sequences per step")
    args = cli.parse_args(argv)
    teacher_steps, steps = (200, 150) if args.quick else (400, 600)
    every = steps // 10
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    teacher = train_teacher(teacher_steps, gen)
    student = llama(hidden=32)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    loss_fn = sequence_level_loss if args.sequence_level else token_local_loss
    mode = "sequence-level (rb)" if args.sequence_level else "token-local (kl_from_hidden)"

    start = evaluate(student, teacher)
    print(
        f"gradient: {mode}; batch {args.batch}; exact sequence KL(student||teacher) on the "
        "step's fresh samples, nats"
    )
    print("| step | KL | standard error | completion length |")
    print("|---|---|---|---|")
    for step in range(steps + 1):
        sequences, mask = sample(student, args.batch)
        loss, details = loss_fn(student, teacher, sequences, mask)
        if step % every == 0:
            d = details.diagnostics
            length = float(mask.sum(1).float().mean())
            print(f"| {step} | {d.mean:.3f} | {d.stderr:.3f} | {length:.2f} |", flush=True)
        if step < steps:
            opt.zero_grad()
            loss.backward()
            opt.step()
    end = evaluate(student, teacher)

    z = (start[0] - end[0]) / math.hypot(start[1], end[1])
    print(
        f"\non {EVAL_SAMPLES} fresh samples: KL {start[0]:.3f} +- {start[1]:.3f} (length "
        f"{start[2]:.2f}) before, {end[0]:.3f} +- {end[1]:.3f} (length {end[2]:.2f}) after; "
        f"decrease z = {z:.1f} (needs {Z_DECREASE})"
    )
    failures = [] if z >= Z_DECREASE else [f"the exact KL did not decrease (z = {z:.1f})"]
    return finish(
        f"exact sequence KL(student||teacher) {start[0]:.2f} -> {end[0]:.2f} nats in {steps} "
        f"steps, {mode} gradient (z = {z:.1f}); completion length {start[2]:.1f} -> "
        f"{end[2]:.1f}",
        failures,
    )


if __name__ == "__main__":
    sys.exit(main())
