"""The ``klest`` command: list and run experiments, audit estimators, run the demo.

klest list
klest run NAME [--quick] [--out DIR] [--seed N] [--progress | --no-progress]
klest audit [--quick] [--seed N] [--progress | --no-progress]
klest demo [--quick] [--progress | --no-progress]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]

# Experiments `klest demo` runs, in order (each must be registered).
DEMO = ("schulman", "chimera-variance")

DESCRIPTION = (
    "klest: KL divergence estimators and their gradients. List and run the experiments that "
    "reproduce published results, audit the built-in estimators against exact answers, or run "
    "the demo."
)
PROGRESS_HELP = (
    "report progress on standard error: a bar on a terminal, else a line every few seconds "
    "(on unless --no-progress)"
)


def _run_experiment(name: str, *, quick: bool, seed: int, out: Path | None, progress: bool) -> bool:
    from klest.experiments import RunConfig, registry, write_report
    from klest.experiments.runner import pyplot

    experiments = registry()
    if name not in experiments:
        raise SystemExit(
            f"unknown experiment {name!r}; `klest list` shows: {', '.join(experiments)}"
        )
    try:
        pyplot()  # fail before the experiment runs, not after
    except ImportError as e:
        raise SystemExit(f"klest run {name}: {e}") from None
    out = out or Path("runs") / name
    report = experiments[name].run(RunConfig(quick=quick, seed=seed, progress=progress))
    if progress:
        files = 2 + len(report.figures)
        print(f"klest run {name}: writing {files} files to {out}", file=sys.stderr, flush=True)
    paths = write_report(report, out)
    print(f"## {name}{' (--quick)' if quick else ''}\n")
    print(report.table)
    if report.summary:
        print(report.summary)
    print("\nwrote:")
    for p in paths:
        print(f"  {p}")
    print()
    sys.stdout.flush()
    return bool(report.results.get("reproduced", True))


def _cmd_list(_: argparse.Namespace) -> int:
    from klest.experiments import registry

    for name, e in registry().items():
        print(f"{name:20s} {e.description}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    ok = _run_experiment(
        args.name, quick=args.quick, seed=args.seed, out=args.out, progress=args.progress
    )
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    ok = True
    for i, name in enumerate(DEMO, 1):
        if args.progress:
            print(f"klest demo: {i}/{len(DEMO)} {name}", file=sys.stderr, flush=True)
        ok &= _run_experiment(name, quick=args.quick, seed=0, out=None, progress=args.progress)
    return 0 if ok else 1


def _cmd_audit(args: argparse.Namespace) -> int:
    import torch

    from klest.audit import run_audit_suite

    torch.set_num_threads(1)  # many tiny ops: threads only add overhead
    print(run_audit_suite(quick=args.quick, seed=args.seed, progress=args.progress), end="")
    return 0


def _add_common(p: argparse.ArgumentParser, *, quick: str, seed: bool = True) -> None:
    p.add_argument("--quick", action="store_true", help=quick)
    if seed:
        p.add_argument(
            "--seed", type=int, default=0, metavar="N", help="seed of every draw (default 0)"
        )
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help=PROGRESS_HELP
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="klest", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "list",
        help="list the experiments",
        description="List the registered experiments, one line each: name and description.",
    )
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser(
        "run",
        help="run one experiment; writes result.json, table.md, PNGs",
        description=(
            "Run one experiment: print its table and summary, and write result.json (every "
            "number), table.md and one PNG per figure to the output directory. Exits 1 when the "
            "experiment reports that it did not reproduce its claim."
        ),
    )
    p.add_argument("name", metavar="NAME", help="the experiment (klest list shows them)")
    _add_common(p, quick="the small size the test suite runs (seconds to a minute)")
    p.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="output directory (default runs/NAME)"
    )
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "audit",
        help="audit the built-in value and gradient estimators against exact testbeds",
        description=(
            "Audit every built-in value estimator (bias and spread against the exact KL) and "
            "gradient estimator (which KL its mean gradient descends) on testbeds with exact "
            "answers; prints markdown tables."
        ),
    )
    _add_common(
        p, quick="fewer trials per estimator (200 value and 300 gradient instead of 2000 each)"
    )
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser(
        "demo",
        help="reproduce Schulman's table and the Chimera variance figure, write plots",
        description=(
            f"Run the experiments {' and '.join(DEMO)} with seed 0: print their tables and "
            "write their results and plots under runs/NAME."
        ),
    )
    _add_common(p, quick="the small size the test suite runs (seconds)", seed=False)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``klest`` command with ``argv`` (default: the process's arguments); return the
    exit status."""
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
