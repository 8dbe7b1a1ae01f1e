"""The run folder (``--out``): checked before any work, never silently re-used (see
``resume.choose_resume``), cleared only on ``--overwrite``, opened once every check has passed (:func:`open_run_folder`)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import UsageError, command_line, flag_name, git_revision, save_config, write_json
from ..runtime.dist import barrier
from ..runtime.stopping import MARKER
from .checkpoint import LAST, Resume, checkpoint_files
from .data_record import LISTED, Listings, write_listing_record
from .monitor import TB_DIR, TensorBoard
from .train_config import ResolvedSettings, TrainConfig, config_changes

if TYPE_CHECKING:
    from .session import RunSession

log = logging.getLogger("train")


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
    old = checkpoint_files(path) + [p for p in (path / TB_DIR, path / MARKER, path / "config.json", path / LISTED,
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


def write_run_record(cfg: TrainConfig, world_size: int, resume: Resume | None, step: int,
                     resolved: ResolvedSettings | None = None) -> None:
    """OUT/config.json: the run's config as it started (``--config`` on this file repeats that
    run), what its "auto" data flags resolved to (``resolved``), its world size, command and git
    revision; every resume appends to its "history" when, where from, with which command, what
    it changed (flag: [old, new]) and what the flags resolved to this time."""
    path = Path(cfg.out) / "config.json"
    entry = None
    if resume is not None:
        changes = config_changes(resume.checkpoint["config"], cfg)
        entry = {"resumed": datetime.now(timezone.utc).isoformat(timespec="seconds"), "at_step": step,
                 "from": str(resume.path), "world_size": world_size, "command": command_line(),
                 "git_revision": git_revision(), "changes": {flag_name(k): v for k, v in changes.items()},
                 "resolved": resolved.as_record() if resolved else {}}
        try:
            record = json.loads(path.read_text()) if resume.path.parent.resolve() == path.parent.resolve() else None
        except (OSError, json.JSONDecodeError):
            record = None  # a folder without a readable record: start one, from this resume
        if isinstance(record, dict) and isinstance(record.get("history", []), list):
            record["history"] = [*record.get("history", []), entry]
            write_json(path, record)
            return
    save_config(cfg, cfg.out, {"world_size": world_size, "resolved": resolved.as_record() if resolved else {},
                               "history": [entry] if entry else []})


def open_run_folder(cfg: TrainConfig, session: RunSession, resume: Resume | None, step: int,
                    resolved: ResolvedSettings | None = None, preview: torch.Tensor | None = None,
                    listings: Listings | None = None) -> TensorBoard:
    """Rank 0, once every check has passed: the folder (an old run cleared on --overwrite), its
    config.json, the object store's listing (``listings``: ``data_record.LISTED``), TensorBoard
    from ``step`` on, and ``preview`` (``data.preview.augmentation_grid``). Returns the
    TensorBoard writer (a no-op on other ranks). A resumed checkpoint in this folder counts as
    saved."""
    tb = TensorBoard(None)
    if resume is not None and resume.path.parent == Path(cfg.out):
        session.saved.step, session.saved.path = step, resume.path
    if session.info.is_main:
        prepare_run_folder(cfg.out, cfg.overwrite, resuming=resume is not None)
        write_run_record(cfg, session.info.world_size, resume, step, resolved)
        write_listing_record(cfg.out, listings)
        session.signals.clear_marker()
        tb = session.close_at_exit(TensorBoard(Path(cfg.out) / TB_DIR, purge_step=step + 1 if resume else None))
        if preview is not None:  # what the augmentation does, once per run
            tb.image("data/augmented_views", preview, step)
    barrier()
    return tb
