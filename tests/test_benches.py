"""Benchmarks run end to end on tiny sizes and print their tables (the object store's: moto's S3
server behind the far network on 127.0.0.1); their timings are not checked, only what must
hold whatever the machine (requests per shard, op counts)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import REPO, cli_env


def table_rows(stdout: str, header: str) -> dict[str, list[str]]:
    """The rows of the first table whose header starts with ``header``: {first cell: the others}."""
    table = next(block for block in stdout.split("\n\n") if block.startswith(header))
    rows = {}
    for line in table.splitlines()[2:]:  # below the header and the alignment line
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.setdefault(cells[0], cells[1:])
    return rows


def run_bench(name: str, timeout: float, extra: list[str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / name), "--smoke", *(extra or [])], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_store_clients_prints_every_row_with_its_requests_per_shard():
    proc = run_bench("store_clients.py", timeout=180)
    rows = table_rows(proc.stdout, "| download layer")
    project = [name for name in rows if name.startswith("project: one GET per shard")]
    assert {"project: one GET per shard, 1 at a time", "project: one GET per shard, 4 at once"} <= set(project)
    for name in project:
        assert rows[name][2] == "1.00", (name, rows[name])  # requests per shard: one GET each
    transfer = {name: float(cells[2]) for name, cells in rows.items() if name.startswith("boto3 transfer manager")}
    assert len(transfer) == 3 and max(transfer.values()) > 1, transfer  # a HEAD first, ranged parts
    assert "What pays" in proc.stdout and "direct network" in proc.stdout


@pytest.mark.slow  # a 2-rank run under torchrun
def test_far_store_trains_through_the_far_network_and_counts_one_get_per_shard():
    proc = run_bench("far_store.py", timeout=300)
    rows = table_rows(proc.stdout, "| run |")
    assert set(rows) == {"far"}, rows
    for cells in rows.values():
        epoch, rate, _, wait, gets, heads, ranged = cells[:7]
        assert epoch == "1" and float(rate.replace(",", "")) > 0 and re.fullmatch(r"\d+%", wait)
        assert float(gets) >= 1 and float(heads) == float(ranged) == 0  # whole GETs, nothing else


@pytest.mark.slow  # two augmentation modules at full size; the fixed count itself is a fast test of test_batch_augment
def test_augment_host_counts_a_fixed_number_of_ops_per_batch_now_and_more_with_each_image_before():
    """Against 6a4b01f (one resize per image and view) where the clone has that commit; a
    shallow clone compares today's code with itself."""
    history = subprocess.run(["git", "cat-file", "-e", "6a4b01f^{commit}"], cwd=REPO, capture_output=True).returncode == 0
    proc = run_bench("augment_host.py", timeout=180, extra=[] if history else ["--before", "HEAD"])
    rows = table_rows(proc.stdout, "| images per batch")
    before = [int(cells[0].replace(",", "")) for cells in rows.values()]
    now = [int(cells[1].replace(",", "")) for cells in rows.values()]
    assert len(rows) == 2 and len(set(now)) == 1, rows
    assert before[1] > before[0] or not history, rows  # 6a4b01f: an op more per image and view
    assert "| host: thumbnails" in proc.stdout and "| with the arithmetic" in proc.stdout


@pytest.mark.slow  # a torch.compile trace in its own process; test_batch_augment traces the same in the fast tier
def test_augment_capture_probe_finds_the_augmentation_whole_under_torch_compile():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "augment_capture.py"), "--device", "cpu"], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok torch.compile(fullgraph=True): max |compiled - eager|" in proc.stdout


@pytest.mark.slow  # a process that writes JPEGs and imports torchvision: about 10 s
def test_train_view_times_every_recipe_on_both_sides():
    """bench/train_view.py on 4 JPEGs: a row per recipe, CPU milliseconds on both sides that an
    image's decode and crop take at least and no sane pipeline exceeds, and the ratio of the two."""
    proc = run_bench("train_view.py", timeout=120)
    rows = table_rows(proc.stdout, "| recipe |")
    assert list(rows) == ["classic: crop 224, flip", "v2: crop 176, flip, ta_wide, erase 0.1",
                          "v2 with ra (magnitude 9)", "v2 with augmix (severity 3)"], proc.stdout
    for name, (ours, theirs, ratio) in rows.items():
        ours_ms, theirs_ms = float(ours), float(theirs)
        assert 0.1 < ours_ms < 1000 and 0.1 < theirs_ms < 1000, (name, ours, theirs)
        assert abs(float(ratio.rstrip("x")) - theirs_ms / ours_ms) <= 0.01 + 0.01 * theirs_ms / ours_ms, (name, ratio)


@pytest.mark.slow  # writes JPEGs and runs every pipeline of the JPEG path's table: about 20 s
def test_jpeg_path_runs_every_row_of_its_table():
    """bench/jpeg_path.py, the source of docs/performance.md's JPEG-path figures, on 8 images:
    every row with a positive rate and its ms per image, one time behind both, each row's comparison
    with its before-row where it has one."""
    proc = run_bench("jpeg_path.py", timeout=300)
    rows = table_rows(proc.stdout, "| what runs per image")
    assert len(rows) >= 10 and "MoCo v2, two views: the official pipeline (PIL transforms, PIL blur)" in rows, proc.stdout
    for name, (rate, ms, vs_official, vs_before) in rows.items():
        per_second, ms_each = float(rate.replace(",", "")), float(ms)
        # one time per image behind both roundings: the rate to a unit, the milliseconds to 0.01
        assert per_second > 0 and 1000 / (per_second + 0.5) <= ms_each + 0.005, (name, rate, ms)
        assert per_second <= 0.5 or 1000 / (per_second - 0.5) >= ms_each - 0.005, (name, rate, ms)
        assert vs_official.endswith("x") and (vs_before.endswith("x") or vs_before == ""), name
