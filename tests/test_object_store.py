"""Shards in an S3-compatible object store (``--data-dir s3://BUCKET/PREFIX``), against a real
S3 API server on localhost (moto's server mode) behind a real network's faults (the proxy of
tests/far_network.py, which also counts every request the server answers):

* the shards order, one order for shards wherever they are (a function of seed, epoch and world
  size; each rank reads whole shards; a resume at another shape sees each remaining sample once),
  the samplers owning their state;
* the node's cache (one download per shard per node, a bound it keeps, holds it never deletes),
  the read-ahead (what the workers were asked for and a depth more, then the next epoch);
* one GET per shard, no HEAD, no ranged parts; a run from the bucket and the same run from the
  shards on a file system end bit for bit alike;
* faults: a short outage waited out (same weights), a long one stops every rank named with exit
  75 after a checkpoint and the resume ends bit for bit, a shard rewritten mid-run is named (exit
  2), a restarted attempt's pre-flight waits for the store; a resume on other data refused;
* no credential in any file or line; the cache's room refused in one line."""
from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Callable

import boto3
import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    assert_ok,
    assert_same_state,
    cli_env,
    free_port,
    in_process,
    load_ckpt,
    run_ranks,
    wait_until,
)

import train_moco
from ddp_utils.config import UsageError
from ddp_utils.data.object_store import (
    BucketMissing,
    Patience,
    ShardChanged,
    StoreUnavailable,
    check_address,
    describe_failure,
    fetch,
    is_transient,
    masked,
)
from ddp_utils.data.order import (
    SHUFFLE_SHARDS,
    ResumableDistributedSampler,
    ShardAwareSampler,
    ShardedEvalSampler,
    epoch_sequence,
)
from ddp_utils.data.sets import check_data_dir
from ddp_utils.data.shard_cache import CacheFull, NodeCache, ReadAhead, ReadAheadLoader, SplitShards, needs_of
from ddp_utils.data.shards import INDEX, RECORDS, ShardIndex, ShardReader
from ddp_utils.runtime.stopping import EXIT_STORE
from ddp_utils.train import preflight
from ddp_utils.train.preflight import check_cache_room
from train_classifier import ClassifierConfig, script_data, views_of

# 11 shards of 7 samples and one of 4: 81 samples
SHARD_OF = np.concatenate([np.full(7, s) for s in range(11)] + [np.full(4, 11)]).astype(np.int32)


def rank_orders(world_size: int, seed: int = 0, epoch: int = 0, skip: int = 0, earlier=(), batch: int = 1
                ) -> list[list[int]]:
    orders = []
    for rank in range(world_size):
        sampler = ShardAwareSampler(SHARD_OF, world_size, rank, seed, batch)
        if earlier:
            sampler.continue_from({"order": "shards", "epoch": epoch, "segments": [list(s) for s in earlier]}, 1)
        sampler.set_epoch(epoch, skip)
        orders.append([index for _, index in sampler])
    return orders


# ----------------------------------------------------------------------------- the shards order
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
    sampler = ShardAwareSampler(SHARD_OF, 2, 1, 0)
    sampler.set_epoch(3)
    assert sampler.indices_of_epoch(3).tolist() == [i for _, i in sampler]  # what the read-ahead fetches


