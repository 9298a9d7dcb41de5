"""The topk experiment (quick): every row present; the deterministic estimators have no spread
and the tail bucket is below the KL; the sampled ones spread. (Their unbiasedness is tested in
tests/logits/test_topk.py, exactly and with enough draws: 64 draws of an importance-weighted
tail are too heavy-tailed for a normal approximation.)"""

from __future__ import annotations

from klest.experiments import registry
from klest.experiments.runner import RunConfig, write_report
from klest.experiments.topk import TEACHERS


def test_topk_quick(tmp_path):
    report = registry()["topk"].run(RunConfig(quick=True, progress=False))
    write_report(report, tmp_path)
    assert (tmp_path / "table.md").read_text().count("| unbiased-cv |") == 2 * 2 * 3
    rows = {key: s for key, s in report.results.items() if isinstance(s, dict)}
    assert len(rows) == len(TEACHERS) * 2 * 3 * 5
    for key, s in rows.items():
        estimator = key.rsplit("/", 1)[1]
        if estimator.startswith("unbiased"):
            assert s["rel_std"] > 0 and s["grad_rel_var"] > 0
        else:
            assert s["rel_std"] == 0 and s["rel_bias_se"] == 0
        if estimator == "tail-bucket":
            assert s["rel_bias"] < 0, key
