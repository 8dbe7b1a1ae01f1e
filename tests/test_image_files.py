"""ImageFolder runs on JPEGs made from real photographs: CMYK, grayscale and PNG-named-JPEG files
decode as RGB on every path; a file that cannot be decoded is named once, with its reason, and
the run stops with exit code 2 after a checkpoint of its last completed step, which resumes once
the file is fixed, to the weights of a run that never met it; --check-data lists every such
file; the share of time spent waiting for data is logged; the log and config.json say what
"auto" resolved to; the launchers run ImageFolder jobs to the end."""
from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    assert_ok,
    assert_same_state,
    cli_env,
    in_process,
    load_ckpt,
    read_scalars,
    run_ranks,
)

import train_classifier
import train_moco
from ddp_utils.data.image_files import (
    PLACEHOLDER_SIDE,
    FolderListing,
    ImageFiles,
    UnreadableImage,
    data_fingerprint,
    decode_rgb,
)
from ddp_utils.data.order import ResumableDistributedSampler
from ddp_utils.data.pipeline import LoaderBatches, SeededTransform, build_data
from ddp_utils.data.preview import augmentation_grid
from ddp_utils.data.recipes import moco_recipe
from ddp_utils.data.unreadable import UnreadableFiles
from ddp_utils.runtime.dist import DistInfo
from ddp_utils.train.preflight import resolved_settings
from ddp_utils.train.train_config import data_plan

CPU = DistInfo(0, 0, 1, 1, torch.device("cpu"), None, "single")
# small_cnn at 32 px on the full-size JPEGs: decoding is most of the work
FOLDER_RUN = ["--dataset", "imagefolder", "--device", "cpu", "--arch", "small_cnn", "--image-size", "32",
              "--workers", "0", "--log-every", "1"]


def damage(path: Path, how: str) -> None:
    """Make ``path`` a file no decoder can read: cut to a third, emptied, text, or (a baseline
    JPEG) "undefined-table": whole, with the markers the device decoder's check reads, but its
    frame names a quantization table that no DQT defines, so only decoding finds it."""
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    elif how == "undefined-table":
        data, at = path.read_bytes(), 2
        while data[at + 1] not in (0xC0, 0xC1):  # to the frame header (SOF0/1)
            at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
        tq = at + 12  # after marker, length, precision, height, width, components, and its id and sampling
        path.write_bytes(data[:tq] + b"\x03" + data[tq + 1:])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.write_text("<html><body>404 Not Found</body></html>\n")


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "data"))


def file_met_at_batch(data: Path, batch: int, batch_size: int, world_size: int = 1, rank: int = 0,
                      baseline: bool = False) -> Path:
    """The training file rank ``rank`` of a run (seed 0) meets in batch ``batch`` of its first
    epoch (``baseline``: one that the device decoder is given)."""
    files = ImageFiles(FolderListing.of(str(data / "train")))
    encoded = files.reading("encoded")
    sampler = ResumableDistributedSampler(files, world_size, rank, seed=0)
    sampler.set_epoch(0)
    order = [i for _, i in sampler][batch * batch_size:(batch + 1) * batch_size]
    # the preview's samples (0..7) are tested on their own
    index = next(i for i in order if i >= 8 and (not baseline or encoded[i][0].dim() == 1))
    return Path(files.samples[index][0])


# ----------------------------------------------------------------------------- decoding
def test_odd_files_decode_as_rgb_and_damaged_ones_are_named_with_their_reason(jpeg_folder, tmp_path):
    odd = jpeg_folder / "train/n00000000"
    for name in ("odd_cmyk.JPEG", "odd_gray.JPEG", "odd_png.JPEG"):
        image = decode_rgb(str(odd / name))
        assert image.mode == "RGB" and image.size == (500, 375), name
    gray = torch.from_numpy(np.array(decode_rgb(str(odd / "odd_gray.JPEG"))))  # H x W x 3
    assert torch.equal(gray[..., 0], gray[..., 1]) and torch.equal(gray[..., 1], gray[..., 2])
    data = copy_of(jpeg_folder, tmp_path)
    reasons = {"truncated": "image file is truncated", "empty": "empty file", "text": "not an image file PIL can read"}
    for i, (how, reason) in enumerate(reasons.items()):
        path = data / f"train/n00000001/train_0001_{i:05d}.JPEG"
        damage(path, how)
        with pytest.raises(UnreadableImage) as err:
            decode_rgb(str(path))
        assert err.value.path == str(path) and err.value.reason.startswith(reason)
        assert str(err.value) == f"{path} ({err.value.reason})" and "\n" not in str(err.value)


