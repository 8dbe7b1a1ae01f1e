"""Data sets and transforms: the embedded digits, an ImageFolder tree, synthetic tensors."""
from __future__ import annotations

import torch
from helpers import assert_ok, in_process, load_ckpt, run_cli, run_on_ranks, write_image_folder

import train_classifier
from ddp_utils.data.loading import SeededTransform, make_loaders
from ddp_utils.data.recipes import classifier_recipe, moco_recipe
from ddp_utils.data.sets import DigitsDataset, SyntheticImages, load_split
from ddp_utils.data.transforms import eval_transform, training_augmentation, view_transform


def classification_transforms(dataset: str, size: int, augment: bool):
    """(train, eval) per-sample transforms of train_classifier.py's loader path."""
    return view_transform(classifier_recipe(dataset, size, augment), dataset, size), eval_transform(dataset, size)


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
    raw = load_split("imagefolder", str(tmp_path / "tree"), train=True, size=48)
    train_tf, eval_tf = classification_transforms("imagefolder", 48, augment=True)
    loaders = make_loaders(raw, load_split("imagefolder", str(tmp_path / "tree"), False, 48),
                           train_tf, eval_tf, batch_size=4, workers=0, seed=0, rank=0,
                           world_size=1, pin_memory=False)
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
    from ddp_utils.train.build import download_once_per_node
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


def _epoch_batches(loaders, epoch: int, skip: int = 0) -> list[torch.Tensor]:
    loaders.set_epoch(epoch, skip_batches=skip)
    return [images for images, _ in loaders.train]


def test_persistent_workers_see_each_epoch_and_resume_exactly():
    """Training workers live across epochs (persistent_workers; the evaluation loaders' workers
    leave after each pass, so a rank keeps one resident pool): the epoch reaches them with every index,
    so augmentation changes between epochs and a loader started mid-epoch (a resume) yields the
    very batches an uninterrupted one does."""
    raw = DigitsDataset(train=True)
    train_tf, eval_tf = classification_transforms("digits", 32, augment=True)

    def build():
        return make_loaders(torch.utils.data.Subset(raw, range(64)), DigitsDataset(train=False), train_tf,
                            eval_tf, batch_size=8, workers=2, seed=0, rank=0, world_size=1, pin_memory=False)

    loaders = build()
    assert loaders.train.persistent_workers and not loaders.val.persistent_workers
    epoch0, epoch1 = _epoch_batches(loaders, 0), _epoch_batches(loaders, 1)
    assert len(epoch0) == len(epoch1) == 8
    # Same samples in the same order per epoch is not the point: with the sampler's order fixed
    # (seed, epoch), the same sample gets another crop in another epoch.
    loaders.train_sampler.set_epoch(1)
    order1 = [i for _, i in loaders.train_sampler]
    loaders.train_sampler.set_epoch(0)
    order0 = [i for _, i in loaders.train_sampler]
    first = order0.index(order1[0])
    assert not torch.equal(epoch1[0][0], epoch0[first // 8][first % 8])
    resumed = _epoch_batches(build(), 1, skip=3)  # a fresh loader resuming after 3 batches of epoch 1
    assert len(resumed) == 5 and all(torch.equal(a, b) for a, b in zip(resumed, epoch1[3:]))


def test_imagefolder_on_the_device_splits_the_work_and_stays_seeded(tmp_path):
    """ImageFolder with --aug-on device: workers decode and crop each view, the device does the
    rest as a batch, keyed by the same (seed, epoch, index); then a MoCo run through the CLI."""
    from ddp_utils.data.loading import DeviceFinish

    write_image_folder(tmp_path / "tree")
    tree = str(tmp_path / "tree")
    eval_tf = eval_transform("imagefolder", 32)

    def first_batches(epoch: int):
        per_sample, on_device = training_augmentation(moco_recipe("imagefolder", 32, "v2"), "imagefolder", 32,
                                                      seed=0, views=2, on_device=True)
        loaders = make_loaders(load_split("imagefolder", tree, True, 32), load_split("imagefolder", tree, False, 32),
                               per_sample, eval_tf, batch_size=4, workers=0, seed=0, rank=0, world_size=1,
                               pin_memory=False, device_augment=on_device, device=torch.device("cpu"))
        assert isinstance(loaders.train, DeviceFinish)
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
    # TensorBoard's images tab: 8 training images, each beside its query and key view (32 px,
    # make_grid's 2 px padding): 3 columns x 8 rows, written once, at step 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0})
    events.Reload()
    (grid,) = events.Images("data/augmented_views")
    assert (grid.step, grid.width, grid.height) == (0, 3 * 34 + 2, 8 * 34 + 2)
