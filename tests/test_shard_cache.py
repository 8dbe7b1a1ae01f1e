"""The node's cache of shards from an object store, its read-ahead and the waits for it, against
moto's S3 server behind the far-network proxy (tests/far_network.py), in this process:

* a wait for a shard is bounded: a DataLoader worker whose rank's read-ahead never delivers gives
  up after --store-timeout + shard_cache.WAIT_SLACK_S and records the fault, and the training
  process, reading the sample again, raises it at once;
* a node is the launcher's node: ranks of one node share one folder and exactly one of them, its
  LOCAL_RANK 0, prepares it, with uneven tasks per node and a cyclic distribution;
* the bound holds: shards_in_use bounds what the read-ahead holds for its workers; the folder,
  and what open descriptors keep of deleted files, never exceeds the cache's capacity while a
  loader with workers reads more shards than it holds, nor does --check-data's cache; a full
  disk is one line, exit 2;
* a later attempt of a run keeps the shards it listed (no GET for them), a new run starts empty;
* the downloads in flight follow the loaders' demand: through connections too slow for a fixed
  4, the read-ahead keeps more in flight and the loader hardly waits;
* a worker forked as the read-ahead starts is never stuck on an import its download thread was
  inside (the client is made before the thread starts)."""
from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import wait_until
from torch.utils.data import Dataset

from ddp_utils.config import UsageError
from ddp_utils.data import shard_cache
from ddp_utils.data.image_files import ShardFiles, read_as
from ddp_utils.data.object_store import Patience, StoreUnavailable
from ddp_utils.data.order import SHUFFLE_SHARDS, ShardAwareSampler, ShardedEvalSampler
from ddp_utils.data.pipeline import DataPlan, StoreCache, build_data, node_cache_of
from ddp_utils.data.recipes import AugmentRecipe
from ddp_utils.data.shard_cache import (
    DOWNLOADS,
    START_DOWNLOADS,
    WAIT_SLACK_S,
    CacheFull,
    NodeCache,
    ReadAhead,
    ReadAheadLoader,
    SplitShards,
    local_name,
    needs_of,
    shards_in_use,
)
from ddp_utils.data.shards import ShardIndex
from ddp_utils.data.unreadable import check_decodes, why_unreadable
from ddp_utils.runtime.dist import DistInfo
from ddp_utils.runtime.launch import detect_launch
from ddp_utils.train import preflight
from ddp_utils.train.checkpoint import Resume
from ddp_utils.train.train_config import STORE_MARGIN_S, data_plan
from train_classifier import ClassifierConfig, script_data, views_of


class _Samples(Dataset):
    """A loader's (epoch, index) keys to ``files``' samples: the encoded bytes (a placeholder
    with target -1 - index when they cannot be read)."""

    def __init__(self, files):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key):
        return self.files[key[1] if isinstance(key, tuple) else key]


class _OnDisk:
    """Samples, on a thread, the bytes ``folder``'s shards take on disk: its files (the ranks'
    holds are hard links to them), and every file deleted from it that a process of this test
    (this one, its DataLoader workers) still holds open. ``peak``: the most bytes (st_size)
    seen; ``over``: the most allocated bytes (st_blocks) beyond their sizes, less a block per
    file (a file's last block is allocated whole), downloads under way left out (their blocks
    run ahead of their size while a write is under way)."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self.over = str(folder), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _OnDisk:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            files, writing = {}, set()  # the folder's own files, read at once: a rank's hold is a link to one of them
            for entry in _scandir(self.folder):
                if entry.name != DOWNLOADS:  # the record of downloads, a line each: not the cache's shards
                    try:
                        stat = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not entry.is_dir(follow_symlinks=False):
                        files[stat.st_ino] = stat
                        if ".part-" in entry.name:
                            writing.add(stat.st_ino)
            for pid in _family(os.getpid()):
                for fd in _listdir(f"/proc/{pid}/fd"):
                    try:
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if target.startswith(self.folder) and target.endswith(" (deleted)"):
                            stat = os.stat(f"/proc/{pid}/fd/{fd}")
                            files[stat.st_ino] = stat
                    except OSError:
                        continue
            size = sum(stat.st_size for stat in files.values())
            self.peak = max(self.peak, size)
            whole = [stat for ino, stat in files.items() if ino not in writing]
            self.over = max(self.over, sum(stat.st_blocks * 512 - stat.st_size - 4096 for stat in whole))
            time.sleep(0.002)


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:
        return []


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux's /proc/PID/task/TID/children)."""
    found = [pid]
    for tid in _listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            found += _family(int(child))
    return found


