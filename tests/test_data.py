"""Data sets and transforms: the embedded digits, an ImageFolder tree, synthetic tensors; image files
finished on the device by a thread of their own, the stream contract, and the device decoder's
refusals and hardware probe (the last section)."""
from __future__ import annotations

import gc
import multiprocessing
import re
import shutil
import subprocess
import sys
import threading
import traceback
import weakref
from pathlib import Path

import pytest
import torch
from helpers import assert_ok, cli_env, in_process, load_ckpt, run_cli, run_on_ranks, write_image_folder

import train_classifier
from ddp_utils.data import files_on_device
from ddp_utils.data.data_stream import HELD_BATCHES, DataStream
from ddp_utils.data.files_on_device import (
    AHEAD,
    NVJPEG_STATUS_ARCH_MISMATCH,
    NVJPEG_STATUS_SUCCESS,
    THREAD_NAME,
    DecodeFallbacks,
    FinishOnDevice,
    collate_files,
    describe_decoder,
    nvjpeg_backend,
    torchvision_nvjpeg,
)
from ddp_utils.data.object_store import StoreUnavailable
from ddp_utils.data.pipeline import DataPlan, SeededTransform, build_data
from ddp_utils.data.recipes import classifier_recipe, eval_recipe, moco_recipe
from ddp_utils.data.sets import DigitsDataset, SyntheticImages, load_split
from ddp_utils.data.transforms import view_transform
from ddp_utils.train.train_config import data_plan

CPU = torch.device("cpu")


def classification_transforms(dataset: str, size: int, augment: bool):
    """(train, eval) per-sample transforms of train_classifier.py's loader path."""
    return (view_transform(classifier_recipe(dataset, size, augment), dataset, size),
            view_transform(eval_recipe(dataset), dataset, size))


def plan(**given) -> DataPlan:
    """A DataPlan: the digits classifier's loader path at 32 px unless ``given`` says otherwise."""
    size, dataset = given.get("image_size", 32), given.get("dataset", "digits")
    base = dict(dataset=dataset, data_dir="", image_size=size, synthetic_samples=2048, debug=False, seed=0,
                batch_size=8, workers=0, normalization="auto", recipe=classifier_recipe(dataset, size), views=1,
                aug_on_device=False)
    return DataPlan(**{**base, **given})


def test_digits_split_is_fixed_and_disjoint():
    train, val = DigitsDataset(train=True), DigitsDataset(train=False)
    assert (len(train), len(val)) == (1438, 359)
    image, label = train[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 10
    assert image.min() >= 0 and image.max() <= 1
    # Same split on every call (and so on every rank), train and val share no image.
    assert torch.equal(DigitsDataset(train=False).images, val.images)
    train_rows = {tuple(x.flatten().tolist()) for x in train.images}
    assert not any(tuple(x.flatten().tolist()) in train_rows for x in val.images[:50])


def test_no_augment_is_deterministic_and_augment_is_seeded_per_sample():
    raw = DigitsDataset(train=True)
    train_tf, eval_tf = classification_transforms("digits", 32, augment=True)
    plain_tf, _ = classification_transforms("digits", 32, augment=False)
    plain = SeededTransform(raw, plain_tf, seed=0)
    assert torch.equal(plain[3][0], eval_tf(raw[3][0]))
    aug = SeededTransform(raw, train_tf, seed=0)
    first = [aug[(0, i)][0] for i in range(8)]
    assert all(torch.equal(a, aug[(0, i)][0]) for i, a in enumerate(first))  # same (seed, epoch, index)
    assert any(not torch.equal(a, aug[(1, i)][0]) for i, a in enumerate(first))  # a new epoch re-draws
    # The caller's RNG stream is untouched by the per-sample seeding.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    aug[0]
    assert torch.equal(torch.rand(3), expected)


def test_synthetic_is_reproducible():
    ds = SyntheticImages(16, 24, num_classes=5)
    assert torch.equal(ds[7][0], SyntheticImages(16, 24, num_classes=5)[7][0])
    assert ds[7][0].shape == (3, 24, 24)


def test_imagefolder_loads_and_trains(tmp_path, capsys):
    write_image_folder(tmp_path / "tree")
    loaders = build_data(plan(dataset="imagefolder", data_dir=str(tmp_path / "tree"), image_size=48, batch_size=4),
                         rank=0, world_size=1, device=CPU)
    loaders.set_epoch(0)
    images, labels = next(iter(loaders.train))
    assert images.shape == (4, 3, 48, 48) and images.dtype == torch.float32
    assert loaders.num_classes == 3
    out = tmp_path / "run"
    proc = in_process(train_classifier.main, ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "tree"),
                                              "--image-size", "48", "--arch", "small_cnn", "--batch-size", "6",
                                              "--epochs", "1", "--device", "cpu", "--workers", "1",
                                              "--out", str(out)], capsys)
    assert_ok(proc)
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 36 // 6
    assert "(36 images)" in proc.stdout


