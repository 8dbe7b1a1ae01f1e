"""The one way from a run's data plan to its batches (:func:`build_data`): the training batches,
the evaluation batches and MoCo's kNN bank, each rank's share of them, on the path the plan
chooses. Both scripts build their data here; every decode and augmentation mode is wired here.

One function makes every kind of batch (:func:`_batches`: training, validation and the kNN
bank alike, the evaluation ones with ``recipes.eval_recipe``), on one of three paths:

* in-memory data (digits, CIFAR-10, synthetic) with ``aug_on_device``: the split is one tensor
  on the device, batched and augmented there as a whole (:class:`DeviceBatches`), no workers;
  an evaluation split stored at another size than the network's goes the loader path's way;
* image files with ``aug_on_device``: DataLoader workers decode each file (or, with
  ``decode_on_device``, only read its bytes) and pack the batch; in the training process a thread
  of its own crops, resizes and augments every view as a batch, ahead of the training loop (the
  opt-in module ``files_on_device``);
* the loader path (the reference): workers run torchvision's per-sample transforms
  (``transforms.view_transform``).

Randomness: data order comes from ``order`` (the samples order: one permutation shared out,
as ``DistributedSampler``'s; or, for shards, the shards order, in which each rank reads whole
shards); augmentation is a function of (seed, epoch, sample index), so a resumed or re-sharded
run applies exactly the crops and flips of an uninterrupted one. Shards in an object store are
read through the node's cache, filled ahead by each rank's read-ahead (``shard_cache``).

Each ``iter()`` of a path's batches is a pass, ``data_stream.Batches``: on the loader path and
for in-memory data ``data_stream.LoopBatches``, for image files on the device
``files_on_device.ThreadBatches``. Passes of image files record the files a batch could not
decode in the rank's ``unreadable.UnreadableFiles`` as they hand each batch out
(``UnreadableFiles.record``).
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from .. import hashing
from ..config import UsageError
from .batch_augment import BatchAugment, DeviceAugment, pinned_to_device
from .data_stream import DataStream, LoopBatches, Made
from .host_memory import (
    EVAL_PREFETCH,
    TRAIN_PREFETCH,
    check_shared_memory,
    eval_batch_size,
    loader_memory,
    mean_image_pixels,
)
from .image_files import FolderListing, image_files_of, read_as
from .order import (
    SHUFFLE_SHARDS,
    Key,
    RepeatedAugmentationSampler,
    ResumableDistributedSampler,
    ShardAwareSampler,
    ShardedEvalSampler,
    augmentation_index,
)
from .recipes import AugmentRecipe, eval_recipe
from .sets import bank_subset, in_memory_tensors, load_raw_splits, num_classes_of
from .shard_cache import (
    NodeCache,
    ReadAhead,
    ReadAheadLoader,
    SplitShards,
    batches_asked,
    needs_of,
    shards_in_use,
)
from .shards import largest_shard
from .unreadable import UnreadableFiles

if TYPE_CHECKING:
    from .files_on_device import DecodeFallbacks, FinishOnDevice

# One kind of batch on one path; each iter() a pass (data_stream.Batches)
Passes: TypeAlias = "LoaderBatches | DeviceBatches | FinishOnDevice"
log = logging.getLogger("train")


@dataclass(frozen=True)
class StoreCache:
    """Shards read from an object store: how each node keeps them (``shard_cache``)."""

    folder: str          # the job's cache folder; each node's is below it
    gb: float            # GB of disk a node's cache may fill; 0: what its ranks' loaders and downloads need
    read_ahead: int      # shards a rank downloads beyond what its workers read, at least
    downloads: int       # downloads at once per rank, at most
    timeout: float       # s a fault of the store is waited out before the run stops (exit 75)
    keep: bool = False   # keep the node's folder when the run ends
    if_match: bool = True  # GETs carry If-Match on the listed ETag (--no-store-if-match: the answer's ETag compared)

    def node_folder(self, node: str) -> str:
        """The cache folder of node ``node`` (``launch.node_identity``)."""
        return f"{self.folder}-node{node}"

    def rank_shards(self, in_use: int) -> int:
        """Shards of a rank's share of the node's cache at ``gb`` 0: those its loaders hold at
        once (``in_use``), as many more as it reads ahead or downloads at once, whichever is
        more, and one its training process reads itself."""
        return in_use + max(self.read_ahead, self.downloads) + 1

    def node_bytes(self, largest_shard: int, ranks_on_node: int, in_use: int) -> int:
        """The most a node's cache holds: ``gb``, or (0) its ranks' shares (:meth:`rank_shards`)."""
        if self.gb:
            return int(self.gb * 1e9)
        return ranks_on_node * self.rank_shards(in_use) * largest_shard

    def too_small(self, largest_shard: int, ranks_on_node: int, in_use: int) -> str | None:
        """One line when ``gb`` leaves a rank less than the shards its loaders hold at once and
        the one its training process reads (``in_use`` + 1 of the largest shard), else None."""
        needed = ranks_on_node * (in_use + 1) * largest_shard
        if not self.gb or self.gb * 1e9 >= needed:
            return None
        return (f"--shard-cache-gb {self.gb:g}: each of the node's {ranks_on_node} rank(s) must hold {in_use + 1} of "
                f"the largest shard ({largest_shard / 1e6:,.1f} MB) at once ({in_use} its loaders' workers read, "
                f"one its training process reads), {needed / 1e9:.2f} GB for the node; raise it (0 sizes it to the "
                f"read-ahead), or lower --workers or --batch-size, or write larger shards (write_shards.py "
                f"--shard-mb: more images to a shard)")


@dataclass(frozen=True)
class DataPlan:
    """What a run's batches depend on; each script fills it from its config."""

    dataset: str
    data_dir: str
    image_size: int             # px, resolved (not 0): the evaluation views' side (and the training views' by default)
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
    order: str = "samples"           # the training order: "samples" or "shards" (``order``)
    ra_reps: int = 1                 # the samples order's repetitions of each sample an epoch (--ra-reps; 1: none)
    store: StoreCache | None = None  # shards from an object store: the node's cache
    cache_bytes: int = 0             # ... and the bytes it may fill (train.preflight sizes it)
    train_size: int = 0              # px of the training views' side (FixRes); 0: image_size
    val_resize: int = 0              # image files' evaluation view: short side resized to this, then the
    #                                  centre crop of image_size; 0: round(image_size x 256/224)
    # An image folder's train and val listings, made once for the job (train.preflight); None: listed here
    listings: tuple[FolderListing, FolderListing] | None = field(default=None, repr=False, compare=False)

    @property
    def train_image_size(self) -> int:
        """px of the training views' side."""
        return self.train_size or self.image_size


