"""Sphinx configuration for klest's documentation (``make docs``)."""

from __future__ import annotations

import klest

project = "klest"
author = "the klest authors"
copyright = "2026, the klest authors"
release = klest.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax itself, copied into _static: math renders offline (no CDN).
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
    "myst_parser",
]

# Curly quotes and ellipses, but no dashes: "--" in command-line options (--use-kl-loss) stays
# two hyphens instead of becoming an en dash that a reader would copy.
smartquotes_action = "qe"

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Docstrings: Google style (Args:, Returns:, Example:), reStructuredText inside.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = False
# Show the option types by their public names instead of expanding each Literal.
autodoc_type_aliases = {
    name: f"klest.{name}"
    for name in (
        "AlphaFit",
        "Backend",
        "Baseline",
        "Direction",
        "Estimator",
        "Grad",
        "Level",
        "Reduction",
    )
}

# Markdown pages: $...$ math, ::: fences, heading anchors for cross-page links.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"klest {release}"
html_static_path = ["_static"]
# Wide tables wrap inside the column; wide display math scrolls instead of being cut.
html_css_files = ["klest.css"]
html_theme_options = {
    "navigation_with_keys": True,
}


# -- Module-level constants re-exported by a package ---------------------------------------------
# ``klest.Direction`` (a Literal alias) and ``klest.GRADIENT_ESTIMATORS`` (a dict) are documented
# by the string literal under their assignment in the module that defines them (``klest._types``,
# ``klest.sampled.penalty``). Autodoc looks for that string in the package that re-exports them,
# finds none, and falls back to the object's class docstring (dict's); this hook puts it back.


def _reexported_from(package: str) -> dict[str, str]:
    """``{name: defining module}`` from a package's ``from X import name`` lines."""
    import ast
    import importlib
    import inspect

    tree = ast.parse(inspect.getsource(importlib.import_module(package)))
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def _attribute_docstring(app, what, name, obj, options, lines) -> None:
    if what != "data":
        return
    from sphinx.pycode import ModuleAnalyzer

    package, _, attr = name.rpartition(".")
    source = _reexported_from(package).get(attr) if package else None
    if source is None:
        return
    doc = ModuleAnalyzer.for_module(source).find_attr_docs().get(("", attr))
    if doc:
        lines[:] = list(doc)


def _alias_names(app, what, name, obj, options, signature, return_annotation):
    """Show an option alias inside a union as its name (``klest.Baseline | BaselineEMA``):
    autodoc otherwise prints its internal ``TypeAliasForwardRef('klest.Baseline')`` there."""
    import re

    def clean(text):
        return None if text is None else re.sub(r"TypeAliasForwardRef\('([^']+)'\)", r"\1", text)

    return clean(signature), clean(return_annotation)


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _attribute_docstring)
    app.connect("autodoc-process-signature", _alias_names)
