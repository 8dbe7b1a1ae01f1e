"""bench/gpu_check.sh on a machine that cannot run it: one line naming what is missing, exit 2,
at once, nothing measured (the GPU run itself is the check's job, not the tests'). Its plan: each
part's limit, their sum within the budget, the decisive parts first, a budget too small for them
refused in one line. The workers and batch it fits to a /dev/shm of a given size pass the
project's own check. Its parts run on the CPU: bench/device_finish.py's decode comparison, race
probe, loader and profile rows on a small ImageNet-like folder (their figures real, their checks
able to fail), the JPEG rows' interval inside the first epoch, and (slow) the whole --cpu-smoke
run: every part in the plan's order, its log the console's lines, the whole table at the end."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from helpers import REPO, cli_env

from bench import device_finish, gpu_preflight


def gpu_check(*args: str, python: str = sys.executable, timeout: float = 120,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in cli_env({"PYTHON": python}).items() if k not in ("OUT", "GPU_CHECK_BUDGET")}
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd="/", env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


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
    assert proc.returncode == 2 and proc.stderr.strip() == "usage: bash bench/gpu_check.sh [--cpu-smoke] [--plan]"


# ----------------------------------------------------------------------------- the plan
# The stated order: the parts that decide (decode, race and its control, batch independence, graph
# capture; the JPEG folder they read first), then the loader alone and the breakdown (after the
# /dev/shm fit), then the throughput rows, then the smoke runs.
ORDER = ["writing the ImageNet-like JPEG folder", "device_finish.py decode-diff", "device_finish.py race:",
         "device_finish.py race --unprotected", "device_finish.py independence", "gpu_hazards.py", "augment_capture.py",
         "gpu_preflight.py --shm", "device_finish.py loader", "device_finish.py breakdown",
         "writing the noise CIFAR-10 folder", "throughput.py: ResNet-18 32 px classifier", "throughput.py: ResNet-18 32 px MoCo",
         "throughput.py: ResNet-50 224 px MoCo v2", "JPEG path: ResNet-50 MoCo v2, --decode-on loader",
         "JPEG path: ResNet-50 linear probe, --decode-on loader", "JPEG path: ResNet-50 MoCo v2, --decode-on device",
         "JPEG path: ResNet-50 linear probe, --decode-on device", "the CIFAR-10 demo recipe", "smoke: classifier",
         "smoke: MoCo"]
DECISIVE = 7
KILL_AFTER, MARGIN = 5, 5  # gpu_check.sh: seconds between timeout's TERM and KILL; kept for the script
PLAN_LINE = re.compile(r"^\s+(\d+)\. (.+?)\s+(\d+) s  (decisive|planned|if time is left)(?:  \((lane \d|before the lanes)\))?$")


def plan_of(text: str) -> list[tuple[int, str, int, str, str]]:
    """The plan's lines in ``text``: (number, what, limit, state, lane: "" on a GPU)."""
    plan = []
    for line in text.splitlines():
        m = PLAN_LINE.match(line)
        if m:
            number, what, limit, state, lane = m.groups()
            plan.append((int(number), what, int(limit), state, "" if lane in (None, "before the lanes") else lane))
    return plan


def check_plan(text: str, budget: int) -> dict[str, int]:
    """The plan in ``text`` holds every part in the stated order; per lane the planned limits (+5 s
    each, +5 s for the script, the pre-flight's included) sum to at most ``budget``, the decisive
    parts are planned, the planned ones come first, and the printed totals are those sums."""
    plan = plan_of(text)
    assert [n for n, *_ in plan] == list(range(len(ORDER) + 1))
    assert plan[0][1].startswith("pre-flight") and plan[0][3] == "decisive"
    assert all(what.startswith(expected) for (_, what, *_), expected in zip(plan[1:], ORDER)), [p[1] for p in plan]
    assert [state == "decisive" for _, _, _, state, _ in plan[1:]] == [True] * DECISIVE + [False] * (len(ORDER) - DECISIVE)
    preflight = plan[0][2] + KILL_AFTER + MARGIN
    used: dict[str, int] = {}
    for lane in sorted({lane for *_, lane in plan[1:]}):
        states = [state for *_, state, own in plan[1:] if own == lane]
        planned = states.count("decisive") + states.count("planned")
        assert "if time is left" not in states[:planned], f"{lane or 'the GPU plan'}: the planned parts come first"
        used[lane] = preflight + sum(limit + KILL_AFTER for _, _, limit, state, own in plan[1:]
                                     if own == lane and state != "if time is left")
        assert used[lane] <= budget, f"{lane or 'the GPU plan'}: {used[lane]} s planned against a {budget} s budget"
        said = f"{lane + ' ' if lane else ''}planned: {used[lane]} s of the {budget} s budget"
        assert said in text, said
    return used


