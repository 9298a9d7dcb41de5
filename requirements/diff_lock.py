"""Compare a venv's installed packages with the lock, requirements/constraints.txt.

    python requirements/diff_lock.py            # print what differs: name, locked, installed
    python requirements/diff_lock.py --check    # the same, exit 1 when anything differs
    python requirements/diff_lock.py --write    # rewrite the lock from the venv, print what moved

The venv is the one of the python that runs this script (or --python PATH); its packages are
`pip freeze --all` less pip and the editable klest. Packages pinned by requirements/peers.txt
and absent from the lock are left out: the peers file pins them. Standard library only.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "constraints.txt"
PEERS = HERE / "peers.txt"
# Never in the lock: the installer itself (the venv's own) and the package under test.
UNLOCKED = {"pip", "klest"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def normalize(name: str) -> str:
    """The name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines: list[str], source: str) -> dict[str, tuple[str, str]]:
    """{normalized name: (name as written, version)} of `name==version` lines; comments skipped."""
    pins: dict[str, tuple[str, str]] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-e "):
            continue
        match = PIN.match(line)
        if match is None:
            raise SystemExit(f"{source}: not a `name==version` pin: {raw!r}")
        pins[normalize(match[1])] = (match[1], match[2])
    return pins


def installed(python: str) -> dict[str, tuple[str, str]]:
    out = subprocess.run(
        [python, "-m", "pip", "freeze", "--all", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pins = parse_pins(out.splitlines(), f"pip freeze of {python}")
    return {key: pin for key, pin in pins.items() if key not in UNLOCKED}


def differences(
    locked: dict[str, tuple[str, str]], current: dict[str, tuple[str, str]]
) -> list[tuple[str, str, str]]:
    """(name, locked version or '-', installed version or '-') for each package that differs."""
    rows = []
    for key in sorted(locked.keys() | current.keys()):
        old = locked.get(key, (None, "-"))
        new = current.get(key, (None, "-"))
        if old[1] != new[1]:
            rows.append((new[0] or old[0], old[1], new[1]))
    return rows


def print_table(rows: list[tuple[str, str, str]], header: tuple[str, str, str]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the venv's python")
    parser.add_argument("--lock", type=Path, default=LOCK)
    parser.add_argument("--label", default="installed", help="the venv's column in the table")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when anything differs")
    mode.add_argument("--write", action="store_true", help="rewrite the lock from the venv")
    args = parser.parse_args(argv)

    text = args.lock.read_text().splitlines()
    locked = parse_pins(text, str(args.lock))
    peers = parse_pins(PEERS.read_text().splitlines(), str(PEERS))
    clashes = [
        (peers[key][0], locked[key][1], peers[key][1])
        for key in sorted(locked.keys() & peers.keys())
        if locked[key][1] != peers[key][1]
    ]
    if clashes:
        print(f"{args.lock.name} and {PEERS.name} pin these differently:")
        print_table(clashes, ("name", "lock", "peers"))
        return 1
    current = {
        key: pin for key, pin in installed(args.python).items() if key in locked or key not in peers
    }
    rows = differences(locked, current)

    if args.write:
        # The comment block at the top stays; the pins below it are the venv's, sorted.
        header = []
        for line in text:
            if line.strip() and not line.lstrip().startswith("#"):
                break
            header.append(line)
        while header and not header[-1].strip():
            header.pop()
        body = [f"{name}=={version}" for _, (name, version) in sorted(current.items())]
        args.lock.write_text("\n".join([*header, "", *body]) + "\n")
        print(f"{args.lock}: {len(body)} pins, {len(rows)} moved")
        if rows:
            print_table(rows, ("name", "was", "now"))
        return 0

    if not rows:
        print(f"{len(current)} installed packages, all as pinned in {args.lock.name}")
        return 0
    print(f"{len(rows)} packages differ from {args.lock.name}:")
    print_table(rows, ("name", "locked", args.label))
    if args.check:
        print(
            "The lock and this venv disagree: `make lock` if pyproject.toml's dependencies "
            "changed, `make clean` if the venv holds leftovers."
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