def _download_worker(info, data_dir: str):
    """CIFAR-10 with --download on 2 ranks, torchvision's CIFAR10 replaced by a recorder: one node
    (both ranks local), two nodes (each rank a node's local rank 0), and a failing download."""
    import dataclasses

    from torchvision import datasets

    from ddp_utils.config import UsageError
    from ddp_utils.train.preflight import download_once_per_node
    from train_classifier import ClassifierConfig

    calls, fail = [], []

    class RecordingCIFAR10:
        def __init__(self, root, train, download):
            calls.append(("download" if download else "read", train))
            if download and fail:
                raise OSError("Network is unreachable")

    datasets.CIFAR10 = RecordingCIFAR10
    cfg = ClassifierConfig(dataset="cifar10", download=True, data_dir=data_dir, device="cpu")
    results = {}
    for scenario, as_info in (("one node", info), ("two nodes", dataclasses.replace(info, local_rank=0))):
        calls.clear()
        download_once_per_node(cfg, as_info)
        load_split("cifar10", data_dir, True, 32)
        results[scenario] = list(calls)
    fail.append(True)
    try:
        download_once_per_node(cfg, info)
    except UsageError as err:
        results["failure"] = str(err)
    return results


def test_cifar10_is_downloaded_once_per_node_then_only_read(tmp_path):
    fetch = [("download", True), ("download", False)]
    rank0, rank1 = run_on_ranks(_download_worker, tmp_path, str(tmp_path))
    assert rank0["one node"] == fetch + [("read", True)] and rank1["one node"] == [("read", True)]
    assert rank0["two nodes"] == rank1["two nodes"] == fetch + [("read", True)]
    assert rank0["failure"] == rank1["failure"] == (
        f"--download: CIFAR-10 could not be fetched into {tmp_path} (Network is unreachable); check the "
        f"network, or copy cifar-10-batches-py/ there and drop --download")


def _listing_worker(info, data_dir: str, empty_class_dir: str):
    """An image folder listed for 2 ranks through the pre-flight's step, torchvision's scan
    counted: once per split on rank 0, never on rank 1; then a folder with an empty class."""
    import dataclasses

    from torchvision import datasets

    from ddp_utils.config import UsageError
    from ddp_utils.data.pipeline import raw_splits
    from ddp_utils.data.recipes import AugmentRecipe
    from ddp_utils.train.preflight import list_image_files_once
    from ddp_utils.train.train_config import ResolvedSettings
    from train_classifier import ClassifierConfig

    scans = []
    scan = datasets.DatasetFolder.make_dataset

    def counted(*args, **kwargs):
        scans.append(args[0])
        return scan(*args, **kwargs)

    datasets.DatasetFolder.make_dataset = staticmethod(counted)
    cfg = ClassifierConfig(dataset="imagefolder", data_dir=data_dir, device="cpu")
    listings, _ = list_image_files_once(cfg, info)
    resolved = ResolvedSettings(image_size=32, workers=0, aug_on="loader", decode_on="loader", order="samples",
                                amp="none", global_batch=64)
    train, val = raw_splits(data_plan(cfg, resolved, AugmentRecipe(), listings=listings))
    results = {"scans": [str(Path(path).relative_to(data_dir)) for path in scans],
               "samples": (train.samples, val.samples), "classes": (train.classes, val.classes)}
    try:
        list_image_files_once(dataclasses.replace(cfg, data_dir=empty_class_dir), info)
    except UsageError as err:
        results["failure"] = str(err)
    return results


def test_an_image_folder_is_listed_once_per_job_and_every_rank_gets_its_listing(tmp_path):
    """Rank 0 scans train/ and val/, rank 1 none; both hold the samples torchvision's
    ImageFolder lists, in its order; a class folder without images stops both ranks with rank
    0's one line."""
    from torchvision.datasets import ImageFolder

    data, empty = tmp_path / "data", tmp_path / "empty"
    write_image_folder(data, per_class=4)
    (data / "train" / "class1" / "nested").mkdir()  # ImageFolder walks into subfolders
    shutil.copy(next((data / "train" / "class1").glob("*.png")), data / "train" / "class1" / "nested" / "x.png")
    shutil.copytree(data, empty)
    for image in (empty / "val" / "class2").iterdir():
        image.unlink()
    rank0, rank1 = run_on_ranks(_listing_worker, tmp_path, str(data), str(empty))
    assert rank0["scans"] == ["train", "val"] and rank1["scans"] == []
    expected = tuple(ImageFolder(str(data / split)).samples for split in ("train", "val"))
    assert rank0["samples"] == rank1["samples"] == expected and len(expected[0]) == 13
    assert rank0["classes"] == rank1["classes"] == (["class0", "class1", "class2"],) * 2
    assert rank0["failure"] == rank1["failure"]
    assert rank0["failure"].startswith(f"--data-dir {empty}: val/: Found no valid file for the classes class2")


def _epoch_batches(loaders, epoch: int, skip: int = 0) -> list[torch.Tensor]:
    loaders.set_epoch(epoch, skip_batches=skip)
    return [images for images, _ in loaders.train]


