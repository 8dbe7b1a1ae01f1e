"""The skeleton both training scripts share: validate -> init -> build -> train -> clean up,
the optimizer/schedule/scaler trio, resume, and the run checkpoint."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch
from torch import nn

from .accumulation import GradientAccumulator
from .checkpoint import resolve_resume, save_checkpoint
from .config import UsageError, config_dict, save_config, usage_error_exit
from .data import Loaders, steps_per_epoch
from .dist import DistInfo, barrier, cleanup_distributed, detect_launch, init_distributed
from .logs import setup_logging
from .monitor import TensorBoard
from .precision import grad_scaler
from .run_state import RunState, restore_training_state, training_state
from .schedule import build_lr_scheduler
from .train_config import TrainConfig

log = logging.getLogger("train")


@dataclass
class TrainRun:
    """What one run is made of. ``model`` is what checkpoints store (unwrapped when saved)."""

    cfg: TrainConfig
    info: DistInfo
    loaders: Loaders
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    accumulator: GradientAccumulator
    state: RunState
    total_steps: int
    tb: TensorBoard


def build_optimization(cfg: TrainConfig, params, batches_per_epoch: int, device: torch.device):
    """SGD, the LR schedule (counted in optimizer steps over all --epochs) and the fp16 scaler."""
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    epoch_steps = steps_per_epoch(batches_per_epoch, cfg.accum_steps)
    total_steps = cfg.epochs * epoch_steps
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, total_steps,
                                      cfg.milestone_steps(epoch_steps))
    return optimizer, lr_scheduler, grad_scaler(cfg.amp, device), total_steps


def resume_if_asked(cfg: TrainConfig, info: DistInfo, *, model: nn.Module, optimizer, lr_scheduler,
                    scaler) -> RunState:
    """Load ``--resume`` (a path, or ``auto``: the run folder's last checkpoint if any)."""
    path = resolve_resume(cfg.resume, cfg.out)
    if path is None:
        if cfg.resume == "auto":
            log.info("--resume auto: no checkpoint in %s yet, starting from scratch", cfg.out)
        return RunState()
    state, _ = restore_training_state(str(path), model=model, optimizer=optimizer,
                                      lr_scheduler=lr_scheduler, grad_scaler=scaler,
                                      world_size=info.world_size, batch_size=cfg.batch_size)
    return state


def save_run(run: TrainRun) -> None:
    """Checkpoint the run (all ranks call; rank 0 writes)."""
    state = training_state(run.state, config_dict(run.cfg), run.info.world_size, model=run.model,
                           optimizer=run.optimizer, lr_scheduler=run.lr_scheduler, grad_scaler=run.scaler)
    save_checkpoint(state, run.cfg.out)


def log_batch_geometry(run: TrainRun) -> None:
    cfg, info = run.cfg, run.info
    log.info("global batch %d = %d rank(s) x %d accum steps x %d per micro-batch; %d optimizer "
             "steps per epoch, %d in all", info.world_size * cfg.accum_steps * cfg.batch_size,
             info.world_size, cfg.accum_steps, cfg.batch_size,
             steps_per_epoch(len(run.loaders.train), cfg.accum_steps), run.total_steps)


R = TypeVar("R", bound=TrainRun)


def run_script(cfg: TrainConfig, setup: Callable[[TrainConfig, DistInfo], R], fit: Callable[[R], object]) -> int:
    """Validate, initialise the process group, build the run, train, and always clean up.

    Bad input is found before the process group exists, so every rank reports it and exits 2
    without waiting for a peer; nothing is written until the run is fully built.
    """
    prog = Path(sys.argv[0]).name
    try:
        cfg.validate(detect_launch())
    except UsageError as err:
        return usage_error_exit(prog, err)
    info = init_distributed(cfg.device, cfg.dist_timeout)
    setup_logging(info.rank, cfg.debug)
    log.info("%s launch: world size %d, backend %s, device %s", info.launcher, info.world_size,
             info.backend or "none", info.device)
    try:
        torch.autograd.set_detect_anomaly(cfg.debug)
        if cfg.debug:
            log.info("--debug: autograd anomaly detection on, small data subsets, finite checks "
                     "after every step")
        try:
            run = setup(cfg, info)
        except UsageError as err:  # found once data or checkpoints are read; every rank finds it
            return usage_error_exit(prog, err)
        if info.is_main:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            save_config(cfg, cfg.out, {"world_size": info.world_size})
            run.tb = TensorBoard(Path(cfg.out) / "tb")
        barrier()
        log_batch_geometry(run)
        fit(run)
        run.tb.close()
    finally:
        cleanup_distributed()
    return 0
