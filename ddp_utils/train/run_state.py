"""Where a run stands (epoch, optimizer step, batches of the epoch already consumed), and the
checkpoint round trip of everything that has to continue exactly after a resume.

The LR schedule is not part of it: the LR is a function of the optimizer step
(``schedule.LRSchedule``), so the saved ``step`` and this run's flags determine it."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import UsageError, flag_name
from .checkpoint import restore_rng_states, rng_states

log = logging.getLogger("train")
# Config fields that name this run, not its training: they may differ on resume without a word.
RUN_ONLY_FIELDS = ("out", "resume", "overwrite")


@dataclass
class RunState:
    epoch: int = 0              # epochs completed (0-based index of the epoch in progress)
    step: int = 0               # optimizer steps done since the start of training
    batches_done: int = 0       # micro-batches of `epoch` this rank consumed (a multiple of accum_steps)
    nonfinite_skipped: int = 0  # optimizer steps skipped for a non-finite loss (--skip-nonfinite)

    @property
    def epoch_number(self) -> int:
        """The epoch of the last step, counted from 1, as every message counts epochs (0 = none yet)."""
        return self.epoch if self.batches_done == 0 else self.epoch + 1

    def describe(self) -> str:
        return describe_position(self.step, self.epoch, self.batches_done)


def describe_position(step: int, epoch: int, batches_done: int) -> str:
    if batches_done == 0:
        return f"step {step}, end of epoch {epoch}" if epoch else f"step {step}"
    return f"step {step}, in epoch {epoch + 1}"


@dataclass(frozen=True)
class Resume:
    """A checkpoint chosen by ``--resume`` (already read and checked to be a checkpoint)."""

    path: Path
    checkpoint: dict[str, Any]


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under DistributedDataParallel (what checkpoints store)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def training_state(state: RunState, config: dict[str, Any], world_size: int, *, script: str,
                   facts: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                   grad_scaler: Any) -> dict[str, Any]:
    """Everything a resume needs, as plain data (every rank must call: RNG states are gathered).
    ``script`` and ``facts`` (e.g. the class count) let a resume refuse a checkpoint that cannot fit."""
    return {
        **asdict(state),
        "script": script,
        "facts": facts,
        "world_size": world_size,
        "config": config,
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "rng": rng_states(),
    }


def checkpoint_script(ckpt: dict[str, Any]) -> str:
    """Which script wrote ``ckpt`` (checkpoints from before the field existed: from their keys)."""
    return ckpt.get("script") or ("train_moco.py" if "queue" in ckpt["model"] else "train_classifier.py")


def check_resume_fits(resume: Resume, script: str, config: dict[str, Any], fixed: tuple[str, ...],
                      facts: dict[str, Any], world_size: int, announce: bool) -> None:
    """Refuse (one line, every difference listed) a checkpoint of the other script or with another
    model shape; log the settings that changed and may change (epochs, lr, batch, world size...)."""
    ckpt, path = resume.checkpoint, resume.path
    other = checkpoint_script(ckpt)
    if other != script:
        hint = "; to start a classifier from it use --pretrained" if other == "train_moco.py" else ""
        raise UsageError(f"--resume {path}: a checkpoint of {other}, not of {script}{hint}")
    saved = {**ckpt["config"], **ckpt.get("facts", {})}
    now = {**config, **facts}
    differences = [f"{_label(name)}: checkpoint {saved[name]}, now {now[name]}"
                   for name in (*fixed, *facts) if name in saved and saved[name] != now[name]]
    if differences:
        raise UsageError(f"--resume {path} does not fit this run ({'; '.join(differences)}); resume with "
                         f"the checkpoint's settings, or start a new run in another --out")
    changed = [f"{_label(name)} {saved[name]} -> {value}" for name, value in config.items()
               if name in saved and saved[name] != value and name not in RUN_ONLY_FIELDS]
    if ckpt["world_size"] != world_size:
        changed.append(f"world size {ckpt['world_size']} -> {world_size}")
    if changed and announce:
        log.info("resuming with changed settings: %s", ", ".join(changed))


def _label(name: str) -> str:
    return "number of classes" if name == "num_classes" else flag_name(name)


def restore_training_state(resume: Resume, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                           grad_scaler: Any, world_size: int, batch_size: int, announce: bool) -> RunState:
    """Load the checkpoint into the objects given; returns where the run stands. A model that
    does not fit (another --image-size, say) is a UsageError with the first mismatch.

    The LR needs nothing from the checkpoint but its ``step``: this run's schedule gives the LR
    of every step from there on (more --epochs extends it). The optimizer's saved ``lr`` is
    replaced before the next step. A checkpoint of an earlier version also holds an
    ``"lr_scheduler"`` entry (a LambdaLR's state, and ``initial_lr`` in the optimizer's param
    groups): both are ignored."""
    ckpt, path = resume.checkpoint, resume.path
    try:
        unwrap(model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        detail = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise UsageError(f"--resume {path}: its model does not fit this one ({detail[:160]}); was it "
                         f"written with another --arch or --image-size?") from None
    # Checkpoints of the LambdaLR version: their "lr_scheduler" entry is ignored (the LR follows
    # from the step) and LambdaLR's "initial_lr" is dropped from the param groups.
    for group in optimizer.param_groups:
        group.pop("initial_lr", None)
    if grad_scaler is not None and ckpt["grad_scaler"] is not None:
        grad_scaler.load_state_dict(ckpt["grad_scaler"])
    restore_rng_states(ckpt["rng"])
    state = RunState(ckpt["epoch"], ckpt["step"], ckpt["batches_done"], ckpt.get("nonfinite_skipped", 0))
    old_ws, old_bs = ckpt["world_size"], ckpt["config"]["batch_size"]
    if (old_ws, old_bs) != (world_size, batch_size) and state.batches_done:
        # Same global sample position, expressed in this run's micro-batches.
        state.batches_done = state.batches_done * old_ws * old_bs // (world_size * batch_size)
        if announce:
            log.warning("resuming with world size %d x batch %d (was %d x %d): the epoch continues "
                        "near, not exactly at, the saved position", world_size, batch_size, old_ws, old_bs)
    if announce:
        log.info("resumed from %s: %s, %d batches into the epoch", path, state.describe(), state.batches_done)
    return state