def test_a_damaged_file_comes_as_a_placeholder_that_the_batches_record_on_the_host(jpeg_folder, tmp_path):
    data = copy_of(jpeg_folder, tmp_path)
    files = ImageFiles(FolderListing.of(str(data / "train")))
    bad = [i for i, (path, _) in enumerate(files.samples) if Path(path).name == "train_0002_00003.JPEG"][0]
    damage(Path(files.samples[bad][0]), "empty")
    image, target = files[bad]
    assert target == -1 - bad and image.size == (PLACEHOLDER_SIDE, PLACEHOLDER_SIDE) and image.getbbox() is None
    from torchvision.transforms import v2 as T

    seeded = SeededTransform(files, T.Compose([T.ToImage(), T.Resize((8, 8)), T.ToPureTensor()]), seed=0)
    unreadable = UnreadableFiles()
    loader = LoaderBatches(torch.utils.data.DataLoader(seeded, batch_size=13, num_workers=1),
                           functools.partial(unreadable.record, files=files))
    targets = torch.cat([t for _, t in loader])
    assert len(targets) == len(files) and (targets >= 0).all()  # every batch with valid labels
    assert [e.path for e in unreadable.found] == [files.samples[bad][0]]  # recorded once, by name
    assert unreadable.found[0].reason == "empty file"


@pytest.mark.parametrize("aug_on, decode_on", [("loader", "auto"), ("device", "loader"), ("device", "device")])
def test_cmyk_grayscale_and_png_named_jpeg_are_rgb_on_every_path(jpeg_folder, aug_on, decode_on):
    """Training (both views), evaluation, the kNN bank and the preview: every sample 3 x 32 x 32,
    the odd files among them, and none taken for a damaged file."""
    cfg = train_moco.MocoConfig(dataset="imagefolder", data_dir=str(jpeg_folder), image_size=32, batch_size=13,
                                workers=0, aug_on=aug_on, decode_on=decode_on, device="cpu", moco_k=64)
    resolved = resolved_settings(cfg, "single", 1, CPU.device, world_size=1)
    recipe = moco_recipe(cfg.dataset, resolved.image_size, cfg.aug, cfg.crop_min, cfg.normalization)
    loaders = build_data(data_plan(cfg, resolved, recipe, train_moco.script_data(cfg)),
                         rank=0, world_size=1,
                         device=CPU.device)
    loaders.set_epoch(0)
    seen = 0
    for (im_q, im_k), targets in loaders.train:
        assert im_q.shape == im_k.shape == (13, 3, 32, 32) and torch.isfinite(im_q).all()
        seen += len(targets)
    assert seen == 39  # all of them, the three odd files included
    for split in (loaders.val, loaders.bank):
        images = torch.cat([x for x, _ in split])
        assert images.shape[1:] == (3, 32, 32) and len(images) in (12, 39)
    grid = augmentation_grid(loaders)  # its rows are samples 0..7: the odd files first
    assert grid.shape[0] == 3
    assert not loaders.unreadable


# ----------------------------------------------------------------------------- --check-data
def test_check_data_lists_every_file_that_cannot_be_decoded(jpeg_folder, tmp_path, capsys):
    data = copy_of(jpeg_folder, tmp_path)
    broken = {"truncated": data / "train/n00000001/train_0001_00004.JPEG",
              "empty": data / "train/n00000002/train_0002_00007.JPEG", "text": data / "val/n00000000/val_0000_00001.JPEG"}
    for how, path in broken.items():
        damage(path, how)
    args = FOLDER_RUN + ["--batch-size", "4", "--out", str(tmp_path / "run")]
    proc = in_process(train_classifier.main, args + ["--data-dir", str(data), "--check-data"], capsys)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[0] == ("train_classifier.py: error: --check-data: 3 of 51 image files cannot be decoded; fix or "
                        "remove them:")
    expected = {broken["truncated"]: "image file is truncated", broken["empty"]: "empty file",
                broken["text"]: "not an image file PIL can read"}
    listed = dict(re.fullmatch(r"  (\S+) \((.*)\)", line).groups() for line in lines[1:])
    assert {Path(path): reason.split(" (")[0] for path, reason in listed.items()} == expected
    assert not (tmp_path / "run").exists()
    proc = in_process(train_classifier.main, args + ["--data-dir", str(jpeg_folder), "--check-data"], capsys)
    assert proc.returncode == 0 and re.search(r"  data check: all 51 image files decode \([\d.]+ s on \d+ threads?\)",
                                              proc.stdout)
    proc = in_process(train_classifier.main, ["--check-data", "--device", "cpu"], capsys)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "--check-data does nothing with --dataset digits; drop it (it applies to imagefolder and shards)")


