"""Shards in an S3-compatible object store (``--data-dir s3://BUCKET/PREFIX``), against a real
S3 API server on localhost (moto's server mode): the shard-aware order (each rank reads whole
shards; a function of seed, epoch and world size; a resume at another world size sees each
remaining sample once), the bounded local cache emptied at start, the credentials never written
down, exact resume through the real scripts, and bad input as one line."""
from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
from helpers import REPO, assert_ok, assert_same_state, cli_env, free_port, load_ckpt, run_ranks

from ddp_utils.config import UsageError
from ddp_utils.data.object_store import ShardCache, check_address
from ddp_utils.data.pipeline import ShardedEvalSampler
from ddp_utils.data.sets import check_data_dir
from ddp_utils.data.shard_order import SHUFFLE_SHARDS, ShardAwareSampler, epoch_sequence
from ddp_utils.data.shards import INDEX, RECORDS, ShardIndex, ShardReader
from ddp_utils.train.preflight import check_cache_room
from train_classifier import ClassifierConfig

# 11 shards of 7 samples and one of 4: 81 samples
SHARD_OF = np.concatenate([np.full(7, s) for s in range(11)] + [np.full(4, 11)]).astype(np.int32)


def rank_orders(world_size: int, seed: int = 0, epoch: int = 0, skip: int = 0, earlier=()) -> list[list[int]]:
    orders = []
    for rank in range(world_size):
        sampler = ShardAwareSampler(SHARD_OF, world_size, rank, seed)
        sampler.set_epoch(epoch, skip, earlier)
        orders.append([index for _, index in sampler])
    return orders


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_reads_whole_shards_of_its_own_and_every_sample_once(world_size):
    orders = rank_orders(world_size)
    seen = [i for order in orders for i in order]
    assert len(seen) == len(set(seen)) == len(SHARD_OF) // world_size * world_size  # N mod W left out
    for order in orders:
        shards = set(SHARD_OF[order].tolist())
        assert len(shards) <= len(order) / 7 + 3  # its contiguous piece: about N / W / 7 shards (+ the short one)
        sequence = epoch_sequence(SHARD_OF, 0, 0).tolist()
        piece = sorted(order, key=sequence.index)  # the rank's contiguous piece, before its shuffle
        start = 0
        while start < len(piece):  # a window: the samples of the next 4 shards of the piece, shuffled
            shards = list(dict.fromkeys(SHARD_OF[piece[start:]].tolist()))[:SHUFFLE_SHARDS]
            size = int(np.isin(SHARD_OF[piece[start:]], shards).sum())
            assert sorted(order[start:start + size]) == sorted(piece[start:start + size])
            assert order[start:start + size] != piece[start:start + size]
            start += size
    others = [set(SHARD_OF[order].tolist()) for order in orders]
    shared = sum(len(a & b) for k, a in enumerate(others) for b in others[k + 1:])
    assert shared <= world_size - 1  # at most the shard on each boundary between two ranks' pieces


def test_the_order_is_a_function_of_seed_epoch_and_world_size():
    assert rank_orders(2) == rank_orders(2)
    assert rank_orders(2, epoch=1) != rank_orders(2) != rank_orders(2, seed=1)
    assert set(sum(rank_orders(2, epoch=1) + rank_orders(2), [])) == set(range(81))  # another sample left out
    assert rank_orders(2, skip=8) == [order[8:] for order in rank_orders(2)]  # a resume at the same shape
    first, second = (epoch_sequence(SHARD_OF, 0, e) for e in (0, 1))
    assert sorted(first) == list(range(len(SHARD_OF))) and not np.array_equal(first, second)


