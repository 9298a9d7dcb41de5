"""The benchmark commands run and write well-formed JSON (no timing is asserted: speed and
memory are measured by `klest bench`, never by tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from klest.bench_gpu import format_vocab_gpu
from klest.cli import main


def test_vocab_cpu_quick_writes_every_method(tmp_path, capsys):
    assert main(["bench", "vocab-cpu", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "vocab-cpu.json").read_text())
    assert [c["allocator"] for c in report["cases"]] == ["default", "cached"]
    sums = []
    for case in report["cases"]:
        assert set(case["results"]) == {"naive", "klest", "klest-recompute"}
        for method, r in case["results"].items():
            assert "error" not in r, (method, r.get("error"))
            assert r["seconds"] > 0 and math.isfinite(r["time_vs_naive"])
            sums.append(r["kl_sum"])
    # The methods compute the same KL: float32 sums of 256 KLs of size ~4 agree to ~1e-6.
    assert max(sums) - min(sums) <= 1e-5 * abs(sums[0])
    assert "| naive |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_vocab_gpu_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="CUDA"):
        main(["bench", "vocab-gpu", "--quick", "--out", str(tmp_path)])


def test_vocab_gpu_table_renders_the_recorded_run():
    """The formatter reads every field the GPU benchmark writes: rendered from the H200 run kept in
    benchmarks/results (the benchmark itself needs CUDA, which CI lacks)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "vocab-gpu.json"
    report = json.loads(path.read_text())
    table = format_vocab_gpu(report)
    for method in report["methods"]:
        assert f"| {method} |" in table
    assert "fused linear" in table and "nan" not in table.lower()
