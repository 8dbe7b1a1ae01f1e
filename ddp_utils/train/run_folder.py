"""The run folder (``--out``): checked before any work, never silently re-used (see
``resume.choose_resume``), cleared only on ``--overwrite``, opened once every check has passed."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import UsageError, save_config
from ..data.loading import Loaders
from ..data.preview import augmentation_grid
from ..runtime.dist import barrier
from ..runtime.stopping import MARKER
from .checkpoint import LAST, checkpoint_files
from .monitor import TensorBoard

if TYPE_CHECKING:
    from .resume import Resume
    from .session import RunSession
    from .train_config import TrainConfig

log = logging.getLogger("train")
TB_DIR = "tb"


def check_out_dir(out: str) -> None:
    """``--out`` must be a folder (or not exist yet) somewhere this process can write."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; give a folder for the run")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {out}: {parent} is a file, not a folder; give a folder for the run")
    try:  # the only reliable test (permissions, read-only mounts, root): create and remove a file
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UsageError(f"--out {out}: cannot write in {parent} ({err.strerror}); choose a folder "
                         f"you can write to") from None


def prepare_run_folder(out: str, overwrite: bool, resuming: bool) -> None:
    """Rank 0, once every check has passed: create ``out``; on ``--overwrite`` clear the old run
    first (checkpoints, TensorBoard events, marker, config), so two runs never mix in one ``tb/``."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    if resuming:
        return
    old = checkpoint_files(path) + [p for p in (path / TB_DIR, path / MARKER, path / "config.json",
                                                  path / f".{LAST}.tmp") if p.exists()]
    if not old:
        return
    for item in old:
        shutil.rmtree(item) if item.is_dir() else item.unlink()
    if overwrite:
        log.warning("--overwrite: removed %s from %s", ", ".join(p.name for p in old), out)
    else:  # only reachable without checkpoints: an earlier attempt that never saved one
        log.warning("removed %s of an earlier run that wrote no checkpoint in %s",
                    ", ".join(p.name for p in old), out)


def open_run_folder(cfg: TrainConfig, session: RunSession, loaders: Loaders, resume: Resume | None,
                    step: int) -> TensorBoard:
    """Rank 0, once every check has passed: the folder (an old run cleared on --overwrite), its
    config.json, TensorBoard from ``step`` on, and a picture of the augmentation. Returns the
    TensorBoard writer (a no-op on other ranks). A resumed checkpoint in this folder counts as
    saved."""
    tb = TensorBoard(None)
    if resume is not None and resume.path.parent == Path(cfg.out):
        session.saved.step, session.saved.path = step, resume.path
    if session.info.is_main:
        prepare_run_folder(cfg.out, cfg.overwrite, resuming=resume is not None)
        save_config(cfg, cfg.out, {"world_size": session.info.world_size})
        session.signals.clear_marker()
        tb = session.close_at_exit(TensorBoard(Path(cfg.out) / TB_DIR, purge_step=step + 1 if resume else None))
        if resume is None:  # what the augmentation does, once per run
            grid = augmentation_grid(loaders, cfg.dataset, cfg.resolved_image_size(), normalization=cfg.normalization)
            tb.image("data/augmented_views", grid, step)
    barrier()
    return tb
