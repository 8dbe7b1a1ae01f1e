"""Shards from an object store on a node's local disk: one cache per node, shared by its ranks
and their DataLoader workers (:class:`NodeCache`), filled ahead of the reads by each rank's
read-ahead (:class:`ReadAhead`), which learns the order of every pass from its loader
(:class:`ReadAheadLoader`): an epoch's order is known when it starts.

The cache folder (``--shard-cache-dir``, below it ``ddp-shards-RUN-nodeN/``) holds:

* ``NAME`` (the shard's address, ``/`` written ``--``): a whole downloaded shard (a download goes
  to ``NAME.part-...-BYTES`` and is renamed once all its bytes arrived);
* ``rankR/NAME``: a hard link to it while rank R holds it (its loaders read it now or soon). A
  shard is deleted to make room only when no rank holds it (its link count is 1), the one held
  least recently first, so the folder stays within ``capacity`` bytes, the downloads in flight
  counted;
* ``NAME.failed`` and ``rankR.failed``: a shard the store did not give, and a rank whose
  read-ahead stopped on it: the fault, for the rank's workers that wait;
* ``locks/``: a lock per shard (one process downloads it, the others of the node wait and link
  it) and one for the room;
* ``downloads.txt``: a line per download (address, bytes, requests, rank).

Who talks to the store: each rank's read-ahead threads, in its training process. A DataLoader
worker never does: it waits for its rank's link (:meth:`NodeCache.open`), or for a fault, which
it hands on as an unreadable sample (``image_files``), so the training process learns of it and
every rank stops together at the step's agreement. A read in the training process outside a
loader's pass (the augmentation preview, a sample checked again) fetches what it needs itself.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import DataLoader, get_worker_info

from .object_store import (
    SCHEME,
    STORE_FAULTS,
    Patience,
    ShardRef,
    StoreError,
    StoreUnavailable,
    fetch,
    say_recovered,
)
from .order import ShardAwareSampler

DOWNLOADS = "downloads.txt"
POLL_S = 0.02          # s: how often a process waiting for a shard looks for it
WORKER_SLACK_S = 120.0  # s: beyond the store's patience, how long a worker waits before it reports its shard missing
CLOSE_WAIT_S = 1.0      # s: how long the end of a run waits for the downloads under way
FAULTS = {kind.__name__: kind for kind in STORE_FAULTS}


def local_name(address: str) -> str:
    return address[len(SCHEME):].replace("/", "--")


@dataclass(frozen=True)
class SplitShards:
    """Where each sample of a split lies, numbered as its loader numbers them (a Subset's
    positions): ``shard_of`` its shard's number, ``refs`` each shard."""

    shard_of: np.ndarray
    refs: tuple[ShardRef, ...]

    def of(self, positions: np.ndarray) -> np.ndarray:
        return self.shard_of[positions]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class NodeCache:
    """One node's cache of shards in ``folder`` (at most ``capacity`` bytes), as rank ``rank``
    uses it; every process of the node may use it at once (locks, hard links). ``patience``:
    seconds a download may keep failing before its fault is reported (``--store-timeout``);
    ``if_match``: each GET carries If-Match (``object_store.fetch``)."""

    def __init__(self, folder: str, capacity: int, rank: int, patience: float, if_match: bool = True):
        self.folder, self.capacity, self.rank, self.patience = Path(folder), capacity, rank, patience
        self.if_match = if_match
        self.read_ahead: ReadAhead | None = None  # the training process's, never a worker's

    def __getstate__(self):
        return {**self.__dict__, "read_ahead": None}  # a spawned worker's copy: its threads stay behind

    # -------------------------------------------------------------- the node's folder
    def start_empty(self) -> NodeCache:
        """Delete whatever an earlier attempt of the job left (a preempted job's shards, part
        downloads, holds and faults). Once per node, before any of its ranks reads."""
        shutil.rmtree(self.folder, ignore_errors=True)
        (self.folder / "locks").mkdir(parents=True)
        return self

    def leave(self, keep: bool) -> None:
        """This rank is done with the cache: its holds go; the last rank of the node to leave
        deletes the folder unless ``keep``."""
        shutil.rmtree(self.folder / f"rank{self.rank}", ignore_errors=True)
        shutil.rmtree(self.folder / f"rank{self.rank}-now", ignore_errors=True)
        (self.folder / f"rank{self.rank}.active").unlink(missing_ok=True)
        if keep:
            return
        try:
            with _locked(self.folder / "locks" / "room"):
                if not any(self.folder.glob("rank*.active")):
                    shutil.rmtree(self.folder, ignore_errors=True)
        except FileNotFoundError:  # another rank of the node deleted it first
            pass

    def join(self) -> None:
        """This rank uses the cache (the last to :meth:`leave` deletes it)."""
        (self.folder / "locks").mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{self.rank}.active").touch()

    # -------------------------------------------------------------- holding a shard
    def _link(self, address: str, now: bool = False) -> Path:
        return self.folder / f"rank{self.rank}{'-now' if now else ''}" / local_name(address)

    def hold(self, ref: ShardRef, patience: Patience, now: bool = False) -> Path:
        """Rank ``rank`` holds the shard (``now``: a hold of its own, for one read in this
        process): downloaded first if the node has no copy, else linked. Raises the store's
        fault (after recording it for the node's other processes)."""
        link, name = self._link(ref.address, now), local_name(ref.address)
        if link.exists():
            return link
        link.parent.mkdir(parents=True, exist_ok=True)
        final = self.folder / name
        with _locked(self.folder / "locks" / f"{name}.lock"):
            self.raise_fault(name)
            with _locked(self.folder / "locks" / "room"):
                if final.exists():
                    os.utime(final)  # held now: evicted last
                    os.link(final, link)
                    return link
                part = self._reserve(name, ref.size)
            try:
                requests = fetch(ref, str(part), patience, self.if_match)
                with _locked(self.folder / "locks" / "room"):
                    os.replace(part, final)
                    os.link(final, link)
                with open(self.folder / DOWNLOADS, "a") as downloads:
                    downloads.write(f"{ref.address} {ref.size} {requests} rank{self.rank}\n")
            except StoreError as err:
                self.record_fault(name, err)
                raise
            finally:
                part.unlink(missing_ok=True)
        return link

    def release(self, address: str, now: bool = False) -> None:
        """Rank ``rank`` no longer holds the shard; the copy stays until room is needed."""
        self._link(address, now).unlink(missing_ok=True)

    def _reserve(self, name: str, size: int) -> Path:
        """Room for ``size`` more bytes (shards no rank holds deleted, the least recently held
        first), reserved by a part file that names its size. Under the room lock."""
        shards, reserved = [], 0
        for entry in os.scandir(self.folder):
            if not entry.is_file() or entry.name.endswith((".failed", ".active", ".txt")):
                continue
            if ".part-" in entry.name:
                reserved += int(entry.name.rsplit("-", 1)[1])
            else:
                stat = entry.stat()
                shards.append((stat.st_mtime, stat.st_nlink, stat.st_size, entry.path))
        used = reserved + sum(size for _, _, size, _ in shards)
        for _, links, bytes_, path in sorted(shards):
            if used + size <= self.capacity:
                break
            if links == 1:  # held by no rank
                os.unlink(path)
                used -= bytes_
        part = self.folder / f"{name}.part-{os.getpid()}-{threading.get_ident()}-{size}"
        part.touch()
        return part

    # -------------------------------------------------------------- faults
    def record_fault(self, name: str, err: StoreError, rank_wide: bool = False) -> None:
        """The fault, for this node's processes that wait for the shard (``rank_wide``: for
        every shard this rank's workers wait for)."""
        marker = self.folder / (f"rank{self.rank}.failed" if rank_wide else f"{name}.failed")
        with contextlib.suppress(OSError):  # the folder went with the run's end: nobody waits any more
            marker.write_text(f"{type(err).__name__}\t{err.address}\t{err.reason}\n")

    def raise_fault(self, name: str | None = None) -> None:
        """Raise the fault recorded for the shard ``name`` or for this rank, if one was."""
        for marker in ([self.folder / f"{name}.failed"] if name else []) + [self.folder / f"rank{self.rank}.failed"]:
            try:
                kind, address, reason = marker.read_text().rstrip("\n").split("\t")
            except FileNotFoundError:
                continue
            raise FAULTS[kind](address, reason)

    # -------------------------------------------------------------- reading
    def open(self, ref: ShardRef) -> int:
        """A read-only descriptor of the shard (it stays readable through it whatever the cache
        does next). A DataLoader worker waits for its rank's read-ahead to hold it; the training
        process opens what its rank holds, waits for what its read-ahead is fetching, and
        fetches anything else itself. Raises the store's fault."""
        held = self._link(ref.address)
        if get_worker_info() is not None or (self.read_ahead is not None and self.read_ahead.fetching(ref.address)):
            return os.open(self._wait_for(held, ref), os.O_RDONLY)
        try:
            return os.open(held, os.O_RDONLY)
        except FileNotFoundError:
            pass
        path = self.hold(ref, Patience(self.patience, on_recovered=say_recovered), now=True)
        try:
            return os.open(path, os.O_RDONLY)
        finally:
            self.release(ref.address, now=True)

    def _wait_for(self, held: Path, ref: ShardRef) -> Path:
        deadline = time.monotonic() + self.patience + WORKER_SLACK_S
        while not held.exists():
            self.raise_fault(local_name(ref.address))
            if time.monotonic() > deadline:
                raise StoreUnavailable(ref.address, f"not fetched by the rank's read-ahead within "
                                                    f"{self.patience + WORKER_SLACK_S:.0f} s")
            time.sleep(POLL_S)
        return held

    def downloads(self) -> list[tuple[str, int]]:
        """(address, bytes) of every shard this node downloaded since :meth:`start_empty`, in order."""
        log_file = self.folder / DOWNLOADS
        if not log_file.exists():
            return []
        return [(line.split()[0], int(line.split()[1])) for line in log_file.read_text().splitlines()]


