r"""The migration table: every KL option of TRL, verl, OpenRLHF, NeMo-RL, slime and the Tinker
cookbook (:data:`klest.integrations.migration.OPTIONS`, each written as one klest call), with
what its value estimates and what its gradient descends, measured against exact answers.

Each option's call equals the framework's KL term, in value and in gradient, on the same batch
(the tests check each against the framework's formula written out by hand).
The experiment measures, on a tabular autoregressive policy with exact
answers (:class:`~klest.testbeds.TabularAutoregressive`, V = 3 tokens, T <= 4 with an
end-of-sequence token, so token-local and sequence-level gradients differ):

- the gradient (:func:`klest.audit_grad`, batches of 8 sequences from 2 prompts), its mean
  against the exact gradients of the sequence-level :math:`KL(\pi\|ref)` and
  :math:`KL(ref\|\pi)`, and of their token-local versions
  :math:`\sum_t E_{y_{<t}\sim \mathrm{sg}(\pi)} KL(\pi_t\|ref_t)` (or
  :math:`KL(ref_t\|\pi_t)`) whose prefix distribution carries no gradient
  (:meth:`~klest.testbeds.TabularAutoregressive.token_local_kl`);
- the value (:func:`klest.audit_value`), its mean against the exact KL.

Each option's per-token terms are summed per sequence for the measurement (the framework's
aggregation, a separate choice, is in the call and in a second table: on sequences of unequal
length a per-sequence token mean weights each sequence by 1/length).

The options' sources and the background papers are in :mod:`klest.integrations.migration`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.audit import GradAudit, ValueAudit, audit_grad, audit_value
from klest.experiments.runner import (
    FALSE_ALARM,
    Experiment,
    Report,
    RunConfig,
    pyplot,
    table_threshold,
)
from klest.integrations.migration import AGGREGATIONS, OPTIONS, RL_FIX, Batch, KLCall
from klest.testbeds import Sample, TabularAutoregressive

VOCAB, HORIZON, EOS, SCALE = 3, 4, 2, 1.0
BATCH, PROMPTS = 8, 2
VALUE_BATCH = 256  # per-sequence values are independent draws: many per call
SEPARATION = 1 / 3


def _separated_testbed(start: int = 0) -> TabularAutoregressive:
    """The first random table from seed ``start`` on whose four exact gradients (sequence-level
    and token-local, both directions) differ pairwise by at least ``SEPARATION`` of the larger
    norm: where each verdict can tell the four apart."""
    for table_seed in itertools.count(start):
        tb = TabularAutoregressive.random(VOCAB, HORIZON, eos=EOS, scale=SCALE, seed=table_seed)
        grads = [_flat(tb.exact_kl_grad(d)) for d in ("pi||ref", "ref||pi")]
        grads += [_flat(tb.token_local().exact_kl_grad(d)) for d in ("pi||ref", "ref||pi")]
        gaps = [
            float((a - b).norm() / torch.maximum(a.norm(), b.norm()))
            for a, b in itertools.combinations(grads, 2)
        ]
        if min(gaps) >= SEPARATION:
            return tb
    raise AssertionError("unreachable")


def _flat(grads: list[Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def batch_of(sample: Sample) -> Batch:
    """A testbed sample as a trainer's batch: ``PROMPTS`` prompts of equal group size."""
    n = sample.logp.shape[0]
    group = torch.arange(n) * PROMPTS // n
    return Batch(sample.logp, sample.logp_ref, sample.mask, group, sample.logits, sample.logits_ref)


def _loss(call: KLCall, reduction: str = "seq-mean-token-sum") -> Callable[[Sample], Tensor]:
    def loss(sample: Sample) -> Tensor:
        return call(batch_of(sample), reduction=reduction)

    return loss


def _per_sequence(call: KLCall) -> Callable[[Sample], Tensor]:
    return _loss(call, "per-sequence")


def _z_for_kl(a: GradAudit, direction: str) -> float:
    """The audit's statistic for "the mean gradient is the exact gradient of KL(direction)"."""
    return a.z_target if a.direction == direction else a.z_other


def _gradient_verdict(seq: GradAudit, local: GradAudit, threshold: float) -> str:
    """Which KL the mean gradient descends, from the audit against the sequence-level KLs
    (``seq``) and against the token-local ones (``local``): a statistic above ``threshold``
    rejects its hypothesis."""
    ok = {
        (part, d): _z_for_kl(a, d) <= threshold
        for part, a in (("seq", seq), ("local", local))
        for d in ("pi||ref", "ref||pi")
    }
    if ok["seq", "pi||ref"] != ok["seq", "ref||pi"]:
        return "descends KL(pi‖ref)" if ok["seq", "pi||ref"] else "descends KL(ref‖pi)"
    if ok["seq", "pi||ref"]:
        return "indistinguishable here"
    if ok["local", "pi||ref"] != ok["local", "ref||pi"]:
        return f"descends KL({'pi‖ref' if ok['local', 'pi||ref'] else 'ref‖pi'}), token-local"
    if seq.z_zero <= threshold:
        return "zero in expectation"
    return "biased"