@pytest.mark.parametrize("segments", [
    [(3, 4, 2), (2, 5, None)],             # 3 ranks x batch 4 took 2 batches each; 2 ranks x 5 finish
    [(3, 4, 2), (2, 5, 1), (4, 2, None)],  # resized twice in one epoch
    [(2, 8, 3), (1, 8, None)],
])
def test_a_resume_at_another_shape_sees_each_remaining_sample_once(segments):
    """The stated rule: the epoch's samples each seen once, but for fewer than one global batch
    of the last shape (what every epoch's rounding drops); each shape's state_dict carries the
    segments before it."""
    seen, earlier = [], []
    for world_size, batch, batches in segments:
        orders = rank_orders(world_size, earlier=earlier, batch=batch)
        whole = min(len(order) // batch for order in orders)
        assert all(len(order) == len(orders[0]) for order in orders)
        for order in orders:
            seen += order[:(batches if batches is not None else whole) * batch]
        if batches is not None:
            sampler = ShardAwareSampler(SHARD_OF, world_size, 0, 0, batch)
            sampler.continue_from({"order": "shards", "epoch": 0, "segments": [list(s) for s in earlier]}, 1)
            sampler.set_epoch(0)
            saved = sampler.state_dict(0, batches)
            earlier.append((world_size, batch, batches))
            assert saved == {"order": "shards", "epoch": 0, "segments": [list(s) for s in earlier]}
    assert len(seen) == len(set(seen))
    last_world, last_batch, _ = segments[-1]
    assert len(SHARD_OF) - len(seen) < last_world * last_batch


def test_each_sampler_continues_its_own_state_and_refuses_the_others_mid_epoch():
    shards = ShardAwareSampler(SHARD_OF, 2, 0, 0, batch_size=4)
    assert shards.continue_from({"order": "shards", "epoch": 1, "segments": [[2, 4, 6]]}, accum_steps=2) == (6, "")
    batches, remark = shards.continue_from({"order": "shards", "epoch": 1, "segments": [[2, 4, 5]]}, accum_steps=2)
    assert batches == 4 and "near, not exactly at" in remark  # a whole window of 2 micro-batches
    assert shards.continue_from({"order": "shards", "epoch": 1, "segments": [[3, 4, 2]]}, 1)[0] == 0
    samples = ResumableDistributedSampler(list(range(81)), 2, 0, 0, batch_size=4)
    assert samples.continue_from({"order": "samples", "epoch": 1, "segments": [[2, 4, 6]]}, 1) == (6, "")
    batches, remark = samples.continue_from({"order": "samples", "epoch": 1, "segments": [[3, 4, 3]]}, 1)
    assert batches == 4 and "near" in remark  # 36 samples consumed: 4 batches of 2 x 4, 4 seen again
    assert samples.state_dict(1, 5) == {"order": "samples", "epoch": 1, "segments": [[2, 4, 5]]}
    assert samples.continue_from({"order": "shards", "epoch": 2, "segments": []}, 1) == (0, "")  # an epoch's end
    for sampler, other in ((shards, "samples"), (samples, "shards")):
        with pytest.raises(UsageError, match=rf"^saved part way through an epoch read in the {other} order, which "
                                             rf"this run \(--order {sampler.kind}\) cannot continue; resume with "
                                             rf"--order {other}, or from a checkpoint at an epoch's end$"):
            sampler.continue_from({"order": other, "epoch": 0, "segments": [[2, 4, 1]]}, 1)


# ----------------------------------------------------------------------------- the store, the cache
def test_the_node_cache_keeps_its_bound_and_deletes_only_shards_no_rank_holds(bucket, written, tmp_path):
    index, local = ShardIndex.read(f"{bucket}/train"), ShardReader(ShardIndex.read(str(written / "train")))
    refs, largest = index.refs(), max(shard["bytes"] for shard in index.shards)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "left-by-a-preempted-attempt.part-1-1-100").write_bytes(b"x" * 100)
    cache = NodeCache(str(tmp_path / "cache"), int(2.5 * largest), rank=0, patience=0).prepare()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["locks"]
    patience = Patience(0)
    held = []
    for ref in refs:  # each in turn: the ones let go are deleted, least recently held first
        cache.hold(ref, patience)
        cache.release(ref.address)
        held.append(sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.tar")))
    assert max(held) <= 2.5 * largest
    reader = ShardReader(index, cache)
    for i in np.argsort(index.shard, kind="stable").tolist()[::5]:  # read back through the cache: the same bytes
        assert bytes(reader.read(i).numpy()) == bytes(local.read(i).numpy())
    assert [address for address, _ in cache.downloads()][:len(refs)] == [r.address for r in refs]
    assert reader.open_shards == 0  # each read opens its shard and closes it
    cache.hold(refs[0], patience)
    cache.hold(refs[1], patience)
    with pytest.raises(CacheFull, match=rf"^{tmp_path}/cache: the node's cache of shards may fill [\d.]+ GB and its "
                                        r"ranks hold [\d.]+ GB of it: no room for [\d.]+ MB more; raise "
                                        r"--shard-cache-gb"):
        cache.hold(refs[2], patience)  # no room, and every shard held: refused rather than over the bound
    assert all((tmp_path / "cache" / f"rank0/{local_name}").exists() for local_name in
               (r.address[5:].replace("/", "--") for r in refs[:2]))
    assert sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.tar")) <= 2.5 * largest


def _hold_as_rank(folder: str, rank: int, ref) -> None:
    cache = NodeCache(folder, 1 << 30, rank=rank, patience=10)
    os.close(os.open(cache.hold(ref, Patience(10)), os.O_RDONLY))


def test_the_ranks_of_a_node_download_a_shard_once(bucket, tmp_path):
    """Four processes as four ranks of one node ask for the same shard at once: one downloads it,
    the others wait and link it."""
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    NodeCache(str(tmp_path / "cache"), 1 << 30, rank=0, patience=10).prepare()
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_hold_as_rank, args=(str(tmp_path / "cache"), rank, ref)) for rank in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(60)
    assert [rank.exitcode for rank in ranks] == [0] * 4
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30, rank=0, patience=10)
    assert cache.downloads() == [(ref.address, ref.size)]
    assert all((tmp_path / "cache" / f"rank{rank}").is_dir() for rank in range(4))


