r"""Top-k distillation at a realistic vocabulary: bias and spread of value and gradient.

A teacher stored as its top-k log-probs (k in {20, 50, 100}) over V = 32000 tokens, and a
student near it (the teacher's logits plus N(0, 1) noise), at positions with two peaky
teachers: Zipf-like (log-probs :math:`-1.1\log(\mathrm{rank})`, ranks shuffled) and
low-temperature (N(0, 1) logits divided by 0.25). At each position n tokens are sampled from
the student; every estimator of :func:`klest.logits.topk.kl_from_topk` gives n draws of its
value and of its gradient with respect to the student's logits, compared with the exact
full-vocabulary KL and its exact gradient (:func:`klest.kl_from_logits`), both directions:

- value: bias / KL (summed over positions) with its standard error, and the spread of one draw
  / KL;
- gradient: the norm of the bias of the mean gradient, noise removed, / the norm of the exact
  gradient (next to the noise of that mean, for scale), and the variance of one draw (trace of
  its covariance) / the squared norm.

The student's logits are float32 (as in training); the statistics are accumulated in float64.
"""

from __future__ import annotations

import math

import torch

from klest._progress import progress_bar
from klest.audit import TOPK_AUDIT
from klest.experiments.runner import Experiment, Report, RunConfig
from klest.logits.from_logits import kl_from_logits
from klest.logits.topk import kl_from_topk
from klest.testbeds import make_generator

TEACHERS = ("zipf", "low-temperature")


def _teacher(kind: str, v: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "zipf":
        ranks = torch.randperm(v, generator=gen).double() + 1
        return -1.1 * ranks.log()
    return torch.randn(v, generator=gen, dtype=torch.float64) / 0.25


def _position(kind: str, v: int, n: int, gen: torch.Generator) -> dict:
    teacher = _teacher(kind, v, gen).log_softmax(-1)
    student = teacher + torch.randn(v, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(student.softmax(-1), n, replacement=True, generator=gen)
    return {"teacher": teacher, "student": student, "labels": labels}


def _measure(pos: dict, estimator: str, k: int, direction: str) -> dict:
    teacher, student, labels = pos["teacher"], pos["student"], pos["labels"]
    n, v = labels.numel(), teacher.numel()
    z0 = student.clone().requires_grad_(True)
    exact = kl_from_logits(z0, teacher, direction=direction)
    (exact_grad,) = torch.autograd.grad(exact, z0)
    top, idx = teacher.topk(k)
    z = student.float().expand(n, v).clone().requires_grad_(True)  # float32, as in training
    est = kl_from_topk(
        z,
        idx.expand(n, k),
        top.expand(n, k),
        labels=labels,
        logp_ref_label=teacher[labels],
        estimator=estimator,  # type: ignore[arg-type]
        direction=direction,  # type: ignore[arg-type]
        reduction="none",
    )
    (grads,) = torch.autograd.grad(est.sum(), z)  # row i: the gradient of draw i
    est, grads = est.detach().double(), grads.double()
    var_g = float(grads.var(0).sum())
    bias_g2 = float(((grads.mean(0) - exact_grad) ** 2).sum())
    return {
        "exact": float(exact.detach()),
        "mean": float(est.mean()),
        "var": float(est.var()),
        "n": n,
        "grad_norm2": float((exact_grad**2).sum()),
        "grad_bias2": max(bias_g2 - var_g / n, 0.0),
        "grad_var": var_g,
        "teacher_mass": float(top.exp().sum()),
        "student_mass": float(student.softmax(-1)[idx].sum()),
    }


def _summary(cells: list[dict]) -> dict:
    kl = sum(c["exact"] for c in cells)
    bias = sum(c["mean"] - c["exact"] for c in cells)
    se = math.sqrt(sum(c["var"] / c["n"] for c in cells))
    return {
        "rel_bias": bias / kl,
        "rel_bias_se": se / kl,
        "rel_std": math.sqrt(sum(c["var"] for c in cells) / len(cells)) / (kl / len(cells)),
        "grad_rel_bias": sum(math.sqrt(c["grad_bias2"] / c["grad_norm2"]) for c in cells)
        / len(cells),
        "grad_rel_var": sum(c["grad_var"] / c["grad_norm2"] for c in cells) / len(cells),
        # the noise of the mean gradient over one position's draws, for scale
        "grad_noise": sum(math.sqrt(c["grad_var"] / c["n"] / c["grad_norm2"]) for c in cells)
        / len(cells),
        "kl": kl / len(cells),
        "teacher_mass": sum(c["teacher_mass"] for c in cells) / len(cells),
        "student_mass": sum(c["student_mass"] for c in cells) / len(cells),
    }


def run(config: RunConfig) -> Report:
    v, n, per_teacher = (2000, 64, 1) if config.quick else (32000, 256, 2)
    ks = (20, 50, 100)
    gen = make_generator(config.seed)
    positions = {
        kind: [_position(kind, v, n, gen) for _ in range(per_teacher)] for kind in TEACHERS
    }
    results: dict = {
        "experiment": "topk",
        "quick": config.quick,
        "seed": config.seed,
        "V": v,
        "draws_per_position": n,
        "positions_per_teacher": per_teacher,
    }
    lines = [
        "| teacher | k | top-k mass (teacher / student) | KL | estimator | bias / KL | "
        "std / KL | grad bias / ‖∇KL‖ (noise) | grad var / ‖∇KL‖² |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total = len(positions) * 2 * len(ks) * len(TOPK_AUDIT)
    bar = progress_bar(total=total, desc="topk", enabled=config.progress)
    for kind, cells_of in positions.items():
        for direction in ("pi||ref", "ref||pi"):
            for k in ks:
                for est in TOPK_AUDIT:
                    s = _summary([_measure(p, est, k, direction) for p in cells_of])
                    bar.update(1)
                    results[f"{kind}/{direction}/k={k}/{est}"] = s
                    lines.append(
                        f"| {kind} | {k} | {s['teacher_mass']:.3f} / {s['student_mass']:.3f} | "
                        f"KL({direction}) {s['kl']:.3f} | {est} | "
                        f"{s['rel_bias']:+.4f} ± {s['rel_bias_se']:.4f} | {s['rel_std']:.3f} | "
                        f"{s['grad_rel_bias']:.3f} ({s['grad_noise']:.3f}) | "
                        f"{s['grad_rel_var']:.3g} |"
                    )
    bar.close()
    table = "\n".join(lines) + "\n"
    return Report(
        results=results,
        table=table,
        summary=(
            "truncated and truncated-raw are biased in value and (more) in gradient at every k; "
            "tail-bucket is below the KL; unbiased and unbiased-cv are unbiased within their "
            "standard errors, and unbiased-cv has the lower gradient variance"
        ),
    )


EXPERIMENT = Experiment(
    name="topk",
    description="Top-k distillation: bias and spread of value and gradient, V = 32000",
    run=run,
)

__all__ = ["EXPERIMENT", "TEACHERS", "run"]