def _value_verdict(seq: ValueAudit, local: ValueAudit, threshold: float) -> str:
    """What the value estimates: the KL, the token-level KL(ref||pi), or neither, with the
    measured bias relative to the KL (± its standard error); ``|z|`` above ``threshold`` rejects."""
    arrow = seq.direction.replace("||", "‖")
    rel = f"{seq.bias / seq.exact:+.1%} ± {seq.se_bias / seq.exact:.1%}"
    if abs(seq.z) <= threshold:
        return f"KL({arrow}) (bias {rel})"
    if seq.direction == "ref||pi" and abs(local.z) <= threshold:
        return f"token-level KL(ref‖pi) ({rel} of KL(ref‖pi))"
    return f"biased ({rel} of KL({arrow}))"


def _measure(config: RunConfig, bar: Any) -> dict[str, Any]:
    testbed = _separated_testbed()
    local = testbed.token_local()
    # --quick: 600 batches keep the weakest rejection (score+mean against grad KL(pi||ref), z
    # about 9.6) 5 standard deviations above the verdict threshold; at 300 it was 2.7.
    trials = 600 if config.quick else 2000
    value_trials = 50 if config.quick else 500
    calls = [o.call for o in OPTIONS] + [o.intended for o in OPTIONS]
    grads = {c.gradient_key(): c for c in calls}
    values = {c.value_key(): c for c in calls}
    # One-sided tests of the gradients: 5 per gradient (the 2 sequence-level KLs, zero, the 2
    # token-local KLs) and 3 per aggregation; two-sided tests of the values, 2 per value. The
    # table's false-alarm rate, FALSE_ALARM, is Bonferroni-corrected over all of them.
    z_grad = table_threshold(5 * len(grads) + 3 * len(AGGREGATIONS), two_sided=False)
    z_value = table_threshold(2 * len(values))
    common = dict(batch_size=BATCH, n_trials=trials, seed=config.seed, z_threshold=z_grad)
    gradients: dict[str, dict[str, Any]] = {}
    for key, call in grads.items():
        seq = audit_grad(_loss(call), testbed, direction=call.direction, name=key, **common)
        tok = audit_grad(_loss(call), local, direction=call.direction, name=key, **common)
        gradients[key] = {
            "verdict": _gradient_verdict(seq, tok, z_grad),
            "sequence": _grad_summary(seq),
            "token_local": _grad_summary(tok),
        }
        bar.update(1)
    value_rows: dict[str, dict[str, Any]] = {}
    for key, call in values.items():
        vcommon = dict(
            direction=call.direction,
            batch_size=VALUE_BATCH,
            n_trials=value_trials,
            seed=config.seed,
            z_threshold=z_value,
            name=key,
        )
        seq_v = audit_value(_per_sequence(call), testbed, **vcommon)
        tok_v = audit_value(_per_sequence(call), local, **vcommon)
        value_rows[key] = {
            "verdict": _value_verdict(seq_v, tok_v, z_value),
            "sequence": seq_v.as_dict(),
            "token_local": tok_v.as_dict(),
        }
        bar.update(1)
    aggregations = {}
    for reduction, users in AGGREGATIONS:
        a = audit_grad(_loss(RL_FIX, reduction), testbed, name=reduction, **common)
        aggregations[reduction] = {"users": users, **_grad_summary(a)}
        bar.update(1)
    mean_length = float(testbed.expectation(torch.ones_like))
    return {
        "testbed": {
            "vocab": VOCAB,
            "horizon": HORIZON,
            "eos": EOS,
            "scale": SCALE,
            "exact_kl_pi_ref": float(testbed.exact_kl("pi||ref").detach()),
            "exact_kl_ref_pi": float(testbed.exact_kl("ref||pi").detach()),
            "token_level_kl_ref_pi": float(testbed.token_local_kl("ref||pi").detach()),
            "mean_length": mean_length,
        },
        "batch": BATCH,
        "value_batch": VALUE_BATCH,
        "prompts": PROMPTS,
        "gradient_trials": trials,
        "value_trials": value_trials,
        "z_gradient": z_grad,
        "z_value": z_value,
        "false_alarm": FALSE_ALARM,
        "gradients": gradients,
        "values": value_rows,
        "aggregations": aggregations,
    }