def test_persistent_workers_see_each_epoch_and_resume_exactly():
    """Training workers live across epochs (persistent_workers; the evaluation loaders' workers
    leave after each pass, so a rank keeps one resident pool): the epoch reaches them with every index,
    so augmentation changes between epochs and a loader started mid-epoch (a resume) yields the
    very batches an uninterrupted one does."""
    def build():  # the --debug subset: 256 training images, 8 batches of 32
        return build_data(plan(debug=True, batch_size=32, workers=2), rank=0, world_size=1, device=CPU)

    loaders = build()
    assert loaders.train.loader.persistent_workers and not loaders.val.loader.persistent_workers
    epoch0, epoch1 = _epoch_batches(loaders, 0), _epoch_batches(loaders, 1)
    assert len(epoch0) == len(epoch1) == 8
    # Same samples in the same order per epoch is not the point: with the sampler's order fixed
    # (seed, epoch), the same sample gets another crop in another epoch.
    loaders.train_sampler.set_epoch(1)
    order1 = [i for _, i in loaders.train_sampler]
    loaders.train_sampler.set_epoch(0)
    order0 = [i for _, i in loaders.train_sampler]
    first = order0.index(order1[0])
    assert not torch.equal(epoch1[0][0], epoch0[first // 32][first % 32])
    resumed = _epoch_batches(build(), 1, skip=3)  # a fresh loader resuming after 3 batches of epoch 1
    assert len(resumed) == 5 and all(torch.equal(a, b) for a, b in zip(resumed, epoch1[3:]))


def test_a_python_that_can_deadlock_a_starting_worker_is_named_when_workers_run(tmp_path, capsys):
    """CPython before 3.11.10 can leave a forked worker deadlocked before its first line
    (gh-112275); a run with workers on such a Python says so, in the log and in --check."""
    from ddp_utils.data.pipeline import worker_start_hazard

    assert worker_start_hazard(2, (3, 11, 7)) == (
        "Python 3.11.7 can deadlock a DataLoader worker as it starts, leaving the run waiting for ever "
        "(CPython gh-112275, fixed in 3.11.10 and 3.12); use a newer Python, or --workers 0")
    assert worker_start_hazard(2, (3, 10, 14)) is not None
    assert worker_start_hazard(0, (3, 11, 7)) is None
    assert worker_start_hazard(2, (3, 11, 10)) is None and worker_start_hazard(2, (3, 12, 1)) is None
    root = tmp_path / "folder"
    write_image_folder(root / "train", per_class=4)
    write_image_folder(root / "val", per_class=2)
    hazard = worker_start_hazard(1)
    proc = in_process(train_classifier.main, ["--dataset", "imagefolder", "--data-dir", str(root), "--device", "cpu",
                                              "--workers", "1", "--batch-size", "8", "--check", "--out", str(tmp_path / "run")],
                      capsys)
    assert proc.returncode == 0
    assert (f"warning: {hazard}" in proc.stdout) == (hazard is not None)


def test_imagefolder_on_the_device_splits_the_work_and_stays_seeded(tmp_path):
    """ImageFolder with --aug-on device: workers decode and pack each batch, the device crops and
    augments every view as a batch, keyed by (seed, epoch, index); then a MoCo run through the CLI."""
    from ddp_utils.data.files_on_device import FinishOnDevice

    write_image_folder(tmp_path / "tree")
    tree = str(tmp_path / "tree")

    def first_batches(epoch: int):
        loaders = build_data(plan(dataset="imagefolder", data_dir=tree, batch_size=4, views=2, aug_on_device=True,
                                  recipe=moco_recipe("imagefolder", 32, "v2")), rank=0, world_size=1, device=CPU)
        assert isinstance(loaders.train, FinishOnDevice) and isinstance(loaders.val, FinishOnDevice)
        loaders.set_epoch(epoch)
        return next(iter(loaders.train))

    (query, key), labels = first_batches(0)
    assert query.shape == key.shape == (4, 3, 32, 32) and query.dtype == torch.float32 and len(labels) == 4
    assert not torch.equal(query, key)  # two views
    (query_again, key_again), _ = first_batches(0)
    assert torch.equal(query, query_again) and torch.equal(key, key_again)  # seeded per sample
    (query_next, _), _ = first_batches(1)
    assert not torch.equal(query, query_next)  # a new epoch: another order and other draws

    out = tmp_path / "run"
    proc = run_cli("train_moco.py", ["--dataset", "imagefolder", "--data-dir", tree, "--image-size", "32",
                                     "--aug-on", "device", "--device", "cpu", "--batch-size", "8",
                                     "--moco-k", "64", "--max-steps", "2", "--knn-every", "0", "--out", str(out)])
    assert_ok(proc)
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 2
    # TensorBoard's images tab: 8 training images, each beside its query and key view (32 px
    # enlarged to 64, make_grid's 2 px padding): a 14 px header, 3 columns x 8 rows, written once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0})
    events.Reload()
    (grid,) = events.Images("data/augmented_views")
    assert (grid.step, grid.width, grid.height) == (0, 3 * 66 + 2, 14 + 8 * 66 + 2)


@pytest.mark.parametrize("size, views, tile", [(16, 2, 64), (32, 1, 64), (96, 2, 96)])
def test_the_preview_enlarges_small_images_and_names_its_columns(size, views, tile):
    """Digits at 16, 32 and 96 px, one or two views: 8 rows of tiles of at least 64 px, a header
    with each column's name, and small images enlarged by whole pixels (nearest neighbour)."""
    from ddp_utils.data.preview import augmentation_grid

    recipe = moco_recipe("digits", size, "v2") if views == 2 else classifier_recipe("digits", size)
    loaders = build_data(plan(image_size=size, recipe=recipe, views=views, aug_on_device=True), rank=0, world_size=1,
                         device=CPU)
    grid = augmentation_grid(loaders)
    columns = 1 + views
    assert grid.shape == (3, 14 + 8 * (tile + 2) + 2, columns * (tile + 2) + 2)
    header = grid[:, :14]
    for column in range(columns):  # each column's label: dark pixels in its own part of the header
        left = 2 + column * (tile + 2)
        assert (header[:, :, left:left + tile] < 0.5).any(), column
    assert (header[:, :, :2] == 1).all()  # the padding column stays white
    scale = tile // size
    for column in range(columns):  # every source pixel a scale x scale square of one value
        first = grid[:, 16:16 + tile, 2 + column * (tile + 2):2 + column * (tile + 2) + tile]
        blocks = first.reshape(3, size, scale, size, scale)
        assert torch.equal(blocks, blocks[:, :, :1, :, :1].expand_as(blocks))


def test_a_subset_of_synthetic_images_generates_only_its_samples():
    """The augmentation preview takes 8 samples: it must not generate the whole split first."""
    from torch.utils.data import Subset

    from ddp_utils.data.sets import in_memory_tensors

    class Counted(SyntheticImages):
        calls = 0

        def __getitem__(self, index):
            Counted.calls += 1
            return super().__getitem__(index)

    images, labels = in_memory_tensors(Subset(Counted(5000, 8), [7, 4000, 12]))
    assert Counted.calls == 3 and images.shape == (3, 3, 8, 8)
    whole = SyntheticImages(5000, 8)
    assert torch.equal(images[1], whole[4000][0]) and labels.tolist() == [whole[i][1] for i in (7, 4000, 12)]


def test_padded_for_crop_resizes_a_chunk_at_a_time(monkeypatch):
    """The stored split is resized once to the output size, ``chunk`` images at a time (a whole
    CIFAR-10 split in float at 224 px would take 30 GB), with the result of one pass."""
    import ddp_utils.data.pipeline as pipeline
    from ddp_utils.data.batch_augment import BatchAugment

    augment = BatchAugment(classifier_recipe("cifar10", 12, augment=True), 12)
    assert augment.recipe.pad_crop
    images = torch.randint(0, 256, (10, 3, 8, 8), dtype=torch.uint8)
    whole = pipeline.padded_for_crop(images, augment)
    sizes, interpolate = [], pipeline.F.interpolate
    monkeypatch.setattr(pipeline.F, "interpolate", lambda x, **kw: sizes.append(len(x)) or interpolate(x, **kw))
    chunked = pipeline.padded_for_crop(images, augment, chunk=4)
    assert sizes == [4, 4, 2] and chunked.dtype == torch.uint8 and chunked.shape == (10, 3, 12, 12)
    assert torch.equal(chunked, whole)


def test_device_batches_come_in_the_networks_memory_format(monkeypatch):
    """Augmented on the device, a batch is written straight in the network's layout (CUDA:
    channels_last), so nothing re-lays it before the first convolution."""
    import ddp_utils.data.batch_augment as ba

    augment = ba.DeviceAugment(ba.BatchAugment(moco_recipe("cifar10", 16, "v2", 0.2), 16), seed=0, views=2)
    images, index = torch.rand(6, 3, 16, 16), torch.arange(6)
    plain = augment(images, 0, index)
    monkeypatch.setattr(ba, "memory_format", lambda device: torch.channels_last)
    nhwc = augment(images, 0, index)
    for a, b in zip(plain, nhwc):
        assert b.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(a, b)


def test_device_evaluation_batches_equal_the_evaluation_loader():
    """In-memory splits are evaluated from the copy on the device, batched there: the same
    images, labels and order as the loader path's per-sample evaluation view, on each rank's shard."""
    from ddp_utils.data.pipeline import DeviceBatches

    for rank in (0, 1):
        batches = build_data(plan(batch_size=16, aug_on_device=True), rank=rank, world_size=2, device=CPU).val
        loader = build_data(plan(batch_size=16), rank=rank, world_size=2, device=CPU).val
        assert isinstance(batches, DeviceBatches) and len(batches) == len(loader) == 3
        for (x, y), (x_ref, y_ref) in zip(batches, loader, strict=True):
            assert torch.equal(y, y_ref)
            torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-6)


def test_the_knn_bank_of_in_memory_data_is_batched_from_the_training_tensor():
    """MoCo's kNN bank (a fixed subset of the training split) comes from the images the training
    batches already hold on the device: the loader path's images, labels and order, on each rank."""
    from ddp_utils.data.pipeline import DeviceBatches

    for rank in (0, 1):
        moco = dict(batch_size=16, recipe=moco_recipe("digits", 32, "v1", 0.2), views=2, bank_samples=300)
        loaders = build_data(plan(**moco, aug_on_device=True), rank=rank, world_size=2, device=CPU)
        assert isinstance(loaders.bank, DeviceBatches) and isinstance(loaders.val, DeviceBatches)
        assert loaders.bank.images is loaders.train.images  # no second copy on the device
        reference = build_data(plan(**moco), rank=rank, world_size=2, device=CPU).bank
        assert len(loaders.bank) == len(reference) == 3
        for (x, y), (x_ref, y_ref) in zip(loaders.bank, reference, strict=True):
            assert torch.equal(y, y_ref)
            torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-6)


