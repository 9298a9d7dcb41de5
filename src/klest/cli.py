"""The ``klest`` command: list and run experiments, audit estimators, run the demo.

klest list
klest run NAME [--quick] [--out DIR] [--seed N]
klest audit [--quick] [--seed N]
klest demo [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Experiments `klest demo` runs, in order (each must be registered).
DEMO = ("schulman", "chimera-variance")

# Gradient estimators `klest audit` checks on a tabular autoregressive testbed, per direction.
GRAD_AUDIT = {
    "pi||ref": (
        "k1/autodiff",
        "k2/autodiff",
        "k3/autodiff",
        "k3/token",
        "k3/score",
        "k3/score+loo",
        "k3/score+ema",
        "k3/score+mean",
        "k3/cumulative",
        "k3/cumulative+loo",
        "k3/cumulative+ema",
        "rb/rb",
        "rb/rb+loo",
        "rb/autodiff",
    ),
    "ref||pi": (
        "k1/autodiff",
        "k3/autodiff",
        "k3/token",
        "k3/score",
        "k3/score+loo",
        "k3/score+ema",
        "k3/score+mean",
        "k3/cumulative",
        "k3/cumulative+loo",
        "k3/cumulative+ema",
        "rb/rb",
    ),
}

# Value estimators `klest audit` checks on every testbed, and (sequence testbeds) at the
# sequence level: per-token values of KL(ref||pi) summed over a sequence estimate the token
# sum of E_{y<t ~ pi} KL(ref_t||pi_t), not the sequence KL(ref||pi); level="sequence" is the
# unbiased option.
VALUE_AUDIT = ("k1", "k2", "k3", "abs", "cv:0.5", "cv:loo", "cv:ema")
SEQUENCE_VALUE_AUDIT = ("k1", "k3", "cv:0.5", "cv:loo", "cv:ema")


def _run_experiment(name: str, *, quick: bool, seed: int, out: Path | None, progress: bool) -> bool:
    from klest.experiments import RunConfig, registry, write_report

    experiments = registry()
    if name not in experiments:
        raise SystemExit(
            f"unknown experiment {name!r}; `klest list` shows: {', '.join(experiments)}"
        )
    out = out or Path("runs") / name
    report = experiments[name].run(RunConfig(quick=quick, seed=seed, progress=progress))
    paths = write_report(report, out)
    print(f"## {name}{' (--quick)' if quick else ''}\n")
    print(report.table)
    if report.summary:
        print(report.summary)
    print("\nwrote:")
    for p in paths:
        print(f"  {p}")
    print()
    return bool(report.results.get("reproduced", True))


def _cmd_list(_: argparse.Namespace) -> int:
    from klest.experiments import registry

    for name, e in registry().items():
        print(f"{name:20s} {e.description}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    ok = _run_experiment(
        args.name, quick=args.quick, seed=args.seed, out=args.out, progress=not args.no_progress
    )
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    ok = True
    for name in DEMO:
        ok &= _run_experiment(name, quick=args.quick, seed=0, out=None, progress=True)
    return 0 if ok else 1


def _cmd_audit(args: argparse.Namespace) -> int:
    import torch

    from klest.audit import audit_grad, audit_value, format_grad_audits, format_value_audits
    from klest.testbeds import CategoricalTestbed, GaussianTestbed, TabularAutoregressive

    torch.set_num_threads(1)  # many tiny ops: threads only add overhead
    testbeds = [
        GaussianTestbed.schulman(1.0),
        CategoricalTestbed.random(6, scale=1.0, seed=args.seed),
        TabularAutoregressive.random(3, 4, eos=2, seed=args.seed),
    ]
    trials = 200 if args.quick else 2000
    audits = []
    for tb in testbeds:
        plan = [(spec, "token") for spec in VALUE_AUDIT]
        if isinstance(tb, TabularAutoregressive):
            plan += [(spec, "sequence") for spec in SEQUENCE_VALUE_AUDIT]
        for direction in ("pi||ref", "ref||pi"):
            for spec, level in plan:
                audits.append(
                    audit_value(
                        spec,
                        tb,
                        direction=direction,
                        level=level,
                        batch_size=16,
                        n_trials=trials,
                        seed=args.seed,
                    )
                )
    print("## Value estimators (bias against the exact KL)\n")
    print(
        "On sequences, token-level values of KL(ref||pi) are biased (their prefixes come from pi,"
        " not ref); the `@sequence` rows apply the estimator to the whole-sequence log-ratio.\n"
    )
    print(format_value_audits(audits))
    tabular = TabularAutoregressive.random(3, 4, eos=2, seed=args.seed, scale=0.7)
    grad_trials = 300 if args.quick else 2000
    for direction, specs in GRAD_AUDIT.items():
        grads = [
            audit_grad(
                spec,
                tabular,
                direction=direction,
                batch_size=8,
                n_trials=grad_trials,
                seed=args.seed,
            )
            for spec in specs
        ]
        print(
            f"## Gradient estimators claiming KL({direction}) on a tabular autoregressive "
            f"policy (V=3, T=4, eos; exact KL {float(tabular.exact_kl(direction).detach()):.3f};"
            f" batches of 8, {grad_trials} trials)\n"
        )
        print(format_grad_audits(grads))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klest", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="list the experiments")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("run", help="run one experiment; writes result.json, table.md, PNGs")
    p.add_argument("name")
    p.add_argument("--quick", action="store_true", help="the small size CI runs")
    p.add_argument("--out", type=Path, default=None, help="output directory (default runs/NAME)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("audit", help="audit every built-in value estimator on the testbeds")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser("demo", help="reproduce the headline seed results and say where plots are")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=_cmd_demo)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
