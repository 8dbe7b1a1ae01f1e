"""Host memory: the DataLoader workers' batches in /dev/shm stay within the bound the pre-flight
checks (measured on a real loader), evaluation batches of image files are capped, and a node
whose /dev/shm is too small gets one line and exit 2, from --check and from a 2-rank run, before
anything is written."""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import pytest
import torch

import train_moco
from bench.host_memory import peak_shm_while
from ddp_utils.data.host_memory import (
    EVAL_PREFETCH,
    KEPT_PER_WORKER,
    SHM_DIR,
    TRAIN_PREFETCH,
    LoaderMemory,
    eval_batch_size,
    shm_problem,
)
from ddp_utils.data.pipeline import DataPlan, build_data, plan_memory
from ddp_utils.data.recipes import moco_recipe
from tests.helpers import in_process, run_ranks

needs_shm = pytest.mark.skipif(not Path(SHM_DIR).is_dir(), reason="no /dev/shm on this OS")


def test_evaluation_batches_of_image_files_are_capped():
    assert [eval_batch_size(b, image_files=True) for b in (8, 32, 64, 256, 512)] == [32, 128, 256, 256, 512]
    assert eval_batch_size(256, image_files=False) == 1024  # in-memory data: no shared memory


def test_a_worker_keeps_a_buffer_for_every_batch_it_may_have_in_flight():
    """Its prefetched batches plus the one it fills: fewer kept buffers and a worker would make
    a fresh segment per batch again; the bound counts what it keeps."""
    assert KEPT_PER_WORKER == max(TRAIN_PREFETCH, EVAL_PREFETCH) + 1
    assert LoaderMemory(train_batch=10, eval_batch=100, workers=4, kept=True).per_rank == 4 * KEPT_PER_WORKER * 110
    assert LoaderMemory(train_batch=10, eval_batch=100, workers=4).per_rank == 9 * 10 + 5 * 100  # in flight only


def test_the_line_for_a_small_shm_names_the_room_the_need_and_the_fix(tmp_path):
    huge = LoaderMemory(train_batch=10**15, eval_batch=10**14, workers=2)
    line = shm_problem(huge, ranks_on_node=8, shm_dir=str(tmp_path))
    assert "\n" not in line and " free; " in line and "8 rank(s) need up to" in line
    assert "--shm-size=" in line and "--ipc=host" in line and "--workers" in line
    assert shm_problem(LoaderMemory(1, 1, workers=2), 8, shm_dir=str(tmp_path)) is None
    assert shm_problem(huge, 8, shm_dir=str(tmp_path / "absent")) is None


@needs_shm
@pytest.mark.slow
@pytest.mark.machine_alone  # /dev/shm is the machine's: another worker's loaders would count
@pytest.mark.parametrize("decode_on_device", [False, True], ids=["workers-decode", "device-decodes"])
def test_the_workers_shared_memory_stays_within_the_bound(jpeg_folder, decode_on_device):
    """Two training epochs and an evaluation pass with 2 workers and a slow consumer (every
    prefetch slot fills): the peak of /dev/shm in use stays under the bound, and reaches a
    third of it (the bound is not loose by more)."""
    plan = DataPlan(dataset="imagefolder", data_dir=str(jpeg_folder), image_size=224, synthetic_samples=0,
                    debug=False, seed=0, batch_size=4, workers=2, normalization="auto",
                    recipe=moco_recipe("imagefolder", 224, "v2"), views=2, aug_on_device=True,
                    decode_on_device=decode_on_device)
    loaders = build_data(plan, rank=0, world_size=1, device=torch.device("cpu"))

    def consume():
        for epoch in range(2):
            loaders.set_epoch(epoch)
            for _ in loaders.train:
                time.sleep(0.2)
        for _ in loaders.val:
            time.sleep(0.2)
    peak = peak_shm_while(consume)
    bound = plan_memory(plan, loaders.train_set).per_rank
    assert bound / 3 < peak <= bound, (peak, bound)


def _workers_to_fill_shm() -> int:
    """--workers for which a 1024 px loader-path run needs more than /dev/shm's room (per worker
    about 0.8 GB: a 2-view batch of 8 and an evaluation batch of 32, float32)."""
    return math.ceil(shutil.disk_usage(SHM_DIR).free / 0.8e9) + 1


@needs_shm
def test_check_says_in_one_line_that_shm_is_too_small(jpeg_folder, tmp_path, capsys):
    args = ["--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--aug-on", "loader", "--image-size", "1024",
            "--batch-size", "8", "--workers", str(_workers_to_fill_shm()), "--arch", "small_cnn",
            "--out", str(tmp_path / "run"), "--check"]
    proc = in_process(train_moco.main, args, capsys)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and f"{SHM_DIR} has " in proc.stderr and "--shm-size=" in proc.stderr
    ok = in_process(train_moco.main, [*args[:-5], "--workers", "1", "--out", str(tmp_path / "run"), "--check"], capsys)
    assert ok.returncode == 0 and "host memory: the DataLoader workers' batches take up to" in ok.stdout


@needs_shm
def test_a_two_rank_run_with_too_small_shm_exits_2_on_every_rank_writing_nothing(jpeg_folder, tmp_path):
    out = tmp_path / "run"
    proc = run_ranks("train_classifier.py", [
        "--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--aug-on", "loader", "--image-size", "1024",
        "--batch-size", "8", "--workers", str(_workers_to_fill_shm()), "--arch", "small_cnn", "--out", str(out)],
        tmp_path)
    assert proc.codes == [2, 2], proc.stderr
    assert proc.stderr.count("\n") == 1 and f"{SHM_DIR} has " in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_check_names_the_device_memory_the_data_path_holds(jpeg_folder, tmp_path, capsys):
    """--check with image files finished on the device: one line with the bytes a training and an
    evaluation pass hold on the device (the float atlas at 12 bytes per atlas pixel, the batch in
    the making, the finished batches), those of files_on_device.DeviceMemory for the folder's mean
    image; none on the loader path."""
    from ddp_utils.data.files_on_device import AHEAD, DeviceMemory
    from ddp_utils.data.host_memory import ATLAS_PADDING, mean_image_pixels, size_text
    from ddp_utils.data.image_files import FolderListing, ImageFiles

    args = ["--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--image-size", "64", "--batch-size", "8",
            "--workers", "1", "--arch", "small_cnn", "--out", str(tmp_path / "run"), "--check"]
    device = in_process(train_moco.main, [*args, "--aug-on", "device", "--decode-on", "device"], capsys)
    assert device.returncode == 0, device.stderr
    line, = [ln.strip() for ln in device.stdout.splitlines() if ln.strip().startswith("device memory:")]
    pixels = mean_image_pixels(ImageFiles(FolderListing.of(str(jpeg_folder / "train"))))
    train = DeviceMemory.of_pass(pixels, 8, 2, 64, decode_on_device=True)
    assert train.atlas == round(12 * ATLAS_PADDING * 8 * pixels) and train.made == (AHEAD + 2) * 8 * 2 * 3 * 64 * 64 * 4
    assert line.startswith(f"device memory: the data path holds about {size_text(train.total)} per rank on cpu in a "
                           f"training pass (the float atlas {size_text(train.atlas)}, "), line
    loader = in_process(train_moco.main, [*args, "--aug-on", "loader"], capsys)
    assert loader.returncode == 0 and "device memory:" not in loader.stdout
