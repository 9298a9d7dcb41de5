"""The library works without its optional dependencies; the experiments say what to install.

matplotlib and tqdm are the ``klest[experiments]`` extra: ``import klest`` must not load them,
progress bars must fall back to plain lines without tqdm, and ``klest run`` without matplotlib
must say which extra to install.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from klest._progress import progress_bar
from klest.audit import audit_grad, audit_value
from klest.cli import main
from klest.testbeds import TabularAutoregressive

OPTIONAL = ("matplotlib", "tqdm")


def test_import_klest_loads_neither_matplotlib_nor_tqdm():
    """In a fresh interpreter. torch itself imports tqdm when it is installed (torch.hub, which
    falls back to its own bar without it), so torch is imported with tqdm hidden, then tqdm is
    made importable again before ``import klest``."""
    code = (
        "import sys\n"
        "sys.modules['tqdm'] = None\n"
        "import torch\n"
        "del sys.modules['tqdm']\n"
        "import klest\n"
        f"loaded = [name for name in {OPTIONAL!r} if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_library_and_its_progress_bars_work_without_tqdm_or_matplotlib():
    """A fresh interpreter where neither imports (as if not installed): audits with progress
    bars asked for run, and report in plain lines (one per update: interval 0), nothing else."""
    code = (
        "import sys\n"
        f"for name in {OPTIONAL!r} + ('tqdm.auto', 'matplotlib.pyplot'):\n"
        "    sys.modules[name] = None\n"
        "import klest\n"
        "from klest.testbeds import GaussianTestbed\n"
        "tb = GaussianTestbed.schulman(1.0)\n"
        "a = klest.audit_value('k3', tb, batch_size=4, n_trials=5, progress=True)\n"
        "b = klest.audit_value('cv:ema', tb, batch_size=4, n_trials=5, progress=True)\n"
        "g = klest.audit_grad('k3/pathwise', tb, batch_size=4, n_trials=5, progress=True)\n"
        "assert a.n_draws == 20 and b.n_draws == 5 and g.n_trials == 5\n"
    )
    env = {**os.environ, "KLEST_PROGRESS_INTERVAL": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = [line.rsplit(", ", 1)[0] for line in done.stderr.splitlines()]  # less the time
    # k3: one block of draws; cv:ema: 5 trials one by one; the gradient: 5 trials.
    assert counts == [
        "audit k3: 1/1 (100%)",
        *(f"audit cv:ema: {i}/5 ({20 * i}%)" for i in range(1, 6)),
        *(f"audit k3/pathwise: {i}/5 ({20 * i}%)" for i in range(1, 6)),
    ], done.stderr  # no warning


def test_progress_bar_without_tqdm_iterates_updates_and_closes(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `from tqdm.auto import ...` now fails
    assert list(progress_bar(range(3), desc="x")) == [0, 1, 2]
    with progress_bar(total=3, desc="x") as bar:
        bar.update()
        bar.update(2)
    bar.close()
    with pytest.raises(TypeError, match="no iterable"):
        iter(progress_bar(total=3, desc="x"))


def test_progress_bar_is_tqdm_on_a_terminal_when_installed_and_enabled(monkeypatch):
    tqdm = pytest.importorskip("tqdm.auto").tqdm
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = progress_bar(range(3), desc="x", enabled=True)
    assert isinstance(bar, tqdm) and list(bar) == [0, 1, 2]
    assert not isinstance(progress_bar(range(3), desc="x", enabled=False), tqdm)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_audits_with_and_without_progress_bars_agree():
    """A bar only watches the loop: the same seed gives the same draws."""
    tb = TabularAutoregressive.random(3, 3, eos=2, seed=0)
    runs = [
        (
            audit_value("k3", tb, batch_size=4, n_trials=20, progress=progress),
            audit_value("cv:ema", tb, batch_size=4, n_trials=20, progress=progress),
            audit_grad("k3/score", tb, batch_size=4, n_trials=20, progress=progress),
        )
        for progress in (False, True)
    ]
    (k3, ema, grad), (k3_bar, ema_bar, grad_bar) = runs
    assert (k3.mean, k3.std, ema.mean, ema.std) == (
        k3_bar.mean,
        k3_bar.std,
        ema_bar.mean,
        ema_bar.std,
    )
    assert torch.equal(grad.mean_grad, grad_bar.mean_grad)


def test_klest_run_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    expected = r"klest run schulman: .*pip install 'klest\[experiments\]'"
    with pytest.raises(SystemExit, match=expected):
        main(["run", "schulman", "--quick", "--out", str(tmp_path), "--no-progress"])
    assert not list(tmp_path.iterdir()), "nothing is computed or written before the check"
