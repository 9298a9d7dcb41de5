"""The documentation's contracts: every public name has a docstring that says what it computes,
every one is in the API reference, and nothing points users at files they do not have."""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import json
import re
import typing
from pathlib import Path

import pytest

import klest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = (
    "klest",
    "klest.nn",
    "klest.logits",
    "klest.testbeds",
    "klest.audit",
    "klest.integrations.hf",
    "klest.integrations.trl",
    "klest.integrations.verl",
    "klest.integrations.openrlhf",
    "klest.integrations.migration",
    "klest.distributed",
    "klest.layout",
)


def _public_names(modname: str) -> list[str]:
    """``__all__``, or (a module without one) the classes and functions it defines."""
    module = importlib.import_module(modname)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == modname
    ]


PUBLIC = [(m, n) for m in PUBLIC_MODULES for n in _public_names(m)]


def _defining_module(modname: str, name: str) -> str:
    """The module a package's ``from X import name`` line takes ``name`` from."""
    tree = ast.parse(inspect.getsource(importlib.import_module(modname)))
    for node in tree.body:
        imported = isinstance(node, ast.ImportFrom) and node.module
        if imported and any((a.asname or a.name) == name for a in node.names):
            return node.module
    return modname


def _attribute_docstring(modname: str, name: str) -> str | None:
    """The string literal under ``name = ...`` (or ``name: T = ...``) in the defining module:
    how constants and type aliases are documented (what Sphinx renders for them)."""
    source = inspect.getsource(importlib.import_module(_defining_module(modname, name)))
    body = ast.parse(source).body
    for node, following in itertools.pairwise(body):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        assigns = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        if assigns and documented:
            return following.value.value
    return None


def _docstring(modname: str, name: str) -> str | None:
    obj = getattr(importlib.import_module(modname), name)
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj):
        return inspect.getdoc(obj)
    return _attribute_docstring(modname, name)  # constants, dicts, Literal aliases


@pytest.mark.parametrize(("modname", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_has_a_docstring(modname: str, name: str) -> None:
    doc = _docstring(modname, name)
    assert doc and doc.strip(), f"{modname}.{name} has no docstring"


FUNCTIONS = [
    (m, n) for m, n in PUBLIC if inspect.isfunction(getattr(importlib.import_module(m), n))
]


@pytest.mark.parametrize(("modname", "name"), FUNCTIONS, ids=[f"{m}.{n}" for m, n in FUNCTIONS])
def test_public_function_states_its_math_or_its_arguments(modname: str, name: str) -> None:
    """A public function's docstring has a ``.. math::`` block, a ``:math:`` role, or an ``Args:``
    (``Returns:`` for a function without arguments) section: it says what it computes, or what
    it takes and gives."""
    doc = _docstring(modname, name) or ""
    assert re.search(r"\.\. math::|:math:`|^\s*(Args|Returns):\s*$", doc, re.MULTILINE), (
        f"{modname}.{name}: its docstring has neither math nor an Args: section"
    )


def _documented_in_api_reference() -> set[str]:
    """Full names that an autodoc directive of docs/api/ documents."""
    names: set[str] = set()
    for page in sorted((ROOT / "docs" / "api").glob("*.rst")):
        current = ""
        for line in page.read_text().splitlines():
            m = re.match(r"\.\. (currentmodule|module|automodule)::\s*(\S+)", line)
            if m:
                current = m.group(2)
                continue
            m = re.match(r"\.\. auto(function|class|data|exception)::\s*(\S+)", line)
            if m:
                target = m.group(2)
                names.add(target if target.startswith("klest.") else f"{current}.{target}")
    return names


def test_every_public_name_is_in_the_api_reference() -> None:
    documented = _documented_in_api_reference()

    def found(modname: str, name: str) -> bool:
        # A name exported by several public modules (klest.logits.kl_from_logits is
        # klest.kl_from_logits) is documented once, under any of them.
        obj = getattr(importlib.import_module(modname), name)
        aliases = {
            f"{other}.{name}"
            for other in ("klest", *PUBLIC_MODULES)
            if getattr(importlib.import_module(other), name, None) is obj
        }
        return bool(aliases & documented)

    missing = [f"{m}.{n}" for m, n in PUBLIC if not found(m, n)]
    assert not missing, f"not in docs/api/*.rst: {missing}"


# Internal notes and source documents that users of the library do not have (the possessives
# "seed's" / "seeds'" refer to those documents too), matched case-insensitively.
FORBIDDEN = re.compile(r"seed 00|design\.md|\.\./shared|\bseed's\s|\bseeds'\s", re.IGNORECASE)


GENERATED = ("_build", "__pycache__")
BINARY = (".png", ".jpg", ".svg", ".pyc", ".ico")


def _user_facing_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in ("src", "docs", "examples"):
        for path in sorted((ROOT / top).rglob("*")):
            parts = path.relative_to(ROOT).parts
            generated = any(p in GENERATED or p.endswith(".egg-info") for p in parts)
            if path.is_file() and not generated and path.suffix not in BINARY:
                files.append(path)
    return files


def test_no_references_to_internal_documents() -> None:
    hits = []
    for path in _user_facing_files():
        for number, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            hits += [
                f"{path.relative_to(ROOT)}:{number}: {m.group(0).strip()!r}"
                for m in FORBIDDEN.finditer(line + "\n")
            ]
    assert not hits, "user-facing text cites internal documents:\n" + "\n".join(hits)


def test_literal_aliases_are_literals() -> None:
    """The option names documented as ``Literal`` aliases are ones (the API page says so)."""
    names = ("Direction", "Reduction", "Level", "Estimator", "Grad", "Baseline", "AlphaFit")
    for name in (*names, "SamplerDirection", "SamplerDivergence"):
        assert typing.get_origin(getattr(klest, name)) is typing.Literal, name


# Illustrative fragments that need a trainer or a model are fenced ```{code-block} python.
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT / "docs")) for p in PAGES])
def test_page_examples_run(page: Path) -> None:
    """The ``python`` code blocks of each documentation page run, in order, in one namespace,
    without a KLGradientWarning (a page's example that warns would teach a pitfall)."""
    import warnings

    import torch

    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.DOTALL | re.MULTILINE)
    namespace: dict = {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", klest.KLGradientWarning)
        for number, block in enumerate(blocks, 1):
            exec(compile(block, f"{page.name} block {number}", "exec"), namespace)
    assert klest.get_default_validate(), f"{page.name} left validation off"


def test_recorded_experiment_results_are_full_size_runs_of_registered_experiments():
    """The results kept beside the docs' figures (the source of the numbers the docs quote) are
    full-size runs (not ``--quick``) of experiments the CLI knows, each with its table."""
    from klest.experiments import registry

    recorded = sorted((ROOT / "docs" / "_static" / "experiments").glob("*-result.json"))
    assert recorded
    for path in recorded:
        name = path.name.removesuffix("-result.json")
        result = json.loads(path.read_text())
        assert name in registry() and result["experiment"] == name, path.name
        assert result["quick"] is False, path.name
        assert path.with_name(f"{name}-table.md").read_text().strip(), path.name


def test_recorded_results_keep_seven_significant_digits_and_name_what_is_left_out(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT / "docs"))
    pytest.importorskip("PIL", reason="docs/figures.py needs Pillow (the docs extra)")
    figures = importlib.import_module("figures")
    monkeypatch.setattr(figures, "OUT", tmp_path / "out")
    (tmp_path / "out").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    result = {"quick": False, "x": [0.123456789012, 2, {"y": -1234567.891}], "s": "a"}
    result["raw"] = list(range(100))  # 291 bytes of JSON: over the limit set below
    monkeypatch.setattr(figures, "MAX_ENTRY_BYTES", 100)
    (run / "result.json").write_text(json.dumps(result))
    (run / "table.md").write_text("| a |\n")
    figures.copy_results(run, "demo")
    assert json.loads((tmp_path / "out" / "demo-result.json").read_text()) == {
        "quick": False,
        "x": [0.1234568, 2, {"y": -1234568.0}],
        "s": "a",
        "omitted": {
            "raw": f"{len(json.dumps(list(range(100)), separators=(',', ':')))} bytes "
            "of JSON, left out"
        },
    }
    assert (tmp_path / "out" / "demo-table.md").read_text() == "| a |\n"


