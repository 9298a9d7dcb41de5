"""The page docs/integrations/verl_openrlhf.md: its ``python`` examples run, in order, in one
namespace, without a KLGradientWarning (its ``bash`` and ``yaml`` blocks need the peers), by the
rule of ``tests/test_docs.py`` for the pages of ``docs/``."""

from __future__ import annotations

from pathlib import Path

from tests.test_docs import test_page_examples_run as run_page_examples

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations" / "verl_openrlhf.md"


def test_page_examples_run():
    run_page_examples(PAGE)
