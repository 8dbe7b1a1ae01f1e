"""Building blocks both scripts' ``setup`` uses: the checks before anything is built, the raw
splits and loader options, SGD with its schedule and scaler, the DDP wrapper."""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ..config import UsageError
from ..data.loading import Loaders, default_workers, steps_per_epoch, usable_cpus
from ..data.sets import (
    DEBUG_TRAIN_SAMPLES,
    DEBUG_VAL_SAMPLES,
    debug_subset,
    download_cifar10,
    load_split,
    num_classes_of,
)
from ..runtime.collectives import all_gather_object, all_ranks_agree
from ..runtime.dist import DistInfo, gpu_identity, restart_count, shared_gpu_problem
from .fast_path import maybe_compile, sgd
from .precision import grad_scaler
from .resume import Resume, choose_resume
from .schedule import LRSchedule
from .train_config import TrainConfig

log = logging.getLogger("train")


def preflight(cfg: TrainConfig, info: DistInfo) -> Resume | None:
    """The checks every rank must pass before anything is built (folders, data, the checkpoint
    to resume, GPUs not shared), agreed by all ranks so that all stop together, and the CIFAR-10
    download. Returns the checkpoint to resume, or None. Nothing is written into --out."""
    # A node that comes back joins with a fresh torchrun agent (restart count 0) while the others'
    # count restarts: the job is restarted if any rank says so.
    restarted = any(all_gather_object(restart_count() > 0))
    with all_ranks_agree():
        cfg.check_paths()
        resume = choose_resume(cfg.resume, cfg.out, cfg.overwrite, info.is_main, restarted)
    download_once_per_node(cfg, info)
    if info.device.type == "cuda" and info.is_distributed:
        problem = shared_gpu_problem(all_gather_object(gpu_identity(info.device)))
        if problem:
            raise UsageError(problem)
    return resume


def download_once_per_node(cfg: TrainConfig, info: DistInfo) -> None:
    """``--download``: local rank 0 of each node fetches CIFAR-10 while the others wait (a failed
    download stops every rank with exit 2); afterwards every rank only reads it."""
    if cfg.dataset == "cifar10" and cfg.download:
        with all_ranks_agree():
            if info.local_rank == 0:
                download_cifar10(cfg.data_dir)


def load_raw_splits(cfg: TrainConfig) -> tuple[Dataset, Dataset]:
    """Train and val splits without transforms (CIFAR-10 is on disk after :func:`preflight`)."""
    size = cfg.resolved_image_size()
    train = load_split(cfg.dataset, cfg.data_dir, True, size, cfg.synthetic_samples)
    val = load_split(cfg.dataset, cfg.data_dir, False, size, cfg.synthetic_samples)
    if num_classes_of(train) != num_classes_of(val):
        raise UsageError(f"--data-dir {cfg.data_dir}: train/ has {num_classes_of(train)} classes but val/ "
                         f"has {num_classes_of(val)}; both need the same class folders")
    if cfg.debug:
        return debug_subset(train, DEBUG_TRAIN_SAMPLES), debug_subset(val, DEBUG_VAL_SAMPLES)
    return train, val


def loader_options(cfg: TrainConfig, info: DistInfo) -> dict:
    """Keyword arguments for make_loaders / eval_loader: batch, workers, sharding, pinning."""
    # torchrun's workers share the agent's CPUs; srun gives each task its own (--cpus-per-task)
    sharing = 1 if info.launcher == "slurm" else info.local_world_size
    workers = cfg.workers if cfg.workers >= 0 else default_workers(cfg.dataset, sharing)
    if cfg.workers < 0 and workers and info.is_main:
        log.info("--workers -1: %d DataLoader workers per rank, for %d usable CPUs shared by %d rank(s)", workers,
                 usable_cpus(), sharing)
    return dict(batch_size=cfg.batch_size, workers=workers, rank=info.rank, world_size=info.world_size,
                pin_memory=info.device.type == "cuda")


def build_optimization(cfg: TrainConfig, params, loaders: Loaders, device: torch.device):
    """SGD, the LR of every optimizer step over all --epochs, the fp16 scaler (disabled for
    other precisions) and the number of optimizer steps in all."""
    optimizer = sgd(params, cfg.lr, cfg.momentum, cfg.weight_decay, device)
    epoch_steps = steps_per_epoch(loaders.batches_per_epoch, cfg.accum_steps)
    total_steps = cfg.epochs * epoch_steps
    lr_schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps,
                             tuple(cfg.milestone_steps(epoch_steps)), epoch_steps)
    return optimizer, lr_schedule, grad_scaler(cfg.amp, device), total_steps


def wrap_network(module: nn.Module, cfg: TrainConfig, info: DistInfo) -> nn.Module:
    """DDP around ``module`` when distributed, then torch.compile with --compile. Every rank must
    call it (DDP broadcasts rank 0's weights). Gradients live in DDP's all-reduce buckets
    (``gradient_as_bucket_view``): one copy of them fewer."""
    if info.is_distributed:
        module = DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                     gradient_as_bucket_view=True)
    return maybe_compile(module, cfg.compile)
