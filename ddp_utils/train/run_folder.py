"""The run folder (``--out``): checked before any work, never silently re-used, cleared only on
``--overwrite``, and the checkpoint ``--resume`` continues from."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..config import UsageError
from ..runtime.dist import restart_count
from ..runtime.stopping import MARKER
from .checkpoint import LAST, UnreadableCheckpoint, checkpoint_files, read_checkpoint
from .run_state import Resume, describe_position

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


def _summary(path: Path) -> str:
    try:
        ckpt = read_checkpoint(path)
    except UnreadableCheckpoint:
        return f"{path.name}, unreadable"
    return f"{path.name} at {describe_position(ckpt['step'], ckpt['epoch'], ckpt['batches_done'])}"


def choose_resume(resume: str, out: str, overwrite: bool, announce: bool) -> Resume | None:
    """The checkpoint this run continues from, or None to start from scratch.

    ``--resume PATH``: that file, or exit 2 if it cannot be read. ``--resume auto``: the newest
    checkpoint in ``out`` that reads; unreadable newer ones are reported and passed over. No
    ``--resume``: a folder that already holds a checkpoint is refused unless ``--overwrite``.
    """
    if overwrite and restart_count() > 0:
        # A restarted attempt (torchrun --max-restarts, SLURM requeue) must not wipe what its own
        # first attempt wrote: it continues instead.
        resume = "auto"
        if announce:
            log.info("restarted attempt: --overwrite already cleared %s; continuing from its checkpoint", out)
    found = checkpoint_files(out)
    if not resume:
        if found and not overwrite:
            raise UsageError(f"--out {out} already holds a run ({_summary(found[0])}): continue it with "
                             f"--resume auto, start over with --overwrite, or choose another --out")
        return None
    if resume != "auto":
        if found and Path(resume).resolve() not in [p.resolve() for p in found]:
            raise UsageError(f"--out {out} holds another run ({_summary(found[0])}): continue {resume} "
                             f"into a new --out")
        try:
            return Resume(Path(resume), read_checkpoint(resume))
        except UnreadableCheckpoint as err:
            raise UsageError(f"--resume {resume}: {err}") from None
    unreadable: list[tuple[Path, UnreadableCheckpoint]] = []
    for path in found:
        try:
            ckpt = read_checkpoint(path)
        except UnreadableCheckpoint as err:
            unreadable.append((path, err))
            continue
        for bad, err in unreadable if announce else ():
            log.warning("%s is unreadable (%s); resuming from the previous one at step %d",
                        bad.name, err, ckpt["step"])
        return Resume(path, ckpt)
    if unreadable:
        reasons = "; ".join(f"{path.name}: {err}" for path, err in unreadable)
        raise UsageError(f"--resume auto: no readable checkpoint in {out} ({reasons}); start over with "
                         f"--overwrite or choose another --out")
    if announce:
        log.info("--resume auto: no checkpoint in %s yet, starting from scratch", out)
    return None


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
