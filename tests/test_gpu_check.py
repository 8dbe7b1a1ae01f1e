"""bench/gpu_check.sh on a machine that cannot run it: one line naming what is missing, exit 2,
at once, nothing measured (the GPU run itself is the check's job, not the tests'). Its parts run
on the CPU: bench/device_finish.py's decode comparison, race probe, loader and profile rows on a
small ImageNet-like folder (their figures real, their checks able to fail), the JPEG rows'
interval inside the first epoch, and (slow) the whole --cpu-smoke run."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from helpers import REPO, cli_env

from bench import device_finish


def gpu_check(*args: str, python: str = sys.executable, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd="/",
                          env=cli_env({"PYTHON": python}), capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_without_a_gpu_the_check_stops_at_once_with_one_line():
    proc = gpu_check()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no usable NVIDIA GPU" in proc.stderr and "--cpu-smoke" in proc.stderr


def test_a_python_without_torch_is_named(tmp_path):
    bare = tmp_path / "python"  # this interpreter without site-packages: torch cannot import
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')
    bare.chmod(0o755)
    proc = gpu_check(python=str(bare))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "cannot import torch" in proc.stderr and "PYTHON=" in proc.stderr
    missing = gpu_check(python=str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no python at PYTHON=" in missing.stderr


def test_a_wrong_argument_is_a_usage_error():
    proc = gpu_check("--cpu-smoek")
    assert proc.returncode == 2 and proc.stderr.strip() == "usage: bash bench/gpu_check.sh [--cpu-smoke]"


# ----------------------------------------------------------------------------- the JPEG rows' interval
def shell_sizes(mode: str) -> dict[str, int]:
    """The JPEG_* sizes gpu_check.sh sets for ``mode`` (``--cpu-smoke`` or the GPU check's ``""``)."""
    text = (REPO / "bench" / "gpu_check.sh").read_text()
    label = mode or '""'
    branch = text.split(f"\n{label})", 1)[1].split(";;", 1)[0]
    return {name: int(value) for name, value in re.findall(r"\b(JPEG_[A-Z_]+)=(\d+)", branch)}


@pytest.mark.parametrize("mode", ["", "--cpu-smoke"])
def test_the_jpeg_rows_interval_lies_inside_the_first_epoch(mode):
    """The parsed interval (the last --log-every one) follows a warm-up interval and ends before
    the first epoch does: 10 classes x JPEG_PER_CLASS + 3 odd files, in batches of JPEG_BATCH."""
    sizes = shell_sizes(mode)
    steps_per_epoch = (10 * sizes["JPEG_PER_CLASS"] + 3) // sizes["JPEG_BATCH"]
    log, steps = sizes["JPEG_LOG"], sizes["JPEG_STEPS"]
    assert log < steps <= 2 * log, "the last progress line must close the second interval"
    assert steps < steps_per_epoch, "the interval must end inside the first epoch"


# ----------------------------------------------------------------------------- bench/device_finish.py on the CPU
def run_part(capsys, *args: str) -> tuple[int, list[str]]:
    """device_finish.main in this process: (exit code, its markdown rows)."""
    code = device_finish.main(list(args))
    out = capsys.readouterr().out
    return code, [line for line in out.splitlines() if line.startswith("| ")]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def test_decode_diff_on_the_cpu_is_exact_and_sees_a_difference(jpeg_folder, capsys, monkeypatch):
    """The CPU as the device runs the same decoder as decode_cpu: max and mean 0; every device
    value one level off (its low bit flipped) shows as max 1, mean 1. The CMYK, grayscale and PNG
    files stay off the device."""
    args = ("decode-diff", "--data-dir", str(jpeg_folder), "--device", "cpu", "--batch-size", "8", "--files", "0")
    code, rows = run_part(capsys, *args)
    assert code == 0 and len(rows) == 1
    part, what, figure, detail = cells(rows[0])
    assert part == "device decode" and "48 baseline JPEGs" in what  # 36 train + 12 val
    assert figure == "max 0, mean 0.000" and "0.0% of values differ" in detail and "3 other file(s)" in detail

    real = device_finish.decode_on

    def one_off(device, batch):
        images, failed = real(device, batch)
        return [image ^ 1 for image in images], failed

    monkeypatch.setattr(device_finish, "decode_on", one_off)
    code, rows = run_part(capsys, *args)
    assert code == 0 and cells(rows[0])[2] == "max 1, mean 1.000" and "100.0% of values differ" in rows[0]


def test_batch_independence_on_the_cpu_is_exact_and_sees_a_shape_dependent_kernel(jpeg_folder, capsys, monkeypatch):
    """On the CPU a sample's views in a batch and alone are bit for bit; a blur whose result
    follows its sub-batch's size (as a kernel chosen by shape could) is caught and exits 1."""
    args = ("independence", "--data-dir", str(jpeg_folder), "--device", "cpu", "--batch-size", "6",
            "--image-size", "64")
    code, rows = run_part(capsys, *args)
    assert code == 0 and len(rows) == 1
    part, what, figure, detail = cells(rows[0])
    assert part == "batch independence" and "of 6 images" in what and figure == "max 0"
    assert detail.startswith("0 of 6 samples not bit for bit")

    from ddp_utils.data import batch_augment
    real = batch_augment.gaussian_blur
    monkeypatch.setattr(batch_augment, "gaussian_blur", lambda x, sigma, size: real(x, sigma, size) + 1e-3 * len(x))
    code, rows = run_part(capsys, *args)
    assert code == 1 and not cells(rows[0])[3].startswith("0 of 6")


def test_race_probe_on_the_cpu_sees_no_race_and_would_count_one(jpeg_folder, capsys, monkeypatch):
    """Two iterations on the CPU: none differs. A decode that changes one pixel in the second
    iteration (the third call: the idle reference is the first) is counted, and exits 1; the
    control (--unprotected: files_on_device._decode_all on the training stream) counts it too, exit 0."""
    args = ("race", "--data-dir", str(jpeg_folder), "--device", "cpu", "--batch-size", "4", "--image-size", "32",
            "--iterations", "2", "--arch", "resnet18")
    code, rows = run_part(capsys, *args)
    assert code == 0 and len(rows) == 1
    part, what, figure, detail = cells(rows[0])
    assert part == "race probe" and what.startswith("decode_on(cpu) of 4 JPEGs") and figure == "0 of 2 differed"
    assert "vs idle device: 0; vs CPU: 0; queued reads: 0" in detail and "max absolute difference 0" in detail

    def corrupt_third_call(module, name: str) -> list:
        real, calls = getattr(module, name), []

        def decode(device, batch):
            images, failed = real(device, batch)
            calls.append(1)
            if len(calls) == 3:
                images[0][0, 0, 0] ^= 1
            return images, failed

        monkeypatch.setattr(module, name, decode)
        return calls

    calls = corrupt_third_call(device_finish, "decode_on")
    code, rows = run_part(capsys, *args)
    assert code == 1 and len(calls) == 3
    assert cells(rows[0])[2] == "1 of 2 differed" and "vs idle device: 1; vs CPU: 1; queued reads: 0" in rows[0]

    monkeypatch.undo()
    code, rows = run_part(capsys, *args, "--unprotected")
    assert code == 0 and cells(rows[0])[1].startswith("unprotected decode") and cells(rows[0])[2] == "0 of 2 differed"
    calls = corrupt_third_call(device_finish.files_on_device, "_decode_all")  # decode_on's body: the reference's too
    code, rows = run_part(capsys, *args, "--unprotected")
    assert code == 0 and len(calls) == 3 and cells(rows[0])[2] == "1 of 2 differed"


def test_loader_rows_at_the_worker_counts_asked(jpeg_folder, capsys):
    """The loader alone: one row per decode mode and workers count, img/s > 0, and for device
    decode the host's share inside decode_on; an interval longer than an epoch is refused."""
    base = ("loader", "--data-dir", str(jpeg_folder), "--device", "cpu", "--batch-size", "8", "--image-size", "32")
    code, rows = run_part(capsys, *base, "--workers", "1", "2", "--warmup-batches", "1", "--batches", "3")
    assert code == 0 and len(rows) == 4
    seen = []
    for line in rows:
        part, what, figure, detail = cells(line)
        mode, workers = re.search(r"--decode-on (\w+), (\d+) worker\(s\)", what).groups()
        seen.append((mode, int(workers)))
        assert part == "loader" and float(figure.removesuffix(" img/s").replace(",", "")) > 0
        assert "batches 2-4 of epoch 0's 4" in detail
        share = re.search(r"host in decode_on (\d+)%", detail)
        assert (share is not None) == (mode == "device") and (share is None or 0 < int(share.group(1)) <= 100)
    assert seen == [("loader", 1), ("loader", 2), ("device", 1), ("device", 2)]
    code, rows = run_part(capsys, *base, "--workers", "1", "--warmup-batches", "2", "--batches", "3")
    assert code == 2 and rows == []


def test_breakdown_prints_a_row_per_range(jpeg_folder, capsys):
    """One row per device_finish/* range (a time, or ? while a range is not in the profile, - for
    decoding in the loader-decode mode), then the whole finish's host time."""
    code, rows = run_part(capsys, "breakdown", "--data-dir", str(jpeg_folder), "--device", "cpu", "--batch-size", "4",
                          "--image-size", "32", "--loader-workers", "0", "--warmup-batches", "1", "--batches", "1")
    assert code == 0 and len(rows) == len(device_finish.RANGES) + 1
    for name, line in zip(device_finish.RANGES, rows):
        part, what, figure, _ = cells(line)
        assert part == "device finish" and what.startswith(f"device_finish/{name} per batch")
        loader_mode, device_mode = figure.removesuffix(" ms").split(" / ")
        assert re.fullmatch(r"\d+\.\d\d|\?", device_mode)
        assert re.fullmatch(r"-" if name == "decode" else r"\d+\.\d\d|\?", loader_mode)
    whole = cells(rows[-1])
    assert whole[1].startswith("whole FinishOnDevice.finish") and all(float(ms) > 0 for ms in
                                                                   whole[2].removesuffix(" ms").split(" / "))


def test_range_times_reads_each_range_from_the_profile():
    """A range's CPU time per batch comes from the profile's events; a missing range is None."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("device_finish/crop"):
                x @ x
    times = device_finish.range_times(prof.events(), torch.device("cpu"), batches=2)
    assert set(times) == set(device_finish.RANGES)
    assert times["crop"] > 0 and all(times[name] is None for name in device_finish.RANGES if name != "crop")


@pytest.mark.slow
def test_the_cpu_smoke_runs_every_part():
    """``--cpu-smoke`` runs every part on the CPU and passes:
    each part's rows, the MoCo v2 throughput row on the full v2 recipe, the JPEG rows' in-epoch
    interval, the decode comparison exact and no race on the CPU."""
    proc = gpu_check("--cpu-smoke", timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "All parts passed." in proc.stdout and "FAILED" not in proc.stdout
    rows = [cells(line) for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    count: dict[str, int] = {}
    for row in rows:
        count[row[0]] = count.get(row[0], 0) + 1
    assert count == {"throughput": 3, "CIFAR-10 demo recipe": 2, "CUDA syncs": 2, "JPEG path": 4, "device decode": 1,
                     "race probe": 2, "loader": 4, "batch independence": 1, "device finish": 7, "smoke": 2}
    by_part = {part: [row for row in rows if row[0] == part] for part in count}
    assert ", v2, cifar10 64 px" in by_part["throughput"][2][1]
    assert all("steps 3-4 of epoch 1" in row[3] for row in by_part["JPEG path"])
    assert by_part["device decode"][0][2] == "max 0, mean 0.000"
    assert [row[2] for row in by_part["race probe"]] == ["0 of 2 differed", "0 of 2 differed"]
    assert [re.search(r"(\d+) worker", row[1]).group(1) for row in by_part["loader"]] == ["1", "2", "1", "2"]


def test_the_sync_counter_sees_every_optimizer_step_of_the_real_loop(monkeypatch, tmp_path, capsys):
    """bench/cuda_syncs.py counts per optimizer step through a hook on the training loop; on the
    CPU the real classifier's loop must reach it once per step, after the step is counted."""
    from helpers import assert_ok, in_process

    import train_classifier
    from bench.cuda_syncs import after_each_step

    monkeypatch.setattr(train_classifier, "ends_the_run", train_classifier.ends_the_run)  # restored afterwards
    steps: list[int] = []
    after_each_step(train_classifier, lambda run: steps.append(run.state.step))
    args = ["--dataset", "digits", "--device", "cpu", "--batch-size", "32", "--accum-steps", "2", "--max-steps", "3",
            "--epochs", "1", "--log-every", "1000", "--out", str(tmp_path / "run")]
    assert_ok(in_process(train_classifier.main, args, capsys))
    assert steps == [1, 2, 3]
