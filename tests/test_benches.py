"""Benchmarks run end to end on tiny sizes and print their tables (the object store's: moto's S3
server behind the far network on 127.0.0.1); their timings are not checked, only what must
hold whatever the machine (requests per shard, op counts, bytes by formula, every row, ratios
that agree with the figures they divide). Every bench/ file is named by such a run (SMOKE_TESTS),
so that a change which breaks one fails here."""
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


@pytest.mark.slow  # moto's server and every download layer, 1 round: the source of a table in docs/performance.md
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
        epoch, rate, _, wait, near_wait, in_flight, gets, heads, ranged = cells[:9]
        assert epoch == "1" and float(rate.replace(",", "")) > 0 and re.fullmatch(r"\d+%", wait) and near_wait == wait
        assert 1 <= int(in_flight) <= 16  # the read-ahead's own report: --shard-downloads 16 at most
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


# ----------------------------------------------------------------------------- the other benches, tiny
# Every bench/ file and the test that runs its command line at a tiny size; a bench added without
# one fails test_every_bench_has_a_smoke_run. Those that the GPU check runs are covered by its
# --cpu-smoke (tests/test_gpu_check.py); at_commit.py is a library of augment.py and augment_host.py.
GPU_CHECK_SMOKE = "test_gpu_check.py::test_the_cpu_smoke_runs_every_part_in_order_into_its_log"
SMOKE_TESTS = {
    "accumulation.py": "test_accumulation_syncs_once_per_window_and_a_naive_loop_once_per_micro_step",
    "at_commit.py": "test_augment_host_counts_a_fixed_number_of_ops_per_batch_now_and_more_with_each_image_before",
    "augment.py": "test_augment_prints_every_table_with_consistent_ratios",
    "augment_capture.py": GPU_CHECK_SMOKE,
    "augment_host.py": "test_augment_host_counts_a_fixed_number_of_ops_per_batch_now_and_more_with_each_image_before",
    "cuda_syncs.py": GPU_CHECK_SMOKE,
    "device_finish.py": GPU_CHECK_SMOKE,
    "far_store.py": "test_far_store_trains_through_the_far_network_and_counts_one_get_per_shard",
    "file_list.py": "test_file_list_scans_once_per_rank_or_once_for_the_job",
    "gpu_check.py": GPU_CHECK_SMOKE,
    "gpu_check.sh": GPU_CHECK_SMOKE,
    "gpu_hazards.py": GPU_CHECK_SMOKE,
    "gpu_preflight.py": GPU_CHECK_SMOKE,
    "host_memory.py": "test_host_memory_prints_both_decode_places_with_their_bounds",
    "imagenet_like.py": GPU_CHECK_SMOKE,
    "jpeg_path.py": "test_jpeg_path_runs_every_row_of_its_table",
    "knn.py": "test_knn_measures_what_its_formulas_say_and_prints_imagenet_by_formula",
    "moco_step.py": "test_moco_step_parts_add_up_to_their_shares",
    "quickstart.py": "test_quickstart_runs_both_augmentation_places",
    "readme_figures.py": "test_readme_figures_parses_every_figure_of_its_commands",
    "safety.py": "test_safety_times_every_mode_against_the_first",
    "shards.py": "test_shards_prints_its_four_tables",
    "shuffle_bn.py": "test_shuffle_bn_counts_the_bytes_its_formula_gives",
    "store_clients.py": "test_store_clients_prints_every_row_with_its_requests_per_shard",
    "throughput.py": GPU_CHECK_SMOKE,
    "train_view.py": "test_train_view_times_every_recipe_on_both_sides",
}
# In one process (tests/run_benches.py), so that torch is imported once and ranks fork from one server.
SMOKE_COMMANDS = [
    "accumulation.py --arch small_cnn --image-size 16 --batch-size 2 --steps 1",
    "safety.py --arch small_cnn --batch-size 2 --samples 64 --steps 1 --rounds 1 --ckpt-every 2",
    "moco_step.py --arch small_cnn --image-size 16 --batch-size 4 --moco-k 16 --steps 1 --momentum-repeats 2",
    "knn.py --bank 64 --dim 16 --queries 32 --k 5 --rounds 1",
    "shuffle_bn.py --worlds 2 --repeats 1 --byte-steps 1",
    "file_list.py --root {tmp}/tree --train 1000 --val 1000 --rounds 1",  # a file per class at least
    "augment.py --sizes 16 --batch-size 8 --samples 8 --repeats 1 --packed-images {packed}",
    "host_memory.py --batch-sizes 2 --workers 1 --consume-ms 0",
    "shards.py --images 8 --rounds 1 --ranks 2 --workers 2 --startup-images 2000 --work {tmp}/shards",
    "quickstart.py --smoke",
    "readme_figures.py --smoke --seeds 0 --runs moco,probe",
]