def test_the_read_ahead_fetches_what_workers_asked_for_and_its_depth_then_lets_go_and_reads_the_next_epoch(
        bucket, tmp_path):
    index = ShardIndex.read(f"{bucket}/train")
    refs = index.refs()
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30, rank=0, patience=10).prepare()
    ahead = ReadAhead(cache, depth=1, downloads=1, quota=1 << 30)  # one at a time: the depth is 1
    held = lambda: sorted(os.listdir(tmp_path / "cache" / "rank0")) if (tmp_path / "cache" / "rank0").is_dir() else []  # noqa: E731, E501
    name = lambda n: refs[n].address[5:].replace("/", "--")  # noqa: E731
    order = np.argsort(index.shard, kind="stable")  # a pass over the shards in turn
    needs = needs_of(index.shard[order], refs)
    per_shard = [int((index.shard == s).sum()) for s in range(len(refs))]
    try:
        ahead.start_pass(needs, asked=per_shard[0], next_epoch=lambda: needs_of(index.shard[order[::-1]], refs))
        assert wait_until(lambda: held() == sorted([name(0), name(1)]))  # asked: shard 0; depth 1: shard 1
        time.sleep(0.3)
        assert held() == sorted([name(0), name(1)]) and len(cache.downloads()) == 2
        ahead.received(done=per_shard[0], asked=per_shard[0] + per_shard[1])  # shard 0's samples are in
        assert wait_until(lambda: held() == sorted([name(1), name(2)]))
        ahead.received(done=sum(per_shard[:2]), asked=len(order))  # every sample asked for: the rest, required
        last = len(refs) - 1
        assert wait_until(lambda: held() == sorted(name(n) for n in range(2, len(refs))))
        assert len(cache.downloads()) == len(refs)
        ahead.end_pass()  # the next epoch (read backwards) starts: its first shard is held on, depth 1
        assert wait_until(lambda: held() == [name(last)])
        time.sleep(0.3)
        assert held() == [name(last)] and len(cache.downloads()) == len(refs)
    finally:
        ahead.close()
        cache.leave(keep=False)
    assert not (tmp_path / "cache").exists()  # the node's last rank deleted it


class _Positions:
    """A data set whose sample is its (epoch, index) key's index: what a loader's order is, unread."""

    def __getitem__(self, key: tuple[int, int]) -> int:
        return key[1]


def test_a_read_ahead_loader_is_freed_by_its_last_reference(bucket, tmp_path):
    """No reference cycle through the read-ahead keeps a loader, its workers' queues and its
    iterator alive until the cycle collector runs (which finalized the queues first and left a
    rank waiting 5 s per worker at its end)."""
    index = ShardIndex.read(f"{bucket}/train")
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30, rank=0, patience=10).prepare()
    ahead = ReadAhead(cache, depth=1, downloads=1, quota=1 << 30)
    sampler = ShardAwareSampler(index.shard, 1, 0, seed=0, batch_size=8)
    gc.disable()
    try:
        loader = ReadAheadLoader(_Positions(), batch_size=8, sampler=sampler, read_ahead=ahead,
                                 shards=SplitShards(index.shard, index.refs()))  # it reads the next epoch ahead
        batches = list(loader)
        assert sorted(int(i) for batch in batches for i in batch) == list(range(len(index)))
        freed = weakref.ref(loader)
        del loader, batches
        assert freed() is None
    finally:
        gc.enable()
        ahead.close()
        cache.leave(keep=False)


def test_the_index_in_the_bucket_is_read_and_checked(bucket, written):
    here, there = ShardIndex.read(str(written / "train")), ShardIndex.read(f"{bucket}/train")
    assert there.shards == here.shards and np.array_equal(there.offset, here.offset) and there.paths == here.paths
    assert there.fingerprint == here.fingerprint and all(
        there.listed[shard["name"]].etag for shard in here.shards)
    assert np.array_equal(there.width, here.width) and there.width is not None  # what start-up needs, no shard read
    with pytest.raises(UsageError, match=r"^s3://ddp-test/nothing-here/train: no index.json; write the shards"):
        ShardIndex.read("s3://ddp-test/nothing-here/train")
    with pytest.raises(BucketMissing, match=r"^s3://no-such-bucket/x/index.json: no such bucket at this endpoint "
                                            r"\(NoSuchBucket; endpoint http://127.0.0.1:\d+\); check the bucket's name"):
        ShardIndex.read("s3://no-such-bucket/x")
    client = boto3.client("s3")  # a copy whose first shard did not arrive
    for name in (INDEX, RECORDS, *(shard["name"] for shard in here.shards[1:])):
        client.upload_file(str(written / "train" / name), "ddp-test", f"cut/train/{name}")
    with pytest.raises(UsageError, match=rf"^s3://ddp-test/cut/train/{here.shards[0]['name']}: missing; copy the "
                                         rf"shard again"):
        ShardIndex.read("s3://ddp-test/cut/train")