# ----------------------------------------------------------------------------- a file met during a run
DECODE_ON_DEVICE = ["--aug-on", "device", "--decode-on", "device"]


@pytest.mark.parametrize("path, how, reason", [
    ([], "truncated", "image file is truncated"),
    (["--aug-on", "device"], "truncated", "image file is truncated"),
    (DECODE_ON_DEVICE, "truncated", "image file is truncated"),  # its worker decodes it: no end marker
    (DECODE_ON_DEVICE, "undefined-table", "broken data stream"),  # the device's batched decode fails
], ids=["loader", "device", "decode-on-device", "decode-on-device-batch-fails"])
def test_a_damaged_file_mid_epoch_stops_after_a_checkpoint_and_the_fixed_run_ends_as_if_never_met(
        jpeg_folder, tmp_path, capsys, path, how, reason):
    data = copy_of(jpeg_folder, tmp_path)
    bad = file_met_at_batch(data, batch=5, batch_size=4, baseline=how == "undefined-table")  # step 6 of 9
    original = bad.read_bytes()
    damage(bad, how)
    args = FOLDER_RUN + path + ["--data-dir", str(data), "--batch-size", "4", "--epochs", "2"]
    out = tmp_path / "run"
    proc = in_process(train_classifier.main, args + ["--out", str(out)], capsys)
    assert proc.returncode == 2
    said = proc.stdout + proc.stderr
    assert said.count(str(bad)) == 1 and "Traceback" not in said
    assert re.search(rf"ERROR step 6 \(not taken\): cannot decode {re.escape(str(bad))} \({reason}.*\); "
                     r"fix or remove it \(--check-data lists every such file\), then continue with --resume auto; "
                     rf"the last good checkpoint is {re.escape(str(out))}/checkpoint_last.pt \(step 5\)", said)
    stopped = load_ckpt(out / "checkpoint_last.pt")
    assert (stopped["step"], stopped["epoch"], stopped["batches_done"]) == (5, 0, 5)  # step 6's batch unseen
    # not fixed yet: a resume refuses to start, naming it again
    proc = in_process(train_classifier.main, args + ["--out", str(out), "--resume", "auto"], capsys)
    assert proc.returncode == 2 and f"cannot decode {bad}" in proc.stderr and "stopped there" in proc.stderr
    bad.write_bytes(original)  # fixed
    proc = in_process(train_classifier.main, args + ["--out", str(out), "--resume", "auto"], capsys)
    assert_ok(proc)
    assert not (out / "UNREADABLE").exists()
    (resumed,) = json.loads((out / "config.json").read_text())["history"]
    assert resumed["resolved"]["data_changes"] == [f"{bad} fixed in place (the run named it as unreadable)"]
    reference = tmp_path / "reference"  # the same run on the intact folder
    assert_ok(in_process(train_classifier.main, args + ["--out", str(reference)], capsys))
    assert_same_state(load_ckpt(out / "checkpoint_last.pt"), load_ckpt(reference / "checkpoint_last.pt"))


