"""Shards from an object store on a node's local disk: one cache per node, shared by its ranks and
their DataLoader workers (:class:`NodeCache`), filled ahead of the reads by each rank's read-ahead
(:class:`ReadAhead`, threads of the training process, the only ones that talk to the store), which
learns each pass's order from its loader (:class:`ReadAheadLoader`). How and why: docs/data.md,
"Shards in an object store (S3)".

The cache folder (``--shard-cache-dir``, below it ``ddp-shards-RUN-nodeN/``) holds:

* ``NAME`` (the shard's address, ``/`` written ``--``): a whole shard, downloaded to
  ``NAME.part-...-BYTES`` and renamed once all its bytes arrived;
* ``rankR/NAME``: a hard link while rank R holds it; ``rankR-now/THREAD-NAME``: while a thread of
  its training process reads it outside a loader's pass. Only a shard no rank holds (link count 1)
  is deleted to make room, the one held least recently first;
* ``NAME.failed``, ``rankR.failed``: a shard the store did not give (or not in time), and the rank
  whose read-ahead stopped on it, for the rank's waiting workers;
* ``locks/``: a lock per shard (one process downloads it) and one for the room;
* ``downloads.txt``: a line per download, which a later attempt checks before it keeps the shard
  (:meth:`NodeCache.prepare`).

Contracts: the folder never holds more than ``capacity`` bytes, downloads under way counted at their
full size; a read opens and closes the shard (:meth:`NodeCache.reading`); a worker's wait never
outlasts ``--store-timeout`` + ``WAIT_SLACK_S``.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import math
import os
import shutil
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from torch.utils.data import DataLoader, get_worker_info

from .object_store import (
    BOTOCORE_ATTEMPTS,
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    SCHEME,
    STORE_FAULTS,
    Patience,
    ShardRef,
    StoreError,
    StoreUnavailable,
    client,
    fetch,
    say_recovered,
)
from .order import ShardAwareSampler

log = logging.getLogger("train")
DOWNLOADS = "downloads.txt"
POLL_S = 0.02           # s: how often a process waiting for a shard looks for it
# s: how long past --store-timeout a wait for a shard lasts: what a download's own deadline may
# overshoot by (a request under way at it: botocore's tries, each a connection and a read), and a margin
WAIT_SLACK_S = BOTOCORE_ATTEMPTS * (CONNECT_TIMEOUT_S + READ_TIMEOUT_S) + 5.0
CLOSE_WAIT_S = 1.0      # s: how long the end of a run waits for the downloads under way
START_DOWNLOADS = 4     # downloads at once a rank starts with, and again after a fault
HEADROOM = 1.5          # downloads kept in flight: this many times what the measured demand needs
DEMAND_WINDOW_S = 10.0  # s: the loaders' demand is measured over this much of the recent past


# The node caches' folders this process uses: a forked worker points its inherited descriptors into
# them at /dev/null first, else a deleted shard would stay on disk beyond the bound (Linux only).
_FOLDERS: set[str] = set()


def _let_go_of_cache_files_in_child() -> None:
    if not _FOLDERS:
        return
    folders, null = tuple(_FOLDERS), None
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return
    for fd in descriptors:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(folders):
                continue
            null = os.open(os.devnull, os.O_RDONLY) if null is None else null
            os.dup2(null, int(fd))  # the number stays open for whatever closes it; the file no longer is
        except OSError:  # the listing's own descriptor, gone
            continue
    if null is not None:
        os.close(null)


os.register_at_fork(after_in_child=_let_go_of_cache_files_in_child)


def local_name(address: str) -> str:
    return address[len(SCHEME):].replace("/", "--")


def batches_asked(workers: int, prefetch: int | None) -> int:
    """Batches a loader's workers are asked for ahead of the one the training process receives
    (DataLoader's ``prefetch_factor`` per worker; without workers, the batch being read)."""
    return workers * (prefetch or 0) if workers else 1


def shards_in_use(asked: int, per_shard: int, window: int = 1) -> int:
    """The most shards a rank holds at once for a pass of one loader: ``asked`` consecutive
    positions of the pass (the workers' prefetch and the last batch received), every whole shard
    holding at least ``per_shard`` of them, shuffled within windows of ``window`` shards (1: not
    shuffled). Those positions touch a first and a last window and only whole windows between them
    (a rank's piece cuts a shard only at its ends); nor more than ``max(asked, window)``
    (docs/data.md, "The cache's bound"). An epoch continued at another world size may need more."""
    if asked < 2:
        return window
    return min(window * ((asked - 2) // (window * per_shard) + 2), max(asked, window))


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


class CacheFull(StoreError):
    """The node's cache of shards cannot take a shard: its disk is full (or cannot be written),
    or every byte of its bound is held. Exit 2: a restart would fill it again."""

    def describe(self) -> str:
        return f"{self.address}: {self.reason}"


FAULTS = {kind.__name__: kind for kind in (*STORE_FAULTS, CacheFull)}  # a recorded fault, raised again by its name


@dataclass(frozen=True)
class Download:
    """A line of ``downloads.txt``: a shard downloaded into the node's cache, and the version."""

    address: str
    size: int
    etag: str
    version: str
    requests: int
    rank: str
    seconds: float

    @classmethod
    def parse(cls, line: str) -> Download | None:
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 7:
            return None  # cut short by a kill, or written by other code: its shard is not kept
        address, size, etag, version, requests, rank, seconds = fields
        return cls(address, int(size), etag, version, int(requests), rank, float(seconds))

    def line(self) -> str:
        return "\t".join(map(str, (self.address, self.size, self.etag, self.version, self.requests, self.rank,
                                   f"{self.seconds:.3f}"))) + "\n"

    def pins(self, ref: ShardRef) -> bool:
        """Whether this download is the version ``ref`` describes (an ETag or a VersionId to
        compare is needed: a size alone does not tell a rewritten shard)."""
        return bool(ref.etag or ref.version) and (self.address, self.size, self.etag, self.version) == (
            ref.address, ref.size, ref.etag, ref.version)


class NodeCache:
    """One node's cache of shards in ``folder`` (at most ``capacity`` bytes), as rank ``rank``
    uses it; every process of the node may use it at once (locks, hard links). ``patience``:
    seconds a download may keep failing before its fault is reported (``--store-timeout``);
    ``if_match``: each GET carries If-Match (``object_store.fetch``)."""

    def __init__(self, folder: str, capacity: int, rank: int, patience: float, if_match: bool = True):
        self.folder, self.capacity, self.rank, self.patience = Path(folder), capacity, rank, patience
        self.if_match = if_match
        _FOLDERS.add(os.path.join(os.path.realpath(folder), ""))
        self.read_ahead: ReadAhead | None = None  # the training process's, never a worker's

    def __getstate__(self):
        return {**self.__dict__, "read_ahead": None}  # a spawned worker's copy: its threads stay behind

    # -------------------------------------------------------------- the node's folder
    def prepare(self, keep: Iterable[ShardRef] = ()) -> NodeCache:
        """Once per node, before any of its ranks reads: keep the shards of ``keep`` that an
        earlier attempt of the run downloaded whole, as its line in ``downloads.txt`` says (the
        same address, size, ETag and VersionId), with their lines; delete everything else an
        earlier attempt left (other shards, part downloads, holds, faults). Without ``keep``:
        an empty folder."""
        wanted = {ref.address: ref for ref in keep}
        kept: dict[str, Download] = {}
        for download in self._recorded():
            ref = wanted.get(download.address)
            name = local_name(download.address)
            path = self.folder / name
            if ref is not None and download.pins(ref) and path.is_file() and path.stat().st_size == ref.size:
                kept[name] = download
        if self.folder.is_dir():
            for entry in os.scandir(self.folder):
                if entry.name in kept:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        (self.folder / "locks").mkdir(parents=True, exist_ok=True)
        if kept:
            (self.folder / DOWNLOADS).write_text("".join(download.line() for download in kept.values()))
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
        if now:  # a thread's own: another thread's release must not take it away
            return self.folder / f"rank{self.rank}-now" / f"{threading.get_ident()}-{local_name(address)}"
        return self.folder / f"rank{self.rank}" / local_name(address)

    def hold(self, ref: ShardRef, patience: Patience, now: bool = False,
             downloaded: Callable[[ShardRef, float], None] | None = None) -> Path:
        """Rank ``rank`` holds the shard (``now``: a hold of this thread's own, for one read):
        downloaded first if the node has no copy (``downloaded(ref, seconds)`` told after a
        download of this process's), else linked. Raises the store's fault, or
        :class:`CacheFull` when the cache's disk cannot take it (after recording it for the
        node's other processes)."""
        link, name = self._link(ref.address, now), local_name(ref.address)
        if link.exists():
            return link
        final = self.folder / name
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.folder / "locks" / f"{name}.lock"):
                self.raise_fault(name)
                with _locked(self.folder / "locks" / "room"):
                    if final.exists():
                        os.utime(final)  # held now: evicted last
                        os.link(final, link)
                        return link
                    part = self._reserve(name, ref.size)
                try:
                    started = time.monotonic()
                    requests = fetch(ref, str(part), patience, self.if_match)
                    seconds = time.monotonic() - started
                    with _locked(self.folder / "locks" / "room"):
                        os.replace(part, final)
                        os.link(final, link)
                    with open(self.folder / DOWNLOADS, "a") as downloads:
                        downloads.write(Download(ref.address, ref.size, ref.etag, ref.version, requests,
                                                 f"rank{self.rank}", seconds).line())
                finally:
                    part.unlink(missing_ok=True)
        except StoreError as err:
            self.record_fault(name, err)
            raise
        except OSError as err:  # the cache's disk: full, or gone
            full = self.disk_full(err)
            self.record_fault(name, full)
            raise full from None
        if downloaded is not None:
            downloaded(ref, seconds)
        return link

    def release(self, address: str, now: bool = False) -> None:
        """Rank ``rank`` no longer holds the shard; the copy stays until room is needed."""
        self._link(address, now).unlink(missing_ok=True)

    def _reserve(self, name: str, size: int) -> Path:
        """Room for ``size`` more bytes (shards no rank holds deleted, the least recently held
        first), reserved by a part file that names its size. Under the room lock. Raises
        :class:`CacheFull` when the shards the ranks hold leave no room: the bound is kept."""
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
        if used + size > self.capacity:
            raise CacheFull(str(self.folder), f"the node's cache of shards may fill {self.capacity / 1e9:.2f} GB and "
                                              f"its ranks hold {used / 1e9:.2f} GB of it: no room for "
                                              f"{size / 1e6:,.1f} MB more; raise --shard-cache-gb (0 sizes it to "
                                              f"what the ranks read at once)")
        part = self.folder / f"{name}.part-{os.getpid()}-{threading.get_ident()}-{size}"
        part.touch()
        return part

    def disk_full(self, err: OSError) -> CacheFull:
        """The fault of a cache whose disk could not be written (``err``): its folder, its free
        room and what the cache needs."""
        where = next((path for path in (self.folder, *self.folder.parents) if path.is_dir()), self.folder)
        free = shutil.disk_usage(where).free
        return CacheFull(str(self.folder), f"the node's cache of shards could not be written "
                                           f"({err.strerror or err}): {free / 1e9:.2f} GB free there, the cache "
                                           f"may fill {self.capacity / 1e9:.2f} GB; point --shard-cache-dir at a "
                                           f"local disk with room, or lower --shard-cache-gb")

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
    @contextmanager
    def reading(self, ref: ShardRef) -> Iterator[int]:
        """A read-only descriptor of the shard for one read, closed after it (so nothing the cache
        deletes stays on disk behind it). What rank ``rank`` holds is opened at once. Otherwise
        a fault recorded for the shard or the rank is raised at once; a DataLoader worker waits
        for its rank's read-ahead to hold the shard, and so does the training process for a
        shard its read-ahead will hold (the wait bounded: :meth:`_wait_for`); the training
        process fetches anything else itself, held for the read. Raises the store's fault."""
        held, now = self._link(ref.address), False
        try:
            fd = os.open(held, os.O_RDONLY)
        except FileNotFoundError:
            self.raise_fault(local_name(ref.address))
            if get_worker_info() is not None or (self.read_ahead is not None and self.read_ahead.will_hold(ref)):
                self._wait_for(held, ref)
            else:
                held, now = self.hold(ref, Patience(self.patience, on_recovered=say_recovered), now=True), True
            fd = os.open(held, os.O_RDONLY)
        try:
            yield fd
        finally:
            os.close(fd)
            if now:
                self.release(ref.address, now=True)

    def _wait_for(self, held: Path, ref: ShardRef) -> None:
        """Until ``held`` exists: a fault recorded meanwhile is raised; after ``patience`` +
        ``WAIT_SLACK_S`` seconds the shard counts as the store not answering, recorded for the
        rank: the training process, reading the sample again, raises it at once, and so does
        every later wait of the rank's workers (a batch of several missing shards stalls the
        rank that long once, not once a shard)."""
        name, limit = local_name(ref.address), self.patience + WAIT_SLACK_S
        deadline = time.monotonic() + limit
        while not held.exists():
            self.raise_fault(name)
            if time.monotonic() > deadline:
                late = StoreUnavailable(ref.address, f"not fetched by the rank's read-ahead within {limit:.0f} s")
                self.record_fault(name, late, rank_wide=True)
                raise late
            time.sleep(POLL_S)

    def downloads(self) -> list[tuple[str, int]]:
        """(address, bytes) of every shard in this node's record of downloads, in order: those
        kept by :meth:`prepare`, then those since."""
        return [(download.address, download.size) for download in self._recorded()]

    def _recorded(self) -> list[Download]:
        try:
            lines = (self.folder / DOWNLOADS).read_text().splitlines()
        except FileNotFoundError:
            return []
        return [download for download in map(Download.parse, lines) if download is not None]


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


class DownloadPace:
    """How many downloads a rank keeps in flight: ``HEADROOM`` times what covers its loaders' demand
    (Little's law), at least the shards its workers wait for; one more for each arrival while below
    that, up to ``ceiling``; back to ``START_DOWNLOADS`` after a fault; the ceiling at a run's first
    start (:meth:`fresh_start`). Why: docs/data.md, "Shards in an object store (S3)", step 3. Its
    owner keeps it under a lock."""

    def __init__(self, ceiling: int):
        self.ceiling = ceiling
        self.target = min(START_DOWNLOADS, ceiling)
        self._consumed: deque[tuple[float, float]] = deque()  # (when, bytes the loaders had read by then)
        self._total = 0.0
        self._per_byte: float | None = None  # s a download takes per byte, a moving average

    def consumed(self, bytes_: float, now: float) -> None:
        """The loaders read ``bytes_`` more of their shards."""
        if not self._consumed:
            self._consumed.append((now, self._total))
        self._total += bytes_
        self._consumed.append((now, self._total))

    def demand(self, now: float) -> float:
        """Bytes a second the loaders read over the last ``DEMAND_WINDOW_S`` (0 before two reads)."""
        while len(self._consumed) > 2 and now - self._consumed[1][0] > DEMAND_WINDOW_S:
            self._consumed.popleft()
        if len(self._consumed) < 2:
            return 0.0
        since, before = self._consumed[0]
        return (self._total - before) / (now - since) if now > since else 0.0

    def seconds_per_mb(self) -> float:
        return (self._per_byte or 0.0) * 1e6

    def aim(self, now: float, missing: int) -> int:
        """Downloads in flight that cover the demand, with headroom, and the ``missing`` shards
        the workers wait for."""
        return max(math.ceil(HEADROOM * self.demand(now) * (self._per_byte or 0.0)), missing)

    def downloaded(self, size: int, seconds: float, now: float, missing: int) -> None:
        """A download of ``size`` bytes took ``seconds`` (none of its requests failed); the
        workers wait for ``missing`` shards."""
        per_byte = seconds / max(size, 1)
        self._per_byte = per_byte if self._per_byte is None else 0.8 * self._per_byte + 0.2 * per_byte
        if self.aim(now, missing) > self.target:
            self.target = min(self.ceiling, self.target + 1)

    def fresh_start(self) -> None:
        """A run's first start: as many downloads as the ceiling allows, before any is timed. Its
        first epoch's shards are all wanted and the store has not failed; growing by one an
        arrival from ``START_DOWNLOADS`` would starve the first batches through slow connections
        (a restarted attempt keeps its cache warm instead, and starts low)."""
        self.target = self.ceiling

    def fault(self) -> None:
        self.target = min(START_DOWNLOADS, self.ceiling)


class ReadAhead:
    """One rank's downloads ahead of its loaders' reads, on threads of its training process: in the
    pass's order, the shards of the samples its workers were asked for, then ``depth`` more (or as
    many as in flight), then the next epoch's first; never beyond ``quota`` bytes (its share of the
    node's cache). A shard is let go a batch after its last sample was received. A fault stops its
    downloads and is recorded for the rank's workers (docs/data.md, "Shards in an object store (S3)",
    step 2)."""

    def __init__(self, cache: NodeCache, depth: int, downloads: int, quota: int):
        self.cache, self.depth, self.quota = cache, depth, quota
        self.pace = DownloadPace(downloads)
        self.patience = Patience(cache.patience, on_recovered=self._recovered)
        self._threads = [threading.Thread(target=self._download, name=f"read-ahead-{k}", daemon=True)
                         for k in range(downloads)]
        self._cond = threading.Condition()
        self._pass: list[Need] = []
        self._training = False                 # the pass is a training epoch's
        self._bytes_per_position = 0.0         # of the pass: its shards' bytes over its samples
        self._done = self._asked = 0           # positions: samples received (less a batch), samples asked for
        self._next_epoch: Callable[[], list[Need]] | None = None
        self._following: list[Need] | None = None
        self._owed: list[Need] = []            # asked for by an abandoned pass's workers: fetched, held till the end
        self._held: dict[str, int] = {}        # address: bytes
        self._in_flight: dict[str, int] = {}
        self._faulted: set[str] = set()        # downloads under way whose requests failed: not timed
        self.most_in_flight = 0                # downloads at once, at most, since the last training epoch's end
        self.failure: StoreError | None = None
        self._started = self._closed = False
        cache.read_ahead = self
        cache.join()

    # -------------------------------------------------------------- told by the loaders
    def start_pass(self, needs: list[Need], asked: int, next_epoch: Callable[[], list[Need]] | None = None) -> None:
        """A loader starts a pass reading ``needs``; its workers were asked for ``asked`` samples.
        ``next_epoch``: the training loader's next epoch, read ahead once a pass is covered."""
        if not self._started:
            # the client (boto3's imports) made here, not on a download thread: the workers fork next, and one
            # forked inside another thread's import waits for ever (docs/data.md#how-the-workers-start)
            with contextlib.suppress(Exception):  # a client that cannot be made is the first fetch's to report
                client()
        with self._cond:
            self._owed += [n for n in self._pass if n.first < self._asked and n.last >= self._done]
            self._pass, self._done, self._asked = needs, 0, asked
            positions = max((n.last for n in needs), default=-1) + 1
            self._bytes_per_position = sum(n.ref.size for n in needs) / positions if positions else 0.0
            self._training = next_epoch is not None
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

    def start_early(self, needs: list[Need]) -> None:
        """Before any loader's pass: download ``needs`` (a fresh run's first epoch, in its order)
        as the next training epoch's first shards, while the run sets itself up, as many at once
        as the ceiling allows (:meth:`DownloadPace.fresh_start`); the passes that start later take
        over (an evaluation's first, then this epoch's own)."""
        with self._cond:
            self.pace.fresh_start()
        self.start_pass([], 0, next_epoch=lambda: needs)

    def received(self, done: int, asked: int) -> None:
        """The training process received the pass's samples before ``done`` (less a batch) and
        its workers were asked for those before ``asked``."""
        with self._cond:
            if done > self._done:
                self.pace.consumed((done - self._done) * self._bytes_per_position, time.monotonic())
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
            if self._training:
                self._say_pace()
            self._done = self._asked = 1 << 62  # every sample received: none is owed
        self.start_pass(needs, 0)

    def _say_pace(self) -> None:
        pace = self.pace
        log.info("data: the read-ahead keeps up to %d download(s) in flight (%d at most this epoch; --shard-downloads "
                 "%d at most): the loaders read %.1f MB/s, a download takes %.2f s per MB", pace.target,
                 self.most_in_flight, pace.ceiling, pace.demand(time.monotonic()) / 1e6, pace.seconds_per_mb())
        self.most_in_flight = len(self._in_flight)

    def _ahead(self, following: bool) -> Iterator[tuple[Need, bool]]:
        """The shards the rank should hold now, in order, each with whether its samples were asked
        for (under the lock): the pass's from the first not yet passed, those of the samples asked
        for and then ``depth`` more (or as many as the downloads in flight); with ``following``,
        once the pass is covered, the next epoch's first ones within the same depth."""
        beyond, depth = 0, max(self.depth, self.pace.target)
        needs = ((need, need.first < self._asked) for need in self._pass if need.last >= self._done)
        for need, required in itertools.chain(needs, self._next_epoch_needs() if following else ()):
            if not required:
                beyond += 1
                if beyond > depth:
                    return
            yield need, required

    def _next_epoch_needs(self) -> Iterator[tuple[Need, bool]]:
        if self._following is None:  # worked out once a pass, when first reached
            self._following = self._next_epoch() if self._next_epoch is not None else []
        return ((need, False) for need in self._following)

    def will_hold(self, ref: ShardRef) -> bool:
        """Whether the rank holds the shard soon: its download is under way, or its loader's
        workers were asked for its samples."""
        with self._cond:
            if ref.address in self._in_flight or any(n.ref.address == ref.address for n in self._owed):
                return True
            return any(need.ref.address == ref.address for need, required in self._ahead(following=False)
                       if required)

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
        """The next shard to download (under the lock), or None for now: in order, the abandoned
        passes' owed ones, then :meth:`_ahead`'s; none while the downloads in flight are as many
        as the pace allows, nor when the next one does not fit in the quota."""
        if self.failure is not None or self._closed or len(self._in_flight) >= self.pace.target:
            return None
        room = self.quota - sum(self._held.values()) - sum(self._in_flight.values())
        for need in itertools.chain(self._owed, (need for need, _ in self._ahead(following=True))):
            if need.ref.address in self._held or need.ref.address in self._in_flight:
                continue
            return need if need.ref.size <= room else None
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
                self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
            try:
                self.cache.hold(need.ref, self.patience, downloaded=self._downloaded)
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

    def _downloaded(self, ref: ShardRef, seconds: float) -> None:
        with self._cond:
            if ref.address in self._faulted:  # its time includes the store's silence
                self._faulted.discard(ref.address)
            else:
                missing = sum(1 for need, required in self._ahead(following=False)
                              if required and need.ref.address not in self._held)
                self.pace.downloaded(ref.size, seconds, time.monotonic(), missing)
            self._cond.notify_all()

    def _recovered(self, address: str, waited: float, reason: str) -> None:
        say_recovered(address, waited, reason)
        with self._cond:
            self._faulted.add(address)
            self.pace.fault()

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
        return batches_asked(self.num_workers, self.prefetch_factor)

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
