"""The training order for shards read from an object store: each rank reads whole shards, in
turn, so that it downloads each shard it needs once an epoch, and no rank reads another's.

Epoch ``e`` of a job of ``W`` ranks, ``B`` samples a rank's batch (seed ``s``):

1. The epoch's sequence: the shards in an order drawn from (s, e), each shard's samples in their
   stored order; every sample once.
2. Rank ``r`` takes the ``r``-th of ``W`` equal contiguous pieces of it (the last
   ``N mod W`` samples are left out this epoch), so it reads about ``N / W / samples-per-shard + 1``
   shards.
3. It shuffles its piece within consecutive windows of ``SHUFFLE_SHARDS`` shards (drawn from
   (s, e, r)), which it reads in batches of ``B`` (a last part batch is dropped).

So the order is a function of (seed, epoch, W) and of nothing else: a resume at the same world
size skips the batches its checkpoint consumed and sees the rest exactly. A resume at another
world size (or batch size) starts a new *segment* of the epoch: the samples the earlier segments
consumed are known exactly from their (W, B, batches), and what is left of the epoch's sequence,
in its order, is shared out the same way among the new ranks. No sample is seen twice in an epoch
or skipped, except the tail every epoch drops (fewer than one batch per rank, plus ``N mod W``).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from .. import hashing
from .object_store import is_object_store

SHUFFLE_SHARDS = 4  # a rank shuffles its samples within windows of this many consecutive shards
Key = tuple[int, int]  # (epoch, sample index), as the other training samplers yield


def shard_aware(dataset: str, data_dir: str) -> bool:
    """Whether a run on this data trains in the shard-aware order: shards in an object store."""
    return dataset == "shards" and is_object_store(data_dir)


def cache_bytes_needed(largest_shard: int) -> int:
    """The least a rank's cache must hold: its workers read at most two consecutive windows of
    ``SHUFFLE_SHARDS`` shards at once."""
    return 2 * SHUFFLE_SHARDS * largest_shard


def epoch_sequence(shard_of: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Every sample's index once: the shards in an order drawn from (seed, epoch), each shard's
    samples in stored order. ``shard_of``: each sample's shard number."""
    shards = int(shard_of.max()) + 1 if len(shard_of) else 0
    drawn = torch.randperm(shards, generator=torch.Generator().manual_seed(hashing.seed(seed, epoch))).numpy()
    place = np.empty(shards, dtype=np.int64)
    place[drawn] = np.arange(shards)  # where each shard comes in the epoch
    return np.lexsort((np.arange(len(shard_of)), place[shard_of]))


def rank_piece(remaining: np.ndarray, shard_of: np.ndarray, world_size: int, rank: int, seed: int, epoch: int
               ) -> np.ndarray:
    """Rank ``rank``'s share of ``remaining`` (the epoch's samples not yet consumed, in the
    epoch's order; ``shard_of``: each sample's shard): its contiguous piece, shuffled within
    windows of ``SHUFFLE_SHARDS`` consecutive shards."""
    per_rank = len(remaining) // world_size
    piece = remaining[rank * per_rank:(rank + 1) * per_rank].copy()
    shard_starts = np.flatnonzero(np.diff(shard_of[piece], prepend=-1))  # where each shard's run begins
    bounds = [*shard_starts[::SHUFFLE_SHARDS].tolist(), per_rank]
    generator = torch.Generator().manual_seed(hashing.seed(seed, epoch, rank))
    for start, end in zip(bounds, bounds[1:]):
        piece[start:end] = piece[start:end][torch.randperm(end - start, generator=generator).numpy()]
    return piece


class ShardAwareSampler(Sampler[Key]):
    """This rank's training samples of an epoch in the shard-aware order (module docstring), as
    (epoch, index); resumable like ``pipeline.ResumableDistributedSampler``: :meth:`set_epoch`
    takes the samples already consumed this epoch (``skip``) and the epoch's earlier segments,
    each (world size, batch size, batches per rank)."""

    def __init__(self, shard_of: np.ndarray, num_replicas: int, rank: int, seed: int):
        self.shard_of, self.world_size, self.rank, self.seed = shard_of, num_replicas, rank, seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int, skip: int = 0, earlier: Sequence[Sequence[int]] = ()) -> None:
        self.epoch, self.skip = epoch, skip
        self.remaining = self._left_after(earlier)  # the epoch's samples the earlier segments did not consume
        self.num_samples = len(self.remaining) // self.world_size

    def _left_after(self, earlier: Sequence[Sequence[int]]) -> np.ndarray:
        left = epoch_sequence(self.shard_of, self.seed, self.epoch)
        for world_size, batch_size, batches in earlier:
            consumed = np.concatenate([rank_piece(left, self.shard_of, world_size, r, self.seed, self.epoch)
                                       [:batches * batch_size] for r in range(world_size)])
            left = left[~np.isin(left, consumed)]
        return left

    def order(self) -> np.ndarray:
        """This rank's samples of the epoch (its segment), before ``skip``."""
        return rank_piece(self.remaining, self.shard_of, self.world_size, self.rank, self.seed, self.epoch)

    def __iter__(self) -> Iterator[Key]:
        return iter([(self.epoch, int(i)) for i in self.order()[self.skip:]])

    def __len__(self) -> int:
        return self.num_samples - self.skip
