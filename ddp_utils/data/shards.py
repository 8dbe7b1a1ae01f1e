"""An image folder as shards: tar files in WebDataset's layout, plus an index for reading any
sample by its number (docs/data.md, "Shards (`write_shards.py`)"). ``DST/train/`` (and ``DST/val/``)
holds, as ``write_shards.py`` writes it:

* ``shard-000000.tar``, ...: POSIX tars in the ``webdataset`` convention, each sample three members
  under its index in the folder's listing (``000000042``): ``KEY.EXT`` (the file's original bytes,
  EXT its own extension, lower case), ``KEY.cls`` (its class index, as text) and ``KEY.json``
  (``{"path": ..., "class": ..., "index": ...}``, the path below the split folder);
* ``index.json``: the split's classes, the shards (name, bytes, sha256, samples) and the files left
  out (``--skip-unreadable``);
* ``records.npz`` (numpy's format): per sample, in the folder's order, its shard, the byte offset
  and size of its image in that tar, its class, its index, its width and height and whether the
  device decoder takes it; and the paths, NUL-separated. Sample ``i`` is one ``pread``.
"""
from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import resource
import shutil
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from ..config import UsageError
from .object_store import Listed, ShardRef, StorePrefix, is_object_store
from .shard_cache import NodeCache

FORMAT, VERSION = "ddp-image-shards", 1
INDEX, RECORDS = "index.json", "records.npz"


def shard_name(number: int) -> str:
    return f"shard-{number:06d}.tar"


def sample_key(index: int) -> str:
    return f"{index:09d}"


@dataclass(frozen=True)
class Record:
    """Where one sample's image lies: its shard, the offset and size of its bytes there."""

    shard: int
    offset: int
    size: int


def image_members(tar_path: Path, ext_of: dict[str, str]) -> dict[str, Record]:
    """{key: where its image's bytes lie} in one written shard, read from the tar's own headers;
    ``ext_of``: {key: the image member's extension}."""
    found = {}
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            key, _, ext = member.name.partition(".")
            if ext_of.get(key) == ext:
                found[key] = Record(-1, member.offset_data, member.size)
    return found


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return stream_sha256(f)


def stream_sha256(f) -> str:
    """The sha256 of what is left to read in the binary file ``f``, read a MB at a time."""
    digest = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


