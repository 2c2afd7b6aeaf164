"""A library module opens with a few lines saying what it is and why; derivations live in
docs/privacy.md and history in git. A few modules may need more, never many.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("actors", "cluster", "learning", "privacy", "conclave", "tuning")
LONG = 20  # lines, from the opening quotes to the closing ones
MOST_LONG = 10


def opening_docstring_lines(path: Path) -> int:
    tree = ast.parse(path.read_text())
    if ast.get_docstring(tree) is None:
        return 0
    return tree.body[0].end_lineno - tree.body[0].lineno + 1


def library_modules() -> list[Path]:
    return [path for top in LIBRARY for path in sorted((ROOT / top).rglob("*.py"))]


def test_the_library_is_found():
    assert len(library_modules()) > 100


def test_few_library_modules_open_with_a_long_docstring():
    long = {str(path.relative_to(ROOT)): lines for path in library_modules()
            if (lines := opening_docstring_lines(path)) >= LONG}
    assert len(long) <= MOST_LONG, f"{len(long)} modules open with {LONG}+ lines (at most {MOST_LONG}): {long}"
