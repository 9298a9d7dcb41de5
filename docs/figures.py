"""Copy the experiments' figures into ``docs/_static/experiments/``, small enough to commit.

Usage: ``python docs/figures.py RUNS`` after ``klest run NAME --out RUNS/NAME`` for every
experiment below (``make docs-figures`` does both). Each PNG is scaled to at most 1100 pixels
wide and reduced to a 256-colour palette (the plots are flat colours and lines).
"""

from __future__ import annotations

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
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(Path(sys.argv[1])))
