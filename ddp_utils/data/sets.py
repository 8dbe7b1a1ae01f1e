"""The data sets: scikit-learn's digits (no download), CIFAR-10, ImageFolder
(``image_files.ImageFiles``) and synthetic noise, loaded raw (no transform); a run's raw splits
and their fixed subsets (``--debug``, MoCo's kNN bank); in-memory splits as tensors; and the
checks that name what is wrong with a data location."""
from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from .. import hashing
from ..config import UsageError
from ..runtime.logs import masked
from .image_files import FolderListing, ImageFiles, ShardFiles, underlying
from .object_store import check_address, is_object_store
from .shard_cache import NodeCache
from .shards import INDEX as SHARD_INDEX
from .shards import ShardIndex

DATASETS = ("digits", "cifar10", "imagefolder", "shards", "synthetic")
IMAGE_FILES = ("imagefolder", "shards")  # read as image files: an ImageFolder, or its shards (write_shards.py)
FROM_FILES = ("cifar10", *IMAGE_FILES)  # decoded from PIL images; the others are float tensors
NATIVE_SIZE = {"digits": 32, "cifar10": 32, "imagefolder": 224, "shards": 224, "synthetic": 32}
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# load_digits pixels are 0..16 on a black background; measured on the 32 px train split.
DIGITS_MEAN, DIGITS_STD = (0.2093,) * 3, (0.3542,) * 3
# mean, std per data set (synthetic noise is already zero-mean, unit-variance: none)
NORMALIZATION = {"digits": (DIGITS_MEAN, DIGITS_STD), "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
                 "imagefolder": (IMAGENET_MEAN, IMAGENET_STD), "shards": (IMAGENET_MEAN, IMAGENET_STD)}
# The MoCo authors' CIFAR-10 demo normalises with another std (from a widely copied snippet).
CIFAR10_DEMO_STD = (0.2023, 0.1994, 0.2010)
NORMALIZATIONS = ("auto", "cifar10-demo")  # looked up by recipes.eval_recipe
DIGITS_SPLIT_SEED = 20240  # the train/val split never moves with --seed
DIGITS_VAL_FRACTION = 0.2
DEBUG_TRAIN_SAMPLES, DEBUG_VAL_SAMPLES = 256, 128


def image_size_for(dataset: str, asked: int) -> int:
    """px of the evaluation views' side: ``--image-size`` as asked, 0 = the data set's native size."""
    return asked or NATIVE_SIZE[dataset]


# ----------------------------------------------------------------------------- data sets
class DigitsDataset(Dataset):
    """scikit-learn's 1,797 handwritten 8x8 digits, upsampled to ``size`` px RGB in [0, 1].

    Real images that ship inside scikit-learn, so tests and the quick start need no network.
    """

    def __init__(self, train: bool, size: int = 32):
        pixels, targets = digits_arrays()
        images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
        labels = torch.tensor(targets, dtype=torch.long)
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


@functools.lru_cache(maxsize=1)
def digits_arrays():
    """(images N x 8 x 8 float64 in 0..16, labels N): the digits scikit-learn ships, as its
    ``load_digits`` reads them, from its own file; importing sklearn itself would cost a
    process about 1.5 s (its loader is the fallback where the file is elsewhere)."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path) as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


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


# ----------------------------------------------------------------------------- loading
def check_data_dir(dataset: str, data_dir: str, download: bool, named: str = "--data-dir") -> str | None:
    """A one-line description of what is wrong with the data location (``named``: how the
    command that asks calls it), or None if it is usable. An object store's address is checked
    as written; its contents are checked when the job reads its index (``train.preflight``)."""
    if is_object_store(data_dir):
        if dataset != "shards":
            return (f"{named} {masked(data_dir)}: an object store holds shards only; write them with write_shards.py, "
                    f"copy them there and add --dataset shards")
        return check_address(data_dir, named)
    root = Path(data_dir)
    if dataset == "imagefolder":
        for split in ("train", "val"):
            if not (root / split).is_dir():
                return (f"{named} {data_dir}: no '{split}/' folder; ImageFolder expects "
                        f"DIR/train/CLASS/*.jpg and DIR/val/CLASS/*.jpg")
    if dataset == "shards":
        for split in ("train", "val"):
            if not (root / split / SHARD_INDEX).is_file():
                return (f"{named} {data_dir}: no '{split}/{SHARD_INDEX}'; write the shards first: "
                        f"python write_shards.py IMAGEFOLDER {data_dir}")
    if dataset == "cifar10" and not download and not (root / "cifar-10-batches-py").is_dir():
        return (f"{named} {data_dir}: CIFAR-10 not found (no cifar-10-batches-py/); "
                f"add --download or point --data-dir at an existing copy")
    return None


def download_cifar10(data_dir: str) -> None:
    """Fetch and verify both CIFAR-10 splits into ``data_dir`` (done by one process per node)."""
    from torchvision import datasets

    try:
        for train in (True, False):
            datasets.CIFAR10(data_dir, train=train, download=True)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; a bad checksum a RuntimeError
        raise UsageError(f"--download: CIFAR-10 could not be fetched into {data_dir} ({err}); check the "
                         f"network, or copy cifar-10-batches-py/ there and drop --download") from None


def load_split(dataset: str, data_dir: str, train: bool, size: int, synthetic_samples: int = 2048,
               listing: FolderListing | ShardIndex | None = None, shard_cache: NodeCache | None = None) -> Dataset:
    """The raw split (no transform): tensors for digits/synthetic, PIL images otherwise (RGB;
    ImageFolder's files as :class:`ImageFiles` reads them, its shards as :class:`ShardFiles` does,
    from ``listing`` when the job listed or read the split already, else here; shards from an
    object store kept in ``shard_cache``). CIFAR-10 must already be on disk (see
    :func:`download_cifar10`)."""
    if dataset == "digits":
        return DigitsDataset(train, size)
    if dataset == "synthetic":
        n = synthetic_samples if train else max(1, synthetic_samples // 4)
        return SyntheticImages(n, size, seed=0 if train else 1)
    if dataset == "cifar10":
        from torchvision import datasets  # here: importing torchvision costs a process about 2 s

        try:
            return datasets.CIFAR10(data_dir, train=train, download=False)
        except RuntimeError as err:  # torchvision's md5 check: a missing, truncated or foreign file
            raise UsageError(f"--data-dir {data_dir}: cifar-10-batches-py/ is incomplete or damaged ({err}); "
                             f"delete it and run once with --download") from None
    if dataset in IMAGE_FILES:
        listing = listing or list_image_files(dataset, data_dir, train)
        return ImageFiles(listing) if dataset == "imagefolder" else ShardFiles(listing, shard_cache)
    raise ValueError(f"unknown dataset {dataset!r}")


def list_image_files(dataset: str, data_dir: str, train: bool, patience: float = 0.0) -> FolderListing | ShardIndex:
    """The split's list of image files: an image folder's listing, or its shards' index (an
    object store's transient fault waited out for ``patience`` seconds)."""
    if dataset == "imagefolder":
        return list_image_split(data_dir, train)
    return read_shard_split(data_dir, train, patience)