def test_offline_check_finds_remote_assets_and_missing_mathjax(tmp_path, monkeypatch):
    """docs/check_offline.py, which ``make docs`` runs over the built site: a page with math
    that loads MathJax from the site passes; one loading it (or a stylesheet) from another host,
    or naming a MathJax file the site lacks, is reported."""
    monkeypatch.syspath_prepend(str(ROOT / "docs"))
    check_offline = importlib.import_module("check_offline")
    math = '<span class="math notranslate nohighlight">\\(x^2\\)</span>'
    (tmp_path / "_static/mathjax").mkdir(parents=True)
    (tmp_path / "_static/mathjax/tex-chtml.js").write_text("")
    (tmp_path / "api").mkdir()
    pages = {
        "good.html": '<script defer src="_static/mathjax/tex-chtml.js"></script>' + math,
        "api/good.html": '<script src="../_static/mathjax/tex-chtml.js"></script>' + math,
        "plain.html": '<link rel="stylesheet" href="_static/furo.css"><p>no math</p>',
        "cdn.html": '<script src="https://cdn.example/mathjax.js"></script>' + math,
        "font.html": '<link rel="stylesheet" href="//fonts.example/a.css">',
        "lost.html": '<script src="mathjax/tex-chtml.js"></script>' + math,
    }
    for name, body in pages.items():
        (tmp_path / name).write_text(f"<html><body>{body}</body></html>")
    assert check_offline.problems(tmp_path) == [
        "cdn.html: loads https://cdn.example/mathjax.js from another host",
        "cdn.html: has math but loads no MathJax from the site",
        "font.html: loads //fonts.example/a.css from another host",
        "lost.html: mathjax/tex-chtml.js is not in the site",
    ]


def test_docs_ship_mathjax():
    """docs/conf.py loads sphinx-mathjax-offline, whose MathJax (script and fonts) the build
    copies into the site's _static: the math renders without a network."""
    conf = (ROOT / "docs" / "conf.py").read_text()
    assert '"sphinx-mathjax-offline"' in conf
    package = Path(importlib.import_module("sphinx-mathjax-offline").__file__).parent
    assert (package / "static/mathjax/tex-chtml.js").is_file()
    assert (package / "static/mathjax/output/chtml/fonts/woff-v2").is_dir()