def test_the_next_device_batch_can_be_made_early_without_changing_any_batch():
    """The training loop asks for batch i+1's augmentation before step i's host read, so the
    device has it queued while the host waits: the batches are those of plain iteration."""
    made = []
    loaders = build_data(plan(batch_size=100, aug_on_device=True), rank=0, world_size=1, device=CPU)
    augment = loaders.train.augment
    loaders.train.augment = lambda images, epoch, index: made.append(index[0].item()) or augment(images, epoch, index)
    loaders.set_epoch(0)
    plain = list(loaders.train)
    batches, early = iter(loaders.train), []
    for step in range(len(plain)):
        made.clear()
        batches.prepare_next()
        assert len(made) == 1  # made now, not when next() hands it out
        batches.prepare_next()  # asking twice makes nothing more
        early.append(next(batches))
        assert len(made) == 1
    batches.prepare_next()
    assert next(batches, None) is None
    for (x, y), (x_ref, y_ref) in zip(early, plain, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_auto_workers_count_the_cpus_this_process_may_use(tmp_path, monkeypatch, caplog):
    """--workers -1 sizes the pools from the CPUs this process may run on (SLURM's cpuset,
    taskset), shared by the ranks that share them, not from every core of the machine."""
    import subprocess
    import sys

    from helpers import cli_env

    from ddp_utils.data import pipeline
    from ddp_utils.train.preflight import describe_settings, resolved_settings

    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", "from ddp_utils.data.pipeline import "
                             "usable_cpus, default_workers; print(usable_cpus(), default_workers('imagefolder', 1))"],
                            env=cli_env(), capture_output=True, text=True, timeout=60)
    assert pinned.stdout.split() == ["1", "1"], pinned.stderr  # one CPU: one worker, not the machine's
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [pipeline.default_workers("imagefolder", n) for n in (1, 2, 4, 8)] == [15, 7, 3, 1]
    assert pipeline.default_workers("digits", 1) == 0  # in-memory data needs none
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: set(range(112)))  # a DGX H100: 8 GPUs
    assert pipeline.default_workers("imagefolder", 8) == 13  # every core but the rank's own, no cap
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: set(range(16)))
    cfg = train_classifier.ClassifierConfig(dataset="imagefolder", workers=-1)
    for launcher, per_rank in (("torchrun", 7), ("slurm", 15)):  # torchrun's 2 workers share the CPUs
        resolved = resolved_settings(cfg, launcher, 2, torch.device("cpu"), world_size=2)
        assert resolved.workers == per_rank
    assert describe_settings(cfg, resolved_settings(cfg, "torchrun", 2, torch.device("cpu"), world_size=2), "torchrun", 2).endswith(
        "7 DataLoader worker(s) per rank (--workers -1: 16 usable CPUs shared by 2 rank(s))")


