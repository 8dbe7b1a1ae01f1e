"""Building blocks both scripts' ``setup`` uses: the checks before anything is built, what the
"auto" data flags resolve to and the run's data plan, SGD with its schedule and scaler, the DDP
wrapper."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ..config import UsageError, dataset_values, flag_name
from ..data.image_files import describe_unreadable, fix_hint
from ..data.loading import Loaders, steps_per_epoch
from ..data.pipeline import DataPlan, default_workers, load_raw_splits, usable_cpus
from ..data.preview import augmentation_grid
from ..data.recipes import AugmentRecipe, augment_on_device
from ..data.sets import check_data_dir, download_cifar10
from ..runtime.collectives import all_gather_object, all_ranks_agree
from ..runtime.dist import DistInfo, barrier, gpu_identity, restart_count, shared_gpu_problem
from ..runtime.faults import FaultPlan
from .checkpoint import Resume
from .fast_path import maybe_compile, sgd
from .monitor import TensorBoard
from .precision import grad_scaler
from .resume import choose_resume
from .run_folder import (
    TB_DIR,
    UNREADABLE_MARKER,
    check_out_dir,
    prepare_run_folder,
    still_unreadable,
    write_run_record,
)
from .schedule import LRSchedule
from .session import RunSession
from .train_config import TrainConfig

log = logging.getLogger("train")


def preflight(cfg: TrainConfig, session: RunSession) -> Resume | None:
    """The checks every rank must pass before anything is built (folders, data, the fault plan,
    the checkpoint to resume, GPUs not shared), agreed by all ranks so that all stop together,
    and the CIFAR-10 download. Returns the checkpoint to resume, or None. Nothing is written into
    --out."""
    info = session.info
    # A node that comes back joins with a fresh torchrun agent (restart count 0) while the others'
    # count restarts: the job is restarted if any rank says so.
    restarted = any(all_gather_object(restart_count() > 0))
    with all_ranks_agree():
        check_paths(cfg)
        session.faults = FaultPlan.from_env()  # DDP_FAULT: the tests' fault injection
        resume = choose_resume(cfg.resume, cfg.out, cfg.overwrite, info.is_main, restarted)
        refuse_unfixed_files(cfg.out, resume, restarted)
    download_once_per_node(cfg, info)
    if info.device.type == "cuda" and info.is_distributed:
        problem = shared_gpu_problem(all_gather_object(gpu_identity(info.device)))
        if problem:
            raise UsageError(problem)
    return resume


def check_paths(cfg: TrainConfig) -> None:
    """The files and folders the config names: --out a folder this process can write in, the
    data where --data-dir says, and each of ``cfg.required_paths()`` there (bad input if not)."""
    check_out_dir(cfg.out)
    problem = check_data_dir(cfg.dataset, cfg.data_dir, cfg.download)
    if problem:
        raise UsageError(problem)
    for flag, path in cfg.required_paths().items():
        if not Path(path).exists():
            raise UsageError(f"{flag} {path}: no such file or folder")


def refuse_unfixed_files(out: str, resume: Resume | None, restarted: bool) -> None:
    """A run continued in ``out`` after it stopped on image files that could not be decoded (a
    restarted attempt of it, or a resume of its checkpoint) starts only once they decode or are
    gone; a restarted attempt (torchrun, a requeue) exits 2 without repeating the line its first
    attempt printed."""
    continues = resume is not None and Path(resume.path).parent.resolve() == Path(out).resolve()
    if not (continues or restarted):
        return
    unfixed = still_unreadable(out)
    if unfixed:
        raise UsageError(f"{describe_unreadable(unfixed)}: the run in {out} stopped there; {fix_hint(unfixed)}, then continue "
                         f"with --resume auto", said=restarted)


def download_once_per_node(cfg: TrainConfig, info: DistInfo) -> None:
    """``--download``: local rank 0 of each node fetches CIFAR-10 while the others wait (a failed
    download stops every rank with exit 2); afterwards every rank only reads it."""
    if cfg.dataset == "cifar10" and cfg.download:
        with all_ranks_agree():
            if info.local_rank == 0:
                download_cifar10(cfg.data_dir)


def resolved_settings(cfg: TrainConfig, launcher: str, local_world_size: int, device: torch.device) -> dict[str, Any]:
    """What the data flags left to this machine resolve to: the image side (``--image-size 0``),
    DataLoader workers per rank (``--workers -1``) and where augmentation runs (``--aug-on
    auto``); and under "dataset_defaults", the settings at the data set's own defaults
    (``DATASET_DEFAULTS``), however they came. The start-up log, ``--check``, config.json and checkpoints give them
    beside the flags as asked, which stay what a ``--config`` re-run reads."""
    # torchrun's workers share the agent's CPUs; srun gives each task its own (--cpus-per-task)
    sharing = 1 if launcher == "slurm" else local_world_size
    resolved = {"image_size": cfg.resolved_image_size(),
                "workers": cfg.workers if cfg.workers >= 0 else default_workers(cfg.dataset, sharing),
                "aug_on": "device" if augment_on_device(cfg.aug_on, cfg.dataset, device) else "loader",
                "decode_on": "device" if cfg.decode_on == "device" else "loader"}
    own = {name: value for name, value in dataset_values(type(cfg), cfg.dataset).items()
           if getattr(cfg, name) == value}
    if own:  # the settings at the data set's own defaults (the script's DATASET_DEFAULTS)
        resolved["dataset_defaults"] = own
    return resolved


def describe_settings(cfg: TrainConfig, resolved: dict[str, Any], launcher: str, local_world_size: int) -> str:
    """The resolved data settings in words, each followed by the flag it came from where that
    was left to the machine: "224 px (--image-size 0), augmentation on the loader (--aug-on
    auto), 3 DataLoader workers per rank (--workers -1: ...)"."""
    sharing = 1 if launcher == "slurm" else local_world_size
    why_workers = "in-memory data needs none" if resolved["workers"] == 0 else \
        f"{usable_cpus()} usable CPUs shared by {sharing} rank(s)"
    auto = {"image_size": cfg.image_size == 0 and "--image-size 0",
            "aug_on": cfg.aug_on == "auto" and "--aug-on auto",
            "decode_on": cfg.decode_on == "auto" and "--decode-on auto",
            "workers": cfg.workers < 0 and f"--workers -1: {why_workers}"}
    said = {"image_size": f"{resolved['image_size']} px", "aug_on": f"augmentation on the {resolved['aug_on']}",
            "decode_on": f"decoding on the {resolved['decode_on']}",
            "workers": f"{resolved['workers']} DataLoader worker(s) per rank"}
    if cfg.dataset != "imagefolder":
        del said["decode_on"]  # only image files are decoded
    text = ", ".join(text + (f" ({auto[name]})" if auto[name] else "") for name, text in said.items())
    own = resolved.get("dataset_defaults")
    if own:
        text += f"; at the {cfg.dataset} data set's own defaults: " + ", ".join(f"{flag_name(name)} {value}" for name, value in own.items())
    return text