def list_image_split(data_dir: str, train: bool) -> FolderListing:
    """``DIR/train`` or ``DIR/val`` of an image folder, listed; bad input for a class folder
    without images."""
    split = "train" if train else "val"
    try:
        return FolderListing.of(os.path.join(data_dir, split))
    except FileNotFoundError as err:  # a class folder without images, or no class folder at all
        raise UsageError(f"--data-dir {data_dir}: {split}/: {str(err).split('. ')[0]}; every class "
                         f"folder needs at least one image") from None


def read_shard_split(data_dir: str, train: bool, patience: float = 0.0) -> ShardIndex:
    """``DIR/train`` or ``DIR/val`` as ``write_shards.py`` wrote it, its shards checked (bad input
    for a missing or truncated shard, or an index of another format)."""
    return ShardIndex.read(f"{data_dir.rstrip('/')}/{'train' if train else 'val'}", patience)


def load_raw_splits(dataset: str, data_dir: str, image_size: int, synthetic_samples: int = 2048,
                    debug: bool = False, listings: tuple | None = None, shard_cache: NodeCache | None = None
                    ) -> tuple[Dataset, Dataset]:
    """Train and val splits without transforms (CIFAR-10 must be on disk already; image files
    from ``listings``, train's and val's, when the job listed or read them already:
    ``FolderListing`` or ``ShardIndex``); the same class folders in both, else bad input."""
    train_listing, val_listing = listings or (None, None)
    train = load_split(dataset, data_dir, True, image_size, synthetic_samples, train_listing, shard_cache)
    val = load_split(dataset, data_dir, False, image_size, synthetic_samples, val_listing, shard_cache)
    if num_classes_of(train) != num_classes_of(val):
        raise UsageError(f"--data-dir {data_dir}: train/ has {num_classes_of(train)} classes but val/ "
                         f"has {num_classes_of(val)}; both need the same class folders")
    if debug:
        return debug_subset(train, DEBUG_TRAIN_SAMPLES), debug_subset(val, DEBUG_VAL_SAMPLES)
    return train, val


def num_classes_of(ds: Dataset) -> int:
    return len(underlying(ds).classes)  # type: ignore[attr-defined]


def in_memory_tensors(ds: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(images N x C x H x W, targets N) of a data set that fits in memory as tensors: digits
    (float, 1 channel), CIFAR-10 (uint8), synthetic (float, generated once), or a Subset of one;
    None for data read from files (ImageFolder)."""
    if isinstance(ds, Subset):
        if isinstance(ds.dataset, SyntheticImages):  # generated per index: only the chosen ones
            return _generate(ds.dataset, ds.indices)
        whole = in_memory_tensors(ds.dataset)
        if whole is None:
            return None
        index = torch.as_tensor(list(ds.indices), dtype=torch.long)
        return whole[0][index], whole[1][index]
    if isinstance(ds, DigitsDataset):
        return ds.images, ds.targets
    cifar = sys.modules.get("torchvision.datasets.cifar")  # loaded by load_split for CIFAR-10, else not at all
    if cifar is not None and isinstance(ds, cifar.CIFAR10):
        return torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets)  # uint8
    if isinstance(ds, SyntheticImages):
        return _generate(ds, range(len(ds)))
    return None


def _generate(ds: SyntheticImages, indices) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [ds[i] for i in indices]
    return torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples])


def debug_subset(ds: Dataset, n: int) -> Dataset:
    return Subset(ds, range(min(n, len(ds))))  # type: ignore[arg-type]


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
