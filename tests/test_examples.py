"""Every script in ``examples/`` runs with ``--quick`` and ends with its ``RESULT:`` line.

The scripts are found by a glob, so an example added later is tested without editing this file.
Each runs as a user runs it, ``python examples/NAME.py --quick --seed 0``, from the repository
root, with this checkout's ``src`` first on the path, Triton's interpreter
(``TRITON_INTERPRET=1``) and one intra-op thread per process (the suite runs on two shared
cores). A script exits non-zero when
what it demonstrates did not happen, so the exit code is the check of its claim; its own
statistical checks state their false-alarm rates. No timing is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Modules whose names start with an underscore are the examples' shared helpers.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


def run_example(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def test_the_examples_are_found():
    names = {p.name for p in EXAMPLES}
    expected = {
        "vae_chimera.py",
        "distillation_from_teacher.py",
        "grpo_plain_pytorch.py",
        "grpo_trl.py",
        "ppo_reward_shaping.py",
    }
    assert expected <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_quick_succeeds_and_ends_with_result(path: Path):
    """``--quick --seed 0`` (0: every example's default seed): the script takes both options
    (argparse exits with 2 on an unknown one), runs, and ends with its ``RESULT:`` line."""
    done = run_example(path, "--quick", "--seed", "0")
    tail = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, tail
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, tail
    assert lines[-1].startswith("RESULT:"), tail


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_listed_in_the_examples_readme(path: Path):
    readme = (ROOT / "examples" / "README.md").read_text()
    assert f"`{path.name}`" in readme, f"examples/README.md does not list {path.name}"
