"""From raw data sets to each rank's batches: the resumable distributed sampler, the exact
evaluation sampler, per-sample seeded transforms, batches held and augmented on the device, the
DataLoaders, and the kNN bank's fixed subset.

Randomness: data order comes from ``DistributedSampler`` (seed + epoch, identical on every rank,
then sharded); augmentation is a function of (seed, epoch, sample index), so a resumed or
re-sharded run applies exactly the crops and flips of an uninterrupted one.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Sized

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

from .. import hashing
from ..config import UsageError
from ..runtime.dist import memory_format
from .batch_augment import VIEW_COLUMNS, BatchAugment, as_float_rgb, draws, normalize
from .sets import in_memory_tensors, num_classes_of

Transform = Callable[[torch.Tensor], object]
log = logging.getLogger("train")
EVAL_BATCH_FACTOR = 4  # evaluation batches are this many training micro-batches: no activations kept
Key = tuple[int, int]  # (epoch, sample index): what the training sampler yields


class SeededTransform(Dataset):
    """``transform(base[i])`` with the RNG seeded from (seed, epoch, i).

    The key is an (epoch, index) pair from :class:`ResumableDistributedSampler`, so the epoch
    travels with the index into persistent workers; a plain index (evaluation) means epoch 0.
    The caller's global RNG is restored afterwards. ``with_key``: also return (epoch, index), for
    the half of the augmentation that runs on the device (:class:`DeviceFinish`).
    """

    def __init__(self, base: Dataset, transform: Transform | None, seed: int, with_key: bool = False):
        self.base, self.transform, self.seed, self.with_key = base, transform, seed, with_key

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: Key | int):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image, target = self.base[index]
        if self.transform is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(hashing.seed(self.seed, epoch, index))
                image = self.transform(image)
        return (image, target, epoch, index) if self.with_key else (image, target)


class DeviceAugment:
    """The batched augmentation of ``views`` views for (seed, epoch, indices), on the device.

    ``images`` is one batch (every view is drawn from it) or, when DataLoader workers already
    cropped each view, a tuple with one batch per view.
    """

    def __init__(self, augment: BatchAugment, seed: int, views: int = 1):
        self.augment, self.seed, self.views = augment, seed, views

    def __call__(self, images, epoch: int, index: torch.Tensor):
        u = draws(self.seed, epoch, index, self.views)  # every view's uniforms in one call
        layout = memory_format(index.device)  # the network's: no re-lay afterwards
        if self.views == 1:
            return self.augment.apply(images, u, layout)
        sources = images if isinstance(images, (tuple, list)) else [images] * self.views
        return tuple(self.augment.apply(x, u[:, v * VIEW_COLUMNS:(v + 1) * VIEW_COLUMNS], layout)
                     for v, x in enumerate(sources))


class OneAhead:
    """An iterator over batches made on the device that can make the next one early:
    ``prepare_next()`` queues its kernels now (e.g. while the host waits for the ranks'
    agreement), and ``next()`` then hands it out."""

    def __init__(self, batches: Iterator):
        self._batches, self._ahead = batches, None

    def __iter__(self) -> OneAhead:
        return self

    def __next__(self):
        if self._ahead is not None:
            batch, self._ahead = self._ahead, None
            return batch
        return next(self._batches)

    def prepare_next(self) -> None:
        if self._ahead is None:
            self._ahead = next(self._batches, None)  # None at the end: next() then stops


class DeviceBatches:
    """Training batches of an in-memory data set held once, as one tensor, on the training device:
    gathered by index in the sampler's order (the DataLoader path's order, sharding and resume
    skip) and augmented as a whole; no workers, no per-sample Python, no image copies."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, sampler: ResumableDistributedSampler,
                 batch_size: int, augment: DeviceAugment):
        self.images, self.targets = images, targets    # N x C x H x W (uint8 or float), N
        self.sampler, self.batch_size, self.augment = sampler, batch_size, augment

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size    # drop_last, as the DataLoader

    def __iter__(self) -> OneAhead:
        return OneAhead(self._batches())

    def _batches(self):
        keys = list(self.sampler)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            chunk = keys[start:start + self.batch_size]
            index = torch.tensor([i for _, i in chunk])  # B, on the host
            if self.images.is_cuda:  # pinned: the copy below then runs without stalling the host
                index = index.pin_memory()
            index = index.to(self.images.device, non_blocking=True)
            yield self.augment(self.images[index], chunk[0][0], index), self.targets[index]


class DeviceFinish:
    """Finishes on the device what DataLoader workers started (ImageFolder: the workers decode
    and crop each image; flips, colour and blur run here as a batch, keyed by the same
    (epoch, index) the workers used)."""

    def __init__(self, loader: DataLoader, augment: DeviceAugment, device: torch.device):
        self.loader, self.augment, self.device = loader, augment, device
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> OneAhead:
        return OneAhead(self._batches())

    def _batches(self):
        for images, targets, epochs, index in self.loader:
            images = [x.to(self.device, non_blocking=True) for x in images] if isinstance(images, (tuple, list)) \
                else images.to(self.device, non_blocking=True)
            yield self.augment(images, int(epochs[0]), index.to(self.device, non_blocking=True)), targets