def _grad_summary(a: GradAudit) -> dict[str, Any]:
    keep = (
        "direction",
        "z_target",
        "z_other",
        "z_zero",
        "cos_pi_ref",
        "cos_ref_pi",
        "rel_bias",
        "rel_bias_debiased",
        "coef_pi_ref",
        "coef_pi_ref_se",
        "coef_ref_pi",
        "coef_ref_pi_se",
        "exact_norm",
        "variance",
        "verdict",
    )
    return {k: getattr(a, k) for k in keep}


def _row_z(g: dict[str, Any]) -> str:
    """The statistic behind the verdict: z against the gradient it descends (or against 0, or
    against both sequence-level KLs when it descends neither)."""
    verdict = g["verdict"]
    part = g["token_local"] if "token-local" in verdict else g["sequence"]
    z = {part["direction"]: part["z_target"], _other(part["direction"]): part["z_other"]}
    if "pi‖ref" in verdict:
        return f"{z['pi||ref']:.1f}"
    if "ref‖pi" in verdict:
        return f"{z['ref||pi']:.1f}"
    if verdict == "zero in expectation":
        return f"{g['sequence']['z_zero']:.1f} (vs 0)"
    return f"{z['pi||ref']:.0f} / {z['ref||pi']:.0f} (vs pi‖ref / ref‖pi)"


def _other(direction: str) -> str:
    return "ref||pi" if direction == "pi||ref" else "pi||ref"


def _measured(g: dict[str, Any]) -> str:
    """Verdict, then z, cosines and relative error in one cell: the measured cells of a row
    (one cell for the three numbers keeps the table narrow enough for a page)."""
    s = g["sequence"]
    return (
        f"{g['verdict']} | z {_row_z(g)}, cos {s['cos_pi_ref']:.2f} / {s['cos_ref_pi']:.2f}, "
        f"rel. err {s['rel_bias_debiased']:.2f}"
    )


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def _tables(m: dict[str, Any]) -> str:
    tb = m["testbed"]
    lines = [
        f"Tabular autoregressive policy: V = {tb['vocab']}, T <= {tb['horizon']} with an "
        f"end-of-sequence token (mean length {tb['mean_length']:.2f}); KL(pi‖ref) = "
        f"{tb['exact_kl_pi_ref']:.3f}, KL(ref‖pi) = {tb['exact_kl_ref_pi']:.3f}, token-level "
        f"KL(ref‖pi) = {tb['token_level_kl_ref_pi']:.3f}. Batches of {m['batch']} sequences "
        f"from {m['prompts']} prompts; {m['gradient_trials']} batches per gradient, "
        f"{m['value_trials']} batches of {m['value_batch']} per value; per-token terms summed "
        "per sequence. A verdict "
        f"rejects a hypothesis above z = {m['z_gradient']:.2f} (gradients) or "
        f"{m['z_value']:.2f} (values): a false-alarm rate of {m['false_alarm']:.1e} for the "
        "table. z: the statistic of the hypothesis the verdict accepts (N(0, 1) when it "
        "holds). cos: of the mean gradient with the exact gradients of the sequence-level "
        "KL(pi‖ref) and KL(ref‖pi). rel. err: |mean gradient - exact gradient| / |exact "
        "gradient| for the KL the option names, Monte Carlo noise removed.",
        "",
        "| framework | option | value estimates | gradient descends (measured) | "
        "z, cos pi‖ref / ref‖pi, rel. err |",
        "|---|---|---|---|---|",
    ]
    for o in OPTIONS:
        g = m["gradients"][o.call.gradient_key()]
        v = m["values"][o.call.value_key()]["verdict"]
        lines.append(f"| {o.framework} | {_esc(o.option)} | {v} | {_measured(g)} |")
    # The calls as a list: beside the measurements (or in a table of their own) they made the
    # table too wide to read.
    lines += [
        "",
        "Each option as a klest call (same value and gradient), and the call that descends the "
        "KL it names (intended):",
        "",
    ]
    for o in OPTIONS:
        lines += [
            f"- {o.framework}, {_esc(o.option)}:",
            f"  - same: `{o.call.text(o.reduction)}`",
            f"  - intended: `{o.intended.text()}`",
        ]
    lines += [
        "",
        "The intended calls, measured the same way (variance: the trace of the covariance of "
        "one batch's gradient):",
        "",
        "| klest call | value estimates | gradient descends (measured) | "
        "z, cos pi‖ref / ref‖pi, rel. err | variance |",
        "|---|---|---|---|---|",
    ]
    for call in dict.fromkeys(o.intended for o in OPTIONS):
        g = m["gradients"][call.gradient_key()]
        v = m["values"][call.value_key()]["verdict"]
        lines.append(
            f"| `{_esc(call.text())}` | {v} | {_measured(g)} | {g['sequence']['variance']:.3f} |"
        )
    lines += [
        "",
        f"Aggregations of the intended gradient (`{_esc(RL_FIX.text())}` with "
        f"`reduction=`): coefficients of a regression of the mean gradient on the exact "
        f"gradients of KL(pi‖ref) and KL(ref‖pi) (1/mean length = "
        f"{1 / tb['mean_length']:.3f}):",
        "",
        "| reduction | used by | coef on ∇KL(pi‖ref) | coef on ∇KL(ref‖pi) | cos pi‖ref |",
        "|---|---|---|---|---|",
    ]
    for reduction, a in m["aggregations"].items():
        lines.append(
            f"| `{reduction}` | {_esc(a['users'])} | {a['coef_pi_ref']:.3f} ± "
            f"{a['coef_pi_ref_se']:.3f} | {a['coef_ref_pi']:+.3f} ± {a['coef_ref_pi_se']:.3f} | "
            f"{a['cos_pi_ref']:.3f} |"
        )
    lines += ["", "Notes:", ""]
    lines += [f"- {o.framework}, {_esc(o.option)}: {o.note}." for o in OPTIONS if o.note]
    return "\n".join(lines) + "\n"


