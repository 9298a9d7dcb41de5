"""The `klest` command end to end: experiments write result.json, table.md and PNG plots."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

import pytest

from klest.audit import SEQUENCE_VALUE_AUDIT, TOPK_AUDIT, VALUE_AUDIT, VARIATIONAL_AUDIT
from klest.cli import _parser, main
from tests._progress import assert_reports_every_unit
from tests._stats import RATE, assert_failures_consistent, z_for


def test_list_names_the_experiments(capsys):
    assert main(["list"]) == 0
    assert "schulman" in capsys.readouterr().out


def test_command_line_run_schulman_quick_seed_3_reproduces_the_table(tmp_path):
    """The installed command line (``python -m klest.cli``): exit code, files, the table, and
    progress on a standard error that is not a terminal (a pipe): with the interval at 0, a line
    per audit (2 x 3 table rows, 6 x 3 sweep points) and one for the figures."""
    out = tmp_path / "schulman"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "klest.cli", "run", "schulman", "--quick", "--seed", "3"),
            *("--out", str(out), "--progress"),
        ],
        capture_output=True,
        text=True,
        # 2 shared cores: no oversubscription. A progress line at every update.
        env={**os.environ, "OMP_NUM_THREADS": "1", "KLEST_PROGRESS_INTERVAL": "0"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert assert_reports_every_unit(proc.stderr, "schulman") == (2 + 6) * 3 + 1
    result = json.loads((out / "result.json").read_text())
    assert result["seed"] == 3 and result["quick"] is True
    rows = {(s["mu"], r["estimator"]): r for s in result["settings"] for r in s["rows"]}
    # The closed forms the issue names, recomputed here independently of the experiment.
    assert rows[(0.1, "k1")]["stdev_over_true_closed_form"] == pytest.approx(20.0)
    assert rows[(1.0, "k2")]["bias_over_true_closed_form"] == pytest.approx(0.25)
    assert rows[(1.0, "k2")]["stdev_over_true_closed_form"] == pytest.approx(3**0.5)
    assert rows[(1.0, "k3")]["stdev_over_true_closed_form"] == pytest.approx(
        2 * (2.718281828459045 - 2) ** 0.5
    )
    # The 12 z statistics (2 mus x 3 estimators x bias and stdev) against the closed forms:
    # Bonferroni at RATE (6.3e-5) for the 12, two-sided (4.55; the experiment's own 3 would be
    # a false-fail rate of up to 3%, see test_schulman_flag_at_seed_12).
    assert len(rows) == 6
    assert max(_schulman_z(result)) <= z_for(RATE, 12), _schulman_z(result)
    # The experiment's flags are what its stated rule says (|z| <= 3, bias and stdev).
    for r in rows.values():
        assert r["agrees"] == (abs(r["bias_z"]) <= 3 and abs(r["stdev_z"]) <= 3)
    assert result["reproduced"] == all(r["agrees"] for r in rows.values())
    assert (out / "table.md").read_text().count("| k3 |") == 2
    assert (out / "stdev_bias_vs_mu.png").stat().st_size > 10_000
    assert (out / "per_sample_histograms.png").stat().st_size > 10_000
    assert "reproduced" in proc.stdout and str(out / "result.json") in proc.stdout


def _schulman_z(result: dict) -> list[float]:
    """|z| of every bias and stdev entry of the schulman experiment's result."""
    return [abs(r[k]) for s in result["settings"] for r in s["rows"] for k in ("bias_z", "stdev_z")]


@pytest.mark.calibration
def test_schulman_entries_within_the_bonferroni_threshold_over_seeds():
    """The schulman experiment's --quick table (its rows only: the same audits as
    ``klest run schulman --quick``) at 30 seeds: no |z| above ``z_for(RATE, 12)``; no failure
    expected (30 x 6.3e-5 = 1.9e-3)."""
    from klest.experiments import schulman

    worst = []
    for seed in range(30):
        rows = [
            schulman._row(e, mu, 400_000, seed, False)
            for mu in schulman.MUS
            for e in schulman.ESTIMATORS
        ]
        worst.append(max(_schulman_z({"settings": [{"rows": rows}]})))
    assert_failures_consistent(worst, z_for(RATE, 12), RATE, "schulman |z|")