# ----------------------------------------------------------------------------- image files: batches made ahead
# A FinishOnDevice's thread (its batches, its errors, its end), the stream contract through a stand-in
# for CUDA, the images the device's decoder refuses and the hardware-decoder probe
# (ddp_utils/data/files_on_device.py, ddp_utils/data/data_stream.py), the CPU as the device.
def files_plan(folder, decode_on_device: bool, workers: int = 1, views: int = 2) -> DataPlan:
    return DataPlan(dataset="imagefolder", data_dir=str(folder), image_size=32, synthetic_samples=0, debug=False,
                    seed=0, batch_size=5, workers=workers, normalization="auto",
                    recipe=moco_recipe("imagefolder", 32, "v2"), views=views, aug_on_device=True,
                    decode_on_device=decode_on_device, bank_samples=0)


def same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(y1, y2)
        for v1, v2 in zip(x1 if isinstance(x1, tuple) else [x1], x2 if isinstance(x2, tuple) else [x2]):
            assert torch.equal(v1, v2)


def threads_ahead() -> set[threading.Thread]:
    """The FinishOnDevice threads running (another test's run stopped mid-epoch may leave its own
    until the garbage collector takes the run: each test counts those it started)."""
    return {t for t in threading.enumerate() if t.name == THREAD_NAME}


@pytest.mark.parametrize("decode_on_device", [False, True], ids=["workers-decode", "device-decodes"])
def test_the_threads_batches_are_the_loops_own_bit_for_bit(jpeg_folder, decode_on_device):
    """Two epochs of training batches (each asked for early with prepare_next, as the loop does),
    validation and the kNN bank: made by a thread of their own, then with no thread (``ahead``
    0: each batch made on the loop's thread when asked): the same batches in the same order, bit
    for bit; no thread is left once each pass is over."""
    assert AHEAD >= 1
    before = threads_ahead()

    def passes(ahead: int) -> list:
        loaders = build_data(files_plan(jpeg_folder, decode_on_device), rank=0, world_size=1, device=CPU)
        for batches in (loaders.train, loaders.val, loaders.bank):
            batches.ahead = ahead
        made = []
        for epoch in (0, 1):
            loaders.set_epoch(epoch)
            it = iter(loaders.train)
            for _ in range(len(loaders.train)):
                it.prepare_next()
                it.prepare_next()  # asking twice changes nothing
                made.append(next(it))
            it.prepare_next()
            assert next(it, None) is None
        made += [*loaders.val, *loaders.bank]
        return made

    threaded = passes(AHEAD)
    assert threads_ahead() <= before
    same_batches(threaded, passes(0))