@dataclass
class Loaders:
    """A rank's batches of a run, as :func:`build_data` made them for ``plan``."""

    plan: DataPlan
    train: Passes
    val: Passes
    bank: Passes | None  # MoCo's kNN bank
    train_sampler: ResumableDistributedSampler | ShardAwareSampler
    train_set: Dataset    # the raw training split
    num_classes: int
    unreadable: UnreadableFiles = field(default_factory=UnreadableFiles)  # what this rank could not read
    read_ahead: ReadAhead | None = None  # shards from an object store: this rank's downloads
    decode_fallbacks: DecodeFallbacks | None = None  # image files on the device: what its decoder refused

    def close(self, restartable: bool = False) -> None:
        """The device path's threads stopped (:meth:`stop_making`). Shards from an object store:
        stop downloading, let this rank's holds go, and (the node's last rank, unless the plan
        keeps it or the run stopped to be started again: ``restartable``, whose next attempt keeps
        what it can use) delete the node's cache."""
        self.stop_making(self.train, self.val, self.bank)
        if self.read_ahead is not None:
            self.read_ahead.close()
            self.read_ahead.cache.leave(keep=self.plan.store.keep or restartable)

    @staticmethod
    def stop_making(*passes: Passes | None) -> None:
        """Image files finished on the device: each of ``passes``' thread stopped, the batches it
        made and did not hand out dropped, its float atlas let go (a pass that ends early, the
        run's end, which must stop the thread before the process group goes)."""
        from .files_on_device import FinishOnDevice

        for batches in passes:
            if isinstance(batches, FinishOnDevice):
                batches.close()

    @property
    def batches_per_epoch(self) -> int:
        """Training micro-batches in a whole epoch (``len(train)`` shrinks while resuming)."""
        return self.train_sampler.num_samples // self.train.batch_size

    def training_views(self, index: list[int]) -> list[torch.Tensor]:
        """The training views (each N x C x H x W) of samples ``index`` at epoch 0, made as the
        training batches make them (image files they cannot decode recorded alike)."""
        train = self.train
        if isinstance(train, DeviceBatches):
            at = torch.tensor(index, device=train.images.device)
            return _as_list(train.augment(train.images[at], 0, torch.tensor(index)))  # the draws take host indices
        samples = [train.loader.dataset[(0, i)] for i in index]  # a LoaderBatches' or FinishOnDevice's loader
        if self.plan.aug_on_device:
            from .files_on_device import collate_files

            batch = train.finish(collate_files(samples))
        else:
            batch = default_collate(samples)
        return _as_list((batch if train.record is None else train.record(batch))[0])

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Reshuffle for ``epoch`` (augmentation follows: the epoch travels with each index);
        skip the batches a checkpoint consumed."""
        self.train_sampler.set_epoch(epoch, skip=skip_batches * self.train.batch_size)


def _as_list(views) -> list[torch.Tensor]:
    return list(views) if isinstance(views, (list, tuple)) else [views]


@dataclass(frozen=True)
class _Kind:
    """What one kind of batch is: training (``train``: shuffled by the resumable sampler,
    drop_last, resident workers) or evaluation (every sample of the shard once, workers per pass)."""

    recipe: AugmentRecipe
    views: int
    seed: int
    batch_size: int
    train: bool
    size: int  # px of the views' side


def build_data(plan: DataPlan, *, rank: int, world_size: int, device: torch.device, ranks_on_node: int = 1,
               node: str = "0", fresh: bool = False) -> Loaders:
    """Every rank's batches for ``plan``: training (sharded, shuffled, drop_last; resumable),
    evaluation (sharded, each sample once) and, with ``plan.bank_samples`` set, the kNN bank.
    Bad input when ``/dev/shm`` cannot hold the workers' batches of ``ranks_on_node`` ranks.
    Shards from an object store come through the cache of node ``node``
    (``launch.node_identity``), of ``plan.cache_bytes``, shared by its ``ranks_on_node`` ranks,
    which the caller leaves with :meth:`Loaders.close`; a ``fresh`` run (no checkpoint to
    continue: its first epoch is known now) starts downloading that epoch's first shards at
    once, while it sets itself up."""
    cache = node_cache_of(plan, rank, node)
    train_raw, val_raw = raw_splits(plan, cache)
    read_ahead = None
    if cache is not None:
        largest = largest_shard(image_files_of(train_raw).index, image_files_of(val_raw).index)
        # each rank's share, less the shard its training process reads itself
        quota = cache.capacity // ranks_on_node - largest
        read_ahead = ReadAhead(cache, plan.store.read_ahead, plan.store.downloads, quota)
    check_shared_memory(plan_memory(plan, train_raw), ranks_on_node)
    unreadable = UnreadableFiles()
    held = _held_on_device(plan, train_raw, val_raw, device)
    if held and rank == 0:
        log.info("data: the training split held on %s, batches made there%s", device,
                 f" (--workers {plan.workers} unused)" if plan.workers else "")
    fallbacks = None
    if plan.aug_on_device and not held and image_files_of(train_raw) is not None:  # files_on_device's path
        from .files_on_device import DecodeFallbacks, describe_decoder

        fallbacks = DecodeFallbacks()
        if plan.decode_on_device and rank == 0:
            log.info("data: %s", describe_decoder(device))

    def batches(raw: Dataset, sampler, kind: _Kind) -> Passes:
        files = image_files_of(raw)  # image files: the placeholders of those a batch could not decode recorded
        record = None if files is None else functools.partial(unreadable.record, files=files)
        return _batches(raw, sampler, kind, plan=plan, device=device, held=held, read_ahead=read_ahead,
                        fallbacks=fallbacks, record=record)

    sampler = training_order(plan, train_raw, world_size, rank)
    if read_ahead is not None and fresh:
        shards = split_shards(train_raw)
        read_ahead.start_early(needs_of(shards.of(sampler.indices_of_epoch(0)), shards.refs))
    if plan.ra_reps > 1 and rank == 0:
        log.info("data: repeated augmentation: each sample %d times an epoch, its copies dealt to the ranks in turn; "
                 "%d samples a rank an epoch, about %d distinct images in all", plan.ra_reps, sampler.num_samples,
                 -(-sampler.num_samples * world_size // plan.ra_reps))
    train = batches(train_raw, sampler, _Kind(plan.recipe, plan.views, plan.seed, plan.batch_size, train=True,
                                              size=plan.train_image_size))
    require_a_batch(len(train), len(train_raw), world_size, plan.batch_size)
    evaluation = _Kind(eval_recipe(plan.dataset, plan.normalization, plan.val_resize, plan.recipe.interpolation), views=1, seed=0, train=False,
                       batch_size=eval_batch_size(plan.batch_size, image_files_of(train_raw) is not None),
                       size=plan.image_size)

    def eval_batches(raw: Dataset) -> Passes:  # validation and the kNN bank, on every path
        by_shard = shards_of(raw) if plan.order == "shards" else None  # the shards order: few shards a rank
        return batches(raw, ShardedEvalSampler(raw, world_size, rank, by_shard), evaluation)

    bank = None
    if plan.bank_samples is not None:
        bank = eval_batches(bank_subset(train_raw, plan.bank_samples, plan.seed) if plan.bank_samples else train_raw)
    return Loaders(plan, train, eval_batches(val_raw), bank, sampler, train_raw, num_classes_of(train_raw),
                   unreadable, read_ahead, fallbacks)


def raw_splits(plan: DataPlan, shard_cache: NodeCache | None = None) -> tuple[Dataset, Dataset]:
    """The plan's train and val splits as stored, before any transform (``--check`` reads them
    too); shards from an object store read through ``shard_cache``."""
    return load_raw_splits(plan.dataset, plan.data_dir, plan.image_size, plan.synthetic_samples, plan.debug,
                           plan.listings, shard_cache)


def training_order(plan: DataPlan, train_raw: Dataset, world_size: int, rank: int
                   ) -> ResumableDistributedSampler | ShardAwareSampler:
    """Rank ``rank``'s order of the training split, the plan's (``order``): the shards order
    (each rank reads whole shards), or one permutation of the samples shared out, each sample
    ``plan.ra_reps`` times in a row when that is above 1 (repeated augmentation)."""
    if plan.order == "shards":
        if plan.ra_reps > 1:  # the configuration refuses it first (--ra-reps with --order shards)
            raise UsageError("repeated augmentation (--ra-reps) needs the samples order; drop --order shards")
        return ShardAwareSampler(shards_of(train_raw), world_size, rank, plan.seed, plan.batch_size)
    if plan.ra_reps > 1:
        return RepeatedAugmentationSampler(train_raw, world_size, rank, plan.seed, plan.batch_size, plan.ra_reps)
    return ResumableDistributedSampler(train_raw, world_size, rank, plan.seed, plan.batch_size)


def node_cache_of(plan: DataPlan, rank: int, node: str) -> NodeCache | None:
    """Rank ``rank``'s view of the cache of shards from an object store of node ``node`` (the
    node's local rank 0 prepares it at start: ``train.preflight``); None for data on a file
    system."""
    if plan.store is None:
        return None
    if plan.cache_bytes <= 0:
        raise ValueError("a plan of shards from an object store needs cache_bytes (train.preflight sizes it)")
    return NodeCache(plan.store.node_folder(node), plan.cache_bytes, rank, plan.store.timeout, plan.store.if_match)


def rank_shards_in_use(plan: DataPlan, train_shards: np.ndarray, val_shards: np.ndarray) -> int:
    """The most shards one rank's loaders hold at once, over the run's passes
    (``shard_cache.shards_in_use``): training epochs in the shards order (windows of
    ``SHUFFLE_SHARDS``), validation and the kNN bank in shard order, each with its workers'
    prefetch and batch. ``train_shards``, ``val_shards``: each sample's shard."""
    passes = [(batches_asked(plan.workers, TRAIN_PREFETCH), plan.batch_size, train_shards, SHUFFLE_SHARDS)]
    eval_batch, eval_asked = eval_batch_size(plan.batch_size, True), batches_asked(plan.workers, EVAL_PREFETCH)
    passes.append((eval_asked, eval_batch, val_shards, 1))
    if plan.bank_samples is not None:
        bank = bank_subset(range(len(train_shards)), plan.bank_samples, plan.seed).indices  # type: ignore[arg-type]
        passes.append((eval_asked, eval_batch, train_shards[np.asarray(bank, dtype=np.int64)], 1))
    return max(_in_use(shard_of, (asked + 1) * batch, window) for asked, batch, shard_of, window in passes
               if len(shard_of))