# ----------------------------------------------------------------------------- the waits
def test_a_worker_gives_up_within_the_store_timeout_and_the_training_process_raises_at_once(
        bucket, proxied, tmp_path, monkeypatch):
    """The proxy holds every request: the rank's read-ahead never delivers. The DataLoader
    worker waiting for the shard gives up after the patience and the slack (the slack shortened
    here from its 30 s), recording the fault for the rank; the training process, reading the
    sample again as the unreadable-file check does, raises it at once instead of waiting as long
    again, and the worker's next wait ends at once too."""
    monkeypatch.setattr(shard_cache, "WAIT_SLACK_S", 0.5)  # read by the forked worker too
    index = ShardIndex.read(f"{bucket}/train")
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30, rank=0, patience=1.0).prepare()
    ahead = ReadAhead(cache, depth=0, downloads=1, quota=1 << 30)
    files = read_as(ShardFiles(index, cache), "encoded")
    sampler = ShardAwareSampler(index.shard, 1, 0, seed=0, batch_size=1)
    loader = ReadAheadLoader(_Samples(files), batch_size=1, sampler=sampler, num_workers=1,
                             read_ahead=ahead, shards=SplitShards(index.shard, index.refs()))
    proxied.hold()
    try:
        batches = iter(loader)
        started = time.monotonic()
        _, target = next(batches)
        waited = time.monotonic() - started
        assert target.item() < 0  # a placeholder: the sample could not be read
        assert 1.5 <= waited < 1.5 + 5.0  # the worker's wait (its start included), not the 121.5 s it was
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"^s3://ddp-test/imagenet-like/train/shard-\d+\.tar: the object "
                                                   r"store did not answer \(not fetched by the rank's read-ahead "
                                                   r"within 2 s; endpoint http://127.0.0.1:\d+\)"):
            why_unreadable(files, -1 - target.item())
        assert time.monotonic() - started < 0.2  # at once: neither a wait nor a fetch of its own
        started = time.monotonic()
        _, target = next(batches)  # the worker's next wait, whatever its shard: the rank's fault at once
        assert target.item() < 0 and time.monotonic() - started < 1.0
        del batches
    finally:
        proxied.release()
        ahead.close()
        cache.leave(keep=False)


def test_the_pre_flight_keeps_the_waits_below_the_collectives_timeout():
    """A wait for a shard lasts at most --store-timeout + the slack; the margin the pre-flight
    keeps below --dist-timeout is that slack and as much again for the step that stops."""
    assert WAIT_SLACK_S == 35.0 and STORE_MARGIN_S == 2 * WAIT_SLACK_S  # botocore's 2 tries x (5 s + 10 s), 5 s
    cfg = ClassifierConfig(dataset="shards", data_dir="s3://b/x", store_timeout=531, dist_timeout=600)
    with pytest.raises(UsageError, match=r"^--store-timeout 531 leaves a rank waiting for the store longer than its "
                                         r"peers wait in a collective \(--dist-timeout 600, less 70 s\); lower it, or "
                                         r"raise --dist-timeout to 601$"):
        cfg.validate(detect_launch({}), 0)
    dataclasses.replace(cfg, store_timeout=530).validate(detect_launch({}), 0)


