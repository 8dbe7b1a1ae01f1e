"""Checkpoints: what one holds, written atomically by rank 0 with a short history, read back as
data only (``torch.load(..., weights_only=True)``); ``run.save_checkpoint`` saves a run's.

``OUT/checkpoint_last.pt`` is the newest; ``checkpoint_prev1.pt`` ... ``checkpoint_prev{N-1}.pt``
are older ones (``--keep-checkpoints N``). A new checkpoint is written to a temp file and fsynced;
only then is the history rotated by renames, so a crash, a preemption or a full disk at any moment
leaves at least the previous checkpoint whole.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import UsageError
from ..runtime.collectives import all_gather_object, all_reduce_sum, broadcast_object
from ..runtime.dist import get_rank, unwrap
from ..runtime.stopping import EXIT_FAILURE, RunStopped
from .train_config import ResolvedSettings

log = logging.getLogger("train")
LAST = "checkpoint_last.pt"
_PREVIOUS = re.compile(r"checkpoint_prev(\d+)\.pt")
REQUIRED_KEYS = ("script", "model", "step", "epoch", "batches_done", "config", "world_size")


class UnreadableCheckpoint(Exception):
    """A checkpoint file that cannot be used; ``str()`` says why in a few words."""


@dataclass(frozen=True)
class Resume:
    """A checkpoint chosen to continue from (``resume.choose_resume``), read and checked to be one."""

    path: Path
    checkpoint: dict[str, Any]


def history_names(keep: int) -> list[str]:
    """File names of the kept checkpoints, newest first."""
    return [LAST] + [f"checkpoint_prev{i}.pt" for i in range(1, keep)]


def checkpoint_files(out_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints in a run folder, newest first (whatever --keep-checkpoints wrote them)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    previous = sorted((int(m.group(1)), p) for p in out.iterdir() if (m := _PREVIOUS.fullmatch(p.name)))
    return ([out / LAST] if (out / LAST).is_file() else []) + [p for _, p in previous]


def newest_checkpoint_in(folder: str | Path, flag: str) -> Path:
    """A run folder given where a checkpoint is expected means its newest checkpoint."""
    found = checkpoint_files(folder)
    if not found:
        raise UsageError(f"{flag} {folder}: a folder without checkpoints; give a run's --out folder or a "
                         f"checkpoint_*.pt file")
    return found[0]


# ----------------------------------------------------------------------------- writing
def checkpoint_contents(*, state: dict[str, Any], script: str, facts: dict[str, Any], world_size: int,
                        config: dict[str, Any], resolved: ResolvedSettings, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                        device: torch.device) -> dict[str, Any]:
    """Everything a resume needs, as plain data (every rank must call: RNG states are gathered).
    ``state``: where the run stands (epoch, step, ...); ``script`` and ``facts`` (e.g. the class
    count) let a resume refuse a checkpoint that cannot fit; ``model`` is unwrapped here."""
    return {
        **state,
        "script": script,
        "facts": facts,
        "world_size": world_size,
        "config": config,
        "resolved": resolved.as_record(),  # plain data: a weights_only load reads it
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "grad_scaler": scaler.state_dict(),  # empty unless fp16
        "rng": rng_states(device),
    }


def weights_finite(model: torch.nn.Module, device: torch.device) -> bool:
    """True on every rank when every floating tensor of the model is finite on every rank: checked
    on the device, the ranks' counts summed, the answer read once."""
    checks = [torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point()]
    bad = (~torch.stack(checks)).sum().to(device=device, dtype=torch.int32).reshape(1)
    return int(all_reduce_sum(bad).item()) == 0