def _in_use(shard_of: np.ndarray, asked: int, window: int) -> int:
    """``shards_in_use`` of a pass over the samples ``shard_of``: the smallest shard's count of
    them, and never more than the shards there are."""
    counts = np.bincount(shard_of)
    counts = counts[counts > 0]
    return min(shards_in_use(asked, int(counts.min()), window), len(counts))


def shards_of(raw: Dataset) -> np.ndarray:
    """Each sample's shard number, for ``raw`` (``ShardFiles`` or a Subset of it)."""
    files = image_files_of(raw)
    shard_of = files.index.shard  # type: ignore[union-attr]
    return shard_of[np.asarray(raw.indices)] if isinstance(raw, Subset) else shard_of


def split_shards(raw: Dataset) -> SplitShards:
    """Where each sample of ``raw`` (``ShardFiles`` or a Subset of it) lies, for a read-ahead."""
    return SplitShards(shards_of(raw), image_files_of(raw).index.refs())  # type: ignore[union-attr]


def _held_on_device(plan: DataPlan, train_raw: Dataset, val_raw: Dataset, device: torch.device) -> dict:
    """{split: (images N x C x H x W, targets N) on ``device``} of in-memory data augmented
    there; empty for the other paths."""
    tensors = in_memory_tensors(train_raw) if plan.aug_on_device else None
    if tensors is None:
        return {}
    return {raw: tuple(t.to(device) for t in pair) for raw, pair in ((train_raw, tensors),
                                                                    (val_raw, in_memory_tensors(val_raw)))}


