"""``--check``: the checks a launch makes before its first collective (``train.preflight``), in
one plain process (no process group, nothing written), and the run that would start, in a few
lines. The launch/ scripts run it once before starting workers, so a mistake is one line and
exit 2, never a restarted group or a launcher's traceback."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from ..config import UsageError
from ..data.host_memory import check_shared_memory, describe_memory
from ..data.image_files import image_files_of
from ..data.pipeline import (
    describe_plan_device_memory,
    plan_memory,
    raw_splits,
    require_a_batch,
    training_order,
    usable_cpus,
    worker_start_hazard,
)
from ..data.recipes import AugmentRecipe
from ..data.sets import IMAGE_FILES, check_data_dir, list_image_files
from ..data.shard_cache import START_DOWNLOADS
from ..data.shards import shards_not_matching
from ..data.unreadable import decode_every_file
from ..runtime.device import device_type
from ..runtime.launch import LaunchEnv, detect_launch, restart_count
from ..runtime.logs import masked, say_error
from ..runtime.precision import precision_name
from ..runtime.stopping import EXIT_OK
from .data_record import check_same_data
from .optimization import steps_per_epoch
from .preflight import check_cache_room, checks_before_start, describe_settings, named_by, resolved_settings
from .resume import check_resume_fits
from .run import describe_position
from .train_config import RESUME_IF_RESTARTED, ScriptData, TrainConfig, data_plan

ScriptCheck = Callable[[Dataset, int], tuple[dict[str, Any], list[str]]]


def check_only(cfg: TrainConfig, script: str, model: str, script_check: ScriptCheck,
               script_data: Callable[[], ScriptData]) -> int:
    """Run every check of a launch; print the run (rank 0) or the one-line problem; return the exit
    code. ``script_check(train_split, image_size)`` returns the script's facts that a resume must
    match (e.g. the class count) and lines to add at the end (a warning's begins "warning: "), or
    raises UsageError; ``script_data()``: what the script adds to the data settings (made once
    the paths are checked: the classifier's reads --pretrained), or raises UsageError."""
    launch = detect_launch()
    says = launch.rank == 0  # a requeued job's check speaks too: its log is where a user looks
    try:
        lines = _checked_run(cfg, script, model, script_check, script_data, launch)
    except UsageError as err:
        if says and not err.said:
            say_error(f"{script}: error: {err}")
        return err.exit_code
    if says:
        print(masked(f"{script} --check: ok, nothing written; the run:"), *(masked(f"  {line}") for line in lines),
              sep="\n", flush=True)
    return EXIT_OK


def _checked_run(cfg: TrainConfig, script: str, model: str, script_check: ScriptCheck,
                 script_data: Callable[[], ScriptData], launch: LaunchEnv) -> list[str]:
    resume, _ = checks_before_start(cfg, restarted=restart_count() > 0, announce=False)  # the pre-flight's own
    data = script_data()
    device, world_size = torch.device(device_type(cfg.device)), launch.world_size
    resolved = resolved_settings(cfg, launch.launcher, launch.local_world_size, device, world_size=world_size,
                                 script=data)
    settings = describe_settings(cfg, resolved, launch.launcher, launch.local_world_size, data)
    lines = [f"launch: world size {world_size}, {device}, precision {precision_name(cfg.amp, device)}"]
    hazard = worker_start_hazard(resolved.workers)
    if hazard:
        lines.append(f"warning: {hazard}")
    if cfg.dataset == "cifar10" and cfg.download and check_data_dir(cfg.dataset, cfg.data_dir, False):
        lines.append(f"data: cifar10, downloaded into {cfg.data_dir} at start; {settings}")
        facts, extra, changes = {}, [], ()
    else:
        listings = tuple(list_image_files(cfg.dataset, cfg.data_dir, split) for split in (True, False)) \
            if cfg.dataset in IMAGE_FILES else None
        listings, changes = check_same_data(resume, listings, named_by(resume), cfg.allow_changes)
        plan = data_plan(cfg, resolved, AugmentRecipe(), data, listings)  # the augmentation plays no part in the checks
        train, val = raw_splits(plan)
        facts, extra = script_check(train, resolved.image_size)
        samples_per_rank = training_order(plan, train, world_size, 0).num_samples
        capacity = check_cache_room(cfg, resolved, (image_files_of(train).index, image_files_of(val).index),
                                    launch.local_world_size, launch.node, data) if cfg.dataset == "shards" else None
        batches = require_a_batch(samples_per_rank // cfg.batch_size, len(train), world_size, cfg.batch_size)
        steps = steps_per_epoch(batches, cfg.accum_steps)
        lines.append(f"data: {cfg.dataset}, {len(train):,} training and {len(val):,} validation images; {settings}")
        store = cfg.store_cache()
        if capacity is not None:
            lines.append(f"object store: each node caches up to {capacity / 1e9:.2f} GB of shards in "
                         f"{store.folder}-nodeN (never more; {'kept' if store.keep else 'deleted'} at the end); each "
                         f"rank reads at least {store.read_ahead} shard(s) ahead and downloads up to "
                         f"{store.downloads} at once (from {START_DOWNLOADS}, as many as its loaders' demand needs); "
                         f"a store that does not answer is waited for {store.timeout:g} s")
        memory = plan_memory(plan, train)
        check_shared_memory(memory, launch.local_world_size)
        if memory is not None:
            lines.append(describe_memory(memory, launch.local_world_size))
        on_device = describe_plan_device_memory(plan, train, device)
        if on_device:
            lines.append(on_device)
        if cfg.check_data:
            started, threads = time.perf_counter(), usable_cpus()
            if cfg.dataset == "shards":  # first the shards' checksums: a damaged copy is one line a shard
                damaged = [line for split in (train, val) for line in shards_not_matching(image_files_of(split).reader)]
                if damaged:
                    raise UsageError(f"--check-data: {len(damaged)} shard(s) differ from the ones the index was "
                                     f"written with:" + "".join(f"\n  {line}" for line in damaged))
            total = decode_every_file(train, val, threads=threads)
            lines.append(f"data check: all {total:,} image files decode ({time.perf_counter() - started:.1f} s on "
                         f"{_count(threads, 'thread')})")
        lines.append(f"steps: {steps:,} per epoch, {steps * cfg.epochs:,} in {_count(cfg.epochs, 'epoch')}"
                     + (f" (stopping at --max-steps {cfg.max_steps})" if cfg.max_steps else ""))
    lines.append(f"model: {model}")
    lines.append(f"optimisation: global batch {resolved.global_batch} = {_count(world_size, 'rank')} x "
                 f"{_count(cfg.accum_steps, 'micro-step')} x {cfg.batch_size}; lr {cfg.lr:g}, {cfg.schedule_summary()}"
                 + (f", {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
                 + (f", gradient norm clipped to {cfg.clip_grad:g}" if cfg.clip_grad else ""))
    remark = cfg.global_batch_remark(world_size, resolved.global_batch)
    if remark:
        lines.append(f"warning: {remark}")
    if resume is not None:
        check_resume_fits(resume, cfg, script, facts, world_size, announce=False)
        lines += [f"data: changed since the checkpoint's run read it: {change}" for change in changes]
        ckpt = resume.checkpoint
        lines.append(f"run folder: {cfg.out}, continuing {resume.path} at "
                     f"{describe_position(ckpt['step'], ckpt['epoch'], ckpt['batches_done'])}")
    else:
        fresh = "started over (--overwrite)" if cfg.overwrite and Path(cfg.out).exists() else "a new run"
        later = ", continued by restarted attempts" if cfg.resume == RESUME_IF_RESTARTED else ""
        lines.append(f"run folder: {cfg.out}, {fresh}{later}")
    return lines + extra


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
