"""The one way from a run's data settings to its batches: the raw splits, where augmentation and
decoding run, the training batches, the evaluation batches and MoCo's kNN bank. Both scripts
build their data through :func:`build_data`; every decode and augmentation mode is wired here.

Where each step runs (``aug_on_device``, ``decode_on_device``):

* in-memory data (digits, CIFAR-10, synthetic) on the device: the split is one tensor there,
  batched and augmented as a whole (:class:`loading.DeviceBatches`), no workers;
* image files on the device: DataLoader workers decode each file (or, with ``decode_on_device``,
  only read its bytes) and pack the batch; the training process crops, resizes and augments every
  view as a batch (:class:`loading.DeviceFinish`), evaluation and the kNN bank likewise;
* the loader path (the reference): workers run torchvision's per-sample transforms.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ..config import UsageError
from .batch_augment import BatchAugment
from .host_memory import check_shared_memory, loader_memory
from .image_files import UnreadableFiles, image_files_of
from .loading import (
    EVAL_PREFETCH,
    TRAIN_PREFETCH,
    DeviceAugment,
    DeviceBatches,
    DeviceFinish,
    Loaders,
    ResumableDistributedSampler,
    SeededTransform,
    ShardedEvalSampler,
    bank_subset,
    checked,
    collate_files,
    device_eval_batches,
    eval_batch_size,
    eval_loader,
    fit_for_pad_crop,
    private_generator,
    require_a_batch,
)
from .recipes import AugmentRecipe
from .sets import (
    DEBUG_TRAIN_SAMPLES,
    DEBUG_VAL_SAMPLES,
    debug_subset,
    in_memory_tensors,
    load_split,
    normalization_stats,
    num_classes_of,
)

log = logging.getLogger("train")


@dataclass(frozen=True)
class DataPlan:
    """What a run's batches depend on; each script fills it from its config."""

    dataset: str
    data_dir: str
    image_size: int             # px, resolved (not 0)
    synthetic_samples: int
    debug: bool                 # small subsets of both splits
    seed: int
    batch_size: int             # per rank and micro-step
    workers: int                # DataLoader workers per rank, resolved (not -1)
    normalization: str
    recipe: AugmentRecipe       # one training view
    views: int                  # views per sample: 1 (classifier) or 2 (MoCo's query and key)
    aug_on_device: bool
    decode_on_device: bool = False
    bank_samples: int | None = None  # MoCo's kNN bank: this many training samples (0: all); None: no bank


def load_raw_splits(dataset: str, data_dir: str, image_size: int, synthetic_samples: int = 2048,
                    debug: bool = False) -> tuple[Dataset, Dataset]:
    """Train and val splits without transforms (CIFAR-10 must be on disk already); the same class
    folders in both, else bad input."""
    train = load_split(dataset, data_dir, True, image_size, synthetic_samples)
    val = load_split(dataset, data_dir, False, image_size, synthetic_samples)
    if num_classes_of(train) != num_classes_of(val):
        raise UsageError(f"--data-dir {data_dir}: train/ has {num_classes_of(train)} classes but val/ "
                         f"has {num_classes_of(val)}; both need the same class folders")
    if debug:
        return debug_subset(train, DEBUG_TRAIN_SAMPLES), debug_subset(val, DEBUG_VAL_SAMPLES)
    return train, val


