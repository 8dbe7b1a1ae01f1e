"""Where a run stands (epoch, optimizer step, batches of the epoch already consumed), and
the checkpoint round trip of everything that has to continue exactly after a resume."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .checkpoint import load_checkpoint, restore_rng_states, rng_states

log = logging.getLogger("train")


@dataclass
class RunState:
    epoch: int = 0          # the epoch in progress (0-based)
    step: int = 0           # optimizer steps done since the start of training
    batches_done: int = 0   # micro-batches of `epoch` this rank consumed (a multiple of accum_steps)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under DistributedDataParallel (what checkpoints store)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def training_state(state: RunState, config: dict[str, Any], world_size: int, *,
                   model: nn.Module, optimizer: torch.optim.Optimizer,
                   lr_scheduler: Any, grad_scaler: Any) -> dict[str, Any]:
    """Everything a resume needs, as plain data (every rank must call: RNG states are gathered)."""
    return {
        **asdict(state),
        "world_size": world_size,
        "config": config,
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "rng": rng_states(),
    }


def restore_schedule_position(lr_scheduler: Any, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Continue the schedule *of this run's config* at the saved step.

    ``LambdaLR.load_state_dict`` would also bring back the saved schedule's definition (its
    length, warm-up, milestones, peak LR), so resuming with more --epochs would keep decaying
    towards the old end while MoCo's momentum schedule followed the new one. Only the position is taken; the LR is then recomputed from the current definition
    (the same value, bit for bit, when nothing changed).
    """
    definitions = [dict(vars(fn)) for fn in lr_scheduler.lr_lambdas]
    base_lrs = list(lr_scheduler.base_lrs)  # --lr of this run
    lr_scheduler.load_state_dict(saved)
    lr_scheduler.base_lrs = base_lrs
    for fn, definition in zip(lr_scheduler.lr_lambdas, definitions):
        if vars(fn) != definition:
            log.warning("LR schedule differs from the checkpoint's (%s, was %s): continuing with "
                        "this run's", definition, dict(vars(fn)))
            vars(fn).update(definition)
    for group, base_lr, fn in zip(optimizer.param_groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas):
        group["lr"] = base_lr * fn(lr_scheduler.last_epoch)
    lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def restore_training_state(path: str, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                           lr_scheduler: Any, grad_scaler: Any, world_size: int,
                           batch_size: int) -> RunState:
    """Load ``path`` into the objects given; returns where the run stands."""
    ckpt = load_checkpoint(path)
    unwrap(model).load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if lr_scheduler is not None and ckpt["lr_scheduler"] is not None:
        restore_schedule_position(lr_scheduler, optimizer, ckpt["lr_scheduler"])
    if grad_scaler is not None and ckpt["grad_scaler"] is not None:
        grad_scaler.load_state_dict(ckpt["grad_scaler"])
    restore_rng_states(ckpt["rng"])
    state = RunState(ckpt["epoch"], ckpt["step"], ckpt["batches_done"])
    old_ws, old_bs = ckpt["world_size"], ckpt["config"]["batch_size"]
    if (old_ws, old_bs) != (world_size, batch_size) and state.batches_done:
        # Same global sample position, expressed in this run's micro-batches.
        state.batches_done = state.batches_done * old_ws * old_bs // (world_size * batch_size)
        log.warning("resuming with world size %d x batch %d (was %d x %d): the epoch continues "
                    "near, not exactly at, the saved position", world_size, batch_size, old_ws, old_bs)
    log.info("resumed from %s: epoch %d, step %d, %d batches into the epoch",
             path, state.epoch, state.step, state.batches_done)
    return state
