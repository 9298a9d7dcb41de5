"""Reproductions of published KL-estimation results: ``klest run NAME [--quick]``."""

from __future__ import annotations

from klest.experiments.runner import Experiment, Report, RunConfig, write_report


def registry() -> dict[str, Experiment]:
    """All experiments by name (imported lazily: plotting libraries load only when needed)."""
    from klest.experiments import (
        chimera,
        control_variates,
        distill,
        kl_regularized_po,
        lm_gradients,
        migration,
        mode_seeking,
        pitfalls,
        rb_vs_mc,
        schulman,
        topk,
    )

    experiments = [
        schulman.EXPERIMENT,
        chimera.VARIANCE,
        chimera.TRAINING,
        pitfalls.EXPERIMENT,
        control_variates.EXPERIMENT,
        mode_seeking.EXPERIMENT,
        migration.EXPERIMENT,
        topk.EXPERIMENT,
        lm_gradients.EXPERIMENT,
        rb_vs_mc.EXPERIMENT,
        distill.EXPERIMENT,
        kl_regularized_po.EXPERIMENT,
    ]
    return {e.name: e for e in experiments}


__all__ = ["Experiment", "Report", "RunConfig", "registry", "write_report"]
