"""bench/gpu_check.py, the GPU check (bench/gpu_check.sh its entry point). On a machine that
cannot run it: one line naming what is missing, exit 2, at once, nothing measured (the GPU run
itself is the check's job, not the tests'). Its plan: the decisive parts first, the planned limits
within the budget, the figures the docs state, a budget too small for the decisive parts refused
in one line. Its runner, on stand-in parts: the table's order, each part's rows then the whole
table last in a log that is the console's lines, a failed part's FAILED row and the parts that
read what it writes not run, the parts left out for the budget named, a part past its limit
killed with its children, --cpu-smoke's two parts side by side said in the table's order, the part
after a size fit started once the fit has ended. The workers and batch it fits to a /dev/shm of a
given size pass the project's own check. Its parts on the CPU: bench/device_finish.py's decode comparison, race
probe, loader and profile rows on a small ImageNet-like folder (their figures real, their checks
able to fail), the JPEG rows' interval inside the first epoch, and (slow) the whole --cpu-smoke
run: every part passes and its rows appear in the table's order."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO, cli_env

from bench import device_finish, gpu_check, gpu_preflight
from bench.gpu_check import PARTS, Part


def gpu_check_sh(*args: str, python: str = sys.executable, timeout: float = 120,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in cli_env({"PYTHON": python}).items() if k not in ("OUT", "GPU_CHECK_BUDGET")}
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd="/", env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_without_a_gpu_the_check_stops_at_once_with_one_line(tmp_path):
    proc = gpu_check_sh(env={"OUT": str(tmp_path)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no usable NVIDIA GPU" in proc.stderr and "--cpu-smoke" in proc.stderr
    assert (tmp_path / "gpu_check.log").read_text() == proc.stderr  # the line the GPU run returns


def test_a_python_without_torch_is_named(tmp_path):
    bare = tmp_path / "python"  # this interpreter without site-packages: torch cannot import
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')
    bare.chmod(0o755)
    proc = gpu_check_sh(python=str(bare))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "cannot import torch" in proc.stderr and "PYTHON=" in proc.stderr
    missing = gpu_check_sh(python=str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no python at PYTHON=" in missing.stderr


def test_a_wrong_argument_or_budget_is_refused_in_one_line(monkeypatch, capsys):
    """A typo, a budget that is not whole seconds, a budget under what the pre-flight and the
    decisive parts need: one line, exit 2, before the pre-flight; the smallest budget it names is
    accepted."""
    proc = gpu_check_sh("--cpu-smoek")
    assert proc.returncode == 2 and proc.stderr.strip() == "usage: bash bench/gpu_check.sh [--cpu-smoke] [--plan]"
    for budget in ("9m", "300"):
        monkeypatch.setenv("GPU_CHECK_BUDGET", budget)
        assert gpu_check.main([]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and ("whole number" in err if budget == "9m" else
                                                       "300 s is less than the pre-flight and the decisive parts" in err)
    need = int(re.search(r"set GPU_CHECK_BUDGET=(\d+) or more", err).group(1))
    for budget, code in ((need - 1, 2), (need, 0)):
        monkeypatch.setenv("GPU_CHECK_BUDGET", str(budget))
        assert gpu_check.main(["--plan"]) == code
    assert f"planned: {need} s of the {need} s budget" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the plan
def test_the_plan_puts_the_decisive_parts_first_and_sums_within_the_budget(capsys):
    """The decisive parts (the JPEG folder, decode, the race probe and its control, batch
    independence, the hazards, graph capture) lead the table; at 560 s on a GPU the plan adds the
    /dev/shm fit, the loader and the breakdown (545 s), 1270 s plans every part, and these are the
    figures docs/performance.md states; --cpu-smoke plans every part at its default budget."""
    decisive = [part.key for part in PARTS if part.decisive]
    assert decisive == [part.key for part in PARTS[:7]] == ["jpeg_folder", "decode", "race", "race_control",
                                                             "independence", "hazards", "capture"]
    default = gpu_check.plan(PARTS, False, None)
    assert (default.budget, default.decisive, default.used, default.every) == (560, 390, 545, 1270)
    assert [part.key for part, planned in zip(PARTS, default.planned) if planned][7:] == ["shm", "loader", "breakdown"]
    cost = [limit + gpu_check.KILL_AFTER for limit in default.limits]
    assert default.used == 45 + 10 + sum(cost[:10]) and default.every == 45 + 10 + sum(cost)
    docs = " ".join((REPO / "docs" / "performance.md").read_text().split())
    assert "(390 s)" in docs and "(545 s)" in docs and "GPU_CHECK_BUDGET=1270" in docs
    for budget in (390, 545, 544, 1269, 1270):
        p = gpu_check.plan(PARTS, False, budget)
        first_unplanned = p.planned.index(False) if False in p.planned else len(PARTS)
        assert p.planned == [True] * first_unplanned + [False] * (len(PARTS) - first_unplanned)
        assert p.used <= budget and (p.used == p.every) == (budget >= 1270)
    smoke = gpu_check.plan(PARTS, True, None)
    assert all(smoke.planned) and smoke.budget == smoke.every

    assert gpu_check.main(["--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["planned: 545 s of the 560 s budget (the pre-flight and the decisive parts: 390 s)",
                          "if time is left: 11 part(s), each run only if the time left covers its limit; "
                          "GPU_CHECK_BUDGET=1270 plans every part"]
    states = [line.split(" s  ")[-1] for line in lines[1:-2]]
    assert states == ["decisive"] * 8 + ["planned"] * 3 + ["if time is left"] * 11


# ----------------------------------------------------------------------------- the runner, on stand-in parts
def stand_in(key: str, code: str, limit: int = 5, **kwargs) -> Part:
    """A part that runs ``python -c code``, the same limit on a GPU and in --cpu-smoke."""
    return Part(key, key, f"{key}: a stand-in", f"-c \"{code}\"", (limit, limit), **kwargs)


def run_stand_ins(parts: list[Part], budget: int, tmp_path, monkeypatch, capsys) -> tuple[int, str, list[str]]:
    """gpu_check.main over ``parts`` in --cpu-smoke, the pre-flight a stand-in: (exit code, the
    console's text, the whole table's rows)."""
    monkeypatch.setattr(gpu_check, "PREFLIGHT", "-c \"print('a machine line')\"")
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("GPU_CHECK_BUDGET", str(budget))
    code = gpu_check.main(["--cpu-smoke"], parts)
    out = capsys.readouterr().out
    log = tmp_path / "gpu_check.log"
    assert log.read_text() == out and out.splitlines()[0] == out.splitlines()[-1] == f"log: {log}"
    whole = out.split("The whole table:\n", 1)[1].splitlines()
    header = whole.index("| part | what ran | figure | detail |")
    assert whole[header - 2] == "a machine line" and whole[header + 1] == "|---|---|---:|---|"
    rows = [line for line in whole[header + 2:] if line.startswith("| ")]
    assert set(rows) <= set(out.split("\nTotal ")[0].splitlines())  # each printed as its part ended too
    return code, out, rows


def test_the_runner_runs_the_table_in_order_and_writes_the_whole_table_last(tmp_path, monkeypatch, capsys):
    """Each part's rows in the table's order: the rows its command prints, or its reader's; a
    part that fails keeps its rows, adds a FAILED row, and the part that reads what it writes is
    not run; its last lines are shown; exit 1; the sizes fill each command."""
    parts = [stand_in("alpha", "print('| alpha | one | 1 | x |'); print('| other | not alpha |')", decisive=True),
             stand_in("beta", "import sys; print('| beta | two | 2 | y |'); print('beta went wrong'); sys.exit(3)"),
             stand_in("gamma", "print('| gamma | never |')", needs="beta"),
             stand_in("delta", "import sys; print(sys.argv[1:])", read=lambda text, s: [f"| delta | {text.strip()} |"])]
    parts[3] = Part("delta", "delta", "delta: a stand-in", parts[3].command + " {loader_workers} x{jpeg_batch}", (5, 5),
                    read=parts[3].read)
    code, out, rows = run_stand_ins(parts, 200, tmp_path, monkeypatch, capsys)
    assert code == 1
    assert rows == ["| alpha | one | 1 | x |", "| beta | two | 2 | y |", "| beta | beta: a stand-in | FAILED | exit code 3 |",
                    "| gamma | gamma: a stand-in | FAILED | not run: beta: a stand-in did not pass |",
                    "| delta | ['1', 'x8'] |"]
    progress = re.findall(r"^\[ *\d+ s\] (\d/4 \w+): a stand-in: (starts|passed|FAILED \([^)]*\)|not run \([^)]*\))",
                          out, re.M)
    assert progress == [
        ("1/4 alpha", "starts"), ("1/4 alpha", "passed"), ("2/4 beta", "starts"), ("2/4 beta", "FAILED (exit code 3)"),
        ("3/4 gamma", "not run (its input is missing)"), ("4/4 delta", "starts"), ("4/4 delta", "passed")]
    assert "FAILED: beta: a stand-in; the last lines of its output:\n```\n| beta | two | 2 | y |\nbeta went wrong\n```" in out
    assert out.splitlines()[-2] == "1 part(s) FAILED: beta: a stand-in."


def test_the_parts_that_no_longer_fit_the_budget_are_left_out_and_named(tmp_path, monkeypatch, capsys):
    """Budget 100 s: the pre-flight (60 + 5 + 5) and a decisive part (5 + 5) are planned, the
    others wait for time left: a part of 20 s runs on the time the others did not use, one of
    100 s cannot and gets a "not run" row, one of 1 s after it still runs; exit 0."""
    parts = [stand_in("first", "print('| first | ran |')", decisive=True),
             stand_in("twenty", "print('| twenty | ran |')", limit=20), stand_in("long", "print('| long | ran |')", limit=100),
             stand_in("short", "print('| short | ran |')", limit=1)]
    code, out, rows = run_stand_ins(parts, 100, tmp_path, monkeypatch, capsys)
    assert code == 0 and "planned: 80 s of the 100 s budget (the pre-flight and the decisive parts: 80 s)" in out
    assert rows[:2] + rows[3:] == ["| first | ran |", "| twenty | ran |", "| short | ran |"]
    assert rows[2].startswith("| long | long: a stand-in | not run | left out for the budget: not in the plan for 100 s")
    assert re.search(r"3/4 long: a stand-in: not run \(left out for the budget: \d+ s left, its limit 100 s\)", out)
    assert out.splitlines()[-3:-1] == ["Not run, left out for the budget (GPU_CHECK_BUDGET=216 runs every part): "
                                       "long: a stand-in.", "All parts that ran passed."]


def test_a_part_past_its_limit_is_killed_with_its_children(tmp_path, monkeypatch, capsys):
    """A part that ignores TERM and leaves a child behind: after its limit (1 s) and KILL_AFTER
    (1 s) its whole process group is killed; its row says it timed out; the next part runs."""
    monkeypatch.setattr(gpu_check, "KILL_AFTER", 1)
    pid_file = tmp_path / "child.pid"
    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                f"open('{pid_file}', 'w').write(str(child.pid)); time.sleep(60)")
    began = time.monotonic()
    code, out, rows = run_stand_ins([stand_in("stubborn", stubborn, limit=1), stand_in("next", "print('| next | ran |')")],
                                    200, tmp_path, monkeypatch, capsys)
    assert code == 1 and time.monotonic() - began < 30
    assert rows == ["| stubborn | stubborn: a stand-in | FAILED | timed out after 1 s |", "| next | ran |"]
    child = int(pid_file.read_text())
    for _ in range(50):  # gone, or a zombie left to its new parent
        try:
            if open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the part's child {child} outlived it")


def test_in_cpu_smoke_two_parts_run_side_by_side_and_are_said_in_the_tables_order(tmp_path, monkeypatch, capsys):
    """--cpu-smoke runs two parts at a time: the first waits for a file that the second writes (one
    after another it would time out), yet its lines and rows come first; the part after one that
    ``fits`` sizes starts once that one has ended, and its command has the size it set."""
    flag = tmp_path / "flag"
    monkeypatch.setitem(gpu_check.CPU_SMOKE, "fitted", 0)

    def fit(text: str, s: dict) -> list[str]:
        s["fitted"] = 7
        return [f"| fit | {text.strip()} |"]

    parts = [stand_in("waits", f"import os, time\nwhile not os.path.exists('{flag}'): time.sleep(0.05)\nprint('| waits |')"),
             stand_in("writes", f"open('{flag}', 'w'); print('| writes |')"),
             stand_in("fit", "import time; time.sleep(1); print('fitted')", read=fit, fits=True),
             stand_in("uses", "import sys; print('| uses |', sys.argv[1:], '|')")]
    parts[3] = Part("uses", "uses", "uses: a stand-in", parts[3].command + " {fitted}", (5, 5))
    code, out, rows = run_stand_ins(parts, 200, tmp_path, monkeypatch, capsys)
    assert code == 0 and rows == ["| waits |", "| writes |", "| fit | fitted |", "| uses | ['7'] |"]
    progress = re.findall(r"^\[ *\d+ s\] (\d)/4 \w+: a stand-in: (starts|passed)", out, re.M)
    assert progress == [(str(i), state) for i in range(1, 5) for state in ("starts", "passed")]


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
@pytest.mark.parametrize("sizes", [gpu_check.GPU, gpu_check.CPU_SMOKE], ids=["gpu", "cpu-smoke"])
def test_the_jpeg_rows_interval_lies_inside_the_first_epoch(sizes):
    """The parsed interval (the last --log-every one) follows a warm-up interval and ends before
    the first epoch does: 10 classes x jpeg_per_class + 3 odd files, in batches of jpeg_batch."""
    steps_per_epoch = (10 * sizes["jpeg_per_class"] + 3) // sizes["jpeg_batch"]
    log, steps = sizes["jpeg_log"], sizes["jpeg_steps"]
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
    """``bash bench/gpu_check.sh --cpu-smoke``, the real parts at tiny sizes on the CPU: every
    part runs in the table's order and passes; its log is the console's lines; the whole table's
    rows, in order: each part's, the MoCo v2 throughput row on the full v2 recipe, the JPEG rows'
    in-epoch interval, the decode comparison exact and no race on the CPU, the graph capture
    equal (torch.compile's whole graph against eager, and the claim's scope), the loader at the
    /dev/shm fit's workers."""
    out = tmp_path / "out"
    proc = gpu_check_sh("--cpu-smoke", timeout=900, env={"OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stderr == "" and (out / "gpu_check.log").read_text() == proc.stdout
    n = len(PARTS)
    started = re.findall(rf"^\[ *\d+ s\] (\d+)/{n} .*: starts, limit \d+ s$", proc.stdout, re.M)
    ended = re.findall(rf"^\[ *\d+ s\] (\d+)/{n} .*: passed in \d+ s$", proc.stdout, re.M)
    assert started == ended[1:] == [str(i) for i in range(1, n + 1)] and ended[0] == "0"  # the pre-flight
    assert proc.stdout.splitlines()[-2] == "All parts that ran passed." and "FAILED" not in proc.stdout

    whole = proc.stdout.split("The whole table:\n", 1)[1].splitlines()
    rows = [cells(line) for line in whole[whole.index("|---|---|---:|---|") + 1:] if line.startswith("| ")]
    hazards = [row[0] for row in rows if row[0].startswith("hazard ")]
    assert [name.split(":")[0] for name in hazards] == [f"hazard {n}" for n in (1, 2, 3, 4, 5, 9)]
    kinds = [row[0] for i, row in enumerate(rows) if i == 0 or rows[i - 1][0] != row[0]]
    assert kinds == ["device decode", "race probe", "batch independence", *hazards, "graph capture", "/dev/shm", "loader",
                     "device finish", "throughput", "JPEG path", "CIFAR-10 demo recipe", "CUDA syncs", "smoke",
                     "CUDA syncs"]
    by_part = {kind: [row for row in rows if row[0] == kind] for kind in kinds}
    assert {kind: len(found) for kind, found in by_part.items() if len(found) > 1} == {
        "race probe": 2, "loader": 2, "device finish": 7, "throughput": 3, "JPEG path": 4, "CIFAR-10 demo recipe": 2,
        "CUDA syncs": 2, "smoke": 2}
    assert ", v2, cifar10 64 px" in by_part["throughput"][2][1]
    assert all("steps 3-4 of epoch 1" in row[3] and row[2].endswith(" img/s") and "?" not in row[1] + row[2]
               for row in by_part["JPEG path"])
    assert by_part["device decode"][0][2] == "max 0, mean 0.000"
    assert [row[2] for row in by_part["race probe"]] == ["0 of 2 differed", "0 of 2 differed"]
    capture = by_part["graph capture"][0]  # bench/augment_capture.py's lines, its claim's scope last
    assert capture[2] == "equal" and "ok torch.compile(fullgraph=True): max \\|compiled - eager\\|" in capture[3]
    assert "; scope: one atlas shape and batch size" in capture[3].split("ok torch.compile", 1)[1], capture
    assert [re.search(r"(\d+) worker", row[1]).group(1) for row in by_part["loader"]] == ["1", "1"]
    assert "?" not in " ".join(" ".join(row[:3]) for row in by_part["CIFAR-10 demo recipe"] + by_part["smoke"])


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