def test_the_caches_room_is_checked_in_one_line(bucket, written, tmp_path, monkeypatch):
    """The minimum is what the loaders hold at once (shard_cache.shards_in_use over the training
    pass, 2 workers x prefetch 2 + the batch received, windows of 4 shuffled shards, and the
    evaluation pass, in shard order; never more than the split's shards) and the shard the
    training process reads itself."""
    indexes = (ShardIndex.read(str(written / "train")), ShardIndex.read(str(written / "val")))
    largest = max(shard["bytes"] for index in indexes for shard in index.shards)
    fewest = [int(np.bincount(index.shard).min()) for index in indexes]
    in_use = max(min(SHUFFLE_SHARDS * ((5 * 4 - 2) // (SHUFFLE_SHARDS * fewest[0]) + 2), 5 * 4,  # 5 batches of 4
                     len(indexes[0].shards)),  # nor more than there are
                 min((3 * 16 - 2) // fewest[1] + 2, 3 * 16, len(indexes[1].shards)))  # validation: 3 batches of 16
    cfg = ClassifierConfig(dataset="shards", data_dir=bucket, shard_cache_dir=str(tmp_path / "new" / "cache"),
                           batch_size=4, workers=2)
    resolved, script = preflight.resolved_settings(cfg, "torchrun", 8, torch.device("cpu"), world_size=8), \
        script_data(cfg, views_of(cfg))
    capacity = check_cache_room(cfg, resolved, indexes, ranks_on_node=8, node="0", script=script)  # 0: sized; a folder made at start
    assert capacity == 8 * (in_use + 16 + 1) * largest  # and --shard-downloads 16 more, and one
    small = dataclasses.replace(cfg, shard_cache_gb=0.001)
    with pytest.raises(UsageError, match=rf"^--shard-cache-gb 0.001: each of the node's 8 rank\(s\) must hold "
                                         rf"{in_use + 1} of the largest shard \({largest / 1e6:,.1f} MB\) at once "
                                         rf"\({in_use} its loaders' workers read, one its training process reads\), "
                                         rf"[\d.]+ GB for the node; raise it \(0 sizes it to the read-ahead\), or "
                                         rf"lower --workers or --batch-size, or write larger shards"):
        check_cache_room(small, resolved, indexes, ranks_on_node=8, node="0", script=script)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 10**6))
    with pytest.raises(UsageError, match=rf"^--shard-cache-dir {tmp_path}/new/cache: 0.00 GB free, the node's cache of "
                                         rf"shards may fill [\d.]+ GB \(8 rank\(s\) x {in_use + 17} of the largest "
                                         rf"shard, {largest / 1e6:,.1f} MB\); point --shard-cache-dir at a local disk"):
        check_cache_room(cfg, resolved, indexes, ranks_on_node=8, node="0", script=script)


def test_an_object_store_without_boto3_installed_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "boto3" else real(name, *a))
    assert check_data_dir("shards", "s3://bucket/x", False) == (
        "--data-dir s3://bucket/x: reading an object store needs boto3, which is not installed; pip install -r "
        "requirements-shards.txt")


