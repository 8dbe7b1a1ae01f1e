"""write_shards.py and the shards it writes: every file's original bytes, class, class name and
index kept, in tars that Python's tarfile and WebDataset's own pipeline read; any sample read
back by its number with one open per shard; a file that cannot be decoded stops the writer with
exit 2 and nothing written (or is left out and listed); a damaged shard set is one line; a run
with ``--dataset shards --order samples`` ends with the weights of the same run on the folder, bit
for bit (the shards order, the default, is tested in tests/test_object_store.py)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_ok, assert_same_state, cli_env, in_process, load_ckpt, run_ranks
from test_image_files import FOLDER_RUN, copy_of, damage, file_met_at_batch

import train_classifier
import write_shards
from ddp_utils.config import UsageError
from ddp_utils.data import shards as shards_module
from ddp_utils.data.image_files import FolderListing, ShardFiles, UnreadableImage
from ddp_utils.data.shards import INDEX, ShardIndex, ShardReader

SHARD_MB = "0.5"  # as conftest's ``written`` shards: the test folder's 39 training images make several


def write_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "write_shards.py"), *args], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_file_is_kept_with_its_bytes_class_name_and_index(jpeg_folder, written, split):
    listing = FolderListing.of(str(jpeg_folder / split))
    index = ShardIndex.read(str(written / split))
    samples = listing.samples()
    assert len(index) == len(samples) and index.classes == listing.classes
    assert (split == "val") or len(index.shards) >= 3
    reader = ShardReader(index)
    for i, (path, target) in enumerate(samples):
        assert bytes(reader.read(i).numpy()) == Path(path).read_bytes(), path
        assert int(index.label[i]) == target and int(index.index[i]) == i
        assert index.path(i) == os.path.relpath(path, jpeg_folder / split)
    written_order = []
    for number, shard in enumerate(index.shards):  # the layout, by a plain tar reader
        with tarfile.open(written / split / shard["name"]) as tar:
            names = tar.getnames()
            key = names[0].split(".")[0]
            meta = json.loads(tar.extractfile(f"{key}.json").read())
            assert sorted(names[:3]) == [f"{key}.cls", f"{key}.{Path(meta['path']).suffix.lower()[1:]}", f"{key}.json"]
            i = int(key)
            assert meta == {"path": index.path(i), "class": listing.classes[samples[i][1]], "index": i}
            assert int(tar.extractfile(f"{key}.cls").read()) == samples[i][1] and int(index.shard[i]) == number
            written_order += [int(name.split(".")[0]) for name in names[::3]]
    # written in an order drawn from --seed (0): each shard mixes the classes
    assert written_order == torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    assert split == "val" or len({int(index.label[i]) for i in written_order[:12]}) == 3


def test_webdatasets_own_pipeline_reads_the_shards(jpeg_folder, written):
    import webdataset

    index = ShardIndex.read(str(written / "train"))
    urls = [str(written / "train" / shard["name"]) for shard in index.shards]
    seen = {}
    for sample in webdataset.WebDataset(urls, shardshuffle=False):
        image_ext = next(ext for ext in sample if ext not in ("__key__", "__url__", "__local_path__", "cls", "json"))
        seen[int(sample["__key__"])] = (sample[image_ext], int(sample["cls"]), json.loads(sample["json"])["path"])
    samples = FolderListing.of(str(jpeg_folder / "train")).samples()
    assert sorted(seen) == list(range(len(samples)))
    for i, (path, target) in enumerate(samples):
        assert seen[i] == (Path(path).read_bytes(), target, index.path(i))


def test_any_order_opens_each_shard_once_per_process(written, monkeypatch):
    index = ShardIndex.read(str(written / "train"))
    opened = []
    real_open = os.open
    monkeypatch.setattr(shards_module.os, "open", lambda path, flags: opened.append(path) or real_open(path, flags))
    reader = ShardReader(index)
    order = list(range(len(index))) * 2
    random.Random(0).shuffle(order)
    for i in order:
        reader.read(i)
    assert sorted(Path(p).name for p in opened) == [shard["name"] for shard in index.shards]


def test_beyond_the_open_file_limit_the_least_recently_read_shard_is_closed(written):
    index = ShardIndex.read(str(written / "train"))
    whole, capped = ShardReader(index), ShardReader(index)
    assert whole.max_open >= len(index.shards)  # the limit raised as far as needed (or 1,024 - 256 anyway)
    capped.max_open = 2
    order = list(range(len(index))) * 2
    random.Random(1).shuffle(order)
    for i in order:
        assert bytes(capped.read(i).numpy()) == bytes(whole.read(i).numpy())
        assert capped.open_shards <= 2
    assert whole.open_shards == len(index.shards)


def test_a_file_that_cannot_be_decoded_stops_the_writer_and_nothing_is_written(jpeg_folder, tmp_path, capsys):
    """In this process (exit 2, nothing written), then the real CLI with --skip-unreadable."""
    data = copy_of(jpeg_folder, tmp_path)
    bad = sorted((data / "val").rglob("*.JPEG"))[1]
    damage(bad, "truncated")
    dst = tmp_path / "out"
    assert write_shards.main([str(data), str(dst), "--shard-mb", SHARD_MB]) == 2
    head, *files = capsys.readouterr().err.strip().splitlines()[-2:]
    assert head == ("write_shards.py: error: 1 of 51 image files cannot be decoded; nothing was written; fix or "
                    "remove them, or leave them out with --skip-unreadable:")
    assert len(files) == 1 and files[0].startswith(f"  {bad} (image file is truncated (")
    assert sorted(os.listdir(tmp_path)) == [data.name]  # no DST, no DST.partial-*

    proc = write_cli(str(data), str(dst), "--shard-mb", SHARD_MB, "--skip-unreadable")
    assert proc.returncode == 0, proc.stderr
    assert f"left out 1 file(s) that cannot be decoded:\n  {bad} (image file is truncated" in proc.stdout
    val = ShardIndex.read(str(dst / "val"))
    listing = FolderListing.of(str(data / "val"))
    left_out = [p for p, _ in listing.samples()].index(str(bad))
    assert len(val) == len(listing.targets) - 1 and left_out not in val.index.tolist()
    assert json.loads((dst / "val" / INDEX).read_text())["left_out"][0].startswith(f"{bad} (image file is truncated")


def test_wrong_commands_get_one_line_and_exit_2(jpeg_folder, written, tmp_path, capsys):
    before = sorted(p.name for p in (written / "train").iterdir())
    for args, said in [
        ([str(jpeg_folder), str(written)], f"write_shards.py: error: DST {written} exists; choose a new folder "
                                           f"(nothing there is changed)"),
        ([str(tmp_path / "nowhere"), str(tmp_path / "out")], f"write_shards.py: error: SRC {tmp_path / 'nowhere'}: "
                                                            f"no 'train/' folder; ImageFolder expects "
                                                            f"DIR/train/CLASS/*.jpg and DIR/val/CLASS/*.jpg"),
        ([str(jpeg_folder), str(tmp_path / "out"), "--shard-mb", "0"], "write_shards.py: error: --shard-mb must "
                                                                        "be positive, got 0.0"),
        ([str(jpeg_folder), str(tmp_path / "out"), "--shard-mbs", "3"], "write_shards.py: error: unrecognized "
                                                                         "arguments: --shard-mbs 3; did you mean "
                                                                         "--shard-mb? (see --help)"),
    ]:
        code = _exit_code(write_shards.main, args)  # in this process: the subprocess tests above and below
        err = capsys.readouterr().err
        assert code == 2 and err.strip().splitlines()[-1] == said and err.count("error:") == 1, err
    assert sorted(p.name for p in (written / "train").iterdir()) == before and not (tmp_path / "out").exists()


def test_each_bound_of_write_shards_is_one_line_and_exit_2_from_the_command_line(tmp_path):
    """write_shards.py's flags come from ``ShardsConfig``'s fields (``ddp_utils.config``): a value
    just past each field's bound, and a float that is not finite, refused by the real command
    line with one line naming the flag, before anything is read or written."""
    import dataclasses

    from ddp_utils.config import bounds_text, flag_name

    cases = []
    for f in dataclasses.fields(write_shards.ShardsConfig):
        bounds = f.metadata["bounds"]
        if bounds:
            value = bounds["above"] if "above" in bounds else bounds["at_least"] - 1
            shown = float(value) if isinstance(f.default, float) else value
            cases.append((flag_name(f.name), str(value), f"{flag_name(f.name)} must be {bounds_text(bounds)}, "
                                                         f"got {shown}"))
    # by hand, so that the loop cannot pass on empty metadata; nan: refused as every float flag is
    assert [flag for flag, _, _ in cases] == ["--shard-mb", "--threads"]
    cases.append(("--shard-mb", "nan", "argument --shard-mb: nan is not a finite number (see --help)"))
    with ThreadPoolExecutor(len(cases)) as pool:
        procs = list(pool.map(lambda case: write_cli("SRC", str(tmp_path / "out"), case[0], case[1]), cases))
    for (flag, value, said), proc in zip(cases, procs):
        assert proc.returncode == 2 and proc.stdout == "", (flag, value, proc.stderr)
        assert proc.stderr == f"write_shards.py: error: {said}\n", proc.stderr
    assert not (tmp_path / "out").exists()


def _exit_code(main, args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit:  # argparse's
        return exit.code


def test_a_missing_or_truncated_shard_or_a_foreign_index_is_one_line(written, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(written / "train", copy)
    first, second = (copy / name for name in ("shard-000000.tar", "shard-000001.tar"))
    size = first.stat().st_size
    first.write_bytes(first.read_bytes()[: size // 2])
    with pytest.raises(UsageError, match=rf"^{first}: {size // 2:,} bytes, the index says {size:,}; copy the shard "
                                         rf"again, or write the shards again$"):
        ShardIndex.read(str(copy))
    shutil.copy(written / "train" / first.name, first)
    second.unlink()
    with pytest.raises(UsageError, match=rf"^{second}: missing; copy the shard again"):
        ShardIndex.read(str(copy))
    shutil.copy(written / "train" / second.name, second)
    meta = json.loads((copy / INDEX).read_text())
    (copy / INDEX).write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(UsageError, match="not a ddp-image-shards v1 index; write the shards again"):
        ShardIndex.read(str(copy))


# ----------------------------------------------------------------------------- training from the shards
SMALL = ["--device", "cpu", "--arch", "small_cnn", "--image-size", "32", "--batch-size", "4", "--epochs", "1",
         "--workers", "1", "--log-every", "1"]
RUNS = {  # each of ImageFiles' three reads: PIL (loader path), decoded (device path), encoded (--decode-on device)
    "classifier, loader path": ("train_classifier.py", ["--aug-on", "loader"]),
    "moco, device path": ("train_moco.py", ["--aug-on", "device", "--moco-k", "32", "--knn-every", "1"]),
    "moco, decoded on the device": ("train_moco.py", ["--aug-on", "device", "--decode-on", "device", "--moco-k", "32",
                                                      "--knn-every", "1"]),
}


@pytest.mark.parametrize("run", [pytest.param("moco, device path"),
                                 pytest.param("classifier, loader path", marks=pytest.mark.slow),
                                 pytest.param("moco, decoded on the device", marks=pytest.mark.slow)])
def test_a_run_on_the_shards_ends_as_the_run_on_the_folder(jpeg_folder, written, tmp_path, run):
    """The same 2-rank run on the folder and on its shards read in the folder's order (``--order
    samples``): the same weights, optimizer state and evaluations (the kNN monitor's bank and
    queries included), bit for bit."""
    script, flags = RUNS[run]
    outs = {}
    for dataset, data, order in (("imagefolder", jpeg_folder, []), ("shards", written, ["--order", "samples"])):
        outs[dataset] = tmp_path / dataset
        proc = run_ranks(script, SMALL + flags + order + ["--dataset", dataset, "--data-dir", str(data),
                                                          "--out", str(outs[dataset])], tmp_path)
        assert_ok(proc)
        outs[dataset + " log"] = [re.sub(r" in [\d.]+ s$", "", line.split("] ", 1)[1]) for line in proc.stdout.splitlines()
                                  if re.search(r"val acc1|kNN acc1", line)]  # without the pass's time
    assert_same_state(load_ckpt(outs["shards"] / "checkpoint_last.pt"),
                      load_ckpt(outs["imagefolder"] / "checkpoint_last.pt"))
    assert outs["shards log"] == outs["imagefolder log"] and outs["shards log"]


@pytest.mark.slow  # two runs of --check; the index's checks are in the fast tier above
def test_check_reads_the_shards_and_a_damaged_one_stops_it_with_one_line(written, tmp_path):
    args = ["--dataset", "shards", "--data-dir", str(written), "--device", "cpu", "--batch-size", "8", "--check"]
    proc = subprocess.run([sys.executable, str(REPO / "train_moco.py"), *args, "--out", str(tmp_path / "run")],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "data: shards, 39 training and 12 validation images" in proc.stdout
    broken = tmp_path / "broken"
    shutil.copytree(written, broken)
    (broken / "val" / "shard-000000.tar").unlink()
    proc = subprocess.run([sys.executable, str(REPO / "train_moco.py"), *args[:3], str(broken), *args[4:],
                           "--out", str(tmp_path / "run")], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"train_moco.py: error: {broken}/val/shard-000000.tar: missing; copy the shard again, or write the shards "
        f"again"), proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_record_that_cannot_be_decoded_is_named_by_its_path_and_shard(written, tmp_path):
    copy = tmp_path / "train"
    shutil.copytree(written / "train", copy)
    index = ShardIndex.read(str(copy))
    i = 5
    shard = copy / index.shards[int(index.shard[i])]["name"]
    with open(shard, "r+b") as f:  # the image's bytes zeroed where they lie: the shard keeps its size
        f.seek(int(index.offset[i]))
        f.write(bytes(int(index.size[i])))
    files = ShardFiles(ShardIndex.read(str(copy)))
    with pytest.raises(UnreadableImage) as raised:
        files.decode_pil(i)
    assert raised.value.path == f"{index.path(i)} in {shard}"
    assert files[i][1] == -1 - i and files[i + 1][1] == int(index.label[i + 1])  # a placeholder, as for a file


@pytest.mark.slow  # three 2-rank runs
def test_a_run_on_the_shards_resumed_mid_epoch_ends_as_the_uninterrupted_one(written, tmp_path):
    """MoCo on the shards in their own order, 2 epochs of 4 steps: stopped at step 3 (--max-steps)
    and resumed with --resume auto, it ends with the uninterrupted run's state, bit for bit."""
    args = SMALL + RUNS["moco, device path"][1] + ["--dataset", "shards", "--data-dir", str(written), "--epochs", "2"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert_ok(run_ranks("train_moco.py", args + ["--out", str(whole)], tmp_path))
    assert_ok(run_ranks("train_moco.py", args + ["--max-steps", "3", "--out", str(part)], tmp_path))
    resumed = run_ranks("train_moco.py", args + ["--resume", "auto", "--out", str(part)], tmp_path)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and ": step 3, in epoch 1" in resumed.stdout
    assert_same_state(load_ckpt(part / "checkpoint_last.pt"), load_ckpt(whole / "checkpoint_last.pt"))
    assert load_ckpt(whole / "checkpoint_last.pt")["step"] == 8  # the shards order: 19 samples a rank, 4 steps an epoch


def test_a_damaged_record_mid_epoch_stops_after_a_checkpoint_and_the_fixed_run_ends_as_if_never_met(
        jpeg_folder, written, tmp_path, capsys):
    """As a damaged file in a folder (tests/test_image_files.py): the record is named once by its
    path and shard, step 6 is not taken, exit 2 after step 5's checkpoint; a resume refuses while
    the record still fails, and once the shard is whole again the run ends as on intact shards."""
    shards = Path(shutil.copytree(written, tmp_path / "shards"))
    met = file_met_at_batch(jpeg_folder, batch=5, batch_size=4)  # the same order on the folder's shards
    index = ShardIndex.read(str(shards / "train"))
    i = index.paths.split("\0").index(os.path.relpath(met, jpeg_folder / "train"))
    shard = shards / "train" / index.shards[int(index.shard[i])]["name"]
    original = shard.read_bytes()
    with open(shard, "r+b") as f:  # the record's bytes zeroed: the shard keeps its size and passes the pre-flight
        f.seek(int(index.offset[i]))
        f.write(bytes(int(index.size[i])))
    name = f"{index.path(i)} in {shard}"
    args = ["--dataset", "shards", "--order", "samples", *FOLDER_RUN[2:], "--batch-size", "4", "--epochs", "2"]
    out = tmp_path / "run"
    proc = in_process(train_classifier.main, args + ["--data-dir", str(shards), "--out", str(out)], capsys)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and said.count(name) == 1 and "Traceback" not in said, said
    assert re.search(rf"ERROR step 6 \(not taken\): cannot decode {re.escape(name)} \(.*\); copy its shard again from "
                     r"where write_shards.py wrote it \(--check-data compares every shard with its index\), then "
                     r"continue with --resume auto", said)
    stopped = load_ckpt(out / "checkpoint_last.pt")
    assert (stopped["step"], stopped["epoch"], stopped["batches_done"]) == (5, 0, 5)
    proc = in_process(train_classifier.main, args + ["--data-dir", str(shards), "--out", str(out), "--resume", "auto"],
                      capsys)
    assert proc.returncode == 2 and f"cannot decode {name}" in proc.stderr and "stopped there" in proc.stderr
    shard.write_bytes(original)  # copied again, as the line says
    assert_ok(in_process(train_classifier.main, args + ["--data-dir", str(shards), "--out", str(out), "--resume",
                                                         "auto"], capsys))
    assert not (out / "UNREADABLE").exists()
    reference = tmp_path / "reference"
    assert_ok(in_process(train_classifier.main, args + ["--data-dir", str(written), "--out", str(reference)], capsys))
    assert_same_state(load_ckpt(out / "checkpoint_last.pt"), load_ckpt(reference / "checkpoint_last.pt"))


def test_check_data_checks_each_shards_sha256_then_decodes_every_record(written, tmp_path, capsys):
    shards = Path(shutil.copytree(written, tmp_path / "shards"))
    args = ["--dataset", "shards", *FOLDER_RUN[2:], "--batch-size", "4", "--check-data", "--out", str(tmp_path / "run")]
    proc = in_process(train_classifier.main, args + ["--data-dir", str(shards)], capsys)
    assert proc.returncode == 0 and re.search(r"  data check: all 51 image files decode", proc.stdout)
    index = ShardIndex.read(str(shards / "val"))
    shard = shards / "val" / index.shards[1]["name"]
    with open(shard, "r+b") as f:  # one byte of an image changed: the size still matches the index
        f.seek(int(index.offset[int((index.shard == 1).argmax())]) + 100)
        f.write(b"\x00")
    proc = in_process(train_classifier.main, args + ["--data-dir", str(shards)], capsys)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "train_classifier.py: error: --check-data: 1 shard(s) differ from the ones the index was written with:",
        f"  {shard}: its bytes are not those the index was written with (sha256); copy the shard again"]
    assert not (tmp_path / "run").exists()