def build_data(plan: DataPlan, *, rank: int, world_size: int, device: torch.device, ranks_on_node: int = 1
               ) -> Loaders:
    """Every rank's batches for ``plan``: training (sharded, shuffled, drop_last; resumable),
    evaluation (sharded, each sample once) and, with ``plan.bank_samples`` set, the kNN bank.
    Bad input when ``/dev/shm`` cannot hold the workers' batches of ``ranks_on_node`` ranks."""
    train_raw, val_raw = load_raw_splits(plan.dataset, plan.data_dir, plan.image_size, plan.synthetic_samples,
                                         plan.debug)
    check_shared_memory(plan_memory(plan, train_raw), ranks_on_node)
    bank_raw = None
    if plan.bank_samples is not None:
        bank_raw = bank_subset(train_raw, plan.bank_samples, plan.seed) if plan.bank_samples else train_raw
    sampler = ResumableDistributedSampler(train_raw, world_size, rank, plan.seed)
    unreadable = UnreadableFiles()
    common = dict(plan=plan, rank=rank, world_size=world_size, device=device, unreadable=unreadable)
    tensors = in_memory_tensors(train_raw) if plan.aug_on_device else None
    if tensors is not None:
        train, val, bank = _in_memory_on_device(tensors, val_raw, bank_raw, sampler, **common)
        if rank == 0:
            log.info("data: the training split held on %s, batches made there%s", device,
                     f" (--workers {plan.workers} unused)" if plan.workers else "")
    elif plan.aug_on_device:
        train, val, bank = _files_on_device(train_raw, val_raw, bank_raw, sampler, **common)
    else:
        train, val, bank = _loader_path(train_raw, val_raw, bank_raw, sampler, **common)
    require_a_batch(len(train), len(train_raw), world_size, plan.batch_size)
    return Loaders(train, val, sampler, train_raw, num_classes_of(train_raw), plan.aug_on_device, unreadable, bank)


def plan_memory(plan: DataPlan, train_raw: Dataset):
    """The host memory ``plan``'s workers fill (``host_memory.loader_memory``)."""
    return loader_memory(train_raw, batch_size=plan.batch_size, workers=plan.workers, views=plan.views,
                         image_size=plan.image_size, aug_on_device=plan.aug_on_device,
                         decode_on_device=plan.decode_on_device)


def _eval_recipe(plan: DataPlan) -> AugmentRecipe:
    mean, std = normalization_stats(plan.dataset, plan.normalization) or (None, None)
    return AugmentRecipe(mean=mean, std=std)


def _train_loader(data: Dataset, raw: Dataset, sampler, plan: DataPlan, device: torch.device,
                  unreadable: UnreadableFiles, collate=None):
    # drop_last: every micro-batch has batch_size samples, so the 1/window loss scale is exact.
    loader = DataLoader(data, batch_size=plan.batch_size, sampler=sampler, drop_last=True, num_workers=plan.workers,
                        pin_memory=device.type == "cuda", persistent_workers=plan.workers > 0,
                        prefetch_factor=TRAIN_PREFETCH if plan.workers else None,
                        generator=private_generator(), **({"collate_fn": collate} if collate else {}))
    return checked(loader, raw, unreadable)


def _in_memory_on_device(tensors, val_raw, bank_raw, sampler, *, plan, rank, world_size, device, unreadable):
    """The training split as one tensor on the device; evaluation and the bank batched there too
    when stored at the network's size, else per sample."""
    augment = DeviceAugment(BatchAugment(plan.recipe, plan.image_size), plan.seed, plan.views)
    images, targets = (t.to(device) for t in tensors)
    train = DeviceBatches(fit_for_pad_crop(images, augment.augment), targets, sampler, plan.batch_size, augment)
    eval_batch = eval_batch_size(plan.batch_size, image_files=False)
    val_images, val_targets = (t.to(device) for t in in_memory_tensors(val_raw))
    val = device_eval_batches(val_images, val_targets, augment.augment, rank=rank, world_size=world_size,
                              batch_size=eval_batch)
    bank = None
    if bank_raw is not None and val is not None:  # the stored size is the network's: the training tensor serves
        subset = torch.as_tensor(list(bank_raw.indices)) if isinstance(bank_raw, Subset) else None
        bank = device_eval_batches(images, targets, augment.augment, rank=rank, world_size=world_size,
                                   batch_size=eval_batch, subset=subset)

    def per_sample(raw: Dataset):  # a split stored at another size than the network's: resized per sample
        from .transforms import eval_transform

        return eval_loader(raw, eval_transform(plan.dataset, plan.image_size, plan.normalization),
                           batch_size=eval_batch, workers=plan.workers, rank=rank, world_size=world_size,
                           pin_memory=device.type == "cuda", unreadable=unreadable)

    if val is None:
        val = per_sample(val_raw)
    if bank is None and bank_raw is not None:
        bank = per_sample(bank_raw)
    return train, val, bank


