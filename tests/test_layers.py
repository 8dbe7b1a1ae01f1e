"""The package reads as a stack, and the tests use it as its users do: no module of ddp_utils
imports itself back through others (imports inside functions and under TYPE_CHECKING counted),
and no test touches a private name of ddp_utils or of the scripts."""
from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "ddp_utils"
SCRIPTS = ("train_classifier", "train_moco")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The ddp_utils modules ``path`` imports anywhere in its text (a function, TYPE_CHECKING)."""
    name, tree = module_name(path), ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, known) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_ddp_utils_has_no_import_cycle():
    graph = import_graph()
    assert "ddp_utils.train.run" in graph["ddp_utils.train.step_policy"]  # the scan sees imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def private_names() -> set[str]:
    """Every private name ddp_utils and the scripts define: functions, classes, module-level
    names and attributes (``self._x = ...``)."""
    names = set()
    for path in [*PACKAGE.rglob("*.py"), *(REPO / f"{s}.py" for s in SCRIPTS)]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(path: Path, defined: set[str] = frozenset()) -> list[str]:
    """``x._name`` where ``x`` comes from ddp_utils or the scripts or ``_name`` is one of theirs
    (``defined``; an attribute of the test's own ``self`` aside), ``from ddp_utils... import
    _name``, and monkeypatching such a name by its string."""
    tree = ast.parse(path.read_text())
    ours: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("ddp_utils", *SCRIPTS):
            ours |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            ours |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                     if alias.name.split(".")[0] in ("ddp_utils", *SCRIPTS)}
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("ddp_utils", *SCRIPTS):
            uses += [f"line {node.lineno}: import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and (root.id in ours or (node.attr in defined and root.id != "self")):
                uses.append(f"line {node.lineno}: {root.id}...{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "setattr" and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and private(name.value) and \
                    isinstance(target, ast.Name) and target.id in ours:
                uses.append(f"line {node.lineno}: setattr({target.id}, {name.value!r})")
    return sorted(uses, key=lambda use: int(use.split(":")[0].split()[1]))


def test_no_test_touches_a_private_name_of_the_package_or_the_scripts():
    defined = private_names()
    assert {"_ptr", "_shuffles", "_fallback_box"} <= defined
    found = {path.name: uses for path in sorted((REPO / "tests").glob("*.py"))
             if path.name != "test_layers.py" and (uses := _private_uses(path, defined))}
    assert found == {}


def test_the_private_name_finder_finds_them(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from ddp_utils.data import batch_augment as ba\nfrom ddp_utils.config import _hidden\n"
                      "import torch\nba._helper(1)\ntorch._C\nmonkeypatch.setattr(ba, '_helper', 1)\nmoco._ptr\n")
    assert _private_uses(sample, {"_ptr"}) == ["line 2: import _hidden", "line 4: ba..._helper",
                                               "line 6: setattr(ba, '_helper')", "line 7: moco..._ptr"]