@pytest.mark.parametrize("mode, budget", [("", None), ("", 400), ("", 1300), ("--cpu-smoke", None), ("--cpu-smoke", 500)])
def test_the_plan_sums_within_the_budget_in_the_stated_order(mode, budget):
    """--plan prints the plan and runs nothing: at the default budget on a GPU the pre-flight, the
    decisive parts and the loader's three fit 560 s and the throughput rows wait for time left;
    a budget of every part plans every part; the CPU smoke plans per lane."""
    env = {} if budget is None else {"GPU_CHECK_BUDGET": str(budget)}
    proc = gpu_check(*filter(None, [mode, "--plan"]), env=env, timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    default, budget = budget is None, budget or (900 if mode else 560)
    used = check_plan(proc.stdout, budget)
    states = [state for *_, state, _ in plan_of(proc.stdout)[1:]]
    if default and not mode:  # decisive, then the /dev/shm fit, the loader and the breakdown
        assert states.count("if time is left") == len(ORDER) - 10 and used[""] <= 560
        decisive = int(re.search(r"the decisive parts: (\d+) s", proc.stdout).group(1))
        every = int(re.search(r"GPU_CHECK_BUDGET=(\d+) plans every part", proc.stdout).group(1))
        header = (REPO / "bench" / "gpu_check.sh").read_text().split("\nset -u\n")[0]
        docs = (REPO / "docs" / "performance.md").read_text()
        for text in (header, docs):  # what the script's header and the docs say of the plan is the plan
            assert f"({decisive} s" in text and f"({used['']} s)" in text and f"GPU_CHECK_BUDGET={every}" in text
    if budget == 1300 or (default and mode):
        assert "if time is left" not in states  # the CPU smoke plans every part at its default budget
    plan = plan_of(proc.stdout)  # the budget that plans every part: the largest lane's limits, all of them
    every = max(plan[0][2] + KILL_AFTER + MARGIN + sum(limit + KILL_AFTER for _, _, limit, _, own in plan[1:] if own == lane)
                for lane in {own for *_, own in plan[1:]})
    assert ("if time is left" in states) == (budget < every)
    assert (f"GPU_CHECK_BUDGET={every} plans every part" in proc.stdout) == (budget < every)


def test_a_budget_smaller_than_the_decisive_parts_is_refused_in_one_line():
    """Before the pre-flight (a missing python is not reached), with or without --plan: one line
    naming the budget and what the pre-flight and the decisive parts need, exit 2; the smallest
    budget it names is accepted."""
    for args in ((), ("--plan",)):
        proc = gpu_check(*args, python="/nowhere/python", env={"GPU_CHECK_BUDGET": "300"}, timeout=30)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
        assert "GPU_CHECK_BUDGET=300 s is less than" in proc.stderr and "decisive parts" in proc.stderr
    need = int(re.search(r"set GPU_CHECK_BUDGET=(\d+) or more", proc.stderr).group(1))
    assert need > 300 and gpu_check("--plan", env={"GPU_CHECK_BUDGET": str(need)}, timeout=30).returncode == 0
    assert gpu_check("--plan", env={"GPU_CHECK_BUDGET": str(need - 1)}, timeout=30).returncode == 2
    bad = gpu_check("--plan", env={"GPU_CHECK_BUDGET": "9m"}, timeout=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "whole number" in bad.stderr


# ----------------------------------------------------------------------------- /dev/shm
def shm_need(folder, batch: int, workers: int, on_device: bool) -> int:
    """What the project's check asks of /dev/shm for a loader part of gpu_check.sh: the plan
    device_finish.py makes (as train_moco.py does), its memory as build_data computes it."""
    from ddp_utils.data.pipeline import plan_memory, raw_splits

    args = device_finish.parse_args(["loader", "--data-dir", str(folder), "--device", "cpu", "--batch-size", str(batch),
                                     "--image-size", "224"])
    plan = device_finish.plan_for(args, workers, on_device)
    memory = plan_memory(plan, raw_splits(plan)[0])
    return 0 if memory is None else memory.per_rank


@pytest.mark.parametrize("room", ["two workers", "one worker at half the batch", "none", "no limit"])
def test_the_workers_and_batch_fitted_to_a_small_dev_shm_pass_its_check(jpeg_folder, monkeypatch, capsys, room):
    """GPU_CHECK_SHM_BYTES stands in for /dev/shm's free bytes: the sizes gpu_preflight.py --shm
    prints for it fit (both decode modes, the MoCo smoke run's loader path too), and one worker
    more would not; when not one worker fits, the batch is halved; when nothing fits, no workers."""
    per_worker = max(shm_need(jpeg_folder, 32, 1, on) for on in (False, True))
    half = max(shm_need(jpeg_folder, 16, 1, on) for on in (False, True))
    free = {"two workers": int(2.5 * per_worker / gpu_preflight.SHM_SHARE), "none": 10**6,
            "one worker at half the batch": int((per_worker + half) / 2 / gpu_preflight.SHM_SHARE), "no limit": 10**15}[room]
    monkeypatch.setenv("GPU_CHECK_SHM_BYTES", str(free))
    gpu_preflight.shm_main(["--jpeg-dir", str(jpeg_folder), "--batch", "32", "--image-size", "224", "--workers", "8", "-1",
                            "--smoke-batch", "256", "--smoke-workers", "4"])
    words, row = capsys.readouterr().out.splitlines()
    sizes = dict(word.split("=") for word in words.split())
    batch, cap, smoke = int(sizes["batch"]), int(sizes["cap"]), int(sizes["smoke_workers"])
    asked = [int(w) for w in sizes["workers"].split(",")]
    every = device_finish.resolve_workers(-1)
    expected_cap = {"two workers": 2, "one worker at half the batch": 1, "none": 0, "no limit": max(8, every)}[room]
    assert (batch, cap) == ((16, 1) if room == "one worker at half the batch" else (32, expected_cap))
    assert asked == [min(8, cap), min(every, cap)]
    assert row.startswith("| /dev/shm |") and gpu_preflight.size(free) in row
    room_bytes = gpu_preflight.SHM_SHARE * free
    for on_device in (False, True):
        assert shm_need(jpeg_folder, batch, cap, on_device) <= room_bytes
    if cap < max(8, every):
        assert max(shm_need(jpeg_folder, batch, cap + 1, on) for on in (False, True)) > room_bytes
    from ddp_utils.data.host_memory import LoaderMemory, eval_batch_size
    view = 3 * 32 * 32 * 4  # CIFAR-10 at 32 px as float32, the MoCo smoke run's --aug-on loader batches

    def smoke_need(workers: int) -> int:
        return LoaderMemory(train_batch=256 * 2 * view, eval_batch=eval_batch_size(256, False) * view,
                            workers=workers).per_rank if workers else 0

    assert smoke_need(smoke) <= room_bytes and (smoke == 4 or smoke_need(smoke + 1) > room_bytes)


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
    """On the CPU a sample's views in a batch and alone at its place are bit for bit, and alone in
    an atlas of its own within the place bound; a blur whose result follows its sub-batch's size
    (as a kernel chosen by shape could) is caught and exits 1."""
    args = ("independence", "--data-dir", str(jpeg_folder), "--device", "cpu", "--batch-size", "6",
            "--image-size", "64")
    code, rows = run_part(capsys, *args)
    assert code == 0 and len(rows) == 1
    part, what, figure, detail = cells(rows[0])
    assert part == "batch independence" and "of 6 images" in what and figure.startswith("max 0 at its place, ")
    assert float(figure.split(", ")[1].split()[0]) <= device_finish.PLACE_BOUND
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
def test_the_cpu_smoke_runs_every_part_in_order_into_its_log(tmp_path):
    """``--cpu-smoke`` runs every part on the CPU and passes, one run for all of this: its log
    ($OUT/gpu_check.log, named first and last) holds exactly the lines the console printed; its
    plan fits the budget; each lane started its parts in the plan's order and saw each to its end;
    the whole table comes last, its rows in the stated order: each part's rows, the MoCo v2
    throughput row on the full v2 recipe, the JPEG rows' in-epoch interval, the decode comparison
    exact and no race on the CPU, the graph capture equal, the loader at the workers asked."""
    out = tmp_path / "out"
    proc = gpu_check("--cpu-smoke", timeout=600, env={"OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    log = out / "gpu_check.log"
    lines = proc.stdout.splitlines()
    assert proc.stderr == "" and log.read_text() == proc.stdout
    assert lines[0] == lines[-1] == f"log: {log}"
    check_plan(proc.stdout, 900)

    started = re.findall(r"^\[ *\d+ s\] (\d+)/21 .* \(lane (\d)\): starts, limit \d+ s$", proc.stdout, re.M)
    ended = re.findall(r"^\[ *\d+ s\] (\d+)/21 .* \(lane \d\): passed in \d+ s$", proc.stdout, re.M)
    assert sorted(int(n) for n, _ in started) == sorted(int(n) for n in ended) == list(range(1, 22))
    for lane in "12":
        order = [int(n) for n, own in started if own == lane]
        assert order == sorted(order) and order, f"lane {lane} ran its parts out of order: {order}"
    assert [int(n) for n, own in started if own == "1"][:6] == [1, 2, 3, 4, 5, 6]  # the decisive ones first
    assert "All parts that ran passed." in proc.stdout and "FAILED" not in proc.stdout and "| not run |" not in proc.stdout

    whole = proc.stdout.split("The whole table:\n", 1)[1].splitlines()
    header = whole.index("| part | what ran | figure | detail |")
    assert whole[header + 1] == "|---|---|---:|---|"
    body = whole[header + 2:]
    n_rows = next(i for i, line in enumerate(body) if not line.startswith("| "))
    assert [line for line in body[n_rows:] if line] == ["All parts that ran passed.", f"log: {log}"]
    rows = [cells(line) for line in body[:n_rows]]
    count: dict[str, int] = {}
    for row in rows:
        count[row[0]] = count.get(row[0], 0) + 1
    hazards = [row[0] for row in rows if row[0].startswith("hazard ")]
    assert [name.split(":")[0] for name in hazards] == [f"hazard {n}" for n in (1, 2, 3, 4, 5, 9)]
    assert count == {"device decode": 1, "race probe": 2, "batch independence": 1, **dict.fromkeys(hazards, 1),
                     "graph capture": 1, "/dev/shm": 1, "loader": 4, "device finish": 7, "throughput": 3,
                     "JPEG path": 4, "CIFAR-10 demo recipe": 2, "CUDA syncs": 2, "smoke": 2}
    kinds = [row[0] for i, row in enumerate(rows) if i == 0 or rows[i - 1][0] != row[0]]
    assert kinds == ["device decode", "race probe", "batch independence", *hazards, "graph capture", "/dev/shm", "loader",
                     "device finish", "throughput", "JPEG path", "CIFAR-10 demo recipe", "CUDA syncs", "smoke",
                     "CUDA syncs"]
    assert all(lines.count(line) == 2 for line in body[:n_rows])  # printed as each part ended, and again at the end
    by_part = {part: [row for row in rows if row[0] == part] for part in count}
    assert ", v2, cifar10 64 px" in by_part["throughput"][2][1]
    assert all("steps 3-4 of epoch 1" in row[3] for row in by_part["JPEG path"])
    assert by_part["device decode"][0][2] == "max 0, mean 0.000"
    assert [row[2] for row in by_part["race probe"]] == ["0 of 2 differed", "0 of 2 differed"]
    assert by_part["graph capture"][0][2] == "equal"
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
