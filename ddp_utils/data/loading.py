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
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sized

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, default_collate

from .. import hashing
from ..config import UsageError
from ..runtime.dist import memory_format
from .batch_augment import (
    VIEW_COLUMNS,
    BatchAugment,
    as_float_rgb,
    atlas_as_float,
    draws,
    normalize,
    to_device,
)
from .decode import EncodedBatch, decode_on
from .image_files import CheckedBatches, UnreadableFiles, image_files_of, sample_path, why_unreadable
from .packed import PackedImages, pack, pack_to_share

Transform = Callable[[torch.Tensor], object]
log = logging.getLogger("train")
EVAL_BATCH_FACTOR = 4  # evaluation batches are this many training micro-batches: no activations kept
EVAL_MAX_IMAGES = 256  # images per evaluation batch of image files, at most (or one training batch)
TRAIN_PREFETCH = 2     # batches each training worker prepares ahead (DataLoader's prefetch_factor)
EVAL_PREFETCH = 1      # batches each evaluation worker prepares ahead: the larger batches (host_memory)
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
                # the CPU generator alone (the transforms' own): torch.manual_seed would also queue
                # a seed for every CUDA device, which costs a millisecond per sample
                torch.default_generator.manual_seed(hashing.seed(self.seed, epoch, index))
                image = self.transform(image)
        return (image, target, epoch, index) if self.with_key else (image, target)


class DeviceAugment:
    """The batched augmentation of ``views`` views for (seed, epoch, indices), on the device;
    ``index`` is on the host, where every view's uniforms are drawn (:mod:`batch_augment`).

    ``images`` is one batch (every view is drawn from it) or, when DataLoader workers already
    cropped each view, a tuple with one batch per view.
    """

    def __init__(self, augment: BatchAugment, seed: int, views: int = 1):
        self.augment, self.seed, self.views = augment, seed, views
        self._atlas = torch.empty(0)  # kept between batches: see packed()

    def __call__(self, images, epoch: int, index: torch.Tensor):
        u = draws(self.seed, epoch, index, self.views)  # every view's uniforms in one call
        first = images[0] if isinstance(images, (tuple, list)) else images
        layout = memory_format(first.device)  # the network's: no re-lay afterwards
        if self.views == 1:
            return self.augment.apply(images, u, layout)
        sources = images if isinstance(images, (tuple, list)) else [images] * self.views
        return tuple(self.augment.apply(x, u[:, v * VIEW_COLUMNS:(v + 1) * VIEW_COLUMNS], layout)
                     for v, x in enumerate(sources))

    def packed(self, atlas: torch.Tensor, places: torch.Tensor, epoch: int, index: torch.Tensor):
        """The views of images of different sizes packed in one atlas (H x W x 3 uint8, on the
        device; ``places`` B x 4, on the host): each cropped from its place
        (``BatchAugment.apply_packed``).

        The atlas is made float in one buffer kept for the next batch (on the CPU a fresh one
        would cost a page fault per 4 KiB; on CUDA it is what the caching allocator would keep
        for it): 12 bytes per atlas pixel, the largest atlas of the run."""
        u = draws(self.seed, epoch, index, self.views)
        layout = memory_format(atlas.device)
        if self._atlas.device != atlas.device or self._atlas.numel() < atlas.numel():
            self._atlas = torch.empty(0)  # the old one freed first
            self._atlas = atlas.new_empty(atlas.numel(), dtype=torch.float32)
        x = atlas_as_float(atlas, out=self._atlas)  # 1 x 3 x H x W, made once for every view
        views = [self.augment.apply_packed(x, places, u[:, v * VIEW_COLUMNS:(v + 1) * VIEW_COLUMNS], layout)
                 for v in range(self.views)]
        return views[0] if self.views == 1 else tuple(views)


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
            index = torch.tensor([i for _, i in chunk])  # B, on the host: the augmentation draws there
            on_device = to_device(index, self.images.device)
            yield self.augment(self.images[on_device], chunk[0][0], index), self.targets[on_device]


def collate_files(samples: list) -> list:
    """A batch of image files for the device path, from (image, target, epoch, index) samples:
    decoded images (3 x h x w uint8, each its own size) packed here, in the worker
    (:class:`packed.PackedImages`, its atlas in a buffer the worker reuses); a batch that holds
    encoded ones (1-D bytes: ``--decode-on device``) joined into one :class:`decode.EncodedBatch`."""
    images = [sample[0] for sample in samples]
    rest = default_collate([sample[1:] for sample in samples])  # targets, epochs, index
    return [EncodedBatch.join(images) if any(image.dim() == 1 for image in images) else pack_to_share(images), *rest]


