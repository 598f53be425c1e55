"""The layout rules of ../shared/DESIGN.md and STYLE.md, read from the source: launcher/ (how) never imports
jobs/ (what) and jobs/ nothing of launcher/ (the config names the job, a task is duck-typed), every file is at
most 300 lines, every module starts with a docstring saying what it is for, and no test module imports another
(what several share is in tests/helpers.py and tests/conftest.py)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGES = ("launcher", "jobs", "tests", "bench")


def modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path))
            for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def imported(tree: ast.Module) -> set[str]:
    """Top-level package of every import, wherever it is in the module (functions too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_launcher_and_jobs_do_not_import_each_other() -> None:
    trees = modules()
    assert not [str(p) for p, tree in trees.items() if p.is_relative_to(REPO / "launcher") and "jobs" in imported(tree)]
    assert not [str(p) for p, tree in trees.items() if p.is_relative_to(REPO / "jobs") and "launcher" in imported(tree)]


def test_files_are_short_and_say_what_they_are_for() -> None:
    trees = modules()
    long = {str(p.relative_to(REPO)): n for p in trees if (n := len(p.read_text().splitlines())) > 300}
    undocumented = [str(p.relative_to(REPO)) for p, tree in trees.items()
                    if p.name != "__init__.py" and not ast.get_docstring(tree)]
    assert not long and not undocumented, (long, undocumented)


def test_test_modules_do_not_import_each_other() -> None:
    """A test module that imports another needs that one's imports too: test_stop_signals.py took MLflow from
    test_tracking.py, so `pytest -m gpu` failed to collect where MLflow is not installed."""
    importing = {}
    for path, tree in modules().items():
        if path.parent == REPO / "tests" and path.name.startswith("test_"):
            names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
            if found := sorted(name for name in names if name.split(".")[0].startswith("test_")):
                importing[str(path.relative_to(REPO))] = found
    assert not importing, importing
