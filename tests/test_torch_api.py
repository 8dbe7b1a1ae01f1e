"""Every torch and torchvision name the project's code spells out (``torch.cuda.Stream``,
``F.normalize``, ``from torchvision.io import decode_jpeg``) exists in the installed release.
CI runs it (the fast tier) on the oldest and the newest supported pair, so this reaches what CPU tests
never execute: the CUDA-only branches, the bench scripts for a GPU. Names reached through
``getattr`` with a fallback are the code's own version switches and are not checked here."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from helpers import REPO

ROOTS = ("torch", "torchvision")
SOURCES = sorted([*REPO.glob("*.py"), *(REPO / "ddp_utils").rglob("*.py"), *(REPO / "bench").glob("*.py")])


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted torch/torchvision path, from the module's imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ROOTS:
                    names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in ROOTS:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.Attribute) -> tuple[str, str] | None:
    """``a.b.c`` as ("a", "a.b.c"), or None when the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, ".".join([node.id, *reversed(parts)])


def used_names(path: Path) -> set[str]:
    """The dotted torch/torchvision paths ``path`` names, through its import aliases."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _aliases(tree)
    used = set(aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):  # every prefix of a chain too: each must resolve
            chain = _dotted(node)
            if chain and chain[0] in aliases:
                used.add(aliases[chain[0]] + chain[1][len(chain[0]):])
    return used


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute reached from the longest importable module."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_finder_sees_aliases_and_misses_nothing_planted(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
                       "from torchvision.io import decode_jpeg as dj\n"
                       "x = torch.cuda.Stream\ny = F.normalize\nz = nn.BatchNorm2d(3).weight\n"
                       "w = torch.not_a_function_anywhere\n")
    names = used_names(planted)
    assert {"torch.cuda.Stream", "torch.nn.functional.normalize", "torch.nn.BatchNorm2d",
            "torchvision.io.decode_jpeg", "torch.not_a_function_anywhere"} <= names
    assert [name for name in sorted(names) if not resolves(name)] == ["torch.not_a_function_anywhere"]


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_every_torch_name_the_code_uses_exists_in_this_release(path):
    import torch

    missing = sorted(name for name in used_names(path) if not resolves(name))
    assert not missing, f"{path.relative_to(REPO)} uses names torch {torch.__version__} lacks: {missing}"
