"""A module of this repository as it was at an earlier commit, loaded beside today's, so that a
benchmark can time both in one run: ``module_at("8719b0f", "ddp_utils/data/batch_augment.py")``.

The source is read with ``git show`` (the benchmark needs a git checkout of this repository); the
module's relative imports resolve against today's package, so the older module must not depend
on what changed around it.
"""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_at(commit: str, path: str) -> types.ModuleType:
    """``path`` (a .py file of the package, relative to the repository) at ``commit``, imported
    under the name ``<package>._at_<commit>_<module>``."""
    try:
        source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"bench: cannot read {path} at {commit} (a git checkout with its history is needed): {err}")
    package = ".".join(Path(path).parent.parts)
    name = f"{package}._at_{commit}_{Path(path).stem}"
    module = types.ModuleType(name)
    module.__package__, module.__file__ = package, f"{commit}:{path}"
    sys.modules[name] = module  # dataclasses and typing look their module up by name
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
