"""The checks every rank passes before anything of a run is built, shared by the run's pre-flight
and ``--check`` (``train.check``), and what the data flags left to the machine resolve to."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import UsageError, dataset_values, flag_name, named_files, per_sample_flags
from ..data.image_files import FolderListing, data_fingerprint
from ..data.order import order_for
from ..data.pipeline import default_workers, rank_shards_in_use, usable_cpus, worker_start_hazard
from ..data.recipes import AugmentRecipe, augment_on_device
from ..data.sets import IMAGE_FILES, check_data_dir, download_cifar10, image_size_for, list_image_files
from ..data.shard_cache import NodeCache
from ..data.shards import ShardIndex, largest_shard
from ..runtime.collectives import all_gather_object, all_ranks_agree, broadcast_object
from ..runtime.device import gpu_identity, shared_gpu_problem
from ..runtime.dist import DistInfo
from ..runtime.faults import FaultPlan
from ..runtime.launch import restart_count
from ..runtime.precision import resolve_amp
from .checkpoint import Resume
from .data_record import check_same_data
from .resume import choose_resume
from .run_folder import check_out_dir
from .train_config import ResolvedSettings, ScriptData, TrainConfig, data_plan
from .unreadable_files import forget_unreadable, named_by_the_run, refuse_unfixed_files

if TYPE_CHECKING:
    from .session import RunSession

log = logging.getLogger("train")
Listings = tuple[FolderListing, FolderListing] | tuple[ShardIndex, ShardIndex]  # image files' train/ and val/


def preflight(cfg: TrainConfig, session: RunSession,
              script: ScriptData) -> tuple[Resume | None, ResolvedSettings, Listings | None]:
    """The checks every rank must pass before anything is built (folders, data, the fault plan,
    the checkpoint to resume, GPUs not shared), agreed by all ranks so that all stop together,
    the CIFAR-10 download and an image folder's listing. Returns the checkpoint to resume (or
    None), what the "auto" data flags resolve to (:func:`resolved_settings`, logged; with image
    files, what identifies them: ``data_fingerprint``; from an object store, the size of the
    node's cache: ``shard_cache_bytes``) and the image files' train and val
    listings (:func:`list_image_files_once`; None for other data); ``script``: what the script
    adds to the data settings. Nothing is written into --out."""
    info = session.info
    # A node that comes back joins with a fresh torchrun agent (restart count 0) while the others'
    # count restarts: the job is restarted if any rank says so.
    restarted = any(all_gather_object(restart_count() > 0))
    with all_ranks_agree():
        resume, session.faults = checks_before_start(cfg, restarted, announce=info.is_main)
    download_once_per_node(cfg, info)
    listings, data_changes = list_image_files_once(cfg, info, restarted, resume)
    if info.is_main:
        forget_unreadable(cfg.out)  # what a run here stopped on is fixed, or put back, or this run starts afresh
    resolved = resolved_settings(cfg, info.launcher, info.local_world_size, info.device, world_size=info.world_size,
                                 script=script)
    resolved = prepare_shard_cache_once_per_node(cfg, info, resolved, listings, resume, script)
    if info.device.type == "cuda" and info.is_distributed:
        problem = shared_gpu_problem(all_gather_object(gpu_identity(info.device)))
        if problem:
            raise UsageError(problem)
    if listings is not None:
        resolved = dataclasses.replace(resolved, data_fingerprint=data_fingerprint(*listings),
                                       data_changes=data_changes)
    if info.is_main:
        log.info("resolved: %s", describe_settings(cfg, resolved, info.launcher, info.local_world_size, script))
        hazard = worker_start_hazard(resolved.workers)
        if hazard:
            log.warning(hazard)
    return resume, resolved, listings


def checks_before_start(cfg: TrainConfig, restarted: bool, announce: bool) -> tuple[Resume | None, FaultPlan]:
    """What the run's pre-flight and ``--check`` both check, on this rank alone: the paths, the
    fault plan (DDP_FAULT, the tests' fault injection), the checkpoint to resume (None: a fresh
    run), and that no image file the run stopped on still fails to decode."""
    check_paths(cfg)
    faults = FaultPlan.from_env()
    resume = choose_resume(cfg.resume, cfg.out, cfg.overwrite, announce, restarted)
    refuse_unfixed_files(cfg.out, resume, restarted)
    return resume, faults


def check_paths(cfg: TrainConfig) -> None:
    """The files and folders the config names: --out a folder this process can write in, the
    data where --data-dir says, and each file a flag names (``opt(names_file=...)``) there (bad
    input if not)."""
    check_out_dir(cfg.out)
    problem = check_data_dir(cfg.dataset, cfg.data_dir, cfg.download)
    if problem:
        raise UsageError(problem)
    for flag, path in named_files(cfg).items():
        if not Path(path).exists():
            raise UsageError(f"{flag} {path}: no such file or folder")


def download_once_per_node(cfg: TrainConfig, info: DistInfo) -> None:
    """``--download``: local rank 0 of each node fetches CIFAR-10 while the others wait (a failed
    download stops every rank with exit 2); afterwards every rank only reads it."""
    if cfg.dataset == "cifar10" and cfg.download:
        with all_ranks_agree():
            if info.local_rank == 0:
                download_cifar10(cfg.data_dir)


def list_image_files_once(cfg: TrainConfig, info: DistInfo, restarted: bool = False, resume: Resume | None = None
                          ) -> tuple[Listings | None, tuple[str, ...]]:
    """Image files: rank 0 lists an image folder's train/ and val/ (or reads the shards' indexes
    and checks their shards), checks that a resumed run continues on the data it read
    (``data_record.check_same_data``), and every rank receives the result, so that the job scans
    the tree once, not once per rank (at 512 ranks, 512 scans of ImageNet's 1.28M files meet one
    file system's metadata servers at once). Bad data stops every rank with rank 0's one line. An
    object store that does not answer is bad input at a first start (the address, or the
    endpoint, is likely wrong); a restarted attempt waits ``--store-timeout`` for it, then stops
    with exit 75. Returns the listings (None for other data sets) and the data's accepted changes."""
    if cfg.dataset not in IMAGE_FILES:
        return None, ()
    found = None
    patience = cfg.store_timeout if restarted else 0.0
    with all_ranks_agree():
        if info.is_main:
            listings = tuple(list_image_files(cfg.dataset, cfg.data_dir, train, patience) for train in (True, False))
            found = check_same_data(resume, listings, named_by(resume), cfg.allow_changes)
            for change in found[1]:
                log.warning("the data changed since the checkpoint's run read it: %s", change)
    return broadcast_object(found)


def named_by(resume: Resume | None) -> list[str]:
    """What the run of the checkpoint to continue named as unreadable (none for a fresh start)."""
    return named_by_the_run(str(resume.path.parent)) if resume is not None else []


def check_cache_room(cfg: TrainConfig, resolved: ResolvedSettings, indexes: Listings, ranks_on_node: int,
                     node: str, script: ScriptData) -> int | None:
    """Shards from an object store: the bytes the cache of node ``node`` may fill; bad input
    when each of its ``ranks_on_node`` ranks gets less of it than the shards its loaders hold at
    once (``pipeline.rank_shards_in_use``, from the resolved workers, the batch and the index's
    images per shard) and one more, or when the cache's disk (here) has less room than that,
    the shards already in the node's folder counted as room. Other data: None, nothing to
    check."""
    store = cfg.store_cache()
    if store is None:
        return None
    plan = data_plan(cfg, resolved, AugmentRecipe(), script)  # the augmentation plays no part
    largest, in_use = largest_shard(*indexes), rank_shards_in_use(plan, indexes[0].shard, indexes[1].shard)
    problem = store.too_small(largest, ranks_on_node, in_use)
    if problem:
        raise UsageError(problem)
    capacity = store.node_bytes(largest, ranks_on_node, in_use)
    folder = Path(store.folder).parent
    existing = next(path for path in (folder, *folder.parents) if path.is_dir())  # made at start if missing
    node_folder = Path(store.node_folder(node))
    cached = sum(path.stat().st_size for path in node_folder.iterdir() if path.is_file()) if node_folder.is_dir() else 0
    free = shutil.disk_usage(existing).free + cached
    if free < capacity:
        raise UsageError(f"--shard-cache-dir {folder}: {free / 1e9:.2f} GB free, the node's cache of shards may fill "
                         f"{capacity / 1e9:.2f} GB ({ranks_on_node} rank(s) x {store.rank_shards(in_use)} of the "
                         f"largest shard, {largest / 1e6:,.1f} MB); point --shard-cache-dir at a local disk with room, "
                         f"or lower --shard-read-ahead, --shard-downloads or --shard-cache-gb")
    return capacity


def prepare_shard_cache_once_per_node(cfg: TrainConfig, info: DistInfo, resolved: ResolvedSettings,
                                      indexes: Listings | None, resume: Resume | None,
                                      script: ScriptData) -> ResolvedSettings:
    """Shards from an object store: every rank sizes its node's cache and checks its disk
    (:func:`check_cache_room`; ``info.node`` names the node); then each node's local rank 0
    prepares the node's cache folder before any rank of the node reads (every rank waits for
    the agreement): a run that continues a checkpoint (``resume``: a restarted attempt, or a
    resume into the same --out) keeps the shards an earlier attempt downloaded of the listing it
    reads (``NodeCache.prepare``); a new run starts with an empty folder. Returns ``resolved``
    with the cache's size (other data: ``resolved`` itself)."""
    store = cfg.store_cache()
    if store is None:
        return resolved
    with all_ranks_agree():  # every rank done reading the folder before one empties it
        capacity = check_cache_room(cfg, resolved, indexes, info.local_world_size, info.node, script)
    with all_ranks_agree():
        if info.local_rank == 0:
            keep = [ref for index in indexes for ref in index.refs()] if resume is not None else []
            NodeCache(store.node_folder(info.node), 0, info.rank, 0.0).prepare(keep)
    return dataclasses.replace(resolved, shard_cache_bytes=capacity)


def ranks_sharing_cpus(launcher: str, local_world_size: int) -> int:
    """The ranks that share this process's CPUs: torchrun's workers share the agent's; srun gives
    each task its own (--cpus-per-task)."""
    return 1 if launcher == "slurm" else local_world_size


def resolved_settings(cfg: TrainConfig, launcher: str, local_world_size: int, device: torch.device, *,
                      world_size: int, script: ScriptData = ScriptData()) -> ResolvedSettings:
    """What the flags left to this machine and data resolve to: the precision (``--amp auto``),
    the image side (``--image-size 0``, or what the script's weights fix: ``script.image_size``),
    DataLoader workers per rank (``--workers -1``), where augmentation runs (``--aug-on auto``),
    where image files are decoded and their order; the global batch of ``world_size`` ranks; and
    the settings at the data set's own defaults (``DATASET_DEFAULTS``), however they came. The
    start-up log, ``--check``, config.json and checkpoints give them beside the flags as asked."""
    sharing = ranks_sharing_cpus(launcher, local_world_size)
    own = {name: value for name, value in dataset_values(type(cfg), cfg.dataset).items()
           if getattr(cfg, name) == value}
    on_device = augment_on_device(cfg.aug_on, cfg.dataset, device, bool(per_sample_flags(cfg)))
    return ResolvedSettings(image_size=image_size_for(cfg.dataset, script.image_size or cfg.image_size),
                            workers=cfg.workers if cfg.workers >= 0 else default_workers(cfg.dataset, sharing),
                            aug_on="device" if on_device else "loader",
                            decode_on="device" if cfg.decode_on == "device" else "loader",
                            order=order_for(cfg.dataset, cfg.order), amp=resolve_amp(cfg.amp, device),
                            global_batch=cfg.global_batch(world_size), dataset_defaults=own)


def describe_settings(cfg: TrainConfig, resolved: ResolvedSettings, launcher: str, local_world_size: int,
                      script: ScriptData = ScriptData()) -> str:
    """The resolved data settings in words, each followed by the flag it came from where that
    was left to the machine: "224 px (--image-size 0), augmentation on the loader (--aug-on
    auto), 3 DataLoader workers per rank (--workers -1: ...)"; then the script's views in words
    (``script.views``)."""
    sharing = ranks_sharing_cpus(launcher, local_world_size)
    why_workers = "in-memory data needs none" if resolved.workers == 0 else \
        f"{usable_cpus()} usable CPUs shared by {sharing} rank(s)"
    per_sample = per_sample_flags(cfg)
    auto = {"image_size": cfg.image_size == 0 and not script.image_size and "--image-size 0",
            "aug_on": cfg.aug_on == "auto" and "--aug-on auto" + (
                f": {', '.join(per_sample)} run per sample" if per_sample else ""),
            "decode_on": cfg.decode_on == "auto" and "--decode-on auto",
            "workers": cfg.workers < 0 and f"--workers -1: {why_workers}",
            "order": cfg.order == "auto" and "--order auto"}
    said = {"image_size": f"{resolved.image_size} px", "aug_on": f"augmentation on the {resolved.aug_on}",
            "decode_on": f"decoding on the {resolved.decode_on}",
            "workers": f"{resolved.workers} DataLoader worker(s) per rank",
            "order": f"the {resolved.order} order"}
    if cfg.dataset != "imagefolder":
        del said["decode_on"]  # only image files are decoded
    if cfg.dataset != "shards":
        del said["order"]  # the one order there is
    text = ", ".join(text + (f" ({auto[name]})" if auto[name] else "") for name, text in said.items())
    views = script.views(resolved.image_size)
    if views:
        text += f"; {views}"
    own = resolved.dataset_defaults
    if own:
        text += f"; at the {cfg.dataset} data set's own defaults: " + ", ".join(f"{flag_name(name)} {value}" for name, value in own.items())
    return text