def data_plan(cfg: TrainConfig, resolved: dict[str, Any], recipe: AugmentRecipe,
              bank_samples: int | None = None) -> DataPlan:
    """The run's data, as ``data.pipeline.build_data`` takes it: the flags with what the "auto"
    ones resolved to, the script's training view (``recipe``, ``cfg.VIEWS`` per sample) and MoCo's
    kNN bank (``bank_samples``; None: no bank)."""
    return DataPlan(dataset=cfg.dataset, data_dir=cfg.data_dir, image_size=resolved["image_size"],
                    synthetic_samples=cfg.synthetic_samples, debug=cfg.debug, seed=cfg.seed, batch_size=cfg.batch_size,
                    workers=resolved["workers"], normalization=cfg.normalization, recipe=recipe, views=cfg.VIEWS,
                    aug_on_device=resolved["aug_on"] == "device", decode_on_device=resolved["decode_on"] == "device",
                    bank_samples=bank_samples)


def raw_splits(cfg: TrainConfig) -> tuple[Dataset, Dataset]:
    """The run's train and val splits without transforms (CIFAR-10 on disk after :func:`preflight`)."""
    return load_raw_splits(cfg.dataset, cfg.data_dir, cfg.resolved_image_size(), cfg.synthetic_samples, cfg.debug)


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


def augmentation_preview(cfg: TrainConfig, loaders: Loaders, is_main: bool, resume: Resume | None):
    """Rank 0 of a fresh run: the picture of the augmentation for TensorBoard, else None (an
    image file among its samples that cannot be decoded stops the run at its first step)."""
    if not is_main or resume is not None:
        return None
    return augmentation_grid(loaders, cfg.dataset, cfg.resolved_image_size(), normalization=cfg.normalization)


def open_run_folder(cfg: TrainConfig, session: RunSession, resume: Resume | None, step: int,
                    resolved: dict | None = None, preview: torch.Tensor | None = None) -> TensorBoard:
    """Rank 0, once every check has passed: the folder (an old run cleared on --overwrite), its
    config.json, TensorBoard from ``step`` on, and ``preview`` (:func:`augmentation_preview`).
    Returns the TensorBoard writer (a no-op on other ranks). A resumed checkpoint in this folder
    counts as saved."""
    tb = TensorBoard(None)
    if resume is not None and resume.path.parent == Path(cfg.out):
        session.saved.step, session.saved.path = step, resume.path
    if session.info.is_main:
        prepare_run_folder(cfg.out, cfg.overwrite, resuming=resume is not None)
        write_run_record(cfg, session.info.world_size, resume, step, resolved)
        session.signals.clear_marker()
        (Path(cfg.out) / UNREADABLE_MARKER).unlink(missing_ok=True)  # its files decode now (preflight)
        tb = session.close_at_exit(TensorBoard(Path(cfg.out) / TB_DIR, purge_step=step + 1 if resume else None))
        if preview is not None:  # what the augmentation does, once per run
            tb.image("data/augmented_views", preview, step)
    barrier()
    return tb
