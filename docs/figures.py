"""Copy the experiments' figures and results into ``docs/_static/experiments/``, small enough
to commit.

Usage: ``python docs/figures.py RUNS`` after ``klest run NAME --out RUNS/NAME`` for every
experiment below (``make docs-figures`` does both). Each PNG is scaled to at most 1100 pixels
wide and reduced to a 256-colour palette (the plots are flat colours and lines). Each run's
``result.json`` (without indentation, numbers to 7 significant digits, entries over 1 MB such
as raw per-draw data left out and named under ``omitted``) and ``table.md`` are copied
beside its figures as ``NAME-result.json`` and ``NAME-table.md``: the source of the numbers the
docs quote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image

FIGURES = {
    "schulman": ("stdev_bias_vs_mu", "per_sample_histograms"),
    "chimera-variance": ("gradient_variance_vs_dimension",),
    "chimera-training": ("training_curves",),
    "pitfalls": ("gradient_bias_mse_vs_samples", "kl_minimization_curves"),
    "control-variates": ("heavy_tails",),
    "mode-seeking": ("fits",),
    "migration": ("gradient_coefficients",),
    "lm-gradients": ("mse_and_bias",),
    "rb-vs-mc": ("sd_and_bias_vs_m",),
    "distill": ("kl_curves",),
    "kl-regularized-po": ("curves", "pareto"),
}
OUT = Path(__file__).resolve().parent / "_static" / "experiments"
MAX_WIDTH = 1100
MAX_BYTES = 150_000
MAX_ENTRY_BYTES = 1_000_000  # a result.json entry larger than this is not copied


def main(runs: Path) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for experiment, names in FIGURES.items():
        for name in names:
            source = runs / experiment / f"{name}.png"
            target = OUT / f"{experiment}-{name}.png"
            image = Image.open(source).convert("RGB")
            if image.width > MAX_WIDTH:
                height = round(image.height * MAX_WIDTH / image.width)
                image = image.resize((MAX_WIDTH, height), Image.Resampling.LANCZOS)
            image.quantize(colors=256, dither=Image.Dither.NONE).save(target, optimize=True)
            size = target.stat().st_size
            print(f"{target.relative_to(OUT.parents[1])}: {image.width}x{image.height}, {size} B")
            if size > MAX_BYTES:
                print(f"  larger than {MAX_BYTES} B", file=sys.stderr)
                return 1
        copy_results(runs / experiment, experiment)
    return 0


def copy_results(run: Path, experiment: str) -> None:
    """``run/result.json`` (compact) and ``run/table.md`` as ``OUT/EXPERIMENT-result.json`` and
    ``OUT/EXPERIMENT-table.md``."""
    result = _rounded(json.loads((run / "result.json").read_text()))
    # Raw per-draw data can be megabytes: such entries are left out, and named.
    sizes = {k: len(json.dumps(v, separators=(",", ":"))) for k, v in result.items()}
    omitted = {k: f"{n} bytes of JSON, left out" for k, n in sizes.items() if n > MAX_ENTRY_BYTES}
    result = {k: v for k, v in result.items() if k not in omitted}
    if omitted:
        result["omitted"] = omitted
    (OUT / f"{experiment}-result.json").write_text(json.dumps(result, separators=(",", ":")))
    (OUT / f"{experiment}-table.md").write_text((run / "table.md").read_text())
    print(f"docs/_static/experiments/{experiment}-result.json, -table.md")


def _rounded(x):
    """``x`` with every float to 7 significant digits (the docs quote at most 4)."""
    if isinstance(x, float):
        return float(f"{x:.7g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(Path(sys.argv[1])))
