"""Check that a built documentation site renders offline: no page loads a script, stylesheet or
font from another host (a CDN), and every page with math loads MathJax from the site itself.

Usage: ``python docs/check_offline.py docs/_build/html`` (``make docs`` runs it after the build).
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path

REMOTE = ("http:", "https:", "//")


class _Assets(HTMLParser):
    """The scripts and stylesheets a page loads, and whether it has math."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self.styles: list[str] = []
        self.math = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"] or "")
        elif tag == "link" and "stylesheet" in (a.get("rel") or "").split():
            self.styles.append(a.get("href") or "")
        if "math" in (a.get("class") or "").split():
            self.math = True


def problems(site: Path) -> list[str]:
    """What keeps ``site`` (a built HTML directory) from rendering offline, one line each."""
    out = []
    pages = sorted(site.rglob("*.html"))
    if not pages:
        return [f"{site}: no HTML pages"]
    for page in pages:
        assets = _Assets()
        assets.feed(page.read_text(encoding="utf-8"))
        name = page.relative_to(site)
        for url in assets.scripts + assets.styles:
            if url.startswith(REMOTE):
                out.append(f"{name}: loads {url} from another host")
        if assets.math:
            local = [
                u for u in assets.scripts if "mathjax" in u.lower() and not u.startswith(REMOTE)
            ]
            if not local:
                out.append(f"{name}: has math but loads no MathJax from the site")
            for url in local:
                if not (page.parent / url.split("?")[0]).is_file():
                    out.append(f"{name}: {url} is not in the site")
    return out


def main(site: Path) -> int:
    found = problems(site)
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(Path(sys.argv[1])))
