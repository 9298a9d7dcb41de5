"""The wheel built from this tree installs and imports in a fresh virtualenv, light on deps."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(out: Path) -> Path:
    args = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)]
    subprocess.run(
        [sys.executable, "-m", "pip", *args],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("klest-*.whl")
    return wheel


def test_wheel_installs_and_imports_in_a_fresh_virtualenv(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = zf.read(metadata).decode()
    assert "klest/py.typed" in names and "klest/logits/kernels/kl_logits.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)
    core = [
        line.split(":", 1)[1].strip()
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert sorted(r.split(">")[0].split("=")[0].split("<")[0].strip() for r in core) in (
        ["torch"],
        ["numpy", "torch"],
    ), core
    assert "License-Expression: Apache-2.0" in meta or "License: Apache-2.0" in meta

    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    # torch is the one dependency; reinstalling its wheel here would take minutes and test
    # nothing of klest's, so the fresh environment sees this one's torch through a .pth file.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    torch_dir = Path(sysconfig.get_paths()["purelib"])
    Path(purelib, "host_torch.pth").write_text(f"{torch_dir}\n")
    # Without the caller's PYTHONPATH, which could put a checkout's sources before the wheel
    # (and its egg-info would make pip skip the install as "already satisfied").
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        env=clean,
    )
    code = (
        "import sys, torch, klest, klest.nn, klest.logits, klest.testbeds, klest.integrations\n"
        "assert klest.__file__.startswith(sys.prefix), klest.__file__\n"
        "logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)\n"
        "klest.kl_penalty(logp, torch.tensor([[-1.2, -0.4]])).backward()\n"
        "assert 'matplotlib' not in sys.modules\n"
        "assert not {'transformers', 'trl', 'verl', 'openrlhf'} & set(sys.modules)\n"
        "print('ok')\n"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=clean)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