def _files_on_device(train_raw, val_raw, bank_raw, sampler, *, plan, rank, world_size, device, unreadable):
    """Workers decode (or only read) and pack; the device makes every view, evaluation's too."""
    read = "encoded" if plan.decode_on_device else "tensor"
    train_set = SeededTransform(read_as(train_raw, read), None, plan.seed, with_key=True)
    augment = DeviceAugment(BatchAugment(plan.recipe, plan.image_size), plan.seed, plan.views)
    train = DeviceFinish(_train_loader(train_set, train_raw, sampler, plan, device, unreadable, collate_files),
                         augment, device, train_raw, unreadable)
    evaluate = DeviceAugment(BatchAugment(_eval_recipe(plan), plan.image_size), seed=0)

    def eval_batches(raw: Dataset) -> DeviceFinish:
        data = SeededTransform(read_as(raw, read), None, seed=0, with_key=True)
        loader = DataLoader(data, batch_size=eval_batch_size(plan.batch_size, image_files=True),
                            sampler=ShardedEvalSampler(data, world_size, rank), num_workers=plan.workers,
                            pin_memory=device.type == "cuda", collate_fn=collate_files,
                            prefetch_factor=EVAL_PREFETCH if plan.workers else None, generator=private_generator())
        return DeviceFinish(checked(loader, raw, unreadable), evaluate, device, raw, unreadable)

    return train, eval_batches(val_raw), None if bank_raw is None else eval_batches(bank_raw)


def _loader_path(train_raw, val_raw, bank_raw, sampler, *, plan, rank, world_size, device, unreadable):
    """torchvision's per-sample transforms in the workers: the reference path."""
    from .transforms import TwoCrops, eval_transform, view_transform

    one_view = view_transform(plan.recipe, plan.dataset, plan.image_size)
    train_set = SeededTransform(train_raw, one_view if plan.views == 1 else TwoCrops(one_view), plan.seed)
    train = _train_loader(train_set, train_raw, sampler, plan, device, unreadable)
    eval_tf = eval_transform(plan.dataset, plan.image_size, plan.normalization)
    options = dict(batch_size=eval_batch_size(plan.batch_size, image_files_of(train_raw) is not None),
                   workers=plan.workers, rank=rank,
                   world_size=world_size, pin_memory=device.type == "cuda", unreadable=unreadable)
    return train, eval_loader(val_raw, eval_tf, **options), \
        None if bank_raw is None else eval_loader(bank_raw, eval_tf, **options)


def read_as(raw: Dataset, read: str) -> Dataset:
    """``raw`` (ImageFiles, or a Subset of it) with its files read as ``read`` (ImageFiles.reading)."""
    if isinstance(raw, Subset):
        return Subset(read_as(raw.dataset, read), raw.indices)
    if image_files_of(raw) is not raw:
        raise TypeError(f"read_as: image files expected, got {type(raw).__name__}")
    return raw.reading(read)


def default_workers(dataset: str, sharing: int) -> int:
    """``--workers -1``: DataLoader workers per rank, from the CPUs this process may run on (its
    affinity: SLURM's cpuset, taskset), shared by ``sharing`` ranks, one CPU kept for the rank."""
    if dataset in ("digits", "synthetic"):
        return 0  # in-memory tensors: worker processes only add start-up time
    # No cap: decoding JPEGs is what starves a GPU, and a node may give each rank 13 cores or more.
    return max(1, usable_cpus() // max(1, sharing) - 1)


def usable_cpus() -> int:
    """The CPUs this process may run on (not the machine's: a job on a shared node owns fewer)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 2