class DeviceFinish:
    """Finishes on the device what DataLoader workers started: ImageFolder's workers decode
    each image (or only read its bytes, decoded here as a batch: ``--decode-on device``) and
    pack the batch (:mod:`packed`); here every view is cropped, resized, coloured, blurred,
    flipped and normalised as a batch, keyed by (seed, epoch, index). With an evaluation
    augmentation (no crop in its recipe) it makes the evaluation view. A file decoded here that
    cannot be decoded becomes a worker's placeholder and goes into ``unreadable``, named by its
    path in ``files`` (the loader's raw data set), as :class:`image_files.CheckedBatches` records
    a worker's."""

    def __init__(self, loader: DataLoader | CheckedBatches, augment: DeviceAugment, device: torch.device,
                 files: Dataset, unreadable: UnreadableFiles):
        self.loader, self.augment, self.device = loader, augment, device
        self.files, self.unreadable = files, unreadable
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> OneAhead:
        return OneAhead(self._batches())

    def _batches(self):
        for batch in self.loader:
            yield self.finish(batch)

    def finish(self, batch: list) -> tuple:
        """(views, targets) of one collated batch (:func:`collate_files`)."""
        images, targets, epochs, index = batch
        if isinstance(images, EncodedBatch):  # decoded and packed on the device
            with record_function("device_finish/decode"):
                decoded, failed = decode_on(self.device, images)
                self.unreadable.found += [why_unreadable(sample_path(self.files, int(index[i]))) for i in failed]
                atlas, places = pack(decoded)
        else:
            atlas, places = images.atlas, images.places
            with record_function("device_finish/copy"):
                atlas = atlas.to(self.device, non_blocking=True)
        views = self.augment.packed(atlas, places, int(epochs[0]), index)
        if isinstance(images, PackedImages):
            images.release()  # copied out (or pinned already): its worker may fill the buffer again
        return views, targets


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
    train: DataLoader | CheckedBatches | DeviceBatches | DeviceFinish
    val: DataLoader | CheckedBatches | DeviceEvalBatches | DeviceFinish
    train_sampler: ResumableDistributedSampler
    train_set: Dataset   # the raw training split
    num_classes: int
    on_device: bool = False  # augmentation runs on the training device
    unreadable: UnreadableFiles = field(default_factory=UnreadableFiles)  # files this rank could not decode
    bank: DataLoader | CheckedBatches | DeviceEvalBatches | DeviceFinish | None = None  # MoCo's kNN bank

    @property
    def batches_per_epoch(self) -> int:
        """Training micro-batches in a whole epoch (``len(train)`` shrinks while resuming)."""
        return self.train_sampler.num_samples // self.train.batch_size

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Reshuffle for ``epoch`` (augmentation follows: the epoch travels with each index);
        skip the batches a checkpoint consumed."""
        self.train_sampler.set_epoch(epoch, skip=skip_batches * self.train.batch_size)


def checked(loader: DataLoader, raw: Dataset, unreadable: UnreadableFiles) -> DataLoader | CheckedBatches:
    """``loader`` of image files with its unreadable files recorded in ``unreadable``; other
    data as it is."""
    files = image_files_of(raw)
    return loader if files is None else CheckedBatches(loader, files, unreadable)


def eval_batch_size(batch_size: int, image_files: bool) -> int:
    """Evaluation (and kNN-bank) batch size for a training micro-batch of ``batch_size``:
    ``EVAL_BATCH_FACTOR`` times it, capped for image files, whose batches go through shared memory."""
    if not image_files:
        return EVAL_BATCH_FACTOR * batch_size
    return min(EVAL_BATCH_FACTOR * batch_size, max(batch_size, EVAL_MAX_IMAGES))


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


def private_generator() -> torch.Generator:
    """Each DataLoader iterator draws its workers' base seed from this generator instead of the
    global RNG, whose position a resumed run would otherwise shift."""
    return torch.Generator().manual_seed(0)


def eval_loader(raw: Dataset, transform: Transform | None, *, batch_size: int, workers: int,
                rank: int, world_size: int, pin_memory: bool, unreadable: UnreadableFiles | None = None
                ) -> DataLoader | CheckedBatches:
    """Sharded, in order, every sample exactly once over all ranks. Its workers are started for
    each pass and leave after it: only the training loader keeps a resident pool. Image files
    it cannot decode go into ``unreadable``."""
    data = SeededTransform(raw, transform, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=ShardedEvalSampler(data, world_size, rank),
                        num_workers=workers, pin_memory=pin_memory, persistent_workers=False,
                        prefetch_factor=EVAL_PREFETCH if workers else None, generator=private_generator())
    return checked(loader, raw, UnreadableFiles() if unreadable is None else unreadable)


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