def test_removing_the_file_a_run_named_lets_it_continue_and_any_other_change_is_refused(jpeg_folder, tmp_path,
                                                                                        capsys):
    """The stop line says "fix or remove it": removed, the resume continues (the data fingerprint
    is compared with the named file put back), and config.json says what was removed; a file the
    run did not name removed as well is other data, refused unless --allow-changes."""
    data = copy_of(jpeg_folder, tmp_path)
    bad = file_met_at_batch(data, batch=5, batch_size=4, baseline=True)
    damage(bad, "undefined-table")
    args = FOLDER_RUN + DECODE_ON_DEVICE + ["--data-dir", str(data), "--batch-size", "4", "--epochs", "2",
                                            "--out", str(tmp_path / "run")]
    proc = in_process(train_classifier.main, args, capsys)
    assert proc.returncode == 2 and f"cannot decode {bad}" in proc.stderr + proc.stdout
    assert "fix or remove it" in proc.stdout + proc.stderr
    bad.unlink()  # removed, as the line says
    other = sorted((data / "val").rglob("*.JPEG"))[0]
    moved = other.rename(tmp_path / other.name)  # and a file the run did not name
    proc = in_process(train_classifier.main, args + ["--resume", "auto"], capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "its run read other image files (data fingerprint" in proc.stderr
    moved.rename(other)
    proc = in_process(train_classifier.main, args + ["--resume", "auto"], capsys)
    assert_ok(proc)
    assert f"the data changed since the checkpoint's run read it: {bad} removed (the run named it as " \
           f"unreadable)" in proc.stdout
    (resumed,) = json.loads((tmp_path / "run" / "config.json").read_text())["history"]
    assert resumed["resolved"]["data_changes"] == [f"{bad} removed (the run named it as unreadable)"]
    assert load_ckpt(tmp_path / "run" / "checkpoint_last.pt")["step"] == 18  # 2 epochs of 9 steps: to the end


def test_a_listing_with_files_put_back_is_imagefolders_own(jpeg_folder, tmp_path):
    """What the removal test compares rests on this: a listing with removed files put back is the
    listing ImageFolder made with them, in nested folders too (its order: class, folder, name)."""
    data = copy_of(jpeg_folder, tmp_path)
    nested = sorted((data / "train").iterdir())[1]
    for name in ("a b", "a", "a/z"):  # " " sorts before "/": "a b" comes before "a/..."
        (nested / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(next(nested.glob("*.JPEG")), nested / name / "x.JPEG")
    whole = FolderListing.of(str(data / "train"))
    paths = whole.paths.split("\0")
    gone = [paths[0], f"{nested.name}/a b/x.JPEG", f"{nested.name}/a/z/x.JPEG", paths[-1]]
    assert all(path in paths for path in gone)
    for path in gone:
        (data / "train" / path).unlink()
    after = FolderListing.of(str(data / "train"))
    assert after.fingerprint != whole.fingerprint
    put_back = after.with_files(gone)
    assert (put_back.paths, put_back.targets.tolist(), put_back.fingerprint) == (
        whole.paths, whole.targets.tolist(), whole.fingerprint)


def test_a_file_the_devices_batched_decode_refuses_on_one_rank_stops_both_ranks_once(jpeg_folder, tmp_path):
    """--decode-on device on 2 ranks: a baseline JPEG whose data cannot be decoded, in rank 1's
    step 3, fails that rank's batched decode; it is decoded alone, becomes a placeholder, both
    ranks stop with exit 2 after rank 0's checkpoint of step 2, the file named once."""
    data = copy_of(jpeg_folder, tmp_path)
    bad = file_met_at_batch(data, batch=2, batch_size=4, world_size=2, rank=1, baseline=True)
    damage(bad, "undefined-table")
    out = tmp_path / "run"
    proc = run_ranks("train_moco.py", FOLDER_RUN + DECODE_ON_DEVICE + [
        "--data-dir", str(data), "--batch-size", "4", "--epochs", "1", "--moco-k", "32", "--knn-every", "0",
        "--out", str(out)], tmp_path)
    assert proc.codes == [2, 2], proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert said.count(f"cannot decode {bad} (broken data stream") == 1 and "Traceback" not in said
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 2 and (out / "UNREADABLE").exists()


def test_a_damaged_validation_file_stops_after_the_epochs_checkpoint(jpeg_folder, tmp_path, capsys):
    data = copy_of(jpeg_folder, tmp_path)
    bad = data / "val/n00000002/val_0002_00001.JPEG"
    damage(bad, "empty")
    out = tmp_path / "run"
    proc = in_process(train_classifier.main, FOLDER_RUN + ["--data-dir", str(data), "--batch-size", "8",
                                                           "--epochs", "2", "--out", str(out)], capsys)
    assert proc.returncode == 2
    assert f"ERROR epoch 1's validation: cannot decode {bad} (empty file)" in proc.stdout
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 4 and "val/acc1" not in read_scalars(out / "tb")


def test_the_knn_bank_and_the_preview_name_a_damaged_file_before_training(jpeg_folder, tmp_path, capsys):
    """MoCo's step-0 kNN pass reads the whole train split (the bank); a fresh run's preview
    shows samples 0..7: either stops the run before its first step, nothing trained to keep."""
    data = copy_of(jpeg_folder, tmp_path)
    in_bank, in_preview = data / "train/n00000002/train_0002_00005.JPEG", data / "train/n00000000/train_0000_00001.JPEG"
    damage(in_bank, "text")
    moco = FOLDER_RUN + ["--data-dir", str(data), "--batch-size", "8", "--moco-k", "32", "--epochs", "1"]
    proc = in_process(train_moco.main, moco + ["--out", str(tmp_path / "m")], capsys)
    assert proc.returncode == 2 and not (tmp_path / "m/checkpoint_last.pt").exists()
    assert (f"ERROR the kNN monitor at step 0: cannot decode {in_bank} (not an image file PIL can read); fix or "
            f"remove it (--check-data lists every such file), then start the run again") in proc.stdout
    in_bank.unlink()
    damage(in_preview, "empty")
    proc = in_process(train_moco.main, moco + ["--knn-every", "0", "--out", str(tmp_path / "p")], capsys)
    assert proc.returncode == 2 and not (tmp_path / "p/checkpoint_last.pt").exists()
    assert f"ERROR step 1 (not taken): cannot decode {in_preview} (empty file)" in proc.stdout


# ----------------------------------------------------------------------------- one batch's path through the files
# One MoCo batch of an ImageFolder on the CUDA default path (--aug-on auto is device there, --decode-on
# auto the loader), from the sampler's keys to the loss: the ddp_utils files it enters, in
# docs/architecture.md's walk. "worker": what a DataLoader worker runs (under its fetch);
# "training process": the rest, the thread that finishes batches ahead included (on CUDA the
# loader's pin-memory thread also calls PackedImages.pin_memory: files_on_device.py, listed).
ONE_BATCH_FILES = {
    "worker": {"data/pipeline.py", "data/image_files.py", "data/files_on_device.py"},
    "training process": {
        "data/order.py", "data/image_files.py", "data/pipeline.py", "data/files_on_device.py",
        "data/data_stream.py", "data/batch_augment.py", "data/unreadable.py", "hashing.py",  # the batch
        "train/run.py", "train/accumulation.py",  # handed to the loop
        "runtime/device.py", "runtime/precision.py", "runtime/dist.py", "models/moco.py", "models/shuffle_bn.py",
        "models/backbones.py", "runtime/collectives.py",  # the forward and the loss
    },
}
# The data's own part (steps 1 to 4 of the walk), from the sampler's keys to the loop's hand-out;
# train/accumulation.py places the batch in its window but is counted with the step.
DATA_PART = {"data/order.py", "data/pipeline.py", "data/image_files.py", "data/files_on_device.py",
             "data/data_stream.py", "data/batch_augment.py", "data/unreadable.py", "hashing.py", "train/run.py"}


def files_one_batch_enters(monkeypatch, args: list[str]) -> dict[str, dict[str, set[str]]]:
    """{"worker" | "training process": {file below ddp_utils/: functions entered}} for the first
    training batch of ``train_moco.main(args)`` (one process, ``--workers 0``: the workers' part
    runs here, under the DataLoader's fetch), from the start of ``train_one_epoch`` to the first
    ``backward()``: sys.setprofile on this thread, threading.setprofile on the thread that
    makes batches ahead (started in between)."""
    package = str(Path(train_moco.__file__).with_name("ddp_utils")) + "/"
    entered: dict[str, dict[str, set[str]]] = {"worker": {}, "training process": {}}
    recording = [False]

    def profile(frame, event, arg):
        if not recording[0] or event != "call" or not frame.f_code.co_filename.startswith(package):
            return
        caller, part = frame.f_back, "training process"
        while caller is not None:
            if caller.f_code.co_filename.endswith("torch/utils/data/_utils/fetch.py"):
                part = "worker"
                break
            caller = caller.f_back
        name = frame.f_code.co_filename[len(package):]
        entered[part].setdefault(name, set()).add(getattr(frame.f_code, "co_qualname", frame.f_code.co_name))

    one_epoch, backward = train_moco.train_one_epoch, torch.Tensor.backward

    def recorded_epoch(run, meter):
        recording[0] = True
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            return one_epoch(run, meter)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    def backward_ends_it(tensor, *a, **kw):
        recording[0] = False
        return backward(tensor, *a, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(train_moco, "train_one_epoch", recorded_epoch)
        patch.setattr(torch.Tensor, "backward", backward_ends_it)
        assert train_moco.main(args) == 0
    return entered


def test_one_moco_batch_on_the_cuda_default_path_enters_the_files_the_architecture_page_walks(
        monkeypatch, jpeg_folder, tmp_path):
    """The CPU stand-in of the CUDA default path: the flags as on CUDA, where auto resolves to
    device augmentation and decoding in the workers. The documented list, file for file, and
    docs/architecture.md names each; the loader path (the control) enters other files."""
    cuda = resolved_settings(train_moco.MocoConfig(dataset="imagefolder"), "single", 1, torch.device("cuda"), world_size=1)
    assert (cuda.aug_on, cuda.decode_on) == ("device", "loader")
    args = ["--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--device", "cpu", "--workers", "0",
            "--image-size", "32", "--batch-size", "8", "--moco-k", "64", "--max-steps", "1", "--knn-every", "0",
            "--log-every", "1000"]
    entered = files_one_batch_enters(monkeypatch, args + ["--aug-on", "device", "--out", str(tmp_path / "device")])
    assert {part: set(files) for part, files in entered.items()} == ONE_BATCH_FILES
    walk = (REPO / "docs/architecture.md").read_text().split("## One MoCo batch")[1].split("\n## ")[0]
    every = set.union(*ONE_BATCH_FILES.values())
    assert [name for name in sorted(every) if name not in walk] == []
    assert f"{len(every)} files" in walk
    assert DATA_PART <= every and f"steps 1 to 4: {len(DATA_PART)} files" in walk
    loader = files_one_batch_enters(monkeypatch, args + ["--aug-on", "loader", "--out", str(tmp_path / "loader")])
    assert "data/transforms.py" in loader["worker"] and "data/batch_augment.py" not in loader["training process"]


# ----------------------------------------------------------------------------- the wait for data
@pytest.mark.machine_alone  # a share of wall time: another worker's load would move it
def test_the_wait_for_data_is_high_when_starved_and_low_in_memory(jpeg_folder, tmp_path, capsys):
    starved = tmp_path / "starved"  # full-size JPEGs decoded and augmented by the training process itself
    proc = in_process(train_classifier.main, FOLDER_RUN + ["--data-dir", str(jpeg_folder), "--batch-size", "8",
                                                           "--aug-on", "loader", "--epochs", "1",
                                                           "--out", str(starved)], capsys)
    assert_ok(proc)
    waits = [v for _, v in read_scalars(starved / "tb")["train/data_wait_percent"]]
    # 4 steps, each its own window; step 1's compute carries one-time costs (first allocations, the
    # optimizer's state), which in one run of the suite held steps 1-2 to 41%
    assert len(waits) == 4 and min(waits[1:]) > 50, waits
    assert re.search(r"data wait \d+% eta", proc.stdout)
    assert re.search(r"WARNING input-bound: the training loop waited for its batches \d+% of epoch 1 \(rank 0\); "
                     r"try more --workers \(now 0 per rank", proc.stdout)
    in_memory = tmp_path / "in_memory"  # digits held as one tensor, batched without augmentation
    proc = in_process(train_classifier.main, ["--device", "cpu", "--no-augment", "--batch-size", "64", "--epochs", "1",
                                              "--log-every", "5", "--out", str(in_memory)], capsys)
    assert_ok(proc)
    waits = [v for _, v in read_scalars(in_memory / "tb")["train/data_wait_percent"]]
    assert len(waits) == 5 and max(waits) < 20, waits
    assert "input-bound" not in proc.stdout


# ----------------------------------------------------------------------------- what runs
def test_the_log_config_json_and_checkpoint_say_what_auto_resolved_to(jpeg_folder, tmp_path, capsys):
    out = tmp_path / "run"
    proc = in_process(train_classifier.main, ["--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--device",
                                              "cpu", "--arch", "small_cnn", "--batch-size", "4", "--max-steps", "1",
                                              "--out", str(out)], capsys)
    assert_ok(proc)
    workers = resolved_settings(train_classifier.ClassifierConfig(dataset="imagefolder"), "single", 1,
                                CPU.device, world_size=1).workers
    assert re.search(rf"INFO resolved: 224 px \(--image-size 0\), augmentation on the loader \(--aug-on auto\), "
                     rf"decoding on the loader \(--decode-on auto\), {workers} DataLoader worker\(s\) per rank "
                     rf"\(--workers -1: \d+ usable CPUs shared by 1 rank\(s\)\)", proc.stdout)
    record = json.loads((out / "config.json").read_text())
    assert {k: record["config"][k] for k in ("image_size", "workers", "aug_on", "amp")} == \
        {"image_size": 0, "workers": -1, "aug_on": "auto", "amp": "auto"}  # as asked: what a --config re-run reads
    assert record["resolved"] == {"image_size": 224, "workers": workers, "aug_on": "loader", "decode_on": "loader",
                                  "order": "samples", "amp": "none", "global_batch": 4, "data_fingerprint": data_fingerprint(
                                      FolderListing.of(str(jpeg_folder / "train")), FolderListing.of(str(jpeg_folder / "val")))}
    assert load_ckpt(out / "checkpoint_last.pt")["resolved"] == record["resolved"]
    proc = in_process(train_classifier.main, ["--config", str(out / "config.json"), "--check", "--out",
                                              str(tmp_path / "again")], capsys)
    assert proc.returncode == 0 and "224 px (--image-size 0), augmentation on the loader (--aug-on auto)" in proc.stdout


# ----------------------------------------------------------------------------- the launchers
def launch(script: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch/torchrun_local.sh"), str(REPO / script), *args], cwd=cwd,
                          env=cli_env({"PYTHON": sys.executable, "NPROC": "2", **env}), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_the_launcher_runs_imagefolder_jobs_to_the_end_and_a_damaged_file_stops_every_rank_once(
        jpeg_folder, tmp_path):
    """launch/torchrun_local.sh (its --check first, then torchrun with 2 ranks and restarts): MoCo
    meets a damaged file on one rank's shard: both ranks stop with exit 2, the file named once (the
    restarted attempt stops at once without a word), and once the file is fixed the launcher's
    resume runs to the end. (The launcher runs the classifier in test_run_safety.py.)"""
    common = ["--dataset", "imagefolder", "--device", "cpu", "--arch", "small_cnn", "--image-size", "32",
              "--batch-size", "4", "--epochs", "1", "--workers", "1"]
    data = copy_of(jpeg_folder, tmp_path)
    bad = file_met_at_batch(data, batch=2, batch_size=4, world_size=2, rank=1)  # step 3, on rank 1 only
    original = bad.read_bytes()
    damage(bad, "truncated")
    moco = common + ["--data-dir", str(data), "--moco-k", "32", "--knn-every", "0", "--out", "moco"]
    proc = launch("train_moco.py", moco, tmp_path, MAX_RESTARTS="1")
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert said.count(f"cannot decode {bad}") == 1
    codes = set(re.findall(r"exitcode\s*: (-?\d+)", said))  # torchrun's report of the last attempt
    assert "2" in codes and codes <= {"2", "-15"}  # a rank still leaving may get torchrun's SIGTERM
    assert "in DataLoader worker process" not in said and "OSError" not in said
    assert (tmp_path / "moco/checkpoint_last.pt").exists() and (tmp_path / "moco/UNREADABLE").exists()
    bad.write_bytes(original)
    proc = launch("train_moco.py", moco + ["--resume", "auto"], tmp_path)
    assert_ok(proc)
    assert "train_moco.py --check: ok" in proc.stdout and "encoders, queue and pointer identical on all 2 ranks" in proc.stdout
    assert load_ckpt(tmp_path / "moco/checkpoint_last.pt")["step"] == 5  # 20 images per rank: 5 steps an epoch
