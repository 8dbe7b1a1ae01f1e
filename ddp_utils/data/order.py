"""The order in which each rank reads its samples. Training: the samples order
(:class:`ResumableDistributedSampler`, one permutation of all samples shared out as torch's
``DistributedSampler`` does; :class:`RepeatedAugmentationSampler`, its ``--ra-reps`` variant) or the
shards order (:class:`ShardAwareSampler`: each rank whole shards of its own, shuffled within windows
of ``SHUFFLE_SHARDS``). Evaluation: :class:`ShardedEvalSampler`, each sample once.

A training order is a function of (seed, epoch, world size) alone. Each sampler says in
``state_dict`` how far an epoch went (its *segments*: world size, batch size, batches per rank) and
decides in ``continue_from`` how a run of another shape continues it. The orders, their resume rules
and why: docs/data.md, "The order of shards: one, wherever they are"; repeated augmentation:
docs/recipe.md, "Repeated augmentation".
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence, Sized

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from .. import hashing
from ..config import UsageError

SHUFFLE_SHARDS = 4  # a rank shuffles its samples within windows of this many consecutive shards
ORDERS = ("samples", "shards")

# (epoch, sample index) or, repeated augmentation's, (epoch, sample index, repetition): what a training sampler yields
Key = tuple[int, ...]
Segment = list[int]    # [world size, batch size, batches per rank] of one part of an epoch


def order_for(dataset: str, asked: str) -> str:
    """The training order: ``--order`` as asked, auto = the shards order for shards, the samples
    order for anything else."""
    if asked != "auto":
        return asked
    return "shards" if dataset == "shards" else "samples"


def _position(epoch: int, segments: Sequence[Segment]) -> dict[str, Any]:
    return {"epoch": epoch, "segments": [list(map(int, segment)) for segment in segments]}


def _check_kind(saved: dict[str, Any], kind: str, reps: int = 1) -> None:
    """A checkpoint saved part way through an epoch of the other order, or of the samples order
    with another number of repetitions (``--ra-reps``; 1 in checkpoints that do not say), cannot
    continue it."""
    if saved["segments"] and saved["order"] != kind:
        raise UsageError(f"saved part way through an epoch read in the {saved['order']} order, which this run "
                         f"(--order {kind}) cannot continue; resume with --order {saved['order']}, or from a "
                         f"checkpoint at an epoch's end")
    saved_reps = saved.get("reps", 1)
    if saved["segments"] and saved_reps != reps:
        raise UsageError(f"saved part way through an epoch read with --ra-reps {saved_reps}, which this run "
                         f"(--ra-reps {reps}) cannot continue; resume with --ra-reps {saved_reps}, or from a "
                         f"checkpoint at an epoch's end")


def augmentation_index(index, rep):
    """The number a sample's augmentation is keyed by (with the seed and epoch): its index, and
    its repetition ``rep`` (repeated augmentation) in the high 32 bits, so that repetition 0 is
    keyed as the sample always was (``hashing`` hashes a word's high half only after its low
    one, and a zero high half of an index below 2**32 is what it hashed before). Python ints or
    int64 tensors."""
    return index + (rep << 32)


def _whole_windows(batches: int, accum_steps: int) -> int:
    return batches - batches % accum_steps


class ResumableDistributedSampler(DistributedSampler):
    """The samples order: ``DistributedSampler``'s, able to start an epoch
    part-way, after the samples a checkpoint already consumed, yielding (epoch, index) keys.
    ``batch_size``: a rank's batch, which a checkpoint's position counts in."""

    kind = "samples"
    reps = 1  # each sample's repetitions an epoch (RepeatedAugmentationSampler's --ra-reps)

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, batch_size: int = 1):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.skip, self.batch_size = 0, batch_size

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[Key]:
        """(epoch, index) pairs: the epoch travels with each index (``pipeline.SeededTransform``)."""
        indices = list(super().__iter__())
        return iter([(self.epoch, i) for i in indices[self.skip:]])

    def __len__(self) -> int:
        return self.num_samples - self.skip

    def state_dict(self, epoch: int, batches_done: int) -> dict[str, Any]:
        """What a checkpoint at ``batches_done`` batches into ``epoch`` needs to continue it."""
        reps = {"reps": self.reps} if self.reps > 1 else {}  # without repetition: the checkpoint as before
        return {"order": self.kind, **reps, **_position(epoch, [[self.num_replicas, self.batch_size, batches_done]]
                                                        if batches_done else [])}

    def continue_from(self, saved: dict[str, Any], accum_steps: int) -> tuple[int, str]:
        """(batches of the saved epoch this run skips, a remark when that is not exactly the
        saved position): the same sample position at this run's shape, rounded down to a whole
        window of ``accum_steps`` (a few samples are seen again rather than skipped). Bad input
        when the epoch was saved part way with another ``reps``."""
        _check_kind(saved, self.kind, self.reps)
        consumed = sum(world * batch * batches for world, batch, batches in saved["segments"])
        exact = consumed % (self.num_replicas * self.batch_size) == 0
        batches = _whole_windows(consumed // (self.num_replicas * self.batch_size), accum_steps)
        if exact and batches * self.num_replicas * self.batch_size == consumed:
            return batches, ""
        return batches, "the epoch continues near, not exactly at, the saved position"


class RepeatedAugmentationSampler(ResumableDistributedSampler):
    """Repeated augmentation (docs/recipe.md), ``reps`` >= 2 repetitions of each sample an
    epoch, yielding (epoch, index, repetition) keys; a rank's epoch is ``len(dataset) //
    num_replicas`` of them. Resumes as :class:`ResumableDistributedSampler`, its position
    counted in entries of the repeated sequence."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, batch_size: int = 1,
                 reps: int = 2):
        super().__init__(dataset, num_replicas, rank, seed, batch_size)
        if reps < 2:
            raise ValueError(f"repeated augmentation needs reps >= 2, got {reps}")
        self.reps = reps
        self.num_samples = len(dataset) // num_replicas  # type: ignore[arg-type]

    def keys_of_epoch(self) -> list[Key]:
        """This rank's whole epoch, from its start (before ``skip``)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # the samples order's permutation
        permutation = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        repeated = [(index, rep) for index in permutation for rep in range(self.reps)]
        repeated += repeated[:-len(repeated) % self.num_replicas]  # padded to a multiple of the world size
        mine = repeated[self.rank::self.num_replicas][:self.num_samples]
        return [(self.epoch, index, rep) for index, rep in mine]

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys_of_epoch()[self.skip:])


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
    """The shards order (docs/data.md): this rank's training samples of an epoch as (epoch,
    index). ``shard_of``: each sample's shard number; ``batch_size``: a rank's batch."""

    kind = "shards"

    def __init__(self, shard_of: np.ndarray, num_replicas: int, rank: int, seed: int, batch_size: int = 1):
        self.shard_of, self.world_size, self.rank, self.seed = shard_of, num_replicas, rank, seed
        self.batch_size = batch_size
        self.earlier: list[Segment] = []  # the epoch's segments at other shapes (continue_from)
        self._earlier_epoch = -1
        self.set_epoch(0)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Epoch ``epoch``, after ``skip`` of this rank's samples (and after the earlier segments,
        if it is the epoch :meth:`continue_from` set up)."""
        if epoch != self._earlier_epoch:
            self.earlier = []
        self.epoch, self.skip = epoch, skip
        self.remaining = self._left_after(self.earlier)  # the epoch's samples the earlier segments did not consume
        self.num_samples = len(self.remaining) // self.world_size

    def _left_after(self, earlier: Sequence[Segment]) -> np.ndarray:
        left = epoch_sequence(self.shard_of, self.seed, self.epoch)
        for world_size, batch_size, batches in earlier:
            consumed = np.concatenate([rank_piece(left, self.shard_of, world_size, r, self.seed, self.epoch)
                                       [:batches * batch_size] for r in range(world_size)])
            left = left[~np.isin(left, consumed)]
        return left

    def order(self) -> np.ndarray:
        """This rank's samples of the epoch (its segment), before ``skip``."""
        return rank_piece(self.remaining, self.shard_of, self.world_size, self.rank, self.seed, self.epoch)

    def indices_of_epoch(self, epoch: int) -> np.ndarray:
        """This rank's samples of a whole epoch ``epoch`` read from its start, in order (what a
        read-ahead fetches for the next epoch)."""
        return rank_piece(epoch_sequence(self.shard_of, self.seed, epoch), self.shard_of, self.world_size,
                          self.rank, self.seed, epoch)

    def __iter__(self) -> Iterator[Key]:
        return iter([(self.epoch, int(i)) for i in self.order()[self.skip:]])

    def __len__(self) -> int:
        return self.num_samples - self.skip

    def state_dict(self, epoch: int, batches_done: int) -> dict[str, Any]:
        """What a checkpoint at ``batches_done`` batches into ``epoch`` needs to continue it: the
        epoch's segments, this one last."""
        if epoch != self.epoch:  # an epoch not started yet
            return {"order": self.kind, **_position(epoch, [])}
        now = [[self.world_size, self.batch_size, batches_done]] if batches_done else []
        return {"order": self.kind, **_position(epoch, [*self.earlier, *now])}

    def continue_from(self, saved: dict[str, Any], accum_steps: int) -> tuple[int, str]:
        """(batches of the saved epoch this run skips, a remark when not exactly where it was
        saved). At the saved shape: the saved batches, rounded down to a whole window of
        ``accum_steps``; at another: none, the epoch's next segment shares out what the saved
        segments left."""
        _check_kind(saved, self.kind)
        segments = [list(segment) for segment in saved["segments"]]
        self._earlier_epoch = saved["epoch"]
        if segments and segments[-1][:2] == [self.world_size, self.batch_size]:
            self.earlier = segments[:-1]
            batches = _whole_windows(segments[-1][2], accum_steps)
            return batches, "" if batches == segments[-1][2] else \
                "the epoch continues near, not exactly at, the saved position"
        self.earlier = segments
        if not segments:
            return 0, ""
        return 0, "the samples of the epoch that the saved run did not reach are shared out among these ranks, each once"


class ShardedEvalSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ... (with ``shard_of``, each sample's shard: the r-th
    of W consecutive runs of the samples ordered by shard, so that it reads few shards): every
    sample exactly once, no padding duplicates (``DistributedSampler`` pads, which would count
    some validation samples twice)."""

    def __init__(self, data: Sized, num_replicas: int, rank: int, shard_of: np.ndarray | None = None):
        if shard_of is None:
            self.indices = range(rank, len(data), num_replicas)
        else:
            by_shard = np.argsort(shard_of, kind="stable")
            self.indices = by_shard[len(data) * rank // num_replicas:len(data) * (rank + 1) // num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