def _batches(raw: Dataset, sampler: Iterable, kind: _Kind, *, plan: DataPlan, device: torch.device,
             held: dict, read_ahead: ReadAhead | None = None, fallbacks: DecodeFallbacks | None = None,
             record: Callable[[list], list] | None = None) -> Passes:
    """``kind`` of batch of ``raw`` in ``sampler``'s order, on the plan's path (see the module
    docstring); ``held``: the splits :func:`_held_on_device` put there; ``read_ahead``: the rank's,
    for shards from an object store; ``fallbacks``: the rank's count of images the device's
    decoder refused (image files on the device); ``record``: called on each batch a pass of image
    files hands out."""
    shards = split_shards(raw) if read_ahead is not None else None
    size = kind.size
    if held or plan.aug_on_device:  # the device paths' (BatchAugment refuses a per-sample-only recipe)
        augment = DeviceAugment(BatchAugment(kind.recipe, size), kind.seed, kind.views)
    if held:  # in-memory data; the kNN bank, a subset of the training split, is batched from its tensor
        subset = raw not in held
        images, targets = held[raw.dataset if subset else raw]
        order = [raw.indices[i] for i in sampler] if subset else sampler
        if kind.train:
            return DeviceBatches(padded_for_crop(images, augment.augment), targets, order, kind.batch_size, augment)
        if tuple(images.shape[-2:]) == (size, size):
            return DeviceBatches(images, targets, order, kind.batch_size, augment, drop_last=False)
        # an evaluation split stored at another size than the network's: resized per sample below
    elif plan.aug_on_device:
        from .files_on_device import FinishOnDevice, collate_files

        data = SeededTransform(read_as(raw, "encoded" if plan.decode_on_device else "decoded"), None, kind.seed,
                               with_key=True)
        loader = data_loader(data, sampler, batch_size=kind.batch_size, workers=plan.workers,
                             pin_memory=device.type == "cuda", train=kind.train, collate=collate_files,
                             read_ahead=read_ahead, shards=shards)
        return FinishOnDevice(loader, augment, device, read_as(raw, "decoded"), fallbacks, record=record)
    from .transforms import TwoCrops, view_transform

    view = view_transform(kind.recipe, plan.dataset, size)
    data = SeededTransform(raw, view if kind.views == 1 else TwoCrops(view), kind.seed)
    loader = data_loader(data, sampler, batch_size=kind.batch_size, workers=plan.workers,
                         pin_memory=device.type == "cuda", train=kind.train, read_ahead=read_ahead, shards=shards)
    return LoaderBatches(loader, record)