def test_schulman_flag_at_seed_12(tmp_path):
    """``klest run schulman --quick --seed 12``: its k1 stdev entry at mu = 0.1 is 3.6 standard
    errors out (a 1-in-3000 event per comparison, 1-in-250 for 12), which a 3-standard-error
    rule would call "NOT reproduced"; the experiment's threshold is from a stated rate
    (Bonferroni: 4.55 for 6.3e-5 over 12)."""
    from klest.experiments import schulman

    assert pytest.approx(z_for(RATE, 12)) == schulman.AGREEMENT_SE
    out = tmp_path / "schulman"
    argv = ["run", "schulman", "--quick", "--seed", "12", "--out", str(out), "--no-progress"]
    status = main(argv)
    result = json.loads((out / "result.json").read_text())
    assert max(_schulman_z(result)) <= z_for(RATE, 12)  # the statistics are fine
    assert (status, result["reproduced"]) == (0, True)


AUDIT_Z = 4.0
"""The audit's threshold on its statistics (``klest.audit.audit_grad``'s default)."""


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    """Cells of the markdown rows whose first cell is ``first_cell``."""
    rows = []
    for line in text.splitlines():
        # Cells are separated by " | " (a KL's name contains "||").
        cells = [c.strip() for c in line.strip().removeprefix("|").removesuffix("|").split(" | ")]
        if line.startswith("|") and cells[0] == first_cell:
            rows.append(cells)
    return rows


def _value_and_se(cell: str) -> tuple[float, float]:
    value, _, se = cell.partition("±")
    return float(value), float(se)


def _objective_verdicts() -> dict[str, str]:
    """The verdict each objective option's row (``+value``, ``;weights=``) and each variational
    bound's row must print: what their exact mean gradients say (tests/audit/test_core.py, the
    quadrature of tests/testbeds/test_variational.py)."""
    weighted = "E[Σ w·ρ] (w·ρ fixed)"
    verdicts = {
        "k1/cumulative+value": "descends KL(pi||ref)",
        "k1/cumulative;weights=clipped-ratio": f"descends {weighted}, not KL(pi||ref)",
        "k1/cumulative;weights=clipped-prefix-ratio": f"descends {weighted}, not KL(pi||ref)",
        "rb/rb;weights=clipped-prefix-ratio": f"descends {weighted}, not KL(pi||ref)",
        "rb/rb;weights=clipped-ratio": f"biased: neither KL; not {weighted}",
    }
    # The variational bounds: pathwise and DReG follow -E[bound] (the quadrature's gradient),
    # STL only at K = 1.
    for alpha, k in VARIATIONAL_AUDIT:
        bound = f"IWAE_{k}" if alpha == 0.0 else f"L_{alpha:g},{k}"
        name = "iwae" if alpha == 0.0 else f"renyi:{alpha:g}"
        for grad in ("pathwise", "stl", "dreg"):
            verdicts[f"{name}/{grad} K={k}"] = (
                "descends KL(pi||ref)"
                if k == 1
                else f"biased: neither KL; not -E[{bound}]"
                if grad == "stl"
                else f"descends -E[{bound}], not KL(pi||ref)"
            )
    return verdicts


N_OBJECTIVE_NULLS = 5
"""Null statistics (one-sided) of the tabular rows of :func:`_objective_verdicts`: z(target)
and z(objective) of ``+value`` (which prints no z(objective)), and z(objective) of the three
weighted rows that descend their objective. The variational bounds' null statistics are left
out of the threshold: at the quick size (100 trials) they are not normal (40 seeds, the 6 null
rows of K > 1: mean +0.25, sd 1.13, 4 of 240 above 3.8 where N(0, 1) gives 0.02; the worst
4.5), so no rate can be stated for them from the normal approximation; their mean gradients'
claims are tested on exact answers in tests/sampled/test_importance_weighted.py and
tests/testbeds/test_variational.py."""


def _is_variational(spec: str) -> bool:
    return spec.startswith(("iwae/", "renyi:"))


