"""Supervised image classification with DistributedDataParallel and gradient accumulation.

One process (CPU or one GPU; also the way to use a debugger):
    python train_classifier.py --dataset digits --arch small_cnn --epochs 5 --out runs/digits
    python train_classifier.py --debug            # tiny subset, anomaly detection, extra checks

One node, every GPU (or N CPU processes with gloo):
    torchrun --standalone --nproc_per_node=4 train_classifier.py --dataset cifar10 --download \\
        --arch resnet18 --batch-size 128 --lr 0.1 --epochs 200 --warmup-steps 500 --out runs/c10

Several nodes (run on every node; HOST is node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        train_classifier.py --dataset imagefolder --data-dir /data/imagenet --arch resnet50 \\
        --batch-size 64 --lr 0.2 --epochs 90 --warmup-steps 2500 --amp bf16 --out runs/in1k

SLURM (see launch/): sbatch launch/slurm_classifier.sbatch --dataset cifar10 ...
Resume after a crash or preemption: add --resume auto (same --out).

--batch-size is per rank and per micro-step: the global batch of one optimizer step is
world_size x --accum-steps x --batch-size, logged at start. --lr is not rescaled for you.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_utils.accumulation import GradientAccumulator
from ddp_utils.checkpoint import resolve_resume, save_checkpoint
from ddp_utils.collectives import reduce_metrics
from ddp_utils.config import UsageError, config_dict, opt, parse_config, save_config, usage_error_exit
from ddp_utils.data import (DEBUG_TRAIN_SAMPLES, DEBUG_VAL_SAMPLES, Loaders, classification_transforms,
                            debug_subset, default_workers, load_split, make_loaders, steps_per_epoch)
from ddp_utils.dist import DistInfo, barrier, cleanup_distributed, detect_launch, init_distributed
from ddp_utils.logs import setup_logging
from ddp_utils.models import build_model
from ddp_utils.monitor import Progress, TensorBoard
from ddp_utils.precision import autocast, grad_scaler
from ddp_utils.run_state import RunState, restore_training_state, training_state, unwrap
from ddp_utils.schedule import build_lr_scheduler
from ddp_utils.train_config import TrainConfig

log = logging.getLogger("train")


@dataclass
class ClassifierConfig(TrainConfig):
    out: str = opt("runs/classifier", "run folder: config.json, checkpoint_last.pt, tb/ (TensorBoard)")


@dataclass
class Run:
    """The objects one training run is made of, built once by :func:`setup`."""

    cfg: ClassifierConfig
    info: DistInfo
    loaders: Loaders
    model: nn.Module  # DDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    accumulator: GradientAccumulator
    state: RunState
    total_steps: int
    tb: TensorBoard


# ----------------------------------------------------------------------------- building
def build_loaders(cfg: ClassifierConfig, info: DistInfo) -> Loaders:
    size = cfg.resolved_image_size()
    if cfg.dataset == "cifar10" and cfg.download:
        if info.is_main:  # one download, not one per rank
            load_split("cifar10", cfg.data_dir, True, size, download=True)
        barrier()
    train_raw = load_split(cfg.dataset, cfg.data_dir, True, size, cfg.download, cfg.synthetic_samples)
    val_raw = load_split(cfg.dataset, cfg.data_dir, False, size, cfg.download, cfg.synthetic_samples)
    if cfg.debug:
        train_raw, val_raw = debug_subset(train_raw, DEBUG_TRAIN_SAMPLES), debug_subset(val_raw, DEBUG_VAL_SAMPLES)
    train_tf, eval_tf = classification_transforms(cfg.dataset, size, cfg.augment)
    workers = cfg.workers if cfg.workers >= 0 else default_workers(cfg.dataset, info.local_world_size)
    return make_loaders(train_raw, val_raw, train_tf, eval_tf, batch_size=cfg.batch_size,
                        workers=workers, seed=cfg.seed, rank=info.rank, world_size=info.world_size,
                        pin_memory=info.device.type == "cuda")


def build_network(cfg: ClassifierConfig, info: DistInfo, num_classes: int) -> nn.Module:
    torch.manual_seed(cfg.seed)  # identical initial weights whatever the world size
    model = build_model(cfg.arch, num_classes, cfg.resolved_image_size()).to(info.device)
    if info.is_distributed:
        model = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    return model


def setup(cfg: ClassifierConfig, info: DistInfo) -> Run:
    loaders = build_loaders(cfg, info)
    model = build_network(cfg, info, loaders.num_classes)
    torch.manual_seed(cfg.seed + 1000 * info.rank)  # per-rank stream for anything random later
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    epoch_steps = steps_per_epoch(len(loaders.train), cfg.accum_steps)
    total_steps = cfg.epochs * epoch_steps
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, total_steps,
                                      cfg.milestone_steps(epoch_steps))
    scaler = grad_scaler(cfg.amp, info.device)
    state = RunState()
    resume_path = resolve_resume(cfg.resume, cfg.out)
    if resume_path is not None:
        state, _ = restore_training_state(str(resume_path), model=model, optimizer=optimizer,
                                          lr_scheduler=lr_scheduler, grad_scaler=scaler,
                                          world_size=info.world_size, batch_size=cfg.batch_size)
    elif cfg.resume == "auto":
        log.info("--resume auto: no checkpoint in %s yet, starting from scratch", cfg.out)
    accumulator = GradientAccumulator(model, optimizer, cfg.accum_steps, lr_scheduler=lr_scheduler,
                                      grad_scaler=scaler, clip_grad=cfg.clip_grad)
    return Run(cfg, info, loaders, model, optimizer, lr_scheduler, scaler, accumulator, state,
               total_steps, TensorBoard(None))


# ----------------------------------------------------------------------------- training
def train_one_epoch(run: Run, progress: Progress) -> None:
    """One pass over the (rest of the) epoch; stops early at --max-steps."""
    cfg, info, state = run.cfg, run.info, run.state
    criterion = nn.CrossEntropyLoss()
    run.model.train()
    run.loaders.set_epoch(state.epoch, skip_batches=state.batches_done)
    images_per_step = info.world_size * cfg.batch_size
    loss_sum = torch.zeros((), device=info.device)  # summed on device: no host sync per micro-step
    window_images, logged_steps, last_log = 0, 0, time.perf_counter()
    for micro, (images, targets) in run.accumulator.micro_batches(run.loaders.train):
        images = images.to(info.device, non_blocking=True)
        targets = targets.to(info.device, non_blocking=True)
        with run.accumulator.sync_context(micro):
            with autocast(cfg.amp, info.device):
                loss = criterion(run.model(images), targets)
            stepped = run.accumulator.backward(loss, micro)
        loss_sum += loss.detach() / micro.window_size
        window_images += images_per_step
        state.batches_done += 1
        if stepped is None:
            continue
        state.step += 1
        logged_steps += 1
        if cfg.debug:
            check_finite(run.model, loss)
        if state.step % cfg.log_every == 0 or state.step == run.total_steps:
            elapsed, last_log = time.perf_counter() - last_log, time.perf_counter()
            mean_loss = reduce_metrics({"loss": loss_sum.item()}, info.device)["loss"] / (info.world_size * logged_steps)
            lr = run.optimizer.param_groups[0]["lr"]
            run.tb.scalars(state.step, train__loss=mean_loss, train__lr=lr,
                           train__images_per_sec=window_images / elapsed)
            progress.update(state.step, state.epoch, mean_loss, lr, window_images / elapsed)
            loss_sum.zero_()
            window_images, logged_steps = 0, 0
        if cfg.ckpt_every and state.step % cfg.ckpt_every == 0:
            checkpoint(run)
        if cfg.max_steps and state.step >= cfg.max_steps:
            return


def check_finite(model: nn.Module, loss: torch.Tensor) -> None:
    """--debug: fail at the first step that produced a non-finite loss or weight."""
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    for name, param in unwrap(model).named_parameters():
        if not torch.isfinite(param).all():
            raise FloatingPointError(f"non-finite values in parameter {name}")
        if param.grad is not None:
            raise AssertionError(f"gradient of {name} survived zero_grad(set_to_none=True)")


@torch.no_grad()
def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader, info: DistInfo, amp: str) -> dict[str, float]:
    """Top-1 accuracy and mean loss over the whole validation split, each sample counted once.

    Runs the bare module: a DDP forward may broadcast buffers, a collective that would hang when
    ranks hold different numbers of validation batches.
    """
    model = unwrap(model)
    was_training = model.training
    model.eval()
    sums = {"loss": 0.0, "correct": 0.0, "count": 0.0}
    for images, targets in loader:
        images, targets = images.to(info.device), targets.to(info.device)
        with autocast(amp, info.device):
            logits = model(images)
        sums["loss"] += nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item()
        sums["correct"] += (logits.argmax(dim=1) == targets).sum().item()
        sums["count"] += len(targets)
    model.train(was_training)
    total = reduce_metrics(sums, info.device)
    return {"loss": total["loss"] / total["count"], "acc1": 100.0 * total["correct"] / total["count"],
            "count": total["count"]}


def checkpoint(run: Run) -> None:
    state = training_state(run.state, config_dict(run.cfg), run.info.world_size, model=run.model,
                           optimizer=run.optimizer, lr_scheduler=run.lr_scheduler, grad_scaler=run.scaler)
    save_checkpoint(state, run.cfg.out)


def fit(run: Run) -> dict[str, float]:
    cfg, state = run.cfg, run.state
    batches = len(run.loaders.train)
    log.info("global batch %d = %d rank(s) x %d accum steps x %d per micro-batch; %d optimizer "
             "steps per epoch, %d in all", run.info.world_size * cfg.accum_steps * cfg.batch_size,
             run.info.world_size, cfg.accum_steps, cfg.batch_size,
             steps_per_epoch(batches, cfg.accum_steps), run.total_steps)
    progress = Progress(min(run.total_steps, cfg.max_steps or run.total_steps), cfg.log_every, run.info.is_main)
    metrics: dict[str, float] = {}
    while state.epoch < cfg.epochs and not (cfg.max_steps and state.step >= cfg.max_steps):
        train_one_epoch(run, progress)
        progress.end_line()
        metrics = evaluate(run.model, run.loaders.val, run.info, cfg.amp)
        run.tb.scalars(state.step, val__loss=metrics["loss"], val__acc1=metrics["acc1"])
        log.info("epoch %d step %d: val loss %.4f, val acc1 %.2f%% (%d images)",
                 state.epoch, state.step, metrics["loss"], metrics["acc1"], metrics["count"])
        if state.batches_done >= batches:  # the epoch is complete (not cut by --max-steps)
            state.epoch, state.batches_done = state.epoch + 1, 0
        checkpoint(run)
    return metrics


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ClassifierConfig, argv, description=__doc__.split("\n")[0])
    try:
        cfg.validate(detect_launch())  # before any process group: every rank fails alike, none hangs
    except UsageError as err:
        return usage_error_exit(Path(sys.argv[0]).name, err)
    info = init_distributed(cfg.device, cfg.dist_timeout)
    setup_logging(info.rank, cfg.debug)
    log.info("%s launch: world size %d, backend %s, device %s", info.launcher, info.world_size,
             info.backend or "none", info.device)
    try:
        torch.autograd.set_detect_anomaly(cfg.debug)
        if cfg.debug:
            log.info("--debug: autograd anomaly detection on, %d-sample subsets, finite checks "
                     "after every step", DEBUG_TRAIN_SAMPLES)
        try:
            run = setup(cfg, info)
        except UsageError as err:  # found once the data is loaded; every rank finds the same
            return usage_error_exit(Path(sys.argv[0]).name, err)
        if info.is_main:  # only now: bad input must not leave a half-made run folder behind
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            save_config(cfg, cfg.out, {"world_size": info.world_size})
            run.tb = TensorBoard(Path(cfg.out) / "tb")
        barrier()
        metrics = fit(run)
        run.tb.close()
        if metrics:
            log.info("final val acc1 %.2f%% at step %d", metrics["acc1"], run.state.step)
    finally:
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