@pytest.mark.parametrize("segments", [
    [(3, 4, 2), (2, 5, None)],             # 3 ranks x batch 4 took 2 batches each; 2 ranks x 5 finish
    [(3, 4, 2), (2, 5, 1), (4, 2, None)],  # resized twice in one epoch
    [(2, 8, 3), (1, 8, None)],
])
def test_a_resume_at_another_shape_sees_each_remaining_sample_once(segments):
    """The stated rule: the epoch's samples each seen once, but for fewer than one global batch
    of the last shape (what every epoch's rounding drops)."""
    seen, earlier = [], []
    for world_size, batch, batches in segments:
        orders = rank_orders(world_size, earlier=earlier)
        whole = min(len(order) // batch for order in orders)
        assert all(len(order) == len(orders[0]) for order in orders)
        for order in orders:
            seen += order[:(batches if batches is not None else whole) * batch]
        if batches is not None:
            earlier.append((world_size, batch, batches))
    assert len(seen) == len(set(seen))
    last_world, last_batch, _ = segments[-1]
    assert len(SHARD_OF) - len(seen) < last_world * last_batch


# ----------------------------------------------------------------------------- the store, the cache
def test_the_cache_holds_at_most_its_bound_and_starts_empty(bucket, written, tmp_path):
    index, local = ShardIndex.read(f"{bucket}/train"), ShardReader(ShardIndex.read(str(written / "train")))
    largest = max(shard["bytes"] for shard in index.shards)
    cache = ShardCache(str(tmp_path / "cache"), int(2.5 * largest))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "left-by-a-preempted-attempt.part-1").write_bytes(b"x" * 100)
    cache.start_empty()
    assert list((tmp_path / "cache").iterdir()) == []
    reader, held = ShardReader(index, cache), []
    for i in np.argsort(index.shard, kind="stable").tolist():  # every shard in turn, as a rank reads its piece
        assert bytes(reader.read(i).numpy()) == bytes(local.read(i).numpy())
        held.append(sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.tar")))
    assert max(held) <= 2.5 * largest
    assert [address for address, _ in cache.downloads()] == [f"{bucket}/train/{s['name']}" for s in index.shards]
    assert reader.open_shards <= ShardReader.OPEN_FROM_CACHE


def _open_shard(cache: ShardCache, address: str, size: int) -> None:
    os.close(cache.open(address, size))


def test_processes_sharing_a_cache_download_a_shard_once(bucket, tmp_path):
    """A rank's DataLoader workers share its cache: one downloads a shard, the others wait for it."""
    index = ShardIndex.read(f"{bucket}/train")
    cache = ShardCache(str(tmp_path / "cache"), 1 << 30).start_empty()
    address, size = f"{bucket}/train/{index.shards[0]['name']}", index.shards[0]["bytes"]
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_open_shard, args=(cache, address, size)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0] * 4
    assert cache.downloads() == [(address, size)]


def test_the_index_in_the_bucket_is_read_and_checked(bucket, written):
    here, there = ShardIndex.read(str(written / "train")), ShardIndex.read(f"{bucket}/train")
    assert there.shards == here.shards and np.array_equal(there.offset, here.offset) and there.paths == here.paths
    with pytest.raises(UsageError, match=r"^s3://ddp-test/nothing-here/train: no index.json; write the shards"):
        ShardIndex.read("s3://ddp-test/nothing-here/train")
    with pytest.raises(UsageError, match=r"^s3://no-such-bucket/x/index.json: the object store refused or could "
                                         r"not be reached \(NoSuchBucket; endpoint http://127.0.0.1:\d+\); check"):
        ShardIndex.read("s3://no-such-bucket/x")
    client = boto3.client("s3")  # a copy whose first shard did not arrive
    for name in (INDEX, RECORDS, *(shard["name"] for shard in here.shards[1:])):
        client.upload_file(str(written / "train" / name), "ddp-test", f"cut/train/{name}")
    with pytest.raises(UsageError, match=rf"^s3://ddp-test/cut/train/{here.shards[0]['name']}: missing; copy the "
                                         rf"shard again"):
        ShardIndex.read("s3://ddp-test/cut/train")
    largest = max(shard["bytes"] for shard in here.shards)
    with pytest.raises(UsageError, match=rf"^--shard-cache-gb 0.001: a rank's cache must hold 8 of the largest "
                                         rf"shard \({largest / 1e6:,.1f} MB\)"):
        check_cache_room(ClassifierConfig(dataset="shards", data_dir=bucket, shard_cache_gb=0.001), (here,))


