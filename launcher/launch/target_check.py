"""Each `_target_` of model, data and optimizer names a module on this Python's path and a name that module defines.

Checked in the parent, before any process starts, from the module's source where it is not imported yet (a job's
module may import transformers: seconds): a job of one's own without PYTHONPATH, a misspelt class or a module that
does not parse failed each worker after the rendezvous, and passed a dry run. What the source cannot tell (a name
made at run time, a package that raises on import) is left to the workers, which say it in one line. The files of
the modules named (job_files) tell launch.json which repo's git state is the job's.
Exercised by: tests/test_own_job.py (a job of one's own, its mistakes) and tests/test_target_check.py.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig

from launcher.derived import ConfigError

TARGET_GROUPS = ("data", "model", "optimizer")  # the job first: its builder names the rest
# a module that makes names without binding them (or with a __getattr__ of its own): its source cannot tell
DYNAMIC = ("globals()", "vars()", "locals()", "exec(", "sys.modules[__name__]")


def check_targets(cfg: DictConfig) -> None:
    """Raise ConfigError for the first group without a `_target_`, or whose `_target_` names nothing. Not for a Slurm
    job with launcher.setup lines: they may give its nodes a path this Python has not."""
    if cfg.launcher.name == "slurm" and cfg.launcher.get("setup"):
        return
    for group in TARGET_GROUPS:
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        target = node.get("_target_")
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{group} has no _target_ (the function or class that builds it, as "
                              f"package.module.Name): add one to conf/{group}/<name>.yaml, or choose {group}=<name>")
        problem = target_problem(target)
        if problem:
            raise ConfigError(f"{group}._target_={target}: {problem}")


def target_problem(target: str) -> str | None:
    """Why `target` names nothing (no such module, a module that does not parse, a name it does not define), or
    None where it does or the source cannot tell."""
    parts = target.split(".")
    if len(parts) < 2:
        return "name the module too (package.module.Name)"
    for end in range(len(parts) - 1, 0, -1):  # a module imported already (torch.optim): ask it
        module = sys.modules.get(".".join(parts[:end]))
        if module is None:
            continue
        if hasattr(module, parts[end]):
            return None
        if not hasattr(module, "__path__"):  # (a package's submodule may just not be imported yet)
            return _no_name(parts[end], dir(module), getattr(module, "__file__", None) or ".".join(parts[:end]))
        break
    try:
        spec = importlib.util.find_spec(parts[0])
    except Exception:  # noqa: BLE001 - a path entry that cannot be read: the workers tell
        return None
    if spec is None:
        return (f"no module named {parts[0]!r} on this Python's path (a job of your own: PYTHONPATH=<the dir that "
                f"holds {parts[0]}/>, see README's 'Adding a job')")
    named = 1
    while named < len(parts) - 1 and spec.submodule_search_locations is not None:  # a package: its next part?
        try:
            inner = importlib.util.find_spec(".".join(parts[:named + 1]))  # (runs the package's __init__)
        except Exception:  # noqa: BLE001 - a package that raises on import (a package it needs is missing): the
            return None  # workers say it
        if inner is None:
            break  # a name the package's __init__ defines
        spec, named = inner, named + 1
    if not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        tree, source = module_source(spec.origin)
    except SyntaxError as error:
        return f"{spec.origin} does not parse: {error.msg} (line {error.lineno})"
    except (OSError, ValueError):  # (unreadable, a NUL byte)
        return None
    if any(isinstance(node, ast.Global) for node in ast.walk(tree)):  # a function may bind module names
        return None
    if any(dynamic in source for dynamic in DYNAMIC):
        return None
    names = bound_names(tree.body)
    if names is None or parts[named] in names or "__getattr__" in names:
        return None
    where = ".".join(parts[:named])
    if spec.submodule_search_locations is not None:  # a package, and no module of it is named so
        if named == len(parts) - 1 and _is_module(target):
            return f"names a module: name what it defines ({target}.<Name>)"
        if named < len(parts) - 1:
            return f"no module named {where}.{parts[named]} ({where} is {Path(spec.origin).parent}/)" + _shadowed(
                parts[:named + 1], Path(spec.origin).parent)
    return _no_name(parts[named], names, spec.origin)


def job_files(cfg: DictConfig) -> list[Path]:
    """The files of the modules that data's, model's and optimizer's `_target_`s name, outside this Python's own
    installation (a job of one's own: launch.json records its repo's git state)."""
    installed = {Path(prefix).resolve() for prefix in (sys.prefix, sys.base_prefix)}
    files = []
    for group in TARGET_GROUPS:
        node = cfg.get(group)
        parts = str(node.get("_target_") or "").split(".") if isinstance(node, DictConfig) else []
        for end in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module: pkg.mod of pkg.mod.Name
            try:
                spec = importlib.util.find_spec(".".join(parts[:end]))
            except Exception:  # noqa: BLE001 - checked above: what is left here is the workers' to say
                spec = None
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                file = Path(spec.origin).resolve()
                if not any(file.is_relative_to(prefix) for prefix in installed):
                    files.append(file)
                break
    return files


@lru_cache(maxsize=None)
def module_source(origin: str) -> tuple[ast.Module, str]:
    """A module's file parsed as Python reads it (from bytes: a BOM, a coding line), and its text; read once per
    launch (launcher/launch/known_keys.py reads the same target's signature from it)."""
    raw = Path(origin).read_bytes()
    return ast.parse(raw, origin), raw.decode("utf-8", errors="replace")


def _shadowed(parts: list[str], found: Path) -> str:
    """What to add where a package of the user's has the module but another of its name comes first on the path (a
    job's package named `jobs`, as the launcher's own)."""
    found = found.resolve()
    for entry in sys.path:
        package = Path(entry or ".").resolve().joinpath(*parts[:-1])
        try:
            has_it = (package / f"{parts[-1]}.py").is_file() or (package / parts[-1]).is_dir()
        except OSError:  # (a path entry this user may not read)
            continue
        if has_it and package != found:
            return f"; {package}/ has it, but comes later on the path: rename that package"
    return ""


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # noqa: BLE001 - its package raises on import: the workers say it
        return False


def _no_name(name: str, names: object, where: str) -> str:
    close = difflib.get_close_matches(name, sorted(str(n) for n in names), n=1)  # type: ignore[union-attr]
    return f"{where} defines no {name}" + (f"; did you mean {close[0]}?" if close else "")


def bound_names(body: list[ast.stmt]) -> set[str] | None:
    """The names a module's top level binds (in if/try/with/for bodies too); None for a star import."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.With,
                               ast.AsyncWith)):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [item.optional_vars for item in node.items if item.optional_vars] if isinstance(
                           node, (ast.With, ast.AsyncWith)) else [node.target])
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        if isinstance(node, ast.Match):
            more = bound_names([stmt for case in node.cases for stmt in case.body])
            if more is None:
                return None
            names |= more
        for field in ("body", "orelse", "finalbody", "handlers"):  # nested blocks of if/try/with/for/while
            inner = getattr(node, field, None)
            if isinstance(inner, list) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                more = bound_names([n for n in inner if isinstance(n, ast.stmt)] +
                                   [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])
                if more is None:
                    return None
                names |= more
        if isinstance(node, ast.stmt) and any(isinstance(n, ast.NamedExpr) for n in ast.walk(node)):
            names.update(n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr))
    return names