def _objective_rows(text: str):
    """Per row of :func:`_objective_verdicts`: ``(spec, verdict, cells, statistics, nulls)``;
    the statistics z(target) and z(objective) (NaN where not printed), the nulls the names of
    those that are null: z(target) where the row descends the claimed KL (and its z(objective),
    printed for the K = 1 bounds, whose objective is that KL), z(objective) where it descends
    its objective; the others are alternatives (expected 7.9 or more at the quick size)."""
    for spec, verdict in _objective_verdicts().items():
        (row,) = [r for r in _table_rows(text, spec) if len(r) == 11]
        found = re.search(r"\(z\(objective\) (-?[\d.]+)\)", row[-1])
        stats = {"target": float(row[5]), "objective": float(found[1]) if found else math.nan}
        null = set()
        if verdict.startswith("descends"):
            null = {"target", "objective"} if verdict.startswith("descends KL") else {"objective"}
        yield spec, verdict, row, stats, null


@pytest.mark.calibration
def test_objective_rows_nulls_within_bonferroni_over_seeds():
    """The tabular objective rows' null statistics in ``klest audit --quick`` (the whole
    suite's draws, so each seed's are those of the CLI) at 40 seeds: none above
    ``z_for(RATE, N_OBJECTIVE_NULLS)`` one-sided; no failure expected (40 x 6.3e-5)."""
    from klest.audit import run_audit_suite

    worst = []
    for seed in range(40):
        text = run_audit_suite(quick=True, seed=seed, progress=False)
        worst.append(
            max(
                stats[key]
                for spec, _, _, stats, null in _objective_rows(text)
                if not _is_variational(spec)
                for key in null
                if not math.isnan(stats[key])
            )
        )
    z = z_for(RATE, N_OBJECTIVE_NULLS, two_sided=False)
    assert_failures_consistent(worst, z, RATE, "objective rows' null z")


