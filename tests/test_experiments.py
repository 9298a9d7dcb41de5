"""Every experiment runs end to end in --quick mode and shows what its seed claims.

Each test runs `klest run NAME --quick`, checks the files written, and asserts the claims on the
numbers in result.json (the claims are restated from the seeds, not read from the code).
"""

from __future__ import annotations

import json

import pytest

from klest.cli import main


def run_quick(name: str, tmp_path) -> dict:
    out = tmp_path / name
    assert main(["run", name, "--quick", "--out", str(out), "--no-progress"]) == 0
    assert (out / "table.md").stat().st_size > 100
    assert list(out.glob("*.png")), "no plot written"
    return json.loads((out / "result.json").read_text())


def test_chimera_variance(tmp_path):
    r = run_quick("chimera-variance", tmp_path)
    rows = {row["D"]: row for row in r["rows"]}
    assert r["k1_and_chimera_flat"]  # k1 / Chimera: 1/B at every D
    # k3 explodes with D, the seed code's inverted ratio much faster.
    assert rows[1000]["k3"]["monte_carlo"] > 100 * rows[1]["k3"]["monte_carlo"]
    assert rows[1000]["k3 (seed code)"]["closed_form"] > 100 * rows[1000]["k3"]["closed_form"]
    # Sticking the landing: the gradient is exactly mu, variance 0 at every D (to rounding).
    assert all(row["chimera + stl"]["monte_carlo"] < 1e-20 for row in r["rows"])
    for d in (1, 10, 100):  # light tails: Monte Carlo within 30% of the closed form
        for e in ("k1", "k3", "chimera"):
            assert rows[d][e]["monte_carlo"] == pytest.approx(rows[d][e]["closed_form"], rel=0.3)


def test_chimera_training(tmp_path):
    r = run_quick("chimera-training", tmp_path)
    c = r["curves"]
    # At D = 1000, k3's gradient noise makes Adam diverge; k1 and Chimera make progress.
    assert c["1000/k3"]["exact_kl"][-1] > c["1000/k3"]["initial_kl"]
    for e in ("k1", "chimera"):
        assert c[f"1000/{e}"]["exact_kl"][-1] < c[f"1000/{e}"]["initial_kl"]
    # k1's gradient noise does not vanish at the optimum; sticking the landing's does.
    assert c["1000/chimera + stl"]["exact_kl"][-1] < 0.1 * c["1000/chimera"]["exact_kl"][-1]
    # At D = 10, k3 converges fastest (the seed's low-dimension caveat).
    assert c["10/k3"]["exact_kl"][-1] < c["10/chimera"]["exact_kl"][-1]


def test_pitfalls(tmp_path):
    r = run_quick("pitfalls", tmp_path)
    a = r["A_gradient_bias_mse"]
    for regime in ("low KL", "high KL"):
        est = a[regime]["estimators"]
        assert est["k1/autodiff"]["8"][0]["verdict"] == "mean gradient zero"
        for e in ("k3/cumulative", "k3/cumulative+loo", "rb/rb", "k3/score"):
            assert est[e]["8"][0]["verdict"] == "descends KL(pi||ref)", (regime, e)
        for e in ("k3/autodiff", "k3/token"):
            assert est[e]["8"][0]["verdict"].startswith("biased"), (regime, e)
    final = r["C_final_kl_to_optimum"]
    assert final["k1/autodiff"] > 2 * final["k3/cumulative"]


def test_control_variates(tmp_path):
    r = run_quick("control-variates", tmp_path)
    rows = {row["ref_std"]: row for row in r["rows"]}
    # The fitted coefficient shrinks as the ratio's tails get heavier.
    assert rows[2.5]["alpha_large_sample"] < 0.2 < rows[0.8]["alpha_large_sample"]
    # Seed 001's in-sample fit is biased; leave-one-out / cross-fitted / EMA are not.
    assert rows[1.3]["estimators"]["cv:in-sample"]["significant_bias"]
    for s, row in rows.items():
        if row["var_r_finite"]:
            for e in ("k1", "cv:loo", "cv:crossfit", "cv:ema"):
                assert not row["estimators"][e]["significant_bias"], (s, e)
    # Where r is light-tailed the fitted control variate beats both k1 and k3.
    e = rows[0.8]["estimators"]
    assert e["cv:loo"]["std"] < 0.5 * min(e["k1"]["std"], e["k3"]["std"])


def test_mode_seeking(tmp_path):
    r = run_quick("mode-seeking", tmp_path)
    assert r["mode_seeking"] and r["mass_covering"]
