"""Checkpoints: written atomically by rank 0, read back as data (``weights_only=True``)."""
from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from .collectives import all_gather_object
from .dist import barrier, get_rank, get_world_size

log = logging.getLogger(__name__)
LAST = "checkpoint_last.pt"


def save_checkpoint(state: dict[str, Any], out_dir: str | os.PathLike, name: str = LAST) -> Path | None:
    """Rank 0 writes ``out_dir/name`` through a temp file and a rename, so a crash or a preemption
    mid-write leaves the previous checkpoint intact. Every rank must call it (it ends in a barrier)."""
    path = Path(out_dir) / name
    if get_rank() == 0:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        log.info("saved checkpoint %s (epoch %d, step %d)", path, state["epoch"], state["step"])
    barrier()  # nobody races ahead (or exits) while the file is still being written
    return path if get_rank() == 0 else None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint is data, not code: tensors, numbers, strings and containers only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def resolve_resume(resume: str, out_dir: str | os.PathLike) -> Path | None:
    """``--resume auto``: the last checkpoint in ``out_dir`` if there is one; ``PATH``: that file."""
    if not resume:
        return None
    if resume == "auto":
        path = Path(out_dir) / LAST
        return path if path.is_file() else None
    return Path(resume)


def rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states (gathered, so rank 0 can store them all)."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return all_gather_object(state)


def restore_rng_states(states: list[dict[str, Any]]) -> None:
    """Restore this rank's RNG states; skipped (with a warning) if the world size changed."""
    if len(states) != get_world_size():
        log.warning("checkpoint has RNG states for %d ranks, running %d: RNG streams not restored",
                    len(states), get_world_size())
        return
    mine = states[get_rank()]
    torch.set_rng_state(mine["torch"])
    random.setstate((3, tuple(mine["python"]), mine["python_pos"]))
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
