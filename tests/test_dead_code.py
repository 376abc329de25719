"""No function or class of ``icr/`` or ``studies/`` that only the tests call.

A top-level function or class is *used* when the project's own code (``icr/``, ``studies/``,
``benchmarks/``) names it beyond its definition: a call, an attribute, an import from another
module, an entry of a module's ``__all__`` (its declared public API), a ``module:name`` reference
(the config's registries) or an import inside generated code (the launcher's script). Registered
components (decorated) are used through their registry. A helper that only a test needs lives in
``tests/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("icr", "studies")
READERS = (*PACKAGES, "benchmarks")
ENTRY_POINTS = {"main"}


def _names_in_string(text: str) -> set[str]:
    """Names a string refers to as code: ``pkg.module:name``, or ``from pkg import a, b``."""
    found = set(re.findall(r"^[\w.]+:(\w+)$", text))
    for names in re.findall(r"\bimport ([\w, ]+)", text):
        found.update(n.strip() for n in names.split(",") if n.strip())
    return found


def _uses(tree: ast.Module) -> set[str]:
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            used.update(e.value for e in getattr(node.value, "elts", ())
                        if isinstance(e, ast.Constant) and isinstance(e.value, str))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used |= _names_in_string(node.value)
    return used


def _declared(tree: ast.Module) -> list[tuple[str, int]]:
    return [(node.name, node.lineno) for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and not node.decorator_list and node.name not in ENTRY_POINTS]


def test_no_top_level_function_or_class_is_called_by_the_tests_alone() -> None:
    trees = {path: ast.parse(path.read_text(), str(path))
             for package in READERS for path in sorted((ROOT / package).rglob("*.py"))}
    used: set[str] = set()
    for tree in trees.values():
        used |= _uses(tree)
    unused = [f"{path.relative_to(ROOT)}:{line} {name}"
              for path, tree in trees.items() if path.relative_to(ROOT).parts[0] in PACKAGES
              for name, line in _declared(tree) if name not in used]
    assert not unused, ("defined in the project, named by no code of it (move a test's helper to "
                        "tests/, or delete it): " + ", ".join(unused))


def test_the_scan_finds_a_helper_only_a_test_names() -> None:
    """The scan's own oracle: a module whose one function nothing calls is flagged; a call, an
    ``__all__`` entry, an import from elsewhere or a generated script's import each count."""
    lonely = ast.parse("def helper():\n    return 1\n")
    assert [name for name, _ in _declared(lonely) if name not in _uses(lonely)] == ["helper"]
    for user in ("helper()", "__all__ = ['helper']", "from m import helper",
                 "SCRIPT = 'from m import other, helper\\n'"):
        assert "helper" in _uses(ast.parse(user)), user
