"""A module of this repository as it was at an earlier commit, loaded beside today's, so that a
benchmark can time both in one run: ``module_at("8719b0f", "ddp_utils/data/batch_augment.py")``.

The whole package is read at that commit (``git archive``; the benchmark needs a git checkout of
this repository with its history) into a folder of its own and imported under another name
(``ddp_utils_at_8719b0f``), so the older module's relative imports find the package as it was
then, whatever has moved since.
"""
from __future__ import annotations

import atexit
import importlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_ROOTS: dict[str, Path] = {}  # commit -> the folder holding that commit's package, for this process


def package_at(commit: str, package: str = "ddp_utils") -> str:
    """Extract ``package`` as it was at ``commit`` (once per process) and return the name it is
    importable under: ``<package>_at_<commit>``."""
    alias = f"{package}_at_{commit}"
    if commit not in _ROOTS:
        try:
            archive = subprocess.run(["git", "archive", "--format=tar", commit, package], cwd=REPO,
                                     capture_output=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as err:
            raise SystemExit(f"bench: cannot read {package}/ at {commit} (a git checkout with its history is "
                             f"needed): {err}")
        root = Path(tempfile.mkdtemp(prefix=f"at_{commit}_"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(root, filter="data")
        (root / package).rename(root / alias)
        sys.path.insert(0, str(root))
        _ROOTS[commit] = root
    return alias


def module_at(commit: str, path: str) -> types.ModuleType:
    """``path`` (a .py file of the package, relative to the repository) at ``commit``, imported
    as ``<package>_at_<commit>.<module path>`` from that commit's package."""
    parts = Path(path).with_suffix("").parts
    return importlib.import_module(".".join([package_at(commit, parts[0]), *parts[1:]]))