# ----------------------------------------------------------------------------- a node is a node
def _slurm(rank: int, node: int, local: int) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
            "SLURM_STEP_NUM_TASKS": "11", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_JOB_NODELIST": "gpu[1-3]",
            "SLURM_JOB_ID": "7"}


BLOCK = [_slurm(rank, node, rank - (0, 4, 8)[node]) for node, ranks in enumerate((range(4), range(4, 8), range(8, 11)))
         for rank in ranks]  # srun's default: 4, 4 and 3 tasks in turn
CYCLIC = [_slurm(rank, rank % 3, rank // 3) for rank in range(11)]  # srun --distribution=cyclic: dealt in turn
TORCHRUN = [{"RANK": str(rank), "WORLD_SIZE": "6", "LOCAL_RANK": str(rank % 3), "LOCAL_WORLD_SIZE": "3",
             "GROUP_RANK": str(rank // 3)} for rank in range(6)]


@pytest.mark.parametrize("envs", [BLOCK, CYCLIC, TORCHRUN], ids=["uneven", "cyclic", "torchrun"])
def test_each_node_has_one_cache_folder_prepared_by_its_local_rank_0(envs, bucket, written, tmp_path, monkeypatch):
    """Each rank's launch as detect_launch reads it: the folder its loaders read (pipeline) and
    the one its pre-flight prepares (train.preflight, LOCAL_RANK 0 of each node); the cache's
    size in each rank's plan, its node's (sized to the node's ranks)."""
    indexes = (ShardIndex.read(f"{bucket}/train"), ShardIndex.read(f"{bucket}/val"))
    cfg = ClassifierConfig(dataset="shards", data_dir=bucket, shard_cache_dir=str(tmp_path), batch_size=4, workers=1)
    prepared = []
    monkeypatch.setattr(preflight.NodeCache, "prepare", lambda cache, keep=(): prepared.append((cache.folder,
                                                                                                  cache.rank)))
    read, node_of, sized = {}, {}, {}
    for env in envs:
        launch = detect_launch(env)
        info = DistInfo(launch.rank, launch.local_rank, launch.world_size, launch.local_world_size,
                        torch.device("cpu"), None, launch.launcher, launch.node)
        node_of[info.rank] = env.get("SLURM_NODEID", env.get("GROUP_RANK"))
        resolved = preflight.prepare_shard_cache_once_per_node(cfg, info, preflight.resolved_settings(
            cfg, info.launcher, info.local_world_size, info.device, world_size=info.world_size), indexes, None, script_data(cfg, views_of(cfg)))
        read[info.rank] = node_cache_of(data_plan(cfg, resolved, AugmentRecipe()), info.rank, info.node).folder
        sized[info.rank] = (resolved.shard_cache_bytes, info.local_world_size)
    folders = {node: {read[rank] for rank in read if node_of[rank] == node} for node in set(node_of.values())}
    assert all(len(shared) == 1 for shared in folders.values())  # a node's ranks share one folder
    # --shard-cache-gb 0: the same share for every rank, times the ranks of its node
    assert len({planned / ranks for planned, ranks in sized.values()}) == 1 and min(sized.values())[0] > 0, sized
    assert len({folder for shared in folders.values() for folder in shared}) == len(folders)  # one per node
    assert sorted(prepared) == sorted((read[rank], rank) for rank in read if int(envs[rank].get(
        "SLURM_LOCALID", envs[rank].get("LOCAL_RANK"))) == 0)  # each prepared once, by its LOCAL_RANK 0
    assert len(prepared) == len(folders)


def test_a_node_without_a_launcher_number_is_its_name_written_for_a_path():
    assert detect_launch({"SLURMD_NODENAME": "gpu/07 a"}).node == "gpu_07_a"
    assert detect_launch({"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "1", "SLURM_NODEID": "4"}).node == "4"


# ----------------------------------------------------------------------------- the bound
def _holds(shard_of: np.ndarray, order: np.ndarray, batch: int, asked_at_once: int) -> int:
    """The most shards the read-ahead holds for its workers during a pass of ``order`` (its
    rule: a shard with a position before ``asked`` and one from ``done`` on), as a loader
    receiving batch after batch tells it."""
    needs, most = needs_of(shard_of[order], [None] * (int(shard_of.max()) + 1)), 0
    batches = len(order) // batch
    for count in range(batches + 1):
        done, asked = max(0, (count - 1) * batch), min(len(order), (count + asked_at_once) * batch)
        most = max(most, sum(1 for need in needs if need.first < asked and need.last >= done))
    return most


@pytest.mark.parametrize("per_shard", [1, 3, 7, 20])
def test_shards_in_use_bounds_what_the_read_ahead_holds_and_is_reached(per_shard):
    """Over many epochs, ranks, batches and workers: the shards order (windows of 4 shuffled
    shards) and the evaluation order (by shard) never hold more than the formula, and reach it
    within a window."""
    sizes = np.full(48, per_shard)
    sizes[-1] = per_shard + 2  # one shard larger: the smallest shard's count is what bounds
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    reached = {}
    for batch, workers, prefetch in ((1, 0, 2), (4, 2, 2), (8, 3, 2), (5, 1, 1)):
        asked = shard_cache.batches_asked(workers, prefetch)
        bound = shards_in_use((asked + 1) * batch, per_shard, SHUFFLE_SHARDS)
        for world, epoch in ((1, 0), (2, 1), (3, 2)):
            sampler = ShardAwareSampler(shard_of, world, world - 1, seed=epoch, batch_size=batch)
            most = _holds(shard_of, sampler.indices_of_epoch(epoch), batch, asked)
            assert most <= bound, (batch, workers, world, epoch)
            if bound <= len(sizes) // 3:  # a piece of the epoch has room to reach it
                reached[bound] = max(reached.get(bound, 0), most)
        evaluation = np.asarray(ShardedEvalSampler(shard_of, 2, 1, shard_of).indices)
        assert _holds(shard_of, evaluation, batch, asked) <= shards_in_use((asked + 1) * batch, per_shard)
    assert reached and all(most > bound - SHUFFLE_SHARDS for bound, most in reached.items()), reached


def test_the_cache_never_holds_more_than_its_bound_while_workers_read_more_shards(one_per_shard, proxied, tmp_path):
    """A pass of 72 shards of one image through 2 workers, 2 images a batch, a cache sized as
    build_data sizes it (the shards the workers read at once, a read-ahead of 2 and one): the
    folder, with whatever deleted files the processes keep open, never exceeds it; the
    read-ahead's holds stay within the formula and its depth; every shard is downloaded once."""
    _, address = one_per_shard
    index = ShardIndex.read(f"{address}/train")
    largest = max(shard["bytes"] for shard in index.shards)
    in_use = shards_in_use((shard_cache.batches_asked(2, 2) + 1) * 2, 1, SHUFFLE_SHARDS)
    store = StoreCache(str(tmp_path / "cache"), 0, read_ahead=2, downloads=2, timeout=10)
    capacity = store.node_bytes(largest, 1, in_use)
    assert capacity < sum(shard["bytes"] for shard in index.shards) / 2  # far less than the pass reads
    cache = NodeCache(str(tmp_path / "cache"), capacity, rank=0, patience=10).prepare()
    ahead = ReadAhead(cache, depth=2, downloads=2, quota=capacity - largest)
    files = read_as(ShardFiles(index, cache), "encoded")
    keys = list(ShardAwareSampler(index.shard, 1, 0, seed=0, batch_size=2))  # one epoch: none read ahead after it
    loader = ReadAheadLoader(_Samples(files), batch_size=2, sampler=keys, num_workers=2, prefetch_factor=2,
                             collate_fn=lambda batch: [target for _, target in batch], read_ahead=ahead,
                             shards=SplitShards(index.shard, index.refs()))
    holds, stop = [], threading.Event()

    def count_holds() -> None:
        while not stop.is_set():
            holds.append(len(_listdir(str(tmp_path / "cache" / "rank0"))))
            time.sleep(0.002)

    counter = threading.Thread(target=count_holds)
    try:
        with _OnDisk(tmp_path / "cache") as disk:
            counter.start()
            targets = [target for batch in loader for target in batch]
            stop.set()
            counter.join()
        assert sorted(targets) == sorted(index.label[[i for _, i in keys]].tolist())  # every sample read, none lost
        assert 0 < disk.peak <= capacity and disk.over <= 0, (disk.peak, capacity, disk.over)
        assert max(holds) <= in_use + 2  # the workers' shards and the depth
        assert sorted(address for address, _ in cache.downloads()) == sorted(r.address for r in index.refs())
    finally:
        ahead.close()
        cache.leave(keep=False)


def test_a_process_forked_while_the_cache_has_files_open_keeps_none_of_them(bucket, proxied, tmp_path):
    """A DataLoader worker forked while a thread of its parent has a file of the node's cache
    open gets a copy of the descriptor; kept, it would hold the shard on disk after the cache
    deletes it, past the bound, for as long as the worker lives (the bound test above met it).
    Forked while one shard downloads and another is being read, the child's copies name no
    file of the cache; the parent's still do."""
    first, second = ShardIndex.read(f"{bucket}/train").refs()[:2]
    cache = NodeCache(str(tmp_path / "cache"), 10 * (first.size + second.size), rank=0, patience=30).prepare()
    cache.hold(first, Patience(30))
    proxied.set(bytes_per_s=300_000)  # a second or two a shard: the fork comes mid-transfer
    download = threading.Thread(target=cache.hold, args=(second, Patience(30)))
    download.start()
    assert wait_until(lambda: any(p.stat().st_size > 0 for p in (tmp_path / "cache").glob("*.part-*")), 10)

    def naming_the_cache() -> int:
        named = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                named += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "cache"))
            except OSError:
                pass
        return named

    with cache.reading(first):
        pid = os.fork()
        if pid == 0:  # the child: how many of its descriptors name a file of the cache?
            os._exit(min(naming_the_cache(), 100))
        in_parent = naming_the_cache()
    _, status = os.waitpid(pid, 0)
    download.join()
    assert in_parent >= 2  # the read and the download, at least
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "cache" / local_name(second.address)).stat().st_size == second.size


def test_check_data_on_a_bucket_streams_through_a_bounded_cache(bucket, proxied):
    """--check-data's reader of a bucket: a temporary cache of a shard per CPU and one (3 here:
    half the split), which decoding every file (shard by shard, on 2 threads) never exceeds,
    each shard downloaded once."""
    index = ShardIndex.read(f"{bucket}/train")
    files = ShardFiles(index)  # no cache given: the reader's own
    cache = files.reader.cache
    largest = max(shard["bytes"] for shard in index.shards)
    assert cache.capacity == (len(os.sched_getaffinity(0)) + 1) * largest
    cache.capacity = 3 * largest  # as on a 2-CPU machine, whatever this one has
    with _OnDisk(cache.folder) as disk:
        assert check_decodes(files, threads=2) == []
    assert 0 < disk.peak <= cache.capacity < sum(shard["bytes"] for shard in index.shards) and disk.over <= 0
    assert sorted(address for address, _ in cache.downloads()) == sorted(r.address for r in index.refs())


def test_a_full_cache_disk_stops_the_rank_with_one_line_and_exit_2(bucket, proxied, tmp_path, monkeypatch):
    """A write of the cache that fails (the disk full: ENOSPC from the download's write, which
    object_store.fetch lets through) is CacheFull, exit 2, naming the folder, its free room and
    what the cache needs; recorded for the node, so the rank's workers and a later read raise
    it, never the store's exit 75."""
    refs = ShardIndex.read(f"{bucket}/train").refs()

    def full(ref, to, patience, if_match=True):
        Path(to).write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), to)

    monkeypatch.setattr(shard_cache, "fetch", full)
    cache = NodeCache(str(tmp_path / "cache"), 3 * 10**9, rank=0, patience=10).prepare()
    line = rf"^{tmp_path}/cache: the node's cache of shards could not be written \(No space left on device\): " \
           rf"[\d.]+ GB free there, the cache may fill 3.00 GB; point --shard-cache-dir at a local disk with room, " \
           rf"or lower --shard-cache-gb$"
    with pytest.raises(CacheFull, match=line) as err:
        with cache.reading(refs[0]):
            pass
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    assert not list((tmp_path / "cache").glob("*.part-*"))  # its part file gone
    ahead = ReadAhead(cache, depth=1, downloads=1, quota=1 << 30)
    try:
        ahead.start_pass(needs_of(np.array([1]), refs), asked=1)
        assert wait_until(lambda: ahead.failure is not None, 10)
        with pytest.raises(CacheFull, match=line):
            cache.raise_fault()  # for the rank's workers: the same line
    finally:
        ahead.close()


# ----------------------------------------------------------------------------- a restart starts warm
def test_a_later_attempt_keeps_the_shards_it_listed_and_a_new_run_starts_empty(bucket, proxied, tmp_path,
                                                                               monkeypatch):
    """A first attempt downloaded 4 shards and left a part file, a fault, another rank's hold and
    a file without its line in downloads.txt. The next attempt, whose listing has another ETag
    for one of the shards, keeps the other 3 (no GET for them) and nothing else; a new run starts
    empty. The pre-flight keeps what the run's listings name when it resumes, nothing otherwise."""
    index = ShardIndex.read(f"{bucket}/train")
    refs, folder, patience = index.refs(), tmp_path / "cache", shard_cache.Patience(10)
    names = [local_name(ref.address) for ref in refs]

    def gets(ref) -> int:
        return sum(request.path == "/" + ref.address[len("s3://"):] for request in proxied.requests)

    first = [gets(ref) for ref in refs]
    cache = NodeCache(str(folder), 1 << 30, rank=0, patience=10).prepare()
    for ref in refs[:4]:
        cache.hold(ref, patience)
        cache.release(ref.address)
    assert wait_until(lambda: [gets(ref) for ref in refs[:4]] == [n + 1 for n in first[:4]], 5)
    (folder / f"{names[5]}.part-1-1-100").write_bytes(b"x" * 100)  # what a killed attempt leaves
    (folder / f"{names[4]}.failed").write_text("StoreUnavailable\tx\ty\n")
    (folder / "rank1").mkdir()
    os.link(folder / names[0], folder / "rank1" / names[0])
    (folder / names[5]).write_bytes(b"no line in downloads.txt")
    changed = [dataclasses.replace(ref, etag='"rewritten"') if n == 2 else ref for n, ref in enumerate(refs)]
    before = [gets(ref) for ref in refs]
    NodeCache(str(folder), 1 << 30, rank=0, patience=10).prepare(keep=changed)  # the next attempt's listing
    assert sorted(p.name for p in folder.iterdir()) == sorted([DOWNLOADS, "locks", names[0], names[1], names[3]])
    assert [address for address, _ in cache.downloads()] == [refs[n].address for n in (0, 1, 3)]
    for ref in refs[:4]:
        cache.hold(ref, patience)
    assert wait_until(lambda: gets(refs[2]) > before[2], 5)
    time.sleep(0.3)  # the proxy logs a request once answered: any other would be in by now
    assert [gets(ref) - old for ref, old in zip(refs[:4], before)] == [0, 0, 1, 0]  # only the changed one again
    NodeCache(str(folder), 1 << 30, rank=0, patience=10).prepare()  # a new run
    assert [p.name for p in folder.iterdir()] == ["locks"]

    kept, real = [], NodeCache.prepare
    monkeypatch.setattr(NodeCache, "prepare", lambda cache, keep=(): kept.append(list(keep)) or real(cache, keep))
    cfg = ClassifierConfig(dataset="shards", data_dir=bucket, shard_cache_dir=str(tmp_path / "job"), workers=1)
    info = DistInfo(0, 0, 1, 1, torch.device("cpu"), None, "single", "0")
    resolved = preflight.resolved_settings(cfg, "single", 1, info.device, world_size=1)
    listings = (index, ShardIndex.read(f"{bucket}/val"))
    for resume in (None, Resume(tmp_path / "checkpoint_last.pt", {})):
        preflight.prepare_shard_cache_once_per_node(cfg, info, resolved, listings, resume, script_data(cfg, views_of(cfg)))
    assert kept == [[], [*listings[0].refs(), *listings[1].refs()]]  # a resume keeps what it lists


# ----------------------------------------------------------------------------- downloads in flight
def test_the_downloads_in_flight_follow_the_loaders_demand(one_per_shard, proxied, tmp_path):
    """Connections of 100 kB/s (a shard of about 80 kB: 0.8 s) and a loader reading 10 shards a
    second: 8 downloads in flight cover it, a fixed 4 would make it wait half the time. The
    read-ahead starts at 2 and keeps more in flight as it measures the demand and each
    download's pace; once it has, the loader hardly waits."""
    _, address = one_per_shard
    index = ShardIndex.read(f"{address}/train")
    order = np.argsort(index.shard, kind="stable")[:60]
    needs = needs_of(index.shard[order], index.refs())
    proxied.set(bytes_per_s=100_000)
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30, rank=0, patience=10).prepare()
    ahead = ReadAhead(cache, depth=2, downloads=16, quota=1 << 30)
    held = [cache.folder / "rank0" / local_name(need.ref.address) for need in needs]
    waits = []
    try:
        ahead.start_pass(needs, asked=5)
        for position, link in enumerate(held):
            started = time.monotonic()
            while not link.exists():
                assert ahead.failure is None
                time.sleep(0.002)
            waits.append(time.monotonic() - started)
            time.sleep(0.1)  # the training step: 10 shards a second
            ahead.received(max(0, position - 1), min(len(needs), position + 6))
    finally:
        ahead.close()
        cache.leave(keep=False)
    later = waits[len(waits) // 2:]
    assert ahead.most_in_flight > 4, ahead.most_in_flight
    assert sum(later) / (sum(later) + 0.1 * len(later)) < 0.2, later  # a fixed 4: about half


@pytest.mark.parametrize("fresh", [True, False])
def test_a_fresh_run_downloads_its_first_shards_while_it_sets_itself_up(one_per_shard, proxied, tmp_path, fresh):
    """build_data for a fresh run (no checkpoint: its first epoch is known) starts the epoch's
    first shards downloading before any loader iterates, as many at once as --shard-downloads
    allows (the pace's fresh start: growing by arrivals from 4 starves the first batches through
    slow connections, docs/performance.md); one that continues a checkpoint waits for its first
    pass. A fault starts the pace low again, so a recovering store is not stormed."""
    _, address = one_per_shard
    store = StoreCache(str(tmp_path / "cache"), 1.0, read_ahead=8, downloads=6, timeout=10)
    plan = DataPlan(dataset="shards", data_dir=address, image_size=16, synthetic_samples=0, debug=False, seed=0,
                    batch_size=2, workers=0, normalization="auto", recipe=AugmentRecipe(), views=1,
                    aug_on_device=False, order="shards", store=store, cache_bytes=int(store.gb * 1e9))
    NodeCache(store.node_folder("0"), 0, rank=0, patience=10).prepare()
    loaders = build_data(plan, rank=0, world_size=1, device=torch.device("cpu"), fresh=fresh)
    try:
        cache = loaders.read_ahead.cache
        if fresh:
            assert wait_until(lambda: len(cache.downloads()) >= 8, 10)
            assert loaders.read_ahead.pace.target == 6 and loaders.read_ahead.most_in_flight > START_DOWNLOADS
            first = [need.ref.address for need in needs_of(
                ShardIndex.read(f"{address}/train").shard[loaders.train_sampler.indices_of_epoch(0)],
                ShardIndex.read(f"{address}/train").refs())[:8]]
            assert sorted(address for address, _ in cache.downloads()[:8]) == sorted(first)
            loaders.read_ahead.pace.fault()
            assert loaders.read_ahead.pace.target == START_DOWNLOADS
        else:
            time.sleep(1.0)
            assert cache.downloads() == []
    finally:
        loaders.close()


# A rank's read-ahead made the store's client on its download thread, boto3's imports with it. A
# resumed run starts its first download when its loader forks the workers, microseconds apart;
# a worker forked while that thread was inside xml.etree's import waited for ever on its module
# lock at its first JPEG decode (torchvision imports xml.etree too). Here an import hook holds
# the thread inside that import until the fork, in a fresh interpreter (pytest imports xml.etree).
FORKED_IN_AN_IMPORT = r'''
import importlib.abc, importlib.util, io, os, sys, threading, time
assert "xml.etree.ElementTree" not in sys.modules and "boto3" not in sys.modules
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from ddp_utils.data import object_store
from ddp_utils.data.image_files import decode_cpu
from ddp_utils.data.object_store import ShardRef
from ddp_utils.data.shard_cache import Need, NodeCache, ReadAhead

inside, forked = threading.Event(), threading.Event()


class HoldTheDownloadThread(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "xml.etree.ElementTree" or not threading.current_thread().name.startswith("read-ahead"):
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            inside.set()
            forked.wait(10)
            run(module)
        spec.loader.exec_module = exec_module
        return spec


class OneJpeg(Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        jpeg = io.BytesIO()
        Image.new("RGB", (8, 8), (200, 10, 10)).save(jpeg, "JPEG")
        return decode_cpu(torch.frombuffer(bytearray(jpeg.getvalue()), dtype=torch.uint8))


sys.meta_path.insert(0, HoldTheDownloadThread())
read_ahead = ReadAhead(NodeCache(sys.argv[1], 1 << 30, 0, 1.0).prepare(), depth=0, downloads=1, quota=1 << 30)
read_ahead.start_pass([Need(ShardRef("s3://bucket/train/shard-000000.tar", 1000, '"etag"', ""), 0, 0)], 1)
deadline = time.monotonic() + 10  # the fork once the download thread is inside the import, or has made the client
while not inside.is_set() and os.getpid() not in object_store._clients and time.monotonic() < deadline:
    time.sleep(0.01)
print("forked while the download thread imports:", inside.is_set(), flush=True)
batches = iter(DataLoader(OneJpeg(), num_workers=1, multiprocessing_context="fork", timeout=20))
forked.set()
try:
    print("decoded", tuple(next(batches).shape), flush=True)
except RuntimeError as err:  # the DataLoader's timeout: the worker waits for ever
    print(err, flush=True)
    for worker in batches._workers:
        worker.kill()
    os._exit(1)
read_ahead.close()
os._exit(0)
'''


@pytest.mark.slow  # a fresh interpreter and a forked worker that imports torchvision
def test_a_worker_forked_as_the_read_ahead_starts_is_not_stuck_in_an_import(tmp_path):
    """The client is made, and boto3 imported, before start_pass starts the download threads:
    the worker forked right after decodes its image (before, it waited for ever)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1",
           "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
           "AWS_DEFAULT_REGION": "us-east-1"}  # no request is made: the client alone
    proc = subprocess.run([sys.executable, "-c", FORKED_IN_AN_IMPORT, str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "decoded (1, 3, 8, 8)" in proc.stdout, proc.stdout + proc.stderr[-3000:]
