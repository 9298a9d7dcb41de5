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

__all__ = ["main"]

# Experiments `klest demo` runs, in order (each must be registered).
DEMO = ("schulman", "chimera-variance")


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

    from klest.audit import run_audit_suite

    torch.set_num_threads(1)  # many tiny ops: threads only add overhead
    print(run_audit_suite(quick=args.quick, seed=args.seed), end="")
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

    p = sub.add_parser(
        "audit",
        help="audit the built-in value and gradient estimators against exact testbeds",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser(
        "demo", help="reproduce Schulman's table and the Chimera variance figure, write plots"
    )
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=_cmd_demo)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