def test_every_bench_has_a_smoke_run():
    """Each bench/ file is named above, by a test that exists; the GPU check runs those it covers."""
    benches = {p.name for p in (REPO / "bench").iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
    assert benches == set(SMOKE_TESTS), f"without a smoke run: {sorted(benches - set(SMOKE_TESTS))}; " \
                                        f"named but gone: {sorted(set(SMOKE_TESTS) - benches)}"
    from bench.gpu_check import PARTS, PREFLIGHT

    gpu_check = [PREFLIGHT.split()[0], *(word for part in PARTS for word in part.command.split())]
    for bench, test in SMOKE_TESTS.items():
        file, _, name = test.rpartition("::")
        assert f"\ndef {name}(" in (REPO / "tests" / (file or "test_benches.py")).read_text(), (bench, test)
        if test == GPU_CHECK_SMOKE and not bench.startswith("gpu_check."):
            assert f"bench/{bench}" in gpu_check, bench
    run_by_smoke = {command.split()[0] for command in SMOKE_COMMANDS}
    assert all(f"test_{bench.removesuffix('.py')}_" in SMOKE_TESTS[bench] for bench in run_by_smoke)


def run_benches(commands: list[str], timeout: float) -> dict[str, tuple[int, str]]:
    """{bench file: (exit code, output)} of ``commands`` run by tests/run_benches.py in one process."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "run_benches.py"), *commands], cwd=REPO, env=cli_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout
    outputs = {}
    for section in proc.stdout.split("==> bench/")[1:]:
        command, _, rest = section.partition("\n")
        output, _, code = rest.rpartition("<== exit ")
        outputs[command.split()[0]] = (int(code), output)
    assert len(outputs) == len(commands), proc.stdout
    return outputs


def test_a_failing_bench_gets_its_own_exit_code_and_the_next_one_still_runs():
    """The runner's negative control, on two benches that import no torch: a usage error exits 2
    in its own section, and the next command runs."""
    outputs = run_benches(["quickstart.py --rounds many", "readme_figures.py --runs classifier,nothing"], timeout=60)
    assert outputs["quickstart.py"][0] == 2 and "--rounds: invalid int value: 'many'" in outputs["quickstart.py"][1]
    assert outputs["readme_figures.py"][0] == 2 and "unknown run ['nothing']" in outputs["readme_figures.py"][1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """{bench file: (exit code, output)} of SMOKE_COMMANDS."""
    tmp = tmp_path_factory.mktemp("benches")
    history = subprocess.run(["git", "cat-file", "-e", "6a4b01f^{commit}"], cwd=REPO, capture_output=True).returncode == 0
    commands = [c.format(tmp=tmp, packed=2 if history else 0) for c in SMOKE_COMMANDS]  # packed: against 2 commits
    return run_benches(commands, timeout=900)


def output_of(smoke: dict, bench: str) -> str:
    code, output = smoke[bench]
    assert code == 0, f"bench/{bench} exited {code}:\n{output}"
    return output


def agrees(ratio: float, top: float, bottom: float, unit: float, ratio_unit: float) -> bool:
    """``ratio``, printed to ``ratio_unit``, is top / bottom for some values that print as ``top``
    and ``bottom`` to ``unit``."""
    low = (top - unit / 2) / (bottom + unit / 2)
    high = (top + unit / 2) / (bottom - unit / 2) if bottom > unit / 2 else float("inf")
    return low - ratio_unit / 2 <= ratio <= high + ratio_unit / 2


def columns(text: str, header: str) -> list[list[str]]:
    """The whitespace-separated rows under the line starting with ``header``, to the next blank line."""
    lines = text[text.index(header):].split("\n\n")[0].splitlines()[1:]
    return [line.split() for line in lines]


@pytest.mark.slow  # all SMOKE_COMMANDS in one process: about 2 minutes on 2 cores, the training runs most of it
def test_accumulation_syncs_once_per_window_and_a_naive_loop_once_per_micro_step(smoke):
    rows = columns(output_of(smoke, "accumulation.py"), "  A  bytes/grad ours")
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8], rows
    for accum, ours, naive, ours_s, naive_s, ratio in rows:
        assert (ours, naive) == ("1.00", f"{int(accum)}.00"), (accum, ours, naive)
        assert agrees(float(ratio), float(naive_s), float(ours_s), 0.001, 0.01), (accum, ratio, naive_s, ours_s)


@pytest.mark.slow
def test_safety_times_every_mode_against_the_first(smoke):
    out = output_of(smoke, "safety.py")
    rows = {line[:40].strip(): line[40:].split() for line in out[out.index("mode    "):].splitlines()[1:5]}
    assert list(rows) == ["agreement off, no checkpoints", "agreement on, no checkpoints",
                          "agreement on, checkpoint every 2", "agreement on, checkpoint every step"], out
    base = float(rows["agreement off, no checkpoints"][0])
    assert rows["agreement off, no checkpoints"][1] == "1.000"
    for name, (seconds, ratio) in rows.items():
        assert agrees(float(ratio), float(seconds), base, 0.001, 0.001), (name, seconds, ratio)


@pytest.mark.slow
def test_moco_step_parts_add_up_to_their_shares(smoke):
    out = output_of(smoke, "moco_step.py")
    parts = dict(re.findall(r"^  (\S.*?\S) +([\d.]+) ms +[\d.]+ %$", out, re.M))
    shares = [float(s) for s in re.findall(r" ms +([\d.]+) %$", out, re.M)]
    assert list(parts) == ["query forward+backward", "key forward (shuffle BN)", "enqueue", "optimizer step",
                           "momentum update"], out
    assert abs(sum(shares) - 100) <= 0.05 * len(shares), shares
    total = float(re.search(r"sum of parts +([\d.]+) ms", out).group(1))
    assert abs(sum(float(ms) for ms in parts.values()) - total) <= 0.05 * (len(parts) + 1), (parts, total)
    fused, loop, ratio = map(float, re.search(r"fused ([\d.]+) ms, Python loop ([\d.]+) ms, loop/fused = ([\d.]+)",
                                              out).groups())
    assert agrees(ratio, loop, fused, 0.01, 0.01), (loop, fused, ratio)


@pytest.mark.slow
def test_knn_measures_what_its_formulas_say_and_prints_imagenet_by_formula(smoke):
    """The bench asserts measured bytes and collectives equal its formulas (it exits 1 if not);
    ImageNet's rows are the formulas', fixed numbers."""
    rows = table_rows(output_of(smoke, "knn.py"), "| setting |")
    assert list(rows) == ["measured: M 64, D 16, N 32", "formula: ImageNet M 1,281,167, D 2048, N 50,000"], rows
    assert rows["measured: M 64, D 16, N 32"][0] == "2" and rows["measured: M 64, D 16, N 32"][5] == "5"
    assert rows["formula: ImageNet M 1,281,167, D 2048, N 50,000"][:7] == [  # the first, W 8, of the two
        "8", "10.51 GB", "657.24 MB (bf16)", "9.19 GB", "465.03 MB", "5", "100"]


@pytest.mark.slow
def test_shuffle_bn_counts_the_bytes_its_formula_gives(smoke):
    """The old path's traffic does not depend on the permutation: measured equals the formula."""
    out = output_of(smoke, "shuffle_bn.py")
    measured = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| 2 | ")][:2]
    assert [cells[1].strip() for cells in measured] == ["32 px", "224 px"], out
    for cells in measured:
        old, formula = cells[3].strip(), cells[5].split("/")[0].strip()
        assert old == formula, cells
    by_formula = table_rows(out, "| W | old MB received")
    assert list(by_formula) == ["8", "16", "32", "64", "128", "256", "512", "1024"], by_formula
    for world, (old, new, ratio) in by_formula.items():
        assert agrees(float(ratio.replace(",", "")), float(old.replace(",", "")), float(new.replace(",", "")),
                      0.1, 0.1), (world, old, new, ratio)
    host = table_rows(out, "| W | W*N | ms |")
    assert all(int(wn) == 32 * int(w) and float(ms) > 0 for w, (wn, ms) in host.items()), host
    for world, image, n, old_ms, new_ms, ratio in (r.strip("|").split("|") for r in out.splitlines()[-2:]):
        assert agrees(float(ratio), float(old_ms), float(new_ms), 0.1, 0.01), (image, old_ms, new_ms, ratio)


@pytest.mark.slow
def test_file_list_scans_once_per_rank_or_once_for_the_job(smoke):
    rows = table_rows(output_of(smoke, "file_list.py"), "| mode |")
    assert list(rows) == ["every rank scans", "rank 0 scans, sends", "rank 0 scans alone"], rows
    assert [cells[1] for cells in rows.values()] == ["2", "1", "1"], rows
    assert re.fullmatch(r"[\d.]+ MB to 1 rank\(s\)", rows["rank 0 scans, sends"][2]), rows
    assert all(re.fullmatch(r"[\d.]+ s", cells[0]) for cells in rows.values()), rows


@pytest.mark.slow
def test_augment_prints_every_table_with_consistent_ratios(smoke):
    out = output_of(smoke, "augment.py")
    if "ImageNet path" in out:  # a clone with the two commits compared
        packed = columns(out, "           CPU ms/img")
        assert [r[0] for r in packed] == ["8719b0f", "28751f1", "now"], out
        assert all(float(ms) > 0 and float(mb) > 0 for _, ms, mb in packed), packed
    (size, per_sample, batched, ratio), = columns(out, " size  per-sample/s")
    assert size == "16" and agrees(float(ratio.rstrip("x")), float(batched.replace(",", "")),
                                   float(per_sample.replace(",", "")), 1, 0.1), (per_sample, batched, ratio)
    (size, random_order, fixed_order), = columns(out, " size  random order")
    assert float(random_order) > 0 and float(fixed_order) > 0
    (size, whole, one_call, per_purpose, ratio), = columns(out, " size  augmentation")
    assert int(one_call) < int(per_purpose) < int(whole), out  # the uniforms: a part of the whole
    assert ratio == f"{int(per_purpose) / int(one_call):.1f}x", (one_call, per_purpose, ratio)


@pytest.mark.slow
def test_host_memory_prints_both_decode_places_with_their_bounds(smoke):
    out = output_of(smoke, "host_memory.py")
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| 2 |")]
    assert [cells[1].strip() for cells in rows] == ["workers", "device"], out
    for cells in rows:
        peak, bound, bound_13, pinned = (float(c.strip().removesuffix(" MB").replace(",", "")) for c in cells[2:])
        assert 0 <= peak and 0 < bound <= bound_13 and pinned > 0, cells  # 13 workers hold more than 1


@pytest.mark.slow
def test_shards_prints_its_four_tables(smoke):
    out = output_of(smoke, "shards.py")
    rates = table_rows(out, "| source |")
    assert list(rates)[:2] == ["folder (a file per image)", "shards on the file system"], rates
    assert rates["folder (a file per image)"][2] == "1.00x"
    opens = table_rows(out, "| one rank of 2, 2 workers")
    assert opens["folder"][1] == "1.00", opens  # an open per image
    assert float(opens["shards on the file system (the samples order)"][1]) < 1, opens
    startup = table_rows(out, "| start-up, a train/ like ImageNet's (2,000 images)")
    assert startup["scan the folder (one rank)"][1] == "1,001 folders, 3,000 entries", startup
    paper = table_rows(out, "| on paper: 512 GPUs x 2,500 img/s")
    assert paper["folder: an open (path lookup) per image"] == ["1,280,000"], paper


@pytest.mark.slow
def test_quickstart_runs_both_augmentation_places(smoke):
    out = output_of(smoke, "quickstart.py")
    rows = table_rows(out, "| --aug-on |")
    assert list(rows) == ["loader", "device"] and all(cells[0] == "1" for cells in rows.values()), rows
    assert all(0 <= float(cells[2]) <= 100 for cells in rows.values()), rows
    ratio = float(re.search(r"loader / device wall time: ([\d.]+)x", out).group(1))
    assert agrees(ratio, float(rows["loader"][1]), float(rows["device"][1]), 0.1, 0.01), (rows, ratio)


@pytest.mark.slow
def test_readme_figures_parses_every_figure_of_its_commands(smoke):
    """--smoke: each command one process of 2 steps, the MoCo quick start's kNN at epochs 0 and 1."""
    rows = table_rows(output_of(smoke, "readme_figures.py"), "| figure |")
    assert list(rows) == ["kNN epoch 0", "kNN epoch 1", "probe", "random probe"], rows
    for figure, (kernels, spread, each) in rows.items():
        assert kernels == "native" and spread == f"{each}-{each}%" and 0 <= float(each) <= 100, (figure, spread, each)