def test_an_address_with_credentials_or_for_other_data_is_one_line():
    assert check_address("s3://KEY:SECRET@bucket/x") == (
        "--data-dir s3://KEY:SECRET@bucket/x: credentials do not belong in the address; set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
    assert check_data_dir("shards", "s3:///x", False) == "--data-dir s3:///x: no bucket; write s3://BUCKET/PREFIX"
    assert check_data_dir("imagefolder", "s3://b/x", False).startswith(
        "--data-dir s3://b/x: an object store holds shards only; write them with write_shards.py")


# ----------------------------------------------------------------------------- the real scripts
SMALL = ["--device", "cpu", "--arch", "small_cnn", "--image-size", "32", "--batch-size", "4", "--workers", "2",
         "--log-every", "1", "--aug-on", "device", "--moco-k", "32", "--knn-every", "1", "--dataset", "shards"]


@pytest.fixture(scope="module")
def whole_run(bucket, s3_server, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """MoCo on 2 ranks from the bucket, 1 epoch of 4 steps, each rank's cache in the run's tmp
    folder."""
    root = tmp_path_factory.mktemp("s3_whole")
    args = SMALL + ["--data-dir", bucket, "--epochs", "1", "--shard-cache-dir", str(root / "cache"),
                    "--out", str(root / "run")]
    proc = run_ranks("train_moco.py", args, root, env=s3_server)
    assert_ok(proc)
    return root, proc


def test_a_run_from_the_bucket_reads_each_of_its_shards_once_and_writes_no_credential(whole_run, bucket,
                                                                                     s3_server):
    root, proc = whole_run
    index = ShardIndex.read(f"{bucket}/train")
    (cache,) = (root / "cache").iterdir()  # one folder for the run, a folder per rank in it
    for rank in range(2):
        downloaded = [line.split()[0] for line in (cache / f"rank{rank}" / "downloads.txt").read_text().splitlines()]
        train = [address.rsplit("/", 1)[1] for address in downloaded if "/train/" in address]
        trained = ShardAwareSampler(index.shard, 2, rank, 0).order()[:16]  # its 4 batches of 4
        bank = list(ShardedEvalSampler(index.shard, 2, rank, index.shard))  # its half of the kNN bank
        for samples in (trained, bank):
            assert len({index.shard[i] for i in samples}) < len(index.shards) == 6
        sized = np.flatnonzero(index.shard == 0).tolist()  # the files whose sizes bound the workers' memory
        assert sorted(train) == sorted({index.shards[index.shard[i]]["name"] for i in [*trained, *bank, *sized]})
    assert re.search(r"final kNN acc1 [\d.]+% at step 4\n", proc.stdout)
    texts = [proc.stdout, proc.stderr] + [p.read_bytes().decode("latin-1") for p in (root / "run").rglob("*")
                                          if p.is_file()]
    for secret in (s3_server["AWS_SECRET_ACCESS_KEY"], s3_server["AWS_ACCESS_KEY_ID"]):
        assert not any(secret in text for text in texts)
    assert f'"data_dir": "{bucket}"' in (root / "run" / "config.json").read_text()


@pytest.mark.slow  # two more 2-rank runs and a 1-rank one
def test_a_resume_from_the_bucket_is_exact_at_the_same_shape_and_follows_the_rule_at_another(whole_run, bucket,
                                                                                          written, s3_server, tmp_path):
    root, _ = whole_run
    args = SMALL + ["--data-dir", bucket, "--epochs", "1", "--shard-cache-dir", str(tmp_path / "cache")]
    part = tmp_path / "part"
    assert_ok(run_ranks("train_moco.py", args + ["--max-steps", "3", "--out", str(part)], tmp_path, env=s3_server))
    local = [arg if arg != bucket else str(written) for arg in args[:-2]]  # the same shards on a file system
    proc = run_ranks("train_moco.py", local + ["--resume", str(part / "checkpoint_last.pt"), "--out",
                                               str(tmp_path / "local")], tmp_path)
    assert proc.codes == [2, 2] and proc.stderr.strip().endswith(
        "saved part way through an epoch read from an object store, whose order this run's --data-dir "
        f"{written} does not follow; resume from the same kind of location, or from a checkpoint at an epoch's end")
    resumed = run_ranks("train_moco.py", args + ["--resume", "auto", "--out", str(part)], tmp_path, env=s3_server)
    assert_ok(resumed)
    assert ": step 3, in epoch 1" in resumed.stdout
    assert_same_state(load_ckpt(part / "checkpoint_last.pt"), load_ckpt(root / "run" / "checkpoint_last.pt"))

    # 2 ranks x batch 4 stopped after 3 batches of epoch 1 (24 of its 38 samples); 1 rank takes
    # the other 15 of the 39 (3 batches), then 9 batches in epoch 2: step 3 + 3 + 9 = 15
    other, args = tmp_path / "other", [arg if arg != "1" or args[k - 1] != "--epochs" else "2"
                                       for k, arg in enumerate(args)] + ["--bn-splits", "4"]  # 1 rank: 4 BN groups
    assert_ok(run_ranks("train_moco.py", args + ["--max-steps", "3", "--out", str(other)], tmp_path, env=s3_server))
    proc = subprocess.run([sys.executable, str(REPO / "train_moco.py"), *args, "--resume", "auto", "--out", str(other)],
                          cwd=REPO, env=cli_env(s3_server), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "the samples of epoch 1 that the saved run did not reach are shared out among these ranks" in proc.stdout
    final = load_ckpt(other / "checkpoint_last.pt")
    assert (final["step"], final["epoch"], final["order_segments"]) == (15, 2, [])


@pytest.mark.slow  # two --check runs of the real CLI
def test_check_reads_the_bucket_and_an_unreachable_store_is_one_line(bucket, s3_server, tmp_path):
    args = [sys.executable, str(REPO / "train_classifier.py"), "--dataset", "shards", "--data-dir", bucket, "--device",
            "cpu", "--batch-size", "8", "--check", "--out", str(tmp_path / "run")]
    proc = subprocess.run(args, cwd=REPO, env=cli_env(s3_server), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "data: shards, 39 training and 12 validation images" in proc.stdout
    closed = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(args, cwd=REPO, env=cli_env({**s3_server, "AWS_ENDPOINT_URL": closed}), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"train_classifier.py: error: {bucket}/train/index.json: the object store refused or could not be reached "
        f"(EndpointConnectionError; endpoint {closed}); check the address, AWS_ENDPOINT_URL and the credentials "
        f"(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # one more 2-rank run
def test_the_classifier_trains_and_evaluates_from_the_bucket_on_the_loader_path(bucket, s3_server, tmp_path):
    """The other script and the other augmentation path: each rank reads its share of the
    validation shards (ordered by shard), every validation image counted once."""
    out = tmp_path / "run"
    proc = run_ranks("train_classifier.py", ["--device", "cpu", "--arch", "small_cnn", "--image-size", "32",
                                             "--batch-size", "4", "--workers", "1", "--aug-on", "loader", "--epochs",
                                             "1", "--dataset", "shards", "--data-dir", bucket, "--shard-cache-dir",
                                             str(tmp_path / "cache"), "--out", str(out)], tmp_path, env=s3_server)
    assert_ok(proc)
    assert re.search(r"epoch 1 step 4: val loss [\d.]+, val acc1 [\d.]+%, acc5 [\d.]+% \(12 images\)", proc.stdout)
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 4