def _figure(m: dict[str, Any]) -> Any:
    plt = pyplot()
    keys = list(m["gradients"])
    fig, axes = plt.subplots(
        1, 2, figsize=(12, 0.32 * len(keys) + 2.2), sharey=True, layout="constrained"
    )
    y = torch.arange(len(keys)).tolist()
    for ax, part, title in (
        (axes[0], "sequence", "sequence-level KLs"),
        (axes[1], "token_local", "token-local KLs"),
    ):
        kind = "" if part == "sequence" else "token-local "
        for offset, (coef, label) in enumerate((("pi_ref", "pi‖ref"), ("ref_pi", "ref‖pi"))):
            xs = [m["gradients"][k][part][f"coef_{coef}"] or 0.0 for k in keys]
            es = [m["gradients"][k][part][f"coef_{coef}_se"] or 0.0 for k in keys]
            ax.errorbar(
                xs,
                [v + 0.2 * offset - 0.1 for v in y],
                xerr=[2 * e for e in es],
                fmt="o",
                ms=4,
                label=f"coef on ∇ {kind}KL({label})",
            )
        ax.axvline(0, color="k", lw=0.5)
        ax.axvline(1, color="k", lw=0.5, ls="--")
        ax.set(title=f"mean gradient regressed on the {title}", xlabel="coefficient (± 2 se)")
        # Below the panel: above, it covered the first rows' points.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    axes[0].set_yticks(y, keys, fontsize=8)
    axes[0].invert_yaxis()
    return fig


def run(config: RunConfig) -> Report:
    torch.set_num_threads(1)  # thousands of tiny ops: threads only add overhead
    n_grads = len({c.gradient_key() for o in OPTIONS for c in (o.call, o.intended)})
    n_values = len({c.value_key() for o in OPTIONS for c in (o.call, o.intended)})
    total = n_grads + n_values + len(AGGREGATIONS)
    with progress_bar(total=total, desc="migration", enabled=config.progress) as bar:
        m = _measure(config, bar)
    rows = [
        {
            "key": o.key,
            "framework": o.framework,
            "option": o.option,
            "source": o.source,
            "call": o.call.text(o.reduction),
            "intended": o.intended.text(),
            "note": o.note,
            "value": m["values"][o.call.value_key()]["verdict"],
            "gradient": m["gradients"][o.call.gradient_key()]["verdict"],
            "gradient_key": o.call.gradient_key(),
            "intended_gradient_key": o.intended.gradient_key(),
            "value_key": o.call.value_key(),
        }
        for o in OPTIONS
    ]
    results = {"experiment": "migration", "quick": config.quick, "seed": config.seed}
    results |= {"rows": rows, **m}
    wrong = sorted({r["framework"] for r in rows if r["gradient"] != "descends KL(pi‖ref)"})
    summary = (
        f"{sum(r['gradient'] != 'descends KL(pi‖ref)' for r in rows)} of {len(rows)} options "
        f"do not descend the sequence-level KL(pi||ref) (frameworks: {', '.join(wrong)}); "
        "every intended call does."
        if all(
            m["gradients"][o.intended.gradient_key()]["verdict"].startswith("descends KL")
            and "token-local" not in m["gradients"][o.intended.gradient_key()]["verdict"]
            for o in OPTIONS
        )
        else "Some intended call does not descend its KL: see the table."
    )
    return Report(results, _tables(m), {"gradient_coefficients": _figure(m)}, summary)


EXPERIMENT = Experiment(
    name="migration",
    description="every KL option of TRL, verl, OpenRLHF, NeMo-RL, slime, Tinker: what it "
    "estimates and descends, measured",
    run=run,
)

__all__ = ["EXPERIMENT", "batch_of", "run"]