@dataclass(frozen=True)
class Need:
    """A shard a pass reads: the first and last position (in the pass's order of samples) of its samples."""

    ref: ShardRef
    first: int
    last: int


def needs_of(shards: np.ndarray, refs: Sequence[ShardRef]) -> list[Need]:
    """The shards a pass reads, in the order of their first sample. ``shards``: each position's shard."""
    if not len(shards):
        return []
    numbers, first = np.unique(shards, return_index=True)
    _, from_end = np.unique(shards[::-1], return_index=True)
    last = len(shards) - 1 - from_end
    return [Need(refs[n], int(f), int(lst)) for f, n, lst in sorted(zip(first.tolist(), numbers.tolist(),
                                                                          last.tolist()))]


class ReadAhead:
    """One rank's downloads ahead of its loaders' reads, on ``downloads`` threads of its
    training process. For the pass in progress it holds, in the pass's order: every shard of the
    samples its workers were asked for (whatever the room), then up to ``depth`` more as long as
    its holds stay within ``quota`` bytes (its share of the node's cache); once the pass is
    covered, the first shards of the next training epoch. A shard is let go once every sample
    of it was received, with a batch's delay (the training process may read the batch's files
    again). A fault stops its downloads and is recorded for the rank's workers."""

    def __init__(self, cache: NodeCache, depth: int, downloads: int, quota: int):
        self.cache, self.depth, self.quota = cache, depth, quota
        self.patience = Patience(cache.patience, on_recovered=say_recovered)
        self._threads = [threading.Thread(target=self._download, name=f"read-ahead-{k}", daemon=True)
                         for k in range(downloads)]
        self._cond = threading.Condition()
        self._pass: list[Need] = []
        self._done = self._asked = 0           # positions: samples received (less a batch), samples asked for
        self._next_epoch: Callable[[], list[Need]] | None = None
        self._following: list[Need] | None = None
        self._owed: list[Need] = []            # asked for by an abandoned pass's workers: fetched, held till the end
        self._held: dict[str, int] = {}        # address: bytes
        self._in_flight: dict[str, int] = {}
        self.failure: StoreError | None = None
        self._started = self._closed = False
        cache.read_ahead = self
        cache.join()

    # -------------------------------------------------------------- told by the loaders
    def start_pass(self, needs: list[Need], asked: int, next_epoch: Callable[[], list[Need]] | None = None) -> None:
        """A loader starts a pass reading ``needs``; its workers were asked for ``asked`` samples.
        ``next_epoch``: the training loader's next epoch, read ahead once a pass is covered."""
        with self._cond:
            self._owed += [n for n in self._pass if n.first < self._asked and n.last >= self._done]
            self._pass, self._done, self._asked = needs, 0, asked
            if next_epoch is not None:
                self._next_epoch = next_epoch
            self._following = None
            keep = {n.ref.address for n, _ in self._ahead(following=False)} | {n.ref.address for n in self._owed}
            for address in [a for a in self._held if a not in keep]:
                self._let_go(address)
            if not self._started and not self._closed:
                self._started = True
                for thread in self._threads:
                    thread.start()
            self._cond.notify_all()

    def received(self, done: int, asked: int) -> None:
        """The training process received the pass's samples before ``done`` (less a batch) and
        its workers were asked for those before ``asked``."""
        with self._cond:
            self._done, self._asked = done, asked
            owed = {n.ref.address for n in self._owed}
            for need in self._pass:
                if need.last < done and need.ref.address in self._held and need.ref.address not in owed:
                    self._let_go(need.ref.address)
            self._cond.notify_all()

    def end_pass(self) -> None:
        """The pass was read to its end: read ahead for the next training epoch."""
        needs = self._next_epoch() if self._next_epoch is not None else []
        with self._cond:
            self._done = self._asked = 1 << 62  # every sample received: none is owed
        self.start_pass(needs, 0)

    def _ahead(self, following: bool) -> Iterator[tuple[Need, bool]]:
        """The shards the rank should hold now, in order, each with whether its samples were asked
        for (under the lock): the pass's from the first not yet passed, those of the samples asked
        for and then ``depth`` more; with ``following``, once the pass is covered, the next
        epoch's first ones within the same depth."""
        beyond = 0
        needs = ((need, need.first < self._asked) for need in self._pass if need.last >= self._done)
        for need, required in itertools.chain(needs, self._next_epoch_needs() if following else ()):
            if not required:
                beyond += 1
                if beyond > self.depth:
                    return
            yield need, required

    def _next_epoch_needs(self) -> Iterator[tuple[Need, bool]]:
        if self._following is None:  # worked out once a pass, when first reached
            self._following = self._next_epoch() if self._next_epoch is not None else []
        return ((need, False) for need in self._following)

    def fetching(self, address: str) -> bool:
        with self._cond:
            return address in self._in_flight

    def close(self) -> None:
        """Stop downloading: no new download starts; one under way is not waited for beyond a
        second (its thread ends with the process; the node's cache, and its holds, are
        :meth:`NodeCache.leave`'s)."""
        with self._cond:
            self._closed = True
            self._pass, self._owed, self._following, self._next_epoch = [], [], None, None
            self._cond.notify_all()
        self.cache.read_ahead = None
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # -------------------------------------------------------------- the downloads
    def _let_go(self, address: str) -> None:
        self._held.pop(address, None)
        self.cache.release(address)

    def _next(self) -> Need | None:
        """The next shard to download (under the lock), or None for now."""
        if self.failure is not None or self._closed:
            return None
        for need in self._owed:
            if need.ref.address not in self._held and need.ref.address not in self._in_flight:
                return need
        room = self.quota - sum(self._held.values()) - sum(self._in_flight.values())
        for need, required in self._ahead(following=True):
            if need.ref.address in self._held or need.ref.address in self._in_flight:
                continue
            # what the workers were asked for, whatever the room; beyond it, only what fits
            return need if required or need.ref.size <= room else None
        return None

    def _wanted(self, address: str) -> bool:
        return any(n.ref.address == address for n in (*self._pass, *self._owed, *(self._following or ())))

    def _download(self) -> None:
        while True:
            with self._cond:
                need = self._next()
                while need is None:
                    if self._closed:
                        return
                    self._cond.wait(timeout=1.0)
                    need = self._next()
                self._in_flight[need.ref.address] = need.ref.size
            try:
                self.cache.hold(need.ref, self.patience)
            except StoreError as err:
                self._fail(need, err)
                continue
            except Exception as err:  # noqa: BLE001 - a rank must not wait for a shard that will never come
                self._fail(need, StoreUnavailable(need.ref.address, f"the read-ahead failed: {err!r}"))
                continue
            with self._cond:
                self._in_flight.pop(need.ref.address, None)
                if self._wanted(need.ref.address) and not self._closed:
                    self._held[need.ref.address] = need.ref.size
                else:
                    self.cache.release(need.ref.address)
                self._cond.notify_all()

    def _fail(self, need: Need, err: StoreError) -> None:
        with self._cond:
            self._in_flight.pop(need.ref.address, None)
            if self.failure is None and not self._closed:  # closed: the run ended while this download ran
                self.failure = err
                self.cache.record_fault(local_name(need.ref.address), err, rank_wide=True)
            self._cond.notify_all()