class Batches:
    """A loader stand-in: ``batches`` collated batches, then ``error`` raised (if any)."""

    def __init__(self, batches: list, error: BaseException | None = None):
        self.batches, self.error, self.batch_size = batches, error, 5

    def __len__(self) -> int:
        return len(self.batches) + (self.error is not None)

    def __iter__(self):
        yield from self.batches
        if self.error is not None:
            raise self.error


def collated(jpeg_folder, decode_on_device: bool, count: int) -> tuple[FinishOnDevice, list]:
    """A FinishOnDevice of the training split and ``count`` of its loader's collated batches."""
    finish = build_data(files_plan(jpeg_folder, decode_on_device, workers=0), rank=0, world_size=1,
                        device=CPU).train
    finish.loader.sampler.set_epoch(0)
    taken = []
    for batch in finish.loader:
        taken.append(batch)
        if len(taken) == count:
            return finish, taken
    raise AssertionError("too few batches")


def test_an_error_of_the_thread_reaches_the_loop_at_its_batch_as_it_was_raised(jpeg_folder):
    """The loader fails (the store's fault) after two batches: the loop gets both, equal to those
    made on its own thread, then the store's error itself (its type, its traceback through the
    loader), then the end; the thread is gone."""
    finish, taken = collated(jpeg_folder, decode_on_device=True, count=2)
    expected = [finish.finish(batch) for batch in taken]
    fault = StoreUnavailable("s3://bucket/train-00003.tar", "timed out after 300 s")
    finish.loader = Batches(taken, fault)
    before = threads_ahead()
    it = iter(finish)
    same_batches([next(it), next(it)], expected)
    with pytest.raises(StoreUnavailable) as raised:
        next(it)
    assert raised.value is fault and "timed out after 300 s" in str(raised.value)
    assert "__iter__" in [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]  # the loader's
    assert next(it, None) is None
    assert threads_ahead() <= before


class WatchedLoader:
    """A DataLoader whose iterators and worker processes can be looked at after they go."""

    def __init__(self, loader):
        self.loader, self.batch_size = loader, loader.batch_size
        self.persistent_workers, self.num_workers = loader.persistent_workers, loader.num_workers
        self.iterators: list[weakref.ref] = []
        self.workers: set = set()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        before = set(multiprocessing.active_children())
        it = iter(self.loader)
        self.workers |= set(multiprocessing.active_children()) - before
        self.iterators.append(weakref.ref(it))
        return it


@pytest.mark.parametrize("how", ["dropped", "closed", "exhausted"])
def test_the_thread_and_the_loaders_workers_end_with_the_iterator(jpeg_folder, how):
    """With garbage collection off (a reference cycle would keep them): the iterator of a loader
    whose 2 workers start with each pass (as evaluation's do), dropped after one batch (the thread
    waiting on a full hand-over), closed after one, or read to its end: the thread has ended, the
    loader's iterator is gone and its workers have exited when that returns."""
    finish = build_data(files_plan(jpeg_folder, decode_on_device=False, workers=0), rank=0, world_size=1,
                        device=CPU).train
    finish.loader.sampler.set_epoch(0)
    finish.loader = WatchedLoader(torch.utils.data.DataLoader(
        finish.loader.dataset, batch_size=5, sampler=finish.loader.sampler, num_workers=2, collate_fn=collate_files,
        drop_last=True))
    gc.collect()
    gc.disable()
    try:
        before = threads_ahead()
        it = iter(finish)
        next(it)
        assert len(threads_ahead() - before) == 1 and len(finish.loader.workers) == 2
        if how == "dropped":
            del it
        elif how == "closed":
            it.close()
        else:
            assert len(list(it)) == len(finish) - 1
        assert threads_ahead() <= before
        assert [ref() for ref in finish.loader.iterators] == [None]
        assert not any(worker.is_alive() for worker in finish.loader.workers)
    finally:
        gc.enable()


def test_a_pass_left_early_keeps_no_made_batch_and_every_pass_lets_its_float_atlas_go(jpeg_folder):
    """The training loop leaves its epoch after one batch (--max-steps): the pass's thread has
    stopped when the loop's ``for`` is left, its made batches dropped and the float atlas let go;
    validation read to its end lets its atlas go; after ``Loaders.close`` no thread is left."""
    from ddp_utils.train.run import RunState, TrainingBatches

    loaders = build_data(files_plan(jpeg_folder, decode_on_device=True), rank=0, world_size=1, device=CPU)
    finish = loaders.train
    before = threads_ahead()
    batches = TrainingBatches(loaders, RunState(), 1, torch.nn.Linear(1, 1), CPU)
    for _ in batches.this_epoch():
        assert len(threads_ahead() - before) == 1 and finish.augment.atlas_bytes > 0
        break
    assert threads_ahead() <= before and finish.augment.atlas_bytes == 0
    assert len(list(loaders.val)) == len(loaders.val) and loaders.val.augment.atlas_bytes == 0
    it = iter(loaders.bank)
    next(it)
    assert len(threads_ahead() - before) == 1
    loaders.close()
    assert threads_ahead() <= before and loaders.bank.augment.atlas_bytes == 0


