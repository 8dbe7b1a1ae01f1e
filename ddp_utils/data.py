"""Data sets, transforms, samplers and loaders shared by both training scripts.

Randomness: data order comes from ``DistributedSampler`` (seed + epoch, identical on every rank,
then sharded); augmentation is seeded per sample from (seed, epoch, sample index), so each rank
draws its own stream for its own samples and a resumed or re-sharded run applies exactly the same
crops and flips as an uninterrupted one.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sized

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset
from torchvision import datasets
from torchvision.transforms import v2 as T

from .config import UsageError

DATASETS = ("digits", "cifar10", "imagefolder", "synthetic")
NATIVE_SIZE = {"digits": 32, "cifar10": 32, "imagefolder": 224, "synthetic": 32}
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# load_digits pixels are 0..16 on a black background; measured on the 32 px train split.
DIGITS_MEAN, DIGITS_STD = (0.2093,) * 3, (0.3542,) * 3
DIGITS_SPLIT_SEED = 20240  # the train/val split never moves with --seed
DIGITS_VAL_FRACTION = 0.2
DEBUG_TRAIN_SAMPLES, DEBUG_VAL_SAMPLES = 256, 128

Transform = Callable[[torch.Tensor], object]


# ----------------------------------------------------------------------------- data sets
class DigitsDataset(Dataset):
    """scikit-learn's 1,797 handwritten 8x8 digits, upsampled to ``size`` px RGB in [0, 1].

    Real images that ship inside scikit-learn, so tests and the quick start need no network.
    """

    def __init__(self, train: bool, size: int = 32):
        from sklearn.datasets import load_digits  # imported here: only this data set needs it

        bunch = load_digits()
        images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
        labels = torch.tensor(bunch.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
        n_val = round(len(labels) * DIGITS_VAL_FRACTION)
        keep = order[n_val:] if train else order[:n_val]
        self.images = F.interpolate(images[keep], size=(size, size), mode="bilinear",
                                    align_corners=False).clamp_(0, 1)  # N x 1 x S x S
        self.targets = labels[keep]
        self.classes = [str(d) for d in range(10)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index].expand(3, -1, -1), int(self.targets[index])


class SyntheticImages(Dataset):
    """Gaussian-noise images with random labels, generated per index (no memory, no files)."""

    def __init__(self, num_samples: int, size: int, num_classes: int = 10, seed: int = 0):
        self.num_samples, self.size, self.num_classes, self.seed = num_samples, size, num_classes, seed
        self.classes = [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.size, self.size, generator=g)
        return image, int(torch.randint(self.num_classes, (), generator=g))


class SeededTransform(Dataset):
    """Applies ``transform`` to ``base[i]`` with the RNG seeded from (seed, epoch, i).

    The global RNG of the calling process is saved and restored around the transform, so a
    loader without workers does not disturb the training process's own random stream.
    """

    def __init__(self, base: Dataset, transform: Transform | None, seed: int):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # read by workers, which are re-created every epoch

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        image, target = self.base[index]
        if self.transform is None:
            return image, target
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hash((self.seed, self.epoch, index)) & 0x7FFF_FFFF_FFFF_FFFF)
            return self.transform(image), target


# ----------------------------------------------------------------------------- transforms
def _normalize(dataset: str) -> list:
    if dataset == "synthetic":
        return []  # already zero-mean unit-variance noise
    mean, std = {"digits": (DIGITS_MEAN, DIGITS_STD), "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
                 "imagefolder": (IMAGENET_MEAN, IMAGENET_STD)}[dataset]
    return [T.Normalize(mean, std)]


def classification_transforms(dataset: str, size: int, augment: bool) -> tuple[Transform, Transform]:
    """(train, eval) transforms; with ``augment=False`` the train pipeline is deterministic."""
    if dataset == "imagefolder":
        eval_geometry = [T.Resize(round(size * 256 / 224), antialias=True), T.CenterCrop(size)]
        train_geometry = [T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]
    else:  # 32 px data; digits and synthetic are already generated at `size`
        eval_geometry = [T.Resize(size, antialias=True)] if dataset == "cifar10" and size != 32 else []
        # Mirroring a digit changes its meaning (a mirrored 3 is no 3), so digits are only shifted.
        flip = [] if dataset == "digits" else [T.RandomHorizontalFlip()]
        train_geometry = eval_geometry + [T.RandomCrop(size, padding=max(1, size // 8))] + flip
    decode = [T.ToImage()] if dataset in ("cifar10", "imagefolder") else []  # PIL -> uint8 tensor
    finish = ([T.ToDtype(torch.float32, scale=True)] if decode else []) + _normalize(dataset)
    finish.append(T.ToPureTensor())
    train_tf = T.Compose(decode + (train_geometry if augment else eval_geometry) + finish)
    eval_tf = T.Compose(decode + eval_geometry + finish)
    return train_tf, eval_tf


# ----------------------------------------------------------------------------- loading
def check_data_dir(dataset: str, data_dir: str, download: bool) -> str | None:
    """A one-line description of what is wrong with the data location, or None if it is usable."""
    root = Path(data_dir)
    if dataset == "imagefolder":
        for split in ("train", "val"):
            if not (root / split).is_dir():
                return (f"--data-dir {data_dir}: no '{split}/' folder; ImageFolder expects "
                        f"DIR/train/CLASS/*.jpg and DIR/val/CLASS/*.jpg")
    if dataset == "cifar10" and not download and not (root / "cifar-10-batches-py").is_dir():
        return (f"--data-dir {data_dir}: CIFAR-10 not found (no cifar-10-batches-py/); "
                f"add --download or point --data-dir at an existing copy")
    return None


def download_cifar10(data_dir: str) -> None:
    """Fetch and verify both CIFAR-10 splits into ``data_dir`` (done by one process per node)."""
    try:
        for train in (True, False):
            datasets.CIFAR10(data_dir, train=train, download=True)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; a bad checksum a RuntimeError
        raise UsageError(f"--download: CIFAR-10 could not be fetched into {data_dir} ({err}); check the "
                         f"network, or copy cifar-10-batches-py/ there and drop --download") from None


def load_split(dataset: str, data_dir: str, train: bool, size: int, synthetic_samples: int = 2048) -> Dataset:
    """The raw split (no transform): tensors for digits/synthetic, PIL images otherwise.
    CIFAR-10 must already be on disk (see :func:`download_cifar10`)."""
    if dataset == "digits":
        return DigitsDataset(train, size)
    if dataset == "synthetic":
        n = synthetic_samples if train else max(1, synthetic_samples // 4)
        return SyntheticImages(n, size, seed=0 if train else 1)
    if dataset == "cifar10":
        return datasets.CIFAR10(data_dir, train=train, download=False)
    if dataset == "imagefolder":
        split = "train" if train else "val"
        try:
            return datasets.ImageFolder(os.path.join(data_dir, split))
        except FileNotFoundError as err:  # a class folder without images, or no class folder at all
            raise UsageError(f"--data-dir {data_dir}: {split}/: {str(err).split('. ')[0]}; every class "
                             f"folder needs at least one image") from None
    raise ValueError(f"unknown dataset {dataset!r}")


def num_classes_of(ds: Dataset) -> int:
    while isinstance(ds, (Subset, SeededTransform)):
        ds = ds.dataset if isinstance(ds, Subset) else ds.base
    return len(ds.classes)  # type: ignore[attr-defined]


def debug_subset(ds: Dataset, n: int) -> Dataset:
    return Subset(ds, range(min(n, len(ds))))  # type: ignore[arg-type]


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

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

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
    train: DataLoader
    val: DataLoader
    train_sampler: ResumableDistributedSampler
    train_set: SeededTransform
    num_classes: int

    @property
    def batches_per_epoch(self) -> int:
        """Training micro-batches in a whole epoch (``len(train)`` shrinks while resuming)."""
        return self.train_sampler.num_samples // self.train.batch_size

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Reshuffle for ``epoch`` and reseed augmentation; skip batches a checkpoint consumed."""
        self.train_sampler.set_epoch(epoch, skip=skip_batches * self.train.batch_size)
        self.train_set.set_epoch(epoch)