class ReadAheadLoader(DataLoader):
    """A DataLoader over shards of an object store that tells its rank's :class:`ReadAhead` the
    order of each pass as it starts (``shards``: where its samples lie) and how far the
    training process has received; a training sampler in the shards order also names its next
    epoch, read ahead at the end of this one."""

    def __init__(self, *args, read_ahead: ReadAhead, shards: SplitShards, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_ahead, self.shards = read_ahead, shards

    def _asked_at_once(self) -> int:
        """Batches the workers are asked for ahead of the one received (DataLoader's prefetch)."""
        return self.num_workers * (self.prefetch_factor or 0) if self.num_workers else 1

    def __iter__(self):
        positions = np.fromiter((key[1] if isinstance(key, tuple) else key for key in self.sampler), dtype=np.int64)
        shards, sampler = self.shards, self.sampler
        needs = needs_of(shards.of(positions), shards.refs)
        next_epoch = None
        if isinstance(sampler, ShardAwareSampler):
            def next_epoch() -> list[Need]:  # holds no reference to the loader: none from the read-ahead to its workers
                return needs_of(shards.of(sampler.indices_of_epoch(sampler.epoch + 1)), shards.refs)
        batch = self.batch_size or 1
        total = len(positions)
        self.read_ahead.start_pass(needs, min(total, self._asked_at_once() * batch), next_epoch)
        return _Received(super().__iter__(), self.read_ahead, batch, total, self._asked_at_once(), len(self))


class _Received:
    """A ReadAheadLoader's iterator: each batch received is told to the read-ahead."""

    def __init__(self, batches, read_ahead: ReadAhead, batch: int, total: int, at_once: int, length: int):
        self._batches, self._read_ahead = batches, read_ahead
        self._batch, self._total, self._at_once, self._length, self._count = batch, total, at_once, length, 0

    def __iter__(self) -> _Received:
        return self

    def __len__(self) -> int:
        return self._length - self._count

    def __next__(self):
        batch = next(self._batches)
        self._count += 1
        if self._count == self._length:
            self._read_ahead.end_pass()
        else:
            self._read_ahead.received((self._count - 1) * self._batch,
                                      min(self._total, (self._count + self._at_once) * self._batch))
        return batch
