"""Repeated augmentation (--ra-reps N, ddp_utils/data/order.py's RepeatedAugmentationSampler):
each rank's keys equal a from-scratch reference of torchvision's RASampler semantics (with our
per-rank cut); the epoch holds each image of its share N times, on N different ranks; each
repetition is augmented differently on every path (and identically when the repetition is
ignored: the negative control), repetition 0 as the sample always was; a 2-rank run stopped
mid-epoch resumes bit for bit; another N cannot continue a saved epoch."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from helpers import TINY_DIGITS, assert_ok, assert_same_state, load_ckpt, resume_folder, run_ranks

from ddp_utils.config import UsageError
from ddp_utils.data import files_on_device, pipeline
from ddp_utils.data.order import RepeatedAugmentationSampler, ResumableDistributedSampler
from ddp_utils.data.pipeline import DataPlan, build_data
from ddp_utils.data.recipes import classifier_recipe

CPU = torch.device("cpu")


def reference_keys(n: int, world: int, rank: int, seed: int, epoch: int, reps: int) -> list[tuple[int, int, int]]:
    """torchvision's RASampler, rank ``rank``'s share, written as positions: the repeated
    sequence's entry p is the (p // reps)-th image of the epoch's permutation (torch.randperm
    seeded seed + epoch), its (p % reps)-th repetition; rank r reads entries r, r + W, ...;
    the cut keeps n // W of them (torchvision's: n // 256 * 256 / W)."""
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    positions = [rank + k * world for k in range(n // world)]
    return [(epoch, permutation[p // reps], p % reps) for p in positions]


def rank_keys(n: int, world: int, seed: int, epoch: int, reps: int) -> list[list[tuple]]:
    samplers = [RepeatedAugmentationSampler(list(range(n)), world, r, seed, reps=reps) for r in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("reps", [2, 3, 4])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [7, 10, 33])
def test_each_ranks_keys_are_rasamplers(n, world, reps):
    for epoch in (0, 3):
        if n // world == 0:
            continue
        for rank, keys in enumerate(rank_keys(n, world, 11, epoch, reps)):
            assert keys == reference_keys(n, world, rank, 11, epoch, reps), (n, world, rank, epoch, reps)


def test_the_permutation_is_the_samples_orders():
    """One rank, N = 2: the distinct images in order are the plain samples order's first ones."""
    plain = ResumableDistributedSampler(list(range(20)), 1, 0, seed=5)
    plain.set_epoch(2)
    (keys,) = rank_keys(20, 1, 5, 2, reps=2)
    assert [i for _, i, _ in keys[::2]] == [i for _, i in plain][:10]


@pytest.mark.parametrize("n, world, reps", [(40, 4, 4), (41, 4, 3), (30, 3, 2), (33, 2, 3), (24, 8, 4)])
def test_every_image_of_the_epochs_share_comes_n_times_on_n_ranks(n, world, reps):
    """Across ranks: the first len // W * W entries of the repeated sequence, i.e. the
    permutation's first images each N times (one image cut short at the end), each repetition of
    an image on a rank of its own when N <= W (on every rank when N > W); the epoch as long as without repetition."""
    ranks = rank_keys(n, world, 0, 1, reps)
    assert all(len(keys) == n // world for keys in ranks)
    where = collections.defaultdict(list)  # image -> [(rank, repetition), ...]
    for rank, keys in enumerate(ranks):
        for _, index, rep in keys:
            where[index].append((rank, rep))
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    total = n // world * world
    full, part = divmod(total, reps)
    assert list(where) != [] and set(where) == set(permutation[:full + (part > 0)])
    for image in permutation[:full]:
        assert sorted(rep for _, rep in where[image]) == list(range(reps))
        assert len({rank for rank, _ in where[image]}) == min(reps, world)  # N > W: a rank meets it again
    if part:
        assert len(where[permutation[full]]) == part


def test_without_repetition_the_sampler_is_unchanged_and_n_must_be_2_or_more():
    """--ra-reps 1 builds the plain samples order (its (epoch, index) keys, its length)."""
    plan = DataPlan(dataset="digits", data_dir="", image_size=16, synthetic_samples=0, debug=False, seed=0,
                    batch_size=8, workers=0, normalization="auto", recipe=classifier_recipe("digits", 16), views=1,
                    aug_on_device=False)
    data = list(range(50))
    plain = pipeline.training_order(plan, data, 3, 1)
    assert type(plain) is ResumableDistributedSampler and len(plain) == 17 and len(next(iter(plain))) == 2
    repeated = pipeline.training_order(dataclasses.replace(plan, ra_reps=3), data, 3, 1)
    assert isinstance(repeated, RepeatedAugmentationSampler) and len(repeated) == 16 and len(next(iter(repeated))) == 3
    with pytest.raises(ValueError):
        RepeatedAugmentationSampler(data, 2, 0, 0, reps=1)


# ----------------------------------------------------------------------------- augmentation per repetition
def _plan(path: str, folder=None) -> DataPlan:
    files = folder is not None
    dataset, size = ("imagefolder", 32) if files else ("digits", 16)
    return DataPlan(dataset=dataset, data_dir=str(folder or ""), image_size=size, synthetic_samples=0, debug=False,
                    seed=3, batch_size=6, workers=0, normalization="auto", recipe=classifier_recipe(dataset, size),
                    views=1, aug_on_device=path == "device", ra_reps=2)


def _first_batches(plan: DataPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0's and rank 1's first training batch of epoch 1, 2 ranks, N = 2: the same images in the
    same order (rank 0 reads every image's repetition 0, rank 1 its repetition 1)."""
    batches = []
    for rank in (0, 1):
        loaders = build_data(plan, rank=rank, world_size=2, device=CPU)
        loaders.set_epoch(1)
        keys = list(loaders.train_sampler)[:plan.batch_size]
        assert {k[2] for k in keys} == {rank}
        images, targets = next(iter(loaders.train))
        batches.append((images, targets, [k[1] for k in keys]))
        loaders.close()
    assert batches[0][2] == batches[1][2] and torch.equal(batches[0][1], batches[1][1])
    return batches


@pytest.mark.parametrize("path", ["loader", "device", "files on device"])
def test_each_repetition_is_augmented_differently_and_the_same_when_ignored(path, jpeg_folder, monkeypatch):
    """The same images on two ranks (their repetitions 0 and 1): most views differ (digits'
    shifts: 25 crops, so a few may coincide; image files: a random resized crop and a flip);
    with the repetition ignored in the augmentation's key, every view is equal bit for bit."""
    plan = _plan("loader" if path == "loader" else "device", jpeg_folder if path == "files on device" else None)
    (zero, _, _), (one, _, _) = _first_batches(plan)
    differ = sum(not torch.equal(a, b) for a, b in zip(zero, one))
    assert differ >= len(zero) // 2, differ
    ignored = lambda index, rep: index  # noqa: E731  (the negative control)
    monkeypatch.setattr(pipeline, "augmentation_index", ignored)
    monkeypatch.setattr(files_on_device, "augmentation_index", ignored)
    (zero, _, _), (one, _, _) = _first_batches(plan)
    assert torch.equal(zero, one)


def test_repetition_zero_is_augmented_as_without_repetition():
    """In-memory data on the device: rank 0's first batch (every key repetition 0) equals the
    plain path's views of the same images at the same epoch, bit for bit, so every seed without
    --ra-reps is what it was."""
    plan = _plan("device")
    loaders = build_data(plan, rank=0, world_size=2, device=CPU)
    loaders.set_epoch(0)
    index = [k[1] for k in list(loaders.train_sampler)[:plan.batch_size]]
    images, _ = next(iter(loaders.train))
    (plain,) = build_data(dataclasses.replace(plan, ra_reps=1), rank=0, world_size=2, device=CPU).training_views(index)
    assert torch.equal(images, plain)


# ----------------------------------------------------------------------------- resume
def test_another_n_cannot_continue_a_saved_epoch():
    sampler = RepeatedAugmentationSampler(list(range(100)), 2, 0, 0, batch_size=4, reps=3)
    assert sampler.continue_from({"order": "samples", "reps": 3, "epoch": 1, "segments": [[2, 4, 5]]}, 1) == (5, "")
    assert sampler.state_dict(1, 5) == {"order": "samples", "reps": 3, "epoch": 1, "segments": [[2, 4, 5]]}
    for saved_reps, other in ((2, sampler), (3, ResumableDistributedSampler(list(range(100)), 2, 0, 0, 4))):
        with pytest.raises(UsageError, match=f"read with --ra-reps {saved_reps}, which this run"):
            other.continue_from({"order": "samples", "reps": saved_reps, "epoch": 1, "segments": [[2, 4, 5]]}, 1)
    plain = {"order": "samples", "epoch": 1, "segments": [[2, 4, 5]]}  # a checkpoint without repetition
    with pytest.raises(UsageError, match="read with --ra-reps 1, which this run \\(--ra-reps 3\\)"):
        sampler.continue_from(plain, 1)
    assert sampler.continue_from({"order": "samples", "reps": 2, "epoch": 2, "segments": []}, 1) == (0, "")  # an end


def test_at_another_shape_the_epoch_continues_from_the_same_entries():
    """Saved at 2 ranks x 4 x 6 batches (48 entries of the repeated sequence consumed), continued
    on 3 ranks x 4: 4 batches each, and the rest of the 3-rank epoch is exactly the entries after
    the first 48 (the 3-rank run's keys from position 48 on)."""
    data = list(range(90))
    saved = {"order": "samples", "reps": 3, "epoch": 0, "segments": [[2, 4, 6]]}
    for rank in range(3):
        sampler = RepeatedAugmentationSampler(data, 3, rank, 0, batch_size=4, reps=3)
        batches, remark = sampler.continue_from(saved, 1)
        assert (batches, remark) == (4, "")
        sampler.set_epoch(0, skip=batches * 4)
        assert list(sampler) == reference_keys(90, 3, rank, 0, 0, 3)[16:]


RA_RUN = TINY_DIGITS + ["--lr", "0.05", "--epochs", "1", "--ra-reps", "3", "--max-steps", "6"]


@pytest.mark.slow  # two 2-rank runs: about 13 s
@pytest.mark.torch_versions  # a 2-rank resume, exact: RNG streams and state through torch.save and torch.load
def test_a_run_with_repetition_resumes_mid_epoch_bit_for_bit(tmp_path):
    """2 ranks, --ra-reps 3, 6 optimizer steps; step 3's checkpoint resumed to step 6 ends with
    the same weights, buffers and optimizer state as the run that never stopped."""
    ref = tmp_path / "ref"
    assert_ok(run_ranks("train_classifier.py", RA_RUN + ["--ckpt-every", "3", "--keep-checkpoints", "5",
                                                         "--out", str(ref)], tmp_path))
    at3 = next(p for p in ref.glob("checkpoint_*.pt") if load_ckpt(p)["step"] == 3)
    assert load_ckpt(at3)["order"] == {"order": "samples", "reps": 3, "epoch": 0, "segments": [[2, 16, 6]]}
    part = resume_folder(at3, tmp_path / "part")
    proc = run_ranks("train_classifier.py", RA_RUN + ["--resume", "auto", "--out", str(part)], tmp_path)
    assert_ok(proc)
    assert "step 3, in epoch 1, 6 batches" in proc.stdout
    resumed, final = load_ckpt(part / "checkpoint_last.pt"), load_ckpt(ref / "checkpoint_last.pt")
    assert resumed["step"] == final["step"] == 6
    assert_same_state(resumed, final)