def default_workers(dataset: str, local_world_size: int) -> int:
    if dataset in ("digits", "synthetic"):
        return 0  # in-memory tensors: worker processes only add start-up time
    return max(1, min(8, (os.cpu_count() or 2) // max(1, local_world_size) - 1))


def make_loaders(train_raw: Dataset, val_raw: Dataset, train_tf: Transform | None,
                 eval_tf: Transform | None, *, batch_size: int, workers: int, seed: int,
                 rank: int, world_size: int, pin_memory: bool) -> Loaders:
    """Training loader (sharded, shuffled, drop_last) and evaluation loader (sharded, exact)."""
    train_set = SeededTransform(train_raw, train_tf, seed)
    sampler = ResumableDistributedSampler(train_set, world_size, rank, seed)
    # drop_last: every micro-batch has batch_size samples, so the 1/window loss scale is exact.
    train = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True,
                       num_workers=workers, pin_memory=pin_memory, generator=_private_generator())
    val = eval_loader(val_raw, eval_tf, batch_size=batch_size, workers=workers, rank=rank,
                      world_size=world_size, pin_memory=pin_memory)
    if len(train) == 0:
        raise UsageError(f"the training split has {len(train_raw)} samples: too few for "  # type: ignore[arg-type]
                         f"{world_size} rank(s) x batch {batch_size}; lower --batch-size")
    return Loaders(train, val, sampler, train_set, num_classes_of(train_raw))


def _private_generator() -> torch.Generator:
    """Each new DataLoader iterator draws a worker base seed from its generator. Without one of
    its own it would draw from the global RNG, and a resumed run (which starts an iterator at a
    different point of that stream) would draw different shuffle-BN permutations afterwards.
    Augmentation does not depend on it: SeededTransform seeds every sample itself."""
    return torch.Generator().manual_seed(0)


def eval_loader(raw: Dataset, transform: Transform | None, *, batch_size: int, workers: int,
                rank: int, world_size: int, pin_memory: bool) -> DataLoader:
    """Sharded, in order, every sample exactly once over all ranks."""
    data = SeededTransform(raw, transform, seed=0)
    return DataLoader(data, batch_size=batch_size, sampler=ShardedEvalSampler(data, world_size, rank),
                      num_workers=workers, pin_memory=pin_memory, generator=_private_generator())


def steps_per_epoch(batches_per_epoch: int, accum_steps: int) -> int:
    """Optimizer steps in one epoch, counting a shorter final window as a step."""
    return math.ceil(batches_per_epoch / accum_steps)