class DeviceEvalBatches:
    """Evaluation batches of an in-memory split held on the device: this rank's shard (samples
    r, r+W, r+2W, ... of ``subset``, as :class:`ShardedEvalSampler`), in order, each batch turned
    into normalised floats there (what the per-sample evaluation transform does at the stored size)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, *, rank: int, world_size: int,
                 batch_size: int, mean: tuple | None, std: tuple | None, subset: torch.Tensor | None = None):
        self.images, self.targets, self.batch_size, self.mean, self.std = images, targets, batch_size, mean, std
        every = torch.arange(len(images), device=images.device) if subset is None else subset.to(images.device)
        self.index = every[rank::world_size]

    def __len__(self) -> int:
        return math.ceil(len(self.index) / self.batch_size)

    def __iter__(self):
        layout = memory_format(self.images.device)
        for start in range(0, len(self.index), self.batch_size):
            index = self.index[start:start + self.batch_size]
            yield normalize(as_float_rgb(self.images[index]), self.mean, self.std, layout), self.targets[index]


# ----------------------------------------------------------------------------- samplers
class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch part-way, after the samples a checkpoint
    already consumed, so a resumed run sees exactly the batches it had not seen yet."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[Key]:
        """(epoch, index) pairs: the epoch travels with each index (see SeededTransform)."""
        indices = list(super().__iter__())
        return iter([(self.epoch, i) for i in indices[self.skip:]])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class ShardedEvalSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ...: every sample exactly once, no padding duplicates
    (``DistributedSampler`` pads, which would count some validation samples twice)."""

    def __init__(self, data: Sized, num_replicas: int, rank: int):
        self.indices = range(rank, len(data), num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Loaders:
    train: DataLoader | DeviceBatches | DeviceFinish
    val: DataLoader
    train_sampler: ResumableDistributedSampler
    train_set: Dataset   # the raw training split
    num_classes: int
    on_device: bool = False  # augmentation runs on the training device

    @property
    def batches_per_epoch(self) -> int:
        """Training micro-batches in a whole epoch (``len(train)`` shrinks while resuming)."""
        return self.train_sampler.num_samples // self.train.batch_size

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Reshuffle for ``epoch`` (augmentation follows: the epoch travels with each index);
        skip the batches a checkpoint consumed."""
        self.train_sampler.set_epoch(epoch, skip=skip_batches * self.train.batch_size)


def default_workers(dataset: str, sharing: int) -> int:
    """``--workers -1``: DataLoader workers per rank, from the CPUs this process may run on (its
    affinity: SLURM's cpuset, taskset), shared by ``sharing`` ranks, one CPU kept for the rank."""
    if dataset in ("digits", "synthetic"):
        return 0  # in-memory tensors: worker processes only add start-up time
    return max(1, min(8, usable_cpus() // max(1, sharing) - 1))


def usable_cpus() -> int:
    """The CPUs this process may run on (not the machine's: a job on a shared node owns fewer)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 2


def make_loaders(train_raw: Dataset, val_raw: Dataset, train_tf: Transform | None,
                 eval_tf: Transform | None, *, batch_size: int, workers: int, seed: int,
                 rank: int, world_size: int, pin_memory: bool, device_augment: DeviceAugment | None = None,
                 device: torch.device | None = None) -> Loaders:
    """Training batches (sharded, shuffled, drop_last) and the evaluation loader (sharded, exact).

    With ``device_augment``: an in-memory split is moved to ``device`` once and batched there
    (``train_tf`` unused); any other split goes through workers running ``train_tf`` (the
    per-sample half, e.g. decode and crop), finished on the device.
    """
    sampler = ResumableDistributedSampler(train_raw, world_size, rank, seed)
    tensors = in_memory_tensors(train_raw) if device_augment is not None else None
    val = None
    if tensors is not None:
        images, targets = (t.to(device) for t in tensors)
        train = DeviceBatches(fit_for_pad_crop(images, device_augment.augment), targets, sampler, batch_size,
                              device_augment)
        val_images, val_targets = (t.to(device) for t in in_memory_tensors(val_raw))
        val = device_eval_batches(val_images, val_targets, device_augment.augment, rank=rank, world_size=world_size,
                                  batch_size=EVAL_BATCH_FACTOR * batch_size)
    else:
        train_set = SeededTransform(train_raw, train_tf, seed, with_key=device_augment is not None)
        # drop_last: every micro-batch has batch_size samples, so the 1/window loss scale is exact.
        train = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True,
                           num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
                           generator=_private_generator())
        if device_augment is not None:
            train = DeviceFinish(train, device_augment, device)
    if val is None:
        val = eval_loader(val_raw, eval_tf, batch_size=EVAL_BATCH_FACTOR * batch_size, workers=workers, rank=rank,
                          world_size=world_size, pin_memory=pin_memory)
    require_a_batch(len(train), len(train_raw), world_size, batch_size)  # type: ignore[arg-type]
    if rank == 0:
        log.info("data: %s", f"the training split held on {device}, batches made there" + (
            f" (--workers {workers} unused)" if workers else "") if tensors is not None else
            f"{workers} DataLoader worker process(es) per rank")
    return Loaders(train, val, sampler, train_raw, num_classes_of(train_raw), device_augment is not None)


def require_a_batch(batches: int, samples: int, world_size: int, batch_size: int) -> int:
    """``batches``, the training micro-batches per rank in an epoch; bad input when there are none."""
    if batches == 0:
        raise UsageError(f"the training split has {samples} samples: too few for {world_size} rank(s) x batch "
                         f"{batch_size}; lower --batch-size")
    return batches


def device_eval_batches(images: torch.Tensor, targets: torch.Tensor, augment: BatchAugment, *, rank: int,
                        world_size: int, batch_size: int, subset: torch.Tensor | None = None
                        ) -> DeviceEvalBatches | None:
    """Evaluation batches of in-memory ``images`` (N x C x H x W, on the training device) made
    there, when they have the network's input size; else None (the per-sample evaluation
    transform resizes them)."""
    if tuple(images.shape[-2:]) != (augment.out_size, augment.out_size):
        return None
    return DeviceEvalBatches(images, targets, rank=rank, world_size=world_size, batch_size=batch_size,
                             mean=augment.recipe.mean, std=augment.recipe.std, subset=subset)


def bank_batches(bank: Dataset, transform: Transform | None, loaders: Loaders, *, batch_size: int, workers: int,
                 rank: int, world_size: int, pin_memory: bool) -> DeviceEvalBatches | DataLoader:
    """The kNN memory bank's batches: the training split (or a Subset of it) as evaluated, from
    the images the training batches already hold on the device where they do."""
    train = loaders.train
    # A device-batched validation split means the stored images have the network's size, so the
    # training tensor on the device is as stored too (not resized by fit_for_pad_crop).
    if isinstance(train, DeviceBatches) and isinstance(loaders.val, DeviceEvalBatches):
        subset = torch.as_tensor(list(bank.indices)) if isinstance(bank, Subset) else None
        batches = device_eval_batches(train.images, train.targets, train.augment.augment, rank=rank,
                                      world_size=world_size, batch_size=EVAL_BATCH_FACTOR * batch_size, subset=subset)
        if batches is not None:
            return batches
    return eval_loader(bank, transform, batch_size=EVAL_BATCH_FACTOR * batch_size, workers=workers, rank=rank,
                       world_size=world_size, pin_memory=pin_memory)


def fit_for_pad_crop(images: torch.Tensor, augment: BatchAugment, chunk: int = 1024) -> torch.Tensor:
    """A pad-and-crop view keeps the input's size: resize the stored images once to the output
    size (as the per-sample pipeline's Resize does before its RandomCrop), ``chunk`` images at a
    time, so the float copy of a whole split (CIFAR-10 at 224 px: 30 GB) never exists at once."""
    size = augment.out_size
    if not augment.recipe.pad_crop or images.shape[-1] == size:
        return images
    out = images.new_empty((len(images), images.shape[1], size, size))
    for start in range(0, len(images), chunk):
        part = F.interpolate(images[start:start + chunk].float(), size=(size, size), mode="bilinear",
                             antialias=True, align_corners=False)
        out[start:start + chunk] = part.round().clamp(0, 255) if images.dtype == torch.uint8 else part
    return out


def _private_generator() -> torch.Generator:
    """Each DataLoader iterator draws its workers' base seed from this generator instead of the
    global RNG, whose position a resumed run would otherwise shift."""
    return torch.Generator().manual_seed(0)


def eval_loader(raw: Dataset, transform: Transform | None, *, batch_size: int, workers: int,
                rank: int, world_size: int, pin_memory: bool) -> DataLoader:
    """Sharded, in order, every sample exactly once over all ranks. Its workers are started for
    each pass and leave after it: only the training loader keeps a resident pool."""
    data = SeededTransform(raw, transform, seed=0)
    return DataLoader(data, batch_size=batch_size, sampler=ShardedEvalSampler(data, world_size, rank),
                      num_workers=workers, pin_memory=pin_memory, persistent_workers=False,
                      generator=_private_generator())


def steps_per_epoch(batches_per_epoch: int, accum_steps: int) -> int:
    """Optimizer steps in one epoch, counting a shorter final window as a step."""
    return math.ceil(batches_per_epoch / accum_steps)


def bank_subset(train_dataset: Dataset, n: int, seed: int) -> Subset:
    """A fixed subset of ``n`` samples (all of them when ``n >= len``), indices in increasing
    order, for a cheaper kNN bank: a function of (len, n, seed) alone, so the same on every rank,
    at any world size and across resumes. A larger ``n`` with the same seed gives a superset."""
    size = len(train_dataset)  # type: ignore[arg-type]
    if n < 0:
        raise ValueError(f"bank_subset: n must be >= 0, got {n}")
    if n >= size:
        return Subset(train_dataset, list(range(size)))
    scores = hashing.ranking(hashing.key(seed), torch.arange(size))
    chosen = torch.argsort(scores, stable=True)[:n].sort().values
    return Subset(train_dataset, chosen.tolist())
