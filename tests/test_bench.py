"""The benchmark scripts run and write well-formed JSON (no timing is asserted: speed and memory
are measured by ``python benchmarks/bench_cpu.py`` / ``bench_gpu.py``, never by tests)."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME.py ARGS`` from the repository root, as the README runs it."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def import_script(name: str, monkeypatch: pytest.MonkeyPatch):
    """A benchmark script as a module (the scripts import their neighbour ``_common`` by name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


def test_vocab_cpu_quick_writes_every_method(tmp_path):
    done = run_script("bench_cpu", "--quick", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "vocab-cpu.json").read_text())
    assert [c["allocator"] for c in report["cases"]] == ["default"]  # --quick: one allocator
    sums = []
    for case in report["cases"]:
        assert set(case["results"]) == {
            "naive",
            "klest",
            "klest-details",
            "klest-recompute",
            "klest-overwrite",
        }
        for method, r in case["results"].items():
            assert "error" not in r, (method, r.get("error"))
            assert r["seconds"] > 0 and math.isfinite(r["time_vs_naive"])
            sums.append(r["kl_sum"])
            if method != "naive":  # the counted passes: both logits read at least once
                assert r["passes"]["logits"]["read"] >= 1 and r["passes_total"] >= 3
    # The methods compute the same KL: float32 sums of 256 KLs of size ~4 agree to ~1e-6.
    assert max(sums) - min(sums) <= 1e-5 * abs(sums[0])
    assert "| naive |" in done.stdout
    (hidden,) = report["hidden"]
    for method, r in hidden["results"].items():
        assert "error" not in r, (method, r.get("error"))
        assert r["matmul_calls"] >= 4 and r["products_of_the_head"] >= 4
    # The run is also kept, stamped, in the file of every run.
    (run,) = (tmp_path / "vocab-cpu.runs.jsonl").read_text().splitlines()
    assert json.loads(run) == report and "commit" in report and "time" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_vocab_gpu_needs_cuda(tmp_path):
    done = run_script("bench_gpu", "--quick", "--out", str(tmp_path))
    assert done.returncode != 0
    assert "needs a CUDA device" in done.stderr
    assert not list(tmp_path.iterdir())


def test_vocab_gpu_table_renders_the_recorded_run(monkeypatch):
    """The formatter reads every field the GPU benchmark writes: rendered from the H200 run kept in
    benchmarks/results (the benchmark itself needs CUDA, which CI lacks)."""
    format_vocab_gpu = import_script("bench_gpu", monkeypatch).format_vocab_gpu
    report = json.loads((BENCHMARKS / "results" / "vocab-gpu.json").read_text())
    table = format_vocab_gpu(report)
    for method in report["methods"]:
        assert f"| {method} |" in table
    assert "fused linear" in table and "nan" not in table.lower()


def test_overhead_quick_writes_every_case_and_appends_the_run(tmp_path):
    for _ in range(2):
        done = run_script("bench_overhead", "--quick", "--out", str(tmp_path), "--device", "cpu")
        assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "overhead-cpu.json").read_text())
    assert len(report["cases"]) == 3 and "commit" in report
    for case in report["cases"]:
        assert set(case["results"]) == {"plain", "klest"}
        for r in case["results"].values():
            assert math.isfinite(r["ratio"]) and math.isfinite(r["cpu_ratio"])
            assert len(r["seconds_all"]) == report["reps"] and r["cpu_seconds"] > 0
    runs = (tmp_path / "overhead-cpu.runs.jsonl").read_text().splitlines()
    assert len(runs) == 2 and json.loads(runs[-1])["cases"] == report["cases"]


def test_overhead_compile_writes_its_own_report_with_the_compiled_forms(tmp_path):
    args = ("--quick", "--compile", "--out", str(tmp_path), "--device", "cpu")
    done = run_script("bench_overhead", *args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "overhead-cpu.json").exists()
    report = json.loads((tmp_path / "overhead-cpu-compiled.json").read_text())
    assert report["compiled"] is True
    penalty = report["cases"][0]["results"]
    assert set(penalty) == {"plain", "klest", "plain, compiled", "klest, compiled, validate=False"}
    assert all(math.isfinite(r["ratio"]) for r in penalty.values())


def test_plain_penalty_is_the_same_math_as_kl_penalty(monkeypatch):
    """The benchmark's baseline computes what klest computes (value and gradient), so the
    ratio compares like with like."""
    bench = import_script("bench_overhead", monkeypatch)
    import klest

    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(16, 12, generator=g, dtype=torch.float64) * 3).requires_grad_()
    logp_ref = -torch.rand(16, 12, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(16, 12, dtype=torch.bool)
    mask[:, 9:] = False
    mask[3, 5:] = False
    plain = bench.plain_penalty(logp, logp_ref, mask, 8)
    ours = klest.kl_penalty(logp, logp_ref, mask=mask, baseline="loo", group=torch.arange(16) // 8)
    torch.testing.assert_close(ours, plain)
    (g_plain,) = torch.autograd.grad(plain, [logp])
    (g_ours,) = torch.autograd.grad(ours, [logp])
    torch.testing.assert_close(g_ours, g_plain)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_the_gpu_session_script_refuses_to_run_without_a_gpu(tmp_path):
    """``benchmarks/run_on_gpu.sh`` parses, and on a machine without CUDA stops at once, saying
    why, before running anything."""
    script = BENCHMARKS / "run_on_gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    done = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr, done.stderr
    assert not list((tmp_path / "out").iterdir())