def test_no_line_repeats_a_credential():
    assert masked("s3://AKIAKEY:SECRET@bucket/x and https://user:pw@host:9000/p?X-Amz-Signature=abc&a=1") == \
        "s3://***@bucket/x and https://***@host:9000/p?X-Amz-Signature=***&a=1"
    assert check_address("s3://KEY:SECRET@bucket/x") == (
        "--data-dir s3://***@bucket/x: credentials do not belong in the address; set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
    assert check_data_dir("shards", "s3:///x", False) == "--data-dir s3:///x: no bucket; write s3://BUCKET/PREFIX"
    assert check_data_dir("imagefolder", "s3://b/x", False).startswith(
        "--data-dir s3://b/x: an object store holds shards only; write them with write_shards.py")


def test_an_endpoint_with_credentials_is_named_masked(monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://user:hunter2@127.0.0.1:1")
    line = describe_failure("s3://b/x/index.json", EndpointConnectionError(endpoint_url="http://user:hunter2@x"))
    assert "hunter2" not in line and "endpoint http://***@127.0.0.1:1" in line
    fault = StoreUnavailable("s3://b/x/train/shard-000000.tar", "EndpointConnectionError, for 3 s")
    assert "hunter2" not in str(fault) and "endpoint http://***@127.0.0.1:1" in str(fault)


def test_throttling_and_server_faults_are_waited_out_and_a_wrong_address_is_not():
    """What is sent again: the store's throttling and its own faults, the network's faults; not
    a missing object, refused or expired credentials (those are read again first:
    tests/test_store_faults.py), a precondition or a wrong endpoint. The patience's wait ends with
    the request that succeeds."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        EndpointResolutionError,
        ReadTimeoutError,
    )

    def failure(code: str, status: int = 400) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "..."}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "GetObject")

    for code in ("SlowDown", "InternalError", "RequestTimeout", "Throttling"):
        assert is_transient(failure(code)), code
    assert is_transient(failure("503", 503)) and is_transient(failure("ABusyStoresOwnCode", 503))
    assert not is_transient(failure("NotImplemented", 501))
    assert is_transient(EndpointConnectionError(endpoint_url="x")) and is_transient(ReadTimeoutError(endpoint_url="x"))
    for code in ("NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "PreconditionFailed",
                 "ExpiredToken"):
        assert not is_transient(failure(code)), code
    assert not is_transient(EndpointResolutionError(msg="Custom endpoint `x` was not a valid URI"))
    faults, waits = [failure("SlowDown"), failure("503", 503)], []

    def throttled(deadline: float) -> str:
        if faults:
            raise faults.pop(0)
        return "the object"

    assert Patience(30, on_recovered=lambda *said: waits.append(said)).call("s3://b/x", throttled) == "the object"
    (said,) = waits
    assert said[0] == "s3://b/x" and said[1] > 0 and said[2] == "503"


def test_a_fault_shorter_than_the_patience_is_waited_out_and_a_longer_one_exits_75(bucket, proxied):
    """The pre-flight's reads through a cut: waited out within the patience (a restarted
    attempt's), bad input at once without it (a first start: likely a wrong address), exit 75
    after it."""
    proxied.cut(1.5)
    started = time.monotonic()
    index = ShardIndex.read(f"{bucket}/val", patience=30)
    assert time.monotonic() - started >= 1.4 and len(index) == 12
    proxied.cut(60)
    with pytest.raises(UsageError, match=r"^s3://ddp-test/imagenet-like/val/index.json: the object store could not "
                                         r"be reached \((EndpointConnectionError|ConnectionClosedError)"):
        ShardIndex.read(f"{bucket}/val")
    with pytest.raises(StoreUnavailable, match=r"^s3://ddp-test/imagenet-like/val/index.json: the object store did "
                                               r"not answer \(\w+, for \d s; endpoint http://127.0.0.1:\d+\); the run "
                                               r"stops to be started again once it answers \(exit 75\)$") as err:
        ShardIndex.read(f"{bucket}/val", patience=1)
    assert err.value.exit_code == EXIT_STORE


def test_a_shard_is_one_get_pinned_to_the_version_listed(bucket, written, proxied, tmp_path):
    index = ShardIndex.read(f"{bucket}/train")
    ref = index.refs()[0]
    # Only this shard's requests: the proxy logs a request once it has sent the whole answer, so the
    # index's own requests may still be arriving in the log
    path = "/ddp-test/imagenet-like/train/shard-000000.tar"
    gets = lambda: [r for r in proxied.requests if r.path == path]  # noqa: E731
    logged = lambda count: wait_until(lambda: len(gets()) >= count, 5) and len(gets())  # noqa: E731
    before = len(gets())
    assert fetch(ref, str(tmp_path / "a"), Patience(0)) == 1
    assert logged(before + 1) == before + 1  # the proxy logs a request once it has sent the whole answer
    (get,) = gets()[before:]
    assert (get.method, get.range_header, get.path) == ("GET", None, path)
    assert (tmp_path / "a").read_bytes() == (written / "train" / "shard-000000.tar").read_bytes()
    with pytest.raises(ShardChanged, match=rf"^s3://ddp-test/imagenet-like/train/shard-000000.tar: not the version "
                                           rf"this run listed at its start \(ETag \"stale\" listed, {ref.etag} now\); "
                                           rf"the data changed under the run"):
        fetch(dataclasses.replace(ref, etag='"stale"'), str(tmp_path / "b"), Patience(30))
    # not sent again (waiting would not change the version): the GET, and the HEAD of a 412's ETag
    assert logged(before + 3) == before + 3 and [r.method for r in gets()[before + 1:]] == ["GET", "HEAD"]
    with pytest.raises(ShardChanged, match=rf"^{ref.address}: not the version this run listed at its start "
                                           rf"\({ref.size:,} bytes arrived, the index says {ref.size + 1:,}\)"):
        fetch(dataclasses.replace(ref, size=ref.size + 1), str(tmp_path / "b"), Patience(30))
    assert logged(before + 4) == before + 4
    proxied.set(bytes_per_s=300_000)
    started, before = time.monotonic(), len(gets())
    threading.Timer(0.6, proxied.cut, (1.0,)).start()  # the body cut part way: continued once the store answers
    assert fetch(ref, str(tmp_path / "c"), Patience(30)) >= 2
    assert (tmp_path / "c").read_bytes() == (tmp_path / "a").read_bytes() and time.monotonic() - started > 1.2
    logged(before + 1)
    (rest,) = gets()[before:]  # the cut one was not answered in full: the proxy logs only the rest
    assert rest.range_header is not None and 0 < rest.response_bytes < ref.size  # no byte fetched twice


# ----------------------------------------------------------------------------- the real scripts
RUN = ["--device", "cpu", "--arch", "small_cnn", "--image-size", "32", "--batch-size", "4", "--workers", "2",
       "--log-every", "1", "--aug-on", "device", "--moco-k", "32", "--dataset", "shards", "--epochs", "2",
       "--knn-every", "2"]  # 2 epochs of 9 steps; the kNN monitor at step 0 and at the end
# A node cache smaller than the data and one download at a time, no kNN pass (which reads every
# shard): the downloads spread over the steps; the first epoch, which ends as the whole run's
# (checkpoint_prev1.pt)
TIGHT = ["--shard-read-ahead", "0", "--shard-downloads", "1", "--shard-cache-gb", "0", "--knn-every", "0",
         "--max-steps", "9"]


@pytest.fixture(scope="module")
def whole_run(one_per_shard, far, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, list]:
    """MoCo on 2 ranks from the bucket through the proxy, a node cache larger than the data; the
    requests it made."""
    proxy, env = far
    root, (_, bucket) = tmp_path_factory.mktemp("s3_whole"), one_per_shard
    before = len(proxy.requests)
    proc = run_ranks("train_moco.py", RUN + ["--data-dir", bucket, "--shard-cache-gb", "1", "--shard-cache-dir",
                                             str(root / "cache"), "--out", str(root / "run")], root, env=env)
    assert_ok(proc)
    return root, proc, proxy.requests[before:]


def test_a_run_from_the_bucket_gets_each_shard_once_per_node_with_one_get_and_writes_no_credential(
        whole_run, one_per_shard, s3_server):
    root, proc, requests = whole_run
    written, bucket = one_per_shard
    prefix = "/ddp-test/one-per-shard"
    assert all(r.method == "GET" and r.range_header is None for r in requests)  # no HEAD, no ranged part
    listings = [r.query for r in requests if "list-type" in r.query]
    versioning = [r.path for r in requests if r.query == "versioning"]
    gets = Counter(r.path for r in requests if "list-type" not in r.query and r.query != "versioning")
    assert len(listings) == 2 and versioning == ["/ddp-test"] * 2  # per split, by rank 0: is it versioned, a listing
    for split in ("train", "val"):
        index = ShardIndex.read(str(written / split))
        for shard in index.shards:  # 2 epochs, the kNN bank and val: each shard once for the node
            assert gets.pop(f"{prefix}/{split}/{shard['name']}") == 1, shard["name"]
        for name in (INDEX, RECORDS):  # read once for the job, by rank 0
            assert gets.pop(f"{prefix}/{split}/{name}") == 1
    assert not gets, gets
    assert re.search(r"final kNN acc1 [\d.]+% at step 18\n", proc.stdout)
    assert not (root / "cache").exists() or not any((root / "cache").iterdir())  # the node's cache went at the end
    texts = [proc.stdout, proc.stderr] + [p.read_bytes().decode("latin-1") for p in (root / "run").rglob("*")
                                          if p.is_file()]
    for secret in (s3_server["AWS_SECRET_ACCESS_KEY"], s3_server["AWS_ACCESS_KEY_ID"]):
        assert not any(secret in text for text in texts)
    record = json.loads((root / "run" / "config.json").read_text())
    assert record["config"]["data_dir"] == bucket
    # the node cache's size, decided once in the pre-flight: --shard-cache-gb 1
    assert record["resolved"]["shard_cache_bytes"] == 10**9
    assert load_ckpt(root / "run" / "checkpoint_last.pt")["resolved"] == record["resolved"]


def test_shards_train_the_same_from_a_bucket_as_from_a_file_system(whole_run, one_per_shard, tmp_path):
    """One order for shards wherever they are: the same run on the shards' folder ends with the
    same weights, optimizer state and kNN accuracies, bit for bit."""
    root, proc, _ = whole_run
    written, _ = one_per_shard
    local = run_ranks("train_moco.py", RUN + ["--data-dir", str(written), "--out", str(tmp_path / "run")], tmp_path)
    assert_ok(local)
    knn = lambda text: re.findall(r"kNN acc1 ([\d.]+)%", text)  # noqa: E731
    assert knn(local.stdout) == knn(proc.stdout) and len(knn(proc.stdout)) == 3
    assert_same_state(load_ckpt(tmp_path / "run" / "checkpoint_last.pt"), load_ckpt(root / "run" / "checkpoint_last.pt"))


def test_a_resume_on_other_data_is_refused_unless_allowed(whole_run, one_per_shard, tmp_path, capsys, monkeypatch):
    """--check of a resume (as the launchers run it: rank 0 of the job's 2): the checkpoint's data
    fingerprint (its shards' index) against this run's. The same shards on a file system fit;
    another index is refused in one line, and --allow-changes lets it go on."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    root, _, _ = whole_run
    written, _ = one_per_shard
    checkpoint = str(root / "run" / "checkpoint_last.pt")
    args = RUN + ["--check", "--resume", checkpoint, "--out", str(tmp_path / "new")]
    assert_ok(in_process(train_moco.main, args + ["--data-dir", str(written)], capsys))
    changed = tmp_path / "changed"
    shutil.copytree(written, changed)
    index = changed / "train" / INDEX
    index.write_text(index.read_text().replace('"written_in_order_drawn_from_seed": 0',
                                               '"written_in_order_drawn_from_seed": 1'))
    proc = in_process(train_moco.main, args + ["--data-dir", str(changed)], capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert re.search(rf"error: --resume {re.escape(checkpoint)}: its run read other image files \(data fingerprint "
                     r"\w+, now \w+: a listing or a shards' index changed\); resume on the data it read, add "
                     r"--allow-changes", proc.stderr)
    assert_ok(in_process(train_moco.main, args + ["--data-dir", str(changed), "--allow-changes"], capsys))


@pytest.fixture
def far_away(far):
    """The proxy with 100 ms per request: a run's downloads spread over its steps, so that an
    outage or a rewrite at a step meets those still to come."""
    proxy, env = far
    proxy.set(latency_s=0.1)
    yield proxy, env
    proxy.set(latency_s=None)
    proxy.end_cut()
    proxy.release()


def _at_steps(actions: dict[int | str, Callable[[], None]]):
    """A watch for run_ranks: each ``actions[key]()`` once, when rank 0 logs optimizer step ``key``
    (an int) or a line matching ``key`` (a regex)."""
    done = set()

    def watch(text: str) -> None:
        for key, action in actions.items():
            if key not in done and re.search(rf"step {key}/" if isinstance(key, int) else key, text):
                done.add(key)
                action()
    return watch


@pytest.mark.slow  # two 2-rank runs
def test_an_outage_is_waited_out_a_longer_one_stops_every_rank_named_and_the_resume_ends_as_never_stopped(
        whole_run, one_per_shard, far_away, tmp_path):
    """Through the proxy, an outage of 2.5 s at step 2 (the run waits, says so and goes on), then,
    once it has said so, one of 10 minutes, beyond --store-timeout 8 (which bounds a whole fetch
    from its start: the fetch a cut meets, then a backoff of up to 5 s; at a fixed step instead, a
    fast run's queued batches could carry it past the first outage's end before anything asked
    the store, and nothing would wait it out; said by any rank: the rank that meets the first
    outage is a matter of timing): every rank stops at the same step with exit
    75, one line naming the store, the shard and the reason, after a checkpoint of the last
    completed step; once the store answers, the resume ends bit for bit as the run that never met
    either (the whole run's step 9)."""
    root, _, _ = whole_run
    proxy, env = far_away
    _, bucket = one_per_shard
    out, args = tmp_path / "run", RUN + TIGHT + ["--data-dir", bucket, "--store-timeout", "8"]
    at_step_2, long_cut = _at_steps({2: lambda: proxy.cut(2.5)}), []

    def watch(text: str) -> None:  # run_ranks hands on rank 0's log; every rank's is in its folder
        at_step_2(text)
        if not long_cut and any("it answers again" in log.read_text() for log in tmp_path.glob("ranks-*/rank*.stdout")):
            long_cut.append(proxy.cut(600))

    proc = run_ranks("train_moco.py", args + ["--out", str(out)], tmp_path, env=env, watch=watch)
    proxy.end_cut()
    assert proc.codes == [EXIT_STORE, EXIT_STORE], proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert "Traceback" not in said
    assert re.search(r"WARNING s3://ddp-test/one-per-shard/\w+/shard-\d+\.tar: the object store did not answer for "
                     r"[\d.]+ s \(\w+\); it answers again and the run goes on", proc.stdout), proc.stdout
    (line,) = [line for line in said.splitlines() if "did not answer (" in line]
    assert re.search(r"ERROR step (\d+) \(not taken\): s3://ddp-test/one-per-shard/train/shard-\d+\.tar: the object "
                     r"store did not answer \(\w+, for \d s; endpoint http://127.0.0.1:\d+\); the run stops to be "
                     r"started again once it answers \(exit 75\); continue with --resume auto; the last good "
                     r"checkpoint is \S+checkpoint_last.pt \(step \d+\)$", line), line
    stopped = int(re.search(r"step (\d+) \(not taken\)", line).group(1))
    assert 2 < stopped <= 9 and load_ckpt(out / "checkpoint_last.pt")["step"] == stopped - 1
    assert "did not answer" in (out / "STORE_UNAVAILABLE").read_text()
    resumed = run_ranks("train_moco.py", args + ["--resume", "auto", "--out", str(out)], tmp_path, env=env)
    assert_ok(resumed)
    assert not (out / "STORE_UNAVAILABLE").exists()
    assert_same_state(load_ckpt(out / "checkpoint_last.pt"), load_ckpt(root / "run" / "checkpoint_prev1.pt"))


@pytest.mark.slow  # a 2-rank run
def test_a_shard_rewritten_mid_run_stops_it_naming_the_shard(one_per_shard, far_away, s3_server, tmp_path):
    proxy, env = far_away
    written, _ = one_per_shard
    client = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"])
    for path in written.rglob("*"):  # a copy of its own, to rewrite
        if path.is_file():
            client.upload_file(str(path), "ddp-test", f"rewritten/{path.relative_to(written)}")

    def rewrite() -> None:  # every training shard: another version of the same size (tar pads, sizes often match)
        proxy.hold()  # the run's requests wait meanwhile
        for path in (written / "train").glob("*.tar"):
            client.put_object(Bucket="ddp-test", Key=f"rewritten/train/{path.name}", Body=path.read_bytes()[::-1])
        proxy.release()

    proc = run_ranks("train_moco.py", RUN + TIGHT + ["--data-dir", "s3://ddp-test/rewritten", "--out",
                                                     str(tmp_path / "run")], tmp_path, env=env,
                     watch=_at_steps({3: rewrite}))
    assert proc.codes == [2, 2], proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert "Traceback" not in said and "cannot decode" not in said
    assert re.search(r"ERROR step \d+ \(not taken\): s3://ddp-test/rewritten/train/shard-\d+\.tar: not the version "
                     r"this run listed at its start \(ETag \S+ listed, \S+ now\); the data changed under the "
                     r"run: put the listed version back, or start a new run on the new data", said), said


@pytest.mark.slow  # a 2-rank run and a 1-rank one
def test_a_resume_from_the_bucket_at_another_shape_follows_the_rule(bucket, s3_server, tmp_path):
    """2 ranks x batch 4 stopped after 3 batches of epoch 1 (24 of its 38 samples); 1 rank takes
    the other 15 of the 39 (3 batches), then 9 batches in epoch 2: step 3 + 3 + 9 = 15."""
    args = ["--device", "cpu", "--arch", "small_cnn", "--image-size", "32", "--batch-size", "4", "--workers", "2",
            "--aug-on", "device", "--moco-k", "32", "--dataset", "shards", "--knn-every", "0", "--data-dir", bucket,
            "--epochs", "2", "--bn-splits", "4", "--shard-cache-dir", str(tmp_path / "cache")]  # 1 rank: 4 BN groups
    other = tmp_path / "other"
    assert_ok(run_ranks("train_moco.py", args + ["--max-steps", "3", "--out", str(other)], tmp_path, env=s3_server))
    proc = subprocess.run([sys.executable, str(REPO / "train_moco.py"), *args, "--resume", "auto", "--out", str(other)],
                          cwd=REPO, env=cli_env(s3_server), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "the samples of the epoch that the saved run did not reach are shared out among these ranks" in proc.stdout
    final = load_ckpt(other / "checkpoint_last.pt")
    assert (final["step"], final["epoch"], final["order"]) == (15, 2, {"order": "shards", "epoch": 2, "segments": []})


@pytest.mark.slow  # two --check runs of the real CLI
def test_check_reads_the_bucket_and_an_unreachable_store_is_one_line(bucket, s3_server, tmp_path):
    args = [sys.executable, str(REPO / "train_classifier.py"), "--dataset", "shards", "--data-dir", bucket, "--device",
            "cpu", "--batch-size", "8", "--check", "--out", str(tmp_path / "run")]
    proc = subprocess.run(args, cwd=REPO, env=cli_env(s3_server), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "data: shards, 39 training and 12 validation images" in proc.stdout
    assert re.search(r"object store: each node caches up to 0.0\d GB of shards in \S+/ddp-shards-\w+-nodeN \(never more; "
                     r"deleted at the end\); each rank reads at least 8 shard\(s\) ahead and downloads up to 16 at "
                     r"once \(from 4, as many as its loaders' demand needs\); a store that does not answer is waited "
                     r"for 300 s", proc.stdout), proc.stdout
    closed = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(args, cwd=REPO, env=cli_env({**s3_server, "AWS_ENDPOINT_URL": closed}), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"train_classifier.py: error: {bucket}/train/index.json: the object store could not be reached "
        f"(EndpointConnectionError; endpoint {closed}); check the address and AWS_ENDPOINT_URL"), proc.stderr
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
    index = ShardIndex.read(f"{bucket}/val")
    assert sorted(i for r in range(2) for i in ShardedEvalSampler(index.shard, 2, r, index.shard)) == list(range(12))
