"""The package's structure as a specification: no import cycle, and no module reaching into
another wing's private names or private modules.

A *wing* is a subpackage of ``klest`` (``klest.sampled``, ``klest.logits``, ...) or a top-level
module; the underscore modules at the top (``klest._checks``, ``klest._types``, ...) are the
shared base every wing may use. Imports are read from the source (every ``import`` statement,
module-level or inside a function, outside ``if TYPE_CHECKING:`` blocks), so a function-local
import that dodges a cycle is a cycle here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import klest

SRC = Path(klest.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` for every klest import in module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, None) if sub in MODULES else (base, alias.name))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return [(m, n) for m, n in found if m == "klest" or m.startswith("klest.")]


def _wing(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "klest"
    return "base" if parts[1].startswith("_") and len(parts) == 2 else parts[1]


def _private_module(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[2:])


def test_the_module_list_is_complete():
    assert "klest.sampled.penalty" in MODULES and "klest.logits.from_logits" in MODULES
    assert len(MODULES) > 40


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (each node's successors) as a path back to its start, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def private_imports(imports: dict[str, list[tuple[str, str | None]]]) -> list[str]:
    """``importer: module.name`` for every private module or name taken from another wing."""
    bad = []
    for name, found in imports.items():
        for module, imported in found:
            if _wing(module) in ("base", _wing(name)):
                continue
            if _private_module(module) or (imported or "").startswith("_"):
                bad.append(f"{name}: {module}{'' if imported is None else '.' + imported}")
    return bad


def test_no_import_cycle():
    graph = {name: {m for m, _ in _imports(name) if m in MODULES and m != name} for name in MODULES}
    importers_of_klest = [name for name in MODULES if name != "klest" and "klest" in graph[name]]
    assert not importers_of_klest, (
        f"these import the package's public surface: {importers_of_klest}"
    )
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_imports_another_wings_private_names():
    bad = private_imports({name: _imports(name) for name in MODULES})
    assert not bad, "private names imported across wings:\n" + "\n".join(bad)


def test_the_checks_flag_what_they_claim():
    """On toy inputs: a cycle through a function-local import, and private imports across wings
    (a private module, an underscore name) while the shared base and a wing's own are fine."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    imports = {
        "klest.sampled.penalty": [("klest._checks", "_inside"), ("klest.sampled.terms", "_x")],
        "klest.nn": [("klest.logits._rows", "chunks"), ("klest.sampled.terms", "_x")],
        "klest.integrations.verl": [("klest.logits.topk", "kl_from_topk")],
    }
    assert private_imports(imports) == [
        "klest.nn: klest.logits._rows.chunks",
        "klest.nn: klest.sampled.terms._x",
    ]


def test_tests_mirror_the_package():
    """Each test folder is named for a wing of the package, and each wing with modules of its
    own has one: the test of a module is found without searching."""
    tests = Path(__file__).parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith("_")}
    folders.discard("__pycache__")
    wings = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert folders <= wings, f"test folders without a wing: {folders - wings}"
    assert wings <= folders, f"wings without tests: {wings - folders}"
