"""The `klest` command end to end: experiments write result.json, table.md and PNG plots."""

from __future__ import annotations

import json

import pytest

from klest.cli import main


def test_list_names_the_experiments(capsys):
    assert main(["list"]) == 0
    assert "schulman" in capsys.readouterr().out


def test_run_schulman_quick_reproduces_the_table(tmp_path, capsys):
    out = tmp_path / "schulman"
    assert main(["run", "schulman", "--quick", "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["reproduced"] is True
    rows = {(s["mu"], r["estimator"]): r for s in result["settings"] for r in s["rows"]}
    # The closed forms the issue names, recomputed here independently of the experiment.
    assert rows[(0.1, "k1")]["stdev_over_true_closed_form"] == pytest.approx(20.0)
    assert rows[(1.0, "k2")]["bias_over_true_closed_form"] == pytest.approx(0.25)
    assert rows[(1.0, "k2")]["stdev_over_true_closed_form"] == pytest.approx(3**0.5)
    assert rows[(1.0, "k3")]["stdev_over_true_closed_form"] == pytest.approx(
        2 * (2.718281828459045 - 2) ** 0.5
    )
    for r in rows.values():
        assert abs(r["bias_z"]) <= 3 and abs(r["stdev_z"]) <= 3
    assert (out / "table.md").read_text().count("| k3 |") == 2
    assert (out / "stdev_bias_vs_mu.png").stat().st_size > 10_000
    assert (out / "per_sample_histograms.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "reproduced" in printed and str(out / "result.json") in printed


def test_unknown_experiment_exits_with_a_message():
    with pytest.raises(SystemExit, match="unknown experiment 'nope'"):
        main(["run", "nope", "--quick"])