def data_loader(data: Dataset, sampler: Iterable, *, batch_size: int, workers: int, pin_memory: bool, train: bool,
                collate: Callable | None = None, read_ahead: ReadAhead | None = None,
                shards: SplitShards | None = None) -> DataLoader:
    """``data`` in ``sampler``'s order, ``batch_size`` samples a batch, ``collate`` (default:
    torch's) making each. Training (``train``): full batches only (every micro-batch has
    batch_size samples, so the 1/window loss scale is exact) and a resident pool of workers,
    each preparing ``TRAIN_PREFETCH`` batches ahead; evaluation: every sample, its workers
    started for each pass and gone after it, ``EVAL_PREFETCH`` batches ahead each (its batches
    are the larger). ``read_ahead``: shards from an object store (``shards``: where ``data``'s
    samples lie), whose rank's read-ahead each pass tells its order (``shard_cache.ReadAheadLoader``)."""
    prefetch = TRAIN_PREFETCH if train else EVAL_PREFETCH
    # Each iterator draws its workers' base seed from a generator of its own: from the global RNG,
    # a resumed run would shift its position.
    settings = dict(batch_size=batch_size, sampler=sampler, drop_last=train, num_workers=workers,
                    pin_memory=pin_memory, persistent_workers=train and workers > 0, collate_fn=collate,
                    prefetch_factor=prefetch if workers else None, generator=torch.Generator().manual_seed(0))
    if read_ahead is not None:
        return ReadAheadLoader(data, **settings, read_ahead=read_ahead, shards=shards)
    return DataLoader(data, **settings)


