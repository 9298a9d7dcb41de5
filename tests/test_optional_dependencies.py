"""The library works without its optional dependencies; the experiments say what to install."""

from __future__ import annotations

import sys

import pytest

from klest.cli import main


def test_klest_run_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(
        SystemExit, match=r"klest run schulman: .*pip install 'klest\[experiments\]'"
    ):
        main(["run", "schulman", "--quick", "--out", str(tmp_path), "--no-progress"])
    assert not list(tmp_path.iterdir()), "nothing is computed or written before the check"
