"""Data sets and transforms: the embedded digits, an ImageFolder tree, synthetic tensors."""
from __future__ import annotations

import torch
from helpers import assert_ok, load_ckpt, run_cli, run_on_ranks, write_image_folder

from ddp_utils.data import (
    DigitsDataset,
    SeededTransform,
    SyntheticImages,
    classification_transforms,
    load_split,
    make_loaders,
)


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
    first = [aug[i][0] for i in range(8)]
    assert all(torch.equal(a, aug[i][0]) for i, a in enumerate(first))  # same (seed, epoch, index)
    aug.set_epoch(1)
    assert any(not torch.equal(a, aug[i][0]) for i, a in enumerate(first))  # a new epoch re-draws
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


def test_imagefolder_loads_and_trains(tmp_path):
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
    proc = run_cli("train_classifier.py", ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "tree"),
                                           "--image-size", "48", "--arch", "resnet18", "--batch-size", "6",
                                           "--epochs", "1", "--device", "cpu", "--workers", "1",
                                           "--out", str(out)])
    assert_ok(proc)
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 36 // 6
    assert "(36 images)" in proc.stdout


def _download_worker(info, data_dir: str):
    """CIFAR-10 with --download on 2 ranks, torchvision's CIFAR10 replaced by a recorder: one node
    (both ranks local), two nodes (each rank a node's local rank 0), and a failing download."""
    import dataclasses

    from torchvision import datasets

    from ddp_utils.config import UsageError
    from ddp_utils.trainer import download_once_per_node
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