def worker_start_hazard(workers: int, version: tuple[int, ...] = tuple(sys.version_info[:3])) -> str | None:
    """A warning when this Python can deadlock a DataLoader worker as it starts, else None.

    Workers are forked from the rank, which runs threads (gloo's or NCCL's, TensorBoard's writer).
    CPython before 3.11.10 resets its interpreter head lock in the child only after taking it; a
    fork while one of those threads holds it (gloo's thread does, taking the GIL to free a
    tensor) leaves the worker stopped before its first line and the rank waiting for its batch
    for ever (CPython gh-112275, fixed in 3.11.10 and 3.12)."""
    if workers == 0 or version >= (3, 11, 10):
        return None
    return (f"Python {'.'.join(map(str, version))} can deadlock a DataLoader worker as it starts, leaving the run "
            "waiting for ever (CPython gh-112275, fixed in 3.11.10 and 3.12); use a newer Python, or --workers 0")


def require_a_batch(batches: int, samples: int, world_size: int, batch_size: int) -> int:
    """``batches``, the training micro-batches per rank in an epoch; bad input when there are none."""
    if batches == 0:
        raise UsageError(f"the training split has {samples} samples: too few for {world_size} rank(s) x batch "
                         f"{batch_size}; lower --batch-size")
    return batches


def plan_memory(plan: DataPlan, train_raw: Dataset):
    """The host memory ``plan``'s workers fill (``host_memory.loader_memory``)."""
    return loader_memory(train_raw, batch_size=plan.batch_size, workers=plan.workers, views=plan.views,
                         image_size=max(plan.image_size, plan.train_image_size), aug_on_device=plan.aug_on_device,
                         decode_on_device=plan.decode_on_device)


def describe_plan_device_memory(plan: DataPlan, train_raw: Dataset, device: torch.device) -> str | None:
    """``--check``'s line on the device memory of image files finished on the device
    (``files_on_device.DeviceMemory``); None on the other paths."""
    files = image_files_of(train_raw)
    if not plan.aug_on_device or files is None:
        return None
    from .files_on_device import DeviceMemory, describe_device_memory

    pixels = mean_image_pixels(files)
    train = DeviceMemory.of_pass(pixels, plan.batch_size, plan.views, plan.train_image_size, plan.decode_on_device)
    evaluation = DeviceMemory.of_pass(pixels, eval_batch_size(plan.batch_size, True), 1, plan.image_size,
                                      plan.decode_on_device)
    return describe_device_memory(train, evaluation, device)


# ----------------------------------------------------------------------------- the loader path
class LoaderBatches:
    """The loader path's batches: ``loader``'s, each pass a :class:`~data_stream.LoopBatches`
    whose batches pass through ``record`` (image files: ``UnreadableFiles.record``) as they are
    handed out."""

    def __init__(self, loader: DataLoader, record: Callable[[list], list] | None = None):
        self.loader, self.record = loader, record
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> LoopBatches:
        return LoopBatches(iter(self.loader), record=self.record)