def test_a_process_that_exits_mid_epoch_exits(jpeg_folder):
    """A script that takes one batch and exits, its thread waiting on a full hand-over and its
    loader's persistent workers up: it exits at once, with its code."""
    script = ("import sys, torch\n"
              "from ddp_utils.data.pipeline import DataPlan, build_data\n"
              "from ddp_utils.data.recipes import moco_recipe\n"
              f"plan = DataPlan(dataset='imagefolder', data_dir={str(jpeg_folder)!r}, image_size=32, "
              "synthetic_samples=0, debug=False, seed=0, batch_size=5, workers=2, normalization='auto', "
              "recipe=moco_recipe('imagefolder', 32, 'v2'), views=2, aug_on_device=True, decode_on_device=True)\n"
              "loaders = build_data(plan, rank=0, world_size=1, device=torch.device('cpu'))\n"
              "loaders.set_epoch(0)\nit = iter(loaders.train)\nnext(it)\nprint('one batch')\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=cli_env())
    assert proc.returncode == 3 and "one batch" in proc.stdout, proc.stderr


class Recorder:
    """A stand-in for ``data_stream.CudaCalls``: every call, in order, with the thread that made it."""

    def __init__(self):
        self.calls: list[tuple[str, str, object]] = []
        self.events: list[Event] = []
        self.inside = threading.local()

    def note(self, what: str, detail: object = None) -> None:
        self.calls.append((threading.current_thread().name, what, detail))

    def new_stream(self, device):
        return Stream(self, "data")

    def use(self, stream):
        recorder = self

        class Use:
            def __enter__(self):
                recorder.note("use", stream.name)
                recorder.inside.stream = stream.name

            def __exit__(self, *exc):
                recorder.inside.stream = None
                recorder.note("used", stream.name)
        return Use()

    def event(self):
        self.events.append(Event(self, len(self.events)))
        return self.events[-1]

    def current_stream(self, device):
        return Stream(self, "training")

    def record_stream(self, tensor, stream) -> None:
        self.note("record_stream", (tensor.data_ptr(), stream.name))


class Stream:
    def __init__(self, recorder: Recorder, name: str):
        self.recorder, self.name = recorder, name

    def wait_stream(self, other: Stream) -> None:
        self.recorder.note("wait_stream", (self.name, other.name))

    def wait_event(self, event: Event) -> None:
        self.recorder.note("wait_event", (self.name, event.number))


class Event:
    def __init__(self, recorder: Recorder, number: int):
        self.recorder, self.number, self.done = recorder, number, False

    def record(self, stream: Stream) -> None:
        self.recorder.note("record", (self.number, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.recorder.note("synchronize", self.number)
        self.done = True


def test_the_data_stream_waits_once_the_training_stream_waits_for_each_batch_and_records_its_tensors():
    """The contract's calls in order: the data stream waits for the current stream when made;
    a batch is made with the data stream current, then its event recorded; handed over, the
    training stream waits for that event, then each device tensor is recorded on it. A pinned
    source is held until its event completes (the oldest waited for beyond HELD_BATCHES)."""
    recorder = Recorder()
    stream = DataStream(CPU, recorder)
    assert [c[1:] for c in recorder.calls] == [("wait_stream", ("data", "training"))]
    recorder.calls.clear()
    views, targets = (torch.zeros(2, 3), torch.ones(2, 3)), torch.arange(2)
    source = torch.zeros(4)
    made = stream.run(lambda: recorder.note("make", recorder.inside.stream) or (views, targets), hold=(source,))
    held = weakref.ref(source)
    del source
    assert made.batch == (views, targets) and held() is not None
    assert [c[1:] for c in recorder.calls] == [("use", "data"), ("make", "data"), ("used", "data"),
                                              ("record", (0, "data"))]
    recorder.calls.clear()
    assert made.hand_over() == (views, targets)
    assert [c[1:] for c in recorder.calls] == [("wait_event", ("training", 0))] + [
        ("record_stream", (t.data_ptr(), "training")) for t in (*views, targets)]
    recorder.events[0].done = True  # its copy is done: the next batch lets its source go
    stream.run(lambda: views, hold=(torch.zeros(1),))
    assert held() is None
    recorder.calls.clear()
    for _ in range(HELD_BATCHES):  # with the last one's, one more than HELD_BATCHES not done
        stream.run(lambda: views, hold=(torch.zeros(1),))
    assert [c[1:] for c in recorder.calls if c[1] == "synchronize"] == [("synchronize", 1)]


def test_a_finish_on_device_makes_each_batch_on_the_data_stream_in_its_thread_and_hands_it_over_in_the_loops(
        jpeg_folder):
    """Through the stand-in, a FinishOnDevice's pass: each batch is augmented in the thread with
    the data stream current and its event recorded there; the loop's thread makes the training
    stream wait for that event before it records the batch's tensors on it; the batches are those
    of the CPU path."""
    finish, taken = collated(jpeg_folder, decode_on_device=True, count=3)
    expected = [finish.finish(batch) for batch in taken]
    recorder = Recorder()
    augment = finish.augment

    class Augment:
        def packed(self, *args):
            recorder.note("augment", recorder.inside.stream)
            return augment.packed(*args)

        def release(self):
            augment.release()

    watched = FinishOnDevice(Batches(taken), Augment(), CPU, finish.decoded, calls=recorder)
    got = list(watched)
    same_batches(got, expected)
    main = threading.current_thread().name
    assert [c for c in recorder.calls if c[1] == "augment"] == [(THREAD_NAME, "augment", "data")] * 3
    for number, (views, targets) in enumerate(got):
        record = recorder.calls.index((THREAD_NAME, "record", (number, "data")))
        wait = recorder.calls.index((main, "wait_event", ("training", number)))
        tensors = [(main, "record_stream", (t.data_ptr(), "training")) for t in (*views, targets)]
        assert record < wait and recorder.calls[wait + 1:wait + 1 + len(tensors)] == tensors


def test_images_the_device_refuses_are_counted_warned_once_and_said_each_epoch(jpeg_folder, tmp_path, capsys,
                                                                               monkeypatch):
    """A device decoder that refuses the first image of every batch: the training process
    decodes it on the CPU (the run trains), one WARNING names the first such file, each epoch's
    line gives the count so far; the start-up line says which decoder decodes."""
    real = files_on_device.decode_on

    def refusing(device, batch):
        images, failed = real(device, batch)
        images[0] = None
        return images, sorted({0, *failed})

    monkeypatch.setattr(files_on_device, "decode_on", refusing)
    proc = in_process(train_classifier.main, ["--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--device",
                                              "cpu", "--arch", "small_cnn", "--image-size", "32", "--workers", "1",
                                              "--aug-on", "device", "--decode-on", "device", "--batch-size", "8",
                                              "--epochs", "2", "--out", str(tmp_path / "run")], capsys)
    assert_ok(proc)
    assert "INFO data: JPEGs decoded on cpu by libjpeg-turbo (torchvision's decode_jpeg; no hardware decoder)" \
        in proc.stdout
    warned = [line for line in proc.stdout.splitlines() if "WARNING" in line and "decoder refused" in line]
    assert len(warned) == 1 and "WARNING --decode-on device: the cpu decoder refused 1 image(s) of a batch" in warned[0]
    assert str(jpeg_folder) in warned[0]
    said = [int(n.replace(",", "")) for n in re.findall(r"epoch \d+ trained in .*; ([\d,]+) image\(s\) the cpu "
                                                       r"decoder refused decoded on the CPU so far\)", proc.stdout)]
    assert len(said) == 2 and 4 <= said[0] < said[1]  # 4 training batches an epoch at least, then more


def test_the_fallback_count_is_shared_and_the_warning_said_once(caplog):
    fallbacks = DecodeFallbacks()
    with caplog.at_level("WARNING", logger="train"):
        fallbacks.add(torch.device("cuda", 0), "/data/a.JPEG", 3)
        fallbacks.add(torch.device("cuda", 0), "/data/b.JPEG")
    assert fallbacks.count == 4
    assert [r.getMessage() for r in caplog.records] == [
        "--decode-on device: the cuda decoder refused 3 image(s) of a batch (/data/a.JPEG among them); the training "
        "process decodes such images on the CPU, which is slower; each epoch's line counts them"]


class FakeNvjpeg:
    """libnvjpeg's two calls the probe makes, answering ``status``."""

    def __init__(self, status: int):
        self.status, self.calls = status, []

    def nvjpegCreateEx(self, backend, device_allocator, pinned_allocator, flags, handle):
        self.calls.append(("create", backend, device_allocator, pinned_allocator, flags))
        return self.status

    def nvjpegDestroy(self, handle):
        self.calls.append(("destroy",))
        return 0


@pytest.mark.parametrize("status, kind", [(NVJPEG_STATUS_SUCCESS, "hardware"),
                                          (NVJPEG_STATUS_ARCH_MISMATCH, "software"), (6, "unknown")])
def test_the_probe_asks_nvjpeg_for_its_hardware_backend_as_torchvision_does(status, kind):
    """torchvision's CUDAJpegDecoder creates its handle with NVJPEG_BACKEND_HARDWARE (3), no
    allocators, default flags: success means the engine decodes, ARCH_MISMATCH software; the probe
    makes the same call and lets a handle it got go."""
    nvjpeg = FakeNvjpeg(status)
    found, detail = nvjpeg_backend(CPU, nvjpeg)
    assert found == kind and nvjpeg.calls[0] == ("create", 3, None, None, 0)
    assert (("destroy",) in nvjpeg.calls) == (kind == "hardware")
    assert kind != "unknown" or "returned status 6" in detail


def test_the_probe_reads_the_libnvjpeg_torchvision_loaded():
    nvjpeg, why = torchvision_nvjpeg()
    if nvjpeg is None:
        pytest.skip(f"torchvision without nvJPEG here: {why}")
    assert "libnvjpeg" in repr(nvjpeg) and why == ""
    assert describe_decoder(CPU).startswith("JPEGs decoded on cpu by libjpeg-turbo")