def rng_states(device: torch.device) -> list[dict[str, Any]]:
    """Every rank's RNG states (gathered, so rank 0 can store them all); CUDA's only when
    training on CUDA (asking creates a CUDA context, even for a --device cpu run)."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return all_gather_object(state)


def write_checkpoint(state: dict[str, Any], out_dir: str | os.PathLike, keep: int = 2) -> Path:
    """Rank 0 writes ``out_dir/checkpoint_last.pt`` and rotates the history; every rank must call
    it and learns the outcome (a broadcast, which also keeps anyone from racing ahead while the
    file is written). A failed write raises :class:`RunStopped` on every rank."""
    out = Path(out_dir)
    error = _write_with_history(state, out, keep) if get_rank() == 0 else None
    error = broadcast_object(error)
    if error:
        raise RunStopped(error, EXIT_FAILURE)
    return out / LAST


def _write_with_history(state: dict[str, Any], out: Path, keep: int) -> str | None:
    last, tmp = out / LAST, out / f".{LAST}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as err:  # a full disk is an OSError; torch may wrap a failed write
        with contextlib.suppress(OSError):
            tmp.unlink()
        kept = f"the previous checkpoint {last} is intact" if last.exists() else "no checkpoint was written yet"
        return (f"could not write the step-{state['step']} checkpoint in {out} ({_write_error_reason(err)}); "
                f"{kept}; free some space (or fix the folder) and continue with --resume auto")
    try:
        names = history_names(keep)
        for older, newer in zip(reversed(names[1:]), reversed(names[:-1])):  # prev1 -> prev2, last -> prev1
            if (out / newer).exists():
                os.replace(out / newer, out / older)
        os.replace(tmp, last)
        for stale in checkpoint_files(out)[keep:]:  # left by an earlier run with a larger --keep-checkpoints
            stale.unlink()
        dir_fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the renames themselves survive a power cut
        finally:
            os.close(dir_fd)
    except OSError as err:
        return f"could not rotate the checkpoints in {out} ({err.strerror or err}); the newest is {tmp}"
    return None


def _write_error_reason(err: BaseException) -> str:
    """The operating system's reason for a failed write. torch's zip writer turns a failed
    ``write`` (a full disk, a file-size limit) into a RuntimeError of its own whose message names
    only a line of its C++; the OSError it swallowed is the exception's context."""
    for cause in (err, err.__cause__, err.__context__):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    return str(err).split(". ")[0].strip() or type(err).__name__


# ----------------------------------------------------------------------------- reading
def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint of these scripts (:func:`load_data`, then a check of its entries)."""
    data = load_data(path)
    missing = [key for key in REQUIRED_KEYS if key not in data] if isinstance(data, dict) else list(REQUIRED_KEYS)
    if missing:
        raise UnreadableCheckpoint("not a checkpoint of train_classifier.py or train_moco.py "
                                   f"(it has no {', '.join(missing)})")
    return data


def load_data(path: str | os.PathLike) -> Any:
    """A file written by ``torch.save``, loaded as data (``weights_only=True``: tensors, numbers,
    strings, containers). Raises :class:`UnreadableCheckpoint` with a short reason; never
    suggests ``weights_only=False``, which would let a file from an unknown source run code."""
    path = Path(path)
    if not path.is_file():
        raise UnreadableCheckpoint("no such file")
    if path.stat().st_size == 0:
        raise UnreadableCheckpoint("the file is empty")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut-off one has no directory
        raise UnreadableCheckpoint("truncated or not a PyTorch checkpoint (no complete zip archive)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise UnreadableCheckpoint(f"it holds a pickled Python object{what} that could run code; "
                                   "weights_only=True refused it and nothing in the file was run. "
                                   "These scripts never write such files") from None
    except Exception as err:  # a damaged archive: torch's messages are long, keep the first clause
        first = str(err).split(". ")[0].strip() or type(err).__name__
        raise UnreadableCheckpoint(f"damaged ({first})") from None
    return data


def mismatch_detail(err: Exception) -> str:
    """The first specific line of a ``load_state_dict`` error (its first line only names the
    module), at most 160 characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[1] if len(lines) > 1 else lines[0] if lines else type(err).__name__)[:160]