# ----------------------------------------------------------------------------- samples and their order
class SeededTransform(Dataset):
    """``transform(base[i])`` with the RNG seeded from (seed, epoch, i), ``i`` with the sample's
    repetition in its high bits (``order.augmentation_index``: repetition 0 seeds as the index).

    The key is an (epoch, index) pair from :class:`ResumableDistributedSampler`, or (epoch,
    index, repetition) from :class:`RepeatedAugmentationSampler`, so the epoch travels with the
    index into persistent workers; a plain index (evaluation) means epoch 0. The caller's global
    RNG is restored afterwards. ``with_key``: also return the key's elements (epoch, index[,
    repetition]), for the half of the augmentation that runs on the device
    (``files_on_device.FinishOnDevice``).
    """

    def __init__(self, base: Dataset, transform: Callable | None, seed: int, with_key: bool = False):
        self.base, self.transform, self.seed, self.with_key = base, transform, seed, with_key

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: Key | int):
        key = key if isinstance(key, tuple) else (0, key)
        epoch, index, rep = (*key, 0)[:3]
        image, target = self.base[index]
        if self.transform is not None:
            with torch.random.fork_rng(devices=[]):
                # the CPU generator alone (the transforms' own): torch.manual_seed would also queue
                # a seed for every CUDA device, which costs a millisecond per sample
                torch.default_generator.manual_seed(hashing.seed(self.seed, epoch, augmentation_index(index, rep)))
                image = self.transform(image)
        return (image, target, *key) if self.with_key else (image, target)


# ----------------------------------------------------------------------------- in-memory data on the device
class DeviceBatches:
    """Batches of an in-memory split held once, as one tensor, on the training device: gathered
    by index in ``sampler``'s order (training: the DataLoader path's order, sharding and resume
    skip; evaluation: a shard's indices, the last batch short) and augmented as a whole; no
    workers, no per-sample Python, no image copies.

    Each pass is a ``data_stream.LoopBatches``: a batch (its indices' copy, the gather, the
    augmentation: :meth:`make`) is made, on CUDA on the device's data stream, when
    ``prepare_next()`` or ``next()`` asks for it, and handed to the training stream when
    ``next()`` hands it out (``data_stream``: who waits for whom). ``calls``:
    ``data_stream.DataStream``'s."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, sampler: Iterable[Key | int], batch_size: int,
                 augment: DeviceAugment, drop_last: bool = True, calls=None):
        self.images, self.targets = images, targets    # N x C x H x W (uint8 or float), N
        self.sampler, self.batch_size, self.augment, self.drop_last = sampler, batch_size, augment, drop_last
        self.stream = DataStream(images.device, calls)  # waits here for the images' copy to the device

    def __len__(self) -> int:
        samples = len(self.sampler)  # type: ignore[arg-type]
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __iter__(self) -> LoopBatches:
        return LoopBatches(self._chunks(), self.make)

    def _chunks(self) -> Iterator[list]:
        keys = [key if isinstance(key, tuple) else (0, key) for key in self.sampler]  # evaluation: epoch 0
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield keys[start:start + self.batch_size]

    def make(self, chunk: list) -> Made:
        """The batch of ``chunk``'s keys, made on the data stream and not yet handed over."""
        device = self.images.device
        index = torch.tensor([key[1] for key in chunk])  # B, on the host: the augmentation draws there
        # each repetition (repeated augmentation's third key element) augmented differently
        drawn = torch.tensor([augmentation_index(key[1], key[2] if len(key) > 2 else 0) for key in chunk])
        host = index.pin_memory() if device.type == "cuda" else index  # held until its copy is done

        def batch():
            on_device = pinned_to_device(host, device)
            return self.augment(self.images[on_device], chunk[0][0], drawn), self.targets[on_device]
        return self.stream.run(batch, hold=(host,))


def padded_for_crop(images: torch.Tensor, augment: BatchAugment, chunk: int = 1024) -> torch.Tensor:
    """The stored images ready for ``augment``'s pad-and-crop view, which keeps the input's size:
    resized once to the output size (as the per-sample pipeline's Resize does before its
    RandomCrop), ``chunk`` images at a time, so the float copy of a whole split (CIFAR-10 at
    224 px: 30 GB) never exists at once; as they are for any other view."""
    size = augment.out_size
    if not augment.recipe.pad_crop or images.shape[-1] == size:
        return images
    out = images.new_empty((len(images), images.shape[1], size, size))
    for start in range(0, len(images), chunk):
        part = F.interpolate(images[start:start + chunk].float(), size=(size, size), mode="bilinear",
                             antialias=True, align_corners=False)
        out[start:start + chunk] = part.round().clamp(0, 255) if images.dtype == torch.uint8 else part
    return out


# ----------------------------------------------------------------------------- workers
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