class LocalSplit:
    """A split's folder, read as :class:`object_store.StorePrefix` reads a bucket's prefix."""

    def __init__(self, root: str):
        self.root = Path(root)

    def read(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.is_file() else None

    def objects(self) -> dict[str, Listed]:
        """{name: its size} of the folder's files (a file system has no ETags or versions)."""
        return {entry.name: Listed(entry.stat().st_size) for entry in self.root.iterdir() if entry.is_file()} \
            if self.root.is_dir() else {}


@dataclass(frozen=True)
class ShardIndex:
    """One split's ``index.json`` and ``records.npz``, checked against the shards where they
    are, with each shard as the listing gave it (an object store's ETag and VersionId)."""

    root: str
    classes: tuple[str, ...]
    shards: tuple[dict, ...]
    shard: np.ndarray    # int32 per sample
    offset: np.ndarray   # int64 per sample: where its image's bytes start in the shard
    size: np.ndarray     # int64 per sample
    label: np.ndarray    # int32 per sample
    index: np.ndarray    # int64 per sample: its index in the folder's listing
    paths: str           # per sample, its path below the split folder, NUL between two
    # what the listing gave for each object read (index.json, records.npz, every shard), by name
    listed: dict[str, Listed] = field(default_factory=dict)
    # shards read pinned by their content (the index's sha256) instead of the listing: shards a
    # later attempt found changed while their index entry did not (``train.data_record``)
    by_content: frozenset[str] = frozenset()
    fingerprint: str = ""        # sha256 of index.json and records.npz: the data a run read
    width: np.ndarray | None = None   # int32 per sample, px (None: an index written without them)
    height: np.ndarray | None = None  # int32 per sample, px
    device_decodable: np.ndarray | None = None  # bool per sample (image_files.device_decodable)

    @classmethod
    def read(cls, root: str, patience: float = 0.0) -> ShardIndex:
        """The split at ``root`` (a folder, or ``s3://BUCKET/PREFIX/train``); bad input (one
        line) when its index is missing or foreign, or a shard is missing or of another size than
        the index says (truncated, replaced). A store's transient fault is waited out for
        ``patience`` seconds (0: reported at once)."""
        split = StorePrefix(root, patience) if is_object_store(root) else LocalSplit(root)
        raw_meta = split.read(INDEX)
        if raw_meta is None:
            raise UsageError(f"{root}: no {INDEX}; write the shards with: python write_shards.py SRC DST")
        meta = json.loads(raw_meta)
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise UsageError(f"{root}/{INDEX}: not a {FORMAT} v{VERSION} index; write the shards again with "
                             f"this version's write_shards.py")
        objects = split.objects()
        for shard in meta["shards"]:
            size = objects[shard["name"]].size if shard["name"] in objects else None
            if size != shard["bytes"]:
                found = "missing" if size is None else f"{size:,} bytes, the index says {shard['bytes']:,}"
                raise UsageError(f"{root}/{shard['name']}: {found}; copy the shard again, or write the shards again")
        raw_records = split.read(RECORDS)
        if raw_records is None:
            raise UsageError(f"{root}: no {RECORDS}; copy it from the shards' folder, or write the shards again")
        with np.load(io.BytesIO(raw_records)) as arrays:
            fields = {name: arrays[name] for name in ("shard", "offset", "size", "label", "index")}
            fields.update({name: arrays[name] for name in ("width", "height", "device_decodable") if name in arrays})
            paths = arrays["paths"].tobytes().decode()
        if len(fields["shard"]) != meta["samples"]:
            raise UsageError(f"{root}/{RECORDS}: {len(fields['shard'])} records, {INDEX} says {meta['samples']}; "
                             f"write the shards again")
        return cls(root=str(root).rstrip("/"), classes=tuple(meta["classes"]), shards=tuple(meta["shards"]),
                   paths=paths, listed={name: objects[name] for name in (INDEX, RECORDS, *(shard["name"] for shard in meta["shards"]))},
                   fingerprint=hashlib.sha256(raw_meta + raw_records).hexdigest(), **fields)

    def __len__(self) -> int:
        return len(self.shard)

    def refs(self) -> tuple[ShardRef, ...]:
        """Each shard as the store's cache fetches it: address, bytes, what the listing gave (none
        for one read ``by_content``), the index's sha256."""
        def pin(name: str) -> Listed:
            return Listed(self.listed[name].size) if name in self.by_content else self.listed[name]

        return tuple(ShardRef(f"{self.root}/{shard['name']}", shard["bytes"], pin(shard["name"]).etag,
                              pin(shard["name"]).version, shard.get("sha256", "")) for shard in self.shards)

    def path(self, i: int) -> str:
        """Sample ``i``'s original path below the split folder (a walk through the paths: for
        messages, not for each read)."""
        return self.paths.split("\0")[i]


def largest_shard(*indexes: ShardIndex) -> int:
    """Bytes of the largest shard of the splits ``indexes``: what bounds a cache of whole shards."""
    return max(shard["bytes"] for index in indexes for shard in index.shards)


def raise_open_file_limit(wanted: int) -> int:
    """This process's limit of open files, first raised towards ``wanted`` as far as its hard
    limit allows (the soft limit is often 1,024 where the hard one is far higher)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted and (hard == resource.RLIM_INFINITY or soft < hard):
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


class ShardReader:
    """Sample ``i``'s bytes from the shards of ``index``, read with ``pread`` (which shares no
    file position). Shards on a file system are opened once per process (a forked worker opens
    its own), as many at once as the process's limit of open files allows (the least recently
    read closed first beyond it). Shards in an object store are read from ``cache``
    (:class:`shard_cache.NodeCache`; None: a temporary one of this process, room for a shard per
    CPU it may use and one more, deleted when the process ends), each opened for one read and
    closed after it, so that a shard the cache deletes never stays on its disk behind a
    descriptor."""

    SPARE_DESCRIPTORS = 256  # of the process's limit, left for everything else (a DataLoader's pipes, ...)

    def __init__(self, index: ShardIndex, cache: NodeCache | None = None):
        self.index, self.cache, self._open, self._pid = index, cache, {}, os.getpid()
        self._refs = index.refs() if is_object_store(index.root) else ()
        if is_object_store(index.root) and cache is None:  # --check-data, say: a cache of its own, gone at exit
            folder = tempfile.mkdtemp(prefix="ddp-shards-")
            atexit.register(shutil.rmtree, folder, True)
            # a shard for each thread that may read at once (check_decodes: one per CPU) and one more
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
            room = (cpus + 1) * largest_shard(index)
            self.cache = NodeCache(folder, capacity=room, rank=0, patience=0.0).prepare()
        # every shard open at once where the limit allows (raised to what is needed, up to the hard limit)
        limit = raise_open_file_limit(len(index.shards) + self.SPARE_DESCRIPTORS) if self.cache is None else 0
        self.max_open = max(1, limit - self.SPARE_DESCRIPTORS)

    def __getstate__(self):
        return {"index": self.index, "cache": self.cache}  # a worker started by spawn opens its own

    def __setstate__(self, state):
        self.__init__(state["index"], state["cache"])

    def read(self, i: int) -> Tensor:
        """The original file's bytes of sample ``i``, as a 1-D uint8 tensor."""
        shard = int(self.index.shard[i])
        if self.cache is not None:
            with self.cache.reading(self._refs[shard]) as fd:
                return self._pread(fd, shard, i)
        if os.getpid() != self._pid:  # forked: the parent's descriptors are shared, not ours to keep
            self._open, self._pid = {}, os.getpid()
        fd = self._open.pop(shard, None)
        if fd is None:
            fd = os.open(self._path(shard), os.O_RDONLY)
            if len(self._open) >= self.max_open:
                os.close(self._open.pop(next(iter(self._open))))  # the least recently read
        self._open[shard] = fd  # last in the dict: the most recently read
        return self._pread(fd, shard, i)

    def _pread(self, fd: int, shard: int, i: int) -> Tensor:
        size, offset = int(self.index.size[i]), int(self.index.offset[i])
        data = torch.empty(size, dtype=torch.uint8)
        if os.preadv(fd, [data.numpy()], offset) != size:  # read straight into the tensor
            raise OSError(f"{self.index.shards[shard]['name']} ends inside sample {i}")
        return data

    def _path(self, shard: int) -> str:
        return os.path.join(self.index.root, self.index.shards[shard]["name"])

    @contextmanager
    def shard_file(self, shard: int) -> Iterator[int]:
        """A read-only descriptor of shard number ``shard`` while the block runs (held in the
        cache meanwhile, for an object store)."""
        if self.cache is not None:
            with self.cache.reading(self._refs[shard]) as fd:
                yield fd
            return
        fd = os.open(self._path(shard), os.O_RDONLY)
        try:
            yield fd
        finally:
            os.close(fd)

    @property
    def open_shards(self) -> int:
        """Shards this process keeps open between reads (those on a file system)."""
        return len(self._open)


def shards_not_matching(reader: ShardReader) -> list[str]:
    """The shards of ``reader``'s index whose bytes are not those the index was written with
    (their sha256 differs), one line each; read one at a time, through its cache for an object
    store."""
    index, found = reader.index, []
    for number, shard in enumerate(index.shards):
        with reader.shard_file(number) as fd, os.fdopen(fd, "rb", closefd=False) as f:
            digest = stream_sha256(f)
        if digest != shard["sha256"]:
            found.append(f"{index.root}/{shard['name']}: its bytes are not those the index was written with "
                         f"(sha256); copy the shard again")
    return found
