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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from .accumulation import GradientAccumulator
from .checkpoint import resolve_resume, save_checkpoint
from .config import UsageError, config_dict, save_config, usage_error_exit
from .data import (
    DEBUG_TRAIN_SAMPLES,
    DEBUG_VAL_SAMPLES,
    Loaders,
    debug_subset,
    default_workers,
    load_split,
    steps_per_epoch,
)
from .dist import DistInfo, barrier, cleanup_distributed, detect_launch, init_distributed
from .logs import setup_logging
from .monitor import Progress, StepMeter, TensorBoard
from .precision import grad_scaler
from .preemption import PreemptionGuard
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
    preemption: PreemptionGuard | None = None
    preempted: bool = False

    def finished(self) -> bool:
        """All epochs done, --max-steps reached, or stopped by a preemption signal."""
        cfg = self.cfg
        return (self.preempted or self.state.epoch >= cfg.epochs
                or bool(cfg.max_steps and self.state.step >= cfg.max_steps))


def load_raw_splits(cfg: TrainConfig, info: DistInfo) -> tuple[Dataset, Dataset]:
    """Train and val splits without transforms; CIFAR-10 is downloaded once, by rank 0."""
    size = cfg.resolved_image_size()
    if cfg.dataset == "cifar10" and cfg.download:
        if info.is_main:
            load_split("cifar10", cfg.data_dir, True, size, download=True)
        barrier()
    train = load_split(cfg.dataset, cfg.data_dir, True, size, cfg.download, cfg.synthetic_samples)
    val = load_split(cfg.dataset, cfg.data_dir, False, size, cfg.download, cfg.synthetic_samples)
    if cfg.debug:
        return debug_subset(train, DEBUG_TRAIN_SAMPLES), debug_subset(val, DEBUG_VAL_SAMPLES)
    return train, val


def loader_options(cfg: TrainConfig, info: DistInfo) -> dict:
    """Keyword arguments for make_loaders / eval_loader: batch, workers, sharding, pinning."""
    workers = cfg.workers if cfg.workers >= 0 else default_workers(cfg.dataset, info.local_world_size)
    return dict(batch_size=cfg.batch_size, workers=workers, rank=info.rank, world_size=info.world_size,
                pin_memory=info.device.type == "cuda")


def build_optimization(cfg: TrainConfig, params, batches_per_epoch: int, device: torch.device):
    """SGD, the LR schedule (counted in optimizer steps over all --epochs) and the fp16 scaler."""
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    epoch_steps = steps_per_epoch(batches_per_epoch, cfg.accum_steps)
    total_steps = cfg.epochs * epoch_steps
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, total_steps,
                                      cfg.milestone_steps(epoch_steps))
    return optimizer, lr_scheduler, grad_scaler(cfg.amp, device), total_steps


def wrap_for_training(module: nn.Module, cfg: TrainConfig, info: DistInfo, optimizer, lr_scheduler,
                      scaler) -> tuple[nn.Module, GradientAccumulator]:
    """DDP around ``module`` when distributed (the only part DDP ever sees), and its accumulator."""
    network = module
    if info.is_distributed:
        network = DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    accumulator = GradientAccumulator(network, optimizer, cfg.accum_steps, lr_scheduler=lr_scheduler,
                                      grad_scaler=scaler, clip_grad=cfg.clip_grad)
    return network, accumulator


def training_meter(run: TrainRun) -> tuple[Progress, StepMeter]:
    """Progress line/bar and per-step metrics for ``fit``."""
    cfg = run.cfg
    progress = Progress(min(run.total_steps, cfg.max_steps or run.total_steps), cfg.log_every, run.info.is_main)
    return progress, StepMeter(run.tb, progress, run.info.device, run.info.world_size, cfg.log_every)


def resume_if_asked(cfg: TrainConfig, info: DistInfo, *, model: nn.Module, optimizer, lr_scheduler,
                    scaler) -> RunState:
    """Load ``--resume`` (a path, or ``auto``: the run folder's last checkpoint if any)."""
    path = resolve_resume(cfg.resume, cfg.out)
    if path is None:
        if cfg.resume == "auto":
            log.info("--resume auto: no checkpoint in %s yet, starting from scratch", cfg.out)
        return RunState()
    return restore_training_state(str(path), model=model, optimizer=optimizer,
                                      lr_scheduler=lr_scheduler, grad_scaler=scaler,
                                      world_size=info.world_size, batch_size=cfg.batch_size)


def save_run(run: TrainRun) -> None:
    """Checkpoint the run (all ranks call; rank 0 writes)."""
    state = training_state(run.state, config_dict(run.cfg), run.info.world_size, model=run.model,
                           optimizer=run.optimizer, lr_scheduler=run.lr_scheduler, grad_scaler=run.scaler)
    save_checkpoint(state, run.cfg.out)


def after_optimizer_step(run: TrainRun) -> bool:
    """Preemption, periodic checkpoint and --max-steps after each optimizer step (every rank
    calls it, it may run collectives); True when the epoch must end here."""
    if run.preemption is not None and run.preemption.should_stop(run.info.device):
        run.preempted = True
        save_run(run)
        if run.info.is_main:
            run.preemption.write_marker(run.state.step)
        return True
    if run.cfg.ckpt_every and run.state.step % run.cfg.ckpt_every == 0:
        save_run(run)
    return bool(run.cfg.max_steps and run.state.step >= run.cfg.max_steps)


def end_epoch_if_complete(run: TrainRun) -> bool:
    """Advance to the next epoch if this one ran to its end (not cut by a stop); True if so."""
    if run.state.batches_done < run.loaders.batches_per_epoch:
        return False
    run.state.epoch, run.state.batches_done = run.state.epoch + 1, 0
    return True


def log_batch_geometry(run: TrainRun) -> None:
    cfg, info = run.cfg, run.info
    log.info("global batch %d = %d rank(s) x %d accum steps x %d per micro-batch; %d optimizer "
             "steps per epoch, %d in all", info.world_size * cfg.accum_steps * cfg.batch_size,
             info.world_size, cfg.accum_steps, cfg.batch_size,
             steps_per_epoch(run.loaders.batches_per_epoch, cfg.accum_steps), run.total_steps)


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
    preemption = PreemptionGuard(cfg.out)  # before the rendezvous: a USR1 then must not kill us
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
        run.preemption = preemption
        if info.is_main:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            save_config(cfg, cfg.out, {"world_size": info.world_size})
            preemption.clear_marker()
            run.tb = TensorBoard(Path(cfg.out) / "tb")
        barrier()
        log_batch_geometry(run)
        fit(run)
        run.tb.close()
    finally:
        preemption.close()
        cleanup_distributed()
    return 0
