"""Resuming: which checkpoint ``--resume`` continues from, whether it fits this run, and putting
everything back exactly (model, optimizer, scaler, RNG streams, the place in the epoch).

The LR schedule is not restored: the LR is a function of the optimizer step and of this run's
flags (``optimization.LRSchedule``), so more ``--epochs`` extends the schedule of a resumed run.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import UsageError, config_dict, fields_on_resume, flag_name
from ..data.order import ResumableDistributedSampler, ShardAwareSampler
from ..runtime.dist import DistInfo, get_rank, get_world_size, unwrap
from ..runtime.stopping import EXIT_OK, RunStopped
from .checkpoint import (
    Resume,
    UnreadableCheckpoint,
    checkpoint_files,
    mismatch_detail,
    newest_checkpoint_in,
    read_checkpoint,
)
from .monitor import TB_DIR, last_accuracies
from .run import RunState, describe_position, is_complete
from .train_config import RESUME_IF_RESTARTED, TrainConfig, config_changes

log = logging.getLogger("train")


def _summary(path: Path) -> str:
    try:
        ckpt = read_checkpoint(path)
    except UnreadableCheckpoint:
        return f"{path.name}, unreadable"
    return f"{path.name} at {describe_position(ckpt['step'], ckpt['epoch'], ckpt['batches_done'])}"


def choose_resume(resume: str, out: str, overwrite: bool, announce: bool, restarted: bool) -> Resume | None:
    """The checkpoint this run continues from, or None to start from scratch.

    ``restarted``: this is a restarted attempt of the job (on any rank). ``--resume PATH``: that
    file (a folder: its newest checkpoint), or exit 2 if it cannot be read. ``--resume auto``: the newest
    checkpoint in ``out`` that reads; unreadable newer ones are reported and passed over. No
    ``--resume``: a folder that already holds a checkpoint is refused unless ``--overwrite``.
    """
    if restarted and (overwrite or resume == RESUME_IF_RESTARTED):
        # A restarted attempt (torchrun --max-restarts, SLURM requeue) continues what its own first
        # attempt wrote (and --overwrite must not wipe it).
        if announce:
            log.info("restarted attempt: continuing from the newest checkpoint in %s", out)
        resume = "auto"
    elif resume == RESUME_IF_RESTARTED:  # a first attempt: a fresh run
        resume = ""
    found = checkpoint_files(out)
    if not resume:
        if found and not overwrite:
            raise UsageError(f"--out {out} already holds a run ({_summary(found[0])}): continue it with "
                             f"--resume auto, start over with --overwrite, or choose another --out")
        return None
    if resume != "auto":
        resume = str(newest_checkpoint_in(resume, "--resume")) if Path(resume).is_dir() else resume
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


def check_resume_fits(resume: Resume, cfg: TrainConfig, script: str, facts: dict[str, Any], world_size: int,
                      announce: bool) -> None:
    """Refuse (one line, every difference listed) a checkpoint of the other script or of another
    model (the fields declared ``on_resume="fixed"``; ``facts`` such as the class count), and one
    whose run had other settings that make another experiment (``on_resume="experiment"``)
    unless --allow-changes; log the settings that changed. (Whether the data is the one the
    checkpoint's run read: ``data_record.check_same_data``, in the pre-flight.)"""
    ckpt, path = resume.checkpoint, resume.path
    if ckpt["script"] != script:
        hint = "; to start a classifier from it use --pretrained" if ckpt["script"] == "train_moco.py" else ""
        raise UsageError(f"--resume {path}: a checkpoint of {ckpt['script']}, not of {script}{hint}")
    saved, now = {**ckpt["config"], **ckpt["facts"]}, {**config_dict(cfg), **facts}
    differences = [f"{_label(name)}: checkpoint {saved[name]}, now {now[name]}"
                   for name in (*fields_on_resume(type(cfg), "fixed"), *facts)
                   if name in saved and saved[name] != now[name]]
    if differences:
        raise UsageError(f"--resume {path} does not fit this run ({'; '.join(differences)}); resume with "
                         f"the checkpoint's settings, or start a new run in another --out")
    changes = config_changes(ckpt["config"], cfg)
    changed = [f"{_label(name)} {old} -> {new}" for name, (old, new) in changes.items()]
    experiment = fields_on_resume(type(cfg), "experiment")
    another_experiment = [text for name, text in zip(changes, changed) if name in experiment]
    if another_experiment and not cfg.allow_changes:
        raise UsageError(f"--resume {path}: its run had other settings ({', '.join(another_experiment)}), so this "
                         f"would be another experiment; resume with its settings, add --allow-changes to "
                         f"continue anyway (recorded in config.json), or start a new run in another --out")
    if ckpt["world_size"] != world_size:
        changed.append(f"world size {ckpt['world_size']} -> {world_size}")
    if changed and announce:
        log.info("resuming with changed settings: %s", ", ".join(changed))


def _label(name: str) -> str:
    return "number of classes" if name == "num_classes" else flag_name(name)


def state_to_start_from(resume: Resume | None, cfg: TrainConfig, script: str, facts: dict[str, Any], *,
                        model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                        sampler: ResumableDistributedSampler | ShardAwareSampler, info: DistInfo) -> RunState:
    """Where the run starts: at the beginning without a checkpoint (``resume`` None); else the
    checkpoint, checked against this run (:func:`check_resume_fits`, ``facts`` such as the class
    count), loaded into the objects given, and the training
    ``sampler`` set to continue the saved epoch by its own rule. A model that does not fit
    (another --image-size, say) is a UsageError naming the first mismatch."""
    if resume is None:
        return RunState()
    check_resume_fits(resume, cfg, script, facts, info.world_size, info.is_main)
    ckpt, path = resume.checkpoint, resume.path
    check_parameter_groups(ckpt["optimizer"], optimizer, path)
    try:
        unwrap(model).load_state_dict(ckpt["model"])
        load_optimizer_for_this_device(optimizer, ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise UsageError(f"--resume {path}: its model does not fit this one ({mismatch_detail(err)}); was it "
                         f"written with another --arch or --image-size?") from None
    if ckpt["grad_scaler"]:  # empty when the checkpoint's run did not use fp16
        scaler.load_state_dict(ckpt["grad_scaler"])
    state = RunState(ckpt["epoch"], ckpt["step"], ckpt["batches_done"], ckpt["nonfinite_skipped"])
    if not is_complete(cfg, state):  # a complete run trains nothing: its RNG streams do not matter
        restore_rng_states(ckpt["rng"], info.device)
    try:
        state.batches_done, remark = sampler.continue_from(saved_order(ckpt), cfg.accum_steps)
    except UsageError as err:
        raise UsageError(f"--resume {path}: {err}") from None
    if remark and info.is_main:
        log.warning("resuming with world size %d x batch %d x accum steps %d (was %d x %d): %s (docs/data.md)",
                    info.world_size, cfg.batch_size, cfg.accum_steps, ckpt["world_size"], ckpt["config"]["batch_size"],
                    remark)
    if info.is_main:
        log.info("resumed from %s: %s, %d batches into the epoch", path, state.describe(), state.batches_done)
    return state


def saved_order(ckpt: dict[str, Any]) -> dict[str, Any]:
    """How far the checkpoint's epoch went, as its training sampler said (``state_dict``); for a
    checkpoint that has no such record, the same from its position: the shards order if it read
    shards from an object store, else the samples order."""
    if "order" in ckpt:
        return ckpt["order"]
    cfg = ckpt["config"]
    kind = "shards" if cfg["dataset"] == "shards" and cfg["data_dir"].startswith("s3://") else "samples"
    now = [[ckpt["world_size"], cfg["batch_size"], ckpt["batches_done"]]] if ckpt["batches_done"] else []
    return {"order": kind, "epoch": ckpt["epoch"], "segments": [*ckpt.get("order_segments", []), *now]}


def stop_if_complete(cfg: TrainConfig, state: RunState, resume: Resume | None) -> None:
    """A resumed run that has nothing left to train ends here, exit 0, naming its last metrics."""
    if resume is None or not is_complete(cfg, state):
        return
    last = last_accuracies(resume.path.parent / TB_DIR)
    raise RunStopped(f"{resume.path} is complete ({state.describe()}, --epochs {cfg.epochs}"
                     f"{f', --max-steps {cfg.max_steps}' if cfg.max_steps else ''}): nothing to train"
                     f"{f'; last logged: {last}' if last else ''}. Raise --epochs to train longer", EXIT_OK)


def check_parameter_groups(saved: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Refuse a checkpoint whose optimizer holds other parameter groups than this run's (see
    ``optimization.parameter_groups``): its state is kept per group and position, so loaded into
    other groups it would land on other parameters."""
    def names(groups: list[dict]) -> list[str]:
        return [group.get("group", "all") for group in groups]

    if names(saved["param_groups"]) != names(optimizer.param_groups):
        raise UsageError(f"--resume {path}: its optimizer holds the parameter groups {', '.join(names(saved['param_groups']))}, "
                         f"this run's {', '.join(names(optimizer.param_groups))}: give --norm-weight-decay and "
                         f"--bias-weight-decay as its run did (set, or -1), or start a new run in another --out")


def load_optimizer_for_this_device(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(saved)``, keeping this device's implementation (fused on CUDA,
    foreach elsewhere: the saved param groups carry the writer's) and laying every state tensor
    out like its parameter (a GPU checkpoint holds channels_last momentum buffers; the fused and
    foreach kernels pair elements by memory position)."""
    implementation = [{key: group[key] for key in ("fused", "foreach") if key in group}
                      for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, keys in zip(optimizer.param_groups, implementation):
        group.update(keys)
    for param, state in optimizer.state.items():
        for name, value in state.items():
            if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                state[name] = torch.empty_like(param).copy_(value)


def restore_rng_states(states: list[dict[str, Any]], device: torch.device) -> None:
    """This rank's RNG streams as the checkpoint saved them; left as they are (with a warning)
    when the world size changed."""
    if len(states) != get_world_size():
        if get_rank() == 0:
            log.warning("checkpoint has RNG states for %d ranks, running %d: RNG streams not restored",
                        len(states), get_world_size())
        return
    mine = states[get_rank()]
    torch.set_rng_state(mine["torch"])
    random.setstate((3, tuple(mine["python"]), mine["python_pos"]))
    if "cuda" in mine and device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"], device)
