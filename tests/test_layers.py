"""The package reads as a stack, and the tests use it as its users do: a module imports only from
its own layer and the layers below (docs/architecture.md's table, the same rows as ``LAYERS``),
no module of ddp_utils imports itself back through others (imports inside functions and under
TYPE_CHECKING counted), no test touches a private name of ddp_utils or of the scripts, and
importing a script imports no torchvision."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "ddp_utils"
SCRIPTS = ("train_classifier", "train_moco")

# The layers, bottom first, as docs/architecture.md's table names them: a module may import from
# its own layer and those before it here, never from one after it.
LAYERS = (
    ("ddp_utils/config.py", "ddp_utils/hashing.py"),
    ("ddp_utils/runtime/",),
    ("ddp_utils/data/",),
    ("ddp_utils/models/", "ddp_utils/eval/"),
    ("ddp_utils/train/",),
    ("train_classifier.py", "train_moco.py"),
)


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


def import_graph(with_scripts: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py")) + ([REPO / f"{s}.py" for s in SCRIPTS] if with_scripts else [])
    known = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, known) for p in paths}


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of a module (``ddp_utils.eval.knn``), None if no row holds it. The
    package's own ``__init__`` is the bottom layer's: Python runs it before any of its modules."""
    if module == "ddp_utils":
        return 0
    for index, row in enumerate(LAYERS):
        for entry in row:
            name = entry.removesuffix(".py").removesuffix("/").replace("/", ".")
            if module == name or (entry.endswith("/") and module.startswith(name + ".")):
                return index
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above the importer's, as "importer imports imported"."""
    return [f"{module} imports {target}" for module in sorted(graph) for target in sorted(graph[module])
            if layer_of(target) > layer_of(module)]


def documented_layers(page: str) -> list[tuple[str, ...]]:
    """The first column of the table in the page's section "The layers", each row's files and
    folders in order."""
    section = page.split("\n## The layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [tuple(re.findall(r"`([^`]+)`", row.split(" | ")[0])) for row in rows]


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
    assert "ddp_utils.train.run" in graph["ddp_utils.train.unreadable_files"]  # the scan sees imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def longest_chain(graph: dict[str, set[str]], within: str) -> list[str]:
    """The longest chain of imports among the modules whose names start with ``within`` (the
    graph has no cycle), top first."""
    inside = {m: {n for n in graph[m] if n.startswith(within)} for m in graph if m.startswith(within)}
    best: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in best:
            best[module] = [module] + max((chain(n) for n in sorted(inside[module])), key=len, default=[])
        return best[module]

    return max((chain(m) for m in sorted(inside)), key=len)


def test_train_is_at_most_eight_floors_deep():
    """A reader follows a call from the scripts down through train/ in at most 8 modules (the
    architecture page's walk); a new module that lengthens the chain fails here, named."""
    chain = longest_chain(import_graph(), "ddp_utils.train.")
    assert len(chain) <= 8, " -> ".join(chain)


def test_the_chain_finder_finds_the_longest_chain():
    graph = {"p.a": {"p.b", "p.c"}, "p.b": {"p.c"}, "p.c": {"q.d"}, "q.d": set()}
    assert longest_chain(graph, "p.") == ["p.a", "p.b", "p.c"]


def test_the_architecture_page_lists_the_layers_in_this_order():
    assert documented_layers((REPO / "docs" / "architecture.md").read_text()) == list(LAYERS)


def test_every_module_has_a_layer_and_none_imports_from_a_layer_above():
    graph = import_graph(with_scripts=True)
    assert "ddp_utils.train.run" in graph["train_moco"]  # the scan sees the scripts' imports
    assert [module for module in graph if layer_of(module) is None] == []
    assert upward_imports(graph) == []


def test_the_layer_check_names_an_upward_import():
    graph = {"ddp_utils.eval.knn": {"ddp_utils.runtime.dist", "ddp_utils.train.accumulation", "ddp_utils.models.moco"},
             "ddp_utils.data.sets": {"ddp_utils", "ddp_utils.hashing"}, "ddp_utils.hashing": {"ddp_utils.data.sets"},
             "ddp_utils.train.run": {"train_moco"}, "train_moco": {"ddp_utils.train.run"}}
    assert upward_imports(graph) == ["ddp_utils.eval.knn imports ddp_utils.train.accumulation",
                                     "ddp_utils.hashing imports ddp_utils.data.sets",
                                     "ddp_utils.train.run imports train_moco"]
    swapped = "# Page\n## The layers\n\n| layer | what |\n| --- | --- |\n| `b/` | x |\n| `a.py`, `c/` | y |\n\n## Next\n| `d/` | z |\n"
    assert documented_layers(swapped) == [("b/",), ("a.py", "c/")]
    assert (layer_of("ddp_utils.plumbing"), layer_of("ddp_utils.runtime"), layer_of("ddp_utils.runtime.dist")) == (None, 1, 1)


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


def test_importing_the_scripts_imports_no_torchvision():
    """Every process of a run, a test or a launcher check imports a script; torchvision's import
    brings torch._dynamo (about 2 s a process), so the package imports it only where it is used."""
    probe = "import sys, train_classifier, train_moco, write_shards; print(sorted(m for m in sys.modules if m.startswith('torchvision')))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
