"""The Guarantees page (``docs/guarantees.md``) lists every stated guarantee with the tests that
check it: each guarantee names at least one test, and every test it names exists (a module under
``tests/`` with a test function of that name), so that a renamed or deleted test cannot leave a
guarantee unchecked without CI failing. The README's guarantees section points to the page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guarantees.md"
REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def guarantees() -> list[str]:
    """The page's guarantees: its top-level list items, each with its continuation lines."""
    items: list[str] = []
    for line in PAGE.read_text().splitlines():
        if line.startswith("- "):
            items.append(line)
        elif line.startswith("  ") and items:
            items[-1] += "\n" + line
    return items


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {n for n in names if n.startswith("test_")}


def test_every_guarantee_names_a_test() -> None:
    items = guarantees()
    assert len(items) >= 15, "the page lost its guarantees"
    bare = [item.splitlines()[0][:80] for item in items if not REF.search(item)]
    assert not bare, f"guarantees without a test: {bare}"


def test_every_named_test_exists() -> None:
    refs = REF.findall(PAGE.read_text())
    missing = []
    for module, name in refs:
        path = ROOT / module
        if not path.is_file() or name not in defined_tests(path):
            missing.append(f"{module}::{name}")
    assert not missing, f"the Guarantees page names tests that do not exist: {missing}"


def test_a_missing_test_is_caught(tmp_path: Path) -> None:
    """The check itself: a reference to a test that is not there is found."""
    module = tmp_path / "test_x.py"
    module.write_text("def test_here():\n    pass\n\n"
                      "class TestY:\n    def test_method(self):\n        pass\n")
    assert defined_tests(module) == {"test_here", "test_method"}
    assert REF.findall("`tests/a/test_x.py::test_gone`, `tests/b.py::test_b`") == [
        ("tests/a/test_x.py", "test_gone"), ("tests/b.py", "test_b")]


def test_the_readme_points_to_the_page() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What it guarantees", 1)[1].split("\n## ", 1)[0]
    assert "docs/guarantees.md" in section