def test_audit_quick_shows_sequence_level_rows_and_baselines(capsys, monkeypatch):
    """``klest audit --quick``: every value estimator on every testbed, @sequence rows on the
    tabular testbed, and the mean / EMA baselines in the gradient tables.

    On sequences the token-level KL(ref||pi) estimators have an exact mean different from the
    KL (prefixes from pi, not ref; exact, no sampling); the @sequence rows' exact mean is the
    KL, and their measured bias is within z standard errors. ``+mean`` scales the expected
    gradient by 1 - 1/8 (batches of 8): its regression coefficient on the claimed KL's gradient
    must be within z of its standard errors of 0.875. z: Bonferroni at ``RATE`` (6.3e-5) over
    these 12 two-sided comparisons (10 @sequence rows, 2 coefficients): 4.55. Progress (by
    default, on a standard error that is not a terminal): a line per audit at interval 0.
    The printed verdicts of the objective options' rows (``+value``, ``;weights=``) and of the
    variational bounds' are what their exact mean gradients say: the tabular rows' null
    statistics (5, one-sided) within Bonferroni's z at ``RATE`` (the variational ones are not
    normal at this size: ``N_OBJECTIVE_NULLS``), every alternative (7.9 to 45 at this size)
    above the audit's 4.0, and the verdict printed where the nulls are below 4.0.
    """
    monkeypatch.setenv("KLEST_PROGRESS_INTERVAL", "0")
    assert main(["audit", "--quick"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    audits = 2 * (3 * len(VALUE_AUDIT) + len(SEQUENCE_VALUE_AUDIT)) + 4 * len(TOPK_AUDIT)
    assert assert_reports_every_unit(captured.err, "klest audit") > audits  # and the gradients
    z = z_for(RATE, 2 * len(SEQUENCE_VALUE_AUDIT) + 2)
    for spec in VALUE_AUDIT:
        rows = _table_rows(text, spec)
        assert len(rows) == 3 * 2, spec  # three testbeds, two directions
    for spec in SEQUENCE_VALUE_AUDIT:
        rows = _table_rows(text, f"{spec}@sequence")
        assert [r[2] for r in rows] == ["KL(pi||ref)", "KL(ref||pi)"], spec
        for r in rows:
            assert r[1] == "tabular-autoregressive"
            exact = float(r[3])
            if r[4] != "—":  # fixed coefficients have an exact mean: the KL itself
                assert float(r[4]) == pytest.approx(exact, rel=1e-4)
            assert abs(float(r[7])) <= z, r  # z column
    (k3_token,) = [
        r for r in _table_rows(text, "k3") if r[1:3] == ["tabular-autoregressive", "KL(ref||pi)"]
    ]
    assert abs(float(k3_token[4]) / float(k3_token[3]) - 1) > 0.05, k3_token
    for direction in ("KL(pi||ref)", "KL(ref||pi)"):
        (ema,) = [r for r in _table_rows(text, "k3/score+ema") if r[1] == direction]
        assert ema[-1] == f"descends {direction}"
        (mean,) = [r for r in _table_rows(text, "k3/score+mean") if r[1] == direction]
        coef, se = _value_and_se(mean[8] if direction == "KL(pi||ref)" else mean[9])
        assert abs(coef - (1 - 1 / 8)) <= z * se, mean
    # The top-k section: each estimator's value row and gradient row in both directions.
    for est in TOPK_AUDIT:
        rows = _table_rows(text, f"topk:{est}")
        value_rows = [r[2] for r in rows if r[1].startswith("categorical")]
        grad_rows = [r[1] for r in rows if not r[1].startswith("categorical")]
        assert value_rows == grad_rows == ["KL(pi||ref)", "KL(ref||pi)"], (est, rows)
    for row in _table_rows(text, "topk:generalized"):  # deterministic: exact verdicts
        assert row[-1] in ("yes", "biased: neither KL"), row
    z_null = z_for(RATE, N_OBJECTIVE_NULLS, two_sided=False)  # 4.21
    rows = list(_objective_rows(text))
    assert sum(len(r[-1]) for r in rows if not _is_variational(r[0])) == N_OBJECTIVE_NULLS
    for spec, verdict, row, stats, null in rows:
        for key, z in ((k, z) for k, z in stats.items() if not math.isnan(z)):
            if key in null:
                assert _is_variational(spec) or z <= z_null, (key, row)
            else:
                assert z > AUDIT_Z, (key, row)
        if all(stats[key] <= AUDIT_Z for key in null if not math.isnan(stats[key])):
            assert row[-1].split(" (z(objective)")[0] == verdict, row
    for grad, exact_zero in (("pathwise", False), ("stl", True), ("dreg", True)):
        (row,) = [r for r in _table_rows(text, f"iwae/{grad} K=2") if len(r) == 4]
        assert (row[1:3] == ["0", "0"]) == exact_zero, row


def test_unknown_experiment_exits_with_a_message():
    with pytest.raises(SystemExit, match="unknown experiment 'nope'"):
        main(["run", "nope", "--quick"])


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_has_help_text():
    """Every argument and option of every command says what it does in ``--help``."""
    commands = _subparsers()
    assert set(commands) == {"list", "run", "audit", "demo"}
    for name, parser in commands.items():
        for action in parser._actions:
            assert action.help and action.help.strip(), (name, action.option_strings)


@pytest.mark.parametrize("command", [[], ["run"], ["audit"], ["demo"], ["list"]])
def test_help_is_plain_text(command, capsys):
    """``klest [COMMAND] --help`` prints plain text: a description, no reST markup (double
    backticks, roles such as :func:) and no markdown code spans."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: klest")
    assert len(text.split("\n\n")[1]) > 40, text  # a description paragraph
    assert "`" not in text and not re.search(r":(func|class|mod|meth|doc|data):", text), text


def test_demo_announces_each_experiment_and_passes_progress_on(monkeypatch, capsys):
    """``klest demo`` says on standard error which experiment runs (i of n) before running it,
    each with progress on (and off with --no-progress)."""
    from klest import cli

    calls = []

    def fake(name, *, quick, seed, out, progress):
        calls.append((name, quick, progress, capsys.readouterr().err))
        return True

    monkeypatch.setattr(cli, "_run_experiment", fake)
    assert main(["demo", "--quick"]) == 0
    assert calls == [
        (name, True, True, f"klest demo: {i}/{len(cli.DEMO)} {name}\n")
        for i, name in enumerate(cli.DEMO, 1)
    ]
    calls.clear()
    assert main(["demo", "--no-progress"]) == 0
    assert calls == [(name, False, False, "") for name in cli.DEMO]
